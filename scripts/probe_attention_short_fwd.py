# ruff: noqa: B023  (each lambda is timed immediately, inside the iteration that defines it)
"""Forward launch configs at the benchmark's short point (B=16, S=1024, non-causal) against FlexAttention,
interleaved rounds on the GPU (the remaining forward misses of issue 6 are at this point).

    PYTHONPATH=$PWD python3 scripts/probe_attention_short_fwd.py [--rounds 3] [--dtype float16] [--dims 64,128]

Each config's kernel is launched directly (preallocated outputs); "public" is ``flash_attention`` as the
benchmark calls it, "flex" the compiled FlexAttention of ``benchmarks/bench_attention.py``.
"""

from __future__ import annotations

import argparse
import math

import torch

import kernels.attention.ops as ops
from benchmarks._harness import interleaved_medians
from benchmarks.bench_attention import _flex
from kernels.attention import flash_attention

CONFIGS = {
    64: [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 32, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3),
         (128, 128, 8, 3), (64, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (256, 64, 16, 2), (256, 64, 16, 3)],
    128: [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 32, 4, 4), (64, 64, 8, 3), (128, 64, 8, 3),
          (128, 32, 8, 3), (64, 32, 4, 3), (64, 32, 4, 2), (64, 64, 4, 2), (64, 128, 4, 2), (128, 128, 8, 2),
          (128, 64, 8, 2), (128, 64, 8, 4), (128, 32, 8, 4), (128, 32, 8, 2), (256, 64, 16, 2), (256, 64, 16, 3),
          (256, 32, 16, 3)],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--dims", default="64,128")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(torch.cuda.get_device_name(), torch.__version__, args.dtype, "S=1024 non-causal forward, TFLOP/s")
    for d in (int(x) for x in args.dims.split(",")):
        b, h, s = 16, 2048 // d, 1024
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(3))
        o = torch.empty_like(q)
        lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
        scale = 1 / math.sqrt(d)
        flex = _flex(s, False)
        runs = {"public": lambda: flash_attention(q, k, v), "flex": lambda: flex(q, k, v)}
        for c in CONFIGS[d]:
            cfg = {"BLOCK_M": c[0], "BLOCK_N": c[1], "BLOCK_D": d, "EVEN_D": True, "num_warps": c[2],
                   "num_stages": c[3]}
            runs[str(c)] = lambda cfg=cfg: ops._launch_fwd(q, k, v, o, lse, -1, -1, scale, cfg)
        medians = interleaved_medians(runs, args.rounds)
        flops = 4 * b * h * s * s * d
        ranked = sorted(medians.items(), key=lambda kv: kv[1])
        print(f"D={d:3} " + "  ".join(f"{name}: {flops / t / 1e9:4.0f}" for name, t in ranked), flush=True)


if __name__ == "__main__":
    main()
