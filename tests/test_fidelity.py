"""Drop-in fidelity: a swap from torch's op to ours changes nothing but speed.

- Every default of every public function and module equals torch's counterpart's, and a call that leaves
  them all at their defaults computes what torch computes, on small-magnitude rows where an ``eps`` rule
  shows (fp16 and bf16 included).
- A CPU user gets the same answers from both CPU paths: the Triton interpreter (``TRITON_INTERPRET=1``)
  and the reference twin that runs without it. One matrix of public calls (multi-dimensional
  ``normalized_shape``, affine or not, every family, forward and backward) runs on the device path of
  this test mode and on the reference path, each compared with torch.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.nn.functional as F

import kernels
import reference.attention as attention_twin
import reference.dropout as dropout_twin
from kernels._common import cpu_runs_reference
from kernels._mode import DEVICE, FLOAT_DTYPES
from kernels.attention import flash_attention, flash_attention_varlen
from kernels.dropout import Dropout, dropout
from kernels.layernorm import AddDropoutNorm, LayerNorm, RMSNorm, add_dropout_norm, layer_norm, rms_norm

# Paths a call can take: this mode's device path (CUDA kernels, or the interpreter on CPU) and the CPU
# reference twin, each in every dtype the kernels take.
PATHS = [(path, dt) for path in ("device", "reference") for dt in FLOAT_DTYPES]
PATH_IDS = [f"{path}-{str(dt).replace('torch.', '')}" for path, dt in PATHS]
# Same-dtype agreement with torch: a few units in the last place of the output dtype.
TOLERANCE = {torch.float16: {"rtol": 2e-3, "atol": 2e-3}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
             torch.float32: {"rtol": 1e-5, "atol": 1e-5}}


def _where(path):
    """(device, context) for a path: the reference path is CPU tensors inside ``cpu_runs_reference``."""
    if path == "reference":
        return "cpu", cpu_runs_reference()
    return DEVICE, contextlib.nullcontext()


# SDPA is a builtin without an inspectable signature: its documented defaults.
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _defaults(fn) -> dict:
    if isinstance(fn, dict):
        return fn
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


# --- defaults ------------------------------------------------------------------------------------------

# (ours, torch's, our parameter name -> torch's where they differ)
SIGNATURE_PAIRS = [
    (layer_norm, F.layer_norm, {}),
    (rms_norm, F.rms_norm, {}),
    (dropout, F.dropout, {}),
    (flash_attention, SDPA_DEFAULTS, {"causal": "is_causal", "softmax_scale": "scale"}),
    (LayerNorm.__init__, torch.nn.LayerNorm.__init__, {}),
    (RMSNorm.__init__, torch.nn.RMSNorm.__init__, {}),
    (Dropout.__init__, torch.nn.Dropout.__init__, {}),
]


def _pair_id(value) -> str:
    return "sdpa" if value is SDPA_DEFAULTS else getattr(value, "__qualname__", "")


@pytest.mark.parametrize(("ours", "theirs", "renamed"), SIGNATURE_PAIRS, ids=_pair_id)
def test_every_shared_default_is_torchs(ours, theirs, renamed):
    our_defaults, their_defaults = _defaults(ours), _defaults(theirs)
    shared = [name for name in our_defaults if renamed.get(name, name) in their_defaults]
    assert shared, "no argument in common: the pair is wrong"
    for name in shared:
        assert our_defaults[name] == their_defaults[renamed.get(name, name)], name
    # every argument torch's has, ours has too, with the same default
    missing = set(their_defaults) - {renamed.get(name, name) for name in our_defaults}
    assert not missing - {"enable_gqa", "attn_mask", "inplace"}, missing


def _small_rows(*shape, dtype, device, rms=0.03):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(*shape, generator=g) * rms).to(device=device, dtype=dtype)


@pytest.mark.parametrize(("path", "dtype"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("shape", [(64,), (4, 6)], ids=str)
def test_norms_with_default_arguments_equal_torchs_on_small_rows(path, dtype, shape):
    """Rows of RMS 0.03: an fp16 eps of 9.8e-4 instead of fp32's 1.2e-7 moves the output by about 50%."""
    device, context = _where(path)
    x = _small_rows(5, *shape, dtype=dtype, device=device)
    with context:
        cases = {
            "layer_norm": (layer_norm(x, shape), F.layer_norm(x, shape)),
            "rms_norm": (rms_norm(x, shape), F.rms_norm(x, shape)),
            "LayerNorm": (LayerNorm(shape, device=device, dtype=dtype)(x),
                          torch.nn.LayerNorm(shape, device=device, dtype=dtype)(x)),
            "RMSNorm": (RMSNorm(shape, device=device, dtype=dtype)(x),
                        torch.nn.RMSNorm(shape, device=device, dtype=dtype)(x)),
        }
    for name, (ours, theirs) in cases.items():
        assert ours.dtype == theirs.dtype == dtype, name
        torch.testing.assert_close(ours, theirs, **TOLERANCE[dtype], msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(("path", "dtype"), PATHS, ids=PATH_IDS)
def test_dropout_and_attention_with_default_arguments_equal_torchs(path, dtype):
    device, context = _where(path)
    x = _small_rows(4000, dtype=dtype, device=device, rms=1.0)
    q, k, v = (_small_rows(1, 2, 9, 16, dtype=dtype, device=device, rms=1.0).roll(i, -1) for i in range(3))
    with context:
        for y in (dropout(x), Dropout()(x)):  # p = 0.5, training: kept elements are x / (1 - 0.5)
            kept = y != 0
            assert torch.equal(y[kept], x[kept] * 2)
            assert 0.45 < kept.double().mean().item() < 0.55
        assert Dropout().eval()(x) is x
        ours = flash_attention(q, k, v)
    theirs = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(dtype)
    torch.testing.assert_close(ours, theirs, **TOLERANCE[dtype])


# --- both CPU paths, one matrix -------------------------------------------------------------------------

NORM_CASES = [(kind, shape, affine) for kind in ("layer", "rms") for shape in ((7,), (4, 6), (2, 3, 5))
              for affine in (("weight", "bias", "none") if kind == "layer" else ("weight", "none"))]


def _norm_call(kind, shape, affine, x, weight, bias, module):
    if module:
        if kind == "layer":
            m = LayerNorm(shape, elementwise_affine=affine != "none", bias=affine == "bias", device=x.device,
                          dtype=weight.dtype)
        else:
            m = RMSNorm(shape, elementwise_affine=affine != "none", device=x.device, dtype=weight.dtype)
        params = [p for p in (m.weight, getattr(m, "bias", None)) if p is not None]  # torch's RMSNorm has no bias
        with torch.no_grad():
            for p, value in zip(params, (weight, bias), strict=False):
                p.copy_(value)
        return m(x), params
    w = weight if affine != "none" else None
    b = bias if affine == "bias" else None
    y = layer_norm(x, shape, w, b) if kind == "layer" else rms_norm(x, shape, w)
    return y, [p for p in (w, b) if p is not None]


@pytest.mark.parametrize(("path", "dtype"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize(("kind", "shape", "affine"), NORM_CASES, ids=str)
@pytest.mark.parametrize("module", [False, True], ids=["function", "module"])
def test_norms_on_both_cpu_paths(path, dtype, kind, shape, affine, module):
    device, context = _where(path)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, *shape, generator=g).to(device, dtype).requires_grad_(True)
    weight = torch.randn(shape, generator=g).to(device, dtype).requires_grad_(True)
    bias = torch.randn(shape, generator=g).to(device, dtype).requires_grad_(True)
    dy = torch.randn(3, *shape, generator=g).to(device, dtype)
    with context:
        y, params = _norm_call(kind, shape, affine, x, weight, bias, module)
        grads = torch.autograd.grad(y, [x, *params], dy)
    # torch in float64 on the same numbers, then rounded to the output dtype
    x64 = x.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True) if affine != "none" else None
    b64 = bias.detach().double().requires_grad_(True) if affine == "bias" else None
    if kind == "layer":
        y64 = F.layer_norm(x64, shape, w64, b64)
    else:  # eps=None on fp16/bf16/fp32 inputs is float32's epsilon (float64's would apply to float64 inputs)
        y64 = F.rms_norm(x64, shape, w64, torch.finfo(torch.float32).eps)
    expected = [y64, *torch.autograd.grad(y64, [t for t in (x64, w64, b64) if t is not None], dy.double())]
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}[dtype]
    for got, want in zip([y, *grads], expected, strict=True):
        assert got.shape == want.shape
        # dW/dB sum over rows: their error grows with the row count (3 here)
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 4)


DROPOUT_CASES = [((0,), 0.3), ((7,), 0.0), ((7,), 1.0), ((3, 5, 11), 0.3), ((4, 33), 0.9)]


@pytest.mark.parametrize(("path", "dtype"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize(("shape", "p"), DROPOUT_CASES, ids=str)
def test_dropout_on_both_cpu_paths(path, dtype, shape, p):
    device, context = _where(path)
    g = torch.Generator().manual_seed(2)
    base = torch.randn(*shape, generator=g).to(device, dtype)
    with context:
        x = base.clone().requires_grad_(True)
        y = dropout(x, p, seed=11)
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        view = base.t() if base.dim() == 2 else base  # a non-contiguous view gives its logical mask
        y_view = dropout(view, p, seed=11)
        inplace = base.clone()
        dropout(inplace, p, seed=11, inplace=True)
        assert dropout(base, p, training=False) is base
    expected = dropout_twin.dropout(base, p, seed=11)
    assert torch.equal(y, expected) and torch.equal(inplace, expected)
    assert torch.equal(dx, dropout_twin.dropout(torch.ones_like(base), p, seed=11))
    assert torch.equal(y_view, dropout_twin.dropout(view.contiguous(), p, seed=11))
    if 0 < p < 1 and base.numel():  # torch's rule: a kept element is x times 1 / (1 - p)
        kept = y != 0
        torch.testing.assert_close(y[kept], (base[kept].float() * (1 / (1 - p))).to(dtype), rtol=0, atol=0)


ATTENTION_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, keywords)
    (2, 4, 2, 5, 7, 16, {}),
    (1, 2, 1, 7, 5, 8, {"causal": True}),
    (1, 2, 2, 9, 9, 16, {"window_size": (2, 1)}),
    (1, 3, 3, 6, 6, 24, {"causal": True, "softmax_scale": 0.3}),
    (2, 2, 1, 5, 6, 16, {"dropout_p": 0.25, "seed": 5}),
]


def _sdpa64(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), dropout_p=0.0, seed=None):
    """torch's SDPA in float64 with the band as a boolean mask (bottom-right aligned) and dropout as ours."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = attention_twin.visible(q.shape[2], k.shape[2], causal=causal, window_size=window_size, device=q.device)
    if dropout_p:
        keep = attention_twin.attention_keep_mask(q.shape[0], q.shape[1], q.shape[2], k.shape[2], dropout_p, seed,
                                                  device=q.device)
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        p = torch.softmax((q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")), -1)
        return (p * keep * attention_twin.attention_keep_scale(dropout_p)) @ v
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale)


@pytest.mark.parametrize(("path", "dtype"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize(("b", "hq", "hkv", "sq", "sk", "d", "kw"), ATTENTION_CASES, ids=str)
def test_attention_on_both_cpu_paths(path, dtype, b, hq, hkv, sq, sk, d, kw):
    device, context = _where(path)
    g = torch.Generator().manual_seed(3)

    def tensor(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    # q as a (B, S, H, D) buffer viewed as (B, H, S, D): strided like a model's projections
    q = tensor(b, sq, hq, d).transpose(1, 2).requires_grad_(True)
    k, v = tensor(b, hkv, sk, d).requires_grad_(True), tensor(b, hkv, sk, d).requires_grad_(True)
    do = tensor(b, hq, sq, d)
    with context:
        o, lse = flash_attention(q, k, v, return_lse=True, **kw)
        grads = torch.autograd.grad(o, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o64 = _sdpa64(q64, k64, v64, **kw)
    expected = [o64, *torch.autograd.grad(o64, (q64, k64, v64), do.double())]
    tol = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 2e-5}[dtype]
    for got, want in zip([o, *grads], expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    scale = kw.get("softmax_scale", d**-0.5)
    mask = attention_twin.visible(sq, sk, causal=kw.get("causal", False), window_size=kw.get("window_size", (-1, -1)),
                                  device=device)
    scores = (q64 @ k64.repeat_interleave(hq // hkv, 1).transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1).detach(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("path", "dtype"), PATHS, ids=PATH_IDS)
def test_packed_attention_on_both_cpu_paths(path, dtype):
    device, context = _where(path)
    g = torch.Generator().manual_seed(4)
    lengths_q, lengths_k = [3, 0, 5], [4, 2, 5]
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 4, 6, 11], dtype=torch.int32, device=device)
    q = torch.randn(8, 4, 16, generator=g).to(device, dtype)
    k, v = (torch.randn(11, 2, 16, generator=g).to(device, dtype) for _ in range(2))
    with context:
        o = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    tol = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 2e-5}[dtype]
    for i in range(3):
        qs = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)[None]
        ks, vs = (t[cu_k[i]:cu_k[i + 1]].transpose(0, 1)[None] for t in (k, v))
        expected = _sdpa64(qs, ks, vs, causal=True)[0].transpose(0, 1)
        torch.testing.assert_close(o[cu_q[i]:cu_q[i + 1]].double(), expected, rtol=tol, atol=tol)


# --- float64 ---------------------------------------------------------------------------------------------

def _f64(*shape, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_(grad)


def _grads_f64(out, inputs):
    return torch.autograd.grad(out, inputs, torch.ones_like(out))


def test_float64_is_taken_where_torch_takes_it_and_computed_in_float64():
    """Every function takes float64 (on the device path too: the twin runs it, in float64), and equals torch's
    float64 op to float64 rounding, forward and backward."""
    exact = {"rtol": 1e-10, "atol": 1e-12}
    x, w, b = _f64(6, 32), _f64(32, seed=1), _f64(32, seed=2)
    for ours, theirs, inputs in ((lambda: layer_norm(x, (32,), w, b), lambda: F.layer_norm(x, (32,), w, b), (x, w, b)),
                                 (lambda: rms_norm(x, (32,), w), lambda: F.rms_norm(x, (32,), w), (x, w))):
        y, y_torch = ours(), theirs()
        assert y.dtype == torch.float64
        torch.testing.assert_close(y, y_torch, **exact)
        for got, want in zip(_grads_f64(y, inputs), _grads_f64(y_torch, inputs), strict=True):
            torch.testing.assert_close(got, want, **exact)
    q, k, v = _f64(1, 4, 9, 16), _f64(1, 2, 11, 16, seed=1), _f64(1, 2, 11, 16, seed=2)
    o = flash_attention(q, k, v, causal=True)
    o_torch = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                             attn_mask=attention_twin.visible(9, 11, causal=True, device=DEVICE))
    assert o.dtype == torch.float64
    torch.testing.assert_close(o, o_torch, **exact)
    for got, want in zip(_grads_f64(o, (q, k, v)), _grads_f64(o_torch, (q, k, v)), strict=True):
        torch.testing.assert_close(got, want, **exact)
    y = dropout(x, 0.3, seed=5)
    keep = dropout_twin.keep_mask(x.numel(), 0.3, 5, device=x.device).reshape(x.shape)
    assert y.dtype == torch.float64 and torch.equal(y, torch.where(keep, x * (1 / 0.7), 0.0))
    y, residual_out = add_dropout_norm(x, x.detach() * 0.5, w, b, dropout_p=0.3, seed=5)
    torch.testing.assert_close(residual_out, torch.where(keep, x * (1 / 0.7), 0.0) + x.detach() * 0.5, **exact)
    torch.testing.assert_close(y, F.layer_norm(residual_out, (32,), w, b), **exact)


def test_float64_modules_and_a_swapped_float64_model():
    """``replace_modules`` never breaks a float64 model: its forward, eval or training, equals torch's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Dropout(0.1),
                                torch.nn.RMSNorm(16)).double().to(DEVICE)
    x = _f64(3, 16, grad=False)
    expected = model.eval()(x)
    replaced = kernels.replace_modules(model)
    assert len(replaced) == 3
    torch.testing.assert_close(model.eval()(x), expected, rtol=1e-10, atol=1e-12)
    assert model.train()(x).dtype == torch.float64
    assert Dropout(0.1).double().eval()(x) is x
    m = AddDropoutNorm(16, kind="rms").double().to(DEVICE)
    y, _ = m(x)
    torch.testing.assert_close(y, F.rms_norm(x, (16,), m.weight), rtol=1e-10, atol=1e-12)


def test_add_dropout_norm_defaults_to_each_norms_eps():
    """``eps=None`` (the default) is LayerNorm's 1e-5 and RMSNorm's rule, as the module's default: on rows of RMS 0.03
    an eps of 1e-5 instead of 1.2e-7 moves an RMSNorm output by about 0.5%."""
    x = _small_rows(5, 64, dtype=torch.float32, device=DEVICE)
    y_rms, _ = add_dropout_norm(x, kind="rms")
    torch.testing.assert_close(y_rms, F.rms_norm(x, (64,)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(AddDropoutNorm(64, kind="rms").to(DEVICE)(x)[0], y_rms, rtol=0, atol=0)
    y_layer, _ = add_dropout_norm(x)
    torch.testing.assert_close(y_layer, F.layer_norm(x, (64,)), rtol=1e-5, atol=1e-5)
