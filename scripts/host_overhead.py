"""Host cost per call of the LayerNorm path, layer by layer, beside torch's, on the GPU.

    python3 scripts/host_overhead.py [--m 4096] [--n 1024,4096] [--dtype bfloat16]

At M = 4096 a LayerNorm moves 8-130 MB: 2-30 us of memory time, the same order as a Python launch. This
times each layer of our path with the GPU kept busy elsewhere out of the picture: ``calls`` back-to-back
calls without synchronising, wall time per call (host-bound when the kernels are short), and the device
time of the same work replayed from a CUDA graph (no host at all). Layers: the public function, the
implementation below autograd (``_norm_fwd_impl`` / ``_norm_bwd_impl``), the bare Triton launch with its
arguments prepared, and torch's ``F.layer_norm`` (forward; forward + backward through autograd).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import kernels.layernorm.ops as ops
from benchmarks._harness import host_us
from kernels.layernorm import layer_norm


def device_us(fn, replays: int = 100) -> float:
    """Device time of ``fn`` replayed from a CUDA graph (no host work between kernels)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def report(m: int, n: int, dtype: torch.dtype) -> None:
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
    b = torch.randn(n, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    xg, wg, bg = (t.clone().requires_grad_(True) for t in (x, w, b))
    y_ours = layer_norm(xg, n, wg, bg)
    y_torch = F.layer_norm(xg, (n,), wg, bg)
    _, mean, rstd = ops._norm_fwd_impl(x, w, b, 1e-5, False)
    cfg = ops._fwd_config(n)
    y = torch.empty_like(x)
    grid = (ops.cdiv(m, cfg["BLOCK_M"]),)

    def bare_fwd():
        ops._layer_norm_fwd_kernel[grid](x, y, w, b, mean, rstd, m, n, x.stride(0), y.stride(0), 1e-5,
                                         IS_RMS=False, HAS_WEIGHT=True, HAS_BIAS=True, **cfg)

    # The compiled kernel itself, past the JIT's dispatch (specialisation key, cache lookup): the floor of
    # any Python launch path. Triton 3.6's launcher takes every argument, constexprs included.
    compiled = ops._layer_norm_fwd_kernel.warmup(x, y, w, b, mean, rstd, m, n, x.stride(0), y.stride(0), 1e-5,
                                                 IS_RMS=False, HAS_WEIGHT=True, HAS_BIAS=True, grid=grid, **cfg)
    constexprs = (False, True, True, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["SINGLE_PASS"])

    def compiled_fwd():
        compiled[(grid[0], 1, 1)](x, y, w, b, mean, rstd, m, n, x.stride(0), y.stride(0), 1e-5, *constexprs)

    rows = [
        ("fwd  layer_norm (no grad)", lambda: layer_norm(x, n, w, b)),
        ("fwd  _norm_fwd_impl", lambda: ops._norm_fwd_impl(x, w, b, 1e-5, False)),
        ("fwd  bare kernel launch", bare_fwd),
        ("fwd  CompiledKernel launch", compiled_fwd),
        ("fwd  torch F.layer_norm", lambda: F.layer_norm(x, (n,), w, b)),
        ("bwd  _norm_bwd_impl", lambda: ops._norm_bwd_impl(dy, x, w, mean, rstd, False, True, False)),
    ]
    # Host only: capturing autograd's backward in a CUDA graph fails and leaves the RNG state unusable.
    host_only = [
        ("bwd  autograd.grad ours", lambda: torch.autograd.grad(y_ours, (xg, wg, bg), dy, retain_graph=True)),
        ("bwd  autograd.grad torch", lambda: torch.autograd.grad(y_torch, (xg, wg, bg), dy, retain_graph=True)),
    ]
    print(f"\nM={m} N={n}: host us/call (back-to-back, no sync) | device us (CUDA graph replay)")
    for name, fn in rows:
        print(f"  {name:28s} {host_us(fn):7.1f} | {device_us(fn):7.1f}", flush=True)
    for name, fn in host_only:
        print(f"  {name:28s} {host_us(fn):7.1f} |     n/a", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--n", default="1024,4096")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, args.dtype)
    for n in (int(v) for v in args.n.split(",")):
        report(args.m, n, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
