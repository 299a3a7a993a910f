"""Dropout benchmarks: ours vs torch eager vs torch.compile, forward and backward.

Bytes counted: 2 * n * element size (read x, write y; backward: read dy, write dx): what must move.
torch also writes a 1-byte mask in the forward and reads it in the backward; that traffic is its cost,
not counted as useful bytes. ``saved_bytes_per_element`` is measured: device memory still held after
the forward (input requiring grad), less the output, per element.

``layout`` says how the input lies in memory: ``contiguous``; ``transposed``, a 2-D ``.t()`` view; ``permuted``,
a (B, S, H, D) tensor viewed as (B, H, S, D), as attention's inputs are. The strided layouts run at
n = 2^27 (and the smallest smoke size).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from benchmarks._harness import SMOKE
from kernels._mode import DEVICE
from kernels.dropout import dropout

P = 0.5
PROVIDERS = ["ours", "torch", "torch.compile"]
DTYPES = [torch.float32, torch.float16] if SMOKE else [torch.float16, torch.bfloat16, torch.float32]
SIZES = [1 << 12, 1 << 14] if SMOKE else [1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 27, 1 << 28]
STRIDED_N = SIZES[0] if SMOKE else 1 << 27


def _input(layout: str, n: int, dtype) -> torch.Tensor:
    """``n`` elements laid out as ``layout`` says (see the module docstring)."""
    if layout == "contiguous":
        return torch.randn(n, device=DEVICE, dtype=dtype)
    if layout == "transposed":
        rows = 1 << ((n.bit_length() - 1) // 2)  # (rows, n / rows), then .t()
        return torch.randn(rows, n // rows, device=DEVICE, dtype=dtype).t()
    b, h, d = 2, 8, 64  # (B, S, H, D) -> (B, H, S, D)
    return torch.randn(b, n // (b * h * d), h, d, device=DEVICE, dtype=dtype).permute(0, 2, 1, 3)


@functools.cache
def _compiled_dropout():
    return torch.compile(lambda x: F.dropout(x, P, True), dynamic=False)


def _provider_fn(provider: str):
    if provider == "ours":
        return lambda x: dropout(x, P)
    if provider == "torch":
        return lambda x: F.dropout(x, P, True)
    if SMOKE:
        pytest.skip("torch.compile is not run in smoke mode (CPU inductor compiles; timings mean nothing)")
    return _compiled_dropout()


def _saved_bytes_per_element(fn, x: torch.Tensor) -> float | None:
    if SMOKE:
        return None
    x = x.detach().requires_grad_(True)
    fn(x)  # warm: compile, allocator pools
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = fn(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return held / x.numel()


POINTS = [("contiguous", n) for n in SIZES] + [(layout, STRIDED_N) for layout in ("transposed", "permuted")]


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize(("layout", "n"), POINTS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_dropout(measure, provider, dtype, layout, n, direction):
    fn = _provider_fn(provider)
    x = _input(layout, n, dtype)
    assert x.numel() == n and x.is_contiguous() == (layout == "contiguous")
    extra = {}
    if direction == "fwd":
        run = functools.partial(fn, x)
        grad_to_none = None
        saved = _saved_bytes_per_element(fn, x)
        if saved is not None:
            extra["saved_bytes_per_element"] = saved
    else:
        x.requires_grad_(True)
        y = fn(x)
        dy = torch.randn_like(y)
        run = lambda: y.backward(dy, retain_graph=True)
        grad_to_none = [x]
    measure(
        run,
        grad_to_none=grad_to_none,
        family="dropout",
        provider=provider,
        direction=direction,
        dtype=dtype,
        shape={"layout": layout, "n": n},
        x_key="n",
        bytes_moved=2 * n * x.element_size(),
        extra=extra,
    )
