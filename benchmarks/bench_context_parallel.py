"""Context-parallel attention on the GPUs of one host: our ring attention against one GPU and against PyTorch's
context parallelism.

Points: B 1, H 32, D 128, causal, bf16, total sequence lengths 32k to 512k split over every GPU of the host (W
ranks, one process each, NCCL), zigzag layout; forward, and forward + backward. Providers, each timed on every rank
(the slowest rank's median counts), each in W processes of its own (spawned anew per provider: a provider's calls
never run in a process that another provider's left its state in):

- ``ours``: :func:`kernels.attention.context_parallel_attention` on this rank's shard;
- ``torch-cp-<backend>``: ``F.scaled_dot_product_attention`` inside PyTorch's
  ``torch.distributed.tensor.experimental.context_parallel`` (its load balancer and rotate method by default), with
  the SDPA backend forced (flash, cuDNN, efficient; a backend it cannot run is reported and left out);
- the single-GPU reference: :func:`kernels.attention.flash_attention` on the whole sequence, every rank on its own
  GPU at once (not a provider: it gives each point's ``efficiency`` = single-GPU time / (W x ring time), the share of
  W GPUs' time that ring attention turns into the same work one GPU does).

TFLOP/s are per GPU: the causal attention's FLOPs (forward 4 B H D S^2 / 2, backward 2.5x) over W, per second.
Results go to ``benchmarks/results/<gpu>-x<W>/attention-cp.{json,md,png}``. Without a GPU (smoke mode) two gloo
ranks on CPUs run a tiny point of ours and the reference (PyTorch's context parallelism needs CUDA).
Knobs: ``FUSED_KERNELS_CP_LENGTHS`` (comma-separated, in thousands of tokens: a run keeps the earlier run's points it
does not measure, so the lengths can be split over several calls), ``FUSED_KERNELS_CP_PEERS`` (comma-separated SDPA
backends, default ``flash,cudnn,efficient``), ``FUSED_KERNELS_CP_PROFILE`` (a folder: each rank's kernel times of
one call of ours per point). On 2 H200s 32k-128k took 6 minutes with two peers; 256k 1.5 and 512k 3 minutes with
cuDNN alone.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import pytest
import torch

from benchmarks._harness import SMOKE, Recorder, results_dir, spawn_ranks, write_results

WORLD = 2 if SMOKE else torch.cuda.device_count()
HEADS, HEAD_DIM = (2, 16) if SMOKE else (32, 128)
LENGTHS = [64] if SMOKE else [1024 * int(k) for k in
                              os.environ.get("FUSED_KERNELS_CP_LENGTHS", "32,64,128,256,512").split(",")]
PEERS = [] if SMOKE else os.environ.get("FUSED_KERNELS_CP_PEERS", "flash,cudnn,efficient").split(",")
DTYPE = torch.float32 if SMOKE else torch.bfloat16
#: ``FUSED_KERNELS_CP_PROFILE=<folder>``: each rank also profiles one call of ours per point (torch.profiler) and
#: writes where its device time went, kernel by kernel, to ``<folder>/cp-profile-<S>-<direction>-rank<r>.txt``
PROFILE_DIR = os.environ.get("FUSED_KERNELS_CP_PROFILE", "")


def _repetitions(length: int) -> int:
    """Timed runs per provider and point after one warm-up run: fewer for the longest (seconds each)."""
    return 3 if SMOKE else (5 if length <= 128 * 1024 else 3 if length <= 256 * 1024 else 2)


def _causal_flops(length: int, backward: bool) -> float:
    forward = 4 * HEADS * HEAD_DIM * length * length / 2
    return forward * (3.5 if backward else 1.0)


def _whole(length: int, device, *, seed: int):
    """q, k, v and the output gradient of the whole sequence, the same on every rank: drawn on the device (the CPU's
    generator took tens of seconds per call at 256k tokens and more, longer than the timed runs)."""
    g = torch.Generator(device).manual_seed(seed)
    return [torch.randn(1, HEADS, length, HEAD_DIM, generator=g, dtype=torch.float32, device=device).to(DTYPE)
            for _ in range(4)]


def _timed(run, repetitions: int, device) -> float:
    """Median seconds of ``run()`` on this rank, every rank starting each run together; the slowest rank's median
    (an all-reduce) is returned on every rank."""
    import torch.distributed as dist

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run()
    times = []
    for _ in range(repetitions):
        sync()
        dist.barrier()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def _profile(run, path: Path) -> None:
    """One call of ``run`` under torch.profiler, after a warm-up call: its wall time and the device time of each
    kernel (attention, NCCL's transfers, the fp32 accumulations and casts), as a table at ``path``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() and not SMOKE
    run()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"one call: {wall * 1e3:.1f} ms wall\n" + prof.key_averages().table(sort_by=sort, row_limit=25))


def _attention_call(fn, tensors, backward: bool):
    """A run of ``fn(q, k, v)``: under no_grad for the forward, else forward and ``.backward`` of the output."""
    q, k, v, do = tensors
    if not backward:
        def run():
            with torch.no_grad():
                fn(q, k, v)
        return run
    for t in (q, k, v):
        t.requires_grad_(True)

    def run():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(do)
    return run


def _worker(rank: int, world: int, init_file: str, out_file: str, provider: str) -> None:
    """One provider's points (every length, both directions) in processes of its own, so that no provider times its
    calls in a process another left its state in (PyTorch's context parallelism sets up a device mesh and dispatches
    SDPA through its own path; allocator pools and communicators differ)."""
    import kernels._mode  # noqa: F401  (CUDA or the interpreter, before triton is imported)

    # isort: split

    import torch.distributed as dist
    import torch.nn.functional as F

    from kernels.attention import context_parallel_attention, flash_attention, shard_sequence

    cuda = not SMOKE
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, **({"device_id": device} if cuda else {}))
    mesh = None
    if provider.startswith("torch-cp-"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (world,))
    measured = []
    for length in LENGTHS:
        reps = _repetitions(length)
        for backward in (False, True):
            direction = "fwd+bwd" if backward else "fwd"
            if provider == "single":
                seconds = _timed(_attention_call(lambda q, k, v: flash_attention(q, k, v, causal=True),
                                                 _whole(length, device, seed=length), backward), reps, device)
            elif provider == "ours":
                shards = [shard_sequence(t, 2) for t in _whole(length, device, seed=length)]
                ours = _attention_call(lambda q, k, v: context_parallel_attention(q, k, v, causal=True), shards,
                                       backward)
                seconds = _timed(ours, reps, device)
                if PROFILE_DIR:
                    tokens = f"{length // 1024}k" if length >= 1024 else str(length)
                    _profile(ours, Path(PROFILE_DIR) / f"cp-profile-{tokens}-{direction}-rank{rank}.txt")
                del shards, ours
            else:
                seconds = _torch_context_parallel(mesh, provider.removeprefix("torch-cp-"), length, backward, reps,
                                                  device, F)
            if cuda:
                torch.cuda.empty_cache()
            if seconds is not None:
                measured.append({"provider": provider, "direction": direction, "S": length, "ms": 1e3 * seconds})
            if rank == 0:
                print(f"S={length} {direction}: {provider} " + (f"{1e3 * seconds:.1f} ms" if seconds else "-"),
                      flush=True)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(measured, f)
    dist.destroy_process_group()


def _torch_context_parallel(mesh, backend: str, length: int, backward: bool, reps: int, device, F) -> float | None:
    """Seconds of PyTorch's context-parallel SDPA with ``backend`` forced, or None when it cannot run the point
    (every rank then agrees to leave it out)."""
    import torch.distributed as dist
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa_backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                    "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    tensors = _whole(length, device, seed=length)
    failed = torch.zeros(1, device=device)
    seconds = None
    try:
        with context_parallel(mesh, buffers=tensors, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(tensors)):
            def attend(q, k, v):
                with sdpa_kernel(sdpa_backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            run = _attention_call(attend, tensors, backward)
            try:
                run()
            except Exception as err:  # a backend that cannot run this point: said, and left out on every rank
                print(f"torch-cp-{backend} S={length}: {type(err).__name__}: {str(err).splitlines()[0][:120]}",
                      flush=True)
                failed.fill_(1)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if not failed.item():
                seconds = _timed(run, reps, device)
    except Exception as err:  # the context itself refused (on every rank alike: same arguments)
        print(f"torch-cp-{backend} S={length}: {type(err).__name__}: {str(err).splitlines()[0][:120]}", flush=True)
    finally:
        del tensors
    return seconds


def _keep_earlier_points(recorder: Recorder, earlier: Path) -> None:
    """Add the records of an earlier run's ``attention-cp.json`` whose points this run did not measure: the longest
    sequences take minutes each, so the lengths may be measured over several calls (``FUSED_KERNELS_CP_LENGTHS``)
    into one table."""
    if not earlier.exists():
        return
    measured = {(r["provider"], r["direction"], r["S"]) for r in recorder.records}
    kept = [r for r in json.loads(earlier.read_text())
            if (r["provider"], r["direction"], r["S"]) not in measured and r.get("world") == WORLD]
    recorder.records[:0] = kept


@pytest.mark.skipif(not SMOKE and WORLD < 2, reason="context parallelism needs 2 or more GPUs of one host")
def test_context_parallel(ceilings):
    measured = []
    with tempfile.TemporaryDirectory() as folder:
        for provider in ["single", "ours", *(f"torch-cp-{backend}" for backend in PEERS)]:
            out_file = os.path.join(folder, f"{provider}.json")
            spawn_ranks(_worker, WORLD, out_file, provider)
            with open(out_file) as f:
                measured += json.load(f)
    recorder = Recorder(ceilings=ceilings)
    single = {(m["direction"], m["S"]): m["ms"] for m in measured if m["provider"] == "single"}
    for m in measured:
        if m["provider"] == "single":
            continue
        extra = {"world": WORLD, "single_gpu_ms": single[(m["direction"], m["S"])]}
        if m["provider"] == "ours":
            extra["efficiency"] = single[(m["direction"], m["S"])] / (WORLD * m["ms"])
        recorder.add(family="attention-cp", provider=m["provider"], direction=m["direction"], dtype=DTYPE,
                     shape={"B": 1, "H": HEADS, "S": m["S"], "D": HEAD_DIM, "causal": True}, ms=m["ms"], x_key="S",
                     flops=_causal_flops(m["S"], m["direction"] == "fwd+bwd") / WORLD, extra=extra)
    out_dir = results_dir().with_name(f"{results_dir().name}-x{WORLD}")
    _keep_earlier_points(recorder, out_dir / "attention-cp.json")
    written = write_results(recorder, out_dir)
    assert any(path.name == "attention-cp.json" for path in written)
    ours = [r for r in recorder.records if r["provider"] == "ours"]
    assert ours and all(math.isfinite(r["efficiency"]) for r in ours)
