"""Merge the records of several benchmark runs of one family into one committed result.

    python3 scripts/merge_bench_runs.py OUT_DIR FAMILY run1/family.json:run1/ceilings.json run2/... [--drop P@run]

Records of a later run replace those of an earlier one at the same (provider, direction, dtype, shape).
``--drop provider@index`` leaves one provider of one run out (a measurement known to be broken).
Every record keeps the ceiling fraction of its own run; the markdown header names each run's ceilings.
Used when one device call cannot hold a family's whole benchmark (the device's 10-minute limit).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import benchmarks._harness as harness
from benchmarks._harness import EXTRA_KEYS, Ceilings, markdown_table, plot


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("family")
    parser.add_argument("runs", nargs="+", help="records.json:ceilings.json")
    parser.add_argument("--drop", action="append", default=[], help="provider@run-index (0-based)")
    parser.add_argument("--plot-ignore", nargs="*", default=[], help="shape keys left out of the plot panels")
    parser.add_argument("--x-key", default="S", help="the plots' x axis when the records do not name it")
    args = parser.parse_args()
    drops = {(p, int(i)) for p, i in (d.split("@") for d in args.drop)}
    merged: dict[tuple, dict] = {}
    headers = []
    ceilings = None
    x_key = args.x_key
    for index, run in enumerate(args.runs):
        records_path, ceilings_path = run.split(":")
        meta = json.loads(Path(ceilings_path).read_text())
        ceilings = Ceilings(meta["copy_gbps"], meta["matmul_tflops"], meta["device"])
        headers.append(f"run {index} ({meta['date']}): copy {meta['copy_gbps']:.0f} GB/s, "
                       f"bf16 matmul {meta['matmul_tflops']:.0f} TFLOP/s")
        for r in json.loads(Path(records_path).read_text()):
            if (r["provider"], index) in drops:
                continue
            x_key = r.get("x_key", x_key)
            key = tuple(sorted((k, str(v)) for k, v in r.items() if k not in ("ms", "gbps", "tflops",
                                                                              "ceiling_fraction")))
            merged[key] = {**r, "run": index}
    records = list(merged.values())
    harness.SMOKE = False  # the records come from GPU runs, whatever machine merges them
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.family}.json").write_text(json.dumps(records, indent=1) + "\n")
    table = markdown_table(args.family, records, ceilings, (*EXTRA_KEYS, "run"))
    lines = table.split("\n")
    lines[2] = (f"Ceilings: each run's, listed below. torch {meta['torch']}, Triton {meta.get('triton', '?')}, "
                "CUDA events, median, L2 flushed.")
    table = "\n".join(lines)
    note = "Merged from several runs on this machine (each record's `run` is in the JSON):\n" + "".join(
        f"- {h}\n" for h in headers)
    (args.out_dir / f"{args.family}.md").write_text(table + "\n" + note)
    # Shape keys that move with x (attention keeps B * S fixed) would split every line into single points.
    plot(args.family, records, x_key, args.out_dir / f"{args.family}.png", (*EXTRA_KEYS, "run", *args.plot_ignore))


if __name__ == "__main__":
    main()
