#!/usr/bin/env bash
# The side-by-side grid in one command, for the Hopper machine (no network:
# everything comes from the repository tree and carry/):
#   1. builds FA3 from $FA3_SRC into build/peers/fa3 unless that build is current,
#   2. builds dash_fa3 in place if dash_fa3/_C*.so is missing,
#   3. runs benchmarks/bench_peers.py, writing table.md, peers.json, ratios.png
#      and the logs under $OUT.
#   FA3_SRC            flash-attention checkout (holds hopper/); default carry/fa3-src
#   OUT                output folder; default build/peers/out
#   FA3_HDIMS          head dims to build FA3 for; default 64,128
#   FA3_FEATURES       FA3 features to keep on (build_fa3.py --features); default none
#   MAX_JOBS           parallel compiles for both builds; default 16
#   BENCH_PEERS_ARGS   extra bench_peers.py arguments, e.g. "--hdims 128 --rounds 5"
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/peers/out}
FA3_SRC=${FA3_SRC:-carry/fa3-src}
mkdir -p "$OUT"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  "$PY" -c "import torch,sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
  git rev-parse --short HEAD 2>/dev/null; date -u; } | tee "$OUT/env.txt"

# The GPU image has no nvidia-cutlass: install the carried wheel (.whl/) when the headers are missing.
if ! "$PY" -c "import sys; sys.path.insert(0, 'third_party'); import cutlass_locator; cutlass_locator.include_dir()" 2>/dev/null; then
  if ls .whl/nvidia_cutlass-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/dash_fa3_site .whl/nvidia_cutlass-*.whl || exit 1
    export PYTHONPATH=/tmp/dash_fa3_site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "error: CUTLASS headers missing: carry .whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl or set DASH_FA3_CUTLASS_INCLUDE"; exit 1
  fi
fi

echo "== FA3 (from $FA3_SRC, MAX_JOBS=$MAX_JOBS)"
if ! "$PY" benchmarks/peers/build_fa3.py --src "$FA3_SRC" --hdims "${FA3_HDIMS:-64,128}" \
     --features "${FA3_FEATURES:-}" --if-needed >"$OUT/fa3_build.log" 2>&1; then
  tail -30 "$OUT/fa3_build.log"; echo "FA3 BUILD FAILED"; exit 1
fi
grep -E "^(FA3|warning|error)" "$OUT/fa3_build.log"

if ! ls dash_fa3/_C*.so >/dev/null 2>&1; then
  echo "== dash_fa3 build (MAX_JOBS=$MAX_JOBS)"
  if ! "$PY" setup.py build_ext --inplace >"$OUT/dash_build.log" 2>&1; then
    tail -40 "$OUT/dash_build.log"; echo "DASH_FA3 BUILD FAILED"; exit 1
  fi
  grep -E "dash_fa3:" "$OUT/dash_build.log" | tail -3
else
  echo "== using existing dash_fa3 build: $(ls dash_fa3/_C*.so)"
fi

echo "== bench_peers"
# shellcheck disable=SC2086  # BENCH_PEERS_ARGS is a list of arguments
"$PY" benchmarks/bench_peers.py --require-fa3 --json "$OUT/peers.json" --png "$OUT/ratios.png" \
  ${BENCH_PEERS_ARGS:-} 2>&1 | tee "$OUT/table.md"
exit "${PIPESTATUS[0]}"
