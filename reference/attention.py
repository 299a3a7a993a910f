"""Pure-PyTorch twins of the attention kernels: naive attention, and FlashAttention-2's tiled forward and
backward written out in torch, block by block, as the kernels will run them.

Shapes: ``q (B, Hq, Sq, D)``, ``k, v (B, Hkv, Sk, D)`` with ``Hq % Hkv == 0`` (GQA/MQA: query head ``h``
reads key/value head ``h // (Hq // Hkv)``). Computation in float32, or float64 for float64 inputs.

**Masks.** Query ``i`` and key ``j`` are aligned bottom-right: ``i`` is treated as position
``i + Sk - Sq``. ``causal`` keeps ``j <= i + Sk - Sq``; ``window_size = (left, right)`` keeps
``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (-1: unbounded on that side). A query row that sees
no key gets output 0 and log-sum-exp ``-inf``.

**Online softmax (the FA2 forward).** For a query block, stream key blocks ``K_j, V_j``, keeping per row
a running max ``m``, a running sum ``l`` and an unnormalised accumulator ``acc``:

    s = Q K_jᵀ · scale;  m' = max(m, rowmax(s));  p = exp(s - m')
    l = exp(m - m')·l + rowsum(p);  acc = exp(m - m')·acc + p V_j;  m = m'

and at the end ``o = acc / l``, ``lse = m + log(l)``. Every block's contribution is rescaled by the
same ``exp(m_old - m_new)`` factor, so the result equals ``softmax(s) V`` exactly in real arithmetic, with
O(block) memory instead of O(Sq·Sk). The kernel does the same in base 2 (``exp2``, with ``log2(e)``
folded into the scale); the twin stays in base e for readability.

**Backward.** With ``P = exp(S·scale - lse)`` recomputed from the saved log-sum-exp and
``delta = rowsum(dO ∘ O)``: ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P ∘ (dP - delta)``,
``dQ = dS K · scale``, ``dK = dSᵀ Q · scale``. (``rowsum(P ∘ dP) = rowsum(dO ∘ O)`` is what lets delta
be computed once, from O.) dK/dV are accumulated per key block over query blocks and dQ per query
block over key blocks, so no two blocks write the same output (deterministic); GQA sums dK/dV over the
query heads of a group.

**Dropout on the probabilities.** With ``dropout_p > 0`` the normalised probabilities are dropped and
rescaled, ``Pd = P ∘ Z / (1 - p)`` (``p`` rounded as below), and ``O = Pd V``; the log-sum-exp is that of
the undropped scores. The keep mask ``Z`` comes from the dropout family's Philox4x32-10
(``reference.dropout.philox4x32``) with 8-bit keep decisions, sixteen per call. Query ``i`` and key ``j``
(of query head ``h`` in batch ``b``) take byte ``2 * ((i div 8) mod 2) + j mod 2`` (the lowest byte is 0)
of word ``(j mod 32) div 8`` of the call with counter ``(4 * (j div 32) + (j mod 8) div 2,
8 * (i div 16) + i mod 8, b * Hq + h, ATTENTION_COUNTER_TAG)`` and the 64-bit seed as key, and the
probability is kept iff that byte is ``>= attention_keep_threshold(p) = min(round(p * 256), 255)``. So
``p`` is rounded to a multiple of 1/256 (off by at most 0.002; FlashAttention-2 does the same), and kept
probabilities are scaled by the inverse of the kept fraction, ``attention_keep_scale(p) = 256 / (256 -
threshold)``, which keeps ``E[Pd] = P`` exact. One call decides queries ``{i, i + 8}`` x keys
``{2t, 2t + 1} + 8w`` (``w < 4``) of a 16 x 32 patch: the elements that one thread holds of an NVIDIA
tensor-core accumulator tile, so the kernel draws each of them once and exchanges nothing between threads.
The tag keeps these counters apart from the element-wise dropout's, whose last two words are 0. The
backward regenerates ``Z``: ``dV = Pdᵀ dO``, ``dP = (dO Vᵀ) ∘ Z / (1 - p)``, ``dS = P ∘ (dP - delta)``;
``delta = rowsum(dO ∘ O)`` still equals ``rowsum(P ∘ dP)``.

Dependency rule: this file imports torch and ``reference.dropout`` only.
"""

from __future__ import annotations

import math

import torch

from reference.dropout import philox4x32

#: Fourth Philox counter word of every attention-dropout draw ("ATT8": 8-bit decisions), shared with the kernel.
ATTENTION_COUNTER_TAG = 0x41545438
_MASK32 = 0xFFFFFFFF
#: Keep decisions are 8-bit: sixteen per Philox call.
KEEP_BITS = 8


def attention_keep_threshold(p: float) -> int:
    """Keep a probability iff its 8-bit draw is >= this: ``round(p * 256)``, capped at 255."""
    return min(round(p * 2**KEEP_BITS), 2**KEEP_BITS - 1)


def attention_keep_scale(p: float) -> float:
    """The factor of a kept probability: the inverse of the kept fraction ``1 - threshold / 256`` (1 when
    ``p`` rounds to 0)."""
    return 2**KEEP_BITS / (2**KEEP_BITS - attention_keep_threshold(p))


def attention_keep_mask(b: int, hq: int, sq: int, sk: int, p: float, seed: int, *, device=None,
                        batch_offset: int = 0) -> torch.Tensor:
    """Boolean (B, Hq, Sq, Sk): which attention probabilities survive dropout ``p`` with ``seed``.
    ``batch_offset``: the index of the first sequence (packed batches draw sequence ``b``'s mask at ``b``)."""
    j = torch.arange(sk, dtype=torch.int64, device=device)
    i = torch.arange(sq, dtype=torch.int64, device=device)
    bh = torch.arange(batch_offset * hq, (batch_offset + b) * hq, dtype=torch.int64, device=device)
    shape = (b * hq, sq, sk)
    counter = (
        (4 * (j // 32) + j % 8 // 2).expand(shape),
        (8 * (i // 16) + i % 8)[:, None].expand(shape),
        bh[:, None, None].expand(shape),
        torch.full(shape, ATTENTION_COUNTER_TAG, dtype=torch.int64, device=device),
    )
    seed &= (1 << 64) - 1
    words = torch.stack(philox4x32(counter, (seed & _MASK32, seed >> 32)))
    word = words.gather(0, (j % 32 // 8).expand(shape).unsqueeze(0)).squeeze(0)
    byte = 2 * (i[:, None] // 8 % 2) + j % 2
    decision = (word >> (KEEP_BITS * byte)) & (2**KEEP_BITS - 1)
    return (decision >= attention_keep_threshold(p)).reshape(b, hq, sq, sk)


def _check_dropout(dropout_p: float, seed) -> None:
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0.0 and seed is None:
        raise ValueError("the twin needs an explicit integer seed when dropout_p > 0")


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_shapes(q, k, v) -> tuple[int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, H, S, D); got {q.dim()}, {k.dim()}, {v.dim()} dims")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head dim")
    if k.shape[1] == 0:  # no heads at all: an empty result
        if q.shape[1] != 0:
            raise ValueError(f"Hq ({q.shape[1]}) must be a multiple of Hkv (0)")
        return 1, q.shape[3]
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"Hq ({q.shape[1]}) must be a multiple of Hkv ({k.shape[1]})")
    return q.shape[1] // k.shape[1], q.shape[3]


def _expand_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, Hkv * group, S, D): each key/value head serves ``group`` query heads."""
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def visible(sq: int, sk: int, *, causal: bool, window_size=(-1, -1), device=None) -> torch.Tensor:
    """Boolean (Sq, Sk): which keys each query sees (bottom-right aligned causal mask and window)."""
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    left, right = window_size
    if causal:
        keep &= j <= i
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    return keep


def _prepare(q, k, v, *, causal, softmax_scale, window_size, dropout_p, seed, batch_offset):
    """What every twin starts from: the checks, the scale, q and the GQA-expanded k/v in the compute
    dtype, the (Sq, Sk) visibility mask and the (B, Hq, Sq, Sk) dropout keep mask (None without dropout)."""
    _check_dropout(dropout_p, seed)
    group, d = _check_shapes(q, k, v)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    ct = _compute_dtype(q)
    b, hq, sq, _ = q.shape
    sk = k.shape[2]
    keep = visible(sq, sk, causal=causal, window_size=window_size, device=q.device)
    kept = (attention_keep_mask(b, hq, sq, sk, dropout_p, seed, device=q.device, batch_offset=batch_offset)
            if dropout_p > 0 else None)
    return scale, ct, q.to(ct), _expand_kv(k, group).to(ct), _expand_kv(v, group).to(ct), keep, kept


def attention(q, k, v, *, causal=False, softmax_scale=None, dropout_p=0.0, seed=None, window_size=(-1, -1),
              batch_offset: int = 0):
    """Naive ``softmax(Q Kᵀ · scale) V`` with the kernel's masks and dropout; materialises the (Sq, Sk)
    scores."""
    scale, _, qf, kf, vf, keep, kept = _prepare(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                                window_size=window_size, dropout_p=dropout_p, seed=seed,
                                                batch_offset=batch_offset)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    sees_some = keep.any(dim=-1, keepdim=True)
    # A row that sees no key gets finite dummy scores, then weight 0: output 0 and gradient 0, not NaN.
    s = torch.where(sees_some, s.masked_fill(~keep, float("-inf")), 0.0)
    p = torch.softmax(s, dim=-1) * sees_some
    if kept is not None:
        p = torch.where(kept, p * attention_keep_scale(dropout_p), 0.0)
    return torch.matmul(p, vf).to(q.dtype)


def flash_attention_forward(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), dropout_p=0.0,
                            seed=None, batch_offset: int = 0, block_m: int = 64, block_n: int = 64):
    """FA2 forward, tiled as the kernel runs it: returns ``(o, lse)``; ``lse`` is the natural-log
    log-sum-exp per row, (B, Hq, Sq), float32 (float64 for float64 inputs)."""
    scale, ct, qf, kf, vf, keep, kept = _prepare(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                                 window_size=window_size, dropout_p=dropout_p, seed=seed,
                                                 batch_offset=batch_offset)
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    o = torch.zeros(b, hq, sq, d, dtype=ct, device=q.device)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=ct, device=q.device)
    for m0 in range(0, sq, block_m):
        rows = slice(m0, min(m0 + block_m, sq))
        q_blk = qf[:, :, rows]
        m = torch.full(q_blk.shape[:-1], float("-inf"), dtype=ct, device=q.device)
        row_sum = torch.zeros_like(m)
        acc = torch.zeros_like(q_blk)
        for n0 in range(0, sk, block_n):
            cols = slice(n0, min(n0 + block_n, sk))
            block_keep = keep[rows, cols]
            if not block_keep.any():  # the kernel skips such blocks (above the diagonal, outside the window)
                continue
            s = torch.matmul(q_blk, kf[:, :, cols].transpose(-1, -2)) * scale
            s = s.masked_fill(~block_keep, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row that has seen nothing yet keeps m = -inf; subtract 0 instead so exp() stays finite. (A score of
            # +inf stays: exp(inf - inf) is NaN, as in the kernel and torch's softmax.)
            m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            row_sum = alpha * row_sum + p.sum(dim=-1)  # the normaliser counts dropped entries too
            if kept is not None:
                p = torch.where(kept[:, :, rows, cols], p * attention_keep_scale(dropout_p), 0.0)
            acc = alpha[..., None] * acc + torch.matmul(p, vf[:, :, cols])
            m = m_new
        seen = row_sum != 0  # NaN counts as seen: a NaN score makes its row NaN, as in the kernel and torch
        safe_sum = torch.where(seen, row_sum, 1.0)
        o[:, :, rows] = torch.where(seen[..., None], acc / safe_sum[..., None], 0.0)
        lse[:, :, rows] = torch.where(seen, m + torch.log(safe_sum), float("-inf"))
    return o.to(q.dtype), lse


def flash_attention_backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                             dropout_p=0.0, seed=None, batch_offset: int = 0, block_m: int = 64, block_n: int = 64):
    """FA2 backward, tiled as the kernel runs it: returns ``(dq, dk, dv)`` in the inputs' dtypes."""
    scale, ct, qf, kf, vf, keep, kept = _prepare(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                                 window_size=window_size, dropout_p=dropout_p, seed=seed,
                                                 batch_offset=batch_offset)
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    group = hq // k.shape[1] if k.shape[1] else 1
    dof, of = do.to(ct), o.to(ct)
    lse_f = lse.to(ct)
    delta = (dof * of).sum(dim=-1)  # (B, Hq, Sq): the preprocess kernel

    def p_and_ds(rows, cols):
        """The dropped probabilities Pd (P itself without dropout), recomputed from the saved log-sum-exp,
        and dS = P * (dP - delta) with dP = (dO V^T) * Z / (1 - p), for one tile."""
        s = torch.matmul(qf[:, :, rows], kf[:, :, cols].transpose(-1, -2)) * scale
        lse_rows = lse_f[:, :, rows, None]
        p = torch.exp(s - torch.where(torch.isinf(lse_rows), 0.0, lse_rows))
        p = p.masked_fill(~keep[rows, cols], 0.0)
        dp = torch.matmul(dof[:, :, rows], vf[:, :, cols].transpose(-1, -2))
        if kept is None:
            return p, p * (dp - delta[:, :, rows, None])
        z = kept[:, :, rows, cols]
        inv_keep = attention_keep_scale(dropout_p)
        pd = torch.where(z, p * inv_keep, 0.0)
        dp = torch.where(z, dp * inv_keep, 0.0)
        return pd, p * (dp - delta[:, :, rows, None])

    def tiles(outer_len, inner_len, outer_block, inner_block):
        for o0 in range(0, outer_len, outer_block):
            for i0 in range(0, inner_len, inner_block):
                yield slice(o0, min(o0 + outer_block, outer_len)), slice(i0, min(i0 + inner_block, inner_len))

    dk_full = torch.zeros(b, hq, sk, d, dtype=ct, device=q.device)
    dv_full = torch.zeros_like(dk_full)
    for cols, rows in tiles(sk, sq, block_n, block_m):  # a key block owns its rows of dK and dV
        if keep[rows, cols].any():
            p, ds = p_and_ds(rows, cols)
            dv_full[:, :, cols] += torch.matmul(p.transpose(-1, -2), dof[:, :, rows])
            dk_full[:, :, cols] += torch.matmul(ds.transpose(-1, -2), qf[:, :, rows]) * scale
    dq = torch.zeros_like(qf)
    for rows, cols in tiles(sq, sk, block_m, block_n):  # a query block owns its rows of dQ
        if keep[rows, cols].any():
            _, ds = p_and_ds(rows, cols)
            dq[:, :, rows] += torch.matmul(ds, kf[:, :, cols]) * scale
    hkv = k.shape[1]
    dk = dk_full.reshape(b, hkv, group, sk, d).sum(dim=2)  # GQA: sum over the group's query heads
    dv = dv_full.reshape(b, hkv, group, sk, d).sum(dim=2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --- packed variable-length batches --------------------------------------------------------------------


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """``(b, query rows, key rows)`` of each packed sequence."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length, got {len(cq)} and {len(ck)}")
    for b in range(len(cq) - 1):
        yield b, slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])


def _as_batch(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).unsqueeze(0)  # (S, H, D) -> (1, H, S, D)


def _as_packed(t: torch.Tensor) -> torch.Tensor:
    return t.squeeze(0).transpose(0, 1)  # (1, H, S, D) -> (S, H, D)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs):
    """Packed ``(total, H, D)`` sequences, each attended alone with :func:`attention` (sequence ``b`` draws
    its dropout mask as batch row ``b``)."""
    out = torch.zeros_like(q)
    for b, rq, rk in _sequences(cu_seqlens_q, cu_seqlens_k):
        out[rq] = _as_packed(attention(_as_batch(q[rq]), _as_batch(k[rk]), _as_batch(v[rk]), batch_offset=b, **kwargs))
    return out


def flash_attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs):
    """Packed FA2 forward: ``(o, lse)`` with o ``(total_q, Hq, D)`` and lse ``(Hq, total_q)``."""
    o = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=_compute_dtype(q), device=q.device)
    for b, rq, rk in _sequences(cu_seqlens_q, cu_seqlens_k):
        ob, lb = flash_attention_forward(_as_batch(q[rq]), _as_batch(k[rk]), _as_batch(v[rk]), batch_offset=b,
                                         **kwargs)
        o[rq], lse[:, rq] = _as_packed(ob), lb[0]
    return o, lse


def flash_attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, **kwargs):
    """Packed FA2 backward: ``(dq, dk, dv)`` laid out as q, k, v."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for b, rq, rk in _sequences(cu_seqlens_q, cu_seqlens_k):
        grads = flash_attention_backward(_as_batch(do[rq]), _as_batch(q[rq]), _as_batch(k[rk]), _as_batch(v[rk]),
                                         _as_batch(o[rq]), lse[:, rq].unsqueeze(0), batch_offset=b, **kwargs)
        dq[rq], dk[rk], dv[rk] = (_as_packed(g) for g in grads)
    return dq, dk, dv


# --- inference: a KV cache, contiguous or paged ---------------------------------------------------------


def _cache_rows(cache: torch.Tensor, b: int, block_table, length: int) -> torch.Tensor:
    """Sequence ``b``'s first ``length`` cache positions as (Hkv, length, D): a slice of a contiguous cache
    (B, Hkv, S_max, D), or the pages ``block_table[b, 0], block_table[b, 1], ...`` of a paged one
    (num_blocks, Hkv, block_size, D), position ``t`` in page ``t // block_size`` at row ``t % block_size``."""
    if block_table is None:
        return cache[b, :, :length]
    block_size = cache.shape[2]
    pages = block_table[b, : -(-length // block_size)].tolist()
    return torch.cat([cache[p] for p in pages], dim=1)[:, :length] if pages else cache[0, :, :0]


def _write_cache(cache: torch.Tensor, b: int, block_table, start: int, new: torch.Tensor) -> None:
    """Write ``new`` (Hkv, S_new, D) into sequence ``b``'s cache at positions ``start ...``, in place."""
    for t in range(new.shape[1]):
        pos = start + t
        if block_table is None:
            cache[b, :, pos] = new[:, t]
        else:
            block_size = cache.shape[2]
            cache[int(block_table[b, pos // block_size]), :, pos % block_size] = new[:, t]


#: the largest finite float8_e4m3fn value: quantised K/V saturate here (the format has no infinity)
FP8_MAX = 448.0


def kv_scales(scale, heads: int, device) -> torch.Tensor:
    """An FP8 cache's dequantisation scale as an fp32 tensor (Hkv,): from a Python float, an fp32 tensor of shape ()
    (one scale for every head) or (Hkv,) (one per head)."""
    if isinstance(scale, torch.Tensor):
        return scale.to(device=device, dtype=torch.float32).expand(heads)
    return torch.full((heads,), float(scale), dtype=torch.float32, device=device)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` rounded to the nearest float8_e4m3fn (ties to even), saturating at +-448: what an FP8 cache
    stores for ``x``, which it reads back as ``stored * scale``. ``scale`` broadcasts against ``x``."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, block_table=None, causal=True,
                           softmax_scale=None, window_size=(-1, -1), return_lse=False, k_scale=None, v_scale=None):
    """Attention of new queries against a KV cache (forward only), written the plain way: append, gather,
    attend.

    ``q`` (B, Hq, Sq, D). ``k_cache``/``v_cache``: contiguous (B, Hkv, S_max, D), or paged (num_blocks, Hkv,
    block_size, D) with ``block_table`` (B, max_blocks) int32. ``cache_seqlens`` (B,) int32: tokens already
    in each sequence's cache. ``k``/``v`` (B, Hkv, Sq_new, D), when given, are written into the cache at
    positions ``cache_seqlens[b] ...`` in place (the caller advances ``cache_seqlens``). Then sequence ``b``'s
    queries attend to its ``cache_seqlens[b] + Sq_new`` keys with :func:`attention`'s masks: queries align
    bottom-right, so with ``causal`` query ``i`` of ``Sq`` sees keys up to ``i + L - Sq`` where ``L`` is that
    sequence's key count. A sequence with no key gets zeros. ``return_lse`` adds the natural-log log-sum-exp of
    each query's visible scores, (B, Hq, Sq) in the compute dtype (-inf where no key is visible).

    An FP8 cache (float8_e4m3fn) holds ``K / k_scale`` and ``V / v_scale`` (:func:`quantize_fp8`; the scales a float
    or an fp32 tensor of shape () or (Hkv,), :func:`kv_scales`): new tokens are quantised on the way in, and the
    attention reads ``stored * scale``."""
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    heads = k_cache.shape[1]
    ks, vs = ((kv_scales(k_scale, heads, q.device)[:, None, None], kv_scales(v_scale, heads, q.device)[:, None, None])
              if fp8 else (None, None))
    new = 0 if k is None else k.shape[2]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=_compute_dtype(q), device=q.device)
    for b in range(q.shape[0]):
        start = int(cache_seqlens[b])
        if k is not None:
            _write_cache(k_cache, b, block_table, start, quantize_fp8(k[b], ks) if fp8 else k[b])
            _write_cache(v_cache, b, block_table, start, quantize_fp8(v[b], vs) if fp8 else v[b])
        length = start + new
        keys = _cache_rows(k_cache, b, block_table, length)[None]
        values = _cache_rows(v_cache, b, block_table, length)[None]
        if fp8:
            keys, values = keys.float() * ks, values.float() * vs
        out[b] = attention(q[b:b + 1], keys, values, causal=causal, softmax_scale=softmax_scale,
                           window_size=window_size)[0]
        if return_lse:
            scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
            group = q.shape[1] // max(keys.shape[1], 1)
            scores = torch.matmul(q[b].to(lse.dtype), _expand_kv(keys, group)[0].to(lse.dtype).transpose(-1, -2))
            seen = visible(q.shape[2], length, causal=causal, window_size=window_size, device=q.device)
            lse[b] = torch.logsumexp((scores * scale).masked_fill(~seen, float("-inf")), dim=-1)
    return (out, lse) if return_lse else out


def merge_partial(out: torch.Tensor, lse: torch.Tensor, row0: int, part: torch.Tensor,
                  part_lse: torch.Tensor) -> None:
    """Merge a partial attention result into a running one, in place (``kernels/attention/_merge.py``): rows
    ``row0 ..`` of ``out`` (B, H, S, D) and ``lse`` (B, H, S) have attended to one set of keys, ``part`` (B, H, rows,
    D) and ``part_lse`` to a disjoint one; afterwards they hold attention over both,
    ``lse = log(exp(lse) + exp(part_lse))`` and ``out = exp(lse_old - lse) out + exp(part_lse - lse) part``. A row
    that has seen no key on either side keeps output 0 and ``-inf``. Context-parallel attention merges its ring
    steps so."""
    rows = slice(row0, row0 + part.shape[2])
    old = lse[:, :, rows]
    new = torch.logaddexp(old, part_lse)
    seen = torch.isfinite(new)
    keep_old = torch.where(seen, torch.exp(old - new), 0.0)
    take_part = torch.where(seen, torch.exp(part_lse - new), 0.0)
    merged = out[:, :, rows].float() * keep_old[..., None] + part.float() * take_part[..., None]
    out[:, :, rows] = merged.to(out.dtype)
    lse[:, :, rows] = new


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (B, H, S, D) by the cosine and sine tables ``cos``, ``sin`` (B or 1, S, D)
    of each token's position: with ``x = (x1, x2)`` split at ``D / 2`` and the tables split the same way,
    ``(x1 c1 - x2 s1, x2 c2 + x1 s2)``, which is transformers' ``x * cos + rotate_half(x) * sin``. Computed in
    float32 (float64 for float64 inputs), rounded once to x's dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    x1, x2 = x.to(compute).chunk(2, dim=-1)
    c1, c2 = cos.to(compute)[:, None].chunk(2, dim=-1)
    s1, s2 = sin.to(compute)[:, None].chunk(2, dim=-1)
    return torch.cat([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], dim=-1).to(x.dtype)
