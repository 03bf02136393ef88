#!/usr/bin/env bash
# The batch-1 layer rows of `dsv4 bench` with the q_a norm inside the q up-projection's GEMV for the
# layer types named (`decode_path.QA_NORM_IN_GEMM`), one process per variant on one machine. From
# the repo root on a CUDA machine:   VARIANTS="none csa both none csa both" CTX=131072 bash benchmarks/qa_norm_sweep.sh
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1
for v in ${VARIANTS:-none csa both}; do
  echo "=== $v"
  timeout "${SWEEP_TIMEOUT:-100}" python3 -c "
import sys
import dsv4.attention.decode_path as d
from dsv4.model.layer_schedule import AttentionType as T
d.QA_NORM_IN_GEMM = {'none': (), 'csa': (T.CSA,), 'hca': (T.HCA,), 'both': (T.CSA, T.HCA)}['$v']
import dsv4.bench as b
sys.exit(b.main(sys.argv[1:]))" --contexts "${CTX:-131072}" --batches ${BATCHES:-1} --prefill 0 --no-reference --no-hf \
    --warmup-ms 10 --rep-ms 50 2>&1 | grep -E "^decode .*layer .*triton"
done
