"""Benchmark fixtures: the ceilings (measured once per run), the recorder, and ``measure``, which times
one provider at one point and records it; the result files are written when the run ends.

Run on a GPU: ``python3 -m pytest benchmarks`` (or ``nox -s bench``). Without a GPU the same suites run
in smoke mode (see ``benchmarks/_harness.py``).
"""

from __future__ import annotations

import kernels._mode  # noqa: F401  (first: chooses CUDA or the interpreter before anything imports triton)

# isort: split

import statistics

import pytest
import torch._dynamo  # imports triton

import kernels._native as native_tier
from benchmarks import _harness

_STATE: dict = {}

# A peer compiled with torch.compile(dynamic=False) recompiles for every shape of a sweep, and dynamo
# keeps at most `recompile_limit` (8) versions per function: past it, the function silently runs eager,
# and the "torch.compile" column would time eager torch. Every sweep stays far below this limit.
torch._dynamo.config.recompile_limit = 1024
torch._dynamo.config.accumulated_recompile_limit = 1 << 16


def pytest_sessionstart(session):
    native_tier.prepare()  # with FUSED_KERNELS_NATIVE=1, built before the first call rather than beside it


def pytest_report_header(config):
    if _harness.SMOKE:
        return "fused-kernels benchmarks: SMOKE MODE (no GPU): interpreter, tiny shapes, timings mean nothing"
    return "fused-kernels benchmarks: CUDA events via triton.testing.do_bench (median, L2 flushed)"


@pytest.fixture(scope="session")
def ceilings() -> _harness.Ceilings:
    """Copy bandwidth and bf16 matmul rate of this machine, measured once in this run."""
    return _harness.measure_ceilings()


@pytest.fixture(scope="session")
def recorder(ceilings) -> _harness.Recorder:
    rec = _harness.Recorder(ceilings=ceilings)
    _STATE["recorder"] = rec
    return rec


@pytest.fixture
def measure(benchmark, recorder):
    """``measure(fn, family=, provider=, direction=, dtype=, shape=, x_key=, bytes_moved= | flops=, ...)``

    Times ``fn`` with :func:`benchmarks._harness.time_ms` inside pytest-benchmark's ``pedantic`` (one
    round: pytest-benchmark's own wall-clock column is the cost of measuring, not the kernel), stores the
    record and copies it into ``benchmark.extra_info``. Returns the record.
    """

    def _measure(fn, *, grad_to_none=None, **record_fields):
        benchmark.group = " ".join(
            str(record_fields[k]).replace("torch.", "") for k in ("family", "direction", "dtype")
        )
        ms = benchmark.pedantic(lambda: _harness.time_ms(fn, grad_to_none=grad_to_none), rounds=1, iterations=1)
        record = recorder.add(ms=ms, **record_fields)
        benchmark.extra_info.update(record)
        return record

    return _measure


@pytest.fixture
def measure_interleaved(benchmark, recorder):
    """``measure_interleaved({provider: (fn, grad_to_none)}, rounds=, **record_fields)``

    Times every provider of one point ``rounds`` times, alternating (round 1: each provider once, round 2:
    again, ...), and records each provider's median. A GPU's speed drifts by several percent over a run; timing
    the peers of a point side by side keeps that drift out of their ratios. Returns the records.
    """

    def _measure(runners: dict, *, rounds: int, **record_fields):
        benchmark.group = " ".join(
            str(record_fields[k]).replace("torch.", "") for k in ("family", "direction", "dtype")
        )
        times = {provider: [] for provider in runners}

        def one_sweep():
            for _ in range(rounds):
                for provider, (fn, grad_to_none) in runners.items():
                    times[provider].append(_harness.time_ms(fn, grad_to_none=grad_to_none))

        benchmark.pedantic(one_sweep, rounds=1, iterations=1)
        records = []
        for provider, runs in times.items():
            record = recorder.add(ms=statistics.median(runs), provider=provider, **record_fields)
            benchmark.extra_info[provider] = record
            records.append(record)
        return records

    return _measure


def pytest_sessionfinish(session, exitstatus):
    rec = _STATE.get("recorder")
    if rec is not None:
        _STATE["written"] = _harness.write_results(rec)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    written = _STATE.get("written") or []
    if written:
        terminalreporter.write_sep("-", f"benchmark results written under {written[0].parent}")
        for path in written:
            terminalreporter.write_line(f"  {path.name}")
    if _harness.SMOKE:
        terminalreporter.write_sep(
            "!", "SMOKE MODE: no GPU; kernels ran in the Triton interpreter on tiny shapes. These timings mean nothing."
        )
