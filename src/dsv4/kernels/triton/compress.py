"""Triton twin of `reference.compress.compress_update`: the chunked compressor state update.

One program per (segment, channel block); a segment is one (request, entry) pair touched by
this step, as in the reference. It walks the entry's slots in position order with the online
softmax merge, starting from the stored pending state for the request's first segments:

    HCA entry w:  tokens w*m' .. w*m'+m'-1                 (all channels)
    CSA entry w:  [:D] of window w-1 tokens, then [D:] of window w tokens

Finished entries go to `entries`; pending ones to a fresh buffer that replaces the state rows
afterwards (segments of one request read and write overlapping state rows, so writing in place
would race). The segment table is built on the host from the batch's host ints: no sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge(m, s, a, z, c):
    m2 = tl.maximum(m, z)
    keep = tl.where(m == float("-inf"), 0.0, tl.exp(m - m2))
    add = tl.where(z == float("-inf"), 0.0, tl.exp(z - m2))
    return m2, s * keep + add, a * keep + c * add


@triton.jit
def _compress_kernel(c_ptr, z_ptr, state_ptr, out_ptr, pend_ptr,
                     seg_req_ptr, seg_entry_ptr, seg_dst_ptr, seg_src_ptr,
                     req_tok0_ptr, req_p0_ptr, req_p1_ptr, req_slot_ptr,
                     stride_ct, stride_sr, stride_sk, stride_sp, D,
                     RATIO: tl.constexpr, OVERLAP: tl.constexpr, NPEND: tl.constexpr, BLOCK_D: tl.constexpr):
    seg = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs < D
    b = tl.load(seg_req_ptr + seg)
    w = tl.load(seg_entry_ptr + seg)
    dst = tl.load(seg_dst_ptr + seg)      # >= 0: finished entry row; < 0: pending -(1 + index)
    src = tl.load(seg_src_ptr + seg)      # stored pending index this segment starts from, or -1
    tok0 = tl.load(req_tok0_ptr + b)
    p0 = tl.load(req_p0_ptr + b)
    p1 = tl.load(req_p1_ptr + b)
    slot = tl.load(req_slot_ptr + b).to(tl.int64)

    m = tl.full((BLOCK_D,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_D,), tl.float32)
    a = tl.zeros((BLOCK_D,), tl.float32)
    if src >= 0:
        base = state_ptr + slot * stride_sr + src * stride_sp + offs
        m = tl.load(base, mask=dmask, other=float("-inf"))
        s = tl.load(base + stride_sk, mask=dmask, other=0.0)
        a = tl.load(base + 2 * stride_sk, mask=dmask, other=0.0)
    if OVERLAP:
        # [:D] halves of the previous window's tokens
        for j in range(RATIO):
            pos = (w - 1) * RATIO + j
            if (pos >= p0) & (pos < p1):
                t = (tok0 + pos - p0).to(tl.int64)
                z = tl.load(z_ptr + t * stride_ct + offs, mask=dmask, other=float("-inf"))
                c = tl.load(c_ptr + t * stride_ct + offs, mask=dmask, other=0.0)
                m, s, a = _merge(m, s, a, z, c)
    for j in range(RATIO):
        pos = w * RATIO + j
        if (pos >= p0) & (pos < p1):
            t = (tok0 + pos - p0).to(tl.int64)
            col = offs + D if OVERLAP else offs
            z = tl.load(z_ptr + t * stride_ct + col, mask=dmask, other=float("-inf"))
            c = tl.load(c_ptr + t * stride_ct + col, mask=dmask, other=0.0)
            m, s, a = _merge(m, s, a, z, c)
    if dst >= 0:
        tl.store(out_ptr + dst.to(tl.int64) * D + offs, a / s, mask=dmask)
    else:
        p = (-1 - dst).to(tl.int64)         # row b * NPEND + k of the pending buffer
        base = pend_ptr + p * 3 * D + offs
        tl.store(base, m, mask=dmask)
        tl.store(base + D, s, mask=dmask)
        tl.store(base + 2 * D, a, mask=dmask)


def compress_update(c: torch.Tensor, z: torch.Tensor, state: torch.Tensor, request_slots: torch.Tensor,
                    start_positions: tuple[int, ...], query_lens: tuple[int, ...], ratio: int, overlap: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `dsv4.kernels.reference.compress.compress_update`."""
    dev, d = c.device, state.shape[-1]
    npend = 2 if overlap else 1
    seg_req, seg_entry, seg_dst, seg_src, e_req, e_idx = [], [], [], [], [], []
    tok0, t, e = [], 0, 0
    for b, (p0, n) in enumerate(zip(start_positions, query_lens)):
        first, last = p0 // ratio, (p0 + n) // ratio + npend - 1      # entries touched: first..last
        tok0.append(t)
        t += n
        for w in range(first, last + 1):
            seg_req.append(b)
            seg_entry.append(w)
            seg_src.append(w - first if w - first < npend else -1)
            if w < (p0 + n) // ratio:                                  # finished this step
                seg_dst.append(e)
                e_req.append(b)
                e_idx.append(w)
                e += 1
            else:
                seg_dst.append(-1 - (b * npend + w - (p0 + n) // ratio))
    bsz = len(query_lens)
    i32 = dict(dtype=torch.int32, device=dev)
    entries = torch.empty(e, d, dtype=torch.float32, device=dev)
    pending = torch.empty(bsz * npend, 3, d, dtype=torch.float32, device=dev)
    c, z = c.float().contiguous(), z.float().contiguous()
    assert state.is_contiguous(), "the state cache is one contiguous tensor"
    block_d = 128
    grid = (len(seg_req), triton.cdiv(d, block_d))
    _compress_kernel[grid](
        c, z, state, entries, pending,
        torch.tensor(seg_req, **i32), torch.tensor(seg_entry, **i32), torch.tensor(seg_dst, **i32),
        torch.tensor(seg_src, **i32), torch.tensor(tok0, **i32),
        torch.tensor(start_positions, **i32), torch.tensor([p + n for p, n in zip(start_positions, query_lens)], **i32),
        request_slots.to(torch.int32).contiguous(),
        c.stride(0), state.stride(0), state.stride(1), state.stride(2), d,
        RATIO=ratio, OVERLAP=overlap, NPEND=npend, BLOCK_D=block_d)
    state[request_slots.long()] = pending.view(bsz, npend, 3, d).transpose(1, 2)
    as_long = dict(dtype=torch.long, device=dev)
    return entries, torch.tensor(e_req, **as_long), torch.tensor(e_idx, **as_long)
