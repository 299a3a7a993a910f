"""FlashAttention-2 in Triton: forward, and the backward as preprocess + dK/dV + dQ kernels.

Implements (read beside ``reference/attention.py``, which runs the same blocks in torch):
- ``_attn_fwd_kernel``: one program per (query block, batch * query head); K/V blocks stream through
  an online softmax in base 2 (``log2(e)`` folded into the scale); writes O and the natural-log
  log-sum-exp per row. Causal and sliding windows are one band ``i + Sk - Sq - LEFT <= j <= i + Sk - Sq +
  RIGHT`` (causal: RIGHT = 0; each side optional): key blocks wholly outside the band are never loaded,
  so cost grows with the window, not with S^2; only blocks that cross its edges, or the end of K, pay
  for a mask.
- ``_attn_bwd_preprocess_kernel``: ``delta = rowsum(dO * O)``; for the Hopper backward it also zeroes the fp32 dQ
  accumulator that kernel adds into, and the dK/dV ones where programs share a GQA group's keys.
- ``_attn_bwd_kernel``: two kinds of programs in one grid, dK/dV programs first (``DKDV``), then dQ
  programs (``DQ``); the launcher runs both kinds in one launch when their tile configs share warps and
  stages, else one launch per kind. A dK/dV program (``_attn_bwd_dkdv_program``) owns a key block of one
  key/value head and loops over the query heads of its GQA group and the query blocks that see the key
  block; P is recomputed from the saved log-sum-exp. A dQ program (``_attn_bwd_dq_program``) owns a query
  block of one query head and loops over key blocks. No atomics: deterministic.

Dropout on the probabilities (``DROPOUT``): the keep mask of each tile is drawn from Philox4x32-10
(``kernels._common.philox``) on the counter stated in ``reference/attention.py``, in the forward and again
in the backward; nothing is stored. Decisions are bytes, sixteen per call, ordered so that one call's
sixteen are the elements one thread holds of the scores' accumulator (``_dropout_keep``): no exchange
between threads, except the transpose the dK/dV programs need. Packed variable-length batches
(``VARLEN``) read each sequence's start from the cumulative lengths.

Limits: head dims are padded to a power of two >= 16 inside the kernel (any D works; D > 256 runs with
small blocks, correct but slow). Any strides. Tiles, warps and stages: ``kernels/attention/configs.py``.

Trade-offs:
- The backward computes Q K^T twice (dK/dV and dQ programs) instead of accumulating dQ with atomics:
  deterministic, at the cost of two more matmuls per tile pair (7 instead of 5).
- The unmasked loop takes the row maximum of the raw scores and scales it once per row, so each score's
  exponent argument is one fused multiply-add (``qk * scale - m``): at D = 64 exp2 alone is as slow as the
  tile's matmuls, and every instruction of the softmax beside it shows in the speed.
- Masks are compile-time variants of one loop (``MASKED``, ``HAS_LEFT``/``HAS_RIGHT``, ``EVEN_D``): the
  interior tiles load without a mask, which lets the loads vectorise and the pipeliner run ahead.
- With a right edge (causal), later query blocks visit more key blocks: the forward and dQ programs take
  query blocks last-first, so that the long ones start in the first waves and the short ones fill the
  tail of the grid (dK/dV programs are already longest-first: key block 0 sees every query).
"""

import triton
import triton.language as tl

from kernels._common.philox import philox4x32, philox_key
from reference.attention import ATTENTION_COUNTER_TAG

_COUNTER_TAG = tl.constexpr(ATTENTION_COUNTER_TAG)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _head_base(ptr, b, h, stride_b, stride_h, start, stride_s):
    """Position ``start`` of head ``h`` of sequence ``b``, 64-bit offsets. Dense (B, H, S, D) tensors have
    ``start = 0``; packed varlen (total, H, D) tensors pass ``stride_b = 0`` and the sequence's offset."""
    return ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + start.to(tl.int64) * stride_s


@triton.jit
def _seq_bounds(cu_seqlens_ptr, b, length, VARLEN: tl.constexpr):
    """``(start, length)`` of sequence ``b``: from the cumulative lengths when packed, else ``(0, length)``."""
    if VARLEN:
        start = tl.load(cu_seqlens_ptr + b)
        length = tl.load(cu_seqlens_ptr + b + 1) - start
    else:
        start = b * 0
    return start, length


@triton.jit
def _load_rows(base, rows, stride_s, offs_d, stride_d, n_rows, D, ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """Rows ``rows`` x dims ``offs_d`` of one head; masks only what may be out of range (zeros there)."""
    return _load_tile(base + rows[:, None] * stride_s + offs_d[None, :] * stride_d, rows, n_rows, offs_d, D,
                      ROW_MASK, EVEN_D)


@triton.jit
def _load_tile(ptrs, rows, n_rows, offs_d, D, ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """The (rows x dims) tile at ``ptrs``, masked only where it may be out of range: rows at or past ``n_rows``
    (``ROW_MASK``) and dims at or past ``D`` (unless ``EVEN_D``); zeros there."""
    if ROW_MASK:
        if EVEN_D:
            tile = tl.load(ptrs, mask=(rows < n_rows)[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows < n_rows)[:, None] & (offs_d < D)[None, :], other=0.0)
    else:
        if EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)
    return tile


@triton.jit
def _apply_window(x, q_idx, k_idx, lo_shift, hi_shift, fill, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """``x`` where query ``q_idx`` sees key ``k_idx`` (``q + lo_shift <= k <= q + hi_shift``, each side only
    if present), ``fill`` elsewhere. The shifts fold in the bottom-right alignment: ``Sk - Sq -/+ window``."""
    if HAS_RIGHT:
        x = tl.where(k_idx <= q_idx + hi_shift, x, fill)
    if HAS_LEFT:
        x = tl.where(k_idx >= q_idx + lo_shift, x, fill)
    return x


@triton.jit
def _dropout_keep(m0, n0, bh, seed_lo, seed_hi, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keep mask of attention dropout for queries ``m0 .. m0 + BLOCK_M`` x keys ``n0 .. n0 + BLOCK_N`` (each
    start a multiple of its block), as ``reference.attention.attention_keep_mask`` states it: query ``i``, key
    ``j`` takes byte ``2 * ((i // 8) % 2) + j % 2`` of word ``(j % 32) // 8`` of Philox4x32-10 on the counter
    ``(4 * (j // 32) + (j % 8) // 2, 8 * (i // 16) + i % 8, bh, TAG)``, kept iff the byte is ``>= threshold``.

    Why that order: the sixteen decisions of one call are queries ``{i, i + 8}`` x keys ``{2t, 2t + 1} + 8w``
    (``w < 4``) of a 16 x 32 patch, exactly the elements one thread holds of an NVIDIA MMA accumulator (rows
    ``r`` and ``r + 8``, the column pair ``2t, 2t + 1`` of every 8 columns). The tile is drawn as
    ``[g, 8a + r, t]`` (query ``16a + 8u + r``, key ``32g + 8w + 2t + h``), widened by joins to
    ``[g, a, r, t, w, h, u]``, permuted and flattened: the compiler lays each step out where the scores keep
    those indices, so no element crosses threads (checked in the TTGIR: no layout conversion that moves data).
    Tiles narrower than 16 x 32 (the small D > 256 tiles) draw each element's call on its own instead."""
    threshold = tl.cast(threshold, tl.uint32)
    k0 = tl.cast(seed_lo, tl.uint32)
    k1 = tl.cast(seed_hi, tl.uint32)
    if (BLOCK_M % 16 == 0) and (BLOCK_N % 32 == 0):
        GROUPS_M: tl.constexpr = BLOCK_M // 16
        GROUPS_N: tl.constexpr = BLOCK_N // 32
        # t last: the default layout then puts t and r in lanes and g in registers, as the scores have them
        octet = (n0 // 8 + tl.arange(0, GROUPS_N) * 4)[:, None, None] + tl.arange(0, 4)[None, None, :]
        pair = (m0 // 2 + tl.arange(0, BLOCK_M // 2))[None, :, None]
        zeros = tl.zeros([GROUPS_N, BLOCK_M // 2, 4], dtype=tl.uint32)
        w0, w1, w2, w3 = philox4x32(zeros + octet.to(tl.uint32), zeros + pair.to(tl.uint32),
                                    zeros + tl.cast(bh, tl.uint32), zeros + _COUNTER_TAG, k0, k1)
        # [.., k, l] of join(join(x0, x2), join(x1, x3)) is x_{2k + l}: the word index w
        words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (GROUPS_N, GROUPS_M, 8, 4, 4))
        # byte 2u + h of each word decides query half u and key parity h
        u0 = tl.join((words & 0xFF) >= threshold, ((words >> 8) & 0xFF) >= threshold)
        u1 = tl.join(((words >> 16) & 0xFF) >= threshold, (words >> 24) >= threshold)
        keep = tl.permute(tl.join(u0, u1), (1, 6, 2, 0, 4, 3, 5))  # [g, a, r, t, w, h, u] -> [a, u, r, g, w, t, h]
        keep = tl.reshape(keep, (BLOCK_M, BLOCK_N))
    else:
        i = (m0 + tl.arange(0, BLOCK_M))[:, None]
        j = (n0 + tl.arange(0, BLOCK_N))[None, :]
        zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.uint32)
        w0, w1, w2, w3 = philox4x32(zeros + (4 * (j // 32) + j % 8 // 2).to(tl.uint32),
                                    zeros + (8 * (i // 16) + i % 8).to(tl.uint32),
                                    zeros + tl.cast(bh, tl.uint32), zeros + _COUNTER_TAG, k0, k1)
        word_index = j % 32 // 8
        word = tl.where(word_index < 2, tl.where(word_index == 0, w0, w1), tl.where(word_index == 2, w2, w3))
        byte = 2 * (i // 8 % 2) + j % 2
        keep = ((word >> (8 * byte).to(tl.uint32)) & 0xFF) >= threshold
    return keep


@triton.jit
def _key_range(m0, Sk, lo_shift, hi_shift, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks a query block [m0, m0 + BLOCK_M) must visit: ``[start, end)``, of which
    ``[full_lo, full_hi)`` (whole blocks inside Sk) every row sees entirely and needs no mask.
    Blocks outside the window (above the causal diagonal, left of a sliding window) are never visited."""
    if HAS_RIGHT:
        end = tl.minimum(tl.maximum(m0 + BLOCK_M - 1 + hi_shift + 1, 0), Sk)
        full_hi = tl.minimum(tl.maximum(m0 + hi_shift + 1, 0), Sk) // BLOCK_N * BLOCK_N
    else:
        end = Sk
        full_hi = Sk // BLOCK_N * BLOCK_N
    if HAS_LEFT:
        start = tl.minimum(tl.maximum(m0 + lo_shift, 0) // BLOCK_N * BLOCK_N, end)
        full_lo = tl.cdiv(tl.maximum(m0 + BLOCK_M - 1 + lo_shift, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, start), end)
    else:
        start = 0
        full_lo = 0
    full_hi = tl.maximum(full_hi, full_lo)
    return start, full_lo, full_hi, end


@triton.jit
def _online_softmax_step(qk, seen, m_i, l_i, scale_log2, MASKED: tl.constexpr):
    """One key block of the online softmax in base 2: ``(p, alpha, m_new, l_new)`` for raw scores ``qk``, the row
    maxima and sums so far, and (``MASKED``) which scores count (``seen``). ``p`` is unnormalised, ``alpha`` rescales
    what was accumulated before; the sum counts every probability (dropout comes after)."""
    if MASKED:
        s = tl.where(seen, qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_new_safe[:, None])
    else:
        # The scale is >= 0 and rounding is monotonic, so max(qk) * scale == max(qk * scale): scaling the
        # row maximum instead of every score leaves one fused multiply-add per score (scale, subtract).
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale_log2)
        m_new_safe = m_new
        p = tl.math.exp2(qk * scale_log2 - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _attn_fwd_inner(
    acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd, start, end, offs_m, offs_n, offs_d,
    Sk, D, lo_shift, hi_shift, scale_log2,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    m0, bh, seed_lo, seed_hi, threshold, inv_keep, DROPOUT: tl.constexpr,
):
    """Stream key blocks [start, end) through the online softmax (base 2)."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k = _load_rows(k_base, cols, stride_ks, offs_d, stride_kd, Sk, D, MASKED, EVEN_D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        seen = None
        if MASKED:
            seen = _apply_window(cols[None, :] < Sk, offs_m[:, None], cols[None, :], lo_shift, hi_shift, False,
                                 HAS_LEFT, HAS_RIGHT)
        p, alpha, m_new, l_i = _online_softmax_step(qk, seen, m_i, l_i, scale_log2, MASKED)
        if DROPOUT:
            keep = _dropout_keep(m0, start_n, bh, seed_lo, seed_hi, threshold, BLOCK_M, BLOCK_N)
            p = tl.where(keep, p * inv_keep, 0.0)
        v = _load_rows(v_base, cols, stride_vs, offs_d, stride_vd, Sk, D, MASKED, EVEN_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# Sq and Sk are not specialised: Triton 3.6 miscompiles the variant where both equal 1 (causal, head dims 80
# and 96, BLOCK_D = 128 with (128, 64, 8 warps, 3 stages)): 14-16% of launches wrote a wrong log-sum-exp on
# the H200 (record benchmarks/results/nvidia-h200/records/attention-race-2026-11-22.txt; none at any other
# length, none without the specialisation).
@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "seed_in_memory", "threshold", "Sq", "Sk"])
def _attn_fwd_kernel(
    q_ptr,  # (B, Hq, Sq, D)
    k_ptr,  # (B, Hkv, Sk, D)
    v_ptr,  # (B, Hkv, Sk, D)
    o_ptr,  # (B, Hq, Sq, D) output
    lse_ptr,  # (B, Hq, Sq) fp32 output; packed: (Hq, total_q)
    cu_seqlens_q, cu_seqlens_k,  # packed batches: (B + 1,) int32 cumulative lengths (VARLEN)
    stride_lb, stride_lh,  # lse strides (batch, head); 1 along the sequence
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    Hq,
    GROUP,  # Hq // Hkv
    Sq,  # packed: unused (each sequence's lengths come from the cumulative lengths)
    Sk,
    D,
    scale_log2,  # softmax_scale * log2(e)
    LEFT,  # window: query i sees keys i + Sk - Sq - LEFT ... i + Sk - Sq + RIGHT (causal: RIGHT = 0)
    RIGHT,
    seed_lo, seed_hi,  # attention dropout: the 64-bit seed as two Philox key words
    seed_ptr, seed_in_memory,  # or the seed as one int64 on the device (dropout philox_key)
    threshold,  # keep iff the word is >= threshold
    inv_keep,  # 1 / the kept fraction (reference.attention.attention_keep_scale)
    HAS_LEFT: tl.constexpr,  # False: unbounded on that side (constexprs follow every run-time argument)
    HAS_RIGHT: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,  # D == BLOCK_D: no mask on the head dim
    DOT_PRECISION: tl.constexpr,
    VARLEN: tl.constexpr,  # packed (total, H, D) sequences delimited by cu_seqlens_q / cu_seqlens_k
):
    pid_m = tl.program_id(0)
    if HAS_RIGHT:
        pid_m = tl.num_programs(0) - 1 - pid_m  # longest query blocks first (see the header)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    q_start, Sq = _seq_bounds(cu_seqlens_q, b, Sq, VARLEN)
    k_start, Sk = _seq_bounds(cu_seqlens_k, b, Sk, VARLEN)
    if pid_m * BLOCK_M >= Sq:  # packed: the grid covers the longest sequence
        return
    if DROPOUT:
        seed_lo, seed_hi = philox_key(seed_lo, seed_hi, seed_ptr, seed_in_memory)
    # Pin float scalars to fp32 (what an eager launch passes; inductor's launcher may pass them wider).
    scale_log2 = tl.cast(scale_log2, tl.float32)
    inv_keep = tl.cast(inv_keep, tl.float32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(_head_base(q_ptr, b, h, stride_qb, stride_qh, q_start, stride_qs), offs_m, stride_qs, offs_d,
                   stride_qd, Sq, D, True, EVEN_D)
    k_base = _head_base(k_ptr, b, hk, stride_kb, stride_kh, k_start, stride_ks)
    v_base = _head_base(v_ptr, b, hk, stride_vb, stride_vh, k_start, stride_vs)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    diag = Sk - Sq  # query i sits at key position i + diag
    lo_shift = diag - LEFT
    hi_shift = diag + RIGHT
    start, full_lo, full_hi, end = _key_range(pid_m * BLOCK_M, Sk, lo_shift, hi_shift, HAS_LEFT, HAS_RIGHT,
                                              BLOCK_M, BLOCK_N)
    if HAS_LEFT:
        acc, m_i, l_i = _attn_fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                        start, full_lo, offs_m, offs_n, offs_d, Sk, D, lo_shift, hi_shift, scale_log2,
                                        True, HAS_LEFT, HAS_RIGHT, EVEN_D, BLOCK_M, BLOCK_N, DOT_PRECISION,
                                        pid_m * BLOCK_M, pid_bh, seed_lo, seed_hi, threshold, inv_keep, DROPOUT)
    acc, m_i, l_i = _attn_fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                    full_lo, full_hi, offs_m, offs_n, offs_d, Sk, D, lo_shift, hi_shift, scale_log2,
                                    False, HAS_LEFT, HAS_RIGHT, EVEN_D, BLOCK_M, BLOCK_N, DOT_PRECISION,
                                    pid_m * BLOCK_M, pid_bh, seed_lo, seed_hi, threshold, inv_keep, DROPOUT)
    acc, m_i, l_i = _attn_fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                    full_hi, end, offs_m, offs_n, offs_d, Sk, D, lo_shift, hi_shift, scale_log2,
                                    True, HAS_LEFT, HAS_RIGHT, EVEN_D, BLOCK_M, BLOCK_N, DOT_PRECISION,
                                    pid_m * BLOCK_M, pid_bh, seed_lo, seed_hi, threshold, inv_keep, DROPOUT)
    # l_i = 0 only for a row that saw no key; not `l_i > 0`, which is False for a NaN row and would turn
    # a NaN (from a NaN or Inf in q, k or v) into zeros instead of propagating it, as torch does
    seen = ~(l_i == 0.0)
    safe_l = tl.where(seen, l_i, 1.0)
    o = tl.where(seen[:, None], acc / safe_l[:, None], 0.0)
    o_ptrs = _head_base(o_ptr, b, h, stride_ob, stride_oh, q_start, stride_os) + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=(offs_m < Sq)[:, None] & (offs_d < D)[None, :])
    lse = tl.where(seen, (m_i + tl.math.log2(safe_l)) * _LN2, float("-inf"))  # to natural log
    tl.store(_head_base(lse_ptr, b, h, stride_lb, stride_lh, q_start, 1) + offs_m, lse, mask=offs_m < Sq)


@triton.jit
def _attn_bwd_preprocess_kernel(
    o_ptr, do_ptr,  # (B, Hq, Sq, D), any strides
    delta_ptr,  # (B, Hq, Sq) fp32 output, laid out as the lse
    dq_acc_ptr,  # (B, Hq, Sq, BLOCK_D) fp32, contiguous: zeroed here when ZERO_DQ_ACC (the Hopper backward's dQ sums)
    dk_acc_ptr, dv_acc_ptr,  # ZERO_DKV_ACC: two contiguous fp32 tensors of dkv_acc_rows rows of BLOCK_D, zeroed here
    dkv_acc_rows,
    cu_seqlens_q,
    stride_lb, stride_lh,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_dob, stride_doh, stride_dos, stride_dod,
    Hq, Sq, D,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    VARLEN: tl.constexpr,
    ZERO_DQ_ACC: tl.constexpr,
    ZERO_DKV_ACC: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    if ZERO_DKV_ACC:
        # their rows are not the grid's (B * Hkv * Sk of them): dealt out over every program, BLOCK_M at a time
        programs = tl.num_programs(0) * tl.num_programs(1)
        first = (pid_bh * tl.num_programs(0) + pid_m) * BLOCK_M
        zeros = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for row0 in range(first, dkv_acc_rows, programs * BLOCK_M):
            rows = row0 + tl.arange(0, BLOCK_M)
            at = rows.to(tl.int64)[:, None] * BLOCK_D + offs_d[None, :]
            tl.store(dk_acc_ptr + at, zeros, mask=(rows < dkv_acc_rows)[:, None])
            tl.store(dv_acc_ptr + at, zeros, mask=(rows < dkv_acc_rows)[:, None])
    b = pid_bh // Hq
    h = pid_bh % Hq
    q_start, Sq = _seq_bounds(cu_seqlens_q, b, Sq, VARLEN)
    if pid_m * BLOCK_M >= Sq:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o = _load_rows(_head_base(o_ptr, b, h, stride_ob, stride_oh, q_start, stride_os), offs_m, stride_os, offs_d, stride_od, Sq, D,
                   True, EVEN_D)
    do = _load_rows(_head_base(do_ptr, b, h, stride_dob, stride_doh, q_start, stride_dos), offs_m, stride_dos, offs_d, stride_dod, Sq, D,
                    True, EVEN_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(_head_base(delta_ptr, b, h, stride_lb, stride_lh, q_start, 1) + offs_m, delta, mask=offs_m < Sq)
    if ZERO_DQ_ACC:
        # here rather than a separate fill: one launch less, and these rows' bytes are written while O and dO are read
        rows = (pid_bh.to(tl.int64) * Sq + offs_m) * BLOCK_D
        tl.store(dq_acc_ptr + rows[:, None] + offs_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=(offs_m < Sq)[:, None])


@triton.jit
def _query_range(n0, Sq, lo_shift, hi_shift, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query blocks the key block [n0, n0 + BLOCK_N) must visit: ``[start, end)``, of which ``[full_lo, full_hi)``
    see all of its keys and need no band mask. Query i sees key j iff ``i + lo_shift <= j <= i + hi_shift``;
    query blocks wholly outside that band for this key block are skipped."""
    if HAS_RIGHT:
        start = tl.maximum(n0 - hi_shift, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - hi_shift, 0), BLOCK_M) * BLOCK_M
    else:
        start = 0
        full_lo = 0
    if HAS_LEFT:
        end = tl.minimum(tl.maximum(n0 + BLOCK_N - lo_shift, 0), Sq)
        full_hi = tl.maximum(n0 - lo_shift + 1, 0) // BLOCK_M * BLOCK_M
    else:
        end = Sq
        full_hi = Sq
    start = tl.minimum(start, end)
    full_lo = tl.minimum(tl.maximum(full_lo, start), end)
    full_hi = tl.maximum(tl.minimum(full_hi, end), full_lo)
    return start, full_lo, full_hi, end


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_qd, stride_dos, stride_dod, start, end,
    offs_m, keys, offs_d, Sq, D, lo_shift, hi_shift, scale_log2,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    n0, bh, seed_lo, seed_hi, threshold, inv_keep, DROPOUT: tl.constexpr,
):
    """Accumulate this key block's dK (unscaled) and dV over the query blocks [start, end) of one head."""
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + offs_m
        q = _load_rows(q_base, rows, stride_qs, offs_d, stride_qd, Sq, D, True, EVEN_D)
        do = _load_rows(do_base, rows, stride_dos, offs_d, stride_dod, Sq, D, True, EVEN_D)
        # Rows past Sq, and rows that saw no key (lse = -inf), get +inf: P = 0 there.
        lse = tl.load(lse_base + rows, mask=rows < Sq, other=float("inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E
        delta = tl.load(delta_base + rows, mask=rows < Sq, other=0.0)
        # Transposed scores: (keys, queries)
        pt = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * scale_log2 - lse2[None, :])
        if MASKED:
            pt = _apply_window(pt, rows[None, :], keys[:, None], lo_shift, hi_shift, 0.0, HAS_LEFT, HAS_RIGHT)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if DROPOUT:
            keep_t = tl.trans(_dropout_keep(m0, n0, bh, seed_lo, seed_hi, threshold, BLOCK_M, BLOCK_N))
            dv += tl.dot(tl.where(keep_t, pt * inv_keep, 0.0).to(do.dtype), do, input_precision=DOT_PRECISION)
            dpt = tl.where(keep_t, dpt * inv_keep, 0.0)
        else:
            dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_program(
    pid_n, pid_bh,  # this program's key block, and batch * key/value head
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_seqlens_q, cu_seqlens_k, stride_lb, stride_lh,
    stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd, stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dkb, stride_dkh, stride_dks, stride_dkd, Hq, Hkv, GROUP, Sq, Sk, D, scale, LEFT, RIGHT,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, seed_lo, seed_hi, threshold, inv_keep, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
):
    """dK and dV of one key block of one key/value head, over every query that sees it."""
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    n0 = pid_n * BLOCK_N
    q_start, Sq = _seq_bounds(cu_seqlens_q, b, Sq, VARLEN)
    k_start, Sk = _seq_bounds(cu_seqlens_k, b, Sk, VARLEN)
    if n0 >= Sk:
        return
    scale = tl.cast(scale, tl.float32)
    inv_keep = tl.cast(inv_keep, tl.float32)
    keys = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(_head_base(k_ptr, b, hk, stride_kb, stride_kh, k_start, stride_ks), keys, stride_ks, offs_d,
                   stride_kd, Sk, D, True, EVEN_D)
    v = _load_rows(_head_base(v_ptr, b, hk, stride_vb, stride_vh, k_start, stride_vs), keys, stride_vs, offs_d,
                   stride_vd, Sk, D, True, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    scale_log2 = scale * _LOG2E
    diag = Sk - Sq
    lo_shift = diag - LEFT
    hi_shift = diag + RIGHT
    start_m, full_lo, full_hi, end_m = _query_range(n0, Sq, lo_shift, hi_shift, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = _head_base(q_ptr, b, h, stride_qb, stride_qh, q_start, stride_qs)
        do_base = _head_base(do_ptr, b, h, stride_dob, stride_doh, q_start, stride_dos)
        bh = b * Hq + h
        lse_base = _head_base(lse_ptr, b, h, stride_lb, stride_lh, q_start, 1)
        delta_base = _head_base(delta_ptr, b, h, stride_lb, stride_lh, q_start, 1)
        if HAS_RIGHT:
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                          stride_qs, stride_qd, stride_dos, stride_dod, start_m, full_lo,
                                          offs_m, keys, offs_d, Sq, D, lo_shift, hi_shift, scale_log2,
                                          True, HAS_LEFT, HAS_RIGHT, EVEN_D, BLOCK_M, BLOCK_N, DOT_PRECISION,
                                          n0, bh, seed_lo, seed_hi, threshold, inv_keep, DROPOUT)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                      stride_qs, stride_qd, stride_dos, stride_dod, full_lo, full_hi,
                                      offs_m, keys, offs_d, Sq, D, lo_shift, hi_shift, scale_log2,
                                      False, HAS_LEFT, HAS_RIGHT, EVEN_D, BLOCK_M, BLOCK_N, DOT_PRECISION,
                                      n0, bh, seed_lo, seed_hi, threshold, inv_keep, DROPOUT)
        if HAS_LEFT:
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                          stride_qs, stride_qd, stride_dos, stride_dod, full_hi, end_m,
                                          offs_m, keys, offs_d, Sq, D, lo_shift, hi_shift, scale_log2,
                                          True, HAS_LEFT, HAS_RIGHT, EVEN_D, BLOCK_M, BLOCK_N, DOT_PRECISION,
                                          n0, bh, seed_lo, seed_hi, threshold, inv_keep, DROPOUT)
    tile = keys[:, None] * stride_dks + offs_d[None, :] * stride_dkd
    mask = (keys < Sk)[:, None] & (offs_d < D)[None, :]
    tl.store(_head_base(dk_ptr, b, hk, stride_dkb, stride_dkh, k_start, stride_dks) + tile,
             (dk * scale).to(dk_ptr.dtype.element_ty), mask=mask)
    tl.store(_head_base(dv_ptr, b, hk, stride_dkb, stride_dkh, k_start, stride_dks) + tile,
             dv.to(dv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd, start, end, offs_m, offs_n,
    offs_d, Sk, D, lo_shift, hi_shift, scale_log2,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    m0, bh, seed_lo, seed_hi, threshold, inv_keep, DROPOUT: tl.constexpr,
):
    """Accumulate this query block's dQ (unscaled) over the key blocks [start, end)."""
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        k = _load_rows(k_base, cols, stride_ks, offs_d, stride_kd, Sk, D, MASKED, EVEN_D)
        v = _load_rows(v_base, cols, stride_vs, offs_d, stride_vd, Sk, D, MASKED, EVEN_D)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2 - lse2[:, None])
        # Keys past Sk load as zeros but would still get P = exp(-lse), which can overflow: mask them.
        if MASKED:
            p = tl.where(cols[None, :] < Sk, p, 0.0)
            p = _apply_window(p, offs_m[:, None], cols[None, :], lo_shift, hi_shift, 0.0, HAS_LEFT, HAS_RIGHT)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:
            keep = _dropout_keep(m0, n0, bh, seed_lo, seed_hi, threshold, BLOCK_M, BLOCK_N)
            dp = tl.where(keep, dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_program(
    pid_m, pid_bh,  # this program's query block, and batch * query head
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_seqlens_q, cu_seqlens_k, stride_lb, stride_lh,
    stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd, stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dqb, stride_dqh, stride_dqs, stride_dqd, Hq, GROUP, Sq, Sk, D, scale, LEFT, RIGHT,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, seed_lo, seed_hi, threshold, inv_keep, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
):
    """dQ of one query block of one query head, over every key it sees."""
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    q_start, Sq = _seq_bounds(cu_seqlens_q, b, Sq, VARLEN)
    k_start, Sk = _seq_bounds(cu_seqlens_k, b, Sk, VARLEN)
    if pid_m * BLOCK_M >= Sq:
        return
    scale = tl.cast(scale, tl.float32)
    inv_keep = tl.cast(inv_keep, tl.float32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_m < Sq
    q = _load_rows(_head_base(q_ptr, b, h, stride_qb, stride_qh, q_start, stride_qs), offs_m, stride_qs, offs_d,
                   stride_qd, Sq, D, True, EVEN_D)
    do = _load_rows(_head_base(do_ptr, b, h, stride_dob, stride_doh, q_start, stride_dos), offs_m, stride_dos, offs_d,
                    stride_dod, Sq, D, True, EVEN_D)
    lse = tl.load(_head_base(lse_ptr, b, h, stride_lb, stride_lh, q_start, 1) + offs_m, mask=row_mask,
                  other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E
    delta = tl.load(_head_base(delta_ptr, b, h, stride_lb, stride_lh, q_start, 1) + offs_m, mask=row_mask, other=0.0)
    k_base = _head_base(k_ptr, b, hk, stride_kb, stride_kh, k_start, stride_ks)
    v_base = _head_base(v_ptr, b, hk, stride_vb, stride_vh, k_start, stride_vs)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    scale_log2 = scale * _LOG2E
    diag = Sk - Sq
    lo_shift = diag - LEFT
    hi_shift = diag + RIGHT
    start, full_lo, full_hi, end = _key_range(pid_m * BLOCK_M, Sk, lo_shift, hi_shift, HAS_LEFT, HAS_RIGHT,
                                              BLOCK_M, BLOCK_N)  # the forward's key ranges
    if HAS_LEFT:
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                start, full_lo, offs_m, offs_n, offs_d, Sk, D, lo_shift, hi_shift, scale_log2,
                                True, HAS_LEFT, HAS_RIGHT, EVEN_D, BLOCK_M, BLOCK_N, DOT_PRECISION,
                                pid_m * BLOCK_M, pid_bh, seed_lo, seed_hi, threshold, inv_keep, DROPOUT)
    dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                            full_lo, full_hi, offs_m, offs_n, offs_d, Sk, D, lo_shift, hi_shift, scale_log2,
                            False, HAS_LEFT, HAS_RIGHT, EVEN_D, BLOCK_M, BLOCK_N, DOT_PRECISION,
                            pid_m * BLOCK_M, pid_bh, seed_lo, seed_hi, threshold, inv_keep, DROPOUT)
    dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                            full_hi, end, offs_m, offs_n, offs_d, Sk, D, lo_shift, hi_shift, scale_log2,
                            True, HAS_LEFT, HAS_RIGHT, EVEN_D, BLOCK_M, BLOCK_N, DOT_PRECISION,
                            pid_m * BLOCK_M, pid_bh, seed_lo, seed_hi, threshold, inv_keep, DROPOUT)
    dq_ptrs = (_head_base(dq_ptr, b, h, stride_dqb, stride_dqh, q_start, stride_dqs)
               + offs_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd)
    tl.store(dq_ptrs, (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_d < D)[None, :])


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "seed_in_memory", "threshold"])
def _attn_bwd_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # (B, H, S, D); packed: (total, H, D)
    lse_ptr, delta_ptr,  # (B, Hq, Sq) fp32; packed: (Hq, total_q)
    dq_ptr, dk_ptr, dv_ptr,  # outputs, laid out as q, k, k
    cu_seqlens_q, cu_seqlens_k,
    stride_lb, stride_lh,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,
    stride_dkb, stride_dkh, stride_dks, stride_dkd,  # dk and dv share one layout
    Hq, Hkv, GROUP, Sq, Sk, D,
    scale,
    LEFT, RIGHT,
    seed_lo, seed_hi, seed_ptr, seed_in_memory, threshold, inv_keep,  # attention dropout, as in the forward
    kv_blocks,  # key blocks per head (of KV_BLOCK_N keys)
    kv_programs,  # kv_blocks * B * Hkv when DKDV, else 0
    q_blocks,  # query blocks per head (of Q_BLOCK_M queries)
    HAS_LEFT: tl.constexpr,  # constexprs follow every run-time argument
    HAS_RIGHT: tl.constexpr,
    DROPOUT: tl.constexpr,
    DKDV: tl.constexpr,  # the first kv_programs programs compute dK/dV
    DQ: tl.constexpr,  # the programs after them compute dQ
    KV_BLOCK_M: tl.constexpr,  # dK/dV programs: queries per step, keys per program
    KV_BLOCK_N: tl.constexpr,
    Q_BLOCK_M: tl.constexpr,  # dQ programs: queries per program, keys per step
    Q_BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    VARLEN: tl.constexpr,
):
    pid = tl.program_id(0)
    if DROPOUT:
        seed_lo, seed_hi = philox_key(seed_lo, seed_hi, seed_ptr, seed_in_memory)
    if DKDV:  # noqa: SIM102  (a compile-time branch around a run-time one)
        if pid < kv_programs:
            _attn_bwd_dkdv_program(
                pid % kv_blocks, pid // kv_blocks, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                cu_seqlens_q, cu_seqlens_k, stride_lb, stride_lh, stride_qb, stride_qh, stride_qs, stride_qd,
                stride_kb, stride_kh, stride_ks, stride_kd, stride_vb, stride_vh, stride_vs, stride_vd,
                stride_dob, stride_doh, stride_dos, stride_dod, stride_dkb, stride_dkh, stride_dks, stride_dkd,
                Hq, Hkv, GROUP, Sq, Sk, D, scale, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT,
                seed_lo, seed_hi, threshold, inv_keep, DROPOUT, KV_BLOCK_M, KV_BLOCK_N, BLOCK_D, EVEN_D, DOT_PRECISION,
                VARLEN)
            return
    if DQ:
        pid -= kv_programs
        pid_m = pid % q_blocks
        if HAS_RIGHT:
            pid_m = q_blocks - 1 - pid_m  # longest query blocks first (see the header)
        _attn_bwd_dq_program(
            pid_m, pid // q_blocks, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
            cu_seqlens_q, cu_seqlens_k, stride_lb, stride_lh, stride_qb, stride_qh, stride_qs, stride_qd,
            stride_kb, stride_kh, stride_ks, stride_kd, stride_vb, stride_vh, stride_vs, stride_vd,
            stride_dob, stride_doh, stride_dos, stride_dod, stride_dqb, stride_dqh, stride_dqs, stride_dqd,
            Hq, GROUP, Sq, Sk, D, scale, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT,
            seed_lo, seed_hi, threshold, inv_keep, DROPOUT, Q_BLOCK_M, Q_BLOCK_N, BLOCK_D, EVEN_D, DOT_PRECISION,
            VARLEN)
