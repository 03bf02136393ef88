"""Probe: a Triton bf16 GEMM for decode batches (M = 16-64 rows) against cuBLAS, at the V4-Flash
projections of one layer (BF16 weights), each timed alone in CUDA-graph replays with the L2 flushed.

    python benchmarks/skinny_gemm_probe.py [--rows 64]

The kernel puts the weights on the MMA's M side (W tile [BLOCK_N, BLOCK_K] from a tensor
descriptor, x^T [BLOCK_K, rows] beside it), walks K in BLOCK_K steps (optionally split over
programs, summed by fp32 atomics into a zeroed buffer), and reads each weight byte once. A lead for
`gemv.linear` at more than one row (cuBLAS today), not a kernel the layer uses.
"""

from __future__ import annotations

import argparse
import itertools
import types

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dsv4.bench.timing import Timer


@triton.jit
def _skinny_kernel(x_desc, w_desc, y_ptr, M, N, K, K_SPLIT, n_group, s_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    k_lo = tl.program_id(1) * K_SPLIT
    xk = (n0 // n_group) * K
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
        w = w_desc.load([n0, k0])
        xt = x_desc.load([0, xk + k0]).T
        acc = tl.dot(w, xt, acc)
    rn = n0 + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    ptr = y_ptr + rm[None, :] * s_ym + rn[:, None]
    msk = (rm[None, :] < M) & (rn[:, None] < N)
    if ATOMIC:
        tl.atomic_add(ptr, acc, mask=msk, sem="relaxed")
    else:
        tl.store(ptr, acc.to(y_ptr.dtype.element_ty), mask=msk)


def skinny(x: torch.Tensor, w: torch.Tensor, groups: int, bn: int, bk: int, stages: int, warps: int,
           splits: int) -> torch.Tensor:
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    bm = max(16, triton.next_power_of_2(m))
    k_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if splits > 1 else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n, bn), triton.cdiv(k, k_split))](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]), out, m, n, k, k_split,
        n // groups, out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, ATOMIC=splits > 1, num_warps=warps,
        num_stages=stages)
    return out.to(x.dtype) if splits > 1 else out


def cublas(x: torch.Tensor, w: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return torch.nn.functional.linear(x, w)
    m, (n, k) = x.shape[0], w.shape
    return torch.bmm(x.view(m, groups, k).transpose(0, 1), w.view(groups, n // groups, k).transpose(1, 2)) \
        .transpose(0, 1).reshape(m, n)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--bn", default="64,128")
    ap.add_argument("--bk", default="64,128")
    ap.add_argument("--stages", default="3,4,6")
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--quiet", action="store_true", help="print only each shape's best")
    args = ap.parse_args()
    ints = lambda v: [int(t) for t in v.split(",")]          # noqa: E731
    timer = Timer(types.SimpleNamespace(device=torch.device("cuda"), warmup_ms=10, rep_ms=50, host_warmup=3,
                                        host_reps=15, graph=True))
    # (name, N, K, groups): V4-Flash HCA / CSA q_b (+ the indexer's), o_a (8 groups), W_ob, input projections
    shapes = [("HCA q_b", 32768, 1024, 1), ("CSA q_b+iq", 40960, 1024, 1), ("o_a", 8192, 4096, 8),
              ("W_ob", 4096, 8192, 1), ("HCA input", 2560, 4096, 1)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, n, k, groups in shapes:
        x = torch.randn(args.rows, groups * k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        want = cublas(x, w, groups).float()
        mb = n * k * 2 / 1e6
        t = timer.time(lambda x=x, w=w, g=groups: cublas(x, w, g), graph=True)
        print(f"{name:12} rows {args.rows} {mb:6.1f} MB  cuBLAS {t.us:6.1f} µs {mb / t.us:5.2f} TB/s", flush=True)
        best = None
        for bn, bk, stages, splits, warps in itertools.product(ints(args.bn), ints(args.bk), ints(args.stages),
                                                               ints(args.splits), ints(args.warps)):
            many = splits > 1 and triton.cdiv(n, bn) * (splits // 2) >= 2 * sms      # enough programs without
            if many or (n // groups) % bn or (k // splits) % bk:
                continue
            try:
                got = skinny(x, w, groups, bn, bk, stages, warps, splits).float()
            except Exception:      # out of shared memory and the like: not a candidate
                continue
            err = ((got - want).abs().max() / want.abs().max()).item()
            if err > 2e-2:
                print(f"  bn {bn} bk {bk} stages {stages} splits {splits} warps {warps}: WRONG {err:.3g}")
                continue
            tt = timer.time(lambda x=x, w=w, g=groups, bn=bn, bk=bk, st=stages, sp=splits, wp=warps:
                            skinny(x, w, g, bn, bk, st, wp, sp), graph=True)
            if best is None or tt.us < best[0]:
                best = (tt.us, bn, bk, stages, splits, warps)
            if not args.quiet:
                print(f"  bn {bn:3} bk {bk:3} stages {stages} splits {splits} warps {warps}: {tt.us:6.1f} µs "
                      f"{mb / tt.us:5.2f} TB/s", flush=True)
        if best:
            print(f"  best {best[0]:.1f} µs (bn {best[1]} bk {best[2]} stages {best[3]} splits {best[4]} "
                  f"warps {best[5]}) vs cuBLAS {t.us:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
