"""Property-based tests: each kernel against its twin over shapes, strides, dtypes and parameters drawn
by hypothesis. Bounded in the interpreter (few, small examples); wider on CUDA. ``derandomize=True``
makes the examples a fixed function of the test, so a failure in CI reproduces on the next run."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import reference.attention as attention_twin
import reference.dropout as dropout_twin
import reference.layernorm as layernorm_twin
from kernels._mode import DEVICE, FLOAT_DTYPES, by_mode
from kernels.attention import flash_attention
from kernels.dropout import dropout
from kernels.layernorm import layer_norm, rms_norm

EXAMPLES = by_mode(interpreter=12, cuda=60)
MAX_SIDE = by_mode(interpreter=70, cuda=700)
MAX_ELEMENTS = by_mode(interpreter=20_000, cuda=4_000_000)  # the twin's int64 Philox temporaries stay small
PROFILE = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _tensor(shape, dtype, seed, *, transpose=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g).to(DEVICE, dtype)
    return t.transpose(-1, -2) if transpose and t.dim() >= 2 else t


@PROFILE
@given(
    shape=st.lists(st.integers(0, MAX_SIDE), min_size=1, max_size=3),
    p=st.floats(0.01, 0.99),
    seed=st.integers(0, 2**64 - 1),
    dtype=st.sampled_from(FLOAT_DTYPES),
    transpose=st.booleans(),
    step=st.integers(1, 3),
)
def test_dropout_kernel_equals_twin(shape, p, seed, dtype, transpose, step):
    assume(math.prod(shape) <= MAX_ELEMENTS)
    x = _tensor(shape, dtype, seed % 1000, transpose=transpose)[..., ::step]
    assert torch.equal(dropout(x, p, seed=seed), dropout_twin.dropout(x, p, seed=seed))


@PROFILE
@given(
    m=st.integers(1, 40),
    n=st.integers(1, MAX_SIDE * 4),
    rms=st.booleans(),
    affine=st.sampled_from(["none", "weight", "both"]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    seed=st.integers(0, 1000),
    layout=st.sampled_from(["contiguous", "row-strided", "transposed"]),
    deterministic=st.booleans(),
)
def test_norm_kernel_is_close_to_twin(m, n, rms, affine, dtype, seed, layout, deterministic):
    x = {"contiguous": lambda: _tensor((m, n), dtype, seed),
         "row-strided": lambda: _tensor((m, n + 5), dtype, seed)[:, 2:n + 2],  # rows n + 5 apart
         "transposed": lambda: _tensor((n, m), dtype, seed).t()}[layout]() * 3 + 1
    w = _tensor((n,), dtype, seed + 1) if affine != "none" else None
    b = _tensor((n,), dtype, seed + 2) if affine == "both" and not rms else None
    dy = _tensor((m, n), dtype, seed + 3)
    xl, wl, bl = (None if t is None else t.detach().requires_grad_(True) for t in (x, w, b))
    leaves = [t for t in (xl, wl, bl) if t is not None]
    if rms:
        got = rms_norm(xl, n, wl, 1e-6, deterministic=deterministic)
        y, rstd = layernorm_twin.rms_norm_forward(x, w, 1e-6)
        dx, dw = layernorm_twin.rms_norm_backward(dy, x, w, rstd)
        db = None
    else:
        got = layer_norm(xl, n, wl, bl, 1e-5, deterministic=deterministic)
        y, mean, rstd = layernorm_twin.layer_norm_forward(x, w, b, 1e-5)
        dx, dw, db = layernorm_twin.layer_norm_backward(dy, x, w, mean, rstd)
    expected_grads = [dx] + [g for g, t in ((dw, w), (db, b)) if t is not None]
    grads = torch.autograd.grad(got, leaves, dy)
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(got, y.to(got.dtype), rtol=tol, atol=tol)
    for g, e in zip(grads, expected_grads, strict=True):
        # dW/dB sum over m rows: the tolerance grows with the row count
        torch.testing.assert_close(g, e.to(g.dtype), rtol=tol, atol=tol * max(1, m) ** 0.5 * 4)


# One hypothesis run per dtype, each a third of the examples: every example compiles kernels of its own shape (the
# GPU suite's slowest test), and three runs spread over the shards that run side by side.
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@settings(PROFILE, max_examples=max(1, EXAMPLES // len(FLOAT_DTYPES)))
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    sq=st.integers(1, by_mode(interpreter=80, cuda=300)),
    sk=st.integers(1, by_mode(interpreter=80, cuda=300)),
    d=st.sampled_from([8, 16, 24, 40, 64]),
    causal=st.booleans(),
    window=st.tuples(st.integers(-1, 40), st.integers(-1, 40)),
    dropout_p=st.sampled_from([0.0, 0.0, 0.3]),
    seed=st.integers(0, 1000),
    bshd=st.booleans(),
)
def test_attention_kernel_is_close_to_twin(dtype, b, hkv, group, sq, sk, d, causal, window, dropout_p, seed, bshd):
    def make(heads, s, offset):
        if bshd:  # (B, S, H, D) memory viewed as (B, H, S, D), as a model's projections give it
            return _tensor((b, s, heads, d), dtype, seed + offset).transpose(1, 2)
        return _tensor((b, heads, s, d), dtype, seed + offset)

    q, k, v = make(hkv * group, sq, 0), make(hkv, sk, 1), make(hkv, sk, 2)
    do = _tensor((b, hkv * group, sq, d), dtype, seed + 3)
    kw = {"causal": causal, "window_size": window, "dropout_p": dropout_p, "seed": seed}
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    got, lse = flash_attention(*leaves, return_lse=True, **kw)
    grads = torch.autograd.grad(got, leaves, do)
    qf, kf, vf, dof = (t.float() for t in (q, k, v, do))
    expected, expected_lse = attention_twin.flash_attention_forward(qf, kf, vf, **kw)
    expected_grads = attention_twin.flash_attention_backward(dof, qf, kf, vf, expected, expected_lse, **kw)
    tol = {torch.float16: 1e-2, torch.bfloat16: 6e-2, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(expected_lse))
    finite = torch.isfinite(expected_lse)
    torch.testing.assert_close(lse[finite], expected_lse[finite], rtol=1e-4, atol=1e-4)
    for g, e in zip(grads, expected_grads, strict=True):
        assert g.dtype == dtype and g.shape == e.shape
        torch.testing.assert_close(g.float(), e, rtol=tol, atol=tol * 4)
