"""Triton indexer selection for prefill chunks: the decode scoring kernel, one row per query token.

`paged_indexer_scores` scores rows that each have a block-table row and a count of visible
entries. A prefill token t of request b is such a row: block_table[b] and (t + 1) // m visible
entries. Tokens are scored in slices so the [rows, N] score buffer stays bounded, and each slice
goes through the same exact top-k (ties to the smaller index) as decode.
"""

from __future__ import annotations

import torch

_ROWS = 2048  # query tokens per slice: scores [2048, N] fp32 (N = 8K entries: 64 MiB)


def prefill_indexer_topk(q: torch.Tensor, weights: torch.Tensor, idx_views: dict[str, torch.Tensor], fmt,
                         block_table: torch.Tensor, token_request: torch.Tensor, positions: torch.Tensor,
                         query_lens: tuple[int, ...], num_entries: tuple[int, ...], ratio: int, topk: int,
                         epb: int) -> torch.Tensor:
    """Same contract as `dsv4.kernels.reference.indexer.prefill_indexer_topk`."""
    from dsv4.kernels.triton.ops import namespace

    ops = namespace()
    n_max = max(num_entries, default=0)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    if n_max == 0:
        return out
    # Only the batch's used block-table columns: a 1M-token table is 4,096 columns wide.
    cols = -(-n_max // epb)
    table = block_table[:, :cols]
    for r0 in range(0, q.shape[0], _ROWS):
        r1 = min(r0 + _ROWS, q.shape[0])
        rows_table = table[token_request[r0:r1].long()].contiguous()
        visible = ((positions[r0:r1].long() + 1) // ratio).to(torch.int32)
        scores = ops.paged_indexer_scores(q[r0:r1].contiguous(), weights[r0:r1].contiguous(), idx_views, fmt,
                                          rows_table, visible, n_max, epb)
        out[r0:r1] = ops.topk_smaller_index(scores, topk)
    return out
