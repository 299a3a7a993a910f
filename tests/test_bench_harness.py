"""Tests of the benchmark harness's arithmetic and result files (no GPU needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._harness import EXTRA_KEYS, Ceilings, Recorder, markdown_table, write_results


def _recorder() -> Recorder:
    rec = Recorder(ceilings=Ceilings(copy_gbps=1000.0, matmul_tflops=500.0, device="test-gpu"))
    for provider, ms in (("ours", 1.0), ("torch", 2.0), ("torch.compile", 4.0)):
        for n in (1024, 4096):
            rec.add(family="toy", provider=provider, direction="fwd", dtype="float16", shape={"n": n},
                    ms=ms, x_key="n", bytes_moved=1e9, extra={"saved_bytes_per_element": 0})
    return rec


def test_recorder_computes_rates_and_ceiling_fractions():
    rec = _recorder()
    ours = rec.records[0]
    assert ours["gbps"] == pytest.approx(1000.0)
    assert ours["ceiling_fraction"] == pytest.approx(1.0)
    assert rec.records[2]["gbps"] == pytest.approx(500.0)
    flop_rec = rec.add(family="mm", provider="ours", direction="bwd", dtype="bfloat16", shape={"s": 1},
                       ms=2.0, x_key="s", flops=5e11)
    assert flop_rec["tflops"] == pytest.approx(250.0)
    assert flop_rec["ceiling_fraction"] == pytest.approx(0.5)


def test_recorder_refuses_ambiguous_records():
    rec = _recorder()
    with pytest.raises(ValueError, match="exactly one"):
        rec.add(family="x", provider="ours", direction="fwd", dtype="float16", shape={}, ms=1.0, x_key="n")
    with pytest.raises(ValueError, match="direction"):
        rec.add(family="x", provider="ours", direction="sideways", dtype="float16", shape={}, ms=1.0,
                x_key="n", flops=1.0)


def test_markdown_table_has_one_row_per_point_and_ratio_to_best_peer():
    rec = _recorder()
    table = markdown_table("toy", rec.records, rec.ceilings, extras=("saved_bytes_per_element",))
    lines = [line for line in table.splitlines() if line.startswith("| fwd")]
    assert len(lines) == 2
    header = next(line for line in table.splitlines() if line.startswith("| direction"))
    assert header.split(" | ")[3:6] == ["ours", "torch", "torch.compile"]
    # ours 1000 GB/s, best peer (torch) 500 GB/s
    assert "| 2.00x | 100% |" in lines[0]
    assert "saved_bytes_per_element" not in header


def test_markdown_table_has_a_ratio_column_for_each_named_peer(monkeypatch):
    import benchmarks._harness as harness

    rec = _recorder()
    monkeypatch.setitem(harness.RATIO_PEERS, "toy", ("torch.compile", "absent-peer"))
    table = markdown_table("toy-variant", rec.records, rec.ceilings, extras=("saved_bytes_per_element",))
    header = next(line for line in table.splitlines() if line.startswith("| direction"))
    assert header.split(" | ")[6:8] == ["ours / torch.compile", "ours / best peer"]  # no column for absent peers
    # ours 1000 GB/s, torch.compile 250 GB/s, best peer (torch) 500 GB/s
    assert "| 4.000x | 2.00x | 100% |" in next(line for line in table.splitlines() if line.startswith("| fwd"))


def test_a_family_timed_otherwise_says_so_in_its_header(monkeypatch):
    import benchmarks._harness as harness

    rec = _recorder()
    monkeypatch.setattr(harness, "SMOKE", False)
    monkeypatch.setitem(harness.FAMILY_TIMING, "toy", "wall clock, slowest rank")
    assert "wall clock, slowest rank." in markdown_table("toy", rec.records, rec.ceilings)
    assert "CUDA events, median, L2 flushed." in markdown_table("other", rec.records, rec.ceilings)


def test_a_family_of_its_own_in_ratio_peers_overrides_its_first_word(monkeypatch):
    import benchmarks._harness as harness

    rec = _recorder()
    monkeypatch.setitem(harness.RATIO_PEERS, "toy", ("torch.compile",))
    monkeypatch.setitem(harness.RATIO_PEERS, "toy-variant", ("torch",))
    table = markdown_table("toy-variant", rec.records, rec.ceilings, extras=("saved_bytes_per_element",))
    header = next(line for line in table.splitlines() if line.startswith("| direction"))
    assert header.split(" | ")[6:8] == ["ours / torch", "ours / best peer"]


def test_write_results_writes_json_markdown_plot_and_ceilings(tmp_path):
    rec = _recorder()
    paths = write_results(rec, out_dir=tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["ceilings.json", "toy.json", "toy.md", "toy.png"]
    records = json.loads((tmp_path / "toy.json").read_text())
    assert len(records) == 6
    assert {"family", "provider", "direction", "dtype", "n", "ms", "gbps", "ceiling_fraction"} <= set(records[0])
    assert (tmp_path / "toy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = json.loads((tmp_path / "ceilings.json").read_text())
    assert meta["copy_gbps"] == 1000.0


def test_host_and_device_timings_of_one_point_are_separate_rows_with_their_meaning_stated():
    rec = Recorder(ceilings=Ceilings(copy_gbps=1000.0, matmul_tflops=500.0, device="test-gpu"))
    for timing, ms in (("host", 2.0), ("device", 1.0)):
        rec.add(family="toy", provider="ours", direction="fwd", dtype="float16", shape={"timing": timing, "n": 8},
                ms=ms, x_key="n", bytes_moved=1e9)
    table = markdown_table("toy", rec.records, rec.ceilings)
    rows = [line for line in table.splitlines() if line.startswith("| fwd")]
    assert [row.split(" | ")[2] for row in rows] == ["device", "host"]
    assert "CUDA-graph replay" in table


def test_graph_ms_times_separate_instances_of_the_work():
    import benchmarks._harness as harness

    built, calls = [], []

    def make_run():
        built.append(len(built))
        index = built[-1]
        return lambda: calls.append(index)

    if harness.SMOKE:
        touched, expected = 1.0, 2
    else:  # instances enough to touch twice the L2 cache
        import torch

        touched, expected = torch.cuda.get_device_properties(0).L2_cache_size / 2, 4
    ms = harness.graph_ms(make_run, touched_bytes=touched)
    assert ms >= 0.0
    assert len(built) == expected and set(calls) == set(built)


def test_the_bench_suite_chooses_the_test_mode_before_anything_imports_triton():
    """``nox -s bench`` on a machine without a GPU runs pytest over ``benchmarks/`` without ``TRITON_INTERPRET`` set:
    the suite's first import must be ``kernels._mode``, which switches the interpreter on before triton loads (an
    import of torch._dynamo, say, loads triton). Collected in a fresh process, in interpreter mode."""
    env = {name: value for name, value in os.environ.items() if name not in ("TRITON_INTERPRET", "FK_TEST_SHARD")}
    env["FUSED_KERNELS_TEST_MODE"] = "interpreter"
    done = subprocess.run([sys.executable, "-m", "pytest", "benchmarks", "--collect-only", "-q", "-p",
                           "no:cacheprovider"], cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "triton was imported before the test mode was chosen" not in done.stdout + done.stderr


def test_host_times_are_ratios_of_times_with_the_device_time_beside():
    rec = Recorder(ceilings=Ceilings(copy_gbps=3000.0, matmul_tflops=800.0, device="GPU"))
    for provider, host, device in (("ours", 30.0, 5.0), ("torch", 20.0, 6.0)):
        rec.add(family="host", provider=provider, direction="fwd", dtype="bfloat16",
                shape={"op": "layer_norm", "size": "tiny", "elements": 8}, ms=host * 1e-3, x_key="elements",
                host=True, extra={"device_us": device})
    assert rec.records[0]["host_us"] == pytest.approx(30.0)
    table = markdown_table("host", rec.records, rec.ceilings, EXTRA_KEYS)
    row = next(line for line in table.splitlines() if "layer_norm" in line)
    # ours' time over torch's (lower is better), the best peer the fastest; the device times beside
    assert "| 30.0 | 20.0 | 5.0 | 6.0 | 1.500x | 1.50x |" in row
    with pytest.raises(ValueError, match="exactly one"):
        rec.add(family="host", provider="ours", direction="fwd", dtype="bfloat16", shape={}, ms=1.0, x_key="x",
                host=True, tokens=1.0)
