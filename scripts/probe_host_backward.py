"""Where the host time of an eager forward + backward goes, on the GPU: dropout layer by layer, beside a
Python ``autograd.Function`` that does nothing and beside torch's dropout.

    python3 scripts/probe_host_backward.py [--calls 300]

Each line is wall time per call of back-to-back calls (no synchronisation inside the loop): host cost
when the kernels are short.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import kernels.dropout.ops as dropout_ops
from benchmarks._harness import host_us
from kernels.dropout import dropout


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def timed(name: str, fn, calls: int) -> None:
    print(f"{name:<60} {host_us(fn, calls=calls, warmup=5, until_done=True):8.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    x = torch.randn(16, 256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    xd = x.detach()
    g = torch.ones_like(x)
    n = args.calls
    timed("torch.ones_like (the gradient seed)", lambda: torch.ones_like(x), n)
    timed("_Identity forward + backward (Python autograd.Function)",
          lambda: torch.autograd.backward(_Identity.apply(x), g), n)
    timed("F.dropout forward, no grad", lambda: F.dropout(xd, 0.1), n)
    timed("F.dropout forward + backward", lambda: torch.autograd.backward(F.dropout(x, 0.1), g), n)
    timed("dropout forward, no grad, seed given", lambda: dropout(xd, 0.1, seed=5), n)
    timed("dropout forward, no grad, seed=None", lambda: dropout(xd, 0.1), n)
    timed("dropout forward with grad (autograd node)", lambda: dropout(x, 0.1), n)
    timed("dropout forward + backward", lambda: torch.autograd.backward(dropout(x, 0.1), g), n)
    timed("dropout forward + backward, seed given", lambda: torch.autograd.backward(dropout(x, 0.1, seed=5), g), n)
    scalars = dropout_ops._kernel_scalars(0.1, 5)
    timed("_dropout_impl (launch only)", lambda: dropout_ops._dropout_impl(xd, 0.1, 5, scalars=scalars), n)
    from kernels._common.seed import draw_seed, seed_for_call

    timed("draw_seed", lambda: draw_seed(x.device), n)
    timed("seed_for_call(None)", lambda: seed_for_call(None, x.device), n)
    timed("torch.cuda.is_current_stream_capturing", torch.cuda.is_current_stream_capturing, n)

    # Inside the backward, which autograd runs on its device thread: time the method's body and the launch.
    spent = {"backward body": 0.0, "launch in backward": 0.0, "calls": 0}
    original_backward, original_launch = dropout_ops._DropoutFunction.backward, dropout_ops._launch

    def launch(*a, **k):
        start = time.perf_counter()
        original_launch(*a, **k)
        spent["launch in backward"] += time.perf_counter() - start

    def backward(ctx, grad_out):
        start = time.perf_counter()
        dropout_ops._launch = launch
        try:
            return original_backward(ctx, grad_out)
        finally:
            dropout_ops._launch = original_launch
            spent["backward body"] += time.perf_counter() - start
            spent["calls"] += 1

    dropout_ops._DropoutFunction.backward = staticmethod(backward)
    timed("dropout forward + backward, backward instrumented", lambda: torch.autograd.backward(dropout(x, 0.1), g), n)
    for key in ("backward body", "launch in backward"):
        print(f"  {key:<58} {1e6 * spent[key] / spent['calls']:8.1f} us")
    dropout_ops._DropoutFunction.backward = staticmethod(original_backward)
    launcher = dropout_ops.kernel_for(dropout_ops._dropout_fwd_kernel, traceable=False)
    print("  FastLauncher cache entries:", len(getattr(launcher, "_compiled", {})))
    for key in getattr(launcher, "_compiled", {}):
        print("   ", key)


if __name__ == "__main__":
    main()
