"""Indexer scan for E2M1 keys (mxfp4, nvfp4) with the keys on the M side of the tensor-core dot:
the default path of `indexer_scores.paged_indexer_scores` for them (precision bf16 / bf16x2).

    grid (B, P): program p scans key tiles p, p+P, ... of its request up to num_entries[b] only;
    a second loop writes -inf to its tiles past that (no key bytes read, no block-table lookups).

Per tile of BLOCK_N keys: S^T[N, H] = K[N, D] . q^T[D, H], the dequantised keys as the register
operand A of the wgmma and q^T (loaded once per program, bf16 hi + lo for bf16x2) as operand B in
shared memory, then score[n] = sum_h w_h ReLU(S^T[n, h]) * D^-1/2. Each key row is read as D/8
int32 words: nibble i of word j is element 8j + i (little-endian bytes, low nibble first), so
the decode is in element order and one K = D dot per q part replaces the previous kernel's
even/odd split (two dots per q part). Entries per block are a compile-time constant (block-table
column and row by shifts; -18% instructions in the loop).

PREFETCH (default): software pipelining by hand. Iteration t issues the block-table lookups of
tile t + 2P and the key / scale loads of tile t + P (whose page ids arrived an iteration ago)
before it decodes and multiplies tile t, so the dependent load chain overlaps the math.
SLOTS (where the top-k asks for group maxima, `indexer_scores.scores_and_maxima(group_max=True)`):
each program also keeps the maxima of SLOTS slots over its tiles (entry i of a tile in slot i mod
SLOTS) and stores them as the top-k's keys, so the filter's bound comes from them: at one row the
top-k's own maxima kernel and its memset leave the step (H100, CSA indexer 128K B = 1 23.1 ->
18.5 µs, 64K B = 4 25.2 -> 21.4; forty-fifth round).
KEYS_M=False: the previous orientation (q [H, D] in registers as operand A, K^T in shared
memory as B), kept for tuning.

Measured (H200, Triton 3.6, V4 shapes H 64, D 128, mxfp4, context 128K, bf16x2, CUDA-graph
replays; the previous kernel in the same runs: 462 µs at B = 64, 21.6-22.0 µs at B = 1):
B = 64 238.8 µs at 33 programs per request (259 at 17, 277 at 9), B = 8 38.6 µs (was 66.9),
B = 1 11.0-11.5 µs. Alternatives, B = 64 / B = 1: no prefetch 241.6 / 12.7 (at 17 programs per
request 275 vs 259: the hand pipelining matters less once more programs share an SM); BLOCK_N 128
259 / 11.8 (227 registers); KEYS_M=False, BLOCK_N 128, no prefetch 276 / 13.0; 8 warps slower
everywhere (478-670 at B = 64); num_stages 1 no effect; eight nibble planes joined with tl.join
(8 consecutive elements per thread) the same (256 / 11.0, removed). Single-bf16 dots only 8-13%
faster (208-226 µs): the loop is bound by the decode and by Triton's register-to-shared layout
conversion of the decoded tile (64 scalar 16-bit shared stores per thread per tile in the SASS,
~975 instructions per thread per tile), not by the MMAs. Both fixed since (sm_90 SASS of the
loop, per thread per tile: 784 -> 463 instructions, 20 -> 6 barriers, 162 -> 128 registers):
the scale bytes load as one word per key in the key words' layout (the tile is no longer
converted, 8 STS.128 instead of 64 STS.U16), and mxfp4 decodes through `_E2M1_PAIR_ASM`. H200
A/B, B = 64: scores + top-k 293.6 -> 258.5 -> 222.0 µs. Folding the key's 2^e_max into the
[N, H] dot output instead of the [N] score: 230.6 µs (its scale loads are repeated per layout).

No host reads of device data, grid from static sizes: capturable in a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.triton.decode_common import pdl_enter, pdl_launch

_MXFP4: tl.constexpr = tl.constexpr(3)
_NVFP4: tl.constexpr = tl.constexpr(4)


@triton.jit
def _locate(bt_row, w, valid, EPB: tl.constexpr, max_blocks):
    """`decode_common.locate` with entries per block a compile-time constant (w >= 0): shifts, not divisions."""
    col = tl.minimum(w // EPB, max_blocks - 1)
    blk = tl.load(bt_row + col, mask=valid, other=0)
    blk = tl.where(blk >= 0, blk, 0)
    return blk.to(tl.int64), w % EPB


@triton.jit
def _tile_loads(data_ptr, scale_ptr, glob_ptr, page, row, valid, s_dp, s_dr, s_sp, s_sr, s_gp, s_gr,
                FMT: tl.constexpr, NW: tl.constexpr, WPG: tl.constexpr, UNIT: tl.constexpr, UNIT_MUL: tl.constexpr,
                SCALE_T: tl.constexpr, ASM: tl.constexpr):
    """Key words [N, NW, 1] int32, their group scales [N, NW, 1] fp32 (times 2^UNIT) and the per-key
    fp32 global scale [N] (nvfp4; 1 for mxfp4) of one tile's keys.

    A key's group scales are one load of SCALE_T (all its scale bytes as one word), split per key
    word in the words' layout: a [N, NW, 1] load of the scale bytes gets a layout of its own (rows
    fastest), and the decoded tile would be converted to it, then stored to shared memory for the
    dot 16 bits at a time and read back transposed (64 STS.U16 per thread per tile)."""
    j = tl.arange(0, NW)[None, :, None]
    v3 = valid[:, None, None]
    base = data_ptr + page[:, None, None] * s_dp + row[:, None, None] * s_dr
    words = tl.load(base.to(tl.pointer_type(tl.int32)) + j, mask=v3, other=0)
    srow = tl.load((scale_ptr + page * s_sp + row * s_sr).to(tl.pointer_type(SCALE_T)), mask=valid, other=0)
    byte = ((srow[:, None, None] >> (8 * (j // WPG)).to(SCALE_T)) & 0xFF).to(tl.int32)
    if FMT == _MXFP4 and ASM:   # per word the bf16x2 bits of 2^(126 + e_g - e_max), per key 2^e_max
        smax = (srow & 0xFF).to(tl.int32)
        for g in tl.static_range(1, NW // WPG):
            smax = tl.maximum(smax, ((srow >> 8 * g) & 0xFF).to(tl.int32))
        fe = tl.maximum(byte - smax[:, None, None] + 253, 1)     # groups 2^252 below the key's largest: 0
        sc = (fe << 7) | (fe << 23)
        glob = (smax << 23).to(tl.float32, bitcast=True)
    elif FMT == _MXFP4:   # UE8M0 byte e+127 -> 2^e * 2^UNIT (undoes the decode's 2^-UNIT)
        sc = ((byte + UNIT) << 23).to(tl.float32, bitcast=True)
        glob = tl.full(valid.shape, 1.0, tl.float32)
    else:               # e4m3 group scale (keys stay exact in bf16); the global scale multiplies the dot
        sc = byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * UNIT_MUL
        glob = tl.load(glob_ptr + page * s_gp + row * s_gr, mask=valid, other=0.0)
    return words, sc, glob


# One pair of E2M1 codes -> bf16x2: $1 / $2 the key word's even / odd nibbles, one per byte
# (word & 0x0F0F0F0F, (word >> 4) & 0x0F0F0F0F), $3 the PRMT selector of pair j (byte 0 <- byte j
# of $1, byte 2 <- byte j of $2: elements 2j and 2j+1 at bits 0-3 and 16-19; bytes 1 and 3 <- the
# sign of a byte below 0x10: zero), $4 the bf16x2 factor. t * (2^6 + 2^12) = (t << 6) | (t << 12)
# (no bits overlap) puts exponent and mantissa at bits 6-8 and the sign at bit 15 of each half,
# which the mask keeps: the bf16 of value * 2^-126 (0.5 is the subnormal 2^-127), exact; the bf16
# multiply by 2^(126 + e_g - e_max) is exact too. 4 instructions per pair (8 when each pair shifted
# and masked its nibbles itself).
_E2M1_PAIR_ASM = tl.constexpr("""{
.reg .b32 t;
prmt.b32 t, $1, $2, $3;
mul.lo.u32 t, t, 4160;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $0, t, $4;
}""")


@triton.jit
def _decode_words(words, sc, BLOCK_N: tl.constexpr, D: tl.constexpr, ASM: tl.constexpr):
    """[N, NW, 1] words and scales -> keys [N, D] in element order (exact): fp32 from the fp16
    decode times the group scale, or (ASM, mxfp4 on the GPU) bf16 pairs from `_E2M1_PAIR_ASM`,
    each key scaled by 2^-e_max (the score takes it back): ~2.4 instead of ~7 instructions per
    element, and no conversion of the tile before it is stored for the dot."""
    if ASM:
        j = tl.arange(0, 4)[None, None, :]
        sel = 0x8480 + 0x0101 * j + 0 * words
        even = words & 0x0F0F0F0F                       # once per word, not per pair
        odd = (words >> 4) & 0x0F0F0F0F
        pair = tl.inline_asm_elementwise(_E2M1_PAIR_ASM, "=r,r,r,r,r", [even + 0 * j, odd + 0 * j, sel, sc + 0 * j],
                                         dtype=tl.int32, is_pure=True, pack=1)
        lo = pair.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (pair >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        val = tl.join(lo, hi)
    else:
        sh = (4 * tl.arange(0, 8))[None, None, :]
        code = (words >> sh) & 15
        bits = ((code & 8) << 12) | ((code & 7) << 9)            # fp16 bits of value * 2^-14
        val = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * sc
    return tl.reshape(val, [BLOCK_N, D])


@triton.jit
def _query_parts(qt, NATIVE: tl.constexpr):
    """fp32 queries -> (hi, lo) bf16 parts of the dot's shared-memory operand (lo for bf16x2)."""
    if NATIVE:
        qt_hi = qt.to(tl.bfloat16)
        qt_lo = (qt - qt_hi.to(tl.float32)).to(tl.bfloat16)
    else:       # the interpreter's bf16 dot is wrong: the same rounded operands through fp32 dots
        qt_hi = qt.to(tl.bfloat16).to(tl.float32)
        qt_lo = (qt - qt_hi).to(tl.bfloat16).to(tl.float32)
    return qt_hi, qt_lo


@triton.jit
def _indexer_scan_kernel(
        q_ptr, w_ptr, out_ptr, data_ptr, scale_ptr, glob_ptr, bt_ptr, nent_ptr, gmax_ptr,
        s_qb, s_qh, s_wb, s_ob, s_dp, s_dr, s_sp, s_sr, s_gp, s_gr, s_bt, s_mb,
        num_tiles, max_entries, max_blocks, out_scale, w_scale, EPB: tl.constexpr,
        FMT: tl.constexpr, PREC: tl.constexpr, NATIVE: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr,
        D: tl.constexpr, NW: tl.constexpr, WPG: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
        KEYS_M: tl.constexpr,
        UNIT: tl.constexpr, UNIT_MUL: tl.constexpr, SCALE_T: tl.constexpr, ASM: tl.constexpr,
        SLOTS: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0)
    p0 = tl.program_id(1)
    step = tl.num_programs(1)
    h = tl.arange(0, BLOCK_H)
    hmask = h < H
    wts = tl.load(w_ptr + b * s_wb + h, mask=hmask, other=0.0).to(tl.float32) * w_scale
    d = tl.arange(0, D)
    if KEYS_M:      # q^T [D, H]: operand B (shared memory)
        qt = tl.load(q_ptr + b * s_qb + h[None, :] * s_qh + d[:, None], mask=hmask[None, :], other=0.0)
    else:           # q [H, D]: operand A (registers)
        qt = tl.load(q_ptr + b * s_qb + h[:, None] * s_qh + d[None, :], mask=hmask[:, None], other=0.0)
    qt_hi, qt_lo = _query_parts(qt, NATIVE)
    n_b = tl.minimum(tl.load(nent_ptr + b), max_entries)
    nt = tl.cdiv(n_b, BLOCK_N)
    bt_row = bt_ptr + b * s_bt
    ar = tl.arange(0, BLOCK_N)
    out_row = out_ptr + b * s_ob
    if SLOTS:       # running maxima of the program's slots (entry i of a tile is slot i mod SLOTS), as keys
        gm = tl.full([SLOTS], -2147483648, tl.int32)

    if PREFETCH:
        o0 = p0 * BLOCK_N + ar
        pg, rw = _locate(bt_row, o0, o0 < n_b, EPB, max_blocks)
        words, sc, gl = _tile_loads(data_ptr, scale_ptr, glob_ptr, pg, rw, o0 < n_b, s_dp, s_dr, s_sp, s_sr,
                                    s_gp, s_gr, FMT, NW, WPG, UNIT, UNIT_MUL, SCALE_T, ASM)
        o1 = o0 + step * BLOCK_N
        pg_n, rw_n = _locate(bt_row, o1, o1 < n_b, EPB, max_blocks)
    for tile in range(p0, nt, step):
        offs = tile * BLOCK_N + ar
        valid = offs < n_b
        if PREFETCH:
            o2 = offs + 2 * step * BLOCK_N
            pg_nn, rw_nn = _locate(bt_row, o2, o2 < n_b, EPB, max_blocks)
            o1 = offs + step * BLOCK_N
            words_n, sc_n, gl_n = _tile_loads(data_ptr, scale_ptr, glob_ptr, pg_n, rw_n, o1 < n_b, s_dp, s_dr,
                                              s_sp, s_sr, s_gp, s_gr, FMT, NW, WPG, UNIT, UNIT_MUL, SCALE_T, ASM)
        else:
            pg, rw = _locate(bt_row, offs, valid, EPB, max_blocks)
            words, sc, gl = _tile_loads(data_ptr, scale_ptr, glob_ptr, pg, rw, valid, s_dp, s_dr, s_sp, s_sr,
                                        s_gp, s_gr, FMT, NW, WPG, UNIT, UNIT_MUL, SCALE_T, ASM)
        k = _decode_words(words, sc, BLOCK_N, D, ASM)
        if NATIVE:
            k = k.to(tl.bfloat16)
            ip: tl.constexpr = None
        else:
            ip: tl.constexpr = "ieee"
        if KEYS_M:      # S^T [N, H]
            s = tl.dot(k, qt_hi, input_precision=ip)
            if PREC == 2:
                s += tl.dot(k, qt_lo, input_precision=ip)
            score = tl.sum(tl.maximum(s, 0.0) * wts[None, :], axis=1) * (gl * out_scale)   # gl > 0: after ReLU
        else:           # S [H, N]
            kt = tl.trans(k)
            s = tl.dot(qt_hi, kt, input_precision=ip)
            if PREC == 2:
                s += tl.dot(qt_lo, kt, input_precision=ip)
            score = tl.sum(tl.maximum(s, 0.0) * wts[:, None], axis=0) * (gl * out_scale)
        score = tl.where(valid, score, float("-inf"))
        tl.store(out_row + offs, score, mask=offs < max_entries)
        if SLOTS:
            bits = score.to(tl.int32, bitcast=True)
            key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)                  # `topk._keys`
            gm = tl.maximum(gm, tl.max(tl.reshape(key, [BLOCK_N // SLOTS, SLOTS]), axis=0))
        if PREFETCH:
            words, sc, gl = words_n, sc_n, gl_n
            pg_n, rw_n = pg_nn, rw_nn
    if SLOTS:
        tl.store(gmax_ptr + b * s_mb + p0 * SLOTS + tl.arange(0, SLOTS), gm)
    # tiles past this request's entries: -inf only
    first = p0 + tl.cdiv(tl.maximum(nt - p0, 0), step) * step
    for tile in range(first, num_tiles, step):
        offs = tile * BLOCK_N + ar
        tl.store(out_row + offs, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=offs < max_entries)


_SCALE_WORD = {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}


def _group_size(fmt_name: str) -> int:
    return 32 if fmt_name == "mxfp4" else 16


def scan_supported(fmt_name: str, dim: int, data, scale, prec: int) -> bool:
    """Whether `_indexer_scan_kernel` runs this call: E2M1 keys readable as aligned int32 words, each
    key's scale bytes (1, 2, 4 or 8) as one aligned word."""
    if fmt_name not in ("mxfp4", "nvfp4") or prec not in (1, 2) or dim % 32 or dim & (dim - 1):
        return False
    sb = dim // _group_size(fmt_name)
    return (sb in _SCALE_WORD and data.data_ptr() % 4 == 0 and data.stride(0) % 4 == 0 and data.stride(1) % 4 == 0
            and scale.data_ptr() % sb == 0 and scale.stride(0) % sb == 0 and scale.stride(1) % sb == 0)


def launch_scan(grid, q, weights, out, data, scale, glob, block_table, num_entries, tiles, max_entries, epb,
                weight_scale, *, fmt_name: str, prec: int, cuda: bool, block_n: int, prefetch: bool, keys_m: bool,
                num_warps: int, num_stages: int | None, asm: bool = True, gmax=None):
    """gmax: [B, P x slots] int32 (P = grid[1], slots a power of two dividing block_n): program p's
    slot j keeps the maximum key (`topk._keys`) of its entries tile * block_n + i (i = j mod slots)
    over the tiles it scans, INT32_MIN where it scans none."""
    heads, dim = q.shape[1], q.shape[2]
    slots = 0 if gmax is None else gmax.shape[1] // grid[1]
    assert gmax is None or (slots * grid[1] == gmax.shape[1] and block_n % slots == 0 and not slots & (slots - 1))
    ge = _group_size(fmt_name)                       # elements per scale group
    extra = {"num_stages": num_stages} if num_stages else {}
    return _indexer_scan_kernel[grid](
        q, weights, out, data, scale, glob, block_table, num_entries, out if gmax is None else gmax,
        q.stride(0), q.stride(1), weights.stride(0), out.stride(0), data.stride(0), data.stride(1),
        scale.stride(0), scale.stride(1), glob.stride(0), glob.stride(1), block_table.stride(0),
        0 if gmax is None else gmax.stride(0),
        tiles, max_entries, block_table.shape[1], dim ** -0.5, weight_scale, EPB=epb,
        FMT=3 if fmt_name == "mxfp4" else 4, PREC=prec, NATIVE=cuda, H=heads,
        BLOCK_H=max(16, triton.next_power_of_2(heads)), D=dim, NW=dim // 8, WPG=ge // 8, BLOCK_N=block_n,
        PREFETCH=prefetch, KEYS_M=keys_m, UNIT=14, UNIT_MUL=2.0 ** 14,
        SCALE_T=_SCALE_WORD[dim // ge],
        ASM=cuda and fmt_name == "mxfp4" and asm, SLOTS=slots, num_warps=num_warps, **extra,
        **pdl_launch(q.device))


@triton.jit
def _group_part(q_ptr, w_ptr, vis_ptr, r0, cnt, s_qb, s_qh, s_wb, max_entries, w_scale, NATIVE: tl.constexpr,
                H: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, FIRST: tl.constexpr, DT: tl.constexpr):
    """Tokens FIRST .. FIRST + DT - 1 of a group: q^T [D, DT * BLOCK_H] (hi, lo parts; column j is
    token j // BLOCK_H, head j % BLOCK_H), weights [DT * BLOCK_H], visible entries [DT]."""
    j = tl.arange(0, DT * BLOCK_H)
    tok = FIRST + j // BLOCK_H
    h = j % BLOCK_H
    jmask = (h < H) & (tok < cnt)
    wts = tl.load(w_ptr + (r0 + tok) * s_wb + h, mask=jmask, other=0.0).to(tl.float32) * w_scale
    d = tl.arange(0, D)
    qt = tl.load(q_ptr + (r0 + tok)[None, :] * s_qb + h[None, :] * s_qh + d[:, None], mask=jmask[None, :],
                 other=0.0).to(tl.float32)                                  # fp32 or bf16 queries
    qt_hi, qt_lo = _query_parts(qt, NATIVE)
    t = FIRST + tl.arange(0, DT)
    n_t = tl.minimum(tl.load(vis_ptr + r0 + t, mask=t < cnt, other=0), max_entries)
    return qt_hi, qt_lo, wts, n_t


@triton.jit
def _prefill_scan_kernel(
        q_ptr, w_ptr, out_ptr, data_ptr, scale_ptr, glob_ptr, bt_ptr, vis_ptr, grp_ptr,
        s_qb, s_qh, s_wb, s_ob, s_dp, s_dr, s_sp, s_sr, s_gp, s_gr, s_bt,
        num_tiles, max_entries, max_blocks, out_scale, w_scale, EPB: tl.constexpr,
        FMT: tl.constexpr, PREC: tl.constexpr, NATIVE: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr,
        D: tl.constexpr, NW: tl.constexpr, WPG: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr,
        DOT_TOKENS: tl.constexpr, PREFETCH: tl.constexpr, UNIT: tl.constexpr, UNIT_MUL: tl.constexpr,
        SCALE_T: tl.constexpr, ASM: tl.constexpr):
    """Program (g, p) scores rows r0 .. r0 + cnt - 1 of group g (cnt <= TOKENS consecutive query
    tokens of one request: grp[g] = (r0, cnt, request)) on key tiles p, p + P, ... Each key tile is
    loaded and decoded once for all of the group's tokens: per DOT_TOKENS of them one dot
    S^T [N, DOT_TOKENS * BLOCK_H] = K . [q_t | q_t+1 | ...]^T (the decoded tile stays the register
    operand), then per token score[n] = sum_h w_h ReLU(S^T[n, h]). Row r's tiles at or past vis[r]
    store -inf."""
    g = tl.program_id(0)
    p0 = tl.program_id(1)
    step = tl.num_programs(1)
    r0 = tl.load(grp_ptr + 3 * g)
    cnt = tl.load(grp_ptr + 3 * g + 1)
    req = tl.load(grp_ptr + 3 * g + 2)
    parts = ()
    n_all = 0
    for i in tl.static_range(TOKENS // DOT_TOKENS):
        part = _group_part(q_ptr, w_ptr, vis_ptr, r0, cnt, s_qb, s_qh, s_wb, max_entries, w_scale, NATIVE, H,
                           BLOCK_H, D, i * DOT_TOKENS, DOT_TOKENS)
        parts = parts + (part,)
        n_all = tl.maximum(n_all, tl.max(part[3], axis=0))
    nt = tl.cdiv(n_all, BLOCK_N)
    bt_row = bt_ptr + req.to(tl.int64) * s_bt
    ar = tl.arange(0, BLOCK_N)
    t = tl.arange(0, DOT_TOKENS)
    if PREFETCH:    # as the decode scan: tile t + P's bytes and tile t + 2P's pages in flight over tile t
        o0 = p0 * BLOCK_N + ar
        pg, rw = _locate(bt_row, o0, o0 < n_all, EPB, max_blocks)
        words, sc, gl = _tile_loads(data_ptr, scale_ptr, glob_ptr, pg, rw, o0 < n_all, s_dp, s_dr, s_sp, s_sr,
                                    s_gp, s_gr, FMT, NW, WPG, UNIT, UNIT_MUL, SCALE_T, ASM)
        o1 = o0 + step * BLOCK_N
        pg_n, rw_n = _locate(bt_row, o1, o1 < n_all, EPB, max_blocks)
    for tile in range(p0, nt, step):
        offs = tile * BLOCK_N + ar
        if PREFETCH:
            o2 = offs + 2 * step * BLOCK_N
            pg_nn, rw_nn = _locate(bt_row, o2, o2 < n_all, EPB, max_blocks)
            o1 = offs + step * BLOCK_N
            words_n, sc_n, gl_n = _tile_loads(data_ptr, scale_ptr, glob_ptr, pg_n, rw_n, o1 < n_all, s_dp, s_dr,
                                              s_sp, s_sr, s_gp, s_gr, FMT, NW, WPG, UNIT, UNIT_MUL, SCALE_T, ASM)
        else:
            valid = offs < n_all
            pg, rw = _locate(bt_row, offs, valid, EPB, max_blocks)
            words, sc, gl = _tile_loads(data_ptr, scale_ptr, glob_ptr, pg, rw, valid, s_dp, s_dr, s_sp, s_sr,
                                        s_gp, s_gr, FMT, NW, WPG, UNIT, UNIT_MUL, SCALE_T, ASM)
        k = _decode_words(words, sc, BLOCK_N, D, ASM)
        if NATIVE:
            k = k.to(tl.bfloat16)
            ip: tl.constexpr = None
        else:
            ip: tl.constexpr = "ieee"
        for i in tl.static_range(TOKENS // DOT_TOKENS):
            qt_hi, qt_lo, wts, n_t = parts[i]
            s = tl.dot(k, qt_hi, input_precision=ip)                              # [N, DOT_TOKENS * BLOCK_H]
            if PREC == 2:
                s += tl.dot(k, qt_lo, input_precision=ip)
            v = tl.reshape(tl.maximum(s, 0.0) * wts[None, :], [BLOCK_N, DOT_TOKENS, BLOCK_H])
            score = tl.sum(v, axis=2) * (gl * out_scale)[:, None]                   # [N, DOT_TOKENS]
            rows = i * DOT_TOKENS + t
            ok = offs[:, None] < n_t[None, :]
            tl.store(out_ptr + (r0 + rows).to(tl.int64)[None, :] * s_ob + offs[:, None],
                     tl.where(ok, score, float("-inf")), mask=(rows < cnt)[None, :] & (offs[:, None] < max_entries))
        if PREFETCH:
            words, sc, gl = words_n, sc_n, gl_n
            pg_n, rw_n = pg_nn, rw_nn
    # tiles past the group's entries: -inf only
    first = p0 + tl.cdiv(tl.maximum(nt - p0, 0), step) * step
    rows = tl.arange(0, TOKENS)
    out_rows = out_ptr + (r0 + rows).to(tl.int64)[None, :] * s_ob
    for tile in range(first, num_tiles, step):
        offs = tile * BLOCK_N + ar
        tl.store(out_rows + offs[:, None], tl.full([BLOCK_N, TOKENS], float("-inf"), tl.float32),
                 mask=(rows < cnt)[None, :] & (offs[:, None] < max_entries))


def launch_prefill_scan(grid, q, weights, out, data, scale, glob, block_table, visible, groups, tiles, max_entries,
                        epb, weight_scale, *, fmt_name: str, prec: int, cuda: bool, block_n: int, tokens: int,
                        dot_tokens: int, prefetch: bool, num_warps: int, num_stages: int | None,
                        asm: bool = True, maxnreg: int | None = None):
    """`_prefill_scan_kernel` over groups [G, 3] int32 (first row, rows, request) of q [T, H, D]."""
    heads, dim = q.shape[1], q.shape[2]
    ge = _group_size(fmt_name)
    extra = {"num_stages": num_stages} if num_stages else {}
    if maxnreg:
        extra["maxnreg"] = maxnreg
    return _prefill_scan_kernel[grid](
        q, weights, out, data, scale, glob, block_table, visible, groups,
        q.stride(0), q.stride(1), weights.stride(0), out.stride(0), data.stride(0), data.stride(1),
        scale.stride(0), scale.stride(1), glob.stride(0), glob.stride(1), block_table.stride(0),
        tiles, max_entries, block_table.shape[1], dim ** -0.5, weight_scale, EPB=epb,
        FMT=3 if fmt_name == "mxfp4" else 4, PREC=prec, NATIVE=cuda, H=heads,
        BLOCK_H=max(16, triton.next_power_of_2(heads)), D=dim, NW=dim // 8, WPG=ge // 8, BLOCK_N=block_n,
        TOKENS=tokens, DOT_TOKENS=dot_tokens, PREFETCH=prefetch, UNIT=14, UNIT_MUL=2.0 ** 14,
        SCALE_T=_SCALE_WORD[dim // ge],
        ASM=cuda and fmt_name == "mxfp4" and asm, num_warps=num_warps, **extra)
