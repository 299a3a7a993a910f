# ruff: noqa: B023  (each lambda is timed immediately, inside the iteration that defines it)
"""Interleaved probes on the GPU for the attention host path and the backward's launches.

    PYTHONPATH=$PWD python3 scripts/probe_attention_bwd_fusion.py [--rounds 3] [--dtype bfloat16]

1. Host path of the forward at the benchmark's S = 1024 points: host microseconds per call of the public
   function (Triton's plain launch vs our FastLauncher; the autograd.Function vs the no-grad path), and the
   forward timed as the benchmark does (do_bench, L2 flushed) beside its device time from a CUDA graph.
2. The preprocess (delta = rowsum(dO * O)): do_bench vs graph replay.
3. The backward's two kernels (dK/dV, dQ) as two launches or as one launch of both program kinds, and
   candidate configs that make a fused launch possible where the table's two configs differ; the variants
   alternate, ``--rounds`` times, same inputs (run-to-run drift on the H200 is ~10%).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import triton.testing

import kernels._common.launch as launch
import kernels.attention.ops as ops
from benchmarks._harness import graph_us, host_us, time_ms
from kernels.attention import flash_attention


def cfg(c: tuple, d: int) -> dict:
    return {"BLOCK_M": c[0], "BLOCK_N": c[1], "BLOCK_D": ops._block_d(d), "EVEN_D": ops._block_d(d) == d,
            "num_warps": c[2], "num_stages": c[3]}


def host_section(dtype) -> None:
    print("\n## 1. forward host path, B=16 S=1024 (us)")
    for d in (128, 64):
        b, h, s = 16, 2048 // d, 1024
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(3))
        for causal in (False, True):
            right = 0 if causal else -1
            scale = 1 / math.sqrt(d)
            public = lambda: flash_attention(q, k, v, causal=causal)
            function = lambda: ops._FlashAttentionFunction.apply(q, k, v, -1, right, scale, 0.0, 0, None, None, 0, 0)
            impl = lambda: ops._fwd_impl(q, k, v, -1, right, scale)
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            launch.PLAIN_LAUNCH = True
            plain_host = host_us(public, calls=200)
            plain_ms = time_ms(public)
            launch.PLAIN_LAUNCH = False
            flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
            line = (f"D={d:3} causal={causal!s:5} host: public plain-launch {plain_host:5.1f}, "
                    f"public {host_us(public):5.1f}, autograd.Function {host_us(function):5.1f}, "
                    f"_fwd_impl {host_us(impl):5.1f}, sdpa {host_us(sdpa):5.1f}"
                    f" | TFLOP/s: do_bench plain-launch {flops / plain_ms / 1e9:4.0f}, do_bench public "
                    f"{flops / time_ms(public) / 1e9:4.0f}, graph {flops / graph_us(public) / 1e6:4.0f}, "
                    f"sdpa do_bench {flops / time_ms(sdpa) / 1e9:4.0f}")
            print(line, flush=True)


def preprocess_section(dtype) -> None:
    print("\n## 2. preprocess delta = rowsum(dO * O), B*S = 16384, H*D = 2048 (us)")
    for d in (128, 64):
        b, h, s = 16, 2048 // d, 1024
        o, do = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(2))
        delta = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
        fn = lambda: ops._launch_bwd_preprocess(o, do, delta)
        moved = 2 * o.numel() * o.element_size() + delta.numel() * 4
        ms = time_ms(fn)
        dev = graph_us(fn, replays=200)
        print(f"D={d:3}: do_bench {ms * 1e3:6.1f} us ({moved / ms / 1e6:5.0f} GB/s), graph {dev:6.1f} us "
              f"({moved / dev / 1e3:5.0f} GB/s)", flush=True)


# (dK/dV config, dQ config) per (D, causal); "separate" launches the table's configs as two launches.
CANDIDATES = {
    (128, False): [((64, 128, 8, 3), (128, 64, 8, 3))],
    (128, True): [((64, 128, 8, 3), (128, 64, 8, 3)), ((64, 128, 8, 2), (128, 64, 8, 2))],
    (64, False): [((64, 128, 8, 3), (128, 64, 8, 3)), ((32, 128, 4, 3), (128, 64, 4, 3))],
    (64, True): [((64, 128, 8, 3), (128, 64, 8, 3)), ((32, 64, 4, 3), (64, 64, 4, 3))],
}


def backward_section(dtype, rounds: int) -> None:
    print(f"\n## 3. backward dK/dV + dQ (no preprocess), TFLOP/s at 2.5x the forward's FLOPs, median of {rounds} "
          "interleaved rounds")
    for d in (128, 64):
        for s in (1024, 4096, 16384):
            b, h = 16384 // s, 2048 // d
            q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(4))
            for causal in (False, True):
                right = 0 if causal else -1
                scale = 1 / math.sqrt(d)
                o, lse = ops._fwd_impl(q, k, v, -1, right, scale)
                delta = torch.empty_like(lse)
                ops._launch_bwd_preprocess(o, do, delta)
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                table = (ops._config("dkdv", d, dtype, -1, right), ops._config("dq", d, dtype, -1, right))

                def separate():
                    ops._launch_bwd(do, q, k, v, lse, delta, None, dk, dv, -1, right, scale, table[0], None)
                    ops._launch_bwd(do, q, k, v, lse, delta, dq, None, None, -1, right, scale, None, table[1])

                variants = {"separate": separate}
                for kv_c, q_c in CANDIDATES[(d, causal)]:
                    kv_cfg, q_cfg = cfg(kv_c, d), cfg(q_c, d)
                    variants[f"fused {kv_c}+{q_c}"] = (lambda kv_cfg=kv_cfg, q_cfg=q_cfg: ops._launch_bwd(
                        do, q, k, v, lse, delta, dq, dk, dv, -1, right, scale, kv_cfg, q_cfg))
                times = {name: [] for name in variants}
                for _ in range(rounds):
                    for name, fn in variants.items():
                        times[name].append(triton.testing.do_bench(fn, warmup=5, rep=40))
                flops = 2.5 * 4 * b * h * s * s * d * (0.5 if causal else 1.0)
                print(f"D={d:3} S={s:5} causal={causal!s:5} "
                      + "  ".join(f"{name}: {flops / statistics.median(t) / 1e9:4.0f}" for name, t in times.items()),
                      flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip", default="", help="comma-separated section numbers to skip")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    skip = set(args.skip.split(","))
    print(torch.cuda.get_device_name(), torch.__version__, args.dtype)
    if "1" not in skip:
        host_section(dtype)
    if "2" not in skip:
        preprocess_section(dtype)
    if "3" not in skip:
        backward_section(dtype, args.rounds)


if __name__ == "__main__":
    main()
