"""The decode step of one layer (one new token per request): fixed shapes, no host reads.

Used for every all-decode batch. With the Triton ops it is what CUDA graphs capture; with the
reference ops it is the readable twin (tests compare it with the general prefill path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv4.attention.compressor import Compressor
from dsv4.cache.handle import LayerCacheHandle
from dsv4.model.layer_schedule import AttentionType
from dsv4.model.rope import RopeTable

if TYPE_CHECKING:
    import types


def _compress_step(comp: Compressor, x: torch.Tensor, cache: LayerCacheHandle, state: torch.Tensor,
                   rope: RopeTable, ops: types.SimpleNamespace) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request into the compressor state -> (entries [B, dim] normed+RoPE'd, entry_index [B])."""
    b = cache.batch
    c = comp.kv_proj(x).float()
    z = comp.gate_proj(x).float() + comp.position_bias.float()[(b.positions % comp.ratio).long()]
    entries, eidx = ops.compress_decode(c, z, state, b.request_slots, b.positions, comp.ratio, comp.overlap)
    cos, sin = rope.cos_sin(eidx.clamp(min=0) * comp.ratio)
    return ops.norm_rope(entries, comp.kv_norm.weight, comp.kv_norm.eps, cos, sin), eidx


def decode_attend(blk, x: torch.Tensor, q: torch.Tensor, q_res: torch.Tensor, kv: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, cache: LayerCacheHandle,
                  ops: types.SimpleNamespace) -> torch.Tensor:
    """Cache writes and attention for an all-decode batch.

    Args:
        blk: the AttentionSubBlock; x [B, d]; q [B, H, D] fp32 (RoPE'd); q_res [B, R_q];
        kv [B, D] (RoPE'd); cos/sin [B, r/2] at the tokens' positions.
    Returns:
        [B, H, D] fp32 attention output before the inverse RoPE.
    """
    b, st, sch = cache.batch, cache.state, cache.schema
    fmt = sch.kv_format
    ops.append_window(st.swa, fmt, st.swa_pos, st.swa_head, kv, b.positions, b.token_request, b.request_slots,
                      b.seq_lens)
    pool = cache.paged
    indices = num_entries = None
    max_entries = 0
    if blk.compressor is not None:
        assert pool is not None, "compressed layers have a paged pool"
        ratio, epb = sch.compress_ratio, sch.entries_per_block
        max_entries = b.seq_len_bound // ratio
        num_entries = b.seq_lens // ratio
        ereq = torch.arange(x.shape[0], device=x.device)
        entries, eidx = _compress_step(blk.compressor, x, cache, st.comp_state, blk.rope, ops)
        ops.write_entries(pool.kv, fmt, entries, ereq, eidx, b.block_table, epb)
        if sch.attn_type is AttentionType.CSA:
            idx = blk.compressor.indexer
            keys, kidx = _compress_step(idx, x, cache, st.idx_state, blk.rope, ops)
            ops.write_entries(pool.indexer, sch.indexer_format, keys, ereq, kidx, b.block_table, epb)
            qi = idx.q_b_proj(q_res).view(x.shape[0], idx.heads, idx.dim)
            qi = ops.norm_rope(qi, None, 0.0, cos, sin, normalize=False, out_dtype=torch.float32)
            qi = sch.indexer_format.to_stored_basis(qi)
            g = idx.scorer.weights_proj(x).float() * idx.heads ** -0.5
            scores = ops.paged_indexer_scores(qi, g, pool.indexer, sch.indexer_format, b.block_table, num_entries,
                                              max_entries, epb)
            indices = ops.topk_smaller_index(scores, idx.topk)
            num_entries = None
    return ops.decode_attention(q, st.swa, fmt, st.swa_pos, b.request_slots, b.positions, blk.cfg.sliding_window,
                                pool.kv if pool is not None else None, b.block_table, sch.entries_per_block,
                                indices, num_entries, max_entries, blk.sinks, blk.cfg.head_dim ** -0.5)
