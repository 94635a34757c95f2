#!/usr/bin/env bash
# One device call for context parallelism (`make cp-check`) on a machine of two or more GPUs: build the
# variants the distributed GPU tests and benchmark use (or use a carried build), run
# tests/test_gpu_distributed.py (two ranks), then benchmarks/bench_distributed.py under torchrun on
# CP_NPROC GPUs; logs and tables under $OUT (or build/cp-check).
#   CP_NPROC          ranks of the benchmark (default 2)
#   CP_BENCH_ARGS     its arguments (default: issue 16's configurations, both transports of ours det, the
#                     nd default beside the run plan)
#   CP_SKIP_TESTS=1   benchmark only
#   DASH_FA3_REBUILD=1, DASH_FA3_VARIANTS, DASH_FA3_LAYOUTS, DASH_FA3_COMMIT as elsewhere
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/cp-check}
mkdir -p "$OUT"
# NVLink multicast stays off: on the shared GPU hosts a program that uses it can take the host's GPUs
# out of service (NCCL, PyTorch's symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
export DASH_FA3_VARIANTS=${DASH_FA3_VARIANTS:-hdim128-bf16-causal,hdim128-bf16-full,hdim64-fp16-causal}
export DASH_FA3_LAYOUTS=${DASH_FA3_LAYOUTS:-dense}
PY=${PYTHON:-python3}
COMMIT=${DASH_FA3_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
status=0

{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; nvidia-smi topo -m;
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'nccl', torch.cuda.nccl.version())";
  echo "commit $COMMIT"; date -u; } 2>&1 | tee "$OUT/env.txt"

if [ "${DASH_FA3_REBUILD:-0}" = 1 ] || ! ls dash_fa3/_C*.so >/dev/null 2>&1; then
  echo "== build (DASH_FA3_VARIANTS=$DASH_FA3_VARIANTS, DASH_FA3_LAYOUTS=$DASH_FA3_LAYOUTS, MAX_JOBS=$MAX_JOBS)"
  if ! "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
  fi
else
  echo "== using existing build: $(ls dash_fa3/_C*.so)"
fi

if [ "${CP_SKIP_TESTS:-0}" != 1 ]; then
  echo "== tests/test_gpu_distributed.py"
  DASH_FA3_REQUIRE_GPU=1 "$PY" -m pytest tests/test_gpu_distributed.py -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

ARGS=${CP_BENCH_ARGS:---tokens 64k,128k --heads 16/16,32/8 --peers cudnn --cp-transports p2p:1,shared:1 --nd-runs}
echo "== bench_distributed on ${CP_NPROC:-2} ranks: $ARGS"
# shellcheck disable=SC2086  # ARGS is a word list
torchrun --standalone --nproc-per-node "${CP_NPROC:-2}" benchmarks/bench_distributed.py $ARGS \
    --out "$OUT/bench" --commit "$COMMIT" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
