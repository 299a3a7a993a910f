"""Peak extra memory and time of attention forward + backward: ours vs naive vs SDPA's backends.

    python3 -m scripts.attention_memory [--out attention-memory.md]

"Peak extra" is ``max_memory_allocated`` during one forward + backward minus what the inputs and the
incoming gradient already hold: activations saved for backward, workspaces, the gradients themselves.
Points: B=4, H=16, S=4096, D=64, causal (the memory comparison of the README) and D=1024 (B=4, H=1, S=1024).
"""

from __future__ import annotations

import kernels._mode  # noqa: F401  (picks CUDA or the interpreter before triton is imported)

# isort: split

import argparse

import torch
import triton.testing

import reference.attention as twin
from benchmarks._peers import sdpa_attention
from kernels.attention import flash_attention

POINTS = [(4, 16, 4096, 64, True), (4, 1, 1024, 1024, True), (4, 1, 1024, 1024, False)]


def provider(name, causal):
    if name == "ours":
        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    if name == "naive":
        return lambda q, k, v: twin.attention(q, k, v, causal=causal)
    return sdpa_attention(name, causal)


def measure(fn, b, h, s, d, dtype):
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn(b, h, s, d, device="cuda", dtype=dtype)
    torch.autograd.grad(fn(q, k, v), (q, k, v), do)  # warm-up, compile
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(fn(q, k, v), (q, k, v), do)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    del grads
    fwd_ms = triton.testing.do_bench(lambda: fn(q, k, v), return_mode="median")
    out = fn(q, k, v)
    bwd_ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                     return_mode="median")
    return fwd_ms, bwd_ms, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="attention-memory.md")
    args = parser.parse_args()
    dtype = torch.bfloat16
    lines = [f"# attention: peak extra memory of forward + backward ({torch.cuda.get_device_name()}, bf16)", "",
             "| B | H | S | D | causal | provider | fwd ms | bwd ms | total ms | peak extra MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for b, h, s, d, causal in POINTS:
        for name in ("ours", "naive", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"):
            try:
                fwd_ms, bwd_ms, peak = measure(provider(name, causal), b, h, s, d, dtype)
                row = f"{fwd_ms:.3f} | {bwd_ms:.3f} | {fwd_ms + bwd_ms:.3f} | {peak:,.0f}"
            except RuntimeError as err:  # a backend that refuses this head dim
                row = f"– | – | – | – ({str(err).splitlines()[0][:60]})"
                torch.cuda.empty_cache()
            lines.append(f"| {b} | {h} | {s} | {d} | {causal} | {name} | {row} |")
            print(lines[-1], flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
