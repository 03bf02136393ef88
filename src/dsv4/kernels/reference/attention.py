"""Reference core attention: shared-KV MQA with a per-head sink (DESIGN §3).

    logit[h, s] = q_h . k_s * D^-1/2
    p[h, s]     = exp(logit) / (exp(sink_h) + sum_s' exp(logit[h, s']))     (V = K)

`prefill_attention` is the op of the general (prefill / mixed) path: every new token of a batch
against its window and its compressed entries, as one masked dense pass per request.
"""

from __future__ import annotations

import torch

from dsv4.cache.formats import EntryFormat
from dsv4.errors import InputError
from dsv4.kernels.reference.cache_ops import gather_all_entries
from dsv4.kernels.reference.norm_rope import norm_rope

_QUERY_CHUNK = 512


def attention_with_sink(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """One request's queries against its keys.

    Args:
        q: [Tq, H, D] fp32; keys: [S, D] fp32 (also the values); mask: [Tq, S] bool, True = visible;
        sinks: [H] fp32 (not scaled).
    Returns:
        [Tq, H, D] fp32; a query that sees nothing attends only to the sink and gets 0.
    """
    out = torch.empty_like(q)
    sink = sinks.float()[None, :, None]
    for c0 in range(0, q.shape[0], _QUERY_CHUNK):
        c1 = min(c0 + _QUERY_CHUNK, q.shape[0])
        logits = torch.einsum("thd,sd->ths", q[c0:c1], keys) * scale
        logits = logits.masked_fill(~mask[c0:c1, None, :], float("-inf"))
        m = torch.maximum(logits.amax(-1, keepdim=True), sink)
        p = torch.exp(logits - m)
        denom = p.sum(-1, keepdim=True) + torch.exp(sink - m)
        out[c0:c1] = torch.einsum("ths,sd->thd", p / denom, keys)
    return out


def prefill_attention(q: torch.Tensor, old_kv: torch.Tensor, old_pos: torch.Tensor, new_kv: torch.Tensor,
                      positions: torch.Tensor, token_request: torch.Tensor, cu_seqlens: torch.Tensor, window: int,
                      kv_views: dict[str, torch.Tensor] | None, kv_fmt: EntryFormat, block_table: torch.Tensor | None,
                      epb: int, indices: torch.Tensor | None, ratio: int, max_entries: int, sinks: torch.Tensor,
                      scale: float, *, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                      out_dtype: torch.dtype | None = None, q_norm: float | None = None) -> torch.Tensor:
    """Attention of every new token of a batch (packed in request order) over its window and entries.

    Keys of the token at position t of request b: the window positions t - W < p <= t, from the
    request's ring as it was before this step (old_kv, positions p < p0_b) or from this step's new
    rows (p >= p0_b, the first new position); then, with ratio > 0, either the selected entries
    `indices` [T, K] (CSA, -1 = masked) or every entry whose window closed by t, the first
    (t + 1) // ratio (HCA), read from the paged pool through the request's block-table row.
    Args:
        q: [T, H, D] fp32; old_kv: [B, W, D] fp32 ring rows in position order, old_pos [B, W]
            (-1 = empty; `gather_window`); new_kv: [T, D] this step's rows as stored (round-tripped);
        positions, token_request: [T]; cu_seqlens: [B + 1] token offsets of the requests;
        kv_views, kv_fmt, block_table, epb: the paged main-entry pool (None without entries);
        max_entries: a bound on the entries of every request (host int); sinks: [H].
        rope: (cos, sin) [T, r/2] of the tokens' positions: the output is then RoPE_{-t}(o), the
            layer's inverse rotation (`norm_rope(..., normalize=False, inverse=True)`).
        out_dtype: the output's dtype (default fp32).
        q_norm: q is the raw up-projection; the attention takes RoPE_t(RMSNorm_1(q)) with eps q_norm
            and rope's cos / sin (the layer's `queries`), so a kernel may normalise q where it loads it.
    Returns:
        [T, H, D] out_dtype.
    """
    if q_norm is not None:
        if rope is None:
            raise InputError("q_norm rotates q: it needs rope=(cos, sin) of the tokens' positions")
        q = norm_rope(q, None, q_norm, *rope, out_dtype=torch.float32)
    dev = q.device
    out = torch.empty_like(q, dtype=torch.float32)
    cu = cu_seqlens.tolist()
    comp = None
    if ratio:
        assert kv_views is not None and block_table is not None, "compressed keys need the paged pool"
        last = torch.tensor([max(c1 - 1, 0) for c1 in cu[1:]], device=dev)
        comp, _ = gather_all_entries(kv_views, kv_fmt, (positions[last].long() + 1) // ratio, max_entries,
                                     block_table, epb)
    for b in range(len(cu) - 1):
        t0, t1 = cu[b], cu[b + 1]
        if t1 == t0:
            continue
        pos = positions[t0:t1].long()
        keys = [old_kv[b].float(), new_kv[t0:t1].float()]
        kpos = torch.cat([old_pos[b].long(), pos])
        kval = torch.cat([old_pos[b] >= 0, torch.ones(t1 - t0, dtype=torch.bool, device=dev)])
        mask = kval[None, :] & (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - window)
        if comp is not None:
            ne = comp.shape[1]
            keys.append(comp[b])
            if indices is None:    # HCA: every entry whose window closed at or before t
                cmask = torch.arange(ne, device=dev)[None, :] < ((pos[:, None] + 1) // ratio)
            else:                  # CSA: the indexer's picks
                sel = indices[t0:t1].long()
                cmask = torch.zeros(t1 - t0, ne + 1, dtype=torch.bool, device=dev)
                cmask.scatter_(1, torch.where(sel >= 0, sel, ne), True)
                cmask = cmask[:, :ne]
            mask = torch.cat([mask, cmask], dim=1)
        out[t0:t1] = attention_with_sink(q[t0:t1].float(), torch.cat(keys), mask, sinks, scale)
    if rope is not None:
        out = norm_rope(out, None, 0.0, *rope, normalize=False, inverse=True)
    return out if out_dtype is None else out.to(out_dtype)
