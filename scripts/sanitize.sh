#!/usr/bin/env bash
# compute-sanitizer over a slice of each family's CUDA tests, on the GPU machine (one device call).
#
#   OUT=/some/dir bash scripts/sanitize.sh [memcheck|racecheck ...]     # default: memcheck racecheck
#
# The slices take the tests with odd sizes (S not a multiple of the block, N not a power of two, strided
# views, empty and width-one rows) and both backward paths of the norms. Each (tool, family) runs as its
# own process, side by side; $OUT/sanitize-<tool>-<family>.log keeps the tail of its output and
# $OUT/sanitize.txt every "ERROR SUMMARY" line. Knob: SANITIZE_TIMEOUT (seconds per run, default 540).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck)

declare -A slice=(
  [dropout]="tests/test_dropout.py -k kernel_equals_twin or gradient_is_the_regenerated or non_contiguous or inplace or empty"
  [layernorm]="tests/test_layernorm.py -k kernel_equals_twin or width_one or non_contiguous or empty_batch or lock_mode or deterministic_mode"
  [attention]="tests/test_attention.py -k block_boundaries or head_dims_that_are_not or rows_that_see_no_key or varlen_equals or dropout_mask_equals"
)

pids=()
for tool in "${tools[@]}"; do
  for family in dropout layernorm attention; do
    read -r file k_flag expr <<< "${slice[$family]}"
    log="$OUT/sanitize-$tool-$family.log"
    (
      timeout "${SANITIZE_TIMEOUT:-540}" compute-sanitizer --tool "$tool" --target-processes all \
        python3 -m pytest "$file" "$k_flag" "$expr" -q -p no:cacheprovider -x > "$log.full" 2>&1
      rc=$?
      printf '\nexit %s\n' "$rc" >> "$log.full"  # 124: timed out before the summary
      { grep -E "passed|failed|ERROR SUMMARY|RACECHECK SUMMARY|^exit" "$log.full"; echo "-- tail"; tail -n 40 "$log.full"; } > "$log"
      rm -f "$log.full"
    ) &
    pids+=($!)
  done
done
for pid in "${pids[@]}"; do wait "$pid"; done
: > "$OUT/sanitize.txt"
for log in "$OUT"/sanitize-*.log; do
  { echo "== $(basename "$log" .log)"; grep -E "passed|failed|SUMMARY|^exit" "$log" | sort -u; } >> "$OUT/sanitize.txt"
done
cat "$OUT/sanitize.txt"
