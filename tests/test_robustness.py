"""Robustness across the three families: every bad input gets a clear error (the table in docs/devices-and-inputs.md is
this file's ``BAD_INPUTS``), every edge size works, NaN and Inf propagate as in torch, large scores do not
overflow, the deterministic paths repeat bit for bit, and the sizes past 32-bit indexing work (CUDA)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F

import reference.attention as attention_twin
import reference.dropout as dropout_twin
import reference.layernorm as layernorm_twin
from kernels._common import cpu_runs_reference
from kernels._mode import DEVICE, FLOAT_DTYPES, INTERPRETER, by_mode
from kernels.attention import flash_attention, flash_attention_varlen
from kernels.dropout import dropout
from kernels.layernorm import layer_norm, rms_norm
from tests._numerics import assert_no_worse_than_torch

#: where the bad-input rows build their tensors: this mode's device, or the CPU for the reference path
_BAD_INPUT_DEVICE = [DEVICE]


def _randn(*shape, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(_BAD_INPUT_DEVICE[0], dtype).requires_grad_(requires_grad)


def _ints(values):
    return torch.tensor(values, dtype=torch.int32, device=_BAD_INPUT_DEVICE[0])


# --- bad inputs: one row of the docs table each ---------------------------------------------------------

def _qkv(hq=4, hkv=2, sq=8, sk=8, d=16, dtype=torch.float32):
    return _randn(1, hq, sq, d, dtype=dtype), _randn(1, hkv, sk, d, dtype=dtype, seed=1), _randn(
        1, hkv, sk, d, dtype=dtype, seed=2)


def _varlen(cu_q=None, cu_k=None, max_q=4, max_k=4):
    q = k = v = _randn(6, 2, 16)
    cu = _ints([0, 2, 6])
    return flash_attention_varlen(q, k, v, cu if cu_q is None else cu_q, cu if cu_k is None else cu_k, max_q, max_k)


def _x(*shape, dtype=torch.float32):
    return _randn(*shape).to(dtype)


def _dual(call):
    """``call(dual)`` inside a forward-mode AD level, ``dual`` making a tensor a dual one."""
    with forward_ad.dual_level():
        return call(lambda t: forward_ad.make_dual(t, torch.ones_like(t)))


BAD_INPUTS = [
    # (id, call, exception, message pattern: names the argument and what was expected)
    ("dropout x not a tensor", lambda: dropout([1.0, 2.0], 0.5), TypeError, r"x must be a torch\.Tensor"),
    ("dropout int x", lambda: dropout(_x(4, dtype=torch.int32), 0.5), TypeError, r"x must be a floating-point tensor"),
    ("dropout bool x", lambda: dropout(_x(4).bool(), 0.5), TypeError, r"x must be a floating-point tensor"),
    ("dropout complex x", lambda: dropout(_x(4, dtype=torch.complex64), 0.5), TypeError, r"x must be a floating"),
    ("dropout p < 0", lambda: dropout(_x(4), -0.1), ValueError, r"p must be in \[0, 1\], got -0\.1"),
    ("dropout p > 1", lambda: dropout(_x(4), 1.5), ValueError, r"p must be in \[0, 1\]"),
    ("dropout p NaN", lambda: dropout(_x(4), float("nan")), ValueError, r"p must be in \[0, 1\], got nan"),
    ("dropout p not a number", lambda: dropout(_x(4), "0.5"), TypeError, r"p must be a float, got str"),
    ("dropout seed negative", lambda: dropout(_x(4), 0.5, seed=-1), ValueError, r"seed must be in \[0, 2\*\*64\)"),
    ("dropout seed >= 2**64", lambda: dropout(_x(4), 0.5, seed=2**64), ValueError, r"seed must be in"),
    ("dropout seed float", lambda: dropout(_x(4), 0.5, seed=1.5), TypeError, r"seed must be None or an int"),
    ("layer_norm int x", lambda: layer_norm(_x(2, 4, dtype=torch.int64), 4), TypeError,
     r"x must be a floating-point tensor"),
    ("layer_norm shape not trailing", lambda: layer_norm(_x(2, 4), 5), ValueError,
     r"normalized_shape \[5\] must match the trailing dims of x, whose shape is \[2, 4\]"),
    ("layer_norm shape longer than x", lambda: layer_norm(_x(4), (1, 4)), ValueError, r"normalized_shape \[1, 4\]"),
    ("layer_norm shape empty", lambda: layer_norm(_x(4), ()), ValueError, r"normalized_shape \[\] must match"),
    ("layer_norm shape not ints", lambda: layer_norm(_x(2, 4), 4.0), TypeError,
     r"normalized_shape must be an int or a sequence of ints"),
    ("layer_norm weight shape", lambda: layer_norm(_x(2, 4), 4, _x(5)), ValueError,
     r"weight must have shape \[4\] \(normalized_shape\), got \[5\]"),
    ("layer_norm bias shape", lambda: layer_norm(_x(2, 4), 4, _x(4), _x(2, 2)), ValueError,
     r"bias must have shape \[4\]"),
    ("layer_norm int weight", lambda: layer_norm(_x(2, 4), 4, _x(4, dtype=torch.int32)), TypeError,
     r"weight must be a floating-point tensor"),
    ("layer_norm weight on another device", lambda: layer_norm(_x(2, 4), 4, torch.ones(4, device="meta")), ValueError,
     r"weight is on meta but x is on"),
    ("layer_norm eps < 0", lambda: layer_norm(_x(2, 4), 4, eps=-1e-5), ValueError,
     r"eps must be a finite number >= 0\.0, got -1e-05"),
    ("layer_norm eps NaN", lambda: layer_norm(_x(2, 4), 4, eps=float("nan")), ValueError, r"eps must be a finite"),
    ("rms_norm complex x", lambda: rms_norm(_x(2, 4, dtype=torch.complex64), 4), TypeError, r"x must be a floating"),
    ("rms_norm weight shape", lambda: rms_norm(_x(2, 4), 4, _x(3)), ValueError, r"weight must have shape \[4\]"),
    ("rms_norm eps inf", lambda: rms_norm(_x(2, 4), 4, eps=float("inf")), ValueError, r"eps must be a finite"),
    ("attention q rank", lambda: flash_attention(_qkv()[0][0], *_qkv()[1:]), ValueError,
     r"q must be 4-D \(batch, heads, seq, head_dim\), got shape \[4, 8, 16\]"),
    ("attention mixed dtypes", lambda: flash_attention(_qkv()[0].half(), *_qkv()[1:]), TypeError,
     r"q, k, v must share one dtype, got torch\.float16, torch\.float32, torch\.float32"),
    ("attention int", lambda: flash_attention(*(t.int() for t in _qkv())), TypeError, r"q must be a floating-point"),
    ("attention k/v length", lambda: flash_attention(*_qkv()[:2], _qkv(sk=5)[2]), ValueError,
     r"k and v must have the same shape, got \[1, 2, 8, 16\] and \[1, 2, 5, 16\]"),
    ("attention batch", lambda: flash_attention(torch.cat([_qkv()[0]] * 2), *_qkv()[1:]), ValueError,
     r"q and k must have the same batch size, got 2 and 1"),
    ("attention head dim", lambda: flash_attention(_qkv(d=8)[0], *_qkv()[1:]), ValueError,
     r"q and k must have the same head dim, got 8 and 16"),
    ("attention Hq % Hkv", lambda: flash_attention(_qkv(hq=3)[0], *_qkv()[1:]), ValueError,
     r"the number of query heads \(3\) must be a multiple of the number of key/value heads \(2\)"),
    ("attention head dim too large", lambda: flash_attention(*_qkv(d=1032, sq=1, sk=1)), ValueError,
     r"head dim must be between 1 and 1024, got 1032"),
    ("attention head dim 0", lambda: flash_attention(*_qkv(d=0)), ValueError, r"head dim must be between 1 and"),
    ("attention v on another device", lambda: flash_attention(*_qkv()[:2], _qkv()[2].to("meta")), ValueError,
     r"v is on meta but q is on"),
    ("attention dropout_p = 1", lambda: flash_attention(*_qkv(), dropout_p=1.0), ValueError,
     r"dropout_p must be in \[0, 1\), got 1\.0"),
    ("attention dropout_p < 0", lambda: flash_attention(*_qkv(), dropout_p=-0.5), ValueError,
     r"dropout_p must be in \[0, 1\)"),
    ("attention seed", lambda: flash_attention(*_qkv(), dropout_p=0.1, seed="7"), TypeError,
     r"seed must be None or an int, got str"),
    ("attention window not a pair", lambda: flash_attention(*_qkv(), window_size=3), TypeError,
     r"window_size must be a pair of ints \(left, right\), got 3"),
    ("attention window float", lambda: flash_attention(*_qkv(), window_size=(2.7, 0)), TypeError,
     r"window_size must be a pair of ints \(left, right\), got \(2\.7, 0\)"),
    ("attention window bool", lambda: flash_attention(*_qkv(), window_size=(True, 0)), TypeError,
     r"window_size must be a pair of ints \(left, right\), got \(True, 0\)"),
    ("attention window triple", lambda: flash_attention(*_qkv(), window_size=(1, 2, 3)), TypeError,
     r"window_size must be a pair of ints"),
    ("attention window < -1", lambda: flash_attention(*_qkv(), window_size=(-2, 0)), ValueError,
     r"window_size entries must be >= 0, or -1 for unbounded"),
    ("attention softmax_scale NaN", lambda: flash_attention(*_qkv(), softmax_scale=float("nan")), ValueError,
     r"softmax_scale must be a finite number, got nan"),
    ("varlen q rank", lambda: flash_attention_varlen(*_qkv(), None, None, 4, 4), ValueError,
     r"q must be 3-D \(total_tokens, heads, head_dim\)"),
    ("varlen cu_seqlens dtype", lambda: _varlen(cu_q=_ints([0, 2, 6]).long()), TypeError,
     r"cu_seqlens_q must be a 1-D int32 tensor of cumulative lengths"),
    ("varlen cu_seqlens lengths", lambda: _varlen(cu_k=_ints([0, 6])),
     ValueError, r"cu_seqlens_q and cu_seqlens_k must have the same length, got 3 and 2"),
    ("varlen max_seqlen", lambda: _varlen(max_q=-1), TypeError, r"max_seqlen_q must be a non-negative int, got -1"),
    ("dropout dual x", lambda: _dual(lambda d: dropout(d(_x(4)), 0.5)), NotImplementedError,
     r"x is a dual tensor \(forward-mode AD\): fused-kernels ops have no jvp"),
    ("rms_norm dual weight", lambda: _dual(lambda d: rms_norm(_x(2, 4), 4, d(_x(4)))), NotImplementedError,
     r"weight is a dual tensor"),
    ("attention dual v", lambda: _dual(lambda d: flash_attention(*_qkv()[:2], d(_qkv()[2]))), NotImplementedError,
     r"v is a dual tensor"),
]


def test_a_dual_tensor_is_refused_even_where_a_plan_was_stored():
    """A call signature whose plan an earlier call stored is checked again inside a forward-mode AD level (a plan's
    key does not tell a dual tensor apart), and takes its plan again after it."""
    x, w = _x(2, 4), _x(4)
    expected = rms_norm(x, 4, w)  # stores the plan
    with forward_ad.dual_level(), pytest.raises(NotImplementedError, match="x is a dual tensor"):
        rms_norm(forward_ad.make_dual(x, torch.ones_like(x)), 4, w)
    assert torch.equal(rms_norm(x, 4, w), expected)


@pytest.mark.parametrize("path", ["device", "reference"])
@pytest.mark.parametrize(("call", "error", "pattern"), [pytest.param(*case[1:], id=case[0]) for case in BAD_INPUTS])
def test_bad_input_raises_a_clear_error(call, error, pattern, path):
    """On this mode's device path and on the reference twin's (CPU tensors without the interpreter) alike."""
    _BAD_INPUT_DEVICE[0] = DEVICE if path == "device" else "cpu"
    try:
        with (cpu_runs_reference() if path == "reference" else contextlib.nullcontext(),
              pytest.raises(error, match=pattern) as raised):
            call()
    finally:
        _BAD_INPUT_DEVICE[0] = DEVICE
    assert type(raised.value) is error  # not a subclass from deeper down (a Triton or torch error)


# --- edge sizes -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 7), (1,), (1, 1)], ids=str)
def test_dropout_empty_and_single_element(shape):
    x = _randn(*shape, requires_grad=True)
    out = dropout(x, 0.5, seed=3)
    assert out.shape == x.shape
    assert torch.equal(out, dropout_twin.dropout(x.detach(), 0.5, seed=3))
    (dx,) = torch.autograd.grad(out.sum(), x)
    assert dx.shape == x.shape


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize(("shape", "n"), [((0, 8), 8), ((2, 0, 8), 8), ((3, 0), 0), ((1, 8), 8), ((8,), 8),
                                          ((1, 1), 1)], ids=str)
def test_norm_empty_and_single_row(norm, shape, n):
    x = _randn(*shape, requires_grad=True)
    w = torch.full((n,), 1.5, device=DEVICE, requires_grad=True)
    b = torch.full((n,), 0.25, device=DEVICE, requires_grad=True)
    if norm == "layer":
        y, params = layer_norm(x, n, w, b), (x, w, b)
        expected = F.layer_norm(x.detach(), (n,), w.detach(), b.detach())
    else:
        y, params = rms_norm(x, n, w), (x, w)
        expected = F.rms_norm(x.detach(), (n,), w.detach())
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(y.sum(), params)
    for g, p in zip(grads, params, strict=True):
        assert g.shape == p.shape and torch.isfinite(g).all()
    if x.numel() == 0:  # no rows: dW and dB are sums over nothing
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads[1:])


@pytest.mark.parametrize(("b", "hq", "hkv", "sq", "sk"), [(0, 2, 1, 5, 5), (1, 0, 0, 5, 5), (1, 2, 1, 0, 5),
                                                          (1, 2, 1, 5, 0), (1, 1, 1, 1, 1), (1, 2, 2, 1, 37)],
                         ids=str)
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_attention_empty_and_single_position(b, hq, hkv, sq, sk, dropout_p):
    q, k, v = (_randn(b, h, s, 16, seed=i, requires_grad=True) for i, (h, s) in enumerate(((hq, sq), (hkv, sk),
                                                                                             (hkv, sk))))
    o, lse = flash_attention(q, k, v, causal=True, dropout_p=dropout_p, seed=4, return_lse=True)
    expected, expected_lse = attention_twin.flash_attention_forward(q.detach(), k.detach(), v.detach(), causal=True,
                                                                    dropout_p=dropout_p, seed=4)
    torch.testing.assert_close(o, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(expected_lse))
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    for g, t in zip(grads, (q, k, v), strict=True):
        assert g.shape == t.shape and torch.isfinite(g).all()
    if sk == 0:  # no key: zeros and lse = -inf, as documented
        assert torch.equal(o, torch.zeros_like(o)) and (lse == float("-inf")).all()


def test_varlen_empty_batch_and_empty_sequences():
    q = k = v = _randn(0, 2, 16)
    zeros = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    assert flash_attention_varlen(q, k, v, zeros, zeros, 0, 0).shape == (0, 2, 16)
    q, k, v = (_randn(5, 2, 16, seed=i) for i in range(3))
    cu = torch.tensor([0, 0, 5, 5], dtype=torch.int32, device=DEVICE)  # sequences of 0, 5 and 0 tokens
    out = flash_attention_varlen(q, k, v, cu, cu, 5, 5, causal=True)
    alone = flash_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), causal=True)[0].transpose(0, 1)
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)


# --- NaN and Inf ---------------------------------------------------------------------------------------

def test_dropout_keeps_nan_and_inf_as_torch_does():
    """A dropped element is ``x * 0``: NaN stays NaN and Inf becomes NaN, kept or not, as in torch."""
    x = _randn(4096)
    x[::7], x[3::7], x[5::7] = float("nan"), float("inf"), float("-inf")
    for p in (0.3, 1.0):
        out = dropout(x, p, seed=11)
        keep = dropout_twin.keep_mask(x.numel(), p, 11, device=x.device) if p < 1 else torch.zeros_like(x).bool()
        expected = x * torch.where(keep, 1 / (1 - p) if p < 1 else 0.0, 0.0)
        assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.isinf(), expected.isinf())
        finite = torch.isfinite(expected)
        torch.testing.assert_close(out[finite], expected[finite])
        assert not torch.isfinite(out[~torch.isfinite(x)]).any()  # never turned into a number
    inplace = x.clone()
    dropout(inplace, 1.0, inplace=True)
    assert torch.equal(inplace.isnan(), (x * 0).isnan())


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("n", by_mode(interpreter=[7, 300], cuda=[7, 1000, 100_000]))
def test_norm_nan_and_inf_stay_in_their_row(norm, bad, n):
    x = _randn(5, n)
    w, b = _randn(n, seed=1), _randn(n, seed=2)

    def run(t):
        t = t.clone().requires_grad_(True)
        y = layer_norm(t, n, w, b) if norm == "layer" else rms_norm(t, n, w, 1e-6)
        (dx,) = torch.autograd.grad(y, t, torch.ones_like(y))
        return y.detach(), dx

    clean_y, clean_dx = run(x)
    x[2, n // 2] = bad
    y, dx = run(x)
    # torch's definition, written out: its fused CUDA rms_norm disagrees with itself here (H200, torch
    # 2.11: an Inf makes the whole row NaN at N = 7, but zeros and one NaN at N = 64 and 1000, as on CPU)
    torch_y = F.layer_norm(x, (n,), w, b) if norm == "layer" else (
        x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)
    assert torch.equal(y.isnan(), torch_y.isnan()) and torch.equal(y.isinf(), torch_y.isinf())
    assert y[2].isnan().any() and torch.isfinite(dx[[0, 1, 3, 4]]).all()
    others = [0, 1, 3, 4]  # rows are independent: the other rows are bitwise the clean run's
    assert torch.equal(y[others], clean_y[others]) and torch.equal(dx[others], clean_dx[others])


def test_attention_nan_stays_in_its_query_row_and_spreads_from_keys_as_in_torch():
    q, k, v = (_randn(1, 2, 70, 16, seed=i) for i in range(3))
    clean = flash_attention(q, k, v, causal=True)
    q_bad = q.clone()
    q_bad[0, 1, 30, 3] = float("nan")
    qb = q_bad.clone().requires_grad_(True)
    out = flash_attention(qb, k, v, causal=True)
    (dq,) = torch.autograd.grad(out, qb, torch.ones_like(out))
    assert out[0, 1, 30].isnan().all()
    rows = torch.ones(70, dtype=torch.bool, device=DEVICE)
    rows[30] = False
    assert torch.equal(out[0, 1, rows], clean[0, 1, rows]) and torch.equal(out[0, 0], clean[0, 0])
    assert torch.isfinite(dq[0, 1, rows]).all() and torch.isfinite(dq[0, 0]).all()
    for tensor_index, value in ((1, float("nan")), (2, float("nan")), (0, float("inf")), (1, float("-inf"))):
        bad = [q.clone(), k.clone(), v.clone()]
        bad[tensor_index][0, 0, 40, 5] = value
        ours = flash_attention(*bad, causal=True)
        # the twin states torch's math (a masked key is -inf whatever its score; torch's math SDPA adds the
        # mask instead, so NaN + -inf would spread a NaN key to the rows that cannot see it)
        expected = attention_twin.attention(*(t.double() for t in bad), causal=True)
        assert torch.equal(ours.isnan(), expected.isnan()), (tensor_index, value)
        finite = ~expected.isnan()
        torch.testing.assert_close(ours[finite].double(), expected[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_attention_scores_of_ten_thousand_do_not_overflow(dtype):
    q, k, v = (_randn(1, 2, 100, 64, seed=i) for i in range(3))
    q, k = q * 40, k * 40  # q.k / 8 reaches ~1e4
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    scores = (q.double() @ k.double().transpose(-1, -2)) / 8
    assert scores.abs().max() > 3e3
    ref = attention_twin.attention(q.double(), k.double(), v.double(), causal=True)
    expected_lse = torch.logsumexp(scores.masked_fill(torch.ones(100, 100, dtype=torch.bool, device=DEVICE).triu(1),
                                                      float("-inf")), dim=-1)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-5, atol=by_mode(interpreter=1e-2, cuda=2e-2))
    # scores ~5e4 before scaling carry fp32 rounding of ~4e-3, so close keys' weights move by ~5e-4 relative
    torch.testing.assert_close(o.double(), ref, rtol=0, atol={torch.float32: 5e-3}.get(dtype, 2e-2))
    grads = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    assert all(torch.isfinite(g).all() for g in grads)


# --- repeatability ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("causal", "dropout_p", "hkv"), [(False, 0.0, 4), (True, 0.0, 1), (True, 0.2, 2)], ids=str)
def test_attention_forward_and_backward_are_bitwise_reproducible(causal, dropout_p, hkv):
    """The backward has no atomics (one program owns each dK/dV block, another each dQ block)."""
    sq, sk, d = by_mode(interpreter=(40, 70, 16), cuda=(1000, 1100, 128))
    dtype = by_mode(interpreter=torch.float32, cuda=torch.bfloat16)
    q, k, v = (_randn(2, h, s, d, dtype=dtype, seed=i, requires_grad=True)
               for i, (h, s) in enumerate(((4, sq), (hkv, sk), (hkv, sk))))
    do = _randn(2, 4, sq, d, dtype=dtype, seed=9)

    def run():
        o = flash_attention(q, k, v, causal=causal, dropout_p=dropout_p, seed=5, deterministic=True)
        return (o.detach(), *torch.autograd.grad(o, (q, k, v), do))

    first = run()
    for _ in range(by_mode(interpreter=1, cuda=9)):
        assert all(torch.equal(a, b) for a, b in zip(first, run(), strict=True))


# --- past 32-bit indexing and long sequences (GPU) ----------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.big_memory
@pytest.mark.skipif(INTERPRETER, reason="needs ~30 GB of GPU memory")
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_norm_past_two_to_the_31_elements(norm):
    """2**21 + 3 rows of 1024 (2**31 + 3072 elements, bf16): rows past the 2**31-th element are right."""
    m, n = 2**21 + 3, 1024
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    y = layer_norm(x, n, w) if norm == "layer" else rms_norm(x, n, w, 1e-6)
    dy = torch.ones_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    for rows in (slice(0, 3), slice(2**21 - 2, 2**21 + 3)):
        xs = x.detach()[rows].float()
        if norm == "layer":
            ys, mean, rstd = layernorm_twin.layer_norm_forward(xs, w.detach().float(), None, 1e-5)
            dxs = layernorm_twin.layer_norm_backward(dy[rows].float(), xs, w.detach().float(), mean, rstd)[0]
        else:
            ys, rstd = layernorm_twin.rms_norm_forward(xs, w.detach().float(), 1e-6)
            dxs = layernorm_twin.rms_norm_backward(dy[rows].float(), xs, w.detach().float(), rstd)[0]
        torch.testing.assert_close(y[rows].float(), ys, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(dx[rows].float(), dxs, rtol=2e-2, atol=5e-2)
    del y, dx
    expected_dw = torch.zeros(n, device="cuda", dtype=torch.float64)
    for chunk in x.detach().split(2**18):  # dy = 1: dW is the column sum of x-hat
        xc = chunk.float() - chunk.float().mean(-1, keepdim=True) if norm == "layer" else chunk.float()
        eps = 1e-5 if norm == "layer" else 1e-6
        expected_dw += (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)).sum(0).double()
    torch.testing.assert_close(dw.double(), expected_dw, rtol=1e-2, atol=2.0)  # a sum over 2M rows, bf16 output


@pytest.mark.cuda
@pytest.mark.big_memory
@pytest.mark.skipif(INTERPRETER, reason="a GPU-size sequence")
def test_attention_sequence_of_131072():
    """B = H = 1, S = 131072, causal, bf16: o, dQ, dK, dV against an fp32 reference computed a block of
    query rows at a time, within twice the error of torch's own bf16 attention (SDPA) plus the bf16 slack."""
    s, d = 131072, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, 1, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = flash_attention(qg, kg, vg, causal=True)
    dq, dk, dv = torch.autograd.grad(o, (qg, kg, vg), do)
    ref = _chunked_causal_attention(q[0, 0].float(), k[0, 0].float(), v[0, 0].float(), do[0, 0].float())
    qp, kp, vp = (t.clone().requires_grad_(True) for t in (q, k, v))
    peer_o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
    peer = (peer_o.detach(), *torch.autograd.grad(peer_o, (qp, kp, vp), do))
    for name, ours, theirs, expected in zip(("o", "dq", "dk", "dv"), (o.detach(), dq, dk, dv), peer, ref, strict=True):
        assert_no_worse_than_torch(name, ours[0, 0], theirs[0, 0], expected, atol=1.6e-2)


def _chunked_causal_attention(q, k, v, do, chunk=4096):
    """fp32 causal attention and its gradients, a block of query rows at a time (scores never exceed
    ``chunk x S``)."""
    s, d = q.shape
    scale = 1 / math.sqrt(d)
    o, dq = torch.empty_like(q), torch.empty_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    cols = torch.arange(s, device=q.device)
    for start in range(0, s, chunk):
        rows = torch.arange(start, min(start + chunk, s), device=q.device)
        keys = slice(0, rows[-1].item() + 1)
        scores = (q[rows] @ k[keys].T) * scale
        scores.masked_fill_(cols[keys][None, :] > rows[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        o[rows] = p @ v[keys]
        dp = do[rows] @ v[keys].T
        ds = p * (dp - (do[rows] * o[rows]).sum(-1, keepdim=True))
        dq[rows] = (ds @ k[keys]) * scale
        dk[keys] += (ds.T @ q[rows]) * scale
        dv[keys] += p.T @ do[rows]
    return o, dq, dk, dv
