#!/usr/bin/env bash
# Nsight Compute counters of the decode step's cache-side kernels and of one prefill chunk's
# compression (one device call, from the repo root on a CUDA machine whose runtime lets ncu read
# the counters). Writes $OUT/step.ncu-rep, $OUT/details.txt (every section) and, per kernel in
# NCU_SASS, $OUT/sass_<kernel>.csv (stall samples per SASS instruction; summarise them with
# benchmarks/ncu_sass.py). Clocks are left alone (--clock-control none).
#   NCU_ARGS="--batches 64 --chunk 8192" (benchmarks/profile_step.py arguments)
#   NCU_KERNELS="regex:..."  NCU_SASS="_indexer_scan_kernel _scores_kernel"
set -uo pipefail
OUT=${OUT:-/tmp/dsv4-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
ncu --version | tail -1
K=${NCU_KERNELS:-"regex:indexer_scan|_scores_kernel|_values_kernel|_topk_kernel|_compress_kernel|_write_entries"}
timeout "${NCU_TIMEOUT:-420}" ncu --profile-from-start off --clock-control none -k "$K" \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
  --section LaunchStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters \
  --import-source no -o "$OUT/step" -f \
  python3 benchmarks/profile_step.py --ncu ${NCU_ARGS:-"--batches 64 --chunk 8192"} > "$OUT/run.log" 2>&1
echo "ncu exit $?"; tail -3 "$OUT/run.log"
ncu --import "$OUT/step.ncu-rep" --page details > "$OUT/details.txt" 2>&1
for k in ${NCU_SASS:-_indexer_scan_kernel _scores_kernel _values_kernel _compress_kernel}; do
  ncu --import "$OUT/step.ncu-rep" -k "$k" --launch-count 1 --page source --print-source sass --csv \
    > "$OUT/sass_$k.csv" 2>&1
done
grep -E "^  [_a-z].*\(|Duration|Memory Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|No Eligible" \
  "$OUT/details.txt" | head -120
