#!/usr/bin/env bash
# compute-sanitizer over a slice of each family's CUDA tests, on a GPU machine.
#
#   OUT=/some/dir bash scripts/sanitize.sh [memcheck|racecheck ...]     # default: memcheck racecheck
#
# The slices take the tests with odd sizes (S not a multiple of the block, N not a power of two, strided
# views, empty and width-one rows), both backward paths of the norms, and for attention every loop edge
# at small blocks plus the production launch tables at odd lengths (head dims up to 192, packed
# batches); the slowest cases (head dims >= 512, fp32 packed batches, 100-run repeats) are left out so
# that each run ends within about ten minutes under the sanitizer. Each (tool, family) slice is
# split into shards (FK_TEST_SHARD, see tests/conftest.py) that run as processes side by side, so that
# the slowest one ends within about ten minutes. Writes $OUT/sanitize.txt (each run's "passed" and
# "SUMMARY" lines) and $OUT/sanitize-logs.txt (the head and tail of every run). Knobs: SANITIZE_TIMEOUT (seconds
# per run, default 540), FAMILIES (default "dropout layernorm attention kvcache"), SHARDS_<family>_<tool>
# (shards of one slice; defaults below), RUNS (only these runs, named <tool>-<family>-<shard>, e.g.
# "racecheck-layernorm-0 memcheck-attention-2"; default: every shard), SANITIZE_ARGS (extra
# compute-sanitizer options, e.g. "--racecheck-report hazard --print-limit 20" for the values each
# racing thread wrote).
set -uo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck)
read -r -a families <<< "${FAMILIES:-dropout layernorm attention kvcache}"

declare -A slice=(
  [dropout]="tests/test_dropout.py -k kernel_equals_twin or gradient_is_the_regenerated or non_contiguous or inplace or empty"
  [layernorm]="tests/test_layernorm.py -k kernel_equals_twin or width_one or non_contiguous or empty_batch or (lock_mode and 4096-512) or (deterministic_mode and 4096-1024)"
  [kvcache]="tests/test_attention_kvcache.py -k contiguous_cache or paged_cache or split_counts or strided or clamped"
  [attention]="tests/test_attention.py -k block_boundaries or rows_that_see_no_key or dropout_mask_equals or (head_dims_that_are_not and not 512 and not 1000 and not 1024) or (varlen_equals and float16 and not bfloat16)"
)
# racecheck instruments every shared-memory access and runs several times slower than memcheck
declare -A default_shards=(
  [dropout_memcheck]=1 [layernorm_memcheck]=1 [attention_memcheck]=3
  [dropout_racecheck]=2 [layernorm_racecheck]=2 [attention_racecheck]=4
)

pids=() logs=()
for tool in "${tools[@]}"; do
  for family in "${families[@]}"; do
    read -r file k_flag expr <<< "${slice[$family]}"
    var="SHARDS_${family}_${tool}"
    shards=${!var:-${default_shards[${family}_${tool}]:-1}}
    for ((i = 0; i < shards; i++)); do
      name="$tool-$family-$i"
      [ -z "${RUNS:-}" ] || [[ " $RUNS " == *" $name "* ]] || continue
      log="$OUT/sanitize-$name.log"
      logs+=("$log")
      (
        FK_TEST_SHARD="$i/$shards" timeout "${SANITIZE_TIMEOUT:-540}" \
          compute-sanitizer --tool "$tool" --target-processes all ${SANITIZE_ARGS:-} \
          python3 -m pytest "$file" "$k_flag" "$expr" -q -p no:cacheprovider -x \
          --basetemp="/tmp/fk-sanitize-$name" > "$log.full" 2>&1  # basetemp: a name to find leftovers by
        rc=$?
        printf '\nexit %s\n' "$rc" >> "$log.full"  # 124: timed out before the summary
        { grep -E "passed|failed|ERROR SUMMARY|RACECHECK SUMMARY|^exit" "$log.full"; echo "-- head"; head -n 60 "$log.full"; echo "-- tail"; tail -n 40 "$log.full"; } > "$log"
        rm -f "$log.full"
      ) &
      pids+=($!)
    done
  done
done
for pid in "${pids[@]}"; do wait "$pid"; done
pkill -f -- "--basetemp=/tmp/fk-sanitize-" 2>/dev/null  # what a timed-out sanitizer left running (only ours)
: > "$OUT/sanitize.txt"
: > "$OUT/sanitize-logs.txt"
for log in "${logs[@]}"; do
  name=$(basename "$log" .log)
  { echo "== $name"; grep -E "passed|failed|SUMMARY|^exit" "$log" | sort -u; } >> "$OUT/sanitize.txt"
  { echo; echo "=== $name"; cat "$log"; } >> "$OUT/sanitize-logs.txt"
  rm -f "$log"
done
cat "$OUT/sanitize.txt"
