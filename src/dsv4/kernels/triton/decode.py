"""Triton twins of the decode-step reads: indexer scores, exact top-k, and sink attention.

Same signatures and results as `dsv4.kernels.reference.decode.paged_indexer_scores`,
`...decode.topk_smaller_index` and `...decode.decode_attention` (plus keyword-only tuning knobs).
The kernels live in their own modules; this one gathers them:

    paged_indexer_scores   dsv4.kernels.triton.indexer_scores   scan of the paged indexer keys
    topk_smaller_index     dsv4.kernels.triton.topk             exact radix-select top-k per row
    decode_indexer_topk    the two above, the scan's group maxima handed to the top-k's filter
    decode_attention       dsv4.kernels.triton.decode_attention window + selected / all entries
"""

from __future__ import annotations

import torch

from dsv4.cache.formats import EntryFormat
from dsv4.kernels.triton.decode_attention import decode_attention
from dsv4.kernels.triton.indexer_scores import paged_indexer_scores, scores_and_maxima
from dsv4.kernels.triton.topk import FILTER_GIVEN_MIN, topk_smaller_index


def decode_indexer_topk(q: torch.Tensor, weights: torch.Tensor, idx_views: dict[str, torch.Tensor],
                        fmt: EntryFormat, block_table: torch.Tensor, num_entries: torch.Tensor, max_entries: int,
                        epb: int, k: int, weight_scale: float = 1.0, **tuning) -> torch.Tensor:
    """The reference's `decode_indexer_topk`, identical result. The scan (TMA or pointer) also keeps
    the maxima of its row slots (disjoint groups of each row, 64 a TMA program, a power of two a
    pointer-scan program), so the top-k's filter bounds the k-th score from them instead of
    re-reading the scores for its own maxima, where it keeps FILTER_GIVEN_MIN a pick or more (fewer
    bound the k-th score loosely: the filter then finds its own). tuning: `scores_and_maxima`'s
    keyword arguments."""
    scores, gmax = scores_and_maxima(q, weights, idx_views, fmt, block_table, num_entries, max_entries, epb,
                                     weight_scale, group_max=True, min_groups=FILTER_GIVEN_MIN * k, **tuning)
    return topk_smaller_index(scores, k, group_max=gmax, order="index")


__all__ = ["decode_attention", "decode_indexer_topk", "paged_indexer_scores", "topk_smaller_index"]
