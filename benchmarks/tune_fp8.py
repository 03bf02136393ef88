"""The decode step's projections with FP8 block weights against the copy ceiling and bf16 (CUDA only).

    python benchmarks/tune_fp8.py [--rounds 2] [--rows 1,64] [--prefill]

For each projection V4-Flash ships in FP8 (the FP8 part of the fused input projection q_a + kv, the
q up-projection with the indexer's, the grouped o_a product, the output projection W_ob), in one
process and alternating: `kernels.triton.fp8_linear.linear_fp8` at its default tiles and at
variants, the bf16 path the layer takes for the same shape (`gemv` at one row, cuBLAS beyond),
and a plain read of the FP8 codes (the floor at one row). Each time is the median of CUDA-graph
replays with the L2 flushed before each (`dsv4.bench.timing.Timer`, as `dsv4 bench` times decode).
Every FP8 result is checked against the reference `linear_fp8`, every bf16 one against torch.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Callable

import torch
import triton
from tune_gemv import plain_read

from dsv4.bench.ceilings import measure_ceilings
from dsv4.bench.timing import Timer
from dsv4.kernels.reference.linear import linear_fp8 as ref_fp8
from dsv4.kernels.triton import gemv as gv
from dsv4.kernels.triton.fp8_linear import linear_fp8
from dsv4.model.fp8_weights import quantize_blocks

DEV = torch.device("cuda")
OPTS = types.SimpleNamespace(device=DEV, warmup_ms=10, rep_ms=50, host_warmup=3, host_reps=15, graph=True,
                             quick=False, seed=0)
# (name, groups, N, K): V4-Flash, heads 64 x 512, q_lora 1024, o_groups 8 x o_lora 1024, hidden 4096
SHAPES = [("q_a + kv", 1, 1536, 4096), ("CSA q_b + iq_b", 1, 40960, 1024), ("HCA q_b", 1, 32768, 1024),
          ("o_a (8 groups)", 8, 8192, 4096), ("o_b", 1, 4096, 8192)]
GEMV_VARIANTS = [(4, 2048, 4, 3), (8, 1024, 4, 3), (8, 2048, 8, 3), (16, 1024, 8, 3), (16, 512, 4, 4),
                 (32, 512, 8, 4), (2, 4096, 4, 3), (4, 4096, 8, 2), (8, 512, 4, 4), (16, 256, 4, 4)]
# the decode-batch GEMM: (BLOCK_N, warps, stages), BLOCK_M the batch's power of two
GEMM_VARIANTS = [(64, 4, 3), (64, 4, 4), (64, 8, 3), (32, 4, 3), (128, 4, 3), (64, 4, 2), (128, 8, 3), (128, 8, 2)]
# the decode-batch GEMM's K splits (the default `_k_splits` splits while the tiles leave SMs idle)
SPLIT_VARIANTS = [1, 2, 4, 8]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", default="1,16,64", help="rows of x (decode batch sizes)")
    ap.add_argument("--prefill", action="store_true", help="also 8192 rows (a prefill chunk) vs cuBLAS bf16")
    ap.add_argument("--no-tiles", action="store_true", help="skip the tile variants (defaults, splits, descriptors)")
    args = ap.parse_args()
    timer = Timer(OPTS)
    gen = torch.Generator(device=DEV).manual_seed(0)
    ceil = measure_ceilings(OPTS).copy_gbps
    print(f"copy ceiling {ceil:,.0f} GB/s  ({torch.cuda.get_device_name()})")
    rows = [int(r) for r in args.rows.split(",")] + ([8192] if args.prefill else [])
    for name, groups, n, k in SHAPES:
        w = torch.randn(n, k, device=DEV, generator=gen) * 0.02
        codes, scale = quantize_blocks(w, "ue8m0")
        wb = w.to(torch.bfloat16)
        fp8_bytes = codes.numel() + scale.numel() * 4
        for t in rows:
            x = torch.randn(t, groups * k, device=DEV, generator=gen).to(torch.bfloat16)
            want = ref_fp8(x.float(), codes, scale, groups)
            cases: dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor | None]] = {}
            if groups == 1:
                bf16 = ((lambda x=x, wb=wb: gv.gemv(x, wb)) if t == 1
                        else (lambda x=x, wb=wb: torch.nn.functional.linear(x, wb)))
                cases["bf16 (the layer's path)"] = (bf16, x.float() @ wb.float().T)
            else:
                wg = wb.view(groups, n // groups, k)
                xg = x.view(t, groups, k).transpose(0, 1)
                cases["bf16 bmm (the layer's path)"] = (lambda xg=xg, wg=wg: torch.bmm(xg, wg.transpose(1, 2)),
                                                        torch.bmm(xg.float(), wg.float().transpose(1, 2)))
            cases["fp8 default"] = (lambda x=x, c=codes, s=scale, g=groups: linear_fp8(x, c, s, g), want)
            if t > 1:
                cases["fp8 Triton's e4m3 conversion"] = (
                    lambda x=x, c=codes, s=scale, g=groups: linear_fp8(x, c, s, g, asm=False), want)
            for desc in (False, True) if 1 < t <= 256 else ():
                d = " descriptors" if desc else ""
                if desc:
                    cases["fp8 descriptors (TMA)"] = (
                        lambda x=x, c=codes, s=scale, g=groups: linear_fp8(x, c, s, g, desc=True), want)
                for sp in SPLIT_VARIANTS:
                    cases[f"fp8{d} {sp} K splits"] = (
                        lambda x=x, c=codes, s=scale, g=groups, sp=sp, desc=desc: linear_fp8(
                            x, c, s, g, splits=sp, desc=desc), want)
            for tiles in ([] if args.no_tiles else GEMV_VARIANTS if t == 1
                          else [(max(16, triton.next_power_of_2(t)), *v) for v in GEMM_VARIANTS] if t <= 256 else []):
                cases[f"fp8 {'x'.join(map(str, tiles[:2]))} w{tiles[2]} s{tiles[3]}"] = (
                    lambda x=x, c=codes, s=scale, g=groups, tiles=tiles: linear_fp8(x, c, s, g, tiles=tiles), want)
            if t == 1:
                out = torch.empty(triton.cdiv(codes.numel(), 8192), device=DEV)
                cases["read floor (fp8 codes)"] = (lambda c=codes, out=out: plain_read(c.view(torch.uint8), out), None)
            times: dict[str, list[float]] = {}
            for label, (fn, ref) in cases.items():
                try:
                    y = fn()
                    if ref is not None:
                        err = ((y.float().reshape(ref.shape) - ref).abs().max() / ref.abs().max()).item()
                        assert err < 1e-2, f"max error {err}"
                    times[label] = []
                except Exception as e:          # a variant Triton cannot compile: say so, keep going
                    print(f"  {name} rows {t} {label}: {type(e).__name__}: {str(e)[:160]}")
            for _ in range(args.rounds):
                for label in times:
                    tm = timer.time(cases[label][0], graph=True)
                    times[label].append(tm.us)
            flops = 2 * t * n * k
            print(f"\n{name}: rows {t}, G {groups}, N {n}, K {k}: FP8 {fp8_bytes / 1e6:.1f} MB, "
                  f"bf16 {2 * n * k / 1e6:.1f} MB, {flops / 1e9:.2f} GFLOP")
            for label, ts in sorted(times.items(), key=lambda kv: min(kv[1])):
                us = min(ts)
                nbytes = 2 * n * k if label.startswith("bf16") else fp8_bytes
                print(f"  {label:<30} {' / '.join(f'{v:8.1f}' for v in ts)} µs  {nbytes / us / 1e3:7,.0f} GB/s "
                      f"{100 * nbytes / us / 1e3 / ceil:5.1f}% of copy  {flops / us / 1e6:6.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
