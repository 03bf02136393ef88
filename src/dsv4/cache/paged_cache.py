"""PagedKVPool: one compressed layer's paged storage (main entries, and indexer keys for CSA).

Both live in uint8 page buffers indexed by the same physical block id, so one block table per
request serves every compressed layer:

    kv_pages       [num_blocks, kv_format.page_bytes(entries_per_block)]        uint8
    indexer_pages  [num_blocks, indexer_format.page_bytes(entries_per_block)]   uint8 (CSA only)

Entry w of a request lives in block `block_table[w // entries_per_block]`, row
`w % entries_per_block`. Block 0 is the null block (never read).
"""

from __future__ import annotations

import torch

from dsv4.cache.schema import LayerCacheSchema


class PagedKVPool:
    def __init__(self, schema: LayerCacheSchema, num_blocks: int, device: torch.device | str = "cpu"):
        assert schema.entries_per_block > 0, "SWA-only layers have no paged pool"
        self.schema = schema
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        epb = schema.entries_per_block
        self.kv_pages = torch.zeros(num_blocks, schema.kv_page_bytes, dtype=torch.uint8, device=self.device)
        self.kv = schema.kv_format.views(self.kv_pages, epb)          # {region: [nb, epb, bytes]}
        self.device = self.kv_pages.device  # the device tensors report ("cuda:0", not "cuda")
        self.indexer_pages: torch.Tensor | None = None
        self.indexer: dict[str, torch.Tensor] | None = None
        if schema.indexer_format is not None:
            self.indexer_pages = torch.zeros(num_blocks, schema.indexer_page_bytes, dtype=torch.uint8,
                                             device=self.device)
            self.indexer = schema.indexer_format.views(self.indexer_pages, epb)

    # Typed views named as in the original design (no copies).
    @property
    def entries(self) -> dict[str, torch.Tensor]:
        """Typed main-entry views, e.g. fp8_ds: nope [nb, epb, 448] e4m3, rope [nb, epb, 64] bf16, scale."""
        return self.schema.kv_format.typed(self.kv)

    @property
    def indexer_keys(self) -> dict[str, torch.Tensor] | None:
        return None if self.indexer is None else self.schema.indexer_format.typed(self.indexer)

    def memory_bytes(self) -> int:
        n = self.kv_pages.numel()
        return n + (self.indexer_pages.numel() if self.indexer_pages is not None else 0)
