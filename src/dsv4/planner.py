"""Memory planner: what a DSV4 cache costs per token and per request, and how many requests fit.

Pure functions of a config, the storage formats, `tokens_per_block`, a context length and a
memory budget; nothing is allocated. The accounting is KVCacheManager's own, so the plan is what
`KVCacheManager(cfg, max_requests=R, memory_bytes=M, ...)` will really admit:

    memory M = num_blocks × block_bytes  +  R × state_bytes_per_request
               ^ null block 0 included     ^ one state slot per request (window ring + compressor state)
    a request of C tokens holds blocks_needed(C) blocks  (dsv4.cache.schema.blocks_needed)
    R requests of C tokens fit  <=>  num_blocks - 1 >= R × blocks_needed(C)

Bytes per token of compressed history, per layer (entry bytes / ratio, page padding excluded):

    CSA   (main entry + indexer key) / m        fp8_ds + mxfp4: (584 + 68) / 4   = 163
    HCA   main entry / m'                       fp8_ds:          584 / 128       = 4.5625
    SWA   0: the window lives in the per-request state

For comparison the planner also prices the same context as a BF16 DSV4 cache, an uncompressed
BF16 cache (every layer keeps every token), and a DeepSeek-V3.2-style cache (MLA latent + FP8
indexer key per token in every layer).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from dsv4.cache.schema import (
    BLOCK_SIZE_ORIGINAL_TOKENS,
    LayerCacheSchema,
    block_fill_ratio,
    blocks_needed,
    build_schemas,
)
from dsv4.errors import InputError
from dsv4.model.config import DSV4Config
from dsv4.model.layer_schedule import AttentionType

#: DeepSeek-V3.2 per layer and token: FP8 MLA latent (512 e4m3 + 4 fp32 scales + 64 bf16 RoPE = 656 B)
#: plus its FP8 indexer key (128 e4m3 + one fp32 scale = 132 B), in each of 61 layers.
V32_LAYERS = 61
V32_LATENT_BYTES = 656
V32_INDEXER_BYTES = 132

DEFAULT_KV_FORMAT = "fp8_ds"
DEFAULT_INDEXER_FORMAT = "mxfp4"


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerTypePlan:
    """Cost of the layers of one attention type (`bytes_per_token` sums them; `*_per_layer` is one)."""

    attn_type: str                  # "swa", "csa" or "hca"
    layers: int
    compress_ratio: int             # 0 for SWA
    main_entry_bytes: int           # one compressed entry in kv_format (0 for SWA)
    indexer_entry_bytes: int        # one indexer key (CSA only, else 0)
    bytes_per_token_per_layer: float
    bytes_per_token: float          # × layers
    block_bytes_per_layer: int      # main page + indexer page of one block id, padding included
    state_bytes_per_layer: int      # one request's state slot in one layer


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheCost:
    """One row of the side-by-side comparison: a cache layout priced at one context and budget."""

    name: str
    description: str
    bytes_per_token: float          # history bytes per original token (entries, no page padding)
    state_bytes_per_request: int
    block_bytes: int
    blocks_per_request: int
    bytes_per_request: int          # blocks × block_bytes + state
    max_concurrent_requests: int


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryPlan:
    """The plan for one DSV4 config, formats, block size, context and memory budget."""

    model: str
    kv_format: str
    indexer_format: str
    tokens_per_block: int
    context: int
    memory_bytes: int
    max_requests_cap: int | None        # the max_requests= asked for, None = as many as fit
    layer_types: tuple[LayerTypePlan, ...]
    compressed_bytes_per_token: float   # Σ over layers of entry bytes / ratio
    paged_bytes_per_token: float        # block_bytes / tokens_per_block: what full blocks really cost
    block_bytes: int                    # one block id across every compressed layer
    state_bytes_per_request: int        # Σ over layers of LayerCacheSchema.state_bytes
    blocks_per_request: int             # blocks a request of `context` tokens holds
    bytes_per_request: int              # blocks_per_request × block_bytes + state_bytes_per_request
    max_concurrent_requests: int        # requests of `context` tokens that fit in memory_bytes
    max_requests: int                   # KVCacheManager max_requests= that realises the plan
    num_blocks: int                     # blocks (null block included) the manager then allocates
    bytes_allocated: int                # num_blocks × block_bytes + max_requests × state

    @property
    def cost(self) -> CacheCost:
        return CacheCost(
            name=f"dsv4 {self.kv_format}+{self.indexer_format}", description="this plan",
            bytes_per_token=self.compressed_bytes_per_token, state_bytes_per_request=self.state_bytes_per_request,
            block_bytes=self.block_bytes, blocks_per_request=self.blocks_per_request,
            bytes_per_request=self.bytes_per_request, max_concurrent_requests=self.max_concurrent_requests)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_types"] = {lt["attn_type"]: lt for lt in d["layer_types"]}
        return d


# ---------------------------------------------------------------------------------------- budgeting
def fit_requests(memory_bytes: int, *, block_bytes: int, state_bytes_per_request: int,
                 blocks_per_request: int, cap: int | None = None) -> int:
    """Most requests of `blocks_per_request` blocks each that a `memory_bytes` cache can hold.

    KVCacheManager(max_requests=R, memory_bytes=M) keeps R state slots and turns the rest into
    num_blocks = (M - R·state) // block_bytes blocks, block 0 being the null block, and needs
    num_blocks >= 2. So R fits when M - R·state >= max(R·blocks_per_request + 1, 2) · block_bytes.
    `cap` bounds R (a fixed max_requests); the cap's state slots are then paid for in full.
    """
    if memory_bytes <= 0:
        return 0
    if cap is not None:
        if block_bytes == 0:  # SWA-only: no blocks, only state slots
            return cap if cap * state_bytes_per_request <= memory_bytes else 0
        num_blocks = (memory_bytes - cap * state_bytes_per_request) // block_bytes
        if num_blocks < 2:
            return 0
        if blocks_per_request == 0:
            return cap
        return min(cap, (num_blocks - 1) // blocks_per_request)
    if block_bytes == 0:
        return memory_bytes // state_bytes_per_request if state_bytes_per_request else 0
    if blocks_per_request == 0:  # nothing paged yet, but the manager still wants 2 blocks
        free = memory_bytes - 2 * block_bytes
        if free < 0:
            return 0
        return free // state_bytes_per_request if state_bytes_per_request else 0
    return max(0, (memory_bytes - block_bytes) // (state_bytes_per_request + blocks_per_request * block_bytes))


def _check_inputs(config: DSV4Config, context: int, memory_bytes: int) -> None:
    if context < 1 or context > config.max_position_embeddings:
        raise InputError(
            f"context={context} must be between 1 and the model's max_position_embeddings="
            f"{config.max_position_embeddings}")
    if memory_bytes < 0:
        raise InputError(f"memory budget must be non-negative, got {memory_bytes} B")


# ---------------------------------------------------------------------------------------- the plan
def plan_memory(config: DSV4Config, *, context: int, memory_bytes: int, kv_format: str = DEFAULT_KV_FORMAT,
                indexer_format: str = DEFAULT_INDEXER_FORMAT,
                tokens_per_block: int = BLOCK_SIZE_ORIGINAL_TOKENS, max_requests: int | None = None) -> MemoryPlan:
    """Price a DSV4 cache for requests of `context` tokens in `memory_bytes` of memory.

    Args:
        config: the model.
        context: tokens per request (prompt + generation), 1 ≤ context ≤ max_position_embeddings.
        memory_bytes: the cache's budget, as KVCacheManager(memory_bytes=...) takes it.
        kv_format, indexer_format: storage formats (dsv4.cache.formats.MAIN_FORMATS / INDEXER_FORMATS).
        tokens_per_block: original tokens per block (a multiple of lcm(m, m')).
        max_requests: a fixed KVCacheManager max_requests= (state slots paid whether used or not);
            None picks the largest number of requests that fits.
    Returns:
        MemoryPlan; its `max_requests` and `num_blocks` are the manager arguments that realise it.
    """
    _check_inputs(config, context, memory_bytes)
    if max_requests is not None and max_requests < 1:
        raise InputError(f"max_requests must be at least 1, got {max_requests}")
    schemas = build_schemas(config, tokens_per_block=tokens_per_block, kv_format=kv_format,
                            indexer_format_name=indexer_format)
    block_bytes = sum(s.block_bytes for s in schemas)
    state = sum(s.state_bytes for s in schemas)
    per_req = blocks_needed(context, tokens_per_block, block_fill_ratio(schemas))
    fit = fit_requests(memory_bytes, block_bytes=block_bytes, state_bytes_per_request=state,
                       blocks_per_request=per_req, cap=max_requests)
    mgr_requests = max_requests if max_requests is not None else fit
    if block_bytes == 0:
        num_blocks = 2  # what the manager allocates for an SWA-only model
    elif mgr_requests:
        num_blocks = (memory_bytes - mgr_requests * state) // block_bytes
    else:
        num_blocks = 0  # nothing fits: the manager would refuse this budget
    return MemoryPlan(
        model=config.name, kv_format=kv_format, indexer_format=indexer_format, tokens_per_block=tokens_per_block,
        context=context, memory_bytes=memory_bytes, max_requests_cap=max_requests,
        layer_types=_layer_type_plans(schemas),
        compressed_bytes_per_token=sum(s.compressed_bytes_per_token for s in schemas),
        paged_bytes_per_token=block_bytes / tokens_per_block, block_bytes=block_bytes,
        state_bytes_per_request=state, blocks_per_request=per_req, bytes_per_request=per_req * block_bytes + state,
        max_concurrent_requests=fit, max_requests=mgr_requests, num_blocks=max(num_blocks, 0),
        bytes_allocated=max(num_blocks, 0) * block_bytes + mgr_requests * state if mgr_requests else 0,
    )


def _layer_type_plans(schemas: list[LayerCacheSchema]) -> tuple[LayerTypePlan, ...]:
    out = []
    for t in (AttentionType.SWA, AttentionType.CSA, AttentionType.HCA):
        group = [s for s in schemas if s.attn_type is t]
        if not group:
            continue
        s = group[0]  # every layer of a type has the same layout
        assert all(g.block_bytes == s.block_bytes and g.state_bytes == s.state_bytes for g in group), \
            "layers of one attention type share one layout"
        out.append(LayerTypePlan(
            attn_type=t.value, layers=len(group), compress_ratio=s.compress_ratio,
            main_entry_bytes=s.kv_format.entry_bytes if s.compress_ratio else 0,
            indexer_entry_bytes=s.indexer_format.entry_bytes if s.indexer_format is not None else 0,
            bytes_per_token_per_layer=s.compressed_bytes_per_token,
            bytes_per_token=s.compressed_bytes_per_token * len(group), block_bytes_per_layer=s.block_bytes,
            state_bytes_per_layer=s.state_bytes))
    return tuple(out)


# ---------------------------------------------------------------------------------------- comparisons
def flat_cache_cost(name: str, description: str, bytes_per_token: int, *, context: int, memory_bytes: int,
                    tokens_per_block: int = BLOCK_SIZE_ORIGINAL_TOKENS, max_requests: int | None = None) -> CacheCost:
    """A cache that keeps every token (no compression, no state), paged in blocks of tokens_per_block."""
    block_bytes = bytes_per_token * tokens_per_block
    per_req = math.ceil(context / tokens_per_block)
    return CacheCost(
        name=name, description=description, bytes_per_token=float(bytes_per_token), state_bytes_per_request=0,
        block_bytes=block_bytes, blocks_per_request=per_req, bytes_per_request=per_req * block_bytes,
        max_concurrent_requests=fit_requests(memory_bytes, block_bytes=block_bytes, state_bytes_per_request=0,
                                             blocks_per_request=per_req, cap=max_requests))


def v32_cost(*, context: int, memory_bytes: int, tokens_per_block: int = BLOCK_SIZE_ORIGINAL_TOKENS,
             max_requests: int | None = None) -> CacheCost:
    """DeepSeek-V3.2-style: 61 layers × (656 B FP8 MLA latent + 132 B FP8 indexer key) per token."""
    return flat_cache_cost(
        "V3.2-style", f"{V32_LAYERS} layers x ({V32_LATENT_BYTES} B FP8 latent + {V32_INDEXER_BYTES} B FP8 indexer)",
        V32_LAYERS * (V32_LATENT_BYTES + V32_INDEXER_BYTES), context=context, memory_bytes=memory_bytes,
        tokens_per_block=tokens_per_block, max_requests=max_requests)


def uncompressed_bf16_cost(config: DSV4Config, *, context: int, memory_bytes: int,
                           tokens_per_block: int = BLOCK_SIZE_ORIGINAL_TOKENS,
                           max_requests: int | None = None) -> CacheCost:
    """DSV4 without compression: every layer keeps every token at head_dim × 2 B."""
    return flat_cache_cost(
        "uncompressed bf16", f"DSV4, {config.num_hidden_layers} layers x {config.head_dim} x 2 B, all tokens",
        config.num_hidden_layers * config.head_dim * 2, context=context, memory_bytes=memory_bytes,
        tokens_per_block=tokens_per_block, max_requests=max_requests)


def compare(config: DSV4Config, plan: MemoryPlan) -> list[CacheCost]:
    """Side by side at the plan's context and budget: the plan, DSV4 in BF16, uncompressed BF16, V3.2-style."""
    same: dict[str, Any] = {"context": plan.context, "memory_bytes": plan.memory_bytes,
                            "tokens_per_block": plan.tokens_per_block, "max_requests": plan.max_requests_cap}
    bf16 = plan_memory(config, kv_format="bf16", indexer_format="bf16", **same).cost
    return [
        plan.cost,
        replace(bf16, name="dsv4 bf16", description="same model, bf16 entries and indexer"),
        uncompressed_bf16_cost(config, **same),
        v32_cost(**same),
    ]


def context_sweep(config: DSV4Config, contexts: list[int], *, tokens_per_block: int = BLOCK_SIZE_ORIGINAL_TOKENS,
                  ) -> dict[str, list[int]]:
    """Bytes per request at each context for DSV4 (default formats), DSV4 BF16 and V3.2-style (for plots)."""
    out: dict[str, list[int]] = {"dsv4 fp8_ds+mxfp4": [], "dsv4 bf16": [], "V3.2-style": []}
    for c in contexts:
        out["dsv4 fp8_ds+mxfp4"].append(plan_memory(
            config, context=c, memory_bytes=0, tokens_per_block=tokens_per_block).bytes_per_request)
        out["dsv4 bf16"].append(plan_memory(
            config, context=c, memory_bytes=0, kv_format="bf16", indexer_format="bf16",
            tokens_per_block=tokens_per_block).bytes_per_request)
        out["V3.2-style"].append(v32_cost(context=c, memory_bytes=0, tokens_per_block=tokens_per_block)
                                 .bytes_per_request)
    return out
