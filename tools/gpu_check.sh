#!/usr/bin/env bash
# The one-call GPU workflow (`make gpu-check`): build (or use a carried build),
# run the GPU tests with skips turned into failures, run the main job, and write
# logs under $OUT (or build/gpu-check). Meant for the Hopper machine.
#   DASH_FA3_REBUILD=1   rebuild even if dash_fa3/_C*.so is present (e.g. carried from the dev box)
#   GPU_CHECK_TESTS      pytest selection (default: tests)
#   GPU_CHECK_BENCH      extra benchmark command to run last (optional)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu-check}
mkdir -p "$OUT"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=0

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; "$PY" -c "import torch,sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"; git rev-parse --short HEAD 2>/dev/null; date -u; } | tee "$OUT/env.txt"

# pytest may be missing on the GPU image: install carried wheels (.whl/) if so.
if ! "$PY" -c "import pytest" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/dash_fa3_site .whl/*.whl
    export PYTHONPATH=/tmp/dash_fa3_site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "pytest is not installed and no wheels were carried in .whl/" | tee -a "$OUT/env.txt"; exit 1
  fi
fi

if [ "${DASH_FA3_REBUILD:-0}" = 1 ] || ! ls dash_fa3/_C*.so >/dev/null 2>&1; then
  echo "== build (DASH_FA3_VARIANTS=${DASH_FA3_VARIANTS:-default}, MAX_JOBS=$MAX_JOBS)"
  if ! "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
  fi
  grep -E "warning|spill|dash_fa3:" "$OUT/build.log" | grep -v "^ptxas info" | tail -20
else
  echo "== using existing build: $(ls dash_fa3/_C*.so)"
fi

echo "== GPU tests"
DASH_FA3_REQUIRE_GPU=1 "$PY" -m pytest ${GPU_CHECK_TESTS:-tests} -q -rs -p no:cacheprovider --durations=8 2>&1 | tee "$OUT/pytest.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== main job"
"$PY" -m dash_fa3.bench 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

if [ -n "${GPU_CHECK_BENCH:-}" ]; then
  echo "== $GPU_CHECK_BENCH"
  bash -c "$GPU_CHECK_BENCH" 2>&1 | tee "$OUT/extra_bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
exit $status
