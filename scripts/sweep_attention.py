# ruff: noqa: B023  (each lambda is timed immediately, inside the iteration that defines it)
"""Attention launch-tile sweep on the GPU, beside SDPA's flash and cuDNN backends in the same run, at the
benchmark's points (B * S = 16k tokens, H * D = 2048); with ``--decode``, the KV-cache decode plan.

    python3 -m scripts.sweep_attention [--dtype float16] [--out sweep.jsonl] [--dims 64,128] [--seqs 1024,4096]
        [--fwd-only] [--fwd-configs "128,64,8,3;64,64,4,3"] [--dkdv-configs ...] [--dq-configs ...] [--window 1024]
    python3 -m scripts.sweep_attention --decode [--caches bf16,fp8,bf16-paged,fp8-paged] [--ragged]
        [--decode-points "1,32,8,32768,128;64,32,8,8192,128"] [--decode-plans "num_warps=8;splits*2"] [--rounds 3]
        [--decode-baseline BASELINE_DECODE_PY]

For every point, times the public forward with each candidate forward tile, and the public backward (as
two launches) with each candidate dK/dV tile and each dQ tile, the other kernels at their table tiles
(``kernels.attention.configs.override``). Prints the best tile per kernel, the TFLOP/s of forward and of
the backward with both best tiles, against SDPA-flash and cuDNN. Tiles that do not fit (shared memory,
registers) are reported and skipped. What it finds goes into ``configs.ROWS`` and the family's TUNING.md.

``--decode`` times one decode step (Sq 1) of ``flash_attention_with_kvcache`` at each point (B, Hq, Hkv, Sk, D; the
benchmark's ``DECODE_POINTS`` by default) for each cache (16-bit or FP8, contiguous or in pages of 16; ``--ragged``:
the benchmark's ragged lengths, at its ``RAGGED_POINTS`` by default) under the table's plan and under each plan of
``--decode-plans``: ``;``-separated changes of ``configs.DecodePlan`` fields (``block_n=64,num_stages=2``,
``splits*2``, ``splits/2``; ``balanced=0,splits=2``: per-sequence splits, 2 each, where the table shares the keys;
``balanced=1,splits=16``: 16 programs per key/value head sharing them), applied through ``configs.override_decode``.
``--decode-baseline`` (another version of ``kernels/attention/_decode.py``, e.g. ``git show
main:kernels/attention/_decode.py > /tmp/base.py``) times every plan also with that file's kernels
(``kvcache.kernels_from``), named ``... @base``: a decode kernel change against its baseline in the same rounds.
Device time by CUDA-graph replay (inputs cycled past L2), the variants interleaved over ``--rounds`` rounds; prints
µs, GB/s of the cache read and each plan's speed-up over the table's, and an FP8 cache's over the 16-bit cache's table
plan (tokens/s). Before timing, each variant's output on one set of inputs is compared with the table plan's
(``_decode_output_gaps``); a variant off by more than ``DECODE_OUTPUT_TOLERANCE`` is reported and not timed.
"""

from __future__ import annotations

import kernels._mode  # noqa: F401  (picks CUDA or the interpreter before triton is imported)

# isort: split

import argparse
import contextlib
import functools
import json
import math

import torch
import torch.nn.functional as F
import triton.testing

from kernels.attention import configs, flash_attention

FWD = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 4),
       (64, 128, 4, 3), (128, 64, 4, 4), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (64, 64, 8, 2)]
DKDV = [(32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (32, 128, 8, 3),
        (64, 128, 8, 2), (16, 128, 4, 4)]
DQ = [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3), (64, 32, 4, 3), (128, 128, 8, 2),
      (64, 64, 8, 3)]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def sweep(label, kernel, candidates, run):
    """``[(ms, tile)]`` sorted, for ``run()`` timed with ``kernel``'s tile forced to each candidate (16-bit
    inputs; the backward as two launches, so a dK/dV or dQ candidate is timed beside the table's other half)."""
    rows = []
    for c in candidates:
        forced = configs.Tile(*c)
        two_launches = None if kernel == "fwd" else False
        try:
            with configs.override(lambda q, t: forced if q.kernel == kernel else t, fuse=two_launches):
                ms = bench(run)
        except Exception as err:  # out of resources and the like: report, go on
            print(f"    {label} {c}: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
            continue
        rows.append((ms, c))
    rows.sort()
    return rows


def sdpa_times(q, k, v, causal, backend):
    from torch.nn.attention import sdpa_kernel

    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    try:
        fwd_ms = bench(fwd)
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        do = torch.randn_like(out)
        bwd_ms = bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
    except RuntimeError:
        return None, None
    return fwd_ms, bwd_ms


def _configs(text: str, default: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """``"128,64,8,3;64,64,4,3"`` as tiles, or ``default`` when empty."""
    return [tuple(int(x) for x in c.split(",")) for c in text.split(";")] if text else default


def _decode_plan_change(spec: str):
    """A ``--decode-plans`` entry as a function of the table's ``configs.DecodePlan``: ``field=N`` sets a field,
    ``splits*N`` and ``splits/N`` scale the split count (at least 1)."""
    changes = [part.strip() for part in spec.split(",") if part.strip()]

    def adjust(plan):
        for change in changes:
            if change.startswith("splits*") or change.startswith("splits/"):
                factor = int(change[7:])
                splits = plan.splits * factor if change[6] == "*" else plan.splits // factor
                plan = plan._replace(splits=max(1, splits))
            else:
                field, value = change.split("=")
                plan = plan._replace(**{field: type(getattr(plan, field))(int(value))})
        return plan

    return adjust


#: largest max |variant - table plan| / max(1, max |table plan|) of a decode variant's output: a different split count
#: or tile reorders the fp32 sums and may flip the last bit of a 16-bit output, nothing more
DECODE_OUTPUT_TOLERANCE = 2e-2


@contextlib.contextmanager
def _under(kernel_version, adjust):
    """A decode variant: its kernels (``kernel_version()``) and its plan change (``adjust``) in force."""
    with kernel_version(), configs.override_decode(adjust):
        yield


def _decode_output_gaps(call, variants) -> dict[str, float]:
    """Max |output - the first variant's| / max(1, max |the first variant's output|) of ``call`` (one decode step,
    the same inputs each time) under each variant, ``name -> context manager factory``; NaN in an output counts as
    an infinite gap. A variant other than the first that raises (a plan that does not fit) has no entry."""
    with next(iter(variants.values()))():
        reference = call().float()
    scale = max(1.0, reference.abs().max().item())
    gaps = {}
    for name, context in variants.items():
        try:
            with context():
                out = call().float()
        except Exception:  # reported where the variant is timed
            continue
        gap = (out - reference).abs().max().item() / scale
        gaps[name] = math.inf if math.isnan(gap) else gap
    return gaps


def decode_main(args) -> None:
    from benchmarks import bench_attention as bench_points
    from benchmarks._harness import graph_ms

    points = ([tuple(int(x) for x in p.split(",")) for p in args.decode_points.split(";")] if args.decode_points
              else bench_points.RAGGED_POINTS if args.ragged else bench_points.DECODE_POINTS)
    from kernels.attention import kvcache
    from scripts.ab_kernels import load_kernels_file

    baseline = load_kernels_file(args.decode_baseline, "baseline_decode_kernels") if args.decode_baseline else None
    plans = {"table": lambda plan: plan}
    plans.update({spec: _decode_plan_change(spec) for spec in args.decode_plans.split(";") if spec.strip()})
    dtype = getattr(torch, args.dtype)
    caches = [c.strip() for c in args.caches.split(",")]
    if args.ragged:
        caches = [c for c in caches if not c.startswith("fp8")] or ["bf16"]  # the ragged points are 16-bit
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "interpreter (timings mean nothing)"
    print(device, torch.__version__, args.dtype, "ragged" if args.ragged else "uniform", flush=True)
    for b, hq, hkv, sk, d in points:
        for cache in caches:
            fp8, paged = cache.startswith("fp8"), cache.endswith("-paged")

            def make(fp8: bool, paged=paged, b=b, hq=hq, hkv=hkv, sk=sk, d=d):
                """``(call, bytes of the cache it reads)`` of one decode step on inputs of its own."""
                if args.ragged:
                    page = bench_points.DECODE_PAGE if paged else 0
                    return bench_points._ragged_call(b, hq, hkv, sk, d, dtype, page,
                                                     bench_points._ragged_lengths(b, sk))
                return bench_points._decode_call("ours", b, hq, hkv, sk, d, dtype, paged, fp8)

            # (plan change, FP8 cache, kernels) per variant; an FP8 cache is also timed as a 16-bit one under the
            # table; with a baseline, every plan also with the baseline's kernels
            variants = {name: (adjust, fp8, contextlib.nullcontext) for name, adjust in plans.items()}
            if baseline is not None:
                variants.update({f"{name} @base": (adjust, fp8, functools.partial(kvcache.kernels_from, baseline))
                                 for name, adjust in plans.items()})
            if fp8:
                variants["16-bit cache, table"] = (plans["table"], False, contextlib.nullcontext)
            read = {kind: make(kind)[1] for kind in {fp8, False}}
            times: dict[str, list[float]] = {name: [] for name in variants}
            # the variants of the table's cache kind on one set of inputs: a plan or kernel that changes the result
            # is not timed
            same_cache = {name: functools.partial(_under, kernel_version, adjust)
                          for name, (adjust, narrow, kernel_version) in variants.items() if narrow == fp8}
            try:
                gaps = _decode_output_gaps(make(fp8)[0], same_cache)
            except Exception as err:  # the table's plan itself failed: the timing loop reports it
                gaps = {}
                print(f"  output check: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
            for name, gap in gaps.items():
                if gap > DECODE_OUTPUT_TOLERANCE:
                    print(f"  {name}: output off the table plan's by {gap:.3g} (relative): not timed")
                    times[name] = [math.nan] * args.rounds
                    del variants[name]
            for _ in range(args.rounds):
                for name, (adjust, narrow, kernel_version) in variants.items():
                    try:
                        with _under(kernel_version, adjust):
                            times[name].append(graph_ms(lambda: make(narrow)[0], touched_bytes=read[narrow]))
                    except Exception as err:  # a plan that does not fit: report once, go on
                        if not times[name]:
                            print(f"  {name}: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
                        times[name].append(math.nan)
            medians = {name: sorted(t)[len(t) // 2] if t else math.nan for name, t in times.items()}
            base = medians["table"]
            print(f"B {b} Hq {hq} Hkv {hkv} Sk {sk} D {d} {cache}:")
            for name, ms in medians.items():
                gbps = read[variants[name][1] if name in variants else fp8] / ms / 1e6
                print(f"  {name:28s} {ms * 1e3:9.1f} us {gbps:7.0f} GB/s  table/this {base / ms:5.2f}x", flush=True)
            if fp8:
                print(f"  FP8 cache against the 16-bit cache, table plans: "
                      f"{medians['16-bit cache, table'] / base:.2f}x tokens/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default=None, help="float16 (bfloat16 with --decode)")
    parser.add_argument("--out", default="sweep_attention.jsonl")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--seqs", default="1024,4096,16384")
    parser.add_argument("--fwd-only", action="store_true", help="sweep the forward kernel only (no backward, no cuDNN)")
    parser.add_argument("--fwd-configs", default="",
                        help='forward configs to sweep instead of FWD, e.g. "128,128,4,3;64,64,4,3"')
    parser.add_argument("--dkdv-configs", default="", help="dK/dV configs to sweep instead of DKDV")
    parser.add_argument("--dq-configs", default="", help="dQ configs to sweep instead of DQ")
    parser.add_argument("--window", type=int, default=-1,
                        help="causal sliding window: each query sees itself and this many keys before it "
                             "(only the causal points run); SDPA rows then show full causal attention")
    parser.add_argument("--decode", action="store_true", help="sweep the KV-cache decode plan instead")
    parser.add_argument("--caches", default="bf16,fp8", help="decode caches: bf16, fp8, bf16-paged, fp8-paged")
    parser.add_argument("--ragged", action="store_true", help="decode: the ragged benchmark's lengths (16-bit)")
    parser.add_argument("--decode-points", default="", help='decode points "B,HQ,HKV,SK,D;..."')
    parser.add_argument("--decode-plans", default="num_warps=8;splits*2;splits/2;num_stages=2",
                        help="decode plan changes to time beside the table's, ';'-separated")
    parser.add_argument("--rounds", type=int, default=3, help="decode: interleaved rounds")
    parser.add_argument("--decode-baseline", default="",
                        help="decode: another version of kernels/attention/_decode.py, timed beside this one")
    args = parser.parse_args()
    if args.decode:
        args.dtype = args.dtype or "bfloat16"
        decode_main(args)
        return
    args.dtype = args.dtype or "float16"
    dtype = getattr(torch, args.dtype)
    fwd_configs = _configs(args.fwd_configs, FWD)
    dkdv_configs = _configs(args.dkdv_configs, DKDV)
    dq_configs = _configs(args.dq_configs, DQ)
    from torch.nn.attention import SDPBackend

    print(torch.cuda.get_device_name(), torch.__version__, args.dtype)
    with open(args.out, "w") as log:
        for d in (int(x) for x in args.dims.split(",")):
            for s in (int(x) for x in args.seqs.split(",")):
                for causal in (False, True) if args.window < 0 else (True,):
                    b, h = 16384 // s, 2048 // d
                    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(4))
                    left, right = args.window, 0 if causal else -1
                    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
                    if args.window >= 0:  # visible pairs of the band only
                        flops = 4 * b * h * d * sum(min(i, args.window) + 1 for i in range(s))
                    fwd = sweep("fwd", "fwd", fwd_configs,
                                lambda: flash_attention(q, k, v, window_size=(left, right)))
                    if args.fwd_only:
                        public_ms = bench(lambda: flash_attention(q, k, v, window_size=(left, right)))
                        flash_fwd_ms = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                        print(f"D={d:3} S={s:5} causal={causal!s:5}  fwd "
                              + "  ".join(f"{c}: {flops / ms / 1e9:5.0f}" for ms, c in fwd)
                              + f"  | flash_attention() {flops / public_ms / 1e9:5.0f}"
                              + f"  sdpa default {flops / flash_fwd_ms / 1e9:5.0f}", flush=True)
                        continue
                    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
                    out = flash_attention(qg, kg, vg, window_size=(left, right))

                    def backward():
                        return torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)

                    dkdv = sweep("dkdv", "dkdv", dkdv_configs, backward)
                    dqr = sweep("dq", "dq", dq_configs, backward)
                    flash = sdpa_times(q, k, v, causal, SDPBackend.FLASH_ATTENTION)
                    cudnn = sdpa_times(q, k, v, causal, SDPBackend.CUDNN_ATTENTION)

                    def tf(ms, mult=1.0):
                        return None if ms is None else flops * mult / ms / 1e9

                    with configs.override(lambda q, t: configs.Tile(*(dkdv[0][1] if q.kernel == "dkdv" else
                                                                     dqr[0][1] if q.kernel == "dq" else t))):
                        bwd_ms = bench(backward)  # both best tiles together, one launch if they agree
                    rec = {
                        "D": d, "S": s, "causal": causal, "dtype": args.dtype,
                        "fwd_best": fwd[0][1], "fwd_tflops": tf(fwd[0][0]),
                        "fwd_all": [(c, round(tf(ms), 1)) for ms, c in fwd],
                        "dkdv_best": dkdv[0][1], "dkdv_ms": dkdv[0][0],
                        "dkdv_all": [(c, round(ms, 4)) for ms, c in dkdv],
                        "dq_best": dqr[0][1], "dq_ms": dqr[0][0], "dq_all": [(c, round(ms, 4)) for ms, c in dqr],
                        "bwd_tflops": tf(bwd_ms, 2.5),
                        "flash": [tf(flash[0]), tf(flash[1], 2.5)], "cudnn": [tf(cudnn[0]), tf(cudnn[1], 2.5)],
                    }
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    fl = rec["flash"]
                    print(f"D={d:3} S={s:5} causal={causal!s:5}  fwd {rec['fwd_tflops']:5.0f} {fwd[0][1]}"
                          f"  bwd {rec['bwd_tflops']:5.0f} (dkdv {dkdv[0][1]} {dkdv[0][0]:.3f} ms,"
                          f" dq {dqr[0][1]} {dqr[0][0]:.3f} ms)"
                          f"  flash {fl[0] or 0:5.0f}/{fl[1] or 0:5.0f}"
                          f"  cudnn {rec['cudnn'][0] or 0:5.0f}/{rec['cudnn'][1] or 0:5.0f}"
                          f"  ratio fwd {rec['fwd_tflops'] / (fl[0] or math.inf):.2f}"
                          f" bwd {rec['bwd_tflops'] / (fl[1] or math.inf):.2f}", flush=True)


if __name__ == "__main__":
    main()
