"""KVCacheManager: owns the pools, the allocators and the request table.

Check, then mutate: every public call validates everything first, so a refused call (an
exception from `dsv4.errors`) leaves every request and every block exactly as before.

    mgr = KVCacheManager(cfg, max_requests=8, num_blocks=64)      # or memory_bytes=...
    mgr.add_request("a")
    batch = mgr.prepare_forward({"a": 37})    # host: allocate blocks, fill int32 metadata
    handle = mgr.acquire(layer_idx, batch)    # per layer view for the attention
    mgr.free_request("a")
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4.cache.allocator import BlockAllocator, SlotAllocator
from dsv4.cache.batch import ForwardBatch
from dsv4.cache.handle import LayerCacheHandle
from dsv4.cache.paged_cache import PagedKVPool
from dsv4.cache.schema import (
    BLOCK_SIZE_ORIGINAL_TOKENS,
    LayerCacheSchema,
    block_fill_ratio,
    blocks_needed,
    build_schemas,
)
from dsv4.cache.state_cache import StateCachePool
from dsv4.errors import ConfigError, InputError, OutOfBlocksError, RequestError
from dsv4.kernels.compress_plan import CompressPlan, plan_ints
from dsv4.kernels.dispatch import BACKENDS
from dsv4.model.config import DSV4Config
from dsv4.model.layer_schedule import AttentionType


@dataclass(kw_only=True, slots=True)
class _Request:
    slot: int
    seq_len: int = 0
    blocks: list[int] = field(default_factory=list)


class KVCacheManager:
    def __init__(self, cfg: DSV4Config, *, max_requests: int = 8, num_blocks: int | None = None,
                 memory_bytes: int | None = None, device: torch.device | str = "cpu",
                 kv_format: str = "fp8_ds", indexer_format: str = "mxfp4",
                 tokens_per_block: int = BLOCK_SIZE_ORIGINAL_TOKENS, max_batch_tokens: int = 8192,
                 backend: str = "auto"):
        if (num_blocks is None) == (memory_bytes is None):
            raise ConfigError("give exactly one of num_blocks= or memory_bytes= to size the cache")
        if max_requests < 1 or max_batch_tokens < 1:
            raise ConfigError("max_requests and max_batch_tokens must be at least 1")
        if backend not in BACKENDS:
            raise ConfigError(f"backend={backend!r} is not one of {BACKENDS}")
        self.cfg, self.backend = cfg, backend
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors report cuda:N, never cuda
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.tokens_per_block = tokens_per_block
        self.max_requests = max_requests
        self.max_batch_tokens = max_batch_tokens
        self.schemas: list[LayerCacheSchema] = build_schemas(
            cfg, tokens_per_block=tokens_per_block, kv_format=kv_format, indexer_format_name=indexer_format)
        self.kv_format, self.indexer_format = kv_format, indexer_format
        self.block_bytes = sum(s.block_bytes for s in self.schemas)
        self.state_bytes_per_request = sum(s.state_bytes for s in self.schemas)
        if memory_bytes is not None:
            num_blocks = self.blocks_for_memory(memory_bytes)
        assert num_blocks is not None
        if num_blocks < 2:
            raise ConfigError(f"num_blocks={num_blocks}: need at least 2 (block 0 is the reserved null block)")
        compressed = [s for s in self.schemas if s.compress_ratio]
        # The smallest ratio fills blocks first: a block is needed once its first entry closes.
        self._fill_ratio = block_fill_ratio(self.schemas)
        self.max_blocks_per_request = max(1, self.blocks_needed(cfg.max_position_embeddings))

        self.allocator = BlockAllocator(num_blocks)
        self.slots = SlotAllocator(max_requests)
        self.paged: dict[int, PagedKVPool] = {s.layer_idx: PagedKVPool(s, num_blocks, self.device) for s in compressed}
        self.states: dict[int, StateCachePool] = {
            s.layer_idx: StateCachePool(s, max_requests, self.device) for s in self.schemas}
        self.requests: dict[str, _Request] = {}
        self._alloc_buffers()

    # ------------------------------------------------------------------ sizing
    def blocks_for_memory(self, memory_bytes: int) -> int:
        """Blocks (null block included) that fit in `memory_bytes` after the state of max_requests."""
        state = self.state_bytes_per_request * self.max_requests
        free = memory_bytes - state
        if self.block_bytes == 0:  # SWA-only model: no paged pools, only the state must fit
            if free < 0:
                raise ConfigError(f"memory_bytes={memory_bytes} is less than the state of {self.max_requests} "
                                  f"requests ({state} B); give more memory or lower max_requests")
            return 2
        if free < 2 * self.block_bytes:
            raise ConfigError(
                f"memory_bytes={memory_bytes} leaves no room for cache blocks: the state of {self.max_requests} "
                f"requests takes {state} B and two blocks take {2 * self.block_bytes} B; give more memory or "
                "lower max_requests")
        return free // self.block_bytes

    def blocks_needed(self, seq_len: int) -> int:
        """Blocks a request of `seq_len` tokens holds (rule: `dsv4.cache.schema.blocks_needed`)."""
        return blocks_needed(seq_len, self.tokens_per_block, self._fill_ratio)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str) -> int:
        """Admit a request with no tokens yet; returns its state slot."""
        if request_id in self.requests:
            raise RequestError(f"request {request_id!r} is already active; free it first or use a new id")
        slot = self.slots.allocate()
        for st in self.states.values():  # a reused slot must not leak the previous request's state
            st.reset_slots(slot)
        self.requests[request_id] = _Request(slot=slot)
        return slot

    def free_request(self, request_id: str) -> None:
        req = self._get(request_id)
        self.allocator.free(req.blocks)
        self.slots.free(req.slot)
        del self.requests[request_id]

    def can_grow(self, new_tokens: dict[str, int]) -> bool:
        """Whether prepare_forward(new_tokens) would find enough free blocks (ids must be active)."""
        need = sum(self.blocks_needed(self._get(r).seq_len + n) - len(self._get(r).blocks)
                   for r, n in new_tokens.items())
        return self.allocator.can_allocate(need)

    def _get(self, request_id: str) -> _Request:
        try:
            return self.requests[request_id]
        except KeyError:
            raise RequestError(f"unknown request {request_id!r}; call add_request first") from None

    # ------------------------------------------------------------------ step planning
    def _alloc_buffers(self) -> None:
        self._ratios = sorted({s.compress_ratio for s in self.schemas if s.compress_ratio})
        self._kinds = sorted({(s.compress_ratio, s.attn_type is AttentionType.CSA)      # (ratio, overlap)
                              for s in self.schemas if s.compress_ratio})
        i32 = {"dtype": torch.int32, "device": "cpu"}   # host buffers even under a `with torch.device(...)`
        r, t, mb = self.max_requests, self.max_batch_tokens, self.max_blocks_per_request
        pin = self.device.type == "cuda"
        self._host = {
            "positions": torch.zeros(t, **i32, pin_memory=pin), "token_request": torch.zeros(t, **i32, pin_memory=pin),
            "cu_seqlens": torch.zeros(r + 1, **i32, pin_memory=pin), "seq_lens": torch.zeros(r, **i32, pin_memory=pin),
            "request_slots": torch.zeros(r, **i32, pin_memory=pin), "block_lens": torch.zeros(r, **i32, pin_memory=pin),
            "block_table": torch.full((r, mb), -1, **i32, pin_memory=pin),
            # seq_len // m per compression ratio m of the model (row i: self._ratios[i]): a decode
            # step reads them instead of running a division kernel per layer
            "entries": torch.zeros(len(self._ratios), r, **i32, pin_memory=pin),
            # the prefill compressor's launch table per compressor kind (ratio, overlap): planned
            # once per forward here, read by every layer's compressors of that kind
            "compress": torch.zeros(len(self._kinds), 7 * r + 1, **i32, pin_memory=pin),
        }
        self._dev = {k: torch.empty_like(v, device=self.device) for k, v in self._host.items()}
        # The host->device copies are asynchronous: the next step may only rewrite the pinned host
        # buffers once the previous step's copies have run.
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None

    def prepare_forward(self, new_tokens: dict[str, int]) -> ForwardBatch:
        """Plan one forward: allocate the blocks the new tokens' entries land in, fill metadata.

        Args:
            new_tokens: request id -> number of new tokens (>= 1), in the order tokens are packed.
        Returns:
            ForwardBatch whose tensors are views of buffers owned by the manager.
        """
        if not new_tokens:
            raise InputError("prepare_forward needs at least one request with new tokens")
        if len(new_tokens) > self.max_requests:
            raise InputError(f"{len(new_tokens)} requests in one step; at most max_requests={self.max_requests}")
        total = 0
        grow: list[tuple[_Request, int]] = []
        for rid, n in new_tokens.items():
            req = self._get(rid)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise InputError(f"request {rid!r}: new token count must be a positive int, got {n!r}")
            end = req.seq_len + n
            if end > self.cfg.max_position_embeddings:
                raise InputError(
                    f"request {rid!r} would reach {end} tokens, past max_position_embeddings="
                    f"{self.cfg.max_position_embeddings}; shorten the prompt or generation")
            grow.append((req, self.blocks_needed(end) - len(req.blocks)))
            total += n
        if total > self.max_batch_tokens:
            raise InputError(f"{total} tokens in one step; at most max_batch_tokens={self.max_batch_tokens} "
                             "(split the prefill into chunks or raise max_batch_tokens)")
        need = sum(g for _, g in grow)
        if not self.allocator.can_allocate(need):
            raise OutOfBlocksError(need, self.allocator.num_free, f"{len(new_tokens)} request(s) this step")
        # ---- everything checked: mutate
        for req, g in grow:
            if g > 0:
                req.blocks.extend(self.allocator.allocate(g))
        return self._fill_batch(new_tokens)

    def _fill_batch(self, new_tokens: dict[str, int]) -> ForwardBatch:
        if self._copied is not None:
            self._copied.synchronize()
        h = self._host
        b_count, t_count = len(new_tokens), sum(new_tokens.values())
        qlens, slens, slots, blens = [], [], [], []
        t = 0
        h["cu_seqlens"][0] = 0
        h["block_table"][:b_count].fill_(-1)
        for b, (rid, n) in enumerate(new_tokens.items()):
            req = self.requests[rid]
            start = req.seq_len
            req.seq_len += n
            h["positions"][t:t + n] = torch.arange(start, start + n, dtype=torch.int32, device="cpu")
            h["token_request"][t:t + n] = b
            t += n
            h["cu_seqlens"][b + 1] = t
            h["seq_lens"][b] = req.seq_len
            h["request_slots"][b] = req.slot
            h["block_lens"][b] = len(req.blocks)
            for i, m in enumerate(self._ratios):
                h["entries"][i, b] = req.seq_len // m
            if req.blocks:
                h["block_table"][b, :len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32, device="cpu")
            qlens.append(n), slens.append(req.seq_len), slots.append(req.slot), blens.append(len(req.blocks))
        sizes = {"positions": t_count, "token_request": t_count, "cu_seqlens": b_count + 1, "seq_lens": b_count,
                 "request_slots": b_count, "block_lens": b_count, "block_table": b_count}
        views = {}
        for k, n in sizes.items():
            self._dev[k][:n].copy_(h[k][:n], non_blocking=True)
            views[k] = self._dev[k][:n]
        self._dev["entries"][:, :b_count].copy_(h["entries"][:, :b_count], non_blocking=True)
        entries = {m: self._dev["entries"][i, :b_count] for i, m in enumerate(self._ratios)}
        plans = self._compress_plans(tuple(s - q for s, q in zip(slens, qlens)), tuple(qlens))
        if self._copied is not None:
            self._copied.record()
        bound = min(max(self.tokens_per_block, 1 << (max(slens) - 1).bit_length()),
                    self.max_blocks_per_request * self.tokens_per_block)
        return ForwardBatch(request_ids=tuple(new_tokens), tokens_per_block=self.tokens_per_block, **views,
                            seq_len_bound=bound, visible_entries=entries, compress_plans=plans,
                            query_lens_host=tuple(qlens), seq_lens_host=tuple(slens), slots_host=tuple(slots),
                            block_lens_host=tuple(blens))

    def _compress_plans(self, starts: tuple[int, ...], qlens: tuple[int, ...]) -> dict[tuple[int, bool], CompressPlan]:
        """Each compressor kind's launch table, copied with the batch (one copy for all kinds)."""
        h, d, n = self._host["compress"], self._dev["compress"], 7 * len(qlens) + 1
        sizes = []
        for i, (ratio, overlap) in enumerate(self._kinds):
            ints, n_mid, n_fin = plan_ints(starts, qlens, ratio, overlap)
            h[i, :n] = torch.tensor(ints, dtype=torch.int32, device="cpu")
            sizes.append((n_mid, n_fin))
        d[:, :n].copy_(h[:, :n], non_blocking=True)
        return {(ratio, overlap): CompressPlan(ratio, overlap, starts, qlens, d[i, :n], *sizes[i])
                for i, (ratio, overlap) in enumerate(self._kinds)}

    def acquire(self, layer_idx: int, batch: ForwardBatch) -> LayerCacheHandle:
        """The cache handle of one layer for this batch (no allocation of cache memory)."""
        if not 0 <= layer_idx < len(self.schemas):
            raise InputError(f"layer_idx={layer_idx} out of range: the model has {len(self.schemas)} layers")
        return LayerCacheHandle(schema=self.schemas[layer_idx], paged=self.paged.get(layer_idx),
                                state=self.states[layer_idx], batch=batch,
                                num_query_heads=self.cfg.num_attention_heads, backend=self.backend)

    # ------------------------------------------------------------------ reporting
    def seq_len(self, request_id: str) -> int:
        return self._get(request_id).seq_len

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._get(request_id).blocks)

    def memory_report(self) -> dict[str, int]:
        paged = sum(p.memory_bytes() for p in self.paged.values())
        state = sum(s.memory_bytes() for s in self.states.values())
        used = self.allocator.num_used
        return {
            "total_blocks": self.allocator.num_usable,
            "free_blocks": self.allocator.num_free,
            "used_blocks": used,
            "active_requests": len(self.requests),
            "block_bytes": self.block_bytes,
            "state_bytes_per_request": self.state_bytes_per_request,
            "paged_bytes_allocated": paged,
            "state_bytes_allocated": state,
            "bytes_allocated": paged + state,
            "bytes_used": used * self.block_bytes + len(self.requests) * self.state_bytes_per_request,
        }
