# ruff: noqa: B023  (each lambda is timed inside the iteration that defines it)
"""A/B timing of the attention forward: this checkout's kernel against a baseline ``_kernels.py``, other
candidate kernels, and forced launch tiles, beside FlexAttention.

    PYTHONPATH=$PWD python3 scripts/ab_attention_fwd.py BASELINE_KERNELS_PY [--rounds 7] [--dtypes float16]
        [--lengths 1024,4096] [--dims 64,128] [--also NAME=KERNELS_PY ...] [--tile BM,BN,WARPS,STAGES ...]

e.g. ``git show HEAD~1:kernels/attention/_kernels.py > /tmp/base.py`` first. Every variant is the public
``flash_attention`` call of the benchmark (same launcher, configs and grid) with one attribute of ``ops``
replaced for the call: "base" and each ``--also`` candidate swap in their jit kernel; each ``--tile`` forces
that forward tile on this checkout's kernel for 16-bit inputs at every length and mask (``--tile 128,64,8,3
--dims 64`` is the "this+128" variant of ``attention-fwd-ab-2026-11-22.txt``). Variants alternate within each
of ROUNDS rounds (``benchmarks._harness.interleaved_medians``); each prints TFLOP/s of its median and its
ratio to "base". Points: the TARGETS table's (B * S = 16k tokens, H * D = 2048), causal and not.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

import kernels.attention.ops as ops
from benchmarks._harness import interleaved_medians
from benchmarks.bench_attention import _flex
from kernels.attention import flash_attention


def _load(path: str, name: str = "baseline"):
    spec = importlib.util.spec_from_file_location(f"{name}_attention_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._attn_fwd_kernel


def _patched(**attributes):
    """``flash_attention`` with ``ops``' named attributes replaced for the call (and restored after it)."""
    def run(q, k, v, causal):
        saved = {name: getattr(ops, name) for name in attributes}
        for name, value in attributes.items():
            setattr(ops, name, value)
        try:
            return flash_attention(q, k, v, causal=causal)
        finally:
            for name, value in saved.items():
                setattr(ops, name, value)
    return run


def _forced_tile(tile: str):
    """``ops._config`` with the forward's (BLOCK_M, BLOCK_N, warps, stages) replaced for 16-bit inputs."""
    block_m, block_n, warps, stages = (int(x) for x in tile.split(","))
    table_config = ops._config

    def config(kernel, d, dtype, *rest, **options):
        cfg = table_config(kernel, d, dtype, *rest, **options)
        if kernel == "fwd" and dtype != torch.float32 and cfg["BLOCK_D"] <= 256:
            cfg.update(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        return cfg
    return config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("baseline")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtypes", default="float16")
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--also", action="append", default=[], metavar="NAME=KERNELS_PY")
    ap.add_argument("--tile", action="append", default=[], metavar="BM,BN,WARPS,STAGES")
    args = ap.parse_args()
    variants = {"base": _patched(_attn_fwd_kernel=_load(args.baseline)), "this": _patched()}
    for spec in args.also:
        name, path = spec.split("=", 1)
        variants[name] = _patched(_attn_fwd_kernel=_load(path, name))
    for tile in args.tile:
        variants[f"({tile})"] = _patched(_config=_forced_tile(tile))

    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: forward TFLOP/s, median of {args.rounds} "
          f"alternating rounds")
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for d in (int(x) for x in args.dims.split(",")):
            for s in (int(x) for x in args.lengths.split(",")):
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(3))
                for causal in (False, True):
                    flex = _flex(s, causal)
                    reference = variants["base"](q, k, v, causal).float()

                    def check(name):
                        if name in variants:
                            err = (variants[name](q, k, v, causal).float() - reference).abs().max().item()
                            if err > 1e-2:
                                raise AssertionError(f"max |{name} - base| = {err:.3g}")

                    runs = {name: (lambda fn=fn: fn(q, k, v, causal)) for name, fn in variants.items()}
                    runs["flex"] = lambda: flex(q, k, v)
                    medians = interleaved_medians(runs, args.rounds, check=check, label=f"D={d} S={s} ")
                    flops = 4 * b * h * s * s * d / (2 if causal else 1)
                    cells = "  ".join(f"{name} {flops / t / 1e9:5.1f} ({medians['base'] / t:5.3f})"
                                      for name, t in medians.items())
                    print(f"{str(dtype)[6:]:8s} D={d:3d} S={s:5d} {'causal' if causal else 'full  '}  {cells}",
                          flush=True)


if __name__ == "__main__":
    main()
