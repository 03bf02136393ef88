"""Triton twin of `reference.linear.linear` for a decode batch of 2-32 rows with bf16 / fp16 weights:
y = x W^T, each weight byte read once.

The weights go on the MMA's M side: a program takes BLOCK_N rows of W (a tensor-descriptor tile
[BLOCK_N, BLOCK_K]) against x^T [BLOCK_K, rows] and walks K; the batch is the MMA's N (16 or 32). No
split-K: the V4-Flash projections have N / 64 >= 40 row tiles. Output group g (N/G rows, a
multiple of BLOCK_N) reads x's g-th K columns (the grouped o_a projection).

H100, 64 rows, CUDA-graph replays with the L2 flushed (`benchmarks/skinny_gemm_probe.py`), µs, this
kernel / cuBLAS: HCA q_b (67 MB) 27.2 / 28.4, CSA q_b + the indexer's 33.6 / 34.7, o_a 28.2 / 32.3,
W_ob 27.8 / 30.6 (cuBLAS splits K there and reduces in a second kernel); 16 rows 26.3 / 27.6,
31.5 / 33.8, 26.8 / 30.9, 27.2 / 29.6. BLOCK_N 64 and BLOCK_K 128 were best at both (32, 128 and 256
rows, 8 warps and 2 K splits measured too). In the layer (H100, 128K, BF16 weights, two rounds on one
machine, `benchmarks/ab_run.sh`): B = 16 CSA 185.7-186.5 -> 180.3-181.1 µs, HCA 127.5-127.8 ->
125.2-125.6; but B = 64 CSA 268.0-269.8 -> 266.8-270.1, HCA 153.2-153.7 -> 155.4-156.0 (also without
programmatic dependent launch: 155.8-156.7); B = 32 CSA 211.2-211.5 -> 208.4-208.6, HCA 136.9-137.1 ->
135.2-135.3. So up to 32 rows (MAX_ROWS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dsv4.kernels.triton.decode_common import pdl_enter, pdl_launch

#: rows of x this kernel takes (more: cuBLAS; at 64 rows the kernel was faster alone, slower in the layer)
MAX_ROWS = 32
BLOCK_N, BLOCK_K, STAGES, WARPS = 64, 128, 4, 4


@triton.jit
def _skinny_kernel(x_desc, w_desc, y_ptr, M, N, K, n_group, s_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    # NATIVE: bf16 / fp16 MMAs; else (the interpreter, whose dots take no bf16) the tiles in fp32, exact
    pdl_enter(PDL)
    n0 = tl.program_id(0) * BLOCK_N
    xk = (n0 // n_group) * K
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = w_desc.load([n0, k0])
        xt = x_desc.load([0, xk + k0]).T
        if NATIVE:
            acc = tl.dot(w, xt, acc)
        else:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    rn = n0 + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    tl.store(y_ptr + rm[None, :] * s_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[None, :] < M) & (rn[:, None] < N))


def fits(x: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    """Whether the kernel takes x [T, G*K] @ weight [N, K]^T: 2-MAX_ROWS rows, bf16 / fp16 x and weight of one
    dtype, 16-byte aligned bases and row strides (tensor descriptors), each group's rows a multiple of
    BLOCK_N and, grouped, K a multiple of BLOCK_K (a K step never reads the next group's columns)."""
    t, (n, k) = x.shape[0], weight.shape
    return (2 <= t <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.stride(-1) == 1 and weight.stride(-1) == 1
            and all(a.data_ptr() % 16 == 0 and a.stride(0) * a.element_size() % 16 == 0 for a in (x, weight))
            and (n // groups) % BLOCK_N == 0 and (groups == 1 or k % BLOCK_K == 0))


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, groups: int = 1, stages: int = STAGES) -> torch.Tensor:
    """y = x W^T as `reference.linear.linear` for a call that `fits`: [T, N] in x's dtype, fp32 sums."""
    t, (n, k) = x.shape[0], weight.shape
    bm = max(16, triton.next_power_of_2(t))
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n, BLOCK_N),)](
        TensorDescriptor.from_tensor(x, [bm, BLOCK_K]), TensorDescriptor.from_tensor(weight, [BLOCK_N, BLOCK_K]),
        y, t, n, k, n // groups, y.stride(0), BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, NATIVE=x.is_cuda,
        num_warps=WARPS,
        num_stages=stages, **pdl_launch(x.device))
    return y
