#!/usr/bin/env bash
# The bench's rows under the machine's Triton and under other Triton releases, on one machine, runs
# alternating (benchmarks/ab_run.sh's method). The GPU numbers in NOTES.md are Triton 3.6's; a fresh
# install of torch 2.13 brings 3.7, whose sm_90 compiles of the attention kernels differ (local compile,
# `compile_report.py each qnorm`: the halves kernel 2,680 -> 4,104 instructions, its spilled loads
# 8 -> 56; the fused B = 1 kernel 2,664 -> 3,216; NOTES.md, sixty-fifth round).
#
# Another release travels as a slimmed wheel tree (the GPU machine reaches no package index, and the
# wheel is ~190 MB): made here, on any x86-64 machine with pip, by
#   bash benchmarks/triton_ab.sh pack 3.7.1 [3.12]     # -> .tri/triton-3.7.1-cp312-slim.tar.xz (~45 MB)
# (.tri/ is git-ignored through .git/info/exclude; carry it to the GPU machine). Then, there:
#   TRI_ROUNDS=2 TRI_ARGS="--contexts 131072 --batches 1,64 --prefill 32768" bash benchmarks/triton_ab.sh
# TRI_TESTS="tests/test_triton_decode.py ..." also runs those tests under each other release (TRI_K: pytest's -k).
# TRI_BASE="ab_main [ab_other ...]" (trees holding a src/, e.g. `git archive main src | tar -x -C ab_main`): their
# dsv4 runs beside this one's under every release (tree $t-<name>), so a change is timed against its base under
# each; TRI_TEST_TREES="base names" also runs TRI_TESTS with those trees' dsv4 (e.g. a branch not yet on main).
set -uo pipefail

if [ "${1:-}" = "pack" ]; then        # pack VERSION [PYTHON]: download, slim and compress a wheel
  v=$2 py=${3:-3.12}
  tag="cp${py/./}" work=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$work/whl" "triton==$v" || exit 1
  (cd "$work" && unzip -q whl/triton-*.whl -x 'triton/backends/amd/*') || exit 1
  # what a CUDA run on sm_90 never loads: the AMD backend, Blackwell's ptxas, the disassembler, CUPTI and
  # the profiler, the test tools; and libtriton's symbol tables (strip: 440 -> 170 MB)
  rm -rf "$work"/triton/backends/nvidia/bin/{ptxas-blackwell,nvdisasm} "$work"/triton/backends/nvidia/lib/cupti \
    "$work"/triton/_C/libproton.so "$work"/triton/FileCheck "$work"/triton/instrumentation
  strip --strip-unneeded "$work"/triton/_C/libtriton.so
  sed -i '/^amd = /d' "$work"/triton-*.dist-info/entry_points.txt     # the backend list Triton loads
  mkdir -p .tri
  (cd "$work" && tar -cf - triton triton-*.dist-info) | xz -9 -T0 > ".tri/triton-$v-$tag-slim.tar.xz"
  rm -rf "$work"
  ls -l ".tri/triton-$v-$tag-slim.tar.xz"
  exit 0
fi

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# a tree for ab_run.sh per carried release: its src/ holds that Triton beside a link to this src/dsv4
trees="${TRI_BASE:+$TRI_BASE }."
for a in .tri/triton-*-slim.tar.xz; do
  [ -e "$a" ] || continue
  t="/tmp/tri/$(basename "$a" .tar.xz)"
  mkdir -p "$t/src" && tar -xJf "$a" -C "$t/src" && ln -sfn "$PWD/src/dsv4" "$t/src/dsv4" || exit 1
  for b in ${TRI_BASE:-}; do           # each base's dsv4 beside the same Triton
    tb="$t-$(basename "$b")"
    mkdir -p "$tb/src" && ln -sfn "$(cd "$b" && pwd)/src/dsv4" "$tb/src/dsv4" || exit 1
    for f in "$t"/src/triton*; do ln -sfn "$f" "$tb/src/$(basename "$f")"; done   # the package and its dist-info
    trees="$trees $tb"
  done
  trees="$trees $t"
  if [ -n "${TRI_TESTS:-}" ]; then
    for tt in "$t" ${TRI_TEST_TREES:+$(for n in $TRI_TEST_TREES; do echo "$t-$n"; done)}; do
      echo "=== tests, $tt: $(PYTHONPATH=$t/src python3 -c 'import triton; print("Triton", triton.__version__)')"
      PYTHONPATH="$tt/src:/tmp/site" timeout "${TRI_TEST_TIMEOUT:-300}" python3 -m pytest -q -x -p no:cacheprovider \
        ${TRI_K:+-k "$TRI_K"} $TRI_TESTS 2>&1 | tail -n 5
    done
  fi
done
AB_TREES="$trees" AB_ROUNDS="${TRI_ROUNDS:-2}" AB_ARGS="${TRI_ARGS:-"--contexts 131072 --batches 1,64 --prefill 0"}" \
  AB_GREP="${TRI_GREP:-"^(decode|prefill) .*triton"}" AB_TIMEOUT="${TRI_TIMEOUT:-300}" exec bash benchmarks/ab_run.sh
