"""Launch mechanics shared by every family's ops.

Each family exposes two paths to the same implementation: eager calls (a ``torch.autograd.Function``
that launches kernels directly) and the registered ``torch.library.triton_op``s that torch.compile
traces. Measured on the GPU machine (dropout README): in eager mode ``wrap_triton`` sends each launch
through a higher-order op costing ~300 us of host time, and ``triton.cdiv`` (itself a jit function)
~9 us, so launchers use :func:`kernel_for` and :func:`cdiv` from here.
"""

from __future__ import annotations

import functools

import torch
from torch.library import wrap_triton

from kernels._common.runtime import INTERPRETER, is_fake


def kernel_for(kernel, *, traceable: bool):
    """The kernel itself for eager launches; ``wrap_triton(kernel)`` inside a registered op."""
    return wrap_triton(kernel) if traceable else kernel


def cdiv(a: int, b: int) -> int:
    """Ceiling division of Python ints (not ``triton.cdiv``: see the module docstring)."""
    return -(-a // b)


def nothing_to_launch(t: torch.Tensor) -> bool:
    """True for empty tensors, and for fakes under the interpreter (an interpreted kernel would read their
    missing data; compiled kernels see fakes through ``wrap_triton``, which records the launch)."""
    return t.numel() == 0 or (INTERPRETER and is_fake(t))


@functools.cache
def multiprocessor_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (4 under the interpreter: programs run one by one)."""
    if INTERPRETER or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def unused_pointer(like: torch.Tensor) -> torch.Tensor:
    """A one-element tensor to pass for a pointer that a compile-time branch never touches.

    Never pass another argument of the same launch instead: inside torch.compile a Triton launch is
    functionalized by cloning each argument the kernel may write, one clone per argument, and the
    caller's tensor is replaced by the clones in argument order. Two arguments sharing storage then leave
    the caller with whichever clone came last, possibly the unwritten one (torch's own note on this is in
    ``torch/_higher_order_ops/triton_kernel_wrap.py``, "if two kernel inputs are views of each other")."""
    return torch.empty(1, device=like.device, dtype=torch.int32)
