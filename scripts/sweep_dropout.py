"""Dropout on the GPU: launch-setting sweep and per-call host overhead.

    python3 -m scripts.sweep_dropout [--log2n 27] [--profile]

1. GB/s per (dtype, chunks, warps) beside the device-to-device copy bandwidth measured in the same run,
   with the compiler's register/spill counts and the count of wide multiplies in the PTX. Chooses
   ``kernels/dropout/configs.py``.
2. Microseconds of host time per call on a tiny tensor (the GPU idles; only the Python/dispatch path is
   timed) for the raw kernel launch, our public function with and without autograd, the registered op,
   and torch's dropout.

3. With ``--profile``, cProfile of the eager call path. The numbers go to the family's TUNING.md.
"""

from __future__ import annotations

import kernels._mode  # noqa: F401  (picks CUDA or the interpreter before triton is imported)

# isort: split

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.testing

from benchmarks._harness import host_us
from kernels._common.seed import int32_word
from kernels.dropout import LANE_STRIDE, dropout, keep_threshold
from kernels.dropout._kernels import _dropout_fwd_kernel


def copy_bandwidth(numel: int) -> float:
    src = torch.randn(numel, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * numel * 4 / ms / 1e6


def sweep(n: int) -> None:
    copy_gbps = copy_bandwidth(2 * n)
    print(f"{torch.cuda.get_device_name()}  copy {copy_gbps:.0f} GB/s   n = 2^{n.bit_length() - 1}")
    header = ("dtype", "chunks", "warps", "GB/s", "of copy", "regs", "spills", "mul.wide")
    print(" ".join(f"{h:>8}" for h in header))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = torch.randn(n, device="cuda", dtype=dtype)
        y = torch.empty_like(x)
        for chunks in (1, 2):
            for warps in (2, 4, 8):
                grid = (triton.cdiv(n, 4 * LANE_STRIDE * chunks),)
                args = (x, y, n, 0x1234, 0x5678, x, 0, int32_word(keep_threshold(0.5)), 2.0)
                meta = {"CHUNKS": chunks, "num_warps": warps}
                compiled = _dropout_fwd_kernel[grid](*args, **meta)
                ms = triton.testing.do_bench(lambda: _dropout_fwd_kernel[grid](*args, **meta),  # noqa: B023
                                             return_mode="median")
                gbps = 2 * n * x.element_size() / ms / 1e6
                row = (str(dtype)[6:], chunks, warps, f"{gbps:.0f}", f"{gbps / copy_gbps:.0%}", compiled.n_regs,
                       compiled.n_spills, compiled.asm["ptx"].count("mul.wide.u32"))
                print(" ".join(f"{v:>8}" for v in row))


def overhead() -> None:
    x = torch.randn(4096, device="cuda", dtype=torch.float16)
    xg = x.clone().requires_grad_(True)
    y = torch.empty_like(x)
    grid = (1,)
    args = (x, y, x.numel(), 1234, 0, x, 0, int32_word(keep_threshold(0.5)), 2.0)
    dy = torch.randn_like(x)
    out_ours, out_torch = dropout(xg, 0.5), F.dropout(xg, 0.5, True)
    cases = {
        "raw kernel launch": lambda: _dropout_fwd_kernel[grid](*args, CHUNKS=1, num_warps=4),
        "dropout(x), no grad": lambda: dropout(x, 0.5),
        "dropout(x), seed given": lambda: dropout(x, 0.5, seed=7),
        "dropout(x), requires grad": lambda: dropout(xg, 0.5),
        "torch.ops.fused_kernels.dropout": lambda: torch.ops.fused_kernels.dropout(x, 0.5, 7),
        "F.dropout(x), no grad": lambda: F.dropout(x, 0.5, True),
        "F.dropout(x), requires grad": lambda: F.dropout(xg, 0.5, True),
        "ours backward": lambda: out_ours.backward(dy, retain_graph=True),
        "torch backward": lambda: out_torch.backward(dy, retain_graph=True),
    }
    print("\nhost time per call, 4096 fp16 elements (us)")
    for name, fn in cases.items():
        print(f"  {name:<34} {host_us(fn, calls=3000, warmup=200):7.1f}")


def profile(calls: int = 2000) -> None:
    """cProfile of the eager call path on a tiny tensor: where host time goes."""
    import cProfile
    import pstats

    x = torch.randn(4096, device="cuda", dtype=torch.float16)
    for _ in range(100):
        dropout(x, 0.5)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        dropout(x, 0.5)
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log2n", type=int, default=27, help="elements of the sweep: 2**log2n")
    parser.add_argument("--profile", action="store_true", help="also cProfile the eager call path")
    args = parser.parse_args(argv)
    sweep(1 << args.log2n)
    overhead()
    if args.profile:
        profile()


if __name__ == "__main__":
    main()
