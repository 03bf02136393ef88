"""Per-kernel device time of one decode step of each layer and of one prefill chunk's compression
(CUDA only): where the time of a step goes, kernel by kernel.

    python benchmarks/profile_step.py [--context 131072] [--batches 1,64] [--chunk 8192 (0: no prefill)] [--fp8-weights]
                                      [--timeline] [--graph]
    ncu --profile-from-start off --clock-control none -k regex:NAME python benchmarks/profile_step.py --ncu ...

Decode: the whole AttentionSubBlock step (Triton ops) at V4-Flash shapes on a synthetic cache
(`dsv4.bench.setup.build_decode_state`); prefill: compress_and_flush (state update on the bf16
projections, RMSNorm, RoPE) + write_entries of one chunk for each compressor, and with
--prefill-layer the whole sub-block on the chunk. Each is run eagerly under `torch.profiler`
after warm-up; the table lists every kernel with its launches and summed device time per step,
and the step's kernel count.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from dsv4.bench import setup as bench_setup
from dsv4.bench.common import LAYER_INDEX, bench_config
from dsv4.bench.timing import _flush_buffer
from dsv4.cache.manager import KVCacheManager
from dsv4.kernels.dispatch import ops_for

DEV = torch.device("cuda")


NCU = False   # --ncu: no torch profiler; one step inside cudaProfilerStart / Stop for Nsight Compute
GRAPH = False  # --graph: profile replays of the step captured in a CUDA graph (as the bench times it)


def kernel_table(title: str, fn: Callable[[], Any], steps: int = 5, timeline: bool = False) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if GRAPH:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        fn = graph.replay
        fn()
        torch.cuda.synchronize()
    if NCU:     # ncu --profile-from-start off: it sees exactly one warm step of each table
        print(f"\n## ncu: {title}")
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    if timeline:
        print_timeline(title, fn)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    calls: dict[str, int] = defaultdict(int)
    us: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:90]
            calls[name] += 1
            us[name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    total = sum(us.values()) / steps
    n = sum(calls.values()) / steps
    print(f"\n## {title}: {n:.0f} kernels, {total:.1f} µs of kernel time per step")
    for name in sorted(us, key=us.get, reverse=True):
        print(f"{us[name] / steps:9.1f} µs  {calls[name] / steps:5.1f}x  {name}")


def print_timeline(title: str, fn: Callable[[], Any]) -> None:
    """One step as the bench times it (`bench.timing.Timer`: the L2 flushed by a 256 MB read, which
    leaves it clean, then the step queued behind a spin kernel so its launches run back to back):
    every kernel's start after the spin's end, its duration, and the idle gap before it (on any
    stream). A flush by a write (this tool's first form) leaves the L2 full of dirty lines that the
    step's first reads must write back: H100, HCA 8K chunk, compressor 12.3 µs after it."""
    flush = _flush_buffer(DEV)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush.sum()
        torch.cuda._sleep(20_000_000)          # ~10 ms: the step's launches queue up behind it
        fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    spin = max((i for i, e in enumerate(ev) if "sleep" in e.name.lower() or "spin" in e.name.lower()), default=1)
    t0 = busy_end = ev[spin].time_range.end if ev else 0.0
    ev = ev[spin + 1:]
    if not ev:
        return
    print(f"\n## timeline: {title} (L2 flushed by a read; start after the spin, duration, idle before, µs)")
    for e in ev:
        s, d = e.time_range.start - t0, e.time_range.end - e.time_range.start
        idle = max(0.0, e.time_range.start - busy_end)
        busy_end = max(busy_end, e.time_range.end)
        print(f"{s:9.1f} {d:8.1f} {idle:7.1f}  {e.name[:80]}")
    print(f"span {busy_end - t0:.1f} µs after the spin")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--prefill-layer", action="store_true", help="also profile the whole layer on the chunk")
    ap.add_argument("--prefill-after", type=int, default=0,
                    help="the layer's chunk comes after this many cached tokens (run through the layer first)")
    ap.add_argument("--timeline", action="store_true", help="also print one step's kernels in time order")
    ap.add_argument("--fp8-weights", action="store_true",
                    help="the decode layers' projections as FP8 blocks (the bench's triton-fp8w layer)")
    ap.add_argument("--ncu", action="store_true",
                    help="run one warm step per table between cudaProfilerStart / Stop, no torch profiler "
                         "(under `ncu --profile-from-start off`)")
    ap.add_argument("--graph", action="store_true", help="profile CUDA-graph replays of each decode step")
    args = ap.parse_args()
    global NCU, GRAPH
    NCU = args.ncu
    cfg, tpb = bench_config(False)
    blocks = {k: bench_setup.make_block(cfg, i, DEV, 0) for k, i in LAYER_INDEX.items()}
    if args.fp8_weights:
        for blk in blocks.values():
            blk.quantize_weights()
    ops = ops_for(DEV, "triton")
    with torch.no_grad():
        for batch in (int(b) for b in args.batches.split(",") if b):
            st = bench_setup.build_decode_state(cfg, context=args.context, batch=batch, device=DEV,
                                                tokens_per_block=tpb, kv_format="fp8_ds", indexer_format="mxfp4",
                                                seed=0)
            for kind, li in LAYER_INDEX.items():
                blk = blocks[kind]
                blk.backend = "triton"
                h = bench_setup.acquire(st.mgr, li, st.batch, "triton")
                GRAPH = args.graph
                kernel_table(f"decode {kind} layer C={args.context} B={batch}{' FP8 weights' * args.fp8_weights}"
                             f"{' (graph)' * args.graph}",
                             lambda blk=blk, st=st, h=h: blk(st.x, st.batch, h), timeline=args.timeline)
                GRAPH = False
            st = None
            torch.cuda.empty_cache()
        n = args.chunk
        for kind, li in LAYER_INDEX.items() if n else ():
            mgr = KVCacheManager(cfg, max_requests=1, num_blocks=64, device=DEV, kv_format="fp8_ds",
                                 indexer_format="mxfp4", tokens_per_block=tpb, max_batch_tokens=n)
            mgr.add_request("r")
            b = mgr.prepare_forward({"r": n})
            torch.cuda.synchronize()
            comp = blocks[kind].compressor
            x = torch.randn(n, cfg.hidden_size, device=DEV).to(torch.bfloat16)
            proj = {"c": comp.kv_proj(x), "z": comp.gate_proj(x)}
            if comp.overlap:
                proj.update(ic=comp.indexer.kv_proj(x), iz=comp.indexer.gate_proj(x))

            from dsv4.bench.prefill import compress_flush  # here: older trees (A/B runs) lack it

            def chunk(proj=proj, b=b, mgr=mgr, li=li, blk=blocks[kind]) -> None:
                compress_flush(blk, proj, b, mgr, li, ops)

            kernel_table(f"prefill {kind} compress_and_flush, chunk {n} (from position 0)", chunk,
                         timeline=args.timeline)
            if args.prefill_layer:    # the whole sub-block on the chunk (repeated: same shapes, same work)
                blk = blocks[kind]
                blk.backend = "triton"
                after = args.prefill_after
                if after:
                    mgr = KVCacheManager(cfg, max_requests=1, num_blocks=(after + n) // tpb + 4, device=DEV,
                                         kv_format="fp8_ds", indexer_format="mxfp4", tokens_per_block=tpb,
                                         max_batch_tokens=max(after, n))
                    mgr.add_request("r")
                    b0 = mgr.prepare_forward({"r": after})
                    blk(torch.randn(after, cfg.hidden_size, device=DEV).to(torch.bfloat16), b0,
                        bench_setup.acquire(mgr, li, b0, "triton"))
                    torch.cuda.synchronize()        # the next plan reuses the pinned host buffers
                    b = mgr.prepare_forward({"r": n})
                h = bench_setup.acquire(mgr, li, b, "triton")
                kernel_table(f"prefill {kind} layer, chunk {n} after {after}", lambda blk=blk, x=x, b=b, h=h:
                             blk(x, b, h), steps=2)

if __name__ == "__main__":
    main()
