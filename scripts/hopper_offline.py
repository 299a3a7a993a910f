"""Compile the Hopper (sm_90) attention kernels on a machine without a GPU and report what ptxas makes of them.

    python3 -m scripts.hopper_offline [--dims 64,128] [--kernels fwd,bwd,decode] [--causal] [--dropout] [--sass]
        [--group-heads N] [--pages 16,40] [--decode-plan block_n=64]

The Gluon kernels do not run in the Triton interpreter, so a change to them is otherwise first seen on a GPU. This
tool compiles them for sm_90a through the public launch path (``kernels.attention.ops``), with a stand-in driver
that names an sm_90 target and launches nothing, then runs Triton's own ``ptxas -v`` over the PTX: a frontend,
layout or register-allocation failure shows here, and so do registers and spill bytes per kernel (which the
Triton launcher only reports on a GPU). ``decode`` compiles the KV-cache decode kernel (a Triton kernel) for a bf16
and an FP8 cache (B 16, Hq 32/Hkv 8, 8192 keys), with ``--pages`` also paged caches of those page sizes, with
``--decode-plan`` the table's plan with those ``configs.DecodePlan`` fields set (``field=N,...``); ``--sass``
adds each kernel's most frequent SASS instructions (Triton's own cuobjdump), the count that shows, for example, what
widening FP8 tiles costs. Nothing is timed; the speed still needs the GPU.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import os
import re
import subprocess
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget

SM90 = GPUTarget("cuda", 90, 32)


class _NoGpuDriver:
    """What Triton's JIT asks of a driver to compile (not launch) a kernel: an sm_90 target, device 0, stream 0."""

    def get_current_target(self):
        return SM90

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


class _Compiles:
    """Stands in for ``kernel_for(kernel)``: ``[grid](*args)`` compiles the kernel for these arguments (our TMA
    arguments as Gluon's descriptors) and keeps what was compiled."""

    def __init__(self, kernel, out: list):
        self.kernel, self.out = kernel, out

    def __getitem__(self, grid):
        from kernels._common.launch import TmaTensor

        def compile_for(*args, **kwargs):
            args = [a.descriptor() if isinstance(a, TmaTensor) else a for a in args]
            start = time.perf_counter()
            compiled = self.kernel.warmup(*args, grid=grid, **kwargs)
            self.out.append((self.kernel.fn.__name__, grid, compiled, time.perf_counter() - start))

        return compile_for


def sass_histogram(cubin: bytes, top: int = 16) -> str:
    """The ``top`` most frequent SASS opcodes of a cubin and the instruction count (Triton's own cuobjdump)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    opcodes = collections.Counter(match.group(1).split(".")[0] for match in re.finditer(
        r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
    return f"{sum(opcodes.values())} instructions: " + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(top))


def ptxas_report(ptx: str) -> str:
    """Registers, barriers, stack and spill bytes as ``ptxas -v`` (Triton's own binary) reports them for sm_90a."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True,
                              check=True)
    lines = (done.stdout + done.stderr).splitlines()
    return "; ".join(re.sub(r"^ptxas info\s*:\s*", "", line.strip()) for line in lines
                     if re.search("spill|registers", line))


def compile_attention(kernels: list[str], dims: list[int], causal: bool, dropout: bool,
                      group_heads: int | None = None, decode_pages: tuple[int, ...] = ()) -> list[tuple]:
    """``(kernel name, label, grid, seconds, compiled kernel)`` for each launch of the Hopper forward (``fwd``) and
    backward (``bwd``) at each head dim, on a small bf16 call (B 2, Hq 8, Hkv 2, S 512), and of the decode kernel
    (``decode``) on a bf16 and an FP8 cache, contiguous and paged with each page size of ``decode_pages``;
    ``group_heads``: the backward's query heads per program (``configs.hopper_group_heads``; default: the launch
    tables' choice)."""
    triton.runtime.driver.set_active(_NoGpuDriver())
    import kernels.attention.kvcache as kvcache
    import kernels.attention.ops as ops
    from kernels.attention import configs

    compiled: list = []
    ops.kernel_for = kvcache.kernel_for = lambda kernel, traceable: _Compiles(kernel, compiled)
    ops.multiprocessor_count = lambda index: 132
    configs.sm_count = lambda device: 132
    left, right = (-1, 0) if causal else (-1, -1)
    rows = []
    for d in dims:
        b, hq, hkv, s, dt = 2, 8, 2, 512, torch.bfloat16
        q, o, do = (torch.zeros(b, hq, s, d, dtype=dt) for _ in range(3))
        k, v = (torch.zeros(b, hkv, s, d, dtype=dt) for _ in range(2))
        lse, delta = torch.zeros(b, hq, s), torch.zeros(b, hq, s)
        before = len(compiled)
        if "fwd" in kernels:
            ops._launch_fwd_hopper(q, k, v, o, lse, left, right, 0.1)
        if "bwd" in kernels:
            bd = configs.block_d(d)
            dq_kernel = configs.takes_hopper_dq_kernel(bd, dropout)
            dq_out = torch.zeros_like(q) if dq_kernel else torch.zeros(b, hq, s, bd)
            drop = ops._dropout_args(0.2, 5) if dropout else ops._NO_DROPOUT
            with configs.hopper_group_heads(group_heads) if group_heads else contextlib.nullcontext():
                parts = configs.hopper_group_parts(hq // hkv, bd, dq_kernel, False, False, left, right)
            acc = None if parts == 1 else tuple(torch.zeros(b, hkv, s, bd) for _ in range(2))
            ops._launch_bwd_hopper(do, q, k, v, lse, delta, dq_out, torch.zeros_like(k), torch.zeros_like(v), left,
                                   right, 0.1, drop, dq_kernel, acc, parts)
        if "decode" in kernels:
            for cache, page in itertools.product((torch.bfloat16, torch.float8_e4m3fn), (0, *decode_pages)):
                queries = torch.zeros(16, 32, 1, d, dtype=torch.bfloat16)
                if page:  # (pages, Hkv, page, D) and each sequence's pages in a table
                    per_sequence = -(-8192 // page)
                    k_cache, v_cache = (torch.zeros(16 * per_sequence, 8, page, d, dtype=cache) for _ in range(2))
                    table = torch.arange(16 * per_sequence, dtype=torch.int32).view(16, per_sequence)
                else:
                    k_cache, v_cache = (torch.zeros(16, 8, 8192, d, dtype=cache) for _ in range(2))
                    table = None
                scales = {"k_scale": 0.5, "v_scale": 0.5} if cache == torch.float8_e4m3fn else {}
                parts = kvcache._attend_parts(queries, k_cache, v_cache, torch.full((16,), 8192, dtype=torch.int32),
                                              0, table, left, right, 0.1, False, 8192, **scales)
                parts[5]()
                label = str(cache).split(".")[-1] + (f" cache, pages of {page}" if page else " cache")
                compiled[-1] = (f"{compiled[-1][0]}[{label}]", *compiled[-1][1:])
        for name, grid, kernel, seconds in compiled[before:]:
            rows.append((name, f"D {d}", grid, seconds, kernel))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="64,128", help="head dims, comma-separated")
    parser.add_argument("--kernels", default="fwd,bwd", help="any of fwd, bwd, decode, comma-separated")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dropout", action="store_true", help="the backward with dropout (p 0.2)")
    parser.add_argument("--sass", action="store_true", help="also each kernel's most frequent SASS instructions")
    parser.add_argument("--group-heads", type=int, help="the backward's query heads per program (group split)")
    parser.add_argument("--pages", default="", help="decode: also paged caches of these page sizes, comma-separated")
    parser.add_argument("--decode-plan", default="", help="decode: DecodePlan fields, e.g. block_n=64")
    args = parser.parse_args(argv)
    fields = dict(part.split("=") for part in args.decode_plan.split(",") if part)
    from kernels.attention import configs

    def plan(p):
        return p._replace(**{name: type(getattr(p, name))(int(value)) for name, value in fields.items()})

    with configs.override_decode(plan) if fields else contextlib.nullcontext():
        rows = compile_attention(args.kernels.split(","), [int(d) for d in args.dims.split(",")], args.causal,
                                 args.dropout, args.group_heads, tuple(int(p) for p in args.pages.split(",") if p))
    for name, label, grid, seconds, kernel in rows:
        print(f"{name} {label} grid {grid} ({seconds:.1f} s): {ptxas_report(kernel.asm['ptx'])}")
        if args.sass:
            print(f"  {sass_histogram(kernel.asm['cubin'])}")


if __name__ == "__main__":
    main()
