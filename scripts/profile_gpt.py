"""Where a training step of the GPT example goes, per backend: torch.profiler over a few eager or compiled steps.

    python3 -m scripts.profile_gpt [--steps 5] [--dropout 0.1] [--batch 16] [--seq 256] [--compile]
    python3 -m scripts.profile_gpt --ops [--calls 300] [--rounds 3] [--only dropout,...] [--profile OP]

Prints, for each backend, the wall time per step, the GPU kernel time per step (sum of kernel durations;
when it is well under the wall time the step is bound by the host) and the kernels that take the most GPU
time, grouped by name, and the GPU time by kind of kernel (attention, matmul, the rest of the forward and
backward, the optimiser), the table to read side by side when asking which part of a step makes the difference.
``--compile`` profiles ``torch.compile(model, fullgraph=True)`` instead of the eager model.

``--ops``: host time per call of each public op instead, ours against torch's, at a tiny size (the kernels
take a few µs, so the clock measures the Python, dispatch and launch path). For each op: the forward with
inputs that require grad (the autograd node included), and the forward plus ``.backward()``; ``calls`` calls
back to back without synchronising (``benchmarks._harness.host_us``), the median of ``rounds`` interleaved
rounds. torch's side is the op a user would otherwise call: ``F.dropout``, ``F.layer_norm``, ``F.rms_norm``,
the composition ``F.layer_norm(F.dropout(x) + residual)`` for ``add_dropout_norm``, and SDPA (whatever
backend it picks) for ``flash_attention``; ours with the compiled eager tier unless ``FUSED_KERNELS_NATIVE=0`` (built
before the first timed call). A last row gives the floor of any op written in Python: an
``autograd.Function`` that only allocates its output, against the bare allocation. ``--profile OP`` adds a
cProfile of that op's forward + backward, the functions with the most own time first.
"""

from __future__ import annotations

import kernels._mode  # noqa: F401  (picks CUDA or the interpreter before triton is imported)

# isort: split

import argparse
import cProfile
import pstats
import re
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

import kernels._native as native_tier
from benchmarks._harness import forward_backward, host_us
from examples.gpt import GPT, add_model_arguments, batches, config_from_arguments, load_corpus
from kernels.attention import flash_attention
from kernels.dropout import dropout
from kernels.layernorm import add_dropout_norm, layer_norm, rms_norm


def profile(backend: str, args) -> None:
    torch.manual_seed(0)
    model = GPT(config_from_arguments(args, backend)).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(load_corpus("cuda"), args.batch, args.seq, args.warmup + 2 * args.steps)
    step_fn = torch.compile(model, fullgraph=True) if args.compile else model

    def step():
        tokens, targets = next(data)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = step_fn(tokens, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    wall_ms = host_us(step, calls=args.steps, warmup=args.warmup, until_done=True) / 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                      and not getattr(e, "is_user_annotation", False)),
                     key=lambda e: e.self_device_time_total, reverse=True)
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / args.steps
    print(f"== {backend}{' compiled' if args.compile else ''}: wall {wall_ms:.2f} ms/step (unprofiled), "
          f"GPU kernels {gpu_ms:.2f} ms/step")
    kinds = {}
    for e in kernels:
        kind = kernel_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total / 1e3 / args.steps
    print("   by kind: " + ", ".join(f"{kind} {ms:.2f}" for kind, ms in sorted(kinds.items())) + " ms/step")
    print(f"{'kernel':<90} {'ms/step':>8} {'calls/step':>10}")
    for e in kernels[: args.top]:
        print(f"{e.key[:90]:<90} {e.self_device_time_total / 1e3 / args.steps:8.3f} {e.count / args.steps:10.1f}")
    cpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"{'host (self CPU time)':<90} {'ms/step':>8} {'calls/step':>10}")
    for e in cpu[: args.top]:
        print(f"{e.key[:90]:<90} {e.self_cpu_time_total / 1e3 / args.steps:8.3f} {e.count / args.steps:10.1f}")


#: (kind, pattern) in the order tried: the first pattern found in a kernel's name names its kind
_KERNEL_KINDS = (
    ("attention", re.compile(r"attn|flash|fmha|sdpa|cudnn", re.IGNORECASE)),
    ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|sm90_|wgmma|splitk", re.IGNORECASE)),
    ("optimizer", re.compile(r"multi_tensor|foreach|adam", re.IGNORECASE)),
)


def kernel_kind(name: str) -> str:
    """``attention``, ``matmul``, ``optimizer``, or ``rest`` (norms, dropout, residual adds, activations, loss,
    copies) for a GPU kernel's name, ours and torch's and inductor's alike."""
    return next((kind for kind, pattern in _KERNEL_KINDS if pattern.search(name)), "rest")


def _cases() -> dict[str, tuple[Callable, Callable]]:
    """op -> (ours, torch's): each returns the output(s) whose sum is differentiated."""
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    x, residual = (torch.randn(8, 1024, **bf16, requires_grad=True) for _ in range(2))
    w, b = (torch.randn(1024, **bf16, requires_grad=True) for _ in range(2))
    q, k, v = (torch.randn(1, 2, 64, 64, **bf16, requires_grad=True) for _ in range(3))
    return {
        "dropout": (lambda: dropout(x, 0.1), lambda: F.dropout(x, 0.1)),
        "layer_norm": (lambda: layer_norm(x, 1024, w, b), lambda: F.layer_norm(x, (1024,), w, b)),
        "rms_norm": (lambda: rms_norm(x, 1024, w), lambda: F.rms_norm(x, (1024,), w)),
        "add_dropout_norm": (lambda: add_dropout_norm(x, residual, w, b, dropout_p=0.1),
                             lambda: _torch_add_dropout_norm(x, residual, w, b)),
        "flash_attention": (lambda: flash_attention(q, k, v, causal=True),
                            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "flash_attention p=0.1": (lambda: flash_attention(q, k, v, causal=True, dropout_p=0.1),
                                  lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)),
    }


class _Passthrough(torch.autograd.Function):
    """The floor of an op written as a Python ``autograd.Function``: one allocation forward, none backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _floors() -> dict[str, tuple[Callable, Callable]]:
    """What no Python op gets under: an ``autograd.Function`` that launches nothing, against one allocation."""
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return {"floor: autograd.Function": (lambda: _Passthrough.apply(x), lambda: torch.empty_like(x))}


def _torch_add_dropout_norm(x, residual, w, b):
    residual_out = F.dropout(x, 0.1) + residual
    return F.layer_norm(residual_out, (x.shape[-1],), w, b), residual_out


def op_host_costs(args) -> None:
    """The ``--ops`` table (see the module docstring) and, with ``--profile``, one op's cProfile."""
    native_tier.prepare()  # the compiled tier (on unless FUSED_KERNELS_NATIVE=0) built before the first timed call
    cases = {**_cases(), **_floors()}
    chosen = args.only.split(",") if args.only else list(cases)
    print(f"{'op':<24} {'fwd ours':>9} {'fwd torch':>9} {'ratio':>6} {'fwd+bwd ours':>13} {'fwd+bwd torch':>13}"
          f" {'ratio':>6}   (µs of host time per call)")
    for name in chosen:
        ours, theirs = cases[name]
        timings = {key: [] for key in ("fwd ours", "fwd torch", "both ours", "both torch")}
        # the floor's torch side is a bare allocation: nothing to differentiate, so forward only
        differentiable = not name.startswith("floor")
        for _ in range(args.rounds):
            timings["fwd ours"].append(host_us(ours, calls=args.calls))
            timings["fwd torch"].append(host_us(theirs, calls=args.calls))
            timings["both ours"].append(host_us(forward_backward(ours), calls=args.calls))
            timings["both torch"].append(host_us(forward_backward(theirs) if differentiable else theirs,
                                                 calls=args.calls))
        m = {key: statistics.median(values) for key, values in timings.items()}
        print(f"{name:<24} {m['fwd ours']:9.1f} {m['fwd torch']:9.1f} {m['fwd ours'] / m['fwd torch']:6.2f} "
              f"{m['both ours']:13.1f} {m['both torch']:13.1f} {m['both ours'] / m['both torch']:6.2f}")
    if args.profile:
        run = forward_backward(cases[args.profile][0])
        for _ in range(20):
            run()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            run()
        profiler.disable()
        torch.cuda.synchronize()
        print(f"\ncProfile of {args.calls} forward + backward calls of {args.profile} (own time first):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10)
    add_model_arguments(parser)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--backends", default="torch,fused")
    parser.add_argument("--compile", action="store_true", help="profile the torch.compile'd model")
    parser.add_argument("--ops", action="store_true", help="host cost per op instead of the step profile")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="--ops: comma-separated subset of the ops (default: all)")
    parser.add_argument("--profile", default="", metavar="OP", help="--ops: also cProfile this op's forward + backward")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if args.ops:
        op_host_costs(args)
        return
    for backend in args.backends.split(","):
        profile(backend, args)


if __name__ == "__main__":
    main()
