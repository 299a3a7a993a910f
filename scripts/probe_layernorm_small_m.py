# ruff: noqa: B023  (each lambda is timed immediately, inside the iteration that defines it)
"""Why the backward at M = 4096 loses to torch: device time of the parts, and autograd's host cost.

    python3 scripts/probe_layernorm_small_m.py

1. Device time (CUDA graph replay, no host) of ``_norm_bwd_impl`` in lock mode and deterministic mode at
   M = 4096 for GROUP_SIZE_M caps, final-sum column widths and programs per SM; torch's ATen backward
   beside it.
2. Host time of ``.backward()`` through a Python ``autograd.Function`` that does no work, on CUDA tensors,
   beside ours and torch's: the floor any Python-level kernel library pays per backward.
Experiment code; the chosen rule goes into ``kernels/layernorm/ops.py``, the numbers into its README.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton.testing

import kernels.layernorm.ops as ops
from benchmarks._harness import graph_us, host_us
from kernels.layernorm import layer_norm
from scripts.sweep_layernorm import copy_gbps


class _NoWork(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        _ = ctx.saved_tensors  # unpacked as a real backward would
        return dy, _NoWork.dw, _NoWork.db


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    m, dtype = 4096, torch.bfloat16
    for n in (1024, 2048, 4096, 8192):
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
        b = torch.randn(n, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        _, mean, rstd = ops._norm_fwd_impl(x, w, b, 1e-5, False)
        _, t_mean, t_rstd = torch.ops.aten.native_layer_norm(x, (n,), w, b, 1e-5)
        torch_us = graph_us(lambda: torch.ops.aten.native_layer_norm_backward(
            dy, x, (n,), t_mean, t_rstd, w, b, [True, True, True]))
        print(f"\nM={m} N={n} bf16: device us (graph replay); torch ATen backward {torch_us:.1f}")
        for det, cap, width, per_sm in itertools.product((False, True), (64, 128, 256, 1024), (256, 64),
                                                         (2, 4)):
            if det and cap != 64:
                continue
            ops._MAX_GROUP_SIZE_M, ops._DWDB_BLOCK_N, ops._PROGRAMS_PER_SM = cap, width, per_sm
            us = graph_us(lambda: ops._norm_bwd_impl(dy, x, w, mean, rstd, False, True, det))
            mode = "deterministic" if det else f"lock cap {cap:4d}"
            print(f"  {mode:18s} final-sum cols {width:3d}  {per_sm}/SM  {us:7.1f}", flush=True)
        ops._MAX_GROUP_SIZE_M, ops._DWDB_BLOCK_N, ops._PROGRAMS_PER_SM = 64, 256, 4

    print("\nBandwidth sweep (M*N = 2^27, bf16) backward, % of copy: programs per SM 2 / 4, GROUP_SIZE_M cap 64 / 128")
    copy = copy_gbps()
    for kind, n in itertools.product(("layer", "rms"), (256, 1024, 4096, 8192)):
        is_rms = kind == "rms"
        rows = (1 << 27) // n
        x = torch.randn(rows, n, device="cuda", dtype=dtype)
        w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
        b = None if is_rms else torch.randn(n, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        _, mean, rstd = ops._norm_fwd_impl(x, w, b, 1e-5, is_rms)
        cells = []
        for per_sm, cap in itertools.product((2, 4), (64, 128)):
            ops._PROGRAMS_PER_SM, ops._MAX_GROUP_SIZE_M, ops._DWDB_BLOCK_N = per_sm, cap, 64
            ms = triton.testing.do_bench(lambda: ops._norm_bwd_impl(dy, x, w, mean, rstd, is_rms, not is_rms, False),
                                         return_mode="median")
            cells.append(f"{per_sm}/SM cap {cap}: {3 * rows * n * 2 / ms / 1e6 / copy:.0%}")
        print(f"  {kind:5} N={n:5}  " + "  ".join(cells), flush=True)
    ops._MAX_GROUP_SIZE_M, ops._DWDB_BLOCK_N, ops._PROGRAMS_PER_SM = 64, 256, 4
    del x, dy

    n = 1024
    x = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.rand(n, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    _NoWork.dw, _NoWork.db = torch.zeros_like(w), torch.zeros_like(b)
    outs = {"no-work Python Function": _NoWork.apply(x, w, b), "ours": layer_norm(x, n, w, b),
            "torch": F.layer_norm(x, (n,), w, b)}

    def backward(out):
        def run():
            x.grad = w.grad = b.grad = None
            out.backward(dy, retain_graph=True)
        return run

    print(f"\nM={m} N={n}: host us per .backward() (grads reset, back-to-back)")
    for name, out in outs.items():
        print(f"  {name:26s} {host_us(backward(out)):7.1f}", flush=True)
    with torch.autograd.set_multithreading_enabled(False):
        for name, out in outs.items():
            print(f"  {name:26s} {host_us(backward(out)):7.1f}  (autograd multithreading off)", flush=True)


if __name__ == "__main__":
    main()
