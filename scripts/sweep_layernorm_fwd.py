# ruff: noqa: B023  (each lambda is timed immediately, inside the iteration that defines it)
"""Forward launch configs of LayerNorm/RMSNorm at the widths below 85% of copy (bf16, M * N = 2**27).

    python3 scripts/sweep_layernorm_fwd.py

Register path: rows per tile and num_warps for N <= 2048, num_warps for wider rows up to 32768. Chunked
path (N >= 16384): persistent programs (1, 2, 4 per SM, one per row, and the L2 rule of ``_fwd_programs``)
and num_warps, chunks of 8192 pipelined 3 deep. Prints the six best per width. Kernel time through
``FastLauncher``, % of the copy bandwidth measured in the same run. Experiment code: the chosen rule
goes into ``_fwd_config``, the numbers into the family README.
"""

from __future__ import annotations

import itertools

import torch
import triton.testing

import kernels.layernorm.ops as ops
from scripts.sweep_layernorm import bandwidth_inputs, copy_gbps


def main() -> None:
    ceiling = copy_gbps()
    print(f"{torch.cuda.get_device_name()}  copy {ceiling:.0f} GB/s  (% of copy, fwd, bf16, M*N = 2^27)")
    launch = ops.kernel_for(ops._layer_norm_fwd_kernel, traceable=False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for kind, n in itertools.product(("layer", "rms"), (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)):
        is_rms = kind == "rms"
        m, x, w, b = bandwidth_inputs(n, is_rms)
        y = torch.empty_like(x)
        mean = torch.empty(m, device="cuda", dtype=torch.float32)
        rstd = torch.empty(m, device="cuda", dtype=torch.float32)
        configs = []  # (programs, config)
        if n <= 2048:
            configs += [(m // (tile // n), dict(BLOCK_M=tile // n, BLOCK_N=n, SINGLE_PASS=True, num_warps=nw))
                        for tile, nw in itertools.product((2048, 4096, 8192, 16384), (2, 4, 8, 16))
                        if 8 <= tile // (32 * nw) <= 64]
        elif n <= 32768:
            configs += [(m, dict(BLOCK_M=1, BLOCK_N=n, SINGLE_PASS=True, num_warps=nw)) for nw in (4, 8, 16, 32)
                        if n // (32 * nw) <= 64]
        if n >= 16384:
            configs += [(min(m, p), dict(BLOCK_M=1, BLOCK_N=8192, SINGLE_PASS=False, num_warps=nw, LOOP_STAGES=3))
                        for p, nw in itertools.product((sms, 2 * sms, 4 * sms, m), (8, 16))]
            default = ops._fwd_config(n)
            configs.append((ops._fwd_programs(m, n, default, 2, 0), dict(default)))
        results = []
        for programs, cfg in configs:
            def run():
                launch[(programs,)](x, y, w, b, None if is_rms else mean, rstd, m, n, n, n, 1e-5,
                                    IS_RMS=is_rms, HAS_WEIGHT=True, HAS_BIAS=b is not None, **cfg)
            ms = triton.testing.do_bench(run, return_mode="median")
            results.append((2 * m * n * 2 / ms / 1e6 / ceiling, programs, cfg))
            ref = torch.nn.functional.layer_norm(x.float(), (n,), w.float(), None if b is None else b.float()) \
                if not is_rms else torch.nn.functional.rms_norm(x.float(), (n,), w.float(), 1e-5)
            assert (y.float() - ref).abs().max().item() < 0.1, cfg
        current = ops._fwd_config(n)
        print(f"{kind:5} N={n:6} M={m} current {current} programs {ops._fwd_programs(m, n, current, 2, 0)}")
        for frac, programs, cfg in sorted(results, key=lambda r: -r[0])[:6]:
            label = " ".join(f"{k}={v}" for k, v in cfg.items())
            print(f"      {frac:5.0%}  programs={programs} {label}", flush=True)


if __name__ == "__main__":
    main()
