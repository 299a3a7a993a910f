"""FlashAttention forward for Hopper (sm_90) in Gluon: warp-specialised, TMA-fed, asynchronous wgmma.

Implements the same forward as ``_attn_fwd_kernel`` (``kernels/attention/_kernels.py``, read beside
``reference/attention.py``): O and the natural-log log-sum-exp of softmax(Q K^T * scale) V, with the band
``i + Sk - Sq - LEFT <= j <= i + Sk - Sq + RIGHT`` (causal: RIGHT = 0), GQA/MQA, Sq != Sk, any
(batch, head, sequence) strides. The portable kernel stays the readable version and runs everywhere else.

Schedule (one program = 64 query rows per consumer warpgroup, one, two or three consumers, of one (batch, query
head)):
- a **producer** warp TMA-loads each consumer's Q rows once, then each K and V block into a ring of ``STAGES``
  shared-memory slots, each with a "ready" and an "empty" mbarrier (K and V apart, so Q K^T starts before V lands);
- each **consumer** warpgroup runs the online softmax on its 64 rows over the key blocks they need: Q K_j^T is
  issued, then P_{j-1} V_{j-1} with P in registers, and only then does it wait for the first, so exp2 of block j
  runs beside the second; one whose rows all lie past Sq computes nothing;
- registers (``configs.HOPPER_FORWARD``): the producer's warpgroup keeps 24 per thread; two consumers of 240 at
  D 128 and at D 256 (64-key blocks, O staged in the consumer's own Q tile: ``O_IN_Q``), three of 160 at D 64;
- **persistent** (``PERSISTENT``: no left band edge, not launched beside a transfer, ``beside_transfer``): programs take
  work items round robin, the ring and its barrier phases running on across tiles; under a causal mask an item pairs a
  head's i-th longest and i-th shortest query blocks (``PAIRED``), so that every item costs the same;
- shorter calls take tiles of their own (``configs.HOPPER_FORWARD_SHORT``, ``configs.HOPPER_FORWARD_SHORT_CAUSAL``):
  two persistent consumers at D 64, one consumer with three programs per SM for short D 64 (causal, to 3072 keys
  grouped, and full below 1024: ``configs.HOPPER_FORWARD_SHORT_FULL``), 64-key blocks for short causal D 128; head
  dims 65-96 (``D_SPLIT``) run the 128-column tiles over 64 + 32 columns.

Limits: sm_90, fp16/bf16, dense (B, H, S, D) tensors whose head dim is contiguous and whose other strides and base
address are 16-byte aligned (TMA), padded head dims 64, 128 and 256, no dropout, no packed batches (under
torch.compile it runs inside the opaque op ``fused_kernels::flash_attn_fwd_gluon``).
``kernels.attention.ops.uses_hopper_forward`` and ``configs.prefers_hopper_forward`` say which calls come here; the
backward has its own kernels (``_hopper_bwd.py``; at head dim 256 ``_hopper_bwd_split.py``).

Trade-offs: masks are applied at run time per key block (a uniform branch), so only blocks crossing a band edge or
the end of K pay for them; the consumers' registers leave room for one program per SM, so without persistence a
short program's prologue and epilogue run alone; no ping-pong barrier between the consumers and every exp2 on the
special-function unit (both measured, not kept). The measurements behind each choice: the family's TUNING.md.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.attention import _kernels as _portable

__all__ = ["CONSUMER_ROWS", "_attn_fwd_hopper_kernel", "gl", "register_operand", "warpgroup_accumulator"]

#: query rows per consumer warpgroup (the wgmma M of one warpgroup); a program has two or three consumers
CONSUMER_ROWS = 64
HALF_M: gl.constexpr = gl.constexpr(CONSUMER_ROWS)
_LN2: gl.constexpr = gl.constexpr(0.6931471805599453)


# The key range of a query block is the portable kernel's rule, compiled as Gluon (scalar arithmetic only).
_key_blocks = gluon.jit(_portable._key_range.fn)


@gluon.constexpr_function
def warpgroup_accumulator(columns):
    """The register layout of one warpgroup's wgmma accumulator: 64 rows by ``columns`` (both Gluon kernels)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, columns, 16])


@gluon.constexpr_function
def register_operand(accumulator):
    """The layout of a wgmma A operand held in registers (P, dS), for a product accumulating in ``accumulator``."""
    return gl.DotOperandLayout(operand_index=0, parent=accumulator, k_width=2)


@gluon.jit
def _over_head_dim(a_tile, b_tile, t_zero, D_SPLIT: gl.constexpr):
    """``a_tile b_tile^T`` summed over the head dim (``S = Q K^T``; in the backward ``S^T = K Q^T``, ``dP^T = V dO^T``),
    issued, not waited for: with ``D_SPLIT`` over its first 96 columns only (64 + 32: the rest is the padding of
    head dims 65-96)."""
    if D_SPLIT:
        acc = warpgroup_mma(a_tile.slice(0, 64, dim=1), b_tile.slice(0, 64, dim=1).permute((1, 0)), t_zero,
                            use_acc=False, is_async=True)
        acc = warpgroup_mma(a_tile.slice(64, 32, dim=1), b_tile.slice(64, 32, dim=1).permute((1, 0)), acc,
                            is_async=True)
    else:
        acc = warpgroup_mma(a_tile, b_tile.permute((1, 0)), t_zero, use_acc=False, is_async=True)
    return acc


@gluon.jit
def _add_product_in_parts(op, b_tile, acc_lo, acc_hi, lo_layout: gl.constexpr, hi_layout: gl.constexpr):
    """``acc += op b_tile`` (``O += P V``; in the backward ``dV += P^T dO``, ``dK += dS^T Q``) over the tile's columns
    0-63 into ``acc_lo`` and 64-95 into ``acc_hi``, issued, not waited for: ``(op_lo, op_hi, acc_lo, acc_hi)``, the
    register operand in each part's layout (to be kept until the products complete) and the accumulators."""
    op_lo = gl.convert_layout(op, register_operand(lo_layout))
    op_hi = gl.convert_layout(op, register_operand(hi_layout))
    acc_lo = warpgroup_mma(op_lo, b_tile.slice(0, 64, dim=1), acc_lo, is_async=True)
    acc_hi = warpgroup_mma(op_hi, b_tile.slice(64, 32, dim=1), acc_hi, is_async=True)
    return op_lo, op_hi, acc_lo, acc_hi


@gluon.jit
def _items(tiles_m, heads, PAIRED: gl.constexpr):
    """``(per_head, items)``: the call's work items, each one query block of a (batch, head), or with ``PAIRED`` a
    head's i-th longest and i-th shortest query blocks together (under a causal mask every pair costs the same)."""
    if PAIRED:
        per_head = (tiles_m + 1) // 2
    else:
        per_head = tiles_m
    return per_head, per_head * heads


@gluon.jit
def _turns(items, PERSISTENT: gl.constexpr):
    """How many work items this program takes: ``items`` dealt round robin over the programs, or its own one."""
    if PERSISTENT:
        turns = gl.cdiv(items - gl.program_id(0), gl.num_programs(0))
    else:
        turns = 1
    return turns


@gluon.jit
def _item_blocks(turn, per_head, tiles_m, HAS_RIGHT: gl.constexpr, PAIRED: gl.constexpr):
    """``(bh, first, second, count)`` of this program's work item ``turn``: its (batch, head), its query blocks and
    how many it has. A head's query blocks are consecutive items, so the programs running side by side share its K
    and V in L2; with a causal mask the longest block of a head comes first."""
    item = gl.program_id(0) + turn * gl.num_programs(0)
    bh = item // per_head
    i = item % per_head
    first = i
    if HAS_RIGHT:
        first = tiles_m - 1 - i
    count = 1
    if PAIRED:
        count = 2 - (first == i).to(gl.int32)
    return bh, first, i, count


@gluon.jit
def _tile(bh, pid_m, Hq, GROUP, Sk, lo_shift, hi_shift, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """``(b, h, hk, m0, start, end)`` of query block ``pid_m`` of (batch, head) ``bh``."""
    h = bh % Hq
    m0 = pid_m * BLOCK_M
    start, _, _, end = _key_blocks(m0, Sk, lo_shift, hi_shift, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)
    return bh // Hq, h, h // GROUP, m0, start, end


@gluon.jit
def _own_rows(m0, start, Sq, Sk, lo_shift, hi_shift, row_layout: gl.constexpr, HALF: gl.constexpr,
              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr):
    """``(m_own, rows, full_lo, full_hi, own_end)`` of consumer ``HALF``'s 64 rows of the tile at ``m0`` (whose
    walk starts at key ``start``): its first row and rows, the key range it needs no mask in, and the end of its
    own walk (``start`` when every row lies past Sq: it computes nothing)."""
    m_own = m0 + HALF * HALF_M
    rows = m_own + gl.arange(0, HALF_M, layout=row_layout)
    _, full_lo, full_hi, own_end = _key_blocks(m_own, Sk, lo_shift, hi_shift, HAS_LEFT, HAS_RIGHT, HALF_M,
                                               BLOCK_N)
    if m_own >= Sq:
        own_end = start
    return m_own, rows, full_lo, full_hi, own_end


@gluon.jit
def _producer(loads, tiling, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CONSUMERS: gl.constexpr, PERSISTENT: gl.constexpr, PAIRED: gl.constexpr):
    """The TMA loads of each tile the program takes, in the order the consumers use them (``_load_tile``)."""
    items, per_head, tiles_m, _, _, _, _, _ = tiling
    block = 0  # K/V blocks loaded so far: the ring runs on across tiles
    tile = 0  # tiles this program has taken before this one
    for turn in range(_turns(items, PERSISTENT)):
        bh, first, second, count = _item_blocks(turn, per_head, tiles_m, HAS_RIGHT, PAIRED)
        for j in range(count):
            block = _load_tile(loads, tiling, bh, first + j * (second - first), block, tile, HAS_LEFT, HAS_RIGHT,
                               BLOCK_N, STAGES, CONSUMERS)
            tile += 1


@gluon.jit
def _load_tile(loads, tiling, bh, pid_m, block, tile, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """Q rows of query block ``pid_m`` of (batch, head) ``bh`` (the program's tile number ``tile``), then its K and
    V blocks into the ring from the ring's block number ``block``; returns the ring's count after the tile."""
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = loads
    _, _, _, Hq, GROUP, Sk, lo_shift, hi_shift = tiling
    b, h, hk, m0, start, end = _tile(bh, pid_m, Hq, GROUP, Sk, lo_shift, hi_shift, HAS_LEFT, HAS_RIGHT,
                                     CONSUMERS * HALF_M, BLOCK_N)
    for part in gl.static_range(CONSUMERS):
        # a fresh mbarrier counts as having completed the phase before 0: the first wait returns at once
        mbarrier.wait(q_empty.index(part), (tile & 1) ^ 1)
        mbarrier.expect(q_ready.index(part), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + part * HALF_M, 0], q_ready.index(part),
                                        q_smem.index(part))
    return _load_kv_blocks(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, start, end,
                           block, BLOCK_N, STAGES)


@gluon.jit
def _load_kv_blocks(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, start, end, block,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The K and V blocks of keys ``[start, end)`` of (batch ``b``, key/value head ``hk``) into the ring, from the
    ring's block number ``block`` on (K and V with barriers of their own, so that Q K^T starts before V lands);
    returns the ring's count after them."""
    for i in range(gl.cdiv(end - start, BLOCK_N)):
        slot = block % STAGES
        # a fresh mbarrier counts as having completed the phase before 0: the first pass does not wait
        phase = ((block // STAGES) & 1) ^ 1
        n0 = start + i * BLOCK_N
        mbarrier.wait(k_empty.index(slot), phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], v_ready.index(slot), v_smem.index(slot))
        block += 1
    return block


@gluon.jit
def _masked_scores(s, rows, n0, Sk, lo_shift, hi_shift, s_layout: gl.constexpr, HAS_LEFT: gl.constexpr,
                   HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr):
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    keep = gl.expand_dims(cols < Sk, 0)
    if HAS_RIGHT:
        keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + hi_shift, 1))
    if HAS_LEFT:
        keep = keep & (gl.expand_dims(cols, 0) >= gl.expand_dims(rows + lo_shift, 1))
    return gl.where(keep, s, float("-inf"))


@gluon.jit
def _column_halves(x):
    """``x``'s two column halves, ``(x[:, :C/2], x[:, C/2:])``: in a wgmma accumulator these are separate registers
    of each thread, so no data moves (used by the backward kernels too)."""
    rows: gl.constexpr = x.shape[0]
    half: gl.constexpr = x.shape[1] // 2
    return gl.split(gl.permute(gl.reshape(x, [rows, 2, half]), [0, 2, 1]))


@gluon.constexpr_function
def _register_halvings(columns):
    """How many times a wgmma accumulator's columns halve while the halves stay in each thread's registers: down
    to 8 columns (beyond, a column bit is a lane's)."""
    return max(columns.bit_length() - 4, 0)


@gluon.jit
def _row_max(x, TREE: gl.constexpr):
    """Row maxima of the accumulator ``x``. ``TREE``: elementwise maxima of column halves first, then the short
    in-thread chain and the shuffles; a plain ``gl.max`` is one dependent chain per row (31 FMNMX at 128 columns)."""
    y = x
    if TREE:
        for _ in gl.static_range(_register_halvings(x.shape[1])):
            lo, hi = _column_halves(y)
            y = gl.maximum(lo, hi)
    return gl.convert_layout(gl.max(y, axis=1), gl.SliceLayout(1, x.type.layout))  # the same layout: no code


@gluon.jit
def _row_sum(x, TREE: gl.constexpr):
    """Row sums of the accumulator ``x``, likewise."""
    y = x
    if TREE:
        for _ in gl.static_range(_register_halvings(x.shape[1])):
            lo, hi = _column_halves(y)
            y = lo + hi
    return gl.convert_layout(gl.sum(y, axis=1), gl.SliceLayout(1, x.type.layout))


@gluon.jit
def _softmax_step(s, m_i, l_i, rows, n0, full_lo, full_hi, Sk, lo_shift, hi_shift, scale_log2,
                  s_layout: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr,
                  TREE: gl.constexpr):
    """Online-softmax update for one block of raw scores: ``(p, alpha, m_new, l_new)``, base 2; ``TREE``: the row
    maximum and sum by column halves (``_row_max``)."""
    if (n0 < full_lo) | (n0 >= full_hi):
        s = _masked_scores(s * scale_log2, rows, n0, Sk, lo_shift, hi_shift, s_layout, HAS_LEFT, HAS_RIGHT, BLOCK_N)
        m_new = gl.maximum(m_i, _row_max(s, TREE))
        # a row that has seen no key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    else:
        # every row sees the whole block: scale the row maximum instead of each score (scale >= 0, rounding is
        # monotonic), which leaves one fused multiply-add per score in front of exp2
        m_new = gl.maximum(m_i, _row_max(s, TREE) * scale_log2)
        m_safe = m_new
        p = gl.exp2(s * scale_log2 - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_safe)
    l_new = l_i * alpha + _row_sum(p, TREE)
    return p, alpha, m_new, l_new


@gluon.jit
def _normalised(acc, safe_l, seen, layout: gl.constexpr):
    """O = acc / l row by row in ``layout``, and 0 in the rows that saw no key (``seen`` False)."""
    rows: gl.constexpr = gl.SliceLayout(1, layout)
    o = acc * gl.expand_dims(gl.convert_layout(1.0 / safe_l, rows), 1)
    return gl.where(gl.expand_dims(gl.convert_layout(seen, rows), 1), o, 0.0)


@gluon.jit
def _consumer(buffers, tiling, out, HALF: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
              PERSISTENT: gl.constexpr, PAIRED: gl.constexpr, O_IN_Q: gl.constexpr, D_SPLIT: gl.constexpr):
    """Consumer ``HALF``'s 64 rows of each tile the program takes (``_consume_tile``)."""
    items, per_head, tiles_m, _, _, _, _, _ = tiling
    block = 0  # K/V blocks of the ring passed so far, as the producer counts them
    tile = 0  # tiles this program has taken before this one
    for turn in range(_turns(items, PERSISTENT)):
        bh, first, second, count = _item_blocks(turn, per_head, tiles_m, HAS_RIGHT, PAIRED)
        for j in range(count):
            block = _consume_tile(buffers, tiling, out, bh, first + j * (second - first), block, tile, HALF,
                                  HAS_LEFT, HAS_RIGHT, BLOCK_N, BLOCK_D, STAGES, CONSUMERS, O_IN_Q, D_SPLIT)
            tile += 1
    tma.store_wait(0)


@gluon.jit
def _consume_tile(buffers, tiling, out, bh, pid_m, block, tile, HALF: gl.constexpr, HAS_LEFT: gl.constexpr,
                  HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr,
                  CONSUMERS: gl.constexpr, O_IN_Q: gl.constexpr, D_SPLIT: gl.constexpr):
    """Consumer ``HALF``'s 64 rows of query block ``pid_m`` of (batch, head) ``bh``, the program's tile number
    ``tile``, whose first key block is the ring's block number ``block``; returns the ring's count after the tile.
    It computes over the key blocks its own rows need (the tile's first block to its own last, interior blocks by
    its own rows), then releases the tile's remaining blocks unread; a consumer whose rows all lie past Sq computes
    nothing. With ``O_IN_Q`` it stages O in its own Q tile, and releases the tile to the producer only once the O
    store has read it."""
    q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = buffers
    _, _, _, Hq, GROUP, Sk, lo_shift, hi_shift = tiling
    o_desc, lse_ptr, stride_lb, stride_lh, Sq, scale_log2 = out
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = warpgroup_accumulator(BLOCK_N)
    o_layout: gl.constexpr = warpgroup_accumulator(BLOCK_D)
    p_layout: gl.constexpr = register_operand(o_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_tile = q_smem.index(HALF).reshape([HALF_M, BLOCK_D])
    o_tile = o_smem.index(HALF).reshape([HALF_M, BLOCK_D])
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
    b, h, _, m0, start, end = _tile(bh, pid_m, Hq, GROUP, Sk, lo_shift, hi_shift, HAS_LEFT, HAS_RIGHT,
                                    CONSUMERS * HALF_M, BLOCK_N)
    m_own, rows, full_lo, full_hi, own_end = _own_rows(m0, start, Sq, Sk, lo_shift, hi_shift, row_layout, HALF,
                                                       HAS_LEFT, HAS_RIGHT, BLOCK_N)
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([HALF_M], gl.float32, layout=row_layout)
    if D_SPLIT:
        # O of head dims 65-96 as 64 + 32 columns
        lo_layout: gl.constexpr = warpgroup_accumulator(64)
        hi_layout: gl.constexpr = warpgroup_accumulator(32)
        acc_lo = gl.zeros([HALF_M, 64], gl.float32, layout=lo_layout)
        acc_hi = gl.zeros([HALF_M, 32], gl.float32, layout=hi_layout)
    else:
        acc = gl.zeros([HALF_M, BLOCK_D], gl.float32, layout=o_layout)
    # wgmma groups that P V adds while S is waited for
    PV_GROUPS: gl.constexpr = 2 if D_SPLIT else 1
    # row maxima and sums by halves: 1.01-1.025x on the two-consumer D 64 tile without a band at B16 H32 S 1024-1536
    # (bf16 and fp16; 0.99-1.01x on smaller grids); elsewhere -4% to +3% from shape to shape and run to run, so one
    # chain per row there
    TREE: gl.constexpr = BLOCK_D == 64 and CONSUMERS == 2 and not (HAS_LEFT or HAS_RIGHT)
    n_blocks = gl.cdiv(own_end - start, BLOCK_N)
    # waited for even with nothing to compute, so that the producer's next load of this Q slot follows this one
    mbarrier.wait(q_ready.index(HALF), tile & 1)
    if n_blocks > 0:
        # block 0: scores and softmax only; its P V is issued in the next step
        slot = block % STAGES
        mbarrier.wait(k_ready.index(slot), (block // STAGES) & 1)
        s = _over_head_dim(q_tile, k_smem.index(slot).reshape([BLOCK_N, BLOCK_D]), s_zero, D_SPLIT)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(slot), count=1)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, rows, start, full_lo, full_hi, Sk, lo_shift, hi_shift,
                                           scale_log2, s_layout, HAS_LEFT, HAS_RIGHT, BLOCK_N, TREE)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for i in range(1, n_blocks):
            prev = (block + i - 1) % STAGES
            prev_phase = ((block + i - 1) // STAGES) & 1
            slot = (block + i) % STAGES
            mbarrier.wait(k_ready.index(slot), ((block + i) // STAGES) & 1)
            s = _over_head_dim(q_tile, k_smem.index(slot).reshape([BLOCK_N, BLOCK_D]), s_zero, D_SPLIT)
            mbarrier.wait(v_ready.index(prev), prev_phase)
            v_tile = v_smem.index(prev).reshape([BLOCK_N, BLOCK_D])
            if D_SPLIT:
                p_lo, p_hi, acc_lo, acc_hi = _add_product_in_parts(p_op, v_tile, acc_lo, acc_hi, lo_layout,
                                                                   hi_layout)
            else:
                acc = warpgroup_mma(p_op, v_tile, acc, is_async=True)
            s = warpgroup_mma_wait(PV_GROUPS, deps=(s,))
            mbarrier.arrive(k_empty.index(slot), count=1)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, rows, start + i * BLOCK_N, full_lo, full_hi, Sk,
                                               lo_shift, hi_shift, scale_log2, s_layout, HAS_LEFT, HAS_RIGHT,
                                               BLOCK_N, TREE)
            if D_SPLIT:
                acc_lo, acc_hi, p_lo, p_hi = warpgroup_mma_wait(0, deps=(acc_lo, acc_hi, p_lo, p_hi))
                mbarrier.arrive(v_empty.index(prev), count=1)
                acc_lo = acc_lo * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, lo_layout)), 1)
                acc_hi = acc_hi * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, hi_layout)), 1)
            else:
                acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
                mbarrier.arrive(v_empty.index(prev), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row_layout), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        if not O_IN_Q:
            # every Q K^T of this tile has completed: the producer may load the next tile's Q rows here
            mbarrier.arrive(q_empty.index(HALF), count=1)
        last = block + n_blocks - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        v_tile = v_smem.index(last % STAGES).reshape([BLOCK_N, BLOCK_D])
        if D_SPLIT:
            p_lo, p_hi, acc_lo, acc_hi = _add_product_in_parts(p_op, v_tile, acc_lo, acc_hi, lo_layout, hi_layout)
            acc_lo, acc_hi, p_lo, p_hi = warpgroup_mma_wait(0, deps=(acc_lo, acc_hi, p_lo, p_hi))
        else:
            acc = warpgroup_mma(p_op, v_tile, acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(v_empty.index(last % STAGES), count=1)
    elif not O_IN_Q:
        mbarrier.arrive(q_empty.index(HALF), count=1)

    if m_own < Sq:
        # l = 0 only for a row that saw no key; `l > 0` would turn a NaN row into zeros instead of propagating it
        seen = ~(l_i == 0.0)
        safe_l = gl.where(seen, l_i, 1.0)
        if D_SPLIT:
            o_lo = _normalised(acc_lo, safe_l, seen, lo_layout)
            o_hi = _normalised(acc_hi, safe_l, seen, hi_layout)
        else:
            o = _normalised(acc, safe_l, seen, o_layout)
        lse = gl.where(seen, (m_i + gl.log2(safe_l)) * _LN2, float("-inf"))
        lse_base = lse_ptr + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
        gl.store(lse_base + rows, lse, mask=rows < Sq)
        # the previous tile's O must have left this staging tile (the TMA store reads it asynchronously)
        tma.store_wait(0)
        gl.thread_barrier()
        if D_SPLIT:
            # the staging tile's columns past 96 go unwritten: the TMA store clips columns past the head dim
            o_tile.slice(0, 64, dim=1).store(o_lo.to(dtype))
            o_tile.slice(64, 32, dim=1).store(o_hi.to(dtype))
        else:
            o_tile.store(o.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, h, m_own, 0], o_smem.index(HALF))
        if O_IN_Q:
            # O was staged in the Q tile: the next tile's Q may land there once the store has read it
            tma.store_wait(0)
            mbarrier.arrive(q_empty.index(HALF), count=1)
    elif O_IN_Q:
        mbarrier.arrive(q_empty.index(HALF), count=1)
    # the tile's blocks past this consumer's own rows: wait for each to land (an arrival counts toward the phase
    # in flight) and release it, so that the producer can refill the slot for the other consumers
    for i in range(n_blocks, gl.cdiv(end - start, BLOCK_N)):
        slot = (block + i) % STAGES
        phase = ((block + i) // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        mbarrier.arrive(k_empty.index(slot), count=1)
        mbarrier.wait(v_ready.index(slot), phase)
        mbarrier.arrive(v_empty.index(slot), count=1)
    return block + gl.cdiv(end - start, BLOCK_N)


@gluon.jit(do_not_specialize=["Sq", "Sk"])
def _attn_fwd_hopper_kernel(
    q_desc, k_desc, v_desc, o_desc,  # TMA descriptors over (B, H, S, D); blocks [1, 1, 64 or BLOCK_N, BLOCK_D]
    lse_ptr, stride_lb, stride_lh,  # (B, Hq, Sq) fp32 output, 1 along the sequence
    B, Hq, GROUP, Sq, Sk, scale_log2, LEFT, RIGHT,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    PERSISTENT: gl.constexpr, PAIRED: gl.constexpr, O_IN_Q: gl.constexpr,
    D_SPLIT: gl.constexpr = False,  # head dims 65-96 in 128-column tiles: products over 64 + 32 columns
):
    FIRST: gl.constexpr = 0
    SECOND: gl.constexpr = 1
    THIRD: gl.constexpr = 2
    tiles_m = gl.cdiv(Sq, CONSUMERS * HALF_M)
    per_head, items = _items(tiles_m, B * Hq, PAIRED)
    lo_shift = Sk - Sq - LEFT
    hi_shift = Sk - Sq + RIGHT

    # list concatenation, not [n, *shape]: the Gluon frontend has no starred expressions
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)  # noqa: RUF005
    if O_IN_Q:
        o_smem = q_smem  # Q and O tiles have one shape, dtype and layout
    else:
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout)  # noqa: RUF005
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)  # noqa: RUF005
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)  # noqa: RUF005
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)  # every consumer releases a slot
        mbarrier.init(v_empty.index(i), count=CONSUMERS)

    buffers = (q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty)
    tiling = (items, per_head, tiles_m, Hq, GROUP, Sk, lo_shift, hi_shift)
    out = (o_desc, lse_ptr, stride_lb, stride_lh, Sq, scale_log2.to(gl.float32))
    loads = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty)
    # the third consumer's entry only when there is one: a partition list is fixed when the kernel is traced (and
    # constexprs stay constexprs only written into each entry, not carried in a tuple variable)
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (buffers, tiling, out, FIRST, HAS_LEFT, HAS_RIGHT, BLOCK_N, BLOCK_D, STAGES, CONSUMERS,
                         PERSISTENT, PAIRED, O_IN_Q, D_SPLIT)),
            (_consumer, (buffers, tiling, out, SECOND, HAS_LEFT, HAS_RIGHT, BLOCK_N, BLOCK_D, STAGES, CONSUMERS,
                         PERSISTENT, PAIRED, O_IN_Q, D_SPLIT)),
            (_consumer, (buffers, tiling, out, THIRD, HAS_LEFT, HAS_RIGHT, BLOCK_N, BLOCK_D, STAGES, CONSUMERS,
                         PERSISTENT, PAIRED, O_IN_Q, D_SPLIT)),
            (_producer, (loads, tiling, HAS_LEFT, HAS_RIGHT, BLOCK_N, STAGES, CONSUMERS, PERSISTENT, PAIRED)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    elif CONSUMERS == 1:
        gl.warp_specialize([
            (_consumer, (buffers, tiling, out, FIRST, HAS_LEFT, HAS_RIGHT, BLOCK_N, BLOCK_D, STAGES, CONSUMERS,
                         PERSISTENT, PAIRED, O_IN_Q, D_SPLIT)),
            (_producer, (loads, tiling, HAS_LEFT, HAS_RIGHT, BLOCK_N, STAGES, CONSUMERS, PERSISTENT, PAIRED)),
        ], [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (buffers, tiling, out, FIRST, HAS_LEFT, HAS_RIGHT, BLOCK_N, BLOCK_D, STAGES, CONSUMERS,
                         PERSISTENT, PAIRED, O_IN_Q, D_SPLIT)),
            (_consumer, (buffers, tiling, out, SECOND, HAS_LEFT, HAS_RIGHT, BLOCK_N, BLOCK_D, STAGES, CONSUMERS,
                         PERSISTENT, PAIRED, O_IN_Q, D_SPLIT)),
            (_producer, (loads, tiling, HAS_LEFT, HAS_RIGHT, BLOCK_N, STAGES, CONSUMERS, PERSISTENT, PAIRED)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
