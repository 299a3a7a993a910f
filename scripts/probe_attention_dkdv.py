# ruff: noqa: B023  (each lambda is timed immediately, inside the iteration that defines it)
"""The dK/dV kernel at D = 128: registers, spills and shared memory of each launch config (from the compiled
kernel), and its time in interleaved rounds (run-to-run drift on the H200 is ~10%), non-causal, bf16.

    PYTHONPATH=$PWD python3 scripts/probe_attention_dkdv.py [--rounds 3] [--seqs 4096,16384]
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import triton.testing

import kernels.attention.ops as ops

CONFIGS = [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (32, 128, 8, 2), (64, 64, 8, 3), (64, 64, 4, 3),
           (32, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seqs", default="4096,16384")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--configs", default="", help='instead of CONFIGS, e.g. "64,128,8,2;64,128,8,3"')
    args = ap.parse_args()
    d, dtype = args.d, torch.bfloat16
    right = 0 if args.causal else -1
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";")] if args.configs else CONFIGS
    print(torch.cuda.get_device_name(), torch.__version__, f"D={d} bf16 causal={args.causal}; dK/dV kernel alone")
    for s in (int(x) for x in args.seqs.split(",")):
        b, h = 16384 // s, 2048 // d
        q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(4))
        scale = 1 / math.sqrt(d)
        o = torch.empty_like(q)
        lse = torch.empty((b, h, s), device="cuda", dtype=torch.float32)
        ops._launch_fwd(q, k, v, o, lse, -1, right, scale, ops._config("fwd", d, dtype))
        delta = torch.empty_like(lse)
        ops._launch_bwd_preprocess(o, do, delta)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        # the dK/dV kernel's 4 of the backward's 7 matmuls; half the pairs when causal
        flops = 4 * b * h * s * s * d * 2.5 * 4 / 7 * (0.5 if args.causal else 1.0)
        times = {c: [] for c in configs}
        failed = set()
        for _ in range(args.rounds):
            for c in configs:
                if c in failed:
                    continue
                cfg = {"BLOCK_M": c[0], "BLOCK_N": c[1], "BLOCK_D": ops._block_d(d), "EVEN_D": True,
                       "num_warps": c[2], "num_stages": c[3]}
                try:
                    times[c].append(triton.testing.do_bench(
                        lambda: ops._launch_bwd(do, q, k, v, lse, delta, None, dk, dv, -1, right, scale, cfg, None),
                        warmup=5, rep=30))
                except Exception as err:  # out of resources: report once
                    print(f"  S={s} {c}: {type(err).__name__}: {str(err).splitlines()[0][:90]}")
                    failed.add(c)
        for c in configs:
            if c in failed:
                continue
            ms = statistics.median(times[c])
            print(f"S={s:5} {c}: {ms:7.3f} ms  {flops / ms / 1e9:5.0f} TFLOP/s (matmul share)", flush=True)
    kernel = ops._attn_bwd_kernel
    for device_cache in kernel.device_caches.values():
        for compiled in device_cache[0].values():
            md = compiled.metadata
            print(f"  compiled: warps={md.num_warps} stages={md.num_stages} regs={getattr(compiled, 'n_regs', '?')} "
                  f"spills={getattr(compiled, 'n_spills', '?')} shared={md.shared}")


if __name__ == "__main__":
    main()
