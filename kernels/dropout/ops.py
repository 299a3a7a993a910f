"""Launcher, registered ops and autograd for seeded dropout.

Eager calls run ``_DropoutFunction`` (a plain ``torch.autograd.Function``); under torch.compile the
public function calls the registered ops, which share the same implementation. Ops
(``torch.ops.fused_kernels``):

- ``dropout(x, p, seed, seed_tensor=None) -> Tensor``: out-of-place, differentiable; its backward is the
  same op on the incoming gradient with the same ``(p, seed)`` (the mask is regenerated, nothing is saved
  but the seed). ``seed_tensor``, a 0-d int64 tensor on the device, replaces ``seed`` when given: the
  seed of a ``seed=None`` call under torch.compile (see ``kernels._common.seed``).
- ``dropout_(x, p, seed, seed_tensor=None) -> ()``: in place, for tensors that need no gradient.

Both are ``torch.library.triton_op``s, so torch.compile sees the Triton kernel. On CPU tensors without
the Triton interpreter they run the twin ``reference.dropout`` (bit-identical).

Launch rule: one program per ``4 * LANE_STRIDE * CHUNKS`` elements, CHUNKS and the warps from
``kernels.dropout.configs``.
"""

from __future__ import annotations

import torch
from torch.library import triton_op

import reference.dropout as twin
from kernels._common import (
    FLOAT_DTYPES,
    LIBRARY_NAMESPACE,
    backend_for,
    cdiv,
    check_float_dtype,
    check_probability,
    check_seed,
    check_tensor,
    kernel_for,
    nothing_to_launch,
)
from kernels._common.seed import (
    Seed,
    dropout_scalars,
    op_seed_args,
    seed_for_call,
    seed_from_op_args,
    seed_pointer,
    seed_value,
)
from kernels.dropout import configs
from kernels.dropout._kernels import _dropout_fwd_kernel
from reference.dropout import LANE_STRIDE

_CHUNK = 4 * LANE_STRIDE  # elements per Philox call group: four runs of LANE_STRIDE


def _launch(src: torch.Tensor, out: torch.Tensor, scalars: tuple, *, traceable: bool) -> None:
    """Run the kernel over contiguous ``src`` into contiguous ``out`` (which may be ``src``).

    ``traceable`` (inside the registered ops) launches through ``wrap_triton`` so torch.compile can trace
    the kernel; eager calls launch it directly (see ``kernels._common.launch``).
    """
    if nothing_to_launch(src):
        return
    n = src.numel()
    chunks, num_warps = configs.CHUNKS_PER_PROGRAM, configs.NUM_WARPS
    grid = (cdiv(n, _CHUNK * chunks),)
    seed_lo, seed_hi, seed_tensor, threshold, scale = scalars
    seed_ptr, seed_in_memory = seed_pointer(seed_tensor, src, traceable)
    kernel_for(_dropout_fwd_kernel, traceable=traceable)[grid](
        src, out, n, seed_lo, seed_hi, seed_ptr, seed_in_memory, threshold, scale, CHUNKS=chunks,
        num_warps=num_warps,
    )


def _dropout_impl(x: torch.Tensor, p: float, seed: Seed, *, traceable: bool = False,
                  scalars: tuple | None = None) -> torch.Tensor:
    """Seeded dropout for ``0 < p < 1`` and a 64-bit unsigned ``seed`` (or a device seed): the one
    implementation behind the eager path and the registered op (``scalars``: ``dropout_scalars(p, seed)``
    when already known)."""
    if backend_for(x) == "reference":
        return twin.dropout(x, p, seed=seed_value(seed))
    src = x.contiguous()
    out = torch.empty_like(src)
    _launch(src, out, scalars or dropout_scalars(p, seed), traceable=traceable)
    return out


class _DropoutFunction(torch.autograd.Function):
    """Eager autograd: the backward is the same dropout on the gradient, from the saved seed alone.

    Eager calls take this path rather than the registered op because the dispatcher's Python custom-op
    path costs tens of microseconds per call, as much as the kernel itself at 2**24 elements (see the
    family README); torch.compile traces the registered op instead.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, seed: Seed) -> torch.Tensor:
        ctx.p, ctx.seed, ctx.scalars = p, seed, dropout_scalars(p, seed)
        return _dropout_impl(x, p, seed, scalars=ctx.scalars)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return _dropout_impl(grad_out, ctx.p, ctx.seed, scalars=ctx.scalars), None, None


@triton_op(f"{LIBRARY_NAMESPACE}::dropout", mutates_args=())
def dropout_op(x: torch.Tensor, p: float, seed: int, seed_tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Registered op: seeded dropout for ``0 < p < 1``; ``seed`` is the 64-bit seed as a signed int64, or
    ``seed_tensor`` (a 0-d int64 device tensor, read by the kernel) when given."""
    return _dropout_impl(x, p, seed_from_op_args(seed, seed_tensor), traceable=True)


def _setup_context(ctx, inputs, output):
    _, ctx.p, ctx.seed, seed_tensor = inputs
    ctx.save_for_backward(seed_tensor)


def _backward(ctx, grad_out):
    (seed_tensor,) = ctx.saved_tensors
    return torch.ops.fused_kernels.dropout(grad_out, ctx.p, ctx.seed, seed_tensor), None, None, None


dropout_op.register_autograd(_backward, setup_context=_setup_context)


def _dropout_inplace_impl(x: torch.Tensor, p: float, seed: Seed, *, traceable: bool = False) -> None:
    if backend_for(x) == "reference" or not x.is_contiguous():
        x.copy_(_dropout_impl(x, p, seed, traceable=traceable))
    else:
        _launch(x, x, dropout_scalars(p, seed), traceable=traceable)


@triton_op(f"{LIBRARY_NAMESPACE}::dropout_", mutates_args={"x"})
def dropout_inplace_op(x: torch.Tensor, p: float, seed: int, seed_tensor: torch.Tensor | None = None) -> None:
    """Registered op: in-place seeded dropout for ``0 < p < 1`` on a tensor that needs no gradient."""
    _dropout_inplace_impl(x, p, seed_from_op_args(seed, seed_tensor), traceable=True)


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, *, seed: int | None = None,
            inplace: bool = False) -> torch.Tensor:
    """Dropout whose mask is a pure function of ``(seed, element index)`` and is never stored.

    Args:
        x: fp16, bf16 or fp32 tensor of any shape and strides (CUDA; CPU runs the interpreter or the twin).
        p: probability of zeroing an element, in ``[0, 1]``. Kept elements are scaled by ``1 / (1 - p)``.
        training: when False, ``x`` is returned unchanged (as ``torch.nn.functional.dropout``).
        seed: 64-bit seed. ``None`` draws one from torch's generator for ``x.device``, so
            ``torch.manual_seed`` governs it and two calls differ; under torch.compile and inside a CUDA
            graph it is drawn on the device, so every compiled call and every graph replay gets a new mask.
            The same ``(seed, p, shape)`` gives the same mask; element ``i`` (row-major in the logical
            shape) is decided by Philox word ``i``.
        inplace: write the result into ``x`` (returns ``x``).

    Returns ``x`` itself when ``p == 0`` or ``training`` is False; ``x * 0`` when ``p == 1`` (zeros, with
    NaN where ``x`` is NaN or infinite, as torch). A dropped element is ``x * 0`` too, so a NaN or Inf in
    ``x`` comes out as NaN wherever it is, as from ``torch.nn.functional.dropout``. The backward
    regenerates the mask from the seed: 0 bytes per element are saved.
    """
    check_tensor("x", x)
    check_float_dtype("x", x, FLOAT_DTYPES)
    p = check_probability("p", p, allow_one=True)
    seed = check_seed("seed", seed)
    if not training or p == 0.0:
        return x
    if p == 1.0:
        # x * 0, as torch: zeros, except that NaN and +-Inf become NaN (a bad value is never hidden)
        return x.mul_(0.0) if inplace else x * 0.0
    backend_for(x)  # a clear error for unsupported devices before any seed is drawn
    seed = seed_for_call(seed, x.device)
    needs_grad = x.requires_grad and torch.is_grad_enabled()
    if torch.compiler.is_compiling():
        op_seed = op_seed_args(seed)
        if inplace and not needs_grad:
            torch.ops.fused_kernels.dropout_(x, p, *op_seed)
            return x
        out = torch.ops.fused_kernels.dropout(x, p, *op_seed)
    elif inplace and not needs_grad:
        _dropout_inplace_impl(x, p, seed)
        return x
    else:
        out = _DropoutFunction.apply(x, p, seed) if needs_grad else _dropout_impl(x, p, seed)
    return x.copy_(out) if inplace else out
