"""Triton twins of the decode-step reads: indexer scores, exact top-k, and sink attention.

Same signatures and results as `dsv4.kernels.reference.decode.paged_indexer_scores`,
`...decode.topk_smaller_index` and `...decode.decode_attention` (plus keyword-only tuning knobs).
The kernels live in their own modules; this one gathers them:

    paged_indexer_scores   dsv4.kernels.triton.indexer_scores   scan of the paged indexer keys
    topk_smaller_index     dsv4.kernels.triton.topk             exact radix-select top-k per row
    decode_attention       dsv4.kernels.triton.decode_attention window + selected / all entries
"""

from __future__ import annotations

from dsv4.kernels.triton.decode_attention import decode_attention
from dsv4.kernels.triton.indexer_scores import paged_indexer_scores
from dsv4.kernels.triton.topk import topk_smaller_index

__all__ = ["decode_attention", "paged_indexer_scores", "topk_smaller_index"]
