"""LayerCacheHandle: one layer's cache, seen through one forward batch.

Made by `KVCacheManager.acquire(layer_idx, batch)`; holds references, allocates no cache
memory. The attention writes and reads the cache only through it, for a whole batch of
requests of different lengths at once. K and V are the same entry: reads return one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.cache.batch import ForwardBatch
from dsv4.cache.paged_cache import PagedKVPool
from dsv4.cache.schema import LayerCacheSchema
from dsv4.cache.state_cache import StateCachePool
from dsv4.errors import DeviceError, InputError
from dsv4.kernels.dispatch import ops_for
from dsv4.kernels.reference.norm_rope import EntryFinish
from dsv4.kernels.streams import on, side_stream


@dataclass(frozen=True, kw_only=True, slots=True)
class SWAView:
    """The window rings: region views [R, W, bytes], positions [R, W] (-1 empty), head [R]."""
    entries: dict[str, torch.Tensor]
    positions: torch.Tensor
    head: torch.Tensor
    slots: torch.Tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class ClassicalView:
    """Compressed entries: typed views [num_blocks, entries_per_block, ...] and the batch's block table."""
    entries: dict[str, torch.Tensor]
    block_table: torch.Tensor
    block_lens: torch.Tensor
    entries_per_block: int


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexerView:
    """Indexer keys: typed views [num_blocks, entries_per_block, ...] and the batch's block table."""
    keys: dict[str, torch.Tensor]
    block_table: torch.Tensor
    block_lens: torch.Tensor
    entries_per_block: int


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCacheHandle:
    schema: LayerCacheSchema
    paged: PagedKVPool | None
    state: StateCachePool
    batch: ForwardBatch
    num_query_heads: int
    backend: str = "auto"   # kernels: "auto" (Triton on CUDA), "reference" or "triton"

    @property
    def ops(self):
        """The op namespace that reads and writes this cache (see dsv4.kernels.dispatch)."""
        return ops_for(self.state.device, self.backend)

    @property
    def head_dim(self) -> int:
        return self.schema.head_dim

    def _check(self, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
        # Compare with where the cache's tensors live, not the device it was asked for: a cache made on
        # "cuda" holds tensors on "cuda:0", and torch.device("cuda") != torch.device("cuda:0").
        dev = self.state.swa_pos.device
        if t.device != dev:
            raise DeviceError(f"{name} is on {t.device} but the cache is on {dev}; move it there")
        if not t.is_floating_point():
            raise DeviceError(f"{name} must be a floating tensor, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise InputError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")

    def _paged(self) -> PagedKVPool:
        if self.paged is None:
            raise InputError(f"layer {self.schema.layer_idx} is SWA-only: it has no compressed cache")
        return self.paged

    # ------------------------------------------------------------------ window
    def write_swa(self, kv: torch.Tensor) -> None:
        """Write the new tokens' kv [T, D] into their rings (stored format), row = position % W."""
        b = self.batch
        self._check("kv", kv, (b.num_tokens, self.head_dim))
        st = self.state
        self.ops.append_window(st.swa, self.schema.kv_format, st.swa_pos, st.swa_head, kv, b.positions,
                          b.token_request, b.request_slots, b.seq_lens)

    def gather_swa_kv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ring contents in position order: kv [B, W, D] fp32, positions [B, W] int32, valid [B, W] bool."""
        st = self.state
        return self.ops.gather_window(st.swa, self.schema.kv_format, st.swa_pos, self.batch.request_slots)

    # ------------------------------------------------------------------ compressed entries
    def flush_compression(self, compressed: torch.Tensor, entry_request: torch.Tensor, entry_index: torch.Tensor,
                          indexer_keys: torch.Tensor | None = None,
                          finish: tuple[EntryFinish, EntryFinish | None] | None = None) -> None:
        """Quantise and scatter finished entries.

        Args:
            compressed: [E, D] finished entries (normed, RoPE'd) to store.
            entry_request: [E] batch index of each entry's request; entry_index: [E] entry number w
                (-1 = padding, written to the null block).
            indexer_keys: [E, D_I] the CSA indexer keys of the same entries (required for CSA).
            finish: (main, indexer) `EntryFinish`: compressed and indexer_keys are the compressors'
                raw entries, normed and RoPE'd by the writes (`attention.compressor.layer_finishers`).
        """
        pool = self._paged()
        self._check("compressed", compressed, (entry_index.shape[0], self.head_dim))
        if pool.indexer is not None:  # check everything before the first write: a refused call writes nothing
            if indexer_keys is None:
                raise InputError(f"layer {self.schema.layer_idx} is CSA: flush_compression needs indexer_keys")
            self._check("indexer_keys", indexer_keys, (entry_index.shape[0], self.schema.indexer_head_dim))
        fin_main, fin_idx = finish if finish is not None else (None, None)
        # CUDA: the indexer keys' write runs on the side stream beside the main entries' (two
        # independent latency-bound launches), joined before this returns
        side = side_stream(compressed.device) if pool.indexer is not None else None
        main = torch.cuda.current_stream(compressed.device) if side is not None else None
        if side is not None:
            side.wait_stream(main)
        if indexer_keys is not None:
            with on(side):
                self.flush_indexer_keys(indexer_keys, entry_request, entry_index, fin_idx)
        self.flush_entries(compressed, entry_request, entry_index, fin_main)
        if side is not None:
            main.wait_stream(side)

    def flush_entries(self, compressed: torch.Tensor, entry_request: torch.Tensor, entry_index: torch.Tensor,
                      finish: EntryFinish | None = None) -> None:
        """The main entries' half of `flush_compression` (same arguments), on the current stream: a
        layer that runs its CSA indexer's compressor and key write as one chain on another stream
        (`attention.compressor.compress_and_flush`) writes the two halves separately."""
        pool = self._paged()
        self._check("compressed", compressed, (entry_index.shape[0], self.head_dim))
        b, sch = self.batch, self.schema
        self.ops.write_entries(pool.kv, sch.kv_format, compressed, entry_request, entry_index, b.block_table,
                               sch.entries_per_block, finish)

    def flush_indexer_keys(self, indexer_keys: torch.Tensor, entry_request: torch.Tensor, entry_index: torch.Tensor,
                           finish: EntryFinish | None = None) -> None:
        """The CSA indexer keys' half of `flush_compression` (its entry rows may come from the
        indexer's own compressor: the same entries), on the current stream."""
        pool, sch = self._paged(), self.schema
        if pool.indexer is None:
            raise InputError(f"layer {sch.layer_idx} is not CSA: it stores no indexer keys")
        self._check("indexer_keys", indexer_keys, (entry_index.shape[0], sch.indexer_head_dim))
        self.ops.write_entries(pool.indexer, sch.indexer_format, indexer_keys, entry_request, entry_index,
                               self.batch.block_table, sch.entries_per_block, finish)

    def num_entries(self) -> torch.Tensor:
        """[B] finished entries per request after this step: seq_len // ratio."""
        return self.batch.visible_entries[self.schema.compress_ratio]

    def max_entries(self) -> int:
        return max(s // self.schema.compress_ratio for s in self.batch.seq_lens_host)

    def gather_compressed_kv(self, selected_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """CSA: per query token, its selected entries. selected_indices [T, k] (-1 = masked).

        Returns kv [T, k, D] fp32 (used as both K and V) and valid [T, k] bool.
        """
        pool, b = self._paged(), self.batch
        return self.ops.gather_entries(pool.kv, self.schema.kv_format, selected_indices, b.token_request,
                                  b.block_table, self.schema.entries_per_block)

    def gather_all_compressed_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """HCA (or CSA with every entry): kv [B, N, D] fp32 and valid [B, N], N = max entries in the batch."""
        pool, b = self._paged(), self.batch
        return self.ops.gather_all_entries(pool.kv, self.schema.kv_format, self.num_entries(), self.max_entries(),
                                      b.block_table, self.schema.entries_per_block)

    def gather_all_indexer_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """CSA: indexer keys [B, N, D_I] fp32 in the format's stored basis, valid [B, N]."""
        pool, b = self._paged(), self.batch
        if pool.indexer is None:
            raise InputError(f"layer {self.schema.layer_idx} has no indexer (only CSA layers do)")
        return self.ops.gather_all_entries(pool.indexer, self.schema.indexer_format, self.num_entries(),
                                      self.max_entries(), b.block_table, self.schema.entries_per_block)

    # ------------------------------------------------------------------ typed views
    def read_swa_view(self) -> SWAView:
        st = self.state
        return SWAView(entries=st.swa_entries, positions=st.swa_pos, head=st.swa_head, slots=self.batch.request_slots)

    def read_classical_view(self) -> ClassicalView:
        pool = self._paged()
        return ClassicalView(entries=pool.entries, block_table=self.batch.block_table,
                             block_lens=self.batch.block_lens, entries_per_block=self.schema.entries_per_block)

    def read_indexer_view(self) -> IndexerView:
        pool = self._paged()
        if pool.indexer_keys is None:
            raise InputError(f"layer {self.schema.layer_idx} has no indexer (only CSA layers do)")
        return IndexerView(keys=pool.indexer_keys, block_table=self.batch.block_table,
                           block_lens=self.batch.block_lens, entries_per_block=self.schema.entries_per_block)
