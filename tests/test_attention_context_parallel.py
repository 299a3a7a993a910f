"""context_parallel_attention over torch.distributed: ranks spawned by the test (gloo on CPUs; NCCL, one GPU per rank,
where the machine has as many GPUs), each holding its shard of one sequence; the output and the gradients of q, k
and v equal single-process flash_attention on the whole sequence (causal and full, both layouts, GQA and MQA);
shard_sequence and unshard_sequence are inverses; bad arguments raise named errors."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks._harness import spawn_ranks

#: (causal, layout, Hkv) for Hq = 4
CASES = [(True, "zigzag", 2), (True, "contiguous", 1), (False, "zigzag", 4), (False, "contiguous", 2)]


def _backend_and_device(rank: int, world: int) -> tuple[str, torch.device]:
    """NCCL with a GPU per rank where the machine has one for every rank, else gloo on CPUs (every rank alike)."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world and not os.environ.get("TRITON_INTERPRET"):
        torch.cuda.set_device(rank)
        return "nccl", torch.device("cuda", rank)
    return "gloo", torch.device("cpu")


def _worker(rank: int, world: int, init_file: str) -> None:
    import kernels._mode  # noqa: F401  (CUDA or the interpreter, before triton is imported)

    # isort: split

    import torch.distributed as dist

    from kernels.attention import context_parallel_attention, flash_attention, shard_sequence, unshard_sequence

    backend, device = _backend_and_device(rank, world)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    # CPUs run fp32, then one bf16 case (the last hop of a shard's gradient travels in the inputs' dtype); GPUs bf16
    runs = [(torch.bfloat16, case) for case in CASES] if device.type == "cuda" else (
        [(torch.float32, case) for case in CASES] + [(torch.bfloat16, CASES[0])])
    for dtype, (causal, layout, hkv) in runs:
        # bf16: the ring rounds each block's partial output and gradient to bf16 before its fp32 merge, the whole
        # call rounds once; relative to the values (dV sums up to S rows) as torch's bf16 default, plus an absolute
        # floor for values near 0
        atol, rtol = (2e-2, 1.6e-2) if dtype == torch.bfloat16 else (2e-5, 0.0)
        g = torch.Generator().manual_seed(7)  # the same whole tensors on every rank
        seq = 8 * world if device.type == "cpu" else 1024 * world
        d = 16 if device.type == "cpu" else 128
        q = torch.randn(2, 4, seq, d, generator=g).to(device, dtype).requires_grad_(True)
        k, v = (torch.randn(2, hkv, seq, d, generator=g).to(device, dtype).requires_grad_(True) for _ in range(2))
        do = torch.randn(2, 4, seq, d, generator=g).to(device, dtype)
        expected = flash_attention(q, k, v, causal=causal)
        grads = torch.autograd.grad(expected, (q, k, v), do)
        shards = [shard_sequence(t.detach(), 2, layout=layout).requires_grad_(True) for t in (q, k, v)]
        for t, shard in zip((q, k, v), shards, strict=True):
            assert torch.equal(unshard_sequence(shard.detach(), 2, layout=layout), t.detach())
        out = context_parallel_attention(*shards, causal=causal, layout=layout)
        local_grads = torch.autograd.grad(out, shards, shard_sequence(do, 2, layout=layout))
        label = f"rank {rank}/{world} {dtype} causal={causal} {layout} Hkv={hkv}"
        torch.testing.assert_close(unshard_sequence(out.detach(), 2, layout=layout), expected.detach(),
                                   rtol=rtol, atol=atol, msg=lambda m, label=label: f"{label}: output\n{m}")
        for name, ours, whole in zip(("dq", "dk", "dv"), local_grads, grads, strict=True):
            torch.testing.assert_close(ours, shard_sequence(whole, 2, layout=layout), rtol=rtol, atol=atol,
                                       msg=lambda m, what=f"{label}: {name}": f"{what}\n{m}")
    # bad arguments, named
    x = torch.zeros(1, 2, 2 * world + 1, 16, device=device)
    with pytest.raises(ValueError, match="equal chunks"):
        shard_sequence(x, 2)
    odd = torch.zeros(1, 2, 3, 16, device=device)
    with pytest.raises(ValueError, match="even"):
        context_parallel_attention(odd, odd, odd)
    with pytest.raises(ValueError, match="layout"):
        shard_sequence(x, 2, layout="striped")
    if world > 1:
        mine = torch.zeros(1, 2, 4 if rank == 0 else 6, 16, device=device)
        with pytest.raises(ValueError, match="one shape on every rank"):
            context_parallel_attention(mine, mine, mine)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ring_attention_equals_flash_attention_on_the_whole_sequence(world):
    spawn_ranks(_worker, world)


def test_without_a_process_group_the_error_says_what_is_missing():
    import torch.distributed as dist

    from kernels.attention import context_parallel_attention

    if dist.is_initialized():
        pytest.skip("this process has a process group")
    x = torch.zeros(1, 2, 4, 16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_attention(x, x, x)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_a_shards_gradient_comes_home_in_the_rows_other_ranks_attend_to(world, layout, causal):
    """The last hop of a shard's K/V gradient (the other ranks' shares, summed on the way) carries the rows from the
    first to the last key any other rank attends to: all of them for full attention, the first chunk of a zigzag
    shard 0 under a causal mask (every other rank's queries follow it whole and precede its second chunk), nothing for
    the last contiguous shard (no other rank's queries follow it)."""
    from kernels.attention import context_parallel as cp

    length = 8
    for source in range(world):
        rows = set()
        for step in range(1, world):
            for _, keys, _ in cp._blocks(step, (source + step) % world, source, world, layout, causal, length):
                rows |= set(range(keys.start, keys.stop))
        got = cp._returned_rows(source, world, layout, causal, length)
        assert set(range(got.start, got.stop)) == rows, (source, got)
    assert cp._returned_rows(0, world, layout, False, length) == slice(0, length)
    if causal and layout == "zigzag":
        assert cp._returned_rows(0, world, layout, causal, length) == slice(0, length // 2)
    if causal and layout == "contiguous":
        assert cp._returned_rows(world - 1, world, layout, causal, length) == slice(0, 0)


def test_an_accumulated_block_adds_its_gradients_to_what_the_accumulators_hold():
    """``_bwd_accumulate`` (here the kernels' gradients added by torch; on Hopper the kernel's own reductions, in
    tests/test_attention_hopper.py): twice into zeroed accumulators is twice ``_bwd_impl``'s gradients, in the
    padded columns' first D, through views into larger tensors as the ring passes them."""
    from kernels.attention import configs, ops

    g = torch.Generator().manual_seed(3)
    b, hq, hkv, sq, sk, d = 1, 4, 2, 12, 20, 24
    q = torch.randn(b, hq, sq, d, generator=g)
    k, v = (torch.randn(b, hkv, sk, d, generator=g) for _ in range(2))
    do = torch.randn(q.shape, generator=g)
    scale = d ** -0.5
    o, lse = ops._fwd_impl(q, k, v, -1, 0, scale)
    expected = ops._bwd_impl(do, q, k, v, o, lse, -1, 0, scale)
    width = configs.block_d(d)
    dq_big = torch.zeros(b, hq, sq + 4, width)
    dk_big, dv_big = (torch.zeros(b, hkv, sk + 4, width) for _ in range(2))
    accumulators = (dq_big[:, :, 4:], dk_big[:, :, :sk], dv_big[:, :, :sk])
    for _ in range(2):
        ops._bwd_accumulate(do, q, k, v, o, lse, -1, 0, scale, *accumulators)
    for name, acc, want in zip(("dq", "dk", "dv"), accumulators, expected, strict=True):
        torch.testing.assert_close(acc[..., :d], 2 * want, rtol=0, atol=0, msg=name)
        assert not acc[..., d:].any(), name
    assert not dq_big[:, :, :4].any() and not dk_big[:, :, sk:].any() and not dv_big[:, :, sk:].any()


@pytest.mark.parametrize("dst_dtype", [None, torch.float32, torch.bfloat16], ids=str)
def test_the_merge_kernel_combines_two_partial_results_as_the_union_of_their_keys(dst_dtype):
    """``merge_partial`` and its twin: rows ``row0 ..`` of a running result merged with a partial one equal attention
    over both key sets (here: two halves of one key set, attended apart); rows that saw no key on one side take the
    other's result, rows that saw none on either keep 0 and -inf; rows outside the range do not move."""
    import reference.attention as twin
    from kernels._mode import DEVICE, INTERPRETER
    from kernels.attention import flash_attention
    from kernels.attention._merge import merge_partial
    from kernels.attention.ops import _fwd_impl

    if INTERPRETER and dst_dtype == torch.bfloat16:
        pytest.skip("bf16 under the interpreter: the ring merges in fp32 with torch there")
    g = torch.Generator().manual_seed(5)
    b, h, s, d, keys, row0 = 2, 3, 24, 20, 16, 8
    q = torch.randn(b, h, s, d, generator=g).to(DEVICE)
    k, v = (torch.randn(b, h, keys, d, generator=g).to(DEVICE) for _ in range(2))
    scale = d ** -0.5
    out, lse = _fwd_impl(q, k[:, :, :10], v[:, :, :10], -1, -1, scale)
    part, part_lse = _fwd_impl(q[:, :, row0:], k[:, :, 10:], v[:, :, 10:], -1, -1, scale)
    out, lse, part_lse = out.float(), lse.float().contiguous(), part_lse.float().contiguous()
    out[0, 0, row0 + 1], lse[0, 0, row0 + 1] = 0.0, float("-inf")  # saw no key before
    part[0, 1, 2], part_lse[0, 1, 2] = 0.0, float("-inf")  # sees none now
    out[1, 2, row0 + 3], lse[1, 2, row0 + 3] = 0.0, float("-inf")  # neither
    part[1, 2, 3], part_lse[1, 2, 3] = 0.0, float("-inf")
    before, before_lse = out.clone(), lse.clone()
    twin_out, twin_lse = out.clone(), lse.clone()
    twin.merge_partial(twin_out, twin_lse, row0, part, part_lse)
    whole = flash_attention(q, k, v)
    dst = None if dst_dtype is None else torch.full_like(out, 7.0, dtype=dst_dtype)
    merge_partial(out, lse, row0, part, part_lse, dst)
    merged = out if dst is None else dst
    tol = {"rtol": 1e-5, "atol": 1e-5} if merged.dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    expected = whole.clone()
    expected[0, 0, row0 + 1] = flash_attention(q[:, :, row0 + 1:row0 + 2], k[:, :, 10:], v[:, :, 10:])[0, 0, 0]
    expected[0, 1, row0 + 2] = before[0, 1, row0 + 2]
    expected[1, 2, row0 + 3] = 0.0
    torch.testing.assert_close(merged[:, :, row0:].float(), expected[:, :, row0:], **tol)
    torch.testing.assert_close(merged.float(), twin_out if dst is None else torch.where(
        torch.arange(s, device=DEVICE)[:, None] < row0, 7.0, twin_out), **tol)
    torch.testing.assert_close(lse, twin_lse, rtol=1e-6, atol=1e-6)
    assert lse[1, 2, row0 + 3] == float("-inf") and lse[0, 1, row0 + 2] == before_lse[0, 1, row0 + 2]
    assert torch.equal(lse[:, :, :row0], before_lse[:, :, :row0])
    if dst is None:
        assert torch.equal(out[:, :, :row0], before[:, :, :row0])
    else:
        assert (dst[:, :, :row0] == 7.0).all()
