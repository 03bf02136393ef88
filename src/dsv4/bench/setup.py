"""Synthetic but valid cache states and layers for benchmarks, built in seconds.

A decode benchmark at context C needs a cache as a C-token prefill would leave it. Running that
prefill (C = 1M, 64 requests) would take far longer than the measurement, and the timings do not
depend on the values, only on the cache being valid. So:

    requests    add_request, then `advance_request`: prepare_forward plans C - 1 tokens
                (allocates their blocks, bumps the length) and nothing touches the cache bytes
    pages       a few thousand random rows encoded with the pool's format, tiled over every
                page (raw random bytes would decode to NaN fp8 / huge scales); the indexer's
                keys with a request's worth of distinct rows, so that no score repeats within a
                request's row (a short pattern repeats each one n / 4,096 times: ties at the
                top-k's k-th score, and group maxima that repeat with the pattern, which a real
                cache does not have)
    window      the last W positions t-W .. t-1 (t = C - 1) at rows p % W, encoded random rows,
                head = t
    compressor  online-softmax states (M, S, A) with finite random values; a pending entry
                that no token of the prefix reached is empty (-inf, 0, 0), as a real prefill
                leaves it
    step        prepare_forward({r: 1 for every request}): one decode token at position C - 1

    positions   0 ............................... C-W-1 | C-W-1 ... C-2 | C-1
                compressed entries (pages)               window ring       this step's token
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from dsv4.attention import AttentionSubBlock
from dsv4.cache.batch import ForwardBatch
from dsv4.cache.formats import EntryFormat
from dsv4.cache.handle import LayerCacheHandle
from dsv4.cache.manager import KVCacheManager
from dsv4.cache.schema import LayerCacheSchema, block_fill_ratio, blocks_needed, build_schemas
from dsv4.cache.state_cache import StateCachePool
from dsv4.model.config import DSV4Config

_PATTERN_ROWS = 4096      # distinct encoded rows tiled over the pages


@dataclass(kw_only=True, slots=True)
class DecodeState:
    """A manager holding `batch` requests of `context - 1` tokens and the planned decode step."""

    mgr: KVCacheManager
    batch: ForwardBatch            # the decode step: one token per request at position context - 1
    x: torch.Tensor                # [batch, hidden] bf16 layer input of the step
    context: int
    request_ids: tuple[str, ...]


def cache_bytes(cfg: DSV4Config, *, context: int, batch: int, tokens_per_block: int, kv_format: str,
                indexer_format: str) -> int:
    """Bytes the decode state's manager allocates (pages + state slots), to skip what cannot fit."""
    schemas = build_schemas(cfg, tokens_per_block=tokens_per_block, kv_format=kv_format,
                            indexer_format_name=indexer_format)
    blocks = batch * blocks_needed(context, tokens_per_block, block_fill_ratio(schemas)) + 1
    return blocks * sum(s.block_bytes for s in schemas) + batch * sum(s.state_bytes for s in schemas)


def build_decode_state(cfg: DSV4Config, *, context: int, batch: int, device: torch.device, tokens_per_block: int,
                       kv_format: str, indexer_format: str, seed: int = 0) -> DecodeState:
    """The cache of `batch` requests after `context - 1` tokens, and a planned decode step (module doc)."""
    assert context >= 1 and batch >= 1, "a decode step needs a context and a request"
    schemas = build_schemas(cfg, tokens_per_block=tokens_per_block, kv_format=kv_format,
                            indexer_format_name=indexer_format)
    per_request = blocks_needed(context, tokens_per_block, block_fill_ratio(schemas))
    mgr = KVCacheManager(cfg, max_requests=batch, num_blocks=max(2, batch * per_request + 1), device=device,
                         kv_format=kv_format, indexer_format=indexer_format, tokens_per_block=tokens_per_block,
                         max_batch_tokens=max(context - 1, batch))
    gen = torch.Generator(device=device).manual_seed(seed)
    rids = tuple(f"r{i}" for i in range(batch))
    slot_ids = []
    for rid in rids:
        slot_ids.append(mgr.add_request(rid))
        advance_request(mgr, rid, context - 1)
    for pool in mgr.paged.values():
        fill_pages(pool.kv, pool.schema.kv_format, gen)
        if pool.indexer is not None:
            fill_pages(pool.indexer, pool.schema.indexer_format, gen, distinct_blocks=per_request)
    slots = torch.tensor(slot_ids, dtype=torch.long, device=device)
    for layer_idx, st in mgr.states.items():
        fill_state(st, mgr.schemas[layer_idx], slots, context - 1, gen)
    step = mgr.prepare_forward(dict.fromkeys(rids, 1))
    x = torch.randn(batch, cfg.hidden_size, device=device, generator=gen).to(torch.bfloat16)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return DecodeState(mgr=mgr, batch=step, x=x, context=context, request_ids=rids)


def advance_request(mgr: KVCacheManager, request_id: str, tokens: int) -> None:
    """Move a request `tokens` positions on without running a model: plan them with prepare_forward
    (which allocates the blocks their entries land in and bumps the length). The caller fills the
    cache bytes those tokens would have written."""
    while tokens > 0:
        n = min(tokens, mgr.max_batch_tokens)
        mgr.prepare_forward({request_id: n})
        if mgr.device.type == "cuda":
            # prepare_forward copies from pinned host buffers asynchronously; the next call reuses them
            torch.cuda.synchronize(mgr.device)
        tokens -= n


def fill_pages(views: dict[str, torch.Tensor], fmt: EntryFormat, gen: torch.Generator, distinct_blocks: int = 1
               ) -> None:
    """Fill every page of a pool (region views [N, P, bytes]) with valid encoded random entries: a
    pattern of at least `distinct_blocks` pages (and _PATTERN_ROWS rows) of distinct rows, tiled."""
    n_blocks, per_page = next(iter(views.values())).shape[:2]
    pat_blocks = max(1, min(n_blocks, max(_PATTERN_ROWS // per_page, distinct_blocks)))
    dev = next(iter(views.values())).device
    parts = fmt.encode(torch.randn(pat_blocks * per_page, fmt.dim, device=dev, generator=gen))
    reps = max(1, min(n_blocks // pat_blocks, 16))   # fewer, larger copies
    for name, v in views.items():
        pat = parts[name].reshape(pat_blocks, per_page, -1).repeat(reps, 1, 1)
        for s in range(0, n_blocks, pat.shape[0]):
            e = min(n_blocks, s + pat.shape[0])
            v[s:e].copy_(pat[: e - s])


def fill_state(st: StateCachePool, sch: LayerCacheSchema, slots: torch.Tensor, t: int,
               gen: torch.Generator) -> None:
    """The window ring and compressor states of `slots` as after tokens 0 .. t-1 (next position t)."""
    b, w, dev = slots.shape[0], sch.window, slots.device
    parts = sch.kv_format.encode(torch.randn(b * w, sch.head_dim, device=dev, generator=gen))
    for name, v in st.swa.items():
        v[slots] = parts[name].reshape(b, w, -1)
    pos = torch.arange(t - w, t, device=dev)
    pos = pos[pos >= 0]
    st.swa_pos[slots] = -1
    st.swa_pos[slots[:, None], (pos % w)[None, :]] = pos.to(torch.int32)[None, :].expand(b, -1)
    st.swa_head[slots] = t
    if sch.compress_ratio:
        csa = sch.indexer_format is not None
        fill_online_state(st.comp_state, slots, t, sch.compress_ratio, csa, gen)
        if st.idx_state is not None:
            fill_online_state(st.idx_state, slots, t, sch.compress_ratio, True, gen)


def fill_online_state(state: torch.Tensor, slots: torch.Tensor, t: int, ratio: int, overlap: bool,
                      gen: torch.Generator) -> None:
    """(M, S, A) [R, 3, P, D] of the pending entries at next position t (DESIGN §5).

    HCA cur (entry t // m') holds the tokens of its window before t: empty iff t % m' == 0.
    CSA cur holds window t//m - 1's [:D] halves and its own window's [D:] halves before t: empty
    iff t == 0; next holds its window's [:D] halves before t: empty iff t % m == 0.
    """
    b, p, d = slots.shape[0], state.shape[2], state.shape[3]
    m = torch.randn(b, p, d, device=state.device, generator=gen)
    s = 1.0 + 3.0 * torch.rand(b, p, d, device=state.device, generator=gen)
    a = s * torch.randn(b, p, d, device=state.device, generator=gen)
    empty = [t == 0, t % ratio == 0] if overlap else [t % ratio == 0]
    for i, e in enumerate(empty):
        if e:
            m[:, i], s[:, i], a[:, i] = float("-inf"), 0.0, 0.0
    state[slots] = torch.stack([m, s, a], dim=1)


def acquire(mgr: KVCacheManager, layer_idx: int, batch: ForwardBatch, backend: str) -> LayerCacheHandle:
    """mgr.acquire with the handle's kernels forced to `backend` (the general path's cache reads and
    writes go through the handle, so a backend comparison must set it as well as the block's)."""
    handle = mgr.acquire(layer_idx, batch)
    if "backend" in {f.name for f in dataclasses.fields(handle)}:
        handle = dataclasses.replace(handle, backend=backend)
    return handle


def make_block(cfg: DSV4Config, layer_idx: int, device: torch.device, seed: int = 0) -> AttentionSubBlock:
    """One layer's AttentionSubBlock on `device`, bf16, random weights at O(1) activation scales:
    projections ~ N(0, 1/fan_in), norm weights ~ U(0.7, 1.3), sinks ~ N(0, 1), position_bias
    ~ N(0, 0.25) (the zero / one defaults would hide the sink and bias work in no numbers)."""
    blk = AttentionSubBlock(cfg, layer_idx)
    blk = blk.to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + layer_idx)
    with torch.no_grad():
        for name, p in blk.named_parameters():
            if name.endswith("norm.weight"):
                v = 0.7 + 0.6 * torch.rand(p.shape, device=device, generator=gen)
            elif name == "sinks":
                v = torch.randn(p.shape, device=device, generator=gen)
            elif name.endswith("position_bias"):
                v = 0.5 * torch.randn(p.shape, device=device, generator=gen)
            else:
                v = torch.randn(p.shape, device=device, generator=gen) / math.sqrt(p.shape[-1])
            p.copy_(v)
    return blk
