"""Attention: the pure-PyTorch twins (naive attention and the FA2 tiled forward/backward) against each
other and against torch in float64. The Triton kernels' tests join these when the kernels land
(the public ``kernels.attention`` functions raise NotImplementedError until then)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import reference.attention as twin

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


def test_public_kernel_api_says_it_is_not_there_yet():
    from kernels.attention import flash_attention

    with pytest.raises(NotImplementedError, match="issue 5"):
        flash_attention(*_qkv(1, 1, 1, 4, 4, 8))
