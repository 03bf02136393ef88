"""The exact top-k over a prefill chunk's score rows (CUDA): the default path against its knobs.

    python benchmarks/topk_prefill_sweep.py [--tokens 8192] [--before 24576] [--k 512]

Rows as `indexer_prefill.prefill_indexer_topk` hands them over for the chunk of `tokens` tokens after
`before` cached (CSA, m = 4): row t sees the first (before + t + 1) // 4 of N = (before + tokens) // 4
entries, -inf past them; scores are standard normal. Each variant's picks must equal the default's;
time is `read_floor.timed_us`
(the median of 15 calls, each after a 256 MB read that flushes the L2, CUDA events).
"""

from __future__ import annotations

import argparse

import torch
from read_floor import timed_us

from dsv4.kernels.triton.topk import topk_smaller_index


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--before", type=int, default=24576)
    ap.add_argument("--k", type=int, default=512)
    o = ap.parse_args()
    dev = torch.device("cuda")
    n = (o.before + o.tokens) // 4
    g = torch.Generator(device=dev).manual_seed(0)
    s = torch.randn(o.tokens, n, device=dev, generator=g)
    vis = (o.before + torch.arange(o.tokens, device=dev) + 1) // 4
    s.masked_fill_(torch.arange(n, device=dev)[None, :] >= vis[:, None], float("-inf"))
    base = topk_smaller_index(s, o.k)
    variants = {"default": {}}
    for fc in (2048, 8192):
        variants[f"filter_chunk {fc}"] = {"filter_chunk": fc}
    for w in (4, 16):
        variants[f"warps {w}"] = {"num_warps": w}
    for gr in (1, 2, 8):
        variants[f"groups {gr} k"] = {"groups": gr * o.k}
    variants["filter_chunk 8192, warps 16"] = {"filter_chunk": 8192, "num_warps": 16}
    variants["filter_chunk 8192, warps 4"] = {"filter_chunk": 8192, "num_warps": 4}
    variants["one select (groups 0, chunk 0)"] = {"groups": 0, "chunk": 0}
    variants["two stages (groups 0, chunk 4096)"] = {"groups": 0, "chunk": 4096}
    print(f"## top-k of [{o.tokens}, {n}] scores, k {o.k}: {s.numel() * 4 / 1e6:.0f} MB")
    for name, kw in variants.items():
        try:
            same = torch.equal(topk_smaller_index(s, o.k, **kw), base)
            us = timed_us(lambda kw=kw: topk_smaller_index(s, o.k, **kw), reps=15)
        except Exception as e:          # a variant that does not compile or launch
            print(f"  {name:<36} {type(e).__name__}: {str(e)[:80]}")
            continue
        print(f"  {name:<36} {us:9.1f} µs  {'' if same else 'DIFFERS'}")


if __name__ == "__main__":
    main()
