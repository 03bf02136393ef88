"""Triton fused RMSNorm + partial RoPE (twin of `reference.norm_rope.norm_rope`): one kernel where
PyTorch runs ~14 small ones, which matters in a decode step of a few tokens; and the rotary
cos/sin of a step's positions (twin of `reference.norm_rope.rope_cos_sin`): one kernel for six.

One program per block of rows; a row is one D-vector (a head of a token, or a token). The row's
channels are loaded as interleaved (even, odd) pairs so the rotation needs no shuffles:

    pair i: (x[2i], x[2i+1]);   pairs i >= (D - r)/2 rotate by (cos[t, j], sin[t, j]), j = i - (D - r)/2

r = 0 (cos/sin [N, 0]) is a plain RMSNorm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.errors import InputError
from dsv4.kernels.triton.encode import FORMAT_ID, round_bf16, round_rows
from dsv4.kernels.triton.hadamard import fwht_constants, fwht_rows

#: rows a program for Hadamard-rotated rows, from HADAMARD_BLOCK_MIN_ROWS rows (`norm_rope`)
HADAMARD_BLOCK_ROWS = 16
HADAMARD_BLOCK_MIN_ROWS = 1 << 16


@triton.jit
def rotated_rows_rms(ptrs, mask, d, cos_row, sin_row, eps, D: tl.constexpr, HALF_R: tl.constexpr,
                     BLOCK_P: tl.constexpr):
    """Rows [R, 2 BLOCK_P] of one token at ptrs (channel d [1, 2 BLOCK_P] along axis 1; 0 where masked)
    -> (RoPE_t(row) in fp32, 1 / sqrt(mean(row^2) + eps) [R]): `_norm_rope_kernel`'s RMSNorm (no
    weight) and rotation with the norm's factor left apart, for a kernel that applies it to what it
    computes from the rows (RoPE_t(RMSNorm_1(x)) = inv RoPE_t(x)).

    Every load here is contiguous along the channels, so the tile keeps a row-major layout: pairs
    split in registers, a partner gathered at d ^ 1 or cos / sin gathered per channel gave it a
    column-major one, which the shared-memory copy of an attention kernel's q operand inherited
    (sm_90: 128 -> 208 registers). Partners come from loads one channel either side (L1 hits), the
    per-pair cos / sin are loaded once per pair and interleaved."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    if HALF_R > 0:
        nxt = tl.load(ptrs + 1, mask=mask & (d + 1 < D), other=0.0).to(tl.float32)
        prv = tl.load(ptrs - 1, mask=mask & (d > 0), other=0.0).to(tl.float32)
        j = tl.arange(0, BLOCK_P) - (D // 2 - HALF_R)  # rotated pair of pair p
        rot = (j >= 0) & (j < HALF_R)
        c = tl.load(cos_row + j, mask=rot, other=1.0)
        s = tl.load(sin_row + j, mask=rot, other=0.0)
        c = tl.reshape(tl.join(c, c), (1, 2 * BLOCK_P))
        s = tl.reshape(tl.join(-s, s), (1, 2 * BLOCK_P))
        x = x * c + tl.where(d % 2 == 0, nxt, prv) * s  # even: x c - x' s; odd: x c + x' s
    return x, inv


@triton.jit
def _norm_rope_kernel(x_ptr, x_s0, x_s1, w_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, heads, eps,
                      D: tl.constexpr, HALF_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                      NORMALIZE: tl.constexpr, WEIGHTED: tl.constexpr, INVERSE: tl.constexpr, HAD: tl.constexpr,
                      LOG_D: tl.constexpr, HSCALE: tl.constexpr, ROUND: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = rows < n_rows
    p = tl.arange(0, BLOCK_P)                       # pair index
    pmask = p < D // 2
    d = tl.arange(0, 2 * BLOCK_P)
    m = rmask[:, None] & (d < D)[None, :]
    r64 = rows.to(tl.int64)
    src = ((r64 // heads) * x_s0 + (r64 % heads) * x_s1)[:, None] + d[None, :]
    base = rows.to(tl.int64)[:, None] * D + d[None, :]
    # the row in contiguous vectors, split into its pairs in registers (two stride-2 loads
    # were scalar loads: H200, q of an 8K prefill chunk [8192, 64, 512] bf16, ~2x the time)
    x = tl.load(x_ptr + src, mask=m, other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, (BLOCK_ROWS, BLOCK_P, 2)))
    if NORMALIZE:
        ms = (tl.sum(even * even, axis=1) + tl.sum(odd * odd, axis=1)) / D
        inv = 1.0 / tl.sqrt(ms + eps)
        even = even * inv[:, None]
        odd = odd * inv[:, None]
        if WEIGHTED:
            w_even, w_odd = tl.split(tl.reshape(tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32),
                                                (BLOCK_P, 2)))
            even = even * w_even[None, :]
            odd = odd * w_odd[None, :]
    if HALF_R > 0:
        first = D // 2 - HALF_R                     # first rotated pair
        j = p - first
        rot = (j >= 0) & pmask
        t = (rows // heads).to(tl.int64)
        cm = rmask[:, None] & rot[None, :]
        c = tl.load(cos_ptr + t[:, None] * HALF_R + j[None, :], mask=cm, other=1.0)
        s = tl.load(sin_ptr + t[:, None] * HALF_R + j[None, :], mask=cm, other=0.0)
        if INVERSE:
            s = -s
        new_even = even * c - odd * s
        odd = odd * c + even * s
        even = new_even
    x = tl.reshape(tl.join(even, odd), (BLOCK_ROWS, 2 * BLOCK_P))
    if HAD:     # rows times H_D (D a power of two: no padding)
        x = fwht_rows(x, BLOCK_ROWS, D, LOG_D, HSCALE)
        if ROUND >= 0:
            x = round_rows(x, ROUND, BLOCK_ROWS, D)
    elif ROUND >= 0:        # bf16 only (every other rounded format is Hadamard-rotated): elementwise
        x = round_bf16(x)
    tl.store(out_ptr + base, x.to(out_ptr.dtype.element_ty), mask=m)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, *,
              normalize: bool = True, inverse: bool = False, out_dtype: torch.dtype | None = None,
              hadamard: bool = False, round_to: str | None = None, block_rows: int | None = None,
              num_warps: int | None = None) -> torch.Tensor:
    """Same contract as `dsv4.kernels.reference.norm_rope.norm_rope`. x may have any token and head
    strides (a column slice of a wider projection is read in place); channels must be contiguous.
    hadamard: the butterfly of `hadamard.fwht_rows` after the rotation (bit for bit the reference's
    `quant.fwht` of the same rows), one kernel where the matmul took a second. round_to: then
    `encode.round_rows` (bit for bit `quant.round_query`) in the same kernel. block_rows, num_warps:
    rows a program and its warps (tuning; `benchmarks/norm_rope_sweep.py`)."""
    d = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    n_rows = x.numel() // d
    if n_rows == 0:
        return out
    half_r = cos.shape[-1]
    if hadamard and d & (d - 1):
        raise InputError(f"norm_rope(hadamard=True) needs a power-of-two row size, got {d}")
    rnd = -1 if round_to in (None, "fp32_i") else FORMAT_ID[round_to]
    if rnd >= 0 and not hadamard and round_to != "bf16_i":
        raise InputError(f"norm_rope(round_to={round_to!r}) rounds Hadamard-rotated rows (hadamard=True)")
    # Hadamard rows of a prefill chunk (the CSA indexer's queries, [8K, 64, 128]) 16 a program: the
    # butterfly's layout shuffles amortise over more rows (H100, 268 MB: 254 -> 186 µs; 4 rows a
    # program stay best for the other shapes and for a decode step's few rows)
    block_rows = block_rows or (HADAMARD_BLOCK_ROWS if hadamard and n_rows >= HADAMARD_BLOCK_MIN_ROWS else 4)
    _norm_rope_kernel[(triton.cdiv(n_rows, block_rows),)](
        x, x.stride(0), x.stride(1) if x.dim() == 3 else 0, weight if weight is not None else x,
        cos.float().contiguous(), sin.float().contiguous(), out, n_rows, heads, eps, D=d, HALF_R=half_r,
        BLOCK_P=triton.next_power_of_2(d // 2), BLOCK_ROWS=block_rows, NORMALIZE=normalize,
        WEIGHTED=weight is not None, INVERSE=inverse, HAD=hadamard, ROUND=rnd, **fwht_constants(d),
        **({"num_warps": num_warps} if num_warps else {}))
    return out


@triton.jit
def _cos_sin_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, n, scale, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                    BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    pos = tl.maximum(tl.load(pos_ptr + i, mask=i < n, other=0).to(tl.int64), 0) * scale
    ang = pos.to(tl.float64)[:, None] * tl.load(inv_ptr + j, mask=jm, other=0.0)[None, :]
    m = (i < n)[:, None] & jm[None, :]
    dst = i.to(tl.int64)[:, None] * HALF + j[None, :]
    tl.store(cos_ptr + dst, tl.cos(ang).to(tl.float32), mask=m)
    tl.store(sin_ptr + dst, tl.sin(ang).to(tl.float32), mask=m)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scale: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `dsv4.kernels.reference.norm_rope.rope_cos_sin` (fp64 angles and cos/sin)."""
    n, half = positions.numel(), inv_freq.shape[0]
    cos = torch.empty(*positions.shape, half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if n:
        block = 32
        _cos_sin_kernel[(triton.cdiv(n, block),)](positions.contiguous(), inv_freq, cos, sin, n, scale, HALF=half,
                                                  BLOCK_HALF=triton.next_power_of_2(max(half, 1)), BLOCK=block)
    return cos, sin
