"""The HCA prefill compression + flush timed as `dsv4 bench` times compress_flush (a 32K prompt in
8K chunks, the L2 flushed and a spin ahead of each chunk, chunks summed, median of runs): the two
kernels (`compress_update`, then `write_entries` with the finish) against the fused kernel
(`kernels.triton.compress_flush`) at several tiles. After each variant the cache pages and the
state are compared with the two-kernel path's (the share of differing bytes, the state's largest
difference). CUDA only.

    python benchmarks/tune_compress_flush.py [--prompt 32768] [--chunk 8192] [--reps 7]
"""

from __future__ import annotations

import argparse
import types

import torch

from dsv4.attention.compressor import layer_finishers
from dsv4.bench import setup as bench_setup
from dsv4.bench.common import LAYER_INDEX, bench_config
from dsv4.bench.timing import Timer
from dsv4.cache.manager import KVCacheManager
from dsv4.kernels.dispatch import ops_for
from dsv4.kernels.triton import compress_flush as cf

DEV = torch.device("cuda")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    cfg, tpb = bench_config(False)
    li = LAYER_INDEX["hca"]
    blk = bench_setup.make_block(cfg, li, DEV, 0)
    comp = blk.compressor
    def fresh_manager() -> KVCacheManager:      # one per variant: the same blocks for the prompt in each
        return KVCacheManager(cfg, max_requests=1, num_blocks=a.prompt // tpb + 8, device=DEV, kv_format="fp8_ds",
                              indexer_format="mxfp4", tokens_per_block=tpb, max_batch_tokens=a.chunk)
    ops = ops_for(DEV, "triton")
    with torch.no_grad():
        x = torch.randn(a.prompt, cfg.hidden_size, device=DEV).to(torch.bfloat16)
        c, z = comp.kv_proj(x), comp.gate_proj(x)
    chunks = [a.chunk] * (a.prompt // a.chunk)
    timer = Timer(types.SimpleNamespace(device=DEV, warmup_ms=10, rep_ms=50, host_warmup=1, host_reps=a.reps,
                                        graph=False))
    fin, _ = layer_finishers(comp, blk.rope, DEV)
    nbytes = 2 * c.numel() * c.element_size()

    def two_kernels(h, c, z):
        entries, req, idx = ops.compress_update(c, z, h.state.comp_state, h.batch.request_slots,
                                                h.batch.start_positions_host, h.batch.query_lens_host, comp.ratio,
                                                False, z_bias=comp.position_bias,
                                                plan=h.batch.compress_plans.get((comp.ratio, False)))
        h.flush_entries(entries, req, idx, fin)

    def fused(finish=fin, **tiles):
        def go(h, c, z):
            b, sch = h.batch, h.schema
            cf.compress_flush(c, z, h.state.comp_state, b.request_slots, b.start_positions_host, b.query_lens_host,
                              comp.ratio, False, h.paged.kv, sch.kv_format, b.block_table, sch.entries_per_block,
                              z_bias=comp.position_bias, plan=b.compress_plans.get((comp.ratio, False)),
                              finish=finish, **tiles)
        return go

    mgr = fresh_manager()

    def one_prompt(fn, region):
        if "p" in mgr.requests:
            mgr.free_request("p")
        mgr.add_request("p")
        t0 = 0
        for n in chunks:
            b = mgr.prepare_forward({"p": n})
            torch.cuda.synchronize()
            h = mgr.acquire(li, b)
            region(lambda h=h, t0=t0, n=n: fn(h, c[t0:t0 + n], z[t0:t0 + n]))
            t0 += n

    def snapshot():                                 # the layer's pages and state after the prompt
        return mgr.paged[li].kv_pages[1:].clone(), mgr.states[li].comp_state.clone()   # not the null block

    variants = [("two kernels", two_kernels), ("fused default", fused()), ("fused default, no finish", fused(None))]
    for tok, rows, bd, w, reg in ((16, 4, 512, 2, 128), (16, 4, 512, 2, 96), (16, 8, 512, 2, 128), (8, 8, 512, 2, 128),
                                  (32, 4, 512, 2, 128), (16, 4, 256, 1, 128), (8, 4, 512, 2, 96)):
        variants.append((f"fused tok={tok} rows={rows} block_d={bd} warps={w} maxnreg={reg}",
                         fused(tok=tok, rows=rows, block_d=bd, num_warps=w, maxnreg=reg)))
    ref = None
    print(f"{'variant':<40} {'µs':>8} {'c, z read':>13}  check (against the first row)")
    for name, fn in variants:
        mgr = fresh_manager()
        t = timer.time_regions(lambda region, fn=fn: one_prompt(fn, region))
        one_prompt(fn, lambda f: f())
        got = snapshot()
        if ref is None:
            ref, check = got, "reference"
        else:
            fin_state = torch.isfinite(ref[1])
            check = (f"pages differ {(got[0] != ref[0]).float().mean().item():.2e}, state max diff "
                     f"{(got[1][fin_state] - ref[1][fin_state]).abs().max().item():.2e}")
        print(f"{name:<40} {t.us:8.1f} {nbytes / (t.us * 1e-6) / 1e9:8.0f} GB/s  {check}", flush=True)


if __name__ == "__main__":
    main()
