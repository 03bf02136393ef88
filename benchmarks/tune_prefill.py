"""Variants of a prefill chunk's compression, timed as `dsv4 bench` times compress_flush (CUDA only).

    python benchmarks/tune_prefill.py [--layers csa,hca] [--rounds 2] [VARIANT ...]

A variant is JSON: {"comp": {input width: compress_update tiles}, "ww": {row channels: write warps}},
e.g. '{"comp": {"512": {"split": 8, "num_warps": 8}}}' (HCA: c, z are 512 wide; CSA main 1024,
indexer 256) or '{"ww": {"128": 2}}' (indexer-key writes at two warps); "{}" is the defaults.
Each variant times what the layer runs per chunk (`compress_and_flush`: compressors, their
writes, CSA's indexer chain on the side stream) over a 32K prompt in 8K chunks: L2 flushed and a
spin ahead of each chunk, chunks summed, median of 15 runs (`Timer.time_regions`). Rounds
alternate the variants; the last lines are every round's µs per variant.
"""

from __future__ import annotations

import argparse
import json
import types

import torch

from dsv4.bench import setup as bench_setup
from dsv4.bench.common import LAYER_INDEX, bench_config
from dsv4.bench.prefill import compress_flush
from dsv4.bench.timing import Timer
from dsv4.cache.manager import KVCacheManager
from dsv4.cache.schema import block_fill_ratio, blocks_needed, build_schemas
from dsv4.kernels.dispatch import ops_for
from dsv4.kernels.triton import cache_ops, compress

DEV = torch.device("cuda")
DEFAULT_VARIANTS = ["{}", '{"ww": {"128": 2}}', '{"comp": {"1024": {"block_s": 4}}}',
                    '{"comp": {"256": {"block_s": 4}}}', '{"comp": {"1024": {"segs": 2}}}',
                    '{"comp": {"512": {"split": 16, "num_warps": 4, "block_s": 4}}}',
                    '{"comp": {"512": {"num_warps": 4}}}', '{"comp": {"512": {"block_s": 4}}}']


def apply(spec: str, ops: types.SimpleNamespace) -> None:
    """Route the op namespace's compress_update and the writes' warps through the variant."""
    d = json.loads(spec)
    tiles = {int(k): v for k, v in d.get("comp", {}).items()}
    warps = {int(k): v for k, v in d.get("ww", {}).items()}

    def compress_update(c, z, *a, **k):
        return compress.compress_update(c, z, *a, **{**k, **tiles.get(c.shape[1], {})})

    ops.compress_update = compress_update
    cache_ops._write_warps = lambda dim: warps.get(dim, _DEFAULT_WARPS(dim))


_DEFAULT_WARPS = cache_ops._write_warps


def chunked_run(blk, proj: dict[str, torch.Tensor], mgr: KVCacheManager, li: int, ops: types.SimpleNamespace,
                total: int, n: int):
    """One run of the prompt for `Timer.time_regions`: a fresh request, one region per chunk."""
    def run(region):
        if "p" in mgr.requests:
            mgr.free_request("p")
        mgr.add_request("p")
        for t0 in range(0, total, n):
            b = mgr.prepare_forward({"p": n})
            torch.cuda.synchronize()
            region(lambda t0=t0, b=b: compress_flush(blk, {k: v[t0:t0 + n] for k, v in proj.items()}, b, mgr, li,
                                                      ops))
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="*", default=DEFAULT_VARIANTS)
    ap.add_argument("--layers", default="csa,hca")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    args = ap.parse_args()
    cfg, tpb = bench_config(False)
    timer = Timer(types.SimpleNamespace(device=DEV, warmup_ms=10, rep_ms=50, host_warmup=3, host_reps=15,
                                        graph=False))
    ops = types.SimpleNamespace(**vars(ops_for(DEV, "triton")))         # a copy: the cached namespace stays
    n, total = args.chunk, args.prompt
    schemas = build_schemas(cfg, tokens_per_block=tpb, kv_format="fp8_ds", indexer_format_name="mxfp4")
    blocks = blocks_needed(total, tpb, block_fill_ratio(schemas)) + 1
    results: dict[tuple[str, str], list[float]] = {}
    with torch.no_grad():
        for kind in args.layers.split(","):
            li = LAYER_INDEX[kind]
            blk = bench_setup.make_block(cfg, li, DEV, 0)
            comp = blk.compressor
            x = torch.randn(total, cfg.hidden_size, device=DEV).to(torch.bfloat16)
            proj = {"c": comp.kv_proj(x), "z": comp.gate_proj(x)}
            if comp.overlap:
                proj.update(ic=comp.indexer.kv_proj(x), iz=comp.indexer.gate_proj(x))
            mgr = KVCacheManager(cfg, max_requests=1, num_blocks=blocks, device=DEV, kv_format="fp8_ds",
                                 indexer_format="mxfp4", tokens_per_block=tpb, max_batch_tokens=n)
            run = chunked_run(blk, proj, mgr, li, ops, total, n)
            for r in range(args.rounds):
                for spec in args.variants:
                    apply(spec, ops)
                    us = timer.time_regions(run).us
                    results.setdefault((kind, spec), []).append(us)
                    print(f"{kind} round {r} {us:8.1f} µs  {spec}", flush=True)
            apply("{}", ops)
    print("\nper variant, every round (µs):")
    for (kind, spec), v in results.items():
        print(f"{kind} " + " ".join(f"{u:7.1f}" for u in v) + f"  {spec}")


if __name__ == "__main__":
    main()
