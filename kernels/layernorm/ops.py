"""Launchers, registered ops and autograd for LayerNorm / RMSNorm.

Eager calls run ``_NormFunction`` (a ``torch.autograd.Function`` launching the kernels directly); under
torch.compile the public functions call the registered ops, which share the implementation:

- ``fused_kernels::norm_fwd(x, weight?, bias?, eps, is_rms, deterministic) -> (y, mean, rstd)``
- ``fused_kernels::norm_bwd(dy, x, weight?, mean, rstd, is_rms, need_db, deterministic) -> (dx, dw, db)``

``x`` is the input viewed as ``(M, N)`` rows. On CPU tensors without the Triton interpreter, and on float64
tensors, the twin ``reference.layernorm`` runs; under torch.compile through the opaque ops ``norm_fwd_twin``,
``norm_bwd_twin``, ``add_dropout_norm_fwd_twin`` and ``add_dropout_norm_bwd_twin`` (``kernels._common.opaque``).

Launch configurations (tiles, warps, grids) come from ``kernels.layernorm.configs``. An eager
``add_dropout_norm`` call checks its arguments once per call signature (``kernels._common.eager``).
"""

from __future__ import annotations

import math

import torch
from torch.library import triton_op

import reference.layernorm as twin
from kernels._common import (
    FLOAT_DTYPES,
    LIBRARY_NAMESPACE,
    autocast_cast,
    backend_for,
    cdiv,
    check_finite_number,
    check_float_dtype,
    check_probability,
    check_same_device,
    check_seed,
    check_tensor,
    kernel_for,
    multiprocessor_count,
    nothing_to_launch,
    unused_pointer,
)
from kernels._common import seed as seeds
from kernels._common.autocast import autocast_dtype
from kernels._common.eager import PlanCache, autocast_key, function_apply, plannable, plans_apply, tensor_key
from kernels._common.launch import (
    PreparedCache,
    current_stream_handle,
    launch_or_replay,
    observed_calls,
    prepared_launches_enabled,
    replayed,
)
from kernels._common.launch import kernels_from as swap_kernels
from kernels._common.opaque import opaque_op
from kernels._common.runtime import INTERPRETER, is_hopper, kernel_path_token
from kernels._common.seed import SEED_WORD_PARAMETERS, Seed
from kernels._native import Refs
from kernels._native import active as native_active
from kernels._native import call_last as native_call_last
from kernels._native import launches as native_launches
from kernels._native import layout as native_layout
from kernels._native import module as native_module
from kernels._native import observed as native_observed
from kernels._native import program_for as native_program_for
from kernels._native import remember as native_remember
from kernels.layernorm import _hopper, configs
from kernels.layernorm._kernels import (
    _add_dropout_norm_fwd_kernel,
    _layer_norm_bwd_dwdb_kernel,
    _layer_norm_bwd_kernel,
    _layer_norm_bwd_split_row_kernel,
    _layer_norm_fwd_kernel,
)

_KERNEL_NAMES = ("_add_dropout_norm_fwd_kernel", "_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel",
                 "_layer_norm_bwd_split_row_kernel", "_layer_norm_bwd_dwdb_kernel")


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


def _shaped(t: torch.Tensor | None, shape) -> torch.Tensor | None:
    """``t`` in ``shape``: itself when it has it already (a reshape is a view op: a few us of host time)."""
    return t if t is None or t.shape == shape else t.reshape(shape)


def _or_unused(t: torch.Tensor | None, like: torch.Tensor, traceable: bool):
    """``t``, or a placeholder for an argument a compile-time branch never reads (see ``unused_pointer``)."""
    return t if t is not None else unused_pointer(like, traceable)


#: recorded launches of eager calls, by call signature (``kernels._common.launch.launch_or_replay``)
_NORM_FORWARD_CALLS = PreparedCache()
_NORM_BACKWARD_CALLS = PreparedCache()
_ADD_DROPOUT_NORM_CALLS = PreparedCache()


def _eager(traceable: bool, seed_in_memory: int = 0) -> bool:
    """Whether a call's launches are recorded and replayed: eager, the seed (if any) passed as ints (a device seed,
    read from memory, is a tensor of the call)."""
    return not traceable and not seed_in_memory and prepared_launches_enabled()


def _norm_fwd_impl(x, weight, bias, eps, is_rms, *, n=None, y_dtype=None, traceable=False):
    """``(y, mean, rstd)`` for rows of ``n`` (default: the last dim) of ``x``; ``y`` has ``x``'s shape (and
    is contiguous) and dtype (or ``y_dtype``), ``mean``/``rstd`` are fp32 of M = x.numel() / n (``mean`` is
    empty for RMSNorm)."""
    n = x.shape[-1] if n is None else n
    if backend_for(x, weight, bias, traced=traceable) == "reference":
        if traceable:  # the registered op's call: rows of the last dim, y in x's dtype
            return _norm_fwd_twin_op(x, weight, bias, eps, is_rms)
        return _norm_fwd_twin(x, weight, bias, eps, is_rms, n, y_dtype)
    x, stride_x = _rows(x, n)
    m = x.numel() // n if n else 0
    # empty_like: ~3.5 us of host time against ~8 for torch.empty(x.shape, device=..., dtype=...) (H100 host)
    y = torch.empty_like(x, dtype=y_dtype or x.dtype, memory_format=torch.contiguous_format)
    mean = torch.empty(0 if is_rms else m, device=x.device, dtype=torch.float32)
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    if nothing_to_launch(x):
        return y, mean, rstd

    hopper = None if traceable else _hopper_forward_plan(x, weight, bias, n, stride_x, is_rms)
    split = hopper is not None and hopper[0] is _hopper._norm_fwd_split_row_kernel
    # each column block's share of each row's statistics, all ones until published (see the kernel)
    stats = torch.full((m, hopper[1]["COL_BLOCKS"]), -1, device=x.device, dtype=torch.int64) if split else None

    def launch():
        device_index = x.device.index or 0
        if split:
            _, plan, per_sm = hopper
            lanes = min(m, per_sm * multiprocessor_count(device_index) // plan["COL_BLOCKS"])
            kernel_for(_hopper._norm_fwd_split_row_kernel, traceable=False)[(plan["COL_BLOCKS"], lanes)](
                x, y, _or_unused(weight, x, False), _or_unused(bias, x, False), _or_unused(mean, x, False), rstd,
                stats, m, n // plan["VEC"], stride_x // plan["VEC"], eps, IS_RMS=is_rms,
                HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, launch_cooperative_grid=True, **plan,
            )
            return
        if hopper is not None:
            plan = hopper[1]
            grid = (min(m, multiprocessor_count(device_index)),)
            kernel_for(_hopper._norm_fwd_shared_row_kernel, traceable=False)[grid](
                x, y, _or_unused(weight, x, False), _or_unused(bias, x, False),
                _or_unused(None if is_rms else mean, x, False), rstd, m, n // plan["VEC"], stride_x // plan["VEC"],
                n // plan["VEC"], eps, IS_RMS=is_rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                **plan,
            )
            return
        cfg = configs.forward(n)
        grid = (configs.forward_programs(m, n, cfg, x.element_size(), device_index),)
        kernel_for(_layer_norm_fwd_kernel, traceable=traceable)[grid](
            x, y, _or_unused(weight, x, traceable), _or_unused(bias, x, traceable),
            _or_unused(None if is_rms else mean, x, traceable), rstd, m, n, stride_x, n, eps,
            IS_RMS=is_rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            STREAM_HINTS=configs.forward_stream_hints(m, n, cfg, x.element_size(), device_index), **cfg,
        )

    signature = None if not _eager(traceable) else (
        x.shape, stride_x, n, x.dtype, y.dtype, x.device.index, None if weight is None else weight.dtype,
        None if bias is None else bias.dtype, eps, is_rms, hopper is not None, split)
    launch_or_replay(_NORM_FORWARD_CALLS, signature, (x, y, weight, bias, mean, rstd, stats), launch)
    return y, mean, rstd


def _hopper_forward_plan(x, weight, bias, n, stride_x, is_rms) -> tuple | None:
    """``(kernel, launch parameters, programs per SM)`` of the Hopper forward (``kernels/layernorm/_hopper.py``) for
    this eager call, or None for the portable kernel: rows wider than the register path's (``configs.hopper_forward``)
    on an sm_90 GPU, unless ``FUSED_KERNELS_LAYERNORM_PATH=portable``, with every copy 16-byte aligned (x, its row
    stride, w and b). LayerNorm rows take the split-row kernel (``configs.hopper_split_forward``), RMSNorm rows the
    shared-memory-row kernel."""
    w_bytes = 0 if weight is None else weight.element_size()
    b_bytes = 0 if bias is None else bias.element_size()
    plan = configs.hopper_forward(n, x.element_size(), w_bytes, b_bytes, is_rms)
    if plan is None or not is_hopper(x.device) or configs.path() == "portable":
        return None
    if (stride_x * x.element_size()) % 16 or any(t is not None and t.data_ptr() % 16 for t in (x, weight, bias)):
        return None
    split = configs.hopper_split_forward(n, x.element_size(), w_bytes, b_bytes, is_rms)
    if split is not None:
        return _hopper._norm_fwd_split_row_kernel, *split
    return _hopper._norm_fwd_shared_row_kernel, plan, 1


def _hopper_backward_plan(x, dy, dres, n, stride_x, stride_dy) -> dict | None:
    """Launch parameters of the Hopper wide-row backward for this call, or None for the portable split-row kernel:
    an sm_90 GPU unless ``FUSED_KERNELS_LAYERNORM_PATH=portable``, 16-bit x and dy (and the fused op's contiguous
    residual gradient ``dres``, when given) whose copies are 16-byte aligned (addresses and row strides). The fused
    op's backward with dropout comes here only for widths of whole dropout chunks (the caller checks)."""
    plan = configs.hopper_backward(n, x.element_size(), dy.element_size(), 0 if dres is None else dres.element_size())
    if plan is None or not is_hopper(x.device) or configs.path() == "portable":
        return None
    if stride_x % 8 or stride_dy % 8 or any(t is not None and t.data_ptr() % 16 for t in (x, dy, dres)):
        return None
    return plan


def _norm_bwd_impl(dy, x, weight, mean, rstd, is_rms, need_db, deterministic, *, n=None, grad_dtypes=None,
                   bias_shape=None, dx_dtype=None, fused=None, traceable=False):
    """``(dx, dw, db)`` for rows of ``n`` (default: the last dim); ``dx`` has ``x``'s shape and dtype (or
    ``dx_dtype``), ``dw`` the weight's shape; dW/dB in fp32, or in ``grad_dtypes = (dw dtype, db dtype)``
    when given (the final sum casts as it stores: no cast launched afterwards); ``db`` has ``bias_shape``
    (default ``(n,)``). ``fused``: the residual + dropout + norm backward's extras for the single-kernel
    path, ``(dres, dr, dropout_p, seed)`` (see ``_add_dropout_norm_bwd_impl``)."""
    n = x.shape[-1] if n is None else n
    need_dw = weight is not None
    dw_dtype, db_dtype = grad_dtypes or (torch.float32, torch.float32)
    dw_shape = weight.shape if need_dw else (0,)
    db_shape = bias_shape if need_db and bias_shape is not None else (n if need_db else 0,)
    if backend_for(x, weight, dy, traced=traceable) == "reference":
        if traceable:  # the registered op's call: rows of the last dim, fp32 dW/dB
            return _norm_bwd_twin_op(dy, x, weight, mean, rstd, is_rms, need_db)
        return _norm_bwd_twin(dy, x, weight, mean, rstd, is_rms, need_db, n, dw_dtype, db_dtype, dw_shape, db_shape,
                              dx_dtype)
    x, stride_x = _rows(x, n)
    dy, stride_dy = _rows(dy, n)
    m = x.numel() // n if n else 0
    dx = torch.empty_like(x, dtype=dx_dtype or x.dtype, memory_format=torch.contiguous_format)
    if m == 0:
        dw = torch.zeros(dw_shape, device=x.device, dtype=dw_dtype)
        db = torch.zeros(db_shape, device=x.device, dtype=db_dtype)
    else:  # empty_like where a tensor of the shape is at hand (cheaper on the host, as above)
        dw = torch.empty_like(weight, dtype=dw_dtype) if need_dw else torch.empty(0, device=x.device, dtype=dw_dtype)
        db = (torch.empty_like(dw, dtype=db_dtype) if need_db and need_dw and db_shape == dw_shape
              else torch.empty(db_shape, device=x.device, dtype=db_dtype))
    if nothing_to_launch(x):
        return dx, dw, db
    sms = multiprocessor_count(x.device.index or 0)
    need_partial = need_dw or need_db
    dres, dr, dropout_p, seed = fused or (None, None, 0.0, 0)
    if configs.fused_backward(n):
        dropout_on = dropout_p > 0
        deterministic = deterministic or configs.lock_free_partials(m, n)  # one buffer per program, no locks
        cfg, programs, rows_per_program, slots = configs.fused_backward_plan(m, n, dropout_on, deterministic, sms)
        partial, locks = _backward_workspace(x.device, slots, n, need_partial, not deterministic and need_partial,
                                             traceable)
        tensors = (x, dy, dx, weight, mean, rstd, partial, locks, dres, dr, dw, db)
        signature = None if not _eager(traceable, isinstance(seed, torch.Tensor)) else (
            x.shape, stride_x, stride_dy, n, x.dtype, dy.dtype, dx.dtype, x.device.index,
            None if weight is None else weight.dtype, dw.dtype, db.dtype, need_db, is_rms, deterministic,
            None if dres is None else dres.dtype, None if dr is None else dr.dtype, dropout_p)
        seed_words = seeds.key_words(seed) if dropout_on and signature is not None else (0, 0)
        if replayed(_NORM_BACKWARD_CALLS, signature, tensors, seed_words):
            return dx, dw, db
        drop = _dropout_kernel_args(dropout_p, seed, x, traceable)

        def launch():
            kernel_for(_layer_norm_bwd_kernel, traceable=traceable)[(programs,)](
                x, dy, dx, _or_unused(weight, x, traceable), _or_unused(None if is_rms else mean, x, traceable), rstd,
                _or_unused(partial, x, traceable), _or_unused(locks, x, traceable),
                m, n, stride_x, stride_dy, n, rows_per_program, slots, _or_unused(dres, x, traceable),
                _or_unused(dr, x, traceable), *drop,
                IS_RMS=is_rms, HAS_WEIGHT=need_dw, NEED_DB=need_db, DETERMINISTIC=deterministic,
                HAS_DRES=dres is not None, STORE_DR=dr is not None, DROPOUT=dropout_on, **cfg,
            )
            if need_partial:
                _launch_dwdb(partial, dw, db, need_dw, need_db, slots, n, x, traceable, locks)

        launch_or_replay(_NORM_BACKWARD_CALLS, signature, tensors, launch, seed_words, SEED_WORD_PARAMETERS)
        return dx, dw, db
    else:
        # Wide rows: programs split each row by columns and exchange the row sums (see the kernel).
        col_blocks, lanes, exchange, wide_cfg = configs.wide_backward(m, n, sms)
        # The portable kernel: two launches under the interpreter (it runs one program at a time: no waiting) and
        # with dropout, whose Philox work lengthens the wait between the programs more than a second read costs.
        one_launch = exchange and not INTERPRETER
        exchange = one_launch and dropout_p == 0
        # The Hopper kernel draws the mask in its own layout: each column block one whole dropout chunk.
        chunk_columns = wide_cfg["BLOCK_N"] == configs.DROPOUT_CHUNK and n % configs.DROPOUT_CHUNK == 0
        hopper = None if not one_launch or traceable or (dropout_p > 0 and not chunk_columns) else (
            _hopper_backward_plan(x, dy, dres, n, stride_x, stride_dy))
        slots = lanes
        partial = torch.empty((slots, 2, n), device=x.device, dtype=torch.float32) if need_partial else None
        if hopper is not None:
            packed_terms = torch.full((m, col_blocks), -1, device=x.device, dtype=torch.int64)
            kernel_for(_hopper._norm_bwd_split_row_kernel, traceable=False)[(col_blocks, lanes)](
                x, dy, dx, _or_unused(weight, x, False), _or_unused(None if is_rms else mean, x, False), rstd,
                packed_terms, _or_unused(partial, x, False), _or_unused(dres, x, False), _or_unused(dr, x, False), m,
                n // 8, stride_x // 8, stride_dy // 8, *_dropout_kernel_args(dropout_p, seed, x, False),
                IS_RMS=is_rms, HAS_WEIGHT=need_dw, NEED_DB=need_db, HAS_DRES=dres is not None,
                STORE_DR=dr is not None, DROPOUT=dropout_p > 0, launch_cooperative_grid=True, **hopper,
            )
            if need_partial:
                _launch_dwdb(partial, dw, db, need_dw, need_db, slots, n, x, traceable)
            return dx, dw, db
        terms = torch.empty((2, m, col_blocks), device=x.device, dtype=torch.float32)
        arrivals = torch.zeros(cdiv(m, wide_cfg["BLOCK_M"]), device=x.device, dtype=torch.int32) if exchange else None
        args = (x, dy, dx, _or_unused(weight, x, traceable), _or_unused(None if is_rms else mean, x, traceable), rstd,
                terms, _or_unused(arrivals, x, traceable), _or_unused(partial, x, traceable), m, n, stride_x,
                stride_dy, n, _or_unused(dres, x, traceable), _or_unused(dr, x, traceable),
                *_dropout_kernel_args(dropout_p, seed, x, traceable))
        flags = dict(IS_RMS=is_rms, HAS_WEIGHT=need_dw, NEED_DB=need_db, HAS_DRES=dres is not None,
                     STORE_DR=dr is not None, DROPOUT=dropout_p > 0,
                     CHUNK_COLUMNS=wide_cfg["BLOCK_N"] == configs.DROPOUT_CHUNK and n % configs.DROPOUT_CHUNK == 0,
                     **wide_cfg)
        kernel = kernel_for(_layer_norm_bwd_split_row_kernel, traceable=traceable)
        if exchange:
            kernel[(col_blocks, lanes)](*args, PHASE=0, launch_cooperative_grid=True, **flags)
        else:
            for phase in (1, 2):
                kernel[(col_blocks, lanes)](*args, PHASE=phase, **flags)
    if need_partial:
        _launch_dwdb(partial, dw, db, need_dw, need_db, slots, n, x, traceable)
    return dx, dw, db


def _launch_dwdb(partial, dw, db, need_dw: bool, need_db: bool, slots: int, n: int, like, traceable: bool,
                 locks=None) -> None:
    """dW/dB: the column sums of the backward's ``slots`` partial rows, cast as stored; with ``locks`` (the
    locked backward's), it also zeroes their first-write flags for the next backward."""
    sum_cfg = configs.dwdb(n, slots)
    kernel_for(_layer_norm_bwd_dwdb_kernel, traceable=traceable)[(cdiv(n, sum_cfg["BLOCK_N"]),)](
        partial, _or_unused(dw if need_dw else None, like, traceable),
        _or_unused(db if need_db else None, like, traceable), _or_unused(locks, like, traceable), slots, n,
        NEED_DW=need_dw, NEED_DB=need_db, RESET_FLAGS=locks is not None, **sum_cfg,
    )


#: eager backward workspaces (partial dW/dB rows, locks and flags), by (device, stream, slots, N, locked); at most
#: 16 of at most 4 MiB of partial rows each (larger ones, e.g. deterministic at large N, are allocated per call,
#: where the allocation is small beside the kernel's time), so what the cache holds stays bounded
_WORKSPACES: dict[tuple, tuple] = {}
_WORKSPACE_LIMIT = 16
_WORKSPACE_MAX_BYTES = 4 << 20


def _backward_workspace(device: torch.device, slots: int, n: int, need_partial: bool, locked: bool,
                        traceable: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(partial, locks)`` of the single-kernel backward: ``(slots, 2, n)`` fp32 partial rows (None without
    dW/dB) and ``2 * slots`` int32 locks then first-write flags, zero on entry (None unless ``locked``).

    An eager call takes them from a cache kept per device and stream: work on one stream runs in order, the
    locks are zero again once released and the final-sum kernel zeroes the flags, so the next backward on the
    stream finds them ready. That saves an allocation and a fill launch per backward (the zeroing alone,
    ``torch.zeros``, cost 10 us of host time at (8, 1024) on the H100 machine's host, 23 us inside a GPT
    step). Traced calls, calls during CUDA graph capture (a graph keeps the addresses it captured) and workspaces
    over ``_WORKSPACE_MAX_BYTES`` allocate their own."""
    if not need_partial:
        return None, None

    def fresh():
        return (torch.empty((slots, 2, n), device=device, dtype=torch.float32),
                torch.zeros(2 * slots, device=device, dtype=torch.int32) if locked else None)

    if (traceable or slots * 2 * n * 4 > _WORKSPACE_MAX_BYTES
            or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
        return fresh()
    key = (device, current_stream_handle(device), slots, n, locked)
    workspace = _WORKSPACES.get(key)
    if workspace is None:
        if len(_WORKSPACES) >= _WORKSPACE_LIMIT:
            # freed buffers go back to the caching allocator, which reuses them in stream order
            _WORKSPACES.clear()
        workspace = _WORKSPACES[key] = fresh()
    return workspace


def _norm_fwd_twin(x, weight, bias, eps, is_rms, n, y_dtype):
    """``_norm_fwd_impl`` of the twin: the twin takes rows and flat parameters (a (4, 6) normalized_shape is rows of
    24); ``mean``/``rstd`` in its compute dtype (float64 for float64 rows)."""
    x2 = twin.as_rows(x, n)
    weight = None if weight is None else weight.reshape(-1)
    bias = None if bias is None else bias.reshape(-1)
    if is_rms:
        y, rstd = twin.rms_norm_forward(x2, weight, eps)
        return y.reshape(x.shape).to(y_dtype or x.dtype), torch.empty(0, device=x.device), rstd
    y, mean, rstd = twin.layer_norm_forward(x2, weight, bias, eps)
    return y.reshape(x.shape).to(y_dtype or x.dtype), mean, rstd


def _norm_bwd_twin(dy, x, weight, mean, rstd, is_rms, need_db, n, dw_dtype, db_dtype, dw_shape, db_shape, dx_dtype):
    """``_norm_bwd_impl`` of the twin: ``(dx, dw, db)``, an empty fp32 tensor for each gradient not asked for."""
    x2, dy2 = twin.as_rows(x, n), twin.as_rows(dy, n)
    w = None if weight is None else weight.reshape(-1)
    if is_rms:
        dx, dw = twin.rms_norm_backward(dy2, x2, w, rstd)
        db = None
    else:
        dx, dw, db = twin.layer_norm_backward(dy2, x2, w, mean, rstd)
    empty = torch.empty(0, device=x.device)
    return (dx.reshape(x.shape).to(dx_dtype or x.dtype), dw.to(dw_dtype).reshape(dw_shape) if weight is not None
            else empty, db.to(db_dtype).reshape(db_shape) if need_db else empty.clone())


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _norm_fwd_twin_fake(x, weight, bias, eps, is_rms):
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(0 if is_rms else m, dtype=torch.float32 if is_rms else _stats_dtype(x)),
            x.new_empty(m, dtype=_stats_dtype(x)))


@opaque_op("norm_fwd_twin", "(Tensor x, Tensor? weight, Tensor? bias, float eps, bool is_rms) -> (Tensor, Tensor, "
           "Tensor)", _norm_fwd_twin_fake)
def _norm_fwd_twin_op(x, weight, bias, eps, is_rms):
    """The twin's forward of the registered op, run as it is when a compiled graph runs (``kernels._common.opaque``):
    the twin's numbers, traced, would take inductor's CPU code generation tens of seconds to compile."""
    y, mean, rstd = _norm_fwd_twin(x, weight, bias, eps, is_rms, x.shape[-1], None)
    return y.contiguous(), mean, rstd


def _norm_bwd_twin_fake(dy, x, weight, mean, rstd, is_rms, need_db):
    n = x.shape[-1]
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(n if weight is not None else 0, dtype=torch.float32),
            x.new_empty(n if need_db else 0, dtype=torch.float32))


@opaque_op("norm_bwd_twin", "(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, bool is_rms, "
           "bool need_db) -> (Tensor, Tensor, Tensor)", _norm_bwd_twin_fake)
def _norm_bwd_twin_op(dy, x, weight, mean, rstd, is_rms, need_db):
    """The twin's backward of the registered op: ``(dx, dw, db)``, fp32 dW/dB (empty where not asked for)."""
    n = x.shape[-1]
    dx, dw, db = _norm_bwd_twin(dy, x, weight, mean, rstd, is_rms, need_db, n, torch.float32, torch.float32,
                                (n,), (n,), None)
    return dx.contiguous(), dw, db


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


def _norm(x, normalized_shape, weight, bias, eps, is_rms: bool, deterministic):
    """Both public norms: an eager call whose arguments a stored plan covers takes it (``kernels._common.eager``);
    any other call is checked (``_check``), then runs, storing its plan."""
    plans = plans_apply()
    key = None
    if plans and type(deterministic) is bool:
        # the kernel path too: the compiled tier runs a plan's calls through one program, holding one path's launches
        key = (tensor_key(x), normalized_shape, type(normalized_shape), tensor_key(weight), tensor_key(bias), eps,
               type(eps), is_rms, deterministic, torch.is_grad_enabled(), autocast_key("cuda"),
               kernel_path_token(configs.PATH_ENV))
        plan = _NORM_PLANS.get(key)
        if plan is not None:
            if native_active():
                y = _native_norm(key, plan, x, weight, bias)
                if y is not None:
                    return y
            return _norm_run(plan, x, weight, bias, _apply_norm)
    op = "rms_norm" if is_rms else "layer_norm"
    cast = autocast_dtype(op, x.device.type) if isinstance(x, torch.Tensor) else None
    if cast is not None:
        x, weight, bias = autocast_cast(op, x, weight, bias)
    _, n = _check(x, normalized_shape, weight, bias)
    eps = check_finite_number("eps", twin.rms_norm_eps(eps, x.dtype) if is_rms else eps, minimum=0.0)
    deterministic = bool(deterministic)
    if torch.compiler.is_compiling():
        w = None if weight is None else weight.reshape(-1)
        b = None if bias is None else bias.reshape(-1)
        y = torch.ops.fused_kernels.norm_fwd(_rows_2d(x, n), w, b, eps, is_rms, deterministic)[0]
        return y.reshape(x.shape)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    plan = (n, eps, is_rms, deterministic, needs_grad, cast)
    _NORM_PLANS.put(key, plan)
    return _norm_run((*plan[:5], None), x, weight, bias, _apply_norm if plans else _NormFunction.apply)


#: checked eager calls of both norms (``kernels._common.eager``): plan key -> ``(n, eps, is_rms, deterministic,
#: needs_grad, autocast dtype or None)``
_NORM_PLANS = PlanCache()
_apply_norm = function_apply(_NormFunction)


def _autocast_to(dtype: torch.dtype, *tensors):
    """Checked ``tensors`` cast to ``dtype`` as autocast casts a norm's inputs (float64 and None pass)."""
    return tuple(t.to(dtype) if t is not None and t.dtype not in (dtype, torch.float64) else t for t in tensors)


def _norm_run(plan: tuple, x, weight, bias, apply):
    """An eager norm call with its checked arguments ``plan``: the autocast cast, then the autograd Function through
    ``apply``, or the forward alone (no autograd node, nothing saved) when nothing needs a gradient."""
    n, eps, is_rms, deterministic, needs_grad, cast = plan
    if cast is not None:
        x, weight, bias = _autocast_to(cast, x, weight, bias)
    if needs_grad:
        return apply(x, weight, bias, n, eps, is_rms, deterministic)
    return _norm_fwd_impl(x, _flat(weight), _flat(bias), eps, is_rms, n=n)[0]


#: compiled-tier programs of the plain norms (``kernels._native``) by (plan key, stream): a program, or False where
#: none can be built (the call then takes the Python path)
_NATIVE_NORMS = PreparedCache()
#: the program each norm plan's calls last ran through (``kernels._native.last_program``)
_NATIVE_LAST_NORMS = PreparedCache()


def _native_norm(key, plan: tuple, x, weight, bias) -> torch.Tensor | None:
    """The call through its compiled-tier program (built on the first call of its plan key and stream), or None
    when it has none: CPU tensors, tensors that are not contiguous (programs are built for contiguous ones), CUDA
    graph capture (a program holds its stream's backward workspace, which a graph must not capture), a misaligned
    tensor."""
    n, eps, is_rms, deterministic, needs_grad, cast = plan
    if cast is not None:
        x, weight, bias = _autocast_to(cast, x, weight, bias)
    inputs = [x] if weight is None and bias is None else [t for t in (x, weight, bias) if t is not None]
    # the backward kernel takes the fused op's seed words too; a plain norm's are (0, 0), as its Python path passes
    outputs = native_call_last(_NATIVE_LAST_NORMS, plan, inputs, [0, 0])
    if outputs is not None:
        return outputs[0]
    if not (x.is_cuda and x.is_contiguous() and (weight is None or weight.is_contiguous())
            and (bias is None or bias.is_contiguous())) or torch.cuda.is_current_stream_capturing():
        return None
    stream = current_stream_handle(x.device)
    program_key = (key, stream)
    program = native_program_for(_NATIVE_NORMS, program_key, lambda: _native_norm_program(
        x, weight, bias, n, eps, is_rms, deterministic, needs_grad))
    if program is None:
        return None
    outputs = native_module().run(program, inputs, [0, 0], stream)
    if outputs is None:
        return None
    native_remember(_NATIVE_LAST_NORMS, plan, program, inputs, stream)
    return outputs[0]


def _native_norm_program(x, weight, bias, n, eps, is_rms, deterministic, needs_grad):
    """The compiled-tier program of a norm call: its forward and (``needs_grad``) backward run once through the
    Python path, the backward on an uninitialised gradient, with their recorded launches observed; None when either
    has none the extension can replay. The forward's tensors (``_norm_fwd_impl``): x, y, weight, bias, mean, rstd,
    the split-row statistics; the backward's (``_norm_bwd_impl``, single-kernel path): x, dy, dx, weight, mean, rstd,
    the dW/dB partial rows, their locks, the fused op's two residual gradients, dW, dB."""
    native = native_module()
    x2, _ = _rows(x, n)
    w, b = _flat(weight), _flat(bias)
    with observed_calls() as seen:
        y, mean, rstd = _norm_fwd_impl(x2, w, b, eps, is_rms, n=n)
    found = native_observed(seen, _NORM_FORWARD_CALLS)
    launches = None if found is None else native_launches(found[0], found[1], native)
    if launches is None or found[1][6] is not None:
        return None
    fwd = Refs(native)
    inputs = {"x": fwd.of("INPUT", 0)}
    present = 1  # the call passes only the tensors it has: x, then weight and bias where given
    for name, t in (("weight", weight), ("bias", bias)):
        inputs[name] = fwd.of("INPUT", present) if t is not None else fwd.none()
        present += t is not None
    y_ref = fwd.alloc(x.shape, y.dtype)
    # RMSNorm has no mean: its empty tensor has no memory (address 0), so the program passes none, allocating nothing
    mean_ref = fwd.alloc(mean.shape, mean.dtype) if mean.numel() else fwd.none()
    rstd_ref = fwd.alloc(rstd.shape, rstd.dtype)
    program = native.Program(
        device=x.device, launches=launches, allocs=fwd.allocs, fixed=fwd.fixed,
        tensors=Refs.flat([inputs["x"], y_ref, inputs["weight"], inputs["bias"], mean_ref, rstd_ref, fwd.none()]),
        outputs=Refs.flat([y_ref]), saved=Refs.flat([inputs["x"], inputs["weight"], mean_ref, rstd_ref]))
    if not needs_grad:
        return program
    grad_dtypes = (torch.float32 if weight is None else weight.dtype, torch.float32 if bias is None else bias.dtype)
    with observed_calls() as seen:
        _norm_bwd_impl(torch.empty_like(y), x2, w, mean, rstd, is_rms, bias is not None, deterministic, n=n,
                       grad_dtypes=grad_dtypes, bias_shape=None if bias is None else bias.shape)
    found = native_observed(seen, _NORM_BACKWARD_CALLS)
    launches = None if found is None else native_launches(found[0], found[1], native)
    if launches is None:
        return None
    _, _, dx, _, _, _, partial, locks, dres, dr, dw, db = found[1]
    if dres is not None or dr is not None:
        return None
    bwd = Refs(native)
    dx_ref = bwd.alloc(x.shape, dx.dtype)
    dw_ref = bwd.alloc(weight.shape, dw.dtype) if weight is not None else bwd.none()
    db_ref = bwd.alloc(bias.shape, db.dtype) if bias is not None else bwd.none()
    saved_weight = bwd.of("SAVED", 1) if weight is not None else bwd.none()
    program.set_backward(
        launches=launches, allocs=bwd.allocs, fixed=bwd.fixed,
        tensors=Refs.flat([bwd.of("SAVED", 0), bwd.of("GRAD", 0), dx_ref, saved_weight, bwd.of("SAVED", 2),
                           bwd.of("SAVED", 3), bwd.hold(partial) if partial is not None else bwd.none(),
                           bwd.hold(locks) if locks is not None else bwd.none(), bwd.none(), bwd.none(), dw_ref,
                           db_ref]),
        grad_layouts=[native_layout(x.shape, y.dtype)],
        input_grads=Refs.flat([dx_ref, *(r for r, t in ((dw_ref, weight), (db_ref, bias)) if t is not None)]))
    return program


def layer_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *, deterministic: bool = False) -> torch.Tensor:
    """Fused LayerNorm over the trailing ``normalized_shape`` dims, like ``torch.nn.functional.layer_norm``.

    Statistics in fp32; output in ``x``'s dtype (fp16, bf16, fp32); ``weight``/``bias`` optional and may
    be fp32 with a low-precision ``x``; any leading shape and any width. Under ``torch.autocast`` on CUDA it
    runs in fp32, as torch's does. ``deterministic=True`` makes dW
    and dB bitwise reproducible (one partial buffer per program instead of lock-shared buffers).
    """
    return _norm(x, normalized_shape, weight, bias, eps, False, deterministic)


def rms_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None, eps: float | None = None, *,
             deterministic: bool = False) -> torch.Tensor:
    """Fused RMSNorm over the trailing ``normalized_shape`` dims, like ``torch.nn.functional.rms_norm``.

    ``eps=None`` (the default, as torch's) follows torch's rule: the machine epsilon of the type the norm
    computes in, ``torch.finfo(torch.float32).eps`` for fp16, bf16 and fp32 inputs (not
    ``torch.finfo(x.dtype).eps``, which torch's documentation suggests but its code does not use).
    Statistics in fp32; under ``torch.autocast`` on CUDA it runs in fp32, as torch's does.
    ``deterministic=True`` makes dW bitwise reproducible.
    """
    return _norm(x, normalized_shape, weight, None, eps, True, deterministic)


# --- residual + dropout + norm ---------------------------------------------------------------------------


def _dropout_kernel_args(dropout_p: float, seed: Seed, like: torch.Tensor, traceable: bool) -> tuple:
    """``(seed_lo, seed_hi, seed_ptr, seed_in_memory, threshold, scale)``: the kernels' dropout arguments, a
    threshold of 0 when there is no dropout (the kernels then compile the mask away)."""
    if dropout_p == 0.0:
        return 0, 0, *seeds.seed_pointer(None, like, traceable), 0, 1.0
    seed_lo, seed_hi, seed_tensor, threshold, scale = seeds.dropout_scalars(dropout_p, seed)
    return seed_lo, seed_hi, *seeds.seed_pointer(seed_tensor, like, traceable), threshold, scale


def _add_dropout_norm_fwd_impl(x, residual, weight, bias, eps, is_rms, dropout_p, seed, residual_dtype, y_dtype, *,
                               traceable=False):
    """``(y, residual_out, mean, rstd)`` over the last dim: ``residual_out = dropout(x) + residual`` in
    ``residual_dtype``, ``y = norm(residual_out)`` in ``y_dtype`` (both contiguous, ``x``'s shape); the
    twin's on CPU tensors without the interpreter (``mean``/``rstd`` then empty: its backward recomputes)."""
    n = x.shape[-1]
    if backend_for(x, residual, weight, bias, residual_dtype, y_dtype, traced=traceable) == "reference":
        if traceable:
            return _add_dropout_norm_fwd_twin_op(x, residual, weight, bias, eps, is_rms, dropout_p,
                                                 *seeds.op_seed_args(seed), residual_dtype, y_dtype)
        return _add_dropout_norm_fwd_twin(x, residual, weight, bias, eps, is_rms, dropout_p, seed, residual_dtype,
                                          y_dtype)
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    # empty_like: ~3.5 us of host time against ~8 for torch.empty(x.shape, device=..., dtype=...) (H100 host)
    residual_out = torch.empty_like(x, dtype=residual_dtype)
    y = torch.empty_like(x, dtype=y_dtype)
    m = x.numel() // n if n else 0
    mean = torch.empty(0 if is_rms else m, device=x.device, dtype=torch.float32)
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    if nothing_to_launch(x):
        return y, residual_out, mean, rstd
    dropout_on = dropout_p > 0
    cfg = configs.add_dropout_norm_forward(n, dropout=dropout_on)
    normalise_here = cfg["SINGLE_PASS"]
    tensors = (x, residual, residual_out, y, weight, bias, mean, rstd)
    signature = None if not _eager(traceable, isinstance(seed, torch.Tensor)) else (
        x.shape, x.dtype, None if residual is None else residual.dtype, residual_out.dtype, y.dtype, x.device.index,
        None if weight is None else weight.dtype, None if bias is None else bias.dtype, eps, is_rms, dropout_p)
    seed_words = seeds.key_words(seed) if dropout_on and signature is not None else (0, 0)
    if not replayed(_ADD_DROPOUT_NORM_CALLS, signature, tensors, seed_words):
        drop = _dropout_kernel_args(dropout_p, seed, x, traceable)
        launch_cfg = {key: value for key, value in cfg.items() if key != "SINGLE_PASS"}

        def launch():
            kernel_for(_add_dropout_norm_fwd_kernel, traceable=traceable)[(cdiv(m, cfg["BLOCK_M"]),)](
                x, _or_unused(residual, x, traceable), residual_out, y, _or_unused(weight, x, traceable),
                _or_unused(bias, x, traceable), _or_unused(None if is_rms else mean, x, traceable), rstd, m, n, eps,
                *drop, IS_RMS=is_rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                HAS_RESIDUAL=residual is not None, DROPOUT=dropout_on, NORM=normalise_here, **launch_cfg,
            )

        launch_or_replay(_ADD_DROPOUT_NORM_CALLS, signature, tensors, launch, seed_words, SEED_WORD_PARAMETERS)
    if not normalise_here:  # rows wider than one tile: the chunked norm forward reads residual_out
        y, mean, rstd = _norm_fwd_impl(residual_out, weight, bias, eps, is_rms, y_dtype=y_dtype,
                                       traceable=traceable)
    return y, residual_out, mean, rstd


def _add_dropout_norm_bwd_impl(dy, dresidual_out, residual_out, weight, mean, rstd, eps, is_rms, need_db,
                               deterministic, dropout_p, seed, x_dtype, has_residual, *, grad_dtypes=None,
                               traceable=False):
    """``(dx, dresidual, dw, db)``: ``dr = norm backward(dy) + dresidual_out`` in fp32, ``dresidual = dr`` in
    residual_out's dtype (None without a residual), ``dx = dropout(dr in x's dtype)`` with the forward's
    mask. ``dresidual_out`` may be None (residual_out unused downstream)."""
    if backend_for(residual_out, dy, weight, x_dtype, traced=traceable) == "reference":
        if traceable:
            return _add_dropout_norm_bwd_twin_op(dy, dresidual_out, residual_out, weight, eps, is_rms, dropout_p,
                                                 *seeds.op_seed_args(seed), x_dtype, has_residual)
        return _add_dropout_norm_bwd_twin(dy, dresidual_out, residual_out, weight, eps, is_rms, dropout_p, seed,
                                          x_dtype, has_residual)
    dresidual_out = None if dresidual_out is None else dresidual_out.contiguous()
    dresidual = torch.empty_like(residual_out) if has_residual else None
    fused = (dresidual_out, dresidual, dropout_p, seed)
    dx, dw, db = _norm_bwd_impl(dy, residual_out, weight, mean, rstd, is_rms, need_db, deterministic,
                                grad_dtypes=grad_dtypes, dx_dtype=x_dtype, fused=fused, traceable=traceable)
    return dx, dresidual, dw, db


def _add_dropout_norm_fwd_twin(x, residual, weight, bias, eps, is_rms, dropout_p, seed, residual_dtype, y_dtype):
    """``_add_dropout_norm_fwd_impl`` of the twin (``mean``/``rstd`` empty: its backward recomputes them)."""
    y, residual_out = twin.add_dropout_norm(
        x, residual, weight, bias, kind="rms" if is_rms else "layer", eps=eps, dropout_p=dropout_p,
        seed=seeds.seed_value(seed) if dropout_p > 0 else None, residual_dtype=residual_dtype, out_dtype=y_dtype)
    return y, residual_out, torch.empty(0, device=x.device), torch.empty(0, device=x.device)


def _add_dropout_norm_bwd_twin(dy, dresidual_out, residual_out, weight, eps, is_rms, dropout_p, seed, x_dtype,
                               has_residual):
    """``_add_dropout_norm_bwd_impl`` of the twin: ``(dx, dresidual, dw, db)``."""
    dx, dresidual, dw, db = twin.add_dropout_norm_backward(
        dy, dresidual_out, residual_out, weight, kind="rms" if is_rms else "layer", eps=eps,
        dropout_p=dropout_p, seed=seeds.seed_value(seed) if dropout_p > 0 else None, x_dtype=x_dtype)
    return dx, dresidual if has_residual else None, dw, db


def _add_dropout_norm_fwd_twin_fake(x, residual, weight, bias, eps, is_rms, dropout_p, seed, seed_tensor,
                                    residual_dtype, y_dtype):
    empty = x.new_empty(0, dtype=torch.float32)
    return torch.empty_like(x, dtype=y_dtype), torch.empty_like(x, dtype=residual_dtype), empty, empty.clone()


@opaque_op("add_dropout_norm_fwd_twin", "(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, "
           "bool is_rms, float dropout_p, SymInt seed, Tensor? seed_tensor, ScalarType residual_dtype, "
           "ScalarType y_dtype) -> (Tensor, Tensor, Tensor, Tensor)", _add_dropout_norm_fwd_twin_fake)
def _add_dropout_norm_fwd_twin_op(x, residual, weight, bias, eps, is_rms, dropout_p, seed, seed_tensor,
                                  residual_dtype, y_dtype):
    """The twin's forward, run as it is when a compiled graph runs (``kernels._common.opaque``)."""
    y, residual_out, mean, rstd = _add_dropout_norm_fwd_twin(
        x, residual, weight, bias, eps, is_rms, dropout_p, seeds.seed_from_op_args(seed, seed_tensor),
        residual_dtype, y_dtype)
    return (torch.empty_like(x, dtype=y_dtype).copy_(y),
            torch.empty_like(x, dtype=residual_dtype).copy_(residual_out), mean.float(), rstd.float())


def _add_dropout_norm_bwd_twin_fake(dy, dresidual_out, residual_out, weight, eps, is_rms, dropout_p, seed,
                                    seed_tensor, x_dtype, has_residual):
    n = residual_out.shape[-1]
    dw_dtype = residual_out.dtype if weight is None else weight.dtype
    return (torch.empty_like(residual_out, dtype=x_dtype), torch.empty_like(residual_out),
            residual_out.new_empty(n if weight is not None else 0, dtype=dw_dtype),
            residual_out.new_empty(n if not is_rms else 0, dtype=dw_dtype))


@opaque_op("add_dropout_norm_bwd_twin", "(Tensor dy, Tensor? dresidual_out, Tensor residual_out, Tensor? weight, "
           "float eps, bool is_rms, float dropout_p, SymInt seed, Tensor? seed_tensor, ScalarType x_dtype, "
           "bool has_residual) -> (Tensor, Tensor, Tensor, Tensor)", _add_dropout_norm_bwd_twin_fake)
def _add_dropout_norm_bwd_twin_op(dy, dresidual_out, residual_out, weight, eps, is_rms, dropout_p, seed, seed_tensor,
                                  x_dtype, has_residual):
    """The twin's backward, run as it is when a compiled graph runs; every result a tensor of its own (an empty
    one where there is none): ``(dx, dresidual, dw, db)``."""
    dx, dresidual, dw, db = _add_dropout_norm_bwd_twin(
        dy, dresidual_out, residual_out, weight, eps, is_rms, dropout_p, seeds.seed_from_op_args(seed, seed_tensor),
        x_dtype, has_residual)
    fakes = _add_dropout_norm_bwd_twin_fake(dy, dresidual_out, residual_out, weight, eps, is_rms, dropout_p, seed,
                                            seed_tensor, x_dtype, has_residual)
    results = (dx, dresidual, dw if weight is not None else None, db if not is_rms else None)
    return tuple(fake if got is None else fake.copy_(got) for fake, got in zip(fakes, results, strict=True))


class _AddDropoutNormFunction(torch.autograd.Function):
    """Eager autograd of ``add_dropout_norm``: saves residual_out, the weight and the row statistics (fp32,
    M each); the dropout mask is drawn again from the seed in the backward."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, options):
        # the non-tensor arguments travel as one tuple: each argument of ``apply`` costs host time
        eps, is_rms, dropout_p, seed, residual_dtype, y_dtype, deterministic = options
        w, b = _flat(weight), _flat(bias)
        y, residual_out, mean, rstd = _add_dropout_norm_fwd_impl(x, residual, w, b, eps, is_rms, dropout_p, seed,
                                                                 residual_dtype, y_dtype)
        ctx.save_for_backward(residual_out, w, mean, rstd)
        ctx.args = (eps, is_rms, bias is not None, deterministic, dropout_p, seed, x.dtype, residual is not None)
        ctx.grad_dtypes = (torch.float32 if weight is None else weight.dtype,
                           torch.float32 if bias is None else bias.dtype)
        ctx.shapes = (x.shape, None if weight is None else weight.shape, None if bias is None else bias.shape)
        ctx.set_materialize_grads(False)
        return y, residual_out

    @staticmethod
    def backward(ctx, dy, dresidual_out):
        residual_out, w, mean, rstd = ctx.saved_tensors
        eps, is_rms, need_db, deterministic, dropout_p, seed, x_dtype, has_residual = ctx.args
        if dy is None:
            dy = torch.zeros_like(residual_out, dtype=x_dtype)  # y unused downstream
        dx, dresidual, dw, db = _add_dropout_norm_bwd_impl(
            dy, dresidual_out, residual_out, w, mean, rstd, eps, is_rms, need_db, deterministic, dropout_p, seed,
            x_dtype, has_residual, grad_dtypes=ctx.grad_dtypes)
        x_shape, w_shape, b_shape = ctx.shapes
        return (_shaped(dx, x_shape), _shaped(dresidual, x_shape), None if w is None else _shaped(dw, w_shape),
                _shaped(db, b_shape) if need_db else None, None)


@triton_op(f"{LIBRARY_NAMESPACE}::add_dropout_norm_fwd", mutates_args=())
def add_dropout_norm_fwd_op(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                            bias: torch.Tensor | None, eps: float, is_rms: bool, dropout_p: float, seed: int,
                            seed_tensor: torch.Tensor | None, residual_dtype: torch.dtype, y_dtype: torch.dtype,
                            deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Registered forward: ``(y, residual_out, mean, rstd)`` over the last dim (``deterministic`` is for the
    backward); ``seed`` as in ``fused_kernels::dropout``."""
    return _add_dropout_norm_fwd_impl(x, residual, weight, bias, eps, is_rms, dropout_p,
                                      seeds.seed_from_op_args(seed, seed_tensor), residual_dtype, y_dtype,
                                      traceable=True)


@triton_op(f"{LIBRARY_NAMESPACE}::add_dropout_norm_bwd", mutates_args=())
def add_dropout_norm_bwd_op(dy: torch.Tensor, dresidual_out: torch.Tensor, residual_out: torch.Tensor,
                            weight: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, eps: float,
                            is_rms: bool, need_db: bool, deterministic: bool, dropout_p: float, seed: int,
                            seed_tensor: torch.Tensor | None, x_dtype: torch.dtype,
                            has_residual: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Registered backward: ``(dx, dresidual, dw, db)`` (fp32 dw/db; empty where not needed)."""
    dx, dresidual, dw, db = _add_dropout_norm_bwd_impl(
        dy.contiguous(), dresidual_out, residual_out, weight, mean, rstd, eps, is_rms, need_db, deterministic,
        dropout_p, seeds.seed_from_op_args(seed, seed_tensor), x_dtype, has_residual, traceable=True)
    def empty():  # one per output: outputs of a registered op must not alias each other
        return torch.empty(0, device=residual_out.device)

    return (dx, empty() if dresidual is None else dresidual, empty() if weight is None else dw.float(),
            db.float() if need_db else empty())


def _add_dropout_norm_setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, is_rms, dropout_p, seed, seed_tensor, _, _, deterministic = inputs
    _, residual_out, mean, rstd = output
    ctx.save_for_backward(residual_out, weight, mean, rstd, seed_tensor)
    ctx.args = (eps, is_rms, bias is not None, deterministic, dropout_p, seed)
    ctx.dtypes = (x.dtype, None if bias is None else bias.dtype, residual is not None)
    ctx.mark_non_differentiable(mean, rstd)


def _add_dropout_norm_backward(ctx, dy, dresidual_out, _dmean, _drstd):
    residual_out, weight, mean, rstd, seed_tensor = ctx.saved_tensors
    eps, is_rms, need_db, deterministic, dropout_p, seed = ctx.args
    x_dtype, bias_dtype, has_residual = ctx.dtypes
    dx, dresidual, dw, db = torch.ops.fused_kernels.add_dropout_norm_bwd(
        dy, dresidual_out, residual_out, weight, mean, rstd, eps, is_rms, need_db, deterministic, dropout_p, seed,
        seed_tensor, x_dtype, has_residual)
    return (dx, dresidual if has_residual else None, None if weight is None else dw.to(weight.dtype),
            db.to(bias_dtype) if need_db else None, None, None, None, None, None, None, None, None)


add_dropout_norm_fwd_op.register_autograd(_add_dropout_norm_backward, setup_context=_add_dropout_norm_setup_context)


def add_dropout_norm(x: torch.Tensor, residual: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, *, kind: str = "layer", eps: float | None = None,
                     dropout_p: float = 0.0, seed: int | None = None, training: bool = True,
                     residual_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
                     deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm block's residual step in one kernel forward and one backward: ``(y, residual_out)`` with

    - ``residual_out = dropout(x, dropout_p, seed) + residual`` (``dropout(x)`` alone when ``residual`` is
      None), added in fp32 and rounded once to ``residual_dtype``: by default ``residual``'s dtype (``x``'s
      without one); ``torch.float32`` keeps the residual stream in fp32;
    - ``y = norm(residual_out) * weight + bias`` over the last dim, ``kind="layer"`` (LayerNorm) or ``"rms"``
      (RMSNorm, no bias), ``eps=None`` giving each norm's default (1e-5 for LayerNorm, as
      :func:`layer_norm`; torch's rule for RMSNorm, see :func:`rms_norm`), statistics in fp32
      from the rounded ``residual_out``, ``y`` in ``x``'s dtype; under CUDA autocast in fp32, as torch's
      norms give it (the dropout and the add keep their dtypes, as torch's do). ``out_dtype`` gives ``y``'s
      dtype instead, autocast or not: where ``y`` feeds a matmul that autocast runs in bf16 (a pre-norm block's
      next projection), ``out_dtype=torch.bfloat16`` gives that matmul the same input (fp32 rounded once to
      bf16) without writing fp32 and casting it in a kernel of its own, and its gradient comes back in bf16.

    The mask is the dropout family's: with the same ``seed`` it drops exactly the elements
    ``kernels.dropout.dropout(x, dropout_p, seed=seed)`` drops (``seed=None`` draws one from torch's
    generator). Nothing is stored for the backward but residual_out and two floats per row; the backward
    takes the gradients of both outputs and draws the mask again. ``dropout_p`` must be below 1;
    ``training=False`` skips the dropout. The twin is ``reference.layernorm.add_dropout_norm``.
    """
    plans = plans_apply()
    key = None
    if plans and plannable(seed, training, deterministic):
        key = (tensor_key(x), tensor_key(residual), tensor_key(weight), tensor_key(bias), kind, eps, type(eps),
               dropout_p, type(dropout_p), training, residual_dtype, out_dtype, deterministic,
               torch.is_grad_enabled(), autocast_key("cuda"), kernel_path_token(configs.PATH_ENV))
        plan = _ADD_DROPOUT_NORM_PLANS.get(key)
        if plan is not None:
            if native_active():
                native, seed = _native_add_dropout_norm(key, plan, x, residual, weight, bias, seed)
                if native is not None:
                    return native
            return _add_dropout_norm_run(plan, x, residual, weight, bias, seed, _apply_add_dropout_norm)
    check_tensor("x", x)
    check_float_dtype("x", x)
    if kind not in ("layer", "rms"):
        raise ValueError(f"kind must be 'layer' or 'rms', got {kind!r}")
    is_rms = kind == "rms"
    if is_rms and bias is not None:
        raise ValueError("bias must be None for kind='rms' (RMSNorm has no bias)")
    if x.dim() == 0:
        raise ValueError("x must have at least one dim (the normalized one)")
    n = x.shape[-1]
    if residual is not None:
        check_float_dtype("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {list(x.shape)}, got {list(residual.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_float_dtype(name, t)
            if tuple(t.shape) != (n,):
                raise ValueError(f"{name} must have shape [{n}] (x's last dim), got {list(t.shape)}")
    for name, dtype in (("residual_dtype", residual_dtype), ("out_dtype", out_dtype)):
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be one of {FLOAT_DTYPES} or None, got {dtype!r}")
    check_same_device(x=x, residual=residual, weight=weight, bias=bias)
    eps = twin.rms_norm_eps(eps, x.dtype) if is_rms else (1e-5 if eps is None else eps)
    eps = check_finite_number("eps", eps, minimum=0.0)
    dropout_p = check_probability("dropout_p", dropout_p, allow_one=False)
    seed = check_seed("seed", seed)
    backend_for(x)
    if not training:
        dropout_p = 0.0
    residual_dtype = residual_dtype or (x.dtype if residual is None else residual.dtype)
    # autocast: y comes out as torch's norm gives it (fp32 on CUDA); the dropout and the add keep their dtypes
    y_dtype = out_dtype or (x.dtype if x.dtype == torch.float64 else None) or autocast_dtype(
        "rms_norm" if is_rms else "layer_norm", x.device.type) or x.dtype
    if torch.compiler.is_compiling():
        seed = seeds.seed_for_call(seed, x.device) if dropout_p > 0 else 0
        y, residual_out, _, _ = torch.ops.fused_kernels.add_dropout_norm_fwd(
            x, residual, weight, bias, eps, is_rms, dropout_p, *seeds.op_seed_args(seed), residual_dtype, y_dtype,
            deterministic)
        return y, residual_out
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, residual, weight, bias))
    plan = (eps, is_rms, dropout_p, residual_dtype, y_dtype, deterministic, needs_grad)
    _ADD_DROPOUT_NORM_PLANS.put(key, plan)
    return _add_dropout_norm_run(plan, x, residual, weight, bias, seed,
                                 _apply_add_dropout_norm if plans else _AddDropoutNormFunction.apply)


#: checked eager calls (``kernels._common.eager``): plan key -> ``(eps, is_rms, dropout_p, residual_dtype, y_dtype,
#: deterministic, needs_grad)``
_ADD_DROPOUT_NORM_PLANS = PlanCache()
_apply_add_dropout_norm = function_apply(_AddDropoutNormFunction)


#: compiled-tier programs of ``add_dropout_norm`` (``kernels._native``) by (plan key, stream), or False
_NATIVE_ADD_DROPOUT_NORMS = PreparedCache()
#: the program each plan's calls last ran through (``kernels._native.last_program``)
_NATIVE_LAST_ADD_DROPOUT_NORMS = PreparedCache()


def _native_add_dropout_norm(key, plan: tuple, x, residual, weight, bias, seed: int | None) -> tuple:
    """``(outputs, seed)``: ``(y, residual_out)`` of a call through its compiled-tier program (built on the first call
    of its plan key and stream), or None where it has none (as :func:`_native_norm`; also rows too wide for the
    single-pass forward, whose norm is a second call), and the seed the Python path then takes (drawn here for
    None where the call drops anything; None inside CUDA graph capture, where nothing is drawn)."""
    tensors = [t for t in (x, residual, weight, bias) if t is not None]
    words = [0, 0]
    if plan[2] > 0:
        seed = seeds.host_seed(seed, x.device)
        if seed is None:
            return None, None
        words = list(seeds.key_words(seed))
    outputs = native_call_last(_NATIVE_LAST_ADD_DROPOUT_NORMS, plan, tensors, words)
    if outputs is not None:
        return tuple(outputs), seed
    if not (x.is_cuda and all(t.is_contiguous() for t in tensors)) or torch.cuda.is_current_stream_capturing():
        return None, seed
    stream = current_stream_handle(x.device)
    program = native_program_for(_NATIVE_ADD_DROPOUT_NORMS, (key, stream),
                                 lambda: _native_add_dropout_norm_program(x, residual, weight, bias, plan))
    if program is None:
        return None, seed
    outputs = native_module().run(program, tensors, words, stream)
    if outputs is None:
        return None, seed
    native_remember(_NATIVE_LAST_ADD_DROPOUT_NORMS, plan, program, tensors, stream)
    return tuple(outputs), seed


def _native_add_dropout_norm_program(x, residual, weight, bias, plan: tuple):
    """The compiled-tier program of an ``add_dropout_norm`` call, built as :func:`_native_norm_program` builds a
    norm's (seed 0: a program takes each call's seed words). The forward's tensors (``_add_dropout_norm_fwd_impl``):
    x, residual, residual_out, y, weight, bias, mean, rstd; the backward's are the norm backward's, its residual_out in
    x's place, the residual gradients in the fused op's two places."""
    eps, is_rms, dropout_p, residual_dtype, y_dtype, deterministic, needs_grad = plan
    native = native_module()
    w, b = _flat(weight), _flat(bias)
    with observed_calls() as seen:
        y, residual_out, mean, rstd = _add_dropout_norm_fwd_impl(x, residual, w, b, eps, is_rms, dropout_p, 0,
                                                                 residual_dtype, y_dtype)
    found = native_observed(seen, _ADD_DROPOUT_NORM_CALLS)
    if found is None or native_observed(seen, _NORM_FORWARD_CALLS) is not None:
        return None
    launches = native_launches(found[0], found[1], native)
    if launches is None:
        return None
    fwd = Refs(native)
    present = iter(range(4))
    x_ref, residual_ref, weight_ref, bias_ref = (
        fwd.of("INPUT", next(present)) if t is not None else fwd.none() for t in (x, residual, weight, bias))
    residual_out_ref, y_ref = fwd.alloc(x.shape, residual_out.dtype), fwd.alloc(x.shape, y.dtype)
    # RMSNorm has no mean: its empty tensor has no memory (address 0), so the program passes none, allocating nothing
    mean_ref = fwd.alloc(mean.shape, mean.dtype) if mean.numel() else fwd.none()
    rstd_ref = fwd.alloc(rstd.shape, rstd.dtype)
    program = native.Program(
        device=x.device, launches=launches, allocs=fwd.allocs, fixed=fwd.fixed,
        tensors=Refs.flat([x_ref, residual_ref, residual_out_ref, y_ref, weight_ref, bias_ref, mean_ref, rstd_ref]),
        outputs=Refs.flat([y_ref, residual_out_ref]),
        saved=Refs.flat([residual_out_ref, weight_ref, mean_ref, rstd_ref]))
    if not needs_grad:
        return program
    grad_dtypes = (torch.float32 if weight is None else weight.dtype, torch.float32 if bias is None else bias.dtype)
    with observed_calls() as seen:
        _add_dropout_norm_bwd_impl(torch.empty_like(y), torch.empty_like(residual_out), residual_out, w, mean, rstd,
                                   eps, is_rms, bias is not None, deterministic, dropout_p, 0, x.dtype,
                                   residual is not None, grad_dtypes=grad_dtypes)
    found = native_observed(seen, _NORM_BACKWARD_CALLS)
    launches = None if found is None else native_launches(found[0], found[1], native)
    if launches is None:
        return None
    _, _, dx, _, _, _, partial, locks, _, dresidual, dw, db = found[1]
    bwd = Refs(native)
    dx_ref = bwd.alloc(x.shape, dx.dtype)
    dresidual_ref = bwd.alloc(x.shape, dresidual.dtype) if residual is not None else bwd.none()
    dw_ref = bwd.alloc(weight.shape, dw.dtype) if weight is not None else bwd.none()
    db_ref = bwd.alloc(bias.shape, db.dtype) if bias is not None else bwd.none()
    program.set_backward(
        launches=launches, allocs=bwd.allocs, fixed=bwd.fixed,
        tensors=Refs.flat([bwd.of("SAVED", 0), bwd.of("GRAD", 0), dx_ref,
                           bwd.of("SAVED", 1) if weight is not None else bwd.none(), bwd.of("SAVED", 2),
                           bwd.of("SAVED", 3), bwd.hold(partial) if partial is not None else bwd.none(),
                           bwd.hold(locks) if locks is not None else bwd.none(), bwd.of("GRAD", 1), dresidual_ref,
                           dw_ref, db_ref]),
        grad_layouts=[native_layout(x.shape, y.dtype), native_layout(x.shape, residual_out.dtype)],
        input_grads=Refs.flat([ref for ref, t in ((dx_ref, x), (dresidual_ref, residual), (dw_ref, weight),
                                                  (db_ref, bias)) if t is not None]))
    return program


def _add_dropout_norm_run(plan: tuple, x, residual, weight, bias, seed: int | None, apply):
    """An eager call with its checked arguments ``plan``: the seed drawn (``seed=None``), then the autograd
    Function through ``apply``, or the forward alone when nothing needs a gradient."""
    eps, is_rms, dropout_p, residual_dtype, y_dtype, deterministic, needs_grad = plan
    seed = seeds.seed_for_call(seed, x.device) if dropout_p > 0 else 0
    if needs_grad:
        return apply(x, residual, weight, bias, (eps, is_rms, dropout_p, seed, residual_dtype, y_dtype, deterministic))
    y, residual_out, _, _ = _add_dropout_norm_fwd_impl(x, residual, _flat(weight), _flat(bias), eps, is_rms,
                                                       dropout_p, seed, residual_dtype, y_dtype)
    return y, residual_out
