"""Reference lightning-indexer scoring and top-k selection (DESIGN §3).

    I[t, w] = sum_h g[t, h] * ReLU(q[t, h] . K[w]) * D_I^-1/2,   visible iff w < (t + 1) // m

Top-min(k, V) of the V visible entries; ties go to the smaller index (a stable descending
sort keeps index order among equal scores). Output has a fixed width k, padded with -1.
"""

from __future__ import annotations

import torch

from dsv4.kernels.reference.cache_ops import gather_all_entries

_QUERY_CHUNK = 256  # bounds the [chunk, H, N] score tensor


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                 query_lens: tuple[int, ...], num_entries: tuple[int, ...], ratio: int, topk: int) -> torch.Tensor:
    """Select entries per query token.

    Args:
        q: [T, H, D_I] fp32 indexer queries (in the keys' stored basis); weights: [T, H] fp32 (g).
        keys: [B, N, D_I] fp32 every finished indexer key per request (N >= num_entries[b]).
        positions: [T] int; query_lens / num_entries: host ints per request.
    Returns:
        [T, topk] int64 entry indices, -1 where fewer than topk entries are visible.
    """
    t_all, dev = q.shape[0], q.device
    out = torch.full((t_all, topk), -1, dtype=torch.long, device=dev)
    scale = q.shape[-1] ** -0.5
    t0 = 0
    for b, (n_q, n_e) in enumerate(zip(query_lens, num_entries)):
        for c0 in range(t0, t0 + n_q, _QUERY_CHUNK):
            c1 = min(c0 + _QUERY_CHUNK, t0 + n_q)
            if n_e == 0:
                continue
            s = torch.einsum("thd,nd->thn", q[c0:c1], keys[b, :n_e]).relu()
            score = (s * weights[c0:c1, :, None]).sum(1) * scale                     # [t, n_e]
            visible = torch.arange(n_e, device=dev)[None, :] < ((positions[c0:c1, None] + 1) // ratio)
            score = score.masked_fill(~visible, float("-inf"))
            k = min(topk, n_e)
            order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :k]
            picked = torch.gather(score, 1, order)
            out[c0:c1, :k] = torch.where(picked == float("-inf"), torch.full_like(order, -1), order)
        t0 += n_q
    return out


def prefill_indexer_topk(q: torch.Tensor, weights: torch.Tensor, idx_views: dict[str, torch.Tensor], fmt,
                         block_table: torch.Tensor, token_request: torch.Tensor, positions: torch.Tensor,
                         query_lens: tuple[int, ...], num_entries: tuple[int, ...], ratio: int, topk: int,
                         epb: int) -> torch.Tensor:
    """Indexer selection for any batch (prefill chunks and decode tokens), keys read from the pool.

    Args:
        q: [T, H, D_I] fp32 (or bf16, computed in fp32) in the keys' stored basis; weights: [T, H] fp32.
        idx_views: the indexer pool's region views; block_table: [B, max_blocks]; token_request,
            positions: [T]; query_lens / num_entries: host ints per request (entries finished
            after this step's flush).
    Returns:
        [T, topk] int64, -1 padded (see `indexer_topk`).
    """
    n_max = max(num_entries, default=0)
    keys, _ = gather_all_entries(idx_views, fmt, torch.tensor(num_entries, device=q.device), n_max, block_table, epb)
    return indexer_topk(q.float(), weights, keys, positions, query_lens, num_entries, ratio, topk)
