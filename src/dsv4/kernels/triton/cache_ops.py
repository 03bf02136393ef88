"""Triton twins of the cache writes and of the decode-step compressor update.

Same signatures and results as `dsv4.kernels.reference.cache_ops.append_window`,
`...cache_ops.write_entries` and `dsv4.kernels.reference.decode.compress_decode`: the cache
bytes they write are identical to the reference's, byte for byte, for every format (fp8_ds,
bf16, fp32; mxfp4, fp8, nvfp4, bf16_i, fp32_i); compress_decode matches within fp32 rounding
(exp and fused multiply-adds may differ in the last ulp).

One program encodes and stores one entry row: it computes the destination (page, row) from
device metadata, quantises the row in registers and writes every region of the row. No host
reads, no boolean-mask indexing, fixed grids: a decode step built from these launches can be
captured in a CUDA graph.

Why the conversions are written out in integer arithmetic on fp32 bit patterns (e4m3, bf16,
E2M1, UE8M0 exponents) instead of `.to(tl.float8e4nv)` / `.to(tl.bfloat16)`: the reference
rounds to nearest-even, and the cast lowering differs between Triton versions, the CPU
interpreter and GPU generations; integer code rounds the same everywhere. Divisions that the
reference performs (fp8 and nvfp4 scales) use `div_rn`: `/` lowers to an approximate
division on NVIDIA GPUs. Power-of-two scalings are multiplications by 2^-e, which are exact.

Region views arrive as {name: [N, P, bytes] uint8} strided views of a page buffer; kernels take
each view's base pointer and its (page, row) strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.cache.formats import EntryFormat
from dsv4.errors import FormatError
from dsv4.kernels.reference import quant

Views = dict[str, torch.Tensor]

# Format ids (constexpr in the kernels); the indexer's bf16_i / fp32_i store like bf16 / fp32.
_FP8_DS, _BF16, _FP32, _MXFP4, _FP8, _NVFP4 = range(6)
_FORMAT_ID = {"fp8_ds": _FP8_DS, "bf16": _BF16, "bf16_i": _BF16, "fp32": _FP32, "fp32_i": _FP32,
              "mxfp4": _MXFP4, "fp8": _FP8, "nvfp4": _NVFP4}
_WRITE_WARPS = 2  # a row is 0.1-2 KB: one or two warps of 16-byte stores cover it


# ====================================================================== bit-level conversions
@triton.jit
def _is_nan(x):
    """fp32 NaN test on the bit pattern (exponent all ones, mantissa not zero)."""
    return (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000


@triton.jit
def _no_nan(x):
    """x with NaN replaced by +0 (the reference's `_no_nan`)."""
    return tl.where(_is_nan(x), 0.0, x)


@triton.jit
def _finite_abs(x):
    """|x| where x is finite, else 0: the values `_finite_amax` reduces."""
    a = tl.abs(x)
    return tl.where(a <= 3.4028234663852886e38, a, 0.0)


@triton.jit
def _ceil_log2_ratio(a, Q_EXP: tl.constexpr, Q_MANT: tl.constexpr):
    """Smallest e with a <= qmax * 2^e for a > 0 normal, qmax = frexp -> (mantissa field Q_MANT,
    exponent Q_EXP). frexp(a) has exponent (biased - 126); a's mantissa exceeds qmax's iff its
    23-bit mantissa field does. int32."""
    bits = a.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 126 - Q_EXP + ((bits & 0x7FFFFF) > Q_MANT).to(tl.int32)


@triton.jit
def _pow2(e):
    """2^e as fp32 for integer e in [-126, 127] (exponent bits, exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(v):
    """fp32 (no NaN) -> e4m3fn byte (int32 0..255): clamp to ±448, nearest, ties to even.

    Normal range (|v| >= 2^-6): round the fp32 mantissa to 3 bits on the bit pattern (a carry
    moves into the exponent); e4m3's bias is 7, fp32's 127, so the code is
    (exponent << 3 | mantissa) - (120 << 3). Subnormals (step 2^-9): |v| * 2^9 is exact and
    below 8; round it to an integer, ties to even (8 is the code of 2^-6 itself).
    """
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960
    q = mag.to(tl.float32, bitcast=True) * 512.0
    fl = q.to(tl.int32)                                   # floor: q >= 0
    fr = q - fl.to(tl.float32)                            # exact
    sub = fl + ((fr > 0.5) | ((fr == 0.5) & ((fl & 1) == 1))).to(tl.int32)
    return tl.where(mag >= 0x3C800000, normal, sub) | sign  # 0x3C800000 = 2^-6


@triton.jit
def _e4m3_value(b):
    """Non-negative e4m3fn byte (int32) -> its fp32 value (exact)."""
    ex = (b >> 3) & 0xF
    mant = b & 7
    normal = (((ex + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    return tl.where(ex == 0, mant.to(tl.float32) * 0.001953125, normal)   # subnormal: mant * 2^-9


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bit pattern (int32 0..0xFFFF), nearest, ties to even; NaN -> 0x7FC0 as torch."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    r = ((mag + 0x7FFF + ((mag >> 16) & 1)) >> 16) | ((bits >> 16) & 0x8000)
    return tl.where(_is_nan(x), 0x7FC0, r)


@triton.jit
def _e2m1_codes(v):
    """fp32 (no NaN) -> E2M1 code (int32 0..15): nearest of {0,.5,1,1.5,2,3,4,6}, ties to the
    even code (midpoints 0.75, 1.75, 3.5 go up; 0.25, 1.25, 2.5, 5 stay), saturating at 6;
    sign bit 3 from v's sign bit (-0 -> 8)."""
    bits = v.to(tl.int32, bitcast=True)
    a = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    idx = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    return idx | ((bits >> 28) & 0x8)


@triton.jit
def _store_f32_bytes(ptr, value, ok):
    """Store one fp32 scalar as 4 little-endian bytes at a byte pointer (no alignment needed)."""
    k = tl.arange(0, 4)
    b = (value.to(tl.int32, bitcast=True) >> (8 * k)) & 0xFF
    tl.store(ptr + k, b.to(tl.uint8), mask=k < 4 * ok)


# ====================================================================== per-format row encoders
@triton.jit
def _encode_fp8_ds(x_ptr, xs, kv_row, sc_row, ok, NOPE: tl.constexpr, ROPE: tl.constexpr,
                   ROPE_P2: tl.constexpr, SB: tl.constexpr, SB_P2: tl.constexpr):
    """kv row = [NOPE e4m3 | ROPE bf16], scale row = [tiles UE8M0 | zero pad to SB]."""
    tiles: tl.constexpr = NOPE // 64
    t = tl.arange(0, SB_P2)
    j = tl.arange(0, 64)
    m = (t[:, None] < tiles * ok) & (j[None, :] < 64)
    off = t[:, None] * 64 + j[None, :]                                       # [SB_P2, 64]
    x = tl.load(x_ptr + off * xs, mask=m, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(_finite_abs(x), axis=1), 1e-4)                  # [SB_P2]
    e = _ceil_log2_ratio(amax, 9, 0x600000)                                   # 448 = 0.875 * 2^9
    q = _e4m3_bits(_no_nan(x) * _pow2(-e)[:, None])
    tl.store(kv_row + off, q.to(tl.uint8), mask=m)
    sbyte = tl.where(t < tiles, e + 127, 0)
    tl.store(sc_row + t, sbyte.to(tl.uint8), mask=t < SB * ok)
    if ROPE > 0:
        k = tl.arange(0, ROPE_P2)
        mk = k < ROPE * ok
        xr = tl.load(x_ptr + (NOPE + k) * xs, mask=mk, other=0.0).to(tl.float32)
        rope_row = (kv_row + NOPE).to(tl.pointer_type(tl.uint16))
        tl.store(rope_row + k, _bf16_bits(xr).to(tl.uint16), mask=mk)


@triton.jit
def _encode_bf16(x_ptr, xs, row, ok, D: tl.constexpr, D_P2: tl.constexpr):
    k = tl.arange(0, D_P2)
    mk = k < D * ok
    x = tl.load(x_ptr + k * xs, mask=mk, other=0.0).to(tl.float32)
    tl.store(row.to(tl.pointer_type(tl.uint16)) + k, _bf16_bits(x).to(tl.uint16), mask=mk)


@triton.jit
def _encode_fp32(x_ptr, xs, row, ok, D: tl.constexpr, D_P2: tl.constexpr):
    k = tl.arange(0, D_P2)
    mk = k < D * ok
    x = tl.load(x_ptr + k * xs, mask=mk, other=0.0).to(tl.float32)
    tl.store(row.to(tl.pointer_type(tl.int32)) + k, x.to(tl.int32, bitcast=True), mask=mk)


@triton.jit
def _store_packed(row, codes, ok, GROUPS: tl.constexpr, GSIZE: tl.constexpr):
    """codes [GROUPS, GSIZE] -> GROUPS * GSIZE / 2 bytes, element 2i low nibble, 2i+1 high."""
    lo, hi = tl.split(tl.reshape(codes, (GROUPS, GSIZE // 2, 2)))
    g = tl.arange(0, GROUPS)[:, None]
    jj = tl.arange(0, GSIZE // 2)[None, :]
    tl.store(row + g * (GSIZE // 2) + jj, (lo | (hi << 4)).to(tl.uint8), mask=(g < GROUPS * ok) & (jj < GSIZE))


@triton.jit
def _encode_mxfp4(x_ptr, xs, d_row, s_row, ok, D: tl.constexpr):
    """data row = D/2 packed E2M1 bytes, scale row = D/32 UE8M0 bytes."""
    G: tl.constexpr = D // 32
    g = tl.arange(0, G)
    off = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = _no_nan(tl.load(x_ptr + off * xs, mask=off < D * ok, other=0.0).to(tl.float32))
    amax = tl.maximum(tl.max(_finite_abs(x), axis=1), 7.052966104933725e-38)   # 6 * 2^-126
    e = _ceil_log2_ratio(amax, 3, 0x400000)                                     # 6 = 0.75 * 2^3
    _store_packed(d_row, _e2m1_codes(x * _pow2(-e)[:, None]), ok, G, 32)
    tl.store(s_row + g, (e + 127).to(tl.uint8), mask=g < G * ok)


@triton.jit
def _encode_fp8(x_ptr, xs, d_row, s_row, ok, D: tl.constexpr):
    """data row = D e4m3 bytes of x / c, scale row = c = max(amax, 1e-4) / 448 as fp32 bytes."""
    k = tl.arange(0, D)
    x = tl.load(x_ptr + k * xs, mask=k < D * ok, other=0.0).to(tl.float32)
    c = tl.math.div_rn(tl.maximum(tl.max(_finite_abs(x), axis=0), 1e-4), 448.0)
    q = _e4m3_bits(tl.math.div_rn(_no_nan(x), c))
    tl.store(d_row + k, q.to(tl.uint8), mask=k < D * ok)
    _store_f32_bytes(s_row, c, ok)


@triton.jit
def _encode_nvfp4(x_ptr, xs, d_row, s_row, g_row, ok, D: tl.constexpr):
    """data row = D/2 packed E2M1 bytes, scale row = D/16 e4m3 bytes, global row = fp32 g."""
    G: tl.constexpr = D // 16
    gi = tl.arange(0, G)
    off = gi[:, None] * 16 + tl.arange(0, 16)[None, :]
    x = tl.load(x_ptr + off * xs, mask=off < D * ok, other=0.0).to(tl.float32)
    amax16 = tl.max(_finite_abs(x), axis=1)                                     # [G]
    g = tl.math.div_rn(tl.maximum(tl.max(amax16, axis=0), 1e-4), 2688.0)       # 448 * 6
    s = _e4m3_bits(tl.math.div_rn(amax16, 6.0 * g))
    s = tl.where(s == 0, 1, s)                                                  # 0x01 = 2^-9
    sg = _e4m3_value(s) * g
    _store_packed(d_row, _e2m1_codes(tl.math.div_rn(_no_nan(x), sg[:, None])), ok, G, 16)
    tl.store(s_row + gi, s.to(tl.uint8), mask=gi < G * ok)
    _store_f32_bytes(g_row, g, ok)


@triton.jit
def _encode_row(x_ptr, xs, r0, r1, r2, ok, FMT: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
                ROPE: tl.constexpr, ROPE_P2: tl.constexpr, SB: tl.constexpr, SB_P2: tl.constexpr):
    """Encode the row at x_ptr (element stride xs) into region rows r0, r1, r2 (byte pointers).

    ok (int 0/1) gates every load and store; it is an int, not a bool, and the masks are
    comparisons against `bound * ok`, because Triton's interpreter cannot broadcast a scalar
    bool into a tensor mask.
    """
    if FMT == 0:
        _encode_fp8_ds(x_ptr, xs, r0, r1, ok, D - ROPE, ROPE, ROPE_P2, SB, SB_P2)
    elif FMT == 1:
        _encode_bf16(x_ptr, xs, r0, ok, D, D_P2)
    elif FMT == 2:
        _encode_fp32(x_ptr, xs, r0, ok, D, D_P2)
    elif FMT == 3:
        _encode_mxfp4(x_ptr, xs, r0, r1, ok, D)
    elif FMT == 4:
        _encode_fp8(x_ptr, xs, r0, r1, ok, D)
    else:
        _encode_nvfp4(x_ptr, xs, r0, r1, r2, ok, D)


# ====================================================================== kernels
@triton.jit
def _append_window_kernel(
        kv_ptr, kv_s0, kv_s1, pos_ptr, treq_ptr, rslot_ptr, seq_ptr, swa_pos_ptr, sp_s0, sp_s1, head_ptr,
        r0, r0_s0, r0_s1, r1, r1_s0, r1_s1, r2, r2_s0, r2_s1, T, B, W,
        FMT: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, ROPE: tl.constexpr, ROPE_P2: tl.constexpr,
        SB: tl.constexpr, SB_P2: tl.constexpr):
    """Program i: token i (if i < T) into its ring row, and request i's head (if i < B)."""
    i = tl.program_id(0)
    is_tok = i < T
    req = tl.load(treq_ptr + i, mask=is_tok, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + i, mask=is_tok, other=0)
    seq = tl.load(seq_ptr + req, mask=is_tok, other=0)
    slot = tl.load(rslot_ptr + req, mask=is_tok, other=0).to(tl.int64)
    keep = is_tok & (pos >= seq - W)          # only the last W tokens of a request can stay in the ring
    row = pos % W
    row = tl.where(row < 0, row + W, row).to(tl.int64)   # floor modulo, as torch's %
    x_ptr = kv_ptr + i.to(tl.int64) * kv_s0
    _encode_row(x_ptr, kv_s1, r0 + slot * r0_s0 + row * r0_s1, r1 + slot * r1_s0 + row * r1_s1,
                r2 + slot * r2_s0 + row * r2_s1, keep.to(tl.int32), FMT, D, D_P2, ROPE, ROPE_P2, SB, SB_P2)
    tl.store(swa_pos_ptr + slot * sp_s0 + row * sp_s1, pos.to(swa_pos_ptr.dtype.element_ty), mask=keep)
    is_req = i < B
    hslot = tl.load(rslot_ptr + i, mask=is_req, other=0).to(tl.int64)
    hseq = tl.load(seq_ptr + i, mask=is_req, other=0)
    tl.store(head_ptr + hslot, hseq.to(head_ptr.dtype.element_ty), mask=is_req)


@triton.jit
def _write_entries_kernel(
        x_ptr, x_s0, x_s1, ereq_ptr, eidx_ptr, bt_ptr, bt_s0, bt_s1, bt_cols, epb,
        r0, r0_s0, r0_s1, r1, r1_s0, r1_s1, r2, r2_s0, r2_s1,
        FMT: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, ROPE: tl.constexpr, ROPE_P2: tl.constexpr,
        SB: tl.constexpr, SB_P2: tl.constexpr):
    """Program i: entry row i into (block_table[req, idx // epb], idx % epb), or the null row (0, 0)
    (the reference's `_locate`)."""
    i = tl.program_id(0)
    req = tl.load(ereq_ptr + i).to(tl.int64)
    idx = tl.load(eidx_ptr + i).to(tl.int64)
    e = tl.maximum(idx, 0)
    col = e // epb
    block = tl.load(bt_ptr + req * bt_s0 + tl.minimum(col, bt_cols - 1) * bt_s1).to(tl.int64)
    ok = (idx >= 0) & (col < bt_cols) & (block >= 0)           # past the table: padding as well
    page = tl.where(ok, block, 0)
    row = tl.where(ok, e % epb, 0)
    _encode_row(x_ptr + i.to(tl.int64) * x_s0, x_s1, r0 + page * r0_s0 + row * r0_s1,
                r1 + page * r1_s0 + row * r1_s1, r2 + page * r2_s0 + row * r2_s1, 1,
                FMT, D, D_P2, ROPE, ROPE_P2, SB, SB_P2)


@triton.jit
def _merge(m, s, a, z, c):
    """Add slot (c, z) to the online softmax (m, s, a): DESIGN §5 (empty m = -inf keeps nothing)."""
    m2 = tl.maximum(m, z)
    keep = tl.where(m == float("-inf"), 0.0, tl.exp(m - m2))
    add = tl.exp(z - m2)
    return m2, s * keep + add, a * keep + c * add


@triton.jit
def _compress_decode_kernel(
        c_ptr, c_s0, c_s1, z_ptr, z_s0, z_s1, st_ptr, st_s0, st_s1, st_s2, st_s3, rslot_ptr, pos_ptr,
        out_ptr, idx_ptr, D, RATIO, OVERLAP: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr):
    """Program (b, j): channels [j*BLOCK, (j+1)*BLOCK) of request b's pending entries."""
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    md = d < D
    slot = tl.load(rslot_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    closes = (pos + 1) % RATIO == 0
    cb = c_ptr + b.to(tl.int64) * c_s0
    zb = z_ptr + b.to(tl.int64) * z_s0
    sb = st_ptr + slot * st_s0 + d * st_s3                         # (M, S, A) at st_s1 apart, pages st_s2
    hi = D if OVERLAP else 0                                       # CSA: the [D:] slot feeds cur
    m, s, a = _merge(tl.load(sb, mask=md), tl.load(sb + st_s1, mask=md), tl.load(sb + 2 * st_s1, mask=md),
                     tl.load(zb + (d + hi) * z_s1, mask=md), tl.load(cb + (d + hi) * c_s1, mask=md))
    tl.store(out_ptr + b.to(tl.int64) * D + d, tl.math.div_rn(a, s), mask=md)
    if OVERLAP:
        nb = sb + st_s2
        nm, ns, na = _merge(tl.load(nb, mask=md), tl.load(nb + st_s1, mask=md), tl.load(nb + 2 * st_s1, mask=md),
                            tl.load(zb + d * z_s1, mask=md), tl.load(cb + d * c_s1, mask=md))
        # On close: cur <- next, next <- empty (the seeds' rotation).
        tl.store(sb, tl.where(closes, nm, m), mask=md)
        tl.store(sb + st_s1, tl.where(closes, ns, s), mask=md)
        tl.store(sb + 2 * st_s1, tl.where(closes, na, a), mask=md)
        tl.store(nb, tl.where(closes, float("-inf"), nm), mask=md)
        tl.store(nb + st_s1, tl.where(closes, 0.0, ns), mask=md)
        tl.store(nb + 2 * st_s1, tl.where(closes, 0.0, na), mask=md)
    else:
        for p in tl.static_range(P):                               # the reference broadcasts over pages
            pb = sb + p * st_s2
            tl.store(pb, tl.where(closes, float("-inf"), m), mask=md)
            tl.store(pb + st_s1, tl.where(closes, 0.0, s), mask=md)
            tl.store(pb + 2 * st_s1, tl.where(closes, 0.0, a), mask=md)
    q = pos // RATIO
    q = tl.where((q * RATIO != pos) & (pos < 0), q - 1, q)        # floor division, as torch's //
    tl.store(idx_ptr + b, tl.where(closes, q, -1), mask=tl.program_id(1) == 0)


# ====================================================================== host wrappers
def _p2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def _format_meta(fmt: EntryFormat) -> dict[str, int]:
    """Constexpr parameters of `_encode_row` for `fmt`."""
    if fmt.name not in _FORMAT_ID:
        raise FormatError(f"the Triton cache writes do not know format {fmt.name!r}")
    sb = fmt.regions[1].bytes_per_entry if fmt.name == "fp8_ds" else 0
    return {"FMT": _FORMAT_ID[fmt.name], "D": fmt.dim, "D_P2": _p2(fmt.dim), "ROPE": fmt.rope_dim,
            "ROPE_P2": _p2(fmt.rope_dim), "SB": sb, "SB_P2": _p2(sb)}


def _region_args(views: Views, fmt: EntryFormat, n: int) -> list:
    """(view, page stride, row stride) for the first n regions; missing ones repeat region 0 (unused)."""
    names = [r.name for r in fmt.regions]
    args = []
    for k in range(n):
        v = views[names[min(k, len(names) - 1)]]
        if v.dtype != torch.uint8 or v.dim() != 3 or v.stride(2) != 1:
            raise FormatError(f"{fmt.name} region views must be uint8 [N, P, bytes] with unit byte stride")
        args += [v, v.stride(0), v.stride(1)]
    return args


def _check_rows(fmt: EntryFormat, rows: torch.Tensor) -> None:
    if rows.dim() != 2 or rows.shape[-1] != fmt.dim:
        raise FormatError(f"{fmt.name} entries have {fmt.dim} channels, got rows of shape {list(rows.shape)}")


def append_window(swa: Views, fmt: EntryFormat, swa_pos: torch.Tensor, swa_head: torch.Tensor, kv: torch.Tensor,
                  positions: torch.Tensor, token_request: torch.Tensor, request_slots: torch.Tensor,
                  seq_lens: torch.Tensor) -> None:
    """Write each new token's kv into its request's ring, row = position % W (reference twin).

    Only tokens with position >= seq_len - W are written (decided in the kernel):

        request tokens  ... | s-W-1 | s-W | ... | s-1 |      s = seq_lens[request]
                              dropped  <---- written ---->   W rows, no two on one row

    Args:
        swa: ring region views {name: [R, W, bytes] uint8}; swa_pos [R, W] int32; swa_head [R] int32.
        kv: [T, D] float (fp32, bf16 or fp16) new tokens' kv (after norm and RoPE).
        positions, token_request: [T] int32; request_slots, seq_lens: [B] int32.
    """
    _check_rows(fmt, kv)
    t, b = kv.shape[0], seq_lens.shape[0]
    if max(t, b) == 0:
        return
    if fmt.hadamard:  # window rings hold main formats; kept for parity with the reference's encode
        kv = quant.hadamard_rotate(kv.float())
    w = swa_pos.shape[1]
    regions = _region_args(swa, fmt, 3)
    _append_window_kernel[(max(t, b),)](
        kv, kv.stride(0), kv.stride(1), positions, token_request, request_slots, seq_lens,
        swa_pos, swa_pos.stride(0), swa_pos.stride(1), swa_head, *regions, t, b, w,
        **_format_meta(fmt), num_warps=_WRITE_WARPS)


def write_entries(views: Views, fmt: EntryFormat, rows: torch.Tensor, entry_request: torch.Tensor,
                  entry_index: torch.Tensor, block_table: torch.Tensor, epb: int) -> None:
    """Quantise finished entries and scatter them into their blocks (reference twin).

        entry w of request r -> block block_table[r, w // epb], row w % epb
        w < 0, w // epb past the table, or block < 0 -> null block 0, row 0 (padding; never read)

    Args:
        views: pool region views {name: [N, epb, bytes] uint8}.
        rows: [E, D] float entries; entry_request [E] int (batch index), entry_index [E] int (-1 = padding).
        block_table: [B, max_blocks] int32 (-1 = none); epb: entries per block.
    Indexer formats with `fmt.hadamard` rotate rows with the reference's own torch matmul first
    (a fused tl.dot would sum in another order and flip roundings).
    """
    _check_rows(fmt, rows)
    e = rows.shape[0]
    if e == 0:  # a step that finishes no entry (a shape, not a device value)
        return
    if fmt.hadamard:
        rows = quant.hadamard_rotate(rows.float())
    _write_entries_kernel[(e,)](
        rows, rows.stride(0), rows.stride(1), entry_request, entry_index, block_table,
        block_table.stride(0), block_table.stride(1), block_table.shape[1], epb,
        *_region_args(views, fmt, 3), **_format_meta(fmt), num_warps=_WRITE_WARPS)


def compress_decode(c: torch.Tensor, z: torch.Tensor, state: torch.Tensor, request_slots: torch.Tensor,
                    positions: torch.Tensor, ratio: int, overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one token per request into its pending entries (DESIGN §5 online softmax; reference twin).

    Args:
        c, z: [B, Dc] fp32 (z includes the position bias); Dc = 2D (CSA, overlap) or D (HCA).
        state: [R, 3, P, D] fp32 (M, S, A), updated in place; request_slots, positions: [B] int.
    Returns:
        entries [B, D] fp32 = A/S of `cur` after the update (meaningful where the token closes
        its window), entry_index [B] int64: the finished entry position // ratio, or -1.
    """
    bsz, d, p = c.shape[0], state.shape[-1], state.shape[2]
    assert c.dtype == z.dtype == state.dtype == torch.float32, "compress_decode works in fp32"
    assert p >= (2 if overlap else 1), "CSA keeps two pending entries (cur, next), HCA one"
    entries = torch.empty(bsz, d, dtype=torch.float32, device=c.device)
    entry_index = torch.empty(bsz, dtype=torch.int64, device=c.device)
    if bsz == 0:
        return entries, entry_index
    block = min(_p2(d), 256)
    _compress_decode_kernel[(bsz, triton.cdiv(d, block))](
        c, c.stride(0), c.stride(1), z, z.stride(0), z.stride(1), state, *state.stride(), request_slots, positions,
        entries, entry_index, d, ratio, OVERLAP=overlap, P=p, BLOCK=block, num_warps=2)
    return entries, entry_index


__all__ = ["append_window", "compress_decode", "write_entries"]
