#!/usr/bin/env bash
# One-call GPU check of the forward kernel: correctness suite, then timing.
#   benchmarks/cpp/fwd_gpu_check.sh BENCH "HDIMS" "DTYPES" [GRID_HDIMS]
# e.g. fwd_gpu_check.sh carry/fwd/fwd_bench "64 128 192v128" "bf16 fp16" "64,128"
# (DvDV: head dim D for Q and K, DV for V and O.)
# Prints one line per case; exits non-zero if any case fails.
set -uo pipefail
BENCH=$1; HDIMS=$2; DTYPES=$3; GRID=${4:-}
fails=0
# A hung kernel (a barrier bug) must not eat the whole call: 30 s per case.
run() { timeout 30 "$BENCH" --time 0 "$@" | grep -v '^device' || { fails=$((fails+1)); echo "  ^^^ FAILED: $*"; }; }
# Smoke test first: if the kernel hangs or fails here, stop at once.
timeout 30 "$BENCH" --time 0 --hdim 128 --seqlen 300 --batch 1 --heads 2 || { echo "smoke test failed"; exit 99; }
for h in $HDIMS; do for t in $DTYPES; do for c in 0 1; do
  a="--hdim ${h%v*} --hdim_v ${h#*v} --dtype $t --causal $c"
  run $a --batch 2 --seqlen_q 1024 --heads 4
  run $a --batch 1 --seqlen_q 1000 --heads 3 --heads_kv 1 --seed 2
  run $a --batch 2 --seqlen_q 300 --seqlen_k 777 --heads 6 --heads_kv 2 --pad 1 --seed 3
  run $a --batch 2 --seqlen_q 777 --seqlen_k 300 --heads 2 --seed 4
  run $a --batch 3 --seqlen_q 1 --seqlen_k 1 --heads 2 --seed 5
  run $a --batch 1 --seqlen_q 1 --seqlen_k 4099 --heads 2 --seed 6
  run $a --batch 1 --seqlen_q 129 --seqlen_k 65 --heads 2 --pad 1 --seed 7
  run $a --batch 1 --seqlen_q 2048 --seqlen_k 2048 --heads 2 --heads_kv 1 --scale 0.3 --seed 8
  # More tiles than CTAs: causal kernels take later tiles off their counter (hdim 64: three warpgroups).
  run $a --batch 2 --seqlen_q 4096 --heads 8 --heads_kv 2 --seed 9
done; done; done
echo "correctness failures: $fails"
if [ -n "$GRID" ]; then timeout 300 "$BENCH" --grid --hdims "$GRID" --iters 30 --warmup 5; fi
exit $fails
