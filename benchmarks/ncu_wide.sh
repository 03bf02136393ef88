#!/usr/bin/env bash
# Nsight Compute of the wide decode attention kernel alone (one device call, from the repo root), as
# `wide_phases.py` launches it: speed of light, warp states, and the stall samples per SASS instruction
# ($OUT/sass_wide.csv; summarised by benchmarks/ncu_sass.py, which also splits the samples by the
# kernel's warpgroups: values, loader, then scores with the parent's code).
#   KINDS=hca BATCHES=64 CTX=131072 bash benchmarks/ncu_wide.sh
# SCRIPT / KERNEL profile another launcher and kernel, e.g. the wide prefill attention:
#   KINDS=csa SCRIPT=prefill_wide_probe.py KERNEL=_prefill_wide_kernel bash benchmarks/ncu_wide.sh
set -uo pipefail
OUT=${OUT:-/tmp/dsv4-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
cd benchmarks
KINDS=${KINDS:-hca} BATCHES=${BATCHES:-64} SPLITS=0 timeout "${NCU_TIMEOUT:-400}" ncu --clock-control none \
  -k regex:"${KERNEL:-_wide_kernel}" --launch-skip 3 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section SourceCounters --section LaunchStats --import-source no \
  -o "$OUT/wide" -f python3 "${SCRIPT:-wide_phases.py}" > "$OUT/run.log" 2>&1
echo "ncu exit $?"; tail -3 "$OUT/run.log"
ncu --import "$OUT/wide.ncu-rep" --page details > "$OUT/details.txt" 2>&1
ncu --import "$OUT/wide.ncu-rep" --page source --print-source sass --csv > "$OUT/sass_wide.csv" 2>&1
grep -E "Duration|Throughput|Pipe|Issue|Eligible|Active Warps" "$OUT/details.txt" | head -40
python3 ncu_sass.py "$OUT/sass_wide.csv" 30 | head -80
