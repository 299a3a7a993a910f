"""Where a kernel runs: the Triton interpreter switch, the device dispatch rule and the kernel-path switches.

The rule: CUDA tensors run the Triton kernels; CPU tensors run the Triton kernels under the
Triton interpreter when ``TRITON_INTERPRET=1`` was set before the kernels were imported, and otherwise run
the pure-PyTorch twin from ``reference/``; float64 runs the twin on every device (the kernels compute in fp32;
the twin computes float64 exactly, as torch's own ops do); any other device is an error.

The interpreter keeps bfloat16 as raw 16-bit integers (numpy has no bfloat16): its ``tl.dot`` multiplies those
bit patterns, and its stores round fp32 to bf16 toward zero where a GPU rounds to nearest even. Launchers whose
kernels take ``tl.dot`` over loaded tiles (attention), or whose results are compared bit for bit with the twin's
(dropout), run bf16 calls there in fp32 and round the outputs once with torch (:func:`interpreter_needs_fp32`),
which is what the GPU kernels' fp32 accumulators do; the norms' bf16 outputs under the interpreter can be one unit
in the last place from a GPU's.

Families with Hopper-only (Gluon) kernels beside their portable ones read a path switch from an environment
variable of their own (:func:`kernel_path`): ``auto`` (the family's measured rule), ``hopper`` (every call the
Hopper kernels support) or ``portable`` (never).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping
from typing import Literal

import torch
from torch._subclasses.fake_tensor import is_fake as _torch_is_fake

_TRUE_WORDS = frozenset({"1", "true", "yes", "on", "y"})


def interpreter_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the interpreter (parsed the way Triton parses it)."""
    env = os.environ if environ is None else environ
    return env.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE_WORDS


# Triton decides at decoration time whether ``@triton.jit`` makes a compiled or an interpreted function,
# so the answer that matters is the one in force when this package (and the kernels) were imported.
INTERPRETER: bool = interpreter_requested()

Backend = Literal["triton", "reference"]


# What CPU tensors run; changed only inside ``cpu_runs_reference``.
_cpu_backend: Backend = "triton" if INTERPRETER else "reference"


def backend_for(x: torch.Tensor, *others: torch.Tensor | torch.dtype | None, traced: bool = False) -> Backend:
    """Which implementation runs for a tensor on ``x.device`` (see the module docstring): the twin when ``x`` or any
    of ``others`` (tensors, dtypes or None) is float64, and for a call of a registered op (``traced``) on CPU fake
    tensors, i.e. while torch.compile traces it: a Triton kernel traced into a compiled graph does not run under the
    interpreter there (inductor hands it its own CPU buffers, and the interpreter computed NaN and numbers of 1e30
    from them), so compiled CPU calls run the twin, as opaque ops (``kernels._common.opaque``)."""
    kind = x.device.type
    if traced and kind == "cpu" and is_fake(x):
        return "reference"
    if x.dtype == torch.float64 or (others and any(_is_float64(o) for o in others)):
        if kind not in ("cuda", "cpu"):
            _unsupported_device(x)
        return "reference"
    if kind == "cuda":
        return "triton"
    if kind == "cpu":
        return _cpu_backend
    _unsupported_device(x)


def _is_float64(value) -> bool:
    return value is torch.float64 or (isinstance(value, torch.Tensor) and value.dtype == torch.float64)


def interpreter_needs_fp32(t: torch.Tensor) -> bool:
    """Whether a call on ``t`` (whose backend is ``triton``) runs its kernels in fp32 and rounds once with torch:
    bfloat16 under the Triton interpreter (see the module docstring)."""
    return INTERPRETER and t.dtype == torch.bfloat16 and t.device.type == "cpu"


def _unsupported_device(x: torch.Tensor):
    raise ValueError(
        f"fused-kernels runs on CUDA tensors (or CPU tensors through the Triton interpreter or the "
        f"reference twin); got a tensor on device {x.device}"
    )


@contextlib.contextmanager
def cpu_runs_reference() -> Iterator[None]:
    """Inside this block CPU tensors run the reference twin even when the interpreter is on: the path a
    CPU user without ``TRITON_INTERPRET`` takes, so one test process can check both CPU paths."""
    global _cpu_backend
    saved, _cpu_backend = _cpu_backend, "reference"
    try:
        yield
    finally:
        _cpu_backend = saved


def is_fake(t: torch.Tensor) -> bool:
    """True for FakeTensors and meta tensors: shape propagation (torch.compile, opcheck), nothing to run.

    Compiled Triton kernels see fakes through ``wrap_triton``; interpreted ones would try to read their
    (missing) data, so launchers ask this first.
    """
    return t.device.type == "meta" or _torch_is_fake(t)


#: the values of a family's kernel-path switch (:func:`kernel_path`)
KERNEL_PATHS = ("auto", "hopper", "portable")

#: what ``os.environ`` reads and writes on POSIX (bytes names and values); elsewhere None
_ENVIRON_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENCODED_NAMES: dict[str, bytes] = {}


def kernel_path_token(env: str):
    """The raw value of kernel-path switch ``env`` (None when unset), for cache keys: an eager call's plan key holds it,
    because the compiled tier keeps one program per plan and a program holds one path's launches. Read in tens of
    nanoseconds where :func:`kernel_path` takes about a microsecond when the variable is unset (``os.environ.get``
    raises and catches a KeyError), which every eager call would pay."""
    if _ENVIRON_DATA is None:
        return os.environ.get(env)
    name = _ENCODED_NAMES.get(env)
    if name is None:
        name = _ENCODED_NAMES[env] = os.fsencode(env)
    return _ENVIRON_DATA.get(name)


def kernel_path(env: str) -> str:
    """The kernel path that environment variable ``env`` asks for now (``auto`` when unset); read at each call,
    so a test or a tool can set it with :func:`forced_kernel_path`."""
    chosen = os.environ.get(env, "auto")
    if chosen not in KERNEL_PATHS:
        raise ValueError(f"{env}={chosen!r}: expected one of {KERNEL_PATHS}")
    return chosen


@contextlib.contextmanager
def forced_kernel_path(env: str, name: str) -> Iterator[None]:
    """Inside the block, ``env`` asks for kernel path ``name`` (one of :data:`KERNEL_PATHS`)."""
    if name not in KERNEL_PATHS:
        raise ValueError(f"path {name!r}: expected one of {KERNEL_PATHS}")
    saved = os.environ.get(env)
    os.environ[env] = name
    try:
        yield
    finally:
        if saved is None:
            del os.environ[env]
        else:
            os.environ[env] = saved


@functools.cache
def is_hopper(device: torch.device) -> bool:
    """Whether ``device`` is an sm_90 GPU (H100, H200, H800, GH200)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
