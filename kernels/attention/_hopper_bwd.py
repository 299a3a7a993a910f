"""FlashAttention backward for Hopper (sm_90) in Gluon: warp-specialised, TMA-fed, asynchronous wgmma, TMA-reduced dQ.

Implements the same gradients as the portable backward (``_attn_bwd_kernel`` in ``kernels/attention/_kernels.py``, read
beside ``reference/attention.py``): dQ, dK, dV of softmax(Q K^T * scale) V for the band
``i + Sk - Sq - LEFT <= j <= i + Sk - Sq + RIGHT`` (causal: RIGHT = 0), GQA/MQA, Sq != Sk, any (batch, head,
sequence) strides. ``delta = rowsum(dO * O)`` comes from the portable preprocess kernel first.

Schedule (one program = 128 keys of one (batch, key/value head)):
- a **producer** warp loads K and V once (two 64-row halves each, by TMA), then for every query head of the GQA
  group and every query block that sees these keys, the 64-row Q and dO tiles into a ring of ``STAGES``
  shared-memory slots ("ready" mbarriers completed by the TMA byte count, an "empty" one both consumers arrive on),
  and the block's log-sum-exp (base 2) and ``delta`` beside them: loaded by the consumers from global memory, their
  latency sat twice per step on the critical path (1.36-1.52x slower at D 128 on an H100).
- two **consumer** warpgroups own 64 keys each and accumulate their dK and dV in registers. Per query block, in the
  transposed frame (keys are the wgmma M): ``S^T = K Q^T``, then ``P^T = exp2(S^T * scale * log2 e - lse * log2 e)``;
  ``dP^T = V dO^T`` and ``dV += P^T dO`` are issued together (P^T as a register operand), then
  ``dS^T = P^T (dP^T - delta)`` and ``dK += dS^T Q``. S^T retires before dP^T is issued so that the two 64 x 64 fp32
  tiles are not live at once beside dK and dV (ptxas serialised the wgmmas for want of registers when they were).
  That is 5 matmuls per tile pair, against 7 for the portable backward, which recomputes Q K^T and dO V^T in
  separate dQ programs.
- dQ: both consumers store their dS^T into one double-buffered tile (an mbarrier says both halves are in) and each
  computes half of dQ's columns over all 128 keys, ``dS K * scale``, in 32-column parts. Each part goes to shared
  memory and from there into the fp32 accumulator by a TMA bulk reduction (``cp.reduce.async.bulk.tensor`` add,
  rows past Sq skipped by the TMA unit), which the consumer issues and does not wait for: the next step's
  ``tma.store_wait`` makes sure it has read its tile. Per-thread atomics from the accumulator layout were 1.02-1.11x
  slower (H100, bf16, S 4096): the consumer issued 16 of them per thread and step and stalled on the load/store
  queue. The preprocess kernel zeroed the accumulator beside ``delta``; one cast makes it dQ.
- register budget: the producer gives its registers back (24 per thread), each consumer takes 240.

Gluon 3.6's ``tma`` module has loads and stores but no reduction; ``_tma_reduce_add`` below builds it from the
operation Triton 3.6 defines (``ttng.async_tma_reduce``, through the Gluon builder).

Limits: sm_90, fp16/bf16, dense (B, H, S, D) tensors that TMA can read in place (head dim contiguous, other strides
and the base 16-byte aligned), padded head dims 64 and 128, no dropout, no packed batches, eager calls.
``kernels.attention.ops.uses_hopper_backward`` says which calls come here.

Speed: on an H100 (bf16) 1.02-1.09x the portable backward at S 2048-8192 and 0.82-0.93x cuDNN; the default path takes
it from 4096 queries and keys on (``configs.prefers_hopper_backward``). Each consumer waits on every wgmma it
issues, so nothing overlaps the softmax inside a warpgroup; issuing dP^T before P^T is computed (0.95-1.02x) and
computing dQ one query block late so that the consumers need not wait on each other (0.95-1.00x) were measured and
not kept.

Trade-offs: dQ is a sum of fp32 reductions in arrival order, so it is not bitwise reproducible run to run
(``deterministic=True`` takes the portable backward); the accumulator costs ``B * Hq * Sq * D * 4`` bytes, written
once as zeros and read once by the cast. Query blocks that cross a band edge, or programs whose keys run past Sk,
apply the mask at run time per block (a uniform branch); the band is taken for the whole 128-key program, so a
consumer may compute a block that its own 64 keys do not see (it masks to zero). Before a consumer overwrites its K
half with dK at the end, both consumers say they are done reading K (the other's last dQ products read it).
"""

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.attention import _kernels as _portable
from kernels.attention._hopper import register_operand, warpgroup_accumulator

__all__ = ["KEY_ROWS", "QUERY_ROWS", "_attn_bwd_hopper_kernel"]

#: keys per program: two consumer warpgroups of 64 (the wgmma M of one warpgroup)
KEY_ROWS = 128
#: query rows per step (the wgmma M of dQ = dS K)
QUERY_ROWS = 64
BLOCK_N: gl.constexpr = gl.constexpr(KEY_ROWS)
HALF_N: gl.constexpr = gl.constexpr(KEY_ROWS // 2)
BLOCK_M: gl.constexpr = gl.constexpr(QUERY_ROWS)
_LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
#: dQ columns per TMA reduction: 32 fp32 are the 128 bytes a swizzled TMA box may span
DQ_TILE = 32
DQ_TILE_COLS: gl.constexpr = gl.constexpr(DQ_TILE)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Adds the shared-memory tile ``src`` into the global tensor under ``tensor_desc`` at ``coord`` with one TMA
    bulk reduction (``cp.reduce.async.bulk.tensor``; rows past the tensor's end are skipped). Triton 3.6 builds the
    operation (``ttng.async_tma_reduce``) but Gluon's ``tma`` module does not name it; like a TMA store it completes
    through ``tma.store_wait``."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)

# The query range of a key block is the portable kernel's rule, compiled as Gluon (scalar arithmetic only).
_query_blocks = gluon.jit(_portable._query_range.fn)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_ready, q_ready,
              do_ready, stats_ready, empty, lse_ptr, delta_ptr, stride_lb, stride_lh, b, hk, GROUP, Sq, n0, start_m,
              end_m, STAGES: gl.constexpr):
    mbarrier.expect(kv_ready.index(0), 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for half in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0 + half * HALF_N, 0], kv_ready.index(0), k_smem.index(half))
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0 + half * HALF_N, 0], kv_ready.index(0), v_smem.index(half))
    query_blocks = gl.cdiv(end_m - start_m, BLOCK_M)
    for i in range(GROUP * query_blocks):
        slot = i % STAGES
        # a fresh mbarrier counts as having completed the phase before 0: the first pass does not wait
        phase = ((i // STAGES) & 1) ^ 1
        h = hk * GROUP + i // query_blocks
        m0 = start_m + (i % query_blocks) * BLOCK_M
        mbarrier.wait(empty.index(slot), phase)
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], q_ready.index(slot), q_smem.index(slot))
        mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], do_ready.index(slot), do_smem.index(slot))
        # The per-query statistics go through shared memory too: a consumer that loaded them from global memory
        # would wait out that latency twice per step. Rows past Sq, and rows that saw no key (lse = -inf), get
        # lse = +inf: P = 0 there.
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0]))
        stats = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
        lse = gl.load(lse_ptr + stats + rows, mask=rows < Sq, other=float("inf"))
        lse_smem.index(slot).store(gl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E)
        delta_smem.index(slot).store(gl.load(delta_ptr + stats + rows, mask=rows < Sq, other=0.0))
        mbarrier.arrive(stats_ready.index(slot), count=1)


@gluon.jit
def _band_kept(pt, keys, rows, Sk, lo_shift, hi_shift, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """P^T with zeros where key ``keys[r]`` is past Sk or outside query ``rows[c]``'s band."""
    keep = gl.expand_dims(keys < Sk, 1)
    if HAS_RIGHT:
        keep = keep & (gl.expand_dims(keys, 1) <= gl.expand_dims(rows + hi_shift, 0))
    if HAS_LEFT:
        keep = keep & (gl.expand_dims(keys, 1) >= gl.expand_dims(rows + lo_shift, 0))
    return gl.where(keep, pt, 0.0)


@gluon.jit
def _dq_by_tma_reduction(ds_buffer, k_smem, dq_smem, dq_desc, b, h, m0, scale, HALF: gl.constexpr,
                         BLOCK_D: gl.constexpr):
    """This consumer's half of dQ's columns for one query block, ``dS K * scale`` over all 128 keys, added into the
    fp32 accumulator by TMA bulk reductions from shared memory: 32 columns per reduction."""
    PARTS: gl.constexpr = BLOCK_D // 2 // DQ_TILE_COLS
    part_layout: gl.constexpr = warpgroup_accumulator(DQ_TILE_COLS)
    part_zero = gl.zeros([BLOCK_M, DQ_TILE_COLS], gl.float32, layout=part_layout)
    ds_lo = ds_buffer.slice(0, HALF_N, dim=0).permute((1, 0))
    ds_hi = ds_buffer.slice(HALF_N, HALF_N, dim=0).permute((1, 0))
    k_lo = k_smem.index(0).reshape([HALF_N, BLOCK_D])
    k_hi = k_smem.index(1).reshape([HALF_N, BLOCK_D])
    col0: gl.constexpr = HALF * (BLOCK_D // 2)
    # the previous step's reductions must have read this consumer's tiles before they are overwritten
    tma.store_wait(0)
    gl.thread_barrier()
    # both 32-column parts are issued before either is waited on
    first = warpgroup_mma(ds_lo, k_lo.slice(col0, DQ_TILE_COLS, dim=1), part_zero, use_acc=False, is_async=True)
    first = warpgroup_mma(ds_hi, k_hi.slice(col0, DQ_TILE_COLS, dim=1), first, is_async=True)
    if PARTS == 2:
        second = warpgroup_mma(ds_lo, k_lo.slice(col0 + DQ_TILE_COLS, DQ_TILE_COLS, dim=1), part_zero, use_acc=False,
                               is_async=True)
        second = warpgroup_mma(ds_hi, k_hi.slice(col0 + DQ_TILE_COLS, DQ_TILE_COLS, dim=1), second, is_async=True)
        first = warpgroup_mma_wait(1, deps=(first,))
        dq_smem.index(HALF * PARTS).reshape([BLOCK_M, DQ_TILE_COLS]).store(first * scale)
        second = warpgroup_mma_wait(0, deps=(second,))
        dq_smem.index(HALF * PARTS + 1).reshape([BLOCK_M, DQ_TILE_COLS]).store(second * scale)
    else:
        first = warpgroup_mma_wait(0, deps=(first,))
        dq_smem.index(HALF * PARTS).reshape([BLOCK_M, DQ_TILE_COLS]).store(first * scale)
    fence_async_shared()
    for j in gl.static_range(PARTS):
        _tma_reduce_add(dq_desc, [b, h, m0, col0 + j * DQ_TILE_COLS], dq_smem.index(HALF * PARTS + j))


@gluon.jit
def _consumer(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_ready, q_ready, do_ready,
              stats_ready, empty, ds_ready, keys_done, dk_desc, dv_desc, dq_desc, b, hk, GROUP, Sq, Sk, n0, scale,
              lo_shift, hi_shift, start_m, full_lo, full_hi, end_m,
              HALF: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_D: gl.constexpr,
              STAGES: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    # (keys, queries) tiles: S^T, dP^T, P^T, dS^T
    t_layout: gl.constexpr = warpgroup_accumulator(BLOCK_M)
    # (64 keys, head dim) accumulators: dK, dV
    acc_layout: gl.constexpr = warpgroup_accumulator(BLOCK_D)
    op_layout: gl.constexpr = register_operand(acc_layout)
    query_layout: gl.constexpr = gl.SliceLayout(0, t_layout)
    k_tile = k_smem.index(HALF).reshape([HALF_N, BLOCK_D])
    v_tile = v_smem.index(HALF).reshape([HALF_N, BLOCK_D])
    keys = n0 + HALF * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, t_layout))
    past_sk = n0 + (HALF + 1) * HALF_N > Sk
    scale_log2 = scale * _LOG2E

    dk = gl.zeros([HALF_N, BLOCK_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([HALF_N, BLOCK_D], gl.float32, layout=acc_layout)
    t_zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=t_layout)
    query_blocks = gl.cdiv(end_m - start_m, BLOCK_M)
    mbarrier.wait(kv_ready.index(0), 0)
    for i in range(GROUP * query_blocks):
        slot = i % STAGES
        phase = (i // STAGES) & 1
        h = hk * GROUP + i // query_blocks
        m0 = start_m + (i % query_blocks) * BLOCK_M
        rows = m0 + gl.arange(0, BLOCK_M, layout=query_layout)
        q_tile = q_smem.index(slot).reshape([BLOCK_M, BLOCK_D])
        do_tile = do_smem.index(slot).reshape([BLOCK_M, BLOCK_D])
        # Order chosen for registers: dK and dV hold 128 per thread at head dim 128, so S^T and dP^T (32 each) and
        # the per-query vectors (16 each) are not all live at once.
        mbarrier.wait(q_ready.index(slot), phase)
        st = warpgroup_mma(k_tile, q_tile.permute((1, 0)), t_zero, use_acc=False, is_async=True)
        mbarrier.wait(stats_ready.index(slot), phase)
        lse2 = lse_smem.index(slot).load(query_layout)
        st = warpgroup_mma_wait(0, deps=(st,))
        pt = gl.exp2(st * scale_log2 - gl.expand_dims(lse2, 0))
        if past_sk | (m0 < full_lo) | (m0 >= full_hi):
            # keys past Sk read as zeros but would still get P = exp(-lse), which can overflow
            pt = _band_kept(pt, keys, rows, Sk, lo_shift, hi_shift, HAS_LEFT, HAS_RIGHT)
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        mbarrier.wait(do_ready.index(slot), phase)
        dpt = warpgroup_mma(v_tile, do_tile.permute((1, 0)), t_zero, use_acc=False, is_async=True)
        dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
        delta = delta_smem.index(slot).load(query_layout)
        dpt = warpgroup_mma_wait(1, deps=(dpt,))
        dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
        ds_op = gl.convert_layout(dst, op_layout)
        dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
        # dS^T of both consumers in one double-buffered tile; the barrier says both halves are in
        ds_buffer = ds_smem.index(i % 2)
        ds_buffer.slice(HALF * HALF_N, HALF_N, dim=0).store(dst)
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(i % 2), count=1)
        dv, dk, pt_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, ds_op))
        mbarrier.arrive(empty.index(slot), count=1)
        mbarrier.wait(ds_ready.index(i % 2), (i // 2) & 1)
        _dq_by_tma_reduction(ds_buffer, k_smem, dq_smem, dq_desc, b, h, m0, scale, HALF, BLOCK_D)

    # Their shared memory stages dK and dV for the TMA stores (which clip rows past Sk). This consumer's V half is
    # read by no one else now; its K half is, by the other consumer's last dQ products: both say they are done
    # first (without that wait, a consumer that finished early overwrote K under the other's dQ).
    mbarrier.arrive(keys_done.index(0), count=1)
    v_tile.store(dv.to(dtype))
    mbarrier.wait(keys_done.index(0), 0)
    k_tile.store((dk * scale).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, n0 + HALF * HALF_N, 0], k_smem.index(HALF))
    tma.async_copy_shared_to_global(dv_desc, [b, hk, n0 + HALF * HALF_N, 0], v_smem.index(HALF))
    tma.store_wait(0)


@gluon.jit
def _consumer_worker(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_ready, q_ready,
                     do_ready, stats_ready, empty, ds_ready, keys_done, dk_desc, dv_desc, dq_desc, b, hk, GROUP, Sq, Sk,
                     n0, scale, lo_shift, hi_shift, start_m, full_lo, full_hi, end_m,
                     HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr):
    _consumer(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_ready, q_ready, do_ready,
              stats_ready, empty, ds_ready, keys_done, dk_desc, dv_desc, dq_desc, b, hk, GROUP, Sq, Sk, n0, scale,
              lo_shift, hi_shift, start_m, full_lo, full_hi, end_m, 1, HAS_LEFT, HAS_RIGHT, BLOCK_D, STAGES)


@gluon.jit(do_not_specialize=["Sq", "Sk"])
def _attn_bwd_hopper_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc,  # TMA descriptors over (B, H, S, D); blocks [1, 1, 64, BLOCK_D]
    dq_desc,  # TMA descriptor over the dQ accumulator ((B, Hq, Sq, BLOCK_D) fp32, zeroed); blocks [1, 1, 64, 32]
    lse_ptr, delta_ptr, stride_lb, stride_lh,  # (B, Hq, Sq) fp32, 1 along the sequence
    Hkv, GROUP, Sq, Sk, scale, LEFT, RIGHT,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    FIRST_HALF: gl.constexpr = 0
    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    n0 = pid_n * BLOCK_N
    scale = scale.to(gl.float32)
    lo_shift = Sk - Sq - LEFT
    hi_shift = Sk - Sq + RIGHT
    start_m, full_lo, full_hi, end_m = _query_blocks(n0, Sq, lo_shift, hi_shift, HAS_LEFT, HAS_RIGHT, BLOCK_M,
                                                     BLOCK_N)

    dtype: gl.constexpr = q_desc.dtype
    # list concatenation, not [n, *shape]: the Gluon frontend has no starred expressions
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)  # noqa: RUF005
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)  # noqa: RUF005
    k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)  # noqa: RUF005
    v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)  # noqa: RUF005
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    stats_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
    stats_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # dQ parts on their way to the TMA reductions: (D / 32) tiles of 64 x 32 fp32 (one buffer; a reduction has a
    # whole step to read its tile)
    dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_D // DQ_TILE_COLS] + dq_desc.block_type.shape,  # noqa: RUF005
                                        dq_desc.layout)
    mbarrier.init(kv_ready.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(stats_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a slot
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # both consumers' halves of dS^T are in
    keys_done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(keys_done.index(0), count=2)  # both consumers have finished reading K

    gl.warp_specialize([
        (_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_ready, q_ready,
                     do_ready, stats_ready, empty, ds_ready, keys_done, dk_desc, dv_desc, dq_desc, b, hk, GROUP, Sq,
                     Sk, n0, scale, lo_shift, hi_shift, start_m, full_lo, full_hi, end_m, FIRST_HALF, HAS_LEFT,
                     HAS_RIGHT, BLOCK_D, STAGES)),
        (_consumer_worker, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_ready,
                            q_ready, do_ready, stats_ready, empty, ds_ready, keys_done, dk_desc, dv_desc, dq_desc, b,
                            hk, GROUP, Sq, Sk, n0, scale, lo_shift, hi_shift, start_m, full_lo, full_hi, end_m,
                            HAS_LEFT, HAS_RIGHT, BLOCK_D, STAGES)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_ready,
                     q_ready, do_ready, stats_ready, empty, lse_ptr, delta_ptr, stride_lb, stride_lh, b, hk, GROUP, Sq,
                     n0, start_m, end_m, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
