"""How long a process's first attention call takes: compiling (empty Triton cache), loading from Triton's disk
cache (a later process), and a warm call. The launch tables are fixed (no autotuning), so the first call
pays only for compiling the kernels its shape needs, once per machine.

    python3 -m scripts.attention_first_call [--dims 64,128]

Each case (head dim, causal) runs in two fresh processes sharing one new ``TRITON_CACHE_DIR``: the first
compiles, the second finds the kernels on disk. A case times forward + backward (synchronised) of
B = 4, H = 16, S = 4096, fp16: the first call, then the second call in the same process.
"""

from __future__ import annotations

import kernels._mode  # noqa: F401  (picks CUDA or the interpreter before triton is imported)

# isort: split

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]  # the case imports kernels from the checkout
CASE = """
import time, torch
from kernels.attention import flash_attention
d, causal = {d}, {causal}
q, k, v = (torch.randn(4, 2048 // d, 4096, d, device="cuda", dtype=torch.float16, requires_grad=True)
           for _ in range(3))
times = []
for _ in range(2):
    torch.cuda.synchronize()
    start = time.perf_counter()
    flash_attention(q, k, v, causal=causal).sum().backward()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
print(f"{{times[0]:.3f}} {{times[1] * 1e3:.2f}}")
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", default="64,128", help="head dims to time")
    args = parser.parse_args(argv)
    print("first call (s) and second call (ms) of forward + backward, B=4 H*D=2048 S=4096 fp16, per process")
    for d in (int(x) for x in args.dims.split(",")):
        for causal in (False, True):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TRITON_CACHE_DIR": cache}
                cells = []
                for label in ("compile", "disk cache"):
                    out = subprocess.run([sys.executable, "-c", CASE.format(d=d, causal=causal)], env=env, cwd=ROOT,
                                         capture_output=True, text=True, check=True).stdout.split()
                    cells.append(f"{label}: first {float(out[0]):6.2f} s, second {float(out[1]):6.2f} ms")
                print(f"D={d:3d} causal={causal!s:5s}  " + "  |  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
