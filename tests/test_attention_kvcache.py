"""flash_attention_with_kvcache: the split-KV kernels against the twin ``reference.attention.attention_with_kvcache``
(contiguous and paged caches, appends, GQA/MQA, windows, empty and ragged caches, forced split counts), the split
plan, CUDA-graph capture and the argument errors. The twin itself is tested in ``test_attention.py``."""

from __future__ import annotations

import contextlib

import pytest
import torch
import triton
import triton.language as tl

import reference.attention as twin
from kernels._mode import DEVICE, FLOAT_DTYPES, INTERPRETER, by_mode
from kernels.attention import configs, flash_attention_with_kvcache
from kernels.attention._decode import _fp16_queries
from tests._caches import kvcache_calls, paged_cache
from tests._numerics import assert_no_worse_than_torch

ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}

#: (Hq, Hkv, Sq, cache_seqlens, S_max, D, causal, window, splits: None = the plan's)
CASES = by_mode(
    interpreter=[
        (4, 2, 1, [5, 0, 37], 40, 16, True, (-1, -1), None),  # decode, an empty cache
        (4, 2, 3, [6, 11, 2], 40, 16, True, (-1, -1), 3),
        (4, 1, 1, [0, 13, 39], 40, 16, True, (-1, -1), 4),  # MQA, splits past a short cache's keys
        (2, 2, 4, [12, 3, 25], 40, 24, True, (4, 0), 2),  # sliding window, D not a power of two
        (8, 2, 5, [30, 1, 7], 40, 16, False, (-1, -1), 2),
        (2, 1, 16, [20, 40, 0], 64, 16, True, (-1, -1), 3),  # 32 rows per key/value head
        (2, 2, 2, [70, 9], 80, 16, True, (3, -1), 5),  # causal with a left window
    ],
    cuda=[
        (32, 8, 1, [8191, 4000, 0, 1], 8192, 128, True, (-1, -1), None),
        (32, 8, 1, [8191, 4000, 0, 1], 8192, 128, True, (-1, -1), 1),
        (32, 8, 4, [3000, 1024, 77], 4096, 128, True, (-1, -1), 7),
        (16, 16, 1, [5000, 17], 6000, 64, True, (-1, -1), None),
        (8, 1, 16, [2000, 2048, 0], 2100, 64, True, (-1, -1), None),  # MQA, 128 rows per key/value head
        (8, 2, 8, [3000, 511], 4096, 256, True, (500, 0), None),
        (4, 2, 3, [900, 100], 1024, 96, False, (-1, -1), 3),
        (4, 4, 2, [1000, 1], 1200, 40, True, (64, 16), None),
        (4, 2, 1, [300], 512, 512, True, (-1, -1), None),
    ],
)


def _inputs(hq, hkv, sq, seqlens, s_max, d, dtype, *, append=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(seqlens)
    q = torch.randn(b, hq, sq, d, generator=g)
    k_cache, v_cache = (torch.randn(b, hkv, s_max, d, generator=g) for _ in range(2))
    new = [torch.randn(b, hkv, sq, d, generator=g) for _ in range(2)] if append else [None, None]
    to = lambda t: None if t is None else t.to(DEVICE, dtype)
    return (to(q), to(k_cache), to(v_cache), torch.tensor(seqlens, dtype=torch.int32, device=DEVICE), to(new[0]),
            to(new[1]))


def _forced(splits, **fields):
    """The table's plan with ``splits`` (None: the table's) and other ``DecodePlan`` fields forced."""
    if splits is not None:
        fields["splits"] = splits
    return configs.override_decode(lambda p: p._replace(**fields)) if fields else contextlib.nullcontext()


def _twin(q, k_cache, v_cache, seqlens, k, v, **kw):
    """The twin in float64 on copies of the caches; returns (out, lse, k_cache after, v_cache after)."""
    caches = [k_cache.double().clone(), v_cache.double().clone()]
    new = [None if t is None else t.double() for t in (k, v)]
    out, lse = twin.attention_with_kvcache(q.double(), *caches, seqlens, k=new[0], v=new[1], return_lse=True, **kw)
    return out, lse, *caches


def _peer(q, k_cache, v_cache, seqlens, k, v, **kw):
    """The twin in the input dtype, as a peer's rounding error."""
    return twin.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), seqlens, k=k, v=v, **kw)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_contiguous_cache_matches_the_twin_and_appends_in_place(case, dtype):
    hq, hkv, sq, seqlens, s_max, d, causal, window, splits = case
    q, k_cache, v_cache, seqlens_t, k, v = _inputs(hq, hkv, sq, seqlens, s_max, d, dtype)
    kw = {"causal": causal, "window_size": window}
    ref, ref_lse, ref_k, ref_v = _twin(q, k_cache, v_cache, seqlens_t, k, v, **kw)
    peer = _peer(q, k_cache, v_cache, seqlens_t, k, v, **kw)
    with _forced(splits):
        out, lse = flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t, k=k, v=v, return_lse=True, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    # the append is a copy: the caches equal the twin's bit for bit, new rows and old ones
    assert torch.equal(k_cache.double(), ref_k) and torch.equal(v_cache.double(), ref_v)
    assert_no_worse_than_torch("out", out, peer, ref, atol=ATOL[dtype])
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows that see no key: lse -inf exactly there"
    seen = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[seen].double(), ref_lse[seen], rtol=0, atol=1e-3)
    assert (out[~seen] == 0).all()


#: decode-shaped dense calls of flash_attention: (Hq, Hkv, Sq, Sk, D, causal, window)
DENSE_DECODE_CASES = by_mode(
    interpreter=[(4, 2, 1, 256, 16, True, (-1, -1)), (2, 2, 5, 300, 24, False, (-1, -1)),
                 (4, 1, 16, 260, 16, True, (40, 0))],
    cuda=[(32, 8, 1, 4096, 128, True, (-1, -1)), (16, 4, 16, 2048, 64, True, (-1, -1)),
          (8, 8, 3, 1000, 96, False, (100, 100)), (8, 2, 16, 256, 128, True, (31, -1))],
)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", DENSE_DECODE_CASES, ids=str)
def test_decode_shaped_flash_attention_runs_the_split_kernel(case, dtype, monkeypatch):
    """A few queries against many keys (a transformers decoding step): flash_attention's forward is the split-KV
    kernel's, with q's layout kept, the twin's output and lse, and a backward through the saved lse."""
    from kernels.attention import flash_attention, kvcache

    hq, hkv, sq, sk, d, causal, window = case
    runs = []
    attend = kvcache._attend
    monkeypatch.setattr(kvcache, "_attend", lambda *a, **kw: runs.append(1) or attend(*a, **kw))
    g = torch.Generator().manual_seed(3)
    b = 2
    # (B, S, H, D) storage viewed as (B, H, S, D), as transformers' projections give them
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(DEVICE, dtype).transpose(1, 2)
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    q.requires_grad_(True)
    kw = {"causal": causal, "window_size": window}
    out, lse = flash_attention(q, k, v, return_lse=True, **kw)
    assert runs, "the split-KV kernel ran"
    assert out.transpose(1, 2).is_contiguous(), "(B, S, H, D) in memory, as q"
    ref = twin.attention(q.detach().double(), k.double(), v.double(), **kw)
    peer = twin.attention(q.detach(), k, v, **kw)
    assert_no_worse_than_torch("out", out, peer, ref, atol=ATOL[dtype])
    _, ref_lse = twin.flash_attention_forward(q.detach().double(), k.double(), v.double(), **kw)
    seen = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[seen].double(), ref_lse[seen], rtol=0, atol=1e-3)
    do = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, q, do)
    q64 = q.detach().double().requires_grad_(True)
    (ref_dq,) = torch.autograd.grad(twin.attention(q64, k.double(), v.double(), **kw), q64, do.double())
    q_peer = q.detach().clone().requires_grad_(True)
    (peer_dq,) = torch.autograd.grad(twin.attention(q_peer, k, v, **kw), q_peer, do)
    assert_no_worse_than_torch("dq", dq, peer_dq, ref_dq, atol=ATOL[dtype])


def test_decode_steps_of_a_growing_cache_agree_with_the_twin():
    """A transformers decoding loop: the keys grow by one per step (a new contiguous tensor each time, as a dynamic
    cache concatenates them). On a GPU the steps after the first replay the recorded launch with the step's key
    count and strides."""
    from kernels.attention import flash_attention

    dtype = torch.float32 if INTERPRETER else torch.bfloat16
    hq, hkv, d, start, steps = by_mode(interpreter=(4, 2, 16, 256, 3), cuda=(16, 4, 128, 1000, 40))
    g = torch.Generator().manual_seed(5)
    keys, values = (torch.randn(2, hkv, start + steps, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    for step in range(steps):
        sk = start + step
        q = torch.randn(2, hq, 1, d, generator=g).to(DEVICE, dtype)
        k, v = keys[:, :, :sk].contiguous(), values[:, :, :sk].contiguous()
        out = flash_attention(q, k, v, causal=True)
        ref = twin.attention(q.double(), k.double(), v.double(), causal=True)
        assert_no_worse_than_torch(f"step {step}", out, twin.attention(q, k, v, causal=True), ref, atol=ATOL[dtype])


#: powers of two (the kernel splits a position by a shift) and not (by a division); S_max a multiple of each, and
#: its key blocks few enough that the paged and the contiguous plans split alike (the paged plan aims at twice the
#: programs: where a cache's blocks allow more splits, the two plans differ and their sums round differently)
@pytest.mark.parametrize("block_size", by_mode(interpreter=[1, 8, 12, 16], cuda=[16, 40, 64, 256]))
@pytest.mark.parametrize("append", [True, False])
def test_paged_cache_gives_the_contiguous_result(block_size, append):
    dtype = torch.float32 if INTERPRETER else torch.bfloat16
    hq, hkv, sq, seqlens, s_max, d = by_mode(interpreter=(4, 2, 2, [0, 21, 46], 48, 16),
                                             cuda=(16, 4, 3, [0, 2100, 3837, 700], 3840, 128))
    q, k_cache, v_cache, seqlens_t, k, v = _inputs(hq, hkv, sq, seqlens, s_max, d, dtype, append=append)
    order = torch.randperm(len(seqlens) * s_max // block_size, generator=torch.Generator().manual_seed(1)).tolist()
    k_pages, table = paged_cache(k_cache, block_size, order, spare_pages=1)
    v_pages, _ = paged_cache(v_cache, block_size, order, spare_pages=1)
    for splits in (None, 3):
        with _forced(splits):
            contiguous = flash_attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), seqlens_t, k=k, v=v)
            paged = flash_attention_with_kvcache(q, k_pages, v_pages, seqlens_t, k=k, v=v, block_table=table)
        # the same blocks in the same order: only the addresses differ
        assert torch.equal(paged, contiguous)
        # page numbers loaded a key block ahead, over blocks of 16 keys (several whole blocks a split, pages that
        # straddle blocks): the same result as loaded with their blocks
        results = []
        for ahead in (False, True):
            with _forced(splits, block_n=16, pages_ahead=ahead):
                results.append(flash_attention_with_kvcache(q, k_pages, v_pages, seqlens_t, k=k, v=v,
                                                            block_table=table))
        assert torch.equal(*results)
    if append:  # the new tokens landed in their pages (the second call wrote the same values again)
        for b, start in enumerate(seqlens):
            for t in range(sq):
                pos = start + t
                page = int(table[b, pos // block_size])
                assert torch.equal(k_pages[page, :, pos % block_size], k[b, :, t])
                assert torch.equal(v_pages[page, :, pos % block_size], v[b, :, t])
    assert torch.isnan(k_pages[-1]).all(), "the spare page is never written"


def test_split_counts_agree_and_empty_splits_weigh_nothing():
    dtype = torch.float32 if INTERPRETER else torch.float16
    q, k_cache, v_cache, seqlens_t, _, _ = _inputs(*by_mode(interpreter=(4, 2, 1, [3, 35, 0], 40, 16),
                                                            cuda=(32, 8, 1, [3, 9000, 0, 128], 9000, 128)),
                                                   dtype, append=False)
    outs = []
    for splits in (1, 2, 5, 64):
        with _forced(splits):
            outs.append(flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t, return_lse=True))
    for out, lse in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], rtol=0, atol=2 * ATOL[dtype])
        torch.testing.assert_close(lse, outs[0][1], rtol=0, atol=1e-4)
    assert (outs[-1][0][2] == 0).all() and torch.isneginf(outs[-1][1][2]).all()  # the empty cache


def test_strided_views_take_no_copies():
    """q from a (B, S, H, D) tensor, caches allocated (B, S_max, Hkv, D) as FlashAttention keeps them, viewed as
    (B, Hkv, S_max, D)."""
    dtype = torch.float32 if INTERPRETER else torch.bfloat16
    hq, hkv, sq, seqlens, s_max, d = by_mode(interpreter=(4, 2, 2, [5, 30], 40, 16),
                                             cuda=(32, 8, 2, [4000, 77], 4096, 128))
    q, k_cache, v_cache, seqlens_t, k, v = _inputs(hq, hkv, sq, seqlens, s_max, d, dtype)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_view, v_view = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k_cache, v_cache))
    expected = flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t, k=k, v=v)
    out = flash_attention_with_kvcache(q_view, k_view, v_view, seqlens_t, k=k.transpose(1, 2).contiguous()
                                       .transpose(1, 2), v=v)
    assert torch.equal(out, expected)
    assert torch.equal(k_view, k_cache) and torch.equal(v_view, v_cache)


def test_lengths_past_the_capacity_are_clamped():
    """CUDA calls read no length back (unless FUSED_KERNELS_CHECK_INDICES=1): a length past the capacity is clamped
    and new tokens past it are dropped. CPU calls check the lengths and raise."""
    dtype = torch.float32 if INTERPRETER else torch.float16
    q, k_cache, v_cache, _, k, v = _inputs(2, 1, 2, [0, 0], 24, 16, dtype)
    full = torch.tensor([22, 22], dtype=torch.int32, device=DEVICE)
    expected = flash_attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), full, k=k, v=v)
    past = torch.tensor([22, 500], dtype=torch.int32, device=DEVICE)
    before = k_cache.clone()
    if INTERPRETER:
        with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 500 with 2 new tokens needs 502 positions"):
            flash_attention_with_kvcache(q, k_cache, v_cache, past, k=k, v=v)
        assert torch.equal(k_cache, before)
        return
    out = flash_attention_with_kvcache(q, k_cache, v_cache, past, k=k, v=v)
    # sequence 1's new tokens fall outside its 24 positions: not written; it attends to its 24 keys
    assert torch.equal(k_cache[1], before[1])
    torch.testing.assert_close(out[0], expected[0], rtol=0, atol=0)
    assert torch.isfinite(out).all()


def _splits_and_balanced(*args, **kwargs):
    plan = configs.decode_plan(*args, **kwargs)
    return plan.splits, plan.balanced


def test_decode_plan_splits_from_the_gpu_and_the_shapes(monkeypatch):
    plan = configs.decode_plan(1, 8, 4, 128, torch.bfloat16, 32768, False, 132)
    assert plan.splits == 16 and plan.block_n == 128  # 128 programs in one wave over 132 SMs
    # several sequences: one wave of programs per key/value head shares the batch's keys
    assert _splits_and_balanced(64, 8, 4, 128, torch.bfloat16, 8192, False, 132) == (16, True)
    assert _splits_and_balanced(3, 8, 4, 128, torch.bfloat16, 32768, True, 132) == (33, True)  # paged: 2 per SM
    # ... but not where a full cache's per-sequence splits are short (32 blocks in 8 splits), nor where a wave has no
    # room for every head, nor in an FP8 cache
    assert _splits_and_balanced(16, 1, 16, 64, torch.bfloat16, 8192, False, 132) == (8, False)
    assert _splits_and_balanced(2, 256, 1, 128, torch.bfloat16, 8192, False, 132) == (1, False)
    assert _splits_and_balanced(64, 8, 4, 128, torch.bfloat16, 8192, False, 132, fp8=True) == (1, False)  # FP8
    # a small cache splits up to 8 ways, one key block a split at the least (a step that is latency, not bytes);
    # 4 blocks a split from 32 blocks on; never past the programs per SM
    assert configs.decode_plan(1, 8, 4, 128, torch.bfloat16, 512, False, 132).splits == 4  # 4 key blocks: 4 splits
    assert configs.decode_plan(1, 8, 4, 128, torch.bfloat16, 1024, True, 132).splits == 8
    assert configs.decode_plan(1, 8, 4, 128, torch.bfloat16, 2048, False, 132).splits == 8  # 16 blocks, 2 each
    assert configs.decode_plan(1, 8, 4, 64, torch.bfloat16, 1024, False, 132).splits == 8
    assert configs.decode_plan(1, 8, 4, 128, torch.bfloat16, 1024, False, 132, fp8=True).splits == 8  # FP8 alike
    assert configs.decode_plan(1, 8, 4, 128, torch.bfloat16, 4096, True, 132, fp8=True).splits == 8  # 32 blocks
    assert configs.decode_plan(4, 8, 4, 128, torch.bfloat16, 1024, False, 132).splits == 4  # 32 programs, 1 per SM
    assert configs.decode_plan(4, 8, 4, 128, torch.bfloat16, 1024, True, 132).splits == 8  # paged: 2 per SM
    assert configs.decode_plan(1, 1, 1, 128, torch.bfloat16, 1 << 20, False, 132).splits == configs.DECODE_MAX_SPLITS
    assert configs.decode_plan(1, 8, 4, 128, torch.bfloat16, 32768, False, 66).splits == 8
    monkeypatch.setattr(configs, "DECODE_BALANCED_SPLITS", False)  # splits per sequence
    assert configs._decode_plan(3, 8, 4, 128, torch.bfloat16, 32768, False, 132).splits == 5  # 120 programs, not 144
    assert configs._decode_plan(64, 8, 4, 128, torch.bfloat16, 8192, False, 132).splits == 1  # 512 programs already
    # FP8: 2 per SM would be 33 splits, but 256 key blocks in chunks of 8 fill 32 of them: the empty one is dropped
    assert configs.decode_plan(1, 8, 4, 128, torch.bfloat16, 32768, False, 132, fp8=True).splits == 32
    assert configs.decode_plan(1, 8, 4, 128, torch.bfloat16, 30000, False, 132, fp8=True).splits == 30  # 235 blocks
    # one sequence in a paged 16-bit cache: page numbers a block ahead, one program per SM (as contiguous); batches
    # of several sequences keep two per SM (balanced splits) and no look-ahead
    one = configs.decode_plan(1, 8, 4, 128, torch.bfloat16, 32768, True, 132)
    assert one.pages_ahead and one.splits == 16 and one == configs.decode_plan(1, 8, 4, 128, torch.float16, 32768,
                                                                                True, 132)._replace(pages_ahead=True)
    assert configs.decode_plan(1, 8, 4, 128, torch.bfloat16, 32768, False, 132).splits == 16
    assert not configs.decode_plan(1, 8, 4, 128, torch.bfloat16, 32768, False, 132).pages_ahead  # contiguous
    assert not configs.decode_plan(1, 8, 4, 128, torch.float32, 32768, True, 132).pages_ahead  # not measured
    several = configs._decode_plan(2, 8, 4, 128, torch.bfloat16, 32768, True, 132)
    assert not several.pages_ahead and several.splits == 16  # 2 per SM (per-sequence splits in this test)
    monkeypatch.setattr(configs, "DECODE_PAGED_ONE_SEQUENCE_AHEAD", False)  # two per SM, 33 -> 32 as above
    assert configs._decode_plan(1, 8, 4, 128, torch.bfloat16, 32768, True, 132) == one._replace(splits=32,
                                                                                               pages_ahead=False)
    # a paged FP8 cache at D <= 64 whose 256 (sequence, head) programs fill the SMs: 4 per SM, 2 splits; not at D 128,
    # nor at B 1 (8 programs: 2 per SM)
    assert configs.decode_plan(32, 8, 4, 64, torch.bfloat16, 8192, True, 132, fp8=True).splits == 2
    assert configs.decode_plan(32, 8, 4, 128, torch.bfloat16, 8192, True, 132, fp8=True).splits == 1
    assert configs.decode_plan(1, 8, 4, 64, torch.bfloat16, 32768, True, 132, fp8=True).splits == 32
    # page numbers a key block ahead: paged FP8 caches past D 64 only
    assert configs.decode_plan(8, 8, 4, 128, torch.bfloat16, 32768, True, 132, fp8=True).pages_ahead
    assert not configs.decode_plan(8, 8, 4, 128, torch.bfloat16, 32768, False, 132, fp8=True).pages_ahead
    assert not configs.decode_plan(8, 8, 4, 64, torch.bfloat16, 32768, True, 132, fp8=True).pages_ahead
    assert not configs.decode_plan(8, 8, 4, 128, torch.bfloat16, 32768, True, 132).pages_ahead
    wide = configs.decode_plan(1, 8, 4, 1024, torch.float32, 4096, False, 132)
    assert wide.block_n == 16 and wide.num_stages == 1 and wide.block_m == 16  # 128 KiB of K and V per stage


@pytest.mark.cuda
def test_cuda_graph_replays_a_decode_step():
    q, k_cache, v_cache, seqlens_t, k, v = _inputs(32, 8, 1, [5000, 100, 0], 8192, 128, torch.bfloat16)
    cache_k, cache_v = k_cache.clone(), v_cache.clone()
    expected = flash_attention_with_kvcache(q, cache_k, cache_v, seqlens_t, k=k, v=v)
    out = flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t, k=k, v=v)  # compiles, warms up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t, k=k, v=v)
    seqlens_t += 1  # the next step: one more token in each cache, read by the replay on the GPU
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    shifted = flash_attention_with_kvcache(q, cache_k, cache_v, seqlens_t, k=k, v=v)
    assert torch.equal(captured, shifted)
    assert torch.equal(k_cache, cache_k)


def _bad_call(**changes):
    q, k_cache, v_cache, seqlens_t, k, v = _inputs(4, 2, 2, [3, 5], 16, 16, torch.float32)
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": seqlens_t, "k": k, "v": v}
    args.update(changes)
    return lambda: flash_attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                                                args.pop("cache_seqlens"), **args)


@pytest.mark.parametrize(("changes", "error", "words"), [
    ({"q": torch.zeros(2, 4, 2, 16, dtype=torch.int32)}, TypeError, "q must"),
    ({"q": torch.zeros(2, 4, 16)}, ValueError, "q must be 4-D"),
    ({"k_cache": torch.zeros(2, 2, 16, 16, dtype=torch.float16)}, TypeError, "one dtype"),
    ({"v_cache": torch.zeros(2, 2, 17, 16)}, ValueError, "same shape"),
    ({"q": torch.zeros(2, 3, 2, 16)}, ValueError, "multiple of the number of key/value heads"),
    ({"q": torch.zeros(2, 4, 2, 8)}, ValueError, "head dim"),
    ({"cache_seqlens": torch.zeros(2, dtype=torch.int64)}, TypeError, "cache_seqlens must be an int32"),
    ({"cache_seqlens": torch.zeros(3, dtype=torch.int32)}, ValueError, "one length per sequence"),
    ({"k_cache": torch.zeros(3, 2, 16, 16), "v_cache": torch.zeros(3, 2, 16, 16)}, ValueError, "batch size"),
    ({"block_table": torch.zeros(2, 4)}, TypeError, "block_table must be an int32"),
    ({"block_table": torch.zeros(3, 4, dtype=torch.int32)}, ValueError, "one row per sequence"),
    ({"v": None}, ValueError, "together"),
    ({"k": torch.zeros(2, 2, 2, 16, dtype=torch.float16)}, TypeError, "k must have the cache's dtype"),
    ({"v": torch.zeros(2, 1, 2, 16)}, ValueError, "v must be (B, Hkv, Sq_new, D)"),
    ({"k": torch.zeros(2, 2, 17, 16), "v": torch.zeros(2, 2, 17, 16)}, ValueError, "do not fit"),
    ({"window_size": (2.5, 0)}, TypeError, "window_size"),
    ({"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
])
def test_bad_arguments_are_named(changes, error, words):
    changes = {name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in changes.items()}
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        _bad_call(**changes)()


# --- FP8 caches -------------------------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn
#: (Hq, Hkv, Sq, cache_seqlens, S_max, D) of the FP8 cases
FP8_SHAPE = by_mode(interpreter=(4, 2, 2, [5, 0, 29], 32, 16), cuda=(32, 8, 1, [4000, 0, 8191, 17], 8192, 128))


def _fp8_scales(kind: str, hkv: int):
    """(k_scale, v_scale) of a kind: Python floats, fp32 tensors of shape (), or one per key/value head."""
    if kind == "float":
        return 0.02, 0.03
    if kind == "scalar":
        return torch.tensor(0.02, device=DEVICE), torch.tensor(0.03, device=DEVICE)
    return (torch.linspace(0.01, 0.03, hkv, device=DEVICE), torch.linspace(0.04, 0.02, hkv, device=DEVICE))


def _fp8_inputs(dtype, scales, *, paged: bool, seed=0):
    hq, hkv, sq, seqlens, s_max, d = FP8_SHAPE
    q, k_cache, v_cache, seqlens_t, k, v = _inputs(hq, hkv, sq, seqlens, s_max, d, dtype, seed=seed)
    k_scale, v_scale = scales
    heads = (1, hkv, 1, 1)
    caches = [twin.quantize_fp8(c, twin.kv_scales(s, hkv, DEVICE).view(heads))
              for c, s in ((k_cache, k_scale), (v_cache, v_scale))]
    table = None
    if paged:
        order = torch.randperm(len(seqlens) * (s_max // 8), generator=torch.Generator().manual_seed(seed)).tolist()
        (caches[0], table), (caches[1], _) = (paged_cache(c, 8, order) for c in caches)
    return q, caches[0], caches[1], seqlens_t, k, v, table


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("scale_kind", ["float", "scalar", "per_head"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_fp8_cache_matches_the_twin_and_quantises_appends_as_torch(dtype, scale_kind, paged):
    scales = _fp8_scales(scale_kind, FP8_SHAPE[1])
    q, k_cache, v_cache, seqlens_t, k, v, table = _fp8_inputs(dtype, scales, paged=paged)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref = twin.attention_with_kvcache(q.double(), ref_k, ref_v, seqlens_t, k=k.double(), v=v.double(),
                                      block_table=table, k_scale=scales[0], v_scale=scales[1])
    out = flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t, k=k, v=v, block_table=table,
                                       k_scale=scales[0], v_scale=scales[1])
    # the appended tokens are stored exactly as torch rounds them (from q's dtype: the twin's k is that, widened)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=ATOL[dtype])
    if paged:  # page numbers loaded a key block ahead: the same result (the appends now write the same bytes again)
        results = []
        for ahead in (False, True):
            with _forced(None, block_n=16, pages_ahead=ahead):
                results.append(flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t, k=k, v=v,
                                                            block_table=table, k_scale=scales[0], v_scale=scales[1]))
        assert torch.equal(*results)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_fp8_value_of_v_reads_back_exactly(dtype):
    """Every finite float8_e4m3fn value stored in V comes out unchanged where the softmax puts all its weight on its
    key: the widening of V tiles is exact, in an unmasked key block (a full cache) and in a masked last one, each
    sequence's chosen key holding a row of the values and every other key a score at least 2^14 below it."""
    d, capacity = by_mode(interpreter=(16, 32), cuda=(128, 512))
    values = torch.arange(256, dtype=torch.int32)
    values = values[(values & 0x7F) != 0x7F].to(torch.uint8)  # NaN excepted
    batch = -(-values.numel() // d)
    rows = torch.zeros(batch * d, dtype=torch.uint8)
    rows[:values.numel()] = values
    gen = torch.Generator().manual_seed(0)
    lengths = [capacity if b % 2 == 0 else capacity - 3 for b in range(batch)]
    chosen = [int(torch.randint(0, n, (1,), generator=gen)) for n in lengths]
    v_cache = (torch.randint(0, 0x7F, (batch, 1, capacity, d), generator=gen, dtype=torch.uint8)
               | (torch.randint(0, 2, (batch, 1, capacity, d), generator=gen, dtype=torch.uint8) << 7))
    k_cache = torch.zeros(batch, 1, capacity, d, dtype=torch.uint8)
    for b in range(batch):
        v_cache[b, 0, chosen[b]] = rows[b * d:(b + 1) * d]
        k_cache[b, 0, chosen[b], 0] = 0x7E  # 448
    q = torch.zeros(batch, 1, 1, d)
    q[..., 0] = 448.0
    out = flash_attention_with_kvcache(
        q.to(DEVICE, dtype), k_cache.to(DEVICE).view(FP8), v_cache.to(DEVICE).view(FP8),
        torch.tensor(lengths, dtype=torch.int32, device=DEVICE), k_scale=1.0, v_scale=1.0)
    expected = rows.view(FP8).float().view(batch, 1, 1, d)
    assert torch.equal(out.float().cpu(), expected)


def test_fp8_rounding_is_torchs_at_ties_and_the_formats_edges():
    """The kernel rounds value / scale to float8_e4m3fn in integer arithmetic (the interpreter's own conversion is
    wrong): ties to even in every binade and among subnormals, carries into the exponent, saturation at 448, signed
    zeros; the bytes it stores equal torch's ``x.clamp(-448, 448).to(float8_e4m3fn)``."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()  # every finite non-negative value
    mids = (codes[:-1] + codes[1:]) / 2  # ties
    near = torch.cat([mids * (1 - 2**-20), mids * (1 + 2**-20)])  # just either side of each tie
    edges = torch.tensor([0.0, -0.0, 447.9, 448.0, 449.0, 464.0, 465.0, 1e6, 2**-10, 2**-9 * 0.5, 2**-9 * 1.5, 1e-30])
    values = torch.cat([codes, mids, near, edges])
    values = torch.cat([values, -values])
    d = 16
    tokens = -(-values.numel() // d)
    k = torch.zeros(tokens * d)
    k[:values.numel()] = values
    k = k.view(1, 1, tokens, d).to(DEVICE)
    q = torch.zeros(1, 1, 1, d, device=DEVICE)
    caches = [torch.zeros(1, 1, tokens, d, device=DEVICE).to(FP8) for _ in range(2)]
    flash_attention_with_kvcache(q, *caches, torch.zeros(1, dtype=torch.int32, device=DEVICE), k=k, v=k,
                                 k_scale=1.0, v_scale=1.0)
    expected = k.clamp(-448, 448).to(FP8)
    stored, wanted = caches[0].view(torch.uint8).flatten(), expected.view(torch.uint8).flatten()
    wrong = (stored != wanted).nonzero().flatten()[:5].tolist()
    assert not wrong, [(k.flatten()[i].item(), stored[i].item(), wanted[i].item()) for i in wrong]


def test_fp8_output_is_within_fp8_error_of_the_full_precision_cache():
    """Per-head scales from each head's largest value (amax / 448): the FP8 cache's output differs from the one of
    the cache it quantises by at most 8% of the output's RMS in RMS (about 4% measured on the twin at the GPU
    shape), the bound the family README states."""
    hq, hkv, sq, seqlens, s_max, d = FP8_SHAPE
    dtype = torch.float32 if INTERPRETER else torch.bfloat16
    q, k_cache, v_cache, seqlens_t, _, _ = _inputs(hq, hkv, sq, seqlens, s_max, d, dtype, append=False)
    seqlens_t = torch.full_like(seqlens_t, s_max)
    scales = [c.float().abs().amax(dim=(0, 2, 3)) / twin.FP8_MAX for c in (k_cache, v_cache)]
    fp8 = [twin.quantize_fp8(c, s.view(1, hkv, 1, 1)) for c, s in zip((k_cache, v_cache), scales, strict=True)]
    full = flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t).float()
    quantised = flash_attention_with_kvcache(q, *fp8, seqlens_t, k_scale=scales[0], v_scale=scales[1]).float()
    rms = lambda t: t.pow(2).mean().sqrt().item()
    assert rms(quantised - full) <= 0.08 * rms(full), (rms(quantised - full), rms(full))
    assert rms(quantised - full) > 0  # the cache did lose precision: the check is not of a cache kept at full width


@pytest.mark.parametrize(("changes", "error", "words"), [
    ({"k_scale": 0.5, "v_scale": 0.5}, ValueError, "k_scale and v_scale are for"),
    ({"fp8": True}, ValueError, "needs k_scale and v_scale"),
    ({"fp8": True, "k_scale": 0.5}, ValueError, "v_scale is missing"),
    ({"fp8": True, "k_scale": torch.ones(3), "v_scale": 0.5}, ValueError, "shape () or (Hkv,)"),
    ({"fp8": True, "k_scale": torch.ones(2, dtype=torch.float16), "v_scale": 0.5}, ValueError, "fp32 tensor"),
    ({"fp8": True, "k_scale": -1.0, "v_scale": 0.5}, ValueError, "positive finite"),
    ({"fp8": True, "k_scale": 0.5, "v_scale": float("inf")}, ValueError, "positive finite"),
    ({"e5m2": True, "k_scale": 0.5, "v_scale": 0.5}, TypeError, "k_cache must"),
    ({"fp8": True, "fp8_new": True, "k_scale": 0.5, "v_scale": 0.5}, TypeError, "k must have q's dtype"),
])
def test_bad_fp8_arguments_are_named(changes, error, words):
    q, k_cache, v_cache, seqlens_t, k, v = _inputs(4, 2, 2, [3, 5], 16, 16, torch.float32)
    cache_dtype = torch.float8_e5m2 if changes.pop("e5m2", False) else FP8 if changes.pop("fp8", False) else None
    if cache_dtype is not None:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    if changes.pop("fp8_new", False):
        k, v = k.to(FP8), v.to(FP8)
    changes = {name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in changes.items()}
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t, k=k, v=v, **changes)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_balanced_splits_give_the_twins_result_on_ragged_batches(case, paged):
    """Balanced splits (``DecodePlan.balanced``: each key/value head's ``splits`` programs share the batch's key
    blocks, laid end to end, evenly, a program's share crossing sequence boundaries, read from the lengths on the
    GPU) on ragged batches, empty sequences, windows and appends: the twin's output and log-sum-exp, and, for 1, 2
    and 5 programs per head (one program walking every sequence; shares spanning several), the result of as many
    splits per sequence."""
    hq, hkv, sq, seqlens, s_max, d, causal, window, _ = case
    dtype = torch.float32
    q, k_cache, v_cache, seqlens_t, k, v = _inputs(hq, hkv, sq, seqlens, s_max, d, dtype)
    table = None
    if paged:
        order = torch.randperm(len(seqlens) * (s_max // 8), generator=torch.Generator().manual_seed(3)).tolist()
        (k_cache, table), (v_cache, _) = (paged_cache(c, 8, order) for c in (k_cache, v_cache))
    kw = {"causal": causal, "window_size": window, "block_table": table}
    ref, ref_lse, _, _ = _twin(q, k_cache, v_cache, seqlens_t, k, v, **kw)
    for splits in (1, 2, 5):
        results = []
        for balanced in (False, True):
            with configs.override_decode(lambda p, s=splits, bal=balanced: p._replace(splits=s, balanced=bal)):
                results.append(flash_attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), seqlens_t, k=k, v=v,
                                                            return_lse=True, **kw))
        (out, _), (out_balanced, lse_balanced) = results
        torch.testing.assert_close(out_balanced.double(), ref, rtol=0, atol=ATOL[dtype])
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isinf(lse_balanced), torch.isinf(ref_lse))
        torch.testing.assert_close(lse_balanced[seen].double(), ref_lse[seen], rtol=0, atol=1e-4)
        torch.testing.assert_close(out_balanced, out, rtol=0, atol=ATOL[dtype])
        assert (out_balanced[~seen] == 0).all()


# --- eager calls: checked plans and recorded launches -------------------------------------------------------------

#: (Hq, Hkv, Sq, lengths of each call of one signature, S_max, D): the GPU's splits the keys
REPLAY_SHAPE = by_mode(interpreter=(4, 2, 2, ([5, 0, 29], [6, 1, 30], [0, 2, 3]), 32, 16),
                       cuda=(32, 8, 1, ([4000, 0, 8191, 17], [4001, 1, 8000, 18], [0, 3, 5, 7000]), 8192, 128))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("append", [True, False], ids=["append", "read"])
@pytest.mark.parametrize("cache", ["plain", "fp8-float", "fp8-per_head"])
def test_calls_that_take_a_stored_plan_and_replay_give_what_checked_calls_give(monkeypatch, paged, append, cache):
    """An eager call whose signature was seen takes the stored plan (no checks) and, on a GPU, replays the recorded
    append and attention launches with its own tensors: bit for bit what checked, freshly launched calls give, for
    calls with new data, lengths and page tables."""
    import kernels._common.eager as eager
    import kernels.attention.kvcache as kvcache

    dtype = torch.float32 if INTERPRETER else torch.bfloat16
    scales = None if cache == "plain" else _fp8_scales(cache.split("-")[1], REPLAY_SHAPE[1])

    def calls():
        return kvcache_calls(REPLAY_SHAPE, dtype, DEVICE, paged=paged, append=append, scales=scales)

    kvcache._PLANS.clear()
    kvcache._KVCACHE_CALLS._entries.clear()
    monkeypatch.setattr(eager, "EAGER_PLANS", False)
    expected = calls()
    assert not kvcache._PLANS._entries and not kvcache._KVCACHE_CALLS._entries
    monkeypatch.setattr(eager, "EAGER_PLANS", True)
    got = calls()
    assert len(kvcache._PLANS._entries) == 1
    if not INTERPRETER:  # launches are recorded for CUDA calls only
        assert [bool(recorded) for recorded in kvcache._KVCACHE_CALLS._entries.values()] == [True]
    for got_call, expected_call in zip(got, expected, strict=True):
        for a, e in zip(got_call, expected_call, strict=True):
            assert torch.equal(a, e)


def test_a_stored_plan_leaves_no_argument_unchecked():
    """After a plan is stored, arguments that the checks refuse still raise (grad mode and ``requires_grad`` are part
    of the key, ``True`` is not taken for ``1``), and arguments that cannot be keys are checked on every call."""
    q, k_cache, v_cache, seqlens_t, _, _ = _inputs(2, 1, 1, [3, 4], 16, 16, torch.float32, append=False)
    for _ in range(2):
        expected = flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t, softmax_scale=1)
        with pytest.raises(TypeError, match="softmax_scale"):
            flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t, softmax_scale=True)
        flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t, softmax_scale=1, window_size=(1, 0))
        with pytest.raises(TypeError, match="window_size"):
            flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t, softmax_scale=1, window_size=(True, 0))
        with pytest.raises(ValueError, match="forward-only"):
            flash_attention_with_kvcache(q.clone().requires_grad_(True), k_cache, v_cache, seqlens_t,
                                         softmax_scale=1)
        with pytest.raises(ValueError, match="k_scale"):
            flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t, softmax_scale=1, k_scale=1.0, v_scale=1.0)
        with pytest.raises(ValueError, match="cache_seqlens"):
            flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t[:1], softmax_scale=1)
        listed = flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t, softmax_scale=1, window_size=[-1, -1])
        assert torch.equal(listed, expected)
        with torch.no_grad():
            assert torch.equal(flash_attention_with_kvcache(q, k_cache, v_cache, seqlens_t, softmax_scale=1),
                               expected)


@triton.jit
def _fp16_queries_kernel(q_ptr, out_ptr, scale_ptr, scale_log2):
    offs = tl.arange(0, 16)[:, None] * 64 + tl.arange(0, 64)[None, :]
    q16, scale_out = _fp16_queries(tl.load(q_ptr + offs), tl.cast(scale_log2, tl.float32))
    tl.store(out_ptr + offs, q16)
    tl.store(scale_ptr, scale_out)


def _fp16_queries_of(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """``_decode._fp16_queries`` run by a one-program kernel on a (16, 64) bf16 tile."""
    out = torch.empty(16, 64, dtype=torch.float16, device=DEVICE)
    scale_out = torch.empty(1, dtype=torch.float32, device=DEVICE)
    _fp16_queries_kernel[(1,)](q, out, scale_out, scale)
    return out, scale_out.item()


@pytest.mark.parametrize("largest", [3.0, 1e-3, 6e6, 0.0])
def test_bf16_queries_against_an_fp8_cache_go_to_fp16_exactly_scaled_by_a_power_of_two(largest):
    """bf16 queries against an FP8 cache are taken to fp16 (so that FP8 tiles widen to fp16 in one conversion per
    pair): times a power of two that puts their largest element in [2^14, 2^15), the scores' scale divided by it.
    Every bf16 element within 2^-29 of the largest comes back exactly (smaller ones are fp16 subnormals there)."""
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(16, 64, generator=g) * largest / 4).clamp(-largest, largest)
    q[0, 0] = largest
    q = q.to(torch.bfloat16).to(DEVICE)
    q16, scale = _fp16_queries_of(q, 0.125)
    power = 0.125 / scale
    assert power == 2.0 ** round(torch.tensor(power).log2().item())
    if largest == 0.0:
        assert torch.equal(q16, torch.zeros_like(q16))
        return
    top = q.float().abs().max().item()
    assert 2.0 ** 14 <= top * power < 2.0 ** 15
    kept = q.float().abs() >= top * 2.0 ** -29
    assert torch.equal((q16.float() / power)[kept], q.float()[kept])


def test_bf16_queries_with_a_nan_or_an_infinity_keep_it_in_fp16():
    q = torch.ones(16, 64, dtype=torch.bfloat16, device=DEVICE)
    q[3, 5], q[7, 1] = float("nan"), float("inf")
    q16, _ = _fp16_queries_of(q, 0.125)
    assert torch.isnan(q16[3, 5]) and torch.isinf(q16[7, 1])
