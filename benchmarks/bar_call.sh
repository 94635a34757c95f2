#!/usr/bin/env bash
# The backward's bar measurements in one call on the GPU machine (docs/journal/rect-bwd.md run 16):
#
#   DASH_FA3_COMMIT=<short hash> [STEPS="tests rect auto grid"] [BASE=carry/base] [OUT=...] \
#       bash benchmarks/bar_call.sh
#
# Builds this tree (VARIANTS, default head dims 64 and 128, bf16, dense) and FA3 (from FA3_SRC,
# default carry/fa3-src; peers/build_fa3.py) side by side, and BASE too when STEPS has `ab`; then
# runs each step of STEPS in order:
#   tests  the backward GPU tests of auto, the grouped and rectangular schedules and every schedule in
#          the non-deterministic mode (skips are failures)
#   rect   bench_rect.py --set all beside FA3, with its results data file (--results)
#   auto   bench_auto.py --set all
#   grid   bench_peers.py --direction bwd beside FA3 on the square grid
#   nd     bench_auto.py --nd on ND_SETS (default grid,first,held_out,probe,probe2): the
#          non-deterministic backward with every schedule beside the deterministic ones
#   peers  issue 54's table: bench_peers.py (forward and backward) beside FA3, FA4 and cuDNN, one
#          process per head dim (PEER_HDIMS, default "128 64"); FA4 from build/fa4_site
#          (peers/fa4_carry.sh unpack, an earlier call of the same warm machine)
#   ab     ab_builds.sh: the square grid, BASE against this tree, ours only
# Every output goes to one folder and is packed into $OUT/bar.tar.xz with the printed tables also
# as $OUT/*.md: the device returns few files a call. LIMIT (default 580 s) bounds the whole script;
# each step gets what is left, so a slow step leaves the outputs of the earlier ones. The copy on
# the device has no git: DASH_FA3_COMMIT names the commit the tables print.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${DASH_FA3_COMMIT:?set DASH_FA3_COMMIT to the commit being measured}"
export DASH_FA3_COMMIT CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONUNBUFFERED=1
STEPS=${STEPS:-tests rect auto grid}
for s in $STEPS; do
  case $s in tests|rect|auto|grid|nd|peers|ab) ;; *) echo "unknown step '$s' (tests rect auto grid nd peers ab)" >&2; exit 2 ;; esac
done
if [[ " $STEPS " == *" ab "* ]] && [ ! -d "${BASE:-}" ]; then
  echo "step ab needs BASE, the base source tree (e.g. git archive REV | tar -x -C carry/base)" >&2; exit 2
fi
OUT=${OUT:-build/bar}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
W=$(mktemp -d)
PY=${PYTHON:-python3}
T0=$(date +%s)
left() { echo $(( ${LIMIT:-580} - ($(date +%s) - T0) )); }
has() { [[ " $STEPS " == *" $1 "* ]]; }

# pytest and the CUTLASS headers may be missing on the GPU image: the carried wheels (.whl/).
if ! "$PY" -c "import pytest, cutlass_library" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/dash_fa3_site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/dash_fa3_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; echo "commit $DASH_FA3_COMMIT"; } \
  | tee "$W/env.txt"
dev=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200' | tr 'A-Z' 'a-z')

build() {  # tree log jobs
  ( cd "$1" && { ls dash_fa3/_C*.so >/dev/null 2>&1 ||
      DASH_FA3_VARIANTS=${VARIANTS:-hdim64-bf16,hdim128-bf16} DASH_FA3_LAYOUTS=dense MAX_JOBS=$3 \
      "$PY" setup.py build_ext --inplace >"$W/$2" 2>&1; } )
  echo "$2: rc $? at $(( $(date +%s) - T0 )) s"
}
build . build_head.log $({ has rect || has grid || has peers || has ab; } && echo 8 || echo 16) &
if has ab; then build "$BASE" build_base.log 4 & fi
# FA3 only for the steps that time it.
if has rect || has grid || has peers; then
  ( MAX_JOBS=4 "$PY" benchmarks/peers/build_fa3.py --src "${FA3_SRC:-carry/fa3-src}" --hdims 64,128 --if-needed \
      >"$W/build_fa3.log" 2>&1; echo "FA3: rc $? at $(( $(date +%s) - T0 )) s" ) &
fi
wait
ls dash_fa3/_C*.so >/dev/null 2>&1 || { tail -30 "$W/build_head.log"; exit 1; }

status=0
run() {  # name, command...
  local name=$1 t; shift
  t=$(left)
  if [ "$t" -le 5 ]; then echo "== $name skipped: out of time"; status=1; return; fi
  echo "== $name at $(( $(date +%s) - T0 )) s"
  timeout "$t" "$@" 2>&1 | tee "$W/$name.md"
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "$name failed"; status=1; }
}
if has tests; then
  run tests env DASH_FA3_REQUIRE_GPU=1 "$PY" -m pytest tests/test_gpu_bwd.py -q -rs -p no:cacheprovider \
    -k "(auto or grouped or rect or random or non_deterministic) and not 100_runs"
fi
if has rect; then
  run rect "$PY" benchmarks/bench_rect.py --set all --json "$W/rect.json" \
    --results "$W/rect_bwd_${dev:-gpu}_$(date -u +%F)_$DASH_FA3_COMMIT.json"
fi
has auto && run auto "$PY" benchmarks/bench_auto.py --set all --json "$W/auto.json"
if has grid; then
  run grid "$PY" benchmarks/bench_peers.py --direction bwd --require-fa3 --peers fa3 \
    --schedules spt,shift,symmetric_shift,split,sections --json "$W/grid.json"
fi
has nd && run nd "$PY" benchmarks/bench_auto.py --nd --set "${ND_SETS:-grid,first,held_out,probe,probe2}" \
  --json "$W/nd.json"
if has peers; then
  [ -d build/fa4_site ] || { echo "step peers needs FA4 in build/fa4_site (benchmarks/peers/fa4_carry.sh)"; status=1; }
  for d in ${PEER_HDIMS:-128 64}; do
    run "peers_d$d" env PYTHONPATH="$PWD/build/fa4_site:$PYTHONPATH" FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 \
      "$PY" benchmarks/bench_peers.py --hdims "$d" --require-fa3 --require-fa4 --rounds 3 --json "$W/peers_d$d.json"
  done
fi
has ab && run ab env TREES="$BASE ." OUT="$W/ab" bash benchmarks/ab_builds.sh
echo "== done at $(( $(date +%s) - T0 )) s"
tar -cJf "$OUT/bar.tar.xz" -C "$W" .
for f in "$W"/*.md; do cp "$f" "$OUT/"; done
exit $status
