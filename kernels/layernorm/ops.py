"""Launchers, registered ops and autograd for LayerNorm / RMSNorm.

Eager calls run ``_NormFunction`` (a ``torch.autograd.Function`` launching the kernels directly); under
torch.compile the public functions call the registered ops, which share the implementation:

- ``fused_kernels::norm_fwd(x, weight?, bias?, eps, is_rms, deterministic) -> (y, mean, rstd)``
- ``fused_kernels::norm_bwd(dy, x, weight?, mean, rstd, is_rms, need_db, deterministic) -> (dx, dw, db)``

``x`` is the input viewed as ``(M, N)`` rows. On CPU tensors without the Triton interpreter the twin
``reference.layernorm`` runs.

Launch rules (why in the family README):
- forward: rows up to ``_MAX_FUSED_FWD`` elements stay in registers, several rows per program when N
  is small (about 4096 elements per tile); wider rows are processed in chunks of ``_CHUNK``.
- backward, rows up to ``_MAX_FUSED_BWD``: tiles of ~4096 elements, ``programs = min(row tiles, 4 * SMs)``,
  each owning a contiguous range of rows and making one locked add of its partial dW/dB;
  ``GROUP_SIZE_M = min(programs, 64)`` buffers in lock mode (about eight programs per lock, each adding
  once: short waits, and a final sum over 64 rows of N); one buffer per program with
  ``deterministic=True`` (no waiting, a larger final sum).
- backward, wider rows: a row-terms kernel, then programs over (1024-column block, row group) with about
  ``4 * SMs`` programs in all; lock-free and deterministic.
"""

from __future__ import annotations

import math

import torch
from torch.library import triton_op

import reference.layernorm as twin
from kernels._common import (
    backend_for,
    cdiv,
    check_float_dtype,
    check_same_device,
    check_tensor,
    kernel_for,
    multiprocessor_count,
    nothing_to_launch,
    unused_pointer,
)
from kernels.layernorm._kernels import (
    _layer_norm_bwd_columns_kernel,
    _layer_norm_bwd_dwdb_kernel,
    _layer_norm_bwd_kernel,
    _layer_norm_bwd_row_terms_kernel,
    _layer_norm_fwd_kernel,
)

_MAX_FUSED_FWD = 16384
_MAX_FUSED_BWD = 8192
_CHUNK = 4096
_FWD_TILE = 4096  # elements per forward tile (several rows when N is small)
_FWD_ELEMENTS_PER_THREAD = 16
_BWD_TILE = 4096  # elements per backward tile
_BWD_ELEMENTS_PER_THREAD = 16
_WIDE_COLUMNS = 1024  # column block of the wide backward
_PROGRAMS_PER_SM = 4
_MAX_GROUP_SIZE_M = 64


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _fwd_config(n: int) -> dict:
    if n <= _MAX_FUSED_FWD:
        block_n = _next_pow2(n)
        block_m = max(1, min(64, _FWD_TILE // block_n))
        single = True
    else:
        block_n, block_m, single = _CHUNK, 1, False
    num_warps = max(1, min(32, block_m * block_n // (32 * _FWD_ELEMENTS_PER_THREAD)))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "SINGLE_PASS": single, "num_warps": num_warps}


def _bwd_config(n: int) -> dict:
    """Register path (n <= _MAX_FUSED_BWD): a tile of about _BWD_TILE elements, several rows when n is small."""
    block_n = _next_pow2(n)
    block_m = max(1, min(64, _BWD_TILE // block_n))
    num_warps = max(1, min(16, block_m * block_n // (32 * _BWD_ELEMENTS_PER_THREAD)))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps}


def _rows_2d(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as (M, N) rows with unit column stride (a view when possible)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def _norm_fwd_impl(x, weight, bias, eps, is_rms, *, traceable=False):
    m, n = x.shape
    if backend_for(x) == "reference":
        if is_rms:
            y, rstd = twin.rms_norm_forward(x, weight, eps)
            return y, torch.empty(0, device=x.device, dtype=torch.float32), rstd
        return twin.layer_norm_forward(x, weight, bias, eps)
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    mean = torch.empty(0 if is_rms else m, device=x.device, dtype=torch.float32)
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    if nothing_to_launch(x):
        return y, mean, rstd
    cfg = _fwd_config(n)
    grid = (cdiv(m, cfg["BLOCK_M"]),)
    kernel_for(_layer_norm_fwd_kernel, traceable=traceable)[grid](
        x, y, weight if weight is not None else unused_pointer(x), bias if bias is not None else unused_pointer(x),
        mean, rstd, m, n, x.stride(0), y.stride(0), eps,
        IS_RMS=is_rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, **cfg,
    )
    return y, mean, rstd


def _norm_bwd_impl(dy, x, weight, mean, rstd, is_rms, need_db, deterministic, *, grad_dtypes=None,
                   traceable=False):
    """``(dx, dw, db)``; dW/dB in fp32, or in ``grad_dtypes = (dw dtype, db dtype)`` when given (the final
    sum casts as it stores: no cast launched afterwards)."""
    m, n = x.shape
    need_dw = weight is not None
    dw_dtype, db_dtype = grad_dtypes or (torch.float32, torch.float32)
    if backend_for(x) == "reference":
        if is_rms:
            dx, dw = twin.rms_norm_backward(dy, x, weight, rstd)
            db = None
        else:
            dx, dw, db = twin.layer_norm_backward(dy, x, weight, mean, rstd)
        empty = torch.empty(0, device=x.device)
        return dx, dw.to(dw_dtype) if need_dw else empty, db.to(db_dtype) if need_db else empty
    dx = torch.empty((m, n), device=x.device, dtype=x.dtype)
    alloc = torch.zeros if m == 0 else torch.empty
    dw = alloc(n if need_dw else 0, device=x.device, dtype=dw_dtype)
    db = alloc(n if need_db else 0, device=x.device, dtype=db_dtype)
    if nothing_to_launch(x):
        return dx, dw, db
    sms = multiprocessor_count(x.device.index or 0)
    need_partial = need_dw or need_db
    if n <= _MAX_FUSED_BWD:
        cfg = _bwd_config(n)
        tiles = cdiv(m, cfg["BLOCK_M"])
        programs = min(tiles, _PROGRAMS_PER_SM * sms)
        rows_per_program = cdiv(tiles, programs) * cfg["BLOCK_M"]
        programs = cdiv(m, rows_per_program)
        slots = programs if deterministic else min(programs, _MAX_GROUP_SIZE_M)
        partial = torch.empty((slots, 2, n) if need_partial else (0,), device=x.device, dtype=torch.float32)
        locks = torch.zeros(2 * slots if not deterministic else 1, device=x.device, dtype=torch.int32)
        counts = locks[slots:] if not deterministic else locks
        kernel_for(_layer_norm_bwd_kernel, traceable=traceable)[(programs,)](
            x, dy, dx, weight if need_dw else unused_pointer(x), mean, rstd, partial, locks, counts,
            m, n, x.stride(0), dy.stride(0), dx.stride(0), rows_per_program, slots,
            IS_RMS=is_rms, HAS_WEIGHT=need_dw, NEED_DB=need_db, DETERMINISTIC=deterministic, **cfg,
        )
    else:
        # Wide rows: row terms, then (column block, row group) programs with exclusive buffers.
        c1 = torch.empty(m, device=x.device, dtype=torch.float32)
        c2 = torch.empty(m, device=x.device, dtype=torch.float32)
        kernel_for(_layer_norm_bwd_row_terms_kernel, traceable=traceable)[(m,)](
            x, dy, weight if need_dw else unused_pointer(x), mean, rstd, c1, c2, m, n, x.stride(0),
            dy.stride(0), IS_RMS=is_rms, HAS_WEIGHT=need_dw, BLOCK_M=1, BLOCK_N=_CHUNK, num_warps=8,
        )
        col_blocks = cdiv(n, _WIDE_COLUMNS)
        block_m = max(1, _BWD_TILE // _WIDE_COLUMNS)
        row_groups = max(1, min(cdiv(m, block_m), cdiv(_PROGRAMS_PER_SM * sms, col_blocks)))
        rows_per_program = cdiv(cdiv(m, row_groups), block_m) * block_m
        row_groups = cdiv(m, rows_per_program)
        slots = row_groups
        partial = torch.empty((slots, 2, n) if need_partial else (0,), device=x.device, dtype=torch.float32)
        kernel_for(_layer_norm_bwd_columns_kernel, traceable=traceable)[(col_blocks, row_groups)](
            x, dy, dx, weight if need_dw else unused_pointer(x), mean, rstd, c1, c2, partial, m, n,
            x.stride(0), dy.stride(0), dx.stride(0), rows_per_program, IS_RMS=is_rms, HAS_WEIGHT=need_dw,
            NEED_DB=need_db, BLOCK_M=block_m, BLOCK_N=_WIDE_COLUMNS, num_warps=8,
        )
    if need_partial:
        block_n = min(256, _next_pow2(n))
        kernel_for(_layer_norm_bwd_dwdb_kernel, traceable=traceable)[(cdiv(n, block_n),)](
            partial, dw if need_dw else partial, db if need_db else partial, slots, n,
            NEED_DW=need_dw, NEED_DB=need_db, BLOCK_S=min(32, _next_pow2(slots)), BLOCK_N=block_n,
            num_warps=4,
        )
    return dx, dw, db


class _NormFunction(torch.autograd.Function):
    """Eager autograd for both norms; saves x (as rows), weight, mean and rstd (fp32, M each). Takes the
    caller's tensors and reshapes inside, so autograd records one node, not one per reshape; dW/dB come
    out of the final-sum kernel in the parameters' dtypes (measured: each reshape node and each cast
    cost 10-25 us of host time per backward, `scripts/host_overhead.py`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, n, eps, is_rms, deterministic):
        x2 = _rows_2d(x, n)
        w = None if weight is None else weight.reshape(-1).contiguous()
        b = None if bias is None else bias.reshape(-1).contiguous()
        y, mean, rstd = _norm_fwd_impl(x2, w, b, eps, is_rms)
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.is_rms, ctx.deterministic, ctx.need_db = is_rms, deterministic, bias is not None
        ctx.shapes = (x.shape, None if weight is None else weight.shape, None if bias is None else bias.shape)
        ctx.grad_dtypes = (torch.float32 if weight is None else weight.dtype,
                           torch.float32 if bias is None else bias.dtype)
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, mean, rstd = ctx.saved_tensors
        x_shape, w_shape, b_shape = ctx.shapes
        dx, dw, db = _norm_bwd_impl(_rows_2d(dy, x2.shape[1]), x2, w, mean, rstd, ctx.is_rms, ctx.need_db,
                                    ctx.deterministic, grad_dtypes=ctx.grad_dtypes)
        return (dx.reshape(x_shape), None if w_shape is None else dw.reshape(w_shape),
                None if b_shape is None else db.reshape(b_shape), None, None, None, None)


@triton_op("fused_kernels::norm_fwd", mutates_args=())
def norm_fwd_op(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                is_rms: bool, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Registered forward: rows ``x`` (M, N) -> ``(y, mean, rstd)``; ``deterministic`` is for backward."""
    return _norm_fwd_impl(x, weight, bias, eps, is_rms, traceable=True)


@triton_op("fused_kernels::norm_bwd", mutates_args=())
def norm_bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor,
                rstd: torch.Tensor, is_rms: bool, need_db: bool,
                deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Registered backward: ``(dx, dw, db)``; ``dw``/``db`` are empty when not needed."""
    return _norm_bwd_impl(dy.contiguous(), x, weight, mean, rstd, is_rms, need_db, deterministic,
                          traceable=True)


def _setup_context(ctx, inputs, output):
    x, weight, bias, _, is_rms, deterministic = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.is_rms, ctx.deterministic, ctx.need_db = is_rms, deterministic, bias is not None
    ctx.mark_non_differentiable(mean, rstd)


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = torch.ops.fused_kernels.norm_bwd(dy, x, weight, mean, rstd, ctx.is_rms, ctx.need_db,
                                                  ctx.deterministic)
    return dx, (dw if weight is not None else None), (db if ctx.need_db else None), None, None, None


norm_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _check(x, normalized_shape, weight, bias) -> tuple[tuple[int, ...], int]:
    check_tensor("x", x)
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor (float16, bfloat16, float32), got {x.dtype}")
    check_float_dtype("x", x)
    if isinstance(normalized_shape, int):
        shape = (normalized_shape,)
    elif isinstance(normalized_shape, (tuple, list, torch.Size)) and all(isinstance(s, int) for s in normalized_shape):
        shape = tuple(normalized_shape)
    else:
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}")
    if len(shape) == 0 or len(shape) > x.dim() or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(
            f"normalized_shape {list(shape)} must match the trailing dims of x, whose shape is {list(x.shape)}"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_float_dtype(name, t)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {list(shape)} (normalized_shape), got {list(t.shape)}")
    check_same_device(x=x, weight=weight, bias=bias)
    backend_for(x)
    return shape, math.prod(shape)


def _norm(x, shape, n, weight, bias, eps, is_rms, deterministic):
    if not torch.compiler.is_compiling() and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, weight, bias)):
        return _NormFunction.apply(x, weight, bias, n, float(eps), is_rms, deterministic)
    x2 = _rows_2d(x, n)
    w = None if weight is None else weight.reshape(-1).contiguous()
    b = None if bias is None else bias.reshape(-1).contiguous()
    if torch.compiler.is_compiling():
        y = torch.ops.fused_kernels.norm_fwd(x2, w, b, float(eps), is_rms, deterministic)[0]
    else:  # inference: no autograd node, nothing saved
        y = _norm_fwd_impl(x2, w, b, float(eps), is_rms)[0]
    return y.reshape(x.shape)


def layer_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *, deterministic: bool = False) -> torch.Tensor:
    """Fused LayerNorm over the trailing ``normalized_shape`` dims, like ``torch.nn.functional.layer_norm``.

    Statistics in fp32; output in ``x``'s dtype (fp16, bf16, fp32); ``weight``/``bias`` optional and may
    be fp32 with a low-precision ``x``; any leading shape and any width. ``deterministic=True`` makes dW
    and dB bitwise reproducible (one partial buffer per program instead of lock-shared buffers).
    """
    shape, n = _check(x, normalized_shape, weight, bias)
    return _norm(x, shape, n, weight, bias, eps, False, deterministic)


def rms_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None, eps: float | None = 1e-6, *,
             deterministic: bool = False) -> torch.Tensor:
    """Fused RMSNorm over the trailing ``normalized_shape`` dims, like ``torch.nn.functional.rms_norm``
    (``eps=None`` means ``torch.finfo(x.dtype).eps``, as torch)."""
    shape, n = _check(x, normalized_shape, weight, None)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return _norm(x, shape, n, weight, None, eps, True, deterministic)
