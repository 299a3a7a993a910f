"""FlashAttention backward for Hopper (sm_90) at head dim 256, in Gluon: the head dim split between two consumers.

Implements the same gradients as the portable backward (``_attn_bwd_kernel`` in ``kernels/attention/_kernels.py``, read
beside ``reference/attention.py``) and as ``_hopper_bwd.py``, for padded head dim 256, without dropout. The kernel of
``_hopper_bwd.py`` gives each consumer warpgroup 64 keys and their whole dK and dV rows; at head dim 256 those are
2 x 64 x 256 fp32, 256 registers per thread, all a thread can have. So here both consumers work on the same 64 keys
and split the head dim instead: each owns 128 columns of dK and dV (128 registers per thread).

Schedule (one program = 64 keys of one (batch, key/value head)):
- a **producer** warp loads K and V once, as two 128-column halves each, then for every query head of the GQA group
  and every query block that sees these keys, the 64-row Q and dO tiles as two 32-row halves into a ring of
  ``STAGES`` slots, with the block's log-sum-exp (base 2) and ``delta`` beside them.
- each **consumer** takes one 32-row half of the query block for the scores: ``S^T = K Q_half^T`` and
  ``dP^T = V dO_half^T`` (64 keys x 32 queries, over all 256 columns of K and V), ``P^T`` and
  ``dS^T = P^T (dP^T - delta)``, and stores P and dS, its 32 rows of each, into one shared (64 x 64) tile each. A
  barrier says both halves are in; then with its 128 columns ``c``: ``dV[:, c] += P^T dO[:, c]``,
  ``dK[:, c] += dS^T Q[:, c]`` and ``dQ[:, c] = dS K[:, c] * scale``, all three reading P and dS from shared memory.
  Per tile pair that is the same 5 matmuls as ``_hopper_bwd.py``; the scores' products are 64 x 32 (wgmma N 32).
- dQ goes out by TMA bulk reductions (``cp.reduce.async.bulk.tensor`` add into the fp32 accumulator, 32 columns
  each), staged in shared memory that is free by then: once both consumers say every product of the step has read
  its tiles, the first consumer stages its 128 columns in the slot's Q tiles and the second in its dO tiles (64 x 128
  fp32 is the 32 KiB of a 64 x 256 tile). A consumer hands the slot back to the producer one step later, after
  ``tma.store_wait`` says its reductions have read the staging, so the producer still loads a step ahead. A staging
  buffer of its own did not fit: K, V and two ring slots take 192 KiB of the 227.
- two barriers per step between the consumers: ``tiles_ready`` (both halves of P and dS are stored) and
  ``tiles_read`` (both consumers' dV, dK and dQ products are done: the slot's Q and dO and the P and dS tiles are
  free). After the last step's ``tiles_read`` no one reads K or V any more, and each consumer writes its dK and dV
  columns through the shared memory they came in.
- ``WRITE_DQ`` False leaves dQ out (no dQ product, staging or reductions; each consumer hands the slot back once
  its products of the step are done): dQ then comes from ``_hopper_bwd_dq.py``, a kernel of its own.

Limits: sm_90, fp16/bf16, dense (B, H, S, D) tensors that TMA can read in place, padded head dim 256, no dropout, no
packed batches; ``kernels.attention.ops.uses_hopper_backward`` says which calls come here.

Trade-offs: with ``WRITE_DQ``, as ``_hopper_bwd.py``, dQ is a sum of fp32 reductions in arrival order (not bitwise
reproducible; the portable backward is); and with 64 keys per program every program reads each query block's Q
and dO (64 KiB) and writes 64 KiB of dQ per 64 keys, twice the traffic per FLOP of the 128-key programs at head
dim 128.

The default runs it without dQ (``WRITE_DQ`` False), then ``_hopper_bwd_dq.py`` (the family's TUNING.md says why).
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

from kernels.attention._hopper import _column_halves, warpgroup_accumulator
from kernels.attention._hopper_bwd import (
    DQ_TILE_COLS,
    _band_kept,
    _key_program,
    _query_blocks,
    _ring_step,
    _stage_query_stats,
    _tma_reduce_add,
)

__all__ = ["KEY_ROWS", "QUERY_HALF", "QUERY_ROWS", "_attn_bwd_hopper_split_kernel"]

#: keys per program: the wgmma M of one warpgroup, shared by both consumers
KEY_ROWS = 64
#: query rows per step; each consumer takes half of them for the scores
QUERY_ROWS = 64
QUERY_HALF = QUERY_ROWS // 2
BLOCK_N: gl.constexpr = gl.constexpr(KEY_ROWS)
BLOCK_M: gl.constexpr = gl.constexpr(QUERY_ROWS)
HALF_M: gl.constexpr = gl.constexpr(QUERY_HALF)
_LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_ready, q_ready,
              do_ready, stats_ready, empty, lse_ptr, delta_ptr, stride_lb, stride_lh, b, hk, GROUP, Sq, n0, start_m,
              end_m, BLOCK_D: gl.constexpr, STAGES: gl.constexpr):
    COLS: gl.constexpr = BLOCK_D // 2
    mbarrier.expect(kv_ready.index(0), 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for half in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0, half * COLS], kv_ready.index(0), k_smem.index(half))
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0, half * COLS], kv_ready.index(0), v_smem.index(half))
    query_blocks = gl.cdiv(end_m - start_m, BLOCK_M)
    for i in range(GROUP * query_blocks):
        slot, phase, h, m0 = _ring_step(i, query_blocks, hk * GROUP, start_m, BLOCK_M, STAGES)
        # a fresh mbarrier counts as having completed the phase before 0: the first pass does not wait
        phase = phase ^ 1
        mbarrier.wait(empty.index(slot), phase)
        mbarrier.expect(q_ready.index(slot), 2 * q_desc.block_type.nbytes)
        for half in gl.static_range(2):
            tma.async_copy_global_to_shared(q_desc, [b, h, m0 + half * HALF_M, 0], q_ready.index(slot),
                                            q_smem.index(2 * slot + half))
        mbarrier.expect(do_ready.index(slot), 2 * do_desc.block_type.nbytes)
        for half in gl.static_range(2):
            tma.async_copy_global_to_shared(do_desc, [b, h, m0 + half * HALF_M, 0], do_ready.index(slot),
                                            do_smem.index(2 * slot + half))
        _stage_query_stats(lse_ptr, delta_ptr, stride_lb, stride_lh, lse_smem.index(slot), delta_smem.index(slot),
                           stats_ready.index(slot), b, h, m0, Sq)


@gluon.jit
def _consumer(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, lse_smem, delta_smem, kv_ready, q_ready, do_ready,
              stats_ready, empty, tiles_ready, tiles_read, dk_desc, dv_desc, dq_desc, b, hk, GROUP, Sk, n0, scale,
              lo_shift, hi_shift, start_m, full_lo, full_hi, end_m, HALF: gl.constexpr, HAS_LEFT: gl.constexpr,
              HAS_RIGHT: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr, WRITE_DQ: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    COLS: gl.constexpr = BLOCK_D // 2  # this consumer's columns of dK, dV and dQ
    DQ_PARTS: gl.constexpr = COLS // DQ_TILE_COLS
    gl.static_assert(DQ_PARTS == 4, "dQ goes out as four 32-column parts per consumer")
    # (keys, this consumer's queries) tiles: S^T, dP^T, P^T, dS^T
    t_layout: gl.constexpr = warpgroup_accumulator(HALF_M)
    # (64 rows, this consumer's columns): dK, dV, dQ
    acc_layout: gl.constexpr = warpgroup_accumulator(COLS)
    query_layout: gl.constexpr = gl.SliceLayout(0, t_layout)
    k_cols = k_smem.index(HALF).reshape([BLOCK_N, COLS])
    v_cols = v_smem.index(HALF).reshape([BLOCK_N, COLS])
    keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, t_layout))
    past_sk = n0 + BLOCK_N > Sk
    scale_log2 = scale * _LOG2E
    # dQ staging: this slot's Q tiles (first consumer) or dO tiles (second), 64 x 32 fp32 parts, once both
    # consumers' products of the step are done with them
    if HALF == 0:
        staged = q_smem
    else:
        staged = do_smem
    if WRITE_DQ:
        staging = staged._reinterpret(gl.float32, [STAGES * DQ_PARTS] + dq_desc.block_type.shape,  # noqa: RUF005
                                      dq_desc.layout)

    dk = gl.zeros([BLOCK_N, COLS], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, COLS], gl.float32, layout=acc_layout)
    t_zero = gl.zeros([BLOCK_N, HALF_M], gl.float32, layout=t_layout)
    query_blocks = gl.cdiv(end_m - start_m, BLOCK_M)
    steps = GROUP * query_blocks
    mbarrier.wait(kv_ready.index(0), 0)
    for i in range(steps):
        slot, phase, h, m0 = _ring_step(i, query_blocks, hk * GROUP, start_m, BLOCK_M, STAGES)
        rows = m0 + HALF * HALF_M + gl.arange(0, HALF_M, layout=query_layout)
        q_own = q_smem.index(2 * slot + HALF).reshape([HALF_M, BLOCK_D])
        do_own = do_smem.index(2 * slot + HALF).reshape([HALF_M, BLOCK_D])
        mbarrier.wait(q_ready.index(slot), phase)
        st = warpgroup_mma(k_smem.index(0).reshape([BLOCK_N, COLS]), q_own.slice(0, COLS, dim=1).permute((1, 0)),
                           t_zero, use_acc=False, is_async=True)
        st = warpgroup_mma(k_smem.index(1).reshape([BLOCK_N, COLS]), q_own.slice(COLS, COLS, dim=1).permute((1, 0)),
                           st, is_async=True)
        mbarrier.wait(do_ready.index(slot), phase)
        dpt = warpgroup_mma(v_smem.index(0).reshape([BLOCK_N, COLS]), do_own.slice(0, COLS, dim=1).permute((1, 0)),
                            t_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_smem.index(1).reshape([BLOCK_N, COLS]),
                            do_own.slice(COLS, COLS, dim=1).permute((1, 0)), dpt, is_async=True)
        if i > 0:
            if WRITE_DQ:
                # the previous step's dQ reductions have read their staging: that slot goes back to the producer
                tma.store_wait(0)
                gl.thread_barrier()
                mbarrier.arrive(empty.index((i - 1) % STAGES), count=1)
            else:
                # both consumers' products of the previous step are done with the P and dS tiles
                mbarrier.wait(tiles_read.index(0), (i - 1) & 1)
        mbarrier.wait(stats_ready.index(slot), phase)
        lse2 = lse_smem.index(slot).slice(HALF * HALF_M, HALF_M).load(query_layout)
        st = warpgroup_mma_wait(2, deps=(st,))
        pt = gl.exp2(st * scale_log2 - gl.expand_dims(lse2, 0))
        if past_sk | (m0 < full_lo) | (m0 >= full_hi):
            # keys past Sk read as zeros but would still get P = exp(-lse), which can overflow
            pt = _band_kept(pt, keys, rows, Sk, lo_shift, hi_shift, HAS_LEFT, HAS_RIGHT)
        # P and dS are stored query-major, so that each consumer's half is whole rows of the shared tile
        p_smem.slice(HALF * HALF_M, HALF_M, dim=0).store(gl.permute(pt.to(dtype), (1, 0)))
        delta = delta_smem.index(slot).slice(HALF * HALF_M, HALF_M).load(query_layout)
        dpt = warpgroup_mma_wait(0, deps=(dpt,))
        dst = pt * (dpt - gl.expand_dims(delta, 0))
        ds_smem.slice(HALF * HALF_M, HALF_M, dim=0).store(gl.permute(dst.to(dtype), (1, 0)))
        fence_async_shared()
        mbarrier.arrive(tiles_ready.index(0), count=1)
        mbarrier.wait(tiles_ready.index(0), i & 1)
        for half in gl.static_range(2):
            q_half = q_smem.index(2 * slot + half).reshape([HALF_M, BLOCK_D]).slice(HALF * COLS, COLS, dim=1)
            do_half = do_smem.index(2 * slot + half).reshape([HALF_M, BLOCK_D]).slice(HALF * COLS, COLS, dim=1)
            dv = warpgroup_mma(p_smem.slice(half * HALF_M, HALF_M, dim=0).permute((1, 0)), do_half, dv,
                               is_async=True)
            dk = warpgroup_mma(ds_smem.slice(half * HALF_M, HALF_M, dim=0).permute((1, 0)), q_half, dk,
                               is_async=True)
        if WRITE_DQ:
            dq = warpgroup_mma(ds_smem, k_cols, gl.zeros([BLOCK_M, COLS], gl.float32, layout=acc_layout),
                               use_acc=False, is_async=True)
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
            mbarrier.arrive(tiles_read.index(0), count=1)
            dq = dq * scale
            first, second = _column_halves(dq)
            parts01 = _column_halves(first)
            parts23 = _column_halves(second)
            mbarrier.wait(tiles_read.index(0), i & 1)
            for j in gl.static_range(2):
                staging.index(slot * DQ_PARTS + j).reshape([BLOCK_M, DQ_TILE_COLS]).store(parts01[j])
                staging.index(slot * DQ_PARTS + 2 + j).reshape([BLOCK_M, DQ_TILE_COLS]).store(parts23[j])
            fence_async_shared()
            for j in gl.static_range(DQ_PARTS):
                _tma_reduce_add(dq_desc, [b, h, m0, HALF * COLS + j * DQ_TILE_COLS],
                                staging.index(slot * DQ_PARTS + j))
        else:
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
            mbarrier.arrive(tiles_read.index(0), count=1)
            # this consumer is done with the slot's Q and dO
            mbarrier.arrive(empty.index(slot), count=1)
    if not WRITE_DQ:  # noqa: SIM102 (a constexpr test and a run-time one: the Gluon frontend keeps them apart)
        if steps > 0:
            mbarrier.wait(tiles_read.index(0), (steps - 1) & 1)

    # After the last step's tiles_read no product reads K or V: this consumer's columns of them stage its dK and dV
    # for the TMA stores (which clip rows past Sk).
    v_cols.store(dv.to(dtype))
    k_cols.store((dk * scale).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, n0, HALF * COLS], k_smem.index(HALF))
    tma.async_copy_shared_to_global(dv_desc, [b, hk, n0, HALF * COLS], v_smem.index(HALF))
    tma.store_wait(0)


@gluon.jit
def _consumer_worker(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, lse_smem, delta_smem, kv_ready, q_ready,
                     do_ready, stats_ready, empty, tiles_ready, tiles_read, dk_desc, dv_desc, dq_desc, b, hk, GROUP, Sk,
                     n0, scale, lo_shift, hi_shift, start_m, full_lo, full_hi, end_m, HAS_LEFT: gl.constexpr,
                     HAS_RIGHT: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr, WRITE_DQ: gl.constexpr):
    _consumer(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, lse_smem, delta_smem, kv_ready, q_ready, do_ready,
              stats_ready, empty, tiles_ready, tiles_read, dk_desc, dv_desc, dq_desc, b, hk, GROUP, Sk, n0, scale,
              lo_shift, hi_shift, start_m, full_lo, full_hi, end_m, 1, HAS_LEFT, HAS_RIGHT, BLOCK_D, STAGES, WRITE_DQ)


@gluon.jit(do_not_specialize=["Sq", "Sk"])
def _attn_bwd_hopper_split_kernel(
    q_desc, do_desc,  # TMA descriptors over (B, Hq, Sq, D); blocks [1, 1, 32, BLOCK_D]
    k_desc, v_desc, dk_desc, dv_desc,  # over (B, Hkv, Sk, D); blocks [1, 1, 64, BLOCK_D / 2]
    dq_desc,  # over the dQ accumulator ((B, Hq, Sq, BLOCK_D) fp32, zeroed); blocks [1, 1, 64, 32]
    lse_ptr, delta_ptr, stride_lb, stride_lh,  # (B, Hq, Sq) fp32, 1 along the sequence
    Hkv, GROUP, Sq, Sk, scale, LEFT, RIGHT,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, WRITE_DQ: gl.constexpr,
    KEY_MAJOR: gl.constexpr = False,  # the grid's order (``_key_program``)
):
    FIRST_HALF: gl.constexpr = 0
    b, hk, n0 = _key_program(Hkv, BLOCK_N, KEY_MAJOR)
    scale = scale.to(gl.float32)
    lo_shift = Sk - Sq - LEFT
    hi_shift = Sk - Sq + RIGHT
    start_m, full_lo, full_hi, end_m = _query_blocks(n0, Sq, lo_shift, hi_shift, HAS_LEFT, HAS_RIGHT, BLOCK_M,
                                                     BLOCK_N)

    dtype: gl.constexpr = q_desc.dtype
    # list concatenation, not [n, *shape]: the Gluon frontend has no starred expressions
    q_smem = gl.allocate_shared_memory(dtype, [2 * STAGES] + q_desc.block_type.shape, q_desc.layout)  # noqa: RUF005
    do_smem = gl.allocate_shared_memory(dtype, [2 * STAGES] + do_desc.block_type.shape,  # noqa: RUF005
                                        do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)  # noqa: RUF005
    v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)  # noqa: RUF005
    tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], tile_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], tile_layout)
    stats_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    stats_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    tiles_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    tiles_read = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(stats_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers' reductions have read their staging
    mbarrier.init(tiles_ready.index(0), count=2)  # both consumers' halves of P and dS are stored
    mbarrier.init(tiles_read.index(0), count=2)  # both consumers' products of the step are done

    gl.warp_specialize([
        (_consumer, (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, lse_smem, delta_smem, kv_ready, q_ready,
                     do_ready, stats_ready, empty, tiles_ready, tiles_read, dk_desc, dv_desc, dq_desc, b, hk, GROUP,
                     Sk, n0, scale, lo_shift, hi_shift, start_m, full_lo, full_hi, end_m, FIRST_HALF, HAS_LEFT,
                     HAS_RIGHT, BLOCK_D, STAGES, WRITE_DQ)),
        (_consumer_worker, (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, lse_smem, delta_smem, kv_ready,
                            q_ready, do_ready, stats_ready, empty, tiles_ready, tiles_read, dk_desc, dv_desc, dq_desc,
                            b, hk, GROUP, Sk, n0, scale, lo_shift, hi_shift, start_m, full_lo, full_hi, end_m,
                            HAS_LEFT, HAS_RIGHT, BLOCK_D, STAGES, WRITE_DQ)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_ready,
                     q_ready, do_ready, stats_ready, empty, lse_ptr, delta_ptr, stride_lb, stride_lh, b, hk, GROUP,
                     Sq, n0, start_m, end_m, BLOCK_D, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
