"""Compile a launch for Hopper (sm_90a) on a machine without a GPU and print what ptxas reports.

    PYTHONPATH=$PWD python3 scripts/compile_report.py [--d 128] [--dtype bfloat16] [--s 4096] [--causal]

The GPU machine is lent for minutes per session; shared memory, registers and spills do not need it.
This records the arguments our launchers pass (meta tensors, so nothing runs), specialises them the
way Triton does (an int equal to 1 becomes a constant, pointers and ints divisible by 16 get that
divisibility, ``do_not_specialize`` arguments stay plain), compiles through Triton for
``GPUTarget("cuda", 90, 32)`` and runs the bundled ``ptxas -v`` on the PTX. Triton's own launch may
specialise slightly differently (it checks each real pointer's alignment), so treat small differences
from the device's ``n_spills``/``n_regs`` as that.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import re
import subprocess
import tempfile
import typing

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kernels.attention.ops as ops

_TYPES = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32"}


class _Recorder:
    """Stands in for ``kernel_for(kernel)``: keeps the kernel and the arguments of the launch."""

    launches: typing.ClassVar[list] = []

    def __init__(self, kernel, *, traceable: bool = False):
        self.kernel = kernel

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            _Recorder.launches.append((self.kernel, grid, args, kwargs))
        return record


def specialise(kernel, args, kwargs):
    """``(signature, constexprs, attrs, options)`` for ``triton.compile``, as a launch would specialise."""
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    signature, constexprs, attrs = {}, {}, {}
    values = dict(zip([p.name for p in kernel.params], args, strict=False))
    values.update({k: v for k, v in kwargs.items() if k not in options})
    for i, p in enumerate(kernel.params):
        value = values.get(p.name, p.default)
        if p.is_constexpr or value is None:  # Triton makes a None argument a constant
            signature[p.name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = _TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[p.name] = "i1"
        elif isinstance(value, int):
            plain = p.do_not_specialize
            if value == 1 and not plain:
                signature[p.name], constexprs[(i,)] = "constexpr", 1
            else:
                signature[p.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
                if value % 16 == 0 and not plain:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[p.name] = "fp32"
    return signature, constexprs, attrs, options


def report(kernel, args, kwargs) -> str:
    signature, constexprs, attrs, options = specialise(kernel, args, kwargs)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        pathlib.Path(ptx).write_text(compiled.asm["ptx"])
        out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out).group(1)
    spills = re.search(r"(\d+) bytes spill stores", out).group(1)
    cfg = {k: v for k, v in kwargs.items() if "BLOCK_M" in k or "BLOCK_N" in k or k in ("DKDV", "DQ", "num_warps",
                                                                                      "num_stages")}
    return (f"{kernel.__name__:24s} {cfg}  shared {compiled.metadata.shared // 1024} KiB, {regs} registers, "
            f"{spills} bytes spilled")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    b, h, s, d = 16384 // args.s, 2048 // args.d, args.s, args.d
    q, k, v, do, o = (torch.empty(b, h, s, d, device="meta", dtype=dtype) for _ in range(5))
    lse, delta = (torch.empty(b, h, s, device="meta", dtype=torch.float32) for _ in range(2))
    right, scale = (0 if args.causal else -1), 1 / math.sqrt(d)
    ops.kernel_for = _Recorder
    ops.unused_pointer = lambda like, traceable=True: None
    ops._launch_fwd(q, k, v, o, lse, -1, right, scale, ops._config("fwd", d, dtype, -1, right, s))
    dkdv_cfg, dq_cfg = (ops._config(kernel, d, dtype, -1, right) for kernel in ("dkdv", "dq"))
    ops._launch_bwd(do, q, k, v, lse, delta, None, k, v, -1, right, scale, dkdv_cfg, None)
    ops._launch_bwd(do, q, k, v, lse, delta, q, None, None, -1, right, scale, None, dq_cfg)
    if ops._fusable(dkdv_cfg, dq_cfg):
        ops._launch_bwd(do, q, k, v, lse, delta, q, k, v, -1, right, scale, dkdv_cfg, dq_cfg)
    print(f"sm_90a, D={d} S={s} {args.dtype} causal={args.causal}")
    for kernel, _, kargs, kwargs in _Recorder.launches:
        print(report(kernel, kargs, kwargs), flush=True)


if __name__ == "__main__":
    main()
