"""Reference compressor state update: online softmax over each entry's slots (DESIGN §5).

Every token j at position p contributes slots (c, z) to pending entries:

    HCA (ratio m', no overlap):  (c_j, z_j)            -> entry p // m'
    CSA (ratio m, overlap):      (c_j[D:], z_j[D:])    -> entry p // m          ("cur")
                                 (c_j[:D], z_j[:D])    -> entry p // m + 1      ("next")

A pending entry is (M, S, A) per channel: running max of z, sum of exp(z - M), sum of
exp(z - M) * c; empty = (-inf, 0, 0). Merging is associative, so a chunk of tokens is reduced
per entry in one vectorised pass and merged with the stored state. An entry is finished once
its window's last token (w+1)*m - 1 has been seen; its value is A / S.

For one request with new tokens at positions [p0, p1):

    entries   p0//m ... p1//m - 1     finish in this step (returned)
              p1//m, p1//m + 1        pending afterwards (stored; the second only for CSA)
"""

from __future__ import annotations

import torch

from dsv4.kernels.compress_plan import CompressPlan


def compress_update(c: torch.Tensor, z: torch.Tensor, state: torch.Tensor, request_slots: torch.Tensor,
                    start_positions: tuple[int, ...], query_lens: tuple[int, ...], ratio: int, overlap: bool,
                    *, z_bias: torch.Tensor | None = None, plan: CompressPlan | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold a batch of new tokens into the pending entries; return the finished ones.

    Args:
        c, z: [T, Dc] projections of the packed new tokens (any float dtype; the math is fp32);
            Dc = 2D for CSA (overlap), D for HCA.
        z_bias: [ratio, Dc] position bias added to z in fp32 (row pos mod ratio); None when z has it.
        state: [R, 3, P, D] fp32 (M, S, A) of the P pending entries per request slot (updated in place).
        request_slots: [B] int state slot per request; start_positions, query_lens: host ints per request.
        ratio: tokens per window m; overlap: CSA's two-window scheme.
        plan: the Triton twin's launch table for this batch (`ForwardBatch.compress_plans`); the
            reference plans from the host ints and does not read it.
    Returns:
        entries [E, D] fp32 (A/S, before norm and RoPE), entry_request [E] int64 (batch index),
        entry_index [E] int64 (entry number w), ordered by (request, w).
    """
    dev = c.device
    d = state.shape[-1]
    npend = 2 if overlap else 1
    # Segments: one per (request, entry touched this step), entries p0//m ... p1//m + npend - 1.
    first = [p0 // ratio for p0 in start_positions]
    counts = [(p0 + n) // ratio + npend - f for p0, n, f in zip(start_positions, query_lens, first)]
    seg_base = torch.tensor([0] + counts[:-1], dtype=torch.long).cumsum(0).tolist()
    nseg = sum(counts)

    pos = torch.cat([torch.arange(p0, p0 + n) for p0, n in zip(start_positions, query_lens)]).to(dev)
    c, z = c.float(), z.float()
    if z_bias is not None:
        z = z + z_bias.float()[pos % ratio]
    req = torch.cat([torch.full((n,), b, dtype=torch.long) for b, n in enumerate(query_lens)]).to(dev)
    base_t = torch.tensor(seg_base, device=dev)[req] - torch.tensor(first, device=dev)[req]
    w = pos // ratio
    if overlap:
        seg = torch.cat([base_t + w, base_t + w + 1])
        sc = torch.cat([c[:, d:], c[:, :d]])
        sz = torch.cat([z[:, d:], z[:, :d]])
        ss = torch.ones_like(sz)
    else:
        seg, sc, sz, ss = base_t + w, c, z, torch.ones_like(z)

    # The stored pending entries enter as pre-reduced slots of segments 0 and 1 of each request.
    slots = request_slots.long()
    st = state[slots]                                             # [B, 3, P, D]
    pend_seg = (torch.tensor(seg_base, device=dev)[:, None] + torch.arange(npend, device=dev)).reshape(-1)
    m_all = torch.cat([sz, st[:, 0].reshape(-1, d)])
    s_all = torch.cat([ss, st[:, 1].reshape(-1, d)])
    a_all = torch.cat([sc * ss, st[:, 2].reshape(-1, d)])
    seg_all = torch.cat([seg, pend_seg])

    idx = seg_all[:, None].expand(-1, d)
    m_seg = torch.full((nseg, d), float("-inf"), device=dev).scatter_reduce(0, idx, m_all, "amax")
    # exp(M_i - M_seg); an empty slot (M_i = -inf) weighs 0 even when its whole segment is empty.
    wgt = torch.where(m_all == float("-inf"), torch.zeros_like(m_all), torch.exp(m_all - m_seg[seg_all]))
    s_seg = torch.zeros(nseg, d, device=dev).index_add_(0, seg_all, s_all * wgt)
    a_seg = torch.zeros(nseg, d, device=dev).index_add_(0, seg_all, a_all * wgt)

    # Finished: the first counts[b] - npend segments of each request. Pending: the last npend.
    local = torch.arange(nseg, device=dev) - torch.repeat_interleave(
        torch.tensor(seg_base, device=dev), torch.tensor(counts, device=dev))
    seg_req = torch.repeat_interleave(torch.arange(len(counts), device=dev), torch.tensor(counts, device=dev))
    done = local < (torch.tensor(counts, device=dev)[seg_req] - npend)
    entries = a_seg[done] / s_seg[done]
    entry_request = seg_req[done]
    entry_index = local[done] + torch.tensor(first, device=dev)[entry_request]

    keep = ~done                                                  # exactly npend per request, in order
    state[slots] = torch.stack([m_seg[keep], s_seg[keep], a_seg[keep]]).view(3, -1, npend, d).transpose(0, 1)
    return entries, entry_request, entry_index
