"""Does an L2 prefetch during a latency-bound stretch shorten the projection after it? (CUDA only)

    python benchmarks/l2_prefetch_check.py [--gaps 16,40] [--sizes 0,16,24,32,40,48]

The idea: a batch-1 decode step's scan / top-k / attention chain leaves DRAM mostly idle, so a side
branch could pull the output projection's weight into the L2 meanwhile. Two prefetchers: one
`cp.async.bulk.prefetch.L2` per thread (sm_90: the TMA unit fetches, nothing returns to the SM, the
kernel ends at once) and a plain read of the bytes (`read_floor.triton_read`).

First the mechanism alone: CUDA events around a plain read of the first 8-48 MB of W_oa, queued
behind a 40 µs spin while a side stream prefetched them (or not). Then the projections: each case
is one CUDA graph, timed as `dsv4 bench` times decode (L2 flushed by a read before each
replay): a spin of `gap` µs on the main stream stands for the step's latency-bound chain (scan,
top-k, attention), then the V4-Flash o_a product (8 groups of [1024, 4096] bf16, 64 MB) and W_ob
(4096 x 8192, 64 MB) at batch 1, as `grouped_output` runs them. A side branch forked at the start
prefetches the first `size` MB of W_oa with the bulk prefetcher. Printed: the graph's time minus
the spin's alone, per size (a spin counts SM cycles, so its length moves a little with the clock).
"""

from __future__ import annotations

import argparse
import types

import torch
import triton
import triton.language as tl

from dsv4.attention.layers import grouped_output
from dsv4.bench.timing import Timer
from dsv4.kernels.triton import gemv

DEV = torch.device("cuda")

#: bytes per prefetch instruction (a multiple of 16) and threads per program
PIECE, THREADS = 16384, 128


@triton.jit
def _prefetch_kernel(ptr, nbytes, PIECE: tl.constexpr, THREADS: tl.constexpr):
    off = (tl.program_id(0).to(tl.int64) * THREADS + tl.arange(0, THREADS)) * PIECE
    size = tl.minimum(nbytes - off, PIECE).to(tl.int32)
    addr = ptr.to(tl.int64) + off
    # size <= 0 past the end: predicated off. The asm has a side effect (not pure): it stays.
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(weight: torch.Tensor, nbytes: int) -> None:
    """Hint the L2 to fetch the first nbytes of `weight` (contiguous, 16-byte aligned; sm_90+)."""
    n = min(nbytes, weight.numel() * weight.element_size()) // 16 * 16
    if n > 0:
        _prefetch_kernel[(triton.cdiv(n, PIECE * THREADS),)](weight, n, PIECE=PIECE, THREADS=THREADS,
                                                              num_warps=THREADS // 32)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gaps", default="16,40")
    ap.add_argument("--sizes", default="0,16,24,32,40,48")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    timer = Timer(types.SimpleNamespace(device=DEV, warmup_ms=10, rep_ms=50, host_warmup=3, host_reps=15,
                                        graph=True))
    gen = torch.Generator(device=DEV).manual_seed(0)
    w_a = (torch.randn(8 * 1024, 4096, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    w_b = (torch.randn(4096, 8192, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    o = torch.randn(1, 64, 512, device=DEV, generator=gen).to(torch.bfloat16)
    # grouped_output reads a module's .weight and runs the projections through ops.linear
    mod_a, mod_b = types.SimpleNamespace(weight=w_a), types.SimpleNamespace(weight=w_b)
    ops = types.SimpleNamespace(linear=gemv.linear)
    side = torch.cuda.Stream()
    cycles_per_us = 1800            # the spin counts SM clock cycles (~1.8-2.0 GHz under load)

    def case(gap: int, size_mb: int):
        def fn():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch_l2(w_a, size_mb << 20)
            torch.cuda._sleep(gap * cycles_per_us)
            grouped_output(o, mod_a, mod_b, 8, ops)
            main.wait_stream(side)
        return fn

    # the mechanism alone: CUDA events around a plain read of the first `size` MB, queued behind a
    # 40 µs spin on the main stream while a side stream prefetched (or read) those bytes
    from read_floor import triton_read
    flush = torch.ones(64 << 20, dtype=torch.int32, device=DEV)
    for size in (8, 16, 32, 48):
        part = w_a.view(-1)[: (size << 20) // 2]
        row = []
        for pre in ("none", "bulk", "loads", "none", "bulk", "loads"):
            ts = []
            for _ in range(25):
                flush.sum()
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    if pre == "bulk":
                        prefetch_l2(part, size << 20)
                    elif pre == "loads":
                        triton_read(part)
                torch.cuda._sleep(40 * cycles_per_us)
                main.wait_stream(side)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                triton_read(part)
                b.record()
                b.synchronize()
                ts.append(1e3 * a.elapsed_time(b))
            row.append(f"{pre} {sorted(ts)[len(ts) // 2]:5.1f}")
        print(f"read {size} MB (µs): " + "  ".join(row), flush=True)
    for gap in (int(g) for g in args.gaps.split(",")):
        spin = min(timer.time(lambda g=gap: torch.cuda._sleep(g * cycles_per_us), graph=True).us for _ in range(2))
        print(f"\nspin {gap} µs (measured {spin:.1f}); o_a + W_ob at batch 1 after it, µs:")
        for _ in range(args.rounds):
            row = []
            for size in (int(s) for s in args.sizes.split(",")):
                tm = timer.time(case(gap, size), graph=True)
                note = "" if tm.mode == "graph" else f" ({tm.mode}: {tm.note})"
                row.append(f"{size} MB {tm.us - spin:6.1f}{note}")
            print("  " + "   ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
