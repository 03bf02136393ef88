"""Triton twins of the decode-step reads: indexer scores over the paged keys, and sink attention.

Same signatures and results as `dsv4.kernels.reference.decode.paged_indexer_scores` and
`...decode.decode_attention` (plus keyword-only tuning knobs). Keys are read straight from the
paged pools / window ring through the block table and dequantised in registers; nothing is
gathered into a temporary. Grids depend only on static sizes (B, H, max_entries, K, W), bounds
are device-side, there is no host read: both ops can be captured in a CUDA graph.

    paged_indexer_scores  grid (B, P): program p scans key tiles p, p+P, ... of its request with
                          q [H, D_I] loaded once; a tile at or past num_entries[b] only stores -inf,
                          so the cost follows each request's context, not max_entries.
                          Per tile: S[H, N] = q . K^T on tensor cores, then sum_h w_h ReLU(S).
                          E2M1 keys stay split in even/odd elements (low/high nibbles): q is
                          loaded as q[:, 0::2] and q[:, 1::2] and two dots replace the interleave.
    decode_attention      grid (head blocks, B, S): split s runs an online softmax over key tiles
                          s, s+S, ... (window ring, then CSA indices / HCA entries); each tile is
                          loaded once and feeds both q . K^T and p . V (V = K). S = 1 applies the
                          sink in the kernel; S > 1 stores (m, l, acc) per split and a combine
                          kernel adds the sink once. Heads are split across programs (BLOCK_H of
                          them, 16 at D 512) because acc [H, 512] fp32 for 64 heads does not fit
                          in registers; the programs of one request read the same key tiles, which
                          the head-block-fastest grid order keeps in L2.

Precision (`precision=`): "ieee" = fp32 operands and fp32 FMA dots (the default for fp32
entries: exact up to summation order); "tf32x3" = fp32 operands on tensor cores in three TF32
passes (near-fp32); "bf16" = bf16 tensor-core operands, fp32 accumulation (the default for
fp8_ds / bf16 attention); "bf16x2" = the varying fp32 operand (q, or p) split into bf16 hi + lo,
two dots (~1e-5; the default for quantised indexer keys, whose top-k is sensitive to near-ties).
Dequantised keys of every quantised format (and bf16) are exact in bf16 (E2M1 x power of two,
e4m3 x power of two, E2M1 x e4m3), so only q and p are rounded. Per-key fp32 factors (fp8's
scale, nvfp4's global scale) multiply the dot's result instead of the keys. fp8_ds rows decode
with the hardware e4m3 conversion (sm_89+; the interpreter too, except the NaN codes, which the
writer never stores). mxfp4 scales are read as 2^(byte - 113) (the 2^14 of the E2M1 decode
folded in): bytes >= 241 (|key| >= 2^113) overflow, byte 0 (never written) is not 0.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsv4.cache.formats import EntryFormat
from dsv4.errors import FormatError, InputError

Views = dict[str, torch.Tensor]

_LOG2E = 1.4426950408889634
_PRECISIONS = {"ieee": 0, "bf16": 1, "bf16x2": 2, "tf32x3": 3}
_MAIN_FMT = {"fp32": 0, "bf16": 1, "fp8_ds": 2}
_IDX_FMT = {"fp32_i": 0, "bf16_i": 1, "fp8": 2, "mxfp4": 3, "nvfp4": 4}
# constexpr ids used inside the kernels (FMT is a main-format id in decode_attention, an indexer one above)
_FP8_DS: tl.constexpr = tl.constexpr(2)
_FP8: tl.constexpr = tl.constexpr(2)
_MXFP4: tl.constexpr = tl.constexpr(3)
_NVFP4: tl.constexpr = tl.constexpr(4)


# ====================================================================== shared helpers
@triton.jit
def _split(x, PREC: tl.constexpr):
    """fp32 operand -> (hi, lo) in the dot's operand type (lo used only by bf16x2)."""
    if PREC == 0 or PREC == 3:
        hi = x
        lo = x
    else:
        hi = x.to(tl.bfloat16)
        lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def _dot(a_hi, a_lo, b, PREC: tl.constexpr, NATIVE: tl.constexpr):
    """a @ b with a given as _split(a); b already in the operand type (exact in bf16 unless ieee).

    NATIVE=False (the CPU interpreter, whose bf16 dot is wrong) runs the same bf16-rounded
    operands through an fp32 dot."""
    if PREC == 0:
        out = tl.dot(a_hi, b, input_precision="ieee")
    elif PREC == 3:
        out = tl.dot(a_hi, b, input_precision="tf32x3")
    elif NATIVE:
        out = tl.dot(a_hi, b)
        if PREC == 2:
            out += tl.dot(a_lo, b)
    else:
        bf = b.to(tl.float32)
        out = tl.dot(a_hi.to(tl.float32), bf, input_precision="ieee")
        if PREC == 2:
            out += tl.dot(a_lo.to(tl.float32), bf, input_precision="ieee")
    return out


@triton.jit
def _locate(bt_row, w, valid, epb, max_blocks):
    """Entry indices w [N] -> (physical block int64, row), as the reference: masked -> block 0."""
    wc = tl.maximum(w, 0)
    col = tl.minimum(wc // epb, max_blocks - 1)
    blk = tl.load(bt_row + col, mask=valid, other=0)
    blk = tl.where(blk >= 0, blk, 0)
    return blk.to(tl.int64), wc % epb


@triton.jit
def _e2m1_x2p14(code):
    """E2M1 code (int32 0..15) -> value * 2^-14 fp32: sign and the 3 magnitude bits placed in
    fp16 bits 15 and 9..11 make an fp16 that is exactly value * 2^-14 (subnormal codes too)."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


# ====================================================================== indexer scores
@triton.jit
def _indexer_scores_kernel(
        q_ptr, w_ptr, out_ptr, data_ptr, scale_ptr, glob_ptr, bt_ptr, nent_ptr,
        s_qb, s_qh, s_wb, s_ob, s_dp, s_dr, s_sp, s_sr, s_gp, s_gr, s_bt,
        num_tiles, max_entries, epb, max_blocks, out_scale,
        FMT: tl.constexpr, PREC: tl.constexpr, NATIVE: tl.constexpr, H: tl.constexpr,
        BLOCK_H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, GS: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    hmask = h < H
    wts = tl.load(w_ptr + b * s_wb + h, mask=hmask, other=0.0)
    q_row = q_ptr + b * s_qb + h[:, None] * s_qh
    if FMT >= _MXFP4:   # packed E2M1: byte j holds elements 2j (low nibble) and 2j+1
        j = tl.arange(0, D // 2)[None, :]
        qe_hi, qe_lo = _split(tl.load(q_row + 2 * j, mask=hmask[:, None], other=0.0), PREC)
        qo_hi, qo_lo = _split(tl.load(q_row + 2 * j + 1, mask=hmask[:, None], other=0.0), PREC)
    else:
        d = tl.arange(0, D_PAD)[None, :]
        q_hi, q_lo = _split(tl.load(q_row + d, mask=hmask[:, None] & (d < D), other=0.0), PREC)
    n_b = tl.minimum(tl.load(nent_ptr + b), max_entries)
    for tile in range(tl.program_id(1), num_tiles, tl.num_programs(1)):
        offs = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if tile * BLOCK_N < n_b:
            valid = offs < n_b
            page, row = _locate(bt_ptr + b * s_bt, offs, valid, epb, max_blocks)
            v3 = valid[:, None, None]
            if FMT >= _MXFP4:
                g = tl.arange(0, D // (2 * GS))[None, :, None]
                jj = tl.arange(0, GS)[None, None, :]
                base = data_ptr + page[:, None, None] * s_dp + row[:, None, None] * s_dr
                byte = tl.load(base + g * GS + jj, mask=v3, other=0).to(tl.int32)
                sp = scale_ptr + page[:, None, None] * s_sp + row[:, None, None] * s_sr + g
                if FMT == _MXFP4:   # UE8M0 byte e+127 -> 2^e * 2^14 (undoes _e2m1_x2p14's 2^-14)
                    sc = ((tl.load(sp, mask=v3, other=0).to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
                else:               # e4m3 group scale; the fp32 global scale multiplies the dot below
                    sc = tl.load(sp, mask=v3, other=0.0).to(tl.float32) * 16384.0
                k_lo = tl.reshape(_e2m1_x2p14(byte & 15) * sc, [BLOCK_N, D // 2]).to(qe_hi.dtype)
                k_hi = tl.reshape(_e2m1_x2p14(byte >> 4) * sc, [BLOCK_N, D // 2]).to(qe_hi.dtype)
                s = (_dot(qe_hi, qe_lo, tl.trans(k_lo), PREC, NATIVE)
                     + _dot(qo_hi, qo_lo, tl.trans(k_hi), PREC, NATIVE))
            else:
                dk = tl.arange(0, D_PAD)[None, :]
                kp = data_ptr + page[:, None] * s_dp + row[:, None] * s_dr + dk
                k = tl.load(kp, mask=valid[:, None] & (dk < D), other=0.0).to(tl.float32).to(q_hi.dtype)
                s = _dot(q_hi, q_lo, tl.trans(k), PREC, NATIVE)
            if FMT == _FP8 or FMT == _NVFP4:   # per-key fp32 scale
                s = s * tl.load(glob_ptr + page * s_gp + row * s_gr, mask=valid, other=0.0)[None, :]
            score = tl.sum(tl.maximum(s, 0.0) * wts[:, None], axis=0) * out_scale
            score = tl.where(valid, score, float("-inf"))
        else:
            score = tl.full([BLOCK_N], float("-inf"), tl.float32)
        tl.store(out_ptr + b * s_ob + offs, score, mask=offs < max_entries)


def paged_indexer_scores(q: torch.Tensor, weights: torch.Tensor, idx_views: Views, fmt: EntryFormat,
                         block_table: torch.Tensor, num_entries: torch.Tensor, max_entries: int, epb: int,
                         *, precision: str | None = None, block_n: int | None = None,
                         num_programs: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """I[b, w] = sum_h weights[b, h] * ReLU(q[b, h] . K_b[w]) * D_I^-1/2 over each request's keys.

    Args:
        q: [B, H, D_I] fp32 in the keys' stored basis; weights: [B, H] fp32.
        idx_views: the indexer pool's region views {name: [num_blocks, epb, bytes] uint8}.
        block_table: [B, max_blocks] int32; num_entries: [B] int (visible entries).
        max_entries: static width N of the output; epb: entries per block.
        precision: "ieee" | "tf32x3" | "bf16" | "bf16x2" (default: ieee for fp32 keys, else bf16x2).
        block_n, num_programs, num_warps: tile of keys, programs per request, warps (tuning).
    Returns:
        [B, N] fp32, -inf at w >= num_entries[b].
    """
    if fmt.name not in _IDX_FMT:
        raise FormatError(f"paged_indexer_scores reads indexer formats {tuple(_IDX_FMT)}, got {fmt.name!r}")
    bsz, heads, dim = q.shape
    if dim != fmt.dim or weights.shape != (bsz, heads):
        raise InputError(f"q must be [B, H, {fmt.dim}] and weights [B, H]; got {list(q.shape)}, {list(weights.shape)}")
    out = torch.empty(bsz, max_entries, dtype=torch.float32, device=q.device)
    if bsz == 0 or max_entries == 0:
        return out
    prec = _precision(precision, "ieee" if fmt.name == "fp32_i" else "bf16x2")
    cuda = q.device.type == "cuda"
    # sm_90 compile (H 64, D_I 128): bf16x2 BLOCK_N 64 / 8 warps ~110 registers, no spill; the
    # fp32 FMA dot of "ieee" needs BLOCK_N 16 to stay spill-free (80 registers).
    bn = block_n or ((16 if prec == 0 else 64) if cuda else 16)
    tiles = triton.cdiv(max_entries, bn)
    nprog = num_programs or (min(tiles, max(1, triton.cdiv(4 * _sm_count(q.device), bsz))) if cuda else 2)
    warps = num_warps or (8 if heads > 16 or prec == 0 else 4)
    typed = fmt.typed(idx_views)
    data = typed["data"]
    scale = typed.get("scale", data)
    glob = typed.get("global", scale)          # fp8: the fp32 per-key scale; nvfp4: the global scale
    q, weights = q.float().contiguous(), weights.float().contiguous()
    _indexer_scores_kernel[(bsz, min(nprog, tiles))](
        q, weights, out, data, scale, glob, block_table, num_entries,
        q.stride(0), q.stride(1), weights.stride(0), out.stride(0), data.stride(0), data.stride(1),
        scale.stride(0), scale.stride(1), glob.stride(0), glob.stride(1), block_table.stride(0),
        tiles, max_entries, epb, block_table.shape[1], dim ** -0.5,
        FMT=_IDX_FMT[fmt.name], PREC=prec, NATIVE=cuda, H=heads, BLOCK_H=max(16, triton.next_power_of_2(heads)),
        D=dim, D_PAD=triton.next_power_of_2(dim), GS=16 if fmt.name == "mxfp4" else 8, BLOCK_N=bn, num_warps=warps)
    return out


# ====================================================================== decode attention
@triton.jit
def _load_kv(kv_ptr, rope_ptr, sc_ptr, page, row, valid, s_kp, s_kr, s_rp, s_rr, s_sp, s_sr,
             FMT: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, NCH: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows (page, row) [BLOCK_N] -> dequantised keys [BLOCK_N, NCH*64] fp32 (0 where masked / d >= D).

    Built as [rows, chunk, 64] so each fp8_ds 64-channel tile meets its one scale byte by
    broadcasting; chunks at or past NOPE // 64 come from the bf16 rope part."""
    c = tl.arange(0, NCH)[None, :, None]
    d = c * 64 + tl.arange(0, 64)[None, None, :]
    p3 = page[:, None, None]
    r3 = row[:, None, None]
    v3 = valid[:, None, None]
    if FMT == _FP8_DS:
        x = tl.load(kv_ptr + p3 * s_kp + r3 * s_kr + d, mask=v3 & (d < NOPE), other=0.0).to(tl.float32)
        sb = tl.load(sc_ptr + p3 * s_sp + r3 * s_sr + c, mask=v3 & (c < NOPE // 64), other=0).to(tl.int32)
        x = x * (sb << 23).to(tl.float32, bitcast=True)          # UE8M0: 2^(byte - 127), exact
        # the rope part (<= 64 channels) is one chunk, loaded as [rows, 1, 64] and broadcast into
        # chunk NOPE // 64: a full-tile pointer tensor for it would cost registers for nothing
        j = tl.arange(0, 64)[None, None, :]
        rope = tl.load(rope_ptr + p3 * s_rp + r3 * s_rr + j, mask=v3 & (j < D - NOPE), other=0.0)
        x = tl.where(c < NOPE // 64, x, tl.where(c == NOPE // 64, rope.to(tl.float32), 0.0))
    else:
        x = tl.load(kv_ptr + p3 * s_kp + r3 * s_kr + d, mask=v3 & (d < D), other=0.0).to(tl.float32)
    return tl.reshape(x, [BLOCK_N, NCH * 64])


@triton.jit
def _attend(q_hi, q_lo, k, valid, m_i, l_i, acc, qk_scale, PREC: tl.constexpr, NATIVE: tl.constexpr):
    """One key tile of the online softmax (log2 domain). V = K: the same tile feeds both dots."""
    s = _dot(q_hi, q_lo, tl.trans(k), PREC, NATIVE) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)      # no key yet: keep exp2 finite
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    p_hi, p_lo = _split(p, PREC)
    acc = acc * alpha[:, None] + _dot(p_hi, p_lo, k, PREC, NATIVE)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _decode_attn_kernel(
        q_ptr, sinks_ptr, out_ptr, pml_ptr,
        wkv_ptr, wrope_ptr, wsc_ptr, swa_pos_ptr, slots_ptr, pos_ptr,
        ckv_ptr, crope_ptr, csc_ptr, bt_ptr, idx_ptr, nent_ptr,
        s_qb, s_qh, s_ob, s_os, s_oh,
        s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_pos,
        s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, s_bt, s_idx,
        ring, window, epb, max_blocks, n_comp, qk_scale,
        H: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, NCH: tl.constexpr,
        FMT: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, NATIVE: tl.constexpr, BLOCK_N: tl.constexpr,
        FUSED: tl.constexpr):
    """MODE 0 SWA, 1 CSA (indices), 2 HCA (first num_entries). Output: FUSED -> out [B, H, D];
    else partial acc into out [B, S, H, NCH*64] and (m, l) into pml [B, S, H, 2]."""
    b = tl.program_id(1)
    split = tl.program_id(2)
    n_split = tl.num_programs(2)
    h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    d = tl.arange(0, NCH * 64)[None, :]
    q = tl.load(q_ptr + b * s_qb + h[:, None] * s_qh + d, mask=hmask[:, None] & (d < D), other=0.0)
    q_hi, q_lo = _split(q, PREC)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, NCH * 64], tl.float32)

    # window ring: rows with t - W < pos <= t
    slot = tl.load(slots_ptr + b).to(tl.int64)
    t = tl.load(pos_ptr + b)
    n_wt = tl.cdiv(ring, BLOCK_N)
    for tile in range(split, n_wt, n_split):
        r = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        wpos = tl.load(swa_pos_ptr + slot * s_pos + r, mask=r < ring, other=-1)
        valid = (wpos >= 0) & (wpos <= t) & (wpos > t - window)
        k = _load_kv(wkv_ptr, wrope_ptr, wsc_ptr, tl.zeros_like(r).to(tl.int64) + slot, r, valid,
                     s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, FMT, D, NOPE, NCH, BLOCK_N).to(q_hi.dtype)
        m_i, l_i, acc = _attend(q_hi, q_lo, k, valid, m_i, l_i, acc, qk_scale, PREC, NATIVE)

    # compressed entries; compressed tile c belongs to split (n_wt + c) % S (balances the splits)
    if MODE != 0:
        if MODE == 2:
            n_c = tl.minimum(tl.load(nent_ptr + b), n_comp)         # ragged: stop at this request's end
        else:
            n_c = n_comp
        for tile in range((split + n_split - n_wt % n_split) % n_split, tl.cdiv(n_c, BLOCK_N), n_split):
            c = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            if MODE == 1:
                w = tl.load(idx_ptr + b * s_idx + c, mask=c < n_comp, other=-1).to(tl.int32)
                valid = w >= 0
            else:
                w = c
                valid = c < n_c
            page, row = _locate(bt_ptr + b * s_bt, w, valid, epb, max_blocks)
            k = _load_kv(ckv_ptr, crope_ptr, csc_ptr, page, row, valid,
                         s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, FMT, D, NOPE, NCH, BLOCK_N).to(q_hi.dtype)
            m_i, l_i, acc = _attend(q_hi, q_lo, k, valid, m_i, l_i, acc, qk_scale, PREC, NATIVE)

    if FUSED:   # p = exp(l) / (exp(sink) + sum exp(l)), the sink unscaled
        sink = tl.load(sinks_ptr + h, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_f)
        inv = alpha / (l_i * alpha + tl.exp2(sink - m_f))
        tl.store(out_ptr + b * s_ob + h[:, None] * s_oh + d, acc * inv[:, None], mask=hmask[:, None] & (d < D))
    else:
        tl.store(out_ptr + b * s_ob + split * s_os + h[:, None] * s_oh + d, acc, mask=hmask[:, None])
        ml = pml_ptr + ((b * n_split + split) * H + h) * 2
        tl.store(ml, m_i, mask=hmask)
        tl.store(ml + 1, l_i, mask=hmask)


@triton.jit
def _combine_kernel(part_ptr, pml_ptr, sinks_ptr, out_ptr, s_pb, s_ps, s_ph, s_ob, s_oh,
                    H: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                    D: tl.constexpr, D_PAD: tl.constexpr):
    """out = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s + 2^(sink - M)), M = max(m_s, sink)."""
    b = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    s = tl.arange(0, S_PAD)[:, None]
    ml = pml_ptr + ((b * S + s) * H + h[None, :]) * 2
    smask = (s < S) & hmask[None, :]
    ms = tl.load(ml, mask=smask, other=float("-inf"))
    ls = tl.load(ml + 1, mask=smask, other=0.0)
    sink = tl.load(sinks_ptr + h, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_f = tl.maximum(tl.max(ms, axis=0), sink)
    den = tl.sum(tl.exp2(ms - m_f[None, :]) * ls, axis=0) + tl.exp2(sink - m_f)
    d = tl.arange(0, D_PAD)[None, :]
    acc = tl.zeros([BLOCK_H, D_PAD], tl.float32)
    for si in range(S):
        m_s = tl.load(pml_ptr + ((b * S + si) * H + h) * 2, mask=hmask, other=float("-inf"))
        part = tl.load(part_ptr + b * s_pb + si * s_ps + h[:, None] * s_ph + d, mask=hmask[:, None], other=0.0)
        acc += tl.exp2(m_s - m_f)[:, None] * part
    tl.store(out_ptr + b * s_ob + h[:, None] * s_oh + d, acc / den[:, None], mask=hmask[:, None] & (d < D))


def decode_attention(q: torch.Tensor, swa: Views, kv_fmt: EntryFormat, swa_pos: torch.Tensor,
                     request_slots: torch.Tensor, positions: torch.Tensor, window: int,
                     kv_views: Views | None, block_table: torch.Tensor | None, epb: int,
                     indices: torch.Tensor | None, num_entries: torch.Tensor | None, max_entries: int,
                     sinks: torch.Tensor, scale: float, *, precision: str | None = None,
                     block_h: int | None = None, block_n: int | None = None, num_splits: int | None = None,
                     num_warps: int | None = None) -> torch.Tensor:
    """Attention of one query token per request over its window ring and compressed entries.

    Keys: the ring rows with t - W < pos <= t (this step's token already written), then either
    the selected entries `indices` [B, K] (CSA, -1 = masked) or the first num_entries[b] entries
    (HCA; max_entries is the static bound), or none (SWA).
    Args:
        q: [B, H, D] fp32; sinks: [H]; swa: ring region views {name: [R, W, bytes]};
        swa_pos: [R, W] int32; request_slots, positions: [B] int; block_table: [B, max_blocks].
        precision: "ieee" | "tf32x3" | "bf16" | "bf16x2" (default: ieee for fp32 entries, else bf16).
        block_h, block_n, num_splits, num_warps: heads per program, keys per tile, key splits
        per (request, head block), warps (tuning; defaults per device).
    Returns:
        [B, H, D] fp32.
    """
    if kv_fmt.name not in _MAIN_FMT:
        raise FormatError(f"decode_attention reads main-entry formats {tuple(_MAIN_FMT)}, got {kv_fmt.name!r}")
    if kv_fmt.name == "fp8_ds" and kv_fmt.rope_dim > 64:
        raise FormatError(f"decode_attention reads fp8_ds entries with rope_dim <= 64, got {kv_fmt.rope_dim}")
    mode = 0 if indices is None and num_entries is None else (1 if indices is not None else 2)
    if mode and (kv_views is None or block_table is None):
        raise InputError("compressed keys (indices or num_entries) need kv_views and block_table")
    bsz, heads, dim = q.shape
    if dim != kv_fmt.dim or sinks.shape != (heads,):
        raise InputError(f"q must be [B, H, {kv_fmt.dim}] and sinks [H]; got {list(q.shape)}, {list(sinks.shape)}")
    out = torch.empty(bsz, heads, dim, dtype=torch.float32, device=q.device)
    if bsz == 0:
        return out
    prec = _precision(precision, "ieee" if kv_fmt.name == "fp32" else "bf16")
    cuda = q.device.type == "cuda"
    nch = triton.next_power_of_2(triton.cdiv(dim, 64))
    bh, bn, warps = _attention_tiles(heads, nch, prec, cuda)
    bh, bn, warps = block_h or bh, block_n or bn, num_warps or warps
    n_hb = triton.cdiv(heads, bh)
    ring = swa_pos.shape[1]
    n_comp = 0 if mode == 0 else (indices.shape[1] if mode == 1 else max_entries)
    tiles = triton.cdiv(ring, bn) + triton.cdiv(n_comp, bn)
    if num_splits is None:  # fill the GPU at small batch; >= 256 keys per split keeps partials cheap
        num_splits = max(1, min(triton.cdiv(2 * _sm_count(q.device), bsz * n_hb), triton.cdiv(tiles * bn, 256))
                         ) if cuda else 1
    n_split = max(1, min(num_splits, tiles))

    wt = kv_fmt.typed(swa)
    ct = kv_fmt.typed(kv_views) if kv_views is not None else wt
    wkv, ckv = (wt["nope"], ct["nope"]) if kv_fmt.name == "fp8_ds" else (wt["kv"], ct["kv"])
    wrope, crope = (wt["rope"], ct["rope"]) if kv_fmt.name == "fp8_ds" else (wkv, ckv)
    wsc, csc = (wt["scale"], ct["scale"]) if kv_fmt.name == "fp8_ds" else (wkv, ckv)
    bt = block_table if block_table is not None else swa_pos
    idx = indices if indices is not None else swa_pos
    nent = num_entries if num_entries is not None else request_slots
    q = q.float().contiguous()
    if n_split == 1:
        part, pml, s_split = out, out, 0
    else:
        part = torch.empty(bsz, n_split, heads, nch * 64, dtype=torch.float32, device=q.device)
        pml = torch.empty(bsz, n_split, heads, 2, dtype=torch.float32, device=q.device)
        s_split = part.stride(1)
    _decode_attn_kernel[(n_hb, bsz, n_split)](
        q, sinks, part, pml, wkv, wrope, wsc, swa_pos, request_slots, positions,
        ckv, crope, csc, bt, idx, nent,
        q.stride(0), q.stride(1), part.stride(0), s_split, part.stride(-2),
        *_rows(wkv), *_rows(wrope), *_rows(wsc), swa_pos.stride(0),
        *_rows(ckv), *_rows(crope), *_rows(csc), bt.stride(0), idx.stride(0),
        ring, window, epb, bt.shape[-1], n_comp, scale * _LOG2E,
        H=heads, BLOCK_H=bh, D=dim, NOPE=kv_fmt.dim - kv_fmt.rope_dim, NCH=nch,
        FMT=_MAIN_FMT[kv_fmt.name], MODE=mode, PREC=prec, NATIVE=cuda, BLOCK_N=bn, FUSED=n_split == 1,
        num_warps=warps)
    if n_split > 1:
        bhc = min(16, triton.next_power_of_2(heads))
        _combine_kernel[(bsz, triton.cdiv(heads, bhc))](
            part, pml, sinks, out, part.stride(0), part.stride(1), part.stride(2), out.stride(0), out.stride(1),
            H=heads, S=n_split, S_PAD=triton.next_power_of_2(n_split), BLOCK_H=bhc, D=dim, D_PAD=nch * 64,
            num_warps=4)
    return out


# ====================================================================== host helpers
def _precision(name: str | None, default: str) -> int:
    name = name or default
    if name not in _PRECISIONS:
        raise InputError(f"precision={name!r} is not one of {tuple(_PRECISIONS)}")
    return _PRECISIONS[name]


def _attention_tiles(heads: int, nch: int, prec: int, cuda: bool) -> tuple[int, int, int]:
    """Default (BLOCK_H, BLOCK_N, num_warps) of decode_attention.

    From sm_90 compiles (ptxas): D 512 bf16 operands with 16 heads x 32 keys and 8 warps is the
    largest tile without spills (255 registers: K tile 32 KB bf16 + acc 16 x 512 fp32); 32 or 64
    heads per program spill. The fp32 FMA dots of "ieee"/"tf32x3" spill at D 512 for any tile
    (validation formats: correct, slow). The CPU interpreter wants few, small tiles.
    """
    if not cuda:
        return max(16, min(64, triton.next_power_of_2(heads))), 16, 4
    if prec in (0, 3):
        return 16, 16, 8
    if nch >= 8:
        return 16, 32, 8
    return max(16, min(64, triton.next_power_of_2(heads))), 32, 4


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """(page, row) strides of a typed region view [N, P, C]; its channels must be contiguous."""
    assert t.stride(-1) == 1, "region views have contiguous channels"
    return t.stride(0), t.stride(1)


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a static property: no sync, capturable)."""
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())
