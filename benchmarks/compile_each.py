"""The `each` set of `compile_report.py`: one variant of every plain-Triton kernel, captured from the op
wrappers under `on_sm90` and compiled for sm_90 on every core. The capture and compile machinery and the
argument builders are `sm90_compile.py`'s.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import torch
import triton
from sm90_compile import (
    SMS,
    attention_args,
    compile_info,
    compress_chunk,
    entry_finish,
    launched,
    on_sm90,
    prefill_args,
)


def each(st: Any, cfg: Any, tpb: int, sargs: tuple, scan_maxima: Any, tma: Any, write_finish: Any) -> None:
    """`each`: one variant of every plain-Triton kernel the package launches, as the GPU path launches it
    at V4-Flash shapes (`on_sm90`), a row `each <module>.<kernel> <variant>` each
    (tests/test_triton_compile.py checks that every launched kernel has one). The decode step is
    `attention.decode_path`'s, the prefill chunk `AttentionSubBlock._attend_general`'s (16 new tokens
    after 2,032 cached). The Gluon kernels are the `wide`, `prefill_wide` and `scan_tma` rows'."""
    from dsv4.bench import setup as bs
    from dsv4.bench.common import LAYER_INDEX
    from dsv4.kernels.reference.cache_ops import EntryWrite
    from dsv4.kernels.triton import cache_ops as co
    from dsv4.kernels.triton import compress as cmp
    from dsv4.kernels.triton import decode_attention as att
    from dsv4.kernels.triton import decode_attention_2p as tp
    from dsv4.kernels.triton import decode_attention_halves as dh
    from dsv4.kernels.triton import decode_combine as dcm
    from dsv4.kernels.triton import fp8_linear as fl
    from dsv4.kernels.triton import gather, gemv, topk
    from dsv4.kernels.triton import indexer_prefill as ip
    from dsv4.kernels.triton import indexer_scan as scn
    from dsv4.kernels.triton import indexer_scan_tma as ts
    from dsv4.kernels.triton import indexer_scores as sc
    from dsv4.kernels.triton import norm_rope as nr
    from dsv4.kernels.triton import prefetch as pf
    from dsv4.kernels.triton import prefill_attention as pa
    from dsv4.kernels.triton import prefill_attention_halves as pah
    from dsv4.kernels.triton import skinny_gemm as sk

    mgr, b = st.mgr, st.batch
    csa = LAYER_INDEX["csa"]
    sch, stt, pool = mgr.schemas[csa], mgr.states[csa], mgr.paged[csa]
    fmt = sch.kv_format
    # fp8 indexer keys: the format the pointer scorer (not the E2M1 scan) reads on the GPU
    st8 = bs.build_decode_state(cfg, context=2048, batch=2, device=torch.device("cpu"), tokens_per_block=tpb,
                                kv_format="fp8_ds", indexer_format="fp8")
    sch8, b8 = st8.mgr.schemas[csa], st8.batch
    cos, sin = torch.rand(2, 32), torch.rand(2, 32)

    def row(variant: str, module: Any, kname: str, call: Any, **gpu_kw: Any) -> None:
        _ROWS.append((f"each {module.__name__.rsplit('.', 1)[1]}.{kname} {variant}",
                      launched(module, kname, call, **gpu_kw)))

    with on_sm90():
        # the decode step of the CSA layer (HCA for the fused attention's one-row form), 2 requests at 2,048
        row("decode positions", nr, "_cos_sin_kernel",
            lambda: nr.rope_cos_sin(torch.rand(32, dtype=torch.float64), b.positions))
        row("indexer queries (Hadamard, mxfp4 rounding)", nr, "_norm_rope_kernel",
            lambda: nr.norm_rope(torch.randn(2, 64, 128).bfloat16(), None, 0.0, cos, sin, normalize=False,
                                 out_dtype=torch.float32, hadamard=True, round_to="mxfp4"))
        row("fp8_ds", co, "_append_window_kernel",
            lambda: co.append_window(stt.swa, fmt, stt.swa_pos, stt.swa_head, torch.randn(2, 512), b.positions,
                                     b.token_request, b.request_slots, b.seq_lens))
        c, z = torch.randn(2, 1024).bfloat16(), torch.randn(2, 1024).bfloat16()
        fold = lambda **kw: co.compress_decode(c, z, stt.comp_state, b.request_slots, b.positions, 4, True,  # noqa: E731
                                               z_bias=torch.randn(4, 1024), **kw)
        row("csa main", co, "_compress_decode_kernel", fold)
        row("csa main fp8_ds finish", co, "_compress_decode_write_kernel",
            lambda: fold(write=EntryWrite(pool.kv, fmt, b.block_table, 64, entry_finish(512))))
        row("int8 queries", ts, "_q8_kernel", tma)
        row("mxfp4 bf16 block_n 64 group maxima", scn, "_indexer_scan_kernel", scan_maxima)
        row("fp8 keys bf16x2 block_n 64", sc, "_indexer_scores_kernel",
            lambda: sc.paged_indexer_scores(*sargs[:2], st8.mgr.paged[csa].indexer, sch8.indexer_format,
                                            b8.block_table, b8.seq_lens // 4, b8.seq_len_bound // 4, 64, block_n=64))
        # the top-k over 128K-token rows (32,768 scores): the filter (its 2,048 groups), bounded by the scan's
        # maxima at decode, by its own in a prefill chunk; 16K rows (4,096) take one select
        scores = torch.randn(2, 32768)
        filtered = lambda **kw: topk.topk_smaller_index(scores, 512, groups=topk.FILTER_GROUPS * 512,  # noqa: E731
                                                        **kw)
        given = lambda: filtered(group_max=torch.randint(-2**31, 2**31 - 1, (2, 2112), dtype=torch.int32),  # noqa: E731
                                 order="index")
        row("128K decode, the scan's maxima", topk, "_bound_kernel", given)
        row("128K decode", topk, "_filter_kernel", given)
        row("128K decode", topk, "_filtered_select_kernel", given)
        row("128K prefill rows", topk, "_group_max_kernel", filtered)
        row("16K decode, one select", topk, "_topk_kernel",
            lambda: topk.topk_smaller_index(torch.randn(2, 4096), 512, order="index"))
        # one HCA row: the q norm inside the fused kernel (decode_path.Q_NORM_IN_ATTENTION), split keys
        # (decode_attention's GPU choices past its inline device checks: the tiles of 64 heads x 8 chunks of 64
        # channels at bf16 operands, the key tile and the splits for 128 window rows + 16 entries)
        hca = attention_args(mgr, b, "hca", rows=1)
        entries = hca[12]
        bh, bn, warps = att._attention_tiles(64, 8, 1, True)
        bn = att._tile_keys(128, entries, 64 // bh, SMS)
        splits = att.fused_splits((triton.cdiv(128, bn) + triton.cdiv(entries, bn)) * bn, 64 // bh, SMS)
        one_row = lambda: att.decode_attention(*hca, rope=(cos[:1], sin[:1]), out_dtype=torch.bfloat16,  # noqa: E731
                                               q_norm=1e-6, block_h=bh, block_n=bn, num_warps=warps,
                                               num_splits=splits)
        row(f"hca one row q_norm block_h={bh} block_n={bn} warps={warps} splits={splits}", att,
            "_decode_attn_kernel", one_row, num_stages=att.NUM_STAGES)
        row(f"hca one row {splits} splits rope bf16-out", dcm, "_combine_kernel", one_row)
        aargs = attention_args(mgr, b, "csa")
        # the halves kernels' second half: the programmatic dependent launch, the prefill's inverse rotation
        row("csa fp8_ds half 1", dh, "_halves_kernel", lambda: att.decode_attention(*aargs, scheme="halves"),
            launch=1)
        two_pass = lambda: att.decode_attention(*aargs, scheme="two_pass", score_splits=SMS // 2,  # noqa: E731
                                                value_splits=2, rope=(cos, sin), out_dtype=torch.bfloat16)
        row(f"csa {SMS // 2} splits", tp, "_scores_kernel", two_pass)
        row("csa 2 value splits rope", tp, "_values_kernel", two_pass)
        row("hca o_a weights, 0.4 of a 50 MB L2", pf, "_prefetch_kernel",
            lambda: pf.l2_prefetch([torch.empty(8192, 4096, dtype=torch.bfloat16)], int(0.4 * 50e6)))
        # a prefill chunk of the CSA layer
        row("fp8_ds window", gather, "_read_fp8_ds_kernel",
            lambda: gather.gather_window(stt.swa, fmt, stt.swa_pos, b.request_slots))
        row("fp8_ds -> bf16", co, "_roundtrip_kernel",
            lambda: co.roundtrip_rows(torch.randn(16, 512), fmt, torch.bfloat16))
        kw, call = compress_chunk(512, 4, True)
        row("csa main " + " ".join(f"{k}={v}" for k, v in kw.items()), cmp, "_compress_kernel", call)
        row("fp8_ds finish", co, "_write_entries_kernel", write_finish(pool.kv, fmt, 512))
        row("mxfp4 4 tokens block_n 64", scn, "_prefill_scan_kernel",
            lambda: ip.grouped_scores(torch.randn(16, 64, 128).bfloat16(), torch.randn(16, 64), pool.indexer,
                                      sch.indexer_format, b.block_table[:1], torch.full((16,), 508, dtype=torch.int32),
                                      ip.token_groups((16,), 0, 16, ip.TOKENS, "cpu"), 512, 64, tokens=ip.TOKENS,
                                      block_n=64))
        pargs, fin = prefill_args(mgr, b, "csa")
        row("csa fp8_ds half 1 q_norm rope bf16-out", pah, "_prefill_halves_kernel",
            lambda: pa.prefill_attention(*pargs, **fin, q_norm=1e-6), launch=1)
        row("csa fp8_ds " + "block_h={} block_n={} warps={}".format(*pa._prefill_tiles(64, 8, 1, True)), pa,
            "_prefill_attn_kernel", lambda: pa.prefill_attention(*pargs, scheme="fused", **fin),
            num_stages=att.NUM_STAGES)
        # the V4-Flash projections: q up (+ the indexer's, N 40,960, K 1,024), q_a + kv (N 1,536, K 4,096), W_ob
        x1, x4, x16 = torch.randn(1, 1024).bfloat16(), torch.randn(4, 4096).bfloat16(), torch.randn(16, 1024).bfloat16()
        w_up, norm = torch.empty(40960, 1024, dtype=torch.bfloat16), (torch.rand(1024).bfloat16(), 1e-6)
        up8 = torch.empty(40960, 1024, dtype=torch.float8_e4m3fn), torch.empty(320, 8)
        in8 = torch.empty(1536, 4096, dtype=torch.float8_e4m3fn), torch.empty(12, 32)
        row("one row q up, q_a norm inside", gemv, "_gemv_kernel", lambda: gemv.gemv(x1, w_up, norm=norm))
        row("16 rows q up", sk, "_skinny_kernel", lambda: sk.skinny_gemm(x16, w_up))
        row("one row q up, q_a norm inside", fl, "_gemv_kernel", lambda: fl.linear_fp8(x1, *up8, norm=norm))
        row("16 rows q up", fl, "_gemm_desc_kernel", lambda: fl.linear_fp8(x16, *up8))
        k_splits = fl._k_splits(triton.cdiv(1536, fl._gemm_tiles(4)[1]), 4096, 4, SMS)[0]
        inputs = lambda: fl.linear_fp8(x4, *in8, splits=k_splits)     # noqa: E731
        row(f"4 rows q_a + kv, {k_splits} K splits", fl, "_gemm_kernel", inputs)
        row(f"4 rows q_a + kv, {k_splits} K splits", fl, "_sum_splits_kernel", inputs)
        row("W_ob for a prefill chunk", fl, "_dequant_kernel",
            lambda: fl.dequantize(torch.empty(4096, 8192, dtype=torch.float8_e4m3fn), torch.empty(32, 64),
                                  torch.bfloat16))
        row("one row hca q_a + kv beside the dense compressor", fl, "_gemv_pair_kernel",
            lambda: fl.gemv_pair(torch.randn(1, 4096).bfloat16(), torch.empty(1024, 4096, dtype=torch.bfloat16),
                                 *in8))
    # compiled on every core (forked workers share the captured arguments): ~40 s -> ~25 s on 2 cores
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as workers:
        for (label, _), info in zip(_ROWS, workers.imap(_compile_row, range(len(_ROWS)))):
            print(f"{label:<60} {info}", flush=True)


#: `each`'s rows (label, `launched`), read by the forked compile workers
_ROWS: list[tuple[str, tuple]] = []


def _compile_row(i: int) -> dict[str, Any] | str:
    return compile_info(*_ROWS[i][1])

