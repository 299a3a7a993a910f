"""The three families inside the way people train: autocast, CUDA graphs, activation checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels._mode import DEVICE, INTERPRETER
from kernels.attention import flash_attention
from kernels.dropout import dropout
from kernels.layernorm import add_dropout_norm, layer_norm, rms_norm

# The interpreter runs on numpy, which has no bf16: CPU autocast to fp16 there.
AUTOCAST_DTYPE = torch.float16 if INTERPRETER else torch.bfloat16


def _pairs():
    """(name, ours, torch's) for each public function, on fp32 inputs made by ``_inputs``."""
    return [
        ("layer_norm", lambda x, w, b: layer_norm(x, 64, w, b), lambda x, w, b: F.layer_norm(x, (64,), w, b)),
        ("rms_norm", lambda x, w: rms_norm(x, 64, w), lambda x, w: F.rms_norm(x, (64,), w)),
        ("attention", lambda q, k, v: flash_attention(q, k, v, causal=True),
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        # a branch from a Linear (autocast: low precision) into the fp32 residual stream, then the norm
        ("add_dropout_norm", lambda x, r, w, b: add_dropout_norm(F.linear(x, w.diag()), r, w, b)[0],
         lambda x, r, w, b: F.layer_norm(F.linear(x, w.diag()) + r, (64,), w, b)),
    ]


def _inputs(name):
    g = torch.Generator().manual_seed(0)
    shapes = {"attention": [(1, 2, 48, 32)] * 3, "layer_norm": [(6, 64), (64,), (64,)],
              "rms_norm": [(6, 64), (64,)], "add_dropout_norm": [(6, 64), (6, 64), (64,), (64,)]}[name]
    return [torch.randn(*s, generator=g).to(DEVICE).requires_grad_(True) for s in shapes]


@pytest.mark.parametrize(("name", "ours", "theirs"), _pairs(), ids=[p[0] for p in _pairs()])
def test_autocast_follows_torch(name, ours, theirs):
    """Under autocast the output dtype, the values and the gradients' dtypes are torch's."""
    device_type = torch.device(DEVICE).type
    if INTERPRETER and name != "attention":
        pytest.skip("CPU autocast leaves norms alone; nothing to cast (checked on CUDA)")
    args = _inputs(name)
    with torch.autocast(device_type, dtype=AUTOCAST_DTYPE):
        expected = theirs(*args)
        got = ours(*args)
    assert got.dtype == expected.dtype
    tol = 2e-2 if got.dtype != torch.float32 else 1e-4
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    dy = torch.randn_like(got)
    grads = torch.autograd.grad(got, args, dy)
    expected_grads = torch.autograd.grad(expected, args, dy)
    for g, e in zip(grads, expected_grads, strict=True):
        assert g.dtype == e.dtype == torch.float32  # leaves stay fp32, as with torch's ops
        torch.testing.assert_close(g, e, rtol=5 * tol, atol=5 * tol)


def test_autocast_leaves_dropout_alone():
    x = torch.randn(256, device=DEVICE)
    with torch.autocast(torch.device(DEVICE).type, dtype=AUTOCAST_DTYPE):
        assert dropout(x, 0.5, seed=1).dtype == F.dropout(x, 0.5).dtype == torch.float32


def test_checkpoint_recomputes_the_same_dropout_mask():
    """torch.utils.checkpoint restores the RNG state before recomputing: a seed=None dropout inside the block
    draws the same seed again, so the gradients equal the non-checkpointed run's exactly."""
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(8, 64, device=DEVICE, requires_grad=True)
    w = torch.randn(64, device=DEVICE, requires_grad=True)

    def block(t):
        return dropout(layer_norm(t, 64, w) * 2.0, 0.5) @ torch.ones(64, 16, device=DEVICE)

    def grads(use_checkpoint, seed=1234):
        torch.manual_seed(seed)
        y = checkpoint(block, x, use_reentrant=False) if use_checkpoint else block(x)
        return torch.autograd.grad(y.square().sum(), (x, w))

    plain, checkpointed = grads(False), grads(True)
    for a, b in zip(plain, checkpointed, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(grads(False, seed=99)[0], plain[0])  # another mask would show


def _opcheck_cases():
    """(op name, sample arguments) for every op of the namespace; gradients where the op has a backward."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(DEVICE).requires_grad_(grad)

    x, w, b = rand(8, 32, grad=True), rand(32, grad=True), rand(32, grad=True)
    mean, rstd = x.detach().mean(-1), x.detach().var(-1, unbiased=False).add(1e-5).rsqrt()
    q, k, v = (rand(1, 2, 40, 32, grad=True) for _ in range(3))
    o, lse = torch.ops.fused_kernels.flash_attn_fwd(q, k, v, -1, 0, 0.2, 0.1, 9, None, None, None, 0, 0)
    seed_tensor = torch.tensor(-3, dtype=torch.int64, device=DEVICE)
    return [
        ("dropout", (rand(300, grad=True), 0.3, 5, None)),
        ("dropout", (rand(300, grad=True), 0.6, 0, seed_tensor)),
        ("dropout_", (rand(300), 0.3, 5, None)),
        ("norm_fwd", (x, w, b, 1e-5, False, False)),
        ("norm_fwd", (x, w, None, 1e-6, True, True)),
        ("norm_bwd", (rand(8, 32), x.detach(), w.detach(), mean, rstd, False, True, False)),
        ("add_dropout_norm_fwd", (x, rand(8, 32, grad=True), w, b, 1e-5, False, 0.2, 5, None, torch.float32,
                                  torch.float32, False)),
        ("add_dropout_norm_fwd", (x, None, w, None, 1e-6, True, 0.0, 0, None, torch.float32, torch.bfloat16, True)),
        ("add_dropout_norm_bwd", (rand(8, 32), rand(8, 32), x.detach(), w.detach(), mean, rstd, 1e-5, False, True,
                                  False, 0.2, 5, None, torch.float32, True)),
        ("flash_attn_fwd", (q, k, v, -1, 0, 0.2, 0.1, 0, seed_tensor, None, None, 0, 0)),
        ("flash_attn_bwd", (rand(1, 2, 40, 32), q.detach(), k.detach(), v.detach(), o.detach(), lse, -1, 0, 0.2,
                            0.1, 9, None, None, None, 0, 0)),
        # the opaque ops of compiled calls that can take the Hopper kernels: nothing differentiates them (they run
        # inside compiled forward and backward graphs), so their inputs do not require grad
        ("flash_attn_fwd_gluon", (q.detach(), k.detach(), v.detach(), -1, 0, 0.2)),
        ("flash_attn_bwd_gluon", (rand(1, 2, 40, 32), q.detach(), k.detach(), v.detach(), o.detach(), lse, -1, 0,
                                  0.2, 0.1, 0, seed_tensor)),
    ]


@pytest.mark.cuda
def test_every_registered_op_passes_opcheck():
    """``torch.library.opcheck`` (schema, fake implementation, autograd registration, AOT dispatch) on each
    op of the ``fused_kernels`` namespace, every one of which the cases must cover."""
    cases = _opcheck_cases()
    registered = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fused_kernels::")}
    assert registered == {name for name, _ in cases}
    for name, args in cases:
        torch.library.opcheck(getattr(torch.ops.fused_kernels, name).default, args)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["dropout", "layer_norm", "rms_norm", "attention"])
def test_cuda_graph_capture_and_replay_forward_and_backward(family):
    """``make_graphed_callables`` captures the forward and the backward; replays on new inputs copied into
    the static buffers give eager's results."""
    g = torch.Generator(device="cuda").manual_seed(0)
    if family == "attention":
        fn = lambda q, k, v: flash_attention(q, k, v, causal=True)
        shapes = [(2, 4, 128, 64)] * 3
        dtype = torch.bfloat16
    else:
        w = torch.randn(256, device="cuda", generator=g)
        fn = {"dropout": lambda x: dropout(x, 0.25, seed=77),
              "layer_norm": lambda x: layer_norm(x, 256, w),
              "rms_norm": lambda x: rms_norm(x, 256, w)}[family]
        shapes = [(32, 256)]
        dtype = torch.float32
    samples = tuple(torch.randn(s, device="cuda", dtype=dtype, generator=g, requires_grad=True) for s in shapes)
    graphed = torch.cuda.make_graphed_callables(fn, samples)
    for _ in range(3):
        inputs = [torch.randn(s, device="cuda", dtype=dtype, generator=g).requires_grad_(True) for s in shapes]
        out = graphed(*inputs)
        dy = torch.randn_like(out)
        grads = torch.autograd.grad(out, inputs, dy)
        ref_inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
        ref = fn(*ref_inputs)
        ref_grads = torch.autograd.grad(ref, ref_inputs, dy)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _attention_masks_agree(q, k, v, o, dv, do):
    """o is linear in v for a fixed mask (o = A v, dv = A^T do), so <do, o> == <dv, v> exactly when the
    backward used the forward's mask; another mask would leave an O(1) gap."""
    lhs, rhs = (do.double() * o.double()).sum(), (dv.double() * v.double()).sum()
    return torch.isclose(lhs, rhs, rtol=1e-3, atol=1e-3 * float(do.abs().sum()) / do.numel() ** 0.5)


def _kept(y):
    return y != 0


@pytest.mark.cuda
def test_seedless_dropout_in_a_cuda_graph_draws_a_new_mask_on_every_replay():
    """seed=None inside capture draws the seed on the device (graph-safe RNG): each replay of the forward
    draws a new mask, and the captured backward regenerates the mask its forward drew."""
    x = torch.randn(1 << 14, device="cuda", requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(lambda t: dropout(t, 0.5) * 1.0, (x,))
    masks = []
    for _ in range(3):
        inp = torch.randn(1 << 14, device="cuda").abs().add_(0.1).requires_grad_(True)
        y = graphed(inp)
        (dx,) = torch.autograd.grad(y, inp, torch.ones_like(y))
        assert torch.equal(_kept(y), _kept(dx))
        torch.testing.assert_close(y[_kept(y)], 2 * inp.detach()[_kept(y)], rtol=0, atol=0)
        masks.append(_kept(y))
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    assert 0.45 < masks[0].float().mean().item() < 0.55


@pytest.mark.cuda
def test_seedless_attention_dropout_in_a_cuda_graph_draws_a_new_mask_on_every_replay():
    shape = (1, 2, 128, 64)
    samples = tuple(torch.randn(shape, device="cuda", requires_grad=True) for _ in range(3))
    graphed = torch.cuda.make_graphed_callables(lambda q, k, v: flash_attention(q, k, v, dropout_p=0.3), samples)
    q, k, v = (t.detach().clone().requires_grad_(True) for t in samples)
    outputs = []
    for _ in range(2):
        o = graphed(q, k, v)
        do = torch.randn_like(o)
        (dv,) = torch.autograd.grad(o, v, do)
        assert _attention_masks_agree(q, k, v, o, dv, do)
        outputs.append(o.detach().clone())
    assert not torch.equal(outputs[0], outputs[1])


@pytest.mark.cuda
def test_compiled_seedless_dropout_draws_fresh_masks_that_its_backward_reuses():
    """Under torch.compile(fullgraph=True) a seed=None call draws its seed on the device (no graph break, no
    seed baked into the graph): new masks every call, the same ones after the same torch.manual_seed."""
    f = torch.compile(lambda t: dropout(t, 0.5) * 1.0, fullgraph=True)
    x = torch.randn(1 << 14, device="cuda").abs().add_(0.1).requires_grad_(True)
    masks = []
    for _ in range(2):
        y = f(x)
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        assert torch.equal(_kept(y), _kept(dx))
        masks.append(_kept(y))
    assert not torch.equal(masks[0], masks[1])
    torch.manual_seed(3)
    first = f(x)
    torch.manual_seed(3)
    assert torch.equal(f(x), first)


@pytest.mark.cuda
def test_compiled_seedless_attention_dropout_draws_fresh_masks_that_its_backward_reuses():
    f = torch.compile(lambda q, k, v: flash_attention(q, k, v, causal=True, dropout_p=0.3), fullgraph=True)
    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", requires_grad=True) for _ in range(3))
    outputs = []
    for _ in range(2):
        o = f(q, k, v)
        do = torch.randn_like(o)
        (dv,) = torch.autograd.grad(o, v, do)
        assert _attention_masks_agree(q, k, v, o, dv, do)
        outputs.append(o.detach())
    assert not torch.equal(outputs[0], outputs[1])
