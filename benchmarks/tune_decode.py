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
    prefill   the prefill chunk's compressors (unless --no-prefill), or only them (--prefill-only),
              the prefill attention (--prefill-attention), the prefill indexer (--prefill-indexer):
              `tune_prefill.py`

Every time is the median of `triton.testing.do_bench` over CUDA-graph replays (L2 flushed
between replays). Registers / spills come from the compiled kernels. Prints one table per
section; --json writes every number.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
from tune_common import DEV, RESULTS, attempt, overlap, record, rel
from tune_prefill import prefill_attention_variants, prefill_compress, prefill_indexer_variants

from dsv4.bench import setup as bench_setup
from dsv4.bench.common import LAYER_INDEX, bench_config
from dsv4.bench.decode import random_selection
from dsv4.kernels.reference import decode as ref
from dsv4.kernels.triton import decode_attention as att_mod
from dsv4.kernels.triton import indexer_scores as sc_mod
from dsv4.kernels.triton import topk as topk_mod


def focus_variants(section: str, batch: int) -> list[dict[str, Any]]:
    """--focus: the defaults against the runners-up of the first sweep (benchmarks/NOTES.md)."""
    small = batch <= 16
    if section == "topk":
        return [{}, dict(chunk=4096), dict(groups=1024), dict(groups=4096), dict(num_warps=8),
                dict(num_warps=32), dict(digit=4), dict(digit=6), dict(block=2048), dict(block=8192),
                dict(chunk=8192), dict(chunk=2048)]
    if section == "scores":
        return [{}, dict(precision="bf16x2", num_warps=8), dict(precision="bf16x2", block_n=128),
                dict(precision="bf16x2", num_programs=128 if small else 4), dict(precision="bf16"),
                dict(precision="bf16", block_n=128)]
    if not small:     # the halves scheme's tiles and splits against the two-pass scheme's defaults
        return [{}, dict(block_n=16), dict(num_splits=1), dict(num_splits=3), dict(scheme="two_pass")]
    return [{}, dict(num_stages=3, split_keys=256), dict(split_keys=256), dict(split_keys=32),
            dict(block_n=16, num_warps=4), dict(num_splits=16, block_n=16), dict(block_n=64),
            dict(block_n=64, split_keys=128)]


def scan_variants(batch: int, quick: bool) -> list[dict[str, Any]]:
    """--scan-sweep: the TMA scan (`indexer_scan_tma`, the default where it runs) against its bf16 MMA
    alone (tma_int8=False) and the pointer scan (tma=False), its stages, registers and programs per SM
    (with --quick-sweep: the first three and the programs per SM)."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    out: list[dict[str, Any]] = [{}, dict(tma_int8=True), dict(tma_int8=False), dict(tma=False)]
    if not quick:
        out += [dict(tma_stages=3), dict(tma_stages=4), dict(tma=True), dict(tma_maxnreg=128),
                dict(tma_maxnreg=96), dict(tma_maxnreg=96, tma_stages=3), dict(tma_maxnreg=72),
                dict(tma_maxnreg=72, tma_stages=3), dict(tma_maxnreg=64), dict(tma_maxnreg=64, tma_stages=3)]
    out += [dict(num_programs=max(1, 4 * sms // batch))]                                  # one wave
    out += [dict(num_programs=-(-per_sm * sms // batch)) for per_sm in (4, 8, 12, 16, 20, 24)]    # per SM in all
    return out


def filter_candidates(scores: torch.Tensor, k: int, groups: int) -> str:
    """Min / mean / max per row of the scores at or above the k-th largest of `groups` group maxima
    (the top-k filter's candidates, computed here in torch, -inf left out as the kernel does)."""
    n = scores.shape[1]
    gs = 1 << (max(1, -(-n // groups)) - 1).bit_length()
    pad = torch.full((scores.shape[0], -(-n // gs) * gs - n), float("-inf"), device=scores.device)
    gmax = torch.cat([scores, pad], 1).view(scores.shape[0], -1, gs).amax(2)
    t = gmax.topk(min(k, gmax.shape[1]), 1).values[:, -1:]
    c = ((scores >= t) & (scores > float("-inf"))).sum(1).float()
    return f"{c.min().item():.0f} / {c.mean().item():.0f} / {c.max().item():.0f} (group {gs})"


def indexer_variants(case: str, batch: int, quick: bool, focus: bool, scan_sweep: bool, only: str | None,
                     scores: torch.Tensor, want_top: torch.Tensor, idx: Any, sargs: tuple, base: torch.Tensor) -> None:
    """The top-k variants on the given scores, then (unless only top-k) the indexer scores variants."""
    if only != "scores":
        topk_variants(case, batch, quick, focus, scan_sweep, scores, want_top, idx)
    if only == "topk":
        return
    indexer_scores_variants(case, batch, quick, focus, scan_sweep, sargs, base)


def topk_variants(case: str, batch: int, quick: bool, focus: bool, scan_sweep: bool, scores: torch.Tensor,
                  want_top: torch.Tensor, idx: Any) -> None:
    attempt("topk", case, "torch int64 packed (reference, before)", lambda: ref.topk_smaller_index(scores, idx.topk),
            lambda o: None if torch.equal(o, want_top) else "differs")
    attempt("topk", case, "torch fp32 topk (not exact)", lambda: torch.topk(scores, idx.topk, dim=1), lambda o: None)
    for groups in (1024, 2048, 4096):
        cands = filter_candidates(scores, idx.topk, groups)
        print(f"# top-k filter, {groups} group maxima per row: candidates {cands}", flush=True)
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


def indexer_scores_variants(case: str, batch: int, quick: bool, focus: bool, scan_sweep: bool, sargs: tuple,
                            base: torch.Tensor) -> None:
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
        sc_variants = scan_variants(batch, quick)
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
    if only in ("topk", "scores"):
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
        # the wide scheme (Gluon, sm_90, fp8_ds) at its default splits and around them
        variants += [dict(scheme="wide")] + [dict(scheme="wide", num_splits=s)
                                             for s in ((1, 3, 4) if batch >= 32 else (4, 8, 16, 33, 66))]
        tp = {"scheme": "two_pass"}
        if batch >= 32:
            variants += [dict(scheme="halves", block_n=16), dict(scheme="halves", num_splits=3),
                         dict(tp, score_splits=3), dict(tp, value_splits=2)]
        elif batch >= 8:
            variants += [dict(scheme="halves", block_n=16), dict(tp, value_splits=1), dict(tp, score_splits=4)]
            variants += [dict(scheme="halves", num_splits=s) for s in (4, 5, 6)]
        else:
            variants += [dict(tp, value_splits=8)] + [dict(scheme="halves", num_splits=s)
                                                      for s in (5, 8, 16, 20, 33, 44, 66, 88)]
        if focus:
            variants = focus_variants("attention", batch)
        for kw in variants:
            attempt(f"att-{kind}", case, " ".join(f"{k}={v}" for k, v in kw.items()) or "default",
                    lambda kw=kw, aargs=aargs: att_mod.decode_attention(*aargs, **kw), a_check, "decode_attention")
    del st, mgr
    torch.cuda.empty_cache()


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
    p.add_argument("--only", choices=("topk", "scores", "attention"),
                   help="only the top-k / indexer scores / attention variants")
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
