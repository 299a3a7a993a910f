"""Launchers, registered ops and autograd for FlashAttention-2.

Eager calls run ``_FlashAttentionFunction``; under torch.compile ``flash_attention`` calls the
registered ops ``fused_kernels::flash_attn_fwd`` / ``flash_attn_bwd``, which share the implementation.
CPU tensors without the Triton interpreter run the twin ``reference.attention``.

Launch configurations come from tables by head dim and dtype (``_CONFIGS`` and below), chosen by
``scripts/sweep_attention.py`` on the H200; the README records the sweep.
"""

from __future__ import annotations

import math

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

# Launch configurations: (BLOCK_M, BLOCK_N, num_warps, num_stages) by padded head dim, for 16-bit inputs
# and for fp32 (twice the bytes per tile, IEEE dots). BLOCK_M is the query block and BLOCK_N the key
# block in every kernel. See the README's performance notes for how these were chosen.
_CONFIGS = {
    "fwd": {16: (64, 64, 4, 3), 32: (64, 64, 4, 3), 64: (64, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 4, 2)},
    "dkdv": {16: (32, 128, 4, 3), 32: (32, 128, 4, 3), 64: (32, 128, 4, 3), 128: (64, 128, 8, 2), 256: (32, 32, 4, 2)},
    "dq": {16: (128, 64, 8, 3), 32: (128, 64, 8, 3), 64: (128, 64, 8, 3), 128: (128, 64, 8, 3), 256: (32, 32, 4, 2)},
}
_FP32_CONFIG = {16: (64, 32, 4, 2), 32: (64, 32, 4, 2), 64: (64, 32, 4, 2), 128: (32, 32, 4, 2), 256: (32, 16, 4, 1)}
# Head dims above 256 (up to 1024): small blocks so that the tiles fit in shared memory.
_WIDE_CONFIGS = {"fwd": (32, 64, 8, 1), "dkdv": (16, 16, 8, 2), "dq": (16, 32, 8, 1)}
_WIDE_FP32_CONFIG = (16, 16, 8, 1)
# fp32 backward tiles above this padded head dim do not fit in shared memory even at 16 x 16 (measured on
# the H200: 256 KiB asked for D = 1024); that backward runs the tiled twin on the GPU instead (correct, slow).
_FP32_MAX_KERNEL_BWD_DIM = 512


def _block_d(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _config(kernel: str, d: int, dtype: torch.dtype) -> dict:
    """Launch parameters of ``kernel`` ("fwd", "dkdv" or "dq") for head dim ``d``."""
    block_d = _block_d(d)
    if block_d > 256:
        block_m, block_n, warps, stages = _WIDE_FP32_CONFIG if dtype == torch.float32 else _WIDE_CONFIGS[kernel]
    elif dtype == torch.float32:
        block_m, block_n, warps, stages = _FP32_CONFIG[block_d]
    else:
        block_m, block_n, warps, stages = _CONFIGS[kernel][block_d]
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d, "EVEN_D": d == block_d,
            "num_warps": warps, "num_stages": stages}


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch_fwd(q, k, v, o, lse, causal: bool, scale: float, cfg: dict, *, traceable=False):
    b, hq, sq, d = q.shape
    grid = (cdiv(sq, cfg["BLOCK_M"]), b * hq)
    kernel_for(_attn_fwd_kernel, traceable=traceable)[grid](
        q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        hq, hq // k.shape[1], sq, k.shape[2], d, scale * 1.4426950408889634,
        CAUSAL=causal, DOT_PRECISION=_precision(q.dtype), **cfg,
    )


def _launch_bwd_preprocess(o, do, delta, *, traceable=False):
    b, hq, sq, d = o.shape
    block_d = _block_d(d)
    block_m = max(16, min(128, 8192 // block_d))
    kernel_for(_attn_bwd_preprocess_kernel, traceable=traceable)[(cdiv(sq, block_m), b * hq)](
        o, do, delta, *o.stride(), *do.stride(), hq, sq, d, BLOCK_M=block_m, BLOCK_D=block_d, EVEN_D=d == block_d,
    )


def _launch_bwd_dkdv(do, q, k, v, lse, delta, dk, dv, causal: bool, scale: float, cfg: dict, *, traceable=False):
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    kernel_for(_attn_bwd_dkdv_kernel, traceable=traceable)[(cdiv(sk, cfg["BLOCK_N"]), b * hkv)](
        q, k, v, do, lse, delta, dk, dv, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        hq, hkv, hq // hkv, sq, sk, d, scale, CAUSAL=causal, DOT_PRECISION=_precision(q.dtype), **cfg,
    )


def _launch_bwd_dq(do, q, k, v, lse, delta, dq, causal: bool, scale: float, cfg: dict, *, traceable=False):
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    kernel_for(_attn_bwd_dq_kernel, traceable=traceable)[(cdiv(sq, cfg["BLOCK_M"]), b * hq)](
        q, k, v, do, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        hq, hq // hkv, sq, sk, d, scale, CAUSAL=causal, DOT_PRECISION=_precision(q.dtype), **cfg,
    )


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
    _launch_fwd(q, k, v, o, lse, causal, scale, _config("fwd", d, q.dtype), traceable=traceable)
    return o, lse


def _bwd_impl(do, q, k, v, o, lse, causal: bool, scale: float, *, traceable=False):
    if backend_for(q) == "reference" or (q.dtype == torch.float32 and _block_d(q.shape[3]) > _FP32_MAX_KERNEL_BWD_DIM):
        return twin.flash_attention_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=scale)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if nothing_to_launch(q) or sk == 0:
        return (torch.zeros((b, hq, sq, d), device=q.device, dtype=q.dtype),
                torch.zeros((b, hkv, sk, d), device=q.device, dtype=k.dtype),
                torch.zeros((b, hkv, sk, d), device=q.device, dtype=v.dtype))
    dq = torch.empty((b, hq, sq, d), device=q.device, dtype=q.dtype)
    dk = torch.empty((b, hkv, sk, d), device=q.device, dtype=k.dtype)
    dv = torch.empty((b, hkv, sk, d), device=q.device, dtype=v.dtype)
    delta = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
    _launch_bwd_preprocess(o, do, delta, traceable=traceable)
    _launch_bwd_dkdv(do, q, k, v, lse, delta, dk, dv, causal, scale, _config("dkdv", d, q.dtype),
                     traceable=traceable)
    _launch_bwd_dq(do, q, k, v, lse, delta, dq, causal, scale, _config("dq", d, q.dtype), traceable=traceable)
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
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    if torch.compiler.is_compiling():
        o, lse = torch.ops.fused_kernels.flash_attn_fwd(q, k, v, bool(causal), scale)
    else:
        o, lse = _FlashAttentionFunction.apply(q, k, v, bool(causal), scale)
    return (o, lse) if return_lse else o


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
    """Packed variable-length batches: not implemented yet (the attention-extras issue)."""
    raise NotImplementedError("flash_attention_varlen comes with the attention-extras issue")
