"""The decode step of one layer (one new token per request): fixed shapes, no host reads.

Used for every all-decode batch. With the Triton ops it is what CUDA graphs capture; with the
reference ops it is the readable twin (tests compare it with the general prefill path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv4.cache.handle import LayerCacheHandle
from dsv4.model.layer_schedule import AttentionType

if TYPE_CHECKING:
    import types


def decode_attend(blk, proj: dict[str, torch.Tensor], q: torch.Tensor, q_res: torch.Tensor, kv: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, cache: LayerCacheHandle,
                  ops: types.SimpleNamespace) -> torch.Tensor:
    """Cache writes and attention for an all-decode batch.

    Args:
        blk: the AttentionSubBlock; proj: its input projections of x (`AttentionSubBlock.project`);
        q [B, H, D] fp32 (RoPE'd); q_res [B, R_q]; kv [B, D] (RoPE'd); cos/sin [B, r/2] at the
        tokens' positions.
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
    comp = blk.compressor
    if comp is not None:
        assert pool is not None, "compressed layers have a paged pool"
        ratio, epb = sch.compress_ratio, sch.entries_per_block
        max_entries = b.seq_len_bound // ratio
        num_entries = b.seq_lens // ratio
        ereq = torch.arange(q.shape[0], device=q.device)
        entries, eidx = comp.compress_decode(proj["c"], proj["z"], b, st.comp_state, ops)
        # entries finish at the same positions in both CSA compressors (same ratio): one table
        ecos, esin = ops.rope_cos_sin(blk.rope.inv_freq_on(q.device), eidx, ratio)
        ops.write_entries(pool.kv, fmt, comp.finish(entries, ecos, esin, ops), ereq, eidx, b.block_table, epb)
        if sch.attn_type is AttentionType.CSA:
            idx = comp.indexer
            keys, kidx = idx.compress_decode(proj["ic"], proj["iz"], b, st.idx_state, ops)
            ops.write_entries(pool.indexer, sch.indexer_format, idx.finish(keys, ecos, esin, ops), ereq, kidx,
                              b.block_table, epb)
            qi, g = idx.queries(q_res, proj["iw"], cos, sin, sch.indexer_format, ops)
            scores = ops.paged_indexer_scores(qi, g, pool.indexer, sch.indexer_format, b.block_table, num_entries,
                                              max_entries, epb)
            indices = ops.topk_smaller_index(scores, idx.topk)
            num_entries = None
    return ops.decode_attention(q, st.swa, fmt, st.swa_pos, b.request_slots, b.positions, blk.cfg.sliding_window,
                                pool.kv if pool is not None else None, b.block_table, sch.entries_per_block,
                                indices, num_entries, max_entries, blk.sinks, blk.cfg.head_dim ** -0.5)
