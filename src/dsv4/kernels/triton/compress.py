"""Triton twin of `reference.compress.compress_update`: the chunked compressor state update.

One program per (segment, channel block); a segment is one (request, entry) pair touched by
this step, as in the reference. It reduces the entry's slots with the online softmax, a tile of
BLOCK_S slots at a time (a tile's max, then one merge into the running (M, S, A)), starting
from the stored pending state for the request's first segments:

    HCA entry w:  tokens w*m' .. w*m'+m'-1                 (all channels)
    CSA entry w:  [:D] of window w-1 tokens, then [D:] of window w tokens    (2m slots)

Finished entries go to `entries`; pending ones to a fresh buffer that replaces the state rows
afterwards (segments of one request read and write overlapping state rows, so writing in place
would race). The host sends only per-request ints (7 per request, one pinned asynchronous copy:
no sync, no device read); each program finds its request and entry from them, and the programs
of finished entries also write entry_request / entry_index. No per-entry host work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _compress_kernel(c_ptr, z_ptr, state_ptr, out_ptr, pend_ptr, ereq_ptr, eidx_ptr, tab_ptr, req_slot_ptr,
                     stride_ct, stride_sr, stride_sk, stride_sp, D, B, nseg,
                     RATIO: tl.constexpr, OVERLAP: tl.constexpr, NPEND: tl.constexpr, B_PAD: tl.constexpr,
                     SEGS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program (channel block, SEGS consecutive segments). tab rows [8, B]: seg_base (B + 1 values),
    first, end, fin_base, tok0, p0, p1 (see `_request_table`). Every per-segment quantity is a
    [SEGS] vector; slot tiles are [SEGS, BLOCK_S, BLOCK_D]."""
    # one grid axis, channel blocks fastest: the programs running side by side read neighbouring
    # columns of the same token rows (whole rows from DRAM), not one column of many far-apart rows
    n_cb = tl.cdiv(D, BLOCK_D)
    cb = tl.program_id(0) % n_cb
    seg = (tl.program_id(0) // n_cb) * SEGS + tl.arange(0, SEGS)
    live = seg < nseg
    offs = cb * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs < D
    r = tl.arange(0, B_PAD)
    ends = tl.load(tab_ptr + 1 + r, mask=r < B, other=2147483647)          # seg_base[b + 1]
    b = tl.sum((ends[None, :] <= seg[:, None]).to(tl.int32), 1)              # the request of each segment
    b = tl.minimum(b, B - 1)                                                 # (segments past the end: masked)
    local = seg - tl.load(tab_ptr + b)
    row = tab_ptr + (B + 1) + b
    first = tl.load(row)
    end = tl.load(row + B)
    fin_base = tl.load(row + 2 * B)
    tok0 = tl.load(row + 3 * B)
    p0 = tl.load(row + 4 * B)
    p1 = tl.load(row + 5 * B)
    slot = tl.load(req_slot_ptr + b).to(tl.int64)
    w = first + local

    sd = live[:, None] & dmask[None, :]
    # segments `local` < NPEND start from the stored pending entry `local`, the others empty
    stored = sd & (local < NPEND)[:, None]
    base = state_ptr + slot[:, None] * stride_sr + local[:, None] * stride_sp + offs[None, :]
    m = tl.load(base, mask=stored, other=float("-inf"))
    s = tl.load(base + stride_sk, mask=stored, other=0.0)
    a = tl.load(base + 2 * stride_sk, mask=stored, other=0.0)
    # slot j: OVERLAP -> j < m: [:D] of token (w-1)*m + j, j >= m: [D:] of token w*m + j - m
    #         else    -> token w*m + j
    NS: tl.constexpr = 2 * RATIO if OVERLAP else RATIO
    if OVERLAP:
        pos0 = (w - 1) * RATIO
    else:
        pos0 = w * RATIO
    for s0 in tl.static_range(0, NS, BLOCK_S):
        j = s0 + tl.arange(0, BLOCK_S)
        pos = pos0[:, None] + j[None, :]                                     # [SEGS, BLOCK_S]
        ok = live[:, None] & (j < NS)[None, :] & (pos >= p0[:, None]) & (pos < p1[:, None])
        t = (tok0[:, None] + pos - p0[:, None]).to(tl.int64)
        if OVERLAP:
            col = offs[None, None, :] + D * (j[None, :, None] >= RATIO).to(tl.int32)
        else:
            col = offs[None, None, :] + 0 * j[None, :, None]
        msk = ok[:, :, None] & dmask[None, None, :]
        ptr = t[:, :, None] * stride_ct + col
        z = tl.load(z_ptr + ptr, mask=msk, other=float("-inf"))
        c = tl.load(c_ptr + ptr, mask=msk, other=0.0)
        m2 = tl.maximum(m, tl.max(z, axis=1))
        ms = tl.where(m2 == float("-inf"), 0.0, m2)            # no slot yet: keep exp finite
        keep = tl.where(m == float("-inf"), 0.0, tl.exp(m - ms))
        e = tl.where(msk, tl.exp(z - ms[:, None, :]), 0.0)
        s = s * keep + tl.sum(e, axis=1)
        a = a * keep + tl.sum(c * e, axis=1)
        m = m2
    # finished: entry row fin_base + local, in (request, w) order
    fin = live & (w < end)
    dst = (fin_base + local).to(tl.int64)
    tl.store(out_ptr + dst[:, None] * D + offs[None, :], a / s, mask=fin[:, None] & dmask[None, :])
    once = fin & (cb + 0 * seg == 0)                                      # the first channel block writes them
    tl.store(ereq_ptr + dst, b.to(tl.int64), mask=once)
    tl.store(eidx_ptr + dst, w.to(tl.int64), mask=once)
    # pending k = w - end: pending[b, :, k] of the [B, 3, NPEND, D] buffer (the state's layout)
    pend = live & (w >= end)
    pbase = pend_ptr + ((b * 3 * NPEND + w - end).to(tl.int64) * D)[:, None] + offs[None, :]
    pm = pend[:, None] & dmask[None, :]
    tl.store(pbase, m, mask=pm)
    tl.store(pbase + NPEND * D, s, mask=pm)
    tl.store(pbase + 2 * NPEND * D, a, mask=pm)


def _request_table(start_positions: tuple[int, ...], query_lens: tuple[int, ...], ratio: int, npend: int
                   ) -> tuple[list[int], int, int]:
    """Per-request ints of one step, as the kernel reads them, and (segments, finished entries).

    Request b (new tokens at positions [p0, p0 + n)) touches entries first = p0//m .. end + npend - 1
    (end = (p0+n)//m), one segment each, numbered from seg_base[b]; those below `end` finish and
    are rows fin_base[b] + (w - first) of `entries`; its tokens start at row tok0[b] of c and z.
    Rows: seg_base (B + 1 values), first, end, fin_base, tok0, p0, p1.
    """
    seg_base, first, end, fin_base, tok0, p1 = [0], [], [], [], [], []
    nfin = ntok = 0
    for p0, n in zip(start_positions, query_lens):
        f, e = p0 // ratio, (p0 + n) // ratio
        first.append(f)
        end.append(e)
        fin_base.append(nfin)
        tok0.append(ntok)
        p1.append(p0 + n)
        seg_base.append(seg_base[-1] + e + npend - f)
        nfin += e - f
        ntok += n
    return seg_base + first + end + fin_base + tok0 + list(start_positions) + p1, seg_base[-1], nfin


def compress_update(c: torch.Tensor, z: torch.Tensor, state: torch.Tensor, request_slots: torch.Tensor,
                    start_positions: tuple[int, ...], query_lens: tuple[int, ...], ratio: int, overlap: bool,
                    *, segs: int | None = None, block_d: int | None = None, block_s: int | None = None,
                    num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `dsv4.kernels.reference.compress.compress_update` (segs: entries per program,
    block_d: channels per program, block_s: slots per load, num_warps; tuning)."""
    dev, d = c.device, state.shape[-1]
    npend = 2 if overlap else 1
    bsz = len(query_lens)
    host, nseg, e = _request_table(start_positions, query_lens, ratio, npend)
    cuda = dev.type == "cuda"
    tab = torch.tensor(host, dtype=torch.int32, pin_memory=cuda).to(dev, non_blocking=True)
    entries = torch.empty(e, d, dtype=torch.float32, device=dev)
    e_out = torch.empty(2, e, dtype=torch.int64, device=dev)                 # entry_request, entry_index
    pending = torch.empty(bsz, 3, npend, d, dtype=torch.float32, device=dev)
    c, z = c.float().contiguous(), z.float().contiguous()
    assert state.is_contiguous() and state.shape[2] == npend, "the state cache is one contiguous tensor"
    ns = 2 * ratio if overlap else ratio
    cfg = _tiles(d, ns, cuda)
    segs, block_d = segs or cfg[0], block_d or cfg[1]
    block_s, warps = block_s or cfg[2], num_warps or cfg[3]
    if nseg:
        _compress_kernel[(triton.cdiv(nseg, segs) * triton.cdiv(d, block_d),)](
            c, z, state, entries, pending, e_out[0], e_out[1], tab, request_slots,
            c.stride(0), state.stride(0), state.stride(1), state.stride(2), d, bsz, nseg,
            RATIO=ratio, OVERLAP=overlap, NPEND=npend, B_PAD=triton.next_power_of_2(max(bsz, 2)),
            SEGS=segs, BLOCK_D=block_d, BLOCK_S=block_s, num_warps=warps)
    state[request_slots] = pending
    return entries, e_out[0], e_out[1]


def _tiles(d: int, ns: int, cuda: bool) -> tuple[int, int, int, int]:
    """Default (SEGS, BLOCK_D, BLOCK_S, num_warps): CSA (2m = 8 slots) whole rows per program, HCA
    (128 slots) 32 channels with all 128 slots in one load. H200, one 8K chunk, graph replay with
    the L2 flushed (benchmarks/tune_decode.py): CSA main 36 µs at 4 warps (2-4 segments per
    program, 128-512 channels, 1-8 warps: 36-38 µs), indexer 20 µs at 1 warp (31 at 4); HCA 28 µs
    (35 with 64 channels x 32 slots per step). The CPU interpreter wants few, small tiles."""
    if not cuda:
        return 1, min(triton.next_power_of_2(d), 128), min(triton.next_power_of_2(ns), 32), 4
    if ns >= 64:
        return 1, 32, triton.next_power_of_2(ns), 4
    return 1, triton.next_power_of_2(d), triton.next_power_of_2(ns), 1 if d <= 128 else 4
