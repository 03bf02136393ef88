"""Variants of the decode-step kernels at V4-Flash shapes, timed in one device call (CUDA only).

    python benchmarks/tune_decode.py [--contexts 131072] [--batches 1,64] [--quick-sweep] [--json out.json]

For each (context, batch): a synthetic cache (`dsv4.bench.setup.build_decode_state`), then

    topk      the reference's packed int64 torch.topk, fp32 torch.topk (not exact: ties), and the
              Triton radix select for several (block, warps); every Triton result is checked to be
              identical to the reference's
    scores    paged_indexer_scores variants (precision, block_n, warps, stages, E2M1 decode,
              programs per request); each checked against the bf16x2 result
    attention decode_attention variants (CSA over a random top-k selection, HCA over all
              entries): head block, key tile, warps, stages, splits; each checked against the
              default's output
    accuracy  score error of bf16 / bf16x2 against the fp32 reference scores, and the overlap of
              their top-k sets with the reference's top-k (on keys that are all distinct)

Every time is the median of `triton.testing.do_bench` over CUDA-graph replays (L2 flushed
between replays). Registers / spills come from the compiled kernels. Prints one table per
section; --json writes every number.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from dsv4.bench import setup as bench_setup
from dsv4.bench.common import LAYER_INDEX, bench_config
from dsv4.bench.decode import random_selection
from dsv4.kernels.reference import decode as ref
from dsv4.kernels.triton import decode_attention as att_mod
from dsv4.kernels.triton import indexer_scores as sc_mod
from dsv4.kernels.triton import topk as topk_mod
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


def focus_variants(section: str, batch: int) -> list[dict[str, Any]]:
    """--focus: the defaults against the runners-up of the first sweep (benchmarks/NOTES.md)."""
    small = batch <= 16
    if section == "topk":
        return [{}, dict(digit=4), dict(digit=6), dict(chunk=8192), dict(chunk=8192, num_warps=32),
                dict(num_warps=8), dict(num_warps=32), dict(chunk=2048), dict(num_warps=4),
                dict(num_warps=4, chunk=8192), dict(num_warps=16)]
    if section == "scores":
        return [{}, dict(precision="bf16x2", num_warps=8), dict(precision="bf16x2", block_n=128),
                dict(precision="bf16x2", num_programs=128 if small else 4), dict(precision="bf16"),
                dict(precision="bf16", block_n=128)]
    if not small:     # the halves scheme's tiles and splits against the two-pass scheme's defaults
        return [{}, dict(block_n=16), dict(num_splits=1), dict(num_splits=3), dict(scheme="two_pass")]
    return [{}, dict(num_stages=3, split_keys=256), dict(split_keys=256), dict(split_keys=32),
            dict(block_n=16, num_warps=4), dict(num_splits=16, block_n=16), dict(block_n=64),
            dict(block_n=64, split_keys=128)]


def scan_variants(batch: int) -> list[dict[str, Any]]:
    """--scan-sweep: `indexer_scan` layouts and tiles at the default precision, the previous kernel
    (scan=False) and bf16x2."""
    out: list[dict[str, Any]] = [{}, dict(scan=False), dict(prefetch=False), dict(block_n=128), dict(num_stages=1),
                                 dict(keys_m=False), dict(keys_m=False, prefetch=False),
                                 dict(keys_m=False, block_n=128), dict(keys_m=False, block_n=128, prefetch=False),
                                 dict(keys_m=False, num_warps=8, block_n=128), dict(num_warps=8, block_n=128)]
    out += [dict(num_programs=n) for n in ((9, 12, 24, 33, 66) if batch >= 64 else (33, 66, 264))]
    out += [dict(precision="bf16x2"), dict(precision="bf16x2", keys_m=False)]
    return out


def indexer_variants(case: str, batch: int, quick: bool, focus: bool, scan_sweep: bool, only: str | None,
                     scores: torch.Tensor, want_top: torch.Tensor, idx: Any, sargs: tuple, base: torch.Tensor) -> None:
    """The top-k variants on the given scores, then (unless only top-k) the indexer scores variants."""
    attempt("topk", case, "torch int64 packed (reference, before)", lambda: ref.topk_smaller_index(scores, idx.topk),
            lambda o: None if torch.equal(o, want_top) else "differs")
    attempt("topk", case, "torch fp32 topk (not exact)", lambda: torch.topk(scores, idx.topk, dim=1), lambda o: None)
    tk_variants: list[dict[str, Any]] = [{}]
    if scan_sweep:
        tk_variants += [dict(chunk=8192), dict(chunk=8192, num_warps=8), dict(chunk=2048),
                        dict(chunk=4096, num_warps=8), dict(chunk=16384)]
    if not quick:
        tk_variants += [dict(chunk=0), dict(chunk=0, block=8192), dict(chunk=2048), dict(chunk=8192),
                        dict(chunk=4096, num_warps=4), dict(chunk=4096, num_warps=16), dict(chunk=2048, num_warps=4)]
    if focus:
        tk_variants = focus_variants("topk", batch)
    for kw in tk_variants:
        attempt("topk", case, "triton " + (" ".join(f"{k}={v}" for k, v in kw.items()) or "default"),
                lambda kw=kw: topk_mod.topk_smaller_index(scores, idx.topk, **kw),
                lambda o: None if torch.equal(o, want_top) else f"{(o != want_top).sum().item()} differ")
    if only == "topk":
        return

    def sc_check(o: torch.Tensor, tol: float = 2e-2) -> str | None:
        e = rel(o, base)
        return None if e < tol else f"err {e:.2g}"

    sc_variants: list[dict[str, Any]] = [dict(precision="bf16x2"), dict(precision="bf16")]
    if not quick:
        sc_variants += [
            dict(precision="bf16", block_n=128), dict(precision="bf16", num_warps=4),
            dict(precision="bf16", block_n=128, num_warps=4), dict(precision="bf16", decode=1),
            dict(precision="bf16", decode=1, block_n=128), dict(precision="bf16", num_stages=1),
            dict(precision="bf16", num_stages=2),
            dict(precision="bf16", num_programs=4 if batch > 8 else 128),
            dict(precision="bf16", num_programs=32 if batch > 8 else 256),
        ]
    if focus:
        sc_variants = focus_variants("scores", batch)
    if scan_sweep:
        sc_variants = scan_variants(batch)
    # every variant must match the bf16x2 kernel (~3e-6 off fp32) to 1e-4: the queries are rounded as
    # the layer rounds them, so "bf16" has exact operands for mxfp4 / bf16 keys
    for kw in sc_variants:
        attempt("scores", case, " ".join(f"{k}={v}" for k, v in kw.items()),
                lambda kw=kw: sc_mod.paged_indexer_scores(*sargs, **kw), lambda o: sc_check(o, 1e-4),
                "indexer_scores")


def sweep_case(cfg, tpb, blocks, context: int, batch: int, quick: bool, focus: bool = False,
               scan_sweep: bool = False, only: str | None = None) -> None:
    dev = DEV
    t0 = time.time()
    st = bench_setup.build_decode_state(cfg, context=context, batch=batch, device=dev, tokens_per_block=tpb,
                                        kv_format="fp8_ds", indexer_format="mxfp4", seed=0)
    print(f"# state C={context} B={batch} built in {time.time() - t0:.1f} s", flush=True)
    case = f"C={context // 1024 or context}K B={batch}"
    mgr, b = st.mgr, st.batch
    gen = torch.Generator(device=dev).manual_seed(1)

    # ------------------------------------------------------------------ indexer: scores + top-k
    li = LAYER_INDEX["csa"]
    sch, pool = mgr.schemas[li], mgr.paged[li]
    ifmt, epb, ratio = sch.indexer_format, sch.entries_per_block, sch.compress_ratio
    idx = blocks["csa"].compressor.indexer
    qi = ifmt.round_query(ifmt.to_stored_basis(torch.randn(batch, idx.heads, idx.dim, device=dev, generator=gen)))
    g = torch.randn(batch, idx.heads, device=dev, generator=gen)
    nent, nmax = b.seq_lens // ratio, b.seq_len_bound // ratio
    sargs = (qi, g, pool.indexer, ifmt, b.block_table, nent, nmax, epb)
    base = sc_mod.paged_indexer_scores(*sargs, precision="bf16x2", scan=False)
    scores = base.clone()
    want_top = ref.topk_smaller_index(scores, idx.topk)

    if only != "attention":
        indexer_variants(case, batch, quick, focus, scan_sweep, only, scores, want_top, idx, sargs, base)
    if only == "topk":
        return

    # ------------------------------------------------------------------ attention
    cfgm = blocks["csa"].cfg
    q = torch.randn(batch, cfgm.num_attention_heads, cfgm.head_dim, device=dev, generator=gen)
    for kind in ("csa", "hca"):
        li = LAYER_INDEX[kind]
        sch, stt, pool = mgr.schemas[li], mgr.states[li], mgr.paged[li]
        r = sch.compress_ratio
        sel = random_selection(batch, context // r, idx.topk, dev, gen) if kind == "csa" else None
        ne = None if kind == "csa" else b.seq_lens // r
        aargs = (q, stt.swa, sch.kv_format, stt.swa_pos, b.request_slots, b.positions, cfgm.sliding_window,
                 pool.kv, b.block_table, sch.entries_per_block, sel, ne, b.seq_len_bound // r,
                 blocks[kind].sinks, cfgm.head_dim ** -0.5)
        want = att_mod.decode_attention(*aargs)

        def a_check(o: torch.Tensor, want=want) -> str | None:
            e = rel(o, want)
            return None if e < 1e-2 else f"err {e:.2g}"

        variants: list[dict[str, Any]] = [{}]
        if not quick:
            variants += [dict(num_stages=1), dict(num_stages=2), dict(block_n=16), dict(block_n=16, num_warps=4),
                         dict(block_h=32, block_n=16), dict(split_keys=64), dict(num_splits=1), dict(num_splits=4)]
            if batch <= 16:
                variants += [dict(num_splits=16, block_n=16), dict(num_splits=32, block_n=16),
                             dict(num_splits=64, block_n=16), dict(num_splits=32, block_n=16, num_warps=4),
                             dict(num_splits=16)]
        # the three schemes against each other, and the tiles of the halves and two-pass ones
        variants += [dict(scheme="fused"), dict(scheme="halves"), dict(scheme="two_pass")]
        tp = {"scheme": "two_pass"}
        if batch >= 32:
            variants += [dict(scheme="halves", block_n=16), dict(scheme="halves", num_splits=3),
                         dict(tp, score_splits=3), dict(tp, value_splits=2)]
        elif batch >= 8:
            variants += [dict(scheme="halves", block_n=16), dict(tp, value_splits=1), dict(tp, score_splits=4)]
        else:
            variants += [dict(tp, value_splits=8)]
        if focus:
            variants = focus_variants("attention", batch)
        for kw in variants:
            attempt(f"att-{kind}", case, " ".join(f"{k}={v}" for k, v in kw.items()) or "default",
                    lambda kw=kw, aargs=aargs: att_mod.decode_attention(*aargs, **kw), a_check, "decode_attention")
    del st, mgr
    torch.cuda.empty_cache()


@triton.jit
def _stream_kernel(c_ptr, z_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """The read floor of a compressor's inputs: c and z in contiguous tiles of BLOCK elements, one sum out."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(c_ptr + offs, mask=m, other=0.0).to(tl.float32) + tl.load(z_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(x, 0))


def prefill_compress(chunk: int = 8192) -> None:
    """compress_update of one prefill chunk (a request's first): device time (graph replay) and the
    time from a synced start to its end (host work included, as `dsv4 bench` times it)."""
    from dsv4.kernels.triton.compress import compress_update
    dev = DEV
    cases = (("csa main", 512, 4, True), ("csa indexer", 128, 4, True), ("hca", 512, 128, False))
    for name, d, ratio, overlap in cases:
        dc = 2 * d if overlap else d
        c = torch.randn(chunk, dc, device=dev).bfloat16()          # as the layer's projection GEMM gives them
        z = torch.randn(chunk, dc, device=dev).bfloat16()
        bias = torch.randn(ratio, dc, device=dev)
        state = torch.zeros(4, 3, 2 if overlap else 1, d, device=dev)
        slots = torch.tensor([1], dtype=torch.int32, device=dev)
        nbytes = 2 * chunk * dc * 2 + (chunk // ratio) * d * 4

        # (segs, block_d, block_s, split, num_warps); {} = the defaults
        variants: list[dict[str, int]] = [{}]
        if name == "csa main":
            variants += [dict(block_s=8), dict(num_warps=2), dict(num_warps=8), dict(segs=8), dict(segs=2, num_warps=2),
                         dict(single=False)]
        elif name == "csa indexer":
            variants += [dict(block_s=4), dict(num_warps=2), dict(segs=8), dict(segs=2, num_warps=1),
                         dict(single=False)]
        else:
            variants += [dict(block_s=8), dict(block_s=2), dict(split=32), dict(block_d=16, num_warps=2),
                         dict(block_d=64, num_warps=8), dict(segs=4, num_warps=8), dict(single=False)]
        sums = torch.empty(triton.cdiv(c.numel(), 4096), device=dev)
        prefill_one(name + " read floor (stream c, z)", chunk,
                    lambda c=c, z=z, sums=sums: _stream_kernel[(sums.numel(),)](c, z, sums, c.numel(), BLOCK=4096),
                    2 * chunk * dc * 2)
        cf, zf = c.float(), z.float() + bias[torch.arange(chunk, device=dev) % ratio]
        prefill_one(name + " fp32 inputs, bias added before (the layer's old path, kernel only)", chunk,
                    lambda cf=cf, zf=zf, state=state, slots=slots, ratio=ratio, overlap=overlap:
                    compress_update(cf, zf, state, slots, (chunk,), (chunk,), ratio, overlap), nbytes)
        for kw in variants:
            def run(c=c, z=z, state=state, slots=slots, ratio=ratio, overlap=overlap, kw=kw, bias=bias):
                return compress_update(c, z, state, slots, (chunk,), (chunk,), ratio, overlap, z_bias=bias, **kw)

            prefill_one(name + " " + (" ".join(f"{k}={v}" for k, v in kw.items()) or "default"), chunk, run, nbytes)


def prefill_attention_variants(cfg, tpb: int, chunk: int = 8192, cached: int = 24576) -> None:
    """prefill_attention of one chunk after `cached` tokens (the last 8K chunk of a 32K prompt), fp8_ds,
    V4-Flash heads: CSA over a random top-512 selection of the visible entries per token, HCA over
    every visible entry; each variant checked against the default's output."""
    from dsv4.cache.manager import KVCacheManager
    from dsv4.kernels.triton.prefill_attention import prefill_attention
    total = cached + chunk
    mgr = KVCacheManager(cfg, max_requests=1, num_blocks=total // tpb + 4, device=DEV, kv_format="fp8_ds",
                         indexer_format="mxfp4", tokens_per_block=tpb, max_batch_tokens=cached)
    mgr.add_request("r")
    b1 = mgr.prepare_forward({"r": cached})
    for li in LAYER_INDEX.values():
        mgr.acquire(li, b1).write_swa(torch.randn(cached, cfg.head_dim, device=DEV))
    batch = mgr.prepare_forward({"r": chunk})
    q = torch.randn(chunk, cfg.num_attention_heads, cfg.head_dim, device=DEV)
    sinks = torch.randn(cfg.num_attention_heads, device=DEV)
    for kind, li in LAYER_INDEX.items():
        h, sch = mgr.acquire(li, batch), mgr.schemas[li]
        old_kv, old_pos, _ = h.gather_swa_kv()
        ratio = sch.compress_ratio
        n = total // ratio
        keys = torch.randn(n, cfg.indexer_head_dim, device=DEV) if sch.indexer_format is not None else None
        h.flush_compression(torch.randn(n, cfg.head_dim, device=DEV), torch.zeros(n, dtype=torch.long, device=DEV),
                            torch.arange(n, device=DEV), keys)
        indices = None
        if kind == "csa":
            vis = (batch.positions.long() + 1) // ratio                                   # [T]
            r = torch.rand(chunk, n, device=DEV).masked_fill(torch.arange(n, device=DEV)[None, :] >= vis[:, None], 2)
            indices = r.topk(cfg.index_topk, dim=1, largest=False).indices                # distinct visible picks
        new_kv = sch.kv_format.roundtrip(torch.randn(chunk, cfg.head_dim, device=DEV))
        args = (q, old_kv, old_pos, new_kv, batch.positions, batch.token_request, batch.cu_seqlens,
                cfg.sliding_window, mgr.paged[li].kv, sch.kv_format, batch.block_table, sch.entries_per_block,
                indices, ratio, h.max_entries(), sinks, cfg.head_dim ** -0.5)
        want = prefill_attention(*args, scheme="fused")
        for kw in ({}, dict(scheme="fused"), dict(scheme="halves", block_n=16),
                   dict(scheme="fused", block_h=16, block_n=32, num_warps=8),
                   dict(scheme="fused", block_h=16, block_n=64, num_warps=8, num_stages=2)):
            attempt("pattn", f"{kind} T={chunk}", " ".join(f"{k}={v}" for k, v in kw.items()) or "default",
                    lambda kw=kw, args=args: prefill_attention(*args, **kw),
                    lambda out, want=want: None if rel(out, want) < 1e-2 else f"rel {rel(out, want):.2e}",
                    "prefill_attention")
        # the layer's form: the inverse rotation and the bf16 output in the attention op
        finish = dict(rope=(torch.rand(chunk, 32, device=DEV), torch.rand(chunk, 32, device=DEV)),
                      out_dtype=torch.bfloat16)
        want = prefill_attention(*args, scheme="fused", **finish).float()
        for kw in (dict(scheme="fused", **finish), dict(scheme="halves", **finish)):
            attempt("pattn", f"{kind} T={chunk}", f"scheme={kw['scheme']} rope bf16-out",
                    lambda kw=kw, args=args: prefill_attention(*args, **kw),
                    lambda out, want=want: None if rel(out.float(), want) < 1e-2 else f"rel {rel(out.float(), want)}",
                    "prefill_attention")


def prefill_indexer_variants(cfg, tpb: int, chunk: int = 8192, cached: int = 24576) -> None:
    """The prefill indexer of one chunk after `cached` tokens (the last 8K chunk of a 32K prompt),
    mxfp4 keys, V4-Flash indexer heads: scores of every token by the per-row decode scan and by the
    grouped scan (tokens per program x tile x warps x programs per group), checked against the
    per-row scores; then the whole selection (scores and top-k in 2,048-row slices) both ways."""
    from dsv4.cache.manager import KVCacheManager
    from dsv4.kernels.triton import indexer_prefill as ip
    total, li = cached + chunk, LAYER_INDEX["csa"]
    mgr = KVCacheManager(cfg, max_requests=1, num_blocks=total // tpb + 4, device=DEV, kv_format="fp8_ds",
                         indexer_format="mxfp4", tokens_per_block=tpb, max_batch_tokens=cached)
    mgr.add_request("r")
    mgr.prepare_forward({"r": cached})
    batch = mgr.prepare_forward({"r": chunk})
    h, sch = mgr.acquire(li, batch), mgr.schemas[li]
    n = total // sch.compress_ratio
    h.flush_compression(torch.randn(n, cfg.head_dim, device=DEV), torch.zeros(n, dtype=torch.long, device=DEV),
                        torch.arange(n, device=DEV), torch.randn(n, cfg.indexer_head_dim, device=DEV))
    fmt, views, epb = sch.indexer_format, mgr.paged[li].indexer, sch.entries_per_block
    q = fmt.round_query(fmt.to_stored_basis(torch.randn(chunk, cfg.index_n_heads, cfg.indexer_head_dim, device=DEV)))
    g = torch.randn(chunk, cfg.index_n_heads, device=DEV)
    visible = ((batch.positions.long() + 1) // sch.compress_ratio).to(torch.int32)
    table = batch.block_table[:, :-(-n // epb)]
    rows_table = table[batch.token_request.long()].contiguous()
    want = sc_mod.paged_indexer_scores(q, g, views, fmt, rows_table, visible, n, epb)
    case = f"T={chunk} after {cached}"
    check = lambda out: None if rel(out, want) < 1e-5 else f"rel {rel(out, want):.2e}"  # noqa: E731
    attempt("pindexer", case, "per-row scan", lambda: sc_mod.paged_indexer_scores(q, g, views, fmt, rows_table,
                                                                                   visible, n, epb),
            check, "indexer_scores")
    for tokens, dt, bn, warps, progs, pf in ((1, 1, 64, 4, 1, False), (4, 4, 64, 4, 1, False),
                                             (4, 2, 64, 4, 1, False), (4, 2, 64, 4, 1, True), (4, 2, 64, 4, 2, True),
                                             (4, 2, 64, 8, 1, True), (8, 2, 64, 8, 1, True)):
        groups = ip.token_groups((chunk,), 0, chunk, tokens, DEV)
        attempt("pindexer", case, f"grouped tokens={tokens}x{dt} bn={bn} warps={warps} programs={progs} prefetch={pf}",
                lambda tokens=tokens, dt=dt, groups=groups, bn=bn, warps=warps, progs=progs, pf=pf: ip.grouped_scores(
                    q, g, views, fmt, table, visible, groups, n, epb, tokens=tokens, dot_tokens=dt, block_n=bn,
                    num_warps=warps, programs=progs, prefetch=pf),
                check, "indexer_prefill_scan")
    scores = ip.grouped_scores(q, g, views, fmt, table, visible, ip.token_groups((chunk,), 0, chunk, ip.TOKENS, DEV), n,
                               epb, tokens=ip.TOKENS)
    top = topk_mod.topk_smaller_index(scores, cfg.index_topk)
    for kw in ({}, dict(num_warps=8, block=4096)):
        attempt("pindexer", case, "top-k " + (" ".join(f"{k}={v}" for k, v in kw.items()) or "default"),
                lambda kw=kw: topk_mod.topk_smaller_index(scores, cfg.index_topk, **kw),
                lambda out: None if torch.equal(out, top) else "differs")
    args = (q, g, views, fmt, batch.block_table, batch.token_request, batch.positions, batch.query_lens_host,
            (n,), sch.compress_ratio, cfg.index_topk, epb)
    ref_sel = ip.prefill_indexer_topk(*args, tokens=0)
    for tokens in (0, ip.TOKENS):      # host work per slice (the groups' table): timed without a graph
        run = lambda tokens=tokens: ip.prefill_indexer_topk(*args, tokens=tokens)  # noqa: E731
        out = run()
        us = 1e3 * triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
        record("pindexer", case, f"selection tokens={tokens or 'per-row'} (no graph)", us,
               **({} if torch.equal(out, ref_sel) else {"WRONG": f"overlap {overlap(out, ref_sel):.4f}"}))


def prefill_one(name: str, chunk: int, run: Callable[[], Any], nbytes: int) -> None:
    us = graph_us(run)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(20):
        torch.cuda.synchronize()
        a.record()
        run()
        b.record()
        b.synchronize()
        samples.append(1e3 * a.elapsed_time(b))
    host = sorted(samples)[len(samples) // 2]
    record("prefill", f"chunk {chunk}", name, us, host_incl_us=round(host, 1),
           pct_bw_device=round(100 * nbytes / (us * 1e-6) / 4.248e12, 1))


def accuracy(cfg, tpb, blocks, context: int, batch: int) -> None:
    """Score error and top-k overlap of bf16 / bf16x2 vs the fp32 reference on all-distinct keys."""
    dev = DEV
    old = bench_setup._PATTERN_ROWS
    bench_setup._PATTERN_ROWS = 1 << 30                      # every page its own random rows
    try:
        st = bench_setup.build_decode_state(cfg, context=context, batch=batch, device=dev, tokens_per_block=tpb,
                                            kv_format="fp8_ds", indexer_format="mxfp4", seed=3)
    finally:
        bench_setup._PATTERN_ROWS = old
    mgr, b = st.mgr, st.batch
    li = LAYER_INDEX["csa"]
    sch, pool = mgr.schemas[li], mgr.paged[li]
    ifmt, epb, ratio = sch.indexer_format, sch.entries_per_block, sch.compress_ratio
    idx = blocks["csa"].compressor.indexer
    gen = torch.Generator(device=dev).manual_seed(5)
    qi = ifmt.round_query(ifmt.to_stored_basis(torch.randn(batch, idx.heads, idx.dim, device=dev, generator=gen)))
    g = torch.randn(batch, idx.heads, device=dev, generator=gen)
    sargs = (qi, g, pool.indexer, ifmt, b.block_table, b.seq_lens // ratio, b.seq_len_bound // ratio, epb)
    want = ref.paged_indexer_scores(*sargs)
    top_ref = ref.topk_smaller_index(want, idx.topk)
    case = f"C={context // 1024 or context}K B={batch}"
    for prec in ("bf16x2", "bf16"):
        for scan in (True, False):
            s = sc_mod.paged_indexer_scores(*sargs, precision=prec, scan=scan)
            top = topk_mod.topk_smaller_index(s, idx.topk)
            record("accuracy", case, f"{prec} scan={scan}", None, max_rel_err=f"{rel(s, want):.2e}",
                   topk_overlap=f"{overlap(top, top_ref):.4f}",
                   identical_topk=f"{(top == top_ref).all(dim=1).float().mean().item():.3f}")
    del st, mgr
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="131072")
    p.add_argument("--batches", default="64,1")
    p.add_argument("--quick-sweep", action="store_true", help="defaults only (a smoke run)")
    p.add_argument("--focus", action="store_true", help="defaults vs the first sweep's runners-up")
    p.add_argument("--scan-sweep", action="store_true", help="indexer scores / top-k variants (scan kernel)")
    p.add_argument("--no-accuracy", action="store_true")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--prefill-only", action="store_true", help="only the prefill compressor variants")
    p.add_argument("--prefill-attention", action="store_true", help="only the prefill attention variants")
    p.add_argument("--prefill-indexer", action="store_true", help="only the prefill indexer variants")
    p.add_argument("--only", choices=("topk", "attention"), help="only the top-k / attention variants")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_decode: needs a CUDA device", file=sys.stderr)
        return 2
    cfg, tpb = bench_config(False)
    blocks = {k: bench_setup.make_block(cfg, LAYER_INDEX[k], DEV) for k in ("csa", "hca")}
    with torch.no_grad():
        if a.prefill_attention:
            prefill_attention_variants(cfg, tpb)
            a.prefill_only = a.no_prefill = True
        if a.prefill_indexer:
            prefill_indexer_variants(cfg, tpb)
            a.prefill_only = a.no_prefill = True
        fns = ([] if a.no_accuracy or a.prefill_only else [lambda: accuracy(cfg, tpb, blocks, 131072, 4)])
        for fn in fns + ([] if a.no_prefill else [prefill_compress]):
            try:
                fn()
            except Exception as e:
                print(f"# failed: {type(e).__name__}: {e}", flush=True)
        for c in ([] if a.prefill_only else (int(x) for x in a.contexts.split(","))):
            for bsz in (int(x) for x in a.batches.split(",")):
                sweep_case(cfg, tpb, blocks, c, bsz, a.quick_sweep, a.focus, a.scan_sweep, a.only)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(RESULTS, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
