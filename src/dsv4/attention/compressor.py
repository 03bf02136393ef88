"""The KV compressor of CSA and HCA layers (DESIGN §3, §5), on the online state cache.

Per token j: c_j = x_j W_c, z_j = x_j W_z + APE[j mod m], in fp32. Each entry is a per-channel
softmax of z over its slots applied to c, then weighted RMSNorm and RoPE at the window's first
token w*m (applied by the cache writes: `Compressor.finisher`, `write_entries(finish=)`). CSA
(overlap) entries span two windows; HCA entries one. The state between steps is the (M, S, A)
online softmax kept in the state cache, so chunks and decode steps continue exactly where the
last call stopped.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from dsv4.attention.layers import RMSNorm
from dsv4.cache.batch import ForwardBatch
from dsv4.cache.handle import LayerCacheHandle
from dsv4.kernels.reference.cache_ops import EntryWrite
from dsv4.kernels.reference.norm_rope import EntryFinish
from dsv4.kernels.streams import on, side_stream
from dsv4.model.rope import RopeTable


class Compressor(nn.Module):
    """Parameters named as transformers' compressors: kv_proj, gate_proj, position_bias, kv_norm."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float = 1e-6):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))
        self.kv_norm = RMSNorm(dim, eps)

    def update(self, c: torch.Tensor, z: torch.Tensor, batch: ForwardBatch, state: torch.Tensor,
               ops: types.SimpleNamespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fold the batch's tokens into the state; return the entries that finished, before `finish`.

        Args:
            c, z: [T, width] kv_proj(x) and gate_proj(x) of the packed new tokens, read in place in
                their dtype (z without the position bias, which compress_update adds in fp32).
            state: [R, 3, P, dim] fp32 online-softmax state of this compressor (updated in place).
            ops: the op namespace (`dsv4.kernels.dispatch.ops_for`) that runs `compress_update`.
        Returns:
            entries [E, dim] fp32 (A/S), entry_request [E], entry_index [E] (int64).
        """
        return ops.compress_update(c, z, state, batch.request_slots, batch.start_positions_host,
                                   batch.query_lens_host, self.ratio, self.overlap, z_bias=self.position_bias,
                                   plan=batch.compress_plans.get((self.ratio, self.overlap)))

    def compress_decode(self, c: torch.Tensor, z: torch.Tensor, batch: ForwardBatch, state: torch.Tensor,
                        ops: types.SimpleNamespace, write: EntryWrite | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per request (an all-decode batch): entries [B, dim] fp32 (A/S, before norm and
        RoPE; meaningful where entry_index >= 0) and entry_index [B] (-1: no entry finished).

        c, z as in `compress`, read in place (column views of the layer's fused projection). write:
        also store the finished entries there (`ops.compress_decode(write=)`: one kernel on Triton)."""
        return ops.compress_decode(c, z, state, batch.request_slots, batch.positions, self.ratio, self.overlap,
                                   z_bias=self.position_bias, write=write)

    def finisher(self, rope: RopeTable, device: torch.device) -> EntryFinish:
        """kv_norm then RoPE at each entry's first token w*m: what `write_entries(finish=)` applies
        to this compressor's raw entries as it stores them."""
        return EntryFinish(self.kv_norm.weight, self.kv_norm.eps, rope.inv_freq_on(device), self.ratio)


def compress_and_flush(comp: Compressor, proj: dict[str, torch.Tensor], batch: ForwardBatch,
                       cache: LayerCacheHandle, rope: RopeTable, ops: types.SimpleNamespace) -> None:
    """A layer's compressors on one step and the flush of the entries they finish: the main one
    and, CSA, the indexer's (the same ratio: they finish the same entries), each followed by its
    cache write (kv_norm and RoPE applied by the writes: `layer_finishers`). On CUDA the indexer's
    compressor and key write run as one chain on the side stream beside the main chain (the key
    write takes the rows of the indexer's own compressor, so it waits for nothing on the main
    stream), joined before this returns.

    Args:
        proj: the layer's projections of x (c, z; CSA also ic, iz); cache: the layer's handle for
            this batch (its state caches are updated in place, its entries written).
    """
    st = cache.state
    fin_main, fin_idx = layer_finishers(comp, rope, batch.device)
    side = side_stream(batch.device) if st.idx_state is not None else None
    main = torch.cuda.current_stream(batch.device) if side is not None else None
    if side is not None:
        side.wait_stream(main)
    if st.idx_state is not None:
        with on(side):       # independent inputs, state and cache region
            keys, kreq, kidx = comp.indexer.update(proj["ic"], proj["iz"], batch, st.idx_state, ops)
            cache.flush_indexer_keys(keys, kreq, kidx, fin_idx)
    entries, req, idx = comp.update(proj["c"], proj["z"], batch, st.comp_state, ops)
    cache.flush_entries(entries, req, idx, fin_main)
    if side is not None:
        main.wait_stream(side)


def layer_finishers(comp: Compressor, rope: RopeTable, device: torch.device
                    ) -> tuple[EntryFinish, EntryFinish | None]:
    """The finish of the layer's main entries and (CSA) indexer keys, for `flush_compression(finish=)`."""
    indexer = getattr(comp, "indexer", None)
    return comp.finisher(rope, device), indexer.finisher(rope, device) if indexer is not None else None
