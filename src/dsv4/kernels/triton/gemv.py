"""Triton twin of `reference.linear.linear` for one token: y = x W^T with x [1, K], the projections
of a batch-1 decode step.

A batch-1 projection reads its weight once and does nothing else: it is a stream over W. Here
each program takes BLOCK_N whole rows of W (contiguous K) and walks K in BLOCK_K steps, an fp32
dot per row; no split-K, so no second kernel to reduce partial sums. cuBLAS picks split-K
kernels plus a reduction kernel for the wide-K projections of V4-Flash (K 4096 / 8192).

Measured (H200, bf16, one call with the L2 flushed, triton.testing.do_bench): the CSA layer's
fused input projection (N 4160, K 4096) 16.7 µs vs cuBLAS 19.3; the output projection (N 4096,
K 8192) 26.4 vs 29.2. The grouped o_a bmm stays on cuBLAS (as fast as these tiles). For the
tiles of the q up-projection see `_tiles`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.reference.linear import linear as torch_linear
from dsv4.kernels.triton.decode_common import pdl_enter, pdl_launch


def _tiles(k: int) -> tuple[int, int, int, int, bool]:
    """(BLOCK_N, BLOCK_K, warps, stages, 2-D accumulator) for a reduction of length k.

    H200, bf16, CUDA-graph replays with the L2 flushed (benchmarks/tune_gemv.py): the wide-K
    projections (K 4096 / 8192) are fastest at 16 rows x 1024 x 8 warps, each step's products
    summed right away (a [16, 1024] accumulator costs registers: 18.5 vs 16.7 µs for N 4160 K 4096);
    the q up-projection (K 1024, N 40960) at 16 x 256 x 4 warps, 4 stages, products summed in a
    [16, 256] accumulator and reduced once (30.0 vs 31.4 µs; cuBLAS 31.3)."""
    if k <= 1024:
        return 16, 256, 4, 4, True
    return 16, 1024, 8, 3, False


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, s_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 ACC2D: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    nm = rn < N
    if ACC2D:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        km = (k0 + rk) < K
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * s_wn + (k0 + rk)[None, :], mask=nm[:, None] & km[None, :],
                    other=0.0).to(tl.float32)
        x = tl.load(x_ptr + k0 + rk, mask=km, other=0.0).to(tl.float32)
        if ACC2D:
            acc += w * x[None, :]
        else:
            acc += tl.sum(w * x[None, :], 1)
    if ACC2D:
        y = tl.sum(acc, 1)
    else:
        y = acc
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=nm)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] (contiguous) @ weight [N, K]^T (rows contiguous, any row stride) -> [1, N] in x's dtype,
    fp32 accumulation: the stream kernel above."""
    n, k = weight.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages, acc2d = _tiles(k)
    _gemv_kernel[(triton.cdiv(n, bn),)](x, weight, y, n, k, weight.stride(0), BLOCK_N=bn, BLOCK_K=bk, ACC2D=acc2d,
                                        num_warps=warps, num_stages=stages, **pdl_launch(x.device))
    return y


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as `dsv4.kernels.reference.linear.linear`. One row of x on CUDA (a batch-1 decode
    step) runs `gemv`; more rows, or the CPU, run the reference's GEMM (cuBLAS is near the bandwidth
    limit once rows share each weight load)."""
    if x.shape[0] == 1 and x.is_cuda and weight.stride(-1) == 1 and x.is_contiguous():
        return gemv(x, weight)
    return torch_linear(x, weight)
