"""Registers, spills and tensor-core instructions of the decode kernels' variants, without a GPU.

    python benchmarks/compile_report.py            # V4-Flash shapes, sm_90, the variants below
    SASS_DIR=dir [PTX=1] [TTGIR=1] python benchmarks/compile_report.py wide   # SASS (PTX, Triton's layouts) in dir
    python benchmarks/compile_report.py qnorm      # the fused attention's B = 1 tile with / without q_norm
    python benchmarks/compile_report.py each       # one variant of every plain-Triton kernel, as the GPU launches it

Triton compiles for sm_90 on any machine (its wheel carries ptxas and cuobjdump): each op wrapper
is called on CPU tensors of a small V4-shaped cache with its kernel launch intercepted, the
captured arguments give the kernel signature, and the compiled cubin is read with
`cuobjdump -res-usage` / `-sass`; `wgmma_serialised` is ptxas's own note (C7512) that it put a wait
after every warpgroup MMA for want of registers. The Triton here may be newer than the device's
(`pip install --target` its version beside, then on PYTHONPATH): a lead for what to time there, not a
measurement. That machinery is `sm90_compile.py`'s, the `each` set `compile_each.py`'s; this script
holds the other sets and picks them from its arguments.
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import torch
from compile_each import each
from sm90_compile import (
    SMS,
    attention_args,
    captured,
    compress_chunk,
    entry_finish,
    patched,
    prefill_args,
    report,
    tma_scan,
)


def main() -> int:
    warnings.filterwarnings("ignore")
    from dsv4.bench import setup as bs
    from dsv4.bench.common import LAYER_INDEX, bench_config
    from dsv4.kernels.triton import cache_ops as co
    from dsv4.kernels.triton import decode_attention as att
    from dsv4.kernels.triton import decode_attention_2p as tp
    from dsv4.kernels.triton import indexer_scan as scn
    from dsv4.kernels.triton import indexer_scores as sc
    from dsv4.kernels.triton import topk

    cfg, tpb = bench_config(False)
    dev = torch.device("cpu")
    st = bs.build_decode_state(cfg, context=2048, batch=2, device=dev, tokens_per_block=tpb, kv_format="fp8_ds",
                               indexer_format="mxfp4")
    mgr, b = st.mgr, st.batch
    sch, pool = mgr.schemas[LAYER_INDEX["csa"]], mgr.paged[LAYER_INDEX["csa"]]
    ifmt = sch.indexer_format
    qi = torch.randn(2, 64, 128)
    g = torch.randn(2, 64)
    sargs = (qi, g, pool.indexer, ifmt, b.block_table, b.seq_lens // 4, b.seq_len_bound // 4, 64)
    scan_maxima = lambda: sc.scores_and_maxima(*sargs, num_programs=2, num_warps=4, precision="bf16",  # noqa: E731
                                               block_n=64, tma=False, group_max=True)
    er, ei = torch.zeros(8, dtype=torch.int64), torch.arange(8)
    write_finish = lambda views, fmt, d: lambda: co.write_entries(views, fmt, torch.randn(8, d), er, ei,  # noqa: E731
                                                                   b.block_table, 64, entry_finish(d))
    which = sys.argv[1:] or ["scores", "scan", "attention", "topk", "cache", "fp8"]   # or "wide" alone
    if "scores" in which:
        for kw in [dict(precision="bf16x2", block_n=64, num_warps=8), dict(precision="bf16", block_n=64, num_warps=8),
                   dict(precision="bf16", block_n=128, num_warps=8), dict(precision="bf16", block_n=64, num_warps=4),
                   dict(precision="bf16", block_n=128, num_warps=4), dict(precision="bf16", block_n=32, num_warps=4),
                   dict(precision="bf16", block_n=64, num_warps=8, decode=1),
                   dict(precision="bf16", block_n=128, num_warps=8, decode=1)]:
            report(f"scores {kw}", sc, "_indexer_scores_kernel",
                   lambda kw=kw: sc.paged_indexer_scores(*sargs, num_programs=2, scan=False, **kw))
    if "scan" in which:
        for kw in [dict(precision="bf16x2", block_n=64), dict(precision="bf16x2", block_n=64, prefetch=False),
                   dict(precision="bf16x2", block_n=128), dict(precision="bf16", block_n=64),
                   dict(precision="bf16x2", block_n=128, keys_m=False, prefetch=False)]:
            report(f"scan {kw}", scn, "_indexer_scan_kernel",
                   lambda kw=kw: sc.paged_indexer_scores(*sargs, num_programs=2, num_warps=4, **kw))
        report("scan group maxima (bf16, block_n 64, 64 slots)", scn, "_indexer_scan_kernel", scan_maxima)
    if "scan" in which or "scan_tma" in which:
        from dsv4.kernels.triton import indexer_scan_tma as ts
        tma = tma_scan(qi, g, ifmt.typed(pool.indexer), b)
        with captured(ts, "_scan_tma_kernel"), captured(ts, "_scan_redo_kernel"):
            report("scan_tma queries (int8)", ts, "_q8_kernel", tma)
        gmax = torch.empty(2, 64 * ts.programs_per_request(8, b.seq_len_bound // 4), dtype=torch.int32)
        with captured(ts, "_q8_kernel"), captured(ts, "_scan_tma_kernel"):
            report("scan_tma redo (bf16 MMA) group maxima", ts, "_scan_redo_kernel", lambda: tma(gmax=gmax))
        with captured(ts, "_q8_kernel"), captured(ts, "_scan_redo_kernel"):
            for stages in (2, 4):
                report(f"scan_tma stages={stages}", ts, "_scan_tma_kernel", lambda stages=stages: tma(stages=stages))
            report("scan_tma int8=False", ts, "_scan_tma_kernel", lambda: tma(int8=False))
            report("scan_tma group maxima", ts, "_scan_tma_kernel", lambda: tma(gmax=gmax))
            report("scan_tma group maxima int8=False", ts, "_scan_tma_kernel", lambda: tma(gmax=gmax, int8=False))
            for nreg in (128, 96):
                report(f"scan_tma maxnreg={nreg}", ts, "_scan_tma_kernel", lambda nreg=nreg: tma(maxnreg=nreg))
        # a prefill chunk's scan (16 tokens, 4 a group, 2 programs a group), as `indexer_prefill.grouped_scores`
        # launches it on sm_90, its queries' kernel chained (PDL)
        from dsv4.kernels.triton import indexer_prefill as ip
        typed = ifmt.typed(pool.indexer)
        with captured(ts, "_q8_kernel"), patched(ts, "pdl", lambda dev: True):
            report("scan_tma prefill tokens=4", ts, "_prefill_scan_tma_kernel", lambda: ts.launch_prefill(
                torch.randn(16, 64, 128).bfloat16(), torch.randn(16, 64), torch.empty(16, 512), typed["data"],
                typed["scale"], b.block_table[:1], torch.full((16,), 508, dtype=torch.int32),
                ip.token_groups((16,), 0, 16, ip.TOKENS, "cpu"), 512, 1.0, tokens=ip.TOKENS,
                programs=ip.TMA_PROGRAMS))
    if "attention" in which or "wide" in which or "prefill_wide" in which:
        for kind in ("csa", "hca"):
            aargs = attention_args(mgr, b, kind)
            from dsv4.kernels.triton import decode_attention_wide as dw
            from dsv4.kernels.triton import decode_combine as dcm
            with contextlib.ExitStack() as es:        # the wide scheme's checks want a GPU: call it past them
                es.enter_context(patched(dw, "supported", lambda *a: True))
                es.enter_context(patched(att, "sm_count", lambda dev: SMS))
                es.enter_context(captured(dcm, "_combine_kernel"))         # launched after it: intercepted too
                if "prefill_wide" not in which or "wide" in which:
                    report(f"attention wide {kind}", dw, "_wide_kernel",
                           lambda aargs=aargs: att.decode_attention(*aargs, scheme="wide"))
            if "prefill_wide" in which:     # the wide prefill kernel on 16 new tokens after 2,032 cached
                from dsv4.kernels.triton import prefill_attention as pa
                from dsv4.kernels.triton import prefill_attention_wide as pw
                pargs, fin = prefill_args(mgr, b, kind)
                with contextlib.ExitStack() as es:
                    es.enter_context(patched(pw, "supported", lambda *a: True))
                    es.enter_context(patched(pw, "sm_count", lambda dev: SMS))
                    qn = {**fin, "q_norm": 1e-6}
                    for label, kw in (("", {}), (" rope bf16-out", fin), (" q_norm rope bf16-out", qn)):
                        report(f"prefill wide {kind}{label}", pw, "_prefill_wide_kernel",
                               lambda pargs=pargs, kw=kw: pa.prefill_attention(*pargs, scheme="wide", **kw))
            if "attention" not in which:
                continue
            for bh, bn, w in [(16, 32, 8), (16, 64, 8), (16, 16, 4), (16, 16, 8), (32, 16, 8), (32, 32, 8),
                              (64, 16, 8), (64, 16, 16), (16, 32, 4)]:
                report(f"attention {kind} block_h={bh} block_n={bn} warps={w}", att, "_decode_attn_kernel",
                       lambda bh=bh, bn=bn, w=w, aargs=aargs: att.decode_attention(
                           *aargs, block_h=bh, block_n=bn, num_warps=w, num_splits=1, precision="bf16"),
                       num_stages=att.NUM_STAGES)
            rope = (torch.rand(2, 32), torch.rand(2, 32))
            for r, dt in ((None, None), (rope, torch.bfloat16)):
                with captured(tp, "_scores_kernel"):            # pass 1 launches first: intercepted too
                    report(f"two-pass values {kind} rope={r is not None} out={dt}", tp, "_values_kernel",
                           lambda aargs=aargs, r=r, dt=dt: att.decode_attention(
                               *aargs, scheme="two_pass", score_block_n=32, score_warps=8, value_block_n=32,
                               value_block_d=128, value_warps=4, value_splits=1, rope=r, out_dtype=dt))
    if "qnorm" in which:        # the fused kernel's B = 1 tile (two splits), without and with the q norm inside
        aargs = attention_args(mgr, b, "hca")
        rope = (torch.rand(2, 32), torch.rand(2, 32))
        from dsv4.kernels.triton import decode_combine as dcm
        for qn, cap in ((None, {}), (1e-6, {}), (1e-6, {"maxnreg": 128})):
            with captured(dcm, "_combine_kernel"):             # launched after it: intercepted too
                report(f"attention hca block_h=16 block_n=32 warps=8 splits=2 q_norm={qn} {cap}", att,
                       "_decode_attn_kernel",
                       lambda qn=qn: att.decode_attention(*aargs, block_h=16, block_n=32, num_warps=8, num_splits=2,
                                                          precision="bf16", rope=rope, q_norm=qn),
                       num_stages=att.NUM_STAGES, **cap)
    if "topk" in which:
        s = torch.randn(2, 40000)
        for blk, w in [(16384, 16), (16384, 8), (8192, 16), (8192, 8), (4096, 8)]:
            report(f"topk block={blk} warps={w}", topk, "_topk_kernel",
                   lambda blk=blk, w=w: topk.topk_smaller_index(s, 512, block=blk, num_warps=w))
    if "cache" in which:
        rows = torch.randn(8, 128)
        report("write_entries mxfp4 (Hadamard)", co, "_write_entries_kernel",
               lambda: co.write_entries(pool.indexer, ifmt, rows, er, ei, b.block_table, 64))
        report("write_entries fp8_ds", co, "_write_entries_kernel",
               lambda: co.write_entries(pool.kv, sch.kv_format, torch.randn(8, 512), er, ei, b.block_table, 64))
        for name, views, fmt, d in (("fp8_ds", pool.kv, sch.kv_format, 512), ("mxfp4", pool.indexer, ifmt, 128)):
            report(f"write_entries {name} finish", co, "_write_entries_kernel", write_finish(views, fmt, d))
        from dsv4.kernels.triton import compress as cmp
        for name, d, ratio, ov, tunings in [
                ("csa main", 512, 4, True, [{}, dict(block_s=4), dict(num_warps=2)]),
                ("csa indexer", 128, 4, True, [{}, dict(block_s=4)]),
                ("hca", 512, 128, False, [{}, dict(split=16, num_warps=4, block_s=4), dict(num_warps=4)])]:
            for tuning in tunings:
                kw, call = compress_chunk(d, ratio, ov, **tuning)
                report(f"compress {name} {kw}", cmp, "_compress_kernel", call)
    if "fp8" in which:          # the FP8 block-weight projections (kernels.triton.fp8_linear) at V4-Flash shapes
        from dsv4.kernels.triton import fp8_linear as fl
        from dsv4.model.fp8_weights import quantize_blocks
        for rows, n, k, groups in [(1, 40960, 1024, 1), (1, 8192, 4096, 8), (1, 4096, 8192, 1), (16, 40960, 1024, 1),
                                   (64, 40960, 1024, 1), (64, 4096, 8192, 1), (200, 8192, 4096, 8)]:
            codes, scale = quantize_blocks(torch.randn(n, k) * 0.02)
            x = torch.randn(rows, groups * k).bfloat16()
            tiles = fl._gemv_tiles(n, k) if rows == 1 else fl._gemm_tiles(rows)
            for desc in (False, True) if rows > 1 else (False,):
                kname = "_gemv_kernel" if rows == 1 else ("_gemm_desc_kernel" if desc else "_gemm_kernel")
                report(f"linear_fp8 rows={rows} N={n} K={k} groups={groups} tiles={tiles}{' desc' * desc}", fl,
                       kname, lambda x=x, c=codes, s=scale, g=groups, d=desc: fl.linear_fp8(x, c, s, g, desc=d),
                       num_warps=tiles[2], num_stages=tiles[3])
    if "each" in which:
        each(st, cfg, tpb, sargs, scan_maxima, tma_scan(qi, g, ifmt.typed(pool.indexer), b), write_finish)
    return 0


if __name__ == "__main__":
    sys.exit(main())
