"""The prefill compressor of a one-window kind (HCA) and the cache write of the entries it
finishes, as one kernel: `compress_update` followed by `write_entries(finish=)`, same results.

Why one kernel: at an 8K prefill chunk HCA finishes 64 entries from 16.8 MB of c and z. The two
kernels ran as a chain (the compressor, then a write that waits for all of it: H100, L2 cold,
12.3 + 2.9 µs per chunk), so the write's launch and its one-row-per-program chain sat after the
compressor's last byte. Here the program that completes an entry writes it.

Work split: a segment is one (request, entry) pair the chunk touches (`compress_plan`); its m
slots (token positions w*m .. w*m + m - 1) are cut into SPLITS runs of TOK slots, and the D
channels into blocks of BLOCK_D. A program reduces one [TOK, BLOCK_D] tile of c and z (bias
added to z) to a partial online-softmax state (M, S, A) per channel and stores it; the tile's
rows are whole runs of consecutive tokens, so its loads are wide and contiguous (the two-kernel
compressor walked one entry's slots in narrow column blocks). Then it counts itself in on its
segment (an acq_rel atomic on a per-segment counter, after a barrier: the CUB last-block
pattern); the last of the segment's SPLITS x channel-block programs merges the partials and

    entry finished (w < end)  -> A / S, then RMSNorm, RoPE at w*m, quantise, scatter
                                 (`cache_ops._store_entry`, the write_entries kernel's row code)
    entry pending  (w >= end) -> (M, S, A) into the request's state row

and sets the counter back to 0, so the counters are zero between launches (one buffer per
device and stream, `_counters`; no memset launch). The first segment of a request also merges
the stored state. When a request's first and pending segments are different segments, their
finishers meet on a per-request counter: the state is overwritten by the second to arrive
(after the first segment has read it), so no program waits for another.

Only one-window compressors (no overlap: one pending entry, NPEND = 1) take this path; CSA's
two-window compressors keep the two kernels (`compress_flush` runs them), which already meet
the prefill bandwidth target.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.cache.formats import EntryFormat
from dsv4.errors import InputError
from dsv4.kernels.compress_plan import CompressPlan, make_plan
from dsv4.kernels.reference.norm_rope import EntryFinish
from dsv4.kernels.triton import cache_ops
from dsv4.kernels.triton.compress import _rows_contiguous, compress_update


@triton.jit(do_not_specialize=["one_first", "one_end", "one_p0", "one_p1"])
def _compress_flush_kernel(
        c_ptr, z_ptr, zb_ptr, state_ptr, part_ptr, pend_ptr, row_ptr, cnt_ptr, tab_ptr, req_slot_ptr,
        stride_ct, stride_zt, stride_bt, stride_sr, stride_sk, B, n_seg, one_first, one_end, one_p0, one_p1,
        bt_ptr, bt_s0, bt_s1, bt_cols, epb, r0, r0_s0, r0_s1, r1, r1_s0, r1_s1, r2, r2_s0, r2_s1,
        w_ptr, inv_ptr, eps,
        RATIO: tl.constexpr, TOK: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
        B_PAD: tl.constexpr,
        SINGLE: tl.constexpr, WIDE: tl.constexpr, BIAS: tl.constexpr,
        FMT: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, ROPE: tl.constexpr, ROPE_P2: tl.constexpr,
        SB: tl.constexpr, SB_P2: tl.constexpr, HAD: tl.constexpr, LOG_D: tl.constexpr, HSCALE: tl.constexpr,
        FINISH: tl.constexpr, HALF_R: tl.constexpr):
    """Program (segment g, run s, channel block cb), cb fastest. tab: the plan's table (rows
    first, end, tok0, p0, p1 at B + 1 + {0, 1, 3, 4, 5} B, seg_base at 7 B + 1); SINGLE: one
    request, its ints one_* as arguments. Scratch: part [n_seg, SPLITS, 3, D] partials, pend
    [B, 3, D] a pending entry waiting for its request's first segment, row [n_seg, 2, D] the
    finished entry (A / S) and its finished form. cnt [n_seg + B] int32, zero on entry and exit."""
    NCB: tl.constexpr = D_P2 // BLOCK_D
    pid = tl.program_id(0)
    cb = pid % NCB
    s = (pid // NCB) % SPLITS
    g = pid // (NCB * SPLITS)
    if SINGLE:
        b = pid * 0
        first, end, tok0, p0, p1, g0 = one_first, one_end, 0, one_p0, one_p1, 0
    else:
        r = tl.arange(0, B_PAD)
        bases = tl.load(tab_ptr + 7 * B + 2 + r, mask=r < B, other=2147483647)      # seg_base[1:]
        b = tl.sum((bases <= g).to(tl.int32), 0)
        row = tab_ptr + (B + 1) + b
        first = tl.load(row)
        end = tl.load(row + B)
        tok0 = tl.load(row + 3 * B)
        p0 = tl.load(row + 4 * B)
        p1 = tl.load(row + 5 * B)
        g0 = tl.load(tab_ptr + 7 * B + 1 + b)
    local = g - g0
    w = first + local

    # this program's slots s*TOK .. s*TOK + TOK - 1 of entry w, channels cb*BLOCK_D .., ROWS slots at
    # a time: each thread holds every row of its channels, so the running (M, S, A) stay in its
    # registers (elementwise max / exp / sums; a reduction across threads went through shared
    # memory and barriers: H100, 8K chunk, 44 µs against 12 for the two-kernel compressor)
    cols = cb * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = cols < D
    m = tl.full([BLOCK_D], float("-inf"), tl.float32)
    ssum = tl.zeros([BLOCK_D], tl.float32)
    a = tl.zeros([BLOCK_D], tl.float32)
    for k0 in tl.static_range(0, TOK, ROWS):
        j = s * TOK + k0 + tl.arange(0, ROWS)
        pos = w * RATIO + j
        live = (pos >= p0) & (pos < p1)
        t = tok0 + pos - p0
        if WIDE:
            t = t.to(tl.int64)
        msk = live[:, None] & cm[None, :]
        z = tl.load(z_ptr + t[:, None] * stride_zt + cols[None, :], mask=msk, other=float("-inf")).to(tl.float32)
        if BIAS:
            # a runtime row stride, as c's and z's: with the constant D the compiler saw the rows as one
            # run and gave this load its own layout, converted through shared memory for the add
            z += tl.load(zb_ptr + j[:, None] * stride_bt + cols[None, :], mask=msk, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + t[:, None] * stride_ct + cols[None, :], mask=msk, other=0.0).to(tl.float32)
        m2 = tl.maximum(m, tl.max(z, 0))
        ms = tl.where(m2 == float("-inf"), 0.0, m2)          # no live slot yet: keep exp finite
        keep = tl.where(m == float("-inf"), 0.0, tl.exp(m - ms))
        e = tl.exp(z - ms[None, :])                          # masked slots: exp(-inf) = 0
        ssum = ssum * keep + tl.sum(e, 0)
        a = a * keep + tl.sum(c * e, 0)
        m = m2
    pp = part_ptr + (g * SPLITS + s).to(tl.int64) * (3 * D) + cols
    tl.store(pp, m, mask=cm)
    tl.store(pp + D, ssum, mask=cm)
    tl.store(pp + 2 * D, a, mask=cm)

    # count in; the last program of the segment finishes it
    tl.debug_barrier()                                       # every thread's partial before the release
    arrived = tl.atomic_add(cnt_ptr + g, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS * NCB - 1:
        tl.store(cnt_ptr + g, 0)
        d = tl.arange(0, D_P2)
        dm = d < D
        # the partials, merged run by run ([D] vectors: a [SPLITS, D] tile held all of them at once);
        # volatile loads: issued after the atomic, never from a stale L1 line
        pr = part_ptr + (g * SPLITS).to(tl.int64) * (3 * D) + d
        mm = tl.load(pr, mask=dm, other=float("-inf"), volatile=True)
        ss = tl.load(pr + D, mask=dm, other=0.0, volatile=True)
        aa = tl.load(pr + 2 * D, mask=dm, other=0.0, volatile=True)
        for q in tl.static_range(1, SPLITS):
            pq = pr + q * (3 * D)
            mm, ss, aa = _merge(mm, ss, aa, tl.load(pq, mask=dm, other=float("-inf"), volatile=True),
                                tl.load(pq + D, mask=dm, other=0.0, volatile=True),
                                tl.load(pq + 2 * D, mask=dm, other=0.0, volatile=True))
        slot = tl.load(req_slot_ptr + b).to(tl.int64)
        st = state_ptr + slot * stride_sr + d
        nseg = end + 1 - first
        if local == 0:                                       # the stored pending entry comes first
            mm, ss, aa = _merge(tl.load(st, mask=dm, other=float("-inf")), tl.load(st + stride_sk, mask=dm, other=0.0),
                                tl.load(st + 2 * stride_sk, mask=dm, other=0.0), mm, ss, aa)
            if nseg > 1:       # the request's pending segment may be waiting for this read
                tl.debug_barrier()
                met = tl.atomic_add(cnt_ptr + n_seg + b, 1, sem="acq_rel", scope="gpu")
                if met == 1:                                 # it was: its entry moves into the state now
                    tl.store(cnt_ptr + n_seg + b, 0)
                    pd = pend_ptr + b.to(tl.int64) * (3 * D) + d
                    pm0 = tl.load(pd, mask=dm, volatile=True)
                    ps0 = tl.load(pd + D, mask=dm, volatile=True)
                    pa0 = tl.load(pd + 2 * D, mask=dm, volatile=True)
                    tl.store(st, pm0, mask=dm)
                    tl.store(st + stride_sk, ps0, mask=dm)
                    tl.store(st + 2 * stride_sk, pa0, mask=dm)
        if w < end:                                          # finished: A / S, finished and written
            rr = row_ptr + g.to(tl.int64) * (2 * D)
            tl.store(rr + d, tl.math.div_rn(aa, ss), mask=dm)
            tl.debug_barrier()                               # the row's stores before its loads
            cache_ops._store_entry(rr, 1, b.to(tl.int64), w.to(tl.int64), bt_ptr, bt_s0, bt_s1, bt_cols, epb,
                                   r0, r0_s0, r0_s1, r1, r1_s0, r1_s1, r2, r2_s0, r2_s1, rr + D, w_ptr, inv_ptr,
                                   eps, RATIO, FMT, D, D_P2, ROPE, ROPE_P2, SB, SB_P2, HAD, LOG_D, HSCALE, FINISH,
                                   HALF_R)
        else:                                                # pending: into the state, once it was read
            if nseg == 1:                                    # this program read it above
                tl.store(st, mm, mask=dm)
                tl.store(st + stride_sk, ss, mask=dm)
                tl.store(st + 2 * stride_sk, aa, mask=dm)
            else:
                pd = pend_ptr + b.to(tl.int64) * (3 * D) + d
                tl.store(pd, mm, mask=dm)
                tl.store(pd + D, ss, mask=dm)
                tl.store(pd + 2 * D, aa, mask=dm)
                tl.debug_barrier()
                met = tl.atomic_add(cnt_ptr + n_seg + b, 1, sem="acq_rel", scope="gpu")
                if met == 1:                                 # the first segment has read the state
                    tl.store(cnt_ptr + n_seg + b, 0)
                    tl.store(st, mm, mask=dm)
                    tl.store(st + stride_sk, ss, mask=dm)
                    tl.store(st + 2 * stride_sk, aa, mask=dm)


@triton.jit
def _merge(m1, s1, a1, m2, s2, a2):
    """Two online-softmax states (M, S, A) as one (DESIGN §5; an empty one, M = -inf, weighs 0)."""
    m = tl.maximum(m1, m2)
    ms = tl.where(m == float("-inf"), 0.0, m)
    k1 = tl.where(m1 == float("-inf"), 0.0, tl.exp(m1 - ms))
    k2 = tl.where(m2 == float("-inf"), 0.0, tl.exp(m2 - ms))
    return m, s1 * k1 + s2 * k2, a1 * k1 + a2 * k2


_COUNTERS: dict[tuple, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least n counters for kernels on the current stream of `device`.
    The kernel leaves every counter it touched at 0 again, so the buffer is allocated (zeroed)
    once and reused; one per stream, so launches on two streams never share a counter."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 2 * (buf.numel() if buf is not None else 256)), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def _tiles(d: int, ratio: int, cuda: bool) -> tuple[int, int, int, int]:
    """Default (TOK slots, ROWS at a time, BLOCK_D channels, num_warps) of a program: BLOCK_D = 8
    channels (16 bytes of bf16) x 32 lanes x warps, so every thread holds whole columns."""
    if not cuda:
        return min(ratio, 8), min(ratio, 4), min(triton.next_power_of_2(d), 64), 4
    return min(ratio, 16), min(ratio, 4), min(triton.next_power_of_2(d), 512), 2


def compress_flush(c: torch.Tensor, z: torch.Tensor, state: torch.Tensor, request_slots: torch.Tensor,
                   start_positions: tuple[int, ...], query_lens: tuple[int, ...], ratio: int, overlap: bool,
                   views: cache_ops.Views, fmt: EntryFormat, block_table: torch.Tensor, epb: int, *,
                   z_bias: torch.Tensor | None = None, plan: CompressPlan | None = None,
                   finish: EntryFinish | None = None, tok: int | None = None, rows: int | None = None,
                   block_d: int | None = None, num_warps: int | None = None, maxnreg: int | None = None,
                   single: bool = True) -> None:
    """`compress_update` and `write_entries` of the entries it finishes, as one op (same
    arguments as the two; reference twin `dsv4.kernels.reference.compress.compress_flush`).
    One-window compressors run the fused kernel; two-window ones (overlap, CSA) the two kernels.
    Tuning: tok slots per program, rows of them at a time, block_d channels per program,
    num_warps; single=False: a one-request
    batch read from the table as any other (testing)."""
    if overlap:
        entries, req, idx = compress_update(c, z, state, request_slots, start_positions, query_lens, ratio, overlap,
                                            z_bias=z_bias, plan=plan)
        cache_ops.write_entries(views, fmt, entries, req, idx, block_table, epb, finish)
        return
    dev, d = c.device, state.shape[-1]
    bsz = len(query_lens)
    if plan is None:
        plan = make_plan(start_positions, query_lens, ratio, overlap, dev)
    elif not plan.matches(start_positions, query_lens, ratio, overlap) or plan.table.device != dev:
        raise InputError(f"compress plan for ratio {plan.ratio} (overlap {plan.overlap}, {len(plan.query_lens)} "
                         f"requests, {plan.table.device}) does not describe this call (ratio {ratio}, overlap "
                         f"{overlap}, {bsz} requests, {dev}): pass the plan of this batch and compressor kind")
    assert state.is_contiguous() and state.shape[2] >= 1, "the state cache is one contiguous tensor"
    if d != fmt.dim:
        raise InputError(f"{fmt.name} entries have {fmt.dim} channels, the compressor state {d}")
    n_seg = plan.num_segments
    if bsz == 0 or n_seg == 0:
        return
    cfg = _tiles(d, ratio, dev.type == "cuda")
    tok, block_d, warps = tok or cfg[0], block_d or cfg[2], num_warps or cfg[3]
    rows = rows or min(cfg[1], tok)
    d_p2 = triton.next_power_of_2(d)
    if tok & (tok - 1) or ratio % tok or rows & (rows - 1) or tok % rows or block_d & (block_d - 1) or block_d > d_p2:
        raise InputError(f"compress_flush tiles tok {tok}, rows {rows}, block_d {block_d} for ratio {ratio}, {d} "
                         "channels: powers of two, tok dividing the ratio, rows dividing tok, block_d at most the "
                         "channels' power of two")
    splits = ratio // tok
    c, z = _rows_contiguous(c), _rows_contiguous(z)
    zb = z_bias.contiguous() if z_bias is not None else c
    part = torch.empty(n_seg * splits * 3 * d + bsz * 3 * d + n_seg * 2 * d, dtype=torch.float32, device=dev)
    pend = part[n_seg * splits * 3 * d:]
    fin_rows = pend[bsz * 3 * d:]
    cnt = _counters(dev, n_seg + bsz)
    if finish is not None:
        extra, half_r = (finish.weight, finish.inv_freq, finish.eps), finish.inv_freq.shape[0]
    else:   # never read
        extra, half_r = (c, c, 0.0), 0
    p0, n0 = start_positions[0], query_lens[0]
    _compress_flush_kernel[(n_seg * splits * (d_p2 // block_d),)](
        c, z, zb, state, part, pend, fin_rows, cnt, plan.table, request_slots, c.stride(0), z.stride(0),
        zb.stride(0) if z_bias is not None else 0, state.stride(0), state.stride(1), bsz, n_seg, p0 // ratio,
        (p0 + n0) // ratio, p0, p0 + n0,
        block_table, block_table.stride(0), block_table.stride(1), block_table.shape[1], epb,
        *cache_ops._region_args(views, fmt, 3), *extra,
        RATIO=ratio, TOK=tok, ROWS=rows, SPLITS=splits, BLOCK_D=block_d, B_PAD=triton.next_power_of_2(max(bsz, 2)),
        SINGLE=bsz == 1 and single, WIDE=max(c.shape[0] * c.stride(0), z.shape[0] * z.stride(0)) >= 2**31,
        BIAS=z_bias is not None, **cache_ops._format_meta(fmt), FINISH=finish is not None, HALF_R=half_r,
        num_warps=warps, **({"maxnreg": maxnreg} if maxnreg else {}))


__all__ = ["compress_flush"]
