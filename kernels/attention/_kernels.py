"""FlashAttention-2 in Triton: forward, and the backward as preprocess + dK/dV + dQ kernels.

Implements (read beside ``reference/attention.py``, which runs the same blocks in torch):
- ``_attn_fwd_kernel``: one program per (query block, batch * query head); K/V blocks stream through
  an online softmax in base 2 (``log2(e)`` folded into the scale); writes O and the natural-log
  log-sum-exp per row. Causal: key blocks wholly above the (bottom-right aligned) diagonal are never
  loaded; only the blocks that cross the diagonal, or the end of K, pay for a mask.
- ``_attn_bwd_preprocess_kernel``: ``delta = rowsum(dO * O)``.
- ``_attn_bwd_dkdv_kernel``: one program per (key block, batch * key/value head); loops over the query
  heads of its GQA group and the query blocks that see the key block; P is recomputed from the saved
  log-sum-exp. No atomics: deterministic.
- ``_attn_bwd_dq_kernel``: one program per (query block, batch * query head), looping over key blocks.

Limits: head dims are padded to a power of two >= 16 inside the kernel (any D works; D > 256 runs with
small blocks, correct but slow). Any strides. Dropout and sliding windows come with a later issue.

Trade-offs:
- Three backward kernels compute Q K^T twice (dK/dV and dQ) instead of accumulating dQ with atomics:
  deterministic, at the cost of two more matmuls per tile pair (7 instead of 5).
- Masks are compile-time variants of one loop (``KEY_MASK``, ``CAUSAL_MASK``, ``EVEN_D``): the interior
  tiles load without a mask, which lets the loads vectorise and the pipeliner run ahead.
- Out-of-range keys need no mask in the dK/dV kernel (their rows of dK/dV are never stored) and
  out-of-range queries none anywhere in the backward (their log-sum-exp is loaded as +inf, so P = 0).
"""

import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _head_base(ptr, b, h, stride_b, stride_h):
    """Start of head ``h`` of batch ``b`` in a (B, H, S, D) tensor (64-bit offsets)."""
    return ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def _load_rows(base, rows, stride_s, offs_d, stride_d, n_rows, D, ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """Rows ``rows`` x dims ``offs_d`` of one head; masks only what may be out of range (zeros there)."""
    ptrs = base + rows[:, None] * stride_s + offs_d[None, :] * stride_d
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
def _attn_fwd_inner(
    acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd, start, end, offs_m, offs_n, offs_d,
    Sk, D, diag, scale_log2,
    KEY_MASK: tl.constexpr, CAUSAL_MASK: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Stream key blocks [start, end) through the online softmax (base 2)."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k = _load_rows(k_base, cols, stride_ks, offs_d, stride_kd, Sk, D, KEY_MASK, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if KEY_MASK:
            s = tl.where(cols[None, :] < Sk, s, float("-inf"))
        if CAUSAL_MASK:
            s = tl.where(cols[None, :] <= offs_m[:, None] + diag, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if KEY_MASK or CAUSAL_MASK:
            # A row that has seen no key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        p = tl.math.exp2(s - m_new_safe[:, None])
        alpha = tl.math.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_rows(v_base, cols, stride_vs, offs_d, stride_vd, Sk, D, KEY_MASK, EVEN_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_fwd_kernel(
    q_ptr,  # (B, Hq, Sq, D)
    k_ptr,  # (B, Hkv, Sk, D)
    v_ptr,  # (B, Hkv, Sk, D)
    o_ptr,  # (B, Hq, Sq, D) output
    lse_ptr,  # (B, Hq, Sq) fp32 output, contiguous
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    Hq,
    GROUP,  # Hq // Hkv
    Sq,
    Sk,
    D,
    scale_log2,  # softmax_scale * log2(e)
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,  # D == BLOCK_D: no mask on the head dim
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(_head_base(q_ptr, b, h, stride_qb, stride_qh), offs_m, stride_qs, offs_d, stride_qd, Sq, D,
                   True, EVEN_D)
    k_base = _head_base(k_ptr, b, hk, stride_kb, stride_kh)
    v_base = _head_base(v_ptr, b, hk, stride_vb, stride_vh)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    diag = Sk - Sq  # query i sits at key position i + diag
    if CAUSAL:
        # Keys past the last row's diagonal are never loaded; blocks left of the first row's diagonal
        # (and inside Sk) need no mask.
        end = tl.minimum(tl.maximum((pid_m + 1) * BLOCK_M + diag, 0), Sk)
        full_end = tl.minimum(tl.maximum(pid_m * BLOCK_M + diag + 1, 0), Sk) // BLOCK_N * BLOCK_N
    else:
        end = Sk
        full_end = Sk // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attn_fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                    0, full_end, offs_m, offs_n, offs_d, Sk, D, diag, scale_log2,
                                    False, False, EVEN_D, BLOCK_N, DOT_PRECISION)
    acc, m_i, l_i = _attn_fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                    full_end, end, offs_m, offs_n, offs_d, Sk, D, diag, scale_log2,
                                    True, CAUSAL, EVEN_D, BLOCK_N, DOT_PRECISION)
    seen = l_i > 0.0
    safe_l = tl.where(seen, l_i, 1.0)
    o = tl.where(seen[:, None], acc / safe_l[:, None], 0.0)
    o_ptrs = _head_base(o_ptr, b, h, stride_ob, stride_oh) + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=(offs_m < Sq)[:, None] & (offs_d < D)[None, :])
    lse = tl.where(seen, (m_i + tl.math.log2(safe_l)) * _LN2, float("-inf"))  # to natural log
    tl.store(lse_ptr + pid_bh.to(tl.int64) * Sq + offs_m, lse, mask=offs_m < Sq)


@triton.jit
def _attn_bwd_preprocess_kernel(
    o_ptr, do_ptr,  # (B, Hq, Sq, D), any strides
    delta_ptr,  # (B, Hq, Sq) fp32 output, contiguous
    stride_ob, stride_oh, stride_os, stride_od,
    stride_dob, stride_doh, stride_dos, stride_dod,
    Hq, Sq, D,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(_head_base(o_ptr, b, h, stride_ob, stride_oh), offs_m, stride_os, offs_d, stride_od, Sq, D,
                   True, EVEN_D)
    do = _load_rows(_head_base(do_ptr, b, h, stride_dob, stride_doh), offs_m, stride_dos, offs_d, stride_dod, Sq, D,
                    True, EVEN_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + pid_bh.to(tl.int64) * Sq + offs_m, delta, mask=offs_m < Sq)


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_qd, stride_dos, stride_dod, start, end,
    offs_m, keys, offs_d, Sq, D, diag, scale_log2,
    CAUSAL_MASK: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
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
        if CAUSAL_MASK:
            pt = tl.where(keys[:, None] <= rows[None, :] + diag, pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,
    lse_ptr, delta_ptr,  # (B, Hq, Sq) fp32, contiguous
    dk_ptr, dv_ptr,  # (B, Hkv, Sk, D) outputs, contiguous
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    Hq, Hkv, GROUP, Sq, Sk, D,
    scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    n0 = pid_n * BLOCK_N
    keys = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(_head_base(k_ptr, b, hk, stride_kb, stride_kh), keys, stride_ks, offs_d, stride_kd, Sk, D,
                   True, EVEN_D)
    v = _load_rows(_head_base(v_ptr, b, hk, stride_vb, stride_vh), keys, stride_vs, offs_d, stride_vd, Sk, D,
                   True, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    scale_log2 = scale * _LOG2E
    diag = Sk - Sq
    if CAUSAL:
        # Query i sees key j iff j <= i + diag: rows before (n0 - diag) see none of this block, rows from
        # (last key - diag) on see all of it; only the query blocks in between need the mask.
        start_m = tl.maximum(n0 - diag, 0) // BLOCK_M * BLOCK_M
        full_start = tl.minimum(tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M, Sq)
        full_start = tl.maximum(full_start, start_m)
    else:
        start_m = 0
        full_start = 0
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = _head_base(q_ptr, b, h, stride_qb, stride_qh)
        do_base = _head_base(do_ptr, b, h, stride_dob, stride_doh)
        stat_base = (b * Hq + h).to(tl.int64) * Sq
        if CAUSAL:
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_ptr + stat_base, delta_ptr + stat_base,
                                          stride_qs, stride_qd, stride_dos, stride_dod, start_m, full_start,
                                          offs_m, keys, offs_d, Sq, D, diag, scale_log2,
                                          True, EVEN_D, BLOCK_M, DOT_PRECISION)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_ptr + stat_base, delta_ptr + stat_base,
                                      stride_qs, stride_qd, stride_dos, stride_dod, full_start, Sq,
                                      offs_m, keys, offs_d, Sq, D, diag, scale_log2,
                                      False, EVEN_D, BLOCK_M, DOT_PRECISION)
    out = (b * Hkv + hk).to(tl.int64) * Sk * D + keys[:, None] * D + offs_d[None, :]
    mask = (keys < Sk)[:, None] & (offs_d < D)[None, :]
    tl.store(dk_ptr + out, (dk * scale).to(dk_ptr.dtype.element_ty), mask=mask)
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd, start, end, offs_m, offs_n,
    offs_d, Sk, D, diag, scale_log2,
    KEY_MASK: tl.constexpr, CAUSAL_MASK: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate this query block's dQ (unscaled) over the key blocks [start, end)."""
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        k = _load_rows(k_base, cols, stride_ks, offs_d, stride_kd, Sk, D, KEY_MASK, EVEN_D)
        v = _load_rows(v_base, cols, stride_vs, offs_d, stride_vd, Sk, D, KEY_MASK, EVEN_D)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2 - lse2[:, None])
        # Keys past Sk load as zeros but would still get P = exp(-lse), which can overflow: mask them.
        if KEY_MASK:
            p = tl.where(cols[None, :] < Sk, p, 0.0)
        if CAUSAL_MASK:
            p = tl.where(cols[None, :] <= offs_m[:, None] + diag, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,
    lse_ptr, delta_ptr,
    dq_ptr,  # (B, Hq, Sq, D) output, contiguous
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    Hq, GROUP, Sq, Sk, D,
    scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_m < Sq
    q = _load_rows(_head_base(q_ptr, b, h, stride_qb, stride_qh), offs_m, stride_qs, offs_d, stride_qd, Sq, D,
                   True, EVEN_D)
    do = _load_rows(_head_base(do_ptr, b, h, stride_dob, stride_doh), offs_m, stride_dos, offs_d, stride_dod, Sq, D,
                    True, EVEN_D)
    lse = tl.load(lse_ptr + pid_bh.to(tl.int64) * Sq + offs_m, mask=row_mask, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E
    delta = tl.load(delta_ptr + pid_bh.to(tl.int64) * Sq + offs_m, mask=row_mask, other=0.0)
    k_base = _head_base(k_ptr, b, hk, stride_kb, stride_kh)
    v_base = _head_base(v_ptr, b, hk, stride_vb, stride_vh)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    scale_log2 = scale * _LOG2E
    diag = Sk - Sq
    if CAUSAL:  # the forward's key ranges
        end = tl.minimum(tl.maximum((pid_m + 1) * BLOCK_M + diag, 0), Sk)
        full_end = tl.minimum(tl.maximum(pid_m * BLOCK_M + diag + 1, 0), Sk) // BLOCK_N * BLOCK_N
    else:
        end = Sk
        full_end = Sk // BLOCK_N * BLOCK_N
    dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                            0, full_end, offs_m, offs_n, offs_d, Sk, D, diag, scale_log2,
                            False, False, EVEN_D, BLOCK_N, DOT_PRECISION)
    dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                            full_end, end, offs_m, offs_n, offs_d, Sk, D, diag, scale_log2,
                            True, CAUSAL, EVEN_D, BLOCK_N, DOT_PRECISION)
    out = pid_bh.to(tl.int64) * Sq * D + offs_m[:, None] * D + offs_d[None, :]
    tl.store(dq_ptr + out, (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_d < D)[None, :])
