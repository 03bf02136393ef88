"""Per-kernel device time of the decode top-k's paths (CUDA-graph replays, as tune_decode times them).

    python benchmarks/topk_parts.py [--batches 1,4,8,16,32,64] [--n 32768] [--k 512] [--parts]

Paths: the filter (`_group_max_kernel`, `_filter_kernel`, then `_filtered_select_kernel` over the
candidates) and the two stages (chunks' top-k, then the top-k of their picks), whole per batch size
(the filter is the default at every batch: `topk.FILTER_MIN_SCORES`) and, with --parts, each kernel alone on
inputs the kernel before it wrote, with launch variants. Timed as tune_decode times (L2 flushed before each replay).
Scores: standard normal, so the filter keeps about 1.15 k candidates per row (tune_decode reports
the counts on the scan's scores).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import triton
from tune_common import graph_us

from dsv4.kernels.reference.decode import topk_smaller_index as ref_topk
from dsv4.kernels.triton import topk as tk
from dsv4.kernels.triton.decode_common import pdl_launch


def filter_parts(s: torch.Tensor, k: int, fchunk: int, warps: int, blk: int, blk2: int
                 ) -> tuple[float, ...]:
    """The filter's three kernels (group maxima and bound, candidates, select; the maxima's arrival
    counts zeroed in the timed region, as `topk_smaller_index` does): all three, then each alone, then
    the maxima without the bound (the arrival counts set so that no program is a row's last)."""
    bsz, n = s.shape
    dev = s.device
    ch, p, g = tk.filter_layout(n, triton.next_power_of_2(tk.FILTER_GROUPS * k), fchunk, True)
    gmax = torch.empty(bsz, p * g, dtype=torch.int32, device=dev)
    cand = torch.empty(bsz, p * ch, dtype=torch.int64, device=dev)
    counts = torch.empty(bsz, 2 * p, dtype=torch.int32, device=dev)
    bound = torch.empty(bsz, 1, dtype=torch.int32, device=dev)
    arrive = torch.zeros(bsz, dtype=torch.int32, device=dev)
    out = torch.empty(bsz, k, dtype=torch.int64, device=dev)
    steps = triton.next_power_of_2(max(1, min(triton.cdiv(ch, g), 4096 // g)))

    tail = [0]                  # the arrival counts' start: 0, or -2^30 so that no row's last program runs

    def k1():
        arrive.fill_(tail[0])
        tk._group_max_kernel[(bsz, p)](s, gmax, bound, arrive, s.stride(0), gmax.stride(0), n, k, ch, p * g, G=g,
                                       SKEW=int(0.618 * g) | 1, STEPS=steps, NG=triton.next_power_of_2(p * g),
                                       PASSES=tk.FILTER_PASSES, DIGIT=tk.DIGIT, num_warps=4, **pdl_launch(dev))

    def k2():
        tile = min(blk, triton.next_power_of_2(ch))
        tk._filter_kernel[(bsz, p)](s, cand, counts, bound, s.stride(0), cand.stride(0), n, ch, SEGS=p, BLOCK=tile,
                                    ROW=max(1, tile // (32 * warps)), ORDER=0, num_warps=warps, **pdl_launch(dev))

    def k3():
        tk._filtered_select_kernel[(bsz,)](s, cand, counts, bound, out, s.stride(0), cand.stride(0), out.stride(0),
                                           n, k, ch, SEGS=p, SEL_BLOCK=blk2, K_PAD=triton.next_power_of_2(k),
                                           DIGIT=tk.DIGIT, ORDER=0, num_warps=warps, **pdl_launch(dev))

    def chain():
        k1()
        k2()
        k3()
    chain()
    assert torch.equal(out, ref_topk(s, k)), "the filter path differs from the reference"
    whole = (graph_us(chain), graph_us(k1), graph_us(k2), graph_us(k3))
    tail[0] = -2**30
    return whole + (graph_us(k1),)


def stage_parts(s: torch.Tensor, k: int) -> tuple[float, float, float]:
    bsz, n = s.shape
    ch = tk.DEFAULT_CHUNK
    g = triton.cdiv(n, ch)
    cand = torch.empty(bsz, g * k, dtype=torch.int64, device=s.device)
    bounds = torch.empty(bsz, g, dtype=torch.int32, device=s.device)
    out = torch.empty(bsz, k, dtype=torch.int64, device=s.device)
    cuda = True
    n2 = (g - 1) * k + min(k, n - (g - 1) * ch)

    def s1():
        tk._launch(s, s, cand, bounds, n, k, ch, g, False, False, None, None, cuda, None)

    def s2():
        tk._launch(s, cand, out, bounds, n2, k, n2, 1, True, True, None, None, cuda, None)

    return _time_pair(s1, s2, out, s, k, "two-stage")


def _time_pair(first: Callable[[], None], second: Callable[[], None], out: torch.Tensor, s: torch.Tensor, k: int,
               path: str) -> tuple[float, float, float]:
    """Run both kernels once, check the result against the reference, then time each and the pair."""
    def both() -> None:
        first()
        second()
    both()
    assert torch.equal(out, ref_topk(s, k)), f"{path} path differs from the reference"
    return graph_us(first), graph_us(second), graph_us(both)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,4,8,16,32,64")
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--parts", action="store_true", help="each kernel alone, with launch variants")
    a = p.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b in (int(x) for x in a.batches.split(",")):
        s = torch.randn(b, a.n, device="cuda", generator=gen)
        two = tk.topk_smaller_index(s, a.k, chunk=tk.DEFAULT_CHUNK)
        assert torch.equal(two, ref_topk(s, a.k))
        ng = tk.FILTER_GROUPS * a.k
        whole = (graph_us(lambda s=s: tk.topk_smaller_index(s, a.k, chunk=tk.DEFAULT_CHUNK)),
                 graph_us(lambda s=s, ng=ng: tk.topk_smaller_index(s, a.k, groups=ng, filter_chunk=a.n)),
                 graph_us(lambda s=s, ng=ng: tk.topk_smaller_index(s, a.k, groups=ng)))
        print(f"B={b} N={a.n} k={a.k}: two stages / filter, one program per row / filter, {tk.FILTER_CHUNK} "
              "scores per program  " + " / ".join(f"{x:.1f}" for x in whole) + " µs", flush=True)
        if not a.parts:
            continue
        print(f"B={b}: two stages  stage 1 / stage 2 / both  " +
              " / ".join(f"{x:.1f}" for x in stage_parts(s, a.k)) + " µs", flush=True)
        for fchunk, warps, blk, blk2 in ((4096, 8, 1024, 1024), (2048, 8, 1024, 1024), (8192, 8, 1024, 1024),
                                         (4096, 4, 1024, 1024), (4096, 16, 1024, 1024), (4096, 8, 2048, 1024),
                                         (4096, 8, 1024, 2048), (4096, 4, 1024, 512)):
            r = filter_parts(s, a.k, fchunk, warps, blk, blk2)
            print(f"B={b} filter chunk {fchunk:5d} warps {warps:2d} tile {blk:5d} select block {blk2:4d}: "
                  "all three / maxima / candidates / select / maxima without bound  "
                  + " / ".join(f"{x:.1f}" for x in r) + " µs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
