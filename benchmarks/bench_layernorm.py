"""LayerNorm / RMSNorm benchmarks, forward and backward separately.

Two sweeps (the family's speed targets are stated on both):
- ``classic``: M = 4096 rows, N = 1024 ... 16384, fp16 and bf16, providers ours, torch, torch.compile,
  apex ``FusedLayerNorm``/``FusedRMSNorm`` (when ``import apex`` works; build it from source with its
  ``--cpp_ext --cuda_ext`` options), Liger (when ``liger_kernel`` imports).
- ``bandwidth``: M * N = 2**27 elements, N = 256 ... 65536, bf16, ours and torch.

Bytes counted: forward 2 * M * N * elt (read x, write y), backward 3 * M * N * elt (read x and dy, write
dx); the weight, bias and statistics are small and not counted.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from benchmarks._harness import SMOKE
from kernels._mode import DEVICE
from kernels.layernorm import layer_norm, rms_norm

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


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(("sweep", "m", "n", "dtype"), _points(), ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_norm(measure, provider, sweep, m, n, dtype, kind, direction):
    if sweep == "bandwidth" and provider not in ("ours", "torch"):
        pytest.skip("the bandwidth sweep compares ours with torch only")
    fn, module_params = _provider_fn(provider, kind, n, dtype)
    x = torch.randn(m, n, device=DEVICE, dtype=dtype)
    w = torch.rand(n, device=DEVICE, dtype=dtype) + 0.5
    b = torch.randn(n, device=DEVICE, dtype=dtype)
    elt = x.element_size()
    if direction == "fwd":
        run = functools.partial(fn, x, w, b)
        grad_to_none = None
        moved = 2 * m * n * elt
    else:
        params = [x, w, b] if module_params is None else [x]
        for t in params:
            t.requires_grad_(True)
        y = fn(x, w, b)
        dy = torch.randn_like(y)
        run = lambda: y.backward(dy, retain_graph=True)
        grad_to_none = params + (module_params or [])
        moved = 3 * m * n * elt
    measure(
        run,
        grad_to_none=grad_to_none,
        family="layernorm",
        provider=provider,
        direction=direction,
        dtype=dtype,
        shape={"sweep": sweep, "kind": kind, "M": m, "N": n},
        x_key="N",
        bytes_moved=moved,
    )
