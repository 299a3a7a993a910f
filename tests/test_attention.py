"""Attention: the pure-PyTorch twins (naive attention and the FA2 tiled forward/backward) against each
other and against torch in float64, and the Triton kernels against both.

Kernel accuracy rule: error against float64 at most 2x the error of torch computing the same attention
in the input's dtype, plus a small atol (tests/_numerics.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import reference.attention as twin
from kernels._mode import DEVICE, FLOAT_DTYPES, INTERPRETER, by_mode
from kernels.attention import configs, flash_attention, flash_attention_varlen
from tests._caches import paged_cache
from tests._numerics import assert_no_worse_than_torch

F64 = torch.float64

CASES = [  # (B, Hq, Hkv, Sq, Sk, D)
    (1, 1, 1, 1, 1, 16),
    (2, 4, 4, 17, 17, 16),
    (1, 4, 1, 128, 128, 40),
    (2, 4, 2, 200, 130, 16),
    (1, 2, 2, 33, 100, 8),
]


def _qkv(b, hq, hkv, sq, sk, d, dtype=F64):
    g = torch.Generator().manual_seed(b * 1000 + sq * 10 + sk)
    q = torch.randn(b, hq, sq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, sk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, sk, d, generator=g, dtype=dtype)
    return q, k, v


def _masked_reference(q, k, v, keep, scale):
    """softmax over the visible keys, written independently of the twin (GQA by explicit head map)."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for h in range(q.shape[1]):
        kh, vh = k[:, h // group], v[:, h // group]
        s = q[:, h] @ kh.transpose(-1, -2) * scale
        for i in range(q.shape[2]):
            cols = keep[i].nonzero().flatten()
            if cols.numel():
                out[:, h, i] = torch.einsum("bn,bnd->bd", torch.softmax(s[:, i, cols], dim=-1), vh[:, cols])
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_naive_twin_matches_an_independent_reference(case, causal):
    q, k, v = _qkv(*case)
    keep = twin.visible(q.shape[2], k.shape[2], causal=causal)
    expected = _masked_reference(q, k, v, keep, 1 / math.sqrt(q.shape[-1]))
    torch.testing.assert_close(twin.attention(q, k, v, causal=causal), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_naive_twin_matches_sdpa_when_alignments_agree(causal):
    q, k, v = _qkv(2, 4, 4, 50, 50, 16)  # Sq == Sk: torch's top-left causal equals our bottom-right
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(twin.attention(q, k, v, causal=causal), expected, rtol=1e-10, atol=1e-10)


def test_bottom_right_causal_and_rows_that_see_nothing():
    keep = twin.visible(5, 3, causal=True)  # query i sees keys j <= i + 3 - 5
    assert keep.tolist() == [
        [False, False, False],
        [False, False, False],
        [True, False, False],
        [True, True, False],
        [True, True, True],
    ]
    q, k, v = _qkv(1, 1, 1, 5, 3, 8)
    o, lse = twin.flash_attention_forward(q, k, v, causal=True)
    assert torch.equal(o[0, 0, :2], torch.zeros(2, 8, dtype=F64))
    assert torch.isinf(lse[0, 0, :2]).all() and (lse[0, 0, :2] < 0).all()
    assert torch.isfinite(lse[0, 0, 2:]).all()


def test_window_mask():
    keep = twin.visible(6, 6, causal=False, window_size=(2, 1))
    for i in range(6):
        assert keep[i].nonzero().flatten().tolist() == [j for j in range(6) if i - 2 <= j <= i + 1]


@pytest.mark.parametrize("window", [(-1, -1), (3, 0), (5, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("blocks", [(16, 16), (64, 32)], ids=str)
def test_flash_forward_twin_equals_naive_in_float64(case, causal, window, blocks):
    q, k, v = _qkv(*case)
    o, lse = twin.flash_attention_forward(q, k, v, causal=causal, window_size=window, block_m=blocks[0],
                                          block_n=blocks[1])
    torch.testing.assert_close(o, twin.attention(q, k, v, causal=causal, window_size=window), rtol=1e-10,
                               atol=1e-10)
    # lse against its definition, log(sum(exp(scores))) over the visible keys
    group = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    keep = twin.visible(q.shape[2], k.shape[2], causal=causal, window_size=window)
    expected = torch.logsumexp(s.masked_fill(~keep, float("-inf")), dim=-1)
    assert lse.dtype == F64
    torch.testing.assert_close(lse, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window", [(-1, -1), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_flash_backward_twin_equals_autograd_in_float64(case, causal, window):
    q, k, v = (t.requires_grad_(True) for t in _qkv(*case))
    out = twin.attention(q, k, v, causal=causal, window_size=window)
    do = torch.randn_like(out)
    expected = torch.autograd.grad(out, (q, k, v), do)
    o, lse = twin.flash_attention_forward(q.detach(), k.detach(), v.detach(), causal=causal, window_size=window,
                                          block_m=16, block_n=32)
    got = twin.flash_attention_backward(do, q.detach(), k.detach(), v.detach(), o, lse, causal=causal,
                                        window_size=window, block_m=16, block_n=32)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected, strict=True):
        assert g.shape == e.shape, name
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_low_precision_inputs_keep_fp32_statistics():
    q, k, v = _qkv(1, 2, 2, 20, 20, 16, dtype=torch.float32)
    o, lse = twin.flash_attention_forward(q.half(), k.half(), v.half(), causal=True)
    assert o.dtype == torch.float16 and lse.dtype == torch.float32
    torch.testing.assert_close(o.float(), twin.attention(q, k, v, causal=True), rtol=1e-2, atol=1e-2)


def test_twin_shape_errors():
    q, k, v = _qkv(1, 3, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        twin.attention(q, k, v)
    with pytest.raises(ValueError, match="4-D"):
        twin.attention(q[0], k, v)
    with pytest.raises(ValueError, match="same shape"):
        twin.attention(*_qkv(1, 2, 2, 4, 4, 8)[:2], v[:, :, :3])


# --- the twin of attention against a KV cache ----------------------------------------------------------

KVCACHE_CASES = [
    # (Hq, Hkv, Sq, cache_seqlens, causal, window)
    (4, 2, 3, [0, 5, 17], True, (-1, -1)),
    (4, 1, 1, [9, 0, 30], True, (-1, -1)),  # decode, MQA, an empty cache
    (2, 2, 4, [6, 11, 2], False, (-1, -1)),
    (4, 2, 2, [12, 3, 25], True, (4, 0)),  # sliding window
]


def _kvcache_inputs(hq, hkv, sq, seqlens, *, s_max=40, d=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    b = len(seqlens)
    q = torch.randn(b, hq, sq, d, generator=g, dtype=F64)
    k_cache, v_cache = (torch.randn(b, hkv, s_max, d, generator=g, dtype=F64) for _ in range(2))
    k_new, v_new = (torch.randn(b, hkv, sq, d, generator=g, dtype=F64) for _ in range(2))
    return q, k_cache, v_cache, torch.tensor(seqlens, dtype=torch.int32), k_new, v_new


@pytest.mark.parametrize(("hq", "hkv", "sq", "seqlens", "causal", "window"), KVCACHE_CASES, ids=str)
def test_twin_kvcache_appends_in_place_and_attends_like_sdpa(hq, hkv, sq, seqlens, causal, window):
    q, k_cache, v_cache, cache_seqlens, k_new, v_new = _kvcache_inputs(hq, hkv, sq, seqlens)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out = twin.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=k_new, v=v_new, causal=causal,
                                      window_size=window)
    for b, start in enumerate(seqlens):
        keys = torch.cat([before_k[b, :, :start], k_new[b]], dim=1)
        values = torch.cat([before_v[b, :, :start], v_new[b]], dim=1)
        # the cache now holds the new keys at start ..., and nothing else moved
        torch.testing.assert_close(k_cache[b, :, :start + sq], keys, rtol=0, atol=0)
        torch.testing.assert_close(v_cache[b, :, start + sq:], before_v[b, :, start + sq:], rtol=0, atol=0)
        mask = twin.visible(sq, start + sq, causal=causal, window_size=window)
        expected = F.scaled_dot_product_attention(q[b], keys.repeat_interleave(hq // hkv, 0),
                                                  values.repeat_interleave(hq // hkv, 0), attn_mask=mask)
        torch.testing.assert_close(out[b], expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("block_size", [4, 8])
def test_twin_kvcache_paged_equals_contiguous(block_size):
    hq, hkv, sq, seqlens = 4, 2, 3, [0, 13, 29]
    q, k_cache, v_cache, cache_seqlens, k_new, v_new = _kvcache_inputs(hq, hkv, sq, seqlens)
    order = torch.randperm(len(seqlens) * 40 // block_size, generator=torch.Generator().manual_seed(1)).tolist()
    k_pages, table = paged_cache(k_cache, block_size, order)
    v_pages, _ = paged_cache(v_cache, block_size, order)
    paged = twin.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens, k=k_new, v=v_new, block_table=table)
    contiguous = twin.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=k_new, v=v_new)
    torch.testing.assert_close(paged, contiguous, rtol=0, atol=0)
    for b, start in enumerate(seqlens):  # the appended tokens landed in the right pages and rows
        for t in range(sq):
            pos = start + t
            page = int(table[b, pos // block_size])
            assert torch.equal(k_pages[page, :, pos % block_size], k_new[b, :, t])
    decode = twin.attention_with_kvcache(q[:, :, :1], k_pages, v_pages, cache_seqlens + sq, block_table=table)
    torch.testing.assert_close(decode, twin.attention_with_kvcache(q[:, :, :1], k_cache, v_cache, cache_seqlens + sq),
                               rtol=0, atol=0)


# --- the Triton kernels ------------------------------------------------------------------------------

KERNEL_CASES = by_mode(
    interpreter=[(1, 1, 1, 1, 1, 16), (2, 4, 2, 17, 33, 16), (1, 2, 1, 70, 70, 40), (1, 2, 2, 100, 37, 8),
                 (1, 1, 1, 65, 130, 64)],
    cuda=[(b, hq, hkv, sq, sk, d) for (b, hq, hkv) in ((2, 4, 4), (1, 4, 1)) for (sq, sk) in
          ((1, 1), (17, 17), (128, 128), (200, 200), (1000, 1000), (200, 77), (77, 1000))
          for d in (16, 40, 64, 80, 128, 256)]
    # from 1024 queries on, full attention takes larger query blocks (256 rows at D = 128)
    + [(1, 2, 1, 1100, 1100, 64), (1, 2, 1, 1100, 1100, 96), (1, 2, 2, 1024, 1500, 128), (2, 2, 2, 1300, 777, 128)],
)
ATTN_ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}


def _low_precision_attention(q, k, v, causal, window_size=(-1, -1), dropout_p=0.0, seed=None):
    """torch in the input dtype (scores, P and PV in that dtype; softmax in fp32), as a peer's error; with
    ``dropout_p``, P is dropped by the twin's keep mask and scaled in that dtype."""
    group = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ kx.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
    keep = twin.visible(q.shape[2], k.shape[2], causal=causal, window_size=window_size, device=q.device)
    sees = keep.any(dim=-1, keepdim=True)
    s = torch.where(sees, s.masked_fill(~keep, float("-inf")), 0.0)
    p = (torch.softmax(s.float(), dim=-1) * sees).to(q.dtype)
    if dropout_p > 0:
        b, hq, sq, sk = p.shape
        keep = twin.attention_keep_mask(b, hq, sq, sk, dropout_p, seed, device=q.device)
        p = torch.where(keep, p * twin.attention_keep_scale(dropout_p), 0.0)
    return p @ vx


def _grads(fn, q, k, v, do):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_kernel_within_twice_torchs_own_error(case, causal, dtype):
    q, k, v = (t.to(DEVICE, dtype) for t in _qkv(*case, dtype=torch.float32))
    do = torch.randn_like(q)
    ours = _grads(lambda a, b, c: flash_attention(a, b, c, causal=causal), q, k, v, do)
    peer = _grads(lambda a, b, c: _low_precision_attention(a, b, c, causal), q, k, v, do)
    ref = _grads(lambda a, b, c: twin.attention(a, b, c, causal=causal), q.double(), k.double(), v.double(),
                 do.double())
    for name, o, t, r in zip(("o", "dq", "dk", "dv"), ours, peer, ref, strict=True):
        assert o.dtype == dtype and o.shape == r.shape, name
        assert_no_worse_than_torch(name, o, t, r, atol=ATTN_ATOL[dtype])


WINDOW_CASES = by_mode(interpreter=[(1, 2, 1, 70, 70, 16), (1, 1, 1, 33, 90, 16)],
                       cuda=[(2, 4, 2, 300, 300, 64), (1, 4, 1, 77, 500, 40), (1, 2, 2, 500, 120, 128)])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("window", [(16, 0), (20, 30), (0, 0), (50, -1), (-1, 8)], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", WINDOW_CASES, ids=str)
def test_kernel_sliding_window_within_twice_torchs_own_error(case, causal, window, dtype):
    q, k, v = (t.to(DEVICE, dtype) for t in _qkv(*case, dtype=torch.float32))
    do = torch.randn_like(q)
    kw = {"causal": causal, "window_size": window}
    ours = _grads(lambda a, b, c: flash_attention(a, b, c, **kw), q, k, v, do)
    peer = _grads(lambda a, b, c: _low_precision_attention(a, b, c, causal, window), q, k, v, do)
    ref = _grads(lambda a, b, c: twin.attention(a, b, c, **kw), q.double(), k.double(), v.double(), do.double())
    for name, o, t, r in zip(("o", "dq", "dk", "dv"), ours, peer, ref, strict=True):
        assert_no_worse_than_torch(name, o, t, r, atol=ATTN_ATOL[dtype])


def test_window_rows_at_the_edges_see_the_right_keys():
    """Window (2, 1), Sq = Sk: row 0 sees keys 0-1, the last row the last 3; a row of a band that misses
    K entirely (Sq > Sk, right = 0) gets zeros and lse = -inf."""
    q, k, v = (t.to(DEVICE, torch.float32) for t in _qkv(1, 1, 1, 6, 6, 16, dtype=torch.float32))
    o, lse = flash_attention(q, k, v, window_size=(2, 1), return_lse=True)
    torch.testing.assert_close(o, twin.attention(q, k, v, window_size=(2, 1)), rtol=1e-5, atol=1e-5)
    s = (q @ k.transpose(-1, -2))[0, 0] / 4.0
    torch.testing.assert_close(lse[0, 0, 0], torch.logsumexp(s[0, :2], dim=0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[0, 0, 5], torch.logsumexp(s[5, 3:], dim=0), rtol=1e-5, atol=1e-5)
    q2 = torch.cat([q, q], dim=2)  # Sq = 12 > Sk = 6: rows 0..5 sit before key 0
    o2, lse2 = flash_attention(q2, k, v, window_size=(3, 0), return_lse=True)
    assert torch.equal(o2[:, :, :6], torch.zeros_like(o2[:, :, :6])) and (lse2[:, :, :6] == float("-inf")).all()


def test_window_size_errors():
    q, k, v = (t.to(DEVICE, torch.float32) for t in _qkv(1, 1, 1, 4, 4, 16, dtype=torch.float32))
    with pytest.raises(ValueError, match="window_size entries"):
        flash_attention(q, k, v, window_size=(-2, 0))
    with pytest.raises(TypeError, match="pair of ints"):
        flash_attention(q, k, v, window_size=3)


@pytest.mark.parametrize("case", KERNEL_CASES[:4], ids=str)
def test_kernel_lse_equals_the_twin(case):
    q, k, v = (t.to(DEVICE, torch.float32) for t in _qkv(*case, dtype=torch.float32))
    _, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    _, expected = twin.flash_attention_forward(q, k, v, causal=True)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert torch.equal(torch.isinf(lse), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(lse[finite], expected[finite], rtol=1e-5, atol=1e-5)


def test_kernel_rows_that_see_no_key():
    q, k, v = (t.to(DEVICE, torch.float32) for t in _qkv(1, 2, 1, 9, 4, 16, dtype=torch.float32))
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)  # rows 0..4 see nothing
    assert torch.equal(o[:, :, :5], torch.zeros_like(o[:, :, :5]))
    assert (lse[:, :, :5] == float("-inf")).all() and torch.isfinite(lse[:, :, 5:]).all()
    q.requires_grad_(True)
    (dq,) = torch.autograd.grad(flash_attention(q, k, v, causal=True).sum(), q)
    assert torch.equal(dq[:, :, :5], torch.zeros_like(dq[:, :, :5])) and torch.isfinite(dq).all()


@pytest.mark.skipif(INTERPRETER, reason="a fault of compiled code; the interpreter runs the kernel as Python")
@pytest.mark.parametrize("table", ["long-sequence", "short-sequence"])
@pytest.mark.parametrize("d", [80, 96])
def test_kernel_one_query_one_key_is_right_on_every_launch(d, table):
    """Regression: Triton 3.6 miscompiled the forward specialised to Sq = Sk = 1 (causal, D = 80 or 96, the
    long-sequence table's (128, 64, 8 warps, 3 stages)): 1 launch in 6 or 7 wrote a wrong log-sum-exp on the
    H200. With one key, o = v whatever the lse, so only dV (= P dO = dO) and the lse show it; 200 launches
    miss it with probability ~1e-14. Both launch tables run (Sq = 1 normally takes the short one)."""

    def long_tiles(query, tile):
        return configs.lookup(query._replace(sq=2048)).tile if table == "long-sequence" else tile

    q, k, v = (t.to(DEVICE, torch.float16) for t in _qkv(2, 4, 4, 1, 1, d, dtype=torch.float32))
    do = torch.randn_like(q)
    expected_lse = (q.float() @ k.float().transpose(-1, -2)).squeeze(-1) / math.sqrt(d)
    q.requires_grad_(True)
    v.requires_grad_(True)
    wrong = 0
    for _ in range(200):
        with configs.override(long_tiles):  # long-sequence: the tiles of a 2048-query call
            o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
            (dv,) = torch.autograd.grad(o, v, do)
        wrong += not (torch.allclose(lse, expected_lse, rtol=1e-3, atol=1e-3) and torch.equal(dv, do))
    assert wrong == 0, f"{wrong} of 200 launches wrong"


def test_kernel_accepts_bshd_views_and_custom_scale():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 37, 3, 16, generator=g).to(DEVICE) for _ in range(3))  # (B, S, H, D)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    out = flash_attention(qt, kt, vt, causal=True, softmax_scale=0.3)
    expected = twin.attention(qt, kt, vt, causal=True, softmax_scale=0.3)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_outputs_and_gradients_keep_the_layout_of_bshd_views(dtype):
    """O of (B, S, H, D) views of q, k, v is laid out (B, S, H, D), as SDPA lays its output out, so that a caller's
    ``o.transpose(1, 2).reshape(B, S, H * D)`` is a view, not a copy; dQ, dK and dV come in q's, k's and v's layout
    (autograd then keeps them as the leaves' gradients without a copy). dO in O's layout is read in place. The
    values are the contiguous call's."""
    g = torch.Generator().manual_seed(5)
    b, s, hq, hkv, d = 2, 37, 4, 2, 16
    q = torch.randn(b, s, hq, d, generator=g).to(DEVICE, dtype).transpose(1, 2)
    k, v = (torch.randn(b, s, hkv, d, generator=g).to(DEVICE, dtype).transpose(1, 2) for _ in range(2))
    do = torch.randn(b, s, hq, d, generator=g).to(DEVICE, dtype).transpose(1, 2)
    got = _grads(lambda a, b_, c: flash_attention(a, b_, c, causal=True), q, k, v, do)
    for name, t, like in zip(("o", "dq", "dk", "dv"), got, (q, q, k, v), strict=True):
        assert t.stride() == like.stride(), (name, t.stride(), like.stride())
    assert got[0].transpose(1, 2).is_contiguous()
    dense = _grads(lambda a, b_, c: flash_attention(a, b_, c, causal=True), q.contiguous(), k.contiguous(),
                   v.contiguous(), do.contiguous())
    for name, t, e in zip(("o", "dq", "dk", "dv"), got, dense, strict=True):
        torch.testing.assert_close(t, e, msg=lambda m, n=name: f"{n}: {m}")


def test_output_strides_follow_dense_inputs_and_else_are_contiguous():
    """``_output_strides``: a dense permutation with the last dim contiguous keeps its strides (a dim of one
    element takes its contiguous stride); a slice with gaps, an expanded dim or a strided last dim gives
    contiguous strides."""
    from kernels.attention.ops import _output_strides

    cases = [
        (torch.empty(2, 3, 5, 8), (120, 40, 8, 1)),
        (torch.empty(2, 5, 3, 8).transpose(1, 2), (120, 8, 24, 1)),
        (torch.empty(2, 3, 5, 10)[..., :8], (120, 40, 8, 1)),
        (torch.empty(1, 5, 1, 8).transpose(1, 2), (40, 40, 8, 1)),
        (torch.empty(2, 1, 5, 8).expand(2, 3, 5, 8), (120, 40, 8, 1)),
        (torch.empty(2, 3, 8, 5).transpose(-1, -2), (120, 40, 8, 1)),
        (torch.empty(7, 3, 8)[:, :2], (16, 8, 1)),
        (torch.empty(3, 7, 8).transpose(0, 1), (8, 56, 1)),
    ]
    for t, expected in cases:
        assert _output_strides(t) == expected, (t.shape, t.stride())
        assert _output_strides(t) == expected, "a second ask, answered from the cache"


def test_output_strides_of_symbolic_sizes_follow_the_same_rule():
    """A traced call's sizes are symbols, which the cache cannot hash: the rule still gives its input's strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from kernels.attention.ops import _output_strides

    mode = FakeTensorMode(shape_env=ShapeEnv())
    bshd = mode.from_tensor(torch.empty(2, 5, 3, 8).transpose(1, 2))
    padded = mode.from_tensor(torch.empty(2, 3, 5, 10)[..., :8])
    with mode:
        _, h, s, d = bshd.shape
        assert _output_strides(bshd) == (s * h * d, d, h * d, 1)
        _, h, s, d = padded.shape
        assert _output_strides(padded) == (h * s * d, s * d, d, 1)


@pytest.mark.parametrize("d", by_mode(interpreter=[8, 33], cuda=[8, 33, 96, 160, 192, 512, 1000, 1024]))
def test_kernel_head_dims_that_are_not_powers_of_two(d):
    q, k, v = (t.to(DEVICE) for t in _qkv(1, 2, 2, 19, 23, d, dtype=torch.float32))
    do = torch.randn_like(q)
    got = _grads(lambda a, b, c: flash_attention(a, b, c, causal=True), q, k, v, do)
    expected = _grads(lambda a, b, c: twin.attention(a, b, c, causal=True), q, k, v, do)
    for name, g, e in zip(("o", "dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_kernel_bad_inputs():
    q, k, v = (t.to(DEVICE, torch.float32) for t in _qkv(1, 4, 2, 8, 8, 16, dtype=torch.float32))
    with pytest.raises(ValueError, match="q must be 4-D"):
        flash_attention(q[0], k, v)
    with pytest.raises(TypeError, match="one dtype"):
        flash_attention(q.half(), k, v)
    with pytest.raises(TypeError, match="q must be a floating-point tensor"):
        flash_attention(q.int(), k.int(), v.int())
    with pytest.raises(ValueError, match="same shape"):
        flash_attention(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match="batch size"):
        flash_attention(torch.cat([q, q]), k, v)
    with pytest.raises(ValueError, match="head dim"):
        flash_attention(q[..., :8], k, v)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        flash_attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="v is on meta"):
        flash_attention(q, k, v.to("meta"))
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        flash_attention(q, k, v, dropout_p=1.0)
    with pytest.raises(TypeError, match="seed must be None or an int"):
        flash_attention(q, k, v, dropout_p=0.1, seed=1.5)


@pytest.mark.cuda
def test_kernel_long_sequence_and_large_head_dim():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(4, 1, 1024, 1024, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    ours = _grads(lambda a, b, c: flash_attention(a, b, c, causal=True), q, k, v, do)
    peer = _grads(lambda a, b, c: _low_precision_attention(a, b, c, True), q, k, v, do)
    ref = _grads(lambda a, b, c: twin.attention(a, b, c, causal=True), q.double(), k.double(), v.double(),
                 do.double())
    for name, o, t, r in zip(("o", "dq", "dk", "dv"), ours, peer, ref, strict=True):
        assert_no_worse_than_torch(name, o, t, r, atol=ATTN_ATOL[torch.bfloat16])
    long = torch.randn(1, 2, 16384, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    long.requires_grad_(True)
    flash_attention(long, long, long, causal=True).sum().backward()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 64 * long.numel() * long.element_size()  # O(S) buffers, nowhere near an S x S one


@pytest.mark.parametrize("window", [(-1, -1), (7, 3), (0, -1)], ids=str)
@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("sq", "sk"), [(70, 45), (45, 70), (64, 64)], ids=str)
@pytest.mark.parametrize("launches", [1, 2])
def test_kernel_block_boundaries(blocks, causal, sq, sk, window, launches):
    """Small blocks, so the masked/unmasked split of every loop (both edges of the band, the tails of Sq
    and Sk) is crossed; the backward as one launch (dK/dV and dQ programs with different blocks) or two."""

    def small_blocks(query, tile):
        block_m, block_n = blocks[::-1] if query.kernel == "dq" else blocks
        return tile._replace(block_m=block_m, block_n=block_n, num_stages=1)

    with configs.override(small_blocks, fuse=launches == 1):
        _check_small_blocks(causal, sq, sk, window)


def _check_small_blocks(causal, sq, sk, window):
    q, k, v = (t.to(DEVICE) for t in _qkv(1, 2, 1, sq, sk, 16, dtype=torch.float32))
    do = torch.randn_like(q)
    kw = {"causal": causal, "window_size": window}
    if window == (7, 3):  # and dropout, whose keep mask is drawn per tile
        kw.update(dropout_p=0.25, seed=5)
    got = _grads(lambda a, b, c: flash_attention(a, b, c, **kw), q, k, v, do)
    expected = _grads(lambda a, b, c: twin.attention(a, b, c, **kw), q, k, v, do)
    for name, g, e in zip(("o", "dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=2e-4, atol=2e-4, msg=lambda m, n=name: f"{n}: {m}")


# --- dropout on the attention probabilities ---------------------------------------------------------


def test_twin_keep_mask_is_the_documented_philox_draw():
    from reference.dropout import philox4x32

    seed, p = 0x1234_5678_9ABC_DEF0, 0.3
    threshold = twin.attention_keep_threshold(p)
    assert threshold == round(0.3 * 256) == 77
    mask = twin.attention_keep_mask(2, 3, 37, 70, p, seed)
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 4, 10), (1, 0, 3, 7), (0, 2, 9, 5), (1, 1, 24, 17), (0, 1, 36, 69),
                       (1, 2, 15, 31), (0, 0, 16, 32), (1, 1, 30, 45)]:
        counter = tuple(torch.tensor([c]) for c in (4 * (j // 32) + j % 8 // 2, 8 * (i // 16) + i % 8, b * 3 + h,
                                                    twin.ATTENTION_COUNTER_TAG))
        word = int(philox4x32(counter, (seed & 0xFFFFFFFF, seed >> 32))[j % 32 // 8])
        byte = (word >> (8 * (2 * (i // 8 % 2) + j % 2))) & 0xFF
        assert bool(mask[b, h, i, j]) == (byte >= threshold)


def test_one_philox_call_decides_a_query_pair_by_a_key_octet():
    """The sixteen decisions of one call: queries {i, i + 8} x keys {2t, 2t + 1} + 8w of a 16 x 32 patch (the
    elements one thread holds of a tensor-core accumulator), all sixteen bytes used once."""
    from reference.dropout import philox4x32

    seed = 0xDEAD_BEEF_0BAD_F00D
    # p = 0.5: a byte is kept iff its top bit is set, so the mask spells out the words' top bits
    mask = twin.attention_keep_mask(1, 1, 32, 64, 0.5, seed)[0, 0]
    for pair, octet in [(0, 0), (3, 1), (7, 3), (12, 6)]:
        counter = tuple(torch.tensor([c]) for c in (octet, pair, 0, twin.ATTENTION_COUNTER_TAG))
        words = [int(w) for w in philox4x32(counter, (seed & 0xFFFFFFFF, seed >> 32))]
        rows = [16 * (pair // 8) + pair % 8 + 8 * u for u in (0, 1)]
        keys = [32 * (octet // 4) + 8 * w + 2 * (octet % 4) + h for w in range(4) for h in (0, 1)]
        expected = [[bool(words[(key % 32) // 8] >> (8 * (2 * u + key % 2) + 7) & 1) for key in keys]
                    for u in (0, 1)]
        assert mask[rows][:, keys].tolist() == expected


@pytest.mark.parametrize("p", [0.1, 0.25, 0.5, 0.9])
def test_attention_keep_rate_and_scale(p):
    """The 8-bit rule: p rounded to a multiple of 1/256, the kept fraction as drawn (262144 draws: 5 sigma
    is under 0.005), and the scale that keeps E[Pd] = P exact."""
    threshold = twin.attention_keep_threshold(p)
    assert abs(threshold / 256 - p) <= 1 / 512
    assert twin.attention_keep_scale(p) == 256 / (256 - threshold)
    kept = twin.attention_keep_mask(2, 4, 64, 512, p, 7).float().mean().item()
    assert abs(kept - (1 - threshold / 256)) < 0.005
    assert twin.attention_keep_threshold(1 - 1e-9) == 255 and twin.attention_keep_scale(1e-3) == 1.0


@pytest.mark.parametrize("window", [(-1, -1), (5, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES[1:4], ids=str)
def test_flash_twins_with_dropout_equal_naive_and_its_autograd(case, causal, window):
    q, k, v = (t.requires_grad_(True) for t in _qkv(*case))
    kw = {"causal": causal, "window_size": window, "dropout_p": 0.3, "seed": 99}
    out = twin.attention(q, k, v, **kw)
    do = torch.randn_like(out)
    expected = torch.autograd.grad(out, (q, k, v), do)
    o, lse = twin.flash_attention_forward(q.detach(), k.detach(), v.detach(), block_m=16, block_n=32, **kw)
    torch.testing.assert_close(o, out.detach(), rtol=1e-10, atol=1e-10)
    got = twin.flash_attention_backward(do, q.detach(), k.detach(), v.detach(), o, lse, block_m=16, block_n=32, **kw)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_kernel_dropout_mask_equals_the_twins():
    """q = 0 makes every probability 1/Sk and v = I reads them out: o * Sk / (keep scale) is the keep mask."""
    b, h, sq, sk, p, seed = 2, 3, 37, 64, 0.4, 2024
    q = torch.zeros(b, h, sq, sk, device=DEVICE)
    k = torch.randn(b, h, sk, sk, device=DEVICE)
    v = torch.eye(sk, device=DEVICE).expand(b, h, sk, sk).contiguous()
    o = flash_attention(q, k, v, dropout_p=p, seed=seed)
    mask = twin.attention_keep_mask(b, h, sq, sk, p, seed, device=DEVICE)
    torch.testing.assert_close(o * sk / twin.attention_keep_scale(p), mask.float(), rtol=1e-5, atol=1e-5)
    assert 0.5 < mask.float().mean().item() < 0.7


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("causal", "window"), [(False, (-1, -1)), (True, (-1, -1)), (True, (20, 0))], ids=str)
@pytest.mark.parametrize("case", by_mode(interpreter=[(1, 2, 1, 45, 70, 16), (2, 2, 2, 33, 33, 40)],
                                         cuda=[(2, 4, 2, 300, 300, 64), (1, 4, 1, 77, 500, 40),
                                               (1, 2, 2, 500, 120, 128)]), ids=str)
def test_kernel_dropout_within_twice_torchs_own_error(case, causal, window, dtype):
    q, k, v = (t.to(DEVICE, dtype) for t in _qkv(*case, dtype=torch.float32))
    do = torch.randn_like(q)
    kw = {"causal": causal, "window_size": window, "dropout_p": 0.2, "seed": 12345}
    ours = _grads(lambda a, b, c: flash_attention(a, b, c, **kw), q, k, v, do)
    # the peer is torch in the input dtype with the same keep mask, as for attention without dropout (an fp32
    # peer rounded once was tighter than any kernel that rounds P and dS to 16 bits: bf16 dQ at (2, 4, 2, 300,
    # 300, 64) causal came out 2.42e-2 against a bound of 2.38e-2 when the mask's draw order changed)
    peer = _grads(lambda a, b, c: _low_precision_attention(a, b, c, **kw), q, k, v, do)
    ref = _grads(lambda a, b, c: twin.attention(a, b, c, **kw), q.double(), k.double(), v.double(), do.double())
    for name, o, t, r in zip(("o", "dq", "dk", "dv"), ours, peer, ref, strict=True):
        assert_no_worse_than_torch(name, o, t, r, atol=ATTN_ATOL[dtype])


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_every_kernel_picks_its_tile_knowing_whether_it_drops(dropout_p):
    """The launch table has dropout-only rows (the dK/dV tile at D = 64): forward and backward must both ask
    with the call's dropout, or those rows never apply."""
    from kernels.attention import configs

    asked = []

    def record(query, tile):
        asked.append((query.kernel, query.dropout))
        return tile

    q, k, v = (t.to(DEVICE, torch.float32).requires_grad_(True) for t in _qkv(1, 2, 2, 40, 40, 64,
                                                                           dtype=torch.float32))
    with configs.override(record):
        flash_attention(q, k, v, causal=True, dropout_p=dropout_p, seed=3).sum().backward()
    assert {kernel for kernel, _ in asked} == {"fwd", "dkdv", "dq"}
    assert {dropout for _, dropout in asked} == {dropout_p > 0}


def test_kernel_dropout_seeds():
    q, k, v = (t.to(DEVICE, torch.float32) for t in _qkv(1, 2, 2, 40, 40, 16, dtype=torch.float32))
    a = flash_attention(q, k, v, dropout_p=0.5, seed=7)
    assert torch.equal(a, flash_attention(q, k, v, dropout_p=0.5, seed=7))
    assert not torch.equal(a, flash_attention(q, k, v, dropout_p=0.5, seed=8))
    torch.manual_seed(0)
    first = flash_attention(q, k, v, dropout_p=0.5)
    second = flash_attention(q, k, v, dropout_p=0.5)
    assert not torch.equal(first, second)  # seed=None draws a fresh seed from torch's generator
    torch.manual_seed(0)
    assert torch.equal(first, flash_attention(q, k, v, dropout_p=0.5))
    assert torch.equal(flash_attention(q, k, v, dropout_p=0.0, seed=3), flash_attention(q, k, v))


# --- packed variable-length batches -------------------------------------------------------------------


def _packed(lengths_q, lengths_k, hq, hkv, d, dtype):
    g = torch.Generator().manual_seed(sum(lengths_q) * 7 + sum(lengths_k))
    q = torch.randn(sum(lengths_q), hq, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(sum(lengths_k), hkv, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(sum(lengths_k), hkv, d, generator=g).to(DEVICE, dtype)

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)

    return q, k, v, cu(lengths_q), cu(lengths_k)


VARLEN_CASES = by_mode(
    interpreter=[((1, 17, 40), (1, 17, 40), 2, 1, 16), ((5, 33), (70, 2), 2, 2, 40)],
    cuda=[((1, 17, 40, 300, 129), (1, 17, 40, 300, 129), 4, 2, 64), ((5, 33, 1000), (70, 2, 999), 4, 4, 128),
          ((1, 1, 1), (1, 3, 2), 2, 1, 80), ((1100, 300), (1030, 1500), 2, 1, 96)],
)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("causal", "window"), [(False, (-1, -1)), (True, (-1, -1)), (False, (8, 3))], ids=str)
@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
def test_varlen_equals_each_sequence_alone(case, causal, window, dtype):
    lengths_q, lengths_k, hq, hkv, d = case
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, hq, hkv, d, dtype)
    do = torch.randn_like(q)
    kw = {"causal": causal, "window_size": window}
    got = _grads(lambda a, b, c: flash_attention_varlen(a, b, c, cu_q, cu_k, max(lengths_q), max(lengths_k), **kw),
                 q, k, v, do)
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(lengths_q)):
        rq, rk = slice(bounds_q[i], bounds_q[i + 1]), slice(bounds_k[i], bounds_k[i + 1])
        one = [t.transpose(0, 1).unsqueeze(0) for t in (q[rq], k[rk], v[rk], do[rq])]
        # packed batches run the portable kernels: the sequence alone runs them too, so that the comparison is of
        # packing, not of two kernels' roundings (the Hopper kernels are held to the portable ones elsewhere)
        with configs.forced_path("portable"):
            alone = _grads(lambda a, b, c: flash_attention(a, b, c, **kw), *one)
        for name, g, e, rows in zip(("o", "dq", "dk", "dv"), got, alone, (rq, rq, rk, rk), strict=True):
            torch.testing.assert_close(g[rows], e.squeeze(0).transpose(0, 1), rtol=1e-5,
                                       atol=1e-5 if dtype == torch.float32 else 2e-3,
                                       msg=lambda m, n=name, j=i: f"{n} of sequence {j}: {m}")


def test_varlen_dropout_and_lse_equal_the_twin():
    q, k, v, cu_q, cu_k = _packed((3, 50, 20), (9, 50, 1), 2, 1, 16, torch.float32)
    do = torch.randn_like(q)
    kw = {"causal": True, "dropout_p": 0.3, "seed": 77}
    got = _grads(lambda a, b, c: flash_attention_varlen(a, b, c, cu_q, cu_k, 50, 50, **kw), q, k, v, do)
    expected = _grads(lambda a, b, c: twin.attention_varlen(a, b, c, cu_q, cu_k, **kw), q, k, v, do)
    for name, g, e in zip(("o", "dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    _, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 50, 50, causal=True, return_lse=True)
    _, expected_lse = twin.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, causal=True)
    assert lse.shape == (2, q.shape[0])
    assert torch.equal(torch.isinf(lse), torch.isinf(expected_lse))
    finite = torch.isfinite(expected_lse)
    torch.testing.assert_close(lse[finite], expected_lse[finite], rtol=1e-5, atol=1e-5)


def test_varlen_calls_of_one_signature_with_new_lengths_give_what_checked_calls_give(monkeypatch):
    """Packed calls whose signature was seen take the stored plan and, on a GPU, replay the recorded launches with
    their own cumulative lengths: bit for bit what checked, freshly launched calls give."""
    import kernels._common.eager as eager
    import kernels.attention.ops as ops

    lengths = [((3, 50, 20), (9, 50, 1)), ((40, 3, 30), (20, 30, 10)), ((73, 0, 0), (30, 0, 30))]

    def calls():
        out = []
        for step, (lengths_q, lengths_k) in enumerate(lengths):
            torch.manual_seed(step)
            q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 2, 1, 16, torch.float32)
            do = torch.randn_like(q)
            out.append(_grads(lambda a, b, c, cq=cu_q, ck=cu_k: flash_attention_varlen(a, b, c, cq, ck, 73, 50,
                                                                                        causal=True), q, k, v, do))
        return out

    ops._VARLEN_PLANS.clear()
    monkeypatch.setattr(eager, "EAGER_PLANS", False)
    expected = calls()
    assert not ops._VARLEN_PLANS._entries
    monkeypatch.setattr(eager, "EAGER_PLANS", True)
    got = calls()
    assert len(ops._VARLEN_PLANS._entries) == 1
    for got_call, expected_call in zip(got, expected, strict=True):
        for a, e in zip(got_call, expected_call, strict=True):
            assert torch.equal(a, e)


def test_varlen_bad_inputs():
    q, k, v, cu_q, cu_k = _packed((3, 5), (3, 5), 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="q must be 3-D"):
        flash_attention_varlen(q[None], k, v, cu_q, cu_k, 5, 5)
    with pytest.raises(TypeError, match="cu_seqlens_q must be a 1-D int32"):
        flash_attention_varlen(q, k, v, cu_q.long(), cu_k, 5, 5)
    with pytest.raises(ValueError, match="same length"):
        flash_attention_varlen(q, k, v, cu_q[:2], cu_k, 5, 5)
    with pytest.raises(TypeError, match="max_seqlen_q must be a non-negative int"):
        flash_attention_varlen(q, k, v, cu_q, cu_k, -1, 5)


# --- registered ops and torch.compile -------------------------------------------------------------------


@pytest.mark.cuda
def test_registered_ops_pass_opcheck():
    q, k, v = (t.to(DEVICE).requires_grad_(True) for t in _qkv(1, 4, 2, 70, 50, 64, dtype=torch.float32))
    fwd = torch.ops.fused_kernels.flash_attn_fwd.default
    torch.library.opcheck(fwd, (q, k, v, -1, 0, 0.125, 0.0, 0, None, None, None, 0, 0))
    # window, dropout, signed seed; then the seed on the device
    torch.library.opcheck(fwd, (q, k, v, 16, 4, 0.125, 0.2, -5, None, None, None, 0, 0))
    device_seed = torch.tensor(-5, dtype=torch.int64, device=DEVICE)
    torch.library.opcheck(fwd, (q, k, v, 16, 4, 0.125, 0.2, 0, device_seed, None, None, 0, 0))
    qp, kp, vp, cu_q, cu_k = _packed((3, 40), (9, 30), 2, 1, 32, torch.float32)
    qp, kp, vp = (t.requires_grad_(True) for t in (qp, kp, vp))
    torch.library.opcheck(fwd, (qp, kp, vp, -1, 0, 0.2, 0.0, 0, None, cu_q, cu_k, 40, 30))


def test_the_opaque_ops_of_compiled_hopper_calls_pass_opcheck():
    """A compiled call that can take the Hopper kernels goes through ``flash_attn_fwd_gluon`` / ``_bwd_gluon``, which
    run the eager dispatch (any kernel, any device) and give the registered ops' results."""
    q, k, v = (t.to(DEVICE) for t in _qkv(1, 4, 2, 70, 50, 64, dtype=torch.float32))
    fwd, bwd = torch.ops.fused_kernels.flash_attn_fwd_gluon, torch.ops.fused_kernels.flash_attn_bwd_gluon
    torch.library.opcheck(fwd.default, (q, k, v, 16, 0, 0.125))
    o, lse = fwd(q, k, v, 16, 0, 0.125)
    expected = torch.ops.fused_kernels.flash_attn_fwd(q, k, v, 16, 0, 0.125, 0.0, 0, None, None, None, 0, 0)
    assert torch.equal(o, expected[0]) and torch.equal(lse, expected[1])
    do = torch.randn_like(o)
    for dropout_p, seed in ((0.0, 0), (0.2, -5)):
        args = (do, q, k, v, o, lse, 16, 0, 0.125, dropout_p, seed, None)
        torch.library.opcheck(bwd.default, args)
        grads = torch.ops.fused_kernels.flash_attn_bwd(*args, None, None, 0, 0)
        for a, b in zip(bwd(*args), grads, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_the_ops_fake_outputs_have_the_real_ones_layout_for_bshd_views():
    """opcheck (fake tensors against real ones, strides included) with q, k, v as (B, S, H, D) views and dO in O's
    layout: the opaque ops of compiled Hopper calls, and on a GPU the registered ops, give their outputs the
    inputs' layout in both."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 50, h, 64, generator=g).to(DEVICE).transpose(1, 2) for h in (4, 2, 2))
    gluon_fwd, gluon_bwd = torch.ops.fused_kernels.flash_attn_fwd_gluon, torch.ops.fused_kernels.flash_attn_bwd_gluon
    torch.library.opcheck(gluon_fwd.default, (q, k, v, -1, 0, 0.125))
    o, lse = gluon_fwd(q, k, v, -1, 0, 0.125)
    assert o.stride() == q.stride()
    do = torch.randn(1, 50, 4, 64, generator=g).to(DEVICE).transpose(1, 2)
    torch.library.opcheck(gluon_bwd.default, (do, q, k, v, o, lse, -1, 0, 0.125, 0.0, 0, None))
    if DEVICE == "cuda":  # the registered ops trace their kernels, which AOT dispatch cannot under the interpreter
        fwd, bwd = torch.ops.fused_kernels.flash_attn_fwd, torch.ops.fused_kernels.flash_attn_bwd
        torch.library.opcheck(fwd.default, (q, k, v, -1, 0, 0.125, 0.0, 0, None, None, None, 0, 0))
        torch.library.opcheck(bwd.default, (do, q, k, v, o, lse, -1, 0, 0.125, 0.0, 0, None, None, None, 0, 0))


def test_a_seed_on_the_device_keys_the_same_mask_as_the_int():
    """The ops' ``seed_tensor`` (how seed=None travels under torch.compile and CUDA graphs) is read by the
    kernels as the int64 whose bits the int seed gives: forward and backward match the int path bitwise."""
    q, k, v = (t.to(DEVICE).requires_grad_(True) for t in _qkv(1, 2, 1, 40, 40, 32, dtype=torch.float32))
    for seed in (7, -5, 2**40 + 3):  # -5 is the signed form of 2**64 - 5
        on_device = torch.tensor(seed, dtype=torch.int64, device=DEVICE)
        by_int = torch.ops.fused_kernels.flash_attn_fwd(q, k, v, -1, 0, 0.2, 0.3, seed, None, None, None, 0, 0)
        by_tensor = torch.ops.fused_kernels.flash_attn_fwd(q, k, v, -1, 0, 0.2, 0.3, 0, on_device, None, None, 0, 0)
        assert torch.equal(by_int[0], by_tensor[0])
        do = torch.randn_like(by_int[0])
        for a, b in zip(torch.autograd.grad(by_int[0], (q, k, v), do), torch.autograd.grad(by_tensor[0], (q, k, v), do),
                        strict=True):
            assert torch.equal(a, b)
    twin_o, _ = twin.flash_attention_forward(q, k, v, causal=True, softmax_scale=0.2, dropout_p=0.3,
                                             seed=(-5) & (2**64 - 1))
    on_device = torch.tensor(-5, dtype=torch.int64, device=DEVICE)
    o, _ = torch.ops.fused_kernels.flash_attn_fwd(q, k, v, -1, 0, 0.2, 0.3, 0, on_device, None, None, 0, 0)
    torch.testing.assert_close(o, twin_o, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_torch_compile_fullgraph_matches_eager():
    """One function compiled while its dropout_p and seed change between calls: torch.compile makes a
    number that changed symbolic ("automatic dynamic"); each setting must still match eager."""
    q, k, v = (t.to(DEVICE, torch.bfloat16).requires_grad_(True) for t in _qkv(2, 4, 2, 300, 300, 64,
                                                                                  dtype=torch.float32))
    for dropout_p, seed in ((0.0, 11), (0.1, 11), (0.2, 11), (0.2, 12)):

        def block(a, b, c):
            # each block runs inside the iteration that defines it (B023)
            return flash_attention(a, b, c, causal=True, window_size=(64, 0), dropout_p=dropout_p,  # noqa: B023
                                   seed=seed).sum()  # noqa: B023

        eager = torch.autograd.grad(block(q, k, v), (q, k, v))
        compiled = torch.autograd.grad(torch.compile(block, fullgraph=True)(q, k, v), (q, k, v))
        for a, b in zip(eager, compiled, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2)  # a different dropout mask would be O(1) off


@pytest.mark.cuda
def test_torch_compile_of_a_gpt_attention_block_keeps_the_layouts_and_matches_eager():
    """q, k, v as the (B, S, 3, H, D) projection's strided views, O transposed back to (B, S, H * D), as
    ``examples/gpt.py`` does, compiled (fullgraph) against eager: same output and gradients."""
    g = torch.Generator().manual_seed(8)
    b, s, h, d = 2, 300, 4, 64
    qkv = torch.randn(b, s, 3 * h * d, generator=g).to(DEVICE, torch.bfloat16).requires_grad_(True)

    def block(x):
        q, k, v = x.view(b, s, 3, h, d).permute(2, 0, 3, 1, 4)
        return flash_attention(q, k, v, causal=True).transpose(1, 2).reshape(b, s, h * d)

    dy = torch.randn(b, s, h * d, generator=g).to(DEVICE, torch.bfloat16)
    eager_y = block(qkv)
    (eager_dx,) = torch.autograd.grad(eager_y, qkv, dy)
    compiled_y = torch.compile(block, fullgraph=True)(qkv)
    (compiled_dx,) = torch.autograd.grad(compiled_y, qkv, dy)
    torch.testing.assert_close(compiled_y, eager_y, rtol=0, atol=0)
    torch.testing.assert_close(compiled_dx, eager_dx, rtol=1e-2, atol=1e-2)


def test_every_query_finds_a_launch_row_and_every_row_is_reachable():
    from kernels.attention import configs

    used = set()
    for kernel in ("fwd", "dkdv", "dq"):
        for d in (16, 32, 40, 64, 96, 128, 256, 512, 1024):
            for dtype in (torch.float16, torch.float32):
                for left, right in ((-1, -1), (-1, 0), (0, -1), (100, 27), (1024, 1024), (4096, 0)):
                    for sq in (1, 512, 1024, 1025, 4096):
                        for dropout in (False, True):
                            used.add(configs.lookup(configs.query(kernel, d, dtype, left, right, sq, dropout)))
    unreachable = [row for row in configs.ROWS if row not in used]
    assert not unreachable, unreachable
    assert all(row.why for row in configs.ROWS)


def _tile(kernel, d, dtype, left=-1, right=-1, sq=4096, dropout=False):
    from kernels.attention import configs

    return configs.tile(configs.query(kernel, d, dtype, left, right, sq, dropout))


def test_narrow_band_rows_apply_only_to_short_bounded_bands():
    causal = _tile("fwd", 128, torch.float16, -1, 0)
    assert _tile("fwd", 128, torch.float16, 1024, 0).block_m == 64
    assert _tile("fwd", 128, torch.float16, 4096, 0) == causal  # a long band is a plain band
    assert _tile("fwd", 128, torch.float16, 1024, -1) == causal  # one side unbounded
    assert _tile("fwd", 128, torch.float32, 1024, 0) == _tile("fwd", 128, torch.float32)


def test_sequence_length_rows():
    from kernels.attention import configs

    for dtype in (torch.float16, torch.bfloat16):
        # D = 128: 64-row forward blocks up to 1024 queries, then 128 rows (band) or 256 (full, from 1024 on)
        assert _tile("fwd", 128, dtype, -1, 0, 1024).block_m == 64
        assert _tile("fwd", 128, dtype, -1, 0, 1025).block_m == 128
        assert _tile("fwd", 128, dtype, -1, -1, 1023).block_m == 64
        assert _tile("fwd", 128, dtype, -1, -1, 1024).block_m == _tile("fwd", 128, dtype, -1, -1, 16384).block_m == 256
        # D = 64: 128-row forward blocks above 1024 queries (from 1024 on without a band)
        assert _tile("fwd", 64, dtype, -1, 0, 1024).block_m == 64
        assert _tile("fwd", 64, dtype, -1, 0, 1025).block_m == _tile("fwd", 64, dtype, -1, -1, 1024).block_m == 128
        # dropout keeps the default tiles its GPU tests run (the large blocks were measured without it)
        for d in (64, 128):
            for right in (-1, 0):
                assert configs.lookup(configs.query("fwd", d, dtype, -1, right, 16384, dropout=True)).why == "default"
        assert _tile("dkdv", 64, dtype, -1, 0, 16).block_n == 64  # short causal: small tiles
        assert _tile("dkdv", 64, dtype, -1, -1, 16) == _tile("dkdv", 64, dtype, -1, -1, 4096)
    for sq in (16, 1025, 16384):  # fp32 has one tile per head dim
        assert _tile("fwd", 64, torch.float32, -1, -1, sq) == _tile("fwd", 64, torch.float32, -1, 0, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backward_launches_fused_where_the_rows_say(dtype):
    from kernels.attention import configs

    def fused(d, left, right, sq):
        return configs.fuse_backward(*(configs.launch_config(k, d, dtype, left, right, sq) for k in ("dkdv", "dq")))

    assert fused(128, -1, -1, 4096) and fused(128, -1, 0, 4096) and fused(64, -1, -1, 4096)
    assert fused(64, -1, 0, 1024) and not fused(64, -1, 0, 1025)
    assert not fused(128, 1024, 0, 4096)  # narrow window: dK/dV at 4 warps, dQ at 8


def test_override_changes_tiles_inside_the_block_only():
    from kernels.attention import configs

    before = _tile("fwd", 64, torch.float16)
    with configs.override(lambda query, tile: tile._replace(block_m=16), fuse=False):
        assert _tile("fwd", 64, torch.float16) == before._replace(block_m=16)
        assert not configs.fuse_backward(*(configs.launch_config(k, 64, torch.float16) for k in ("dkdv", "dq")))
    assert _tile("fwd", 64, torch.float16) == before


def test_backward_entry_takes_a_sliced_log_sum_exp():
    """The internal backward given the rows of a larger lse (a view with its parent's strides), as context-parallel
    attention passes them: the gradients of a contiguous lse."""
    from kernels.attention.ops import _bwd_impl, _fwd_impl

    g = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(1, 2, 16, 16, generator=g).to(DEVICE) for _ in range(4))
    rows = slice(8, 16)
    o, lse = _fwd_impl(q[:, :, rows], k, v, -1, -1, 0.25)
    parent = torch.zeros(1, 2, 16, device=DEVICE)
    parent[:, :, rows] = lse
    expected = _bwd_impl(do[:, :, rows], q[:, :, rows], k, v, o, lse, -1, -1, 0.25)
    got = _bwd_impl(do[:, :, rows], q[:, :, rows], k, v, o, parent[:, :, rows], -1, -1, 0.25)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
