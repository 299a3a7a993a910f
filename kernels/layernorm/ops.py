"""Launchers, registered ops and autograd for LayerNorm / RMSNorm.

Eager calls run ``_NormFunction`` (a ``torch.autograd.Function`` launching the kernels directly); under
torch.compile the public functions call the registered ops, which share the implementation:

- ``fused_kernels::norm_fwd(x, weight?, bias?, eps, is_rms, deterministic) -> (y, mean, rstd)``
- ``fused_kernels::norm_bwd(dy, x, weight?, mean, rstd, is_rms, need_db, deterministic) -> (dx, dw, db)``

``x`` is the input viewed as ``(M, N)`` rows. On CPU tensors without the Triton interpreter the twin
``reference.layernorm`` runs.

Launch configurations (tiles, warps, grids) come from ``kernels.layernorm.configs``.
"""

from __future__ import annotations

import math

import torch
from torch.library import triton_op

import reference.layernorm as twin
from kernels._common import (
    LIBRARY_NAMESPACE,
    autocast_cast,
    backend_for,
    cdiv,
    check_finite_number,
    check_float_dtype,
    check_same_device,
    check_tensor,
    kernel_for,
    multiprocessor_count,
    nothing_to_launch,
    unused_pointer,
)
from kernels._common.launch import kernels_from as swap_kernels
from kernels.layernorm import configs
from kernels.layernorm._kernels import (
    _layer_norm_bwd_columns_kernel,
    _layer_norm_bwd_dwdb_kernel,
    _layer_norm_bwd_kernel,
    _layer_norm_bwd_row_terms_kernel,
    _layer_norm_fwd_kernel,
)

_KERNEL_NAMES = ("_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel", "_layer_norm_bwd_row_terms_kernel",
                 "_layer_norm_bwd_columns_kernel", "_layer_norm_bwd_dwdb_kernel")


def kernels_from(module):
    """Inside ``with kernels_from(module):`` calls launch ``module``'s jit kernels (another version of
    ``kernels/layernorm/_kernels.py``, same signatures) instead of this checkout's: interleaved A/B timing of a
    kernel change in one process (``scripts/ab_kernels.py``)."""
    return swap_kernels(globals(), module, _KERNEL_NAMES)


def _rows_2d(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as (M, N) rows with unit column stride (a view when possible): the registered ops' layout."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def _rows(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """``t`` (any shape ending in the normalized dims, ``n`` elements each) and the stride between its rows of
    ``n``: ``t`` itself when its rows are unit-stride and evenly spaced, else a contiguous copy. No view is
    made (each costs a few us of host time, the order of the kernel itself at M = 4096)."""
    if t.is_contiguous():
        return t, n
    if t.dim() == 2 and t.shape[1] == n and t.stride(1) == 1:
        return t, t.stride(0)
    return t.contiguous(), n


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    """A weight or bias as a flat run of ``n`` elements (the kernels index it by column)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def _or_unused(t: torch.Tensor | None, like: torch.Tensor, traceable: bool):
    """``t``, or a placeholder for an argument a compile-time branch never reads (see ``unused_pointer``)."""
    return t if t is not None else unused_pointer(like, traceable)


def _norm_fwd_impl(x, weight, bias, eps, is_rms, *, n=None, traceable=False):
    """``(y, mean, rstd)`` for rows of ``n`` (default: the last dim) of ``x``; ``y`` has ``x``'s shape (and
    is contiguous), ``mean``/``rstd`` are fp32 of M = x.numel() / n (``mean`` is empty for RMSNorm)."""
    n = x.shape[-1] if n is None else n
    if backend_for(x) == "reference":
        # the twin takes rows and flat parameters: a (4, 6) normalized_shape is rows of 24
        x2 = x.reshape(-1, n)
        weight = None if weight is None else weight.reshape(-1)
        bias = None if bias is None else bias.reshape(-1)
        if is_rms:
            y, rstd = twin.rms_norm_forward(x2, weight, eps)
            return y.reshape(x.shape), torch.empty(0, device=x.device, dtype=torch.float32), rstd
        y, mean, rstd = twin.layer_norm_forward(x2, weight, bias, eps)
        return y.reshape(x.shape), mean, rstd
    x, stride_x = _rows(x, n)
    m = x.numel() // n if n else 0
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    mean = torch.empty(0 if is_rms else m, device=x.device, dtype=torch.float32)
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    if nothing_to_launch(x):
        return y, mean, rstd
    cfg = configs.forward(n)
    grid = (configs.forward_programs(m, n, cfg, x.element_size(), x.device.index or 0),)
    kernel_for(_layer_norm_fwd_kernel, traceable=traceable)[grid](
        x, y, _or_unused(weight, x, traceable), _or_unused(bias, x, traceable),
        _or_unused(None if is_rms else mean, x, traceable), rstd, m, n, stride_x, n, eps,
        IS_RMS=is_rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, **cfg,
    )
    return y, mean, rstd


def _norm_bwd_impl(dy, x, weight, mean, rstd, is_rms, need_db, deterministic, *, n=None, grad_dtypes=None,
                   bias_shape=None, traceable=False):
    """``(dx, dw, db)`` for rows of ``n`` (default: the last dim); ``dx`` has ``x``'s shape, ``dw`` the
    weight's shape; dW/dB in fp32, or in ``grad_dtypes = (dw dtype, db dtype)`` when given (the final sum
    casts as it stores: no cast launched afterwards); ``db`` has ``bias_shape`` (default ``(n,)``)."""
    n = x.shape[-1] if n is None else n
    need_dw = weight is not None
    dw_dtype, db_dtype = grad_dtypes or (torch.float32, torch.float32)
    dw_shape = weight.shape if need_dw else (0,)
    db_shape = bias_shape if need_db and bias_shape is not None else (n if need_db else 0,)
    if backend_for(x) == "reference":
        x2, dy2 = x.reshape(-1, n), dy.reshape(-1, n)
        w = None if weight is None else weight.reshape(-1)
        if is_rms:
            dx, dw = twin.rms_norm_backward(dy2, x2, w, rstd)
            db = None
        else:
            dx, dw, db = twin.layer_norm_backward(dy2, x2, w, mean, rstd)
        empty = torch.empty(0, device=x.device)
        return (dx.reshape(x.shape), dw.to(dw_dtype).reshape(dw_shape) if need_dw else empty,
                db.to(db_dtype).reshape(db_shape) if need_db else empty)
    x, stride_x = _rows(x, n)
    dy, stride_dy = _rows(dy, n)
    m = x.numel() // n if n else 0
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    alloc = torch.zeros if m == 0 else torch.empty
    dw = alloc(dw_shape, device=x.device, dtype=dw_dtype)
    db = alloc(db_shape, device=x.device, dtype=db_dtype)
    if nothing_to_launch(x):
        return dx, dw, db
    sms = multiprocessor_count(x.device.index or 0)
    need_partial = need_dw or need_db
    w_arg = _or_unused(weight, x, traceable)
    mean_arg = _or_unused(None if is_rms else mean, x, traceable)
    if configs.fused_backward(n):
        cfg = configs.backward(n)
        programs, rows_per_program, slots = configs.backward_grid(m, cfg, sms, deterministic)
        partial = torch.empty((slots, 2, n), device=x.device, dtype=torch.float32) if need_partial else None
        # Locks, then first-write flags: one zeroed allocation (lock mode only).
        locks = None if deterministic or not need_partial else torch.zeros(
            2 * slots, device=x.device, dtype=torch.int32)
        kernel_for(_layer_norm_bwd_kernel, traceable=traceable)[(programs,)](
            x, dy, dx, w_arg, mean_arg, rstd, _or_unused(partial, x, traceable), _or_unused(locks, x, traceable),
            m, n, stride_x, stride_dy, n, rows_per_program, slots,
            IS_RMS=is_rms, HAS_WEIGHT=need_dw, NEED_DB=need_db, DETERMINISTIC=deterministic, **cfg,
        )
    else:
        # Wide rows: row terms, then (column block, row group) programs with exclusive buffers.
        c1 = torch.empty(m, device=x.device, dtype=torch.float32)
        c2 = torch.empty(m, device=x.device, dtype=torch.float32)
        kernel_for(_layer_norm_bwd_row_terms_kernel, traceable=traceable)[(m,)](
            x, dy, w_arg, mean_arg, rstd, c1, c2, m, n, stride_x, stride_dy,
            IS_RMS=is_rms, HAS_WEIGHT=need_dw, **configs.row_terms(),
        )
        col_blocks, row_groups, rows_per_program, wide_cfg = configs.wide_backward(m, n, sms)
        slots = row_groups
        partial = torch.empty((slots, 2, n), device=x.device, dtype=torch.float32) if need_partial else None
        kernel_for(_layer_norm_bwd_columns_kernel, traceable=traceable)[(col_blocks, row_groups)](
            x, dy, dx, w_arg, mean_arg, rstd, c1, c2, _or_unused(partial, x, traceable), m, n,
            stride_x, stride_dy, n, rows_per_program, IS_RMS=is_rms, HAS_WEIGHT=need_dw,
            NEED_DB=need_db, **wide_cfg,
        )
    if need_partial:
        sum_cfg = configs.dwdb(n, slots)
        kernel_for(_layer_norm_bwd_dwdb_kernel, traceable=traceable)[(cdiv(n, sum_cfg["BLOCK_N"]),)](
            partial, _or_unused(dw if need_dw else None, x, traceable),
            _or_unused(db if need_db else None, x, traceable), slots, n, NEED_DW=need_dw, NEED_DB=need_db,
            **sum_cfg,
        )
    return dx, dw, db


class _NormFunction(torch.autograd.Function):
    """Eager autograd for both norms; saves x, weight, mean and rstd (fp32, M each). Works on the caller's
    tensors without views (a contiguous copy only for rows that are not evenly spaced), so autograd
    records one node; dW/dB come out of the final-sum kernel in the parameters' shapes and dtypes
    (measured: each reshape node and each cast cost 10-25 us of host time per backward,
    `scripts/host_overhead.py`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, n, eps, is_rms, deterministic):
        x, _ = _rows(x, n)
        w, b = _flat(weight), _flat(bias)
        y, mean, rstd = _norm_fwd_impl(x, w, b, eps, is_rms, n=n)
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.n, ctx.is_rms, ctx.deterministic, ctx.need_db = n, is_rms, deterministic, bias is not None
        ctx.grad_dtypes = (torch.float32 if weight is None else weight.dtype,
                           torch.float32 if bias is None else bias.dtype)
        ctx.bias_shape = None if bias is None else bias.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, mean, rstd = ctx.saved_tensors
        dx, dw, db = _norm_bwd_impl(dy, x, w, mean, rstd, ctx.is_rms, ctx.need_db, ctx.deterministic, n=ctx.n,
                                    grad_dtypes=ctx.grad_dtypes, bias_shape=ctx.bias_shape)
        return (dx, dw if w is not None else None, db if ctx.need_db else None, None, None, None, None)


@triton_op(f"{LIBRARY_NAMESPACE}::norm_fwd", mutates_args=())
def norm_fwd_op(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                is_rms: bool, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Registered forward: rows ``x`` (M, N) -> ``(y, mean, rstd)``; ``deterministic`` is for backward."""
    return _norm_fwd_impl(x, weight, bias, eps, is_rms, traceable=True)


@triton_op(f"{LIBRARY_NAMESPACE}::norm_bwd", mutates_args=())
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
    eps = check_finite_number("eps", eps, minimum=0.0)
    if not torch.compiler.is_compiling() and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, weight, bias)):
        return _NormFunction.apply(x, weight, bias, n, float(eps), is_rms, deterministic)
    if not torch.compiler.is_compiling():  # inference: no autograd node, nothing saved
        return _norm_fwd_impl(x, _flat(weight), _flat(bias), float(eps), is_rms, n=n)[0]
    w = None if weight is None else weight.reshape(-1)
    b = None if bias is None else bias.reshape(-1)
    y = torch.ops.fused_kernels.norm_fwd(_rows_2d(x, n), w, b, float(eps), is_rms, deterministic)[0]
    return y.reshape(x.shape)


def layer_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *, deterministic: bool = False) -> torch.Tensor:
    """Fused LayerNorm over the trailing ``normalized_shape`` dims, like ``torch.nn.functional.layer_norm``.

    Statistics in fp32; output in ``x``'s dtype (fp16, bf16, fp32); ``weight``/``bias`` optional and may
    be fp32 with a low-precision ``x``; any leading shape and any width. Under ``torch.autocast`` on CUDA it
    runs in fp32, as torch's does. ``deterministic=True`` makes dW
    and dB bitwise reproducible (one partial buffer per program instead of lock-shared buffers).
    """
    if isinstance(x, torch.Tensor):
        x, weight, bias = autocast_cast("layer_norm", x, weight, bias)
    shape, n = _check(x, normalized_shape, weight, bias)
    return _norm(x, shape, n, weight, bias, eps, False, deterministic)


def rms_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None, eps: float | None = None, *,
             deterministic: bool = False) -> torch.Tensor:
    """Fused RMSNorm over the trailing ``normalized_shape`` dims, like ``torch.nn.functional.rms_norm``.

    ``eps=None`` (the default, as torch's) follows torch's rule: the machine epsilon of the type the norm
    computes in, ``torch.finfo(torch.float32).eps`` for fp16, bf16 and fp32 inputs (not
    ``torch.finfo(x.dtype).eps``, which torch's documentation suggests but its code does not use).
    Statistics in fp32; under ``torch.autocast`` on CUDA it runs in fp32, as torch's does.
    ``deterministic=True`` makes dW bitwise reproducible.
    """
    if isinstance(x, torch.Tensor):
        x, weight = autocast_cast("rms_norm", x, weight)
    shape, n = _check(x, normalized_shape, weight, None)
    return _norm(x, shape, n, weight, None, twin.rms_norm_eps(eps, x.dtype), True, deterministic)
