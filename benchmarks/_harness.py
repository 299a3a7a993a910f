"""The benchmark harness: timing, the machine's ceilings, records, and the result files.

Every family suite (``benchmarks/bench_<family>.py``) times its providers with :func:`time_ms` and
hands each measurement to :func:`Recorder.add`, which computes GB/s or TFLOP/s and the fraction of the
ceiling measured in the same run. At the end of the run :func:`write_results` writes, per family, under
``benchmarks/results/<gpu-name>/`` (or ``$FUSED_KERNELS_RESULTS_DIR/<gpu-name>/``):

- ``<family>.json``: a list of records (``family, provider, direction, dtype, <shape keys>, ms,
  gbps|tflops, ceiling_fraction``, plus any family extras),
- ``<family>.md``: one row per point, one column per provider, and ours' ratio to the best peer,
- ``<family>.png``: the metric against size, one line per provider, one panel per series,
- ``ceilings.json``: the copy bandwidth and matmul rate the fractions are taken against.

Without a GPU the suites run in *smoke mode*: tiny shapes, kernels under the Triton interpreter, wall
clock timing. Those timings mean nothing; the files go to ``benchmarks/results/cpu-smoke/``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels._mode import INTERPRETER

SMOKE: bool = INTERPRETER
RESULTS_ROOT = Path(__file__).resolve().parent / "results"


def gpu_slug() -> str:
    """Folder name for this machine's results: the GPU's name, lower-case, dashes (``nvidia-h100-80gb-hbm3``)."""
    if SMOKE:
        return "cpu-smoke"
    name = torch.cuda.get_device_name()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def results_dir() -> Path:
    base = os.environ.get("FUSED_KERNELS_RESULTS_DIR")
    return (Path(base) if base else RESULTS_ROOT) / gpu_slug()


def spawn_ranks(worker: Callable[..., None], world: int, *args) -> None:
    """Run ``worker(rank, world, init_file, *args)`` in ``world`` spawned processes, ``init_file`` a fresh
    torch.distributed rendezvous file (the worker initialises and destroys its process group); returns when all are
    done. A rank that raises prints its traceback and exits at once: a peer waiting in a collective that rank never
    joins would hang its ``destroy_process_group``, and the exit makes the spawning process end the other ranks and
    raise. The multi-GPU benchmark and the tests of context parallelism share it."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_rank_main, args=(worker, world, os.path.join(folder, "init"), args), nprocs=world,
                           join=True, start_method="spawn")


def _rank_main(rank: int, worker: Callable[..., None], world: int, init_file: str, args: tuple) -> None:
    try:
        worker(rank, world, init_file, *args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    # A rank that is done leaves without the interpreter's teardown (its files are closed, its process group
    # destroyed): once in seven local runs of a test on CPU ranks, a rank died of SIGABRT with no Python exception
    # ("terminate called without an active exception", a C++ thread destroyed while running), most likely in the
    # teardown of gloo's threads, and failed the run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def time_ms(fn: Callable[[], object], *, grad_to_none: Sequence[torch.Tensor] | None = None) -> float:
    """Median milliseconds of ``fn``: CUDA events through ``triton.testing.do_bench`` (L2 flushed before
    every repetition) on a GPU; a few wall-clock runs in smoke mode."""
    if SMOKE:
        fn()
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - start) * 1e3)
        return sorted(runs)[1]
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))


def interleaved_medians(runs: dict[str, Callable[[], object]], rounds: int, *,
                        check: Callable[[str], None] | None = None, label: str = "") -> dict[str, float]:
    """Median milliseconds of each of ``runs`` over ``rounds`` interleaved rounds (every variant once per
    round, so that clock drift falls on all alike). Each variant runs once first, then ``check(name)`` if
    given; a variant that raises there (does not compile, out of resources, wrong output) is reported
    on one line, prefixed by ``label``, and left out."""
    kept = {}
    for name, fn in runs.items():
        try:
            fn()
            if check is not None:
                check(name)
            kept[name] = fn
        except Exception as err:  # a probe's variant that cannot run here: say why and go on
            print(f"  {label}{name}: {type(err).__name__}: {str(err).splitlines()[0][:100]}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in kept}
    for _ in range(rounds):
        for name, fn in kept.items():
            times[name].append(time_ms(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def graph_ms(make_run: Callable[[], Callable[[], object]], *, touched_bytes: float = 0.0, replays: int = 20) -> float:
    """Device milliseconds per call, from CUDA-graph replay: no host work between kernels, so what the device
    alone takes, whatever the Python and launch path in front of it cost.

    ``make_run()`` builds one instance of the work (its own inputs, and for a backward its own forward graph)
    and returns the call to time. The graph cycles through enough instances that the bytes they touch
    (``touched_bytes`` each) exceed twice the L2 cache, so every call reads from memory as after
    ``time_ms``'s L2 flush; ``touched_bytes=0`` times one instance over and over (data stays in L2).
    Instances are built and warmed up on the capture stream, so a backward's kernels (autograd runs them on
    the forward's stream) are captured too. Each replay is queued behind a device-side sleep, so the host's
    launch of the graph is hidden; the median over ``replays`` replays is returned. Smoke mode: wall clock
    of the same cycle (the path is exercised; the figure means nothing)."""
    if SMOKE:
        runs = [make_run() for _ in range(2)]
        return time_ms(lambda: [run() for run in runs]) / len(runs)
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    instances = max(1, math.ceil(2 * l2_bytes / touched_bytes)) if touched_bytes > 0 else 1
    calls_per_instance = max(1, math.ceil(32 / instances))  # >= 32 calls per graph: the sleep covers its launch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        runs = [make_run() for _ in range(instances)]
        for _ in range(2):  # compilation, autotuning and cached workspaces happen here, outside the capture
            for run in runs:
                run()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls_per_instance):
                for run in runs:
                    run()
        graph.replay()
        stream.synchronize()
        per_call = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(2_000_000)  # ~1 ms of device time, ahead of the host's graph launch
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            per_call.append(start.elapsed_time(end) / (calls_per_instance * instances))
    torch.cuda.current_stream().wait_stream(stream)
    return statistics.median(per_call)


def graph_us(fn: Callable[[], object]) -> float:
    """Device microseconds per call of ``fn``, replayed from a CUDA graph over the same inputs (see
    :func:`graph_ms`): the pure device time of the work ``host_us`` times from the host."""
    return graph_ms(lambda: fn) * 1e3


def forward_backward(fn: Callable[[], object]) -> Callable[[], None]:
    """A call of ``fn`` and ``.backward()`` of its output(s) with ones as their gradient: what host-cost tables time
    as "forward + backward"."""

    def run():
        out = fn()
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return run


def host_us(fn: Callable[[], object], *, calls: int = 300, warmup: int = 10, until_done: bool = False) -> float:
    """Microseconds of host time per call: ``calls`` calls issued back to back, the clock stopped before
    waiting for the device. Equal to the per-call cost of the Python/dispatch path whenever the kernels
    are shorter than it (the case these scripts look at); the device is drained before and after.
    ``until_done`` stops the clock after the drain instead: wall time per call, host- or device-bound."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if until_done:
        torch.cuda.synchronize()
    end = time.perf_counter()
    torch.cuda.synchronize()
    return (end - start) / calls * 1e6


@dataclass(frozen=True)
class Ceilings:
    """The machine's measured limits: device-to-device copy (bytes read + written) and a bf16 matmul."""

    copy_gbps: float
    matmul_tflops: float
    device: str

    def as_dict(self) -> dict:
        return {"copy_gbps": self.copy_gbps, "matmul_tflops": self.matmul_tflops, "device": self.device}


def measure_ceilings() -> Ceilings:
    """Copy bandwidth on a 2 GiB buffer and an 8192^3 bf16 matmul on random data (tiny CPU stand-ins in
    smoke mode)."""
    device = "cpu" if SMOKE else "cuda"
    numel = (1 << 20) if SMOKE else (1 << 29)  # fp32: 4 MiB smoke, 2 GiB on the GPU
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src))
    copy_gbps = 2 * src.numel() * src.element_size() / (copy_ms * 1e-3) / 1e9
    src = dst = None  # free 4 GiB before the matmul
    size = 256 if SMOKE else 8192
    dtype = torch.float32 if SMOKE else torch.bfloat16
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    mm_ms = time_ms(lambda: a @ b)
    matmul_tflops = 2 * size**3 / (mm_ms * 1e-3) / 1e12
    name = "CPU (smoke mode)" if SMOKE else torch.cuda.get_device_name()
    return Ceilings(copy_gbps=copy_gbps, matmul_tflops=matmul_tflops, device=name)


@dataclass
class Recorder:
    """Collects one record per (family, provider, point) during a run."""

    ceilings: Ceilings
    records: list[dict] = field(default_factory=list)
    x_keys: dict[str, str] = field(default_factory=dict)

    def add(
        self,
        *,
        family: str,
        provider: str,
        direction: str,
        dtype: torch.dtype | str,
        shape: dict,
        ms: float,
        x_key: str,
        bytes_moved: float | None = None,
        flops: float | None = None,
        tokens: float | None = None,
        host: bool = False,
        extra: dict | None = None,
    ) -> dict:
        """Store a measurement; exactly one of ``bytes_moved`` (GB/s), ``flops`` (TFLOP/s), ``tokens`` (tokens/s,
        a whole model's throughput, with no ceiling) or ``host`` (``ms`` is the host time of one call, recorded as
        ``host_us``: lower is better) is given."""
        if sum(x is not None and x is not False for x in (bytes_moved, flops, tokens, host)) != 1:
            raise ValueError("give exactly one of bytes_moved (memory-bound), flops (compute-bound), tokens "
                             "(a model's throughput) or host (host time per call)")
        if direction not in ("fwd", "bwd", "fwd+bwd"):
            raise ValueError(f"direction must be fwd, bwd or fwd+bwd, got {direction!r}")
        dtype_name = str(dtype).replace("torch.", "")
        record = {"family": family, "provider": provider, "direction": direction, "dtype": dtype_name}
        record.update(shape)
        record["ms"] = ms
        if bytes_moved is not None:
            record["gbps"] = bytes_moved / (ms * 1e-3) / 1e9
            record["ceiling_fraction"] = record["gbps"] / self.ceilings.copy_gbps
        elif tokens is not None:
            record["tokens_per_s"] = tokens / (ms * 1e-3)
        elif host:
            record["host_us"] = ms * 1e3
        else:
            record["tflops"] = flops / (ms * 1e-3) / 1e12
            record["ceiling_fraction"] = record["tflops"] / self.ceilings.matmul_tflops
        if extra:
            record.update(extra)
        self.x_keys[family] = x_key
        self.records.append(record)
        return record


_RECORD_FIXED = ("family", "provider", "direction", "dtype", "ms", "gbps", "tflops", "ceiling_fraction")


def _shape_keys(records: list[dict], extras: set[str]) -> list[str]:
    keys: list[str] = []
    for r in records:
        for k in r:
            if k not in _RECORD_FIXED and k not in extras and k not in keys:
                keys.append(k)
    return keys


def _metric(records: list[dict]) -> str:
    return next(m for m in ("gbps", "tflops", "tokens_per_s", "host_us") if m in records[0])


_UNITS = {"gbps": "GB/s", "tflops": "TFLOP/s", "tokens_per_s": "tokens/s", "host_us": "us of host time per call"}
#: metrics that are times: their ratios are ours' time over the peer's, and the best peer is the fastest
_LOWER_IS_BETTER = {"host_us"}


#: Peers whose ratio gets a column of its own in a family's table (keyed by the family's name, else its name's
#: first word): the peers the family's speed targets are stated against, beside the ratio to the best peer.
RATIO_PEERS: dict[str, tuple[str, ...]] = {
    "attention": ("sdpa-flash", "flex", "sdpa-cudnn"),
    "attention-varlen": ("sdpa-flash-padded", "sdpa-cudnn-padded"),
    "attention-decode": ("sdpa", "flex"),
    "attention-cp": ("torch-cp-flash", "torch-cp-cudnn"),
    "attention-decode-fp8": ("bf16-cache",),
    "attention-decode-ragged": ("uniform",),
    "model": ("torch",),
    "transformers": ("sdpa", "sdpa+liger", "sdpa+gelu-tanh"),
    "host": ("torch",),
}

#: The provider that is ours in a family's table, where it is not named "ours"
OURS_PROVIDER: dict[str, str] = {"transformers": "fused-kernels"}
#: families whose benchmark times its calls otherwise than with CUDA events (the table's header says how)
FAMILY_TIMING: dict[str, str] = {
    "attention-cp": "wall clock between device synchronisations, every rank starting each call together, the "
                    "slowest rank's median",
}


def markdown_table(family: str, records: list[dict], ceilings: Ceilings, extras: Sequence[str] = ()) -> str:
    """One row per point, one column per provider (the metric), ours' ratio to each of the family's
    ``RATIO_PEERS`` present, then ours' ratio to the best peer (any provider not named ``ours*``) and ours'
    fraction of the ceiling."""
    metric = _metric(records)
    unit = _UNITS[metric]
    ours_name = OURS_PROVIDER.get(family, "ours")
    shape_keys = _shape_keys(records, set(extras) | {metric})
    providers: list[str] = []
    for r in records:
        if r["provider"] not in providers:
            providers.append(r["provider"])
    if ours_name in providers:
        providers.remove(ours_name)
        providers.insert(0, ours_name)
    rows: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in records:
        point = (r["direction"], r["dtype"], *(r.get(k) for k in shape_keys))
        rows[point][r["provider"]] = r
    if metric == "gbps":
        ceiling = f"{ceilings.copy_gbps:.0f} GB/s copy"
    else:
        ceiling = f"{ceilings.matmul_tflops:.0f} TFLOP/s bf16 matmul"
    timing = "smoke mode: these timings mean nothing" if SMOKE else FAMILY_TIMING.get(
        family, "CUDA events, median, L2 flushed")
    if metric == "tokens_per_s":  # whole models: their own timing, no ceiling
        ceiling, timing = "none (whole-model throughput)", "CUDA events, median" if not SMOKE else timing
    lower = metric in _LOWER_IS_BETTER
    if lower:  # host time per call: calls issued back to back, the clock stopped before waiting for the device
        ceiling = "none (host time; ratios are ours' time over the peer's, lower is better)"
        timing = "host clock over back-to-back calls, median of interleaved rounds" if not SMOKE else timing
    lines = [
        f"# {family}: {unit} ({ceilings.device})",
        "",
        f"Ceiling measured in the same run: {ceiling}. torch {torch.__version__}, {timing}.",
        "",
    ]
    if any("timing" in r for r in records):
        lines += ["`timing`: host = CUDA events around calls issued from Python (host work counts where it is "
                  "longer than the kernels); device = CUDA-graph replay, inputs cycled past L2 (no host work).", ""]
    named = RATIO_PEERS.get(family, RATIO_PEERS.get(family.split("-")[0], ()))
    ratio_peers = [p for p in named if p in providers]
    # host times stand beside the device time of the same call (CUDA-graph replay)
    beside = [p for p in providers if any(r.get("device_us") is not None for r in records if r["provider"] == p)] \
        if lower else []
    head = ["direction", "dtype", *shape_keys, *providers, *(f"{p} device us" for p in beside),
            *(f"ours / {p}" for p in ratio_peers), "ours / best peer", "ours / ceiling"]
    # parallel runs: ours' efficiency against one device doing the same work (stated by the family's suite)
    efficiency = any("efficiency" in r for r in records if r["provider"] == ours_name)
    if efficiency:
        head.append("ours efficiency")
    if ours_name != "ours":
        head = [h.replace("ours", ours_name) if h.startswith("ours /") else h for h in head]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for point in sorted(rows, key=lambda p: tuple((str(type(v)), v) for v in p)):
        by_provider = rows[point]
        cells = [str(v) for v in point]
        for prov in providers:
            rec = by_provider.get(prov)
            cells.append(f"{rec[metric]:.1f}" if rec else "–")
        for prov in beside:
            rec = by_provider.get(prov)
            cells.append(f"{rec['device_us']:.1f}" if rec and rec.get("device_us") is not None else "–")
        ours = by_provider.get(ours_name)
        for prov in ratio_peers:
            rec = by_provider.get(prov)
            cells.append(f"{ours[metric] / rec[metric]:.3f}x" if ours and rec else "–")
        # Variants of ours (e.g. "ours-full-causal", a reference point) are not peers.
        peers = [rec[metric] for prov, rec in by_provider.items() if not prov.startswith(ours_name)]
        if ours and peers:
            cells.append(f"{ours[metric] / (min(peers) if lower else max(peers)):.2f}x")
        else:
            cells.append("–")
        cells.append(f"{ours['ceiling_fraction']:.0%}" if ours and "ceiling_fraction" in ours else "–")
        if efficiency:
            cells.append(f"{ours['efficiency']:.0%}" if ours and "efficiency" in ours else "–")
        lines.append("| " + " | ".join(cells) + " |")
    extra_keys = [k for k in extras if any(k in r for r in records)]
    if extra_keys:
        lines += ["", "Extras per record are in the JSON: " + ", ".join(extra_keys) + "."]
    return "\n".join(lines) + "\n"


def plot(family: str, records: list[dict], x_key: str, path: Path, extras: Sequence[str] = ()) -> None:
    """The metric against ``x_key`` (log2 axis), one line per provider, one panel per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = _metric(records)
    shape_keys = [k for k in _shape_keys(records, set(extras) | {metric}) if k != x_key]
    panels: dict[tuple, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        panel = (r["direction"], r["dtype"], *(f"{k}={r.get(k)}" for k in shape_keys))
        panels[panel][r["provider"]].append((r[x_key], r[metric]))
    n = len(panels)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (panel, lines) in zip(axes.flat, sorted(panels.items(), key=lambda kv: str(kv[0])), strict=False):
        for provider, points in sorted(lines.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=provider,
                    linewidth=2.5 if provider == OURS_PROVIDER.get(family, "ours") else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_title(" ".join(str(p) for p in panel), fontsize=9)
        ax.set_xlabel(x_key)
        ax.set_ylabel(_UNITS[metric])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"{family}{' (smoke mode: meaningless timings)' if SMOKE else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


#: record keys that are measurements or annotations rather than shape (kept out of tables and panels)
EXTRA_KEYS: tuple[str, ...] = ("saved_bytes_per_element", "peak_extra_mib", "x_key", "tokens_per_s", "loss_last",
                                "peak_mib", "loss", "device_us", "efficiency", "single_gpu_ms", "world", "kv_gbps")


def write_results(recorder: Recorder, out_dir: Path | None = None) -> list[Path]:
    """Write ``<family>.json``, ``<family>.md``, ``<family>.png`` and ``ceilings.json``; return the paths."""
    if not recorder.records:
        return []
    out = out_dir or results_dir()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    by_family: dict[str, list[dict]] = defaultdict(list)
    for r in recorder.records:
        by_family[r["family"]].append(r)
    meta = {
        **recorder.ceilings.as_dict(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "smoke": SMOKE,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        pass
    ceil_path = out / "ceilings.json"
    ceil_path.write_text(json.dumps(meta, indent=2) + "\n")
    written.append(ceil_path)
    for family, records in by_family.items():
        js = out / f"{family}.json"
        js.write_text(json.dumps(records, indent=1) + "\n")
        md = out / f"{family}.md"
        md.write_text(markdown_table(family, records, recorder.ceilings, EXTRA_KEYS))
        png = out / f"{family}.png"
        plot(family, records, recorder.x_keys[family], png, EXTRA_KEYS)
        written += [js, md, png]
    return written
