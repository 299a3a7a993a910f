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
