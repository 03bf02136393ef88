"""Triton twin of `reference.decode.decode_attention`: sink attention of one query token per request.

Four schemes. On sm_90, for fp8_ds entries and 64 heads, wherever the halves scheme would be the
default: the wide one in `decode_attention_wide` (Gluon: 64 heads and all 512 channels in one
warp-specialised program, a loader, a scores and a values warpgroup over two 64-key tiles; bf16 q,
B = 64 128K CSA 35.5 µs, HCA 46.2 µs). Else from
4 requests of 64 heads, or one request with 4,096 entries or more (bf16 operands, D 512), the
halves one in
`decode_attention_halves` (64 heads and half of the value channels per program, one pass; see
`_scheme` for the H200 numbers: B = 64 128K CSA 55 µs, HCA 74 µs); its dots take fp8_ds keys as
fp16 operands, with q and p in fp16 (exact keys, rounding finer than bf16's:
`decode_common.key_operand`). The two-pass one in `decode_attention_2p` (pass 1: logits of all
heads per key tile into a scores buffer, pass 2: values per 128-channel slice), the default
before it, serves the other precisions on request. Otherwise the fused kernel below:

    grid (head blocks, B, S): split s runs an online softmax over key tiles s, s+S, ... (window
    ring, then CSA indices / HCA entries); each tile is loaded once and feeds both q . K^T and
    p . V (V = K). S = 1 applies the sink in the kernel; S > 1 stores (m, l, acc) per split and
    a combine kernel adds the sink once. Heads are split across programs (BLOCK_H of them, 16
    at D 512) because acc [H, 512] fp32 for 64 heads does not fit in registers; the programs of
    one request read the same key tiles, which the head-block-fastest grid order keeps in L2.

Keys are read straight from the paged pools / window ring through the block table and
dequantised in registers; nothing is gathered into a temporary. Grids depend only on static
sizes (B, H, K, W, max_entries), bounds are device-side, there is no host read: capturable in a
CUDA graph. fp8_ds rows decode with the hardware e4m3 conversion (sm_89+; the interpreter too,
except the NaN codes, which the writer never stores). Precision: see `decode_common` (default
"bf16" for fp8_ds / bf16 entries, "ieee" for fp32 entries).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.cache.formats import EntryFormat
from dsv4.errors import FormatError, InputError
from dsv4.kernels.triton import decode_attention_2p as tp
from dsv4.kernels.triton import decode_attention_halves as dh
from dsv4.kernels.triton.decode_combine import UNROLL_SPLITS, combine

try:        # the wide scheme is written in Gluon, which a Triton before 3.4 lacks: the other schemes then
    from dsv4.kernels.triton import decode_attention_wide as dw
except ImportError:
    dw = None
from dsv4.kernels.triton.decode_common import (
    FP8_DS_ID,
    LOG2E,
    Views,
    dequant_entry_tile,
    dot_prec,
    load_entry_tile,
    locate,
    note_compile,
    pdl_enter,
    pdl_launch,
    precision_id,
    rows,
    sm_count,
    split_operand,
)
from dsv4.kernels.triton.norm_rope import norm_rope, rotated_rows_rms

_MAIN_FMT = {"fp32": 0, "bf16": 1, "fp8_ds": FP8_DS_ID.value}
#: default minimum keys per split of the key range (split-K only while each split keeps this many);
#: 64 measured best at B = 1 (H200, V4 shapes: 27 µs vs 55 µs at 256), no change at B = 64 ...
SPLIT_KEYS = 64
#: ... but one 32-key tile a split where that leaves at most the combine's unrolled count of splits
#: (H100, `benchmarks/ab_run.sh`, two rounds, layer BF16 / FP8 weights, µs: CSA 128K B = 1 (640 keys,
#: 10 -> 20 splits) 125.1 / 90.1 -> 124.3 / 88.1; HCA 8K B = 2 110.4 / 79.5 -> 108.4 / 76.6; HCA 8K B = 1
#: 95.1 / 61.0 -> 94.3 / 60.6; CSA 8K B = 1 122.2 / 86.1 -> 123.1 / 84.4). HCA at 128K (36 tiles) keeps
#: 18 splits: 36 took the layer from 97.3 / 63.2 to 98.8 / 65.4 even with the combine unrolled, 24 to
#: 98.4 / 64.5 (some splits still two tiles long)
SHORT_SPLIT_KEYS = 32
#: default software-pipelining depth on CUDA: 1 (no pipelining) measured fastest at every tested
#: (B, layer) on an H200 with Triton 3.6, e.g. B = 64 HCA 337 µs vs 458 µs at the default 3
NUM_STAGES = 1


@triton.jit
def _load_kv(kv_ptr, rope_ptr, sc_ptr, page, row, valid, s_kp, s_kr, s_rp, s_rr, s_sp, s_sr,
             FMT: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, NCH: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows (page, row) [BLOCK_N] -> dequantised keys [BLOCK_N, NCH*64] fp32 (0 where masked / d >= D)."""
    x, sb, rope = load_entry_tile(kv_ptr, rope_ptr, sc_ptr, page, row, valid, 0, s_kp, s_kr, s_rp, s_rr, s_sp, s_sr,
                                  FMT, D, NOPE, NCH)
    return dequant_entry_tile(x, sb, rope, 0, FMT, NOPE, NCH, BLOCK_N)


@triton.jit
def _attend(q_hi, q_lo, k, valid, m_i, l_i, acc, qk_scale, PREC: tl.constexpr, NATIVE: tl.constexpr):
    """One key tile of the online softmax (log2 domain). V = K: the same tile feeds both dots."""
    # Where the membar pass puts the key tile's barrier after the q operand's shared-memory loads (it
    # did once q was normalised in the prologue, QNORM), ptxas hoists all 64 of them above it and
    # holds 128 registers of q through the tile: sm_90, 128 -> 208 registers, one program an SM
    # instead of two. With this barrier first the default tiles compile to the same SASS as without
    # (16 x 16 keys x 8 warps: 215 -> 103 registers; benchmarks/compile_report.py qnorm / attention)
    tl.debug_barrier()
    s = dot_prec(q_hi, q_lo, tl.trans(k), PREC, NATIVE) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)      # no key yet: keep exp2 finite
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    p_hi, p_lo = split_operand(p, PREC)
    acc = acc * alpha[:, None] + dot_prec(p_hi, p_lo, k, PREC, NATIVE)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def attend_entries(q_hi, q_lo, m_i, l_i, acc, ckv_ptr, crope_ptr, csc_ptr, bt_row, idx_row, n_c, n_idx,
                   first, step, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, epb, max_blocks, qk_scale,
                   FMT: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, NCH: tl.constexpr, MODE: tl.constexpr,
                   PREC: tl.constexpr, NATIVE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles first, first + step, ... of one query's compressed entries, through its block-table
    row: MODE 1 the selected entries idx_row[0 : n_idx] (-1 = masked), MODE 2 entries 0 .. n_c - 1."""
    for tile in range(first, tl.cdiv(n_c, BLOCK_N), step):
        c = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if MODE == 1:
            w = tl.load(idx_row + c, mask=c < n_idx, other=-1).to(tl.int32)
            valid = w >= 0
        else:
            w = c
            valid = c < n_c
        page, row = locate(bt_row, w, valid, epb, max_blocks)
        k = _load_kv(ckv_ptr, crope_ptr, csc_ptr, page, row, valid,
                     s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, FMT, D, NOPE, NCH, BLOCK_N).to(q_hi.dtype)
        m_i, l_i, acc = _attend(q_hi, q_lo, k, valid, m_i, l_i, acc, qk_scale, PREC, NATIVE)
    return m_i, l_i, acc


@triton.jit
def with_sink(acc, m_i, l_i, sinks_ptr, h, hmask):
    """The finished output acc / (exp(sink) + sum exp(l)) (log2-domain m, l; the sink unscaled)."""
    sink = tl.load(sinks_ptr + h, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_f = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_f)
    inv = alpha / (l_i * alpha + tl.exp2(sink - m_f))
    return acc * inv[:, None]


@triton.jit
def _decode_attn_kernel(
        q_ptr, sinks_ptr, out_ptr, pml_ptr,
        wkv_ptr, wrope_ptr, wsc_ptr, swa_pos_ptr, slots_ptr, pos_ptr,
        ckv_ptr, crope_ptr, csc_ptr, bt_ptr, idx_ptr, nent_ptr,
        s_qb, s_qh, s_ob, s_os, s_oh,
        s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_pos,
        s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, s_bt, s_idx,
        ring, window, epb, max_blocks, n_comp, qk_scale, cos_ptr, sin_ptr, q_eps,
        H: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, NCH: tl.constexpr,
        FMT: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, NATIVE: tl.constexpr, BLOCK_N: tl.constexpr,
        FUSED: tl.constexpr, NORM_PART: tl.constexpr, QNORM: tl.constexpr, HALF_R: tl.constexpr,
        PDL: tl.constexpr):
    """MODE 0 SWA, 1 CSA (indices), 2 HCA (first num_entries). Output: FUSED -> out [B, H, D];
    else partial acc into out [B, S, H, NCH*64] and (m, l) into pml [B, S, H, 2]; NORM_PART (fp16 out):
    the partial is acc / l, as `decode_combine` weighs it. QNORM: q is the
    raw up-projection, normalised (q_eps) and rotated (cos / sin [B, HALF_R]) here first."""
    pdl_enter(PDL)
    b = tl.program_id(1)
    split = tl.program_id(2)
    n_split = tl.num_programs(2)
    h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    d = tl.arange(0, NCH * 64)[None, :]
    q_rows = q_ptr + b * s_qb + h[:, None] * s_qh + d
    if QNORM:   # every split of the head block redoes it: 512 channels a head, cheaper than a launch
        # q . k = inv (RoPE(raw) . k): the rows' 1 / rms scales their scores (V = K: q is not a value)
        q, inv = rotated_rows_rms(q_rows, hmask[:, None] & (d < D), d, cos_ptr + b * HALF_R, sin_ptr + b * HALF_R,
                                  q_eps, D, HALF_R, NCH * 32)
        qk_scale = qk_scale * inv[:, None]
    else:
        q = tl.load(q_rows, mask=hmask[:, None] & (d < D), other=0.0)
    q_hi, q_lo = split_operand(q, PREC)
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
        m_i, l_i, acc = attend_entries(
            q_hi, q_lo, m_i, l_i, acc, ckv_ptr, crope_ptr, csc_ptr, bt_ptr + b * s_bt, idx_ptr + b * s_idx,
            n_c, n_comp, (split + n_split - n_wt % n_split) % n_split, n_split,
            s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, epb, max_blocks, qk_scale,
            FMT, D, NOPE, NCH, MODE, PREC, NATIVE, BLOCK_N)

    if FUSED:
        out = with_sink(acc, m_i, l_i, sinks_ptr, h, hmask)
        tl.store(out_ptr + b * s_ob + h[:, None] * s_oh + d, out, mask=hmask[:, None] & (d < D))
    else:
        part = out_ptr + b * s_ob + split * s_os + h[:, None] * s_oh + d
        if NORM_PART:   # acc / l as fp16 (0 where the split saw no key): half the partial bytes
            tl.store(part, (acc * tl.where(l_i > 0.0, 1.0 / l_i, 0.0)[:, None]).to(tl.float16), mask=hmask[:, None])
        else:
            tl.store(part, acc, mask=hmask[:, None])
        ml = pml_ptr + ((b * n_split + split) * H + h) * 2
        tl.store(ml, m_i, mask=hmask)
        tl.store(ml + 1, l_i, mask=hmask)


def decode_attention(q: torch.Tensor, swa: Views, kv_fmt: EntryFormat, swa_pos: torch.Tensor,
                     request_slots: torch.Tensor, positions: torch.Tensor, window: int,
                     kv_views: Views | None, block_table: torch.Tensor | None, epb: int,
                     indices: torch.Tensor | None, num_entries: torch.Tensor | None, max_entries: int,
                     sinks: torch.Tensor, scale: float, *, precision: str | None = None,
                     block_h: int | None = None, block_n: int | None = None, num_splits: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     split_keys: int | None = None, scheme: str | None = None,
                     score_block_n: int | None = None, score_warps: int | None = None,
                     score_splits: int | None = None, value_block_n: int | None = None,
                     value_block_d: int | None = None, value_warps: int | None = None,
                     value_splits: int | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                     out_dtype: torch.dtype | None = None, q_norm: float | None = None) -> torch.Tensor:
    """Attention of one query token per request over its window ring and compressed entries.

    Keys: the ring rows with t - W < pos <= t (this step's token already written), then either
    the selected entries `indices` [B, K] (CSA, -1 = masked) or the first num_entries[b] entries
    (HCA; max_entries is the static bound), or none (SWA).
    Args:
        q: [B, H, D] float (bf16 is read as is where the dots take bf16 operands, else as fp32);
        sinks: [H]; swa: ring region views {name: [R, W, bytes]};
        swa_pos: [R, W] int32; request_slots, positions: [B] int; block_table: [B, max_blocks].
        precision: "ieee" | "tf32x3" | "bf16" | "bf16x2" (default: ieee for fp32 entries, else bf16).
        block_h, block_n, num_splits, num_warps, num_stages: heads per program, keys per tile, key
        splits per (request, head block), warps, pipeline depth (tuning; defaults per device).
        split_keys: the default num_splits gives each split at least this many keys (SPLIT_KEYS).
        scheme: "fused" (the kernel below), "halves" (`decode_attention_halves`), "two_pass"
        (`decode_attention_2p`) or "wide" (`decode_attention_wide`: fp8_ds, 64 heads, sm_90); default:
        see `_scheme`. block_n, num_warps, num_splits are also the
        halves scheme's keys per tile, warps and key splits per request;
        score_block_n, score_warps, score_splits: the two-pass pass 1 keys per tile, warps, key splits per
        request; value_block_n, value_block_d, value_warps, value_splits: its pass 2 keys per tile,
        value channels per program, warps, key splits (> 1: atomic adds, deterministic only at 2).
        block_h, split_keys apply to the fused kernel only.
        rope: (cos, sin) [B, r/2]: return RoPE_{-t}(o) (applied by the split combine or the two-pass
        scheme's pass 2; by `norm_rope` after a one-split fused kernel); out_dtype: the output's
        dtype (default fp32).
        q_norm: q is then the raw up-projection: the attention takes RoPE_t(RMSNorm_1(q)) (eps q_norm,
        rope's cos / sin), rounded to bf16 for bf16 operands (`norm_rope(..., out_dtype=)`'s rounding).
        The fused kernel rotates its heads where it loads them and scales their scores by the norm's
        1 / rms (RoPE and q . k are linear in q; no kernel before it): its bf16 operand is the rotated
        raw row, whose unrotated channels a bf16 q holds exactly, not the rounded normalised row. The
        other schemes run `norm_rope` first.
    Returns:
        [B, H, D] out_dtype.
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
    prec = precision_id(precision, "ieee" if kv_fmt.name == "fp32" else "bf16")
    if q_norm is not None and rope is None:
        raise InputError("q_norm rotates q: it needs rope=(cos, sin) of the tokens' positions")
    if bsz == 0:
        return torch.empty(bsz, heads, dim, dtype=out_dtype or torch.float32, device=q.device)
    cuda = q.device.type == "cuda"
    nch = triton.next_power_of_2(triton.cdiv(dim, 64))
    ring = swa_pos.shape[1]
    n_comp = 0 if mode == 0 else (indices.shape[1] if mode == 1 else max_entries)
    wt = kv_fmt.typed(swa)
    ct = kv_fmt.typed(kv_views) if kv_views is not None else wt
    wkv, ckv = (wt["nope"], ct["nope"]) if kv_fmt.name == "fp8_ds" else (wt["kv"], ct["kv"])
    wrope, crope = (wt["rope"], ct["rope"]) if kv_fmt.name == "fp8_ds" else (wkv, ckv)
    wsc, csc = (wt["scale"], ct["scale"]) if kv_fmt.name == "fp8_ds" else (wkv, ckv)
    if kv_fmt.name == "fp8_ds" and any(t.data_ptr() % 8 or t.stride(0) % 8 or t.stride(1) % 8 for t in (wsc, csc)):
        raise InputError("fp8_ds scale views must start and step on 8-byte boundaries (the kernels read each "
                         "entry's scale bytes as one word), as the pool's regions do")
    bt = block_table if block_table is not None else swa_pos
    idx = indices if indices is not None else swa_pos
    nent = num_entries if num_entries is not None else request_slots
    # bf16 operands: a bf16 q is the operand as is (no conversion kernels); else fp32
    q = q.contiguous() if prec == 1 and q.dtype == torch.bfloat16 else q.float().contiguous()
    keys = (wkv, wrope, wsc, ckv, crope, csc)
    if scheme is None:
        scheme = _scheme(bsz, heads, nch, prec, cuda, block_h is None and num_splits is None, n_comp)
        if scheme == "halves" and dw is not None and dw.supported(q, keys, dim, kv_fmt.dim - kv_fmt.rope_dim,
                                                                   kv_fmt.name):
            scheme = "wide"     # measured faster wherever halves is the default (`_scheme`)
    if scheme not in SCHEMES:
        raise InputError(f"scheme={scheme!r} is not one of {SCHEMES}")
    if q_norm is not None and scheme != "fused":
        q = norm_rope(q, None, q_norm, *rope, out_dtype=torch.bfloat16 if prec == 1 else torch.float32)
    meta = (swa_pos, request_slots, positions, bt, idx, nent)
    strides = (*rows(wkv), *rows(wrope), *rows(wsc), swa_pos.stride(0),
               *rows(ckv), *rows(crope), *rows(csc), bt.stride(0), idx.stride(0))
    if scheme == "wide":
        nope = kv_fmt.dim - kv_fmt.rope_dim
        if dw is None or not dw.supported(q, keys, dim, nope, kv_fmt.name):
            raise InputError("the wide scheme takes fp8_ds entries of 448 + 64 channels (16-byte aligned rows) and "
                             "64 heads on an sm_90 GPU, with Triton 3.6 or later")
        tiles = triton.cdiv(ring, dw.BLOCK_N) + triton.cdiv(n_comp, dw.BLOCK_N)
        # the halves scheme's split rule, its tiles counted in its 32 keys (H200, HCA 1M B = 4, µs, wide
        # at 16 / 33 splits: 52.4 / 37.7; the rule on 64-key tiles gave 16)
        tiles32 = triton.cdiv(ring, 32) + triton.cdiv(n_comp, 32)
        splits = max(1, min(num_splits or dh.default_splits(sm_count(q.device), bsz, tiles32, n_comp), tiles))
        part, pml = dw.value_wide(q, keys, meta, strides, ring, window, epb, bt.shape[-1], n_comp, scale * LOG2E,
                                  dim=dim, nope=nope, mode=mode, splits=splits)
        return combine(part, pml, sinks, rope, out_dtype, dim, nch, cuda)
    if scheme == "halves":
        if prec != 1 or nch % 2:
            raise InputError(f"the halves scheme takes bf16 operands and an even number of 64-channel chunks; "
                             f"got precision={precision!r}, D {dim}")
        hbn, hwarps = dh.halves_tiles(cuda)
        part, pml = dh.value_halves(q, keys, meta, strides, ring, window, epb, bt.shape[-1], n_comp, scale * LOG2E,
                                    dim=dim, nope=kv_fmt.dim - kv_fmt.rope_dim, nch=nch, fmt=_MAIN_FMT[kv_fmt.name],
                                    mode=mode, native=cuda, block_n=block_n or hbn, warps=num_warps or hwarps,
                                    splits=num_splits)
        return combine(part, pml, sinks, rope, out_dtype, dim, nch, cuda)
    out = torch.empty(bsz, heads, dim, dtype=torch.float32, device=q.device)
    if scheme == "two_pass":
        sbn, swarps, vbn, vdv, vwarps = _two_pass_tiles(nch, cuda)
        sms = sm_count(q.device) if cuda else 0
        splits = score_splits or (max(1, sms // bsz) if cuda else 2)   # one wave of pass-1 programs
        vsplits = value_splits or ((2 if bsz * (nch * 64 // (value_block_d or vdv)) < sms else 1) if cuda else 2)
        if vsplits == 1 and out_dtype is not None:     # one split stores: straight into out_dtype
            out = torch.empty(bsz, heads, dim, dtype=out_dtype, device=q.device)
        tp.two_pass(out, q, sinks, keys, meta, strides,
                    ring, window, epb, bt.shape[-1], n_comp, scale * LOG2E,
                    dim=dim, nope=kv_fmt.dim - kv_fmt.rope_dim, nch=nch, fmt=_MAIN_FMT[kv_fmt.name], mode=mode,
                    prec=prec, native=cuda, block_n=score_block_n or sbn, warps=score_warps or swarps,
                    splits=splits, block_nv=value_block_n or vbn, block_dv=value_block_d or vdv,
                    warps_v=value_warps or vwarps, value_splits=vsplits,
                    stages=num_stages or TWO_PASS_STAGES, rope=rope)
        return out if out_dtype is None else out.to(out_dtype)
    bh, bn, warps = _attention_tiles(heads, nch, prec, cuda)
    if cuda and prec in (1, 2) and nch >= 8 and bsz * triton.cdiv(heads, bh) >= sm_count(q.device):
        bn, warps = 16, 4   # enough programs to fill the GPU: two 4-warp programs per SM hide more latency
    elif (cuda and (bn, warps) == (32, 8)
          and all(k is None for k in (block_h, block_n, num_warps, num_splits, split_keys))):
        bn = _tile_keys(ring, n_comp, bsz * triton.cdiv(heads, bh), sm_count(q.device))
    bh, bn, warps = block_h or bh, block_n or bn, num_warps or warps
    n_hb = triton.cdiv(heads, bh)
    tiles = triton.cdiv(ring, bn) + triton.cdiv(n_comp, bn)
    if num_splits is None:
        num_splits = fused_splits(tiles * bn, bsz * n_hb, sm_count(q.device), split_keys) if cuda else 1
    n_split = max(1, min(num_splits, tiles))

    if n_split == 1:
        part, pml, s_split = out, out, 0
    else:
        # fp8_ds values are fp16-exact (scales up to 2^7, `key_operand`), so their convex combination
        # acc / l is held by fp16: half the partial bytes written here and read by the combine
        pdt = torch.float16 if kv_fmt.name == "fp8_ds" else torch.float32
        part = torch.empty(bsz, n_split, heads, nch * 64, dtype=pdt, device=q.device)
        pml = torch.empty(bsz, n_split, heads, 2, dtype=torch.float32, device=q.device)
        s_split = part.stride(1)
    # (cos, sin, eps) of the in-kernel q norm (unused otherwise)
    qn = (rope[0].float().contiguous(), rope[1].float().contiguous(), q_norm) if q_norm is not None else (q, q, 0.0)
    k = _decode_attn_kernel[(n_hb, bsz, n_split)](
        q, sinks, part, pml, wkv, wrope, wsc, swa_pos, request_slots, positions,
        ckv, crope, csc, bt, idx, nent,
        q.stride(0), q.stride(1), part.stride(0), s_split, part.stride(-2), *strides,
        ring, window, epb, bt.shape[-1], n_comp, scale * LOG2E, *qn,
        H=heads, BLOCK_H=bh, D=dim, NOPE=kv_fmt.dim - kv_fmt.rope_dim, NCH=nch,
        FMT=_MAIN_FMT[kv_fmt.name], MODE=mode, PREC=prec, NATIVE=cuda, BLOCK_N=bn, FUSED=n_split == 1,
        NORM_PART=part.dtype == torch.float16,
        QNORM=q_norm is not None, HALF_R=rope[0].shape[-1] if q_norm is not None else 0,
        num_warps=warps, **({"num_stages": num_stages or NUM_STAGES} if cuda else {}), **pdl_launch(q.device))
    note_compile("decode_attention", k)
    if n_split == 1:
        return _finish(out, rope, out_dtype)
    return combine(part, pml, sinks, rope, out_dtype, dim, nch, cuda)


#: the fused kernel's 64-key tiles from this many keys a request (CSA's top-k alone) ...
TILE64_MIN_KEYS = 512


def _tile_keys(ring: int, n_comp: int, programs: int, sms: int) -> int:
    """Keys a tile of the fused kernel at 16 heads x 8 warps: 64 where a request has TILE64_MIN_KEYS
    keys or more and a split of one 64-key tile each still runs as one wave at one program an SM
    (178 registers and 144 KB of shared memory with the q norm inside, sm_90), else 32. One tile a
    split is the shortest chain of index loads, key bytes and dots a split can have.

    H100, `benchmarks/ab_run.sh`, two rounds, layer BF16 / FP8 weights, µs, 32 -> 64 keys: CSA (640
    keys) 128K B = 1 124.1 / 87.8 -> 123.6 / 87.6, B = 2 139.4 / 105.3 -> 137.2 / 103.5, 8K B = 1
    123.4 / 84.0 -> 120.9 / 83.6, B = 2 129.2 / 95.8 -> 127.0 / 93.9; HCA 128K B = 1 (1,152 keys)
    97.2 / 63.5 -> 96.4 / 62.4. Not taken: HCA 128K B = 2 (144 programs: two waves) 114.9 / 86.8 ->
    116.5 / 86.7; HCA 8K (192 keys) B = 2 108.3 / 76.2 -> 109.2 / 77.5, B = 1 even."""
    n64 = triton.cdiv(ring, 64) + triton.cdiv(n_comp, 64)
    return 64 if n64 * 64 >= TILE64_MIN_KEYS and programs * n64 <= sms else 32


def fused_splits(keys: int, programs: int, sms: int, split_keys: int | None = None) -> int:
    """Default key splits of the fused kernel over `keys` (tiles padded) for `programs` (request, head
    block) pairs on `sms` SMs: fill two programs an SM at small batch, each split keeping split_keys
    keys (default: SHORT_SPLIT_KEYS where that stays within the combine's unrolled splits, else
    SPLIT_KEYS), so that the partials stay cheap."""
    per = split_keys or (SHORT_SPLIT_KEYS if triton.cdiv(keys, SHORT_SPLIT_KEYS) <= UNROLL_SPLITS else SPLIT_KEYS)
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(keys, per)))


def _finish(out: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
            out_dtype: torch.dtype | None) -> torch.Tensor:
    """The inverse rotation and output dtype, where no combine kernel applied them."""
    if rope is not None:
        return norm_rope(out, None, 0.0, *rope, normalize=False, inverse=True, out_dtype=out_dtype)
    return out if out_dtype is None else out.to(out_dtype)


def _attention_tiles(heads: int, nch: int, prec: int, cuda: bool) -> tuple[int, int, int]:
    """Default (BLOCK_H, BLOCK_N, num_warps) of decode_attention.

    From sm_90 compiles (ptxas, num_stages 1 as launched): D 512 bf16 operands with 16 heads and 8
    warps fit without spills at 32 keys (128 registers) and at 64 keys (180); 32 heads x 32 keys
    fit too (177) but measured slower at B = 1 (H200, 128K: CSA 13.9 vs 11.1 µs, HCA 15.2 vs 12.5;
    B = 4 CSA 14.2 vs 15.2, HCA 25.5 vs 22.7); 64 heads spill (255 registers, 25.6 µs at B = 1).
    64 keys: faster in tune_decode (CSA 21.1 vs 24.1 µs, HCA 24.8 vs 27.2) but in `dsv4 bench`,
    the session's first code and this alternating on one H200, the HCA attention at B = 1 took
    24.7-24.8 µs vs 22.2-22.7 at 32 keys (the layer 122.0 vs 119.3; CSA unchanged): 32 stays.
    With enough (request, head block) programs to fill the GPU the caller switches to 16 keys x 4
    warps (H200, B = 64: CSA 190 µs vs 210, HCA 303 vs 341; at B = 1 it loses: 29 vs 23 µs). The fp32 FMA dots
    of "ieee"/"tf32x3" spill at D 512 for any tile (validation formats: correct, slow). The CPU
    interpreter wants few, small tiles.
    From 4 requests of 64 heads (or one with many entries) the halves scheme replaces this kernel
    (`_scheme`): its 64 heads per program dequantise each key twice instead of 4 times, 3.4x
    faster at B = 64.
    """
    if not cuda:
        return max(16, min(64, triton.next_power_of_2(heads))), 16, 4
    if prec in (0, 3):
        return 16, 16, 8
    if nch >= 8:
        return 16, 32, 8
    return max(16, min(64, triton.next_power_of_2(heads))), 32, 4


#: software-pipelining depth of both passes: 1, the loops pipeline their loads by hand (Triton's
#: 2 / 3 measured slower: H200, B = 64 CSA 140 / 139 µs vs 107)
TWO_PASS_STAGES = 1
#: the fused kernel below this many (request, head) pairs on CUDA, the halves scheme from it ...
MANY_ROWS = 4 * 64
#: ... or from this many compressed keys a request (HCA at 1M: 8,192 entries)
LONG_KEYS = dh.LONG_KEYS
SCHEMES = ("fused", "halves", "two_pass", "wide")


def _scheme(bsz: int, heads: int, nch: int, prec: int, cuda: bool, no_fused_knobs: bool, n_comp: int = 0) -> str:
    """Default scheme: on CUDA the halves scheme for bf16 operands at D 512 from 4 requests of 64
    heads or from LONG_KEYS compressed keys a request, else the fused kernel; the CPU interpreter
    takes the halves scheme (bf16 operands) or the two-pass one whenever no fused-kernel knob is
    given, so the tests cover all three.

    H200, Triton 3.6, context 128K, CUDA-graph replays with L2 flushed: the halves scheme against
    the two-pass one (the default before it), µs: B = 64 CSA 77.6 -> 55.1, HCA 105.3 -> 74.0;
    B = 16 CSA 35.6 -> 27.6, HCA 47.4 -> 31.9; B = 8 CSA 33.8 -> 23.0, HCA 43.8 -> 25.4. The
    two-pass scheme against the fused kernel, for the record: B = 64 CSA 190 -> 91 µs, HCA 302 -> 124.
    Below 8 requests, since the fp16 operands and the small-grid combine (H200, the op with its
    combine, `tune_decode.py --only attention`), halves / fused µs: B = 4 128K CSA 19.6 / 21.0,
    HCA 24.6 / 28.7, 1M HCA 48.2 / 126.2; B = 2 128K CSA 16.0 / 16.5, HCA 20.3 / 20.0, 1M HCA
    38.5 / 52.9; B = 1 128K CSA 15.0 / 15.6, HCA (1,024 entries) 17.9 / 16.5, 1M HCA (8,192)
    37.5 / 43.4. The whole layer (`benchmarks/ab_run.sh`, 2 rounds, H200), µs, fused -> halves:
    HCA 1M B = 4 200.7 -> 125.6, B = 2 130.4 -> 117.4, B = 1 112.4 -> 110.8; CSA 128K B = 4
    146.6 -> 143.7; but HCA 128K B = 2 97.6 -> 99.1 and CSA 128K B = 1 113.5 -> 114.5 (the op
    0.6 µs faster): hence 4 requests, or one long one.

    On sm_90 with fp8_ds entries and 64 heads `decode_attention` takes the wide scheme wherever this
    picks halves (`decode_attention_wide`; H200, the op with its combine, halves / wide µs: 128K
    B = 64 CSA 60.4 / 42.9, HCA 80.2 / 59.3; B = 16 CSA 30.6 / 26.2, HCA 35.3 / 30.4; B = 4 CSA
    19.9 / 17.7, HCA 24.7 / 20.0; one long request, HCA 1M B = 1 29.9 / 28.0, B = 2 36.7 / 32.8,
    B = 4 47.7 / 37.7; the wide scheme's first, one-program form). Its warp-specialised form, the
    same harness (fp32 q): 128K B = 64 CSA 43.2, HCA 54.7; B = 16 CSA 25.9, HCA 28.4; B = 4 CSA
    18.8, HCA 20.4; HCA 1M B = 1 26.7, B = 2 29.1, B = 4 34.9. CSA below 4 requests keeps the fused
    kernel (B = 1, µs, fused / halves / one-program wide: 15.6 / 15.0 / 16.5).
    """
    if not cuda:
        return ("halves" if prec == 1 and nch % 2 == 0 else "two_pass") if no_fused_knobs else "fused"
    many = bsz * heads >= MANY_ROWS or n_comp >= LONG_KEYS
    return "halves" if prec == 1 and nch >= 8 and nch % 2 == 0 and many else "fused"


def _two_pass_tiles(nch: int, cuda: bool) -> tuple[int, int, int, int, int]:
    """Default (score BLOCK_N, score warps, value BLOCK_N, value DV, value warps) of the two-pass scheme.

    sm_90 compiles (benchmarks/compile_report.py style, num_stages 1): pass 1 at 32 keys x 8 warps
    205 registers, 96 KB shared (q [64, 512] bf16 + the key tile), no spills, 1 program per SM,
    hence score splits = SMs // B (one wave; B = 64: 2 splits 90 µs vs 3: 102, 4: 95, 5: 105);
    32 keys x 4 warps spills. Pass 2 at 32 keys x 128 channels x 4 warps: 246 registers, no spills;
    DV 64 / 256, 16 / 64 keys, 8 warps were all slower at B = 64 (e.g. CSA 117, 106, 128, 116 µs).
    Value splits (atomic adds into a zeroed out, deterministic at 2) pay below ~1 wave of pass-2
    programs: B = 16 CSA 57 -> 48 µs at 2; at B = 64 they cost (105 -> 113).
    """
    if not cuda:
        return 16, 4, 16, min(128, nch * 64), 4
    return 32, 8, 32, 128, 4
