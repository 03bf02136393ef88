"""StateCachePool: one layer's per-request state (DESIGN §5). One slot per active request.

    swa_pages  [R, kv_format.page_bytes(W)] uint8   window ring, entry of position p at row p % W
    swa_pos    [R, W] int32                          position held by each ring row, -1 = empty
    swa_head   [R] int32                             tokens written so far = next position
    comp_state [R, 3, P, D] fp32                     online softmax (M, S, A) of the P pending
                                                     entries (CSA: cur, next; HCA: cur)
    idx_state  [R, 3, P, D_I] fp32                   the indexer's own compressor state (CSA)

A pending entry is empty as (M, S, A) = (-inf, 0, 0). For the request's next position p, the
pending entries are CSA: cur = entry p // m, next = cur + 1; HCA: cur = entry p // m'. The
position says which entries they are, so nothing else is stored.
"""

from __future__ import annotations

import torch

from dsv4.cache.schema import LayerCacheSchema


class StateCachePool:
    def __init__(self, schema: LayerCacheSchema, max_requests: int, device: torch.device | str = "cpu"):
        self.schema = schema
        self.max_requests = max_requests
        self.device = dev = torch.device(device)
        w = schema.window
        self.swa_pages = torch.zeros(max_requests, schema.kv_format.page_bytes(w), dtype=torch.uint8, device=dev)
        self.swa = schema.kv_format.views(self.swa_pages, w)          # {region: [R, W, bytes]}
        self.swa_pos = torch.full((max_requests, w), -1, dtype=torch.int32, device=dev)
        self.swa_head = torch.zeros(max_requests, dtype=torch.int32, device=dev)
        self.device = self.swa_head.device  # the device tensors report ("cuda:0", not "cuda")
        p = schema.pending_entries
        self.comp_state: torch.Tensor | None = None
        self.idx_state: torch.Tensor | None = None
        if p:
            self.comp_state = torch.empty(max_requests, 3, p, schema.head_dim, dtype=torch.float32, device=dev)
            if schema.indexer_format is not None:
                self.idx_state = torch.empty(max_requests, 3, p, schema.indexer_head_dim, dtype=torch.float32,
                                             device=dev)
        self.reset_slots(slice(None))

    @property
    def swa_entries(self) -> dict[str, torch.Tensor]:
        """Typed views of the window ring (see EntryFormat.typed)."""
        return self.schema.kv_format.typed(self.swa)

    def reset_slots(self, slots: int | slice) -> None:
        """Empty the given slots (a slot or a slice of them): no window entries, empty pending entries,
        head 0. Basic indexing only: fills of views, no index tensor copied to the device (a pageable
        copy would make the host wait for the device at every admission)."""
        if isinstance(slots, int):   # a 0-dim target takes a scalar as a host-to-device copy, not a fill
            slots = slice(slots, slots + 1)
        self.swa_pos[slots] = -1
        self.swa_head[slots] = 0
        self.swa_pages[slots] = 0
        for st in (self.comp_state, self.idx_state):
            if st is not None:
                st[slots, 0] = float("-inf")
                st[slots, 1:] = 0.0

    def memory_bytes(self) -> int:
        tensors = [self.swa_pages, self.swa_pos, self.swa_head, self.comp_state, self.idx_state]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
