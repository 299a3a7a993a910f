# ruff: noqa: B023  (each lambda is timed immediately, inside the iteration that defines it)
"""LayerNorm/RMSNorm launch-config sweep on the GPU (kernel time only, bf16, M * N = 2**27).

    python3 scripts/sweep_layernorm.py

Varies the module-level launch constants of ``kernels/layernorm/ops.py`` (tile size, elements per
thread, programs per SM) and times the forward and backward implementations directly with do_bench,
beside the copy bandwidth measured in the same run. Chooses the constants; the numbers go to the family
README.
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


def main() -> None:
    ceiling = copy_gbps()
    print(f"{torch.cuda.get_device_name()}  copy {ceiling:.0f} GB/s")
    widths = (256, 1024, 4096, 8192, 16384)
    for kind in ("layer", "rms"):
        is_rms = kind == "rms"
        for n in widths:
            m = (1 << 27) // n
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
            b = None if is_rms else torch.randn(n, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn_like(x)
            fwd_rows = []
            for tile, ept in itertools.product((4096, 8192), (8, 16)):
                ops._FWD_TILE, ops._FWD_ELEMENTS_PER_THREAD = tile, ept
                ms = triton.testing.do_bench(lambda: ops._norm_fwd_impl(x, w, b, 1e-5, is_rms), return_mode="median")
                fwd_rows.append((2 * m * n * 2 / ms / 1e6 / ceiling, tile, ept))
            _, mean, rstd = ops._norm_fwd_impl(x, w, b, 1e-5, is_rms)
            bwd_rows = []
            if n <= ops._MAX_FUSED_BWD:
                for tile, ept, per_sm in itertools.product((4096, 8192), (8, 16), (4, 8)):
                    ops._BWD_TILE, ops._BWD_ELEMENTS_PER_THREAD, ops._PROGRAMS_PER_SM = tile, ept, per_sm
                    ms = triton.testing.do_bench(
                        lambda: ops._norm_bwd_impl(dy, x, w, mean, rstd, is_rms, not is_rms, False),
                        return_mode="median")
                    bwd_rows.append((3 * m * n * 2 / ms / 1e6 / ceiling, tile, ept, per_sm))
            best_f = max(fwd_rows)
            line = f"{kind:5} N={n:6}  fwd best {best_f[0]:.0%} (tile {best_f[1]}, {best_f[2]}/thread)"
            line += "  all: " + " ".join(f"{r[0]:.0%}" for r in fwd_rows)
            print(line)
            if bwd_rows:
                best_b = max(bwd_rows)
                print(f"{'':5} {'':8}  bwd best {best_b[0]:.0%} (tile {best_b[1]}, {best_b[2]}/thread, "
                      f"{best_b[3]}/SM)  all: " + " ".join(f"{r[0]:.0%}" for r in bwd_rows))
            ops._FWD_TILE, ops._FWD_ELEMENTS_PER_THREAD = 4096, 16
            ops._BWD_TILE, ops._BWD_ELEMENTS_PER_THREAD, ops._PROGRAMS_PER_SM = 4096, 16, 4


if __name__ == "__main__":
    main()
