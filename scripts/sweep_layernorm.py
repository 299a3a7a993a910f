# ruff: noqa: B023  (each lambda is timed immediately, inside the iteration that defines it)
"""LayerNorm/RMSNorm launch-setting sweep on the GPU: % of the copy bandwidth at M * N = 2^27, bf16.

    python3 -m scripts.sweep_layernorm [--direction fwd,bwd] [--widths 256,1024,...] [--kinds layer,rms]
                                       [--op norm|add_dropout_norm] [--dropout 0.1]

For each width, times the public call (forward, or backward through autograd) under each candidate set of
``kernels.layernorm.configs.Settings`` (through ``configs.override``) beside the current settings, and prints
the best few with the device-to-device copy bandwidth measured in the same run. Forward candidates: the
forward tile and elements per thread (register path) and the L2 fraction and warps of the chunked path;
backward candidates: the backward tile, elements per thread and row-loop pipelining depth. ``--op
add_dropout_norm`` times the fused residual + dropout + norm instead (4 passes of M * N forward, 5 backward),
with its own forward candidates and, beside each, the flat dropout pass (``dropout_chunk_tiles=False``).
What it finds goes into ``configs.Settings`` and the family's TUNING.md.
"""

from __future__ import annotations

import kernels._mode  # noqa: F401  (picks CUDA or the interpreter before triton is imported)

# isort: split

import argparse
import itertools

import torch
import triton.testing

from kernels.layernorm import add_dropout_norm, configs, layer_norm, rms_norm

# fwd_row_tiles=(): the candidates' rule decides at every width, also where the measured table would
FWD_CANDIDATES = [{"fwd_tile": tile, "fwd_elements_per_thread": ept, "fwd_row_tiles": ()} for tile, ept in
                  itertools.product((2048, 4096, 8192), (16, 32, 64))]
FWD_CHUNKED_CANDIDATES = [{"chunk_l2_fraction": frac, "chunk_warps": warps} for frac, warps in
                          itertools.product((0.0, 0.25, 0.5, 1.0), (8, 16))]
ADN_FWD_CANDIDATES = [{"add_dropout_norm_row_tile": tile, "fwd_elements_per_thread": ept, "chunk_tile_max_warps": w}
                      for tile, ept, w in itertools.product((4096, 8192), (32, 64, 128), (4, 8))]
BWD_CANDIDATES = [{"bwd_tile": tile, "bwd_elements_per_thread": ept, "bwd_loop_stages": stages}
                  for tile, ept, stages in itertools.product((2048, 4096, 8192), (8, 16, 32), (2, 3))]


def copy_gbps() -> float:
    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * 4 / ms / 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--direction", default="fwd,bwd")
    parser.add_argument("--widths", default="256,512,1024,2048,4096,8192,16384,32768,65536")
    parser.add_argument("--kinds", default="layer,rms")
    parser.add_argument("--top", type=int, default=4, help="best candidates printed per width")
    parser.add_argument("--op", default="norm", choices=["norm", "add_dropout_norm"])
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout_p of --op add_dropout_norm")
    args = parser.parse_args(argv)
    ceiling = copy_gbps()
    print(f"{torch.cuda.get_device_name()}  copy {ceiling:.0f} GB/s  (% of copy, bf16, M*N = 2^27)")
    for direction, kind, n in itertools.product(args.direction.split(","), args.kinds.split(","),
                                                (int(w) for w in args.widths.split(","))):
        m = 2**27 // n
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=direction == "bwd")
        # the weight's gradient too (dW's partial sums are part of the backward), as the benchmark takes it
        w = (torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5).requires_grad_(direction == "bwd")
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        fused = args.op == "add_dropout_norm"
        if fused:
            res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=direction == "bwd")
            dres = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

        def fwd():
            if fused:
                return add_dropout_norm(x, res, w, kind=kind, dropout_p=args.dropout)
            return layer_norm(x, n, w) if kind == "layer" else rms_norm(x, n, w)

        if direction == "fwd":
            if fused:
                candidates = ADN_FWD_CANDIDATES if n <= configs.SETTINGS.max_fused_fwd else []
            else:
                candidates = FWD_CANDIDATES if configs.forward(n)["SINGLE_PASS"] else FWD_CHUNKED_CANDIDATES
            moved = 4 if fused else 2
        else:
            candidates = BWD_CANDIDATES if configs.fused_backward(n) else []
            moved = 5 if fused else 3
        if fused:
            candidates = [c for changes in candidates for c in (changes, {**changes, "dropout_chunk_tiles": False})]
        rows = []
        for changes in [{}, *candidates]:
            with configs.override(**changes):
                if direction == "fwd":
                    run = fwd
                else:
                    y = fwd()
                    if fused:
                        run = lambda: torch.autograd.grad(y, (x, res, w), (dy, dres), retain_graph=True)
                    else:
                        run = lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True)
                try:
                    ms = triton.testing.do_bench(run, return_mode="median")
                except Exception as err:  # out of resources and the like: report, go on
                    print(f"    {changes}: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
                    continue
            rows.append((moved * m * n * 2 / ms / 1e6 / ceiling, changes))
        current = rows[0][0]
        best = "  ".join(f"{frac:.0%} {changes or 'current'}" for frac, changes in sorted(rows, key=lambda r: -r[0])
                         [:args.top])
        print(f"{direction} {kind:5} N={n:5}  current {current:.0%}  best: {best}", flush=True)


if __name__ == "__main__":
    main()
