"""``scripts/``: a short toolkit, each tool listed in its README and runnable with ``--help`` from the
repository root of a fresh checkout (``python3 -m scripts.<name>`` or ``bash scripts/<name>.sh``)."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TOOLS = sorted(p for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py")


def test_scripts_is_a_short_toolkit_and_its_readme_lists_every_tool():
    assert 0 < len(TOOLS) <= 10, [p.name for p in TOOLS]
    readme = (ROOT / "scripts" / "README.md").read_text()
    for tool in TOOLS:
        command = f"bash scripts/{tool.name}" if tool.suffix == ".sh" else f"python3 -m scripts.{tool.stem}"
        assert command in readme, f"scripts/README.md does not list {command}"


@pytest.mark.parametrize("tool", TOOLS, ids=lambda p: p.name)
def test_every_tool_prints_its_usage(tool):
    command = ["bash", str(tool)] if tool.suffix == ".sh" else [sys.executable, "-m", f"scripts.{tool.stem}"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the checkout itself
    done = subprocess.run([*command, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower() or "Knobs" in done.stdout, done.stdout[:500]


def test_ab_kernels_times_peers_beside_the_variants_and_checks_only_the_variants():
    """``--peer`` runs (SDPA backends) join the interleaved rounds under their own names; only the variants' outputs
    are compared with the first variant's (a peer computes the same attention by other means)."""
    import contextlib

    import torch

    from scripts import ab_kernels

    calls = []
    out = torch.ones(3)

    def peer():
        calls.append("peer")
        return (out + 1,)  # would fail the check

    medians = ab_kernels._timed({"this": contextlib.nullcontext}, lambda: (out,), rounds=2, label="t",
                                peers={"sdpa-x": peer})
    assert set(medians) == {"this", "sdpa-x"} and all(ms >= 0 for ms in medians.values())
    assert len(calls) >= 3  # once before the rounds, then once per round


def test_ab_kernels_variants_set_what_they_name_and_restore_it():
    """Each attention variant of ``scripts.ab_kernels`` changes the configuration it names inside its block (path,
    tile fields) and nothing after it."""
    import argparse

    from kernels.attention import configs
    from scripts import ab_kernels

    tiles = ["bwd:128:128,2,split_96=0", "fwd:64:128,2,persistent=1,path=hopper"]
    args = argparse.Namespace(family="attention", baseline="-", hopper_dq=None, path=["portable"], hopper_tile=tiles,
                              tile=[], group_heads=[1])
    before = (configs.path(), configs.HOPPER_BACKWARD[128], configs.HOPPER_FORWARD[64], configs.hopper_tables_version,
              dict(configs.HOPPER_BACKWARD_GROUP_HEADS))
    seen = {}
    for name, variant in ab_kernels._variants(args).items():
        with variant():
            seen[name] = (configs.path(), configs.HOPPER_BACKWARD[128].split_96, configs.HOPPER_FORWARD[64].persistent,
                          dict(configs.HOPPER_BACKWARD_GROUP_HEADS))
    heads = before[4]
    assert seen == {
        "this": (before[0], True, False, heads),
        "path:portable": ("portable", True, False, heads),
        "group-heads:1": (before[0], True, False, {"causal": 1, "full": 1}),
        "bwd:128:128,2,split_96=0": (before[0], False, False, heads),
        "fwd:64:128,2,persistent=1,path=hopper": ("hopper", True, True, heads),
    }
    assert (configs.path(), configs.HOPPER_BACKWARD[128], configs.HOPPER_FORWARD[64],
            configs.hopper_tables_version, configs.HOPPER_BACKWARD_GROUP_HEADS) == before


def test_sweep_attention_decode_plan_changes_set_the_fields_they_name():
    """``--decode-plans`` entries of ``scripts.sweep_attention``: ``field=N`` sets a field of the table's
    ``DecodePlan`` (as its type), ``splits*N`` and ``splits/N`` scale the split count, never below 1."""
    from kernels.attention import configs
    from scripts import sweep_attention

    table = configs.DecodePlan(16, 128, 4, 3, 5)
    assert sweep_attention._decode_plan_change("num_warps=8,block_n=64")(table) == table._replace(num_warps=8,
                                                                                                   block_n=64)
    assert sweep_attention._decode_plan_change("splits*2")(table).splits == 10
    assert sweep_attention._decode_plan_change("splits/2")(table).splits == 2
    assert sweep_attention._decode_plan_change("splits/8")(table).splits == 1
    assert sweep_attention._decode_plan_change("balanced=1")(table).balanced is True


def test_sweep_attention_decode_output_check_measures_each_variant_against_the_first():
    """``scripts.sweep_attention`` checks every decode variant's output against the table plan's before timing it:
    equal outputs give 0, a shifted one its shift over max(1, max |reference|), NaN an infinite gap, a variant that
    raises no entry; a real decode step under twice the splits stays within the tolerance."""
    from benchmarks import bench_attention
    from kernels.attention import configs
    from scripts import sweep_attention

    shift = {"by": 0.0}

    @contextlib.contextmanager
    def shifted(by):
        shift["by"] = by
        try:
            yield
        finally:
            shift["by"] = 0.0

    def fails():
        raise RuntimeError("does not fit")

    reference = torch.linspace(-3.0, 3.0, 64)
    gaps = sweep_attention._decode_output_gaps(
        lambda: reference + shift["by"],
        {"table": contextlib.nullcontext, "same": contextlib.nullcontext, "off": functools.partial(shifted, 0.3),
         "nan": functools.partial(shifted, math.nan), "fails": fails})
    assert gaps["table"] == gaps["same"] == 0.0
    assert gaps["off"] == pytest.approx(0.1) and gaps["off"] > sweep_attention.DECODE_OUTPUT_TOLERANCE
    assert gaps["nan"] == math.inf and "fails" not in gaps

    call, _ = bench_attention._decode_call("ours", 1, 4, 2, 256, 16, torch.float32, False)
    split = configs.decode_plan(1, 2, 2, 16, torch.float32, 256, False, 4).splits
    gaps = sweep_attention._decode_output_gaps(call, {
        "table": contextlib.nullcontext,
        "splits*2": functools.partial(configs.override_decode, lambda plan: plan._replace(splits=2 * split))})
    assert gaps["splits*2"] <= sweep_attention.DECODE_OUTPUT_TOLERANCE


def test_decode_kernels_from_swaps_in_a_baseline_and_restores_this_checkouts():
    """``kvcache.kernels_from`` (``scripts.sweep_attention --decode-baseline``): inside the block the KV-cache calls
    launch the given module's kernels, also when the block is left by an exception; after it, this checkout's."""
    from kernels.attention import _decode, kvcache
    from scripts.ab_kernels import load_kernels_file

    baseline = load_kernels_file(_decode.__file__, "baseline_decode_kernels")
    ours = (kvcache._kvcache_append_kernel, kvcache._kvcache_attn_kernel)
    assert ours == (_decode._kvcache_append_kernel, _decode._kvcache_attn_kernel)
    with pytest.raises(RuntimeError), kvcache.kernels_from(baseline):
        assert kvcache._kvcache_attn_kernel is baseline._kvcache_attn_kernel is not ours[1]
        assert kvcache._kvcache_append_kernel is baseline._kvcache_append_kernel is not ours[0]
        raise RuntimeError
    assert (kvcache._kvcache_append_kernel, kvcache._kvcache_attn_kernel) == ours


@pytest.mark.parametrize("split", [["--group-heads", "8"], ["--group-heads", "1", "--decode-plan", "block_n=64"]],
                         ids=["whole-groups", "split-groups-another-decode-plan"])
def test_hopper_offline_compiles_the_gluon_kernels_without_a_gpu(split):
    """``scripts.hopper_offline`` compiles the Hopper forward and backward for sm_90 with a stand-in driver and
    reports ptxas's registers and spill bytes for each, in a process of its own (the Gluon kernels do not run
    under the interpreter, which this suite may have on); the backward with whole GQA groups per program and with
    each group split over programs; the decode kernel with the table's plan and with fields of it set
    (``--decode-plan``)."""
    unset = ("PYTHONPATH", "TRITON_INTERPRET", "FUSED_KERNELS_TEST_MODE")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    done = subprocess.run([sys.executable, "-m", "scripts.hopper_offline", "--dims", "64", "--causal", "--kernels",
                           "fwd,bwd,decode", "--sass", *split], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    kernels, histograms = lines[0::2], lines[1::2]
    expected = ["_attn_fwd_hopper_kernel", "_attn_bwd_hopper_kernel", "_kvcache_attn_kernel[bfloat16",
                "_kvcache_attn_kernel[float8_e4m3fn"]
    assert [line.split()[0] for line in kernels] == expected, lines
    for line in kernels:
        assert re.search(r"Used \d+ registers", line) and re.search(r"\d+ bytes spill stores", line), line
    for line in histograms:
        assert re.match(r"\s+\d+ instructions: [A-Z]", line), line
