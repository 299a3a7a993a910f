"""The compiled tier of the eager path (``kernels/_native``): recorded programs replayed from C++.

On CPUs the extension runs in capture mode (each launch logged with the bytes of every parameter, nothing run):
the tests check what a launch is given, where the autograd node sends each gradient, and when a call must step
aside. On a GPU the tier is compared with the Python path bit for bit.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import torch

import kernels._native as native_tier
from kernels._common.launch import forget_recorded_launches
from kernels._mode import DEVICE, INTERPRETER


@pytest.fixture(scope="module")
def native():
    module = native_tier.module()
    if module is None:
        if not INTERPRETER:  # the GPU machine has the compiler and ninja: a failed build there is a failure
            pytest.fail("the compiled tier could not be built")
        pytest.skip("the compiled tier could not be built here (a C++ compiler and ninja are needed)")
    return module


@pytest.fixture
def capture(native):
    native.set_capture_mode(True)
    native.take_log()
    yield native
    native.take_log()
    native.set_capture_mode(False)


def _words(logged) -> list[bytes]:
    return logged[6]


def _pointer(word: bytes) -> int:
    return struct.unpack("<Q", word)[0]


def test_each_parameter_reaches_the_kernel_as_tritons_launcher_packs_it(capture):
    params = [("ptr", 0), ("i32", -7), ("i64", -(2**40)), ("u64", 2**63 + 5), ("fp32", 1e-5), ("i1", True),
              ("fp64", 0.1), ("i8", -1), ("u16", 65535), ("ptr", 4096)]
    launch = capture.Launch(function=77, grid=[3, 2, 1], block=256, shared=1024, cooperative=True, params=params,
                            tensor_slots=[0, 0], int_slots=[1, 0, 2, 1])
    program = capture.Program(device=torch.device("cpu"), launches=[launch], allocs=[], fixed=[],
                              tensors=[capture.INPUT, 0], outputs=[], saved=[])
    x = torch.zeros(4)
    assert capture.run(program, [x], [2**32 + 9, -3], 0xABC) == []
    (logged,) = capture.take_log()
    assert logged[:6] == (77, (3, 2, 1), 256, 1024, True, 0xABC)
    expected = [struct.pack("<Q", x.data_ptr()), struct.pack("<I", 9), struct.pack("<q", -3),
                struct.pack("<Q", 2**63 + 5), struct.pack("<f", 1e-5), b"\x01", struct.pack("<d", 0.1), b"\xff",
                struct.pack("<H", 65535), struct.pack("<Q", 4096)]
    # then Triton's two scratch pointers, null: kernels that need scratch memory are never recorded
    assert _words(logged) == [*expected, bytes(8), bytes(8)]


def test_a_parameter_of_an_unknown_type_or_a_slot_on_a_non_pointer_is_refused(native):
    with pytest.raises(RuntimeError, match="no parameter of type"):
        native.Launch(function=1, grid=[1, 1, 1], block=32, shared=0, cooperative=False, params=[("fp16", 1.0)],
                      tensor_slots=[], int_slots=[])

    class Recorded:  # a recorded call whose one launch has such a parameter: no program, the Python path
        def native_forms(self, tensors):
            return [{"function": 1, "grid": [1, 1, 1], "block": 32, "shared": 0, "cooperative": False,
                     "params": [("bf16", 1.0)], "tensor_slots": [], "int_slots": [], "tma": [], "device": 0}]

    assert native_tier.launches(Recorded(), (), native) is None
    with pytest.raises(RuntimeError, match="not a pointer"):
        native.Launch(function=1, grid=[1, 1, 1], block=32, shared=0, cooperative=False, params=[("i32", 0)],
                      tensor_slots=[0, 0], int_slots=[])


def test_a_program_whose_launches_read_past_its_tensors_or_the_calls_ints_is_refused(capture):
    reads_tensor_1 = capture.Launch(function=1, grid=[1, 1, 1], block=32, shared=0, cooperative=False,
                                    params=[("ptr", 0)], tensor_slots=[0, 1], int_slots=[])
    with pytest.raises(RuntimeError, match="does not list"):
        capture.Program(device=torch.device("cpu"), launches=[reads_tensor_1], allocs=[], fixed=[],
                        tensors=[capture.INPUT, 0], outputs=[], saved=[])
    reads_int_1 = capture.Launch(function=1, grid=[1, 1, 1], block=32, shared=0, cooperative=False,
                                 params=[("i32", 0)], tensor_slots=[], int_slots=[0, 1])
    program = capture.Program(device=torch.device("cpu"), launches=[], allocs=[], fixed=[], tensors=[],
                              outputs=[], saved=[])
    program.set_backward(launches=[reads_int_1], allocs=[], fixed=[], tensors=[], grad_layouts=[], input_grads=[])
    with pytest.raises(RuntimeError, match="fewer ints"):  # the backward's ints are the forward call's
        capture.run(program, [torch.zeros(2)], [7], 0)
    assert capture.run(program, [torch.zeros(2)], [7, 8], 0) == []
    assert capture.take_log() == []


def test_a_program_is_built_once_per_key_and_a_failed_build_is_not_retried():
    from kernels._common.launch import PreparedCache

    cache, builds = PreparedCache(), []

    def build(result):
        builds.append(result)
        return result

    program = object()
    assert [native_tier.program_for(cache, "a", lambda: build(program)) for _ in range(3)] == [program] * 3
    assert [native_tier.program_for(cache, "b", lambda: build(None)) for _ in range(3)] == [None] * 3
    assert builds == [program, None]


def _norm_like_program(native):
    """A program shaped as a norm's: inputs x and w; the forward allocates y and a statistics row, returns y and
    saves x, w and the statistics; the backward allocates dx and dw from the gradient and the saved tensors."""
    forward = native.Launch(function=1, grid=[1, 1, 1], block=128, shared=0, cooperative=False,
                            params=[("ptr", 0)] * 4, tensor_slots=[0, 0, 1, 1, 2, 2, 3, 3], int_slots=[])
    program = native.Program(device=torch.device("cpu"), launches=[forward],
                             allocs=[([2, 3], [], torch.float32), ([2], [], torch.float32)], fixed=[],
                             tensors=[native.INPUT, 0, native.ALLOC, 0, native.INPUT, 1, native.ALLOC, 1],
                             outputs=[native.ALLOC, 0], saved=[native.INPUT, 0, native.INPUT, 1, native.ALLOC, 1])
    workspace = torch.zeros(8)
    backward = native.Launch(function=2, grid=[1, 1, 1], block=128, shared=0, cooperative=False,
                             params=[("ptr", 0)] * 7, tensor_slots=[i for k in range(7) for i in (k, k)],
                             int_slots=[])
    program.set_backward(launches=[backward], allocs=[([2, 3], [], torch.float32), ([3], [], torch.float32)],
                         fixed=[workspace],
                         tensors=[native.SAVED, 0, native.GRAD, 0, native.ALLOC, 0, native.SAVED, 1, native.SAVED, 2,
                                  native.FIXED, 0, native.ALLOC, 1],
                         grad_layouts=[([2, 3], [], torch.float32)], input_grads=[native.ALLOC, 0, native.ALLOC, 1])
    return program, workspace


def test_the_autograd_node_gives_each_input_the_gradient_its_launch_wrote(capture):
    program, workspace = _norm_like_program(capture)
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    (y,) = capture.run(program, [x, w], [], 0x5123)
    assert y.shape == (2, 3) and y.dtype == torch.float32 and y.grad_fn is not None
    (forward,) = capture.take_log()
    x_at, y_at, w_at, stats_at = (_pointer(word) for word in _words(forward)[:4])
    assert (x_at, y_at, w_at) == (x.data_ptr(), y.data_ptr(), w.data_ptr()) and stats_at not in (0, x_at, y_at)
    # a gradient of another dtype, not contiguous: the backward gets it contiguous in the recorded dtype
    grad = torch.randn(3, 2, dtype=torch.float64).t()
    # the backward runs on its forward's stream, as torch's backward ops do
    y.backward(grad)
    (backward,) = capture.take_log()
    assert forward[5] == backward[5] == 0x5123
    saved_x, dy, dx, saved_w, saved_stats, held, dw = (_pointer(word) for word in _words(backward)[:7])
    assert (saved_x, saved_w, saved_stats, held) == (x.data_ptr(), w.data_ptr(), stats_at, workspace.data_ptr())
    assert dy not in (grad.data_ptr(), 0)
    assert x.grad.data_ptr() == dx and w.grad.data_ptr() == dw
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_each_gradient_arrives_in_its_recorded_layout_and_an_unused_output_gives_zeros(capture):
    """A program of two outputs whose backward hands the output gradients straight back as the inputs' (so the test
    can read what the backward was given): the used output's gradient in the recorded dtype and layout, zeros for
    the unused one."""
    noop = capture.Launch(function=3, grid=[1, 1, 1], block=32, shared=0, cooperative=False, params=[],
                          tensor_slots=[], int_slots=[])
    program = capture.Program(device=torch.device("cpu"), launches=[noop],
                              allocs=[([2, 3], [], torch.float32), ([3, 2], [1, 3], torch.float16)], fixed=[],
                              tensors=[], outputs=[capture.ALLOC, 0, capture.ALLOC, 1], saved=[])
    program.set_backward(launches=[noop], allocs=[], fixed=[], tensors=[],
                         grad_layouts=[([2, 3], [], torch.float32), ([3, 2], [1, 3], torch.float16)],
                         input_grads=[capture.GRAD, 0, capture.GRAD, 1])
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(3, 2, dtype=torch.float16, requires_grad=True)
    _, second = capture.run(program, [a, b], [], 0)
    assert second.stride() == (1, 3)  # allocated in the recorded layout
    grad = torch.randn(3, 2, dtype=torch.float64)
    second.backward(grad)  # the first output unused
    assert torch.equal(a.grad, torch.zeros(2, 3)) and b.grad.dtype == torch.float16
    assert torch.equal(b.grad, grad.half())
    assert len(capture.take_log()) == 2  # forward and backward


def _saves_its_output_program(native):
    """Outputs: a non-differentiable one, then y; the forward saves y; the backward's launch reads the saved y and
    the gradient of y, and the input's gradient is that gradient (handed straight back)."""
    launch = native.Launch(function=4, grid=[1, 1, 1], block=32, shared=0, cooperative=False,
                           params=[("ptr", 0)] * 2, tensor_slots=[0, 0, 1, 1], int_slots=[])
    program = native.Program(device=torch.device("cpu"), launches=[launch],
                             allocs=[([2], [], torch.int32), ([2, 3], [], torch.float32)], fixed=[],
                             tensors=[native.ALLOC, 0, native.ALLOC, 1], outputs=[native.ALLOC, 0, native.ALLOC, 1],
                             saved=[native.ALLOC, 1], non_differentiable=[0])
    program.set_backward(launches=[launch], allocs=[], fixed=[], tensors=[native.SAVED, 0, native.GRAD, 1],
                         grad_layouts=[native_tier.UNREAD, ([2, 3], [], torch.float32)],
                         input_grads=[native.GRAD, 1])
    return program


def test_the_node_numbers_gradients_as_the_outputs_and_saves_an_output_as_torch_does(capture):
    """A non-differentiable output keeps its place (the backward finds y's gradient second); a saved output reaches
    the backward as the forward's tensor; saved-tensor hooks see it; a second backward or an output changed in place
    is refused, as for any torch node."""
    program = _saves_its_output_program(capture)
    x = torch.randn(2, 3, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        counts, y = capture.run(program, [x], [], 0)
    assert not counts.requires_grad and y.requires_grad and len(packed) == 1
    assert "RecordedBackward" in type(y.grad_fn).__name__ or "RecordedBackward" in y.grad_fn.name()
    grad = torch.randn(2, 3)
    y.backward(grad, retain_graph=True)
    _, backward = capture.take_log()
    assert _pointer(_words(backward)[0]) == y.data_ptr() and torch.equal(x.grad, grad)
    y.backward(grad)  # retained: a second backward runs
    with pytest.raises(RuntimeError, match=r"second time|freed"):
        y.backward(grad)
    _, y = capture.run(program, [x], [], 0)
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(grad)


def test_without_a_gradient_to_compute_no_node_is_made(capture):
    program, _ = _norm_like_program(capture)
    x, w = torch.randn(2, 3), torch.randn(3)
    (y,) = capture.run(program, [x, w], [], 0)
    assert y.grad_fn is None
    with torch.no_grad():
        (y,) = capture.run(program, [x.requires_grad_(), w], [], 0)
    assert y.grad_fn is None
    assert len(capture.take_log()) == 2


def test_a_misaligned_input_launches_nothing_and_asks_for_the_python_path(capture):
    program, _ = _norm_like_program(capture)
    x = torch.randn(7)[1:7].view(2, 3)  # 4 bytes past a 16-byte boundary
    assert x.data_ptr() % 16
    assert capture.run(program, [x, torch.randn(3)], [], 0) is None
    assert capture.take_log() == []


def test_a_guarded_program_runs_only_the_call_it_was_built_for(capture):
    """``call`` (the fast path) runs a program only for inputs of the dtypes, sizes and strides it was guarded with,
    on the guarded stream's handle (capture mode has no CUDA stream to compare: the current-stream and graph-capture
    checks are the GPU tests'); anything else launches nothing and asks for the Python side's lookup."""
    from kernels._common.launch import PreparedCache

    program, _ = _norm_like_program(capture)
    x, w = torch.randn(2, 3), torch.randn(3)
    assert capture.call(program, [x, w], []) is None  # never guarded
    cache, plan = PreparedCache(), ("a plan",)
    assert native_tier.call_last(cache, plan, [x, w], []) is None  # no program kept for the plan
    native_tier.remember(cache, plan, program, [x, w], 0x77)
    (y,) = native_tier.call_last(cache, plan, [torch.randn(2, 3), torch.randn(3)], [])
    assert y.shape == (2, 3)
    (logged,) = capture.take_log()
    assert logged[5] == 0x77
    strided = torch.randn(3, 2).t()  # the guarded sizes, other strides
    others = ([x.double(), w], [torch.randn(3, 3), w], [strided, w], [x], [x, w, w])
    assert all(capture.call(program, inputs, []) is None for inputs in others)
    assert capture.take_log() == []
    program.guard([strided, w], 0x78)  # a guard is replaced, not added to
    assert capture.call(program, [x, w], []) is None
    assert capture.call(program, [strided, w], []) is not None


def test_the_last_program_of_a_plan_is_kept_by_the_plan_objects_identity():
    from kernels._common.launch import PreparedCache, forget_recorded_launches

    class Program:
        def guard(self, inputs, stream):
            self.guarded = (inputs, stream)

    cache, plan, program = PreparedCache(), (1, 2.0), Program()
    assert native_tier.last_program(cache, plan) is None
    native_tier.remember(cache, plan, program, ["x"], 5)
    assert native_tier.last_program(cache, plan) is program and program.guarded == (["x"], 5)
    assert native_tier.last_program(cache, tuple([1, 2.0])) is None  # an equal plan of another key
    forget_recorded_launches()  # kernels swapped: every program is forgotten
    assert native_tier.last_program(cache, plan) is None


def test_a_forward_mode_tangent_asks_for_the_python_path(capture):
    """A program has no jvp: a dual input launches nothing, and the op's Python path answers (an autograd.Function
    without a jvp refuses it), so the tangent is never dropped silently."""
    import torch.autograd.forward_ad as forward_ad

    program, _ = _norm_like_program(capture)
    x, w = torch.randn(2, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, torch.randn(2, 3))
        assert capture.run(program, [dual, w], [], 0) is None
    assert capture.take_log() == []
    assert capture.run(program, [x, w], [], 0) is not None  # outside: the same call runs


def test_a_recorded_launch_keeps_triton_launchers_parameters_in_order(monkeypatch):
    """A launch's native form takes the compiled kernel's signature: constexprs (declared, or an argument Triton
    specialised to one: an int equal to 1, a None pointer) are left out, and each tensor or int slot lands on its
    parameter's new index."""
    import types

    from kernels._common import launch as launch_module

    names = ["x_ptr", "out_ptr", "n", "one", "seed_lo", "absent_ptr", "scale", "BLOCK"]
    signature = {"x_ptr": "*bf16", "out_ptr": "*bf16", "n": "i32", "one": "constexpr", "seed_lo": "i32",
                 "absent_ptr": "constexpr", "scale": "fp32", "BLOCK": "constexpr"}
    compiled = types.SimpleNamespace(src=types.SimpleNamespace(signature=signature))
    function = 0x5EED
    monkeypatch.setitem(launch_module._COMPILED_BY_FUNCTION, function, (compiled, names))
    # Triton's C launcher after (grid, stream, function): cooperative flag, PDL flag, the two scratch buffers,
    # (num_warps, num_ctas, shared memory), launch metadata, the two hooks
    leading = (True, False, None, None, (8, 1, 4096), None, None, None)
    entry = (len, function, leading, (1024,))  # a C function stands for the compiled launcher
    values = [0, 0, 4096, 1, 0, None, 0.5]
    prepared = launch_module.PreparedLaunch(entry, (16, 1, 1), values, [(0, 1), (1, 0)], [(4, 0)], 0)
    form = prepared.native_form()
    assert form == {"function": function, "grid": [16, 1, 1], "block": 256, "shared": 4096, "cooperative": True,
                    "params": [("ptr", 0), ("ptr", 0), ("i32", 4096), ("i32", 0), ("fp32", 0.5)],
                    "tensor_slots": [0, 1, 1, 0], "int_slots": [3, 0], "tma": [], "device": 0}
    # what the tier cannot replay: a launcher behind a Python wrapper, clusters, programmatic launch
    for other in ((lambda *a: None, function, leading, (1024,)),
                  (len, function, (True, False, None, None, (8, 2, 4096), None, None, None), (1024,)),
                  (len, function, (True, True, None, None, (8, 1, 4096), None, None, None), (1024,))):
        assert launch_module.PreparedLaunch(other, (16, 1, 1), values, [], [], 0).native_form() is None


def make_tensordesc_arg(arg, meta):  # what ``_unwrap_tensordesc_launcher`` finds beside Triton's launcher wrapper
    raise AssertionError("a replay from C++ encodes its tensor maps itself")


def _tensordesc_wrapper(launcher, tensordesc_indices, tensordesc_meta):
    def inner(*args):  # the shape of Triton 3.6's ``wrap_handle_tensordesc`` wrapper
        return launcher, tensordesc_indices, tensordesc_meta

    return inner


def test_a_tma_argument_becomes_its_tensor_map_encoded_as_tritons_launcher_encodes_it(monkeypatch, capture):
    """A TMA parameter: the tensor map over the call's tensor (encoded once per address, as Triton's launcher does:
    sizes and tile innermost first, byte strides without the innermost), then the tensor's shape and strides."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    from kernels._common import launch as launch_module

    names = ["desc", "out_ptr", "n", "BLOCK"]
    signature = {"desc": "tensordesc<bf16[64, 32]>", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    compiled = __import__("types").SimpleNamespace(src=__import__("types").SimpleNamespace(signature=signature))
    function = 0x7A
    monkeypatch.setitem(launch_module._COMPILED_BY_FUNCTION, function, (compiled, names))
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 9, "block_size": [64, 32], "fp4_padded": False}
    wrapper = _tensordesc_wrapper(len, {0}, [meta])
    leading = (False, False, None, None, (4, 1, 32768), None, None, None)
    values = [None, 0, 100]
    prepared = launch_module.PreparedLaunch.__new__(launch_module.PreparedLaunch)
    prepared._entry, prepared._grid, prepared._values = (wrapper, function, leading, (64,)), (2, 1, 1), values
    prepared._tensor_slots, prepared._int_slots, prepared._device = [(1, 1)], [], 0
    prepared._tma_slots, prepared._expanded = ((0, 0, (64, 32), None),), None
    source = torch.zeros(100, 48, dtype=torch.bfloat16)[:, :40]  # strided rows
    out = torch.zeros(4)
    form = prepared.native_form((source, out))
    assert form["params"] == [("tma", None), ("i32", 100), ("i32", 40), ("i64", 48), ("i64", 1), ("ptr", 0),
                              ("i32", 100)]
    assert form["tensor_slots"] == [5, 1]
    launch = native_tier.launches(launch_module.RecordedCall((prepared,)), (source, out), capture)[0]
    program = capture.Program(device=torch.device("cpu"), launches=[launch], allocs=[], fixed=[],
                              tensors=[capture.INPUT, 0, capture.INPUT, 1], outputs=[], saved=[])
    for _ in range(2):
        capture.run(program, [source, out], [], 0)
    (encoding,) = capture.take_encodings()  # the second call's map came from the cache
    assert encoding == {"address": source.data_ptr(), "elem_type": TMA_DTYPE_DEVICE_TO_HOST[9], "dims": [40, 100],
                        "strides": [96], "box": [32, 64], "swizzle": 3, "fill": 0}
    first, second = capture.take_log()
    assert first[3] == 32768 and first[6] == second[6]
    words = first[6]
    assert len(words[0]) == 128 and _pointer(words[0][:8]) == source.data_ptr()  # capture mode's stand-in map
    assert [struct.unpack("<i", w)[0] for w in words[1:3]] == [100, 40]
    assert [struct.unpack("<q", w)[0] for w in words[3:5]] == [48, 1]
    assert _pointer(words[5]) == out.data_ptr() and struct.unpack("<i", words[6])[0] == 100


def test_a_killed_builds_lock_is_cleared_and_a_running_builds_is_waited_for(monkeypatch, tmp_path):
    """torch's extension builder waits forever on a lock file that a dead build left behind; a build under way is
    waited for, then the library it built is taken."""
    import threading
    import time

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: "built")
    monkeypatch.setattr(native_tier, "_LOCK_POLL_SECONDS", 0.01)
    lock = tmp_path / "lock"
    lock.touch()
    done = threading.Timer(0.3, lock.unlink)  # the other process's build ends
    done.start()
    started = time.monotonic()
    assert native_tier._build() == "built" and time.monotonic() - started >= 0.25
    done.join()
    lock.touch()
    stale = time.time() - native_tier._STALE_LOCK_SECONDS - 1
    os.utime(lock, (stale, stale))
    assert native_tier._build() == "built" and not lock.exists()


def test_a_built_library_is_imported_without_the_build_lock(monkeypatch, tmp_path):
    """torch's loader takes the build lock even for a library already built; a process that ends inside it leaves
    the lock for the next one to wait on. A library of this source and torch version is imported directly."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: "built")
    monkeypatch.setattr(native_tier, "_import_library", lambda path: ("imported", path))
    assert native_tier._build() == "built"  # nothing built yet
    name = native_tier._extension_name()
    library = tmp_path / (name + (".pyd" if os.name == "nt" else ".so"))
    library.touch()
    assert native_tier._build() == ("imported", str(library))
    (tmp_path / "lock").touch()  # a build under way: waited for, not imported past
    monkeypatch.setattr(native_tier, "_wait_for_a_build_under_way", lambda lock: None)
    assert native_tier._build() == "built"
    monkeypatch.setattr(torch, "__version__", "0.0.0+another")
    assert native_tier._extension_name() != name  # a torch upgrade builds anew


def _unbuilt_tier(monkeypatch, build, cuda_in_use: bool) -> None:
    """The tier as a fresh process with it on finds it: not built, no build thread, ``build`` its builder."""
    monkeypatch.setattr(native_tier, "_build", build)
    monkeypatch.setattr(native_tier, "_MODULE", [])
    monkeypatch.setattr(native_tier, "_BUILDER", [])
    monkeypatch.setattr(native_tier, "NATIVE", True)
    monkeypatch.setattr(native_tier, "INTERPRETER", False)
    monkeypatch.setattr(native_tier, "hooks_installed", lambda: False)
    monkeypatch.setattr(native_tier, "_cuda_in_use", lambda: cuda_in_use)


def test_the_first_eager_call_starts_the_build_in_the_background_and_never_waits(monkeypatch):
    """``active`` asks ``ready``: the first call starts one build thread and returns at once (the call takes the
    Python path); ``module`` waits for the build under way instead of building again; once built, calls take it."""
    import threading

    release, builds = threading.Event(), []

    def slow_build():
        builds.append(threading.current_thread().name)
        release.wait(30)
        return "extension"

    _unbuilt_tier(monkeypatch, slow_build, cuda_in_use=True)
    assert native_tier.active() is False and native_tier.active() is False
    assert len(native_tier._BUILDER) == 1
    for _ in range(3000):  # until the builder holds the build lock
        if builds:
            break
        threading.Event().wait(0.01)
    waited = []
    waiter = threading.Thread(target=lambda: waited.append(native_tier.module()))
    waiter.start()
    assert native_tier.active() is False  # still building: no call waits
    release.set()
    waiter.join(30)
    native_tier._BUILDER[0].join(30)
    assert waited == ["extension"] and builds == ["fused-kernels-native-build"]
    assert native_tier.active() is True and native_tier.ready() == "extension"


def test_no_build_starts_in_a_process_without_cuda_in_use(monkeypatch):
    """A process on CPU tensors (or one that has not touched CUDA yet) never starts the compiler on a call's
    behalf: no call there could take a program."""
    builds = []
    _unbuilt_tier(monkeypatch, lambda: builds.append("built") or "extension", cuda_in_use=False)
    assert native_tier.active() is False and native_tier.ready() is None
    assert native_tier._BUILDER == [] and builds == []


def test_switched_turns_the_tier_on_or_off_inside_its_block_only():
    saved = native_tier.NATIVE
    for on in (True, False):
        with native_tier.switched(on):
            assert native_tier.NATIVE is on
        assert native_tier.NATIVE is saved
    with pytest.raises(KeyError), native_tier.switched(not saved):
        raise KeyError("left by an exception")
    assert native_tier.NATIVE is saved


def test_the_tier_is_on_unless_the_environment_turns_it_off():
    import subprocess
    import sys

    code = "import kernels._native as n; print(n.NATIVE)"
    for value, expected in ((None, "True"), ("1", "True"), ("0", "False")):
        env = {k: v for k, v in os.environ.items() if k != "FUSED_KERNELS_NATIVE"}
        if value is not None:
            env["FUSED_KERNELS_NATIVE"] = value
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == expected


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork: POSIX only")
def test_a_child_forked_during_a_build_starts_its_own(monkeypatch):
    """The build thread does not survive fork, and the lock it holds would never be released in the child: there
    the build is forgotten, and the locks start free."""
    import threading
    import warnings

    release, started = threading.Event(), threading.Event()

    def slow_build():
        started.set()
        release.wait(30)
        return "extension"

    monkeypatch.setattr(native_tier, "_build", slow_build)
    monkeypatch.setattr(native_tier, "_MODULE", [])
    monkeypatch.setattr(native_tier, "_BUILDER", [])
    monkeypatch.setattr(native_tier, "_LOCK", threading.Lock())
    monkeypatch.setattr(native_tier, "_BUILDER_LOCK", threading.Lock())
    monkeypatch.setattr(native_tier, "_cuda_in_use", lambda: True)
    assert native_tier.ready() is None and started.wait(30)  # the builder now holds the build lock
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a process with threads, on purpose
        pid = os.fork()
    if pid == 0:  # the child: exit status 0 only when the build is forgotten and the lock is free
        ok = not native_tier._BUILDER and native_tier._LOCK.acquire(blocking=False)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    release.set()
    native_tier._BUILDER[0].join(30)
    assert os.waitstatus_to_exitcode(status) == 0
    assert native_tier.ready() == "extension"


def test_prepare_builds_in_the_calling_thread_only_where_the_tier_is_on(monkeypatch):
    calls = []
    monkeypatch.setattr(native_tier, "module", lambda: calls.append("built"))
    for on, interpreter, expected in ((True, False, ["built"]), (False, False, []), (True, True, [])):
        calls.clear()
        monkeypatch.setattr(native_tier, "NATIVE", on)
        monkeypatch.setattr(native_tier, "INTERPRETER", interpreter)
        native_tier.prepare()
        assert calls == expected


def test_python_m_kernels_native_builds_the_extension_ahead(native):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kernels._native"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"built {native.__name__}:")


def test_the_interpreter_never_takes_the_tier(monkeypatch):
    monkeypatch.setattr(native_tier, "NATIVE", True)
    assert native_tier.active() == (not INTERPRETER and native_tier.module() is not None)


# --- on a GPU: the tier against the Python path --------------------------------------------------------------


def _python_then_native(monkeypatch, programs, calls):
    """``(calls() on the Python path, calls() with the tier on)``, the tier's program cache ``programs`` emptied
    first; fails when the tier built no program."""
    monkeypatch.setattr(native_tier, "NATIVE", False)
    python = calls()
    monkeypatch.setattr(native_tier, "NATIVE", True)
    programs._entries.clear()
    forget_recorded_launches()  # the programs plans last ran through too
    compiled = calls()
    assert any(program is not False for program in programs._entries.values()), "no program was built"
    return python, compiled


def _norm_calls(fn, x, w, b, dy, deterministic):
    """Three calls (the first stores the plan, the second builds the program, the third replays it): each call's
    output and gradients."""
    out = []
    for _ in range(3):
        for t in (x, w, b):
            if t is not None:
                t.grad = None
        y = fn(x, x.shape[-1:], w, b, deterministic=deterministic) if b is not None else (
            fn(x, x.shape[-1:], w, deterministic=deterministic))
        y.backward(dy)
        out.append([y.detach().clone(), *(t.grad.clone() for t in (x, w, b) if t is not None)])
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(8, 1024), (2, 5, 2048), (3, 96)])
@pytest.mark.parametrize("affine", ["weight+bias", "weight", "bias", "none"])
def test_native_norms_equal_the_python_path_bit_for_bit(native, monkeypatch, kind, dtype, shape, affine):
    import kernels.layernorm.ops as ops
    from kernels.layernorm import layer_norm, rms_norm

    fn = layer_norm if kind == "layer_norm" else rms_norm
    torch.manual_seed(0)
    n = shape[-1]
    x = torch.randn(shape, device=DEVICE, dtype=dtype, requires_grad=True)
    if kind == "rms_norm" and affine == "bias":
        pytest.skip("RMSNorm has no bias")
    w = torch.randn(n, device=DEVICE, dtype=dtype, requires_grad=True) if "weight" in affine else None
    b = (torch.randn(n, device=DEVICE, dtype=dtype, requires_grad=True)
         if "bias" in affine and kind == "layer_norm" else None)
    dy = torch.randn(shape, device=DEVICE, dtype=dtype)
    python, compiled = _python_then_native(monkeypatch, ops._NATIVE_NORMS,
                                           lambda: _norm_calls(fn, x, w, b, dy, deterministic=True))
    for got in compiled:
        for a, e in zip(got, python[0], strict=True):
            assert torch.equal(a, e)


@pytest.mark.cuda
def test_native_programs_follow_the_current_stream_and_step_aside_in_graph_capture(native, monkeypatch):
    """A program runs on the stream it was built for: another stream gets its own; a CUDA graph captured on the
    program's own stream takes the Python path (a drawn seed stays a device seed: each replay drops anew)."""
    import kernels.layernorm.ops as ops
    from kernels.dropout import dropout
    from kernels.layernorm import rms_norm

    monkeypatch.setattr(native_tier, "NATIVE", True)
    forget_recorded_launches()
    x = torch.randn(64, 256, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(256, device=DEVICE, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    with torch.no_grad():
        expected = [rms_norm(x, 256, w) for _ in range(3)][-1]  # the plan, the program, the guarded call
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side = [rms_norm(x, 256, w) for _ in range(3)]
            for _ in range(3):
                dropout(x, 0.5)
        torch.cuda.current_stream().wait_stream(side)
        assert all(torch.equal(y, expected) for y in on_side)
        assert len({key[1] for key, program in ops._NATIVE_NORMS._entries.items() if program}) == 2
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            captured = rms_norm(static_x, 256, w)
            dropped = dropout(static_x, 0.5)
        static_x.copy_(x * 2)
        graph.replay()
        masks = [dropped != 0]
        graph.replay()
        masks.append(dropped != 0)
        torch.cuda.synchronize()
    assert torch.equal(captured, rms_norm(x * 2, 256, w))
    assert not torch.equal(*masks) and 0.4 < masks[0].float().mean().item() < 0.6


@pytest.mark.cuda
def test_native_norm_steps_aside_for_views_and_inference_still_replays(native, monkeypatch):
    import kernels.layernorm.ops as ops
    from kernels.layernorm import layer_norm

    monkeypatch.setattr(native_tier, "NATIVE", True)
    forget_recorded_launches()
    x = torch.randn(16, 512, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(512, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(512, device=DEVICE, dtype=torch.bfloat16)
    expected = torch.nn.functional.layer_norm(x.float(), (512,), w.float(), b.float()).to(x.dtype)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(layer_norm(x, (512,), w, b), expected, rtol=2e-2, atol=2e-2)
    assert any(program is not False for program in ops._NATIVE_NORMS._entries.values())
    wide = torch.randn(16, 1024, device=DEVICE, dtype=torch.bfloat16)[:, ::2]  # same shape, strided rows
    with torch.no_grad():
        for _ in range(3):
            got = layer_norm(wide, (512,), w, b)
    reference = torch.nn.functional.layer_norm(wide.float(), (512,), w.float(), b.float()).to(x.dtype)
    torch.testing.assert_close(got, reference, rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(8, 1024), (3, 5, 7)])
def test_native_dropout_equals_the_python_path_bit_for_bit(native, monkeypatch, dtype, shape):
    import kernels.dropout.ops as ops
    from kernels.dropout import dropout

    x = torch.randn(shape, device=DEVICE, dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, device=DEVICE, dtype=dtype)

    def calls():
        out = []
        for seed in (1, 2**63 + 11, 12345):
            x.grad = None
            y = dropout(x, 0.3, seed=seed)
            y.backward(dy)
            out.append((y.detach().clone(), x.grad.clone()))
        return out

    python, compiled = _python_then_native(monkeypatch, ops._NATIVE_DROPOUTS, calls)
    for (y, dx), (y_ref, dx_ref) in zip(compiled, python, strict=True):
        assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    # seed=None: torch's generator governs the draws, as on the Python path
    torch.manual_seed(5)
    first = dropout(x, 0.3)
    torch.manual_seed(5)
    assert torch.equal(dropout(x, 0.3), first) and not torch.equal(dropout(x, 0.3), first)


_FRESH_THREADS = """
import threading

import torch

import kernels._native as native
import kernels.dropout.ops as ops
from kernels.dropout import dropout

native.prepare()
x = torch.randn(4096, device="cuda", requires_grad=True)
for _ in range(2):  # the plan, then the program (whose builder runs its launch on this thread); no backward yet
    dropout(x, 0.3, seed=1)
assert any(program is not False for program in ops._NATIVE_DROPOUTS._entries.values()), "no program"
results = []


def step():
    x.grad = None
    y = dropout(x, 0.3, seed=1)
    y.backward(torch.ones_like(y))
    results.append((y.detach().clone(), x.grad.clone()))


step()  # the autograd engine's device thread: a recorded backward is the first work it runs
worker = threading.Thread(target=step)  # a thread whose first CUDA work is a program's forward
worker.start()
worker.join()
assert len(results) == 2, "the thread's call failed"
with native.switched(False):  # last: the Python path's backward would make a context current on the engine's thread
    y = dropout(x, 0.3, seed=1)
    expected = (y.detach(), torch.autograd.grad(y, x, torch.ones_like(y))[0])
for got in results:
    assert all(torch.equal(a, e) for a, e in zip(got, expected)), "not the Python path's result"
print("ok")
"""


@pytest.mark.cuda
def test_a_program_runs_on_threads_where_cuda_has_not_run_yet(native):
    """The autograd engine's device thread, when a recorded backward is the first work it runs, and a new thread
    whose first call is a program's have no CUDA context current: the extension makes the device's current, as
    Triton's launcher does (in a process of its own, as this one's threads have run CUDA work already)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "FUSED_KERNELS_NATIVE"}
    done = subprocess.run([sys.executable, "-c", _FRESH_THREADS], capture_output=True, text=True, timeout=600,
                          env=env, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def _attention_calls(q, k, v, do, **kwargs):
    """Three calls (plan, program built, program replayed): each call's output, log-sum-exp and gradients."""
    from kernels.attention import flash_attention

    out = []
    for _ in range(3):
        for t in (q, k, v):
            t.grad = None
        o, lse = flash_attention(q, k, v, return_lse=True, **kwargs)
        o.backward(do)
        out.append([o.detach().clone(), lse.clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()])
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "hq", "hkv", "sq", "sk", "d"), [(2, 4, 4, 256, 256, 64), (1, 8, 2, 200, 333, 128),
                                                               (2, 4, 1, 128, 128, 96)])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("options", [{"causal": True}, {}, {"dropout_p": 0.25, "seed": 7}, {"window_size": (32, 0)}])
def test_native_attention_equals_the_python_path_bit_for_bit(native, monkeypatch, dtype, b, hq, hkv, sq, sk, d,
                                                             layout, options):
    import kernels.attention.ops as ops

    torch.manual_seed(0)

    def make(heads, seq):
        if layout == "bshd":  # a (B, S, H, D) tensor viewed as (B, H, S, D), as transformers passes it
            return torch.randn(b, seq, heads, d, device=DEVICE, dtype=dtype).transpose(1, 2).requires_grad_(True)
        return torch.randn(b, heads, seq, d, device=DEVICE, dtype=dtype, requires_grad=True)

    q, k, v = make(hq, sq), make(hkv, sk), make(hkv, sk)
    do = torch.randn(b, hq, sq, d, device=DEVICE, dtype=dtype)
    kwargs = {"deterministic": True, **options}  # dQ summed in a fixed order, so two runs compare bit for bit
    python, compiled = _python_then_native(monkeypatch, ops._NATIVE_CALLS,
                                           lambda: _attention_calls(q, k, v, do, **kwargs))
    for got in compiled:
        for name, a, e in zip(("o", "lse", "dq", "dk", "dv"), got, python[0], strict=True):
            assert a.stride() == e.stride() and torch.equal(a, e), name


@pytest.mark.cuda
def test_native_attention_with_arrival_order_dq_matches_within_rounding(native, monkeypatch):
    """The default backward (dQ added up in arrival order on Hopper): equal to the Python path to rounding, and
    inference calls (no gradient) replay too."""
    import kernels.attention.ops as ops
    from kernels.attention import flash_attention

    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 8, 512, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    python, compiled = _python_then_native(monkeypatch, ops._NATIVE_CALLS,
                                           lambda: _attention_calls(q, k, v, do, causal=True))
    expected = python[0]
    for got in compiled:
        for a, e in zip(got, expected, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-2, atol=1e-2)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(flash_attention(q, k, v, causal=True), expected[0])


@pytest.mark.cuda
def test_native_attention_with_a_group_split_over_programs_matches_within_rounding(native, monkeypatch):
    """A grouped Hopper backward split over programs (``configs.hopper_group_heads``): the program allocates dK's and
    dV's fp32 accumulators, the preprocess zeroes them and copies cast them; equal to the Python path to
    rounding (both sum in arrival order)."""
    import kernels.attention.ops as ops
    from kernels.attention import configs

    if not configs.is_hopper(torch.device(DEVICE)):
        pytest.skip("needs an sm_90 GPU (H100, H200)")
    torch.manual_seed(2)
    q = torch.randn(2, 8, 512, 128, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 512, 128, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    with configs.forced_path("hopper"), configs.hopper_group_heads(1):
        python, compiled = _python_then_native(monkeypatch, ops._NATIVE_CALLS,
                                               lambda: _attention_calls(q, k, v, do, causal=True))
    for got in compiled:
        for a, e in zip(got, python[0], strict=True):
            assert a.stride() == e.stride()
            torch.testing.assert_close(a, e, rtol=1e-2, atol=1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("residual_kind", ["bf16", "fp32-stream", "none"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("used", ["both", "y only"])
def test_native_add_dropout_norm_equals_the_python_path(native, monkeypatch, kind, residual_kind, dropout_p, used):
    """Bit for bit with both outputs used; with residual_out unused downstream the program feeds zeros where the
    Python path feeds nothing (the same sums: adding zero)."""
    import kernels.layernorm.ops as ops
    from kernels.layernorm import add_dropout_norm

    torch.manual_seed(0)
    x = torch.randn(6, 1024, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    residual = (torch.randn(6, 1024, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
                if residual_kind != "none" else None)
    w = torch.randn(1024, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(1024, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) if kind == "layer" else None
    dy = torch.randn(6, 1024, device=DEVICE, dtype=torch.bfloat16)
    residual_dtype = torch.float32 if residual_kind == "fp32-stream" else None

    def calls():
        out = []
        for seed in (3, 4, 5):
            for t in (x, residual, w, b):
                if t is not None:
                    t.grad = None
            y, residual_out = add_dropout_norm(x, residual, w, b, kind=kind, dropout_p=dropout_p, seed=seed,
                                               residual_dtype=residual_dtype, deterministic=True)
            loss = (y.float() * dy.float()).sum()
            if used == "both":
                loss = loss + residual_out.float().square().sum()
            loss.backward()
            out.append([y.detach().clone(), residual_out.detach().clone(),
                        *(t.grad.clone() for t in (x, residual, w, b) if t is not None)])
        return out

    python, compiled = _python_then_native(monkeypatch, ops._NATIVE_ADD_DROPOUT_NORMS, calls)
    for got, expected in zip(compiled, python, strict=True):
        for a, e in zip(got, expected, strict=True):
            assert torch.equal(a, e)


@pytest.mark.cuda
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("append", [True, False], ids=["append", "read"])
@pytest.mark.parametrize("scales", [None, (0.02, 0.03), "per_head"], ids=["plain", "fp8-float", "fp8-per_head"])
def test_native_kvcache_equals_the_python_path_bit_for_bit(native, monkeypatch, paged, append, scales):
    """Decoding calls through the tier (the first builds the program, the later ones run it, each with its own data,
    lengths and page table): outputs, log-sum-exps and the caches the appends wrote, bit for bit."""
    import kernels.attention.kvcache as kvcache
    from tests._caches import kvcache_calls

    if scales == "per_head":
        scales = (torch.linspace(0.01, 0.03, 8, device=DEVICE), torch.linspace(0.04, 0.02, 8, device=DEVICE))
    shape = (32, 8, 1, ([4000, 0, 8191, 17], [4001, 1, 8000, 18], [0, 3, 5, 7000]), 8192, 128)
    python, compiled = _python_then_native(
        monkeypatch, kvcache._NATIVE_KVCACHE,
        lambda: kvcache_calls(shape, torch.bfloat16, DEVICE, paged=paged, append=append, scales=scales))
    for got, expected in zip(compiled, python, strict=True):
        for name, a, e in zip(("o", "lse", "k_cache", "v_cache"), got, expected, strict=True):
            assert torch.equal(a, e), name


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("options", [{"causal": True}, {}, {"dropout_p": 0.25, "seed": 7}, {"window_size": (32, 0)}])
def test_native_attention_varlen_equals_the_python_path_bit_for_bit(native, monkeypatch, dtype, options):
    """Packed calls of one signature with their own cumulative lengths (the first stores the plan, the second builds
    the program, the later ones run it): outputs, log-sum-exps and gradients bit for bit."""
    import kernels.attention.ops as ops
    from kernels.attention import flash_attention_varlen

    lengths = [(300, 17, 700), (500, 500, 17), (1, 1015, 1), (17, 300, 700)]  # 1017 rows each

    def calls():
        out = []
        for step, seqs in enumerate(lengths):
            torch.manual_seed(step)
            q, k, v = (torch.randn(1017, heads, 128, device=DEVICE, dtype=dtype, requires_grad=True)
                       for heads in (8, 2, 2))
            cu = torch.tensor([0, *torch.tensor(seqs).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
            o, lse = flash_attention_varlen(q, k, v, cu, cu, 1015, 1015, return_lse=True, **options)
            o.backward(torch.randn_like(o))
            out.append([o.detach().clone(), lse.clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()])
        return out

    python, compiled = _python_then_native(monkeypatch, ops._NATIVE_CALLS, calls)
    for got, expected in zip(compiled, python, strict=True):
        for name, a, e in zip(("o", "lse", "dq", "dk", "dv"), got, expected, strict=True):
            assert torch.equal(a, e), name


def test_a_plan_key_holds_the_kernel_path_and_the_hopper_tables():
    """The compiled tier keeps one program per plan, holding one path's launches (and, for attention, one set of
    Hopper tiles): a call under another path or other tiles must not find the plan, and so the program, of a call
    made before (``configs.forced_path`` and ``configs.hopper_tiles`` after a call; the A/B tools and the tests that
    compare one path with the other rely on it)."""
    import kernels.attention.ops as attention_ops
    import kernels.layernorm.ops as layernorm_ops
    from kernels.attention import configs as attention_configs
    from kernels.layernorm import configs as layernorm_configs
    from kernels.layernorm import layer_norm

    q = torch.randn(1, 2, 16, 16, device=DEVICE)
    args = (q, q, q, True, None, 0.0, (-1, -1), False)
    auto = attention_ops._plan_key(*args)
    with attention_configs.forced_path("portable"):
        portable = attention_ops._plan_key(*args)
    tiles = {128: attention_configs.HOPPER_FORWARD[128]._replace(stages=3)}
    with attention_configs.hopper_tiles(forward=tiles):
        other_tiles = attention_ops._plan_key(*args)
    assert len({auto, portable, other_tiles}) == 3
    assert attention_ops._plan_key(*args) == auto  # the same path and tables again: the same plan

    x = torch.randn(4, 32, device=DEVICE)
    plans = layernorm_ops._NORM_PLANS._entries
    plans.clear()
    layer_norm(x, (32,))
    with layernorm_configs.forced_path("portable"):
        layer_norm(x, (32,))
    layer_norm(x, (32,))
    assert len(plans) == 2


@pytest.mark.cuda
def test_native_attention_follows_a_path_switched_after_its_program_was_built(native, monkeypatch):
    """A plan's calls run through its program (built on the plan's second call); switching the kernel path or the
    Hopper tiles afterwards must run the other launches, not replay the program built before: the calls here equal
    the Python path's under each switch, and the two paths' outputs differ (so that replaying the wrong program
    would show)."""
    from kernels.attention import configs, flash_attention

    if not configs.is_hopper(torch.device(DEVICE)):
        pytest.skip("needs an sm_90 GPU: the paths are the same kernels elsewhere")
    monkeypatch.setattr(native_tier, "NATIVE", True)
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 8, 1024, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))

    def calls(path, tiles=None):
        with configs.forced_path(path), configs.hopper_tiles(forward=tiles):
            return [flash_attention(q, k, v, causal=True) for _ in range(3)]

    expected = {}
    with native_tier.switched(False):
        for path in ("hopper", "portable"):
            expected[path] = calls(path)[0]
    assert not torch.equal(expected["hopper"], expected["portable"])
    for path in ("hopper", "portable", "hopper"):
        for o in calls(path):
            assert torch.equal(o, expected[path]), path
    # other Hopper tiles: a forward on 64-key blocks equals its own Python-path call, not the 128-key program's
    tiles = {128: configs.HOPPER_FORWARD[128]._replace(block_n=64, stages=3)}
    with native_tier.switched(False):
        other = calls("hopper", tiles)[0]
    assert not torch.equal(other, expected["hopper"])
    for o in calls("hopper", tiles):
        assert torch.equal(o, other)
