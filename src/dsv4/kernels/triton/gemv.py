"""Triton twin of `reference.linear.linear` for one token: y = x W^T with x [1, K], the projections
of a batch-1 decode step.

A batch-1 projection reads its weight once and does nothing else: it is a stream over W. Here
each program takes BLOCK_N whole rows of W (contiguous K) and walks K in BLOCK_K steps, summing
the fp32 products; no split-K, so no second kernel to reduce partial sums. cuBLAS picks split-K
kernels plus a reduction kernel for the wide-K projections of V4-Flash (K 4096 / 8192).

First measured (H200, bf16, one call with the L2 flushed, triton.testing.do_bench): the CSA layer's
fused input projection (N 4160, K 4096) 16.7 µs vs cuBLAS 19.3; the output projection (N 4096,
K 8192) 26.4 vs 29.2, at the tiles of that time. The tiles now, and the q up-projection's, are in
`_tiles`. The grouped o_a product runs here too (`groups`): alone no faster than cuBLAS's batched
GEMM, but in the step it launches while the attention's combine ends and W_ob's GEMV while it ends
(programmatic dependent launch): H200, BF16 layer B = 1 CSA 128K 114.0 -> 112.8 µs, HCA 1M 114.8 ->
111.4 (benchmarks/NOTES.md #116). Loading the first K step's weights before the PDL wait, as the
FP8 kernel does, made the BF16 layers 4-5 µs slower here (not understood)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.errors import InputError
from dsv4.kernels.reference.linear import linear as torch_linear
from dsv4.kernels.triton import skinny_gemm as skinny
from dsv4.kernels.triton.decode_common import pdl_enter, pdl_launch
from dsv4.kernels.triton.norm_rope import norm_rope


def _tiles(k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for a reduction of length k. The kernel sums the products in
    a [BLOCK_N, BLOCK_K] accumulator and reduces it once at the end.

    H200, bf16, CUDA-graph replays with the L2 flushed (benchmarks/tune_gemv.py, µs, two rounds):
    K 4096 / 8192 at 4 rows x 1024 x 4 warps, the products summed in a [4, 1024] accumulator and
    reduced once: CSA input projection (N 4160) 12.9-13.0, HCA's (N 2560) 10.2-10.3, W_ob (N 4096,
    K 8192) 19.9-20.1; 16 rows x 1024 x 8 warps reduced every step 13.0-13.1, 11.3-11.4, 20.1-20.2;
    cuBLAS 15.5-15.7, 12.2-12.4, 22.9-23.1. K 1024, the q up-projection, at 16 x 256 x 4 warps and
    4 stages, 2-D: CSA (N 40960) 23.3-23.5, HCA (N 32768) 20.2-20.4; cuBLAS 24.6-24.8, 19.8-19.9
    (a plain read of the same weight: 22.1-22.2, 18.5-18.7). In the layer's step the K-1024 tiles
    beat cuBLAS on both (CSA B = 1 layer 116.5-117.0 -> 114.6-115.1 µs, HCA 87.9-88.4 -> 87.5-87.7):
    its many small programs leave SMs to the side branch sooner."""
    if k <= 1024:
        return 16, 256, 4, 4
    return 4, 1024, 4, 3


@triton.jit
def rms_scale(x_ptr, K, eps, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(x[0:K]^2) + eps) of one row (fp32): the RMSNorm a one-row GEMV applies to x itself."""
    rk = tl.arange(0, BLOCK_K)
    ss = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xk = tl.load(x_ptr + k0 + rk, mask=(k0 + rk) < K, other=0.0).to(tl.float32)
        ss += xk * xk
    return tl.math.rsqrt(tl.sum(ss, 0) / K + eps)


@triton.jit
def rms_apply(x, inv, nw_ptr, kk, km, DT: tl.constexpr):
    """x's elements kk (fp32) as RMSNorm_w(x) rounded to DT, as the separate norm stores them
    (`reference.linear.rms_rows`), back in fp32."""
    return (x * inv * tl.load(nw_ptr + kk, mask=km, other=0.0).to(tl.float32)).to(DT).to(tl.float32)


@triton.jit
def gemv_rows(x_ptr, w_ptr, y_ptr, nw_ptr, pid, N, K, n_group, s_wn, eps, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    """Rows pid * BLOCK_N ... of y = x W^T: one program's work (`_gemv_kernel`, the pair kernel in
    `fp8_linear`). Output group g (n_group rows; a program never straddles two) reads x's g-th K
    columns. NORM (one group): x is RMSNorm_nw(x) first, each program finding the row's scale itself."""
    pdl_enter(PDL)
    n0 = pid * BLOCK_N
    x_ptr += (n0 // n_group) * K
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    nm = rn < N
    if NORM:
        inv = rms_scale(x_ptr, K, eps, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        km = (k0 + rk) < K
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * s_wn + (k0 + rk)[None, :], mask=nm[:, None] & km[None, :],
                    other=0.0).to(tl.float32)
        x = tl.load(x_ptr + k0 + rk, mask=km, other=0.0).to(tl.float32)
        if NORM:
            x = rms_apply(x, inv, nw_ptr, k0 + rk, km, x_ptr.dtype.element_ty)
        acc += w * x[None, :]
    tl.store(y_ptr + rn, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, N, K, n_group, s_wn, eps, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    gemv_rows(x_ptr, w_ptr, y_ptr, nw_ptr, tl.program_id(0), N, K, n_group, s_wn, eps, BLOCK_N, BLOCK_K, NORM, PDL)


def gemv(x: torch.Tensor, weight: torch.Tensor, groups: int = 1,
         norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [1, G*K] (contiguous) @ weight [N, K]^T (rows contiguous, any row stride) -> [1, N] in x's
    dtype, fp32 accumulation: the stream kernel above. groups: as `reference.linear.linear` (each
    group's N/G rows a multiple of the row block); norm = (w [K], eps), one group: x is RMSNorm_w(x)
    rounded to x's dtype first, in the kernel (no norm kernel before it)."""
    n, k = weight.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = _tiles(k)
    if x.shape != (1, groups * k) or n % groups:
        raise InputError(f"gemv: x must be [1, {groups} * {k}] and N {n} a multiple of groups {groups}; "
                         f"got x {list(x.shape)}")
    if groups > 1 and (n // groups) % bn:
        raise InputError(f"gemv: {n // groups} rows per group is not a multiple of the row block {bn}")
    nw, eps = _norm_args(norm, groups, k, x)
    _gemv_kernel[(triton.cdiv(n, bn),)](x, weight, y, nw, n, k, n // groups, weight.stride(0), eps, BLOCK_N=bn,
                                        BLOCK_K=bk, NORM=norm is not None, num_warps=warps, num_stages=stages,
                                        **pdl_launch(x.device))
    return y


def _norm_args(norm: tuple[torch.Tensor, float] | None, groups: int, k: int,
               x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The kernel's (norm weight, eps) arguments; x stands in for the weight without a norm (never read)."""
    if norm is None:
        return x, 0.0
    if groups != 1 or norm[0].shape != (k,) or not norm[0].is_contiguous():
        raise InputError(f"a GEMV's norm takes one group and a contiguous [{k}] weight; got groups {groups}, "
                         f"weight {list(norm[0].shape)}")
    return norm[0], float(norm[1])


def linear(x: torch.Tensor, weight: torch.Tensor, groups: int = 1,
           norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """Same contract as `dsv4.kernels.reference.linear.linear`. One row of x on CUDA (a batch-1 decode
    step) runs `gemv` (grouped too: the o_a product; with the norm inside); 2-32 rows of bf16 on CUDA
    the norm kernel, then `skinny_gemm` (weights on the MMA's M side; 5-13% faster than cuBLAS at the
    V4 projections); more rows, or the CPU, the norm kernel, then the reference's GEMM (cuBLAS)."""
    n, k = weight.shape
    if (x.shape[0] == 1 and x.is_cuda and weight.stride(-1) == 1 and x.is_contiguous()
            and (groups == 1 or (n // groups) % _tiles(k)[0] == 0)):
        return gemv(x, weight, groups, norm)
    x = rms_rows(x, norm)
    if x.is_cuda and skinny.fits(x, weight, groups):
        return skinny.skinny_gemm(x, weight, groups)
    return torch_linear(x, weight, groups)


def rms_rows(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None) -> torch.Tensor:
    """`reference.linear.rms_rows` by the norm_rope kernel: x itself without a norm."""
    if norm is None:
        return x
    none = x.new_empty(x.shape[0], 0, dtype=torch.float32)
    return norm_rope(x, norm[0], norm[1], none, none)
