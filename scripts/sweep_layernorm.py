# ruff: noqa: B023  (each lambda is timed immediately, inside the iteration that defines it)
"""LayerNorm/RMSNorm backward launch-config sweep on the GPU (kernel time only, bf16, M * N = 2**27).

    python3 scripts/sweep_layernorm.py

Varies the module-level constants of the register-path backward in ``kernels/layernorm/ops.py`` (tile
size, elements per thread, so num_warps, and the pipelining depth of the row loop) and times
``_norm_bwd_impl`` with do_bench beside the copy bandwidth measured in the same run. The forward has its
own sweep (``sweep_layernorm_fwd.py``). Chooses the constants; the numbers go to the family README.
"""

from __future__ import annotations

import itertools

import torch
import triton.testing

import kernels.layernorm.ops as ops


def copy_gbps() -> float:
    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * 4 / ms / 1e6


def bandwidth_inputs(n: int, is_rms: bool):
    """``(m, x, w, b)`` of the bandwidth sweep: M*N = 2^27 bf16 elements, rows of ``n``; no bias for RMSNorm."""
    m = (1 << 27) // n
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    b = None if is_rms else torch.randn(n, device="cuda", dtype=torch.bfloat16)
    return m, x, w, b


def main() -> None:
    ceiling = copy_gbps()
    print(f"{torch.cuda.get_device_name()}  copy {ceiling:.0f} GB/s  (% of copy, bwd, bf16, M*N = 2^27)")
    defaults = ops._BWD_TILE, ops._BWD_ELEMENTS_PER_THREAD, ops._BWD_LOOP_STAGES
    for kind, n in itertools.product(("layer", "rms"), (256, 512, 1024, 2048, 4096, 8192)):
        is_rms = kind == "rms"
        m, x, w, b = bandwidth_inputs(n, is_rms)
        dy = torch.randn_like(x)
        _, mean, rstd = ops._norm_fwd_impl(x, w, b, 1e-5, is_rms)
        rows = []
        for tile, ept, stages in itertools.product((2048, 4096, 8192), (8, 16, 32), (2, 3)):
            if tile < n or not 1 <= tile // (32 * ept) <= 16:
                continue
            ops._BWD_TILE, ops._BWD_ELEMENTS_PER_THREAD, ops._BWD_LOOP_STAGES = tile, ept, stages
            ops._cached_bwd_config.cache_clear()
            cfg = ops._bwd_config(n)
            ms = triton.testing.do_bench(lambda: ops._norm_bwd_impl(dy, x, w, mean, rstd, is_rms, not is_rms, False),
                                         return_mode="median")
            rows.append((3 * m * n * 2 / ms / 1e6 / ceiling, tile, cfg["num_warps"], stages))
        ops._BWD_TILE, ops._BWD_ELEMENTS_PER_THREAD, ops._BWD_LOOP_STAGES = defaults
        ops._cached_bwd_config.cache_clear()
        cells = "  ".join(f"{r[0]:.0%} (tile {r[1]}, {r[2]} warps, {r[3]} stages)"
                          for r in sorted(rows, key=lambda r: -r[0])[:4])
        print(f"{kind:5} N={n:5}  default {ops._bwd_config(n)}\n      {cells}", flush=True)


if __name__ == "__main__":
    main()
