#!/usr/bin/env bash
# The batch-1 layer rows of `dsv4 bench` with the decode step's L2 prefetch off or at other shares, in
# one process per variant on one machine (benchmarks/NOTES.md #149). From the repo root on a CUDA machine:
#   VARIANTS="off 0.2 0.4 0.6 off" CTX=131072 bash benchmarks/prefetch_sweep.sh
# A variant is "off" (no prefetch) or a share of the L2 (`decode_path.PREFETCH_L2_SHARE`).
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1
for v in ${VARIANTS:-off 0.4 off 0.4}; do
  echo "=== $v"
  timeout "${SWEEP_TIMEOUT:-100}" python3 -c "
import sys
import dsv4.attention.decode_path as d
if '$v' == 'off':
    d.PREFETCH_MAX_ROWS = 0
else:
    d.PREFETCH_L2_SHARE = float('$v')
import dsv4.bench as b
sys.exit(b.main(sys.argv[1:]))" --contexts "${CTX:-131072}" --batches 1 --prefill 0 --no-reference --no-hf \
    --warmup-ms 10 --rep-ms 50 2>&1 | grep -E "^decode .*layer .*triton"
done
