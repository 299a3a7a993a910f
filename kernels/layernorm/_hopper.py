"""LayerNorm / RMSNorm of wide rows for Hopper (sm_90) in Gluon: a forward that holds each row in shared memory
(RMSNorm's), a forward that splits each row by columns (LayerNorm's), and a split-row backward whose rows stream
through a shared-memory ring. Each implements what its portable kernel in ``kernels/layernorm/_kernels.py`` does
(read beside ``reference/layernorm.py``), which stays the readable version that other devices and the interpreter run.

Shared-row forward (``_norm_fwd_shared_row_kernel``; persistent, one program per SM walking rows): a row's chunks of
``CHUNK`` elements are copied by ``cp.async`` (one commit group each) into a ring of ``CHUNKS + EXTRA`` slots; the
statistics accumulate as they land (RMSNorm sums squares; LayerNorm runs Welford's update per register slot, merged
at the end: one pass over shared memory), then each chunk is normalised with the portable roundings, stored, and its
slot refilled with the chunk one ring further on, so the next row streams in meanwhile. w and b of the first
``RESIDENT`` chunks stay in shared memory; the rest come from L2 ``AHEAD`` chunks before their use.

Split forward (``_norm_fwd_split_row_kernel``): program (column block of ``BLOCK_N``, lane) takes rows ``lane, lane
+ lanes, ...`` of its columns through a ring of ``RING`` slots, keeps its columns' w and b in shared memory, and
publishes its share of a row's statistics (mean and sum of squared deviations, one relaxed 64-bit exchange:
``_publish_stats``) ``PUBLISH_AHEAD`` rows before it normalises that row; every block merges the shares in one order,
so a row's blocks use the same mean and rstd, and block 0 stores them.

Backward (``_norm_bwd_split_row_kernel``, rows over 8192): the portable split-row kernel's grid and arithmetic, the
rows copied into a ring so that a program publishes its share of a row's sums some rows before it finishes it; a
block's two sums travel as one relaxed 64-bit exchange into a slot that reads all ones until then, polled by the
finishing program (no fences); each row's mean and rstd come in the ring with the row. It takes the fused residual +
dropout + norm backward too (``HAS_DRES``, ``STORE_DR``; ``DROPOUT``: the mask drawn again on each 4096-element chunk
viewed as (4 runs, 1024 groups), one Philox call per four elements).

Limits: sm_90, eager calls (under torch.compile the portable kernels are traced); 16-bit rows (x, dy, the residual
gradient) whose widths, row strides and addresses are 16-byte multiples; the forwards take rows of more than the
register path's width up to 14 slots of 8192 elements (``configs.hopper_forward``), the backward rows over 8192, with
dropout only widths of whole 4096-element chunks; the split kernels need every program resident at once (a
cooperative launch). ``kernels.layernorm.ops`` picks them.

Trade-offs: the shared-row forward runs one program per SM (a 128 KB row leaves no room for a second), so the gaps of
its schedule are not covered by another program (why LayerNorm, which also reads w and b, takes the split forward);
the split kernels wait for a row's slowest block, hidden by publishing ahead. Their measurements: the family's
TUNING.md.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from kernels._common.philox_gluon import LANE_STRIDE as _LANE_STRIDE
from kernels._common.philox_gluon import philox4x32 as _philox4x32
from kernels._common.philox_gluon import philox_key as _philox_key

__all__ = ["_norm_bwd_split_row_kernel", "_norm_fwd_shared_row_kernel", "_norm_fwd_split_row_kernel"]


@gluon.jit
def _copy_chunk(slot, row_ptr, offs, chunk: gl.constexpr, CHUNK: gl.constexpr, N, live):
    """Issue the copy of chunk ``chunk`` of the row at ``row_ptr`` into ``slot`` (masked off past N or when not
    ``live``) as one commit group."""
    cols = chunk * CHUNK + offs
    async_copy.async_copy_global_to_shared(slot, row_ptr + cols, mask=(cols < N) & live)
    async_copy.commit_group()


@gluon.jit
def _affine(w_ptr, b_ptr, cols, N, HAS_WEIGHT: gl.constexpr, HAS_BIAS: gl.constexpr):
    """``(w, b)`` over ``cols`` in fp32, read from global memory (w 1 and b 0 where the norm has none)."""
    mask = cols < N
    if HAS_WEIGHT:
        w = gl.load(w_ptr + cols, mask=mask, other=0.0).to(gl.float32)
    else:
        w = gl.where(mask, 1.0, 0.0)
    if HAS_BIAS:
        b = gl.load(b_ptr + cols, mask=mask, other=0.0).to(gl.float32)
    else:
        b = gl.where(mask, 0.0, 0.0)
    return w, b


@gluon.jit
def _resident_affine(w_res, b_res, c: gl.constexpr, cols, N, layout: gl.constexpr, HAS_WEIGHT: gl.constexpr,
                     HAS_BIAS: gl.constexpr):
    """``(w, b)`` of chunk ``c`` in fp32, from the program's shared-memory copy."""
    mask = cols < N
    if HAS_WEIGHT:
        w = w_res.index(c).load(layout).to(gl.float32)
    else:
        w = gl.where(mask, 1.0, 0.0)
    if HAS_BIAS:
        b = b_res.index(c).load(layout).to(gl.float32)
    else:
        b = gl.where(mask, 0.0, 0.0)
    return w, b


@gluon.jit
def _norm_fwd_shared_row_kernel(
    x_ptr,  # (M, N) input, row stride stride_x_row, unit column stride
    y_ptr,  # (M, N) output, row stride stride_y_row
    w_ptr,  # (N,) weight or a dummy when HAS_WEIGHT is False
    b_ptr,  # (N,) bias or a dummy when HAS_BIAS is False
    mean_ptr,  # (M,) fp32 mean (not written for RMSNorm)
    rstd_ptr,  # (M,) fp32 1/std
    M,
    N_VECS,  # N // VEC, and the row strides in VECs below: the compiler then knows every copy is whole
    x_row_vecs,
    y_row_vecs,
    eps,
    IS_RMS: gl.constexpr,
    HAS_WEIGHT: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    CHUNK: gl.constexpr,  # elements per shared-memory slot
    CHUNKS: gl.constexpr,  # chunks per row: cdiv(N, CHUNK)
    VEC: gl.constexpr,  # elements per 16-byte copy
    EXTRA: gl.constexpr = 0,  # slots beyond one row's (< CHUNKS): the next row's first chunks load ahead
    AHEAD: gl.constexpr = 1,  # chunks by which the loads of w and b from L2 run ahead of their use (1 or 2)
    RESIDENT: gl.constexpr = 0,  # leading chunks whose w and b stay in shared memory for all the program's rows
):
    SLOTS: gl.constexpr = CHUNKS + EXTRA
    N = N_VECS * VEC
    stride_x_row = x_row_vecs.to(gl.int64) * VEC
    stride_y_row = y_row_vecs.to(gl.int64) * VEC
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [gl.num_warps()], [0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    slots = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [SLOTS, CHUNK], flat)
    offs = gl.arange(0, CHUNK, layout=layout)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)

    # w and b of the first RESIDENT chunks: copied once, one commit group older than the first row's chunks.
    if RESIDENT > 0 and HAS_WEIGHT:
        w_res = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [RESIDENT, CHUNK], flat)
    else:
        w_res = slots  # never read
    if RESIDENT > 0 and HAS_BIAS:
        b_res = gl.allocate_shared_memory(b_ptr.dtype.element_ty, [RESIDENT, CHUNK], flat)
    else:
        b_res = slots  # never read
    if RESIDENT > 0:
        for c in gl.static_range(RESIDENT):
            cols = c * CHUNK + offs
            if HAS_WEIGHT:
                async_copy.async_copy_global_to_shared(w_res.index(c), w_ptr + cols, mask=cols < N)
            if HAS_BIAS:
                async_copy.async_copy_global_to_shared(b_res.index(c), b_ptr + cols, mask=cols < N)
        async_copy.commit_group()

    # The program's chunks form one sequence (its k-th row's chunk c is number k * CHUNKS + c), copied in order
    # into slot (number % SLOTS), one commit group each: the first SLOTS now, then one per chunk written out.
    for g in gl.static_range(SLOTS):
        row = pid + (g // CHUNKS) * programs
        _copy_chunk(slots.index(g), x_ptr + row * stride_x_row, offs, g % CHUNKS, CHUNK, N, row < M)

    base = 0  # the slot of the current row's chunk 0
    for row in range(pid, M, programs):
        # Statistics, each chunk as it lands: SLOTS - 1 - c copies are issued after this row's chunk c.
        if IS_RMS:
            acc = gl.zeros([CHUNK], gl.float32, layout)
            for c in gl.static_range(CHUNKS):
                async_copy.wait_group(SLOTS - 1 - c)
                x = slots.index((base + c) % SLOTS).load(layout).to(gl.float32)
                acc = gl.fma(x, x, acc)
            mean = 0.0
            rstd = 1.0 / gl.sqrt(gl.div_rn(gl.sum(acc, axis=0), N * 1.0) + eps)
        else:
            # Welford per register slot across the chunks (each slot sees one element per chunk), then
            # the slots merged (Chan et al.): the statistics in one pass over the chunks as they land.
            slot_mean = gl.zeros([CHUNK], gl.float32, layout)
            slot_m2 = gl.zeros([CHUNK], gl.float32, layout)
            for c in gl.static_range(CHUNKS):
                async_copy.wait_group(SLOTS - 1 - c)
                x = slots.index((base + c) % SLOTS).load(layout).to(gl.float32)
                delta = x - slot_mean
                if c == CHUNKS - 1:
                    delta = gl.where(c * CHUNK + offs < N, delta, 0.0)
                slot_mean = slot_mean + delta * (1.0 / (c + 1))
                slot_m2 = gl.fma(delta, x - slot_mean, slot_m2)
            counts = gl.where((CHUNKS - 1) * CHUNK + offs < N, CHUNKS * 1.0, (CHUNKS - 1) * 1.0)
            mean = gl.div_rn(gl.sum(counts * slot_mean, axis=0), N * 1.0)
            spread = slot_mean - mean
            m2 = gl.sum(gl.fma(counts * spread, spread, slot_m2), axis=0)
            rstd = 1.0 / gl.sqrt(gl.div_rn(m2, N * 1.0) + eps)
            gl.store(mean_ptr + row, mean)
        gl.store(rstd_ptr + row, rstd)

        # Normalise and store chunk c, then copy chunk number + SLOTS into its slot.
        y_row = y_ptr + row * stride_y_row
        # w and b of chunk j >= RESIDENT are loaded AHEAD chunks before their use, queued in (w0, b0), (w1, b1)
        if RESIDENT == 0:
            w0, b0 = _affine(w_ptr, b_ptr, offs, N, HAS_WEIGHT, HAS_BIAS)
        if AHEAD == 2:
            if RESIDENT == 0:
                w1, b1 = _affine(w_ptr, b_ptr, CHUNK + offs, N, HAS_WEIGHT, HAS_BIAS)
            elif RESIDENT == 1:
                w0, b0 = _affine(w_ptr, b_ptr, CHUNK + offs, N, HAS_WEIGHT, HAS_BIAS)
        for c in gl.static_range(CHUNKS):
            cols = c * CHUNK + offs
            if c < RESIDENT:
                w, b = _resident_affine(w_res, b_res, c, cols, N, layout, HAS_WEIGHT, HAS_BIAS)
            else:
                w = w0
                b = b0
                if AHEAD == 2 and c + 1 < CHUNKS:
                    w0 = w1
                    b0 = b1
            if c + AHEAD < CHUNKS and c + AHEAD >= RESIDENT:
                if AHEAD == 2 and c + 1 >= RESIDENT:
                    w1, b1 = _affine(w_ptr, b_ptr, cols + 2 * CHUNK, N, HAS_WEIGHT, HAS_BIAS)
                else:
                    w0, b0 = _affine(w_ptr, b_ptr, cols + AHEAD * CHUNK, N, HAS_WEIGHT, HAS_BIAS)
            slot = slots.index((base + c) % SLOTS)
            y = (slot.load(layout).to(gl.float32) - mean) * rstd  # the portable kernel's roundings, in its order
            if HAS_WEIGHT:
                y = y * w
            if HAS_BIAS:
                y = y + b
            gl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)
            refill = row + (1 + (c + EXTRA) // CHUNKS) * programs
            _copy_chunk(slot, x_ptr + refill * stride_x_row, offs, (c + EXTRA) % CHUNKS, CHUNK, N,
                        refill < M)
        base = (base + CHUNKS) % SLOTS


@gluon.jit
def _copy_rows_tile(x_slot, dy_slot, dres_slot, stats_slot, x_ptr, dy_ptr, dres_ptr, mean_ptr, rstd_ptr, row, cols, M,
                    N, x_row_vecs, dy_row_vecs, VEC: gl.constexpr, HAS_DRES: gl.constexpr, IS_RMS: gl.constexpr):
    """Issue the copies of row ``row``'s column block (x and dy, and the contiguous dres with ``HAS_DRES``) and of its
    statistics (mean, rstd) into their slots as one commit group (masked off past M and N)."""
    pair_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    pair = gl.arange(0, 2, layout=pair_layout)
    if IS_RMS:
        stats = rstd_ptr + row + pair * 0
    else:
        stats = gl.where(pair == 0, mean_ptr + row, rstd_ptr + row)
    async_copy.async_copy_global_to_shared(stats_slot, stats, mask=(pair < 2) & (row < M))
    mask = (cols < N) & (row < M)
    async_copy.async_copy_global_to_shared(x_slot, x_ptr + row.to(gl.int64) * x_row_vecs * VEC + cols, mask=mask)
    async_copy.async_copy_global_to_shared(dy_slot, dy_ptr + row.to(gl.int64) * dy_row_vecs * VEC + cols, mask=mask)
    if HAS_DRES:
        async_copy.async_copy_global_to_shared(dres_slot, dres_ptr + row.to(gl.int64) * N + cols, mask=mask)
    async_copy.commit_group()


@gluon.jit
def _row_values(x_slot, dy_slot, w, mean, rstd, cols, N, layout: gl.constexpr, IS_RMS: gl.constexpr,
                HAS_WEIGHT: gl.constexpr):
    """``(dy, xhat, g)`` of one row's column block, from its slots and its statistics, as the portable
    ``_bwd_tile_values``."""
    mask = cols < N
    x = x_slot.load(layout).to(gl.float32)
    dy = dy_slot.load(layout).to(gl.float32)
    if IS_RMS:
        xhat = x * rstd
    else:
        xhat = gl.where(mask, (x - mean) * rstd, 0.0)
    if HAS_WEIGHT:
        g = gl.where(mask, dy * w, 0.0)  # a select: g - c1 must not contract into an fma (see the portable kernel)
    else:
        g = dy
    return dy, xhat, g


@gluon.jit
def _slot_stats(stats_slot):
    """``(mean, rstd)`` of a row from its statistics slot (``_copy_rows_tile``)."""
    both: gl.constexpr = gl.BlockedLayout([2], [32], [gl.num_warps()], [0])  # each thread reads both
    values = stats_slot.load(both)
    pair = gl.arange(0, 2, layout=both)
    return gl.sum(gl.where(pair == 0, values, 0.0), axis=0), gl.sum(gl.where(pair == 1, values, 0.0), axis=0)


@gluon.jit
def _chunk_keep_factor(chunk, k0, k1, threshold, scale, layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """The dropout factors (``scale`` where kept, 0 where dropped, fp32) of dropout chunk ``chunk`` (int64), a
    ``BLOCK_N = 4 * LANE_STRIDE``-element tensor in ``layout``: the mask ``kernels.dropout.dropout`` draws for those
    elements. Element ``e`` of a chunk takes word ``e // LANE_STRIDE`` of group ``chunk * LANE_STRIDE +
    e % LANE_STRIDE``. The words are drawn on the chunk viewed as (4 runs, LANE_STRIDE), each thread holding all four
    runs of its groups (one Philox call per four elements), then moved into ``layout``."""
    runs: gl.constexpr = gl.BlockedLayout([4, 4], [1, 32], [1, gl.num_warps()], [1, 0])
    lane = gl.arange(0, _LANE_STRIDE, layout=gl.SliceLayout(0, runs))
    group = (chunk * _LANE_STRIDE + lane.to(gl.int64)).to(gl.uint64)
    zero = (lane * 0).to(gl.uint32)
    w0, w1, w2, w3 = _philox4x32(group.to(gl.uint32), (group >> 32).to(gl.uint32), zero, zero, k0, k1)
    run = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, runs)), 1)
    word = gl.where(run == 0, gl.expand_dims(w0, 0), gl.where(run == 1, gl.expand_dims(w1, 0), gl.where(
        run == 2, gl.expand_dims(w2, 0), gl.expand_dims(w3, 0))))
    factor = gl.where(word >= threshold, scale, 0.0)
    return gl.convert_layout(gl.reshape(factor, [BLOCK_N]), layout)


@gluon.jit
def _post_pair(slot_ptr, lo, hi):
    """Write two fp32 scalars into an int64 slot as one relaxed 64-bit exchange, so the value is its own flag (no
    fence, no count). The slot holds all ones until then, a pattern no fp32 arithmetic produces (NaN results are
    0x7FFFFFFF)."""
    packed = (hi.to(gl.uint32, bitcast=True).to(gl.uint64) << 32) | lo.to(gl.uint32, bitcast=True).to(gl.uint64)
    gl.atomic_xchg(slot_ptr, packed.to(gl.int64, bitcast=True), sem="relaxed", scope="gpu")


@gluon.jit
def _read_pairs(slots_ptr, row, share, share_mask, M, COL_BLOCKS: gl.constexpr):
    """A first volatile read of row ``row``'s slots (all ones where a block has not published yet; 0 past M), for
    ``_await_pairs``."""
    return gl.load(slots_ptr + row * COL_BLOCKS + share, mask=share_mask & (row < M), other=0, volatile=True)


@gluon.jit
def _await_pairs(slots_ptr, pairs, mask):
    """``(lo, hi)`` fp32 of every slot of ``slots_ptr`` under ``mask``, ``pairs`` being a first volatile read of them
    (issued early, so that its latency overlaps other work): read again until none holds all ones (``_post_pair``)."""
    while gl.sum((pairs == -1).to(gl.int32), axis=0) > 0:  # a block has not published yet
        pairs = gl.load(slots_ptr, mask=mask, other=0, volatile=True)
    lo = (pairs & 0xFFFFFFFF).to(gl.uint32).to(gl.float32, bitcast=True)
    hi = (pairs >> 32).to(gl.uint32).to(gl.float32, bitcast=True)
    return lo, hi


@gluon.jit
def _publish(terms_ptr, row, block, g, xhat, COL_BLOCKS: gl.constexpr):
    """Publish this column block's share of row ``row``'s sums of g and g * xhat (``_post_pair``)."""
    _post_pair(terms_ptr + row * COL_BLOCKS + block, gl.sum(g, axis=0), gl.sum(g * xhat, axis=0))


@gluon.jit(do_not_specialize=["seed_lo", "seed_hi", "seed_in_memory", "threshold"])
def _norm_bwd_split_row_kernel(
    x_ptr,  # (M, N) forward input, row stride x_row_vecs * VEC
    dy_ptr,  # (M, N) upstream gradient, row stride dy_row_vecs * VEC
    dx_ptr,  # (M, N) output gradient, contiguous
    w_ptr,  # (N,) weight or dummy
    mean_ptr,  # (M,) fp32 (unused for RMSNorm)
    rstd_ptr,  # (M,) fp32
    terms_ptr,  # (M, COL_BLOCKS) int64, all ones on entry: each block's two fp32 row sums, packed (_publish)
    partial_ptr,  # (lanes, 2, N) fp32: one exclusive dW/dB slot per lane
    dres_ptr,  # (M, N) contiguous gradient reaching x (residual_out) from later blocks (HAS_DRES) or a dummy
    dr_ptr,  # (M, N) contiguous: the fused op's residual gradient, dx before any dropout (STORE_DR) or a dummy
    M,
    N_VECS,  # N // VEC and the row strides in VECs: the compiler then knows every copy is whole
    x_row_vecs,
    dy_row_vecs,
    seed_lo,  # the dropout mask's seed and keep threshold, as the portable kernel takes them (read with DROPOUT)
    seed_hi,
    seed_ptr,
    seed_in_memory,
    threshold,
    scale,
    IS_RMS: gl.constexpr,
    HAS_WEIGHT: gl.constexpr,
    NEED_DB: gl.constexpr,
    BLOCK_N: gl.constexpr,  # columns per program
    COL_BLOCKS: gl.constexpr,  # cdiv(N, BLOCK_N), the grid's first axis
    SHARES: gl.constexpr,  # COL_BLOCKS rounded up to a power of two
    VEC: gl.constexpr,  # elements per 16-byte copy of x and dy (16-bit)
    RING: gl.constexpr,  # shared-memory slots of (x, dy) column blocks per program
    PUBLISH_AHEAD: gl.constexpr,  # rows by which a program's publishing runs ahead of its finishing (< RING)
    HAS_DRES: gl.constexpr = False,  # the fused residual + dropout + norm backward: dx += dres ...
    STORE_DR: gl.constexpr = False,  # ... dr = dx stored for the residual ...
    DROPOUT: gl.constexpr = False,  # ... and dx = dropout(dr) with the forward's mask (each block one whole chunk)
):
    """Wide rows, the portable ``_layer_norm_bwd_split_row_kernel``'s one-launch exchange with a deeper lookahead and a
    cheaper handshake: program (column block, lane) takes rows ``lane, lane + lanes, ...`` of its columns, copied
    asynchronously into a ring of ``RING`` shared-memory slots. Iteration k reads the shares of row k (a load issued
    first, used last), publishes its own share of row k + PUBLISH_AHEAD, takes row k's dW/dB terms, then waits until
    every block's share of row k is there, writes dx and refills row k's slot with row k + RING. All programs must
    be resident at once (cooperative launch). With ``HAS_DRES`` the residual stream's gradient travels in the ring
    beside x and dy, and is added to dx as the portable kernel adds it (``STORE_DR``: stored as dr too); with
    ``DROPOUT`` (``BLOCK_N`` one dropout chunk and N a multiple of it) dx is then masked as the portable kernel masks
    it, the mask drawn again from the seed."""
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [gl.num_warps()], [0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    N = N_VECS * VEC
    block = gl.program_id(0)
    lane = gl.program_id(1)
    lanes = gl.num_programs(1)
    cols = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout)
    col_mask = cols < N
    x_slots = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [RING, BLOCK_N], flat)
    dy_slots = gl.allocate_shared_memory(dy_ptr.dtype.element_ty, [RING, BLOCK_N], flat)
    # Each row's mean and rstd travel in the ring with it: loaded where used, they were an L2 round trip on which
    # every warp of the program stalled.
    stats_slots = gl.allocate_shared_memory(gl.float32, [RING, 2], flat)
    if HAS_DRES:
        dres_slots = gl.allocate_shared_memory(dres_ptr.dtype.element_ty, [RING, BLOCK_N], flat)
    else:
        dres_slots = dy_slots  # never read
    if HAS_WEIGHT:
        w = gl.load(w_ptr + cols, mask=col_mask, other=0.0).to(gl.float32)
    else:
        w = gl.where(col_mask, 0.0, 0.0)  # never read
    dw_acc = gl.where(col_mask, 0.0, 0.0)
    db_acc = gl.where(col_mask, 0.0, 0.0)
    share_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    share = gl.arange(0, SHARES, layout=share_layout)
    share_mask = share < COL_BLOCKS
    if DROPOUT:
        k0, k1 = _philox_key(seed_lo, seed_hi, seed_ptr, seed_in_memory)
        keep_threshold = threshold.to(gl.uint32)
        keep_scale = scale.to(gl.float32)

    # Row k of this program is lane + k * lanes, its copies commit group k.
    for k in gl.static_range(RING):
        _copy_rows_tile(x_slots.index(k), dy_slots.index(k), dres_slots.index(k), stats_slots.index(k), x_ptr, dy_ptr,
                        dres_ptr, mean_ptr, rstd_ptr, lane + k * lanes, cols, M, N, x_row_vecs, dy_row_vecs, VEC,
                        HAS_DRES, IS_RMS)
    for k in gl.static_range(PUBLISH_AHEAD):
        row = lane + k * lanes
        async_copy.wait_group(RING - 1 - k)
        if row < M:
            mean, rstd = _slot_stats(stats_slots.index(k))
            _, xhat, g = _row_values(x_slots.index(k), dy_slots.index(k), w, mean, rstd, cols, N, layout, IS_RMS,
                                     HAS_WEIGHT)
            _publish(terms_ptr, row, block, g, xhat, COL_BLOCKS)

    # The blocks' shares of the row an iteration finishes are read one iteration before (an L2 round trip, which
    # stalled every warp of the program where it was read on use): published PUBLISH_AHEAD - 1 iterations before
    # that, they are there by then but for a block running behind (then read again).
    shares = _read_pairs(terms_ptr, lane, share, share_mask, M, COL_BLOCKS)
    for row in range(lane, M, lanes):
        step = (row - lane) // lanes  # row `step` of this program
        shares_ptr = terms_ptr + row * COL_BLOCKS + share
        next_shares = _read_pairs(terms_ptr, row + lanes, share, share_mask, M, COL_BLOCKS)
        ahead = row + PUBLISH_AHEAD * lanes

        # Publish row step + PUBLISH_AHEAD: RING - 1 - PUBLISH_AHEAD copies are issued after it.
        slot = (step + PUBLISH_AHEAD) % RING
        async_copy.wait_group(RING - 1 - PUBLISH_AHEAD)
        if ahead < M:
            ahead_mean, ahead_rstd = _slot_stats(stats_slots.index(slot))
            _, xhat, g = _row_values(x_slots.index(slot), dy_slots.index(slot), w, ahead_mean, ahead_rstd, cols, N,
                                     layout, IS_RMS, HAS_WEIGHT)
            _publish(terms_ptr, ahead, block, g, xhat, COL_BLOCKS)

        slot = step % RING
        row_mean, rstd = _slot_stats(stats_slots.index(slot))
        dy, xhat, g = _row_values(x_slots.index(slot), dy_slots.index(slot), w, row_mean, rstd, cols, N, layout,
                                  IS_RMS, HAS_WEIGHT)
        if HAS_WEIGHT:
            dw_acc += dy * xhat
        if NEED_DB:
            db_acc += dy
        sum_g, sum_gx = _await_pairs(shares_ptr, shares, share_mask)
        c2 = gl.div_rn(gl.sum(sum_gx, axis=0), N * 1.0)
        if IS_RMS:
            dx = (g - xhat * c2) * rstd
        else:
            dx = (g - gl.div_rn(gl.sum(sum_g, axis=0), N * 1.0) - xhat * c2) * rstd
        if HAS_DRES:
            dx += dres_slots.index(slot).load(layout).to(gl.float32)
        if STORE_DR:
            gl.store(dr_ptr + row.to(gl.int64) * N + cols, dx.to(dr_ptr.dtype.element_ty), mask=col_mask)
        if DROPOUT:
            factor = _chunk_keep_factor(row.to(gl.int64) * COL_BLOCKS + block, k0, k1, keep_threshold, keep_scale,
                                        layout, BLOCK_N)
            dx = dx.to(dx_ptr.dtype.element_ty).to(gl.float32) * factor
        gl.store(dx_ptr + row.to(gl.int64) * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=col_mask)
        _copy_rows_tile(x_slots.index(slot), dy_slots.index(slot), dres_slots.index(slot), stats_slots.index(slot),
                        x_ptr, dy_ptr, dres_ptr, mean_ptr, rstd_ptr, row + RING * lanes, cols, M, N, x_row_vecs,
                        dy_row_vecs, VEC, HAS_DRES, IS_RMS)
        shares = next_shares

    if HAS_WEIGHT or NEED_DB:
        partial = partial_ptr + lane.to(gl.int64) * 2 * N + cols
        if HAS_WEIGHT:
            gl.store(partial, dw_acc, mask=col_mask)
        if NEED_DB:
            gl.store(partial + N, db_acc, mask=col_mask)


@gluon.jit
def _publish_stats(stats_ptr, row, block, x, cols, N, BLOCK_N: gl.constexpr, COL_BLOCKS: gl.constexpr,
                   IS_RMS: gl.constexpr):
    """Publish this column block's share of row ``row``'s statistics (``_post_pair``): RMSNorm its sum of squares;
    LayerNorm its mean and the sum of squared deviations from it (both over the block's own columns, two passes over
    registers)."""
    mask = cols < N
    if IS_RMS:
        lo = gl.sum(x * x, axis=0)
        hi = lo * 0.0
    else:
        count = gl.minimum(N - block * BLOCK_N, BLOCK_N) * 1.0
        lo = gl.div_rn(gl.sum(x, axis=0), count)
        centered = gl.where(mask, x - lo, 0.0)
        hi = gl.sum(centered * centered, axis=0)
    _post_pair(stats_ptr + row * COL_BLOCKS + block, lo, hi)


@gluon.jit
def _norm_fwd_split_row_kernel(
    x_ptr,  # (M, N) input, row stride x_row_vecs * VEC, unit column stride
    y_ptr,  # (M, N) output, contiguous
    w_ptr,  # (N,) weight or a dummy when HAS_WEIGHT is False
    b_ptr,  # (N,) bias or a dummy when HAS_BIAS is False
    mean_ptr,  # (M,) fp32 mean (not written for RMSNorm)
    rstd_ptr,  # (M,) fp32 1/std
    stats_ptr,  # (M, COL_BLOCKS) int64, all ones on entry: each block's share of the row statistics (_publish_stats)
    M,
    N_VECS,  # N // VEC and the row stride in VECs
    x_row_vecs,
    eps,
    IS_RMS: gl.constexpr,
    HAS_WEIGHT: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BLOCK_N: gl.constexpr,  # columns per program
    COL_BLOCKS: gl.constexpr,  # cdiv(N, BLOCK_N), the grid's first axis
    SHARES: gl.constexpr,  # COL_BLOCKS rounded up to a power of two
    VEC: gl.constexpr,  # elements per 16-byte copy
    RING: gl.constexpr,  # shared-memory slots of column blocks per program
    PUBLISH_AHEAD: gl.constexpr,  # rows by which publishing runs ahead of normalising (< RING)
):
    """Wide rows split by columns, as the split-row backward: program (column block, lane) takes rows ``lane,
    lane + lanes, ...`` of its columns through a ring of ``RING`` shared-memory slots, publishes its share of a row's
    statistics ``PUBLISH_AHEAD`` rows before it normalises that row, and keeps its columns' w and b in shared memory
    for all its rows. All programs must be resident at once (cooperative launch)."""
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [gl.num_warps()], [0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    N = N_VECS * VEC
    stride_x_row = x_row_vecs.to(gl.int64) * VEC
    block = gl.program_id(0)
    lane = gl.program_id(1)
    lanes = gl.num_programs(1)
    cols = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout)
    col_mask = cols < N
    slots = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [RING, BLOCK_N], flat)
    if HAS_WEIGHT:
        w_res = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [BLOCK_N], flat)
        async_copy.async_copy_global_to_shared(w_res, w_ptr + cols, mask=col_mask)
    if HAS_BIAS:
        b_res = gl.allocate_shared_memory(b_ptr.dtype.element_ty, [BLOCK_N], flat)
        async_copy.async_copy_global_to_shared(b_res, b_ptr + cols, mask=col_mask)
    async_copy.commit_group()  # one group older than the first row's
    share_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    share = gl.arange(0, SHARES, layout=share_layout)
    share_mask = share < COL_BLOCKS
    # counts of the blocks' columns, for merging their shares
    counts = gl.minimum(N - share * BLOCK_N, BLOCK_N).to(gl.float32)

    # Row k of this program is lane + k * lanes, its copy commit group k.
    for k in gl.static_range(RING):
        row = lane + k * lanes
        async_copy.async_copy_global_to_shared(slots.index(k), x_ptr + row * stride_x_row + cols,
                                               mask=col_mask & (row < M))
        async_copy.commit_group()
    for k in gl.static_range(PUBLISH_AHEAD):
        row = lane + k * lanes
        async_copy.wait_group(RING - 1 - k)
        if row < M:
            x = slots.index(k).load(layout).to(gl.float32)
            _publish_stats(stats_ptr, row, block, x, cols, N, BLOCK_N, COL_BLOCKS, IS_RMS)

    # The blocks' shares of the row an iteration normalises are read one iteration before, as in the backward.
    shares = _read_pairs(stats_ptr, lane, share, share_mask, M, COL_BLOCKS)
    for row in range(lane, M, lanes):
        step = (row - lane) // lanes
        shares_ptr = stats_ptr + row * COL_BLOCKS + share
        next_shares = _read_pairs(stats_ptr, row + lanes, share, share_mask, M, COL_BLOCKS)

        ahead = row + PUBLISH_AHEAD * lanes
        async_copy.wait_group(RING - 1 - PUBLISH_AHEAD)
        if ahead < M:
            x = slots.index((step + PUBLISH_AHEAD) % RING).load(layout).to(gl.float32)
            _publish_stats(stats_ptr, ahead, block, x, cols, N, BLOCK_N, COL_BLOCKS, IS_RMS)

        lo, hi = _await_pairs(shares_ptr, shares, share_mask)
        if IS_RMS:
            mean = 0.0
            rstd = 1.0 / gl.sqrt(gl.div_rn(gl.sum(gl.where(share_mask, lo, 0.0), axis=0), N * 1.0) + eps)
        else:
            # the blocks' (count, mean, m2) merged (Chan et al.): m2 = sum m2_i + sum count_i (mean_i - mean)^2
            mean = gl.div_rn(gl.sum(gl.where(share_mask, counts * lo, 0.0), axis=0), N * 1.0)
            spread = lo - mean
            m2 = gl.sum(gl.where(share_mask, gl.fma(counts * spread, spread, hi), 0.0), axis=0)
            rstd = 1.0 / gl.sqrt(gl.div_rn(m2, N * 1.0) + eps)
            if block == 0:
                gl.store(mean_ptr + row, mean)
        if block == 0:
            gl.store(rstd_ptr + row, rstd)

        slot = slots.index(step % RING)
        y = (slot.load(layout).to(gl.float32) - mean) * rstd  # the portable kernel's roundings, in its order
        if HAS_WEIGHT:
            y = y * w_res.load(layout).to(gl.float32)
        if HAS_BIAS:
            y = y + b_res.load(layout).to(gl.float32)
        gl.store(y_ptr + row.to(gl.int64) * N + cols, y.to(y_ptr.dtype.element_ty), mask=col_mask)
        refill = row + RING * lanes
        async_copy.async_copy_global_to_shared(slot, x_ptr + refill * stride_x_row + cols,
                                               mask=col_mask & (refill < M))
        async_copy.commit_group()
        shares = next_shares
