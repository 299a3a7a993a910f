#!/usr/bin/env bash
# One call on the GPU machine: environment report, the CUDA test suite, the benchmarks.
#
#   bash scripts/gpu_check.sh [family ...]      # family: dropout | layernorm | attention (default: all);
#                                               # any name N selects tests/test_N*.py (integration, gpt, swap, common)
#
# Uses the machine's own python3 (no network, no nox). Writes under $OUT (default ./gpu-out):
#   env.txt, tests.log (summaries), tests_all.log (every shard's output), bench.log, results.tgz (benchmarks/results/<gpu>/ of this run), summary.md
# Knobs: EXAMPLE=1 (then the GPT example's step times, eager and compiled, both backends: gpt-*.txt), SHARDS=16 (test processes; the attention suite took 540 s with 15 on the H200, near the 600 s limit of one device call), SKIP_TESTS=1, SKIP_BENCH=1, TEST_ARGS="...", BENCH_ARGS="..." (extra pytest args).
# Exit status: non-zero when the tests or the benchmarks failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
FAMILIES=("$@")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export FUSED_KERNELS_RESULTS_DIR="$OUT/results"

# Peers carried as wheels (the GPU machine has no network): `.whl/` is git-ignored and passed with
# `carry`; see the README of the device tool. Installed into a private folder, never over the image.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fk-site .whl/*.whl \
    && export PYTHONPATH="/tmp/fk-site${PYTHONPATH:+:$PYTHONPATH}"
fi

tests_target=$(ls tests/test_*.py | tr '\n' ' ')
bench_target=benchmarks
if [ ${#FAMILIES[@]} -gt 0 ]; then
  tests_target="" bench_target=""
  for family in "${FAMILIES[@]}"; do
    tests_target+=$(ls tests/test_"$family"*.py 2>/dev/null | tr '\n' ' ')
    bench_target+=$(ls benchmarks/bench_"$family"*.py 2>/dev/null | tr '\n' ' ')
  done
fi

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton, platform; print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__, "gpu", torch.cuda.get_device_name())'
  python3 -c 'import apex; print("apex", getattr(apex, "__version__", "importable"))' 2>&1 | tail -n 1
  python3 -c 'import liger_kernel, importlib.metadata as m; print("liger-kernel", m.version("liger-kernel"))' 2>&1 | tail -n 1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # Shards run side by side (compiling is CPU-bound, the machine has 16 cores): SHARDS processes, each
  # taking every SHARDS-th collected test (FK_TEST_SHARD, see tests/conftest.py). tests.log gathers the
  # summaries.
  start=$(date +%s)
  shards=${SHARDS:-16}
  pids=()
  for ((i = 0; i < shards; i++)); do
    # shellcheck disable=SC2086
    FK_TEST_SHARD="$i/$shards" python3 -m pytest $tests_target -q -p no:cacheprovider ${TEST_ARGS:-} \
      > "$OUT/tests-$i.log" 2>&1 &
    pids+=($!)
  done
  : > "$OUT/tests.log"
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    rc=$?
    { echo "== shard $i/$shards: exit $rc"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests-$i.log" | tail -n 20; } \
      | tee -a "$OUT/tests.log"
    [ "$rc" = 0 ] || [ "$rc" = 5 ] || status=1  # 5: nothing collected (no bf16 under the interpreter)
  done
  echo "tests: $([ $status = 0 ] && echo ok || echo FAILED) in $(( $(date +%s) - start )) s" | tee -a "$OUT/tests.log"
  cat "$OUT"/tests-*.log > "$OUT/tests_all.log" && rm -f "$OUT"/tests-*.log  # the device returns 8 files at most
fi

if [ "${SKIP_BENCH:-0}" != 1 ] && [ -n "$bench_target" ]; then
  start=$(date +%s)
  # shellcheck disable=SC2086
  python3 -m pytest $bench_target -q -p no:cacheprovider --benchmark-columns=median ${BENCH_ARGS:-} 2>&1 \
    > "$OUT/bench.log"
  rc=$?
  tail -n 30 "$OUT/bench.log"
  echo "benchmarks: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
  [ "$rc" = 0 ] || status=1
  if [ -d "$OUT/results" ]; then
    tar czf "$OUT/results.tgz" -C "$OUT/results" .
    cat "$OUT"/results/*/*.md > "$OUT/summary.md" 2>/dev/null
    rm -rf "$OUT/results"
    cat "$OUT/summary.md"
  fi
fi
if [ "${EXAMPLE:-0}" = 1 ]; then
  # The example trains each backend in turn; nothing else runs beside it, so the step times are clean.
  for mode in eager compiled; do
    flag=$([ $mode = compiled ] && echo --compile)
    # shellcheck disable=SC2086
    python3 examples/gpt.py --steps "${EXAMPLE_STEPS:-200}" $flag > "$OUT/gpt-$mode.txt" 2> "$OUT/gpt-$mode.log"
    rc=$?
    tr '\r' '\n' < "$OUT/gpt-$mode.log" | grep -v '^ *$' > "$OUT/gpt-$mode.progress" && rm -f "$OUT/gpt-$mode.log"
    echo "== GPT example ($mode): exit $rc"; cat "$OUT/gpt-$mode.txt"
    [ "$rc" = 0 ] || status=1
  done
fi
exit $status
