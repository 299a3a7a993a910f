"""Attention against a KV cache, for inference (forward only): split-KV decoding, GQA packing, paged caches.

Implements ``reference.attention.attention_with_kvcache`` (read beside it) in two kernels:
- ``_kvcache_append_kernel``: copies the new keys and values into the cache at positions ``cache_seqlens[b] ...``
  of each sequence, in place (through the block table when the cache is paged). One program per (token block,
  batch * key/value head); K and V in the same program. Into an FP8 cache (``QUANTIZE``) it writes the bytes of
  ``value / scale`` rounded to float8_e4m3fn as torch rounds (``_fp8_e4m3_bits``, integer arithmetic).
- ``_kvcache_attn_kernel``: each program's rows are the queries of every query head that shares its key/value head
  (row ``r``: query head ``hk * GROUP + r // Sq``, query ``r % Sq``), so one read of a K/V tile serves the GQA group.
  The keys a sequence's queries can see, ``[lo, L)`` with ``L = cache_seqlens[b] + Sq_new``, are cut at run time:
  per sequence into ``SPLITS`` chunks of whole key blocks (grid: batch * key/value head, split, row block), or,
  ``BALANCED`` (several sequences in a 16-bit cache), laid end to end across the batch and cut into equal shares, one
  per program (grid: key/value head, program, row block), a share crossing sequences taken a sequence at a time.
  ``_decode_rows`` streams one sequence's part through the forward's online softmax (base 2,
  ``_online_softmax_step``); a lone part writes its rows, else each writes them normalised, with their log-sum-exp,
  to fp32 partial buffers and counts itself in its row block's arrivals, and the last part to arrive combines them
  (``_combine_splits``: ``lse = log sum_s exp(lse_s)``, ``o = sum_s exp(lse_s - lse) o_s``; an empty part has
  ``lse_s = -inf``) and resets the count for the next call.

Masks: the forward's band with ``Sk = L`` per sequence (queries align bottom-right); key blocks every row sees whole
load without a mask (``MASKED``, a compile-time variant of one loop). Paged caches (``PAGED``): each key row finds
its page through ``block_table[b, j // block_size]`` (any page size, a shift where it is a power of two); a K/V load
waits on its page numbers, so the pipeliner keeps one block in flight and a paged launch runs two programs per SM,
or (``PAGES_AHEAD``: paged FP8, or one sequence at one program per SM) the page numbers load a block early. FP8
caches: tiles widen to q's dtype for their products, to fp16 where q is bf16 (``_fp16_queries``: one conversion per
pair, where bf16 is a chain); the K scale multiplies the softmax scale, the V scale the output. The widening bounds
a contiguous FP8 step, not memory, so it too runs two programs per SM.

Limits: forward only, any head dim of the family (padded to a power of two), fp16/bf16/fp32 and float8_e4m3fn
caches; ``cache_seqlens[b] + Sq_new`` is clamped to [0, capacity] on the device, block-table entries are not checked.

Trade-offs: the program count comes from the shapes on the host (``configs.decode_plan``), never from the lengths,
which only the GPU reads: a call needs no synchronisation and a CUDA graph can capture it, but a batch much shorter
than the cache's capacity has short chunks. A balanced program pays a query load and a part per sequence it
touches: 3-9% of an FP8 step, bound by its widening, so FP8 caches keep per-sequence splits.
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
def _page_position(cols, block_size, PAGE_SHIFT: tl.constexpr):
    """``(page_of, row_in_page)`` of cache positions ``cols``: their page's index in the sequence's table row and
    their row in it. Pages of ``2^PAGE_SHIFT`` positions split a position by a shift and a mask; other sizes
    (``PAGE_SHIFT`` -1) by a division by the runtime ``block_size``, a routine of about twenty instructions per
    position."""
    if PAGE_SHIFT >= 0:
        return cols >> PAGE_SHIFT, cols & ((1 << PAGE_SHIFT) - 1)
    return cols // block_size, cols % block_size


@triton.jit
def _page_numbers(cols, table_row, block_size, end, PAGE_SHIFT: tl.constexpr):
    """The pages of cache positions ``cols`` of one sequence (page 0 for positions at or past ``end``, whose table
    entries may lie past the row)."""
    page_of, _ = _page_position(cols, block_size, PAGE_SHIFT)
    return tl.load(table_row + page_of, mask=cols < end, other=0)


@triton.jit
def _cache_row_offsets(cols, table_row, block_size, stride_page, stride_s, L, PAGED: tl.constexpr,
                       MASKED: tl.constexpr, PAGE_SHIFT: tl.constexpr):
    """64-bit offsets of cache positions ``cols`` of one sequence and head: ``cols * stride_s`` in a contiguous cache,
    ``page * stride_page + row * stride_s`` in a paged one (positions at or past ``L`` read page 0 when ``MASKED``)."""
    if PAGED:
        page_of, row_in_page = _page_position(cols, block_size, PAGE_SHIFT)
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
    PAGES_AHEAD: tl.constexpr = False,
):
    """Stream cache positions [start, end) (whole key blocks, except a masked last one) through the online
    softmax (base 2). ``PAGES_AHEAD`` (paged, whole blocks): each block's page numbers are loaded one iteration
    before its K and V, a loop-carried vector, so that no K/V load waits on a table load of its own iteration."""
    ahead = PAGED and PAGES_AHEAD and not MASKED
    pages = offs_n
    if ahead:
        pages = _page_numbers(start + offs_n, table_row, block_size, end, PAGE_SHIFT)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if ahead:
            _, row_in_page = _page_position(cols, block_size, PAGE_SHIFT)
            k_rows = pages.to(tl.int64) * stride_kpage + row_in_page.to(tl.int64) * stride_ks
            v_rows = pages.to(tl.int64) * stride_vpage + row_in_page.to(tl.int64) * stride_vs
            pages = _page_numbers(cols + BLOCK_N, table_row, block_size, end, PAGE_SHIFT)
        else:
            k_rows = _cache_row_offsets(cols, table_row, block_size, stride_kpage, stride_ks, L, PAGED, MASKED,
                                        PAGE_SHIFT)
            v_rows = _cache_row_offsets(cols, table_row, block_size, stride_vpage, stride_vs, L, PAGED, MASKED,
                                        PAGE_SHIFT)
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


@triton.jit
def _first_visible_key(L, Sq, LEFT, HAS_LEFT: tl.constexpr, BLOCK_N: tl.constexpr):
    """``lo``: the first cache position (rounded down to a key block) that some query of a sequence of ``L`` keys
    sees; 0 without a left edge. ``L`` a scalar or a vector of lengths."""
    lo = L * 0
    if HAS_LEFT:
        lo = tl.minimum(tl.maximum(L - Sq - LEFT, 0), L) // BLOCK_N * BLOCK_N
    return lo


@triton.jit
def _decode_rows(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, o_part_ptr, lse_part_ptr, arrivals_ptr, seqlens_ptr, table_ptr, stride_tb,
    stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd, stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh,
    Hkv, GROUP, Sq, new_tokens, D, block_size, capacity, scale_log2, LEFT, RIGHT,
    k_scale, v_scale, k_scale_ptr, v_scale_ptr, stride_k_scale, stride_v_scale,
    b, hk, pid_r, first_block, end_block, slot, first_slot, splits,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PAGED: tl.constexpr, SPLIT: tl.constexpr,
    STORE_LSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, K_SCALE_IN_MEMORY: tl.constexpr,
    V_SCALE_IN_MEMORY: tl.constexpr, PAGE_SHIFT: tl.constexpr, LONE_PARTS: tl.constexpr,
    PAGES_AHEAD: tl.constexpr,
):
    """Row block ``pid_r`` of sequence ``b`` and key/value head ``hk`` over key blocks ``[first_block, end_block)``
    of the keys its queries see (counted from ``lo``): one of the ``splits`` parts of those keys, whose partial
    results sit in slots ``first_slot ...`` (this one in ``slot``). A lone part writes its rows (``LONE_PARTS``: there
    may be one); with several, each writes its partial result and the last to arrive combines them all."""
    ROWS = GROUP * Sq
    rows = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)
    q_head = hk * GROUP + rows // Sq
    q_idx = rows % Sq
    row_ok = rows < ROWS
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # an FP8 cache's K scale folds into the scores' scale, its V scale into the normalised output
    scale_log2 = tl.cast(scale_log2, tl.float32) * _head_scale(k_scale, k_scale_ptr, stride_k_scale, hk,
                                                               K_SCALE_IN_MEMORY)
    v_scale = _head_scale(v_scale, v_scale_ptr, stride_v_scale, hk, V_SCALE_IN_MEMORY)

    q_ptrs = (q_ptr + b.to(tl.int64) * stride_qb + q_head[:, None].to(tl.int64) * stride_qh
              + q_idx[:, None].to(tl.int64) * stride_qs + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    if k_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        q, scale_log2 = _fp16_queries(q, scale_log2)

    L = _sequence_keys(seqlens_ptr, b, new_tokens, capacity)
    lo_shift = L - Sq - LEFT  # query i sees keys from i + lo_shift (HAS_LEFT) ...
    hi_shift = L - Sq + RIGHT  # ... to i + hi_shift (HAS_RIGHT)
    lo = _first_visible_key(L, Sq, LEFT, HAS_LEFT, BLOCK_N)
    start = tl.minimum(lo + first_block * BLOCK_N, L)
    end = tl.minimum(lo + end_block * BLOCK_N, L)
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
                                        HAS_RIGHT, EVEN_D, BLOCK_N, DOT_PRECISION, PAGE_SHIFT, PAGES_AHEAD)
    acc, m_i, l_i = _kvcache_attn_inner(acc, m_i, l_i, q, k_head, v_head, table_row, full_hi, end, q_idx, offs_n,
                                        offs_d, L, D, block_size, stride_kb, stride_ks, stride_kd, stride_vb,
                                        stride_vs, stride_vd, lo_shift, hi_shift, scale_log2, True, PAGED, HAS_LEFT,
                                        HAS_RIGHT, EVEN_D, BLOCK_N, DOT_PRECISION, PAGE_SHIFT)

    # l_i = 0 only for a row that saw no key (an empty part, a query before every visible key); not `l_i > 0`,
    # which would turn a NaN row into zeros
    seen = ~(l_i == 0.0)
    safe_l = tl.where(seen, l_i, 1.0)
    o = tl.where(seen[:, None], acc / safe_l[:, None] * v_scale, 0.0)  # (times 1.0 exactly, but for FP8)
    lse = tl.where(seen, (m_i + tl.math.log2(safe_l)) * _LN2, float("-inf"))
    if SPLIT:
        if LONE_PARTS and splits == 1:
            _store_rows(o, lse, o_ptr, lse_ptr, b, q_head, q_idx, row_ok, offs_d, D, stride_ob, stride_oh,
                        stride_os, stride_od, stride_lb, stride_lh, STORE_LSE)
        else:
            part = slot.to(tl.int64) * ROWS + rows
            tl.store(o_part_ptr + part[:, None] * BLOCK_D + offs_d[None, :], o, mask=row_ok[:, None])
            tl.store(lse_part_ptr + part, lse, mask=row_ok)
            # The last part of this row block to finish combines them all: every thread's stores are done before
            # the arrival is counted (release), and the combining program reads the others' after it (acquire).
            tl.debug_barrier()
            arrival = (b * Hkv + hk) * tl.num_programs(2) + pid_r
            arrived = tl.atomic_add(arrivals_ptr + arrival, 1, sem="acq_rel", scope="gpu")
            if arrived == splits - 1:
                tl.debug_barrier()
                o, lse = _combine_splits(o_part_ptr, lse_part_ptr, first_slot.to(tl.int64) * ROWS + rows,
                                         ROWS, splits, row_ok, offs_d, BLOCK_D)
                tl.atomic_xchg(arrivals_ptr + arrival, 0, sem="relaxed", scope="gpu")  # ready for the next call
                _store_rows(o, lse, o_ptr, lse_ptr, b, q_head, q_idx, row_ok, offs_d, D, stride_ob, stride_oh,
                            stride_os, stride_od, stride_lb, stride_lh, STORE_LSE)
    else:
        _store_rows(o, lse, o_ptr, lse_ptr, b, q_head, q_idx, row_ok, offs_d, D, stride_ob, stride_oh, stride_os,
                    stride_od, stride_lb, stride_lh, STORE_LSE)


@triton.jit(do_not_specialize=["new_tokens", "Sq"])
def _kvcache_attn_kernel(
    q_ptr,  # (B, Hq, Sq, D)
    k_ptr, v_ptr,  # (B, Hkv, S_max, D), or paged (num_blocks, Hkv, block_size, D)
    o_ptr,  # (B, Hq, Sq, D)
    lse_ptr,  # (B, Hq, Sq) fp32 (STORE_LSE)
    o_part_ptr, lse_part_ptr,  # SPLIT: (slots * ROWS, BLOCK_D) and (slots * ROWS,) fp32
    arrivals_ptr,  # SPLIT: (B * Hkv * row blocks,) int32, zero on entry and on exit: parts done per row block
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
    SPLITS,  # key splits per (batch, key/value head); BALANCED: unused (the grid's second axis)
    k_scale, v_scale, k_scale_ptr, v_scale_ptr, stride_k_scale, stride_v_scale,  # an FP8 cache's scales (else 1.0)
    BATCH,  # sequences (BALANCED)
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PAGED: tl.constexpr, SPLIT: tl.constexpr,
    STORE_LSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, K_SCALE_IN_MEMORY: tl.constexpr,
    V_SCALE_IN_MEMORY: tl.constexpr, BALANCED: tl.constexpr = False, BLOCK_B: tl.constexpr = 1,
    PAGE_SHIFT: tl.constexpr = -1,  # PAGED: log2(block_size) where it is a power of two, else -1
    PAGES_AHEAD: tl.constexpr = False,  # PAGED: page numbers loaded a key block ahead (DecodePlan.pages_ahead)
):
    pid_r = tl.program_id(2)
    if BALANCED:
        # program (head, p, row block) of P: the key blocks of the batch's sequences, laid end to end, cut into P
        # shares of one size; program p reads share p, which may end one sequence and start others, and writes one
        # part per sequence it touches. Sequence b's parts are those of programs first[b] ... last[b], their partial
        # results in slots b + first[b] ... b + last[b] of the head (b + p never repeats: from one part to the next
        # b or p grows). An empty sequence is one empty part of the program where its keys would start.
        hk = tl.program_id(0)
        program = tl.program_id(1)
        programs = tl.num_programs(1)
        offs_b = tl.arange(0, BLOCK_B)
        in_batch = offs_b < BATCH
        L = tl.minimum(tl.maximum(tl.load(seqlens_ptr + offs_b, mask=in_batch, other=0) + new_tokens, 0), capacity)
        L = tl.where(in_batch, L, 0)
        blocks = tl.cdiv(L - _first_visible_key(L, Sq, LEFT, HAS_LEFT, BLOCK_N), BLOCK_N)
        ends = tl.cumsum(blocks, axis=0)
        starts = ends - blocks
        share = tl.maximum(tl.cdiv(tl.sum(blocks, axis=0), programs), 1)
        first = tl.where(in_batch, tl.minimum(starts // share, programs - 1), programs)
        last = tl.where(in_batch, tl.maximum(first, (ends - 1) // share), programs)
        slots = hk * (programs + BATCH)
        for seq in range(tl.sum((last < program).to(tl.int32), axis=0), tl.sum((first <= program).to(tl.int32), 0)):
            b = program * 0 + seq  # a tensor under the interpreter too, whose loops count in Python ints
            mine = offs_b == b
            seq_start = tl.sum(tl.where(mine, starts, 0), axis=0)
            seq_first = tl.sum(tl.where(mine, first, 0), axis=0)
            seq_last = tl.sum(tl.where(mine, last, 0), axis=0)
            first_block = tl.maximum(program * share - seq_start, 0)
            end_block = tl.minimum((program + 1) * share - seq_start, tl.sum(tl.where(mine, blocks, 0), axis=0))
            _decode_rows(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, o_part_ptr, lse_part_ptr, arrivals_ptr, seqlens_ptr,
                         table_ptr, stride_tb, stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh,
                         stride_ks, stride_kd, stride_vb, stride_vh, stride_vs, stride_vd, stride_ob, stride_oh,
                         stride_os, stride_od, stride_lb, stride_lh, Hkv, GROUP, Sq, new_tokens, D, block_size,
                         capacity, scale_log2, LEFT, RIGHT, k_scale, v_scale, k_scale_ptr, v_scale_ptr,
                         stride_k_scale, stride_v_scale, b, hk, pid_r, first_block, end_block, slots + b + program,
                         slots + b + seq_first, seq_last - seq_first + 1, HAS_LEFT, HAS_RIGHT, PAGED, SPLIT,
                         STORE_LSE, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, DOT_PRECISION, K_SCALE_IN_MEMORY,
                         V_SCALE_IN_MEMORY, PAGE_SHIFT, True, PAGES_AHEAD)
    else:
        # program (sequence * head, split, row block): the keys the sequence's queries see cut into SPLITS parts
        pid_bhk = tl.program_id(0)
        split = tl.program_id(1)
        b = pid_bhk // Hkv
        hk = pid_bhk % Hkv
        L = _sequence_keys(seqlens_ptr, b, new_tokens, capacity)
        per_split = tl.cdiv(tl.cdiv(L - _first_visible_key(L, Sq, LEFT, HAS_LEFT, BLOCK_N), BLOCK_N), SPLITS)
        _decode_rows(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, o_part_ptr, lse_part_ptr, arrivals_ptr, seqlens_ptr,
                     table_ptr, stride_tb, stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh,
                     stride_ks, stride_kd, stride_vb, stride_vh, stride_vs, stride_vd, stride_ob, stride_oh,
                     stride_os, stride_od, stride_lb, stride_lh, Hkv, GROUP, Sq, new_tokens, D, block_size,
                     capacity, scale_log2, LEFT, RIGHT, k_scale, v_scale, k_scale_ptr, v_scale_ptr,
                     stride_k_scale, stride_v_scale, b, hk, pid_r, split * per_split, (split + 1) * per_split,
                     pid_bhk * SPLITS + split, pid_bhk * SPLITS, SPLITS, HAS_LEFT, HAS_RIGHT, PAGED, SPLIT,
                     STORE_LSE, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, DOT_PRECISION, K_SCALE_IN_MEMORY,
                     V_SCALE_IN_MEMORY, PAGE_SHIFT, False, PAGES_AHEAD)


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
