"""FlashAttention-2 in Triton: forward, and the backward as preprocess + dK/dV + dQ kernels.

Implements (read beside ``reference/attention.py``, which runs the same blocks in torch):
- ``_attn_fwd_kernel``: one program per (query block, batch * query head); K/V blocks stream through
  an online softmax in base 2 (``log2(e)`` folded into the scale); writes O and the natural-log
  log-sum-exp per row. Causal: key blocks wholly above the (bottom-right aligned) diagonal are never
  loaded, and only the blocks that cross it, or the end of K, pay for a mask (``MASKED`` pass).
- ``_attn_bwd_preprocess_kernel``: ``delta = rowsum(dO * O)``.
- ``_attn_bwd_dkdv_kernel``: one program per (key block, batch * key/value head); loops over the query
  heads of its GQA group and the query blocks that see the key block; P is recomputed from the saved
  log-sum-exp. No atomics: deterministic.
- ``_attn_bwd_dq_kernel``: one program per (query block, batch * query head), looping over key blocks.

Limits: head dims are padded to a power of two >= 16 inside the kernel (any D works; D > 256 runs with
small blocks, correct but slow). Any strides. Dropout and sliding windows come with a later issue.
Trade-off: three backward kernels recompute Q K^T twice (dK/dV and dQ) instead of accumulating dQ with
atomics: deterministic, at the cost of one more pass of matmuls.
"""

import triton
import triton.language as tl


@triton.jit
def _load_tile(ptr, b, h, stride_b, stride_h, rows, stride_s, offs_d, stride_d, mask):
    """Rows ``rows`` x dims ``offs_d`` of head ``h`` in batch ``b`` of a (B, H, S, D) tensor (64-bit offsets)."""
    base = ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    return tl.load(base + rows[:, None] * stride_s + offs_d[None, :] * stride_d, mask=mask, other=0.0)


@triton.jit
def _attn_fwd_block(
    acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, start, end, offs_m, offs_n, Sk, diag,
    scale_log2, CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    d_mask,
):
    """Stream key blocks [start, end) through the online softmax (base 2)."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            kt = tl.load(k_ptrs + start_n * stride_ks, mask=(cols[None, :] < Sk) & d_mask[:, None], other=0.0)
        else:
            kt = tl.load(k_ptrs + start_n * stride_ks, mask=d_mask[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale_log2
        if MASKED:
            visible = cols[None, :] < Sk
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + diag)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows that have seen no key yet keep m = -inf; subtract 0 so exp2 stays finite (gives 0).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MASKED:
            v = tl.load(v_ptrs + start_n * stride_vs, mask=(cols[:, None] < Sk) & d_mask[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs + start_n * stride_vs, mask=d_mask[None, :], other=0.0)
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
    d_mask = offs_d < D
    row_mask = offs_m < Sq
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    q = _load_tile(q_ptr, b, h, stride_qb, stride_qh, offs_m, stride_qs, offs_d, stride_qd,
                   row_mask[:, None] & d_mask[None, :])
    k_ptrs = k_base + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd  # K^T tile (BLOCK_D, BLOCK_N)
    v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    diag = Sk - Sq  # query i sits at key position i + diag
    if CAUSAL:
        # Keys past the last row's diagonal are never loaded; blocks entirely left of the first row's
        # diagonal (and inside Sk) need no mask.
        end = tl.minimum(tl.maximum((pid_m + 1) * BLOCK_M + diag, 0), Sk)
        full_end = tl.minimum(tl.maximum(pid_m * BLOCK_M + diag + 1, 0), Sk) // BLOCK_N * BLOCK_N
    else:
        end = Sk
        full_end = Sk // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attn_fwd_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, 0, full_end, offs_m,
                                    offs_n, Sk, diag, scale_log2, CAUSAL, False, BLOCK_N, DOT_PRECISION, d_mask)
    acc, m_i, l_i = _attn_fwd_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, full_end, end, offs_m,
                                    offs_n, Sk, diag, scale_log2, CAUSAL, True, BLOCK_N, DOT_PRECISION, d_mask)
    seen = l_i > 0.0
    safe_l = tl.where(seen, l_i, 1.0)
    o = tl.where(seen[:, None], acc / safe_l[:, None], 0.0)
    o_base = o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od, o.to(o_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])
    lse = tl.where(seen, (m_i + tl.math.log2(safe_l)) * 0.6931471805599453, float("-inf"))  # to natural log
    tl.store(lse_ptr + pid_bh.to(tl.int64) * Sq + offs_m, lse, mask=row_mask)


@triton.jit
def _attn_bwd_preprocess_kernel(
    o_ptr, do_ptr,  # (B, Hq, Sq, D), any strides
    delta_ptr,  # (B, Hq, Sq) fp32 output, contiguous
    stride_ob, stride_oh, stride_os, stride_od,
    stride_dob, stride_doh, stride_dos, stride_dod,
    Hq, Sq, D,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < Sq)[:, None] & (offs_d < D)[None, :]
    o = _load_tile(o_ptr, b, h, stride_ob, stride_oh, offs_m, stride_os, offs_d, stride_od, mask).to(tl.float32)
    do = _load_tile(do_ptr, b, h, stride_dob, stride_doh, offs_m, stride_dos, offs_d, stride_dod, mask).to(tl.float32)
    tl.store(delta_ptr + pid_bh.to(tl.int64) * Sq + offs_m, tl.sum(o * do, axis=1), mask=offs_m < Sq)


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
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    log2e = 1.4426950408889634
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    key_mask = offs_n < Sk
    kv_mask = key_mask[:, None] & d_mask[None, :]
    k = _load_tile(k_ptr, b, hk, stride_kb, stride_kh, offs_n, stride_ks, offs_d, stride_kd, kv_mask)
    v = _load_tile(v_ptr, b, hk, stride_vb, stride_vh, offs_n, stride_vs, offs_d, stride_vd, kv_mask)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    diag = Sk - Sq
    # Causal: query i sees key j iff j <= i + diag, so rows before (first key - diag) see none of this block.
    start_m = 0
    if CAUSAL:
        start_m = tl.maximum(pid_n * BLOCK_N - diag, 0) // BLOCK_M * BLOCK_M
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        do_base = do_ptr + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
        stat_base = (b * Hq + h).to(tl.int64) * Sq
        for m0 in range(start_m, Sq, BLOCK_M):
            rows = m0 + offs_m
            row_mask = rows < Sq
            q = tl.load(q_base + rows[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                        mask=row_mask[:, None] & d_mask[None, :], other=0.0)
            do = tl.load(do_base + rows[:, None] * stride_dos + offs_d[None, :] * stride_dod,
                         mask=row_mask[:, None] & d_mask[None, :], other=0.0)
            lse = tl.load(lse_ptr + stat_base + rows, mask=row_mask, other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse)  # rows that saw no key: P = 0
            delta = tl.load(delta_ptr + stat_base + rows, mask=row_mask, other=0.0)
            # Transposed scores: (BLOCK_N keys, BLOCK_M queries)
            st = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * (scale * log2e)
            pt = tl.math.exp2(st - lse[None, :] * log2e)
            visible = key_mask[:, None] & row_mask[None, :]
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= rows[None, :] + diag)
            pt = tl.where(visible, pt, 0.0)
            dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PRECISION)
            dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PRECISION)
    out = b.to(tl.int64) * Hkv * Sk * D + hk.to(tl.int64) * Sk * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(dk_ptr + out, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


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
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    log2e = 1.4426950408889634
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    row_mask = offs_m < Sq
    qd_mask = row_mask[:, None] & d_mask[None, :]
    q = _load_tile(q_ptr, b, h, stride_qb, stride_qh, offs_m, stride_qs, offs_d, stride_qd, qd_mask)
    do = _load_tile(do_ptr, b, h, stride_dob, stride_doh, offs_m, stride_dos, offs_d, stride_dod, qd_mask)
    lse = tl.load(lse_ptr + pid_bh.to(tl.int64) * Sq + offs_m, mask=row_mask, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(delta_ptr + pid_bh.to(tl.int64) * Sq + offs_m, mask=row_mask, other=0.0)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    diag = Sk - Sq
    end = Sk
    if CAUSAL:
        end = tl.minimum(tl.maximum((pid_m + 1) * BLOCK_M + diag, 0), Sk)
    for n0 in range(0, end, BLOCK_N):
        cols = n0 + offs_n
        kv_mask = (cols < Sk)[:, None] & d_mask[None, :]
        k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (scale * log2e)
        p = tl.math.exp2(s - lse[:, None] * log2e)
        visible = row_mask[:, None] & (cols < Sk)[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None] + diag)
        p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    out = pid_bh.to(tl.int64) * Sq * D + offs_m[:, None] * D + offs_d[None, :]
    tl.store(dq_ptr + out, (dq * scale).to(dq_ptr.dtype.element_ty), mask=qd_mask)
