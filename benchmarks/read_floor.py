"""The read floor of a prefill chunk's compression (CUDA only): how long a plain streaming read of
the compressor inputs of one chunk takes, timed as `dsv4 bench` times compress_flush (L2 flushed
by a 256 MB read, then CUDA events around the one kernel).

    python benchmarks/read_floor.py [--chunks 8192,32768]

Per chunk size and layer kind: the bf16 projections c, z (and CSA's indexer ic, iz) of one chunk
as one buffer of the same bytes, read by a Triton kernel (16-byte loads, a few KB per program,
one partial sum stored per program) and by torch's sum; the µs, the GB/s and the % of the copy
ceiling, and what compress_flush of a 32K prompt would read as (% of bandwidth, the bench's byte
count) if it took no more than these reads: a ceiling no compressor of these chunks can pass.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from dsv4.bench.common import bench_config
from dsv4.bench.counts import Geometry, prefill_work

DEV = torch.device("cuda")
PROMPT = 32768


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * UNROLL
    acc = tl.zeros([BLOCK], tl.float32)
    for u in tl.static_range(UNROLL):
        o = base + u * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + o, mask=o < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def triton_read(x: torch.Tensor, block: int = 2048, unroll: int = 4) -> torch.Tensor:
    grid = triton.cdiv(x.numel(), block * unroll)
    out = torch.empty(grid, dtype=torch.float32, device=x.device)
    _read_kernel[(grid,)](x, out, x.numel(), BLOCK=block, UNROLL=unroll, num_warps=8)
    return out


def timed_us(fn, reps: int = 60) -> float:
    flush = torch.ones(64 * 2**20, dtype=torch.int32, device=DEV)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    samples = []
    for _ in range(reps):
        flush.sum()
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(1e3 * a.elapsed_time(b))
    return statistics.median(samples)


def copy_gbps() -> float:
    """The bench's copy ceiling: dst.copy_(src) of 2 GiB, read + write counted."""
    src = torch.empty(2**30, dtype=torch.int16, device=DEV).random_()
    dst = torch.empty_like(src)
    us = timed_us(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() * 2 / us / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="8192,32768")
    args = ap.parse_args()
    cfg, _ = bench_config(False)
    ceiling = copy_gbps()
    print(f"copy ceiling {ceiling:,.0f} GB/s")
    print(f"{'layer':5} {'chunk':>6} {'MB read':>8} {'reader':8} {'µs':>7} {'GB/s':>7} {'% BW':>5} "
          f"{'32K prompt µs':>13} {'compress_flush % BW at most':>28}")
    for chunk in (int(c) for c in args.chunks.split(",")):
        for kind in ("csa", "hca"):
            geo = Geometry.of(cfg, kind, "fp8_ds", "mxfp4")
            cols = sum(2 * width for _, _, width, _, _ in geo.compressors())       # c and z of each compressor
            x = torch.randn(chunk, cols, device=DEV).to(torch.bfloat16)
            cf_bytes = prefill_work(geo, PROMPT, chunk)["compress_flush"].total_bytes
            for name, fn in (("triton", lambda x=x: triton_read(x)), ("torch", lambda x=x: x.sum())):
                us = timed_us(fn)
                gbps = x.numel() * 2 / us / 1e3
                prompt_us = us * PROMPT / chunk
                cf_pct = 100 * cf_bytes / prompt_us / 1e3 / ceiling
                print(f"{kind:5} {chunk:6d} {x.numel() * 2 / 1e6:8.1f} {name:8} {us:7.1f} {gbps:7,.0f} "
                      f"{100 * gbps / ceiling:5.1f} {prompt_us:13.1f} {cf_pct:28.1f}")


if __name__ == "__main__":
    main()
