"""Decode-step benchmarks: the cache-side ops, the whole layer, and transformers' layer.

For every (context C, batch B), one synthetic cache (`dsv4.bench.setup.build_decode_state`) serves
both layers and every implementation; per layer:

    op          what is timed (one decode step of B requests, token at position C - 1)
    append      append_window                                 kv into the window ring
    flush       compress_decode(write=)                       the fold, then kv_norm, RoPE, quantise and
                                                                  scatter of the finished entry (CSA: main
                                                                  and indexer compressors), as the layer runs it
    indexer     decode_indexer_topk (scores + top-k)          CSA only
    attention   decode_attention                              window + top-k (CSA) / all entries (HCA);
                                                                  q, output and RoPE as the layer has them
    cache       the four above on the decode step's branches  "cache-side decode work": the compressors
                                                                  on a side branch (CSA: the indexer's
                                                                  first, whose keys the scan waits for),
                                                                  the window append after them (CSA) or on
                                                                  a branch of its own (HCA), the scan on the
                                                                  main stream, the attention after the join,
                                                                  as `attention.decode_path` runs them
    layer       AttentionSubBlock.forward                     projections included
    layer (triton-fp8w)  the same, its projections as the checkpoint's FP8 blocks (Triton only)
    layer (hf)  transformers DeepseekV4Attention.forward      bf16 eager, synthesised DynamicCache

Inputs the ops take from the projections (kv, c/z, q, indexer q and weights) are made once,
outside the timing; the attention op reads a random valid selection of min(k, N_I) entries
(the cache op uses the indexer's own).
Repeated calls are valid: they rewrite the same ring row and entry, and keep folding the token
into finite online-softmax states. Triton work is also timed as CUDA-graph replays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dsv4.attention.decode_path import URGENT_BRANCHES, WINDOW_ON_TABLE, query_dtype
from dsv4.bench.common import FP8_IMPL, LAYER_INDEX, Row
from dsv4.bench.counts import Geometry, Work, decode_work
from dsv4.bench.setup import DecodeState, acquire, build_decode_state, cache_bytes
from dsv4.bench.timing import Timing, free_memory, guarded
from dsv4.kernels.reference.cache_ops import EntryWrite
from dsv4.kernels.streams import on, side_stream
from dsv4.model.layer_schedule import AttentionType

if TYPE_CHECKING:
    import types

    from dsv4.bench.runner import BenchContext

OPS = {"csa": ("append", "flush", "indexer", "attention", "cache"), "hca": ("append", "flush", "attention", "cache")}


def run_decode(ctx: BenchContext) -> list[Row]:
    rows: list[Row] = []
    for context in ctx.opts.contexts:
        for batch in ctx.opts.batches:
            rows += _decode_case(ctx, context, batch)
    return rows


def _impls(ctx: BenchContext) -> list[str]:
    return list(ctx.ops) + (["hf"] if ctx.opts.hf else [])


def _failed(ctx: BenchContext, context: int, batch: int, status: str, reason: str | None) -> list[Row]:
    rows = []
    for kind in ctx.opts.layers:
        for impl in _impls(ctx):
            for op in (("layer",) if impl == "hf" else OPS[kind] + ("layer",)):
                rows.append(Row(kind="decode", layer=kind, context=context, batch=batch, op=op, impl=impl,
                                status=status, reason=reason))
    ctx.log(f"decode C={context} B={batch}: [red]{status}[/] {reason}")
    return rows


def _decode_case(ctx: BenchContext, context: int, batch: int) -> list[Row]:
    o = ctx.opts
    if context > ctx.cfg.max_position_embeddings:
        return _failed(ctx, context, batch, "skipped", f"context > max_position_embeddings "
                                                       f"{ctx.cfg.max_position_embeddings}")
    need = cache_bytes(ctx.cfg, context=context, batch=batch, tokens_per_block=ctx.tokens_per_block,
                       kv_format=o.kv_format, indexer_format=o.indexer_format)
    if o.device.type == "cuda":
        free = torch.cuda.mem_get_info(o.device)[0]
        if need > 0.85 * free:
            return _failed(ctx, context, batch, "skipped",
                           f"the cache needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
    status, state, reason = guarded(lambda: build_decode_state(
        ctx.cfg, context=context, batch=batch, device=o.device, tokens_per_block=ctx.tokens_per_block,
        kv_format=o.kv_format, indexer_format=o.indexer_format, seed=o.seed))
    if status != "ok":
        return _failed(ctx, context, batch, status, f"building the cache state: {reason}")
    rows: list[Row] = []
    try:
        for kind in o.layers:
            geo = Geometry.of(ctx.cfg, kind, o.kv_format, o.indexer_format)
            work = decode_work(geo, batch, context, state.batch.seq_len_bound // geo.ratio)
            for impl, ops in ctx.ops.items():
                rows += _time_ops(ctx, state, kind, impl, ops, work)
                rows.append(_time_layer(ctx, state, kind, impl, work["layer"]))
            if kind in ctx.fp8_blocks:
                fp8_work = decode_work(geo, batch, context, state.batch.seq_len_bound // geo.ratio, fp8_weights=True)
                rows.append(_time_layer(ctx, state, kind, FP8_IMPL, fp8_work["layer"]))
            if o.hf:
                rows.append(_time_hf(ctx, state, kind, work["layer"]))
    finally:
        del state
        free_memory()
    return rows


def _row(ctx: BenchContext, state: DecodeState, kind: str, op: str, impl: str, work: Work,
         result: tuple[str, Timing | None, str | None], note: str | None = None) -> Row:
    status, timing, reason = result
    row = Row(kind="decode", layer=kind, context=state.context, batch=state.batch.num_requests, op=op, impl=impl,
              status=status, reason=reason, bytes=work.total_bytes, flops=work.total_flops,
              bytes_detail=dict(work.bytes), flops_detail=dict(work.flops), note=note)
    if timing is not None:
        row.us, row.mode, row.us_eager = timing.us, timing.mode, timing.us_eager
        row.note = "; ".join(n for n in (note, timing.note) if n) or None
        ctx.log(f"decode {kind} C={row.context} B={row.batch} {op:<9} {impl:<9} {timing.us:12.1f} µs ({timing.mode})")
    else:
        ctx.log(f"decode {kind} C={row.context} B={row.batch} {op:<9} {impl:<9} [red]{status}[/] {reason}")
    return row


# ------------------------------------------------------------------------------------------ ops
def op_closures(blk: Any, state: DecodeState, ops: types.SimpleNamespace, layer_idx: int
                ) -> dict[str, Callable[[], Any]]:
    """The cache-side ops of one decode step of `state` for layer `layer_idx`, as closures."""
    mgr, b, x = state.mgr, state.batch, state.x
    sch, st, pool = mgr.schemas[layer_idx], mgr.states[layer_idx], mgr.paged[layer_idx]
    cfg, dev, n = blk.cfg, x.device, b.num_requests
    fmt, ratio, epb = sch.kv_format, sch.compress_ratio, sch.entries_per_block
    gen = torch.Generator(device=dev).manual_seed(1)
    comp = blk.compressor
    csa = comp.overlap

    def cz(c_mod: Any) -> tuple[torch.Tensor, torch.Tensor]:
        c = c_mod.kv_proj(x).float()
        z = c_mod.gate_proj(x).float() + c_mod.position_bias.float()[(b.positions % c_mod.ratio).long()]
        return c, z

    kv = torch.randn(n, cfg.head_dim, device=dev, generator=gen).to(x.dtype)
    # the attention's queries and output as the layer passes them (`decode_path.decode_attend`): q in
    # `query_dtype`, the output in x's dtype, de-rotated by the op (RoPE at -t on its rope channels)
    q = torch.randn(n, cfg.num_attention_heads, cfg.head_dim, device=dev, generator=gen).to(query_dtype(ops, fmt))
    rope = ops.rope_cos_sin(blk.rope.inv_freq_on(dev), b.positions)
    c, z = cz(comp)
    num_entries, max_entries = b.visible_entries[ratio], b.seq_len_bound // ratio
    fns: dict[str, Callable[[], Any]] = {}
    fns["append"] = lambda: ops.append_window(st.swa, fmt, st.swa_pos, st.swa_head, kv, b.positions,
                                              b.token_request, b.request_slots, b.seq_lens)
    if csa:
        idx, ifmt = comp.indexer, sch.indexer_format
        ci, zi = cz(idx)
        qi = ifmt.round_query(ifmt.to_stored_basis(torch.randn(n, idx.heads, idx.dim, device=dev, generator=gen)))
        g = torch.randn(n, idx.heads, device=dev, generator=gen)

    write = EntryWrite(pool.kv, fmt, b.block_table, epb, comp.finisher(blk.rope, dev))
    if csa:
        iwrite = EntryWrite(pool.indexer, ifmt, b.block_table, epb, idx.finisher(blk.rope, dev))

    def flush_main() -> None:
        ops.compress_decode(c, z, st.comp_state, b.request_slots, b.positions, ratio, csa, write=write)

    def flush_indexer() -> None:
        ops.compress_decode(ci, zi, st.idx_state, b.request_slots, b.positions, ratio, True, write=iwrite)

    def flush() -> None:
        flush_main()
        if csa:
            flush_indexer()

    def indexer() -> torch.Tensor:
        return ops.decode_indexer_topk(qi, g, pool.indexer, ifmt, b.block_table, num_entries, max_entries, epb,
                                       idx.topk)

    def attention(sel: torch.Tensor | None) -> torch.Tensor:
        return ops.decode_attention(q, st.swa, fmt, st.swa_pos, b.request_slots, b.positions, cfg.sliding_window,
                                    pool.kv, b.block_table, epb, sel, None if csa else num_entries, max_entries,
                                    blk.sinks, cfg.head_dim ** -0.5, rope=rope, out_dtype=x.dtype)

    fns["flush"] = flush
    selected = None
    if csa:
        fns["indexer"] = indexer
        selected = random_selection(n, state.context // ratio, idx.topk, dev, gen)
    fns["attention"] = lambda: attention(selected)

    kind = AttentionType.CSA if csa else AttentionType.HCA
    urgent, window_on_table = kind in URGENT_BRANCHES, kind in WINDOW_ON_TABLE

    def cache(branches: bool = True) -> torch.Tensor:
        """The attention's output after all four ops. The ops are independent but for the scan (the
        indexer's new keys) and the attention (all of them): the step overlaps them on its branches,
        and so does this row (off CUDA, or branches=False: one after another, the tests' twin)."""
        if not branches:
            fns["append"]()
            flush()
            return attention(indexer() if csa else None)
        side, table = side_stream(dev, urgent=urgent), side_stream(dev, 1, urgent=urgent)
        main = torch.cuda.current_stream(dev) if side is not None else None
        if side is not None:
            side.wait_stream(main)
            table.wait_stream(main)
        keys_ready = None
        with on(side):
            if csa:
                flush_indexer()
                keys_ready = side.record_event() if side is not None else None
            flush_main()
            if not window_on_table:
                fns["append"]()
        with on(table):
            if window_on_table:
                fns["append"]()
        if keys_ready is not None:
            main.wait_event(keys_ready)
        sel = indexer() if csa else None
        if side is not None:
            main.wait_stream(side)
            main.wait_stream(table)
        return attention(sel)

    fns["cache"] = cache
    return fns


def random_selection(batch: int, entries: int, k: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """[batch, k] int64: min(k, entries) distinct visible entries per request in random order, -1 padded
    (a valid top-k for the attention op, independent of any indexer implementation)."""
    kk = min(k, entries)
    sel = torch.rand(batch, entries, device=device, generator=gen).topk(kk, dim=1).indices
    pad = torch.full((batch, k - kk), -1, dtype=sel.dtype, device=device)
    return torch.cat([sel, pad], dim=1)


def _time_ops(ctx: BenchContext, state: DecodeState, kind: str, impl: str, ops: types.SimpleNamespace,
              work: dict[str, Work]) -> list[Row]:
    blk = ctx.blocks[kind]
    status, fns, reason = guarded(lambda: op_closures(blk, state, ops, LAYER_INDEX[kind]))
    rows = []
    for op in OPS[kind]:
        if status != "ok":
            rows.append(_row(ctx, state, kind, op, impl, work[op], (status, None, f"setting up the ops: {reason}")))
            continue
        fn = fns[op]
        rows.append(_row(ctx, state, kind, op, impl, work[op],
                         guarded(lambda fn=fn: ctx.timer.time(fn, graph=impl == "triton"))))
    return rows


# ------------------------------------------------------------------------------------------ layers
def _time_layer(ctx: BenchContext, state: DecodeState, kind: str, impl: str, work: Work) -> Row:
    """impl "triton" / "reference": the bf16 block; FP8_IMPL: its FP8-weight twin with the Triton kernels."""
    blk = ctx.fp8_blocks[kind] if impl == FP8_IMPL else ctx.blocks[kind]
    backend = "triton" if impl == FP8_IMPL else impl
    blk.backend = backend
    handle = acquire(state.mgr, LAYER_INDEX[kind], state.batch, backend)
    note = "projections: FP8 e4m3 codes, one scale per 128x128 block (the checkpoint's)" if impl == FP8_IMPL else None
    return _row(ctx, state, kind, "layer", impl, work,
                guarded(lambda: ctx.timer.time(lambda: blk(state.x, state.batch, handle), graph=backend == "triton")),
                note=note)


def _time_hf(ctx: BenchContext, state: DecodeState, kind: str, work: Work) -> Row:
    def measure() -> Timing:
        step = ctx.hf_layer(kind).decode_step(state.x, state.context, seed=ctx.opts.seed)
        return ctx.timer.time(step)

    row = _row(ctx, state, kind, "layer", "hf", work, guarded(measure),
               note="transformers DeepseekV4Attention, bf16 eager, DynamicCache")
    free_memory()  # its synthesised cache is as large as ours, in bf16
    return row
