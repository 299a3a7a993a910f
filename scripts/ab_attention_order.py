# ruff: noqa: B023  (each lambda is timed immediately, inside the iteration that defines it)
"""Interleaved A/B on the GPU: causal forward and dQ kernels with query blocks launched longest-first (as
landed) against first-to-last (the variant is built from a copy of ``_kernels.py`` with the reversal
removed). Run-to-run drift on the H200 is ~10%, so the two run alternately, several rounds, same inputs.

    PYTHONPATH=$PWD python3 scripts/ab_attention_order.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import pathlib
import statistics
import tempfile

import torch
import triton.testing

import kernels.attention._kernels as landed
import kernels.attention.ops as ops

REVERSALS = ("        pid_m = tl.num_programs(0) - 1 - pid_m  # longest query blocks first (see the header)\n",  # fwd
             "            pid_m = q_blocks - 1 - pid_m  # longest query blocks first (see the header)\n")  # dQ


def first_to_last_module():
    src = pathlib.Path(landed.__file__).read_text()
    for line in REVERSALS:
        assert src.count(line) == 1, "a reversal line moved: update this script"
        src = src.replace(line, line[: len(line) - len(line.lstrip())] + "pass\n")
    path = pathlib.Path(tempfile.mkdtemp()) / "_kernels_first_to_last.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("_kernels_first_to_last", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    variants = {"longest-first": (landed._attn_fwd_kernel, landed._attn_bwd_kernel)}
    other = first_to_last_module()
    variants["first-to-last"] = (other._attn_fwd_kernel, other._attn_bwd_kernel)
    print(torch.cuda.get_device_name(), torch.__version__, args.dtype, "causal; TFLOP/s, median over rounds")
    for d in (64, 128):
        for s in (1024, 4096, 16384):
            b, h = 16384 // s, 2048 // d
            q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(4))
            scale = 1 / math.sqrt(d)
            o = torch.empty_like(q)
            lse = torch.empty((b, h, s), device="cuda", dtype=torch.float32)
            ops._launch_fwd(q, k, v, o, lse, -1, 0, scale, ops._config("fwd", d, dtype, -1, 0, s))
            delta = torch.empty_like(lse)
            ops._launch_bwd_preprocess(o, do, delta)
            dq = torch.empty_like(q)
            flops = 4 * b * h * s * s * d * 0.5
            times = {name: {"fwd": [], "dq": []} for name in variants}
            for _ in range(args.rounds):
                for name, (fwd_kernel, dq_kernel) in variants.items():
                    ops._attn_fwd_kernel, ops._attn_bwd_kernel = fwd_kernel, dq_kernel
                    cfg = ops._config("fwd", d, dtype, -1, 0, s)
                    times[name]["fwd"].append(triton.testing.do_bench(
                        lambda: ops._launch_fwd(q, k, v, o, lse, -1, 0, scale, cfg), warmup=5, rep=30))
                    cfg_dq = ops._config("dq", d, dtype, -1, 0)
                    times[name]["dq"].append(triton.testing.do_bench(
                        lambda: ops._launch_bwd(do, q, k, v, lse, delta, dq, None, None, -1, 0, scale, None, cfg_dq),
                        warmup=5, rep=30))
            ops._attn_fwd_kernel, ops._attn_bwd_kernel = variants["longest-first"]
            line = f"D={d:3} S={s:5}"
            for name in variants:
                fwd_ms, dq_ms = (statistics.median(times[name][kk]) for kk in ("fwd", "dq"))
                line += f"  {name}: fwd {flops / fwd_ms / 1e9:5.0f} dq {dq_ms:.3f} ms"
            print(line, flush=True)


if __name__ == "__main__":
    main()
