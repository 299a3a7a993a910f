"""Launchers, registered ops and autograd for FlashAttention-2.

Eager calls run ``_FlashAttentionFunction``; under torch.compile ``flash_attention`` calls the
registered ops ``fused_kernels::flash_attn_fwd`` / ``flash_attn_bwd``, which share the implementation.
CPU tensors without the Triton interpreter run the twin ``reference.attention``.

**Not yet verified on a GPU.** These kernels pass the interpreter tests against the twin, but no GPU run
has compiled or timed them yet, so CUDA tensors are refused unless ``FUSED_KERNELS_ALLOW_UNVERIFIED=1``
is set (the CUDA test mode sets it). The session that verifies them on the GPU removes this guard.
"""

from __future__ import annotations

import math
import os

import torch
from torch.library import triton_op

import reference.attention as twin
from kernels._common import (
    backend_for,
    cdiv,
    check_float_dtype,
    check_same_device,
    check_tensor,
    kernel_for,
    nothing_to_launch,
)
from kernels.attention._kernels import (
    _attn_bwd_dkdv_kernel,
    _attn_bwd_dq_kernel,
    _attn_bwd_preprocess_kernel,
    _attn_fwd_kernel,
)

_MAX_HEAD_DIM = 1024


def _blocks(d: int) -> dict:
    block_d = max(16, 1 << (d - 1).bit_length())
    if block_d <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": block_d, "num_warps": 4}
    if block_d <= 256:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_D": block_d, "num_warps": 8}
    return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_D": block_d, "num_warps": 8}  # the slow, correct path


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _fwd_impl(q, k, v, causal: bool, scale: float, *, traceable=False):
    b, hq, sq, d = q.shape
    if backend_for(q) == "reference":
        o, lse = twin.flash_attention_forward(q, k, v, causal=causal, softmax_scale=scale)
        return o, lse.float()
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
    if nothing_to_launch(q) or k.shape[2] == 0:
        o.zero_()
        lse.fill_(float("-inf"))
        return o, lse
    cfg = _blocks(d)
    grid = (cdiv(sq, cfg["BLOCK_M"]), b * hq)
    kernel_for(_attn_fwd_kernel, traceable=traceable)[grid](
        q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        hq, hq // k.shape[1], sq, k.shape[2], d, scale * 1.4426950408889634,
        CAUSAL=causal, DOT_PRECISION=_precision(q.dtype), **cfg,
    )
    return o, lse


def _bwd_impl(do, q, k, v, o, lse, causal: bool, scale: float, *, traceable=False):
    if backend_for(q) == "reference":
        return twin.flash_attention_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=scale)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    dq = torch.zeros((b, hq, sq, d), device=q.device, dtype=q.dtype)
    dk = torch.zeros((b, hkv, sk, d), device=q.device, dtype=k.dtype)
    dv = torch.zeros((b, hkv, sk, d), device=q.device, dtype=v.dtype)
    if nothing_to_launch(q) or sk == 0:
        return dq, dk, dv
    cfg = _blocks(d)
    delta = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
    kernel_for(_attn_bwd_preprocess_kernel, traceable=traceable)[(cdiv(sq, cfg["BLOCK_M"]), b * hq)](
        o, do, delta, *o.stride(), *do.stride(), hq, sq, d, BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"],
    )
    common = dict(CAUSAL=causal, DOT_PRECISION=_precision(q.dtype), **cfg)
    kernel_for(_attn_bwd_dkdv_kernel, traceable=traceable)[(cdiv(sk, cfg["BLOCK_N"]), b * hkv)](
        q, k, v, do, lse, delta, dk, dv, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        hq, hkv, hq // hkv, sq, sk, d, scale, **common,
    )
    kernel_for(_attn_bwd_dq_kernel, traceable=traceable)[(cdiv(sq, cfg["BLOCK_M"]), b * hq)](
        q, k, v, do, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        hq, hq // hkv, sq, sk, d, scale, **common,
    )
    return dq, dk, dv


class _FlashAttentionFunction(torch.autograd.Function):
    """Eager autograd: saves q, k, v, o and the fp32 log-sum-exp (O(B·H·S) extra memory)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = _fwd_impl(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _bwd_impl(do, q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


@triton_op("fused_kernels::flash_attn_fwd", mutates_args=())
def flash_attn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Registered forward: ``(o, lse)``."""
    return _fwd_impl(q, k, v, causal, scale, traceable=True)


@triton_op("fused_kernels::flash_attn_bwd", mutates_args=())
def flash_attn_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Registered backward: ``(dq, dk, dv)``."""
    return _bwd_impl(do, q, k, v, o, lse, causal, scale, traceable=True)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.fused_kernels.flash_attn_bwd(do.contiguous(), q, k, v, o, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


flash_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _validate(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {list(t.shape)}")
        check_float_dtype(name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_same_device(q=q, k=k, v=v)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[3]} and {k.shape[3]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"the number of query heads ({q.shape[1]}) must be a multiple of the number of "
                         f"key/value heads ({k.shape[1]})")
    if not 1 <= q.shape[3] <= _MAX_HEAD_DIM:
        raise ValueError(f"head dim must be between 1 and {_MAX_HEAD_DIM}, got {q.shape[3]}")


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, dropout_p=0.0, seed=None, window_size=(-1, -1),
                    return_lse=False, deterministic=False):
    """FlashAttention-2: ``softmax(q kᵀ · scale) v`` without materialising the scores.

    q ``(B, Hq, Sq, D)``, k/v ``(B, Hkv, Sk, D)`` with ``Hq % Hkv == 0`` (GQA/MQA), any strides, fp16/bf16/fp32.
    ``causal`` aligns bottom-right (query i sees keys ``j <= i + Sk - Sq``); a query that sees no key
    gets zeros and a log-sum-exp of -inf. ``return_lse`` adds the natural-log log-sum-exp (B, Hq, Sq) fp32.
    The backward is deterministic in every mode (``deterministic`` is accepted for API compatibility).
    """
    _validate(q, k, v)
    if dropout_p != 0.0:
        raise NotImplementedError("dropout_p > 0 inside attention comes with the attention-extras issue")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError("window_size comes with the attention-extras issue")
    if q.device.type == "cuda" and os.environ.get("FUSED_KERNELS_ALLOW_UNVERIFIED") != "1":
        raise NotImplementedError(
            "kernels.attention has passed its interpreter tests but has not been verified on a GPU yet; "
            "set FUSED_KERNELS_ALLOW_UNVERIFIED=1 to run it anyway"
        )
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    if torch.compiler.is_compiling():
        o, lse = torch.ops.fused_kernels.flash_attn_fwd(q, k, v, bool(causal), scale)
    else:
        o, lse = _FlashAttentionFunction.apply(q, k, v, bool(causal), scale)
    return (o, lse) if return_lse else o


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
    """Packed variable-length batches: not implemented yet (the attention-extras issue)."""
    raise NotImplementedError("flash_attention_varlen comes with the attention-extras issue")
