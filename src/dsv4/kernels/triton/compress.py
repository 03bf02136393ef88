"""Triton twin of `reference.compress.compress_update`: the chunked compressor state update.

A segment is one (request, entry) pair touched by this step, as in the reference; a program
takes a channel block of a few segments. It reduces each entry's slots with the online softmax,
starting from the stored pending state for the request's first segments. The slots of a window
are dealt to SPLIT groups of threads; each slot is one [LANES, BLOCK_D] slab of a group's
threads, so a group's running (M, S, A) take BLOCK_S slots at a time (their max, then one
merge) with elementwise math only, and the groups merge once at the end. Reducing [slots,
channels] tiles along the slot axis instead went through shared memory and barriers each tile.

    HCA entry w:  tokens w*m' .. w*m'+m'-1                 (all channels)
    CSA entry w:  [:D] of window w-1 tokens, then [D:] of window w tokens    (2m slots)

Finished entries go to `entries`; the entries still open at the end of the step (the last
npend segments of a request) are written back into the state in place. Only a request's first
npend segments read the state and only its last npend write it, so one "boundary" program per
request (and channel block) takes both groups: it reads every stored row before it writes
any, and no other program touches the request's state (writing from separate programs would
race). The others take runs of the segments in between. The host sends only per-request ints
(7 per request: `dsv4.kernels.compress_plan`, copied once per forward by the manager; no sync,
no device read); each program finds its request and entry from them, and the programs of
finished entries also write entry_request / entry_index. No per-entry host work, one launch.
A one-request chunk (a long prompt's) passes its ints as kernel arguments instead: its
programs' slot loads then wait on no table lookup (H200, 8K chunk: CSA main 19.5 -> 16.9 µs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.errors import InputError
from dsv4.kernels.compress_plan import CompressPlan, make_plan
from dsv4.kernels.triton.decode_common import CHUNK_MAJOR


@triton.jit
def _on_axis(v, AXIS: tl.constexpr):
    """A vector on axis AXIS (0 or 1) of a 3-D slab whose last axis is the channels."""
    if AXIS == 0:
        return v[:, None, None]
    else:
        return v[None, :, None]


@triton.jit
def _groups(x, GA: tl.constexpr):
    """A [LANES, BLOCK_D] tile broadcast along the group axis GA of the slab."""
    if GA == 0:
        return x[None, :, :]
    else:
        return x[:, None, :]


# a one-request chunk's ints vary from chunk to chunk: no specialisation on them (one compile, not dozens)
@triton.jit(do_not_specialize=["one_first", "one_end", "one_p0", "one_p1"])
def _compress_kernel(c_ptr, z_ptr, zb_ptr, state_ptr, out_ptr, ereq_ptr, eidx_ptr, tab_ptr, req_slot_ptr,
                     stride_ct, stride_zt, stride_sr, stride_sk, stride_sp, D, B, n_mid,
                     one_first, one_end, one_p0, one_p1,
                     RATIO: tl.constexpr, OVERLAP: tl.constexpr, NPEND: tl.constexpr, B_PAD: tl.constexpr,
                     LANES: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT: tl.constexpr,
                     WIDE: tl.constexpr, BIAS: tl.constexpr, SINGLE: tl.constexpr):
    """Program (channel block, q): q < B is request q's boundary program, its first NPEND and last
    NPEND segments (the only ones that read or write the state); q >= B takes LANES consecutive
    middle segments. tab rows [7, B]: mid_base (B + 1 values), first, end, fin_base, tok0, p0, p1
    (see `dsv4.kernels.compress_plan`); SINGLE: one request, its ints one_* as arguments.
    Per-segment quantities are [LANES] vectors; a slot of every group is one [SPLIT, LANES,
    BLOCK_D] tile. WIDE: element offsets into c / z need 64 bits (else 32-bit offsets:
    half the registers of the tile's addresses). c, z in any float dtype (fp32 math); BIAS: z gets
    zb[pos % m, column] added (slot j of a window is position j mod m)."""
    # one grid axis, channel blocks fastest: the programs running side by side read neighbouring
    # columns of the same token rows (whole rows from DRAM), not one column of many far-apart rows
    n_cb = tl.cdiv(D, BLOCK_D)
    cb = tl.program_id(0) % n_cb
    q = tl.program_id(0) // n_cb
    k = tl.arange(0, LANES)
    bnd = (q + 0 * k) < B                                                    # (vector: the interpreter)
    mid = (q - B) * LANES + k
    if SINGLE:      # one request: its ints are arguments, so the slot loads need no table lookup first
        b = 0 * k
        first = one_first + 0 * k
        end = one_end + 0 * k
        fin_base = 0 * k
        tok0 = 0 * k
        p0 = one_p0 + 0 * k
        p1 = one_p1 + 0 * k
        mid_base = 0 * k
    else:
        r = tl.arange(0, B_PAD)
        ends = tl.load(tab_ptr + 1 + r, mask=r < B, other=2147483647)        # mid_base[b + 1]
        b = tl.sum((ends[None, :] <= mid[:, None]).to(tl.int32), 1)          # the request of a middle segment
        b = tl.where(bnd, q, tl.minimum(b, B - 1))
        row = tab_ptr + (B + 1) + b
        first = tl.load(row)
        end = tl.load(row + B)
        fin_base = tl.load(row + 2 * B)
        tok0 = tl.load(row + 3 * B)
        p0 = tl.load(row + 4 * B)
        p1 = tl.load(row + 5 * B)
        mid_base = tl.load(tab_ptr + b)
    slot = tl.load(req_slot_ptr + b).to(tl.int64)
    nseg = end + NPEND - first
    # boundary lanes k < NPEND: segments 0.. ; k >= NPEND: the last NPEND (those not already taken)
    local_b = tl.where(k < NPEND, k, nseg - 2 * NPEND + k)
    live_b = (k < 2 * NPEND) & (local_b < nseg) & ((k < NPEND) | (local_b >= NPEND))
    local = tl.where(bnd, local_b, NPEND + mid - mid_base)
    live = tl.where(bnd, live_b, mid < n_mid)
    w = first + local
    offs = cb * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs < D

    sd = live[:, None] & dmask[None, :]
    # segments `local` < NPEND start from the stored pending entry `local` (group 0), the others empty
    stored = sd & (local < NPEND)[:, None]
    base = state_ptr + slot[:, None] * stride_sr + local[:, None] * stride_sp + offs[None, :]
    # the slab's group axis GA: 0 ([SPLIT, LANES, BLOCK_D]) on Triton 3.6, 1 ([LANES, SPLIT, BLOCK_D])
    # on 3.7+, whose coalescing orders a tie of equally contiguous axes the other way: either way the
    # threads of a warp spread over the groups after the channels (`decode_common.CHUNK_MAJOR`)
    GA: tl.constexpr = 1 if CHUNK_MAJOR else 0
    la: tl.constexpr = 1 - GA                                              # the lanes' axis
    g = _on_axis(tl.arange(0, SPLIT), GA)
    m = tl.where(g == 0, _groups(tl.load(base, mask=stored, other=float("-inf")), GA), float("-inf"))
    s = tl.where(g == 0, _groups(tl.load(base + stride_sk, mask=stored, other=0.0), GA), 0.0)
    a = tl.where(g == 0, _groups(tl.load(base + 2 * stride_sk, mask=stored, other=0.0), GA), 0.0)
    # slot j: OVERLAP -> j < m: [:D] of token (w-1)*m + j, j >= m: [D:] of token w*m + j - m
    #         else    -> token w*m + j
    NS: tl.constexpr = 2 * RATIO if OVERLAP else RATIO
    GS: tl.constexpr = NS // SPLIT
    if OVERLAP:
        pos0 = _on_axis((w - 1) * RATIO, la)
    else:
        pos0 = _on_axis(w * RATIO, la)
    live3, p0_3, p1_3, tok0_3 = _on_axis(live, la), _on_axis(p0, la), _on_axis(p1, la), _on_axis(tok0, la)
    dmask3 = dmask[None, None, :]
    for j0 in tl.static_range(0, GS, BLOCK_S):
        # BLOCK_S slots of every group, each one [SPLIT, LANES, BLOCK_D] slab (GA): the running (m, s, a)
        # of a group stay in its threads (elementwise max / exp / sums, no reduction across threads)
        zs = ()
        cs = ()
        for jj in tl.static_range(BLOCK_S):
            j = g * GS + (j0 + jj)                                              # [SPLIT, 1, 1] (GA)
            pos = pos0 + j
            msk = live3 & (pos >= p0_3) & (pos < p1_3) & dmask3
            t = tok0_3 + pos - p0_3
            if WIDE:
                t = t.to(tl.int64)
            if OVERLAP:
                col = offs[None, None, :] + D * (j >= RATIO).to(tl.int32)
            else:
                col = offs[None, None, :] + 0 * j
            z = tl.load(z_ptr + t * stride_zt + col, mask=msk, other=float("-inf")).to(tl.float32)
            if BIAS:   # loaded per lane (the same cached row): a shared [1, BLOCK_D] row is converted
                # through shared memory, measured 2-4x slower (H200, 8K chunk)
                z += tl.load(zb_ptr + (j % RATIO) * (NS // RATIO) * D + col + 0 * t, mask=msk,
                             other=0.0).to(tl.float32)
            zs = zs + (z,)
            cs = cs + (tl.load(c_ptr + t * stride_ct + col, mask=msk, other=0.0).to(tl.float32),)
        m2 = m
        for jj in tl.static_range(BLOCK_S):
            m2 = tl.maximum(m2, zs[jj])
        ms = tl.where(m2 == float("-inf"), 0.0, m2)                          # no slot yet: keep exp finite
        keep = tl.where(m == float("-inf"), 0.0, tl.exp(m - ms))
        s = s * keep
        a = a * keep
        for jj in tl.static_range(BLOCK_S):
            e = tl.exp(zs[jj] - ms)                                             # masked slots: exp(-inf) = 0
            s += e
            a += cs[jj] * e
        m = m2
    if SPLIT == 1:      # one group: the merge is the identity
        m = tl.max(m, axis=GA)
        s = tl.sum(s, axis=GA)
        a = tl.sum(a, axis=GA)
    else:
        mf = tl.max(m, axis=GA)
        wg = tl.where(m == float("-inf"), 0.0, tl.exp(m - _groups(tl.where(mf == float("-inf"), 0.0, mf), GA)))
        m = mf
        s = tl.sum(s * wg, axis=GA)
        a = tl.sum(a * wg, axis=GA)
    # finished: entry row fin_base + local, in (request, w) order
    fin = live & (w < end)
    dst = (fin_base + local).to(tl.int64)
    tl.store(out_ptr + dst[:, None] * D + offs[None, :], a / s, mask=fin[:, None] & dmask[None, :])
    once = fin & (cb + 0 * k == 0)                                        # the first channel block writes them
    tl.store(ereq_ptr + dst, b.to(tl.int64), mask=once)
    tl.store(eidx_ptr + dst, w.to(tl.int64), mask=once)
    # pending w >= end: state row w - end, in place. Only boundary programs have such lanes, and
    # they read the stored rows above: every lane's read is done before any lane writes.
    tl.debug_barrier()
    pend = live & (w >= end)
    pbase = state_ptr + slot[:, None] * stride_sr + (w - end)[:, None] * stride_sp + offs[None, :]
    pm = pend[:, None] & dmask[None, :]
    tl.store(pbase, m, mask=pm)
    tl.store(pbase + stride_sk, s, mask=pm)
    tl.store(pbase + 2 * stride_sk, a, mask=pm)


def compress_update(c: torch.Tensor, z: torch.Tensor, state: torch.Tensor, request_slots: torch.Tensor,
                    start_positions: tuple[int, ...], query_lens: tuple[int, ...], ratio: int, overlap: bool,
                    *, z_bias: torch.Tensor | None = None, plan: CompressPlan | None = None,
                    segs: int | None = None, block_d: int | None = None, block_s: int | None = None,
                    split: int | None = None, num_warps: int | None = None, single: bool = True,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `dsv4.kernels.reference.compress.compress_update`. plan: the batch's
    launch table for this compressor kind (`ForwardBatch.compress_plans`, planned and copied once
    per forward by the manager); without one the table is planned here and copied (one pinned
    asynchronous copy per call). Tuning: segs middle entries per program, a power of two; block_d
    channels per program; split groups of threads per window (a power of two dividing its slots),
    each reducing its share of the slots block_s at a time (a divisor of the share); num_warps;
    single=False: a one-request batch read from the table as any other (testing). The state is
    updated in place by the kernel: one launch, nothing after it; c and z are read as they come
    (bf16 projections in place, the bias added in the kernel)."""
    dev, d = c.device, state.shape[-1]
    npend = 2 if overlap else 1
    bsz = len(query_lens)
    cuda = dev.type == "cuda"
    if plan is None:
        plan = make_plan(start_positions, query_lens, ratio, overlap, dev)
    elif not plan.matches(start_positions, query_lens, ratio, overlap) or plan.table.device != dev:
        raise InputError(f"compress plan for ratio {plan.ratio} (overlap {plan.overlap}, {len(plan.query_lens)} "
                         f"requests, {plan.table.device}) does not describe this call (ratio {ratio}, overlap "
                         f"{overlap}, {bsz} requests, {dev}): pass the plan of this batch and compressor kind")
    tab, n_mid, e = plan.table, plan.num_middle, plan.num_finished
    entries = torch.empty(e, d, dtype=torch.float32, device=dev)
    e_out = torch.empty(2, e, dtype=torch.int64, device=dev)                 # entry_request, entry_index
    c, z = _rows_contiguous(c), _rows_contiguous(z)
    zb = z_bias.contiguous() if z_bias is not None else c       # any float dtype: no conversion kernel
    assert state.is_contiguous() and state.shape[2] == npend, "the state cache is one contiguous tensor"
    ns = 2 * ratio if overlap else ratio
    cfg = _tiles(d, ns, cuda)
    segs, block_d = segs or cfg[0], block_d or cfg[1]
    split, warps = split or cfg[3], num_warps or cfg[4]
    if not block_s and ns % split == 0:
        block_s = _largest_pow2_divisor(ns // split, cfg[2])
    if segs & (segs - 1) or split & (split - 1) or ns % split or (ns // split) % block_s:
        raise InputError(f"compressor tiles segs {segs}, split {split}, block_s {block_s} for {ns} slots: segs and "
                         "split powers of two, split dividing the slots, block_s dividing slots / split")
    lanes = max(segs, 2 * npend)                               # a boundary program takes 2 npend segments
    if bsz:
        _compress_kernel[((bsz + triton.cdiv(n_mid, lanes)) * triton.cdiv(d, block_d),)](
            c, z, zb, state, entries, e_out[0], e_out[1], tab, request_slots,
            c.stride(0), z.stride(0), state.stride(0), state.stride(1), state.stride(2), d, bsz, n_mid,
            start_positions[0] // ratio, (start_positions[0] + query_lens[0]) // ratio, start_positions[0],
            start_positions[0] + query_lens[0],
            RATIO=ratio, OVERLAP=overlap, NPEND=npend, B_PAD=triton.next_power_of_2(max(bsz, 2)),
            LANES=lanes, BLOCK_D=block_d, BLOCK_S=block_s, SPLIT=split,
            WIDE=max(c.shape[0] * c.stride(0), z.shape[0] * z.stride(0)) >= 2**31, BIAS=z_bias is not None,
            SINGLE=bsz == 1 and single, num_warps=warps)
    return entries, e_out[0], e_out[1]


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, width] as the kernel reads it: contiguous columns, any row stride (a column view of
    the layer's fused projection is read in place)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _tiles(d: int, ns: int, cuda: bool) -> tuple[int, int, int, int, int]:
    """Default (segs, block_d, most slots at a time, split, num_warps) for ns slots per window: CSA (2m = 8
    slots) one group of four segments x 128 channels x 4 warps, all 8 slots at a time; HCA (128
    slots) 8 groups of 16 slots x two entries x 32 channels x 8 warps, 8 slots at a time.

    Tuned on what the layer runs per prefill chunk (`compress_and_flush`: CSA's two compressors
    side by side, each followed by its write; H200, a 32K prompt in 8K chunks, L2 flushed before
    each chunk, `benchmarks/tune_prefill.py`, NOTES.md seventeenth round): CSA 96.1 / 95.7 -> 94.4 /
    94.8 µs with the main compressor taking 8 slots at a time instead of 4, HCA 61.4-61.6 ->
    57.2-57.4 µs with 8 groups of 8 warps, 8 slots at a time, instead of 16 groups of 4 warps, 4
    at a time; the neighbouring tiles measured slower (tuned alone on one chunk before, fourteenth
    round: CSA main 16.6 µs, indexer 9.5, HCA 14.7; a stream read of the same c and z: 11.6, 6.3,
    8.0). Persistent programs that load their next item while reducing the current one were slower
    (CSA main 21.9-28.2, HCA 20.6-29.0: register-bound). The CPU interpreter wants few, small tiles."""
    split = _largest_pow2_divisor(ns, 8 if ns >= 64 else 1)
    if not cuda:
        return 1, min(triton.next_power_of_2(d), 128), 8, split, 4
    if ns >= 64:
        return 2, 32, 8, split, 8
    return 4, 128, 8, split, 4


def _largest_pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p
