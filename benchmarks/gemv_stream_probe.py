"""How fast can one decode row's FP8 weight stream go? (CUDA only, sm_90 for the descriptor forms.)

The batch-1 step's three big projections (q_b, the grouped o_a, W_ob: 33.5 MB of FP8 codes each)
stream at 2.4-2.7 TB/s inside the step (thirty-seventh round's timeline). This probe times, for each
shape, chains of R launches over R distinct copies of the codes (so no launch finds its bytes in the
L2), captured in one CUDA graph after an L2-flushing read, and reports µs a launch:

    gemv        the production one-row GEMV (`fp8_linear.linear_fp8`, programmatic dependent launch)
    read_ptr    a plain pointer read of the codes (16-byte loads, one partial sum a program)
    read_desc   the codes read through a tensor descriptor (TMA into shared memory), a program
                BLOCK_N rows, K in BLOCK_K steps, pipelined by Triton (stages)
    gemv_desc   the one-row FP8 GEMV with its code tiles loaded that way

    python benchmarks/gemv_stream_probe.py [--copies 8]

--inputs instead times the step's first stage, one launch each after the flush: the FP8 q_a + kv
GEMV ([1,536, 4,096] codes) and the dense compressors' bf16 GEMV (HCA [1,024, 4,096], CSA
[2,624, 4,096]) alone and one after the other, at several tiles (BLOCK_N, BLOCK_K, warps, stages).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile
from triton.tools.tensor_descriptor import TensorDescriptor
from tune_gemv import _read_kernel as _read_ptr

from dsv4.kernels.triton import fp8_linear, gemv
from dsv4.kernels.triton.decode_common import pdl_enter, pdl_launch
from dsv4.model.fp8_weights import quantize_blocks

DEV = torch.device("cuda")


@triton.jit
def _read_desc(w_desc, out_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        acc += w_desc.load([n0, k0]).to(tl.int32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _gemv_desc(x_ptr, w_desc, s_ptr, y_ptr, N, K, n_group, s_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PDL: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    xg = x_ptr + (n0 // n_group) * K
    srow = s_ptr + (n0 // 128) * s_sn
    pdl_enter(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    rk = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        w = w_desc.load([n0, k0]).to(tl.float32)
        xs = tl.load(xg + k0 + rk).to(tl.float32) * tl.load(srow + (k0 + rk) // 128)
        acc += w * xs[None, :]
    rn = n0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + rn, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=rn < N)


def chain_us(fns: list, reps: int) -> float:
    """µs a launch: a graph of [flush read, fns...] against a graph of [flush read] alone."""
    flush = torch.ones(96 * 2**20, dtype=torch.int32, device=DEV)

    def graph(body: list):
        for f in body:
            f()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            with torch.cuda.graph(g, stream=s):
                flush.sum()
                for f in body:
                    f()
        torch.cuda.synchronize()
        return g

    def med(g) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        out = []
        for _ in range(reps):
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            out.append(1e3 * a.elapsed_time(b))
        return statistics.median(out)

    g0, g1 = graph([]), graph(fns)
    base, full = med(g0), med(g1)
    return (full - base) / len(fns)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--inputs", action="store_true", help="the step's input GEMVs instead (module doc)")
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    print(torch.cuda.get_device_name())
    if args.inputs:
        for layer, dense_rows in (("HCA", 1024), ("CSA", 2624)):
            probe_inputs(layer, dense_rows, args.reps, gen)
        return
    # (name, groups, N per group, K)
    shapes = [("HCA q_b", 1, 32768, 1024), ("o_a (8 groups)", 8, 1024, 4096), ("W_ob", 1, 4096, 8192)]
    for name, groups, n, k in shapes:
        probe_shape(name, groups, n, k, args.copies, args.reps, gen)


def probe_shape(name: str, groups: int, n: int, k: int, copies: int, reps: int,
                gen: torch.Generator) -> None:
    nt = groups * n
    mats = []
    for _ in range(copies):
        w = torch.randn(nt, k, device=DEV, generator=gen) * 0.02
        mats.append(quantize_blocks(w))
        del w
    codes0, scale0 = mats[0]
    x = torch.randn(1, groups * k, device=DEV, generator=gen).to(torch.bfloat16)
    ref = fp8_linear.linear_fp8(x, codes0, scale0, groups=groups).float()
    mb = codes0.numel() / 1e6
    rows = []

    def run(label: str, fns: list, check=None) -> None:
        try:
            us = chain_us(fns, reps)
            bad = check() if check else ""
            rows.append((label, us, bad))
        except Exception as e:        # a variant that does not compile is a row, not a stop
            rows.append((label, None, f"{type(e).__name__}: {str(e)[:100]}"))

    run("gemv (production)", [lambda c=c, s=s: fp8_linear.linear_fp8(x, c, s, groups=groups) for c, s in mats])
    out = torch.empty(1 << 20, dtype=torch.float32, device=DEV)
    for block, unroll, warps in ((2048, 4, 8), (4096, 4, 8), (1024, 8, 4)):
        per = block * unroll
        run(f"read_ptr {block}x{unroll} w{warps}",
            [lambda c=c, per=per, block=block, unroll=unroll, warps=warps: _read_ptr[(triton.cdiv(c.numel(), per),)](
                c.view(torch.uint8), out, c.numel(), BLOCK=block, UNROLL=unroll, num_warps=warps)
             for c, _ in mats])
    for bn, bk, warps, stages in ((16, 256, 4, 4), (32, 256, 4, 4), (64, 256, 4, 3), (32, 128, 4, 6),
                                  (64, 128, 4, 4), (128, 128, 8, 4), (16, 256, 4, 6), (32, 256, 8, 3)):
        if nt % bn:
            continue
        descs = [TensorDescriptor.from_tensor(c.view(torch.uint8), [bn, bk]) for c, _ in mats]
        run(f"read_desc {bn}x{bk} w{warps} s{stages}",
            [lambda d=d, bn=bn, bk=bk, warps=warps, stages=stages: _read_desc[(nt // bn,)](
                d, out, k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages) for d in descs])
        ddescs = [TensorDescriptor.from_tensor(c, [bn, bk]) for c, _ in mats]
        y = torch.empty(1, nt, dtype=torch.bfloat16, device=DEV)

        def gd(d, s, bn=bn, bk=bk, warps=warps, stages=stages, y=y):
            _gemv_desc[(nt // bn,)](x, d, s, y, nt, k, n, s.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                                    num_warps=warps, num_stages=stages, **pdl_launch(DEV))

        def check(y=y, d=ddescs[0], gd=gd) -> str:
            gd(d, scale0)
            torch.cuda.synchronize()
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            return "" if err < 1e-2 else f"WRONG rel {err:.2e}"
        run(f"gemv_desc {bn}x{bk} w{warps} s{stages}", [lambda d=d, s=s, gd=gd: gd(d, s)
                                                        for d, (_, s) in zip(ddescs, mats)], check)
    print(f"\n{name}: {mb:.1f} MB of codes a launch, {copies} launches a chain")
    for label, us, bad in rows:
        tail = f"{mb / us:6.2f} TB/s" if us else ""
        print(f"  {label:<34} {us if us is None else f'{us:8.2f}'} µs {tail} {bad}")
    del mats


#: (BLOCK_N, BLOCK_K, warps, stages) tried for the K-4096 input GEMVs (the first of each is the default)
FP8_INPUT_TILES = ((4, 2048, 4, 3), (4, 4096, 4, 1), (8, 4096, 8, 1), (2, 4096, 4, 1), (4, 1024, 4, 3),
                   (8, 1024, 4, 4), (16, 512, 4, 4), (2, 2048, 2, 2))
BF16_INPUT_TILES = ((4, 1024, 4, 3), (4, 4096, 8, 1), (2, 4096, 4, 1), (8, 2048, 8, 1), (4, 2048, 4, 2),
                    (2, 2048, 4, 2), (1, 4096, 4, 1), (2, 1024, 2, 3))


def span_us(fns: list, reps: int) -> float:
    """Median µs from a spin kernel's end to the last of fns' kernels' end (torch.profiler's device
    timestamps), each rep after an L2-flushing read: one stage's latency as the step sees it."""
    flush = torch.ones(64 * 2**20, dtype=torch.int32, device=DEV)
    for f in fns:
        f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.sum()
            torch.cuda._sleep(2_000_000)
            for f in fns:
                f()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    spins = [i for i, e in enumerate(ev) if "sleep" in e.name.lower() or "spin" in e.name.lower()]
    spans = [max(e.time_range.end for e in ev[i + 1:i + 1 + len(fns)]) - ev[i].time_range.end for i in spins]
    return statistics.median(spans)


def probe_inputs(layer: str, dense_rows: int, reps: int, gen: torch.Generator) -> None:
    k = 4096
    codes, scale = quantize_blocks(torch.randn(1536, k, device=DEV, generator=gen) * 0.02)
    dense = (torch.randn(dense_rows, k, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(1, k, device=DEV, generator=gen).to(torch.bfloat16)
    ref_f, ref_d = fp8_linear.linear_fp8(x, codes, scale).float(), gemv.linear(x, dense).float()
    yd = torch.empty(1, dense_rows, dtype=torch.bfloat16, device=DEV)

    def fp8(t):
        return lambda: fp8_linear.linear_fp8(x, codes, scale, tiles=t)

    def bf16(t):
        bn, bk, warps, stages = t
        return lambda: gemv._gemv_kernel[(triton.cdiv(dense_rows, bn),)](
            x, dense, yd, x, dense_rows, k, dense_rows, dense.stride(0), 0.0, BLOCK_N=bn, BLOCK_K=bk, NORM=False,
            num_warps=warps, num_stages=stages, **pdl_launch(DEV))

    print(f"\n{layer} inputs: FP8 {codes.numel() / 1e6:.1f} MB, bf16 {dense.numel() * 2 / 1e6:.1f} MB; µs a launch "
          "from a spin's end, L2 flushed")
    singles = {}
    for kind, tiles, make, y, ref in (("fp8", FP8_INPUT_TILES, fp8, None, ref_f),
                                      ("bf16", BF16_INPUT_TILES, bf16, yd, ref_d)):
        for t in tiles:
            out = make(t)()
            bad = rel_err(out if y is None else y, ref)
            singles[kind, t] = span_us([make(t)], reps)
            print(f"  {kind:<4} {t!s:<22} {singles[kind, t]:7.2f} µs  err {bad:.1e}")
    best = {kind: [FP8_INPUT_TILES[0] if kind == "fp8" else BF16_INPUT_TILES[0]]
            + sorted((t for (kk, t) in singles if kk == kind), key=lambda t, kind=kind: singles[kind, t])[:3]
            for kind in ("fp8", "bf16")}
    for tf in dict.fromkeys(best["fp8"]):
        for tb in dict.fromkeys(best["bf16"]):
            print(f"  pair fp8 {tf!s:<22} bf16 {tb!s:<22} {span_us([fp8(tf), bf16(tb)], reps):7.2f} µs")

def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    torch.cuda.synchronize()
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


if __name__ == "__main__":
    main()
