"""Attention against a KV cache, for inference (forward only): split-KV decoding, GQA packing, paged caches.

Implements ``reference.attention.attention_with_kvcache`` (read beside it) in two kernels:
- ``_kvcache_append_kernel``: copies the new keys and values into the cache at positions ``cache_seqlens[b] ...``
  of each sequence, in place (through the block table when the cache is paged). One program per (token block,
  batch * key/value head); K and V in the same program. Into an FP8 cache (``QUANTIZE``) it writes the bytes of
  ``value / scale`` rounded to float8_e4m3fn as torch rounds (``_fp8_e4m3_bits``, integer arithmetic).
- ``_kvcache_attn_kernel``: one program per (batch * key/value head, key split, row block). Its rows are the
  queries of every query head that shares the key/value head (row ``r``: query head ``hk * GROUP + r // Sq``, query
  ``r % Sq``), so one read of a K/V tile serves the whole GQA group instead of one read per query head. The keys
  the sequence's queries can see, ``[lo, L)`` with ``L = cache_seqlens[b] + Sq_new``, are cut at run time into
  ``SPLITS`` chunks of whole key blocks, so that every split of every sequence gets an equal share of that
  sequence's own length (ragged batches included) and a short sequence leaves its last splits empty. Each program
  streams its chunk through the forward's online softmax (base 2, ``_online_softmax_step``). Without splits it
  writes its rows; with them (``SPLIT``) it writes them normalised, with their log-sum-exp, to fp32 partial
  buffers and counts itself in its row block's arrivals, and the last split to arrive combines them all
  (``_combine_splits``: ``lse = log sum_s exp(lse_s)``, ``o = sum_s exp(lse_s - lse) o_s``; an empty split has
  ``lse_s = -inf`` and weighs nothing) and resets the count for the next call (a combine kernel: TUNING.md).

Masks: the forward's band with ``Sk = L`` per sequence (queries align bottom-right); key blocks every row sees whole
load without a mask (``MASKED``, a compile-time variant of one loop).

Paged caches (``PAGED``): each key row finds its page through ``block_table[b, j // block_size]`` (any page size, a
shift where it is a power of two: ``PAGE_SHIFT``); the page numbers are loads the K/V loads depend on, so a paged
launch runs two programs per SM.

Balanced splits (``BALANCED``, off by default): one split size over the whole batch's keys (``_balanced_split``).
FP8 caches: tiles widen to q's dtype for their products, to fp16 where q is bf16 (``_fp16_queries``; one conversion
per pair, where widening to bf16 is a chain); the K scale multiplies the softmax scale, the V scale the output, per
key/value head. The widening and products bound a contiguous FP8 step, not memory (H200: ~3.6e12 elements/s), so its
launch aims at two programs per SM, as a paged one does (whose page walk bounds it, FP8 or not).

Limits: forward only, any head dim of the family (padded to a power of two), fp16/bf16/fp32 and float8_e4m3fn
caches; ``cache_seqlens[b] + Sq_new`` is clamped to [0, capacity] on the device, block-table entries are not checked.

Trade-offs: the split count is chosen on the host from the shapes (``configs.decode_plan``: programs to fill the
GPU once, chunks of at least a few key blocks), never from the lengths, so a call needs no synchronisation and a
CUDA graph can capture it; a sequence much shorter than the cache's capacity then has short chunks. The partial
results, written and read once, are small beside the K/V read at Sq <= 16.
"""

import triton
import triton.language as tl

from kernels.attention._kernels import _apply_window, _load_tile, _online_softmax_step

_LN2 = tl.constexpr(0.6931471805599453)


#: the largest finite float8_e4m3fn value (``reference.attention.FP8_MAX``)
_FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _head_scale(value, ptr, stride, hk, IN_MEMORY: tl.constexpr):
    """An FP8 cache's scale for key/value head ``hk``: ``value`` (a float argument), or read from ``ptr`` (an fp32
    tensor of shape () with ``stride`` 0, or (Hkv,))."""
    if IN_MEMORY:
        return tl.load(ptr + hk * stride)
    return value


@triton.jit
def _fp8_e4m3_bits(x):
    """The float8_e4m3fn bits (uint8) of fp32 ``x``, rounded to nearest with ties to even, saturating at +-448 (the
    format has no infinity), NaN as 0x7F with x's sign: torch's ``x.clamp(-448, 448).to(torch.float8_e4m3fn)``. In
    integer arithmetic, because the Triton interpreter's own fp32 -> fp8 conversion drops the rounding carry (125.7
    became 64) and breaks ties away from zero."""
    xi = x.to(tl.int32, bitcast=True)
    sign = (xi >> 24) & 0x80
    a = tl.minimum(tl.abs(x), _FP8_MAX)
    ai = a.to(tl.int32, bitcast=True)
    # from 2^-6 up: keep 3 of the 23 mantissa bits, ties to even, the carry free to move into the exponent; then the
    # exponent rebiased from fp32's 127 to 7
    normal = ((ai + 0x7FFFF + ((ai >> 20) & 1)) >> 20) - (120 << 3)
    # below 2^-6: multiples of 2^-9 (adding 2^23 leaves fp32 a unit in the last place of 1: ties to even); 8 of them
    # is 2^-6, whose bits are the same number
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    bits = tl.where(a < 0.015625, subnormal, normal)
    bits = tl.where(x != x, 0x7F, bits)
    return (bits | sign).to(tl.uint8)


@triton.jit
def _sequence_keys(seqlens_ptr, b, new_tokens, capacity):
    """``L``: the keys of sequence ``b`` after the append, clamped to ``[0, capacity]``."""
    return tl.minimum(tl.maximum(tl.load(seqlens_ptr + b) + new_tokens, 0), capacity)


@triton.jit
def _cache_row_offsets(cols, table_row, block_size, stride_page, stride_s, L, PAGED: tl.constexpr,
                       MASKED: tl.constexpr, PAGE_SHIFT: tl.constexpr):
    """64-bit offsets of cache positions ``cols`` of one sequence and head: ``cols * stride_s`` in a contiguous cache,
    ``page * stride_page + row * stride_s`` in a paged one (positions at or past ``L`` read page 0 when ``MASKED``).
    Pages of ``2^PAGE_SHIFT`` positions split a position by a shift and a mask; other sizes (``PAGE_SHIFT`` -1) by a
    division by the runtime ``block_size``, a routine of about twenty instructions per position."""
    if PAGED:
        if PAGE_SHIFT >= 0:
            page_of, row_in_page = cols >> PAGE_SHIFT, cols & ((1 << PAGE_SHIFT) - 1)
        else:
            page_of, row_in_page = cols // block_size, cols % block_size
        if MASKED:
            pages = tl.load(table_row + page_of, mask=cols < L, other=0)
        else:
            pages = tl.load(table_row + page_of)
        return pages.to(tl.int64) * stride_page + row_in_page.to(tl.int64) * stride_s
    return cols.to(tl.int64) * stride_s


@triton.jit
def _kvcache_append_kernel(
    k_new_ptr, v_new_ptr,  # (B, Hkv, S_new, D)
    k_cache_ptr, v_cache_ptr,  # (B, Hkv, S_max, D), or paged (num_blocks, Hkv, block_size, D)
    seqlens_ptr,  # (B,) int32: where sequence b's new tokens go
    table_ptr, stride_tb,  # (B, max_blocks) int32 block table (PAGED)
    stride_knb, stride_knh, stride_kns, stride_knd,
    stride_vnb, stride_vnh, stride_vns, stride_vnd,
    stride_kcb, stride_kch, stride_kcs, stride_kcd,
    stride_vcb, stride_vch, stride_vcs, stride_vcd,
    Hkv, S_new, D, block_size, capacity,
    k_scale, v_scale, k_scale_ptr, v_scale_ptr, stride_k_scale, stride_v_scale,  # QUANTIZE: the FP8 cache's scales
    PAGED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, QUANTIZE: tl.constexpr,
    K_SCALE_IN_MEMORY: tl.constexpr, V_SCALE_IN_MEMORY: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    pos = tl.load(seqlens_ptr + b) + t
    # positions past the capacity are dropped (the attention kernel clamps its lengths the same way)
    rows_ok = (t < S_new) & (pos >= 0) & (pos < capacity)
    ok = rows_ok[:, None] & (offs_d < D)[None, :]
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    if PAGED:
        pages = tl.load(table_row + pos // block_size, mask=rows_ok, other=0).to(tl.int64)
        k_rows = pages * stride_kcb + (pos % block_size).to(tl.int64) * stride_kcs
        v_rows = pages * stride_vcb + (pos % block_size).to(tl.int64) * stride_vcs
    else:
        k_rows = b.to(tl.int64) * stride_kcb + pos.to(tl.int64) * stride_kcs
        v_rows = b.to(tl.int64) * stride_vcb + pos.to(tl.int64) * stride_vcs
    k_src = k_new_ptr + b.to(tl.int64) * stride_knb + hk.to(tl.int64) * stride_knh
    v_src = v_new_ptr + b.to(tl.int64) * stride_vnb + hk.to(tl.int64) * stride_vnh
    k = tl.load(k_src + t[:, None].to(tl.int64) * stride_kns + offs_d[None, :] * stride_knd, mask=ok)
    v = tl.load(v_src + t[:, None].to(tl.int64) * stride_vns + offs_d[None, :] * stride_vnd, mask=ok)
    if QUANTIZE:  # an FP8 cache, passed as its bytes: K / k_scale and V / v_scale, rounded as torch rounds
        k = _fp8_e4m3_bits(tl.math.div_rn(k.to(tl.float32),
                                          _head_scale(k_scale, k_scale_ptr, stride_k_scale, hk, K_SCALE_IN_MEMORY)))
        v = _fp8_e4m3_bits(tl.math.div_rn(v.to(tl.float32),
                                          _head_scale(v_scale, v_scale_ptr, stride_v_scale, hk, V_SCALE_IN_MEMORY)))
    k_dst = k_cache_ptr + hk.to(tl.int64) * stride_kch + k_rows[:, None] + offs_d[None, :] * stride_kcd
    v_dst = v_cache_ptr + hk.to(tl.int64) * stride_vch + v_rows[:, None] + offs_d[None, :] * stride_vcd
    tl.store(k_dst, k, mask=ok)
    tl.store(v_dst, v, mask=ok)


@triton.jit
def _fp16_queries(q, scale_log2):
    """bf16 queries against an FP8 cache as fp16, times the power of two that puts their largest element just below
    2^15, and the scores' scale divided by it: FP8 tiles then widen to fp16, one conversion per pair of elements,
    where widening to bf16 is a chain of conversions that bounded the step. Exact but for elements under 2^-29 of the
    largest (fp16 subnormals); maxima under 2^-112 are scaled by 2^127 only (the power stays a finite fp32); a NaN
    or infinity stays one."""
    largest = tl.max(tl.max(tl.abs(q.to(tl.float32)), axis=1), axis=0)
    exponent = (largest.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased: largest < 2^(exponent - 126)
    # 2^(141 - exponent) as fp32 bits, kept a finite normal number for zeros and tiny maxima
    power = (tl.minimum(268 - exponent, 254) << 23).to(tl.float32, bitcast=True)
    return (q.to(tl.float32) * power).to(tl.float16), scale_log2 / power


@triton.jit
def _kvcache_attn_inner(
    acc, m_i, l_i, q, k_head, v_head, table_row, start, end, q_idx, offs_n, offs_d, L, D, block_size,
    stride_kpage, stride_ks, stride_kd, stride_vpage, stride_vs, stride_vd, lo_shift, hi_shift, scale_log2,
    MASKED: tl.constexpr, PAGED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, PAGE_SHIFT: tl.constexpr,
):
    """Stream cache positions [start, end) (whole key blocks, except a masked last one) through the online
    softmax (base 2)."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k_rows = _cache_row_offsets(cols, table_row, block_size, stride_kpage, stride_ks, L, PAGED, MASKED, PAGE_SHIFT)
        v_rows = _cache_row_offsets(cols, table_row, block_size, stride_vpage, stride_vs, L, PAGED, MASKED, PAGE_SHIFT)
        k_ptrs = k_head + k_rows[:, None] + offs_d[None, :] * stride_kd
        v_ptrs = v_head + v_rows[:, None] + offs_d[None, :] * stride_vd
        k = _load_tile(k_ptrs, cols, L, offs_d, D, MASKED, EVEN_D).to(q.dtype)  # an FP8 cache's tiles widen here
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        seen = None
        if MASKED:
            seen = _apply_window(cols[None, :] < L, q_idx[:, None], cols[None, :], lo_shift, hi_shift, False,
                                 HAS_LEFT, HAS_RIGHT)
        p, alpha, m_new, l_i = _online_softmax_step(qk, seen, m_i, l_i, scale_log2, MASKED)
        v = _load_tile(v_ptrs, cols, L, offs_d, D, MASKED, EVEN_D).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["new_tokens", "Sq"])
def _kvcache_attn_kernel(
    q_ptr,  # (B, Hq, Sq, D)
    k_ptr, v_ptr,  # (B, Hkv, S_max, D), or paged (num_blocks, Hkv, block_size, D)
    o_ptr,  # (B, Hq, Sq, D)
    lse_ptr,  # (B, Hq, Sq) fp32 (STORE_LSE)
    o_part_ptr, lse_part_ptr,  # SPLIT: (B * Hkv * SPLITS * ROWS, BLOCK_D) and (B * Hkv * SPLITS * ROWS,) fp32
    arrivals_ptr,  # SPLIT: (B * Hkv * row blocks,) int32, zero on entry and on exit: splits done per row block
    seqlens_ptr,  # (B,) int32: tokens in each cache before this call's new ones
    table_ptr, stride_tb,  # (B, max_blocks) int32 block table (PAGED)
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,  # stride_kb: batch stride, or page stride when PAGED
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh,  # lse's; 1 along the sequence
    Hkv, GROUP, Sq, new_tokens, D, block_size, capacity,
    scale_log2,  # softmax_scale * log2(e)
    LEFT, RIGHT,  # the band around query i's key position i + L - Sq (causal: RIGHT = 0)
    SPLITS,  # key splits per (batch, key/value head); BALANCED: the key blocks' budget of splits per head
    k_scale, v_scale, k_scale_ptr, v_scale_ptr, stride_k_scale, stride_v_scale,  # an FP8 cache's scales (else 1.0)
    BATCH,  # sequences (BALANCED)
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PAGED: tl.constexpr, SPLIT: tl.constexpr,
    STORE_LSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, K_SCALE_IN_MEMORY: tl.constexpr,
    V_SCALE_IN_MEMORY: tl.constexpr, BALANCED: tl.constexpr = False, BLOCK_B: tl.constexpr = 1,
    PAGE_SHIFT: tl.constexpr = -1,  # PAGED: log2(block_size) where it is a power of two, else -1
):
    pid_r = tl.program_id(2)
    ROWS = GROUP * Sq
    if BALANCED:
        # program (head, slot): the slots of each head cut the batch's key blocks into splits of one size, so that a
        # ragged batch gives every program about the same keys (the slots past the batch's splits idle)
        hk = tl.program_id(0)
        b, split, SPLITS, first_slot, active = _balanced_split(seqlens_ptr, tl.program_id(1), BATCH, new_tokens,
                                                               capacity, Sq, LEFT, SPLITS, HAS_LEFT, BLOCK_N, BLOCK_B)
        pid_bhk = b * Hkv + hk
        part_base = hk * tl.num_programs(1) + first_slot  # this sequence's partials: slots first_slot ...
    else:
        pid_bhk = tl.program_id(0)
        split = tl.program_id(1)
        b = pid_bhk // Hkv
        hk = pid_bhk % Hkv
        active = pid_r >= 0  # every program works
        part_base = pid_bhk * SPLITS
    rows = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)
    q_head = hk * GROUP + rows // Sq
    q_idx = rows % Sq
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # an FP8 cache's K scale folds into the scores' scale, its V scale into the normalised output
    scale_log2 = tl.cast(scale_log2, tl.float32) * _head_scale(k_scale, k_scale_ptr, stride_k_scale, hk,
                                                               K_SCALE_IN_MEMORY)
    v_scale = _head_scale(v_scale, v_scale_ptr, stride_v_scale, hk, V_SCALE_IN_MEMORY)

    q_ptrs = (q_ptr + b.to(tl.int64) * stride_qb + q_head[:, None].to(tl.int64) * stride_qh
              + q_idx[:, None].to(tl.int64) * stride_qs + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=(rows < ROWS)[:, None] & (offs_d < D)[None, :], other=0.0)
    if k_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        q, scale_log2 = _fp16_queries(q, scale_log2)

    L = _sequence_keys(seqlens_ptr, b, new_tokens, capacity)
    lo_shift = L - Sq - LEFT  # query i sees keys from i + lo_shift (HAS_LEFT) ...
    hi_shift = L - Sq + RIGHT  # ... to i + hi_shift (HAS_RIGHT)
    # keys some query of the sequence sees: [lo, L), cut into SPLITS chunks of whole key blocks
    lo = 0
    if HAS_LEFT:
        lo = tl.minimum(tl.maximum(lo_shift, 0), L) // BLOCK_N * BLOCK_N
    blocks_per_split = tl.cdiv(tl.cdiv(L - lo, BLOCK_N), SPLITS)
    start = tl.minimum(lo + split * blocks_per_split * BLOCK_N, L)
    end = tl.minimum(start + blocks_per_split * BLOCK_N, L)
    if BALANCED:
        end = tl.where(active, end, start)
    # key blocks every query sees whole: from the last query's left edge to the first query's right edge
    full_lo = start
    if HAS_LEFT:
        full_lo = tl.cdiv(tl.maximum(Sq - 1 + lo_shift, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, start), end)
    full_hi = L
    if HAS_RIGHT:
        full_hi = tl.minimum(tl.maximum(hi_shift + 1, 0), L)
    full_hi = tl.maximum(tl.minimum(full_hi // BLOCK_N * BLOCK_N, end), full_lo)

    if PAGED:
        k_head = k_ptr + hk.to(tl.int64) * stride_kh
        v_head = v_ptr + hk.to(tl.int64) * stride_vh
    else:
        k_head = k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
        v_head = v_ptr + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, m_i, l_i = _kvcache_attn_inner(acc, m_i, l_i, q, k_head, v_head, table_row, start, full_lo, q_idx, offs_n,
                                        offs_d, L, D, block_size, stride_kb, stride_ks, stride_kd, stride_vb,
                                        stride_vs, stride_vd, lo_shift, hi_shift, scale_log2, True, PAGED, HAS_LEFT,
                                        HAS_RIGHT, EVEN_D, BLOCK_N, DOT_PRECISION, PAGE_SHIFT)
    acc, m_i, l_i = _kvcache_attn_inner(acc, m_i, l_i, q, k_head, v_head, table_row, full_lo, full_hi, q_idx,
                                        offs_n, offs_d, L, D, block_size, stride_kb, stride_ks, stride_kd, stride_vb,
                                        stride_vs, stride_vd, lo_shift, hi_shift, scale_log2, False, PAGED, HAS_LEFT,
                                        HAS_RIGHT, EVEN_D, BLOCK_N, DOT_PRECISION, PAGE_SHIFT)
    acc, m_i, l_i = _kvcache_attn_inner(acc, m_i, l_i, q, k_head, v_head, table_row, full_hi, end, q_idx, offs_n,
                                        offs_d, L, D, block_size, stride_kb, stride_ks, stride_kd, stride_vb,
                                        stride_vs, stride_vd, lo_shift, hi_shift, scale_log2, True, PAGED, HAS_LEFT,
                                        HAS_RIGHT, EVEN_D, BLOCK_N, DOT_PRECISION, PAGE_SHIFT)

    # l_i = 0 only for a row that saw no key (an empty split, a query before every visible key); not `l_i > 0`,
    # which would turn a NaN row into zeros
    seen = ~(l_i == 0.0)
    safe_l = tl.where(seen, l_i, 1.0)
    o = tl.where(seen[:, None], acc / safe_l[:, None] * v_scale, 0.0)  # (times 1.0 exactly, but for FP8)
    lse = tl.where(seen, (m_i + tl.math.log2(safe_l)) * _LN2, float("-inf"))
    row_ok = (rows < ROWS) & active
    if SPLIT:
        part = (part_base + split).to(tl.int64) * ROWS + rows
        tl.store(o_part_ptr + part[:, None] * BLOCK_D + offs_d[None, :], o, mask=row_ok[:, None])
        tl.store(lse_part_ptr + part, lse, mask=row_ok)
        # The last split of this row block to finish combines them all: every thread's stores are done before the
        # arrival is counted (release), and the combining program reads the others' after it (acquire). An idle
        # program of a balanced launch counts nothing (it adds 0).
        tl.debug_barrier()
        arrival = pid_bhk * tl.num_programs(2) + pid_r
        arrived = tl.atomic_add(arrivals_ptr + arrival, active.to(tl.int32), sem="acq_rel", scope="gpu")
        if active & (arrived == SPLITS - 1):
            tl.debug_barrier()
            o, lse = _combine_splits(o_part_ptr, lse_part_ptr, part_base.to(tl.int64) * ROWS + rows,
                                     ROWS, SPLITS, row_ok, offs_d, BLOCK_D)
            tl.atomic_xchg(arrivals_ptr + arrival, 0, sem="relaxed", scope="gpu")  # ready for the next call
            _store_rows(o, lse, o_ptr, lse_ptr, b, q_head, q_idx, row_ok, offs_d, D, stride_ob, stride_oh,
                        stride_os, stride_od, stride_lb, stride_lh, STORE_LSE)
    else:
        _store_rows(o, lse, o_ptr, lse_ptr, b, q_head, q_idx, row_ok, offs_d, D, stride_ob, stride_oh, stride_os,
                    stride_od, stride_lb, stride_lh, STORE_LSE)


@triton.jit
def _balanced_split(seqlens_ptr, slot, BATCH, new_tokens, capacity, Sq, LEFT, BUDGET, HAS_LEFT: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """``(b, split, splits, first_slot, active)`` of program ``slot`` of a balanced launch: every sequence's visible
    key blocks (``[lo, L)``, as the kernel computes them) are cut into splits of ``cdiv(total blocks, BUDGET)``
    blocks (at least one split per sequence, so an empty one still writes its zeros), numbered across the batch;
    ``slot`` is split ``split`` of sequence ``b``'s ``splits``, whose first is slot ``first_slot``. Slots past the
    batch's last split are not ``active`` (they stand for sequence ``BATCH - 1`` and do nothing). Read from the
    lengths on the GPU by every program: no plan kernel, no host synchronisation."""
    offs_b = tl.arange(0, BLOCK_B)
    in_batch = offs_b < BATCH
    L = tl.minimum(tl.maximum(tl.load(seqlens_ptr + offs_b, mask=in_batch, other=0) + new_tokens, 0), capacity)
    L = tl.where(in_batch, L, 0)
    lo = tl.zeros_like(L)
    if HAS_LEFT:
        lo = tl.minimum(tl.maximum(L - Sq - LEFT, 0), L) // BLOCK_N * BLOCK_N
    blocks = tl.cdiv(L - lo, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(tl.sum(blocks, axis=0), BUDGET), 1)
    splits = tl.where(in_batch, tl.maximum(tl.cdiv(blocks, per_split), 1), 0)
    ends = tl.cumsum(splits, axis=0)
    b = tl.sum((ends <= slot).to(tl.int32), axis=0)
    active = b < BATCH
    b = tl.minimum(b, BATCH - 1)
    mine = offs_b == b
    count = tl.sum(tl.where(mine, splits, 0), axis=0)
    first_slot = tl.sum(tl.where(mine, ends, 0), axis=0) - count
    return b, slot - first_slot, count, first_slot, active


#: splits the combine takes per step, their loads issued together
COMBINE_UNROLL = tl.constexpr(8)


@triton.jit
def _combine_splits(o_part_ptr, lse_part_ptr, first, ROWS, SPLITS, row_ok, offs_d, BLOCK_D: tl.constexpr):
    """``(o, lse)`` of rows whose split ``s`` results sit at ``first + s * ROWS``: ``lse = log sum_s exp(lse_s)``,
    ``o = sum_s exp(lse_s - lse) o_s``, in one pass with a running maximum; an empty split (``lse_s = -inf``) weighs
    nothing. ``COMBINE_UNROLL`` splits per step, unrolled, so that their loads wait on the L2 together: a loop that
    waited once per split took 0.3 µs per split (4.6 µs of a 24 µs B 1 decode step at 16 splits, H100). Loads bypass L1
    (``.cg``): the partials were written by other programs."""
    m = tl.full(first.shape, float("-inf"), dtype=tl.float32)
    total = tl.zeros(first.shape, dtype=tl.float32)
    acc = tl.zeros([first.shape[0], BLOCK_D], dtype=tl.float32)
    for s0 in range(0, SPLITS, COMBINE_UNROLL):
        for i in tl.static_range(COMBINE_UNROLL):
            ok = row_ok & (s0 + i < SPLITS)
            lse_s = tl.load(lse_part_ptr + first + (s0 + i) * ROWS, mask=ok, other=float("-inf"),
                            cache_modifier=".cg")
            part = tl.load(o_part_ptr + (first + (s0 + i) * ROWS)[:, None] * BLOCK_D + offs_d[None, :],
                           mask=ok[:, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, lse_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            weight = tl.exp(lse_s - m_safe)
            total = total * alpha + weight
            acc = acc * alpha[:, None] + weight[:, None] * part
            m = m_new
    seen = ~(total == 0.0)
    safe_total = tl.where(seen, total, 1.0)
    o = tl.where(seen[:, None], acc / safe_total[:, None], 0.0)
    return o, tl.where(seen, m + tl.log(safe_total), float("-inf"))


@triton.jit
def _store_rows(o, lse, o_ptr, lse_ptr, b, q_head, q_idx, row_ok, offs_d, D, stride_ob, stride_oh, stride_os, stride_od,
                stride_lb, stride_lh, STORE_LSE: tl.constexpr):
    """Rows ``(q_head, q_idx)`` of sequence ``b``'s output (in its dtype) and, with ``STORE_LSE``, their lse."""
    o_ptrs = (o_ptr + b.to(tl.int64) * stride_ob + q_head[:, None].to(tl.int64) * stride_oh
              + q_idx[:, None].to(tl.int64) * stride_os + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d < D)[None, :])
    if STORE_LSE:
        tl.store(lse_ptr + b.to(tl.int64) * stride_lb + q_head.to(tl.int64) * stride_lh + q_idx, lse, mask=row_ok)
