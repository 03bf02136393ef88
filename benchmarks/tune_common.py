"""What the tuning scripts share: the device, the results table, CUDA-graph timing, checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton

from dsv4.bench.common import LAYER_INDEX
from dsv4.bench.decode import random_selection
from dsv4.kernels.triton.decode_common import COMPILE_INFO

RESULTS: list[dict[str, Any]] = []
DEV = torch.device("cuda")


def graph_us(fn: Callable[[], Any], warmup: float = 10, rep: float = 50) -> float:
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    us = 1e3 * triton.testing.do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median")
    del g
    return us


def record(section: str, case: str, variant: str, us: float | None, **extra: Any) -> None:
    row = {"section": section, "case": case, "variant": variant, "us": us, **extra}
    RESULTS.append(row)
    tail = " ".join(f"{k}={v}" for k, v in extra.items())
    print(f"{section:<9} {case:<14} {variant:<44} {us if us is None else round(us, 1)!s:>9} µs  {tail}", flush=True)


def attempt(section: str, case: str, variant: str, run: Callable[[], Any], check: Callable[[Any], str | None],
            kernel: str | None = None) -> None:
    try:
        out = run()
        torch.cuda.synchronize()
        bad = check(out)
        info = dict(COMPILE_INFO.get(kernel, {})) if kernel else {}
        us = graph_us(run)
        record(section, case, variant, us, **info, **({"WRONG": bad} if bad else {}))
    except Exception as e:
        record(section, case, variant, None, error=f"{type(e).__name__}: {str(e)[:120]}")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        return float("inf")
    return ((a[fin] - b[fin]).abs().max() / b[fin].abs().max()).item()


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of |set(a) & set(b)| / |set(b)| (valid indices only)."""
    tot = 0.0
    for ra, rb in zip(a.tolist(), b.tolist()):
        sa, sb = {x for x in ra if x >= 0}, {x for x in rb if x >= 0}
        tot += len(sa & sb) / max(1, len(sb))
    return tot / a.shape[0]


def attention_case(st: Any, kind: str, bsz: int, ctx: int, dev: torch.device) -> tuple:
    """`decode_attention`'s arguments for the V4-Flash CSA or HCA layer of a built decode state
    (`dsv4.bench.setup.build_decode_state`): bf16 queries, random sinks and, for CSA, a random
    top-512 selection, all seeded."""
    mgr, b = st.mgr, st.batch
    li = LAYER_INDEX[kind]
    sch, stt, pool = mgr.schemas[li], mgr.states[li], mgr.paged[li]
    g = torch.Generator(device=dev).manual_seed(1)
    sel = random_selection(bsz, (ctx - 1) // 4, 512, dev, g) if kind == "csa" else None
    ne = None if kind == "csa" else b.seq_lens // sch.compress_ratio
    q = torch.randn(bsz, 64, 512, device=dev, generator=g).to(torch.bfloat16)
    sinks = torch.randn(64, device=dev, generator=g)
    return (q, stt.swa, sch.kv_format, stt.swa_pos, b.request_slots, b.positions, 128, pool.kv, b.block_table,
            sch.entries_per_block, sel, ne, b.seq_len_bound // sch.compress_ratio, sinks, 512 ** -0.5)
