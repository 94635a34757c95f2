#!/usr/bin/env bash
# Builds the backward-kernel harness bwd_bench without Python.
#
#   benchmarks/cpp/bwd_build.sh [VARIANT ...]
#
# VARIANT is HDIM_DTYPE_MASK, e.g. 128_bf16_causal; default: the 12 variants
# hdim 64 96 128 x bf16 fp16 x full causal. Output (default carry/bwd/,
# override with BWD_BUILD_DIR): bwd_bench, the generated instantiation files
# under gen/, and each variant's ptxas report under ptxas/. JOBS sets the
# number of parallel nvcc processes (default: nproc).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD_DIR=${BWD_BUILD_DIR:-$ROOT/carry/bwd}
JOBS=${JOBS:-$(nproc)}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
if [ -z "${CUTLASS_INC:-}" ]; then
  CUTLASS_INC=$(python3 -c "import cutlass_library,os;print(os.path.join(os.path.dirname(cutlass_library.__file__),'source','include'))")
fi
FLAGS="-std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 --expt-relaxed-constexpr --expt-extended-lambda \
 -I$ROOT/csrc -I$CUTLASS_INC -DNDEBUG --use_fast_math -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ \
 -U__CUDA_NO_BFLOAT16_OPERATORS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__"
export NVCC FLAGS BUILD_DIR ROOT

if [ $# -eq 0 ]; then
  set -- $(for h in 64 96 128; do for t in bf16 fp16; do for m in full causal; do echo ${h}_${t}_${m}; done; done; done)
fi
mkdir -p "$BUILD_DIR/gen" "$BUILD_DIR/obj" "$BUILD_DIR/ptxas"

inc="$BUILD_DIR/gen/bwd_variants.inc.new"
: > "$inc"
for var in "$@"; do
  IFS=_ read -r h t m <<< "$var"
  T=$([ "$t" = bf16 ] && echo kBF16 || echo kFP16)
  C=$([ "$m" = causal ] && echo true || echo false)
  src="$BUILD_DIR/gen/bwd_hdim${h}_${t}_${m}.cu"
  new="#include \"kernels/bwd/bwd_launch.cuh\"
template void dash_fa3::run_bwd<${h}, dash_fa3::DType::${T}, ${C}>(const dash_fa3::BwdParams&, cudaStream_t);"
  if [ ! -f "$src" ] || [ "$(cat "$src")" != "$new" ]; then echo "$new" > "$src"; fi
  echo "DASH_BWD_VARIANT(${h}, ${T}, ${C})" >> "$inc"
done
if ! cmp -s "$inc" "$BUILD_DIR/gen/bwd_variants.inc"; then mv "$inc" "$BUILD_DIR/gen/bwd_variants.inc"; else rm "$inc"; fi

newest_header=$(find "$ROOT/csrc/kernels/bwd" "$ROOT/csrc/common" "$ROOT/csrc/schedules" -name '*.h' -o -name '*.cuh' | xargs ls -t | head -1)
compile_one() {
  src=$1; obj=$2; log=$3; dep=$4
  if [ -f "$obj" ] && [ "$obj" -nt "$src" ] && [ "$obj" -nt "$dep" ]; then return 0; fi
  $NVCC $FLAGS -Xptxas -v,--warn-on-spills,--warn-on-local-memory-usage -c "$src" -o "$obj" > "$log" 2>&1 \
    || { cat "$log"; echo "FAILED: $src" >&2; return 1; }
  echo "built $(basename "$obj"): $(grep -A2 'bwd_kernel' "$log" | grep -E 'registers|spill' | tr -s ' ' | tr '\n' ' ')"
}
export -f compile_one
{
  for var in "$@"; do
    echo "$BUILD_DIR/gen/bwd_hdim${var}.cu $BUILD_DIR/obj/bwd_hdim${var}.o $BUILD_DIR/ptxas/${var}.txt $newest_header"
  done
  for f in bwd_preprocess bwd_postprocess; do
    echo "$ROOT/csrc/kernels/bwd/$f.cu $BUILD_DIR/obj/$f.o $BUILD_DIR/ptxas/$f.txt $ROOT/csrc/kernels/bwd/$f.cu"
  done
  echo "$ROOT/benchmarks/cpp/bwd_bench.cu $BUILD_DIR/obj/bwd_bench.o $BUILD_DIR/ptxas/bwd_bench.txt $BUILD_DIR/gen/bwd_variants.inc"
} | FLAGS="$FLAGS -I$BUILD_DIR/gen" xargs -P "$JOBS" -L 1 bash -c 'compile_one "$@"' _
objs=$(for var in "$@"; do echo "$BUILD_DIR/obj/bwd_hdim${var}.o"; done)
$NVCC -gencode=arch=compute_90a,code=sm_90a -o "$BUILD_DIR/bwd_bench" "$BUILD_DIR/obj/bwd_bench.o" \
  "$BUILD_DIR/obj/bwd_preprocess.o" "$BUILD_DIR/obj/bwd_postprocess.o" $objs
echo "built $BUILD_DIR/bwd_bench ($# variants)"
