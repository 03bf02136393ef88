"""Reference decode-step ops: one new token per request, fixed shapes, device metadata only.

These are the specs of the Triton decode kernels, and like them they never read host data or
synchronise, so a decode step built from them can be captured in a CUDA graph. Padding is by
masks: a request whose token finishes no entry gets entry_index -1 (its write goes to the null
block 0); invalid key rows are masked out of the softmax.
"""

from __future__ import annotations

import torch

from dsv4.cache.formats import EntryFormat
from dsv4.errors import InputError
from dsv4.kernels.reference.cache_ops import EntryWrite, Views, read_rows, write_entries
from dsv4.kernels.reference.norm_rope import norm_rope


def compress_decode(c: torch.Tensor, z: torch.Tensor, state: torch.Tensor, request_slots: torch.Tensor,
                    positions: torch.Tensor, ratio: int, overlap: bool, *, z_bias: torch.Tensor | None = None,
                    write: EntryWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one token per request into its pending entries (DESIGN §5 online softmax).

    Args:
        c, z: [B, Dc] float (fp32 math); Dc = 2D (CSA) or D (HCA). z includes the position bias
            unless z_bias [ratio, Dc] is given: then z + z_bias[positions % ratio] (fp32).
        state: [R, 3, P, D] fp32 (M, S, A), updated in place; request_slots, positions: [B] int.
        write: also store the finished entries: `write_entries(write.views, write.fmt, entries,
            arange(B), entry_index, write.block_table, write.epb, write.finish)` (request i's token
            is row i). A request that finishes no entry writes nothing where the cache is read
            (the Triton twin skips the null block's padding row this writes).
    Returns:
        entries [B, D] fp32 = A/S of `cur` for requests whose token closes its window (else
        unspecified), entry_index [B] int64: the finished entry w, or -1.
    """
    d = state.shape[-1]
    c, z = c.float(), z.float()
    if z_bias is not None:
        z = z + z_bias.float()[positions.long() % ratio]
    slots = request_slots.long()
    st = state[slots]                                            # [B, 3, P, D]
    slot_c = c[:, d:] if overlap else c
    slot_z = z[:, d:] if overlap else z

    def merge(m, s, a, zz, cc):
        m2 = torch.maximum(m, zz)
        keep = torch.where(m == float("-inf"), torch.zeros_like(m), torch.exp(m - m2))
        add = torch.exp(zz - m2)
        return m2, s * keep + add, a * keep + cc * add

    m, s, a = merge(st[:, 0, 0], st[:, 1, 0], st[:, 2, 0], slot_z, slot_c)     # cur
    entries = a / s
    closes = (positions.long() + 1) % ratio == 0
    entry_index = torch.where(closes, positions.long() // ratio, torch.full_like(positions.long(), -1))
    empty_m = torch.full_like(m, float("-inf"))
    zero = torch.zeros_like(m)
    if overlap:
        nm, ns, na = merge(st[:, 0, 1], st[:, 1, 1], st[:, 2, 1], z[:, :d], c[:, :d])   # next
        cl = closes[:, None]
        # On close: cur <- next, next <- empty (the seeds' rotation).
        new = torch.stack([torch.stack([torch.where(cl, nm, m), torch.where(cl, empty_m, nm)], 1),
                           torch.stack([torch.where(cl, ns, s), torch.where(cl, zero, ns)], 1),
                           torch.stack([torch.where(cl, na, a), torch.where(cl, zero, na)], 1)], 1)
    else:
        cl = closes[:, None]
        new = torch.stack([torch.where(cl, empty_m, m), torch.where(cl, zero, s), torch.where(cl, zero, a)], 1)
        new = new[:, :, None]
    state[slots] = new
    if write is not None:
        rows = torch.arange(entries.shape[0], device=entries.device)
        write_entries(write.views, write.fmt, entries, rows, entry_index, write.block_table, write.epb, write.finish)
    return entries, entry_index


def paged_indexer_scores(q: torch.Tensor, weights: torch.Tensor, idx_views: Views, fmt: EntryFormat,
                         block_table: torch.Tensor, num_entries: torch.Tensor, max_entries: int, epb: int,
                         weight_scale: float = 1.0) -> torch.Tensor:
    """I[b, w] = sum_h g[b, h] * ReLU(q[b, h] . K_b[w]) * D_I^-1/2 over each request's keys, with
    g = weights.float() * weight_scale (fp32).

    Args:
        q: [B, H, D_I] fp32 in the keys' stored basis; weights: [B, H] any float dtype (e.g. the
            layer's weights_proj output, read in place).
        num_entries: [B] visible (finished) entries; max_entries: static width N of the output.
    Returns:
        [B, N] fp32, -inf at w >= num_entries[b].
    """
    b = q.shape[0]
    w = torch.arange(max_entries, device=q.device)[None, :].expand(b, -1)
    valid = w < num_entries[:, None]
    col = (w // epb).clamp(max=block_table.shape[1] - 1)
    block = block_table.long().gather(1, col)
    block = torch.where(valid & (block >= 0), block, torch.zeros_like(block))
    keys = read_rows(idx_views, fmt, block, w % epb)                         # [B, N, D_I]
    s = torch.einsum("bhd,bnd->bhn", q, keys).relu()
    g = weights.float() * weight_scale
    score = (s * g[:, :, None]).sum(1) * q.shape[-1] ** -0.5
    return score.masked_fill(~valid, float("-inf"))


#: `topk_smaller_index` orders: "score" (descending, the reference's packed order) or "index"
TOPK_ORDERS = ("score", "index")


def topk_smaller_index(scores: torch.Tensor, k: int, order: str = "score") -> torch.Tensor:
    """[B, N] -> [B, k] int64 top-k indices, ties to the smaller index, -1 where the score is -inf.

    fp32 scores map to order-preserving int32 keys; (key << 32) | (2^31 - 1 - index) is then a
    unique int64 per entry, so torch.topk on it is exact and deterministic.

    order "score": the picks by descending score (that packed order). order "index": the same picks
    whose score is above -inf (a NaN with its sign bit set is not: its key is below -inf's), in
    ascending index order, then -1. A set for the attention to read: it reads the cache in entry
    order, and whoever picks can skip the sort by score.
    """
    if order not in TOPK_ORDERS:
        raise InputError(f"order must be one of {TOPK_ORDERS}, got {order!r}")
    n = scores.shape[1]
    kk = min(k, n)
    bits = scores.contiguous().view(torch.int32).long()
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)                    # monotone in the float value
    idx = torch.arange(n, device=scores.device)
    packed = (key << 32) | (0x7FFFFFFF - idx)
    top = torch.topk(packed, kk, dim=1).indices
    if order == "index":
        above = torch.gather(key, 1, top) > _NEG_INF_KEY
        out = torch.where(above, top, torch.full_like(top, n)).sort(dim=1).values
        out = torch.where(out == n, torch.full_like(out, -1), out)
    else:
        picked = torch.gather(scores, 1, top)
        out = torch.where(picked == float("-inf"), torch.full_like(top, -1), top)
    if kk < k:
        out = torch.cat([out, torch.full((scores.shape[0], k - kk), -1, dtype=out.dtype, device=out.device)], 1)
    return out


_NEG_INF_KEY = -2139095041          # the key of -inf: 0xFF800000 ^ 0x7FFFFFFF as int32


def decode_indexer_topk(q: torch.Tensor, weights: torch.Tensor, idx_views: Views, fmt: EntryFormat,
                        block_table: torch.Tensor, num_entries: torch.Tensor, max_entries: int, epb: int, k: int,
                        weight_scale: float = 1.0) -> torch.Tensor:
    """A decode step's indexer selection: `topk_smaller_index` of `paged_indexer_scores` in index order
    ([B, k] int64, the picked entries ascending, then -1); one op so that a backend may pass what its
    scan learns to its top-k."""
    scores = paged_indexer_scores(q, weights, idx_views, fmt, block_table, num_entries, max_entries, epb, weight_scale)
    return topk_smaller_index(scores, k, order="index")


def decode_attention(q: torch.Tensor, swa: Views, kv_fmt: EntryFormat, swa_pos: torch.Tensor,
                     request_slots: torch.Tensor, positions: torch.Tensor, window: int,
                     kv_views: Views | None, block_table: torch.Tensor | None, epb: int,
                     indices: torch.Tensor | None, num_entries: torch.Tensor | None, max_entries: int,
                     sinks: torch.Tensor, scale: float, *, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                     out_dtype: torch.dtype | None = None, q_norm: float | None = None) -> torch.Tensor:
    """Attention of one query token per request over its window ring and compressed entries.

    Keys: the ring rows with t - W < pos <= t (this step's token already written), then either
    the selected entries `indices` [B, K] (CSA, -1 = masked) or the first num_entries[b] entries
    (HCA; max_entries is the static bound), or none (SWA).
    Args:
        q: [B, H, D] float (computed in fp32); sinks: [H].
        rope: (cos, sin) [B, r/2] of the tokens' positions: the output is then RoPE_{-t}(o), the
            layer's inverse rotation (`norm_rope(..., normalize=False, inverse=True)`).
        out_dtype: the output's dtype (default fp32).
        q_norm: q is the raw up-projection; the attention takes RoPE_t(RMSNorm_1(q)) with eps q_norm
            and rope's cos / sin (the layer's `queries`), so a kernel may normalise q where it loads it.
    Returns:
        [B, H, D].
    """
    if q_norm is not None:
        if rope is None:
            raise InputError("q_norm rotates q: it needs rope=(cos, sin) of the tokens' positions")
        q = norm_rope(q, None, q_norm, *rope, out_dtype=torch.float32)
    q = q.float()
    slots = request_slots.long()
    t = positions.long()[:, None]
    wpos = swa_pos[slots].long()                                               # [B, W]
    rows = torch.arange(swa_pos.shape[1], device=q.device)[None, :].expand_as(wpos)
    keys = read_rows(swa, kv_fmt, slots[:, None].expand_as(wpos), rows)       # [B, W, D]
    valid = (wpos >= 0) & (wpos <= t) & (wpos > t - window)
    if indices is not None or num_entries is not None:
        assert kv_views is not None and block_table is not None, "compressed keys need the paged pool"
        if indices is None:
            w = torch.arange(max_entries, device=q.device)[None, :].expand(q.shape[0], -1)
            cvalid = w < num_entries[:, None]
        else:
            w, cvalid = indices.long(), indices >= 0
        col = (w.clamp(min=0) // epb).clamp(max=block_table.shape[1] - 1)
        block = block_table.long().gather(1, col)
        block = torch.where(cvalid & (block >= 0), block, torch.zeros_like(block))
        ckeys = read_rows(kv_views, kv_fmt, block, w.clamp(min=0) % epb)
        keys = torch.cat([keys, ckeys], 1)
        valid = torch.cat([valid, cvalid], 1)
    # Masked rows (empty or stale ring rows, the null block) may hold any bytes, NaN included:
    # p = 0 does not cancel them (0 * NaN = NaN), so they must not reach the einsums.
    keys = keys.masked_fill(~valid[..., None], 0.0)
    logits = torch.einsum("bhd,bsd->bhs", q, keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None]
    m = torch.maximum(logits.amax(-1, keepdim=True), sink)
    p = torch.exp(logits - m)
    p = p / (p.sum(-1, keepdim=True) + torch.exp(sink - m))
    o = torch.einsum("bhs,bsd->bhd", p, keys)
    if rope is not None:
        o = norm_rope(o, None, 0.0, *rope, normalize=False, inverse=True)
    return o if out_dtype is None else o.to(out_dtype)
