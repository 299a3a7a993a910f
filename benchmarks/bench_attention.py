"""Attention benchmarks: ours vs SDPA's flash, cuDNN and efficient backends (each forced with
``sdpa_kernel``) and FlexAttention (``torch.compile(flex_attention)``, causal through a block mask). Points
(the family's target table): B * S = 16k tokens, H * D = 2048, D in {64, 128}, S in {1024, 4096, 16384}, causal on/off,
fp16 and bf16; the providers of a point run in alternating rounds (``measure_interleaved``). Beside it:
``attention-shapes`` (shapes outside that grid: head dims 96 and 256, GQA, (B, S, H, D) views, Sq != Sk),
``attention-decode`` (one query per sequence against a KV cache, contiguous and paged; GB/s of K/V read),
windows, packed batches and dropout. Every table has a column for ours against SDPA's cuDNN backend where
cuDNN can run the point (what ``F.scaled_dot_product_attention`` picks on Hopper).

FLOPs: forward 4 * B * H * (visible query-key pairs) * D, backward 2.5x the forward.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from benchmarks._harness import SMOKE, graph_ms
from benchmarks._peers import sdpa_attention
from kernels._mode import DEVICE
from kernels.attention import flash_attention, flash_attention_varlen

PROVIDERS = ["ours", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex"]
#: Alternating rounds per point (``FUSED_KERNELS_BENCH_ROUNDS``): the table's ratios are of medians over them.
ROUNDS = 1 if SMOKE else int(os.environ.get("FUSED_KERNELS_BENCH_ROUNDS", "3"))


#: (B, Hq, Hkv, S, D) the table adds to its grid: grouped-query attention as current LLMs run it (4-8 query heads per
#: K/V head), and short sequences with many heads (BERT-style encoders, short-context training)
GQA_POINTS = [(2, 32, 8, 4096, 128), (4, 32, 4, 2048, 128), (1, 64, 8, 8192, 128), (2, 28, 4, 4096, 128),
              (8, 16, 2, 2048, 64)]
SHORT_POINTS = [(64, 12, 12, 512, 64), (64, 16, 16, 512, 64), (32, 32, 8, 1024, 128)]


def _points():
    """(B, Hq, Hkv, S, D, dtype): the grid (B·S = 16k tokens, H·D = 2048), then the GQA and short-sequence rows."""
    if SMOKE:
        return [(2, 2, 2, 32, 16, torch.float32), (1, 4, 2, 32, 16, torch.float32)]
    grid = [(16384 // s, 2048 // d, 2048 // d, s, d) for d in (64, 128) for s in (1024, 4096, 16384)]
    return [(*point, dt) for dt in (torch.float16, torch.bfloat16) for point in grid + GQA_POINTS + SHORT_POINTS]


@functools.cache
def _flex(s: int, causal: bool, window: int = -1, enable_gqa: bool = False):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # One static compile per shape (benchmarks/conftest.py raises dynamo's recompile limit: past it dynamo
    # would silently run flex_attention eagerly, which materialises the scores).
    if window >= 0:  # causal sliding window: query i sees keys i - window ... i
        mask = create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv <= window), B=None, H=None, Q_LEN=s,
                                 KV_LEN=s)
    elif causal:
        mask = create_block_mask(lambda b, h, q, kv: q >= kv, B=None, H=None, Q_LEN=s, KV_LEN=s)
    else:
        mask = None
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=enable_gqa)


def _provider_fn(provider: str, s: int, causal: bool, gqa: bool = False):
    """One provider's call; with ``gqa`` the peers take K/V with fewer heads natively (``enable_gqa=True``)."""
    if provider == "ours":
        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    if SMOKE:
        pytest.skip(f"{provider} needs a GPU")
    if provider == "flex":
        return _flex(s, causal, enable_gqa=gqa)
    return sdpa_attention(provider, causal, enable_gqa=gqa)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("b", "h", "hkv", "s", "d", "dtype"), _points(),
                         ids=lambda v: str(v).replace("torch.", ""))
def test_attention(measure_interleaved, b, h, hkv, s, d, dtype, causal, direction):
    """Every provider at one point of the table (H query heads, Hkv key/value heads), timed in ROUNDS alternating
    rounds (median each). FLOPs count the query heads: 4·B·H·S²·D, half of it causal."""
    q = torch.randn(b, h, s, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype) for _ in range(2))
    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0) * (2.5 if direction == "bwd" else 1.0)
    runners = {}
    for provider in PROVIDERS:
        try:
            fn = _provider_fn(provider, s, causal, gqa=hkv != h)
            run, grad_to_none, _ = _runner(fn, q, k, v, direction, flops)
        except pytest.skip.Exception:
            continue
        except RuntimeError as err:  # an SDPA backend that refuses this shape or dtype
            print(f"{provider} cannot run this point: {str(err).splitlines()[0][:120]}")
            continue
        runners[provider] = (run, grad_to_none)
    measure_interleaved(runners, rounds=ROUNDS, family="attention", direction=direction, dtype=dtype,
                        shape={"B": b, "H": h, "Hkv": hkv, "S": s, "D": d, "causal": causal}, x_key="S", flops=flops)


#: (B, Hq, Hkv, Sq, Sk, D, causal, layout): shapes a user meets outside the target grid. "bshd": q, k, v are
#: (B, S, H, D) tensors seen as (B, H, S, D) views, without a copy.
SHAPES = [
    (2, 32, 8, 4096, 4096, 128, True, "bhsd"),
    (8, 16, 16, 2000, 2000, 128, False, "bhsd"),
    (4, 16, 16, 3000, 3000, 64, True, "bhsd"),
    (8, 16, 16, 2048, 2048, 256, True, "bhsd"),
    (4, 20, 20, 2048, 2048, 96, False, "bhsd"),
    (4, 32, 32, 4096, 4096, 128, True, "bshd"),
    (1, 32, 32, 512, 8192, 128, False, "bhsd"),
    # one sequence, or short ones: grids of under two 128-row query tiles per SM
    (1, 16, 16, 2048, 2048, 128, True, "bhsd"),
    (4, 16, 16, 512, 512, 128, False, "bhsd"),
]


def _tensors(b, hq, hkv, sq, sk, d, dtype, layout):
    if layout == "bshd":
        return [torch.randn(b, s, h, d, device=DEVICE, dtype=dtype).transpose(1, 2)
                for h, s in ((hq, sq), (hkv, sk), (hkv, sk))]
    return [torch.randn(b, h, s, d, device=DEVICE, dtype=dtype) for h, s in ((hq, sq), (hkv, sk), (hkv, sk))]


def _expanded_kv(fn, group: int):
    """A peer that takes K/V with as many heads as Q: GQA calls expand K/V first (outside the timed region
    would be kinder to it; inside, it is what a caller without native GQA pays)."""
    if group == 1:
        return fn
    return lambda q, k, v: fn(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("dtype", [torch.float32] if SMOKE else [torch.float16, torch.bfloat16],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize(("b", "hq", "hkv", "sq", "sk", "d", "causal", "layout"),
                         [(1, 4, 2, 48, 64, 24, True, "bshd")] if SMOKE else SHAPES, ids=str)
def test_attention_shapes(measure_interleaved, b, hq, hkv, sq, sk, d, causal, layout, dtype, direction):
    """Every provider on shapes outside the target grid. Causal is bottom-right (ours) where Sq != Sk; the
    peers are given such points only when Sq == Sk, where the two alignments agree."""
    q, k, v = _tensors(b, hq, hkv, sq, sk, d, dtype, layout)
    pairs = sum(min(sk, max(0, i + sk - sq + 1)) for i in range(sq)) if causal else sq * sk
    flops = 4.0 * b * hq * pairs * d
    runners = {}
    for provider in PROVIDERS:
        if provider != "ours" and causal and sq != sk:
            continue
        try:
            fn = _provider_fn(provider, sk, causal)
            if provider != "ours":
                fn = _expanded_kv(fn, hq // hkv)
            run, grad_to_none, _ = _runner(fn, q, k, v, direction, flops)
        except pytest.skip.Exception:
            continue
        except (RuntimeError, ValueError) as err:  # a backend that refuses this shape, dtype or head dim
            print(f"{provider} cannot run this point: {str(err).splitlines()[0][:120]}")
            continue
        runners[provider] = (run, grad_to_none)
    measure_interleaved(runners, rounds=ROUNDS, family="attention-shapes", direction=direction, dtype=dtype,
                        shape={"B": b, "Hq": hq, "Hkv": hkv, "Sq": sq, "Sk": sk, "D": d, "causal": causal,
                               "layout": layout},
                        x_key="D", flops=flops * (2.5 if direction == "bwd" else 1.0))


WINDOW = 1024


def _runner(fn, q, k, v, direction: str, flops: float):
    """``(run, grad_to_none, flops)`` timing the forward, or the backward alone (2.5x the forward's FLOPs)."""
    if direction == "fwd":
        fn(q, k, v)
        return functools.partial(fn, q, k, v), None, flops
    for t in (q, k, v):
        t.requires_grad_(True)
    out = fn(q, k, v)
    do = torch.randn_like(out)
    return (lambda: out.backward(do, retain_graph=True)), [q, k, v], flops * 2.5


def _visible_pairs(s: int, window: int) -> int:
    """(query, key) pairs a causal band of ``window`` keys before each query keeps (window < 0: all causal)."""
    if window < 0:
        return s * (s + 1) // 2
    return sum(min(i, window) + 1 for i in range(s))


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize(("b", "h", "s", "d", "dtype"),
                         [(2, 2, 64, 16, torch.float32)] if SMOKE else
                         [(1, 2048 // d, 16384, d, dt) for dt in (torch.float16, torch.bfloat16) for d in (64, 128)],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("provider", ["ours", "ours-full-causal", "flex"])
def test_attention_sliding_window(measure, provider, b, h, s, d, dtype, direction):
    """Causal sliding window (each query sees itself and the WINDOW keys before it) against our own full
    causal attention at the same S and FlexAttention with a sliding-window block mask. FLOPs count the
    visible pairs only, so TFLOP/s compares work rates and the ms column the wall-clock gain."""
    window = min(WINDOW, s // 4)
    if provider == "flex" and SMOKE:
        pytest.skip("flex needs a GPU")
    if provider == "ours":
        fn = lambda q, k, v: flash_attention(q, k, v, causal=True, window_size=(window, 0))
    elif provider == "ours-full-causal":
        fn = lambda q, k, v: flash_attention(q, k, v, causal=True)
    else:
        fn = _flex(s, True, window)
    q, k, v = (torch.randn(b, h, s, d, device=DEVICE, dtype=dtype) for _ in range(3))
    flops = 4.0 * b * h * d * _visible_pairs(s, -1 if provider == "ours-full-causal" else window)
    run, grad_to_none, flops = _runner(fn, q, k, v, direction, flops)
    measure(run, grad_to_none=grad_to_none, family="attention-window", provider=provider, direction=direction,
            dtype=dtype, shape={"B": b, "H": h, "S": s, "D": d, "window": window}, x_key="D", flops=flops)


def _varlen_lengths(n: int, lo: int, hi: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("dtype", [torch.float32] if SMOKE else [torch.float16, torch.bfloat16],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("provider", ["ours", "sdpa-flash-padded", "sdpa-cudnn-padded"])
def test_attention_varlen(measure, provider, dtype, direction):
    """Causal attention over 16 sequences of 256-4096 tokens (H=16, D=128): ours packed against SDPA's
    flash and cuDNN backends on the zero-padded batch. FLOPs count each sequence's own causal work, for all."""
    lengths = [5, 17, 32] if SMOKE else _varlen_lengths(16, 256, 4096)
    h, d = (2, 16) if SMOKE else (16, 128)
    if provider != "ours" and SMOKE:
        pytest.skip(f"{provider} needs a GPU")
    total, longest = sum(lengths), max(lengths)
    flops = sum(4.0 * h * d * n * (n + 1) / 2 for n in lengths)
    if provider == "ours":
        q, k, v = (torch.randn(total, h, d, device=DEVICE, dtype=dtype) for _ in range(3))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        fn = lambda a, b, c: flash_attention_varlen(a, b, c, cu, cu, longest, longest, causal=True)
    else:
        q, k, v = (torch.randn(len(lengths), h, longest, d, device=DEVICE, dtype=dtype) for _ in range(3))
        fn = sdpa_attention(provider.removesuffix("-padded"), True)
    run, grad_to_none, flops = _runner(fn, q, k, v, direction, flops)
    measure(run, grad_to_none=grad_to_none, family="attention-varlen", provider=provider, direction=direction,
            dtype=dtype, shape={"sequences": len(lengths), "tokens": total, "H": h, "D": d}, x_key="D", flops=flops)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize(("b", "h", "s", "d", "dtype"),
                         [(2, 2, 64, 16, torch.float32)] if SMOKE else
                         [(4, 2048 // d, 4096, d, dt) for dt in (torch.float16, torch.bfloat16) for d in (64, 128)],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("provider", ["ours", "sdpa-flash", "sdpa-cudnn"])
def test_attention_dropout(measure, provider, b, h, s, d, dtype, direction):
    """Causal attention with dropout_p = 0.1 on the probabilities: ours against SDPA's flash and cuDNN
    backends (each draws its own mask; the work is the same)."""
    if provider != "ours" and SMOKE:
        pytest.skip(f"{provider} needs a GPU")
    if provider == "ours":
        fn = lambda q, k, v: flash_attention(q, k, v, causal=True, dropout_p=0.1)
    else:
        fn = sdpa_attention(provider, True, dropout_p=0.1)

    q, k, v = (torch.randn(b, h, s, d, device=DEVICE, dtype=dtype) for _ in range(3))
    flops = 2.0 * b * h * s * s * d
    run, grad_to_none, flops = _runner(fn, q, k, v, direction, flops)
    measure(run, grad_to_none=grad_to_none, family="attention-dropout", provider=provider, direction=direction,
            dtype=dtype, shape={"B": b, "H": h, "S": s, "D": d, "p": 0.1}, x_key="D", flops=flops)


#: (B, Hq, Hkv, Sk, D) of the decode table: one query per sequence (Sq = 1) against Sk cached keys
DECODE_POINTS = [
    (1, 32, 8, 8192, 128), (1, 32, 8, 32768, 128), (1, 32, 8, 131072, 128), (8, 32, 8, 32768, 128),
    (32, 32, 8, 8192, 128), (64, 32, 8, 8192, 128), (64, 32, 8, 4096, 128), (1, 32, 8, 1024, 128),
    (1, 32, 32, 32768, 128), (16, 32, 32, 8192, 128), (1, 32, 8, 32768, 64), (32, 32, 8, 8192, 64),
]
#: positions per page of the paged points (vLLM's default; each key row finds its page through the table)
DECODE_PAGE = 16


def _decode_call(provider: str, b: int, hq: int, hkv: int, sk: int, d: int, dtype, paged: bool, fp8: bool = False):
    """``(call, bytes)``: one decode step of ``provider`` on inputs of its own, and the bytes it reads (its cache).

    Ours: split-KV, one K/V read per GQA group; paged: pages of ``DECODE_PAGE`` positions scattered over the pool
    in random order; ``fp8``: the cache in float8_e4m3fn, one scale per key/value head (its largest value / 448).
    SDPA: flash or efficient (``_decode_sdpa_backend``) on K/V expanded to Hq heads beforehand, as a cache stored
    that way. FlexAttention: its decoding kernel, native GQA. The peers read contiguous caches."""
    from kernels.attention import flash_attention_with_kvcache

    q = torch.randn(b, hq, 1, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(b, hkv, sk, d, device=DEVICE, dtype=dtype) for _ in range(2))
    if provider == "ours":
        seqlens = torch.full((b,), sk, dtype=torch.int32, device=DEVICE)
        table = None
        if paged:
            page = min(DECODE_PAGE, sk)
            pages_per_seq = sk // page
            order = torch.randperm(b * pages_per_seq, device=DEVICE)
            table = order.view(b, pages_per_seq).to(torch.int32)
            # page j of sequence i goes to slot order[i * pages_per_seq + j]
            by_page = [t.view(b, hkv, pages_per_seq, page, d).transpose(1, 2).reshape(-1, hkv, page, d)
                       for t in (k, v)]
            k, v = (torch.empty_like(p).index_copy_(0, order, p) for p in by_page)
        scales = {}
        if fp8:
            import reference.attention as twin

            scales = {name: t.float().abs().amax(dim=(0, 2, 3)) / twin.FP8_MAX for name, t in (("k", k), ("v", v))}
            k, v = (twin.quantize_fp8(t, scales[name].view(1, hkv, 1, 1)) for name, t in (("k", k), ("v", v)))
            scales = {"k_scale": scales["k"], "v_scale": scales["v"]}
        return functools.partial(flash_attention_with_kvcache, q, k, v, seqlens, block_table=table,
                                 **scales), 2 * k.nbytes
    if provider == "flex":
        return functools.partial(_flex_decode(), q, k, v, enable_gqa=True), 2 * k.nbytes
    k, v = (t.repeat_interleave(hq // hkv, 1) for t in (k, v))
    return functools.partial(sdpa_attention(_decode_sdpa_backend(q, k, v), False), q, k, v), 2 * k.nbytes


@functools.cache
def _flex_decode():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _decode_sdpa_backend(q, k, v) -> str:
    """The faster of SDPA's flash and efficient backends on these inputs (pytest.skip when neither runs)."""
    from benchmarks._harness import time_ms

    best = None
    for backend in ("sdpa-flash", "sdpa-efficient"):
        try:
            ms = time_ms(functools.partial(sdpa_attention(backend, False), q, k, v))
        except RuntimeError:
            continue
        if best is None or ms < best[0]:
            best = (ms, backend)
    if best is None:
        pytest.skip("no SDPA backend takes this decode point")
    return best[1]


#: (B, Hq, Hkv, Sk, D) of the ragged decode table: each sequence holds a seeded random length in [Sk / 8, Sk]
RAGGED_POINTS = [(8, 32, 8, 20000, 128), (8, 32, 8, 32768, 128), (32, 32, 8, 8192, 128), (64, 32, 8, 4096, 128),
                 (16, 16, 1, 8192, 64)]


def _ragged_lengths(b: int, sk: int) -> list[int]:
    g = torch.Generator().manual_seed(b * 100003 + sk)
    return torch.randint(sk // 8, sk + 1, (b,), generator=g).tolist()


def _ragged_call(b, hq, hkv, sk, d, dtype, page: int, lengths: list[int]):
    """One decode step of ours over caches holding ``lengths`` keys (pages of ``page`` positions scattered in random
    order, or contiguous for 0), and the bytes of the keys and values it reads."""
    from kernels.attention import flash_attention_with_kvcache

    q = torch.randn(b, hq, 1, d, device=DEVICE, dtype=dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    if page == 0:
        k, v = (torch.randn(b, hkv, sk, d, device=DEVICE, dtype=dtype) for _ in range(2))
        table = None
    else:
        per_seq = -(-sk // page)
        k, v = (torch.randn(b * per_seq, hkv, page, d, device=DEVICE, dtype=dtype) for _ in range(2))
        table = torch.randperm(b * per_seq, device=DEVICE).view(b, per_seq).to(torch.int32)
    read = 2 * sum(lengths) * hkv * d * torch.finfo(dtype).bits // 8
    return functools.partial(flash_attention_with_kvcache, q, k, v, seqlens, block_table=table), read


@pytest.mark.parametrize("page", [0, 16, 256])
@pytest.mark.parametrize(("b", "hq", "hkv", "sk", "d"), [(3, 4, 2, 64, 16)] if SMOKE else RAGGED_POINTS, ids=str)
def test_attention_decode_ragged(recorder, b, hq, hkv, sk, d, page):
    """One decode step of ours on a ragged batch (``lengths`` "ragged": each sequence a seeded random length between
    Sk / 8 and Sk) against the same step with every sequence at the batch's mean length (provider ``uniform``: the
    same total keys), device time by CUDA-graph replay. GB/s count the keys and values read (the lengths', not the
    caches' capacity); the ratio to ``uniform`` is what the uneven lengths cost."""
    dtype = torch.float32 if SMOKE else torch.bfloat16
    lengths = _ragged_lengths(b, sk)
    mean = round(sum(lengths) / b)
    for provider, these in (("ours", lengths), ("uniform", [mean] * b)):
        _, read = _ragged_call(b, hq, hkv, sk, d, dtype, page, these)
        make = functools.partial(lambda t: _ragged_call(b, hq, hkv, sk, d, dtype, page, t)[0], these)
        ms = graph_ms(make, touched_bytes=read)
        recorder.add(family="attention-decode-ragged", provider=provider, direction="fwd", dtype=dtype,
                     shape={"timing": "device", "B": b, "Hq": hq, "Hkv": hkv, "Sk": sk, "D": d, "block_size": page,
                            "lengths": "ragged", "total_keys": sum(lengths)},
                     ms=ms, x_key="Sk", bytes_moved=read)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize(("b", "hq", "hkv", "sk", "d"), [(2, 4, 2, 64, 16)] if SMOKE else DECODE_POINTS, ids=str)
def test_attention_decode_fp8(recorder, b, hq, hkv, sk, d, paged):
    """One decode step of ours on an FP8 cache (``kv_dtype`` float8_e4m3fn) against the same step on the bf16 cache
    (provider ``bf16-cache``, our own kernel: the reference an FP8 cache is measured against), device time by CUDA-graph
    replay; tokens/s = B per step, so the table's ratio is the FP8 cache's speed-up. ``kv_gbps``: GB/s of the cache
    read (half the bytes in FP8)."""
    dtype = torch.float32 if SMOKE else torch.bfloat16
    shape = {"timing": "device", "B": b, "Hq": hq, "Hkv": hkv, "Sk": sk, "D": d,
             "block_size": DECODE_PAGE if paged else 0, "kv_dtype": "float8_e4m3fn"}
    for provider, fp8 in (("ours", True), ("bf16-cache", False)):
        _, touched = _decode_call("ours", b, hq, hkv, sk, d, dtype, paged, fp8)
        make = functools.partial(lambda f: _decode_call("ours", b, hq, hkv, sk, d, dtype, paged, f)[0], fp8)
        ms = graph_ms(make, touched_bytes=touched)
        recorder.add(family="attention-decode-fp8", provider=provider, direction="fwd", dtype=dtype, shape=shape,
                     ms=ms, x_key="Sk", tokens=b, extra={"kv_gbps": touched / (ms * 1e-3) / 1e9})


@pytest.mark.parametrize("timing", ["host", "device"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize(("b", "hq", "hkv", "sk", "d"), [(2, 4, 2, 64, 16)] if SMOKE else DECODE_POINTS, ids=str)
def test_attention_decode(measure_interleaved, recorder, b, hq, hkv, sk, d, paged, timing):
    """One decode step (Sq = 1, every sequence holding Sk keys, nothing appended) of each provider
    (``_decode_call``). GB/s count the K/V bytes of the Hkv-head cache, which every provider must read once; the
    fraction is of copy bandwidth. ``timing``: "host", CUDA events around calls issued from Python (a call's host
    work counts where it is longer than the kernels, as in an eager decode loop); "device", CUDA-graph replay with
    the inputs cycled past L2 (``benchmarks._harness.graph_ms``), as a server that captures its decode step runs it."""
    dtype = torch.float32 if SMOKE else torch.bfloat16
    kv_bytes = 2 * b * hkv * sk * d * torch.finfo(dtype).bits // 8
    fields = {"family": "attention-decode", "direction": "fwd", "dtype": dtype, "x_key": "Sk",
              "bytes_moved": kv_bytes,
              "shape": {"timing": timing, "B": b, "Hq": hq, "Hkv": hkv, "Sk": sk, "D": d,
                        "block_size": DECODE_PAGE if paged else 0}}
    calls = {}
    for provider in ("ours",) if SMOKE else ("ours", "sdpa", "flex"):
        try:
            call, touched = _decode_call(provider, b, hq, hkv, sk, d, dtype, paged)
            call()
        except pytest.skip.Exception:
            continue
        except (RuntimeError, ValueError) as err:  # a peer that refuses this point
            print(f"{provider} cannot run this point: {str(err).splitlines()[0][:120]}")
            continue
        calls[provider] = (call, touched)
    if timing == "host":
        measure_interleaved({p: (call, None) for p, (call, _) in calls.items()}, rounds=ROUNDS, **fields)
        return
    for provider, (call, touched) in calls.items():
        del call  # graph_ms builds its own instances, enough of them to cycle past L2
        make = functools.partial(lambda p: _decode_call(p, b, hq, hkv, sk, d, dtype, paged)[0], provider)
        recorder.add(ms=graph_ms(make, touched_bytes=touched), provider=provider, **fields)
