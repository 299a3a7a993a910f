"""The attention kernel paths: which calls take the Hopper forward (``kernels/attention/_hopper.py``) and backward
(``kernels/attention/_hopper_bwd.py``), how a caller forces either path, and that on an sm_90 GPU both paths give the
same attention and gradients, no worse than torch's own in the input dtype.

The rest of the attention tests run on whichever path a call takes: ``FUSED_KERNELS_ATTENTION_PATH=hopper`` runs
every call the Hopper kernels support on them, ``portable`` none."""

from __future__ import annotations

import pytest
import torch

import reference.attention as twin
from kernels._mode import DEVICE, INTERPRETER
from kernels.attention import configs, flash_attention, flash_attention_varlen, ops
from tests._numerics import assert_no_worse_than_torch
from tests.test_attention import _grads, _low_precision_attention

ON_HOPPER = not INTERPRETER and torch.cuda.is_available() and configs.is_hopper(torch.device("cuda"))
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU (H100, H200)")
ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def test_path_comes_from_the_environment_and_rejects_unknown_names(monkeypatch):
    monkeypatch.delenv(configs.PATH_ENV, raising=False)
    assert configs.path() == "auto"
    monkeypatch.setenv(configs.PATH_ENV, "portable")
    assert configs.path() == "portable"
    monkeypatch.setenv(configs.PATH_ENV, "hopper")
    assert configs.path() == "hopper"
    monkeypatch.setenv(configs.PATH_ENV, "fast")
    with pytest.raises(ValueError, match=configs.PATH_ENV):
        configs.path()


def test_forced_path_sets_and_restores_the_environment(monkeypatch):
    monkeypatch.delenv(configs.PATH_ENV, raising=False)
    with configs.forced_path("portable"):
        assert configs.path() == "portable"
        with configs.forced_path("auto"):
            assert configs.path() == "auto"
        assert configs.path() == "portable"
    assert configs.PATH_ENV not in __import__("os").environ
    with pytest.raises(ValueError, match="path"), configs.forced_path("fast"):
        pass


def test_cpu_tensors_never_take_the_hopper_path():
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    assert not configs.is_hopper(q.device)
    assert not ops.uses_hopper_forward(q, q, q)
    assert not ops.uses_hopper_backward(q, q, q, q)


def _qkv(b, hq, hkv, sq, sk, d, dtype, layout="bhsd", seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d))
    if layout == "bshd":  # (B, S, H, D) storage seen as (B, H, S, D): strided views, no copy
        return [torch.randn(s[0], s[2], s[1], s[3], generator=g).to(DEVICE, dtype).transpose(1, 2) for s in shapes]
    return [torch.randn(*s, generator=g).to(DEVICE, dtype) for s in shapes]


def _assert_equals_portable(o, lse, o_portable, lse_portable, dtype):
    """A Hopper forward's O and log-sum-exp against the portable kernel's: the same rows see no key (lse -inf)."""
    torch.testing.assert_close(o, o_portable, rtol=0, atol=ATOL[dtype])
    finite = torch.isfinite(lse)
    assert torch.equal(finite, torch.isfinite(lse_portable))
    torch.testing.assert_close(lse[finite], lse_portable[finite], rtol=0, atol=1e-4)


HOPPER_CASES = [  # (B, Hq, Hkv, Sq, Sk, D, causal, window, dtype, layout)
    (2, 4, 4, 128, 128, 128, False, (-1, -1), torch.bfloat16, "bhsd"),
    (2, 4, 2, 200, 300, 128, True, (-1, -1), torch.bfloat16, "bhsd"),
    (1, 4, 1, 300, 200, 64, True, (-1, -1), torch.float16, "bhsd"),
    (2, 3, 3, 1000, 1000, 64, False, (-1, -1), torch.bfloat16, "bhsd"),
    (1, 2, 2, 129, 1, 128, False, (-1, -1), torch.float16, "bhsd"),
    (1, 2, 2, 1, 513, 128, True, (-1, -1), torch.bfloat16, "bhsd"),
    (1, 8, 2, 777, 777, 96, True, (-1, -1), torch.bfloat16, "bhsd"),
    (1, 2, 1, 250, 250, 40, False, (-1, -1), torch.float16, "bhsd"),
    (2, 4, 2, 300, 300, 128, True, (-1, -1), torch.bfloat16, "bshd"),
    (1, 4, 4, 1100, 1100, 64, False, (-1, -1), torch.float16, "bshd"),
    (1, 2, 2, 500, 700, 128, False, (100, 20), torch.float16, "bhsd"),
    (1, 2, 2, 500, 400, 64, False, (50, -1), torch.bfloat16, "bhsd"),
    (1, 2, 2, 300, 300, 128, True, (64, 0), torch.bfloat16, "bhsd"),
    (1, 2, 2, 70, 1500, 128, False, (-1, 8), torch.bfloat16, "bhsd"),
    # head dims padded to 256: the backward kernel whose consumers split the head dim
    (1, 2, 2, 300, 500, 256, True, (-1, -1), torch.bfloat16, "bhsd"),
    (1, 4, 2, 257, 257, 200, False, (-1, -1), torch.float16, "bshd"),
    (1, 2, 2, 400, 400, 256, False, (64, 0), torch.bfloat16, "bhsd"),
    (2, 6, 2, 700, 500, 256, False, (100, 20), torch.float16, "bhsd"),
]


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("case", HOPPER_CASES, ids=str)
def test_hopper_forward_equals_the_portable_kernel_and_is_no_worse_than_torch(case):
    *dims, causal, window, dtype, layout = case
    q, k, v = _qkv(*dims, dtype, layout)
    with configs.forced_path("hopper"):
        assert ops.uses_hopper_forward(q, k, v)
        o, lse = flash_attention(q, k, v, causal=causal, window_size=window, return_lse=True)
    with configs.forced_path("portable"):
        assert not ops.uses_hopper_forward(q, k, v)
        o_portable, lse_portable = flash_attention(q, k, v, causal=causal, window_size=window, return_lse=True)
    reference = twin.attention(q.double(), k.double(), v.double(), causal=causal, window_size=window)
    peer = _low_precision_attention(q, k, v, causal, window)
    assert_no_worse_than_torch("o", o, peer, reference, atol=ATOL[dtype])
    assert_no_worse_than_torch("o (portable)", o_portable, peer, reference, atol=ATOL[dtype])
    # rows that see no key: lse -inf and o 0 on both paths
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_portable))
    finite = torch.isfinite(lse)
    torch.testing.assert_close(lse[finite], lse_portable[finite], rtol=0, atol=1e-4)
    assert torch.equal(o[~finite], torch.zeros_like(o[~finite]))


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("which", ["short", "short-causal", "table"])
@pytest.mark.parametrize("case", [c for c in HOPPER_CASES if 32 < c[5] <= 128], ids=str)
def test_every_forward_tile_of_a_head_dim_equals_the_portable_kernel(case, which):
    """Head dims 64 and 128 have several Hopper forward tiles (``configs.hopper_forward_tile``: at D 64 one consumer
    per program for shorter causal calls, two persistent consumers for other shorter calls and three one program per
    tile for the rest, at D 128 64-key blocks for short causal calls and 128-key blocks for the others); each is
    forced on every case of its head dim here (bands, GQA, Sq != Sk and strided views included)."""
    *dims, causal, window, dtype, layout = case
    q, k, v = _qkv(*dims, dtype, layout)
    bd = configs.block_d(dims[-1])
    tables = {"short": configs.HOPPER_FORWARD_SHORT, "short-causal": configs.HOPPER_FORWARD_SHORT_CAUSAL}
    if which in tables and bd not in tables[which]:
        pytest.skip(f"head dim {bd} has no {which} tile")
    tile = tables[which][bd][0] if which in tables else configs.HOPPER_FORWARD[bd]
    with configs.forced_path("hopper"), configs.hopper_tiles(forward={bd: tile}):
        o, lse = flash_attention(q, k, v, causal=causal, window_size=window, return_lse=True)
    with configs.forced_path("portable"):
        o_portable, lse_portable = flash_attention(q, k, v, causal=causal, window_size=window, return_lse=True)
    _assert_equals_portable(o, lse, o_portable, lse_portable, dtype)


def _causal_hopper_forward_equals_portable(q, k, v, path, dtype):
    """A causal forward on kernel path ``path``, which must take the Hopper kernel, equals the portable kernel's."""
    with configs.forced_path(path):
        assert ops.uses_hopper_forward(q, k, v, right=0)
        o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    with configs.forced_path("portable"):
        o_portable, lse_portable = flash_attention(q, k, v, causal=True, return_lse=True)
    _assert_equals_portable(o, lse, o_portable, lse_portable, dtype)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("sq, sk", [(700, 700), (300, 700), (700, 300), (1000, 1000)], ids=str)
def test_the_one_consumer_forward_programs_walk_several_pairs_of_tiles_three_to_an_sm(sq, sk, dtype):
    # 64-row tiles (the last one partly past Sq) x 320 heads, paired longest with shortest: several pairs per
    # program with three programs per SM on any Hopper GPU; with Sq 700 > Sk the first tiles see no key
    tile = configs.HOPPER_FORWARD_SHORT_CAUSAL[64][0]
    assert configs.hopper_forward_tile(64, sq, right=0, sk=sk) == tile
    q, k, v = _qkv(8, 40, 8, sq, sk, 64, dtype)
    items = ((sq + 63) // 64 + 1) // 2 * 8 * 40
    assert items > 2 * tile.programs_per_sm * configs.sm_count(q.device)
    _causal_hopper_forward_equals_portable(q, k, v, "hopper", dtype)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("sq, sk", [(2500, 2500), (3072, 3072), (2100, 3000)], ids=str)
def test_grouped_causal_forwards_past_the_ungrouped_bound_take_the_one_consumer_tile_by_default(sq, sk, dtype):
    # the default path: grouped causal D 64 calls to HOPPER_FORWARD_GROUPED_CAUSAL_BELOW keys run
    # the one-consumer tile, three programs per SM walking pairs of tiles, as the portable kernel computes them
    tile = configs.HOPPER_FORWARD_SHORT_CAUSAL[64][0]
    assert configs.hopper_forward_tile(64, sq, right=0, sk=sk, grouped=True) == tile
    assert configs.hopper_forward_tile(64, sq, right=0, sk=sk) != tile
    q, k, v = _qkv(2, 8, 2, sq, sk, 64, dtype)
    _causal_hopper_forward_equals_portable(q, k, v, "auto", dtype)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal, sq, sk", [(False, 300, 700), (True, 300, 700), (True, 700, 300)], ids=str)
@pytest.mark.parametrize("d", [128, 256])
def test_a_persistent_hopper_forward_program_walks_several_tiles_as_the_portable_kernel_would(causal, sq, sk, dtype,
                                                                                             d):
    # 3 or 6 query tiles (the last one partly past Sq) x 160 heads, several per program on any Hopper GPU; causal,
    # a program takes a head's longest and shortest tiles together: with Sq 300 the middle tile goes alone, with
    # Sq 700 > Sk the first three tiles see no key
    q, k, v = _qkv(4, 40, 8, sq, sk, d, dtype)
    rows = configs.HOPPER_FORWARD[d].query_rows
    tiles_m = (sq + rows - 1) // rows
    items = ((tiles_m + 1) // 2 if causal else tiles_m) * 4 * 40
    assert configs.HOPPER_FORWARD[d].persistent and items > 2 * configs.sm_count(q.device)
    with configs.forced_path("hopper"):
        assert ops.uses_hopper_forward(q, k, v)
        o, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    with configs.forced_path("portable"):
        o_portable, lse_portable = flash_attention(q, k, v, causal=causal, return_lse=True)
    torch.testing.assert_close(o, o_portable, rtol=0, atol=ATOL[dtype])
    torch.testing.assert_close(lse, lse_portable, rtol=0, atol=1e-4)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("case", HOPPER_CASES, ids=str)
def test_hopper_backward_equals_the_portable_backward_and_is_no_worse_than_torch(case):
    *dims, causal, window, dtype, layout = case
    q, k, v = _qkv(*dims, dtype, layout)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    kw = {"causal": causal, "window_size": window}
    with configs.forced_path("hopper"):
        assert ops.uses_hopper_backward(q, k, v, do)
        hopper = _grads(lambda a, b, c: flash_attention(a, b, c, **kw), q, k, v, do)
    with configs.forced_path("portable"):
        assert not ops.uses_hopper_backward(q, k, v, do)
        portable = _grads(lambda a, b, c: flash_attention(a, b, c, **kw), q, k, v, do)
    peer = _grads(lambda a, b, c: _low_precision_attention(a, b, c, causal, window), q, k, v, do)
    reference = _grads(lambda a, b, c: twin.attention(a, b, c, **kw), q.double(), k.double(), v.double(), do.double())
    for name, got, port, p, r in zip(("o", "dq", "dk", "dv"), hopper, portable, peer, reference, strict=True):
        assert got.dtype == dtype and got.shape == r.shape, name
        assert_no_worse_than_torch(name, got, p, r, atol=ATOL[dtype])
        assert_no_worse_than_torch(f"{name} (portable)", port, p, r, atol=ATOL[dtype])


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("case", HOPPER_CASES, ids=str)
def test_the_hopper_dq_kernel_gives_torchs_gradients_bitwise_again_and_takes_deterministic_calls(case):
    """dQ by a kernel of its own after a dK/dV kernel without dQ (``configs.HOPPER_BACKWARD_DQ``, forced on here):
    every gradient within twice torch's error, the same bits on a second call (nothing is summed in arrival order),
    so ``deterministic`` calls take it; its launches go through the cached launcher."""
    from kernels._common.launch import _fast_launcher, forget_recorded_launches
    from kernels.attention import _hopper_bwd_dq

    forget_recorded_launches()  # the launcher's compiled-kernel check below needs a launch, not a replay
    *dims, causal, window, dtype, layout = case
    q, k, v = _qkv(*dims, dtype, layout)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    kw = {"causal": causal, "window_size": window, "deterministic": True}
    with configs.forced_path("hopper"), configs.hopper_dq_kernel():
        assert ops.uses_hopper_backward(q, k, v, do, deterministic=True)
        first, second = (_grads(lambda a, b, c: flash_attention(a, b, c, **kw), q, k, v, do) for _ in range(2))
    peer = _grads(lambda a, b, c: _low_precision_attention(a, b, c, causal, window), q, k, v, do)
    del kw["deterministic"]
    reference = _grads(lambda a, b, c: twin.attention(a, b, c, **kw), q.double(), k.double(), v.double(), do.double())
    for name, got, again, p, r in zip(("o", "dq", "dk", "dv"), first, second, peer, reference, strict=True):
        assert torch.equal(got, again), name
        assert_no_worse_than_torch(name, got, p, r, atol=ATOL[dtype])
    assert _fast_launcher(_hopper_bwd_dq._attn_bwd_hopper_dq_kernel)._compiled



@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("case", [c for c in HOPPER_CASES if c[5] > 128], ids=str)
def test_the_one_kernel_d256_backward_kept_for_ab_still_gives_torchs_gradients(case):
    """With the dQ kernel switched off (``configs.hopper_dq_kernel(dims=())``) the head-dim-split kernel adds dQ up
    by TMA reductions itself: the variant A/B tools time against the two kernels stays correct."""
    *dims, causal, window, dtype, layout = case
    q, k, v = _qkv(*dims, dtype, layout)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    kw = {"causal": causal, "window_size": window}
    with configs.forced_path("hopper"), configs.hopper_dq_kernel(dims=()):
        assert ops.uses_hopper_backward(q, k, v, do) and not ops.uses_hopper_backward(q, k, v, do, deterministic=True)
        got = _grads(lambda a, b, c: flash_attention(a, b, c, **kw), q, k, v, do)
    peer = _grads(lambda a, b, c: _low_precision_attention(a, b, c, causal, window), q, k, v, do)
    reference = _grads(lambda a, b, c: twin.attention(a, b, c, **kw), q.double(), k.double(), v.double(), do.double())
    for name, g, p, r in zip(("o", "dq", "dk", "dv"), got, peer, reference, strict=True):
        assert_no_worse_than_torch(name, g, p, r, atol=ATOL[dtype])

HOPPER_DROPOUT_CASES = [HOPPER_CASES[i] for i in (1, 2, 3, 6, 7, 8, 10, 11, 13)]


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("case", HOPPER_DROPOUT_CASES, ids=str)
def test_hopper_backward_with_dropout_equals_the_portable_backward_and_is_no_worse_than_torch(case):
    """Both backwards draw the forward's keep mask again (the Hopper one in its transposed frame, through shared
    memory): their gradients agree with torch's on the same mask, within twice its own error."""
    *dims, causal, window, dtype, layout = case
    q, k, v = _qkv(*dims, dtype, layout)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    kw = {"causal": causal, "window_size": window, "dropout_p": 0.2, "seed": 2024}
    with configs.forced_path("hopper"):
        assert ops.uses_hopper_backward(q, k, v, do, 0.2)
        hopper = _grads(lambda a, b, c: flash_attention(a, b, c, **kw), q, k, v, do)
    with configs.forced_path("portable"):
        portable = _grads(lambda a, b, c: flash_attention(a, b, c, **kw), q, k, v, do)
    peer = _grads(lambda a, b, c: _low_precision_attention(a, b, c, causal, window, 0.2, 2024), q, k, v, do)
    reference = _grads(lambda a, b, c: twin.attention(a, b, c, **kw), q.double(), k.double(), v.double(), do.double())
    for name, got, port, p, r in zip(("o", "dq", "dk", "dv"), hopper, portable, peer, reference, strict=True):
        assert_no_worse_than_torch(name, got, p, r, atol=ATOL[dtype])
        assert_no_worse_than_torch(f"{name} (portable)", port, p, r, atol=ATOL[dtype])


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_hopper_backward_drops_exactly_the_twins_mask(dtype):
    """q = 0 makes every probability 1/Sk, and dO = I reads the dropped ones out of dV = (P o Z / (1 - p))^T dO:
    dV[j, i] * Sk / (keep scale) is the keep mask of query i and key j. Several heads, batches and both consumers'
    key halves; keys past Sk (300) in the last program."""
    b, h, sq, sk, d, p, seed = 2, 3, 128, 300, 128, 0.4, 77
    q = torch.zeros(b, h, sq, d, device=DEVICE, dtype=dtype)
    k = torch.randn(b, h, sk, d, device=DEVICE, dtype=dtype)
    v = torch.randn(b, h, sk, d, device=DEVICE, dtype=dtype)
    do = torch.eye(sq, d, device=DEVICE, dtype=dtype).expand(b, h, sq, d).contiguous()
    with configs.forced_path("hopper"):
        assert ops.uses_hopper_backward(q, k, v, do, p)
        dv = _grads(lambda a, b_, c: flash_attention(a, b_, c, dropout_p=p, seed=seed), q, k, v, do)[3]
    mask = twin.attention_keep_mask(b, h, sq, sk, p, seed, device=DEVICE)
    read = dv.float().transpose(-1, -2) * sk / twin.attention_keep_scale(p)
    torch.testing.assert_close(read, mask.float(), rtol=0, atol=2e-2)
    assert 0.5 < mask.float().mean().item() < 0.7


@pytest.mark.cuda
@needs_hopper
def test_hopper_backward_keyed_by_a_device_seed_draws_the_int_seeds_mask_in_and_out_of_a_cuda_graph():
    """A seed on the device (how seed=None travels in CUDA graph capture) keys the Hopper backward as its int does:
    dK and dV bitwise (dQ is summed in arrival order, so to rounding), eagerly and replayed from a graph."""
    q, k, v = _qkv(1, 4, 2, 600, 600, 64, torch.bfloat16)
    do = torch.randn_like(q)
    scale, p = 0.125, 0.2
    with configs.forced_path("hopper"):
        o, lse = ops._fwd_impl(q, k, v, -1, 0, scale, p, 2**40 + 3)
        assert ops.uses_hopper_backward(q, k, v, do, p)
        by_int = ops._bwd_impl(do, q, k, v, o, lse, -1, 0, scale, p, 2**40 + 3)
        seed = torch.tensor(2**40 + 3, dtype=torch.int64, device=DEVICE)
        by_tensor = ops._bwd_impl(do, q, k, v, o, lse, -1, 0, scale, p, seed)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ops._bwd_impl(do, q, k, v, o, lse, -1, 0, scale, p, seed)
        graph.replay()
    for grads in (by_tensor, captured):
        torch.testing.assert_close(grads[0], by_int[0], rtol=0, atol=1.6e-2)
        assert torch.equal(grads[1], by_int[1]) and torch.equal(grads[2], by_int[2])


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("dims", [(8, 16, 2048, 128, True), (4, 8, 4096, 64, False), (2, 16, 2048, 256, True)],
                         ids=str)
def test_hopper_backward_on_a_full_grid_stays_close_to_the_portable_backward(dims):
    # Many programs per SM, several rounds: a consumer that overwrote its K half with dK while the other consumer's
    # last dQ products still read it gave dQ errors of 0.07-0.19 here, at 1 in 3 runs.
    b, h, s, d, causal = dims
    q, k, v = _qkv(b, h, h, s, s, d, torch.bfloat16)
    do = torch.randn_like(q)
    with configs.forced_path("portable"):
        portable = _grads(lambda x, y, z: flash_attention(x, y, z, causal=causal), q, k, v, do)
    with configs.forced_path("hopper"):
        assert ops.uses_hopper_backward(q, k, v, do)
        for _ in range(3):
            hopper = _grads(lambda x, y, z: flash_attention(x, y, z, causal=causal), q, k, v, do)
            for name, got, want in zip(("o", "dq", "dk", "dv"), hopper, portable, strict=True):
                err = (got.float() - want.float()).abs().max().item()
                assert err < 0.03, f"{name}: max |hopper - portable| = {err}"


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("d", [64, 128, 256])
def test_deterministic_calls_repeat_bitwise_on_the_portable_or_the_reduction_free_hopper_backward(d):
    """``deterministic`` calls take the Hopper backward where its dQ comes from the dQ kernel of its own (head dims 128
    and 256), the portable one where the Hopper backward would add dQ up in arrival order (64). Either way a second
    call gives the same bits."""
    q, k, v = _qkv(2, 8, 2, 1000, 1000, d, torch.bfloat16)
    do = torch.randn_like(q)
    with configs.forced_path("hopper"):
        assert ops.uses_hopper_backward(q, k, v, do, deterministic=True) == (d in (128, 256))
        assert not ops.uses_hopper_backward(q, k, v, do, 0.1, deterministic=True)
        first, second = (_grads(lambda a, b, c: flash_attention(a, b, c, causal=True, deterministic=True), q, k, v, do)
                         for _ in range(2))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.cuda
@needs_hopper
def test_auto_path_takes_the_hopper_backward_on_long_sequences_or_with_dropout():
    short = _qkv(2, 16, 16, 512, 512, 64, torch.bfloat16)
    long_keys = _qkv(1, 2, 2, 512, 4096, 64, torch.bfloat16)
    long = _qkv(1, 2, 2, 1024, 1024, 64, torch.bfloat16)
    wide_short = _qkv(1, 2, 2, 256, 256, 128, torch.bfloat16)
    wide = _qkv(1, 2, 2, 256, 512, 128, torch.bfloat16)
    with configs.forced_path("auto"):
        assert not ops.uses_hopper_backward(*short, short[0])
        assert not ops.uses_hopper_backward(*short, short[0], dropout_p=0.1)
        assert ops.uses_hopper_backward(*long_keys, long_keys[0])  # Sq 512 of at least 512, Sk 4096
        assert ops.uses_hopper_backward(*long, long[0])
        assert ops.uses_hopper_backward(*long, long[0], dropout_p=0.1)
        assert not ops.uses_hopper_backward(*long, long[0], deterministic=True)
        assert not ops.uses_hopper_backward(*wide_short, wide_short[0])
        assert ops.uses_hopper_backward(*wide, wide[0])
    with configs.forced_path("hopper"):
        assert ops.uses_hopper_backward(*short, short[0])


def test_a_hopper_tile_swapped_for_a_block_is_part_of_the_replay_signature(monkeypatch):
    """Eager calls replay the launches recorded under the same signature: a tool that swaps a Hopper tile
    (``configs.hopper_tiles``, ``configs.hopper_dq_kernel``) must not replay a launch recorded under the table's."""
    monkeypatch.setattr(ops, "prepared_launches_enabled", lambda: True)  # as on a GPU, not the interpreter
    q = torch.empty(1, 2, 64, 256)
    signature = lambda: ops._eager_signature(q, q, q, -1, 0, 0.1, 0.0, 0, None, False)
    table, forward = signature(), configs.HOPPER_FORWARD[256]
    with configs.hopper_tiles(forward={256: forward._replace(stages=forward.stages + 1)}):
        assert configs.HOPPER_FORWARD[256].stages == forward.stages + 1
        assert signature() != table
    with configs.hopper_dq_kernel(dims=()):
        assert signature() != table
    assert signature() == table and configs.HOPPER_FORWARD[256] == forward

def test_auto_takes_the_hopper_backward_from_its_head_dims_lengths():
    for block_d, least_keys, least_queries, least_with_dropout in ((64, 1024, 512, 1024), (128, 512, 256, 512)):
        # without dropout: long enough keys, and queries from a shorter minimum
        assert configs.prefers_hopper_backward(block_d, least_queries, least_keys)
        assert not configs.prefers_hopper_backward(block_d, least_queries - 1, 8192)
        assert not configs.prefers_hopper_backward(block_d, 8192, least_keys - 1)
        n = least_with_dropout
        assert configs.prefers_hopper_backward(block_d, n, n, dropout=True)
        assert not configs.prefers_hopper_backward(block_d, n - 1, 8192, dropout=True)
        assert not configs.prefers_hopper_backward(block_d, 8192, n - 1, dropout=True)
    # head dim 256: from 64 queries and keys, but no dropout (those kernels have none)
    assert configs.prefers_hopper_backward(256, 64, 64)
    assert not configs.prefers_hopper_backward(256, 63, 8192)
    assert not configs.prefers_hopper_backward(256, 8192, 63)
    assert not configs.prefers_hopper_backward(256, 8192, 8192, dropout=True)


def test_auto_takes_the_hopper_forward_from_its_head_dims_programs_per_sm_and_lengths():
    # head dim 128: from half a program per SM, at any length
    assert configs.prefers_hopper_forward(128, 66, 132, 1, 1)
    assert not configs.prefers_hopper_forward(128, 65, 132, 8192, 8192)
    # head dim 256: every grid
    assert configs.prefers_hopper_forward(256, 1, 132, 1, 1)
    # head dim 64: from two programs per SM, with queries and keys from its least length
    least = configs.HOPPER_FORWARD_MIN_LENGTH[64]
    assert configs.prefers_hopper_forward(64, 264, 132, least, least)
    assert not configs.prefers_hopper_forward(64, 10_000, 132, least - 1, 8192)
    assert not configs.prefers_hopper_forward(64, 10_000, 132, 8192, least - 1)
    assert not configs.prefers_hopper_forward(64, 263, 132, 8192, 8192)
    # full attention at head dim 64 from its own least length (on the short tile)
    full = configs.HOPPER_FORWARD_MIN_LENGTH_FULL[64]
    assert full < least
    assert configs.prefers_hopper_forward(64, 264, 132, full, full, full=True)
    assert not configs.prefers_hopper_forward(64, 264, 132, full, full)
    assert not configs.prefers_hopper_forward(64, 264, 132, full - 1, 8192, full=True)
    # causal calls on the one-consumer tile: every grid and length it applies to; on the paired two-consumer tile:
    # every grid from its least length
    below = configs.HOPPER_FORWARD_SHORT[64][2]
    assert configs.prefers_hopper_forward(64, 1, 132, 256, 256, causal=True)
    assert configs.prefers_hopper_forward(64, 1, 132, least, least, causal=True)
    assert configs.prefers_hopper_forward(64, 1, 132, below - 1, below - 1, causal=True)
    assert not configs.prefers_hopper_forward(64, 1, 132, below, below, causal=True)  # three consumers
    assert not configs.prefers_hopper_forward(64, 1, 132, least, least)  # not causal: the grid bound holds


def test_shorter_causal_head_dim_64_calls_take_one_consumer_per_program():
    tile, least, below = configs.HOPPER_FORWARD_SHORT_CAUSAL[64]
    assert tile.consumers == 1 and tile.query_rows == 64 and tile.persistent and tile.programs_per_sm == 3
    for sq, sk in ((least, least), (below - 1, below - 1), (least, below - 1)):
        assert configs.hopper_forward_tile(64, sq, right=0, sk=sk) == tile
    two_consumers = configs.HOPPER_FORWARD_SHORT[64][0]
    for sq, sk in ((least - 1, least), (below, below), (1000, below)):  # outside the measured lengths
        assert configs.hopper_forward_tile(64, sq, right=0, sk=sk) == two_consumers
    assert configs.hopper_forward_tile(64, 1024, sk=1024) == two_consumers  # full attention from 1024 keys
    assert configs.hopper_forward_tile(64, 1000, left=0, right=0, sk=1000) == configs.HOPPER_FORWARD[64]  # left edge
    assert configs.hopper_forward_tile(64, 1000, right=0) == tile  # keys as many as queries when not given
    # grouped-query calls keep the tile to a longer bound
    grouped_below = configs.HOPPER_FORWARD_GROUPED_CAUSAL_BELOW[64]
    assert grouped_below > below
    for sq, sk in ((below, below), (grouped_below - 1, grouped_below - 1), (least, grouped_below - 1)):
        assert configs.hopper_forward_tile(64, sq, right=0, sk=sk, grouped=True) == tile
        assert configs.prefers_hopper_forward(64, 1, 132, sq, sk, causal=True, grouped=True)
    for sq, sk in ((grouped_below, grouped_below), (least - 1, least)):  # the ungrouped call's tile
        assert configs.hopper_forward_tile(64, sq, right=0, sk=sk, grouped=True) != tile
        assert (configs.hopper_forward_tile(64, sq, right=0, sk=sk, grouped=True)
                == configs.hopper_forward_tile(64, sq, right=0, sk=sk))
    assert configs.hopper_forward_tile(64, below, sk=below, grouped=True) == configs.HOPPER_FORWARD[64]  # full


def test_short_full_head_dim_64_calls_take_one_consumer_per_program_on_any_grid():
    tile = configs.HOPPER_FORWARD_SHORT_CAUSAL[64][0]
    least, below = configs.HOPPER_FORWARD_SHORT_FULL[64]
    for sq, sk in ((least, least), (below - 1, below - 1), (least, below - 1), (512, 512)):
        assert configs.hopper_forward_tile(64, sq, sk=sk) == tile
        assert configs.prefers_hopper_forward(64, 1, 132, sq, sk, full=True)  # whatever the grid
    two_consumers = configs.HOPPER_FORWARD_SHORT[64][0]
    for sq, sk in ((least - 1, least), (below, below), (512, below)):  # outside the measured lengths
        assert configs.hopper_forward_tile(64, sq, sk=sk) == two_consumers
    assert not configs.prefers_hopper_forward(64, 1, 132, least - 1, least - 1, full=True)
    assert configs.hopper_forward_tile(64, 512, left=0, right=0, sk=512) == configs.HOPPER_FORWARD[64]  # a band
    assert configs.hopper_forward_tile(128, 512, sk=512) == configs.HOPPER_FORWARD[128]  # D 128: not measured


def test_short_causal_head_dim_128_calls_take_64_key_blocks():
    short, full_below, right_edge_below = configs.HOPPER_FORWARD_SHORT[128]
    assert short.block_n == 64 and full_below == 0
    assert configs.hopper_forward_tile(128, 1, right=0) == short
    assert configs.hopper_forward_tile(128, right_edge_below - 1, right=0) == short
    assert configs.hopper_forward_tile(128, right_edge_below, right=0) == configs.HOPPER_FORWARD[128]
    assert configs.hopper_forward_tile(128, 1) == configs.HOPPER_FORWARD[128]  # full attention keeps 128 keys


def test_short_head_dim_64_calls_without_a_left_edge_take_the_two_consumer_tile():
    short, full_below, right_edge_below = configs.HOPPER_FORWARD_SHORT[64]
    assert short.consumers == 2 and short.persistent and configs.HOPPER_FORWARD[64].consumers == 3
    assert configs.hopper_forward_tile(64, full_below - 1) == short
    assert configs.hopper_forward_tile(64, full_below) == configs.HOPPER_FORWARD[64]
    assert configs.hopper_forward_tile(64, right_edge_below - 1, right=0) == short
    assert configs.hopper_forward_tile(64, right_edge_below, right=0) == configs.HOPPER_FORWARD[64]
    assert configs.hopper_forward_tile(64, 100, left=50) == configs.HOPPER_FORWARD[64]  # a left edge: three
    # a tile swapped in for a head dim serves every length of it, and the table comes back after the block
    other = configs.HOPPER_FORWARD[64]._replace(stages=3)
    with configs.hopper_tiles(forward={64: other}):
        assert configs.hopper_forward_tile(64, 100) == other
        assert configs.hopper_forward_tile(64, 1000, right=0) == other  # the one-consumer tile steps aside too
    assert configs.hopper_forward_tile(64, 100) == short
    assert configs.hopper_forward_tile(64, 1000, right=0) == configs.HOPPER_FORWARD_SHORT_CAUSAL[64][0]


def test_an_eager_backward_decides_its_kernel_path_once_per_signature_and_alignment(monkeypatch):
    decisions = []
    monkeypatch.setattr(ops, "uses_hopper_backward", lambda *args: decisions.append(args) or True)
    monkeypatch.setattr(ops, "_HOPPER_BACKWARD_CHOICES", ops.PreparedCache())
    storage = torch.zeros(2 * 64 * 16 + 1)
    q = storage[:2 * 64 * 16].view(1, 2, 64, 16)
    unaligned = storage[1:].view(1, 2, 64, 16)  # 4 bytes past a 16-byte boundary
    for _ in range(3):
        assert ops._hopper_backward_choice(("signature",), q, q, q, q, 0.0, None, False)
    assert len(decisions) == 1
    assert ops._hopper_backward_choice(("signature",), unaligned, q, q, q, 0.0, None, False)
    assert ops._hopper_backward_choice(("another",), q, q, q, q, 0.0, None, False)
    assert len(decisions) == 3
    # calls that are not replayed (no signature) decide every time
    ops._hopper_backward_choice(None, q, q, q, q, 0.0, None, False)
    ops._hopper_backward_choice(None, q, q, q, q, 0.0, None, False)
    assert len(decisions) == 5


@pytest.mark.cuda
@needs_hopper
def test_auto_path_takes_the_hopper_forward_where_it_is_preferred():
    big = _qkv(2, 16, 16, 2048, 2048, 128, torch.bfloat16)  # 512 programs
    small = _qkv(1, 2, 2, 300, 300, 128, torch.bfloat16)  # 6 programs
    one_wave = _qkv(1, 32, 32, 512, 8192, 128, torch.bfloat16)  # 128 programs: about one per SM (114-132 SMs)
    narrow_long = _qkv(2, 32, 32, 2048, 2048, 64, torch.bfloat16)  # 704 programs of 192 rows
    narrow_short = _qkv(8, 32, 32, 1024, 1024, 64, torch.bfloat16)
    narrow_few = _qkv(1, 16, 16, 2048, 2048, 64, torch.bfloat16)  # 256 programs of 128 rows: under two per SM
    with configs.forced_path("auto"):
        # head dim 64 on a small grid: causal calls on the paired tile, full attention on the portable kernel
        assert ops.uses_hopper_forward(*narrow_few, right=0) and not ops.uses_hopper_forward(*narrow_few)
        assert ops.uses_hopper_forward(*big) and ops.uses_hopper_forward(*narrow_long)
        assert ops.uses_hopper_forward(*one_wave)
        assert not ops.uses_hopper_forward(*small)
        # head dim 64 at S 1024: full attention on the two-consumer tile, causal on the one-consumer tile; a sliding
        # window (a left edge) on the portable kernel
        assert ops.uses_hopper_forward(*narrow_short) and ops.uses_hopper_forward(*narrow_short, right=0)
        assert not ops.uses_hopper_forward(*narrow_short, left=256, right=0)
    with configs.forced_path("hopper"):
        assert ops.uses_hopper_forward(*small) and ops.uses_hopper_forward(*narrow_short)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("why", ["dropout", "dropout at head dim 256", "fp32", "packed", "unaligned stride",
                                 "head dim 512", "portable path"])
def test_calls_the_hopper_kernels_do_not_take_run_the_portable_kernels(why):
    dtype = torch.float32 if why == "fp32" else torch.bfloat16
    # 36: a 72-byte row stride, which TMA cannot take
    d = {"unaligned stride": 36, "head dim 512": 512, "dropout at head dim 256": 256}.get(why, 64)
    q, k, v = _qkv(1, 2, 2, 100, 100, d, dtype)
    if why == "packed":
        packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
        cu = torch.tensor([0, 60, 100], device=DEVICE, dtype=torch.int32)
        assert not ops.uses_hopper_forward(*packed, varlen=(cu, cu, 60, 60))
        assert not ops.uses_hopper_backward(*packed, packed[0], varlen=(cu, cu, 60, 60))
        o = flash_attention_varlen(*packed, cu, cu, 60, 60, causal=True)
        with configs.forced_path("portable"):
            first = flash_attention(*(t[:60].transpose(0, 1)[None] for t in packed), causal=True)
        torch.testing.assert_close(o[:60], first[0].transpose(0, 1), rtol=0, atol=1.6e-2)
        return
    dropout_p = 0.1 if why.startswith("dropout") else 0.0
    path = "portable" if why == "portable path" else "hopper"
    with configs.forced_path(path):
        assert not ops.uses_hopper_forward(q, k, v, dropout_p)
        # the Hopper backward draws the dropout mask at head dims 64 and 128; the forward leaves dropout to the
        # portable kernel
        assert ops.uses_hopper_backward(q, k, v, q, dropout_p) == (why == "dropout")
        o = flash_attention(q, k, v, causal=True, dropout_p=dropout_p, seed=5)
    assert torch.isfinite(o).all()
    if dropout_p == 0.0:
        reference = twin.attention(q.double(), k.double(), v.double(), causal=True)
        peer = _low_precision_attention(q, k, v, True, (-1, -1))
        assert_no_worse_than_torch("o", o, peer, reference, atol=2e-5 if dtype == torch.float32 else 1.6e-2)


@pytest.mark.cuda
@needs_hopper
def test_a_compiled_call_runs_the_hopper_kernels_and_matches_eager(monkeypatch):
    """Under torch.compile the Gluon kernels run inside opaque ops (they cannot be traced as the portable kernels
    are), and a deterministic call takes the same backward as eagerly: at head dim 128 the dK/dV kernel and the dQ
    kernel (the same bits as eagerly), at 64 the portable backward."""
    from kernels._common.launch import forget_recorded_launches

    launched = []
    for name in ("_launch_fwd_hopper", "_launch_bwd_hopper", "_launch_bwd_hopper_dq"):
        launch = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _launch=launch, _name=name, **kw: (launched.append(_name),
                                                                                     _launch(*a, **kw))[1])
    hopper_bwd = ["_launch_bwd_hopper"]
    for d, deterministic, backward in ((128, False, hopper_bwd), (128, True, [*hopper_bwd, "_launch_bwd_hopper_dq"]),
                                       (64, True, [])):
        q, k, v = (t.requires_grad_(True) for t in _qkv(2, 4, 2, 200, 300, d, torch.bfloat16))
        do = torch.randn_like(q)

        def block(a, b, c):
            return flash_attention(a, b, c, causal=True, deterministic=deterministic)  # noqa: B023

        with configs.forced_path("hopper"):
            eager_o = block(q, k, v)
            eager = torch.autograd.grad(eager_o, (q, k, v), do)
            torch._dynamo.reset()
            forget_recorded_launches()  # a recording would replay without the launchers
            launched.clear()
            o = torch.compile(block, fullgraph=True)(q, k, v)
            compiled = torch.autograd.grad(o, (q, k, v), do)
        assert launched == ["_launch_fwd_hopper", *backward], (d, deterministic)
        torch.testing.assert_close(o, eager_o, rtol=0, atol=0)
        for a, b in zip(eager, compiled, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0 if deterministic else 2e-3)


#: (B, Hq, Hkv, Sq, Sk, D, causal, dropout p, dtype): grouped calls whose backward may split a group over programs
GROUP_SPLIT_CASES = [
    (2, 8, 2, 300, 300, 128, True, 0.0, torch.bfloat16),  # group 4, partial blocks
    (1, 14, 2, 200, 333, 64, False, 0.0, torch.float16),  # group 7: parts of 1, 2 + 2 + 2 + 1 or 3 + 3 + 1; Sq != Sk
    (2, 8, 1, 256, 512, 128, True, 0.25, torch.bfloat16),  # MQA, group 8, dropout
]


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("heads", [1, 2, 3])
@pytest.mark.parametrize("case", GROUP_SPLIT_CASES, ids=str)
def test_a_group_split_over_programs_gives_the_unsplit_backwards_gradients(case, heads):
    """At most ``heads`` query heads per program (``configs.hopper_group_heads``): the group's parts add dK and dV
    into fp32 accumulators; every gradient stays within twice torch's error and close to the unsplit kernel's."""
    b, hq, hkv, sq, sk, d, causal, p, dtype = case
    q, k, v = _qkv(b, hq, hkv, sq, sk, d, dtype)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    kw = {"causal": causal, "dropout_p": p, "seed": 11}
    bd = configs.block_d(d)
    with configs.forced_path("hopper"):
        assert ops.uses_hopper_backward(q, k, v, do, p)
        with configs.hopper_group_heads(heads):
            parts = configs.hopper_group_parts(hq // hkv, bd, False, False, False, -1, 0 if causal else -1)
            split = _grads(lambda a, b_, c: flash_attention(a, b_, c, **kw), q, k, v, do)
        with configs.hopper_group_heads(hq // hkv):
            whole = _grads(lambda a, b_, c: flash_attention(a, b_, c, **kw), q, k, v, do)
    assert parts == -(-(hq // hkv) // heads)
    peer = _grads(lambda a, b_, c: _low_precision_attention(a, b_, c, causal, (-1, -1), p, 11), q, k, v, do)
    reference = _grads(lambda a, b_, c: twin.attention(a, b_, c, **kw), q.double(), k.double(), v.double(),
                       do.double())
    for name, got, unsplit, pe, r in zip(("o", "dq", "dk", "dv"), split, whole, peer, reference, strict=True):
        assert got.dtype == dtype and got.shape == r.shape and got.stride() == unsplit.stride(), name
        assert_no_worse_than_torch(name, got, pe, r, atol=ATOL[dtype])
        torch.testing.assert_close(got, unsplit, rtol=0, atol=ATOL[dtype], msg=name)


def test_hopper_group_parts_split_a_group_into_the_fewest_parts_of_at_most_the_set_heads():
    """The fewest parts of at most ``HOPPER_BACKWARD_GROUP_HEADS`` heads; the parts need not divide the group (the
    kernel gives each ``cdiv(group, parts)`` heads and the last the rest). The table's own rule: causal calls split,
    others keep the whole group."""
    causal, full, window = (-1, 0), (-1, -1), (64, 0)

    def parts(group, block_d=128, dq_kernel=False, d_split=False, deterministic=False, band=causal):
        return configs.hopper_group_parts(group, block_d, dq_kernel, d_split, deterministic, *band)

    with configs.hopper_group_heads(4):
        assert [parts(g) for g in (1, 2, 4, 5, 6, 7, 8, 16)] == [1, 1, 1, 2, 2, 2, 2, 4]
        assert parts(8, band=full) == parts(8, block_d=64) == 2
        # no split where nothing sums dK and dV: the dQ kernel, head dims 65-96 and 256, deterministic calls
        assert parts(8, dq_kernel=True) == parts(8, d_split=True) == parts(8, block_d=256) == 1
        assert parts(8, deterministic=True) == 1
    with configs.hopper_group_heads(1):
        assert parts(6, block_d=64) == 6
    heads = configs.HOPPER_BACKWARD_GROUP_HEADS
    for group in (2, 4, 7, 8):
        assert parts(group) == (1 if heads["causal"] is None else -(-group // heads["causal"]))
        for band in (full, window):  # a window bounds both sides: the "full" entry
            assert parts(group, band=band) == (1 if heads["full"] is None else -(-group // heads["full"]))


def test_hopper_group_heads_is_checked_restored_and_changes_the_replay_signature():
    before, version = dict(configs.HOPPER_BACKWARD_GROUP_HEADS), configs.hopper_tables_version
    with configs.hopper_group_heads(3):
        assert configs.HOPPER_BACKWARD_GROUP_HEADS == {"causal": 3, "full": 3}
        assert configs.hopper_tables_version != version  # a launch recorded under another split is not replayed
    assert (configs.HOPPER_BACKWARD_GROUP_HEADS, configs.hopper_tables_version) == (before, version)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="heads"), configs.hopper_group_heads(bad):
            pass


def test_the_backward_preprocess_zeroes_the_dk_dv_accumulators_of_a_split_group():
    """A group split over programs adds dK and dV into fp32 accumulators ((B, Hkv, Sk, padded D)) that the
    preprocess kernel zeroes: their rows are not its grid's, so they are dealt over its programs, here more rows
    than the grid's and a count that is no multiple of the block."""
    o, do = (torch.randn(2, 4, 70, 40, generator=torch.Generator().manual_seed(s)).to(DEVICE, torch.float16)
             for s in (1, 2))
    delta = torch.empty(2, 4, 70, device=DEVICE)
    dkv = tuple(torch.full((2, 2, 333, 64), float("nan"), device=DEVICE) for _ in range(2))
    ops._launch_bwd_preprocess(o, do, delta, dkv_acc=dkv)
    torch.testing.assert_close(delta, (o.float() * do.float()).sum(-1), rtol=1e-4, atol=1e-4)
    for acc in dkv:
        assert torch.equal(acc, torch.zeros_like(acc))


def test_the_backward_preprocess_zeroes_the_hopper_dq_accumulator():
    """The Hopper backward adds dQ into an fp32 accumulator ((B, Hq, Sq, padded D)) that the preprocess kernel
    zeroes beside ``delta``: every row, the padded columns too, at a length that is not a multiple of the block."""
    o, do = (torch.randn(2, 3, 70, 40, generator=torch.Generator().manual_seed(s)).to(DEVICE, torch.float16)
             for s in (1, 2))
    delta = torch.empty(2, 3, 70, device=DEVICE)
    acc = torch.full((2, 3, 70, 64), float("nan"), device=DEVICE)
    ops._launch_bwd_preprocess(o, do, delta, dq_acc=acc)
    torch.testing.assert_close(delta, (o.float() * do.float()).sum(-1), rtol=1e-4, atol=1e-4)
    assert torch.equal(acc, torch.zeros_like(acc))


@pytest.mark.cuda
@needs_hopper
def test_hopper_launches_take_the_cached_path():
    """The Gluon kernels' launches, with their TMA arguments, are cached by the family's launcher like every other
    launch (Triton's own launch of a Gluon kernel cost ~100 us more host time per call on an H100 host)."""
    from kernels._common.launch import _fast_launcher, forget_recorded_launches
    from kernels.attention import _hopper, _hopper_bwd, _hopper_bwd_split

    # an earlier test's recording of the same call would replay without the launcher
    forget_recorded_launches()
    for d in (128, 256):
        q, k, v = (torch.randn(1, 2, 256, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        # a dense dO: the gradient of .sum() is an expanded tensor (stride 0), which TMA cannot read, and its
        # backward would run the portable kernels
        do = torch.randn_like(q)
        with configs.forced_path("hopper"):
            assert ops.uses_hopper_backward(q, k, v, do)
            for _ in range(2):
                flash_attention(q, k, v, causal=True).backward(do)
    for kernel in (_hopper._attn_fwd_hopper_kernel, _hopper_bwd._attn_bwd_hopper_kernel,
                   _hopper_bwd_split._attn_bwd_hopper_split_kernel):
        assert _fast_launcher(kernel)._compiled, kernel.__name__


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("split_96", [True, False], ids=["columns96", "columns128"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("case", [
    (1, 8, 2, 777, 777, 96, True, (-1, -1), torch.bfloat16, "bhsd"),
    (2, 4, 4, 300, 500, 80, False, (-1, -1), torch.float16, "bshd"),
    (1, 6, 6, 400, 400, 72, False, (100, 20), torch.bfloat16, "bhsd"),
], ids=str)
def test_head_dims_up_to_96_give_torchs_gradients_over_96_columns_or_the_whole_tile(case, dropout_p, split_96):
    """Head dims 65-96 run in the D 128 Hopper tiles either over 64 + 32 columns (``split_96``, ``D_SPLIT``; the
    default) or over the whole 128-column tile: the output (forward on the Hopper kernel without dropout) and every
    gradient within twice torch's error either way."""
    *dims, causal, window, dtype, layout = case
    q, k, v = _qkv(*dims, dtype, layout)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    kw = {"causal": causal, "window_size": window, "dropout_p": dropout_p, "seed": 3}
    with configs.forced_path("hopper"), configs.hopper_tiles(
            forward={128: configs.HOPPER_FORWARD[128]._replace(split_96=split_96)},
            backward={128: configs.HOPPER_BACKWARD[128]._replace(split_96=split_96)}):
        assert ops.uses_hopper_backward(q, k, v, do, dropout_p=dropout_p)
        assert ops.uses_hopper_forward(q, k, v, dropout_p=dropout_p) == (dropout_p == 0)
        got = _grads(lambda a, b, c: flash_attention(a, b, c, **kw), q, k, v, do)
    peer = _grads(lambda a, b, c: _low_precision_attention(a, b, c, causal, window, dropout_p, 3), q, k, v, do)
    reference = _grads(lambda a, b, c: twin.attention(a, b, c, **kw), q.double(), k.double(), v.double(), do.double())
    for name, g, p, r in zip(("o", "dq", "dk", "dv"), got, peer, reference, strict=True):
        assert_no_worse_than_torch(name, g, p, r, atol=ATOL[dtype])


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("deterministic", [False, True], ids=["reduced-dq", "deterministic"])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_hopper_outputs_and_gradients_keep_the_layout_of_bshd_views(d, deterministic):
    """On the Hopper kernels (every head-dim tile; dQ by reductions or, where ``deterministic`` takes it, by its own
    kernel) O of (B, S, H, D) views is stored (B, S, H, D) and dQ, dK, dV in q's, k's and v's layout, dO in O's
    layout read in place; the values are the contiguous call's."""
    q, k, v = _qkv(2, 4, 2, 300, 300, d, torch.bfloat16, "bshd")
    do = torch.randn(2, 300, 4, d, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    do = do.transpose(1, 2)  # as the gradient of o.transpose(1, 2).reshape(B, S, H * D) arrives
    kw = {"causal": True, "deterministic": deterministic}
    with configs.forced_path("hopper"):
        assert ops.uses_hopper_forward(q, k, v)
        hopper_backward = ops.uses_hopper_backward(q, k, v, do, deterministic=deterministic)
        assert hopper_backward or deterministic  # deterministic calls take it only where dQ has a kernel of its own
        got = _grads(lambda a, b, c: flash_attention(a, b, c, **kw), q, k, v, do)
        dense = _grads(lambda a, b, c: flash_attention(a, b, c, **kw), *(t.contiguous() for t in (q, k, v, do)))
    for name, t, like in zip(("o", "dq", "dk", "dv"), got, (q, q, k, v), strict=True):
        assert t.stride() == like.stride(), (name, t.stride(), like.stride())
    for name, g, e in zip(("o", "dq", "dk", "dv"), got, dense, strict=True):
        if name == "dq" and not deterministic:  # summed in arrival order
            torch.testing.assert_close(g, e, rtol=0, atol=ATOL[torch.bfloat16])
        else:
            assert torch.equal(g, e), name


@pytest.mark.cuda
@needs_hopper
def test_inputs_whose_contiguous_outputs_tma_cannot_store_take_the_portable_kernels():
    """Head dim 100 as views of a 104-wide buffer: q, k, v are TMA-readable (208-byte rows), but their outputs,
    laid out contiguously (the views have gaps), have 200-byte rows that TMA cannot store; the calls take the
    portable kernels even on the forced Hopper path, and give torch's gradients."""
    buffers = _qkv(1, 4, 2, 200, 200, 104, torch.bfloat16)
    q, k, v = (t[..., :100] for t in buffers)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    with configs.forced_path("hopper"):
        assert not ops.uses_hopper_forward(q, k, v)
        assert not ops.uses_hopper_backward(q, k, v, do)
        got = _grads(lambda a, b, c: flash_attention(a, b, c, causal=True), q, k, v, do)
    peer = _grads(lambda a, b, c: _low_precision_attention(a, b, c, True, (-1, -1), 0.0, 0), q, k, v, do)
    reference = _grads(lambda a, b, c: twin.attention(a, b, c, causal=True), q.double(), k.double(), v.double(),
                       do.double())
    for name, g, p, r in zip(("o", "dq", "dk", "dv"), got, peer, reference, strict=True):
        assert g.is_contiguous(), name
        assert_no_worse_than_torch(name, g, p, r, atol=ATOL[torch.bfloat16])


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("causal, hkv", [(True, 8), (True, 2), (False, 2)], ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_a_block_accumulated_in_the_hopper_kernel_adds_its_gradients_to_what_the_accumulators_hold(d, causal, hkv):
    """Context-parallel attention's ring steps add each block's gradients into fp32 accumulators: the Hopper
    backward does it by TMA reductions (``REDUCE_DKDV``, dQ as always) into views of larger tensors that already
    hold other blocks' sums; what it adds is the kernel's ordinary gradients (before their rounding to bf16), and
    nothing outside the views moves. A GQA group of 4 in causal calls is split over programs as well."""
    b, hq, sq, sk = 2, 8, 1024, 2048
    q, k, v = _qkv(b, hq, hkv, sq, sk, d, torch.bfloat16)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    scale, right = d ** -0.5, 0 if causal else -1
    bd = configs.block_d(d)
    g = torch.Generator().manual_seed(2)
    dq_big = torch.randn(b, hq, sq + 128, bd, generator=g).to(DEVICE)
    dk_big, dv_big = (torch.randn(b, hkv, sk + 256, bd, generator=g).to(DEVICE) for _ in range(2))
    before = [t.clone() for t in (dq_big, dk_big, dv_big)]
    accumulators = (dq_big[:, :, 128:], dk_big[:, :, 256:], dv_big[:, :, 256:])
    with configs.forced_path("hopper"):
        o, lse = ops._fwd_impl(q, k, v, -1, right, scale)
        expected = ops._bwd_impl(do, q, k, v, o, lse, -1, right, scale)
        assert ops.accumulates_in_kernel(do, q, k, v, *accumulators)
        ops._bwd_accumulate(do, q, k, v, o, lse, -1, right, scale, *accumulators)
    for name, big, old, skip, want in zip(("dq", "dk", "dv"), (dq_big, dk_big, dv_big), before, (128, 256, 256),
                                          expected, strict=True):
        assert torch.equal(big[:, :, :skip], old[:, :, :skip]), name
        added = big[:, :, skip:, :d] - old[:, :, skip:, :d]
        torch.testing.assert_close(added, want.float(), rtol=1.6e-2, atol=1.6e-2, msg=name)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("causal", [True, False])
def test_a_forward_beside_a_transfer_takes_one_program_per_tile_and_the_same_results(causal):
    """``beside_transfer`` (a ring step whose K/V transfer runs beside the forward) swaps the persistent Hopper
    forward for one program per tile: the same tiles, so the same output and log-sum-exp, bit for bit."""
    q, k, v = _qkv(2, 8, 2, 2048, 4096, 128, torch.bfloat16)
    with configs.forced_path("hopper"):
        assert ops.uses_hopper_forward(q, k, v) and configs.HOPPER_FORWARD[128].persistent
        o, lse = ops._fwd_impl(q, k, v, -1, 0 if causal else -1, 128 ** -0.5)
        o_beside, lse_beside = ops._fwd_impl(q, k, v, -1, 0 if causal else -1, 128 ** -0.5, beside_transfer=True)
    assert torch.equal(o, o_beside) and torch.equal(lse, lse_beside)
