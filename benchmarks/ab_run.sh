#!/usr/bin/env bash
# Same-machine A/B of several source trees (run-to-run variance between lent machines is ~10-20%,
# alternating runs on one machine agree within ~0.3 µs). From the repo root on a CUDA machine:
#   AB_TREES="ab_old ." AB_ROUNDS=2 AB_ARGS="--contexts 131072 --batches 1,64 --prefill 0" \
#   AB_GREP="^decode .*(layer|attention) .*triton" AB_PROFILE="--batches 1 --chunk 0" bash benchmarks/ab_run.sh
# Each tree is a directory holding a src/ (e.g. `git archive <commit> src | tar -x -C ab_old`).
# AB_PROFILE: also run benchmarks/profile_step.py once per tree (per-kernel device time).
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
ARGS=${AB_ARGS:-"--contexts 131072 --batches 1,64 --prefill 0"}
GREP=${AB_GREP:-"^decode .*(layer|attention) .*triton"}
if [ -n "${AB_PROFILE:-}" ]; then
  for t in $AB_TREES; do
    echo "=== profile $t"
    PYTHONPATH="$t/src:/tmp/site" timeout "${AB_PROFILE_TIMEOUT:-120}" python3 benchmarks/profile_step.py $AB_PROFILE \
      2>&1 | grep -vE "^\s*$" | head -n "${AB_PROFILE_LINES:-60}"
  done
fi
for r in $(seq "${AB_ROUNDS:-2}"); do
  for t in $AB_TREES; do
    echo "=== round $r: $t"
    PYTHONPATH="$t/src:/tmp/site" timeout "${AB_TIMEOUT:-120}" python3 -c \
      "import sys, dsv4.bench as b; sys.exit(b.main(sys.argv[1:]))" $ARGS --no-reference --no-hf \
      --warmup-ms 10 --rep-ms 50 2>&1 | grep -E "$GREP"
  done
done
