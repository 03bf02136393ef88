"""The indexer scan's memory floor (CUDA, sm_90): a Gluon kernel that copies the scan's pages exactly as
`indexer_scan_tma` does (same grid, block-table lookups, TMA copies of key words and scale words, stages
refilled as they are read) and does nothing with them, timed beside the scan itself on the same cache.

    CTX=131072 BATCHES=64,32 python benchmarks/scan_floor.py

Prints µs of the scan (default settings) and of the copies alone per (stages, programs a request), and
the GB/s of the copied bytes. Times are CUDA-graph replays with the L2 flushed (`dsv4.bench.timing.Timer`).
"""

from __future__ import annotations

import os
import types

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from dsv4.bench import setup as bs
from dsv4.bench.common import LAYER_INDEX, bench_config
from dsv4.bench.timing import Timer
from dsv4.kernels.triton import indexer_scan_tma as ts
from dsv4.kernels.triton import indexer_scores as sc
from dsv4.kernels.triton.decode_attention_wide import _barrier
from dsv4.kernels.triton.decode_common import sm_count


@gluon.jit
def _copy_kernel(out_ptr, d_desc, s_desc, bt_ptr, nent_ptr, s_bt, max_blocks, NS: gl.constexpr):
    b = gl.program_id(0)
    p0 = gl.program_id(1)
    step = gl.num_programs(1)
    n_b = gl.load(nent_ptr + b)
    mine = gl.cdiv(gl.maximum(gl.cdiv(n_b, ts._EPB) - p0, 0), step)
    raw_d = gl.allocate_shared_memory(gl.int32, [NS, 1, ts._EPB, 16], d_desc.layout)
    raw_s = gl.allocate_shared_memory(gl.int32, [NS, 1, ts._EPB], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()
    bt_row = bt_ptr + b.to(gl.int64) * s_bt
    for i in gl.static_range(NS):
        if i < mine:
            ts._issue(raw_d, raw_s, ready, d_desc, s_desc, i, ts._block(bt_row, p0 + i * step, max_blocks))
    for it in range(0, mine):
        s = it % NS
        blk = ts._block(bt_row, p0 + (it + NS) * step, max_blocks)
        mbarrier.wait(ready.index(s), (it // NS) & 1)
        _barrier()
        if it + NS < mine:
            ts._issue(raw_d, raw_s, ready, d_desc, s_desc, s, blk)
    gl.store(out_ptr + b * step + p0, mine)


def _case(timer: Timer, cfg, tpb: int, ctx: int, bsz: int, dev: torch.device) -> None:
    st = bs.build_decode_state(cfg, context=ctx, batch=bsz, device=dev, tokens_per_block=tpb,
                               kv_format="fp8_ds", indexer_format="mxfp4")
    mgr, b = st.mgr, st.batch
    sch, pool = mgr.schemas[LAYER_INDEX["csa"]], mgr.paged[LAYER_INDEX["csa"]]
    ifmt = sch.indexer_format
    typed = ifmt.typed(pool.indexer)
    nent, nmax = b.seq_lens // sch.compress_ratio, b.seq_len_bound // sch.compress_ratio
    gen = torch.Generator(device=dev).manual_seed(1)
    q = ifmt.round_query(ifmt.to_stored_basis(torch.randn(bsz, 64, 128, device=dev, generator=gen)))
    w = torch.randn(bsz, 64, device=dev, generator=gen)
    scan = timer.time(lambda: sc.paged_indexer_scores(q, w, pool.indexer, ifmt, b.block_table, nent, nmax,
                                                       sch.entries_per_block), graph=True)
    pages = int(triton.cdiv(nent, ts.EPB).sum())
    gbytes = pages * ts.EPB * 68 / 1e9
    print(f"B={bsz} C={ctx}: {pages} pages, {gbytes * 1e3:.1f} MB; scan {scan.us:.1f} µs "
          f"({gbytes / scan.us * 1e6:.0f} GB/s)", flush=True)
    d_desc, s_desc = ts._descriptors(typed["data"], typed["scale"])

    def copies(stages: int, progs: int) -> None:
        out = torch.empty(bsz, progs, dtype=torch.int32, device=dev)
        _copy_kernel[(bsz, progs)](out, d_desc, s_desc, b.block_table, nent, b.block_table.stride(0),
                                   b.block_table.shape[1], NS=stages, num_warps=4)

    for stages in (2, 3, 4):
        for per_sm in (8, 16, 24):
            progs = max(1, triton.cdiv(per_sm * sm_count(dev), bsz))
            t = timer.time(lambda stages=stages, progs=progs: copies(stages, progs), graph=True)
            print(f"  copies alone, {stages} stages, {progs} programs a request: {t.us:6.1f} µs "
                  f"({gbytes / t.us * 1e6:.0f} GB/s)", flush=True)


def main() -> int:
    dev = torch.device("cuda")
    ctx = int(os.environ.get("CTX", 131072))
    timer = Timer(types.SimpleNamespace(device=dev, warmup_ms=10, rep_ms=50, host_warmup=3, host_reps=15, graph=True))
    cfg, tpb = bench_config(False)
    for bsz in (int(x) for x in os.environ.get("BATCHES", "64").split(",")):
        _case(timer, cfg, tpb, ctx, bsz, dev)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
