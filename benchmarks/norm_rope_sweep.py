"""Rows a program and warps of `norm_rope`'s kernel on the prefill chunk's calls (CUDA).

    python benchmarks/norm_rope_sweep.py [--tokens 8192]

Shapes: the CSA indexer's queries [T, 64, 128] bf16 (rope 64, Hadamard, mxfp4 rounding, bf16 out),
q_a [T, 1024] (weighted norm), kv [T, 512] (weighted norm, rope 64), q [T, 64, 512] (norm, rope 64,
bf16 out). Each configuration's output must equal the default's bit for bit; time is `read_floor.timed_us`
(the median of 20 calls, each after a 256 MB read that flushes the L2, CUDA events); GB/s counts x read once
and out written once.
"""

from __future__ import annotations

import argparse

import torch
from read_floor import timed_us

from dsv4.kernels.triton.norm_rope import norm_rope


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    t = ap.parse_args().tokens
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    ang = torch.rand(t, 32, device=dev, generator=g) * 6.28
    cos, sin = ang.cos(), ang.sin()
    none = torch.empty(t, 0, device=dev)
    cases = {
        "indexer q [T,64,128] had+mxfp4": (torch.randn(t, 64, 128, device=dev, generator=g).bfloat16(),
                                            dict(weight=None, eps=0.0, cos=cos, sin=sin, normalize=False,
                                                 out_dtype=torch.bfloat16, hadamard=True, round_to="mxfp4")),
        "q_a [T,1024] weighted": (torch.randn(t, 1024, device=dev, generator=g).bfloat16(),
                                  dict(weight=torch.rand(1024, device=dev, generator=g) + 0.5, eps=1e-6,
                                       cos=none, sin=none)),
        "kv [T,512] weighted rope": (torch.randn(t, 512, device=dev, generator=g).bfloat16(),
                                     dict(weight=torch.rand(512, device=dev, generator=g) + 0.5, eps=1e-6,
                                          cos=cos, sin=sin)),
        "q [T,64,512] rope": (torch.randn(t, 64, 512, device=dev, generator=g).bfloat16(),
                              dict(weight=None, eps=1e-6, cos=cos, sin=sin, out_dtype=torch.bfloat16)),
    }
    configs = [(None, None)] + [(r, w) for r in (4, 8, 16, 32) for w in (1, 2, 4, 8)]
    for name, (x, kw) in cases.items():
        ref = norm_rope(x, **kw)
        nbytes = x.numel() * x.element_size() + ref.numel() * ref.element_size()
        rows = []
        for r, w in configs:
            try:
                out = norm_rope(x, **kw, block_rows=r, num_warps=w)
            except Exception as e:          # a config that does not compile (e.g. too many warps for the tile)
                rows.append((f"{r} x {w}", None, type(e).__name__))
                continue
            same = torch.equal(out.view(torch.int16) if out.dtype == torch.bfloat16 else out.view(torch.int32),
                               ref.view(torch.int16) if ref.dtype == torch.bfloat16 else ref.view(torch.int32))
            us = timed_us(lambda r=r, w=w, x=x, kw=kw: norm_rope(x, **kw, block_rows=r, num_warps=w), reps=20)
            rows.append((f"{r or 'default'} x {w or 'default'}", us, "" if same else "DIFFERS"))
        print(f"## {name}: {nbytes / 1e6:.1f} MB")
        for label, us, note in sorted(rows, key=lambda v: v[1] or 1e9):
            if us is None:
                print(f"  {label:>18}  {note}")
            else:
                print(f"  {label:>18}  {us:9.1f} µs  {nbytes / us / 1e3:7.0f} GB/s  {note}")


if __name__ == "__main__":
    main()
