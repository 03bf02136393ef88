"""How the L2 flush before a timed call changes what a short, read-bound call measures (CUDA only).

    python benchmarks/l2_flush_check.py

`triton.testing.do_bench` (and the bench's timers until this check) flush the L2 by writing a 256 MB
buffer: the L2 is left full of dirty lines, and the timed call's reads evict them, so DRAM also
writes them back inside the timed region. Flushing by reading a 256 MB buffer instead leaves clean
lines: the call finds nothing of its own in the L2 either way. Per size: the median µs of a read
(x.sum over fp32) and of a copy (read + write) after each flush, and the GB/s they imply.
"""

from __future__ import annotations

import statistics

import torch

DEV = torch.device("cuda")


def timed(fn, flush, reps: int = 50) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps + 5):
        flush()
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b))
    return 1e3 * statistics.median(samples[5:])


def main() -> None:
    buf = torch.ones(64 * 2**20, dtype=torch.float32, device=DEV)         # 256 MB
    flushes = {"write 256 MB (do_bench)": lambda: buf.zero_(),
               "read 256 MB": lambda: buf.sum()}
    print(f"{'op':<6} {'MB':>5}  " + "  ".join(f"{k:>28}" for k in flushes))
    for mb in (16, 32, 64, 128, 512):
        x = torch.randn(mb * 2**18, device=DEV)
        y = torch.empty_like(x)
        for op, fn, moved in (("read", lambda x=x: x.sum(), mb), ("copy", lambda x=x, y=y: y.copy_(x), 2 * mb)):
            cells = []
            for flush in flushes.values():
                us = timed(fn, flush)
                cells.append(f"{us:9.1f} µs {moved * 2**20 / us / 1e3:8.0f} GB/s")
            print(f"{op:<6} {mb:>5}  " + "  ".join(f"{c:>28}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
