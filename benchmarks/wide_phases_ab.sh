#!/usr/bin/env bash
# `wide_phases.py` over source trees, alternated on one machine (one device call, from the repo root):
# the wide decode attention's op / kernel / no-tile kernel / combine per tree, ROUNDS rounds at CTX, then
# one round at LONG_CTX (HCA: the per-tile slope) and at B = 16 (TAIL=0: not). Trees as `ab_run.sh` makes them.
#   TREES="ab_old ." ROUNDS=2 CTX=131072 LONG_CTX=524288 BATCHES=64 bash benchmarks/wide_phases_ab.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
root=$PWD
run() {  # tree ctx kinds batches
  (cd benchmarks && PYTHONPATH=$root/$1/src CTX=$2 KINDS=$3 BATCHES=$4 SPLITS=0 python3 wide_phases.py 2>&1 \
    | grep -v -i "leak\|nanobind\|skipped" | sed "s|^|$1 |")
}
for _ in $(seq "${ROUNDS:-2}"); do
  for t in ${TREES:-ab_old .}; do run "$t" "${CTX:-131072}" hca,csa "${BATCHES:-64}"; done
done
[ "${TAIL:-1}" = 1 ] || exit 0
for t in ${TREES:-ab_old .}; do run "$t" "${LONG_CTX:-524288}" hca 64; run "$t" "${CTX:-131072}" hca,csa 16; done
