"""Variants of the prefill-chunk kernels at V4-Flash shapes (CUDA only), run by `tune_decode.py`
(--prefill-only, --prefill-attention, --prefill-indexer): the chunk's compressors against a stream
read of their inputs, the prefill attention of the last 8K chunk of a 32K prompt, and its indexer
(per-row and grouped scans, top-k, the whole selection)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from tune_common import DEV, attempt, graph_us, overlap, record, rel

from dsv4.bench.common import LAYER_INDEX
from dsv4.kernels.triton import indexer_scores as sc_mod
from dsv4.kernels.triton import topk as topk_mod


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
    for name, d, ratio, ov in cases:
        dc = 2 * d if ov else d
        c = torch.randn(chunk, dc, device=dev).bfloat16()          # as the layer's projection GEMM gives them
        z = torch.randn(chunk, dc, device=dev).bfloat16()
        bias = torch.randn(ratio, dc, device=dev)
        state = torch.zeros(4, 3, 2 if ov else 1, d, device=dev)
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
                    lambda cf=cf, zf=zf, state=state, slots=slots, ratio=ratio, ov=ov:
                    compress_update(cf, zf, state, slots, (chunk,), (chunk,), ratio, ov), nbytes)
        for kw in variants:
            def run(c=c, z=z, state=state, slots=slots, ratio=ratio, ov=ov, kw=kw, bias=bias):
                return compress_update(c, z, state, slots, (chunk,), (chunk,), ratio, ov, z_bias=bias, **kw)

            prefill_one(name + " " + (" ".join(f"{k}={v}" for k, v in kw.items()) or "default"), chunk, run, nbytes)


def prefill_chunk_args(cfg, tpb: int, chunk: int = 8192, cached: int = 24576):
    """(kind, prefill_attention's arguments) of one chunk after `cached` tokens (the last 8K chunk of a
    32K prompt), fp8_ds, V4-Flash heads, per layer kind: CSA over a random top-512 selection of the
    visible entries per token, HCA over every visible entry; fp32 queries."""
    from dsv4.cache.manager import KVCacheManager
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
        yield kind, (q, old_kv, old_pos, new_kv, batch.positions, batch.token_request, batch.cu_seqlens,
                     cfg.sliding_window, mgr.paged[li].kv, sch.kv_format, batch.block_table, sch.entries_per_block,
                     indices, ratio, h.max_entries(), sinks, cfg.head_dim ** -0.5)


def prefill_attention_variants(cfg, tpb: int, chunk: int = 8192, cached: int = 24576) -> None:
    """prefill_attention of one chunk after `cached` tokens (`prefill_chunk_args`), each variant
    checked against the fused kernel's output."""
    from dsv4.kernels.triton.prefill_attention import prefill_attention
    for kind, args in prefill_chunk_args(cfg, tpb, chunk, cached):
        q = args[0]
        want = prefill_attention(*args, scheme="fused")
        for kw in ({}, dict(scheme="fused"), dict(scheme="halves"), dict(scheme="wide"),
                   dict(scheme="halves", block_n=16), dict(scheme="fused", block_h=16, block_n=32, num_warps=8),
                   dict(scheme="fused", block_h=16, block_n=64, num_warps=8, num_stages=2)):
            attempt("pattn", f"{kind} T={chunk}", " ".join(f"{k}={v}" for k, v in kw.items()) or "default",
                    lambda kw=kw, args=args: prefill_attention(*args, **kw),
                    lambda out, want=want: None if rel(out, want) < 1e-2 else f"rel {rel(out, want):.2e}",
                    "prefill_attention")
        # the layer's form: the inverse rotation and the bf16 output in the attention op
        finish = dict(rope=(torch.rand(chunk, 32, device=DEV), torch.rand(chunk, 32, device=DEV)),
                      out_dtype=torch.bfloat16)
        want = prefill_attention(*args, scheme="fused", **finish).float()
        for kw in (dict(scheme="fused", **finish), dict(scheme="halves", **finish), dict(scheme="wide", **finish)):
            attempt("pattn", f"{kind} T={chunk}", f"scheme={kw['scheme']} rope bf16-out",
                    lambda kw=kw, args=args: prefill_attention(*args, **kw),
                    lambda out, want=want: None if rel(out.float(), want) < 1e-2 else f"rel {rel(out.float(), want)}",
                    "prefill_attention")
        # ... with the layer's bf16 queries
        bargs = (q.bfloat16(), *args[1:])
        want = prefill_attention(*bargs, scheme="fused", **finish).float()
        for sch in ("halves", "wide"):
            attempt("pattn", f"{kind} T={chunk}", f"scheme={sch} rope bf16-out bf16-q",
                    lambda sch=sch, bargs=bargs, fin=finish: prefill_attention(*bargs, scheme=sch, **fin),
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
    for tokens, dt, bn, warps, progs, pf, regs in ((4, 2, 64, 4, 1, True, None), (4, 2, 64, 4, 1, True, 192),
                                                   (4, 4, 64, 4, 1, True, None), (8, 2, 64, 8, 1, True, 128)):
        groups = ip.token_groups((chunk,), 0, chunk, tokens, DEV)
        attempt("pindexer", case, f"grouped tokens={tokens}x{dt} bn={bn} warps={warps} programs={progs} prefetch={pf}"
                f" maxnreg={regs}",
                lambda tokens=tokens, dt=dt, groups=groups, bn=bn, warps=warps, progs=progs, pf=pf, regs=regs:
                ip.grouped_scores(q, g, views, fmt, table, visible, groups, n, epb, tokens=tokens, dot_tokens=dt,
                                  block_n=bn, num_warps=warps, programs=progs, prefetch=pf, maxnreg=regs, tma=False),
                check, "indexer_prefill_scan")
    for tokens, progs, regs in ((4, 1, None), (2, 1, None), (8, 1, None), (4, 2, None), (4, 1, 128), (2, 1, 128),
                                (4, 1, 255)):
        groups = ip.token_groups((chunk,), 0, chunk, tokens, DEV)
        attempt("pindexer", case, f"tma tokens={tokens} programs={progs} maxnreg={regs}",
                lambda tokens=tokens, groups=groups, progs=progs, regs=regs: ip.grouped_scores(
                    q, g, views, fmt, table, visible, groups, n, epb, tokens=tokens, programs=progs, maxnreg=regs,
                    tma=True),
                check, "indexer_prefill_scan_tma")
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
