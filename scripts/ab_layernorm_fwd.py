"""A/B timing of the LayerNorm/RMSNorm forward: this checkout's kernel against a baseline ``_kernels.py``.

    PYTHONPATH=$PWD python3 scripts/ab_layernorm_fwd.py BASELINE_KERNELS_PY [ROUNDS [SWEEPS]]

e.g. ``git show HEAD~1:kernels/layernorm/_kernels.py > /tmp/base.py`` first. Both run through the same
launcher (``ops._norm_fwd_impl``, its configs and grid); only the jit kernel is swapped. The two are timed
alternately, ROUNDS times each (default 5), with ``triton.testing.do_bench``, and each prints its median
over the rounds, so that clock and thermal drift fall on both alike. SWEEPS (comma-separated, default
all three): ``bandwidth`` (M*N = 2^27, bf16), ``classic`` (M = 4096, fp16), ``narrow`` (M = 2^20,
N < 128). GB/s counts 2*M*N elements (read x, write y).
"""

from __future__ import annotations

import functools
import importlib.util
import statistics
import sys

import torch
import triton

import kernels.layernorm.ops as ops


def _load(path: str):
    spec = importlib.util.spec_from_file_location("baseline_layernorm_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._layer_norm_fwd_kernel


def main() -> None:
    baseline = _load(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    ours = ops._layer_norm_fwd_kernel
    sweeps = {
        "bandwidth": [(2**27 // n, n, torch.bfloat16) for n in (256, 1024, 4096, 16384, 65536)],
        "classic": [(4096, n, torch.float16) for n in (1024, 2048, 4096, 8192, 16384)],
        "narrow": [(2**20, n, dtype) for n in (7, 33, 64) for dtype in (torch.float16, torch.float32)],
    }
    chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else list(sweeps)
    points = [point for name in chosen for point in sweeps[name]]
    print(f"{torch.cuda.get_device_name()}: forward GB/s, median of {rounds} alternating rounds")
    print(f"{'kind':5s} {'dtype':8s} {'M':>8s} {'N':>6s} {'baseline':>9s} {'this':>9s} {'this/base':>9s}")
    for m, n, dtype in points:
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
        for is_rms in (False, True):
            times = {"baseline": [], "this": []}
            for _ in range(rounds):
                for name, kernel in (("baseline", baseline), ("this", ours)):
                    ops._layer_norm_fwd_kernel = kernel
                    bias = None if is_rms else b
                    times[name].append(triton.testing.do_bench(
                        functools.partial(ops._norm_fwd_impl, x, w, bias, 1e-5, is_rms), warmup=10, rep=40))
            ops._layer_norm_fwd_kernel = ours
            gbs = {k: 2 * m * n * x.element_size() / (statistics.median(v) * 1e-3) / 1e9 for k, v in times.items()}
            print(f"{'rms' if is_rms else 'layer':5s} {str(dtype)[6:]:8s} {m:8d} {n:6d} {gbs['baseline']:9.0f} "
                  f"{gbs['this']:9.0f} {gbs['this'] / gbs['baseline']:9.3f}", flush=True)


if __name__ == "__main__":
    main()
