"""The Hadamard butterfly inside Triton kernels: twin of `reference.quant.fwht`, the same fp32 adds
in the same order (stages H = 1, 2, 4, ..), then one multiply by SCALE = fp32(1/sqrt(N)), so a
kernel's result is bit for bit the reference's. Used by the indexer-key writes (`encode`) and
the indexer queries (`norm_rope(hadamard=True)`)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _butterfly(x, ROWS: tl.constexpr, N: tl.constexpr, H: tl.constexpr):
    """One stage on each row of x [ROWS, N]: pairs (a, b) = (x[i], x[i + H]), bit H of i clear ->
    (a + b, a - b)."""
    pairs = tl.permute(tl.reshape(x, (ROWS, N // (2 * H), 2, H)), (0, 1, 3, 2))    # [.., H, 2]: (a, b) last
    a, b = tl.split(pairs)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, N))


@triton.jit
def fwht_rows(x, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr, SCALE: tl.constexpr):
    """x [ROWS, N] fp32 -> each row times H_N (N a power of two)."""
    for s in tl.static_range(LOG_N):
        x = _butterfly(x, ROWS, N, 1 << s)
    return x * SCALE


def fwht_constants(n: int) -> dict[str, int | float]:
    """LOG_N and SCALE of `fwht_rows` for rows of n (a power of two): the scale rounded to fp32,
    as the reference's fp32 multiply uses it."""
    return {"LOG_D": n.bit_length() - 1, "HSCALE": float(torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32))}
