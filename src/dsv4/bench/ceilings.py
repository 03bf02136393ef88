"""The card's measured ceilings: device-to-device copy bandwidth and bf16 matrix rate.

Measured once at the start of a run (CUDA only) and used as the denominators of every "% BW" and
"% MMA" column: datasheet numbers are leads, not what this card does today.

    copy:    dst.copy_(src) of a 2 GiB buffer; bytes moved = read + written = 4 GiB
    matmul:  a @ b, bf16 [8192, 8192] x [8192, 8192] of random values; FLOPs = 2 * 8192^3
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from dsv4.bench.common import BenchOptions
from dsv4.bench.timing import Timer


@dataclass(kw_only=True, slots=True)
class Ceilings:
    copy_gbps: float | None            # 1e9 bytes / s, read + write counted
    mma_tflops: float | None           # 1e12 FLOP / s, bf16 dense matmul
    copy_bytes: int = 0                # bytes moved by one timed copy (read + write)
    copy_us: float | None = None
    matmul_n: int = 0
    matmul_us: float | None = None
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_ceilings(opts: BenchOptions) -> Ceilings:
    """Copy bandwidth and matrix rate of `opts.device`; "n/a" (None) off CUDA."""
    if opts.device.type != "cuda":
        return Ceilings(copy_gbps=None, mma_tflops=None, note=f"n/a on {opts.device.type}: no ceilings measured")
    timer = Timer(opts)
    nbytes = (256 if opts.quick else 2048) * 2**20
    n = 2048 if opts.quick else 8192
    gen = torch.Generator(device=opts.device).manual_seed(opts.seed)
    copy_us, mm_us = _time_copy(timer, opts.device, nbytes, gen), _time_matmul(timer, opts.device, n, gen)
    torch.cuda.empty_cache()
    return Ceilings(copy_gbps=2 * nbytes / copy_us / 1e3, mma_tflops=2 * n**3 / mm_us / 1e6,
                    copy_bytes=2 * nbytes, copy_us=copy_us, matmul_n=n, matmul_us=mm_us,
                    note=f"{torch.cuda.get_device_name(opts.device)}; medians of per-call CUDA event times")


def _time_copy(timer: Timer, device: torch.device, nbytes: int, gen: torch.Generator) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
    dst = torch.empty_like(src)
    return timer.time(lambda: dst.copy_(src)).us


def _time_matmul(timer: Timer, device: torch.device, n: int, gen: torch.Generator) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)   # never zeros: see METHOD
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    return timer.time(lambda: torch.matmul(a, b, out=out)).us
