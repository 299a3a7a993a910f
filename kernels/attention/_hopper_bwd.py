"""FlashAttention backward for Hopper (sm_90) in Gluon: warp-specialised, TMA-fed, asynchronous wgmma, TMA-reduced dQ.

Implements the same gradients as the portable backward (``_attn_bwd_kernel`` in ``kernels/attention/_kernels.py``, read
beside ``reference/attention.py``): dQ, dK, dV of softmax(Q K^T * scale) V for the band
``i + Sk - Sq - LEFT <= j <= i + Sk - Sq + RIGHT`` (causal: RIGHT = 0), GQA/MQA, Sq != Sk, any (batch, head,
sequence) strides. ``delta = rowsum(dO * O)`` comes from the portable preprocess kernel first.

Schedule (one program = 128 keys of one (batch, key/value head), walking every query block of every query head of its
GQA group that sees them; small causal grids run key-block-major: ``_key_program``, ``configs.hopper_key_major``;
a large group is split over ``GROUP_PARTS`` programs side by side in the grid, ``configs.hopper_group_parts``, whose
dK and dV go out as TMA reductions (``REDUCE_DKDV``) into fp32 accumulators the preprocess zeroed, then one cast
each; context-parallel attention reduces every block of a ring step into the same accumulators the same way):
- a **producer** warp loads K and V once, then the 64-row Q and dO tiles into a ring of ``STAGES`` slots ("ready"
  and "empty" mbarriers), with the block's log-sum-exp (base 2) and ``delta`` beside them;
- two **consumer** warpgroups own 64 keys each, dK and dV in registers; in the transposed frame (keys are the wgmma
  M): ``S^T = K Q^T``, ``P^T = exp2(...)``, ``dP^T = V dO^T`` and ``dV += P^T dO`` together, ``dS^T = P^T (dP^T -
  delta)``, ``dK += dS^T Q``: 5 matmuls per tile pair against the portable backward's 7;
- **dQ**: both consumers store dS^T into one double-buffered tile; at D 128 each computes half of dQ's columns over
  all 128 keys, at D 64 they take turns (``DQ_TURNS``); dQ goes out as 32-column parts by TMA bulk reductions
  (``_tma_reduce_add``, built from Triton 3.6's ``ttng.async_tma_reduce``: Gluon's ``tma`` has none) into an fp32
  accumulator the preprocess zeroed, which one cast makes dQ; ``WRITE_DQ`` False leaves dQ to ``_hopper_bwd_dq.py``;
- **dropout** (``DROPOUT``): the producer is a warpgroup and draws both consumers' keep masks of a query block into
  the ring slot beside Q and dO, query-major, packed one 32-byte row per consumer thread; the consumer carries each
  decision in P^T's sign bit past the dP^T wait;
- registers: three warpgroups share 504 per thread: producer 24 and consumers 240 each; with dropout 40 / 232 at
  D 128 and 56 / 224 at D 64; head dims 65-96 (``D_SPLIT``) run the 128-column tiles over 64 + 32 columns.

Limits: sm_90, fp16/bf16, dense (B, H, S, D) tensors that TMA can read in place (head dim contiguous, other strides
and the base 16-byte aligned), padded head dims 64 and 128 (256 has ``_hopper_bwd_split.py``), no packed batches
(under torch.compile it runs inside the opaque op ``fused_kernels::flash_attn_bwd_gluon``).
``kernels.attention.ops.uses_hopper_backward`` and ``configs.prefers_hopper_backward`` say which calls come here.

Trade-offs: dQ is a sum of fp32 reductions in arrival order, not bitwise reproducible (``deterministic=True`` takes
this kernel without dQ and the dQ kernel at head dim 128, the portable backward at 64; they never split a group);
the accumulator costs ``B * Hq * Sq * D * 4`` bytes; each consumer waits on every wgmma it issues, so nothing
overlaps the softmax inside a warpgroup; the band is taken per 128-key program, so a consumer may compute a block its
own keys do not see (masked to zero). The speed, and the levers measured and not kept: the family's TUNING.md.
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

from kernels._common.philox_gluon import philox4x32 as _philox4x32
from kernels._common.philox_gluon import philox_key as _philox_key
from kernels.attention import _kernels as _portable
from kernels.attention._hopper import (
    _add_product_in_parts,
    _column_halves,
    _over_head_dim,
    register_operand,
    warpgroup_accumulator,
)
from reference.attention import ATTENTION_COUNTER_TAG

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
_COUNTER_TAG: gl.constexpr = gl.constexpr(ATTENTION_COUNTER_TAG)


@gluon.jit
def _bytes_at_least(words, threshold_bytes):
    """Bit 7 of each byte of the result: whether that byte of ``words`` is at least the same byte of
    ``threshold_bytes`` (unsigned; every byte the threshold). Four decisions in three instructions: the low seven
    bits compare by a subtraction that cannot borrow across bytes, and one ``lop3`` folds in the high bits (the
    result is ``(x & ~y) | (~(x ^ y) & d)`` bitwise, with ``d = (x | 0x80808080) - (y & 0x7f7f7f7f)``)."""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 d; or.b32 d, $1, 0x80808080; sub.u32 d, d, $3; lop3.b32 $0, $1, $2, d, 0xB2; }",
        "=r,r,r,r", [words, threshold_bytes, threshold_bytes & 0x7F7F7F7F], dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def _byte_permute(low, high, SELECTOR: gl.constexpr):
    """``prmt.b32``: four bytes picked from ``low`` (bytes 0-3) and ``high`` (4-7), one selector nibble each."""
    return gl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SELECTOR};", "=r,r,r", [low, high], dtype=gl.uint32,
                                     is_pure=True, pack=1)


@gluon.jit
def _draw_keep(mask_buffer, m0, k0, bh, key0, key1, threshold_bytes):
    """Stores the dropout keep mask of queries ``m0 .. m0 + 63`` x keys ``k0 .. k0 + 63`` (both multiples of 64) into
    ``mask_buffer`` (128 rows of eight words): the portable kernel's mask (``_dropout_keep``, stated in
    ``reference.attention.attention_keep_mask``), laid out for :func:`_load_drop_signs`.

    Each Philox call decides 16 elements that one thread holds in the query-major accumulator layout, so the tile
    is drawn there, two calls per thread, on ``[g, 8a + r, t]``: word ``w`` of a call decides keys
    ``32g + 8w + 2t + h`` x queries ``16a + 8u + r`` in its byte ``2u + h``. The consumers compute in the transposed
    frame, where one call's 16 elements sit in four threads of two warps, so the tile goes through shared memory:
    row ``R`` holds the 32 decisions of the consumer thread ``R`` (bit 7 of a byte each), which the drawing thread
    assembles four at a time with one byte permute from two compared words."""
    draw: gl.constexpr = gl.BlockedLayout(size_per_thread=[2, 1, 1], threads_per_warp=[1, 8, 4],
                                          warps_per_cta=[1, 4, 1], order=[2, 1, 0])
    g = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, draw)))
    pair = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, draw)))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, draw)))
    octet = gl.expand_dims(gl.expand_dims(k0 // 8 + 4 * g, 1), 2) + gl.expand_dims(gl.expand_dims(t, 0), 1)
    pair = gl.expand_dims(gl.expand_dims(m0 // 2 + pair, 0), 2)
    zeros = gl.zeros([2, 32, 4], gl.uint32, layout=draw)
    w0, w1, w2, w3 = _philox4x32(zeros + octet.to(gl.uint32), zeros + pair.to(gl.uint32), zeros + bh.to(gl.uint32),
                                 zeros + _COUNTER_TAG, key0, key1)
    w0 = _bytes_at_least(w0, zeros + threshold_bytes)
    w1 = _bytes_at_least(w1, zeros + threshold_bytes)
    w2 = _bytes_at_least(w2, zeros + threshold_bytes)
    w3 = _bytes_at_least(w3, zeros + threshold_bytes)
    # The consumer thread of keys 32g + 16v + 8l + 2t + h (v, l: the word's bits) and queries 16a + 8u + r reads
    # its decisions (u, l) from one word, bytes in that order: bytes h and 2 + h of the words w = 2v and 2v + 1.
    h0 = gl.join(_byte_permute(w0, w1, 0x6240), _byte_permute(w2, w3, 0x6240))  # [g, 8a + r, t, v], h = 0
    h1 = gl.join(_byte_permute(w0, w1, 0x7351), _byte_permute(w2, w3, 0x7351))
    chunks = gl.reshape(gl.join(h0, h1), [2, 4, 4, 2, 4, 2, 2])  # [g, a, r // 2, r % 2, t, v, h]
    # row: consumer warp 2g + v, lane 4 (2t + h) + r // 2; column: 4 (r % 2) + a
    chunks = gl.permute(chunks, (0, 5, 4, 6, 2, 3, 1))
    mask_buffer.store(gl.reshape(chunks, [2 * BLOCK_M, 8]))


@gluon.jit
def _load_drop_signs(mask_buffer, t_layout: gl.constexpr):
    """The keep mask :func:`_draw_keep` stored, as a (keys, queries) tile in the consumers' accumulator layout, each
    element a sign bit: 0x80000000 where the element is dropped, 0 where it is kept, so that one XOR with P's bits
    (a ``lop3``) negates the dropped elements. Each thread reads its own row (32 bytes) and moves bit 7 of each byte
    to bit 31; the reshapes move no data. (As booleans, selecting between two values, the mask cost the D 128
    consumer 300 bytes more of spills.)"""
    rows: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32, 1], warps_per_cta=[4, 1],
                                          order=[1, 0])
    dropped = ~mask_buffer.load(rows)  # [thread, 4e + a]
    u0 = gl.join((dropped << 24) & 0x80000000, (dropped << 16) & 0x80000000)  # [.., l]
    u1 = gl.join((dropped << 8) & 0x80000000, dropped & 0x80000000)
    signs = gl.reshape(gl.join(u0, u1), [4, 8, 4, 2, 4, 2, 2])  # [warp, r', t', e, a, l, u]
    signs = gl.reshape(gl.permute(signs, (0, 5, 1, 4, 6, 2, 3)), [HALF_N, BLOCK_M])
    return gl.convert_layout(signs, t_layout)


@gluon.jit
def _key_program(Hkv, BLOCK_N: gl.constexpr, KEY_MAJOR: gl.constexpr = False):
    """``(b, hk, n0)``: the batch, key/value head and first key of this program (both Hopper dK/dV kernels; the grid
    is (key blocks, B * Hkv), or with ``KEY_MAJOR`` (B * Hkv, key blocks): programs start key block by key block)."""
    if KEY_MAJOR:
        pid_bh = gl.program_id(0)
        pid_n = gl.program_id(1)
    else:
        pid_bh = gl.program_id(1)
        pid_n = gl.program_id(0)
    return pid_bh // Hkv, pid_bh % Hkv, pid_n * BLOCK_N


@gluon.jit
def _ring_step(i, query_blocks, first_head, start_m, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """Step ``i`` of a program's walk over its query heads (``first_head`` on, ``query_blocks`` blocks each): the
    ring slot, the phase its ready barriers complete in on this pass, the query head and the block's first row."""
    h = first_head + i // query_blocks
    m0 = start_m + (i % query_blocks) * BLOCK_M
    return i % STAGES, (i // STAGES) & 1, h, m0


@gluon.jit
def _stage_query_stats(lse_ptr, delta_ptr, stride_lb, stride_lh, lse_slot, delta_slot, stats_ready, b, h, m0, Sq):
    """The log-sum-exp (base 2) and ``delta`` of query rows ``m0 .. m0 + 63`` of head ``h`` into a ring slot beside
    Q and dO, then ``stats_ready``. Through shared memory: a consumer that loaded them from global memory would wait
    out that latency twice per step (1.36-1.52x slower at D 128 on an H100). Rows past Sq, and rows that saw no key
    (lse = -inf), get lse = +inf: P = 0 there."""
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    stats = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
    lse = gl.load(lse_ptr + stats + rows, mask=rows < Sq, other=float("inf"))
    lse_slot.store(gl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E)
    delta_slot.store(gl.load(delta_ptr + stats + rows, mask=rows < Sq, other=0.0))
    mbarrier.arrive(stats_ready, count=1)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, mask_smem,
              kv_ready, q_ready, do_ready, stats_ready, mask_ready, empty, lse_ptr, delta_ptr, stride_lb, stride_lh, b,
              hk, first_head, heads, Sq, n0, start_m, end_m, b_heads, key0, key1, threshold, STAGES: gl.constexpr,
              DROPOUT: gl.constexpr):
    mbarrier.expect(kv_ready.index(0), 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for half in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0 + half * HALF_N, 0], kv_ready.index(0), k_smem.index(half))
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0 + half * HALF_N, 0], kv_ready.index(0), v_smem.index(half))
    query_blocks = gl.cdiv(end_m - start_m, BLOCK_M)
    for i in range(heads * query_blocks):
        slot, phase, h, m0 = _ring_step(i, query_blocks, first_head, start_m, BLOCK_M, STAGES)
        # a fresh mbarrier counts as having completed the phase before 0: the first pass does not wait
        phase = phase ^ 1
        mbarrier.wait(empty.index(slot), phase)
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], q_ready.index(slot), q_smem.index(slot))
        mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], do_ready.index(slot), do_smem.index(slot))
        _stage_query_stats(lse_ptr, delta_ptr, stride_lb, stride_lh, lse_smem.index(slot), delta_smem.index(slot),
                           stats_ready.index(slot), b, h, m0, Sq)
        if DROPOUT:
            # both consumers' keep masks, off their critical path: drawn by the consumers themselves, the Philox
            # rounds sat between their matmuls (1.16-1.24x slower at D 128, 1.09-1.10x at D 64)
            for half in gl.static_range(2):
                _draw_keep(mask_smem.index(2 * slot + half), m0, n0 + half * HALF_N, b_heads + h, key0, key1,
                           threshold)
            mbarrier.arrive(mask_ready.index(slot), count=1)


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
                         BLOCK_D: gl.constexpr, ALL_COLUMNS: gl.constexpr, D_SPLIT: gl.constexpr = False):
    """dQ of one query block, ``dS K * scale`` over all 128 keys: this consumer's half of its columns, or all of them
    (``ALL_COLUMNS``), added into the fp32 accumulator by TMA bulk reductions from shared memory, 32 columns each.
    ``D_SPLIT`` (head dims 65-96 in a 128-column tile): the first consumer columns 0-63, the second 64-95."""
    if D_SPLIT:
        COLUMNS: gl.constexpr = 64 - 32 * HALF
        FIRST_TILE: gl.constexpr = 2 * HALF
    else:
        COLUMNS: gl.constexpr = BLOCK_D if ALL_COLUMNS else BLOCK_D // 2
        FIRST_TILE: gl.constexpr = HALF * (COLUMNS // DQ_TILE_COLS)
    PARTS: gl.constexpr = COLUMNS // DQ_TILE_COLS
    gl.static_assert(PARTS <= 2, "dQ parts of one consumer: at most 64 columns")
    ds_lo = ds_buffer.slice(0, HALF_N, dim=0).permute((1, 0))
    ds_hi = ds_buffer.slice(HALF_N, HALF_N, dim=0).permute((1, 0))
    k_lo = k_smem.index(0).reshape([HALF_N, BLOCK_D])
    k_hi = k_smem.index(1).reshape([HALF_N, BLOCK_D])
    col0: gl.constexpr = 0 if ALL_COLUMNS else HALF * (64 if D_SPLIT else COLUMNS)
    # the previous step's reductions must have read this consumer's tiles before they are overwritten
    tma.store_wait(0)
    gl.thread_barrier()
    # one wgmma over this consumer's columns, then stored as 32-column tiles: at head dim 128, two 64 x 32 wgmmas
    # read dS from shared memory twice and ptxas spilled their two accumulators (1.11-1.17x slower)
    dq_zero = gl.zeros([BLOCK_M, COLUMNS], gl.float32, layout=warpgroup_accumulator(COLUMNS))
    dq = warpgroup_mma(ds_lo, k_lo.slice(col0, COLUMNS, dim=1), dq_zero, use_acc=False, is_async=True)
    dq = warpgroup_mma(ds_hi, k_hi.slice(col0, COLUMNS, dim=1), dq, is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq,)) * scale
    if PARTS == 2:
        # 32-column parts are separate registers of the accumulator layout: the split moves no data
        first, second = _column_halves(dq)
        dq_smem.index(FIRST_TILE).reshape([BLOCK_M, DQ_TILE_COLS]).store(first)
        dq_smem.index(FIRST_TILE + 1).reshape([BLOCK_M, DQ_TILE_COLS]).store(second)
    else:
        dq_smem.index(FIRST_TILE).reshape([BLOCK_M, DQ_TILE_COLS]).store(dq)
    fence_async_shared()
    for j in gl.static_range(PARTS):
        _tma_reduce_add(dq_desc, [b, h, m0, col0 + j * DQ_TILE_COLS], dq_smem.index(FIRST_TILE + j))


@gluon.jit
def _reduce_part(part, desc, tiles, b, hk, row0, col0, TILE: gl.constexpr, WAIT: gl.constexpr):
    """Adds ``part`` (64 rows x 32 columns, fp32) into the tensor under ``desc`` at ``[b, hk, row0, col0]`` by one TMA
    bulk reduction from tile ``TILE`` of ``tiles``; ``WAIT`` first lets this thread's earlier reductions finish
    reading their tiles."""
    if WAIT:
        tma.store_wait(0)
        gl.thread_barrier()
    tiles.index(TILE).reshape([HALF_N, DQ_TILE_COLS]).store(part)
    fence_async_shared()
    _tma_reduce_add(desc, [b, hk, row0, col0], tiles.index(TILE))


@gluon.jit
def _reduce_rows(x, desc, tiles, b, hk, row0, FIRST_TILE: gl.constexpr, TILES: gl.constexpr, BLOCK_D: gl.constexpr):
    """Adds ``x`` (this consumer's 64 rows of dK or dV, fp32, ``BLOCK_D`` columns in a wgmma accumulator) into the
    fp32 accumulator under ``desc`` at rows ``row0 ..`` of (b, hk): 32 columns per TMA reduction, staged through
    ``TILES`` tiles (1 or 2) from ``FIRST_TILE`` on, each written again once its reduction has read it. Column
    parts of an accumulator are separate registers: splitting moves no data."""
    gl.static_assert(BLOCK_D == 64 or BLOCK_D == 128, "dK/dV reductions: head dims 64 and 128")
    lo, hi = _column_halves(x)
    if BLOCK_D == 128:
        p0, p1 = _column_halves(lo)
        p2, p3 = _column_halves(hi)
        if TILES == 2:
            _reduce_part(p0, desc, tiles, b, hk, row0, 0, FIRST_TILE, True)
            _reduce_part(p1, desc, tiles, b, hk, row0, 32, FIRST_TILE + 1, False)
            _reduce_part(p2, desc, tiles, b, hk, row0, 64, FIRST_TILE, True)
            _reduce_part(p3, desc, tiles, b, hk, row0, 96, FIRST_TILE + 1, False)
        else:
            _reduce_part(p0, desc, tiles, b, hk, row0, 0, FIRST_TILE, True)
            _reduce_part(p1, desc, tiles, b, hk, row0, 32, FIRST_TILE, True)
            _reduce_part(p2, desc, tiles, b, hk, row0, 64, FIRST_TILE, True)
            _reduce_part(p3, desc, tiles, b, hk, row0, 96, FIRST_TILE, True)
    else:
        if TILES == 2:
            _reduce_part(lo, desc, tiles, b, hk, row0, 0, FIRST_TILE, True)
            _reduce_part(hi, desc, tiles, b, hk, row0, 32, FIRST_TILE + 1, False)
        else:
            _reduce_part(lo, desc, tiles, b, hk, row0, 0, FIRST_TILE, True)
            _reduce_part(hi, desc, tiles, b, hk, row0, 32, FIRST_TILE, True)


@gluon.jit
def _consumer(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, mask_smem, lse_smem, delta_smem, kv_ready, q_ready,
              do_ready, stats_ready, mask_ready, empty, ds_ready, keys_done, dk_desc, dv_desc, dq_desc, b, hk,
              first_head, heads, Sq, Sk, n0, scale, lo_shift, hi_shift, start_m, full_lo, full_hi, end_m, inv_keep,
              HALF: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, DROPOUT: gl.constexpr,
              BLOCK_D: gl.constexpr, STAGES: gl.constexpr, DQ_TURNS: gl.constexpr, WRITE_DQ: gl.constexpr,
              D_SPLIT: gl.constexpr, REDUCE_DKDV: gl.constexpr):
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
    keep_fraction = 1.0 / inv_keep
    log2_inv_keep = gl.log2(inv_keep)

    if D_SPLIT:
        # dK and dV of head dims 65-96 as 64 + 32 columns: 96 registers per thread instead of 128
        lo_layout: gl.constexpr = warpgroup_accumulator(64)
        hi_layout: gl.constexpr = warpgroup_accumulator(32)
        dk_lo = gl.zeros([HALF_N, 64], gl.float32, layout=lo_layout)
        dk_hi = gl.zeros([HALF_N, 32], gl.float32, layout=hi_layout)
        dv_lo = gl.zeros([HALF_N, 64], gl.float32, layout=lo_layout)
        dv_hi = gl.zeros([HALF_N, 32], gl.float32, layout=hi_layout)
    else:
        dk = gl.zeros([HALF_N, BLOCK_D], gl.float32, layout=acc_layout)
        dv = gl.zeros([HALF_N, BLOCK_D], gl.float32, layout=acc_layout)
    # wgmma groups that dV's products add while dP^T is waited for
    DV_GROUPS: gl.constexpr = 2 if D_SPLIT else 1
    t_zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=t_layout)
    query_blocks = gl.cdiv(end_m - start_m, BLOCK_M)
    mbarrier.wait(kv_ready.index(0), 0)
    for i in range(heads * query_blocks):
        slot, phase, h, m0 = _ring_step(i, query_blocks, first_head, start_m, BLOCK_M, STAGES)
        rows = m0 + gl.arange(0, BLOCK_M, layout=query_layout)
        q_tile = q_smem.index(slot).reshape([BLOCK_M, BLOCK_D])
        do_tile = do_smem.index(slot).reshape([BLOCK_M, BLOCK_D])
        # Order chosen for registers: dK and dV hold 128 per thread at head dim 128, so S^T and dP^T (32 each) and
        # the per-query vectors (16 each) are not all live at once.
        mbarrier.wait(q_ready.index(slot), phase)
        st = _over_head_dim(k_tile, q_tile, t_zero, D_SPLIT)
        mbarrier.wait(stats_ready.index(slot), phase)
        lse2 = lse_smem.index(slot).load(query_layout)
        if DROPOUT:
            lse2 = lse2 - log2_inv_keep  # P / (1 - p) from the exp2
        st = warpgroup_mma_wait(0, deps=(st,))
        pt = gl.exp2(st * scale_log2 - gl.expand_dims(lse2, 0))
        if past_sk | (m0 < full_lo) | (m0 >= full_hi):
            # keys past Sk read as zeros but would still get P = exp(-lse), which can overflow
            pt = _band_kept(pt, keys, rows, Sk, lo_shift, hi_shift, HAS_LEFT, HAS_RIGHT)
        if DROPOUT:
            # P^T / (1 - p) (the scale came in with lse), negated where dropped: its sign carries the mask to dS^T
            # below (P >= 0, and where P = 0 the mask does not matter, dS^T is 0 either way), so no mask stays live
            # across the wait; dV takes its positive part, the dropped and rescaled P^T
            mbarrier.wait(mask_ready.index(slot), phase)
            signs = _load_drop_signs(mask_smem.index(2 * slot + HALF), t_layout)
            pt = (pt.to(gl.uint32, bitcast=True) ^ signs).to(gl.float32, bitcast=True)
            pt_op = gl.convert_layout(gl.maximum(pt, 0.0).to(dtype), op_layout)
        else:
            pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        mbarrier.wait(do_ready.index(slot), phase)
        dpt = _over_head_dim(v_tile, do_tile, t_zero, D_SPLIT)
        if D_SPLIT:
            pt_lo, pt_hi, dv_lo, dv_hi = _add_product_in_parts(pt_op, do_tile, dv_lo, dv_hi, lo_layout, hi_layout)
        else:
            dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
        delta = delta_smem.index(slot).load(query_layout)
        dpt = warpgroup_mma_wait(DV_GROUPS, deps=(dpt,))
        if DROPOUT:
            # dS^T = P^T (Z dP^T / (1 - p) - delta): where kept, pt (dP^T - delta (1 - p)); where dropped,
            # pt delta (1 - p)
            scaled_delta = gl.expand_dims(delta * keep_fraction, 0)
            dst = (pt * gl.where(pt > 0.0, dpt - scaled_delta, scaled_delta)).to(dtype)
        else:
            dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
        ds_op = gl.convert_layout(dst, op_layout)
        if D_SPLIT:
            ds_lo, ds_hi, dk_lo, dk_hi = _add_product_in_parts(ds_op, q_tile, dk_lo, dk_hi, lo_layout, hi_layout)
        else:
            dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
        if WRITE_DQ:
            # dS^T of both consumers in one double-buffered tile; the barrier says both halves are in
            ds_buffer = ds_smem.index(i % 2)
            ds_buffer.slice(HALF * HALF_N, HALF_N, dim=0).store(dst)
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(i % 2), count=1)
        if D_SPLIT:
            dv_lo, dv_hi, dk_lo, dk_hi, pt_lo, pt_hi, ds_lo, ds_hi = warpgroup_mma_wait(
                0, deps=(dv_lo, dv_hi, dk_lo, dk_hi, pt_lo, pt_hi, ds_lo, ds_hi))
        else:
            dv, dk, pt_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, ds_op))
        mbarrier.arrive(empty.index(slot), count=1)
        if WRITE_DQ:
            if DQ_TURNS:
                # one consumer computes all of dQ's columns, in turn: one 64 x D wgmma reads dS once instead of
                # twice, and the other consumer goes on to its next step without waiting for dS (1.06-1.19x at D 64)
                if i % 2 == HALF:
                    mbarrier.wait(ds_ready.index(i % 2), (i // 2) & 1)
                    _dq_by_tma_reduction(ds_buffer, k_smem, dq_smem, dq_desc, b, h, m0, scale, HALF, BLOCK_D, True)
            else:
                mbarrier.wait(ds_ready.index(i % 2), (i // 2) & 1)
                _dq_by_tma_reduction(ds_buffer, k_smem, dq_smem, dq_desc, b, h, m0, scale, HALF, BLOCK_D, False,
                                     D_SPLIT)

    if REDUCE_DKDV:
        # other programs (the group's other query heads) or launches (the blocks of a ring step) add to the same
        # keys' gradients: dK and dV are added into fp32 accumulators, through this consumer's dQ tiles
        TILES: gl.constexpr = 2 if DQ_TURNS else BLOCK_D // 64
        _reduce_rows(dv, dv_desc, dq_smem, b, hk, n0 + HALF * HALF_N, HALF * TILES, TILES, BLOCK_D)
        _reduce_rows(dk * scale, dk_desc, dq_smem, b, hk, n0 + HALF * HALF_N, HALF * TILES, TILES, BLOCK_D)
    else:
        # Their shared memory stages dK and dV for the TMA stores (which clip rows past Sk). This consumer's V half
        # is read by no one else now; its K half is, by the other consumer's last dQ products: both say they are
        # done first (without that wait, a consumer that finished early overwrote K under the other's dQ).
        mbarrier.arrive(keys_done.index(0), count=1)
        if D_SPLIT:
            v_tile.slice(0, 64, dim=1).store(dv_lo.to(dtype))
            v_tile.slice(64, 32, dim=1).store(dv_hi.to(dtype))
        else:
            v_tile.store(dv.to(dtype))
        mbarrier.wait(keys_done.index(0), 0)
        if D_SPLIT:
            k_tile.slice(0, 64, dim=1).store((dk_lo * scale).to(dtype))
            k_tile.slice(64, 32, dim=1).store((dk_hi * scale).to(dtype))
        else:
            k_tile.store((dk * scale).to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [b, hk, n0 + HALF * HALF_N, 0], k_smem.index(HALF))
        tma.async_copy_shared_to_global(dv_desc, [b, hk, n0 + HALF * HALF_N, 0], v_smem.index(HALF))
    tma.store_wait(0)


@gluon.jit
def _consumer_worker(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, mask_smem, lse_smem, delta_smem, kv_ready,
                     q_ready, do_ready, stats_ready, mask_ready, empty, ds_ready, keys_done, dk_desc, dv_desc, dq_desc,
                     b, hk, first_head, heads, Sq, Sk, n0, scale, lo_shift, hi_shift, start_m, full_lo, full_hi, end_m,
                     inv_keep, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, DROPOUT: gl.constexpr,
                     BLOCK_D: gl.constexpr, STAGES: gl.constexpr, DQ_TURNS: gl.constexpr, WRITE_DQ: gl.constexpr,
                     D_SPLIT: gl.constexpr, REDUCE_DKDV: gl.constexpr):
    _consumer(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, mask_smem, lse_smem, delta_smem, kv_ready, q_ready,
              do_ready, stats_ready, mask_ready, empty, ds_ready, keys_done, dk_desc, dv_desc, dq_desc, b, hk,
              first_head, heads, Sq, Sk, n0, scale, lo_shift, hi_shift, start_m, full_lo, full_hi, end_m, inv_keep, 1,
              HAS_LEFT, HAS_RIGHT, DROPOUT, BLOCK_D, STAGES, DQ_TURNS, WRITE_DQ, D_SPLIT, REDUCE_DKDV)


@gluon.jit(do_not_specialize=["Sq", "Sk", "seed_lo", "seed_hi", "seed_in_memory", "threshold"])
def _attn_bwd_hopper_kernel(
    q_desc, k_desc, v_desc, do_desc,  # TMA descriptors over (B, H, S, D); blocks [1, 1, 64, BLOCK_D]
    dk_desc, dv_desc,  # as k_desc, or with REDUCE_DKDV over fp32 accumulators (B, Hkv, Sk, BLOCK_D) as dq_desc
    dq_desc,  # TMA descriptor over the dQ accumulator ((B, Hq, Sq, BLOCK_D) fp32, zeroed); blocks [1, 1, 64, 32]
    lse_ptr, delta_ptr, stride_lb, stride_lh,  # (B, Hq, Sq) fp32, 1 along the sequence
    Hkv, GROUP, Sq, Sk, scale, LEFT, RIGHT,
    seed_lo, seed_hi, seed_ptr, seed_in_memory, threshold, inv_keep,  # attention dropout, as the portable kernels
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, DROPOUT: gl.constexpr, BLOCK_D: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, DQ_TURNS: gl.constexpr,
    WRITE_DQ: gl.constexpr = True,
    D_SPLIT: gl.constexpr = False,  # head dims 65-96 in 128-column tiles: products over 64 + 32 columns
    KEY_MAJOR: gl.constexpr = False,  # the grid's order (``_key_program``)
    GROUP_PARTS: gl.constexpr = 1,  # programs per key block of a (batch, K/V head), each walking a part of its group
    REDUCE_DKDV: gl.constexpr = False,  # dK and dV added into fp32 accumulators (dk_desc, dv_desc) by TMA reductions
):
    # with dropout the producer is a warpgroup: it draws the keep masks too
    PRODUCER_WARPS: gl.constexpr = 4 if DROPOUT else 1
    FIRST_HALF: gl.constexpr = 0
    # the parts of one (batch, K/V head) side by side in the grid: their K/V tiles and accumulators stay in L2
    b, group_part, n0 = _key_program(Hkv * GROUP_PARTS, BLOCK_N, KEY_MAJOR)
    hk = group_part // GROUP_PARTS
    # parts of cdiv(GROUP, GROUP_PARTS) heads, the last one the rest (a group of 7 in two: 4 + 3)
    part_heads = gl.cdiv(GROUP, GROUP_PARTS)
    part_first = (group_part % GROUP_PARTS) * part_heads
    heads = gl.minimum(part_heads, GROUP - part_first)
    first_head = hk * GROUP + part_first
    gl.static_assert(GROUP_PARTS == 1 or REDUCE_DKDV, "group parts sum their dK and dV in accumulators")
    gl.static_assert(not REDUCE_DKDV or (WRITE_DQ and not D_SPLIT), "dK/dV reductions: with dQ, head dims 64 and 128")
    scale = scale.to(gl.float32)
    b_heads = b * Hkv * GROUP  # query heads of the batches before b: the dropout counter's head word is b_heads + h
    if DROPOUT:
        key0, key1 = _philox_key(seed_lo, seed_hi, seed_ptr, seed_in_memory)
        threshold = threshold.to(gl.uint32) * 0x01010101  # in every byte
    else:
        key0 = seed_lo.to(gl.uint32)
        key1 = seed_hi.to(gl.uint32)
    inv_keep = inv_keep.to(gl.float32)
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
    mask_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mask_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    # dQ parts on their way to the TMA reductions, tiles of 64 x 32 fp32: D / 32 of them, or twice that when each
    # consumer computes all columns in its turn (one buffer per consumer; a reduction has a whole step to read it)
    DQ_TILES: gl.constexpr = 2 * BLOCK_D // DQ_TILE_COLS if DQ_TURNS else BLOCK_D // DQ_TILE_COLS
    if WRITE_DQ:
        dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_TILES] + dq_desc.block_type.shape,  # noqa: RUF005
                                            dq_desc.layout)
    else:
        # never read (dQ comes from its own kernel; ``dq_desc`` is then a stand-in)
        dq_smem = gl.allocate_shared_memory(gl.float32, [1, 16, 8], mask_layout)
    # dropout keep masks (``_draw_keep``): one per ring slot and consumer, released with the slot
    if DROPOUT:
        mask_smem = gl.allocate_shared_memory(gl.uint32, [2 * STAGES, 2 * BLOCK_M, 8], mask_layout)
    else:
        mask_smem = gl.allocate_shared_memory(gl.uint32, [1, 16, 8], mask_layout)
    mbarrier.init(kv_ready.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(stats_ready.index(i), count=1)
        mbarrier.init(mask_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a slot
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # both consumers' halves of dS^T are in
    keys_done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(keys_done.index(0), count=2)  # both consumers have finished reading K

    gl.warp_specialize([
        (_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, mask_smem, lse_smem, delta_smem, kv_ready,
                     q_ready, do_ready, stats_ready, mask_ready, empty, ds_ready, keys_done, dk_desc, dv_desc, dq_desc,
                     b, hk, first_head, heads, Sq, Sk, n0, scale, lo_shift, hi_shift, start_m, full_lo, full_hi, end_m,
                     inv_keep, FIRST_HALF, HAS_LEFT, HAS_RIGHT, DROPOUT, BLOCK_D, STAGES, DQ_TURNS, WRITE_DQ, D_SPLIT,
                     REDUCE_DKDV)),
        (_consumer_worker, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, mask_smem, lse_smem, delta_smem,
                            kv_ready, q_ready, do_ready, stats_ready, mask_ready, empty, ds_ready, keys_done, dk_desc,
                            dv_desc, dq_desc, b, hk, first_head, heads, Sq, Sk, n0, scale, lo_shift, hi_shift, start_m,
                            full_lo, full_hi, end_m, inv_keep, HAS_LEFT, HAS_RIGHT, DROPOUT, BLOCK_D, STAGES, DQ_TURNS,
                            WRITE_DQ, D_SPLIT, REDUCE_DKDV)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, mask_smem,
                     kv_ready, q_ready, do_ready, stats_ready, mask_ready, empty, lse_ptr, delta_ptr, stride_lb,
                     stride_lh, b, hk, first_head, heads, Sq, n0, start_m, end_m, b_heads, key0, key1, threshold,
                     STAGES, DROPOUT)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
