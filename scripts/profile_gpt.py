"""Where a training step of the GPT example goes, per backend: torch.profiler over a few eager steps.

    python3 -m scripts.profile_gpt [--steps 5] [--dropout 0.1] [--batch 16] [--seq 256]

Prints, for each backend, the wall time per step, the GPU kernel time per step (sum of kernel durations;
when it is well under the wall time the step is bound by the host) and the kernels that take the most GPU
time, grouped by name.
"""

from __future__ import annotations

import kernels._mode  # noqa: F401  (picks CUDA or the interpreter before triton is imported)

# isort: split

import argparse

import torch

from benchmarks._harness import host_us
from examples.gpt import GPT, add_model_arguments, batches, config_from_arguments, load_corpus


def profile(backend: str, args) -> None:
    torch.manual_seed(0)
    model = GPT(config_from_arguments(args, backend)).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(load_corpus("cuda"), args.batch, args.seq, args.warmup + 2 * args.steps)

    def step():
        tokens, targets = next(data)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(tokens, targets)
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
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.self_device_time_total, reverse=True)
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / args.steps
    print(f"== {backend}: wall {wall_ms:.2f} ms/step (unprofiled), GPU kernels {gpu_ms:.2f} ms/step")
    print(f"{'kernel':<90} {'ms/step':>8} {'calls/step':>10}")
    for e in kernels[: args.top]:
        print(f"{e.key[:90]:<90} {e.self_device_time_total / 1e3 / args.steps:8.3f} {e.count / args.steps:10.1f}")
    cpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"{'host (self CPU time)':<90} {'ms/step':>8} {'calls/step':>10}")
    for e in cpu[: args.top]:
        print(f"{e.key[:90]:<90} {e.self_cpu_time_total / 1e3 / args.steps:8.3f} {e.count / args.steps:10.1f}")


def op_host_costs(args) -> None:
    """Wall time per call of each op of one block, forward + backward, at the model's shapes, ours and
    torch's, called back to back without synchronising: the host cost when the kernels are short."""
    import torch.nn.functional as F

    from kernels.attention import flash_attention
    from kernels.dropout import dropout
    from kernels.layernorm import layer_norm

    b, s, h, d = args.batch, args.seq, args.heads, args.d_model
    x = torch.randn(b, s, d, device="cuda", requires_grad=True)
    w, bias = (torch.randn(d, device="cuda", requires_grad=True) for _ in range(2))
    xb = torch.randn(b, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    qkv = torch.randn(b, s, 3, h, d // h, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def attention_inputs():
        return qkv.permute(2, 0, 3, 1, 4).unbind(0)

    cases = {
        "layer_norm fp32": (lambda: layer_norm(x, d, w, bias), lambda: F.layer_norm(x, (d,), w, bias)),
        "dropout bf16": (lambda: dropout(xb, 0.1), lambda: F.dropout(xb, 0.1)),
        "attention bf16 causal p=0.1": (lambda: flash_attention(*attention_inputs(), causal=True, dropout_p=0.1),
                                        lambda: F.scaled_dot_product_attention(*attention_inputs(), is_causal=True,
                                                                               dropout_p=0.1)),
        "attention bf16 causal p=0": (lambda: flash_attention(*attention_inputs(), causal=True),
                                      lambda: F.scaled_dot_product_attention(*attention_inputs(), is_causal=True)),
    }
    print(f"{'op (forward + backward)':<32} {'ours us/call':>12} {'torch us/call':>13}")
    for name, fns in cases.items():
        row = []
        for fn in fns:
            def run(fn=fn):
                out = fn()
                out.backward(torch.ones_like(out))
            row.append(host_us(run, calls=args.calls, warmup=5, until_done=True))
        print(f"{name:<32} {row[0]:12.1f} {row[1]:13.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10)
    add_model_arguments(parser)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--backends", default="torch,fused")
    parser.add_argument("--ops", action="store_true", help="host cost per op instead of the step profile")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if args.ops:
        op_host_costs(args)
        return
    for backend in args.backends.split(","):
        profile(backend, args)


if __name__ == "__main__":
    main()
