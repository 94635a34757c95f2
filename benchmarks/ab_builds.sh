#!/usr/bin/env bash
# A/B of builds in alternating processes, on the GPU machine, in one call:
#
#   TREES="carry/base ." [VARIANTS=hdim64-bf16,hdim128-bf16] [LAYOUTS=dense] [REPS=2] [OUT=build/ab] \
#       bash benchmarks/ab_builds.sh [bench_peers.py arguments]
#
# TREES: source trees, the first being the base (e.g. `git archive <rev> | tar -x -C carry/base`, and
# `.` for this checkout). Each is built in place in parallel (MAX_JOBS, default 16, split between
# them; a tree that already holds dash_fa3/_C*.so is reused), then each tree's own
# benchmarks/bench_peers.py runs in turn, REPS times, with --json $OUT/ab_<tree>_<rep>.json and the
# arguments given (default: the backward, ours only, `spt` and `auto`, 3 rounds, no agreement
# check). Last, ab_summary.py prints every point's median TFLOP/s per tree and the ratio to the base.
# Alternating processes spreads the machine's drift over every tree; compare only within one call.
set -uo pipefail
cd "$(dirname "$0")/.."
TREES=${TREES:?set TREES to the source trees to compare, base first}
# Absolute, since every tree's commands run in that tree.
OUT=$(mkdir -p "${OUT:-build/ab}" && cd "${OUT:-build/ab}" && pwd)
PY=${PYTHON:-python3}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONUNBUFFERED=1
export DASH_FA3_VARIANTS=${VARIANTS:-hdim64-bf16,hdim128-bf16} DASH_FA3_LAYOUTS=${LAYOUTS:-dense}
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(--direction bwd --peers '' --no-check --rounds 3 --schedules spt)
label() { [ "$1" = . ] && echo head || basename "$1"; }

n=$(echo $TREES | wc -w)
jobs=$(( ${MAX_JOBS:-16} / n )); [ $jobs -ge 1 ] || jobs=1
status=0
for t in $TREES; do
  ( cd "$t" && { ls dash_fa3/_C*.so >/dev/null 2>&1 ||
      MAX_JOBS=$jobs "$PY" setup.py build_ext --inplace >"$OUT/build_$(label "$t").log" 2>&1; } ) &
done
wait
for t in $TREES; do
  if ! ls "$t"/dash_fa3/_C*.so >/dev/null 2>&1; then
    echo "build of $t failed: $OUT/build_$(label "$t").log"; tail -20 "$OUT/build_$(label "$t").log"; exit 1
  fi
done
specs=()
for t in $TREES; do specs+=("$(label "$t")=$OUT/ab_$(label "$t")_*.json"); done
for i in $(seq "${REPS:-2}"); do
  for t in $TREES; do
    l=$(label "$t")
    ( cd "$t" && DASH_FA3_COMMIT=$l "$PY" benchmarks/bench_peers.py "${ARGS[@]}" --json "$OUT/ab_${l}_$i.json" \
        >"$OUT/ab_${l}_$i.md" 2>&1 ) || { echo "bench in $t (rep $i) failed: $OUT/ab_${l}_$i.md"; status=1; }
  done
done
"$PY" benchmarks/ab_summary.py "${specs[@]}" | tee "$OUT/ab_summary.md"
exit $status
