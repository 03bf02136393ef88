"""Device time of the decode attention's split combine against its program tile (CUDA only).

    python benchmarks/combine_trip.py [--splits 66] [--batches 1,2] [--tiles 8x64x8,4x32x8,...]

Partials as the fused kernel leaves them at B = 1 on a 132-SM GPU (66 key splits of 64 heads x
512 channels), combined with the rotation and a bf16 output as the layer asks; each tile's result
is checked against the 8 heads x 64 channels x trips of 8 one. CUDA-graph replays, L2 flushed
(`tune_common.graph_us`).
"""

from __future__ import annotations

import argparse
import sys

import torch
from tune_common import graph_us

from dsv4.kernels.triton.decode_combine import combine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--splits", type=int, default=66)
    p.add_argument("--batches", default="1,2")
    p.add_argument("--tiles", default="8x64x8,4x64x8,2x64x8,4x32x8,8x32x8,4x32x16,2x32x16,8x64x16",
                   help="heads x channels x splits per trip of a program")
    a = p.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    for bsz in (int(x) for x in a.batches.split(",")):
        part = torch.randn(bsz, a.splits, 64, 512, device="cuda", generator=g)
        pml = torch.stack([torch.randn(bsz, a.splits, 64, device="cuda", generator=g),
                           torch.rand(bsz, a.splits, 64, device="cuda", generator=g) + 1], dim=-1)
        sinks = torch.randn(64, device="cuda", generator=g)
        ang = torch.rand(bsz, 32, device="cuda", generator=g) * 6.3
        rope = (ang.cos(), ang.sin())
        args = (part, pml, sinks, rope, torch.bfloat16, 512, 8, True)
        base = combine(*args, trip=8, block_h=8, block_d=64)
        for tile in a.tiles.split(","):
            bh, bd, trip = (int(x) for x in tile.split("x"))
            kw = dict(trip=trip, block_h=bh, block_d=bd)
            same = torch.equal(combine(*args, **kw), base)
            us = graph_us(lambda kw=kw, args=args: combine(*args, **kw))
            print(f"B={bsz} splits={a.splits} {bh} heads x {bd} channels, trips of {trip:2d}: {us:6.1f} µs  "
                  f"identical to 8 x 64 x 8: {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
