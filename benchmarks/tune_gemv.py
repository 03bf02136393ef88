"""Batch-1 projections of a V4-Flash decode step against the copy ceiling (CUDA only).

    python benchmarks/tune_gemv.py [--rounds 3]

A batch-1 projection reads its weight once: a stream. For each projection of the benchmarked CSA
and HCA layers (the fused input projection, the q up-projection, the grouped o_a product, the
output projection W_ob) this times, in one process and alternating, torch's GEMM / bmm (cuBLAS),
`kernels.triton.gemv` at its defaults and variants of its tiles, and a plain streaming read of
the same weight bytes (the floor). Each time is the median of CUDA-graph replays with the L2
flushed before each, by `dsv4.bench.timing.Timer` as `dsv4 bench` times decode. Every result is
checked against torch's.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from dsv4.bench.ceilings import measure_ceilings
from dsv4.bench.timing import Timer
from dsv4.kernels.triton import gemv as gv

DEV = torch.device("cuda")
OPTS = types.SimpleNamespace(device=DEV, warmup_ms=10, rep_ms=50, host_warmup=3, host_reps=15, graph=True,
                             quick=False, seed=0)


@triton.jit
def _gemv2d_kernel(x_ptr, w_ptr, y_ptr, N, K, s_wn, s_wg, s_xg, s_yg,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`gemv._gemv_kernel` with a group axis (grid axis 1, the grouped o_a product) and any tiles."""
    g = tl.program_id(1).to(tl.int64)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    nm = rn < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    w_row = w_ptr + g * s_wg + rn[:, None].to(tl.int64) * s_wn
    for k0 in range(0, K, BLOCK_K):
        km = (k0 + rk) < K
        w = tl.load(w_row + (k0 + rk)[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + g * s_xg + k0 + rk, mask=km, other=0.0).to(tl.float32)
        acc += w * x[None, :]
    tl.store(y_ptr + g * s_yg + rn, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=nm)


def gemv2d(x, w, groups, block_n, block_k, warps, stages):
    """x [G, K], w [G, N, K] -> y [G, N]."""
    g, n, k = w.shape
    y = torch.empty(g, n, dtype=x.dtype, device=x.device)
    _gemv2d_kernel[(triton.cdiv(n, block_n), g)](x, w, y, n, k, w.stride(1), w.stride(0), x.stride(0), y.stride(0),
                                                 BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                                                 num_stages=stages)
    return y


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * UNROLL
    acc = tl.zeros([BLOCK], tl.float32)
    for u in tl.static_range(UNROLL):
        o = base + u * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + o, mask=o < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def plain_read(w: torch.Tensor, out: torch.Tensor) -> None:
    n = w.numel()
    _read_kernel[(triton.cdiv(n, 8192),)](w, out, n, BLOCK=2048, UNROLL=4, num_warps=8)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    timer = Timer(OPTS)
    gen = torch.Generator(device=DEV).manual_seed(0)
    ceil = measure_ceilings(OPTS).copy_gbps
    print(f"copy ceiling {ceil:,.0f} GB/s  ({torch.cuda.get_device_name()})")
    # (name, groups, N, K): V4-Flash, heads 64 x 512, q_lora 1024, o_groups 8 x o_lora 1024, hidden 4096
    shapes = [("CSA input", 1, 4160, 4096), ("HCA input", 1, 2560, 4096), ("CSA q_b", 1, 40960, 1024),
              ("HCA q_b", 1, 32768, 1024), ("o_a (8 groups)", 8, 1024, 4096), ("o_b", 1, 4096, 8192)]
    variants = [(8, 1024, 4, 3), (16, 512, 4, 3), (16, 1024, 8, 3), (32, 512, 8, 3), (8, 2048, 8, 3),
                (16, 1024, 8, 2), (4, 1024, 4, 3), (16, 256, 4, 4), (32, 256, 8, 4), (8, 512, 4, 4)]
    for name, groups, n, k in shapes:
        w = (torch.randn(groups, n, k, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
        x = torch.randn(groups, k, device=DEV, generator=gen).to(torch.bfloat16)
        ref = torch.bmm(x[:, None, :].float(), w.float().transpose(1, 2))[:, 0]
        nbytes = w.numel() * 2
        out = torch.empty(triton.cdiv(w.numel(), 8192), device=DEV)
        cases: dict[str, Callable[[], object]] = {"read floor": lambda w=w, out=out: plain_read(w, out)}
        if groups == 1:
            cases["torch"] = lambda x=x, w=w: torch.nn.functional.linear(x, w[0])
            cases["gemv"] = lambda x=x, w=w: gv.gemv(x, w[0])
        else:
            xt = x[:, None, :]
            cases["torch"] = lambda xt=xt, w=w: torch.bmm(xt, w.transpose(1, 2))
        for bn, bk, wp, stg in variants:
            cases[f"2d {bn}x{bk} w{wp} s{stg}"] = (lambda x=x, w=w, bn=bn, bk=bk, wp=wp, stg=stg, g=groups:
                                                    gemv2d(x, w, g, bn, bk, wp, stg))
        for label, fn in cases.items():
            if label == "read floor":
                continue
            y = fn()
            y = y.reshape(groups, n).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, f"{name} {label}: max error {err}"
        times: dict[str, list[float]] = {k2: [] for k2 in cases}
        for _ in range(args.rounds):
            for label, fn in cases.items():
                tm = timer.time(fn, graph=True)
                assert tm.mode == "graph", f"{name} {label}: {tm.note}"
                times[label].append(tm.us)
        print(f"\n{name}: G {groups} N {n} K {k}, {nbytes / 1e6:.1f} MB")
        for label, ts in sorted(times.items(), key=lambda kv: min(kv[1])):
            t = min(ts)
            print(f"  {label:<26} {' / '.join(f'{v:6.1f}' for v in ts)} µs   {nbytes / t / 1e3:7,.0f} GB/s "
                  f"{100 * nbytes / t / 1e3 / ceil:5.1f}% of copy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
