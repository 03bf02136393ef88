"""Per-layer cache layout (`LayerCacheSchema`) and the block budget.

One block covers `tokens_per_block` original tokens of one request, in every compressed layer
at once (one block table per request). With the defaults (256 tokens, m=4, m'=128):

    tokens   0 ........................................................ 255
    CSA      entries 0..63 (one per 4 tokens)   + indexer keys 0..63
    HCA      entries 0..1  (one per 128 tokens)
    SWA      nothing paged: the window lives in the state cache

The state cache (window ring + online compressor state) has one slot per request.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4.cache.formats import EntryFormat, indexer_format, main_format
from dsv4.errors import ConfigError
from dsv4.model.config import DSV4Config
from dsv4.model.layer_schedule import AttentionType, LayerSpec

#: Default original tokens per block (a multiple of lcm(4, 128) = 128 for the real models).
BLOCK_SIZE_ORIGINAL_TOKENS = 256

_F32 = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCacheSchema:
    """Cache layout of one layer; byte sizes are derived from named parts."""

    layer_idx: int
    attn_type: AttentionType
    compress_ratio: int           # 0 for SWA-only layers
    tokens_per_block: int
    head_dim: int
    rope_dim: int
    window: int                   # sliding window W (entries in the ring)
    kv_format: EntryFormat        # main entries: compressed pool and window ring
    indexer_format: EntryFormat | None  # CSA only
    indexer_head_dim: int         # 0 unless CSA

    def __post_init__(self) -> None:
        if self.compress_ratio and self.tokens_per_block % self.compress_ratio:
            raise ConfigError(
                f"tokens_per_block={self.tokens_per_block} must be a multiple of layer "
                f"{self.layer_idx}'s compress ratio {self.compress_ratio}")
        assert (self.indexer_format is not None) == (self.attn_type is AttentionType.CSA), \
            "exactly the CSA layers carry an indexer format"

    # ------------------------------------------------------------------ paged pool
    @property
    def entries_per_block(self) -> int:
        return self.tokens_per_block // self.compress_ratio if self.compress_ratio else 0

    @property
    def indexer_entries_per_block(self) -> int:
        return self.entries_per_block if self.indexer_format is not None else 0

    @property
    def kv_page_bytes(self) -> int:
        return self.kv_format.page_bytes(self.entries_per_block) if self.entries_per_block else 0

    @property
    def indexer_page_bytes(self) -> int:
        fmt = self.indexer_format
        return fmt.page_bytes(self.indexer_entries_per_block) if fmt is not None else 0

    @property
    def block_bytes(self) -> int:
        """Bytes one block id costs in this layer (main page + indexer page)."""
        return self.kv_page_bytes + self.indexer_page_bytes

    @property
    def compressed_bytes_per_token(self) -> float:
        """Paged bytes per original token (entry bytes / ratio, before page padding)."""
        if not self.compress_ratio:
            return 0.0
        idx = self.indexer_format.entry_bytes if self.indexer_format is not None else 0
        return (self.kv_format.entry_bytes + idx) / self.compress_ratio

    # ------------------------------------------------------------------ state slot
    @property
    def pending_entries(self) -> int:
        """Online-softmax accumulators kept per request: CSA 2 (cur, next), HCA 1, SWA 0."""
        return {AttentionType.SWA: 0, AttentionType.HCA: 1, AttentionType.CSA: 2}[self.attn_type]

    @property
    def window_bytes(self) -> int:
        """Ring of W entries in the main format + an int32 position per entry + the int32 head."""
        return self.kv_format.page_bytes(self.window) + 4 * self.window + 4

    @property
    def compressor_state_bytes(self) -> int:
        """(M, S, A) fp32 per channel per pending entry; the indexer has its own at indexer_head_dim."""
        main = 3 * self.pending_entries * self.head_dim * _F32
        idx = 3 * self.pending_entries * self.indexer_head_dim * _F32 if self.indexer_format is not None else 0
        return main + idx

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state slot in this layer."""
        return self.window_bytes + self.compressor_state_bytes


def build_schema(config: DSV4Config, spec: LayerSpec, *, tokens_per_block: int = BLOCK_SIZE_ORIGINAL_TOKENS,
                 kv_format: str = "fp8_ds", indexer_format_name: str = "mxfp4") -> LayerCacheSchema:
    """Derive one layer's cache layout from the architecture and the chosen formats."""
    config.check_tokens_per_block(tokens_per_block)
    csa = spec.attn is AttentionType.CSA
    return LayerCacheSchema(
        layer_idx=spec.layer_idx, attn_type=spec.attn, compress_ratio=spec.compress_ratio,
        tokens_per_block=tokens_per_block, head_dim=config.head_dim, rope_dim=config.rope_dim,
        window=config.sliding_window, kv_format=main_format(kv_format, config.head_dim, config.rope_dim),
        indexer_format=indexer_format(indexer_format_name, config.indexer_head_dim) if csa else None,
        indexer_head_dim=config.indexer_head_dim if csa else 0,
    )


def build_schemas(config: DSV4Config, *, tokens_per_block: int = BLOCK_SIZE_ORIGINAL_TOKENS,
                  kv_format: str = "fp8_ds", indexer_format_name: str = "mxfp4") -> list[LayerCacheSchema]:
    return [build_schema(config, s, tokens_per_block=tokens_per_block, kv_format=kv_format,
                         indexer_format_name=indexer_format_name) for s in config.layer_schedule()]


def block_fill_ratio(schemas: list[LayerCacheSchema]) -> int:
    """The smallest compress ratio among the compressed layers (0 if none): it fills blocks first."""
    return min((s.compress_ratio for s in schemas if s.compress_ratio), default=0)


def blocks_needed(seq_len: int, tokens_per_block: int, fill_ratio: int) -> int:
    """Blocks a request of `seq_len` tokens holds: those containing at least one closed entry.

    `fill_ratio` is `block_fill_ratio(schemas)`; a block is needed once its first entry of the
    fastest-filling layer type closes (0 = no compressed layers, no blocks):

        tokens   0 ... 255 | 256 ... 511 |      (tokens_per_block 256, m = 4, 64 entries/block)
        entry 63 closes at token 255 -> 1 block; entry 64 closes at token 259 -> 2 blocks

    KVCacheManager and the memory planner (`dsv4.planner`) both use this rule.
    """
    if not fill_ratio:
        return 0
    entries = seq_len // fill_ratio
    per_block = tokens_per_block // fill_ratio
    return -(-entries // per_block)


def compute_block_budget(config: DSV4Config, schedule: list[LayerSpec] | None = None, *,
                         max_context_tokens: int, max_concurrent_requests: int,
                         tokens_per_block: int = BLOCK_SIZE_ORIGINAL_TOKENS, kv_format: str = "fp8_ds",
                         indexer_format_name: str = "mxfp4") -> dict[str, int]:
    """Blocks and bytes for `max_concurrent_requests` requests of `max_context_tokens` tokens.

    Returns a dict with `blocks_per_request` (the manager's rule, `blocks_needed`), `num_blocks`
    (incl. the null block 0),
    `block_bytes` (one block id across all layers), `state_bytes_per_request`, `paged_bytes`,
    `state_bytes` and `total_bytes`.
    """
    schedule = schedule if schedule is not None else config.layer_schedule()
    schemas = [build_schema(config, s, tokens_per_block=tokens_per_block, kv_format=kv_format,
                            indexer_format_name=indexer_format_name) for s in schedule]
    per_req = blocks_needed(max_context_tokens, tokens_per_block, block_fill_ratio(schemas))
    block_bytes = sum(s.block_bytes for s in schemas)
    state = sum(s.state_bytes for s in schemas)
    num_blocks = per_req * max_concurrent_requests + 1
    return {
        "blocks_per_request": per_req,
        "num_blocks": num_blocks,
        "block_bytes": block_bytes,
        "state_bytes_per_request": state,
        "paged_bytes": num_blocks * block_bytes,
        "state_bytes": state * max_concurrent_requests,
        "total_bytes": num_blocks * block_bytes + state * max_concurrent_requests,
    }
