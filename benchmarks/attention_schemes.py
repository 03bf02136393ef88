"""The decode attention's three schemes side by side at V4-Flash shapes (CUDA; CPU: a check).

    python benchmarks/attention_schemes.py               # 128K, B = 64, 16, 8, 4, 1
    BATCHES=64 VARIANTS="halves;halves,16;halves,32,3;two_pass;fused" python benchmarks/attention_schemes.py

A variant is "scheme[,block_n[,num_splits]]" (`decode_attention`'s knobs; empty = its default).
Prints µs (CUDA-graph replays, L2 flushed by `dsv4.bench.timing.Timer`), the max error against the
fp32 reference relative to its largest output, and the registers / spills of the last compile.
"""

from __future__ import annotations

import os
import types

import torch
from tune_common import attention_case

from dsv4.bench import setup as bs
from dsv4.bench.common import bench_config
from dsv4.bench.timing import Timer
from dsv4.kernels.reference import decode as ref
from dsv4.kernels.triton import decode_attention as att
from dsv4.kernels.triton.decode_common import COMPILE_INFO


def _knobs(variant: str) -> dict:
    parts = variant.split(",")
    kw: dict = {"scheme": parts[0]} if parts[0] else {}
    if len(parts) > 1 and parts[1]:
        kw["block_n"] = int(parts[1])
    if len(parts) > 2 and parts[2]:
        kw["num_splits"] = int(parts[2])
    return kw


def main() -> int:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    ctx = int(os.environ.get("CTX", 131072 if cuda else 600))
    batches = [int(x) for x in os.environ.get("BATCHES", "64,16,8,4,1" if cuda else "2").split(",")]
    variants = os.environ.get("VARIANTS", "halves;two_pass;fused" if cuda else "halves;two_pass").split(";")
    timer = Timer(types.SimpleNamespace(device=dev, warmup_ms=10, rep_ms=50, host_warmup=3, host_reps=15, graph=True))
    cfg, tpb = bench_config(False)
    for bsz in batches:
        st = bs.build_decode_state(cfg, context=ctx, batch=bsz, device=dev, tokens_per_block=tpb,
                                   kv_format="fp8_ds", indexer_format="mxfp4")
        for kind in ("csa", "hca"):
            aargs = attention_case(st, kind, bsz, ctx, dev)
            want = ref.decode_attention(*aargs)
            row = []
            for v in variants:
                kw = _knobs(v)
                COMPILE_INFO.clear()
                err = ((att.decode_attention(*aargs, **kw) - want).abs().max() / want.abs().max()).item()
                us = timer.time(lambda kw=kw, a=aargs: att.decode_attention(*a, **kw), graph=True).us
                regs = ", ".join(f"{k.split('.')[-1]} {c['regs']}/{c['spills']}" for k, c in COMPILE_INFO.items())
                row.append(f"{v or 'default'} {us:6.1f} (err {err:.1e}{'; ' + regs if regs else ''})")
            print(f"{kind} B={bsz} C={ctx}: " + "; ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
