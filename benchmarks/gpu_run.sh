#!/usr/bin/env bash
# One device call: environment, the GPU test sweep, then the benchmark. Run from the repo root on
# a CUDA machine; wheels for packages its image lacks may sit in .whl/ (carried along).
set -uo pipefail
OUT=${OUT:-/tmp/dsv4-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
TESTS=${TESTS:-"tests/test_triton_cache_ops.py tests/test_triton_decode.py tests/test_gpu_decode.py"}
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/tests.log" | tail -40
fi
if [ -n "${BENCH_ARGS:-}" ]; then
  python3 -c "import sys, dsv4.bench as b; sys.exit(b.main(sys.argv[1:]))" $BENCH_ARGS --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log"
fi
