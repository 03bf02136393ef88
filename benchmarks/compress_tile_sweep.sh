#!/usr/bin/env bash
# The prefill compress_flush rows of `dsv4 bench` with other tiles for the HCA compressor, one process per
# variant on one machine (benchmarks/NOTES.md, thirty-eighth round). From the repo root on a CUDA machine:
#   VARIANTS="default 2,64,2,16,8 default" bash benchmarks/compress_tile_sweep.sh
# A variant is "default", "prefetch" (the chunk's c and z asked into the L2 first: `l2_prefetch`) or "segs,block_d,block_s,split,num_warps" (`compress._tiles` for windows of 64
# slots or more; block_s is the most slots a group takes at a time). LAYERS=csa,hca times both rows.
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1
for v in ${VARIANTS:-default 2,64,2,16,8 default 2,64,2,16,8}; do
  echo "=== $v"
  timeout "${SWEEP_TIMEOUT:-120}" python3 -c "
import sys
import dsv4.kernels.triton.compress as c
if '$v' == 'prefetch':      # the chunk's c and z asked into the L2 before the compressor
    from dsv4.kernels.triton.prefetch import l2_prefetch
    run = c.compress_update
    def pre(cc, zz, *a, **k):
        if a[4] >= 64 and cc.is_contiguous() and zz.is_contiguous():
            l2_prefetch([cc, zz], 1 << 40)
        return run(cc, zz, *a, **k)
    c.compress_update = pre
elif '$v' != 'default':
    tile = tuple(int(x) for x in '$v'.split(','))
    base = c._tiles
    c._tiles = lambda d, ns, cuda: (tile[0], tile[1], tile[2], tile[3], tile[4]) if cuda and ns >= 64 else base(d, ns, cuda)
import dsv4.bench as b
sys.exit(b.main(sys.argv[1:]))" --no-decode --prefill 32768 --layers "${LAYERS:-hca}" --backends triton --no-reference \
    --no-hf --warmup-ms 10 --rep-ms 50 2>&1 | grep -E "compress_flush|Traceback|Error" | grep -v "^ *$"
done
