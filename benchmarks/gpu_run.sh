#!/usr/bin/env bash
# One device call, from the repo root on a CUDA machine: environment, the GPU tests, optionally the
# kernel variant sweep (benchmarks/tune_decode.py), optionally `dsv4 bench`. Each stage has its own
# time limit so a slow one cannot take the others' results with it. Wheels for packages the
# machine's image lacks may sit in .whl/ (carried along).
#   TESTS="tests/..." (default: the GPU test files; SKIP_TESTS=1 skips)   TUNE_ARGS="--batches 1,64"
#   PROFILE_ARGS="--batches 1" (benchmarks/profile_step.py: per-kernel device time of a step)
#   BENCH_ARGS="--contexts 131072 ..."   TEST_TIMEOUT=480 TUNE_TIMEOUT=200 PROFILE_TIMEOUT=150 BENCH_TIMEOUT=400
set -uo pipefail
OUT=${OUT:-/tmp/dsv4-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
TESTS=${TESTS:-"tests/test_triton_cache_ops.py tests/test_triton_decode.py tests/test_triton_topk.py tests/test_triton_prefill.py tests/test_triton_norm_rope.py tests/test_gpu_decode.py"}
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-480}" python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1
  echo "tests exit $?"; grep -E "passed|failed|error|FAILED|ERROR" "$OUT/tests.log" | tail -25
fi
if [ -n "${TUNE_ARGS:-}" ]; then
  timeout "${TUNE_TIMEOUT:-200}" python3 benchmarks/tune_decode.py $TUNE_ARGS --json "$OUT/tune.json" > "$OUT/tune.log" 2>&1
  echo "tune exit $?"; tail -c 4000 "$OUT/tune.log"
fi
if [ -n "${PROFILE_ARGS:-}" ]; then
  timeout "${PROFILE_TIMEOUT:-150}" python3 benchmarks/profile_step.py $PROFILE_ARGS > "$OUT/profile.log" 2>&1
  echo "profile exit $?"; head -c 9000 "$OUT/profile.log"
fi
if [ -n "${BENCH_ARGS:-}" ]; then
  timeout "${BENCH_TIMEOUT:-400}" python3 -c "import sys, dsv4.bench as b; sys.exit(b.main(sys.argv[1:]))" \
    $BENCH_ARGS --json "$OUT/bench.json" --plot "$OUT/bench.png" > "$OUT/bench.log" 2>&1
  echo "bench exit $?"; tail -c 6000 "$OUT/bench.log"
fi
