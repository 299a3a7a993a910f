"""Fused LayerNorm / RMSNorm in Triton: forward, backward, and the dW/dB reduction.

Implements:
- ``_layer_norm_fwd_kernel``: per row, mean and 1/std in fp32; writes y, mean, rstd. Register path:
  a ``BLOCK_M x BLOCK_N`` tile holds several short rows at once (``AFFINE_FIRST``, ``STREAM_HINTS``: load and
  cache variants, TUNING.md). Chunked path
  (rows wider than one tile): persistent programs, as many as keep their rows in flight within half of L2;
  pass 1 merges per-chunk mean and M2 (Chan, Golub and LeVeque's parallel variance), pass 2 re-reads the row
  from L2 (last chunk first) and writes y.
- ``_layer_norm_bwd_kernel`` (rows up to one tile): programs own contiguous row ranges; each computes
  dx for its rows and sums its rows' ``dy * xhat`` / ``dy`` in fp32 registers, then adds that partial
  into one of ``GROUP_SIZE_M`` fp32 buffers under a spin lock (``atomic_cas`` to take, ``atomic_xchg``
  on a first-write flag, a barrier, ``atomic_xchg`` to release). ``DETERMINISTIC`` gives each program
  its own buffer: no lock, and the fixed-order sum below makes dW/dB bitwise reproducible.
- Wider rows cannot keep a partial row of dW in registers, so ``_layer_norm_bwd_split_row_kernel``
  splits each row between programs: a program owns a column block and a lane of row tiles, loads its
  part of a tile once, stores its share of the row sums ``mean(g)`` and ``mean(g * xhat)``, waits until
  every column block has stored its share (an arrival count per tile; all programs resident at once
  through a cooperative launch), then writes dx and sums dW/dB for its columns in registers, one
  exclusive buffer per lane (deterministic in both modes): 3 passes of M*N. The same kernel in two
  launches (shares, then the rest) reads x and dy twice (5 passes): the interpreter's path and the fallback
  when the grid cannot be resident at once. The fused residual + dropout + norm backward runs in it too.
- ``_layer_norm_bwd_dwdb_kernel``: sums the buffers in buffer order into dW and dB, and zeroes the locked
  backward's first-write flags (one lock buffer per stream, never zeroed by a launch of its own).
- ``_add_dropout_norm_fwd_kernel``: the pre-norm block's ``residual_out = dropout(x) + residual``, then its
  norm, in one program, with the mask of ``kernels.dropout.dropout``. ``CHUNK_TILE`` (power-of-two rows,
  tiles of whole dropout chunks): one pass, the mask drawn in the tile's layout (``tile_keep_factor``).
  Otherwise pass 1 walks the rows as the dropout family's flat chunks (``_dropout_add_span``) and pass 2
  re-reads them from L2 as rows (``_norm_tile_fwd``). Its backward is ``_layer_norm_bwd_kernel`` with
  ``HAS_DRES`` (add the residual stream's gradient), ``STORE_DR`` (store it for the residual) and
  ``DROPOUT`` (the mask on each tile's dx: in registers with ``CHUNK_TILE``, else a flat pass over the
  tile re-read from L2, which stops the row loop's pipelining).
RMSNorm is the same code with ``IS_RMS`` (no mean, no bias). Row statistics divide with ``tl.div_rn`` (exact:
with N = 1 the default approximate ``/`` left dx nonzero where it must be exactly 0).

Derived from the Triton tutorials' fused LayerNorm (locked partial buffers); here fp32, many rows per program.

Trade-off: one locked add per program keeps lock traffic negligible; the buffers cost
``GROUP_SIZE_M * N * 8`` bytes, and the deterministic layout ``programs * N * 8`` (more traffic for the
final sum, no waiting on locks). Limits: rows must be contiguous along N (the launcher copies otherwise).
"""

import triton
import triton.language as tl

from kernels._common.philox import (
    LANE_STRIDE,
    chunk_words,
    chunks_keep_factor,
    element_keep_factor,
    philox_key,
    scaled_where_kept,
    tile_keep_factor,
    times_factor,
)


@triton.jit
def _load_affine(w_ptr, b_ptr, cols, N, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 STREAM_HINTS: tl.constexpr = False):
    """``(w, b)`` over ``cols`` in fp32 (zeros, never read, where the norm has none). ``STREAM_HINTS``: kept in L2
    as long as possible (every program reads them, while each row is read once)."""
    w = tl.zeros(cols.shape, tl.float32)
    b = tl.zeros(cols.shape, tl.float32)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0,
                    eviction_policy="evict_last" if STREAM_HINTS else "").to(tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=cols < N, other=0.0,
                    eviction_policy="evict_last" if STREAM_HINTS else "").to(tl.float32)
    return w, b


@triton.jit
def _affine_store(xhat, y_rows, w, b, cols, mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``y = xhat * w + b`` over ``cols`` (fp32; ``w``, ``b`` from ``_load_affine``), stored in y's dtype at row
    pointers ``y_rows``."""
    y = xhat
    if HAS_WEIGHT:
        y = y * w[None, :]
    if HAS_BIAS:
        y = y + b[None, :]
    tl.store(y_rows + cols[None, :], y.to(y_rows.dtype.element_ty), mask=mask)


@triton.jit
def _store_row_stats(mean_ptr, rstd_ptr, rows, row_mask, mean, rstd, IS_RMS: tl.constexpr):
    if not IS_RMS:
        tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _row_sum_of_squares(v):
    """``sum(v * v)`` along axis 1 with every product rounded before the cross-lane adds.

    Triton reduces a row across lanes with butterfly shuffles. Left to itself the compiler contracts a
    lane's own ``v * v`` into the first shuffle add (``fma(v, v, partner_partial)``), so the lanes of
    one row round differently and end up holding statistics one ulp apart; the statistic store then
    writes those copies to one shared-memory address (racecheck: a write-write hazard with different
    values), and the columns of a row are normalized with different 1/std. ``fma(v, v, 0.0)`` is the
    rounded square (a square is never -0), which the compiler cannot contract further.
    """
    return tl.sum(tl.fma(v, v, 0.0), axis=1)


@triton.jit
def _norm_tile_fwd(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, row0, M, N, stride_x_row, stride_y_row, eps,
                   IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, AFFINE_FIRST: tl.constexpr = False, STREAM_HINTS: tl.constexpr = False):
    """Rows ``row0 .. row0 + BLOCK_M`` held in registers (``BLOCK_N >= N``): statistics, y, mean and rstd.
    ``AFFINE_FIRST``: w and b are loaded with the rows, so that their latency is not paid after the row
    reductions (whose barriers no load crosses); it holds them in registers meanwhile. ``STREAM_HINTS``: the rows
    leave L2 first, w and b last."""
    cols = tl.arange(0, BLOCK_N)
    rows = row0 + tl.arange(0, BLOCK_M)
    mask = (rows < M)[:, None] & (cols[None, :] < N)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0,
                eviction_policy="evict_first" if STREAM_HINTS else "")
    w = None  # loaded after the reductions (_norm_rows_fwd)
    b = None
    if AFFINE_FIRST:
        w, b = _load_affine(w_ptr, b_ptr, cols, N, HAS_WEIGHT, HAS_BIAS, STREAM_HINTS)
    _norm_rows_fwd(x.to(tl.float32), y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, rows, M, N, stride_y_row, eps, IS_RMS,
                   HAS_WEIGHT, HAS_BIAS, BLOCK_N, w, b, AFFINE_FIRST)


@triton.jit
def _norm_rows_fwd(x, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, rows, M, N, stride_y_row, eps, IS_RMS: tl.constexpr,
                   HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, w=None, b=None,
                   AFFINE_LOADED: tl.constexpr = False):
    """The norm of rows ``rows`` already in registers (``x`` fp32, 0 outside the rows): y, mean, rstd. ``w`` and
    ``b`` come loaded when ``AFFINE_LOADED``, else they are loaded here, after the reductions."""
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols[None, :] < N)
    if IS_RMS:
        mean = tl.zeros(rows.shape, dtype=tl.float32)
        xc = x
    else:
        mean = tl.div_rn(tl.sum(x, axis=1), N * 1.0)
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.div_rn(_row_sum_of_squares(xc), N * 1.0) + eps)
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * stride_y_row
    if not AFFINE_LOADED:
        w, b = _load_affine(w_ptr, b_ptr, cols, N, HAS_WEIGHT, HAS_BIAS)
    _affine_store(xc * rstd[:, None], y_rows, w, b, cols, mask, HAS_WEIGHT, HAS_BIAS)
    _store_row_stats(mean_ptr, rstd_ptr, rows, row_mask, mean, rstd, IS_RMS)


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr,  # (M, N) input, row stride stride_x_row, unit column stride
    y_ptr,  # (M, N) output, row stride stride_y_row
    w_ptr,  # (N,) weight (any float dtype) or a dummy when HAS_WEIGHT is False
    b_ptr,  # (N,) bias or a dummy when HAS_BIAS is False
    mean_ptr,  # (M,) fp32 mean (not written for RMSNorm)
    rstd_ptr,  # (M,) fp32 1/std
    M,
    N,
    stride_x_row,
    stride_y_row,
    eps,
    IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_PASS: tl.constexpr,  # BLOCK_N >= N: the rows stay in registers
    LOOP_STAGES: tl.constexpr = 1,  # software-pipelining depth of the chunked path's two loops
    AFFINE_FIRST: tl.constexpr = False,  # register path: w and b loaded with the rows (see _norm_tile_fwd)
    STREAM_HINTS: tl.constexpr = False,  # register path: L2 eviction hints (rows first out, w and b last)
):
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_PASS:
        _norm_tile_fwd(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, tl.program_id(0) * BLOCK_M, M, N,
                       stride_x_row, stride_y_row, eps, IS_RMS, HAS_WEIGHT, HAS_BIAS, BLOCK_M, BLOCK_N, AFFINE_FIRST,
                       STREAM_HINTS)
    else:
        # Persistent programs (the launcher sizes the grid so that the rows in flight fit in L2): pass 2
        # re-reads each row from L2, last chunk first (the most recently read).
        n_chunks = tl.cdiv(N, BLOCK_N)
        for row0 in range(tl.program_id(0) * BLOCK_M, M, tl.num_programs(0) * BLOCK_M):
            rows = row0 + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_row
            y_rows = y_ptr + rows.to(tl.int64)[:, None] * stride_y_row
            mean = tl.zeros([BLOCK_M], dtype=tl.float32)
            m2 = tl.zeros([BLOCK_M], dtype=tl.float32)  # sum of squared deviations (sum of squares for RMS)
            for start in tl.range(0, N, BLOCK_N, num_stages=LOOP_STAGES):
                c = start + cols
                mask = row_mask[:, None] & (c[None, :] < N)
                x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
                if IS_RMS:
                    m2 += _row_sum_of_squares(x)
                else:
                    count_b = tl.minimum(N - start, BLOCK_N).to(tl.float32)
                    count_a = tl.cast(start, tl.float32)
                    mean_b = tl.sum(x, axis=1) / count_b
                    xc = tl.where(mask, x - mean_b[:, None], 0.0)
                    delta = mean_b - mean
                    total = count_a + count_b
                    mean = mean + delta * (count_b / total)
                    m2 = m2 + _row_sum_of_squares(xc) + delta * delta * (count_a * count_b / total)
            rstd = 1.0 / tl.sqrt(tl.div_rn(m2, N * 1.0) + eps)
            for i in tl.range(0, n_chunks, num_stages=LOOP_STAGES):
                c = (n_chunks - 1 - i) * BLOCK_N + cols
                mask = row_mask[:, None] & (c[None, :] < N)
                x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
                w, b = _load_affine(w_ptr, b_ptr, c, N, HAS_WEIGHT, HAS_BIAS)
                _affine_store((x - mean[:, None]) * rstd[:, None], y_rows, w, b, c, mask, HAS_WEIGHT, HAS_BIAS)
            _store_row_stats(mean_ptr, rstd_ptr, rows, row_mask, mean, rstd, IS_RMS)


@triton.jit
def _dropout_add_span(src_ptr, res_ptr, out_ptr, start, end, k0, k1, threshold, scale, HAS_RESIDUAL: tl.constexpr,
                      DROPOUT: tl.constexpr):
    """``out[i] = dropout(src[i]) (+ res[i])`` for the flat elements ``start <= i < end`` of contiguous
    tensors, walked in the dropout family's chunks (four runs of ``LANE_STRIDE``, one Philox call per
    four elements): the mask is ``kernels.dropout.dropout``'s for ``src``'s shape. The dropped value is
    rounded to ``src``'s dtype, as that kernel stores it, before the fp32 add; the sum is rounded once to
    ``out``'s dtype. A chunk cut by ``start`` or ``end`` is drawn whole and stored in part."""
    lane = tl.arange(0, LANE_STRIDE)
    first = start // (4 * LANE_STRIDE)  # int64, as start
    for step in range(0, tl.cdiv(end, 4 * LANE_STRIDE) - first):
        chunk = first + step
        base = chunk * (4 * LANE_STRIDE)
        offs0 = base + lane
        offs1 = offs0 + LANE_STRIDE
        offs2 = offs1 + LANE_STRIDE
        offs3 = offs2 + LANE_STRIDE
        in0 = (offs0 >= start) & (offs0 < end)
        in1 = (offs1 >= start) & (offs1 < end)
        in2 = (offs2 >= start) & (offs2 < end)
        in3 = (offs3 >= start) & (offs3 < end)
        v0 = tl.load(src_ptr + offs0, mask=in0, other=0.0)
        v1 = tl.load(src_ptr + offs1, mask=in1, other=0.0)
        v2 = tl.load(src_ptr + offs2, mask=in2, other=0.0)
        v3 = tl.load(src_ptr + offs3, mask=in3, other=0.0)
        if DROPOUT:
            w0, w1, w2, w3 = chunk_words(chunk, k0, k1)
            v0 = scaled_where_kept(v0, w0, threshold, scale, HAS_RESIDUAL).to(src_ptr.dtype.element_ty)
            v1 = scaled_where_kept(v1, w1, threshold, scale, HAS_RESIDUAL).to(src_ptr.dtype.element_ty)
            v2 = scaled_where_kept(v2, w2, threshold, scale, HAS_RESIDUAL).to(src_ptr.dtype.element_ty)
            v3 = scaled_where_kept(v3, w3, threshold, scale, HAS_RESIDUAL).to(src_ptr.dtype.element_ty)
        v0 = v0.to(tl.float32)
        v1 = v1.to(tl.float32)
        v2 = v2.to(tl.float32)
        v3 = v3.to(tl.float32)
        if HAS_RESIDUAL:
            v0 += tl.load(res_ptr + offs0, mask=in0, other=0.0).to(tl.float32)
            v1 += tl.load(res_ptr + offs1, mask=in1, other=0.0).to(tl.float32)
            v2 += tl.load(res_ptr + offs2, mask=in2, other=0.0).to(tl.float32)
            v3 += tl.load(res_ptr + offs3, mask=in3, other=0.0).to(tl.float32)
        out_ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + offs0, v0.to(out_ty), mask=in0)
        tl.store(out_ptr + offs1, v1.to(out_ty), mask=in1)
        tl.store(out_ptr + offs2, v2.to(out_ty), mask=in2)
        tl.store(out_ptr + offs3, v3.to(out_ty), mask=in3)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "seed_in_memory", "threshold"])
def _add_dropout_norm_fwd_kernel(
    x_ptr,  # (M, N) contiguous input of the dropout
    res_ptr,  # (M, N) contiguous residual, or a dummy without HAS_RESIDUAL
    rout_ptr,  # (M, N) contiguous output: dropout(x) + residual, in the residual stream's dtype
    y_ptr,  # (M, N) contiguous output: norm(residual_out) * w + b (x's dtype; fp32 under CUDA autocast)
    w_ptr, b_ptr, mean_ptr, rstd_ptr,  # as _layer_norm_fwd_kernel
    M,
    N,
    eps,
    seed_lo, seed_hi, seed_ptr, seed_in_memory,  # the dropout seed (see kernels._common.philox.philox_key)
    threshold,  # keep iff word >= threshold
    scale,  # 1 / (1 - p), fp32
    IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    NORM: tl.constexpr,  # False: only residual_out (rows wider than one tile go to the chunked norm after)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK_TILE: tl.constexpr = False,  # N == BLOCK_N and the tile is whole dropout chunks: one pass
):
    """Rows ``pid * BLOCK_M ..``. ``CHUNK_TILE``: one pass over the tile, the mask drawn in the rows' layout
    (``tile_keep_factor``). Otherwise pass 1 writes their residual_out in the dropout layout and pass 2
    reads the same rows back (from L2: this program wrote them a moment ago) and normalises them."""
    row0 = tl.program_id(0) * BLOCK_M
    k0, k1 = philox_key(seed_lo, seed_hi, seed_ptr, seed_in_memory)
    if CHUNK_TILE:
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        mask = (rows < M)[:, None] & (cols[None, :] < N)
        v = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if DROPOUT:
            factor = tile_keep_factor(row0, N, k0, k1, tl.cast(threshold, tl.uint32), tl.cast(scale, tl.float32),
                                      BLOCK_M, BLOCK_N)
            # rounded to x's dtype, as the dropout kernel stores it, before the fp32 add
            v = times_factor(v, factor, HAS_RESIDUAL).to(x_ptr.dtype.element_ty)
        v = v.to(tl.float32)
        if HAS_RESIDUAL:
            v += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = v.to(rout_ptr.dtype.element_ty)
        tl.store(rout_ptr + offs, r, mask=mask)
        _norm_rows_fwd(r.to(tl.float32), y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, rows, M, N, N, eps, IS_RMS,
                       HAS_WEIGHT, HAS_BIAS, BLOCK_N)
    else:
        start = row0.to(tl.int64) * N
        end = tl.minimum(row0 + BLOCK_M, M).to(tl.int64) * N
        _dropout_add_span(x_ptr, res_ptr, rout_ptr, start, end, k0, k1, tl.cast(threshold, tl.uint32),
                          tl.cast(scale, tl.float32), HAS_RESIDUAL, DROPOUT)
        if NORM:
            # pass 2 reads what other threads of this program stored in pass 1: the barrier orders them
            tl.debug_barrier()
            _norm_tile_fwd(rout_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, row0, M, N, N, N, eps, IS_RMS,
                           HAS_WEIGHT, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit
def _add_partial(
    partial_ptr,  # (slots, 2, N) fp32: row 0 of a slot is dW's partial, row 1 dB's
    lock_ptr,  # (locks,) int32, zero on entry
    count_ptr,  # (locks,) int32 first-write flags, zero on entry
    slot,
    lock_index,
    cols,
    col_mask,
    dw,
    db,
    N,
    DETERMINISTIC: tl.constexpr,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
):
    """Add partial ``dw``/``db`` (fp32, over ``cols``) into buffer ``slot`` (with DETERMINISTIC the slot is
    this program's own: a plain store)."""
    dw_ptrs = partial_ptr + slot.to(tl.int64) * 2 * N + cols
    db_ptrs = dw_ptrs + N
    if not DETERMINISTIC:
        while tl.atomic_cas(lock_ptr + lock_index, 0, 1) == 1:
            pass
        # The first holder of a lock stores; later holders add. xchg reads and sets the flag at once.
        if tl.atomic_xchg(count_ptr + lock_index, 1) != 0:
            # .cg: read the previous holder's stores from L2, never from a stale L1 line.
            if NEED_DW:
                dw += tl.load(dw_ptrs, mask=col_mask, other=0.0, cache_modifier=".cg")
            if NEED_DB:
                db += tl.load(db_ptrs, mask=col_mask, other=0.0, cache_modifier=".cg")
    if NEED_DW:
        tl.store(dw_ptrs, dw, mask=col_mask)
    if NEED_DB:
        tl.store(db_ptrs, db, mask=col_mask)
    if not DETERMINISTIC:
        # Every thread's store must be done before the lock is released.
        tl.debug_barrier()
        tl.atomic_xchg(lock_ptr + lock_index, 0)


@triton.jit
def _bwd_tile(x_ptr, dy_ptr, mean_ptr, rstd_ptr, w, rows, rows64, row_mask, cols, mask, stride_x_row,
              stride_dy_row, IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """One (rows x cols) tile of the backward in fp32: ``dy``, ``xhat`` (0 outside the tile), ``g = dy * w``
    and the rows' ``rstd``. ``w`` is the columns' weight in fp32 (ignored without HAS_WEIGHT)."""
    x = tl.load(x_ptr + rows64 * stride_x_row + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(dy_ptr + rows64 * stride_dy_row + cols[None, :], mask=mask, other=0.0)
    return _bwd_tile_values(x, dy, mean_ptr, rstd_ptr, w, rows, row_mask, mask, IS_RMS, HAS_WEIGHT)


@triton.jit
def _bwd_tile_values(x, dy, mean_ptr, rstd_ptr, w, rows, row_mask, mask, IS_RMS: tl.constexpr,
                     HAS_WEIGHT: tl.constexpr):
    """:func:`_bwd_tile` on a tile's x and dy as loaded (any float dtype)."""
    x = x.to(tl.float32)
    dy = dy.to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    if IS_RMS:
        xhat = x * rstd[:, None]
    else:
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    if HAS_WEIGHT:
        # A select, not a bare product: `g - c1` must not contract to fma(dy, w, -c1), whose unrounded
        # product leaves dx = ulp * rstd where it must be 0 (N = 1, constant rows).
        g = tl.where(mask, dy * w[None, :], 0.0)
    else:
        g = dy
    return dy, xhat, g, rstd


@triton.jit
def _dx_from_row_terms(g, xhat, rstd, c1, c2, IS_RMS: tl.constexpr):
    """``dx = rstd * (g - c1 - xhat * c2)`` with the row means ``c1 = mean(g)``, ``c2 = mean(g * xhat)``;
    RMSNorm has no mean to subtract, so no ``c1``."""
    if IS_RMS:
        return (g - xhat * c2[:, None]) * rstd[:, None]
    return (g - c1[:, None] - xhat * c2[:, None]) * rstd[:, None]


@triton.jit
def _layer_norm_bwd_kernel(
    x_ptr,  # (M, N) forward input, row stride stride_x_row
    dy_ptr,  # (M, N) upstream gradient, row stride stride_dy_row
    dx_ptr,  # (M, N) output gradient, row stride stride_dx_row
    w_ptr,  # (N,) weight or dummy
    mean_ptr,  # (M,) fp32 (unused for RMSNorm)
    rstd_ptr,  # (M,) fp32
    partial_ptr,  # (slots, 2, N) fp32 partial dW/dB buffers
    lock_ptr,  # (2 * group_size_m,) int32, zero on entry: the spin locks, then the first-write flags
    M,
    N,
    stride_x_row,
    stride_dy_row,
    stride_dx_row,
    rows_per_program,
    group_size_m,  # buffers shared through locks (ignored when DETERMINISTIC)
    # The fused residual + dropout + norm backward (all unused by the plain norms; dx contiguous there):
    dres_ptr,  # (M, N) contiguous gradient reaching residual_out from later blocks (HAS_DRES)
    dr_ptr,  # (M, N) contiguous output: dr = norm's dx + dres, the residual's gradient (STORE_DR)
    seed_lo, seed_hi, seed_ptr, seed_in_memory, threshold, scale,  # dropout of dx (DROPOUT)
    IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    NEED_DB: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOOP_STAGES: tl.constexpr = 1,  # software-pipelining depth of the row loop (loads of the next tiles in flight)
    HAS_DRES: tl.constexpr = False,
    STORE_DR: tl.constexpr = False,
    DROPOUT: tl.constexpr = False,
    CHUNK_TILE: tl.constexpr = False,  # N == BLOCK_N and each tile is whole dropout chunks
):
    """Rows up to one tile wide: dx, and one locked add of this program's partial dW/dB. Fused
    residual + dropout + norm: ``dr = dx + dres`` is stored as the residual's gradient (``STORE_DR``), and
    ``dx = dropout(dr)`` in x's dtype (``DROPOUT``). With ``CHUNK_TILE`` the mask is drawn in the tile's
    own layout (``tile_keep_factor``); otherwise each tile's dr goes to ``dx_ptr``, then a flat pass over the
    tile's elements (read back from L2) applies the mask in place."""
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = row_start + rows_per_program  # the last program's range may pass M: rows are masked
    slot = pid if DETERMINISTIC else pid % group_size_m
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        w = tl.zeros([BLOCK_N], dtype=tl.float32)  # never read
    # Accumulate a whole tile per row slot and reduce over rows once at the end: a tl.sum(axis=0) per
    # iteration would cross warps (shared memory and a barrier) on every tile.
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if DROPOUT:
        k0, k1 = philox_key(seed_lo, seed_hi, seed_ptr, seed_in_memory)
    for r0 in tl.range(row_start, row_end, BLOCK_M, num_stages=LOOP_STAGES):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_mask = (rows < row_end) & (rows < M)
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        dy, xhat, g, rstd = _bwd_tile(x_ptr, dy_ptr, mean_ptr, rstd_ptr, w, rows, rows64, row_mask, cols, mask,
                                      stride_x_row, stride_dy_row, IS_RMS, HAS_WEIGHT)
        c1 = tl.div_rn(tl.sum(g, axis=1), N * 1.0)  # unused (compiled away) for RMSNorm
        c2 = tl.div_rn(tl.sum(g * xhat, axis=1), N * 1.0)
        dx = _dx_from_row_terms(g, xhat, rstd, c1, c2, IS_RMS)
        if HAS_DRES:
            dx += tl.load(dres_ptr + rows64 * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if STORE_DR:
            tl.store(dr_ptr + rows64 * N + cols[None, :], dx.to(dr_ptr.dtype.element_ty), mask=mask)
        if DROPOUT and CHUNK_TILE:
            factor = tile_keep_factor(r0, N, k0, k1, tl.cast(threshold, tl.uint32), tl.cast(scale, tl.float32),
                                      BLOCK_M, BLOCK_N)
            dx = times_factor(dx.to(dx_ptr.dtype.element_ty), factor)
        tl.store(dx_ptr + rows64 * stride_dx_row + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if DROPOUT and not CHUNK_TILE:
            tl.debug_barrier()  # the flat pass reads what other threads just stored
            # tl.cast, not .to: the interpreter's loop variable is a Python int
            tile_end = tl.cast(tl.minimum(tl.minimum(r0 + BLOCK_M, row_end), M), tl.int64) * N
            _dropout_add_span(dx_ptr, dx_ptr, dx_ptr, tl.cast(r0, tl.int64) * N, tile_end, k0, k1,
                              tl.cast(threshold, tl.uint32), tl.cast(scale, tl.float32), False, True)
        if HAS_WEIGHT:
            dw_acc += dy * xhat
        if NEED_DB:
            db_acc += dy
    if HAS_WEIGHT or NEED_DB:
        if DETERMINISTIC:
            count_ptr = lock_ptr  # no locks: never read
        else:
            count_ptr = lock_ptr + group_size_m
        _add_partial(partial_ptr, lock_ptr, count_ptr, slot, slot, cols, col_mask, tl.sum(dw_acc, axis=0),
                     tl.sum(db_acc, axis=0), N,
                     DETERMINISTIC, HAS_WEIGHT, NEED_DB)


@triton.jit
def _split_row_load(x_ptr, dy_ptr, tile, M, N, stride_x_row, stride_dy_row, cols, col_mask, BLOCK_M: tl.constexpr):
    """Row tile ``tile``'s part of x and dy, as stored (16-bit values take half the registers of fp32 while
    the tile waits), masked past M (a tile past the last loads nothing)."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows < M)[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_x_row + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(dy_ptr + rows64 * stride_dy_row + cols[None, :], mask=mask, other=0.0)
    return x, dy


@triton.jit
def _split_row_publish(x, dy, tile, block, w, mean_ptr, rstd_ptr, terms_ptr, arrivals_ptr, M, col_mask,
                       IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                       COL_BLOCKS: tl.constexpr, ARRIVE: tl.constexpr):
    """Store this column block's share of the tile's row sums of ``g`` and ``g * xhat``; with ``ARRIVE``, count
    the block in the tile's arrivals once every thread's stores are done (release: the shares are visible to
    whoever acquires the count)."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    mask = row_mask[:, None] & col_mask[None, :]
    _, xhat, g, _ = _bwd_tile_values(x, dy, mean_ptr, rstd_ptr, w, rows, row_mask, mask, IS_RMS, HAS_WEIGHT)
    term_ptrs = terms_ptr + rows * COL_BLOCKS + block
    tl.store(term_ptrs, tl.sum(g, axis=1), mask=row_mask)
    tl.store(term_ptrs + M * COL_BLOCKS, tl.sum(g * xhat, axis=1), mask=row_mask)
    if ARRIVE:
        tl.debug_barrier()
        tl.atomic_add(arrivals_ptr + tile, 1, sem="release", scope="gpu")


@triton.jit
def _split_row_finish(x, dy, tile, block, w, dw_acc, db_acc, dx_ptr, mean_ptr, rstd_ptr, terms_ptr, arrivals_ptr,
                      dres_ptr, dr_ptr, k0, k1, threshold, scale, M, N, stride_dx_row, cols, col_mask,
                      IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, NEED_DB: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, COL_BLOCKS: tl.constexpr, SHARES: tl.constexpr, WAIT: tl.constexpr,
                      HAS_DRES: tl.constexpr, STORE_DR: tl.constexpr, DROPOUT: tl.constexpr,
                      CHUNK_COLUMNS: tl.constexpr):
    """With every block's share of the tile's row sums stored (``WAIT``: acquire the arrival count until all
    have come), sum them in block order, write the tile's dx (and the fused op's extras) and add its dW/dB
    terms to ``dw_acc``/``db_acc``, which are returned."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    dy, xhat, g, rstd = _bwd_tile_values(x, dy, mean_ptr, rstd_ptr, w, rows, row_mask, mask, IS_RMS, HAS_WEIGHT)
    if HAS_WEIGHT:
        dw_acc += tl.sum(dy * xhat, axis=0)
    if NEED_DB:
        db_acc += tl.sum(dy, axis=0)
    if WAIT:
        while tl.atomic_add(arrivals_ptr + tile, 0, sem="acquire", scope="gpu") < COL_BLOCKS:
            pass
    share = tl.arange(0, SHARES)[None, :]
    shares = terms_ptr + rows[:, None] * COL_BLOCKS + share
    share_mask = row_mask[:, None] & (share < COL_BLOCKS)
    # .cg: the other programs' shares, from L2 (never a stale L1 line)
    c1 = tl.div_rn(tl.sum(tl.load(shares, mask=share_mask, other=0.0, cache_modifier=".cg"), axis=1), N * 1.0)
    c2 = tl.div_rn(tl.sum(tl.load(shares + M * COL_BLOCKS, mask=share_mask, other=0.0, cache_modifier=".cg"),
                          axis=1), N * 1.0)
    dx = _dx_from_row_terms(g, xhat, rstd, c1, c2, IS_RMS)
    flat = rows64 * N + cols[None, :]
    if HAS_DRES:
        dx += tl.load(dres_ptr + flat, mask=mask, other=0.0).to(tl.float32)
    if STORE_DR:
        tl.store(dr_ptr + flat, dx.to(dr_ptr.dtype.element_ty), mask=mask)
    if DROPOUT:
        if CHUNK_COLUMNS:
            factor = chunks_keep_factor(rows.to(tl.int64) * COL_BLOCKS + block, k0, k1, threshold, scale, BLOCK_M,
                                        BLOCK_N)
        else:
            factor = element_keep_factor(flat, k0, k1, threshold, scale)
        dx = times_factor(dx.to(dx_ptr.dtype.element_ty), factor)
    tl.store(dx_ptr + rows64 * stride_dx_row + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    return dw_acc, db_acc


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "seed_in_memory", "threshold"])
def _layer_norm_bwd_split_row_kernel(
    x_ptr,  # (M, N) forward input, row stride stride_x_row
    dy_ptr,  # (M, N) upstream gradient, row stride stride_dy_row
    dx_ptr,  # (M, N) output gradient, row stride stride_dx_row
    w_ptr,  # (N,) weight or dummy
    mean_ptr,  # (M,) fp32 (unused for RMSNorm)
    rstd_ptr,  # (M,) fp32
    terms_ptr,  # (2, M, COL_BLOCKS) fp32: each row's sum of g and of g * xhat over each column block
    arrivals_ptr,  # (row tiles,) int32, zero on entry: column blocks done with each tile's terms (PHASE 0)
    partial_ptr,  # (lanes, 2, N) fp32: one exclusive dW/dB slot per lane of row tiles
    M,
    N,
    stride_x_row,
    stride_dy_row,
    stride_dx_row,
    # The fused residual + dropout + norm backward, as in _layer_norm_bwd_kernel (dx, dres, dr contiguous):
    dres_ptr,
    dr_ptr,
    seed_lo, seed_hi, seed_ptr, seed_in_memory, threshold, scale,
    IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    NEED_DB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COL_BLOCKS: tl.constexpr,  # cdiv(N, BLOCK_N), the grid's first axis
    SHARES: tl.constexpr,  # COL_BLOCKS rounded up to a power of two
    PHASE: tl.constexpr,  # 0: one launch, shares exchanged between programs; 1: shares only; 2: the rest
    HAS_DRES: tl.constexpr = False,
    STORE_DR: tl.constexpr = False,
    DROPOUT: tl.constexpr = False,
    CHUNK_COLUMNS: tl.constexpr = False,  # each row of a column block is one whole dropout chunk
):
    """Wide rows: program (column block, lane) takes row tiles ``lane, lane + lanes, ...`` of its columns.

    ``PHASE`` 0: each tile's share of the row sums is published (stores, then an arrival count per tile) an
    iteration before the tile is finished. Iteration ``t`` issues the loads of tile ``t + lanes``, finishes
    tile ``t`` (waits for its count, adds the shares, writes dx with the fused op's extras, sums dW/dB for
    its columns in registers) while they are in flight, then publishes tile ``t + lanes``.
    x and dy are read once: 3 passes of M * N. Every program must be resident at once (the launcher uses a
    cooperative launch). ``PHASE`` 1 then 2: the same work in two launches without waiting, x and dy read
    twice (5 passes): the interpreter's path (it runs one program at a time) and the fallback when the
    programs cannot all be resident."""
    block = tl.program_id(0)
    lane = tl.program_id(1)
    lanes = tl.num_programs(1)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        w = tl.zeros([BLOCK_N], dtype=tl.float32)  # never read
    # Rows of a tile lie in one thread (warps split the columns), so the sums over rows stay in registers.
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k0 = tl.cast(0, tl.uint32)  # unused without DROPOUT
    k1 = tl.cast(0, tl.uint32)
    if DROPOUT:
        k0, k1 = philox_key(seed_lo, seed_hi, seed_ptr, seed_in_memory)
    thr = tl.cast(threshold, tl.uint32)
    scale = tl.cast(scale, tl.float32)
    row_tiles = tl.cdiv(M, BLOCK_M)
    if PHASE == 0:
        x, dy = _split_row_load(x_ptr, dy_ptr, lane, M, N, stride_x_row, stride_dy_row, cols, col_mask, BLOCK_M)
        if lane < row_tiles:
            _split_row_publish(x, dy, lane, block, w, mean_ptr, rstd_ptr, terms_ptr, arrivals_ptr, M, col_mask,
                               IS_RMS, HAS_WEIGHT, BLOCK_M, COL_BLOCKS, True)
        for tile in range(lane, row_tiles, lanes):
            # The next tile's loads go out first and are consumed last: in flight while this tile finishes.
            ahead = tile + lanes
            x_ahead, dy_ahead = _split_row_load(x_ptr, dy_ptr, ahead, M, N, stride_x_row, stride_dy_row, cols,
                                                col_mask, BLOCK_M)
            dw_acc, db_acc = _split_row_finish(
                x, dy, tile, block, w, dw_acc, db_acc, dx_ptr, mean_ptr, rstd_ptr, terms_ptr, arrivals_ptr, dres_ptr,
                dr_ptr, k0, k1, thr, scale, M, N, stride_dx_row, cols, col_mask, IS_RMS, HAS_WEIGHT, NEED_DB,
                BLOCK_M, BLOCK_N, COL_BLOCKS, SHARES, True, HAS_DRES, STORE_DR, DROPOUT, CHUNK_COLUMNS)
            if ahead < row_tiles:
                _split_row_publish(x_ahead, dy_ahead, ahead, block, w, mean_ptr, rstd_ptr, terms_ptr, arrivals_ptr,
                                   M, col_mask, IS_RMS, HAS_WEIGHT, BLOCK_M, COL_BLOCKS, True)
            x, dy = x_ahead, dy_ahead
    else:
        for tile in range(lane, row_tiles, lanes):
            x, dy = _split_row_load(x_ptr, dy_ptr, tile, M, N, stride_x_row, stride_dy_row, cols, col_mask, BLOCK_M)
            if PHASE == 1:
                _split_row_publish(x, dy, tile, block, w, mean_ptr, rstd_ptr, terms_ptr, arrivals_ptr, M, col_mask,
                                   IS_RMS, HAS_WEIGHT, BLOCK_M, COL_BLOCKS, False)
            else:
                dw_acc, db_acc = _split_row_finish(
                    x, dy, tile, block, w, dw_acc, db_acc, dx_ptr, mean_ptr, rstd_ptr, terms_ptr, arrivals_ptr,
                    dres_ptr, dr_ptr, k0, k1, thr, scale, M, N, stride_dx_row, cols, col_mask, IS_RMS, HAS_WEIGHT,
                    NEED_DB, BLOCK_M, BLOCK_N, COL_BLOCKS, SHARES, False, HAS_DRES, STORE_DR, DROPOUT, CHUNK_COLUMNS)
    if PHASE != 1 and (HAS_WEIGHT or NEED_DB):  # RMSNorm without a weight has no partial buffer
        slot = partial_ptr + lane.to(tl.int64) * 2 * N + cols
        if HAS_WEIGHT:
            tl.store(slot, dw_acc, mask=col_mask)
        if NEED_DB:
            tl.store(slot + N, db_acc, mask=col_mask)


@triton.jit
def _layer_norm_bwd_dwdb_kernel(
    partial_ptr,  # (slots, 2, N) fp32
    dw_ptr,  # (N,) dW in the weight's dtype, or dummy
    db_ptr,  # (N,) dB in the bias's dtype, or dummy
    lock_ptr,  # (2 * slots,) int32: the backward's spin locks, then its first-write flags (RESET_FLAGS), or dummy
    slots,
    N,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
    RESET_FLAGS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Sum the buffers in slot order: a fixed order, so the result depends only on the buffers.

    With RESET_FLAGS, program 0 also zeroes the backward's first-write flags (its spin locks are zero again
    once released), so the lock buffer is ready for the next backward on this stream without a fill."""
    if RESET_FLAGS:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if tl.program_id(0) == 0:
            for f0 in range(0, slots, BLOCK_S):
                flags = f0 + tl.arange(0, BLOCK_S)
                tl.store(lock_ptr + slots + flags, tl.zeros([BLOCK_S], dtype=tl.int32), mask=flags < slots)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc_w = tl.zeros([BLOCK_S, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_S, BLOCK_N], dtype=tl.float32)
    for s0 in range(0, slots, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        mask = (s[:, None] < slots) & col_mask[None, :]
        base = partial_ptr + s.to(tl.int64)[:, None] * 2 * N + cols[None, :]
        if NEED_DW:
            acc_w += tl.load(base, mask=mask, other=0.0)
        if NEED_DB:
            acc_b += tl.load(base + N, mask=mask, other=0.0)
    if NEED_DW:
        tl.store(dw_ptr + cols, tl.sum(acc_w, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)
    if NEED_DB:
        tl.store(db_ptr + cols, tl.sum(acc_b, axis=0).to(db_ptr.dtype.element_ty), mask=col_mask)
