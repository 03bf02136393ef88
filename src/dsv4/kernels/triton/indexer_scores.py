"""Triton twin of `reference.decode.paged_indexer_scores`: the indexer scan of a decode step.

    grid (B, P): program p scans key tiles p, p+P, ... of its request with q [H, D_I] loaded once;
    a tile at or past num_entries[b] only stores -inf, so the cost follows each request's context,
    not max_entries. Per tile: S[H, N] = q . K^T on tensor cores, then sum_h w_h ReLU(S).

Keys are read straight from the paged pool through the block table and dequantised in
registers; nothing is gathered into a temporary. The grid depends only on static sizes and
bounds are device-side: capturable in a CUDA graph.

In this module's kernel (scan=False; fp8, bf16 and fp32 keys, ieee / tf32x3 precision), E2M1 keys
(mxfp4, nvfp4) stay split in even/odd elements (low/high nibbles): q is loaded as
q[:, 0::2] and q[:, 1::2] and two dots replace the interleave. Two decodes of a nibble (DECODE):
    0  fp16 bits (sign << 15 | magnitude << 9) = value * 2^-14, to fp32, times the scale
    1  e4m3 bits (sign << 7 | magnitude << 2) = value * 2^-6, the hardware fp8 -> fp32
       conversion, times the scale
Both are exact. mxfp4 scales are read as 2^(byte - 127 + 14) (resp. + 6): bytes near 255
(|key| >= 2^113) overflow, byte 0 (never written) is not 0. Per-key fp32 factors (fp8's scale,
nvfp4's global scale) multiply the dot's result instead of the keys.

Fast path: E2M1 keys (mxfp4, nvfp4) at bf16 / bf16x2 run `indexer_scan._indexer_scan_kernel`
(keys as the dot's register operand, words decoded in element order, loads pipelined by hand):
H200, 128K, bf16x2: B = 64 462 -> 239 µs, B = 1 22.0 -> 11.5 µs, same accuracy (3.0e-6 vs 2.8e-6
max relative error against fp32; top-512 overlap with the fp32 reference 1.0000 for both).
scan=False forces the kernel below.
From TMA_TILES 64-key tiles in the batch, mxfp4 keys at "bf16" on sm_90 (64 keys a page) run
`indexer_scan_tma` instead: pages copied by the tensor memory accelerator two tiles ahead, keys
decoded straight into the MMA's register operand (H100, 128K: B = 64 108.6 µs against 132.9,
B = 16 34.4 against 39.2).

Precision: see `decode_common`. Defaults (DEFAULT_PRECISION): "bf16" for mxfp4 and bf16 keys,
whose queries arrive rounded to the keys' format (`EntryFormat.round_query`; DeepSeek-V4 scores FP4
queries against FP4 keys), so both operands are exact in bf16 and one dot gives the scores to fp32
rounding; "bf16x2" (q split into two bf16 parts: ~3e-6 relative) for fp8 and nvfp4 keys, whose
rounded queries keep an fp32 scale; "ieee" for fp32 keys. An unrounded query at "bf16" carries
bf16's ~2e-3 relative error into the scores, enough to move near-tied top-k picks.
Measurements: benchmarks/NOTES.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.cache.formats import EntryFormat
from dsv4.errors import FormatError, InputError
from dsv4.kernels.triton import indexer_scan, indexer_scan_tma
from dsv4.kernels.triton.decode_common import (
    Views,
    dot_prec,
    locate,
    note_compile,
    precision_id,
    sm_count,
    split_operand,
)

_IDX_FMT = {"fp32_i": 0, "bf16_i": 1, "fp8": 2, "mxfp4": 3, "nvfp4": 4}
_FP8: tl.constexpr = tl.constexpr(2)
_MXFP4: tl.constexpr = tl.constexpr(3)
_NVFP4: tl.constexpr = tl.constexpr(4)
#: default precision per key format. mxfp4 and bf16 keys take queries rounded to their own format
#: (`EntryFormat.round_query`, which `Indexer.queries` applies): both operands are then exact in bf16
#: and one bf16 dot with fp32 accumulation gives the scores to fp32 rounding. fp8 / nvfp4 queries
#: carry an fp32 scale that bf16 does not hold: bf16x2. fp32 keys: ieee.
#: the scan's programs per SM: 16 from this many key tiles in the batch (32 requests at 128K), ...
SCAN_MANY_TILES = 16384
#: ... 4 from this many (4 requests at 128K, or one at 512K), else 2
SCAN_SOME_TILES = 2048
#: the TMA scan (`indexer_scan_tma`) from this many 64-key tiles in the batch. H100, 128K, TMA / pointer
#: scan µs: B = 64 108.6 / 132.9, B = 16 34.4 / 39.2, B = 8 (4,096 tiles) 21.5 / 23.3, B = 4 15.5 / 15.6,
#: B = 1 9.5 / 9.3
TMA_TILES = 4096
#: its int8 MMA from this many tiles (below, the int8 queries' kernel costs more than it saves). H100,
#: 128K, int8 / bf16 µs: B = 64 94.7 / 98.5, B = 16 33.0 / 32.0, B = 8 21.7 / 20.5
TMA_INT8_TILES = 16384
#: group maxima a row the pointer scan keeps for the top-k's filter where asked (`group_max`): its
#: programs' slots folded to a power of two each, so a row gets SCAN_GROUPS / 2 .. SCAN_GROUPS of them
#: (the filter's bound wants FILTER_GROUPS x k = 2,048 at k = 512, and takes up to GIVEN_GROUPS_MAX)
SCAN_GROUPS = 4096
DEFAULT_PRECISION = {"mxfp4": "bf16", "bf16_i": "bf16", "fp8": "bf16x2", "nvfp4": "bf16x2", "fp32_i": "ieee"}


@triton.jit
def _e2m1(code, DECODE: tl.constexpr):
    """E2M1 code (int32 0..15) -> value * 2^-14 (DECODE 0) or value * 2^-6 (DECODE 1), fp32, exact."""
    if DECODE == 0:
        bits = ((code & 8) << 12) | ((code & 7) << 9)
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        bits = ((code & 8) << 4) | ((code & 7) << 2)
        return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _indexer_scores_kernel(
        q_ptr, w_ptr, out_ptr, data_ptr, scale_ptr, glob_ptr, bt_ptr, nent_ptr,
        s_qb, s_qh, s_wb, s_ob, s_dp, s_dr, s_sp, s_sr, s_gp, s_gr, s_bt,
        num_tiles, max_entries, epb, max_blocks, out_scale, w_scale,
        FMT: tl.constexpr, PREC: tl.constexpr, NATIVE: tl.constexpr, H: tl.constexpr,
        BLOCK_H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, GS: tl.constexpr, BLOCK_N: tl.constexpr,
        DECODE: tl.constexpr, UNIT: tl.constexpr, UNIT_MUL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    hmask = h < H
    wts = tl.load(w_ptr + b * s_wb + h, mask=hmask, other=0.0).to(tl.float32) * w_scale
    q_row = q_ptr + b * s_qb + h[:, None] * s_qh
    if FMT >= _MXFP4:   # packed E2M1: byte j holds elements 2j (low nibble) and 2j+1
        j = tl.arange(0, D // 2)[None, :]
        qe_hi, qe_lo = split_operand(tl.load(q_row + 2 * j, mask=hmask[:, None], other=0.0), PREC)
        qo_hi, qo_lo = split_operand(tl.load(q_row + 2 * j + 1, mask=hmask[:, None], other=0.0), PREC)
    else:
        d = tl.arange(0, D_PAD)[None, :]
        q_hi, q_lo = split_operand(tl.load(q_row + d, mask=hmask[:, None] & (d < D), other=0.0), PREC)
    n_b = tl.minimum(tl.load(nent_ptr + b), max_entries)
    for tile in range(tl.program_id(1), num_tiles, tl.num_programs(1)):
        offs = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if tile * BLOCK_N < n_b:
            valid = offs < n_b
            page, row = locate(bt_ptr + b * s_bt, offs, valid, epb, max_blocks)
            v3 = valid[:, None, None]
            if FMT >= _MXFP4:
                g = tl.arange(0, D // (2 * GS))[None, :, None]
                jj = tl.arange(0, GS)[None, None, :]
                base = data_ptr + page[:, None, None] * s_dp + row[:, None, None] * s_dr
                byte = tl.load(base + g * GS + jj, mask=v3, other=0).to(tl.int32)
                sp = scale_ptr + page[:, None, None] * s_sp + row[:, None, None] * s_sr + g
                if FMT == _MXFP4:   # UE8M0 byte e+127 -> 2^e * 2^UNIT (undoes _e2m1's 2^-UNIT)
                    sc = ((tl.load(sp, mask=v3, other=0).to(tl.int32) + UNIT) << 23).to(tl.float32, bitcast=True)
                else:               # e4m3 group scale; the fp32 global scale multiplies the dot below
                    sc = tl.load(sp, mask=v3, other=0.0).to(tl.float32) * UNIT_MUL
                k_lo = tl.reshape(_e2m1(byte & 15, DECODE) * sc, [BLOCK_N, D // 2]).to(qe_hi.dtype)
                k_hi = tl.reshape(_e2m1(byte >> 4, DECODE) * sc, [BLOCK_N, D // 2]).to(qe_hi.dtype)
                s = (dot_prec(qe_hi, qe_lo, tl.trans(k_lo), PREC, NATIVE)
                     + dot_prec(qo_hi, qo_lo, tl.trans(k_hi), PREC, NATIVE))
            else:
                dk = tl.arange(0, D_PAD)[None, :]
                kp = data_ptr + page[:, None] * s_dp + row[:, None] * s_dr + dk
                k = tl.load(kp, mask=valid[:, None] & (dk < D), other=0.0).to(tl.float32).to(q_hi.dtype)
                s = dot_prec(q_hi, q_lo, tl.trans(k), PREC, NATIVE)
            if FMT == _FP8 or FMT == _NVFP4:   # per-key fp32 scale
                s = s * tl.load(glob_ptr + page * s_gp + row * s_gr, mask=valid, other=0.0)[None, :]
            score = tl.sum(tl.maximum(s, 0.0) * wts[:, None], axis=0) * out_scale
            score = tl.where(valid, score, float("-inf"))
        else:
            score = tl.full([BLOCK_N], float("-inf"), tl.float32)
        tl.store(out_ptr + b * s_ob + offs, score, mask=offs < max_entries)


def paged_indexer_scores(q: torch.Tensor, weights: torch.Tensor, idx_views: Views, fmt: EntryFormat,
                         block_table: torch.Tensor, num_entries: torch.Tensor, max_entries: int, epb: int,
                         weight_scale: float = 1.0, **tuning) -> torch.Tensor:
    """The reference's op: the scores of `scores_and_maxima` (tuning: its keyword arguments)."""
    return scores_and_maxima(q, weights, idx_views, fmt, block_table, num_entries, max_entries, epb, weight_scale,
                             **tuning)[0]


def scores_and_maxima(q: torch.Tensor, weights: torch.Tensor, idx_views: Views, fmt: EntryFormat,
                      block_table: torch.Tensor, num_entries: torch.Tensor, max_entries: int, epb: int,
                      weight_scale: float = 1.0, *, precision: str | None = None, block_n: int | None = None,
                      num_programs: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, decode: int = 0, scan: bool | None = None,
                      prefetch: bool = True, keys_m: bool = True, tma: bool | None = None,
                      tma_stages: int = indexer_scan_tma.STAGES, tma_maxnreg: int | None = None,
                      tma_int8: bool | None = None,
                      group_max: bool = False, min_groups: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """I[b, w] = sum_h weights[b, h] * ReLU(q[b, h] . K_b[w]) * D_I^-1/2 over each request's keys.

    Args:
        q: [B, H, D_I] fp32 in the keys' stored basis; weights: [B, H] any float dtype, any row
            stride (the layer's weights_proj columns, read in place); g = weights.float() * weight_scale
            in the kernel, as the reference computes it: no conversion kernel before the scan.
        idx_views: the indexer pool's region views {name: [num_blocks, epb, bytes] uint8}.
        block_table: [B, max_blocks] int32; num_entries: [B] int (visible entries).
        max_entries: static width N of the output; epb: entries per block.
        precision: "ieee" | "tf32x3" | "bf16" | "bf16x2" (default: DEFAULT_PRECISION[fmt.name]; its
            "bf16" is exact only for queries rounded by `fmt.round_query`).
        block_n, num_programs, num_warps, num_stages, decode: tile of keys, programs per request,
            warps, pipeline depth, E2M1 decode variant (tuning).
        scan, prefetch, keys_m: E2M1 keys (mxfp4, nvfp4) at bf16 / bf16x2 run `indexer_scan` (keys on
            the dot's M side, hand-pipelined loads; decode is then unused) unless scan=False (tuning).
        tma, tma_stages: mxfp4 keys at "bf16" on sm_90 with 64 keys a page run `indexer_scan_tma`
            (pages in flight through the tensor memory accelerator) unless tma=False; tma=True where
            it cannot run raises; by default it runs from TMA_TILES key tiles in the batch.
            tma_stages, tma_maxnreg: its pages in flight, its registers a thread (tuning; by default
            `indexer_scan_tma.MAXNREG` or `MAXNREG_INT8`).
            tma_int8: its int8 MMA where the keys and queries fit it exactly (else its bf16 one); by
                default from TMA_INT8_TILES key tiles in the batch.
        group_max: where the TMA scan or the pointer scan runs, also the maxima of disjoint groups of
            each row's scores (the top-k filter's bound: `topk.topk_smaller_index(group_max=...)`);
            min_groups: only where the scan keeps at least this many a row (else none, and None).
    Returns:
        ([B, N] fp32, -inf at w >= num_entries[b]; [B, G] int32 group maxima as the top-k's keys, or
        None where neither scan ran or group_max is False).
    """
    if fmt.name not in _IDX_FMT:
        raise FormatError(f"paged_indexer_scores reads indexer formats {tuple(_IDX_FMT)}, got {fmt.name!r}")
    bsz, heads, dim = q.shape
    if dim != fmt.dim or weights.shape != (bsz, heads):
        raise InputError(f"q must be [B, H, {fmt.dim}] and weights [B, H]; got {list(q.shape)}, {list(weights.shape)}")
    out = torch.empty(bsz, max_entries, dtype=torch.float32, device=q.device)
    if bsz == 0 or max_entries == 0:
        return out, None
    prec = precision_id(precision, DEFAULT_PRECISION[fmt.name])
    cuda = q.device.type == "cuda"
    # sm_90 compile (H 64, D_I 128): bf16x2 BLOCK_N 64 / 4 warps ~120 registers, no spill (H200:
    # 4 warps 1.5-1.8x faster than 8); the fp32 FMA dot of "ieee" needs BLOCK_N 16 and 8 warps to
    # stay spill-free. Programs in all: ~4 per SM from B = 8 on (B = 64: 335 µs vs 402 µs at 2 per
    # SM, bf16), ~2 per SM below (B = 1: 22 µs vs 30 µs at 4 per SM, one tile each).
    bn = block_n or ((16 if prec == 0 else 64) if cuda else 16)
    tiles = triton.cdiv(max_entries, bn)
    per_sm = 4 if bsz >= 8 else 2
    nprog = num_programs or (min(tiles, max(1, triton.cdiv(per_sm * sm_count(q.device), bsz))) if cuda else 2)
    warps = num_warps or (8 if prec == 0 else 4)
    typed = fmt.typed(idx_views)
    data = typed["data"]
    scale = typed.get("scale", data)
    glob = typed.get("global", scale)          # fp8: the fp32 per-key scale; nvfp4: the global scale
    q = q.float().contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    tma_ok = scan is not False and indexer_scan_tma.supported(q, data, scale, fmt.name, epb, prec)
    if tma and not tma_ok:
        raise InputError("the TMA indexer scan takes mxfp4 keys at bf16, [B, 64, 128] queries, 64 keys a "
                         "page (its scale bytes right after its key bytes, as the pool stores them) and an "
                         "sm_90 GPU")
    total = bsz * triton.cdiv(max_entries, 64)
    if tma_ok and (tma or (tma is None and total >= TMA_TILES)):
        # programs per SM as the pointer scan's (16 from SCAN_MANY_TILES tiles, else 4): H100, 128K B = 64,
        # 4 / 8 / 12 / 16 / 24 per SM (sweep, NOTES.md thirty-second round)
        per_sm = 16 if total >= SCAN_MANY_TILES else 4
        tnp = num_programs or max(1, triton.cdiv(per_sm * sm_count(q.device), bsz))
        gmax = None
        nprog = indexer_scan_tma.programs_per_request(tnp, max_entries)
        if group_max and nprog * indexer_scan_tma.EPB >= min_groups:
            gmax = torch.empty(bsz, nprog * indexer_scan_tma.EPB, dtype=torch.int32, device=q.device)
        k = indexer_scan_tma.launch(q, weights, out, data, scale, block_table, num_entries, max_entries,
                                    weight_scale, tnp, stages=tma_stages,
                                    maxnreg=tma_maxnreg,
                                    int8=total >= TMA_INT8_TILES if tma_int8 is None else tma_int8, gmax=gmax)
        note_compile("indexer_scores", k)
        return out, gmax
    if scan is not False and indexer_scan.scan_supported(fmt.name, dim, data, scale, prec):
        sbn = block_n or (64 if cuda else 16)
        stiles = triton.cdiv(max_entries, sbn)
        # programs per SM by the batch's key tiles in all, so one long request scans as a batch of short
        # ones. H200, µs, 2 / 4 / 8 / 16 per SM (tune_decode --scan-sweep, NOTES.md twenty-ninth round):
        # 128K B = 2 11.0 / 11.2 / 12.8 / 12.9, B = 4 16.2 / 15.2 / 16.6 / 19.5, B = 8 25.3 / 23.2 / 24.3 / 27.1,
        # B = 16 54.6 / 38.6 / 39.8 / 42.6, 512K B = 1 16.2 / 15.4 / 16.7 / 19.6, B = 8 79.4 / 69.4 / 70.0 /
        # 71.9, 1M B = 1 25.6 / 23.5 / 24.3 / 27.2; 128K B = 64 (32,768 tiles) 16 per SM 238, 8 per SM 259
        total = bsz * stiles
        sper = 16 if total >= SCAN_MANY_TILES else (4 if total >= SCAN_SOME_TILES else 2)
        snp = min(stiles, num_programs or (max(1, triton.cdiv(sper * sm_count(q.device), bsz)) if cuda else 2))
        gmax = None
        slots = min(sbn, 1 << max(0, (SCAN_GROUPS // snp).bit_length() - 1))    # about SCAN_GROUPS a row
        if group_max and snp * slots >= min_groups:
            gmax = torch.empty(bsz, snp * slots, dtype=torch.int32, device=q.device)
        k = indexer_scan.launch_scan((bsz, snp), q, weights, out, data, scale, glob, block_table,
                                     num_entries, stiles, max_entries, epb, weight_scale, fmt_name=fmt.name, prec=prec,
                                     cuda=cuda,
                                     block_n=sbn, prefetch=prefetch, keys_m=keys_m,
                                     num_warps=num_warps or 4, num_stages=num_stages, gmax=gmax)
        note_compile("indexer_scores", k)
        return out, gmax
    extra = {"num_stages": num_stages} if num_stages else {}
    k = _indexer_scores_kernel[(bsz, min(nprog, tiles))](
        q, weights, out, data, scale, glob, block_table, num_entries,
        q.stride(0), q.stride(1), weights.stride(0), out.stride(0), data.stride(0), data.stride(1),
        scale.stride(0), scale.stride(1), glob.stride(0), glob.stride(1), block_table.stride(0),
        tiles, max_entries, epb, block_table.shape[1], dim ** -0.5, weight_scale,
        FMT=_IDX_FMT[fmt.name], PREC=prec, NATIVE=cuda, H=heads, BLOCK_H=max(16, triton.next_power_of_2(heads)),
        D=dim, D_PAD=triton.next_power_of_2(dim), GS=16 if fmt.name == "mxfp4" else 8, BLOCK_N=bn,
        DECODE=decode, UNIT=14 if decode == 0 else 6, UNIT_MUL=2.0 ** (14 if decode == 0 else 6),
        num_warps=warps, **extra)
    note_compile("indexer_scores", k)
    return out, None
