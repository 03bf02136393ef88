"""Two-pass decode attention for many (request, head) pairs: all heads of a request per program.

    pass 1, grid (B, S): logits s = q . k^T of all H heads (one [H, D] x [D, N] tensor-core dot
            per key tile, q bf16 in shared memory, each key dequantised once for every head) into
            scores [B, H, NK] fp32, plus each split's softmax stats (m, l); split s takes key tiles
            s, s + S, ... (ring first, then the compressed entries, as the fused kernel)
    pass 2, grid (B, D / DV, VS): M, L per head from the splits' stats and the sink, then
            out[:, slice] = sum_n 2^(s_n - M) v_n[slice] / L; each program dequantises only its DV
            channels of its keys, so the keys are read about once in all. VS > 1 key splits add
            into a zeroed out with atomics (exact, so deterministic, at VS = 2).

No [H, D] fp32 accumulator (the fused kernel's register limit, 16 heads per program): pass 1
holds [H, BN] logits, pass 2 an [H, DV] accumulator. Both loops pipeline their gathered loads by
hand (indices 3 tiles ahead, block-table pages 2, key bytes 1). Static grids and buffer sizes,
no host reads: capturable in a CUDA graph. fp8_ds keys are exact in bf16; q and p are rounded to
bf16 for the dots (fp32 accumulation), as the fused kernel's "bf16" precision.

Measured (H200, Triton 3.6, B = 64, 128K, torch profiler, L2 warm): CSA pass 1 55 µs, pass 2
38 µs, q -> bf16 4 µs; HCA 68 / 57 / 4 µs. Still far from the ~10 µs rooflines: per key tile
pass 1 runs ~1,040 SASS instructions per warp with ~15 block barriers (layout conversions of the
fp8 tile and scales through shared memory, the key tile's store for wgmma, index loads repeated
per layout) and wgmma N = 16 per warpgroup re-reads q [64, 512] from shared memory each tile, so
it is issue / barrier bound rather than memory bound; the hand pipelining gained 168 -> 137 µs
(HCA) but nothing on CSA. Leads: a 2-D key load (no [rows, chunk, 64] conversions), larger key
tiles once registers allow, fp16 probabilities in the scores buffer.
Since then the fp8 bytes, the scale bytes and the rope load in one layout (`load_entry_tile`):
pass 1 870 instructions and 10 barriers per tile, 201 registers (was 255, spilling); H200 A/B,
B = 64: CSA attention 89.6 -> 78.8 µs, HCA 123.0 -> 108.9.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.decode_common import (
    dequant_entry_tile,
    dot_prec,
    inverse_rope,
    load_entry_tile,
    locate,
    note_compile,
    pdl_enter,
    pdl_launch,
    split_operand,
    split_stats,
)

#: scores rows are laid out as [window ring padded to PAD | compressed entries padded to PAD]
PAD = 64


@triton.jit
def _src_idx(pos_ptr, idx_ptr, b, s_pi, slot, t, window, limit, n_c, tile,
             WIN: tl.constexpr, MODE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stage 1 of a key tile: (entry or ring row [BLOCK_N], valid). Tiles past the end come out all
    invalid, so the prefetches of the software pipeline below load nothing for them."""
    c = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if WIN:     # ring rows with t - W < pos <= t
        wpos = tl.load(pos_ptr + slot * s_pi + c, mask=c < limit, other=-1)
        ok = (wpos >= 0) & (wpos <= t) & (wpos > t - window)
        w = c
    elif MODE == 1:
        w = tl.load(idx_ptr + b * s_pi + c, mask=c < limit, other=-1).to(tl.int32)
        ok = w >= 0
    else:
        w = c
        ok = c < n_c
    return w, ok


@triton.jit
def _src_page(bt_row, w, ok, slot, epb, max_blocks, WIN: tl.constexpr):
    """Stage 2: (page int64, row) of each key (the window ring: the request's slot)."""
    if WIN:
        page = tl.zeros_like(w).to(tl.int64) + slot
        row = w
    else:
        page, row = locate(bt_row, w, ok, epb, max_blocks)
    return page, row


@triton.jit
def _scores_src(q_hi, q_lo, m_i, l_i, srow, hmask, kv_ptr, rope_ptr, sc_ptr, s_kp, s_kr, s_rp, s_rr, s_sp, s_sr,
                pos_ptr, idx_ptr, bt_row, b, s_pi, slot, t, window, limit, n_c, epb, max_blocks,
                first, end, step, qk_scale, WIN: tl.constexpr, MODE: tl.constexpr, FMT: tl.constexpr,
                D: tl.constexpr, NOPE: tl.constexpr, NCH: tl.constexpr, PREC: tl.constexpr, NATIVE: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Pass 1 over the key tiles first, first + step, ... < end of one source (ring or entries),
    software-pipelined by hand: while tile i is computed, tile i + 1's bytes, tile i + 2's pages
    and tile i + 3's indices are in flight (each stage uses what the previous iteration loaded)."""
    n = tl.arange(0, BLOCK_N)[None, :]
    w0, ok0 = _src_idx(pos_ptr, idx_ptr, b, s_pi, slot, t, window, limit, n_c, first, WIN, MODE, BLOCK_N)
    p0, r0 = _src_page(bt_row, w0, ok0, slot, epb, max_blocks, WIN)
    x0, sb0, rp0 = load_entry_tile(kv_ptr, rope_ptr, sc_ptr, p0, r0, ok0, 0, s_kp, s_kr, s_rp, s_rr, s_sp, s_sr,
                                   FMT, D, NOPE, NCH)
    w1, ok1 = _src_idx(pos_ptr, idx_ptr, b, s_pi, slot, t, window, limit, n_c, first + step, WIN, MODE, BLOCK_N)
    p1, r1 = _src_page(bt_row, w1, ok1, slot, epb, max_blocks, WIN)
    w2, ok2 = _src_idx(pos_ptr, idx_ptr, b, s_pi, slot, t, window, limit, n_c, first + 2 * step, WIN, MODE,
                       BLOCK_N)
    for tile in range(first, end, step):
        x1, sb1, rp1 = load_entry_tile(kv_ptr, rope_ptr, sc_ptr, p1, r1, ok1, 0, s_kp, s_kr, s_rp, s_rr, s_sp,
                                       s_sr, FMT, D, NOPE, NCH)
        p2, r2 = _src_page(bt_row, w2, ok2, slot, epb, max_blocks, WIN)
        w3, ok3 = _src_idx(pos_ptr, idx_ptr, b, s_pi, slot, t, window, limit, n_c, tile + 3 * step, WIN, MODE,
                           BLOCK_N)
        k = dequant_entry_tile(x0, sb0, rp0, 0, FMT, NOPE, NCH, BLOCK_N).to(q_hi.dtype)
        s = dot_prec(q_hi, q_lo, tl.trans(k), PREC, NATIVE) * qk_scale
        s = tl.where(ok0[None, :], s, float("-inf"))
        tl.store(srow + tile * BLOCK_N + n, s, mask=hmask[:, None])
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)      # no key yet: keep exp2 finite
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
        m_i = m_new
        x0, sb0, rp0, ok0 = x1, sb1, rp1, ok1
        p1, r1, ok1 = p2, r2, ok2
        w2, ok2 = w3, ok3
    return m_i, l_i


@triton.jit
def _scores_kernel(
        q_ptr, sc_out_ptr, pml_ptr,
        wkv_ptr, wrope_ptr, wsc_ptr, swa_pos_ptr, slots_ptr, pos_ptr,
        ckv_ptr, crope_ptr, csc_ptr, bt_ptr, idx_ptr, nent_ptr,
        s_qb, s_qh, s_sb, s_sh,
        s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_pos,
        s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, s_bt, s_idx,
        ring, ring_pad, window, epb, max_blocks, n_comp, qk_scale,
        H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, NCH: tl.constexpr,
        FMT: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, NATIVE: tl.constexpr, BLOCK_N: tl.constexpr,
        PDL: tl.constexpr):
    """Pass 1: scores[b, h, n] = log2-scaled logits (-inf where masked), pml[b, split, h] = (m, l).
    Split s takes ring tiles s, s + S, ... and compressed tile c when (n_wt + c) % S == s."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    h = tl.arange(0, HP)
    hmask = h < H
    d = tl.arange(0, NCH * 64)[None, :]
    q = tl.load(q_ptr + b * s_qb + h[:, None] * s_qh + d, mask=hmask[:, None] & (d < D), other=0.0)
    q_hi, q_lo = split_operand(q, PREC)
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    srow = sc_out_ptr + b * s_sb + h[:, None] * s_sh
    slot = tl.load(slots_ptr + b).to(tl.int64)
    t = tl.load(pos_ptr + b)
    n_wt = ring_pad // BLOCK_N
    m_i, l_i = _scores_src(q_hi, q_lo, m_i, l_i, srow, hmask, wkv_ptr, wrope_ptr, wsc_ptr,
                           s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, swa_pos_ptr, idx_ptr, bt_ptr, b, s_pos, slot, t,
                           window, ring, 0, epb, max_blocks, split, n_wt, n_split, qk_scale,
                           True, MODE, FMT, D, NOPE, NCH, PREC, NATIVE, BLOCK_N)
    if MODE != 0:
        if MODE == 2:
            n_c = tl.minimum(tl.load(nent_ptr + b), n_comp)         # ragged: stop at this request's end
        else:
            n_c = n_comp
        m_i, l_i = _scores_src(q_hi, q_lo, m_i, l_i, srow + ring_pad, hmask, ckv_ptr, crope_ptr, csc_ptr,
                               s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, swa_pos_ptr, idx_ptr, bt_ptr + b * s_bt, b,
                               s_idx, slot, t, window, n_comp, n_c, epb, max_blocks,
                               (split + n_split - n_wt % n_split) % n_split, tl.cdiv(n_c, BLOCK_N), n_split,
                               qk_scale, False, MODE, FMT, D, NOPE, NCH, PREC, NATIVE, BLOCK_N)
    ml = pml_ptr + ((b * n_split + split) * H + h) * 2
    tl.store(ml, m_i, mask=hmask)
    tl.store(ml + 1, l_i, mask=hmask)


@triton.jit
def _values_src(acc, m_f, srow, hmask, kv_ptr, rope_ptr, sc_ptr, s_kp, s_kr, s_rp, s_rr, s_sp, s_sr,
                pos_ptr, idx_ptr, bt_row, b, s_pi, slot, t, window, limit, n_c, epb, max_blocks, c0,
                first, end, step, WIN: tl.constexpr, MODE: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr,
                NOPE: tl.constexpr, DV: tl.constexpr, PREC: tl.constexpr, NATIVE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pass 2 over the key tiles first, first + step, ... < end of one source, pipelined as
    `_scores_src` (the scores tile travels with the key bytes)."""
    n = tl.arange(0, BLOCK_N)[None, :]
    w0, ok0 = _src_idx(pos_ptr, idx_ptr, b, s_pi, slot, t, window, limit, n_c, first, WIN, MODE, BLOCK_N)
    p0, r0 = _src_page(bt_row, w0, ok0, slot, epb, max_blocks, WIN)
    x0, sb0, rp0 = load_entry_tile(kv_ptr, rope_ptr, sc_ptr, p0, r0, ok0, c0, s_kp, s_kr, s_rp, s_rr, s_sp, s_sr,
                                   FMT, D, NOPE, DV // 64)
    n0 = first * BLOCK_N + n
    s0 = tl.load(srow + n0, mask=hmask[:, None] & (n0 < end * BLOCK_N), other=float("-inf"))
    w1, ok1 = _src_idx(pos_ptr, idx_ptr, b, s_pi, slot, t, window, limit, n_c, first + step, WIN, MODE, BLOCK_N)
    p1, r1 = _src_page(bt_row, w1, ok1, slot, epb, max_blocks, WIN)
    w2, ok2 = _src_idx(pos_ptr, idx_ptr, b, s_pi, slot, t, window, limit, n_c, first + 2 * step, WIN, MODE,
                       BLOCK_N)
    for tile in range(first, end, step):
        x1, sb1, rp1 = load_entry_tile(kv_ptr, rope_ptr, sc_ptr, p1, r1, ok1, c0, s_kp, s_kr, s_rp, s_rr, s_sp,
                                       s_sr, FMT, D, NOPE, DV // 64)
        n1 = (tile + step) * BLOCK_N + n
        s1 = tl.load(srow + n1, mask=hmask[:, None] & (n1 < end * BLOCK_N), other=float("-inf"))
        p2, r2 = _src_page(bt_row, w2, ok2, slot, epb, max_blocks, WIN)
        w3, ok3 = _src_idx(pos_ptr, idx_ptr, b, s_pi, slot, t, window, limit, n_c, tile + 3 * step, WIN, MODE,
                           BLOCK_N)
        v = dequant_entry_tile(x0, sb0, rp0, c0, FMT, NOPE, DV // 64, BLOCK_N)
        s = tl.where(ok0[None, :], s0, float("-inf"))   # where, not a load mask: the load stays vectorised
        p_hi, p_lo = split_operand(tl.exp2(s - m_f[:, None]), PREC)
        acc += dot_prec(p_hi, p_lo, v.to(p_hi.dtype), PREC, NATIVE)
        x0, sb0, rp0, ok0, s0 = x1, sb1, rp1, ok1, s1
        p1, r1, ok1 = p2, r2, ok2
        w2, ok2 = w3, ok3
    return acc


@triton.jit
def _values_kernel(
        sc_ptr_in, pml_ptr, sinks_ptr, out_ptr, cos_ptr, sin_ptr,
        wkv_ptr, wrope_ptr, wsc_ptr, swa_pos_ptr, slots_ptr, pos_ptr,
        ckv_ptr, crope_ptr, csc_ptr, bt_ptr, idx_ptr, nent_ptr,
        s_sb, s_sh, s_ob, s_oh,
        s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_pos,
        s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, s_bt, s_idx,
        ring, ring_pad, window, epb, max_blocks, n_comp,
        H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, DV: tl.constexpr,
        S: tl.constexpr, S_PAD: tl.constexpr, VS: tl.constexpr, HALF_R: tl.constexpr, ROPE: tl.constexpr,
        FMT: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, NATIVE: tl.constexpr, BLOCK_N: tl.constexpr,
        PDL: tl.constexpr):
    """Pass 2: out[b, :, slice] = sum_n 2^(s_n - M) v_n[slice] / L, M = max(m_s, sink) and
    L = sum_s 2^(m_s - M) l_s + 2^(sink - M) (the sink unscaled, as the reference). With VS > 1
    key splits (grid axis 2, tiles round-robin as pass 1's) the splits add into a zeroed out.
    ROPE: the slice's channels in the trailing 2 HALF_R get the inverse rotation RoPE_{-t}
    (interleaved pairs, as `norm_rope`; linear, so split partials may be rotated before adding)."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    c0 = tl.program_id(1) * (DV // 64)
    vs = tl.program_id(2)
    n_vs = tl.num_programs(2)
    h = tl.arange(0, HP)
    hmask = h < H
    m_f, den = split_stats(pml_ptr, sinks_ptr, b, h, hmask, H, S, S_PAD)
    acc = tl.zeros([HP, DV], tl.float32)
    srow = sc_ptr_in + b * s_sb + h[:, None] * s_sh
    slot = tl.load(slots_ptr + b).to(tl.int64)
    t = tl.load(pos_ptr + b)
    acc = _values_src(acc, m_f, srow, hmask, wkv_ptr, wrope_ptr, wsc_ptr, s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr,
                      swa_pos_ptr, idx_ptr, bt_ptr, b, s_pos, slot, t, window, ring, 0, epb, max_blocks, c0,
                      vs, tl.cdiv(ring, BLOCK_N), n_vs, True, MODE, FMT, D, NOPE, DV, PREC, NATIVE, BLOCK_N)
    if MODE != 0:
        if MODE == 2:
            n_c = tl.minimum(tl.load(nent_ptr + b), n_comp)
        else:
            n_c = n_comp
        acc = _values_src(acc, m_f, srow + ring_pad, hmask, ckv_ptr, crope_ptr, csc_ptr,
                          s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, swa_pos_ptr, idx_ptr, bt_ptr + b * s_bt, b,
                          s_idx, slot, t, window, n_comp, n_c, epb, max_blocks, c0,
                          (vs + n_vs - tl.cdiv(ring, BLOCK_N) % n_vs) % n_vs, tl.cdiv(n_c, BLOCK_N), n_vs, False,
                          MODE, FMT, D, NOPE, DV, PREC, NATIVE, BLOCK_N)
    d = c0 * 64 + tl.arange(0, DV)[None, :]
    optr = out_ptr + b * s_ob + h[:, None] * s_oh + d
    o = acc / den[:, None]
    if ROPE:
        o = inverse_rope(o, b, c0 * 64, cos_ptr, sin_ptr, HP, DV, D, HALF_R)
    if VS == 1:
        tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & (d < D))
    else:   # two splits add exactly (0 + a + b == 0 + b + a): deterministic for VS = 2
        tl.atomic_add(optr, o, mask=hmask[:, None] & (d < D), sem="relaxed")


def two_pass(out: torch.Tensor, q: torch.Tensor, sinks: torch.Tensor, keys: tuple, meta: tuple, strides: tuple,
             ring: int, window: int, epb: int, max_blocks: int, n_comp: int, qk_scale: float, *,
             dim: int, nope: int, nch: int, fmt: int, mode: int, prec: int, native: bool,
             block_n: int, warps: int, splits: int, block_nv: int, block_dv: int, warps_v: int,
             value_splits: int, stages: int, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Launch both passes. keys = (wkv, wrope, wsc, ckv, crope, csc); meta = (swa_pos, slots,
    positions, block_table, indices, num_entries); strides = the 12 (page, row) strides, swa_pos's,
    the block table's and the indices' row strides, in the fused kernel's order. rope = (cos, sin)
    [B, r/2]: out gets the inverse rotation. out: fp32 where value_splits > 1 (atomic adds), else
    any float dtype."""
    bsz, heads, _ = q.shape
    assert PAD % block_n == 0 and PAD % block_nv == 0 and block_dv % 64 == 0 and (nch * 64) % block_dv == 0
    ring_pad = triton.cdiv(ring, PAD) * PAD
    nk = ring_pad + triton.cdiv(n_comp, PAD) * PAD
    hp = max(16, triton.next_power_of_2(heads))
    tiles = ring_pad // block_n + triton.cdiv(n_comp, block_n)
    splits = max(1, min(splits, tiles))
    scores = torch.empty(bsz, heads, nk, dtype=torch.float32, device=q.device)
    pml = torch.empty(bsz, splits, heads, 2, dtype=torch.float32, device=q.device)
    wkv, wrope, wsc, ckv, crope, csc = keys
    qa = q.to(torch.bfloat16) if prec == 1 else q    # bf16 q: the dot's A operand stays in shared memory
    if value_splits > 1:    # zeroed before pass 1: no other kernel between the passes (pass 2's PDL edge)
        assert out.dtype == torch.float32, "value splits add into an fp32 out"
        out.zero_()
    k = _scores_kernel[(bsz, splits)](
        qa, scores, pml, wkv, wrope, wsc, *meta[:3], ckv, crope, csc, *meta[3:],
        qa.stride(0), qa.stride(1), scores.stride(0), scores.stride(1), *strides,
        ring, ring_pad, window, epb, max_blocks, n_comp, qk_scale,
        H=heads, HP=hp, D=dim, NOPE=nope, NCH=nch, FMT=fmt, MODE=mode, PREC=prec, NATIVE=native,
        BLOCK_N=block_n, num_warps=warps, num_stages=stages, **pdl_launch(q.device))
    note_compile("decode_attention.scores", k)
    cos, sin = (t.float().contiguous() for t in rope) if rope is not None else (pml, pml)   # unread stand-ins
    k = _values_kernel[(bsz, nch * 64 // block_dv, value_splits)](
        scores, pml, sinks, out, cos, sin, wkv, wrope, wsc, *meta[:3], ckv, crope, csc, *meta[3:],
        scores.stride(0), scores.stride(1), out.stride(0), out.stride(1), *strides,
        ring, ring_pad, window, epb, max_blocks, n_comp,
        H=heads, HP=hp, D=dim, NOPE=nope, DV=block_dv, S=splits, S_PAD=triton.next_power_of_2(splits), VS=value_splits,
        HALF_R=rope[0].shape[-1] if rope is not None else 0, ROPE=rope is not None,
        FMT=fmt, MODE=mode, PREC=prec, NATIVE=native, BLOCK_N=block_nv, num_warps=warps_v, num_stages=stages,
        **pdl_launch(q.device))
    note_compile("decode_attention.values", k)
