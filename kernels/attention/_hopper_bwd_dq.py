"""dQ of the FlashAttention backward for Hopper (sm_90), in Gluon: a kernel of its own (D 256; D 128 deterministic).

Implements the dQ of the portable backward's dQ programs (``_attn_bwd_dq_program`` in ``kernels/attention/_kernels.py``,
read beside ``reference/attention.py``): ``dQ = scale * sum_j dS_j K_j`` with ``P = exp(Q K^T * scale - lse)``
and ``dS = P (dO V^T - delta)``, over every key block a query block sees. The dK/dV kernel at head dim 256
(``_hopper_bwd_split.py`` without its dQ) runs beside it; together they make the backward. Why two kernels: a
program of the one-kernel backward holds 64 keys (its dK and dV take the registers) and so writes a 64 x 256 fp32
dQ tile by bulk reduction for every 64 keys x 64 queries it computes, and that write-out limited it. Here dQ
stays in registers for the whole walk over the keys and goes out once, in the output dtype: no fp32 accumulator
to zero, reduce into and cast. The price is two more matmuls per tile pair (Q K^T and dO V^T again): 7 in all,
as the portable backward.

Schedule (one program = 128 query rows of one (batch, query head), two consumers of 64 rows): the forward's
(``_hopper.py``) with dO beside Q.
- a **producer** warp loads each consumer's Q and dO rows once, then the 32-key K and V blocks the tile sees
  into a ring of ``STAGES`` slots (ready barriers completed by the byte count, empty ones both consumers arrive
  on; K and V apart, so that Q K^T starts before V has landed).
- each **consumer** walks the blocks its own rows need: ``S = Q K_j^T`` and ``dP = dO V_j^T`` are issued, then
  ``dQ += dS_{j-1} K_{j-1}`` with ``dS_{j-1}`` in registers; it waits for S, computes ``P`` (masked at band edges,
  past Sk, and for rows past Sq or without keys, whose lse is taken as +inf), waits for dP, releases V_j, forms
  ``dS_j``, and once ``dS_{j-1} K_{j-1}`` is done releases K_{j-1}. The blocks of the tile past its own rows'
  last it releases unread.
- the end: dQ, scaled, is stored through the consumer's Q tile (its products are done) and written by one TMA store,
  which clips rows past Sq and columns past the head dim.
- registers (``configs.HOPPER_DQ``): dQ 64 x 256 fp32 takes 128 of a consumer's 240, S and dP 16 each.
  Shared memory: Q and dO 32 KiB each per consumer, the ring 3 x (K, V) of 32 x 256: 224 KiB. Three slots, not
  the forward's two: K_j stays held until ``dS_j K_j`` is done in the next step, so with two slots the producer
  could load K_{j+1} only once step j had ended, and every step would wait for a load.
  At head dim 128: 64-key blocks in four slots (three ran alike), dQ 64 registers, S and dP 32 each, 197,064
  bytes of shared memory, no spills (offline ptxas).

Limits: sm_90, fp16/bf16, dense (B, H, S, D) tensors that TMA can read in place, padded head dims 64, 128 and 256
(tiles in ``configs.HOPPER_DQ``), no dropout, no packed batches. ``kernels.attention.ops`` launches it after the
dK/dV kernel where ``configs.takes_hopper_dq_kernel`` says so: every call at head dim 256, ``deterministic`` calls
at 128 (where the one-kernel backward with dQ reductions is as fast or faster: 0.90-1.06x it at 128, 0.85-0.90x at
64, against 1.38-1.50x at 256).

Trade-offs: deterministic (one program per dQ tile, no reductions), but 7 matmuls per tile pair instead of 5, and
K and V are read once per 128 query rows.
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

from kernels.attention._hopper import (
    CONSUMER_ROWS,
    _load_kv_blocks,
    _masked_scores,
    _own_rows,
    _tile,
    register_operand,
    warpgroup_accumulator,
)

__all__ = ["QUERY_ROWS", "_attn_bwd_hopper_dq_kernel"]

#: query rows per program: two consumer warpgroups of 64
QUERY_ROWS = 2 * CONSUMER_ROWS
HALF_M: gl.constexpr = gl.constexpr(CONSUMER_ROWS)
_LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready,
              v_empty, b, h, hk, m0, start, end, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    for part in gl.static_range(2):
        mbarrier.expect(q_ready.index(part), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + part * HALF_M, 0], q_ready.index(part),
                                        q_smem.index(part))
        tma.async_copy_global_to_shared(do_desc, [b, h, m0 + part * HALF_M, 0], q_ready.index(part),
                                        do_smem.index(part))
    # the ring's count starts at 0, as a run-time value: the helper carries it through its loop
    _load_kv_blocks(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, start, end,
                    gl.to_tensor(0), BLOCK_N, STAGES)


@gluon.jit
def _ds_block(s, dp, lse2, delta, rows, n0, full_lo, full_hi, Sk, lo_shift, hi_shift, scale_log2,
              s_layout: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr):
    """``dS = P (dP - delta)`` of one key block, from its raw scores ``s``; P is zero where a key is past Sk or outside
    a row's band (blocks outside ``[full_lo, full_hi)``), and where a row's lse is +inf."""
    x = s * scale_log2
    if (n0 < full_lo) | (n0 >= full_hi):
        x = _masked_scores(x, rows, n0, Sk, lo_shift, hi_shift, s_layout, HAS_LEFT, HAS_RIGHT, BLOCK_N)
    p = gl.exp2(x - gl.expand_dims(lse2, 1))
    return p * (dp - gl.expand_dims(delta, 1))


@gluon.jit
def _consumer(q_smem, do_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, dq_desc, lse_ptr,
              delta_ptr, stride_lb, stride_lh, b, h, m0, start, end, Sq, Sk, lo_shift, hi_shift, scale,
              HALF: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_D: gl.constexpr, STAGES: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = warpgroup_accumulator(BLOCK_N)
    dq_layout: gl.constexpr = warpgroup_accumulator(BLOCK_D)
    ds_layout: gl.constexpr = register_operand(dq_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_tile = q_smem.index(HALF).reshape([HALF_M, BLOCK_D])
    do_tile = do_smem.index(HALF).reshape([HALF_M, BLOCK_D])
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
    scale_log2 = scale * _LOG2E
    m_own, rows, full_lo, full_hi, own_end = _own_rows(m0, start, Sq, Sk, lo_shift, hi_shift, row_layout, HALF,
                                                       HAS_LEFT, HAS_RIGHT, BLOCK_N)
    # rows past Sq, and rows that saw no key (lse = -inf), get +inf: P = 0 there
    stats = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + rows
    lse = gl.load(lse_ptr + stats, mask=rows < Sq, other=float("inf"))
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E
    delta = gl.load(delta_ptr + stats, mask=rows < Sq, other=0.0)
    dq = gl.zeros([HALF_M, BLOCK_D], gl.float32, layout=dq_layout)
    n_blocks = gl.cdiv(own_end - start, BLOCK_N)
    mbarrier.wait(q_ready.index(HALF), 0)
    if n_blocks > 0:
        # block 0: dS only; its dS K is issued in the next step
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q_tile, k_smem.index(0).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(0), 0)
        dp = warpgroup_mma(do_tile, v_smem.index(0).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), s_zero,
                           use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
        dp = warpgroup_mma_wait(0, deps=(dp,))
        mbarrier.arrive(v_empty.index(0), count=1)
        ds = _ds_block(s, dp, lse2, delta, rows, start, full_lo, full_hi, Sk, lo_shift, hi_shift, scale_log2,
                       s_layout, HAS_LEFT, HAS_RIGHT, BLOCK_N)
        ds_op = gl.convert_layout(ds.to(dtype), ds_layout)
        for i in range(1, n_blocks):
            prev = (i - 1) % STAGES
            slot = i % STAGES
            phase = (i // STAGES) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            s = warpgroup_mma(q_tile, k_smem.index(slot).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(slot), phase)
            dp = warpgroup_mma(do_tile, v_smem.index(slot).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)
            dq = warpgroup_mma(ds_op, k_smem.index(prev).reshape([BLOCK_N, BLOCK_D]), dq, is_async=True)
            s = warpgroup_mma_wait(2, deps=(s,))
            dp = warpgroup_mma_wait(1, deps=(dp,))
            mbarrier.arrive(v_empty.index(slot), count=1)
            ds = _ds_block(s, dp, lse2, delta, rows, start + i * BLOCK_N, full_lo, full_hi, Sk, lo_shift, hi_shift,
                           scale_log2, s_layout, HAS_LEFT, HAS_RIGHT, BLOCK_N)
            dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
            mbarrier.arrive(k_empty.index(prev), count=1)
            ds_op = gl.convert_layout(ds.to(dtype), ds_layout)
        last = (n_blocks - 1) % STAGES
        dq = warpgroup_mma(ds_op, k_smem.index(last).reshape([BLOCK_N, BLOCK_D]), dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
        mbarrier.arrive(k_empty.index(last), count=1)
    # the tile's blocks past this consumer's own rows: wait for each to land and release it, so that the producer
    # can refill the slot for the other consumer
    for i in range(gl.maximum(n_blocks, 0), gl.cdiv(end - start, BLOCK_N)):
        slot = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        mbarrier.arrive(k_empty.index(slot), count=1)
        mbarrier.wait(v_ready.index(slot), phase)
        mbarrier.arrive(v_empty.index(slot), count=1)
    if m_own < Sq:
        # every product that read this consumer's Q tile is done: dQ goes out through it
        q_tile.store((dq * scale).to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dq_desc, [b, h, m_own, 0], q_smem.index(HALF))
        tma.store_wait(0)


@gluon.jit(do_not_specialize=["Sq", "Sk"])
def _attn_bwd_hopper_dq_kernel(
    q_desc, do_desc,  # TMA descriptors over (B, Hq, Sq, D); blocks [1, 1, 64, BLOCK_D]
    k_desc, v_desc,  # over (B, Hkv, Sk, D); blocks [1, 1, BLOCK_N, BLOCK_D]
    dq_desc,  # over dQ ((B, Hq, Sq, D), q's dtype, contiguous); blocks [1, 1, 64, BLOCK_D]
    lse_ptr, delta_ptr, stride_lb, stride_lh,  # (B, Hq, Sq) fp32, 1 along the sequence
    Hq, GROUP, Sq, Sk, scale, LEFT, RIGHT,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    FIRST: gl.constexpr = 0
    SECOND: gl.constexpr = 1
    tiles_m = gl.cdiv(Sq, 2 * HALF_M)
    bh = gl.program_id(0) // tiles_m
    pid_m = gl.program_id(0) % tiles_m
    if HAS_RIGHT:
        pid_m = tiles_m - 1 - pid_m  # a head's longest tiles first, so the short ones fill the tail
    lo_shift = Sk - Sq - LEFT
    hi_shift = Sk - Sq + RIGHT
    b, h, hk, m0, start, end = _tile(bh, pid_m, Hq, GROUP, Sk, lo_shift, hi_shift, HAS_LEFT, HAS_RIGHT, 2 * HALF_M,
                                     BLOCK_N)
    scale = scale.to(gl.float32)

    dtype: gl.constexpr = q_desc.dtype
    # list concatenation, not [n, *shape]: the Gluon frontend has no starred expressions
    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)  # noqa: RUF005
    do_smem = gl.allocate_shared_memory(dtype, [2] + do_desc.block_type.shape, do_desc.layout)  # noqa: RUF005
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)  # noqa: RUF005
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)  # noqa: RUF005
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a slot
        mbarrier.init(v_empty.index(i), count=2)

    gl.warp_specialize([
        (_consumer, (q_smem, do_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, dq_desc, lse_ptr,
                     delta_ptr, stride_lb, stride_lh, b, h, m0, start, end, Sq, Sk, lo_shift, hi_shift, scale, FIRST,
                     HAS_LEFT, HAS_RIGHT, BLOCK_N, BLOCK_D, STAGES)),
        (_consumer, (q_smem, do_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, dq_desc, lse_ptr,
                     delta_ptr, stride_lb, stride_lh, b, h, m0, start, end, Sq, Sk, lo_shift, hi_shift, scale, SECOND,
                     HAS_LEFT, HAS_RIGHT, BLOCK_N, BLOCK_D, STAGES)),
        (_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_ready, k_ready, k_empty,
                     v_ready, v_empty, b, h, hk, m0, start, end, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
