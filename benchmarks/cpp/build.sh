#!/usr/bin/env bash
# Builds the forward-kernel harness fwd_bench without Python.
#
#   benchmarks/cpp/build.sh [VARIANT ...]
#
# VARIANT is HDIM_DTYPE_MASK, e.g. 128_bf16_causal; default: all 20 variants
# (hdim 64 96 128 192 256 x bf16 fp16 x full causal). Output (default
# carry/fwd/, override with FWD_BUILD_DIR): fwd_bench, the generated
# instantiation files under gen/, and each variant's ptxas report under ptxas/.
# Objects are rebuilt when a header under csrc/ is newer. JOBS sets the
# number of parallel nvcc processes (default: nproc).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD_DIR=${FWD_BUILD_DIR:-$ROOT/carry/fwd}
JOBS=${JOBS:-$(nproc)}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
if [ -z "${CUTLASS_INC:-}" ]; then
  CUTLASS_INC=$(python3 -c "import cutlass_library,os;print(os.path.join(os.path.dirname(cutlass_library.__file__),'source','include'))")
fi
FLAGS="-std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 --expt-relaxed-constexpr --expt-extended-lambda \
 -I$ROOT/csrc -I$CUTLASS_INC -DNDEBUG --use_fast_math"
export NVCC FLAGS BUILD_DIR ROOT

if [ $# -eq 0 ]; then
  set -- $(for h in 64 96 128 192 256; do for t in bf16 fp16; do for m in full causal; do echo ${h}_${t}_${m}; done; done; done)
fi
mkdir -p "$BUILD_DIR/gen" "$BUILD_DIR/obj" "$BUILD_DIR/ptxas"

inc="$BUILD_DIR/gen/fwd_variants.inc.new"
: > "$inc"
for var in "$@"; do
  IFS=_ read -r h t m <<< "$var"
  T=$([ "$t" = bf16 ] && echo kBF16 || echo kFP16)
  C=$([ "$m" = causal ] && echo true || echo false)
  src="$BUILD_DIR/gen/fwd_hdim${h}_${t}_${m}.cu"
  new="#include \"kernels/fwd/fwd_launch.cuh\"
template void dash_fa3::run_fwd<${h}, dash_fa3::DType::${T}, ${C}>(const dash_fa3::FwdParams&, cudaStream_t);"
  if [ ! -f "$src" ] || [ "$(cat "$src")" != "$new" ]; then echo "$new" > "$src"; fi
  echo "DASH_FWD_VARIANT(${h}, ${T}, ${C})" >> "$inc"
done
if ! cmp -s "$inc" "$BUILD_DIR/gen/fwd_variants.inc"; then mv "$inc" "$BUILD_DIR/gen/fwd_variants.inc"; else rm "$inc"; fi

newest_header=$(find "$ROOT/csrc/kernels/fwd" "$ROOT/csrc/common" -name '*.h' -o -name '*.cuh' | xargs ls -t | head -1)
compile_variant() {
  var=$1
  src="$BUILD_DIR/gen/fwd_hdim${var}.cu"
  obj="$BUILD_DIR/obj/fwd_hdim${var}.o"
  if [ -f "$obj" ] && [ "$obj" -nt "$src" ] && [ "$obj" -nt "$2" ]; then return 0; fi
  $NVCC $FLAGS -Xptxas -v,--warn-on-spills -c "$src" -o "$obj" > "$BUILD_DIR/ptxas/$var.txt" 2>&1 \
    || { cat "$BUILD_DIR/ptxas/$var.txt"; echo "FAILED: $var" >&2; return 1; }
  echo "built $var: $(grep -E 'registers|spill' "$BUILD_DIR/ptxas/$var.txt" | tr -s ' ' | tr '\n' ' ')"
}
export -f compile_variant
printf '%s\n' "$@" | xargs -P "$JOBS" -I{} bash -c "compile_variant {} $newest_header"

bench_obj="$BUILD_DIR/obj/fwd_bench.o"
if [ ! -f "$bench_obj" ] || [ "$ROOT/benchmarks/cpp/fwd_bench.cu" -nt "$bench_obj" ] || \
   [ "$BUILD_DIR/gen/fwd_variants.inc" -nt "$bench_obj" ]; then
  $NVCC $FLAGS -I"$BUILD_DIR/gen" -c "$ROOT/benchmarks/cpp/fwd_bench.cu" -o "$bench_obj"
fi
objs=$(for var in "$@"; do echo "$BUILD_DIR/obj/fwd_hdim${var}.o"; done)
$NVCC -gencode=arch=compute_90a,code=sm_90a -o "$BUILD_DIR/fwd_bench" "$bench_obj" $objs
echo "built $BUILD_DIR/fwd_bench ($# variants)"
