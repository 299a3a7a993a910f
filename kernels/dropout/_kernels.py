"""Seeded dropout in Triton: Philox4x32-10 regenerated in-kernel, no mask ever stored.

Implements ``_dropout_fwd_kernel``, which computes ``y = x * (word >= threshold ? 1/(1-p) : 0)`` with
the Philox4x32-10 words of ``kernels._common.philox`` (shared with attention's dropout). Dropout is linear
in its input with a fixed mask, so the backward is the same kernel applied to ``dy`` with the same
seed: the mask is drawn again, not read.

Derived from: the Philox4x32 generator (Salmon et al., SC 2011); the index-to-counter scheme is this
project's and is stated, with the twin, in ``reference/dropout.py``.

Trade-off: one Philox call costs ~40 integer instructions for four words. Using all four words (one
call per four elements) rather than one word per element keeps the kernel bound by memory, not by the
integer pipes; the price is a fixed element-to-word layout (runs of ``LANE_STRIDE`` elements per word),
which the kernel matches with four contiguous loads so nothing is shuffled between threads.

Strided views: ``_dropout_rows_kernel`` (innermost logical dim contiguous, e.g. a permuted (B, S, H, D) tensor)
and ``_dropout_columns_kernel`` (a transposed 2-D matrix whose rows are whole chunks) read a view where it lies
and compute each element's word from its logical index, so the mask is the contiguous copy's; the launcher picks
them (``kernels.dropout.ops._launch_strided``) and copies other views to contiguous first. The rows kernel orders
its programs by memory rather than by logical index where a view's heads lie side by side (``S1_FAST``).

Limits: 64-bit offsets, so any element count works.
"""

import triton
import triton.language as tl

from kernels._common.philox import LANE_STRIDE, chunk_words, group_words, philox_key, scaled_where_kept


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "seed_in_memory", "threshold"])
def _dropout_fwd_kernel(
    x_ptr,  # (n,) contiguous input (dy in the backward)
    y_ptr,  # (n,) contiguous output, may alias x_ptr (in-place)
    n,  # element count
    seed_lo,  # low 32 bits of the seed (Philox key word 0)
    seed_hi,  # high 32 bits of the seed (Philox key word 1)
    seed_ptr,  # int64 seed on the device, read when seed_in_memory != 0 (see philox_key)
    seed_in_memory,
    threshold,  # keep iff word >= threshold, in [1, 2**32 - 1]
    scale,  # 1 / (1 - p), fp32
    CHUNKS: tl.constexpr,  # chunks of 4 * LANE_STRIDE elements per program
):
    k0, k1 = philox_key(seed_lo, seed_hi, seed_ptr, seed_in_memory)
    thr = tl.cast(threshold, tl.uint32)
    # Pin the scale to fp32 (what an eager launch passes): inductor's launcher may hand floats over wider,
    # and x * scale must round the same way in both.
    scale = tl.cast(scale, tl.float32)
    lane = tl.arange(0, LANE_STRIDE)
    out_ty = y_ptr.dtype.element_ty
    for step in tl.static_range(CHUNKS):
        chunk = tl.program_id(0).to(tl.int64) * CHUNKS + step
        base = chunk * (4 * LANE_STRIDE)
        # Issue the four loads before the Philox arithmetic so memory latency hides behind it.
        offs0 = base + lane
        offs1 = offs0 + LANE_STRIDE
        offs2 = offs1 + LANE_STRIDE
        offs3 = offs2 + LANE_STRIDE
        x0 = tl.load(x_ptr + offs0, mask=offs0 < n, eviction_policy="evict_first")
        x1 = tl.load(x_ptr + offs1, mask=offs1 < n, eviction_policy="evict_first")
        x2 = tl.load(x_ptr + offs2, mask=offs2 < n, eviction_policy="evict_first")
        x3 = tl.load(x_ptr + offs3, mask=offs3 < n, eviction_policy="evict_first")
        w0, w1, w2, w3 = chunk_words(chunk, k0, k1)
        tl.store(y_ptr + offs0, scaled_where_kept(x0, w0, thr, scale).to(out_ty), mask=offs0 < n)
        tl.store(y_ptr + offs1, scaled_where_kept(x1, w1, thr, scale).to(out_ty), mask=offs1 < n)
        tl.store(y_ptr + offs2, scaled_where_kept(x2, w2, thr, scale).to(out_ty), mask=offs2 < n)
        tl.store(y_ptr + offs3, scaled_where_kept(x3, w3, thr, scale).to(out_ty), mask=offs3 < n)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "seed_in_memory", "threshold"])
def _dropout_rows_kernel(
    x_ptr, y_ptr,  # a view of logical shape (S0, S1, S2, S3) each, innermost logical dim contiguous in x
    n,  # element count, S0 * S1 * S2 * S3
    S1, S2, S3,
    xs0, xs1, xs2,  # x's strides of the three outer dims (the last one is 1)
    ys0, ys1, ys2, ys3,  # y's strides
    seed_lo, seed_hi, seed_ptr, seed_in_memory, threshold, scale,  # as _dropout_fwd_kernel
    ROW: tl.constexpr,  # min(S3, LANE_STRIDE): S3 divides LANE_STRIDE or LANE_STRIDE divides S3
    ONE_WRAP: tl.constexpr,  # a chunk's rows cross at most one S2 boundary (S2 >= rows per chunk)
    INDEX_64: tl.constexpr,  # row indices past 2^31
    span_chunks=0,  # with S1_FAST: chunks per (S0, S1) index, S2 * S3 / (4 * LANE_STRIDE)
    S1_FAST: tl.constexpr = False,  # S1 is the outer dim nearest in memory: neighbouring programs take S1 neighbours
):
    """The element-wise layout's chunk ``program_id(0)`` of a strided view whose innermost logical dim is contiguous:
    each run of ``LANE_STRIDE`` logical elements is ``LANE_STRIDE // ROW`` pieces of ``ROW`` contiguous elements
    (whole rows when S3 <= LANE_STRIDE, a piece of one row otherwise), so every load is as wide as in
    ``_dropout_fwd_kernel`` and the four words of a Philox call still meet their four elements in one thread.

    Index arithmetic: the chunk's first row is split into (S0, S1, S2) indices once per program; the other rows
    step from it, carrying into S1 and S0 (``ONE_WRAP``) or, where S2 is shorter than a chunk's rows, divided out
    one by one. A division per row cost the first version 90% of its speed (271 GB/s against 2,000, H100).

    Program order: chunk ``program_id(0)`` in logical order, or with ``S1_FAST`` (a permuted ``(B, S, H, D)`` view,
    whose heads lie side by side in memory) the programs of neighbouring ids take the same S2 span of neighbouring
    S1 indices, so that the programs running at once read and write memory contiguously rather than one head's
    rows a stride apart."""
    k0, k1 = philox_key(seed_lo, seed_hi, seed_ptr, seed_in_memory)
    thr = tl.cast(threshold, tl.uint32)
    scale = tl.cast(scale, tl.float32)
    out_ty = y_ptr.dtype.element_ty
    index_ty: tl.constexpr = tl.int64 if INDEX_64 else tl.int32
    PIECES: tl.constexpr = LANE_STRIDE // ROW
    piece = tl.arange(0, PIECES)[:, None]
    column = tl.arange(0, ROW)[None, :]
    lane = piece * ROW + column
    chunk = tl.program_id(0).to(tl.int64)
    if S1_FAST:  # program id = (i0 * span_chunks + span chunk) * S1 + i1
        outer = chunk // S1
        chunk = (outer // span_chunks * S1 + chunk % S1) * span_chunks + outer % span_chunks
    base = chunk * (4 * LANE_STRIDE)
    first_row = (base // S3).to(index_ty)
    first_col = (base % S3).to(index_ty)
    i2 = first_row % S2
    i1 = (first_row // S2) % S1
    i0 = first_row // S2 // S1
    xs, y_offs, inside = (), (), ()
    for w in tl.static_range(4):
        if ROW < LANE_STRIDE:  # whole rows: S3 == ROW, and a chunk starts a row
            step = w * PIECES + piece
            col = column
        else:  # S3 a multiple of LANE_STRIDE: the run is one row's columns
            step = (first_col + w * LANE_STRIDE) // S3
            col = (first_col + w * LANE_STRIDE) % S3 + column
        if ONE_WRAP:
            j2 = i2 + step
            wrap = (j2 >= S2).to(index_ty)
            j2 -= wrap * S2
            j1 = i1 + wrap
            wrap = (j1 >= S1).to(index_ty)
            j1 -= wrap * S1
            j0 = i0 + wrap
        else:
            row = first_row + step
            j2 = row % S2
            j1 = (row // S2) % S1
            j0 = row // S2 // S1
        x_off = j0.to(tl.int64) * xs0 + j1.to(tl.int64) * xs1 + j2.to(tl.int64) * xs2 + col
        y_offs += (j0.to(tl.int64) * ys0 + j1.to(tl.int64) * ys1 + j2.to(tl.int64) * ys2 + col * ys3,)
        mask = base + w * LANE_STRIDE + lane < n
        xs += (tl.load(x_ptr + x_off, mask=mask, eviction_policy="evict_first"),)
        inside += (mask,)
    words = group_words(chunk * LANE_STRIDE + lane, k0, k1)
    for w in tl.static_range(4):
        tl.store(y_ptr + y_offs[w], scaled_where_kept(xs[w], words[w], thr, scale).to(out_ty), mask=inside[w])


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "seed_in_memory", "threshold"])
def _dropout_columns_kernel(
    x_ptr, y_ptr,  # a 2-D view (R, C), C a multiple of 4 * LANE_STRIDE, contiguous along R in x and y
    R, C,
    xs_c, ys_c,  # the strides of the C axis
    seed_lo, seed_hi, seed_ptr, seed_in_memory, threshold, scale,  # as _dropout_fwd_kernel
    BLOCK_R: tl.constexpr,  # rows per program: the contiguous direction, one coalesced access per column
    BLOCK_J: tl.constexpr,  # lanes of a run per program
):
    """A transposed view: the runs lie along C, whose elements are ``xs_c`` apart in memory, while R is contiguous.
    A program takes ``BLOCK_R`` rows x ``BLOCK_J`` lanes of one chunk's four runs of every row: each Philox call
    (row, chunk, lane) decides four elements of the tile, and each access walks R, contiguous in memory. Requires
    whole chunks in every row (C a multiple of ``4 * LANE_STRIDE``), so that chunk = row * C / (4 LS) + k."""
    k0, k1 = philox_key(seed_lo, seed_hi, seed_ptr, seed_in_memory)
    thr = tl.cast(threshold, tl.uint32)
    scale = tl.cast(scale, tl.float32)
    out_ty = y_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    lane = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)[None, :]
    chunk_in_row = tl.program_id(2).to(tl.int64)
    inside = row < R
    xs = ()
    for w in tl.static_range(4):
        col = chunk_in_row * (4 * LANE_STRIDE) + w * LANE_STRIDE + lane
        xs += (tl.load(x_ptr + row + col * xs_c, mask=inside, eviction_policy="evict_first"),)
    words = group_words((row * (C // (4 * LANE_STRIDE)) + chunk_in_row) * LANE_STRIDE + lane, k0, k1)
    for w in tl.static_range(4):
        col = chunk_in_row * (4 * LANE_STRIDE) + w * LANE_STRIDE + lane
        tl.store(y_ptr + row + col * ys_c, scaled_where_kept(xs[w], words[w], thr, scale).to(out_ty), mask=inside)
