#!/usr/bin/env bash
# Nsight Compute profiles of our backward (or forward) and FA3's at the same grid
# points and inputs. Needs both builds (run_peer_grid.sh or
# build_fa3.py + setup.py) and ncu on PATH; writes, per (impl, point), the
# report and three text exports under $OUT/ncu:
#   NAME.ncu-rep        the report (ncu --import NAME.ncu-rep to reopen)
#   NAME.details.csv    every section of --set full (SOL, pipes, stalls, memory, occupancy)
#   NAME.raw.csv        every collected metric
#   NAME.sass.csv       per-SASS-instruction samples (stall reasons) of each kernel
#   summary.md          ncu_summary.py's tables: ours against FA3 per point, top stalls, top bank conflicts
#   DIRECTION default bwd (or fwd)
#   IMPLS    default "ours fa3"           (profile_call.py's IMPL names; fa4 / fa4-det for FA4)
#   POINTS   hdim:mask:seqlen list; default bwd "64:causal:8192 128:full:1024 128:causal:8192",
#            fwd "64:full:8192 128:full:2048 128:causal:1024" (the forward-speed issue's points)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/peers/out}
mkdir -p "$OUT/ncu"
PY=${PYTHON:-python3}
IMPLS=${IMPLS:-ours fa3}
DIRECTION=${DIRECTION:-bwd}
if [ "$DIRECTION" = fwd ]; then
  POINTS=${POINTS:-64:full:8192 128:full:2048 128:causal:1024}
else
  POINTS=${POINTS:-64:causal:8192 128:full:1024 128:causal:8192}
fi
status=0
for point in $POINTS; do
  IFS=: read -r hdim mask seqlen <<<"$point"
  for impl in $IMPLS; do
    name="${impl//:/-}_h${hdim}_${mask}_${seqlen}"  # ncu_summary.py parses it
    echo "== ncu $name"
    if ! ncu --profile-from-start off --set full --import-source no --target-processes all \
         -f -o "$OUT/ncu/$name" "$PY" benchmarks/peers/profile_call.py "$impl" "$hdim" "$mask" "$seqlen" --direction "$DIRECTION" \
         >"$OUT/ncu/$name.log" 2>&1; then
      tail -5 "$OUT/ncu/$name.log"; status=1; continue
    fi
    ncu --import "$OUT/ncu/$name.ncu-rep" --page details --csv >"$OUT/ncu/$name.details.csv"
    ncu --import "$OUT/ncu/$name.ncu-rep" --page raw --csv >"$OUT/ncu/$name.raw.csv"
    ncu --import "$OUT/ncu/$name.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu/$name.sass.csv" 2>&1
  done
done
"$PY" benchmarks/peers/ncu_summary.py "$OUT/ncu" --direction "$DIRECTION" --top 15 --conflicts 12 >"$OUT/ncu/summary.md" || status=1
exit $status
