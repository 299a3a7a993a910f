"""LayerNorm / RMSNorm benchmarks, forward and backward separately.

Two sweeps (the family's speed targets are stated on both):
- ``classic``: M = 4096 rows, N = 1024 ... 16384, fp16 and bf16, providers ours, torch, torch.compile,
  apex ``FusedLayerNorm``/``FusedRMSNorm`` (when ``import apex`` works; build it from source with its
  ``--cpp_ext --cuda_ext`` options), Liger (when ``liger_kernel`` imports).
- ``bandwidth``: M * N = 2**27 elements, N = 256 ... 65536, bf16, ours and torch.

Each record says how it was timed (``timing``): "host", CUDA events around calls issued from Python as a
model issues them (``do_bench``, L2 flushed), so a provider's host path counts wherever it is longer than its
kernels; "device", the classic sweep again replayed from a CUDA graph (no host work; inputs cycled through
enough copies to miss L2), which is what the kernels themselves take. At M = 4096 the kernels run for a few
microseconds, so the two differ by the providers' host costs.

Bytes counted: forward 2 * M * N * elt (read x, write y), backward 3 * M * N * elt (read x and dy, write
dx); the weight, bias and statistics are small and not counted.

``add-dropout-norm``: the fused residual + dropout + norm against torch's dropout, add and norm (eager and
compiled), M * N = 2**27, N = 512 ... 16384, bf16 and fp16, dropout 0.1 and 0 (bytes: see the test).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from benchmarks._harness import SMOKE, graph_ms
from kernels._mode import DEVICE
from kernels.layernorm import add_dropout_norm, layer_norm, rms_norm

PROVIDERS = ["ours", "torch", "torch.compile", "apex", "liger"]
LN_EPS, RMS_EPS = 1e-5, 1e-6


def _points():
    if SMOKE:
        return [("classic", 64, n, torch.float32) for n in (64, 1000)]
    classic_n = (1024, 2048, 4096, 8192, 16384)
    bandwidth_n = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
    points = [("classic", 4096, n, dt) for dt in (torch.float16, torch.bfloat16) for n in classic_n]
    points += [("bandwidth", (1 << 27) // n, n, torch.bfloat16) for n in bandwidth_n]
    return points


@functools.cache
def _compiled(kind: str):
    if kind == "layer":
        return torch.compile(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, LN_EPS), dynamic=False)
    return torch.compile(lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w, RMS_EPS), dynamic=False)


def _peer_module(provider: str, kind: str, n: int, dtype):
    if provider == "apex":
        apex_norm = pytest.importorskip("apex.normalization", reason="apex is not installed (build it from source)")
        cls = apex_norm.FusedLayerNorm if kind == "layer" else apex_norm.FusedRMSNorm
        return cls(n, eps=LN_EPS if kind == "layer" else RMS_EPS).to(DEVICE, dtype)
    liger = pytest.importorskip("liger_kernel.transformers", reason="liger-kernel is not installed")
    if kind == "layer":
        return liger.LigerLayerNorm(n, eps=LN_EPS, bias=True).to(DEVICE, dtype)
    return liger.LigerRMSNorm(n, eps=RMS_EPS, in_place=False).to(DEVICE, dtype)


def _provider_fn(provider: str, kind: str, n: int, dtype):
    """``(fn(x, w, b), owns_affine)``: peers given as modules hold their own weight (and bias)."""
    if provider == "ours":
        if kind == "layer":
            return (lambda x, w, b: layer_norm(x, n, w, b, LN_EPS)), None
        return (lambda x, w, b: rms_norm(x, n, w, RMS_EPS)), None
    if provider == "torch":
        if kind == "layer":
            return (lambda x, w, b: F.layer_norm(x, (n,), w, b, LN_EPS)), None
        return (lambda x, w, b: F.rms_norm(x, (n,), w, RMS_EPS)), None
    if provider == "torch.compile":
        if SMOKE:
            pytest.skip("torch.compile is not run in smoke mode")
        return _compiled(kind), None
    module = _peer_module(provider, kind, n, dtype)
    return (lambda x, w, b: module(x)), list(module.parameters())


def _norm_instance(fn, module_params, m: int, n: int, dtype, direction: str):
    """One instance of a point: its own inputs and ``(run, grad_to_none)``. The backward's run is
    ``y.backward(dy)`` with the gradients reset by the timer (host timing) or ``torch.autograd.grad``, which
    accumulates nothing (device timing: a graph replays the calls without resetting anything)."""
    x = torch.randn(m, n, device=DEVICE, dtype=dtype)
    w = torch.rand(n, device=DEVICE, dtype=dtype) + 0.5
    b = torch.randn(n, device=DEVICE, dtype=dtype)
    if direction == "fwd":
        return functools.partial(fn, x, w, b), None, None
    params = [x, w, b] if module_params is None else [x]
    for t in params:
        t.requires_grad_(True)
    y = fn(x, w, b)
    dy = torch.randn_like(y)
    inputs = params + (module_params or [])
    grads_only = lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True, allow_unused=True)  # RMS: no bias
    return (lambda: y.backward(dy, retain_graph=True)), inputs, grads_only


@pytest.mark.parametrize("timing", ["host", "device"])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(("sweep", "m", "n", "dtype"), _points(), ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_norm(measure, recorder, provider, sweep, m, n, dtype, kind, direction, timing):
    """``timing``: "host", CUDA events around calls issued from Python (the host's work counts where it is
    longer than the kernels'); "device", CUDA-graph replay (``benchmarks._harness.graph_ms``), the classic
    sweep only: at M = 4096 the kernels take a few microseconds, less than any provider's host path."""
    if sweep == "bandwidth" and provider not in ("ours", "torch"):
        pytest.skip("the bandwidth sweep compares ours with torch only")
    if sweep == "bandwidth" and timing == "device":
        pytest.skip("the bandwidth sweep is device-bound: host timing is device timing there")
    fn, module_params = _provider_fn(provider, kind, n, dtype)
    elt = torch.tensor([], dtype=dtype).element_size()
    moved = (2 if direction == "fwd" else 3) * m * n * elt
    fields = dict(family="layernorm", provider=provider, direction=direction, dtype=dtype,
                  shape={"sweep": sweep, "timing": timing, "kind": kind, "M": m, "N": n}, x_key="N",
                  bytes_moved=moved)
    if timing == "host":
        run, grad_to_none, _ = _norm_instance(fn, module_params, m, n, dtype, direction)
        measure(run, grad_to_none=grad_to_none, **fields)
        return

    def make_run():
        run, _, grads_only = _norm_instance(fn, module_params, m, n, dtype, direction)
        return grads_only or run

    recorder.add(ms=graph_ms(make_run, touched_bytes=moved), **fields)


def _add_dropout_norm_points():
    if SMOKE:
        return [(64, 256, torch.float32)]
    return [((1 << 27) // n, n, dt) for dt in (torch.bfloat16, torch.float16) for n in (512, 1024, 2048, 4096, 8192,
                                                                                        16384)]


def _torch_block(x, residual, w, b, kind: str, p: float):
    """The composition the fused op replaces: dropout, add, norm (``(y, residual_out)``)."""
    residual_out = F.dropout(x, p) + residual
    n = x.shape[-1]
    if kind == "layer":
        return F.layer_norm(residual_out, (n,), w, b, LN_EPS), residual_out
    return F.rms_norm(residual_out, (n,), w, RMS_EPS), residual_out


@functools.cache
def _compiled_block(kind: str, p: float):
    return torch.compile(functools.partial(_torch_block, kind=kind, p=p), dynamic=False)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("dropout", [0.1, 0.0])
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(("m", "n", "dtype"), _add_dropout_norm_points(), ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("provider", ["ours", "torch", "torch.compile"])
def test_add_dropout_norm(measure, provider, m, n, dtype, kind, dropout, direction):
    """Residual + dropout + norm at M * N = 2**27: ours (one kernel each way) against torch's three ops,
    eager and compiled. Bytes that must move: forward reads x and the residual and writes residual_out and
    y (4 * M * N * elt); backward reads dy, d(residual_out) and residual_out and writes dx and the residual's
    gradient (5 * M * N * elt). Nothing else is counted (torch's saved mask is its own cost)."""
    if provider == "torch.compile" and SMOKE:
        pytest.skip("torch.compile is not run in smoke mode")
    x, residual = (torch.randn(m, n, device=DEVICE, dtype=dtype) for _ in range(2))
    w = torch.rand(n, device=DEVICE, dtype=dtype) + 0.5
    b = torch.randn(n, device=DEVICE, dtype=dtype) if kind == "layer" else None
    if provider == "ours":
        fn = lambda a, r: add_dropout_norm(a, r, w, b, kind=kind, eps=LN_EPS if kind == "layer" else RMS_EPS,
                                           dropout_p=dropout)
    elif provider == "torch":
        fn = lambda a, r: _torch_block(a, r, w, b, kind, dropout)
    else:
        compiled = _compiled_block(kind, dropout)
        fn = lambda a, r: compiled(a, r, w, b)
    elt = x.element_size()
    if direction == "fwd":
        run, grad_to_none, moved = functools.partial(fn, x, residual), None, 4 * m * n * elt
    else:
        params = [t for t in (x, residual, w, b) if t is not None]
        for t in params:
            t.requires_grad_(True)
        y, residual_out = fn(x, residual)
        dy, dr = torch.randn_like(y), torch.randn_like(residual_out)
        run = lambda: torch.autograd.backward((y, residual_out), (dy, dr), retain_graph=True)
        grad_to_none, moved = params, 5 * m * n * elt
    measure(run, grad_to_none=grad_to_none, family="add-dropout-norm", provider=provider, direction=direction,
            dtype=dtype, shape={"kind": kind, "dropout": dropout, "M": m, "N": n}, x_key="N", bytes_moved=moved)
