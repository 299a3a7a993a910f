// Recorded op calls replayed from C++: the eager host path's compiled tier.
//
// What it implements: a *program* replays an op call that the Python path recorded (kernels/_common/launch.py):
// its forward launches, the tensors it allocates, the outputs it returns, and (optionally) its backward launches
// behind a C++ autograd node. A call through it costs the pybind11 argument conversion, one allocation per output
// or temporary, one cuLaunchKernel per launch and, with autograd, a C++ node: no Python runs in the backward.
//
// Limits: what a program can replay is what a recording can (kernels without scratch memory, TMA arguments or
// clusters); the Python side builds programs and decides when one applies (same signature, same stream,
// contiguous tensors), and every other call takes the Python path. The driver is reached through dlopen, and the
// current stream through c10's device-guard interface, so the extension builds against any torch (CPU builds
// included: tests run programs in "capture" mode, where launches are logged instead of run).
//
// The trade-off: the Python path stays the reference and the fallback; this file knows nothing of any op (a
// program is data), so a new op needs no C++.

#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- the driver ------------------------------------------------------------------------------------------------

using CUresult = int;
using LaunchKernelFn = CUresult (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    void*, void**, void**);
using LaunchCooperativeFn = CUresult (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                         unsigned, void*, void**);
using ErrorStringFn = CUresult (*)(CUresult, const char**);

struct Driver {
  LaunchKernelFn launch = nullptr;
  LaunchCooperativeFn launch_cooperative = nullptr;
  ErrorStringFn error_string = nullptr;
};

const Driver& driver() {
  static Driver d = [] {
    Driver out;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    TORCH_CHECK(lib != nullptr, "fused_kernels native: cannot open libcuda.so.1");
    out.launch = reinterpret_cast<LaunchKernelFn>(dlsym(lib, "cuLaunchKernel"));
    out.launch_cooperative = reinterpret_cast<LaunchCooperativeFn>(dlsym(lib, "cuLaunchCooperativeKernel"));
    out.error_string = reinterpret_cast<ErrorStringFn>(dlsym(lib, "cuGetErrorString"));
    TORCH_CHECK(out.launch && out.launch_cooperative, "fused_kernels native: libcuda.so.1 lacks cuLaunchKernel");
    return out;
  }();
  return d;
}

// ---- capture mode (tests without a GPU) ---------------------------------------------------------------------

struct LoggedLaunch {
  uint64_t function;
  unsigned grid[3];
  unsigned block;
  unsigned shared;
  bool cooperative;
  uint64_t stream;
  std::vector<std::string> params;  // each parameter's bytes, as the kernel receives them
};

bool capture_mode = false;
std::mutex log_mutex;
std::vector<LoggedLaunch> launch_log;

// ---- launches ----------------------------------------------------------------------------------------------------

// One recorded kernel launch: the compiled kernel's CUfunction, its launch shape, and its parameters as the
// kernel takes them (Triton's launcher passes every non-constexpr argument by address, then two scratch pointers);
// the parameters that each call fills: tensor addresses and per-call ints.
struct Launch {
  uint64_t function = 0;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 128;
  unsigned shared = 0;
  bool cooperative = false;
  std::vector<uint64_t> words;          // one 8-byte slot per parameter (each parameter at most 8 bytes)
  std::vector<int64_t> tensor_slots;    // pairs: parameter index, tensor index
  std::vector<int64_t> int_slots;       // triples: parameter index, int index, width in bytes
  std::vector<int64_t> widths;          // each parameter's width in bytes (for the log)
};

uint64_t pack_param(const std::string& type, const py::handle& value, int64_t* width) {
  uint64_t word = 0;
  // two's complement of any Python int (bools included), as Triton's launcher passes it
  auto int_of = [&]() -> uint64_t {
    if (value.is_none()) return 0;
    const uint64_t bits = PyLong_AsUnsignedLongLongMask(value.ptr());
    if (PyErr_Occurred()) throw py::error_already_set();
    return bits;
  };
  if (type == "ptr" || type == "i64" || type == "u64") {
    *width = 8;
    word = int_of();
  } else if (type == "i32" || type == "u32") {
    *width = 4;
    word = int_of() & 0xffffffffull;
  } else if (type == "i16" || type == "u16") {
    *width = 2;
    word = int_of() & 0xffffull;
  } else if (type == "i8" || type == "u8" || type == "i1" || type == "u1") {
    *width = 1;
    word = int_of() & 0xffull;
  } else if (type == "fp32" || type == "f32") {
    *width = 4;
    float f = static_cast<float>(py::cast<double>(value));
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    word = bits;
  } else if (type == "fp64") {
    *width = 8;
    double d = py::cast<double>(value);
    std::memcpy(&word, &d, 8);
  } else {
    TORCH_CHECK(false, "fused_kernels native: no parameter of type ", type);
  }
  return word;
}


std::shared_ptr<Launch> make_launch(uint64_t function, std::vector<int64_t> grid, int64_t block, int64_t shared,
                                    bool cooperative, const std::vector<std::pair<std::string, py::object>>& params,
                                    std::vector<int64_t> tensor_slots, std::vector<int64_t> int_slots) {
  TORCH_CHECK(grid.size() == 3, "grid must have 3 entries");
  TORCH_CHECK(tensor_slots.size() % 2 == 0 && int_slots.size() % 2 == 0, "slots come in pairs");
  auto launch = std::make_shared<Launch>();
  launch->function = function;
  for (int i = 0; i < 3; ++i) launch->grid[i] = static_cast<unsigned>(grid[i]);
  launch->block = static_cast<unsigned>(block);
  launch->shared = static_cast<unsigned>(shared);
  launch->cooperative = cooperative;
  for (const auto& [type, value] : params) {
    int64_t width = 0;
    launch->words.push_back(pack_param(type, value, &width));
    launch->widths.push_back(width);
  }
  const auto n_params = static_cast<int64_t>(params.size());
  for (size_t i = 0; i < tensor_slots.size(); i += 2) {
    TORCH_CHECK(tensor_slots[i] >= 0 && tensor_slots[i] < n_params && launch->widths[tensor_slots[i]] == 8,
                "tensor slot ", tensor_slots[i], " is not a pointer parameter");
  }
  for (size_t i = 0; i < int_slots.size(); i += 2) {
    TORCH_CHECK(int_slots[i] >= 0 && int_slots[i] < n_params, "int slot out of range");
    launch->int_slots.push_back(int_slots[i]);
    launch->int_slots.push_back(int_slots[i + 1]);
    launch->int_slots.push_back(launch->widths[int_slots[i]]);
  }
  launch->tensor_slots = std::move(tensor_slots);
  return launch;
}

void run_launch(const Launch& launch, const std::vector<uint64_t>& addresses, const std::vector<int64_t>& ints,
                void* stream) {
  // the parameter values, then Triton's two scratch pointers (none: such kernels are never recorded)
  const size_t n = launch.words.size();
  std::vector<uint64_t> words(launch.words);
  words.push_back(0);
  words.push_back(0);
  for (size_t i = 0; i < launch.tensor_slots.size(); i += 2) {
    words[launch.tensor_slots[i]] = addresses[launch.tensor_slots[i + 1]];
  }
  for (size_t i = 0; i < launch.int_slots.size(); i += 3) {
    const uint64_t mask = launch.int_slots[i + 2] >= 8 ? ~0ull : ((1ull << (8 * launch.int_slots[i + 2])) - 1);
    words[launch.int_slots[i]] = static_cast<uint64_t>(ints[launch.int_slots[i + 1]]) & mask;
  }
  // little-endian: a parameter narrower than 8 bytes is the low bytes of its word, at the word's address
  std::vector<void*> params(n + 2);
  for (size_t i = 0; i < n + 2; ++i) params[i] = &words[i];
  if (capture_mode) {
    LoggedLaunch logged{launch.function, {launch.grid[0], launch.grid[1], launch.grid[2]}, launch.block,
                        launch.shared, launch.cooperative, reinterpret_cast<uint64_t>(stream), {}};
    for (size_t i = 0; i < n + 2; ++i) {
      const size_t width = i < n ? static_cast<size_t>(launch.widths[i]) : 8;
      logged.params.emplace_back(reinterpret_cast<const char*>(&words[i]), width);
    }
    std::lock_guard<std::mutex> lock(log_mutex);
    launch_log.push_back(std::move(logged));
    return;
  }
  if (static_cast<uint64_t>(launch.grid[0]) * launch.grid[1] * launch.grid[2] == 0) return;
  const Driver& d = driver();
  void* function = reinterpret_cast<void*>(launch.function);
  CUresult result = launch.cooperative
      ? d.launch_cooperative(function, launch.grid[0], launch.grid[1], launch.grid[2], launch.block, 1, 1,
                             launch.shared, stream, params.data())
      : d.launch(function, launch.grid[0], launch.grid[1], launch.grid[2], launch.block, 1, 1, launch.shared, stream,
                 params.data(), nullptr);
  if (result != 0) {
    const char* message = "unknown error";
    if (d.error_string != nullptr) d.error_string(result, &message);
    TORCH_CHECK(false, "fused_kernels native: kernel launch failed: ", message);
  }
}

// ---- programs ----------------------------------------------------------------------------------------------------

// Where a tensor of a stage comes from: the call's inputs, the stage's allocations, tensors the program holds
// (workspaces), the gradients of the outputs, the tensors saved by the forward, or nothing (None).
enum RefKind : int64_t { NONE = 0, INPUT = 1, ALLOC = 2, FIXED = 3, GRAD = 4, SAVED = 5 };

struct Alloc {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
};

struct Stage {
  std::vector<std::shared_ptr<Launch>> launches;
  std::vector<Alloc> allocs;
  std::vector<at::Tensor> fixed;
  std::vector<int64_t> tensors;  // pairs: kind, index, in the order the recorded launches number them
};

struct Program : torch::CustomClassHolder {
  at::Device device{at::kCPU};
  Stage forward;
  std::vector<int64_t> outputs;  // pairs into the forward's tensors: what the call returns
  std::vector<int64_t> saved;    // pairs into the forward's tensors: what the backward reads (SAVED index)
  bool has_backward = false;
  Stage backward;
  std::vector<at::ScalarType> grad_dtypes;  // per output: the dtype its gradient is made (contiguous) in
  std::vector<int64_t> input_grads;          // pairs into the backward's tensors, one per input: its gradient
};

struct StageTensors {
  const std::vector<at::Tensor>* inputs = nullptr;
  std::vector<at::Tensor> allocs;
  const std::vector<at::Tensor>* fixed = nullptr;
  const std::vector<at::Tensor>* grads = nullptr;
  const std::vector<at::Tensor>* saved = nullptr;

  at::Tensor get(int64_t kind, int64_t index) const {
    switch (kind) {
      case INPUT: return (*inputs)[index];
      case ALLOC: return allocs[index];
      case FIXED: return (*fixed)[index];
      case GRAD: return (*grads)[index];
      case SAVED: return (*saved)[index];
      default: return at::Tensor();
    }
  }
};

void* current_stream(const at::Device& device) {
  if (capture_mode || device.type() != at::kCUDA) return nullptr;
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  return impl->getStream(device).native_handle();
}

// Allocates the stage's tensors and runs its launches; false (launching nothing) when a tensor is not 16-byte
// aligned (the compiled kernels may assume the alignment they were recorded with).
bool run_stage(const Program& program, const Stage& stage, StageTensors& tensors, const std::vector<int64_t>& ints) {
  const auto options = at::TensorOptions().device(program.device);
  tensors.allocs.reserve(stage.allocs.size());
  for (const auto& alloc : stage.allocs) tensors.allocs.push_back(at::empty(alloc.sizes, options.dtype(alloc.dtype)));
  tensors.fixed = &stage.fixed;
  std::vector<uint64_t> addresses;
  addresses.reserve(stage.tensors.size() / 2);
  uint64_t aligned = 0;
  for (size_t i = 0; i < stage.tensors.size(); i += 2) {
    at::Tensor t = tensors.get(stage.tensors[i], stage.tensors[i + 1]);
    const uint64_t address = t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0;
    aligned |= address;
    addresses.push_back(address);
  }
  if (aligned & 15) return false;
  c10::OptionalDeviceGuard guard;
  if (!capture_mode && program.device.type() == at::kCUDA) guard.reset_device(program.device);
  void* stream = current_stream(program.device);
  for (const auto& launch : stage.launches) run_launch(*launch, addresses, ints, stream);
  return true;
}

variable_list collect(const StageTensors& tensors, const std::vector<int64_t>& refs) {
  variable_list out;
  out.reserve(refs.size() / 2);
  for (size_t i = 0; i < refs.size(); i += 2) out.push_back(tensors.get(refs[i], refs[i + 1]));
  return out;
}

struct RecordedFunction : public torch::autograd::Function<RecordedFunction> {
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, c10::intrusive_ptr<Program> program,
                               std::vector<int64_t> ints) {
    std::vector<at::Tensor> input_vector(inputs.begin(), inputs.end());
    StageTensors tensors;
    tensors.inputs = &input_vector;
    TORCH_CHECK(run_stage(*program, program->forward, tensors, ints),
                "fused_kernels native: a tensor is not 16-byte aligned");
    variable_list saved = collect(tensors, program->saved);
    ctx->save_for_backward(saved);
    ctx->saved_data["program"] = c10::IValue::make_capsule(program);
    ctx->saved_data["ints"] = ints;
    ctx->saved_data["n_inputs"] = static_cast<int64_t>(inputs.size());
    return collect(tensors, program->outputs);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto program = c10::static_intrusive_pointer_cast<Program>(ctx->saved_data["program"].toCapsule());
    const auto ints = ctx->saved_data["ints"].toIntVector();
    std::vector<at::Tensor> saved = ctx->get_saved_variables();
    std::vector<at::Tensor> grads;
    grads.reserve(grad_outputs.size());
    for (size_t i = 0; i < grad_outputs.size(); ++i) {
      at::Tensor g = grad_outputs[i].to(program->grad_dtypes[i]).contiguous();
      if (reinterpret_cast<uint64_t>(g.data_ptr()) & 15) g = g.clone();
      grads.push_back(std::move(g));
    }
    StageTensors tensors;
    tensors.grads = &grads;
    tensors.saved = &saved;
    TORCH_CHECK(run_stage(*program, program->backward, tensors, ints),
                "fused_kernels native: a saved tensor is not 16-byte aligned");
    variable_list out = collect(tensors, program->input_grads);
    out.emplace_back();  // the program
    out.emplace_back();  // the ints
    return out;
  }
};

// The call: the outputs, or None (nothing launched) when a tensor is not 16-byte aligned.
py::object run(const c10::intrusive_ptr<Program>& program, const std::vector<at::Tensor>& inputs,
               const std::vector<int64_t>& ints) {
  uint64_t aligned = 0;
  bool needs_grad = false;
  for (const auto& t : inputs) {
    aligned |= reinterpret_cast<uint64_t>(t.data_ptr());
    needs_grad |= t.requires_grad();
  }
  if (aligned & 15) return py::none();
  variable_list outputs;
  if (program->has_backward && needs_grad && at::GradMode::is_enabled()) {
    outputs = RecordedFunction::apply(at::TensorList(inputs), program, ints);
  } else {
    StageTensors tensors;
    tensors.inputs = &inputs;
    if (!run_stage(*program, program->forward, tensors, ints)) return py::none();
    outputs = collect(tensors, program->outputs);
  }
  return py::cast(outputs);
}

Stage make_stage(std::vector<std::shared_ptr<Launch>> launches,
                 const std::vector<std::pair<std::vector<int64_t>, at::ScalarType>>& allocs,
                 std::vector<at::Tensor> fixed, std::vector<int64_t> tensors) {
  TORCH_CHECK(tensors.size() % 2 == 0, "tensor refs come in pairs");
  Stage stage;
  stage.launches = std::move(launches);
  for (const auto& [sizes, dtype] : allocs) stage.allocs.push_back({sizes, dtype});
  stage.fixed = std::move(fixed);
  stage.tensors = std::move(tensors);
  return stage;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Recorded op calls replayed from C++ (see recorded_ops.cpp).";
  py::class_<Launch, std::shared_ptr<Launch>>(m, "Launch")
      .def(py::init(&make_launch), py::arg("function"), py::arg("grid"), py::arg("block"), py::arg("shared"),
           py::arg("cooperative"), py::arg("params"), py::arg("tensor_slots"), py::arg("int_slots"));
  py::class_<Program, c10::intrusive_ptr<Program>>(m, "Program")
      .def(py::init([](at::Device device, std::vector<std::shared_ptr<Launch>> launches,
                       std::vector<std::pair<std::vector<int64_t>, at::ScalarType>> allocs,
                       std::vector<at::Tensor> fixed, std::vector<int64_t> tensors, std::vector<int64_t> outputs,
                       std::vector<int64_t> saved) {
             auto program = c10::make_intrusive<Program>();
             program->device = device;
             program->forward = make_stage(std::move(launches), allocs, std::move(fixed), std::move(tensors));
             program->outputs = std::move(outputs);
             program->saved = std::move(saved);
             return program;
           }),
           py::arg("device"), py::arg("launches"), py::arg("allocs"), py::arg("fixed"), py::arg("tensors"),
           py::arg("outputs"), py::arg("saved"))
      .def("set_backward",
           [](Program& program, std::vector<std::shared_ptr<Launch>> launches,
              std::vector<std::pair<std::vector<int64_t>, at::ScalarType>> allocs, std::vector<at::Tensor> fixed,
              std::vector<int64_t> tensors, std::vector<at::ScalarType> grad_dtypes, std::vector<int64_t> input_grads) {
             program.backward = make_stage(std::move(launches), allocs, std::move(fixed), std::move(tensors));
             program.grad_dtypes = std::move(grad_dtypes);
             program.input_grads = std::move(input_grads);
             program.has_backward = true;
           },
           py::arg("launches"), py::arg("allocs"), py::arg("fixed"), py::arg("tensors"), py::arg("grad_dtypes"),
           py::arg("input_grads"));
  m.def("run", &run, py::arg("program"), py::arg("inputs"), py::arg("ints"));
  m.def("set_capture_mode", [](bool on) { capture_mode = on; });
  m.def("take_log", []() {
    std::vector<LoggedLaunch> taken;
    {
      std::lock_guard<std::mutex> lock(log_mutex);
      taken.swap(launch_log);
    }
    py::list out;
    for (const auto& l : taken) {
      py::list params;
      for (const auto& p : l.params) params.append(py::bytes(p));
      out.append(py::make_tuple(l.function, py::make_tuple(l.grid[0], l.grid[1], l.grid[2]), l.block, l.shared,
                                l.cooperative, l.stream, params));
    }
    return out;
  });
  m.attr("NONE") = static_cast<int64_t>(NONE);
  m.attr("INPUT") = static_cast<int64_t>(INPUT);
  m.attr("ALLOC") = static_cast<int64_t>(ALLOC);
  m.attr("FIXED") = static_cast<int64_t>(FIXED);
  m.attr("GRAD") = static_cast<int64_t>(GRAD);
  m.attr("SAVED") = static_cast<int64_t>(SAVED);
}
