#!/usr/bin/env bash
# One run on a GPU machine: environment report, the CUDA test suite, the benchmarks.
#
#   bash scripts/gpu_check.sh [family ...]      # family: dropout | layernorm | attention | host | model |
#                                               # transformers | context_parallel (default: all but model and
#                                               # transformers, the training benchmarks, and context_parallel, minutes
#                                               # on every GPU of the host, which run when named);
#                                               # any name N selects tests/test_N*.py (integration, gpt, swap, common),
#                                               # N.py that one file (attention.py: tests/test_attention.py alone)
#
# Uses the machine's own python3 (no network, no nox). Writes under $OUT (default ./gpu-out):
#   env.txt, tests.log (summaries), tests_all.log (every shard's output), bench.log, results.tgz (benchmarks/results/<gpu>/ of this run), summary.md
# Knobs: EXAMPLE=1 (then the GPT example's step times, eager and compiled, both backends: gpt-*.txt),
#   SHARDS=16 (test processes side by side; tests marked big_memory run alone after them, with the first
#   range), SHARD_RANGE=a:b (run only shards a..b-1 of SHARDS, to split a long suite over several runs:
#   the attention suite takes 8-10 minutes on 16 shards), FK_TEST_FROM=k (skip the first k collected tests:
#   resume a suite that a limit cut; TEST_ARGS=-vv, over the script's -q, names each test in tests_all.log),
#   SKIP_TESTS=1, SHARD_TIMEOUT=seconds (each shard's limit, default 3000: a shard past it is killed and reported
#   with its threads' stacks, so one stuck test does not hold the run; a test running over FAULTHANDLER_TIMEOUT,
#   default 300 s, prints its stack into tests_all.log), SKIP_BENCH=1, TEST_ARGS="...", BENCH_ARGS="..." (extra
#   pytest args, split on spaces: a -k expression with spaces goes in PYTEST_ADDOPTS="-k 'a or b'" instead).
#   FUSED_KERNELS_ATTENTION_PATH=hopper
#   or =portable runs every attention call on that kernel path (default auto: see kernels/attention/README.md).
# Exit status: non-zero when the tests or the benchmarks failed.
set -uo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
FAMILIES=("$@")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export FUSED_KERNELS_RESULTS_DIR="$OUT/results"

# Peers that are not installed on a GPU machine without network (Liger) come as wheels in the git-ignored
# `.whl/` folder; they go into a private folder, never over the machine's own packages.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fk-site .whl/*.whl \
    && export PYTHONPATH="/tmp/fk-site${PYTHONPATH:+:$PYTHONPATH}"
fi

tests_target=$(ls tests/test_*.py | tr '\n' ' ')
# The model benchmarks (dozens of training runs, compiled ones included) and context parallelism (sequences to 512k
# on every GPU) run only when named: gpu_check.sh model, gpu_check.sh transformers, gpu_check.sh context_parallel
bench_target=$(ls benchmarks/bench_*.py | grep -v -e bench_model -e bench_transformers -e bench_context_parallel \
  | tr '\n' ' ')
if [ ${#FAMILIES[@]} -gt 0 ]; then
  tests_target="" bench_target=""
  for family in "${FAMILIES[@]}"; do
    pattern=$([[ $family == *.py ]] && echo "$family" || echo "$family*.py")  # attention.py: that one file
    tests_target+=$(compgen -G "tests/test_$pattern" | sort | tr '\n' ' ')
    bench_target+=$(compgen -G "benchmarks/bench_$pattern" | sort | tr '\n' ' ')
  done
  if [ -z "$tests_target$bench_target" ]; then
    echo "gpu_check.sh: no tests/test_NAME*.py or benchmarks/bench_NAME*.py matches: ${FAMILIES[*]}" >&2
    exit 2
  fi
fi

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton, platform; print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__, "gpu", torch.cuda.get_device_name())'
  python3 -c 'import apex; print("apex", getattr(apex, "__version__", "importable"))' 2>&1 | tail -n 1
  python3 -c 'import liger_kernel, importlib.metadata as m; print("liger-kernel", m.version("liger-kernel"))' 2>&1 | tail -n 1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
# named files without tests (host, model) run no tests: pytest given no file would run the whole suite
if [ "${SKIP_TESTS:-0}" != 1 ] && { [ ${#FAMILIES[@]} = 0 ] || [ -n "$tests_target" ]; }; then
  # Shards run side by side (compiling is CPU-bound, the machine has 16 cores): SHARDS processes, each
  # taking every SHARDS-th collected test (FK_TEST_SHARD, see tests/conftest.py). tests.log gathers the
  # summaries.
  start=$(date +%s)
  shards=${SHARDS:-16}
  range=${SHARD_RANGE:-0:$shards}
  first=${range%%:*} last=${range##*:}
  logs=$(mktemp -d)  # shard logs stay out of $OUT until gathered into one file
  pids=() ids=()
  for ((i = first; i < last; i++)); do
    # shellcheck disable=SC2086
    FK_TEST_SHARD="$i/$shards" FK_STACKS_FILE="$logs/stacks-$i.txt" timeout "${SHARD_TIMEOUT:-3000}" python3 -m pytest $tests_target -q -p no:cacheprovider \
      -m "not big_memory" -o faulthandler_timeout="${FAULTHANDLER_TIMEOUT:-300}" ${TEST_ARGS:-} \
      > "$logs/tests-$i.log" 2>&1 &
    pids+=($!) ids+=("$i")
  done
  : > "$OUT/tests.log"
  for j in "${!pids[@]}"; do
    wait "${pids[$j]}"
    rc=$?
    i=${ids[$j]}
    { echo "== shard $i/$shards: exit $rc$([ "$rc" = 124 ] && echo ' (killed at SHARD_TIMEOUT)')"; grep -E "^(FAILED|ERROR)|^E   |passed|failed" "$logs/tests-$i.log" | tail -n 30
      # a killed shard's threads, as they were when it was killed (tests/conftest.py writes them on SIGTERM)
      [ "$rc" = 124 ] && [ -s "$logs/stacks-$i.txt" ] && { echo "-- its stacks when killed:"; head -n 80 "$logs/stacks-$i.txt"; }; } \
      | tee -a "$OUT/tests.log"
    [ "$rc" = 0 ] || [ "$rc" = 5 ] || status=1  # 5: nothing collected (no bf16 under the interpreter)
  done
  if [ "$first" = 0 ]; then  # tests that need many GB each, one at a time (side by side they exhaust an 80 GB GPU)
    # shellcheck disable=SC2086
    python3 -m pytest $tests_target -q -p no:cacheprovider -m big_memory ${TEST_ARGS:-} > "$logs/tests-big.log" 2>&1
    rc=$?
    { echo "== big_memory tests: exit $rc"; grep -E "^(FAILED|ERROR)|^E   |passed|failed" "$logs/tests-big.log" | tail -n 30; } \
      | tee -a "$OUT/tests.log"
    [ "$rc" = 0 ] || [ "$rc" = 5 ] || status=1
  fi
  echo "tests: $([ $status = 0 ] && echo ok || echo FAILED) in $(( $(date +%s) - start )) s" | tee -a "$OUT/tests.log"
  cat "$logs"/tests-*.log > "$OUT/tests_all.log"
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
