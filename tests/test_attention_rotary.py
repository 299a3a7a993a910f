"""apply_rotary: the rotary kernel against the twin ``reference.attention.apply_rotary`` and transformers' eager
composition (``x * cos + rotate_half(x) * sin``, as the peer's rounding), forward and backward, in q's layout, with
one table per sequence or one for the batch; the twin against that composition in float64; argument errors."""

from __future__ import annotations

import pytest
import torch

import reference.attention as twin
from kernels._mode import DEVICE, FLOAT_DTYPES, by_mode
from kernels.attention import apply_rotary
from tests._numerics import assert_no_worse_than_torch

ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-6}

#: (B, Hq, Hkv, S, D, one table for the batch)
CASES = by_mode(
    interpreter=[(2, 4, 2, 5, 16, False), (1, 3, 1, 7, 24, True), (2, 2, 2, 1, 8, False)],
    cuda=[(4, 16, 4, 2048, 128, False), (2, 32, 8, 1000, 64, True), (3, 5, 1, 77, 96, False), (1, 8, 8, 1, 256, True)],
)


def _eager(x, cos, sin):
    """transformers' composition, in x's dtype (every product and the sum rounded)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _inputs(b, hq, hkv, s, d, shared, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # (B, S, H, D) storage viewed as (B, H, S, D), as attention projections give them
    q = torch.randn(b, s, hq, d, generator=g).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(b, s, hkv, d, generator=g).to(DEVICE, dtype).transpose(1, 2)
    angles = torch.rand(1 if shared else b, s, d // 2, generator=g, dtype=torch.float64) * 6.3
    angles = torch.cat([angles, angles], dim=-1)  # transformers' tables repeat the frequencies
    return q, k, angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)


def test_twin_is_transformers_composition_in_float64():
    q, k, cos, sin = _inputs(2, 3, 1, 6, 16, False, torch.float64)
    torch.testing.assert_close(twin.apply_rotary(q, cos, sin), _eager(q, cos, sin), rtol=0, atol=1e-12)
    # a rotation: every row keeps its norm
    torch.testing.assert_close(twin.apply_rotary(k, cos, sin).norm(dim=-1), k.norm(dim=-1), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_the_twin_forward_and_backward(case, dtype):
    q, k, cos, sin = _inputs(*case, dtype)
    q.requires_grad_(True)
    k.requires_grad_(True)
    q_out, k_out = apply_rotary(q, k, cos, sin)
    assert q_out.dtype == dtype and q_out.shape == q.shape and q_out.stride() == q.stride()
    for name, x, out in (("q", q, q_out), ("k", k, k_out)):
        ref = twin.apply_rotary(x.detach().double(), cos.double(), sin.double())
        assert_no_worse_than_torch(name, out, _eager(x.detach(), cos, sin), ref, atol=ATOL[dtype])
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    for name, x, g, grad in (("dq", q, dq_out, dq), ("dk", k, dk_out, dk)):
        x64 = x.detach().double().requires_grad_(True)
        (ref,) = torch.autograd.grad(twin.apply_rotary(x64, cos.double(), sin.double()), x64, g.double())
        x_peer = x.detach().clone().requires_grad_(True)
        (peer,) = torch.autograd.grad(_eager(x_peer, cos, sin), x_peer, g)
        assert_no_worse_than_torch(name, grad, peer, ref, atol=ATOL[dtype])


def test_tables_that_require_grad_are_differentiated():
    q, k, cos, sin = _inputs(1, 2, 1, 4, 8, True, torch.float32)
    cos.requires_grad_(True)
    q_out, _ = apply_rotary(q, k, cos, sin)
    (dcos,) = torch.autograd.grad(q_out.sum(), cos)
    cos64 = cos.detach().double().requires_grad_(True)
    (ref,) = torch.autograd.grad(twin.apply_rotary(q.double(), cos64, sin.double()).sum(), cos64)
    torch.testing.assert_close(dcos.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("change", "error", "words"), [
    ({"d": 7}, ValueError, "even"),
    ({"cos_shape": (2, 3, 8)}, ValueError, "cos and sin must be"),
    ({"q_dim": 3}, ValueError, "4-D"),
    ({"sin_shape": (2, 5, 8)}, ValueError, "same shape"),
    ({"int_q": True}, TypeError, "q"),
])
def test_bad_arguments_are_named(change, error, words):
    d = change.get("d", 8)
    q = torch.randn(2, 3, 5, d, device=DEVICE)
    k = torch.randn(2, 1, 5, d, device=DEVICE)
    cos = torch.randn(*change.get("cos_shape", (1, 5, d)), device=DEVICE)
    sin = torch.randn(*change.get("sin_shape", cos.shape), device=DEVICE)
    if change.get("q_dim") == 3:
        q = q[0]
    if change.get("int_q"):
        q = q.int()
    with pytest.raises(error, match=words):
        apply_rotary(q, k, cos, sin)


def test_compiled_call_fuses_the_twin_and_matches():
    q, k, cos, sin = _inputs(2, 4, 2, 9, 16, False, torch.float32)
    torch._dynamo.reset()
    got = torch.compile(apply_rotary, fullgraph=True)(q, k, cos, sin)
    for out, ref in zip(got, apply_rotary(q, k, cos, sin), strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
