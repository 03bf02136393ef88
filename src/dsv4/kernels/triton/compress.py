"""Triton twin of `reference.compress.compress_update`: the chunked compressor state update.

A segment is one (request, entry) pair touched by this step, as in the reference; a program
takes a channel block of a few segments. It reduces each entry's slots with the online softmax,
a tile of BLOCK_S slots at a time (a tile's max, then one merge into the running (M, S, A)),
starting from the stored pending state for the request's first segments:

    HCA entry w:  tokens w*m' .. w*m'+m'-1                 (all channels)
    CSA entry w:  [:D] of window w-1 tokens, then [D:] of window w tokens    (2m slots)

Finished entries go to `entries`; the entries still open at the end of the step (the last
npend segments of a request) are written back into the state in place. Only a request's first
npend segments read the state and only its last npend write it, so one "boundary" program per
request (and channel block) takes both groups: it reads every stored row before it writes
any, and no other program touches the request's state (writing from separate programs would
race). The others take runs of the segments in between. The host sends only per-request ints
(7 per request, one pinned asynchronous copy: no sync, no device read); each program finds its
request and entry from them, and the programs of finished entries also write entry_request /
entry_index. No per-entry host work, one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _item(it, tab_ptr, req_slot_ptr, D, B, n_mid, NPEND: tl.constexpr, B_PAD: tl.constexpr,
          LANES: tl.constexpr, BLOCK_D: tl.constexpr):
    """Work item it = (q, channel block), channel blocks fastest: the programs running side by side
    read neighbouring columns of the same token rows. q < B is request q's boundary item, its
    first NPEND and last NPEND segments (the only ones that read or write the state); q >= B
    takes LANES consecutive middle segments. Returns the channel block and per-lane [LANES]
    request b, state slot, entry w, end, fin_base, tok0, p0, p1, local segment, live."""
    n_cb = tl.cdiv(D, BLOCK_D)
    cb = it % n_cb
    q = it // n_cb
    k = tl.arange(0, LANES)
    bnd = (q + 0 * k) < B                                                    # (vector: the interpreter)
    mid = (q - B) * LANES + k
    r = tl.arange(0, B_PAD)
    ends = tl.load(tab_ptr + 1 + r, mask=r < B, other=2147483647)            # mid_base[b + 1]
    b = tl.sum((ends[None, :] <= mid[:, None]).to(tl.int32), 1)              # the request of a middle segment
    b = tl.where(bnd, q, tl.minimum(b, B - 1))
    row = tab_ptr + (B + 1) + b
    first = tl.load(row)
    end = tl.load(row + B)
    nseg = end + NPEND - first
    # boundary lanes k < NPEND: segments 0.. ; k >= NPEND: the last NPEND (those not already taken)
    local_b = tl.where(k < NPEND, k, nseg - 2 * NPEND + k)
    live_b = (k < 2 * NPEND) & (local_b < nseg) & ((k < NPEND) | (local_b >= NPEND))
    local = tl.where(bnd, local_b, NPEND + mid - tl.load(tab_ptr + b))
    live = tl.where(bnd, live_b, mid < n_mid)
    slot = tl.load(req_slot_ptr + b).to(tl.int64)
    return (cb, b, slot, first + local, end, tl.load(row + 2 * B), tl.load(row + 3 * B), tl.load(row + 4 * B),
            tl.load(row + 5 * B), local, live)


@triton.jit
def _slot_tile(c_ptr, z_ptr, w, live, tok0, p0, p1, cb, stride_ct, D, RATIO: tl.constexpr, OVERLAP: tl.constexpr,
               S0: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr):
    """z, c [LANES, BLOCK_S, BLOCK_D] of slots S0.. (masked: z -inf, c 0) and the mask. Slot j:
    OVERLAP -> j < m: [:D] of token (w-1)*m + j, j >= m: [D:] of token w*m + j - m; else token w*m + j."""
    NS: tl.constexpr = 2 * RATIO if OVERLAP else RATIO
    if OVERLAP:
        pos0 = (w - 1) * RATIO
    else:
        pos0 = w * RATIO
    offs = cb * BLOCK_D + tl.arange(0, BLOCK_D)
    j = S0 + tl.arange(0, BLOCK_S)
    pos = pos0[:, None] + j[None, :]                                         # [LANES, BLOCK_S]
    ok = live[:, None] & (j < NS)[None, :] & (pos >= p0[:, None]) & (pos < p1[:, None])
    t = tok0[:, None] + pos - p0[:, None]
    if WIDE:
        t = t.to(tl.int64)
    if OVERLAP:
        col = offs[None, None, :] + D * (j[None, :, None] >= RATIO).to(tl.int32)
    else:
        col = offs[None, None, :] + 0 * j[None, :, None]
    msk = ok[:, :, None] & (offs < D)[None, None, :]
    ptr = t[:, :, None] * stride_ct + col
    return tl.load(z_ptr + ptr, mask=msk, other=float("-inf")), tl.load(c_ptr + ptr, mask=msk, other=0.0), msk


@triton.jit
def _merge_tile(m, s, a, z, c, msk):
    """Fold a slot tile into the running (M, S, A): the tile's max, then one rescale."""
    m2 = tl.maximum(m, tl.max(z, axis=1))
    ms = tl.where(m2 == float("-inf"), 0.0, m2)            # no slot yet: keep exp finite
    keep = tl.where(m == float("-inf"), 0.0, tl.exp(m - ms))
    e = tl.where(msk, tl.exp(z - ms[:, None, :]), 0.0)
    return m2, s * keep + tl.sum(e, axis=1), a * keep + tl.sum(c * e, axis=1)


@triton.jit
def _compress_kernel(c_ptr, z_ptr, state_ptr, out_ptr, ereq_ptr, eidx_ptr, tab_ptr, req_slot_ptr,
                     stride_ct, stride_sr, stride_sk, stride_sp, D, B, n_mid, n_items,
                     RATIO: tl.constexpr, OVERLAP: tl.constexpr, NPEND: tl.constexpr, B_PAD: tl.constexpr,
                     LANES: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, WIDE: tl.constexpr):
    """Persistent: program p takes items p, p + P, ... (`_item`); tab rows [7, B]: mid_base (B + 1
    values), first, end, fin_base, tok0, p0, p1 (`_request_table`). The next item's first slot tile
    is loaded before the current one is reduced, so a program always has a tile in flight.
    WIDE: element offsets into c / z need 64 bits (else 32-bit: half the address registers)."""
    NS: tl.constexpr = 2 * RATIO if OVERLAP else RATIO
    nprog = tl.num_programs(0)
    k = tl.arange(0, LANES)
    cb, b, slot, w, end, fin_base, tok0, p0, p1, local, live = _item(
        tl.program_id(0), tab_ptr, req_slot_ptr, D, B, n_mid, NPEND, B_PAD, LANES, BLOCK_D)
    z_nx, c_nx, m_nx = _slot_tile(c_ptr, z_ptr, w, live, tok0, p0, p1, cb, stride_ct, D, RATIO, OVERLAP, 0,
                                  BLOCK_S, BLOCK_D, WIDE)
    for it in range(tl.program_id(0), n_items, nprog):
        z0, c0, msk0 = z_nx, c_nx, m_nx
        cb_n, b_n, slot_n, w_n, end_n, fin_n, tok0_n, p0_n, p1_n, local_n, live_n = _item(
            it + nprog, tab_ptr, req_slot_ptr, D, B, n_mid, NPEND, B_PAD, LANES, BLOCK_D)
        z_nx, c_nx, m_nx = _slot_tile(c_ptr, z_ptr, w_n, live_n, tok0_n, p0_n, p1_n, cb_n, stride_ct, D, RATIO,
                                      OVERLAP, 0, BLOCK_S, BLOCK_D, WIDE)

        offs = cb * BLOCK_D + tl.arange(0, BLOCK_D)
        sd = live[:, None] & (offs < D)[None, :]
        # segments `local` < NPEND start from the stored pending entry `local`, the others empty
        stored = sd & (local < NPEND)[:, None]
        base = state_ptr + slot[:, None] * stride_sr + local[:, None] * stride_sp + offs[None, :]
        m = tl.load(base, mask=stored, other=float("-inf"))
        s = tl.load(base + stride_sk, mask=stored, other=0.0)
        a = tl.load(base + 2 * stride_sk, mask=stored, other=0.0)
        m, s, a = _merge_tile(m, s, a, z0, c0, msk0)
        for s0 in tl.static_range(BLOCK_S, NS, BLOCK_S):
            z, c, msk = _slot_tile(c_ptr, z_ptr, w, live, tok0, p0, p1, cb, stride_ct, D, RATIO, OVERLAP, s0,
                                   BLOCK_S, BLOCK_D, WIDE)
            m, s, a = _merge_tile(m, s, a, z, c, msk)
        # finished: entry row fin_base + local, in (request, w) order
        fin = live & (w < end)
        dst = (fin_base + local).to(tl.int64)
        tl.store(out_ptr + dst[:, None] * D + offs[None, :], a / s, mask=sd & fin[:, None])
        once = fin & (cb + 0 * k == 0)                                    # the first channel block writes them
        tl.store(ereq_ptr + dst, b.to(tl.int64), mask=once)
        tl.store(eidx_ptr + dst, w.to(tl.int64), mask=once)
        # pending w >= end: state row w - end, in place. Only boundary items have such lanes, and
        # they read the stored rows above: every lane's read is done before any lane writes.
        tl.debug_barrier()
        pm = sd & (w >= end)[:, None]
        pbase = state_ptr + slot[:, None] * stride_sr + (w - end)[:, None] * stride_sp + offs[None, :]
        tl.store(pbase, m, mask=pm)
        tl.store(pbase + stride_sk, s, mask=pm)
        tl.store(pbase + 2 * stride_sk, a, mask=pm)
        cb, b, slot, w, end, fin_base, tok0, p0, p1, local, live = (
            cb_n, b_n, slot_n, w_n, end_n, fin_n, tok0_n, p0_n, p1_n, local_n, live_n)


def _request_table(start_positions: tuple[int, ...], query_lens: tuple[int, ...], ratio: int, npend: int
                   ) -> tuple[list[int], int, int]:
    """Per-request ints of one step, as the kernel reads them, and (middle segments, finished entries).

    Request b (new tokens at positions [p0, p0 + n)) touches entries first = p0//m .. end + npend - 1
    (end = (p0+n)//m), one segment each; those below `end` finish and are rows fin_base[b] +
    (w - first) of `entries`; its tokens start at row tok0[b] of c and z. Its first and last
    npend segments go to its boundary program; the ones between (middle segments) are numbered
    from mid_base[b]. Rows: mid_base (B + 1 values), first, end, fin_base, tok0, p0, p1.
    """
    mid_base, first, end, fin_base, tok0, p1 = [0], [], [], [], [], []
    nfin = ntok = 0
    for p0, n in zip(start_positions, query_lens):
        f, e = p0 // ratio, (p0 + n) // ratio
        first.append(f)
        end.append(e)
        fin_base.append(nfin)
        tok0.append(ntok)
        p1.append(p0 + n)
        mid_base.append(mid_base[-1] + max(e - f - npend, 0))          # nseg = e + npend - f, minus 2 npend
        nfin += e - f
        ntok += n
    return mid_base + first + end + fin_base + tok0 + list(start_positions) + p1, mid_base[-1], nfin


def compress_update(c: torch.Tensor, z: torch.Tensor, state: torch.Tensor, request_slots: torch.Tensor,
                    start_positions: tuple[int, ...], query_lens: tuple[int, ...], ratio: int, overlap: bool,
                    *, segs: int | None = None, block_d: int | None = None, block_s: int | None = None,
                    num_warps: int | None = None, programs_per_sm: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `dsv4.kernels.reference.compress.compress_update` (tuning: segs middle
    entries per item, a power of two; block_d channels per item, block_s slots per load,
    num_warps, programs_per_sm). The state is updated in place by the kernel: one launch,
    nothing after it."""
    dev, d = c.device, state.shape[-1]
    npend = 2 if overlap else 1
    bsz = len(query_lens)
    host, n_mid, e = _request_table(start_positions, query_lens, ratio, npend)
    cuda = dev.type == "cuda"
    tab = torch.tensor(host, dtype=torch.int32, pin_memory=cuda).to(dev, non_blocking=True)
    entries = torch.empty(e, d, dtype=torch.float32, device=dev)
    e_out = torch.empty(2, e, dtype=torch.int64, device=dev)                 # entry_request, entry_index
    c, z = c.float().contiguous(), z.float().contiguous()
    assert state.is_contiguous() and state.shape[2] == npend, "the state cache is one contiguous tensor"
    ns = 2 * ratio if overlap else ratio
    cfg = _tiles(d, ns, cuda)
    segs, block_d = segs or cfg[0], block_d or cfg[1]
    block_s, warps = block_s or cfg[2], num_warps or cfg[3]
    assert segs & (segs - 1) == 0, "segs is a power of two"
    lanes = max(segs, 2 * npend)                               # a boundary item takes 2 npend segments
    n_items = (bsz + triton.cdiv(n_mid, lanes)) * triton.cdiv(d, block_d)
    if bsz:
        _compress_kernel[(min(n_items, _programs(dev, programs_per_sm or cfg[4])),)](
            c, z, state, entries, e_out[0], e_out[1], tab, request_slots,
            c.stride(0), state.stride(0), state.stride(1), state.stride(2), d, bsz, n_mid, n_items,
            RATIO=ratio, OVERLAP=overlap, NPEND=npend, B_PAD=triton.next_power_of_2(max(bsz, 2)),
            LANES=lanes, BLOCK_D=block_d, BLOCK_S=block_s, WIDE=c.numel() >= 2**31, num_warps=warps)
    return entries, e_out[0], e_out[1]


def _programs(dev: torch.device, per_sm: int) -> int:
    """Persistent grid size: per_sm programs on each SM (the interpreter: per_sm programs, so its
    loops take several items)."""
    if dev.type != "cuda":
        return per_sm
    return per_sm * torch.cuda.get_device_properties(dev).multi_processor_count


def _tiles(d: int, ns: int, cuda: bool) -> tuple[int, int, int, int, int]:
    """Default (segs, block_d, block_s, num_warps, programs_per_sm), tiles of 4K elements: CSA
    (2m = 8 slots) four entries x 128 channels, HCA (128 slots) two entries x 16 channels x all
    128 slots. The CPU interpreter wants few, small tiles (and 3 programs: several items each)."""
    if not cuda:
        return 1, min(triton.next_power_of_2(d), 128), min(triton.next_power_of_2(ns), 32), 4, 3
    if ns >= 64:
        return 2, 16, triton.next_power_of_2(ns), 4, 4
    return 4, 128, triton.next_power_of_2(ns), 8, 4
