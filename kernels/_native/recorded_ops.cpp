// Recorded op calls replayed from C++: the eager host path's compiled tier.
//
// What it implements: a *program* replays an op call that the Python path recorded (kernels/_common/launch.py):
// its forward launches, the tensors it allocates, the outputs it returns, and (optionally) its backward launches
// behind a C++ autograd node (RecordedBackward, written as torch's own backward nodes are). A call through it costs
// the pybind11 argument conversion, one allocation per output or temporary, one cuLaunchKernel per launch and, with
// autograd, the node: no Python runs in the backward. TMA arguments are encoded here (cuTensorMapEncodeTiled, as
// Triton's launcher does) and kept per address. A *guarded* program (``guard``) also checks each call itself
// (``call``): the inputs' dtypes, sizes and strides, the current stream and graph capture, so the Python side only
// finds the program its op's checked plan last ran through.
//
// Limits: what a program can replay is what a recording can (kernels without scratch memory, clusters or
// programmatic launch); the Python side builds programs and decides which applies (same signature, same stream,
// the recorded layouts), and every other call takes the Python path. The driver is reached through dlopen and
// torch's stream through its device-guard interface (the backward runs on its forward's, as torch's backward ops
// do), so the extension builds against any torch with no CUDA headers (CPU builds included: tests run programs in
// "capture" mode, where launches and tensor-map encodings are logged instead of run).
//
// The trade-off: the Python path stays the reference and the fallback; this file knows nothing of any op (a
// program is data), so a new op needs no C++.

#include <torch/extension.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

using torch::autograd::variable_list;

// ---- the driver ------------------------------------------------------------------------------------------------

using CUresult = int;
using LaunchKernelFn = CUresult (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    void*, void**, void**);
using LaunchCooperativeFn = CUresult (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                         unsigned, void*, void**);
using EncodeTiledFn = CUresult (*)(void*, int, uint32_t, void*, const uint64_t*, const uint64_t*, const uint32_t*,
                                   const uint32_t*, int, int, int, int);
using ErrorStringFn = CUresult (*)(CUresult, const char**);
using StreamIsCapturingFn = CUresult (*)(void*, int*);
using CtxGetCurrentFn = CUresult (*)(void**);
using CtxSetCurrentFn = CUresult (*)(void*);
using DeviceGetFn = CUresult (*)(int*, int);
using PrimaryCtxRetainFn = CUresult (*)(void**, int);

struct Driver {
  LaunchKernelFn launch = nullptr;
  LaunchCooperativeFn launch_cooperative = nullptr;
  EncodeTiledFn encode_tiled = nullptr;
  ErrorStringFn error_string = nullptr;
  StreamIsCapturingFn stream_is_capturing = nullptr;
  CtxGetCurrentFn ctx_get_current = nullptr;
  CtxSetCurrentFn ctx_set_current = nullptr;
  DeviceGetFn device_get = nullptr;
  PrimaryCtxRetainFn primary_ctx_retain = nullptr;
};

const Driver& driver() {
  static Driver d = [] {
    Driver out;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    TORCH_CHECK(lib != nullptr, "fused_kernels native: cannot open libcuda.so.1");
    out.launch = reinterpret_cast<LaunchKernelFn>(dlsym(lib, "cuLaunchKernel"));
    out.launch_cooperative = reinterpret_cast<LaunchCooperativeFn>(dlsym(lib, "cuLaunchCooperativeKernel"));
    out.encode_tiled = reinterpret_cast<EncodeTiledFn>(dlsym(lib, "cuTensorMapEncodeTiled"));
    out.error_string = reinterpret_cast<ErrorStringFn>(dlsym(lib, "cuGetErrorString"));
    out.stream_is_capturing = reinterpret_cast<StreamIsCapturingFn>(dlsym(lib, "cuStreamIsCapturing"));
    out.ctx_get_current = reinterpret_cast<CtxGetCurrentFn>(dlsym(lib, "cuCtxGetCurrent"));
    out.ctx_set_current = reinterpret_cast<CtxSetCurrentFn>(dlsym(lib, "cuCtxSetCurrent"));
    out.device_get = reinterpret_cast<DeviceGetFn>(dlsym(lib, "cuDeviceGet"));
    out.primary_ctx_retain = reinterpret_cast<PrimaryCtxRetainFn>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    TORCH_CHECK(out.launch && out.launch_cooperative && out.stream_is_capturing && out.ctx_get_current &&
                    out.ctx_set_current && out.device_get && out.primary_ctx_retain,
                "fused_kernels native: libcuda.so.1 lacks cuLaunchKernel, cuStreamIsCapturing or the context calls");
    return out;
  }();
  return d;
}

void check_driver(CUresult result, const char* what) {
  if (result == 0) return;
  const char* message = "unknown error";
  if (driver().error_string != nullptr) driver().error_string(result, &message);
  TORCH_CHECK(false, "fused_kernels native: ", what, " failed: ", message);
}

// Makes device ``ordinal``'s primary context (torch's) current on this thread where none is. A thread on which CUDA
// has not run yet has none: the autograd engine's device thread when a recorded backward is the first work it runs
// (``dropout(x).sum().backward()``), a new Python thread whose first call is a program's. torch's device guard does not
// make one current when the thread's default device is already the tensors' (cudaGetDevice answers 0 without a
// context); the runtime would on its first call, but the launches here go to the driver. Triton's launcher does the
// same before each launch.
void ensure_context(int ordinal) {
  void* current = nullptr;
  check_driver(driver().ctx_get_current(&current), "cuCtxGetCurrent");
  if (current != nullptr) return;
  static std::mutex mutex;
  static std::unordered_map<int, void*> primaries;  // retained once per device, for the process's life
  std::lock_guard<std::mutex> lock(mutex);
  void*& primary = primaries[ordinal];
  if (primary == nullptr) {
    int device = 0;
    check_driver(driver().device_get(&device, ordinal), "cuDeviceGet");
    check_driver(driver().primary_ctx_retain(&primary, device), "cuDevicePrimaryCtxRetain");
  }
  check_driver(driver().ctx_set_current(primary), "cuCtxSetCurrent");
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

struct LoggedEncoding {
  uint64_t address;
  int elem_type;
  std::vector<uint64_t> dims, strides;  // innermost first, as the driver takes them
  std::vector<uint32_t> box;
  int swizzle, fill;
};

bool capture_mode = false;
std::mutex log_mutex;
std::vector<LoggedLaunch> launch_log;
std::vector<LoggedEncoding> encoding_log;

// ---- launches ----------------------------------------------------------------------------------------------------

constexpr size_t kTensorMapBytes = 128;
constexpr size_t kMapsPerSlot = 256;  // encoded maps kept per TMA parameter (addresses the allocator hands out)

// A TMA parameter: the tensor map over one of the call's tensors, for a tile fixed by the kernel; the shape and
// strides are the recorded ones (the op's signature fixes them), so only the address changes from call to call.
struct TmaSlot {
  int64_t param = 0;
  int64_t tensor = 0;
  int elem_type = 0;
  int swizzle = 0;
  int fill = 0;
  std::vector<uint64_t> dims, strides;  // innermost first; strides in bytes, rank - 1 of them
  std::vector<uint32_t> box;            // innermost first
  std::shared_ptr<std::mutex> mutex = std::make_shared<std::mutex>();
  std::shared_ptr<std::unordered_map<uint64_t, std::array<uint64_t, 16>>> maps =
      std::make_shared<std::unordered_map<uint64_t, std::array<uint64_t, 16>>>();
};

// One recorded kernel launch: the compiled kernel's CUfunction, its launch shape, and its parameters as the
// kernel takes them (Triton's launcher passes every non-constexpr argument by address, then two scratch pointers);
// the parameters that each call fills: tensor addresses, per-call ints and tensor maps.
struct Launch {
  uint64_t function = 0;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 128;
  unsigned shared = 0;
  bool cooperative = false;
  std::vector<uint64_t> words;    // the parameters, each at a word offset (tensor maps 64-byte aligned)
  std::vector<size_t> offsets;    // each parameter's first word
  std::vector<size_t> widths;     // each parameter's bytes
  std::vector<int64_t> tensor_slots;  // pairs: parameter index, tensor index
  std::vector<int64_t> int_slots;     // pairs: parameter index, int index
  std::vector<TmaSlot> tma_slots;
};

uint64_t pack_param(const std::string& type, const py::handle& value, size_t* width) {
  // two's complement of any Python int (bools included), as Triton's launcher passes it
  auto int_of = [&]() -> uint64_t {
    if (value.is_none()) return 0;
    const uint64_t bits = PyLong_AsUnsignedLongLongMask(value.ptr());
    if (PyErr_Occurred()) throw py::error_already_set();
    return bits;
  };
  if (type == "ptr" || type == "i64" || type == "u64") {
    *width = 8;
    return int_of();
  }
  if (type == "i32" || type == "u32") {
    *width = 4;
    return int_of() & 0xffffffffull;
  }
  if (type == "i16" || type == "u16") {
    *width = 2;
    return int_of() & 0xffffull;
  }
  if (type == "i8" || type == "u8" || type == "i1" || type == "u1") {
    *width = 1;
    return int_of() & 0xffull;
  }
  if (type == "fp32" || type == "f32") {
    *width = 4;
    const float f = static_cast<float>(py::cast<double>(value));
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return bits;
  }
  if (type == "fp64") {
    *width = 8;
    const double d = py::cast<double>(value);
    uint64_t bits;
    std::memcpy(&bits, &d, 8);
    return bits;
  }
  TORCH_CHECK(false, "fused_kernels native: no parameter of type ", type);
}

// ``tma``: one dict per TMA parameter (its index among ``params``, whose type is "tma"): tensor, elem_type, swizzle,
// fill, dims, strides (bytes), box, all innermost first.
std::shared_ptr<Launch> make_launch(uint64_t function, std::vector<int64_t> grid, int64_t block, int64_t shared,
                                    bool cooperative, const std::vector<std::pair<std::string, py::object>>& params,
                                    std::vector<int64_t> tensor_slots, std::vector<int64_t> int_slots,
                                    const std::vector<py::dict>& tma) {
  TORCH_CHECK(grid.size() == 3, "grid must have 3 entries");
  TORCH_CHECK(tensor_slots.size() % 2 == 0 && int_slots.size() % 2 == 0, "slots come in pairs");
  auto launch = std::make_shared<Launch>();
  launch->function = function;
  for (int i = 0; i < 3; ++i) launch->grid[i] = static_cast<unsigned>(grid[i]);
  launch->block = static_cast<unsigned>(block);
  launch->shared = static_cast<unsigned>(shared);
  launch->cooperative = cooperative;
  std::vector<int64_t> tma_params;
  for (const auto& [type, value] : params) {
    if (type == "tma") {
      const size_t start = (launch->words.size() + 7) / 8 * 8;  // 64-byte aligned within the (aligned) buffer
      launch->words.resize(start + kTensorMapBytes / 8, 0);
      launch->offsets.push_back(start);
      launch->widths.push_back(kTensorMapBytes);
      tma_params.push_back(static_cast<int64_t>(launch->offsets.size()) - 1);
      continue;
    }
    size_t width = 0;
    const uint64_t word = pack_param(type, value, &width);
    launch->offsets.push_back(launch->words.size());
    launch->widths.push_back(width);
    launch->words.push_back(word);
  }
  const auto n_params = static_cast<int64_t>(params.size());
  for (size_t i = 0; i < tensor_slots.size(); i += 2) {
    // messages here and below carry no numbers: where torch's extension builder links libstdc++ statically (seen
    // with GCC 13), formatting a number through an ostream in this library crashed
    TORCH_CHECK(tensor_slots[i] >= 0 && tensor_slots[i] < n_params && launch->widths[tensor_slots[i]] == 8,
                "a tensor slot is not a pointer parameter");
  }
  for (size_t i = 0; i < int_slots.size(); i += 2) {
    TORCH_CHECK(int_slots[i] >= 0 && int_slots[i] < n_params && launch->widths[int_slots[i]] <= 8,
                "int slot out of range");
  }
  TORCH_CHECK(tma.size() == tma_params.size(), "one TMA description per \"tma\" parameter");
  for (size_t i = 0; i < tma.size(); ++i) {
    TmaSlot slot;
    slot.param = tma_params[i];
    slot.tensor = tma[i]["tensor"].cast<int64_t>();
    slot.elem_type = tma[i]["elem_type"].cast<int>();
    slot.swizzle = tma[i]["swizzle"].cast<int>();
    slot.fill = tma[i]["fill"].cast<int>();
    slot.dims = tma[i]["dims"].cast<std::vector<uint64_t>>();
    slot.strides = tma[i]["strides"].cast<std::vector<uint64_t>>();
    slot.box = tma[i]["box"].cast<std::vector<uint32_t>>();
    TORCH_CHECK(!slot.dims.empty() && slot.dims.size() <= 5 && slot.box.size() == slot.dims.size() &&
                    slot.strides.size() + 1 == slot.dims.size(),
                "a TMA parameter needs dims, box and rank - 1 strides (rank 1 to 5)");
    launch->tma_slots.push_back(std::move(slot));
  }
  launch->tensor_slots = std::move(tensor_slots);
  launch->int_slots = std::move(int_slots);
  return launch;
}

void encode_map(const TmaSlot& slot, uint64_t address, uint64_t* map) {
  if (capture_mode) {
    std::memset(map, 0, kTensorMapBytes);
    map[0] = address;  // stands for the map in the log of the launch
    std::lock_guard<std::mutex> lock(log_mutex);
    encoding_log.push_back({address, slot.elem_type, slot.dims, slot.strides, slot.box, slot.swizzle, slot.fill});
    return;
  }
  const Driver& d = driver();
  TORCH_CHECK(d.encode_tiled != nullptr, "fused_kernels native: libcuda.so.1 lacks cuTensorMapEncodeTiled");
  const uint32_t element_strides[5] = {1, 1, 1, 1, 1};
  // interleave none (0), L2 promotion of 128 bytes (2), as Triton's launcher encodes its maps
  check_driver(d.encode_tiled(map, slot.elem_type, static_cast<uint32_t>(slot.dims.size()),
                              reinterpret_cast<void*>(address), slot.dims.data(), slot.strides.data(),
                              slot.box.data(), element_strides, 0, slot.swizzle, 2, slot.fill),
               "cuTensorMapEncodeTiled");
}

void run_launch(const Launch& launch, const std::vector<uint64_t>& addresses, const std::vector<int64_t>& ints,
                void* stream) {
  const size_t n = launch.offsets.size();
  // the parameter words on a 64-byte boundary, then Triton's two scratch pointers (none: such kernels are never
  // recorded)
  std::vector<uint64_t> storage(launch.words.size() + 2 + 8);
  uint64_t* words = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  std::memcpy(words, launch.words.data(), launch.words.size() * 8);
  words[launch.words.size()] = 0;
  words[launch.words.size() + 1] = 0;
  for (size_t i = 0; i < launch.tensor_slots.size(); i += 2) {
    words[launch.offsets[launch.tensor_slots[i]]] = addresses[launch.tensor_slots[i + 1]];
  }
  for (size_t i = 0; i < launch.int_slots.size(); i += 2) {
    const size_t width = launch.widths[launch.int_slots[i]];
    const uint64_t mask = width >= 8 ? ~0ull : ((1ull << (8 * width)) - 1);
    words[launch.offsets[launch.int_slots[i]]] = static_cast<uint64_t>(ints[launch.int_slots[i + 1]]) & mask;
  }
  for (const TmaSlot& slot : launch.tma_slots) {
    const uint64_t address = addresses[slot.tensor];
    uint64_t* map = words + launch.offsets[slot.param];
    std::lock_guard<std::mutex> lock(*slot.mutex);
    auto found = slot.maps->find(address);
    if (found == slot.maps->end()) {
      if (slot.maps->size() >= kMapsPerSlot) slot.maps->clear();
      std::array<uint64_t, 16> encoded{};
      encode_map(slot, address, encoded.data());
      found = slot.maps->emplace(address, encoded).first;
    }
    std::memcpy(map, found->second.data(), kTensorMapBytes);
  }
  // little-endian: a parameter narrower than 8 bytes is the low bytes of its word, at the word's address
  std::vector<void*> params(n + 2);
  for (size_t i = 0; i < n; ++i) params[i] = words + launch.offsets[i];
  params[n] = words + launch.words.size();
  params[n + 1] = words + launch.words.size() + 1;
  if (capture_mode) {
    LoggedLaunch logged{launch.function, {launch.grid[0], launch.grid[1], launch.grid[2]}, launch.block,
                        launch.shared, launch.cooperative, reinterpret_cast<uint64_t>(stream), {}};
    for (size_t i = 0; i < n + 2; ++i) {
      const size_t width = i < n ? launch.widths[i] : 8;
      logged.params.emplace_back(reinterpret_cast<const char*>(params[i]), width);
    }
    std::lock_guard<std::mutex> lock(log_mutex);
    launch_log.push_back(std::move(logged));
    return;
  }
  if (static_cast<uint64_t>(launch.grid[0]) * launch.grid[1] * launch.grid[2] == 0) return;
  const Driver& d = driver();
  void* function = reinterpret_cast<void*>(launch.function);
  check_driver(launch.cooperative
                   ? d.launch_cooperative(function, launch.grid[0], launch.grid[1], launch.grid[2], launch.block, 1,
                                          1, launch.shared, stream, params.data())
                   : d.launch(function, launch.grid[0], launch.grid[1], launch.grid[2], launch.block, 1, 1,
                              launch.shared, stream, params.data(), nullptr),
               "kernel launch");
}

// ---- programs ----------------------------------------------------------------------------------------------------

// Where a tensor of a stage comes from: the call's inputs, the stage's allocations, tensors the program holds
// (workspaces), the gradients of the outputs, the tensors saved by the forward, the stage's copies (made after its
// launches), or nothing (None).
enum RefKind : int64_t { NONE = 0, INPUT = 1, ALLOC = 2, FIXED = 3, GRAD = 4, SAVED = 5, COPY = 6 };

// A tensor a stage allocates: contiguous, or with the given strides (a layout the recorded launches were built for).
struct Alloc {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
};

// A tensor made after a stage's launches: ``source`` (a ref pair) narrowed to the allocation's last size, copied into
// the allocation (a cast where the dtypes differ): an fp32 accumulator becoming a gradient in its input's dtype.
struct Copy {
  Alloc into;
  int64_t source_kind, source_index;
};

struct Stage {
  std::vector<std::shared_ptr<Launch>> launches;
  std::vector<Alloc> allocs;
  std::vector<at::Tensor> fixed;
  std::vector<int64_t> tensors;  // pairs: kind, index, in the order the recorded launches number them
  std::vector<Copy> copies;
  size_t ints_read = 0;  // how many of the call's ints the launches read (one past the highest index)
};

struct Program : torch::CustomClassHolder {
  at::Device device{at::kCPU};
  Stage forward;
  std::vector<int64_t> outputs;           // pairs into the forward's tensors: what the call returns
  std::vector<int64_t> non_differentiable;  // indices into ``outputs``
  std::vector<int64_t> saved;             // pairs into the forward's tensors: what the backward reads (SAVED index)
  bool has_backward = false;
  Stage backward;
  std::vector<Alloc> grad_layouts;  // per output: the dtype and layout the backward takes its gradient in (sizes
                                    // {-1}: not differentiated, its gradient not read)
  std::vector<int64_t> input_grads;  // pairs into the backward's tensors, one per input: its gradient

  size_t ints_read() const { return std::max(forward.ints_read, has_backward ? backward.ints_read : 0); }

  // The call the program was built for, which ``call`` checks each call against (set by ``guard``): each input's
  // dtype, sizes and strides, the stream (torch's, and its handle for the launches).
  bool guarded = false;
  std::vector<Alloc> input_layouts;
  std::optional<c10::Stream> stream;
  int64_t stream_handle = 0;
};

at::Tensor allocate(const Alloc& alloc, const at::TensorOptions& options) {
  if (alloc.strides.empty()) return at::empty(alloc.sizes, options.dtype(alloc.dtype));
  return at::empty_strided(alloc.sizes, alloc.strides, options.dtype(alloc.dtype));
}

struct StageTensors {
  const std::vector<at::Tensor>* inputs = nullptr;
  std::vector<at::Tensor> allocs;
  const std::vector<at::Tensor>* fixed = nullptr;
  const std::vector<at::Tensor>* grads = nullptr;
  const std::vector<at::Tensor>* saved = nullptr;
  std::vector<at::Tensor> copies;

  at::Tensor get(int64_t kind, int64_t index) const {
    switch (kind) {
      case INPUT: return (*inputs)[index];
      case ALLOC: return allocs[index];
      case FIXED: return (*fixed)[index];
      case GRAD: return (*grads)[index];
      case SAVED: return (*saved)[index];
      case COPY: return copies[index];
      default: return at::Tensor();
    }
  }
};

// Allocates the stage's tensors, runs its launches, then its copies; false (launching nothing) when a tensor is not
// 16-byte aligned (the compiled kernels may assume the alignment they were recorded with).
bool run_stage(const Program& program, const Stage& stage, StageTensors& tensors, const std::vector<int64_t>& ints,
               int64_t stream) {
  c10::OptionalDeviceGuard guard;
  if (!capture_mode && program.device.type() == at::kCUDA) {
    guard.reset_device(program.device);
    ensure_context(program.device.index());
  }
  const auto options = at::TensorOptions().device(program.device);
  tensors.allocs.reserve(stage.allocs.size());
  for (const auto& alloc : stage.allocs) tensors.allocs.push_back(allocate(alloc, options));
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
  for (const auto& launch : stage.launches) run_launch(*launch, addresses, ints, reinterpret_cast<void*>(stream));
  for (const auto& copy : stage.copies) {
    at::Tensor source = tensors.get(copy.source_kind, copy.source_index);
    const int64_t last = copy.into.sizes.back();
    if (source.size(-1) != last) source = source.narrow(-1, 0, last);
    tensors.copies.push_back(allocate(copy.into, options).copy_(source));
  }
  return true;
}

variable_list collect(const StageTensors& tensors, const std::vector<int64_t>& refs) {
  variable_list out;
  out.reserve(refs.size() / 2);
  for (size_t i = 0; i < refs.size(); i += 2) out.push_back(tensors.get(refs[i], refs[i + 1]));
  return out;
}

// Whether ``t`` is laid out as ``strides`` says (contiguous where it is empty); a dim of size 1 may have any stride.
bool has_layout(const at::Tensor& t, const std::vector<int64_t>& strides) {
  if (strides.empty()) return t.is_contiguous();
  if (static_cast<int64_t>(strides.size()) != t.dim()) return false;
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (t.size(i) != 1 && t.stride(i) != strides[i]) return false;
  }
  return true;
}

// A gradient in the dtype and layout the recorded backward was built for (a copy where it is not).
at::Tensor conform(const at::Tensor& grad, const Alloc& layout) {
  at::Tensor g = grad;
  const bool layout_ok = has_layout(g, layout.strides);
  if (g.scalar_type() != layout.dtype || !layout_ok || (reinterpret_cast<uint64_t>(g.data_ptr()) & 15)) {
    at::Tensor made = layout.strides.empty()
        ? at::empty(g.sizes(), g.options().dtype(layout.dtype))
        : at::empty_strided(g.sizes(), layout.strides, g.options().dtype(layout.dtype));
    g = made.copy_(g);
  }
  return g;
}

// torch's autograd holds its nodes by std::shared_ptr (torch 2.12 and before) or by c10::intrusive_ptr (since): the
// pointer an edge holds, and a node made as one.
using NodePtr = std::decay_t<decltype(std::declval<torch::autograd::Edge&>().function)>;

template <typename Derived, typename Ptr = NodePtr>
auto make_node() {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<Derived>();
  } else {
    return c10::make_intrusive<Derived>();
  }
}

// The backward of a program's call: a node of torch's autograd graph written as torch's own backward nodes are (its
// saved tensors, ints and stream are members), which costs a call less than a custom autograd Function does (no
// context object, no dictionary of saved values, no output wrapping).
struct RecordedBackward : public torch::autograd::Node {
  c10::intrusive_ptr<Program> program;
  std::vector<int64_t> ints;
  int64_t stream = 0;
  std::vector<torch::autograd::SavedVariable> saved;
  std::mutex mutex;

  std::string name() const override { return "fused_kernels::RecordedBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto& s : saved) s.reset_data();
  }

  variable_list apply(variable_list&& grad_outputs) override {
    std::lock_guard<std::mutex> lock(mutex);
    const size_t n_inputs = program->input_grads.size() / 2;
    auto unread = [&](size_t i) {  // not differentiated: its gradient is not read
      const Alloc& layout = program->grad_layouts[i];
      return layout.sizes.size() == 1 && layout.sizes[0] == -1;
    };
    bool any_grad = false;
    for (size_t i = 0; i < grad_outputs.size(); ++i) any_grad |= !unread(i) && grad_outputs[i].defined();
    if (!any_grad) return variable_list(n_inputs);  // the outputs are unused downstream: nothing flows back
    std::vector<at::Tensor> grads;
    grads.reserve(grad_outputs.size());
    for (size_t i = 0; i < grad_outputs.size(); ++i) {
      const Alloc& layout = program->grad_layouts[i];
      if (unread(i)) {
        grads.emplace_back();
      } else if (!grad_outputs[i].defined()) {  // this output unused downstream, another used: zeros for it
        grads.push_back(allocate(layout, at::TensorOptions().device(program->device)).zero_());
      } else {
        grads.push_back(conform(grad_outputs[i], layout));
      }
    }
    std::vector<at::Tensor> unpacked;
    unpacked.reserve(saved.size());
    for (const auto& s : saved) unpacked.push_back(s.unpack());
    StageTensors tensors;
    tensors.grads = &grads;
    tensors.saved = &unpacked;
    // the forward's stream: the autograd engine runs a node's backward on the stream its forward ran on
    TORCH_CHECK(run_stage(*program, program->backward, tensors, ints, stream),
                "fused_kernels native: a saved tensor is not 16-byte aligned");
    return collect(tensors, program->input_grads);
  }
};

// The forward of a call that needs gradients: its outputs, the differentiable ones with a RecordedBackward as their
// gradient function (a non-differentiable output keeps its slot among the node's inputs, as torch's custom
// functions keep it, so the backward's gradients are numbered as the outputs).
variable_list forward_with_node(const c10::intrusive_ptr<Program>& program, const std::vector<at::Tensor>& inputs,
                                const std::vector<int64_t>& ints, int64_t stream) {
  StageTensors tensors;
  tensors.inputs = &inputs;
  TORCH_CHECK(run_stage(*program, program->forward, tensors, ints, stream),
              "fused_kernels native: a tensor is not 16-byte aligned");
  variable_list outputs = collect(tensors, program->outputs);
  auto node = make_node<RecordedBackward>();
  node->program = program;
  node->ints = ints;
  node->stream = stream;
  node->set_next_edges(torch::autograd::collect_next_edges(at::TensorList(inputs)));
  const NodePtr base(node);
  for (size_t i = 0; i < outputs.size(); ++i) {
    const bool fixed = std::find(program->non_differentiable.begin(), program->non_differentiable.end(),
                                 static_cast<int64_t>(i)) != program->non_differentiable.end();
    if (fixed || !outputs[i].defined()) {
      node->add_input_metadata(torch::autograd::Node::undefined_input());
    } else {
      torch::autograd::set_history(outputs[i], base);
    }
  }
  // An output the backward reads is saved as a detached alias (its data and version counter, without the node as
  // its gradient function, which would make a cycle); the rest as they are.
  node->saved.reserve(program->saved.size() / 2);
  for (const at::Tensor& t : collect(tensors, program->saved)) {
    if (!t.defined()) {
      node->saved.emplace_back();
      continue;
    }
    const bool is_output = std::any_of(outputs.begin(), outputs.end(), [&](const at::Tensor& o) {
      return o.defined() && o.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
    });
    node->saved.emplace_back(is_output ? t.detach() : t, /*is_output=*/false);
  }
  return outputs;
}

// The call, on ``stream`` (the current stream's handle): the outputs, or None (nothing launched) when a tensor is
// not 16-byte aligned or carries a forward-mode tangent.
py::object run(const c10::intrusive_ptr<Program>& program, const std::vector<at::Tensor>& inputs,
               const std::vector<int64_t>& ints, int64_t stream) {
  uint64_t aligned = 0;
  bool needs_grad = false;
  for (const auto& t : inputs) {
    aligned |= reinterpret_cast<uint64_t>(t.data_ptr());
    needs_grad |= t.requires_grad();
    // a tangent of forward-mode AD: the program has no jvp, so the Python path answers as it does for such a call
    if (t._fw_grad(/*level=*/0).defined()) return py::none();
  }
  if (aligned & 15) return py::none();
  TORCH_CHECK(ints.size() >= program->ints_read(), "fused_kernels native: the call passes fewer ints than its "
              "launches read");
  needs_grad = needs_grad && at::GradMode::is_enabled();
  if (needs_grad && !program->has_backward) return py::none();  // a program built for calls without gradients
  variable_list outputs;
  if (needs_grad) {
    outputs = forward_with_node(program, inputs, ints, stream);
  } else {
    StageTensors tensors;
    tensors.inputs = &inputs;
    if (!run_stage(*program, program->forward, tensors, ints, stream)) return py::none();
    outputs = collect(tensors, program->outputs);
  }
  return py::cast(outputs);
}

// Whether ``t`` is what ``layout`` describes on ``device``: its dtype, sizes and strides (any stride on a dim of size 1).
bool matches(const at::Tensor& t, const Alloc& layout, const at::Device& device) {
  return t.defined() && t.device() == device && t.scalar_type() == layout.dtype &&
         t.sizes().equals(layout.sizes) && has_layout(t, layout.strides);
}

// The current stream of a CUDA device (no CUDA headers: through torch's device guard interface).
c10::Stream current_stream(const at::Device& device) {
  return c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(device);
}

// The call of a guarded program (``Program.guard``): its outputs as ``run`` gives them, or None (nothing launched)
// where the call is not the one the program was built for (an input's dtype, sizes, strides or device, the current
// stream), where that stream is capturing a CUDA graph, or where ``run`` declines. The Python side then takes the
// path that builds or finds the right program; a call through here runs no Python past the lookup of the program.
py::object call(const c10::intrusive_ptr<Program>& program, const std::vector<at::Tensor>& inputs,
                const std::vector<int64_t>& ints) {
  if (!program->guarded || inputs.size() != program->input_layouts.size()) return py::none();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!matches(inputs[i], program->input_layouts[i], program->device)) return py::none();
  }
  if (!capture_mode && program->device.is_cuda()) {
    if (!program->stream.has_value() || !(current_stream(program->device) == *program->stream)) return py::none();
    int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE; an error (the legacy stream beside a capture) declines too
    if (driver().stream_is_capturing(reinterpret_cast<void*>(program->stream_handle), &status) != 0 || status != 0) {
      return py::none();
    }
  }
  return run(program, inputs, ints, program->stream_handle);
}

using AllocSpec = std::tuple<std::vector<int64_t>, std::vector<int64_t>, at::ScalarType>;
using CopySpec = std::tuple<AllocSpec, int64_t, int64_t>;

Alloc to_alloc(const AllocSpec& spec) {
  const auto& [sizes, strides, dtype] = spec;
  TORCH_CHECK(strides.empty() || strides.size() == sizes.size(), "an allocation's strides match its sizes");
  return {sizes, strides, dtype};
}

Stage make_stage(std::vector<std::shared_ptr<Launch>> launches, const std::vector<AllocSpec>& allocs,
                 std::vector<at::Tensor> fixed, std::vector<int64_t> tensors, const std::vector<CopySpec>& copies) {
  TORCH_CHECK(tensors.size() % 2 == 0, "tensor refs come in pairs");
  Stage stage;
  stage.launches = std::move(launches);
  for (const auto& spec : allocs) stage.allocs.push_back(to_alloc(spec));
  stage.fixed = std::move(fixed);
  stage.tensors = std::move(tensors);
  // a launch that reads past the stage's tensors or the call's ints would read stray memory: refused here, and in
  // ``run`` for the ints
  const auto n_tensors = static_cast<int64_t>(stage.tensors.size() / 2);
  for (const auto& launch : stage.launches) {
    for (size_t i = 1; i < launch->tensor_slots.size(); i += 2) {
      TORCH_CHECK(launch->tensor_slots[i] >= 0 && launch->tensor_slots[i] < n_tensors,
                  "fused_kernels native: a launch reads a tensor the stage does not list");
    }
    for (const auto& slot : launch->tma_slots) {
      TORCH_CHECK(slot.tensor >= 0 && slot.tensor < n_tensors,
                  "fused_kernels native: a tensor map describes a tensor the stage does not list");
    }
    for (size_t i = 1; i < launch->int_slots.size(); i += 2) {
      TORCH_CHECK(launch->int_slots[i] >= 0, "fused_kernels native: a negative int index");
      stage.ints_read = std::max(stage.ints_read, static_cast<size_t>(launch->int_slots[i]) + 1);
    }
  }
  for (const auto& [into, kind, index] : copies) {
    TORCH_CHECK(!std::get<0>(into).empty(), "a copy needs sizes");
    stage.copies.push_back({to_alloc(into), kind, index});
  }
  return stage;
}

// What capture mode logged so far, the log emptied.
template <typename T>
std::vector<T> take_logged(std::vector<T>& log) {
  std::vector<T> taken;
  std::lock_guard<std::mutex> lock(log_mutex);
  taken.swap(log);
  return taken;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Recorded op calls replayed from C++ (see recorded_ops.cpp).";
  py::class_<Launch, std::shared_ptr<Launch>>(m, "Launch")
      .def(py::init(&make_launch), py::arg("function"), py::arg("grid"), py::arg("block"), py::arg("shared"),
           py::arg("cooperative"), py::arg("params"), py::arg("tensor_slots"), py::arg("int_slots"),
           py::arg("tma") = std::vector<py::dict>());
  py::class_<Program, c10::intrusive_ptr<Program>>(m, "Program")
      .def(py::init([](at::Device device, std::vector<std::shared_ptr<Launch>> launches,
                       std::vector<AllocSpec> allocs, std::vector<at::Tensor> fixed, std::vector<int64_t> tensors,
                       std::vector<int64_t> outputs, std::vector<int64_t> saved,
                       std::vector<int64_t> non_differentiable, std::vector<CopySpec> copies) {
             auto program = c10::make_intrusive<Program>();
             program->device = device;
             program->forward = make_stage(std::move(launches), allocs, std::move(fixed), std::move(tensors), copies);
             program->outputs = std::move(outputs);
             program->saved = std::move(saved);
             program->non_differentiable = std::move(non_differentiable);
             return program;
           }),
           py::arg("device"), py::arg("launches"), py::arg("allocs"), py::arg("fixed"), py::arg("tensors"),
           py::arg("outputs"), py::arg("saved"), py::arg("non_differentiable") = std::vector<int64_t>(),
           py::arg("copies") = std::vector<CopySpec>())
      .def("set_backward",
           [](Program& program, std::vector<std::shared_ptr<Launch>> launches, std::vector<AllocSpec> allocs,
              std::vector<at::Tensor> fixed, std::vector<int64_t> tensors, std::vector<AllocSpec> grad_layouts,
              std::vector<int64_t> input_grads, std::vector<CopySpec> copies) {
             TORCH_CHECK(grad_layouts.size() == program.outputs.size() / 2, "one gradient layout per output");
             program.backward = make_stage(std::move(launches), allocs, std::move(fixed), std::move(tensors), copies);
             program.grad_layouts.clear();
             for (const auto& spec : grad_layouts) {
               const auto& [sizes, strides, dtype] = spec;
               program.grad_layouts.push_back({sizes, strides, dtype});
             }
             program.input_grads = std::move(input_grads);
             program.has_backward = true;
           },
           py::arg("launches"), py::arg("allocs"), py::arg("fixed"), py::arg("tensors"), py::arg("grad_layouts"),
           py::arg("input_grads"), py::arg("copies") = std::vector<CopySpec>())
      .def("guard",
           [](Program& program, const std::vector<at::Tensor>& inputs, int64_t stream) {
             program.input_layouts.clear();
             for (const auto& t : inputs) {
               TORCH_CHECK(t.defined(), "fused_kernels native: a guard's inputs are tensors");
               program.input_layouts.push_back({t.sizes().vec(), t.strides().vec(), t.scalar_type()});
             }
             program.stream_handle = stream;
             program.stream.reset();
             if (!capture_mode && program.device.is_cuda()) program.stream = current_stream(program.device);
             program.guarded = true;
           },
           py::arg("inputs"), py::arg("stream"));
  m.def("run", &run, py::arg("program"), py::arg("inputs"), py::arg("ints"), py::arg("stream"));
  m.def("call", &call, py::arg("program"), py::arg("inputs"), py::arg("ints"));
  m.def("set_capture_mode", [](bool on) { capture_mode = on; });
  m.def("take_log", []() {
    py::list out;
    for (const auto& l : take_logged(launch_log)) {
      py::list params;
      for (const auto& p : l.params) params.append(py::bytes(p));
      out.append(py::make_tuple(l.function, py::make_tuple(l.grid[0], l.grid[1], l.grid[2]), l.block, l.shared,
                                l.cooperative, l.stream, params));
    }
    return out;
  });
  m.def("take_encodings", []() {
    py::list out;
    for (const auto& e : take_logged(encoding_log)) {
      py::dict d;
      d["address"] = e.address;
      d["elem_type"] = e.elem_type;
      d["dims"] = e.dims;
      d["strides"] = e.strides;
      d["box"] = e.box;
      d["swizzle"] = e.swizzle;
      d["fill"] = e.fill;
      out.append(d);
    }
    return out;
  });
  m.attr("NONE") = static_cast<int64_t>(NONE);
  m.attr("INPUT") = static_cast<int64_t>(INPUT);
  m.attr("ALLOC") = static_cast<int64_t>(ALLOC);
  m.attr("FIXED") = static_cast<int64_t>(FIXED);
  m.attr("GRAD") = static_cast<int64_t>(GRAD);
  m.attr("SAVED") = static_cast<int64_t>(SAVED);
  m.attr("COPY") = static_cast<int64_t>(COPY);
}
