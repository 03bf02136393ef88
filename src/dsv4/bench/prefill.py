"""Prefill benchmarks: one T-token prompt (32K by default) into an empty cache, per layer.

    op              what is timed (summed over the prompt's chunks of `prefill_chunk` tokens)
    compress_flush  compress_and_flush                       (CSA: main and indexer compressors;
                                                              state update, then RMSNorm, RoPE,
                                                              quantise, scatter in the writes)
    layer           AttentionSubBlock.forward per chunk       projections included
    layer (hf)      transformers DeepseekV4Attention.forward  bf16 eager, one shot if it fits,
                                                              else in chunks (the row's note says)

Each run starts from a fresh request; the host planning between chunks (prepare_forward) is
outside the timed regions: each chunk's device work is timed with CUDA events, queued behind a
spin kernel so the host's launch latency is not counted (an engine enqueues a chunk's layers
ahead of the GPU), and the chunks are summed; the median is over runs (Timer.time_regions).
compress_flush also reports, as "µs eager", the same work started right after a synchronize
(host launch latency included). The compressor inputs c, z of the whole prompt (bf16, as the
layer's projection GEMM gives them) are computed once, outside the timing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dsv4.attention.compressor import compress_and_flush
from dsv4.bench.common import LAYER_INDEX, Row
from dsv4.bench.counts import Geometry, Work, prefill_work
from dsv4.bench.setup import acquire
from dsv4.bench.timing import Timing, free_memory, guarded
from dsv4.cache.manager import KVCacheManager
from dsv4.cache.schema import block_fill_ratio, blocks_needed, build_schemas

if TYPE_CHECKING:
    import types

    from dsv4.bench.runner import BenchContext

_RID = "prompt"
_HF_SMALL_CHUNK = 2048


def run_prefill(ctx: BenchContext) -> list[Row]:
    o = ctx.opts
    tokens, chunk = o.prefill, min(o.prefill_chunk, o.prefill)
    chunks = [chunk] * (tokens // chunk) + ([tokens % chunk] if tokens % chunk else [])
    rows: list[Row] = []
    for kind in o.layers:
        rows += _prefill_layer(ctx, kind, tokens, chunks)
        free_memory()
    return rows


def _prefill_layer(ctx: BenchContext, kind: str, tokens: int, chunks: list[int]) -> list[Row]:
    o = ctx.opts
    work = prefill_work(Geometry.of(ctx.cfg, kind, o.kv_format, o.indexer_format), tokens, chunks[0])
    gen = torch.Generator(device=o.device).manual_seed(o.seed + 7)
    x = torch.randn(tokens, ctx.cfg.hidden_size, device=o.device, generator=gen).to(torch.bfloat16)
    rows: list[Row] = []
    status, mgr, reason = guarded(lambda: _manager(ctx, tokens, chunks[0]))
    for impl, ops in ctx.ops.items():
        if status != "ok":
            for op in ("compress_flush", "layer"):
                rows.append(_row(ctx, kind, tokens, op, impl, work[op], (status, None, reason)))
            continue
        rows.append(_row(ctx, kind, tokens, "compress_flush", impl, work["compress_flush"],
                         guarded(lambda ops=ops: _time_compress(ctx, mgr, kind, ops, x, chunks))))
        rows.append(_row(ctx, kind, tokens, "layer", impl, work["layer"],
                         guarded(lambda impl=impl: _time_layer(ctx, mgr, kind, impl, x, chunks))))
    mgr = None                                  # its pages go before transformers' run
    free_memory()
    if o.hf:
        rows.append(_time_hf(ctx, kind, x, chunks, work["layer"]))
    return rows


def _manager(ctx: BenchContext, tokens: int, chunk: int) -> KVCacheManager:
    """A manager for one request of `tokens` tokens, planned `chunk` tokens at a time."""
    o = ctx.opts
    schemas = build_schemas(ctx.cfg, tokens_per_block=ctx.tokens_per_block, kv_format=o.kv_format,
                            indexer_format_name=o.indexer_format)
    need = blocks_needed(tokens, ctx.tokens_per_block, block_fill_ratio(schemas))
    return KVCacheManager(ctx.cfg, max_requests=1, num_blocks=need + 1, device=o.device, kv_format=o.kv_format,
                          indexer_format=o.indexer_format, tokens_per_block=ctx.tokens_per_block,
                          max_batch_tokens=chunk)


def _row(ctx: BenchContext, kind: str, tokens: int, op: str, impl: str, work: Work,
         result: tuple[str, Timing | None, str | None], note: str | None = None) -> Row:
    status, timing, reason = result
    row = Row(kind="prefill", layer=kind, context=tokens, batch=1, op=op, impl=impl, status=status, reason=reason,
              bytes=work.total_bytes, flops=work.total_flops, bytes_detail=dict(work.bytes),
              flops_detail=dict(work.flops), note=note)
    if timing is not None:
        row.us, row.mode, row.us_eager = timing.us, timing.mode, timing.us_eager
        row.note = "; ".join(n for n in (note, timing.note) if n) or None
        ctx.log(f"prefill {kind} T={tokens} {op:<14} {impl:<9} {timing.us:12.1f} µs ({timing.mode})")
    else:
        ctx.log(f"prefill {kind} T={tokens} {op:<14} {impl:<9} [red]{status}[/] {reason}")
    return row


def _plan(mgr: KVCacheManager, n: int) -> Any:
    batch = mgr.prepare_forward({_RID: n})
    if mgr.device.type == "cuda":
        torch.cuda.synchronize(mgr.device)   # the next prepare_forward reuses the pinned host buffers
    return batch


def _fresh(mgr: KVCacheManager) -> None:
    if _RID in mgr.requests:
        mgr.free_request(_RID)
    mgr.add_request(_RID)


def _time_compress(ctx: BenchContext, mgr: KVCacheManager, kind: str, ops: types.SimpleNamespace,
                   x: torch.Tensor, chunks: list[int]) -> Timing:
    """What the layer runs per chunk: `compress_and_flush` (state update on the bf16
    projections with the position bias added inside, then RMSNorm and RoPE of the finished
    entries) and the quantised scatter (write_entries)."""
    li = LAYER_INDEX[kind]
    blk = ctx.blocks[kind]
    comp = blk.compressor
    proj = {"c": comp.kv_proj(x), "z": comp.gate_proj(x)}
    if comp.overlap:
        proj.update(ic=comp.indexer.kv_proj(x), iz=comp.indexer.gate_proj(x))

    def run(region: Callable[[Callable[[], Any]], None]) -> None:
        _fresh(mgr)
        t0 = 0
        for n in chunks:
            b = _plan(mgr, n)

            def work(t0: int = t0, n: int = n, b: Any = b) -> None:
                compress_flush(blk, {k: v[t0:t0 + n] for k, v in proj.items()}, b, mgr, li, ops)

            region(work)
            t0 += n

    return ctx.timer.time_regions(run, synced_too=True)


def compress_flush(blk: Any, proj: dict[str, torch.Tensor], batch: Any, mgr: KVCacheManager, li: int,
                   ops: types.SimpleNamespace) -> None:
    """What layer li runs to compress one chunk and flush it (`compress_and_flush`: its compressors,
    each followed by its cache write that norms, rotates, quantises and scatters the entries; CUDA:
    CSA's indexer chain on the side stream)."""
    compress_and_flush(blk.compressor, proj, batch, acquire(mgr, li, batch, ops.name), blk.rope, ops)


def _time_layer(ctx: BenchContext, mgr: KVCacheManager, kind: str, impl: str, x: torch.Tensor,
                chunks: list[int]) -> Timing:
    li, blk = LAYER_INDEX[kind], ctx.blocks[kind]
    blk.backend = impl

    def run(region: Callable[[Callable[[], Any]], None]) -> None:
        _fresh(mgr)
        t0 = 0
        for n in chunks:
            b = _plan(mgr, n)
            h = acquire(mgr, li, b, impl)
            xs = x[t0:t0 + n]
            region(lambda xs=xs, b=b, h=h: blk(xs, b, h))
            t0 += n

    return ctx.timer.time_regions(run)


def _time_hf(ctx: BenchContext, kind: str, x: torch.Tensor, chunks: list[int], work: Work) -> Row:
    """One shot first (what a user of transformers runs); if that fails, the bench's chunks, then 2K."""
    tokens = x.shape[0]
    tries = [[tokens], chunks]
    if max(chunks) > _HF_SMALL_CHUNK:
        tries.append([_HF_SMALL_CHUNK] * (tokens // _HF_SMALL_CHUNK)
                     + ([tokens % _HF_SMALL_CHUNK] if tokens % _HF_SMALL_CHUNK else []))
    failures: list[str] = []
    result: tuple[str, Timing | None, str | None] = ("error", None, "no attempt")
    for tr in dict.fromkeys(tuple(t) for t in tries):          # distinct, in order
        label = "one shot" if len(tr) == 1 else f"chunks of {tr[0]}"
        result = guarded(lambda tr=tr: ctx.timer.time_regions(ctx.hf_layer(kind).prefill_run(x, list(tr))))
        free_memory()
        if result[0] == "ok":
            note = "; ".join([*failures, f"{label}: ok"])
            return _row(ctx, kind, tokens, "layer", "hf", work, result, note=note)
        failures.append(f"{label}: {result[0]}")
        if result[0] != "oom":
            break
    status, _, reason = result
    return _row(ctx, kind, tokens, "layer", "hf", work, (status, None, "; ".join(failures) + f" ({reason})"))
