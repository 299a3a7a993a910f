"""The compiled tier of the eager path: recorded op calls replayed from C++ (``recorded_ops.cpp``).

An eager call of ours costs Python on the host: the op's own code, an ``autograd.Function`` (whose backward node
the autograd engine runs through Python) and the launches. Recorded launches (``kernels/_common/launch.py``) already
cut the launches to a C call each; what stays is the Python around them. This tier turns an op call that the Python
path has recorded into a *program* (data: the launches, the tensors to allocate, what to return and save) that a
small C++ extension runs, with a C++ autograd node for the backward, so a replayed call runs no Python past the
lookup of its program, and its backward none at all.

On by default; ``FUSED_KERNELS_NATIVE=0`` turns it off. The extension is built with ``torch.utils.cpp_extension``
(a C++ compiler and ninja; no CUDA toolkit: the driver is reached through ``dlopen``) and cached by torch in
``TORCH_EXTENSIONS_DIR``: on a background thread that the first eager call which could take the tier starts in a
process that uses CUDA (:func:`ready`; calls take the Python path until it is done, so none waits tens of seconds
for the compiler), or ahead of time by ``python -m kernels._native``, or in the calling thread by :func:`module`
(the test and benchmark sessions call it first when the tier is on, so that every call they time or check can take
it). When it cannot be built, a warning says so once and every call takes the Python path, as it does under the
Triton interpreter, under torch.compile and in CI. The Python path stays the reference: tests compare the two bit
for bit, and run the programs on CPU in capture mode (launches logged, not run) to check what each launch is given.

Programs: ``layer_norm``, ``rms_norm`` and ``add_dropout_norm`` (the single-kernel backward's widths; for
``add_dropout_norm`` rows the single-pass forward takes), ``dropout`` (not in place), dense ``flash_attention``
(Hopper kernels included: their TMA arguments are encoded in C++, each map kept by address),
``flash_attention_varlen`` (the cumulative lengths are inputs, saved for the backward) and
``flash_attention_with_kvcache`` (forward only: the append and the attention launches).

A program keeps the call it was built for (``Program.guard``: the inputs' dtypes, sizes and strides, the stream),
and each op keeps, per checked plan, the program its calls last ran through (:func:`last_program`): a later call of
that plan hands its tensors straight to the extension's ``call``, which checks the rest in C++ (strides, the current
stream, graph capture) and runs it, or declines and the op looks its program up on the Python side as at first.

A program holds the launches of the kernel path and the launch tables in force when it was built; the plan keys hold
the path switch and the Hopper tables' version (``kernels._common.eager``), and the other table overrides empty
every cache (``forget_recorded_launches``) or keep their calls off the tier, so a call under other settings never
replays it.

Limits: what recorded launches cannot replay (clusters, programmatic launch, kernels with scratch memory) has no
program; a program is built for one op signature (strides included) on one stream, and every other call takes the
Python path, as do calls under CUDA graph capture, with launch hooks installed, or with tensors off 16-byte
alignment. A backward's gradient is made contiguous (or into the recorded layout) when it arrives in another.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import pathlib
import threading
import time
import warnings
from collections.abc import Sequence

import torch

from kernels._common.launch import RecordedCall, hooks_installed
from kernels._common.runtime import INTERPRETER

#: eager calls replay their recorded programs from C++ where they can, unless ``FUSED_KERNELS_NATIVE=0``
NATIVE = os.environ.get("FUSED_KERNELS_NATIVE", "1") != "0"
#: whether this process has CUDA in use: only then can a call have a program, and only then is the extension built
#: on a call's behalf (a process on CPU tensors never starts a compiler)
_cuda_in_use = torch.cuda.is_initialized

_SOURCE = pathlib.Path(__file__).with_name("recorded_ops.cpp")
_MODULE: list = []
_LOCK = threading.Lock()


def module():
    """The built extension, or None when it cannot be built (warned once): built in this thread, or waited for where
    a build is under way."""
    if _MODULE:
        return _MODULE[0]
    with _LOCK:
        if not _MODULE:
            _MODULE.append(_build())
    return _MODULE[0]


_BUILDER: list[threading.Thread] = []
_BUILDER_LOCK = threading.Lock()


def ready():
    """The built extension if it is ready, else None; the first call starts building it on a background thread (a
    daemon: a process that ends during the build leaves it unbuilt, and its lock: a process whose build starts while
    that lock is younger than ``_STALE_LOCK_SECONDS`` waits on it, its calls on the Python path; a later one clears
    it and builds). No build starts in a process that has not initialised CUDA."""
    if _MODULE:
        return _MODULE[0]
    if not _cuda_in_use():
        return None
    with _BUILDER_LOCK:
        if not _BUILDER:
            builder = threading.Thread(target=module, name="fused-kernels-native-build", daemon=True)
            _BUILDER.append(builder)
            builder.start()
    return _MODULE[0] if _MODULE else None


def _forget_the_build_after_fork() -> None:
    """In a child process made by fork during a build: the build thread did not come along, and the locks it held
    would never be released there; the child starts a build of its own when a call asks for one (it then waits on
    the parent's build lock file, or finds the build done)."""
    global _LOCK, _BUILDER_LOCK
    if not _MODULE:
        _BUILDER.clear()
        _LOCK = threading.Lock()
        _BUILDER_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_the_build_after_fork)

#: a build lock older than this is a dead build's (a process killed or ended while it built): torch's builder would
#: wait for it forever
_STALE_LOCK_SECONDS = 600
_LOCK_POLL_SECONDS = 0.25


def _extension_name() -> str:
    """One name per source text and torch version: checkouts of different versions never build over each other's,
    and a torch upgrade builds anew instead of loading a library built against other headers."""
    return "fused_kernels_native_" + hashlib.sha1(_SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]


def _wait_for_a_build_under_way(lock: str) -> None:
    """Wait while another process holds the build lock; a lock older than ``_STALE_LOCK_SECONDS`` is removed."""
    while os.path.exists(lock):
        try:
            age = time.time() - os.path.getmtime(lock)
        except FileNotFoundError:
            return
        if age > _STALE_LOCK_SECONDS:
            with contextlib.suppress(FileNotFoundError):
                os.remove(lock)
            return
        time.sleep(_LOCK_POLL_SECONDS)


def _import_library(path: str):
    spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
    built = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(built)
    return built


def _build():
    """The extension: imported where this source's library is built and no build holds the lock, else built (or
    waited for) by ``torch.utils.cpp_extension.load``. torch's loader takes the build lock even to find a library
    already built (it runs ninja), and a process that ends inside it (a short script whose background build thread
    is still loading) leaves that lock behind for the next process to wait on; the import takes no lock."""
    try:
        from torch.utils import cpp_extension

        name = _extension_name()
        directory = cpp_extension._get_build_directory(name, verbose=False)
        lock = os.path.join(directory, "lock")
        _wait_for_a_build_under_way(lock)
        library = os.path.join(directory, name + (".pyd" if os.name == "nt" else ".so"))
        if os.path.exists(library) and not os.path.exists(lock):
            return _import_library(library)
        return cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=["-O2"], verbose=False)
    except Exception as error:  # a missing compiler or ninja: the Python path serves every call
        warnings.warn(f"fused_kernels: the compiled eager tier could not be built ({error}); eager calls take the "
                      "Python path (FUSED_KERNELS_NATIVE=0 turns the tier off)", RuntimeWarning, stacklevel=3)
        return None


@contextlib.contextmanager
def switched(on: bool):
    """The tier turned on or off (:data:`NATIVE`) inside the block, whatever the environment says; for measuring one
    path against the other in one process (the benchmarks)."""
    global NATIVE
    saved, NATIVE = NATIVE, on
    try:
        yield
    finally:
        NATIVE = saved


def prepare() -> None:
    """Build the extension now (in this thread) where the tier is on: a test or benchmark session calls it first, so
    that every call it checks or times can take the tier rather than the Python path of a build under way."""
    if NATIVE and not INTERPRETER:
        module()


def active() -> bool:
    """Whether eager calls may take programs now: turned on, not under the interpreter, no launch hook installed
    (a profiler must see every launch through Triton), the extension built (:func:`ready`: never waited for)."""
    return NATIVE and not INTERPRETER and not hooks_installed() and ready() is not None


def launches(recorded: RecordedCall | bool | None, tensors: tuple, native=None) -> list | None:
    """The extension's launches of a recorded call (``tensors``: a call's with its signature, whose shapes and strides
    the tensor maps read); None when there is none or one cannot be replayed here."""
    if not recorded:
        return None
    forms = recorded.native_forms(tensors)
    if forms is None:
        return None
    native = native or module()
    out = []
    for form in forms:
        form = dict(form)
        form.pop("device")
        for tma in form["tma"]:
            tma.pop("param")
        try:
            out.append(native.Launch(**form))
        except RuntimeError:  # a parameter the extension cannot lay out (a 16-bit float scalar): the Python path
            return None
    return out


def program_for(cache, key, build):
    """The program kept in ``cache`` (a ``PreparedCache``) under ``key``, made by ``build()`` on the key's first call
    (a None from it, no program, is kept as False so it is not built again); None where there is none."""
    program = cache.get(key)
    if program is None:
        program = build() or False
        cache.put(key, program)
    return None if program is False else program


def last_program(cache, plan):
    """The guarded program the last call of ``plan`` (a plan object of an op's ``PlanCache``, one per plan key) ran
    through, kept in ``cache`` (a ``PreparedCache``) by :func:`remember`; None where there is none. The extension's
    ``call`` checks in C++ what the plan key leaves out (strides, the stream, graph capture), so a call that finds one
    skips the Python of the program's lookup."""
    entry = cache.get(id(plan))
    return entry[1] if entry is not None and entry[0] is plan else None


def call_last(cache, plan, inputs: list, ints: list) -> list | None:
    """The outputs of the program ``plan``'s calls last ran through (:func:`last_program`), run by the extension's
    ``call`` for ``inputs`` and ``ints``; None where there is none or where it declines (the call is not the one the
    program was built for, graph capture, a misaligned tensor): nothing was launched."""
    program = last_program(cache, plan)
    return None if program is None else module().call(program, inputs, ints)


def remember(cache, plan, program, inputs: list, stream: int) -> None:
    """Keeps ``program`` as the last one ``plan``'s calls ran through, guarded by this call's ``inputs`` (their dtypes,
    sizes and strides) and ``stream`` (the current one's handle). The entry holds ``plan``, so its id names no other
    plan while it lives."""
    program.guard(inputs, stream)
    cache.put(id(plan), (plan, program))


def observed(seen: list, cache) -> tuple | None:
    """``(recorded call, tensors)`` of the last lookup in ``cache`` among the observed ones (an op may ask
    :func:`~kernels._common.launch.replayed` and then :func:`~kernels._common.launch.launch_or_replay` for one
    signature), or None when the op did not look one up there."""
    for seen_cache, signature, tensors in reversed(seen):
        if seen_cache is cache:
            return seen_cache.get(signature), tensors
    return None


class Refs:
    """Builds a stage's tensor list for the extension: each tensor of a recorded call's tensors tuple named by
    where it comes from (an input, an allocation, a held tensor, an output's gradient, a saved tensor, nothing)."""

    def __init__(self, native):
        self.native = native
        self.allocs: list[tuple[list[int], list[int], torch.dtype]] = []
        self.fixed: list[torch.Tensor] = []
        self.copies: list[tuple] = []

    def none(self) -> tuple[int, int]:
        return self.native.NONE, 0

    def of(self, kind: str, index: int) -> tuple[int, int]:
        return getattr(self.native, kind), index

    def alloc(self, sizes: Sequence[int], dtype: torch.dtype, strides: Sequence[int] | None = None) -> tuple[int, int]:
        """A tensor the stage allocates: contiguous, or with ``strides``."""
        self.allocs.append(layout(sizes, dtype, strides))
        return self.native.ALLOC, len(self.allocs) - 1

    def like(self, t: torch.Tensor) -> tuple[int, int]:
        """A tensor the stage allocates with ``t``'s sizes, strides (all of them: a recorded launch may hold the
        stride of a dim of size 1) and dtype."""
        return self.alloc(t.shape, t.dtype, t.stride())

    def copy(self, source: tuple[int, int], like: torch.Tensor) -> tuple[int, int]:
        """A tensor made after the stage's launches: ``source`` narrowed to ``like``'s last size and copied into a
        tensor of ``like``'s sizes, strides and dtype."""
        self.copies.append((layout(like.shape, like.dtype, like.stride()), *source))
        return self.native.COPY, len(self.copies) - 1

    def hold(self, tensor: torch.Tensor) -> tuple[int, int]:
        self.fixed.append(tensor)
        return self.native.FIXED, len(self.fixed) - 1

    @staticmethod
    def flat(refs: Sequence[tuple[int, int]]) -> list[int]:
        return [i for ref in refs for i in ref]


def layout(sizes: Sequence[int], dtype: torch.dtype, strides: Sequence[int] | None = None) -> tuple:
    """The extension's description of a tensor to make: sizes, strides (empty: contiguous), dtype."""
    return list(sizes), [] if strides is None else list(strides), dtype


#: a gradient the backward does not read (an output that is not differentiated)
UNREAD = ([-1], [], torch.float32)
