"""The three families inside the way people train: autocast, CUDA graphs, activation checkpointing."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels._common import cpu_runs_reference
from kernels._mode import DEVICE, INTERPRETER
from kernels.attention import flash_attention, flash_attention_varlen, flash_attention_with_kvcache
from kernels.dropout import dropout
from kernels.layernorm import add_dropout_norm, layer_norm, rms_norm

AUTOCAST_DTYPE = torch.bfloat16


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

    def fp8(*shape):
        return rand(*shape).to(torch.float8_e4m3fn)

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
        # the opaque ops of compiled calls that run the twin (kernels._common.opaque), on any device
        ("norm_fwd_twin", (x.detach(), w.detach(), b.detach(), 1e-5, False)),
        ("norm_fwd_twin", (x.detach(), None, None, 1e-6, True)),
        ("norm_bwd_twin", (rand(8, 32), x.detach(), w.detach(), mean, rstd, False, True)),
        ("dropout_twin", (rand(300), 0.3, 5, None)),
        ("dropout_twin", (rand(300), 0.6, 0, seed_tensor)),
        ("add_dropout_norm_fwd_twin", (x.detach(), rand(8, 32), w.detach(), b.detach(), 1e-5, False, 0.2, 5, None,
                                       torch.float32, torch.bfloat16)),
        ("add_dropout_norm_bwd_twin", (rand(8, 32), rand(8, 32), x.detach(), w.detach(), 1e-6, True, 0.2, 5, None,
                                       torch.float32, True)),
        ("flash_attn_fwd_twin", (q.detach(), k.detach(), v.detach(), -1, 0, 0.2, 0.1, 9, None, None, None, 0, 0)),
        ("flash_attn_bwd_twin", (rand(1, 2, 40, 32), q.detach(), k.detach(), v.detach(), o.detach(), lse, -1, 0, 0.2,
                                 0.1, 9, None, None, None)),
        # the KV-cache call under torch.compile (it writes the caches), on any device
        ("flash_attn_kvcache", (rand(2, 4, 1, 32), rand(2, 2, 16, 32), rand(2, 2, 16, 32),
                                torch.tensor([3, 9], dtype=torch.int32, device=DEVICE), rand(2, 2, 1, 32),
                                rand(2, 2, 1, 32), None, -1, 0, 0.2, True)),
        # an FP8 cache: its scales as values, then as per-head tensors
        ("flash_attn_kvcache", (rand(2, 4, 1, 32), fp8(2, 2, 16, 32), fp8(2, 2, 16, 32),
                                torch.tensor([3, 9], dtype=torch.int32, device=DEVICE), rand(2, 2, 1, 32),
                                rand(2, 2, 1, 32), None, -1, 0, 0.2, True, 0.5, 0.25)),
        ("flash_attn_kvcache", (rand(2, 4, 1, 32), fp8(2, 2, 16, 32), fp8(2, 2, 16, 32),
                                torch.tensor([3, 9], dtype=torch.int32, device=DEVICE), rand(2, 2, 1, 32),
                                rand(2, 2, 1, 32), None, -1, 0, 0.2, False, 1.0, 1.0,
                                torch.full((2,), 0.5, device=DEVICE), torch.full((2,), 0.25, device=DEVICE))),
    ]


@pytest.mark.cuda
def test_every_registered_op_passes_opcheck():
    """``torch.library.opcheck`` (schema, fake implementation, autograd registration, AOT dispatch) on each
    op of the ``fused_kernels`` namespace, every one of which the cases must cover."""
    cases = _opcheck_cases()
    registered = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fused_kernels::")}
    assert registered == {name for name, _ in cases}
    for name, args in cases:
        # torch's schema checker compares an argument before and after with a multiplication that fp8 tensors
        # lack, so an FP8 cache's call is checked without it (its fake, autograd and AOT dispatch still are)
        fp8 = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic") if fp8 else None
        kwargs = {} if utils is None else {"test_utils": utils}
        torch.library.opcheck(getattr(torch.ops.fused_kernels, name).default, args, **kwargs)


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


# --- torch.compile on the CPU twin path ---------------------------------------------------------------------

def _cpu(*shape, seed=0, grad=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)


def _twin_cases():
    """name -> (function, its CPU inputs): every public function, forward (and backward where it has one)."""
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)

    def kvcache(q, k_cache, v_cache, k, v):  # the caches are written in place: the test compares the inputs after
        lengths = torch.tensor([4, 9], dtype=torch.int32)
        return flash_attention_with_kvcache(q, k_cache, v_cache, lengths, k=k, v=v, causal=True)

    def inplace_dropout(x):
        y = x * 1.0
        dropout(y, 0.3, seed=4, inplace=True)
        return y

    return {
        "flash_attention": (lambda q, k, v: flash_attention(q, k, v, causal=True, dropout_p=0.2, seed=3),
                            (_cpu(1, 4, 9, 16), _cpu(1, 2, 11, 16, seed=1), _cpu(1, 2, 11, 16, seed=2))),
        "flash_attention_varlen": (lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, 5, 5, causal=True),
                                   (_cpu(8, 4, 16), _cpu(8, 2, 16, seed=1), _cpu(8, 2, 16, seed=2))),
        "flash_attention_with_kvcache": (kvcache, (_cpu(2, 4, 1, 16, grad=False), _cpu(2, 2, 12, 16, grad=False),
                                                   _cpu(2, 2, 12, 16, seed=1, grad=False),
                                                   _cpu(2, 2, 1, 16, seed=2, grad=False),
                                                   _cpu(2, 2, 1, 16, seed=3, grad=False))),
        "layer_norm": (lambda x, w, b: layer_norm(x, 32, w, b), (_cpu(6, 32), _cpu(32, seed=1), _cpu(32, seed=2))),
        "rms_norm": (lambda x, w: rms_norm(x, 32, w), (_cpu(6, 32), _cpu(32, seed=1))),
        "dropout": (lambda x: dropout(x, 0.3, seed=4), (_cpu(6, 32),)),
        "dropout inplace": (inplace_dropout, (_cpu(6, 32, grad=False),)),
        "add_dropout_norm": (lambda x, r, w: add_dropout_norm(x, r, w, kind="rms", dropout_p=0.3, seed=4),
                             (_cpu(6, 32), _cpu(6, 32, seed=1), _cpu(32, seed=2))),
        "float64 flash_attention": (lambda q, k, v: flash_attention(q, k, v, causal=True),
                                    tuple(_cpu(1, 2, 9, 16, seed=s, dtype=torch.float64) for s in range(3))),
    }


@pytest.fixture(scope="module")
def inductor_cpu_started():
    """Inductor's first CPU kernel in a process starts its C++ toolchain once (14-19 s on a 2-core CI machine, about
    a minute on a fresh GPU machine's host), whatever the op: paid here, so that the timings below are the ops'."""
    torch.compile(lambda t: t * 2.0 + 1.0, fullgraph=True)(torch.ones(3))


@pytest.mark.parametrize("name", list(_twin_cases()))
def test_compile_fullgraph_on_the_cpu_twin_path(name, inductor_cpu_started):
    """CPU tensors without the interpreter run the twin; under torch.compile(fullgraph=True) it runs as opaque ops
    (``kernels._common.opaque``): no graph break, the eager results and gradients, and a compile of well under a
    minute."""
    import time

    fn, inputs = _twin_cases()[name]
    torch._dynamo.reset()
    with cpu_runs_reference():
        eager_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        expected = fn(*eager_inputs)
        start = time.perf_counter()
        got = torch.compile(fn, fullgraph=True)(*inputs)
        elapsed = time.perf_counter() - start
        expected, got = (out if isinstance(out, tuple) else (out,) for out in (expected, got))
        for ours, theirs in zip((*got, *inputs), (*expected, *eager_inputs), strict=True):  # inputs: in-place writes
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
        grads_needed = [t for t in inputs if t.requires_grad]
        if grads_needed:
            weights = [torch.randn(t.shape, generator=torch.Generator().manual_seed(9)) for t in got]
            ours = torch.autograd.grad(got, grads_needed, weights)
            theirs = torch.autograd.grad(expected, [t for t in eager_inputs if t.requires_grad], weights)
            for a, b in zip(ours, theirs, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # the bound is for a process that has the machine to itself (CI's), not the GPU check's shards side by side
    if not os.environ.get("FK_TEST_SHARD"):
        assert elapsed < 60, f"compiling {name} took {elapsed:.0f} s"


def test_compiled_ops_fed_by_the_graphs_own_tensors_match_eager():
    """Every family inside arithmetic that the compiled graph computes itself, on this mode's device: on CPU tensors a
    compiled call runs the twin (the interpreter, traced into the graph, computed NaN from inductor's buffers)."""
    g = torch.Generator().manual_seed(0)
    x, w, gain = (torch.randn(*s, generator=g).to(DEVICE) for s in ((6, 64), (64, 64), (64,)))

    def f(x, w, gain):
        h = F.linear(x, w) * 2.0
        h = rms_norm(h, 64, gain) + layer_norm(h, 64)
        h = dropout(h, 0.25, seed=5) + 1.0
        q = h.view(6, 4, 16).transpose(0, 1)[None]
        return flash_attention(q, q * 0.5, q, causal=True).sum(-1) + add_dropout_norm(h, h, gain, kind="rms")[0][0, 0]

    expected = f(x, w, gain)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(x, w, gain)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_compile_fullgraph_kvcache_on_the_device_path():
    """The KV-cache op under torch.compile on this mode's device: the caches are written as in eager."""
    q, k_cache, v_cache, k, v = (t.to(DEVICE) for t in _twin_cases()["flash_attention_with_kvcache"][1])
    lengths = torch.tensor([4, 9], dtype=torch.int32, device=DEVICE)
    eager_k_cache, eager_v_cache = k_cache.clone(), v_cache.clone()
    expected = flash_attention_with_kvcache(q, eager_k_cache, eager_v_cache, lengths, k=k, v=v, return_lse=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: flash_attention_with_kvcache(*a, k=k, v=v, return_lse=True), fullgraph=True)
    got = compiled(q, k_cache, v_cache, lengths)
    for ours, theirs in zip((*got, k_cache, v_cache), (*expected, eager_k_cache, eager_v_cache), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# --- a GPU that is not the current one ------------------------------------------------------------------------

def _every_op_forward_and_backward(device: str) -> list[torch.Tensor]:
    """Every public op on ``device``, forward and backward, bf16 at sizes that take the Hopper kernels where there
    are some (attention at S 2048 D 128, norms 65536 wide), deterministic where a reduction order could differ."""
    g = torch.Generator().manual_seed(0)

    def make(*shape, grad=True, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_(grad)

    results = []

    def grads(outputs, inputs):
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        weights = tuple(torch.randn(o.shape, generator=g).to(device, o.dtype) for o in outputs)
        results.extend(o.detach() for o in outputs)
        results.extend(torch.autograd.grad(outputs, inputs, weights))

    q, k, v = make(1, 4, 2048, 128), make(1, 2, 2048, 128), make(1, 2, 2048, 128)
    grads(flash_attention(q, k, v, causal=True, deterministic=True), (q, k, v))
    grads(flash_attention(q, k, v, dropout_p=0.1, seed=5, deterministic=True), (q, k, v))
    qp, kp, vp = make(300, 4, 64), make(300, 2, 64), make(300, 2, 64)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32, device=device)
    grads(flash_attention_varlen(qp, kp, vp, cu, cu, 200, 200, causal=True), (qp, kp, vp))
    with torch.no_grad():
        k_cache, v_cache = make(2, 2, 4096, 128, grad=False), make(2, 2, 4096, 128, grad=False)
        lengths = torch.tensor([1000, 3000], dtype=torch.int32, device=device)
        results.append(flash_attention_with_kvcache(make(2, 4, 1, 128, grad=False), k_cache, v_cache, lengths,
                                                    k=make(2, 2, 1, 128, grad=False),
                                                    v=make(2, 2, 1, 128, grad=False)))
        results.extend((k_cache, v_cache))
    for n in (1024, 65536):
        x, w, b = make(64, n), make(n), make(n)
        grads(layer_norm(x, n, w, b, deterministic=True), (x, w, b))
        grads(rms_norm(x, n, w, deterministic=True), (x, w))
        grads(add_dropout_norm(x, x.detach() * 0.5, w, b, dropout_p=0.1, seed=3, deterministic=True), (x, w, b))
    grads(dropout(x, 0.3, seed=7), (x,))
    return [t.cpu() for t in results]


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETER or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_every_op_runs_on_its_tensors_gpu_whichever_is_current():
    """Tensors on cuda:1 while cuda:0 is current: the same results as with cuda:1 current, and cuda:0 still current
    afterwards (torch's own ops do not care which device is current; a model spread over GPUs calls them so)."""
    torch.cuda.set_device(1)
    expected = _every_op_forward_and_backward("cuda:1")
    torch.cuda.set_device(0)
    got = _every_op_forward_and_backward("cuda:1")
    assert torch.cuda.current_device() == 0
    assert len(got) == len(expected)
    for i, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(ours, theirs), f"result {i} differs"


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETER or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_two_gpus_get_a_clear_error():
    a, b = torch.randn(2, 2, 64, 64, device="cuda:0"), torch.randn(2, 2, 64, 64, device="cuda:1")
    cu = torch.tensor([0, 64], dtype=torch.int32, device="cuda:0")
    calls = [
        lambda: flash_attention(a, a, b),
        lambda: flash_attention_varlen(a[0].transpose(0, 1), a[0].transpose(0, 1), a[0].transpose(0, 1), cu,
                                       cu.to("cuda:1"), 64, 64),
        lambda: flash_attention_with_kvcache(a[:, :, :1], b, b, torch.tensor([3, 4], dtype=torch.int32,
                                                                             device="cuda:0")),
        lambda: layer_norm(a, 64, b[0, 0, 0]),
        lambda: rms_norm(a, 64, b[0, 0, 0]),
        lambda: add_dropout_norm(a, b),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"is on cuda:\d but \w+ is on cuda:\d"):
            call()


def test_autocast_casts_every_input_of_a_planned_call():
    """A call that repeats a signature takes its stored plan; under autocast it still casts whichever of q, k, v is
    not yet in the autocast dtype (here q is, k and v are not)."""
    q = torch.randn(1, 2, 16, 32, device=DEVICE).to(AUTOCAST_DTYPE)
    k, v = (torch.randn(1, 2, 16, 32, device=DEVICE) for _ in range(2))
    with torch.autocast(torch.device(DEVICE).type, dtype=AUTOCAST_DTYPE):
        first = flash_attention(q, k, v, causal=True)
        again = flash_attention(q, k, v, causal=True)
    assert first.dtype == again.dtype == AUTOCAST_DTYPE
    assert torch.equal(first, again)
