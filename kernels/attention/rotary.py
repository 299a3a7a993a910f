"""Launcher of the rotary position embedding: ``apply_rotary`` (kernel: ``kernels/attention/_rotary.py``).

Eager CUDA calls (and CPU calls under the Triton interpreter) run the kernel, one launch per tensor, backward too (an
autograd function that saves only the tables). float64 calls and CPU calls without the interpreter run the twin
``reference.attention.apply_rotary``; under torch.compile the twin's arithmetic is traced, which inductor fuses into
one kernel of its own.
"""

from __future__ import annotations

import torch

import reference.attention as twin
from kernels._common import (
    backend_for,
    cdiv,
    check_float_dtype,
    check_same_device,
    check_tensor,
    interpreter_needs_fp32,
    kernel_for,
)
from kernels.attention._rotary import _rotary_kernel

#: positions per program
_BLOCK_S = 16


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, name: str) -> None:
    check_tensor(name, x)
    check_float_dtype(name, x)
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {list(x.shape)}")
    b, _, s, d = x.shape
    if d % 2:
        raise ValueError(f"the head dim must be even for a rotary embedding, got {d}")
    if cos.shape[0] not in (1, b) or cos.shape[1:] != (s, d):
        raise ValueError(f"cos and sin must be (batch or 1, seq, head_dim) = ({b} or 1, {s}, {d}) for {name} of shape "
                         f"{list(x.shape)}, got {list(cos.shape)}")


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    if interpreter_needs_fp32(x):  # the interpreter rounds bf16 stores toward zero: fp32, rounded once here
        return _launch(x.float(), cos.float(), sin.float(), backward).to(x.dtype)
    out = torch.empty_like(x)
    b, h, s, d = x.shape
    if out.numel() == 0:
        return out
    half = d // 2
    if sin.stride() != cos.stride():  # the kernel takes one set of table strides
        cos, sin = cos.contiguous(), sin.contiguous()
    stride_cb = cos.stride(0) if cos.shape[0] == b and b > 1 else 0
    kernel_for(_rotary_kernel, traceable=False)[(cdiv(s, _BLOCK_S), b * h)](
        x, cos, sin, out, *x.stride(), stride_cb, cos.stride(1), cos.stride(2), *out.stride(), h, s, half,
        BACKWARD=backward, BLOCK_S=_BLOCK_S, BLOCK_HALF=max(16, 1 << (half - 1).bit_length()), num_warps=4,
    )
    return out


class _RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(q, cos, sin, False), _launch(k, cos, sin, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return (None if dq is None else _launch(dq, cos, sin, True),
                None if dk is None else _launch(dk, cos, sin, True), None, None)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary position embedding of queries and keys, ``(q_rotated, k_rotated)``: q (B, Hq, S, D) and k (B, Hkv, S, D)
    in any strides, ``cos``/``sin`` (B or 1, S, D), the tables of each token's position (transformers' rotary
    embedding output). Each half-pair ``(x1, x2)`` of a row becomes ``(x1 c1 - x2 s1, x2 c2 + x1 s2)``: transformers'
    ``x * cos + rotate_half(x) * sin``, computed in fp32 and rounded once. Differentiable in q and k (the tables
    are constants: a call whose tables require grad runs the twin's arithmetic, differentiable in them too). The
    outputs keep q's and k's layouts where they are permutations of dense tensors. fp16, bf16, fp32; float64 through
    the twin."""
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t)
        check_float_dtype(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (batch or 1, seq, head_dim), got shape {list(t.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {list(cos.shape)} and {list(sin.shape)}")
    _check(q, cos, sin, "q")
    _check(k, cos, sin, "k")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    check_same_device(q=q, k=k, cos=cos, sin=sin)
    if (torch.compiler.is_compiling() or backend_for(q, k, cos, sin) == "reference"
            or (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))):
        return twin.apply_rotary(q, cos, sin), twin.apply_rotary(k, cos, sin)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _RotaryFunction.apply(q, k, cos, sin)
    return _launch(q, cos, sin, False), _launch(k, cos, sin, False)
