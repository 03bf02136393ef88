"""Where a chunked prefill's timed regions lose time (CUDA only): per chunk, the CUDA-event time the
bench sums (`Timer.time_regions`: L2 flushed by a read, the chunk queued behind a spin), the
kernels' summed device time (side streams' overlap counted twice), the device's idle time inside the
region, and the host calls inside it that wait or may wait on the device (synchronize, copies, fills,
cudaMalloc / cudaFree). The last of --runs whole prefills is profiled.

    python benchmarks/prefill_gaps.py [--prefill 65536] [--chunk 8192] [--layer csa] [--runs 4]

A region whose event time exceeds its kernel time by more than launch gaps has the host waiting on
the device inside it: the kernels enqueued after the wait run at the host's pace, not back to back.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from dsv4.bench import setup as bench_setup
from dsv4.bench.common import LAYER_INDEX, bench_config
from dsv4.bench.timing import _flush_buffer
from dsv4.cache.manager import KVCacheManager
from dsv4.cache.schema import block_fill_ratio, blocks_needed, build_schemas

DEV = torch.device("cuda")
#: host calls listed per region: the waits (synchronize), and copies, fills and allocations that may wait
_WAITS = ("Synchronize", "cudaMemcpy", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaMemset")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=65536)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--layer", choices=tuple(LAYER_INDEX), default="csa")
    ap.add_argument("--runs", type=int, default=4, help="whole prefills; the last is profiled")
    ap.add_argument("--spin-ms", type=float, default=20.0)
    args = ap.parse_args()
    cfg, tpb = bench_config(False)
    li = LAYER_INDEX[args.layer]
    blk = bench_setup.make_block(cfg, li, DEV, 0)
    blk.backend = "triton"
    schemas = build_schemas(cfg, tokens_per_block=tpb, kv_format="fp8_ds", indexer_format_name="mxfp4")
    need = blocks_needed(args.prefill, tpb, block_fill_ratio(schemas))
    mgr = KVCacheManager(cfg, max_requests=1, num_blocks=need + 1, device=DEV, kv_format="fp8_ds",
                         indexer_format="mxfp4", tokens_per_block=tpb, max_batch_tokens=args.chunk)
    x = torch.randn(args.prefill, cfg.hidden_size, device=DEV).to(torch.bfloat16)
    flush = _flush_buffer(DEV)
    chunks = range(0, args.prefill, args.chunk)

    def one_run() -> list[tuple[int, float]]:
        if "r" in mgr.requests:
            mgr.free_request("r")
        mgr.add_request("r")
        out = []
        for t0 in chunks:
            n = min(args.chunk, args.prefill - t0)
            b = mgr.prepare_forward({"r": n})
            torch.cuda.synchronize()
            h = bench_setup.acquire(mgr, li, b, "triton")
            a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flush.sum()
            torch.cuda._sleep(int(2e6 * args.spin_ms))
            a.record()
            with torch.profiler.record_function(f"region {t0}"):
                blk(x[t0:t0 + n], b, h)
            e.record()
            e.synchronize()
            out.append((t0, 1e3 * a.elapsed_time(e)))
        return out

    with torch.no_grad():
        for i in range(args.runs - 1):
            print(f"run {i}: {sum(us for _, us in one_run()):.1f} µs of events")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            timed = one_run()
    ev = list(prof.events())
    cpu_kind, gpu_kind = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    regions = sorted((e for e in ev if e.name.startswith("region ") and e.device_type == cpu_kind),
                     key=lambda e: e.time_range.start)
    # (the profiler also puts each region on the device's timeline as an annotation: not a kernel)
    gpu = sorted((e for e in ev if e.device_type == gpu_kind and not e.name.startswith("region ")),
                 key=lambda e: e.time_range.start)
    host = [e for e in ev if e.device_type == cpu_kind and any(w in e.name for w in _WAITS)]
    spins = [g for g in gpu if "sleep" in g.name.lower() or "spin" in g.name.lower()]
    print(f"{args.layer} prefill of {args.prefill} in chunks of {args.chunk}: µs per chunk")
    print(f"{'from':>7} {'event':>9} {'kernels':>9} {'idle':>8} {'host':>8}  host calls inside the region")
    total = [0.0, 0.0, 0.0]
    for (t0, us), r, spin in zip(timed, regions, spins, strict=True):
        lo, hi = r.time_range.start, r.time_range.end
        # the region on the device: from the spin's end for the event time the bench counts
        d0 = spin.time_range.end
        ks = [g for g in gpu if d0 <= g.time_range.start < d0 + us]
        busy = sum(g.time_range.end - g.time_range.start for g in ks)
        idle, last = 0.0, d0
        for g in ks:
            idle += max(0.0, g.time_range.start - last)
            last = max(last, g.time_range.end)
        waits = Counter(e.name for e in host if lo <= e.time_range.start <= hi)
        print(f"{t0:7d} {us:9.1f} {busy:9.1f} {idle:8.1f} {hi - lo:8.1f}  "
              + ", ".join(f"{k} x{v}" for k, v in waits.most_common(6)))
        total[0] += us
        total[1] += busy
        total[2] += idle
    print(f"{'sum':>7} {total[0]:9.1f} {total[1]:9.1f} {total[2]:8.1f}")


if __name__ == "__main__":
    main()
