# ruff: noqa: B023  (each lambda is timed inside the iteration that defines it)
"""Interleaved A/B timing on the GPU: this checkout's kernels against another version of a family's
``_kernels.py`` and against forced launch tiles, through the public call, in one process.

    python3 -m scripts.ab_kernels attention BASELINE_KERNELS_PY [--rounds 7] [--dtype bfloat16]
        [--dims 64,128] [--lengths 1024,4096] [--tile KERNEL:BM,BN,WARPS,STAGES ...] [--backward | --backward-only]
        [--dropout P [--no-check]] [--hopper-dq DIMS] [--hopper-tile KERNEL:D:BLOCK_N,STAGES[,FIELD=N] ...]
        [--group G] [--group-heads N ...] [--shape B,HQ,HKV,SQ,SK ...] [--path P ...]
        [--peer cudnn|flash|efficient ...]
    python3 -m scripts.ab_kernels layernorm BASELINE_KERNELS_PY [--rounds 7] [--widths 1024,8192,65536]

Make the baseline first, e.g. ``git show HEAD~1:kernels/attention/_kernels.py > /tmp/base.py``; ``-`` as
the baseline times this checkout alone against the forced tiles. The baseline runs through this checkout's
launchers and launch tables (``ops.kernels_from``), so only the jit code differs; a ``--tile`` forces one
attention kernel's tile (``fwd``, ``dkdv`` or ``dq``) through ``configs.override``; ``--hopper-dq DIMS`` adds a
variant whose Hopper backward computes dQ by its kernel of its own at exactly these padded head dims
(``configs.hopper_dq_kernel``; ``--hopper-dq ""``: at none, every dQ by TMA reductions); ``--hopper-tile`` a variant
whose Hopper forward (``fwd``), dQ kernel (``dq``) or backward (``bwd``; its key block stays 128) takes another key
block and ring depth at padded head dim D, and other fields of its tile by name (``fwd:256:64,2,o_in_q=1``,
``bwd:128:128,2,split_96=0``; ``configs.hopper_tiles``; a field ``path=hopper`` also forces that kernel path);
``--group-heads N`` a variant whose Hopper backward gives a program at most N query heads of a GQA group
(``configs.hopper_group_heads``: a larger group is split over programs that sum dK and dV in fp32);
``--path P`` a variant on kernel path P; ``--peer B`` times SDPA on backend B beside them (forward, or forward +
backward with ``--backward``, or the backward alone), so that a ratio to it comes from the same rounds.
Variants alternate within each round (``benchmarks._harness.interleaved_medians``: run-to-run drift on one GPU is
10-17%, a side by side difference is not). Each variant's outputs must match the first's (``--no-check`` skips
that, for a baseline that draws another dropout mask; ``--dropout`` adds dropout on the attention probabilities).
Prints TFLOP/s (attention, B * S = 16k tokens, H * D = 2048, ``--group`` query heads per K/V head, causal and not;
``--backward`` times forward + backward, 3.5x the forward's FLOPs, ``--backward-only`` the backward of one forward
recorded before the variants, 2.5x) or GB/s (layernorm and RMSNorm, M * N = 2^27, bf16) and the ratio to the first
variant.
"""

from __future__ import annotations

import kernels._mode  # noqa: F401  (picks CUDA or the interpreter before triton is imported)

# isort: split

import argparse
import contextlib
import functools
import importlib.util
from collections.abc import Callable

import torch

import kernels._native as native_tier
from benchmarks._harness import interleaved_medians


def load_kernels_file(path: str, name: str):
    """Another version of a family's kernels file (``_kernels.py``, ``_decode.py``) as a module of its own named
    ``name``: a baseline that a family's ``kernels_from`` swaps in beside this checkout's kernels."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _variants(args) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """Name -> context manager under which the public call runs that variant (made afresh per call)."""
    variants = {}
    if args.baseline != "-":
        import kernels.attention.ops as attention_ops
        import kernels.layernorm.ops as layernorm_ops

        ops = attention_ops if args.family == "attention" else layernorm_ops
        baseline = load_kernels_file(args.baseline, f"baseline_{args.family}_kernels")
        variants["base"] = lambda: ops.kernels_from(baseline)
    variants["this"] = contextlib.nullcontext
    if args.family != "attention":
        return variants
    from kernels.attention import configs

    if args.hopper_dq is not None:
        dims = tuple(int(x) for x in args.hopper_dq.split(",") if x)
        variants[f"dq-kernel@{','.join(map(str, dims)) or 'none'}"] = lambda: configs.hopper_dq_kernel(dims)
    for path in args.path:
        variants[f"path:{path}"] = lambda path=path: configs.forced_path(path)
    for heads in args.group_heads:
        variants[f"group-heads:{heads}"] = lambda heads=heads: configs.hopper_group_heads(heads)
    for spec in args.hopper_tile:
        kernel, d, numbers = spec.split(":")
        table = {"fwd": configs.HOPPER_FORWARD, "dq": configs.HOPPER_DQ, "bwd": configs.HOPPER_BACKWARD}[kernel]
        block_n, stages, *fields = numbers.split(",")
        named = dict(field.split("=") for field in fields)
        path = named.pop("path", None)
        named = {key: int(value) for key, value in named.items()}
        named["stages"] = int(stages)
        if kernel != "bwd":  # the backward's key block is fixed (128 keys, two consumers of 64)
            named["block_n"] = int(block_n)
        tile = {int(d): table[int(d)]._replace(**named)}
        variants[spec] = lambda kernel=kernel, tile=tile, path=path: _all(
            configs.hopper_tiles(**{{"fwd": "forward", "dq": "dq", "bwd": "backward"}[kernel]: tile}),
            configs.forced_path(path) if path else contextlib.nullcontext())
    for spec in args.tile:
        kernel, numbers = spec.split(":")
        forced = configs.Tile(*(int(x) for x in numbers.split(",")))
        variants[spec] = lambda kernel=kernel, forced=forced: configs.override(
            lambda q, t: forced if q.kernel == kernel and q.dtype == "16-bit" else t)
    return variants


@contextlib.contextmanager
def _all(*managers):
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def _timed(variants, run, rounds: int, label: str, check_outputs: bool = True,
           peers: dict[str, Callable[[], object]] | None = None) -> dict[str, float]:
    first = next(iter(variants))
    with variants[first]():
        reference = [t.float() for t in run()]

    def check(name):
        if not check_outputs:
            return
        with variants[name]():
            got = run()
        for g, r in zip(got, reference, strict=True):
            err = (g.float() - r).abs().max().item()
            if err > 2e-2 * max(1.0, r.abs().max().item()):
                raise AssertionError(f"{label}: max |{name} - {first}| = {err:.3g}")

    def runner(name):
        def go():
            with variants[name]():
                return run()
        return go

    runs = {name: runner(name) for name in variants}
    runs.update(peers or {})
    return interleaved_medians(runs, rounds, check=lambda name: name in variants and check(name), label=label)


def _sdpa_peers(args, q, k, v, do, causal: bool) -> dict[str, Callable[[], object]]:
    """``--peer`` runs: SDPA on each named backend, the same call as the variants' (forward, or forward + backward
    with ``--backward``; a GQA call repeats K and V's heads in the timed call, as a user of SDPA would; with
    ``--backward-only``, the backward of one recorded forward that takes the groups natively, ``enable_gqa``)."""
    from benchmarks._peers import sdpa_attention

    group = q.shape[1] // k.shape[1]
    if args.backward_only:
        runs = {}
        for backend in args.peer:
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            try:
                out = sdpa_attention(f"sdpa-{backend}", causal, args.dropout, enable_gqa=group > 1)(qg, kg, vg)
            except RuntimeError as err:  # a backend that refuses these inputs
                print(f"  sdpa-{backend}: {str(err).splitlines()[0][:100]}")
                continue
            runs[f"sdpa-{backend}"] = functools.partial(torch.autograd.grad, out, (qg, kg, vg), do, retain_graph=True)
        return runs
    qg, kg, vg = (t.clone().requires_grad_(args.backward) for t in (q, k, v))

    def call(attention):
        kk, vv = (kg, vg) if group == 1 else (kg.repeat_interleave(group, 1), vg.repeat_interleave(group, 1))
        out = attention(qg, kk, vv)
        if args.backward:
            return torch.autograd.grad(out, (qg, kg, vg), do)
        return (out,)

    attentions = {f"sdpa-{backend}": sdpa_attention(f"sdpa-{backend}", causal, args.dropout) for backend in args.peer}
    return {name: functools.partial(call, attention) for name, attention in attentions.items()}


def _attention(args, variants) -> None:
    from kernels.attention import flash_attention

    dtype = getattr(torch, args.dtype)
    drop = {"dropout_p": args.dropout, "seed": 1234} if args.dropout else {}
    for d in (int(x) for x in args.dims.split(",")):
        shapes = [tuple(int(x) for x in shape.split(",")) for shape in args.shape] or [
            (16384 // s, 2048 // d, 2048 // d // args.group, s, s) for s in (int(x) for x in args.lengths.split(","))]
        for b, h, hkv, sq, sk in shapes:
            q, do = (torch.randn(b, h, sq, d, device="cuda", dtype=dtype) for _ in range(2))
            k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype) for _ in range(2))
            for causal in (False, True):
                pairs = sq * sk
                if causal:  # half when Sq = Sk, as the benchmark tables count; else the bottom-right band's pairs
                    pairs = pairs / 2 if sq == sk else sq * sk - (sq * (sq - 1) // 2 if sq < sk else sk * (sk + 1) // 2)
                flops = 4 * b * h * pairs * d
                if args.backward_only:
                    # one recorded forward; each variant's backward dispatch is made when the backward runs
                    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
                    out = flash_attention(qg, kg, vg, causal=causal, **drop)
                    run = lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)
                    flops *= 2.5
                elif args.backward:
                    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
                    run = lambda: torch.autograd.grad(flash_attention(qg, kg, vg, causal=causal, **drop), (qg, kg, vg),
                                                      do)
                    flops *= 3.5  # forward + backward (2.5x)
                else:
                    run = lambda: (flash_attention(q, k, v, causal=causal, **drop),)
                size = f"B{b} H{h}/{hkv} Sq{sq} Sk{sk}" if args.shape else f"S={sq}"
                label = f"D={d} {size} {'causal' if causal else 'full'}"
                peers = _sdpa_peers(args, q, k, v, do, causal)
                medians = _timed(variants, run, args.rounds, label, not args.no_check, peers)
                _print(label, medians, {name: flops / ms / 1e9 for name, ms in medians.items()}, "TFLOP/s")


def _layernorm(args, variants) -> None:
    from kernels.layernorm import layer_norm, rms_norm

    for kind in ("layer", "rms"):
        for n in (int(x) for x in args.widths.split(",")):
            m = 2**27 // n
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w = (torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5).requires_grad_(True)
            dy = torch.randn_like(x)

            def fwd():
                return layer_norm(x, n, w) if kind == "layer" else rms_norm(x, n, w)

            y = fwd()
            for direction, run, moved in (("fwd", lambda: (fwd(),), 2), ("bwd", lambda: torch.autograd.grad(
                    y, (x, w), dy, retain_graph=True), 3)):
                label = f"{kind} N={n} {direction}"
                medians = _timed(variants, run, args.rounds, label)
                _print(label, medians, {name: moved * m * n * 2 / ms / 1e6 for name, ms in medians.items()}, "GB/s")


def _print(label, medians, rates, unit) -> None:
    first = next(iter(medians))
    cells = "  ".join(f"{name} {rate:7.1f} ({medians[first] / medians[name]:5.3f})" for name, rate in rates.items())
    print(f"{label:28s} {unit}: {cells}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=("attention", "layernorm"))
    parser.add_argument("baseline", help="another version of the family's _kernels.py, or - for none")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16", help="attention inputs (layernorm: bf16)")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--backward", action="store_true", help="attention: time forward + backward")
    parser.add_argument("--backward-only", action="store_true",
                        help="attention: time the backward alone (of one forward recorded before the variants)")
    parser.add_argument("--dropout", type=float, default=0.0, help="attention: dropout_p (seed fixed)")
    parser.add_argument("--no-check", action="store_true", help="do not compare outputs with the first variant's")
    parser.add_argument("--tile", action="append", default=[], metavar="KERNEL:BM,BN,WARPS,STAGES",
                        help="attention: force one kernel's tile for 16-bit inputs (repeatable)")
    parser.add_argument("--hopper-dq", metavar="DIMS",
                        help="attention: a variant whose Hopper backward takes the dQ kernel of its own at these "
                             "padded head dims (comma-separated; empty: none)")
    parser.add_argument("--hopper-tile", action="append", default=[], metavar="KERNEL:D:BLOCK_N,STAGES[,FIELD=N]",
                        help="attention: a variant whose Hopper forward (fwd), dQ kernel (dq) or backward (bwd) at "
                             "padded head dim D takes this key block and ring depth, and other tile fields by name "
                             "(repeatable)")
    parser.add_argument("--shape", action="append", default=[], metavar="B,HQ,HKV,SQ,SK",
                        help="attention: time these shapes (repeatable) instead of the --lengths grid")
    parser.add_argument("--path", action="append", default=[], choices=("auto", "hopper", "portable"),
                        help="attention: a variant that runs on this kernel path (repeatable)")
    parser.add_argument("--peer", action="append", default=[], choices=("cudnn", "flash", "efficient"),
                        help="attention: time SDPA on this backend beside the variants (repeatable)")
    parser.add_argument("--group", type=int, default=1, help="attention: query heads per key/value head (GQA)")
    parser.add_argument("--group-heads", type=int, action="append", default=[], metavar="N",
                        help="attention: a variant whose Hopper backward walks at most N query heads per program")
    parser.add_argument("--widths", default="256,1024,4096,8192,16384,65536")
    args = parser.parse_args(argv)
    variants = _variants(args)
    # the compiled tier (on unless FUSED_KERNELS_NATIVE=0) built now: else it is built beside the first variants'
    # calls, and the calls made before it is ready take the Python path, those after it the tier
    native_tier.prepare()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: medians of {args.rounds} alternating "
          f"rounds; (ratio) = first variant's time / this variant's")
    (_attention if args.family == "attention" else _layernorm)(args, variants)


if __name__ == "__main__":
    main()
