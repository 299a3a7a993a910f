"""Host cost: the host time of one eager call of each public op, ours against torch's, beside the device time.

An eager op of ours must never slow a model down: where the kernels are short, a call costs what its Python,
dispatch and launch path costs on the host. For each op, at two sizes (``size``: ``tiny``, where the kernels take a
few us and the clock measures the host path, and ``model``, a transformer layer's activations: 8192 x 1024 bf16,
attention as (8, 16, 1024, 64)), and two directions (``fwd``: the forward with inputs that require grad, the autograd
node included; ``fwd+bwd``: the forward and ``.backward()``), records ``host_us``: the host time per call of
``CALLS`` calls issued back to back, the clock stopped before waiting for the device (``benchmarks._harness.host_us``),
the median of ``ROUNDS`` interleaved rounds; and ``device_us``: the same call replayed from a CUDA graph (no host
work). torch's side (provider ``torch``) is what a user would otherwise call: ``F.dropout``, ``F.layer_norm``,
``F.rms_norm``, ``F.layer_norm(F.dropout(x) + residual)`` for ``add_dropout_norm``, SDPA for ``flash_attention``
(and on the padded batch for ``flash_attention_varlen``), SDPA with ``enable_gqa`` against the cache with the new
token already in it for ``flash_attention_with_kvcache`` (forward only, as the op; ours appends the token too), and
transformers' ``x * cos + rotate_half(x) * sin`` for ``apply_rotary``. The table's ratios are ours' time over
torch's (lower is better). Provider ``ours`` is the Python path (the compiled eager tier turned off), ``ours-native``
the same call with the tier on (``kernels/_native``, the default), for the ops that have programs there, where its
extension builds.

Smoke mode (no GPU): tiny sizes only, wall clock of a few calls, no device time.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
import torch.nn.functional as F

import kernels._native as native_tier
from benchmarks._harness import SMOKE, forward_backward, graph_us, host_us
from kernels._mode import DEVICE
from kernels.attention import apply_rotary, flash_attention, flash_attention_varlen, flash_attention_with_kvcache
from kernels.dropout import dropout
from kernels.layernorm import add_dropout_norm, layer_norm, rms_norm

CALLS = 5 if SMOKE else int(os.environ.get("FUSED_KERNELS_HOST_CALLS", "300"))
ROUNDS = 1 if SMOKE else int(os.environ.get("FUSED_KERNELS_HOST_ROUNDS", "3"))
SIZES = ["tiny"] if SMOKE else ["tiny", "model"]
DTYPE = torch.float32 if SMOKE else torch.bfloat16

#: rows x width of the norm and dropout inputs; (B, H, S, D) of attention's
_ROWS = {"tiny": (8, 1024), "model": (8192, 1024)}
_HEADS = {"tiny": (1, 2, 64, 64), "model": (8, 16, 1024, 64)}
if SMOKE:
    _ROWS, _HEADS = {"tiny": (4, 64)}, {"tiny": (1, 2, 16, 16)}


def _tensor(*shape, grad=True):
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE, requires_grad=grad)


def _rotate_half_rotary(q, k, cos, sin):
    def rotate(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos[:, None], sin[:, None]
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def _cases(size: str) -> dict[str, tuple]:
    """op -> (ours, torch's, differentiable): each call returns the output(s) whose sum is differentiated."""
    m, n = _ROWS[size]
    x, residual = _tensor(m, n), _tensor(m, n)
    w, b = _tensor(n), _tensor(n)
    batch, heads, seq, d = _HEADS[size]
    q, k, v = (_tensor(batch, heads, seq, d) for _ in range(3))
    lengths = torch.full((batch + 1,), seq, dtype=torch.int32, device=DEVICE).cumsum(0, dtype=torch.int32) - seq
    packed = [t.detach().transpose(1, 2).reshape(batch * seq, heads, d).requires_grad_(True) for t in (q, k, v)]
    cache = [_tensor(batch, heads // 2, seq, d, grad=False) for _ in range(2)]
    query = _tensor(batch, heads, 1, d, grad=False)
    cache_lengths = torch.full((batch,), seq - 1, dtype=torch.int32, device=DEVICE)
    new = [_tensor(batch, heads // 2, 1, d, grad=False) for _ in range(2)]
    angles = torch.rand(1, seq, d // 2, device=DEVICE, dtype=torch.float32)
    cos, sin = (torch.cat([f(angles), f(angles)], -1).to(DTYPE) for f in (torch.cos, torch.sin))
    full_cache = [torch.cat([c[:, :, :-1], t], 2) for c, t in zip(cache, new, strict=True)]
    return {
        "dropout": (lambda: dropout(x, 0.1), lambda: F.dropout(x, 0.1), True),
        "layer_norm": (lambda: layer_norm(x, n, w, b), lambda: F.layer_norm(x, (n,), w, b), True),
        "rms_norm": (lambda: rms_norm(x, n, w), lambda: F.rms_norm(x, (n,), w), True),
        "add_dropout_norm": (lambda: add_dropout_norm(x, residual, w, b, dropout_p=0.1),
                             lambda: (F.layer_norm(F.dropout(x, 0.1) + residual, (n,), w, b)), True),
        "flash_attention": (lambda: flash_attention(q, k, v, causal=True),
                            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), True),
        "flash_attention_varlen": (lambda: flash_attention_varlen(*packed, lengths, lengths, seq, seq, causal=True),
                                   lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), True),
        "flash_attention_with_kvcache": (
            lambda: flash_attention_with_kvcache(query, *cache, cache_lengths, k=new[0], v=new[1]),
            lambda: F.scaled_dot_product_attention(query, *full_cache, enable_gqa=True), False),
        "apply_rotary": (lambda: apply_rotary(q, k[:, : heads // 2], cos, sin),
                         lambda: _rotate_half_rotary(q, k[:, : heads // 2], cos, sin), True),
    }


def _host_us(fn) -> float:
    if SMOKE:  # wall clock of a few calls: the path runs, the figure means nothing
        fn()
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        return (time.perf_counter() - start) / CALLS * 1e6
    return host_us(fn, calls=CALLS)


def _device_us(fn) -> float | None:
    if SMOKE:
        return None
    try:
        return graph_us(fn)
    except Exception as error:  # a call CUDA graphs cannot capture: say so, keep the host figure
        print(f"  no device time ({type(error).__name__}: {str(error).splitlines()[0][:80]})", flush=True)
        return None


#: the ops that the compiled eager tier has programs for
NATIVE_OPS = {"dropout", "layer_norm", "rms_norm", "add_dropout_norm", "flash_attention", "flash_attention_varlen",
              "flash_attention_with_kvcache"}


def _measured_with_native(on: bool, fn) -> float:
    """:func:`_host_us` of ``fn`` with the compiled eager tier turned on or off for the measurement."""
    with native_tier.switched(on):
        return _host_us(fn)


#: every public op
OPS = [
    "dropout", "layer_norm", "rms_norm", "add_dropout_norm", "flash_attention", "flash_attention_varlen",
    "flash_attention_with_kvcache", "apply_rotary"]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op", OPS)
def test_host(benchmark, recorder, op, size):
    ours, theirs, differentiable = _cases(size)[op]
    runs = {"ours": ours, "torch": theirs}
    if op in NATIVE_OPS and not SMOKE and native_tier.module() is not None:
        runs["ours-native"] = ours
    directions = {"fwd": dict(runs)}
    if differentiable:
        directions["fwd+bwd"] = {provider: forward_backward(fn) for provider, fn in runs.items()}
    times: dict[tuple[str, str], list[float]] = {(d, p): [] for d in directions for p in runs}

    def measure_all():
        for _ in range(ROUNDS):
            for direction, fns in directions.items():
                for provider, fn in fns.items():
                    times[(direction, provider)].append(_measured_with_native(provider == "ours-native", fn))

    benchmark.group = f"host {op} {size}"
    benchmark.pedantic(measure_all, rounds=1, iterations=1)
    elements = _ROWS[size][0] * _ROWS[size][1]
    for (direction, provider), values in times.items():
        device = _device_us(directions[direction][provider])
        record = recorder.add(
            family="host", provider=provider, direction=direction, dtype=DTYPE,
            shape={"op": op, "size": size, "elements": elements}, ms=statistics.median(values) * 1e-3,
            x_key="elements", host=True, extra={"device_us": device},
        )
        benchmark.extra_info[f"{direction} {provider}"] = record
