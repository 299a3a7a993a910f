"""Where the host time of one attention call goes, on the GPU machine's host.

    PYTHONPATH=$PWD python3 scripts/profile_attention_host.py [--calls 300]

At the benchmark's S = 1024 points a forward kernel runs 50-90 us, about as long as do_bench's L2 flush
that hides the host path; a longer host path than that shows up in the timing. This runs the public
forward (no grad) and the backward (``.backward()`` through autograd) of a tiny problem under cProfile, so
the kernels are negligible and every microsecond is host time, and prints the heaviest functions; then the
S = 1024, D = 128 non-causal forward in fp16 and bf16: do_bench (as the benchmark times it) against CUDA
graph replay (no host).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from benchmarks._harness import graph_us, time_ms
from kernels.attention import flash_attention


def per_call_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def profile(name: str, fn, calls: int) -> None:
    for _ in range(20):
        fn()
    print(f"\n## {name}: {per_call_us(fn, calls):.1f} us per call (tiny problem: host-bound)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    q, k, v = (torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    profile("forward, no grad", lambda: flash_attention(q, k, v), args.calls)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = flash_attention(qg, kg, vg)
    do = torch.randn_like(out)

    def backward():
        for t in (qg, kg, vg):
            t.grad = None
        out.backward(do, retain_graph=True)

    profile("backward", backward, args.calls)
    sdpa_q = q.clone().requires_grad_(True)
    sdpa_out = torch.nn.functional.scaled_dot_product_attention(sdpa_q, kg, vg)
    print(f"sdpa forward {per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), 300):.1f} us, "
          f"backward {per_call_us(lambda: sdpa_out.backward(do, retain_graph=True), 300):.1f} us per call")
    for dtype in (torch.float16, torch.bfloat16):
        b, h, s, d = 16, 16, 1024, 128
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(3))
        flops = 4 * b * h * s * s * d
        fn = lambda: flash_attention(q, k, v)  # noqa: B023
        print(f"{dtype}: S=1024 D=128 forward TFLOP/s, do_bench {flops / time_ms(fn) / 1e9:.0f}, graph "
              f"{flops / graph_us(fn) / 1e6:.0f}")


if __name__ == "__main__":
    main()
