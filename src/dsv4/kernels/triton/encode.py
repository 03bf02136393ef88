"""Triton row encoders of every storage format: the byte-exact twins of
`dsv4.kernels.reference.quant`'s codecs, as device functions the cache-write kernels call.

Conversions are written out in integer arithmetic on fp32 bit patterns (e4m3, bf16, E2M1,
UE8M0 exponents) instead of `.to(tl.float8e4nv)` / `.to(tl.bfloat16)`: the reference rounds to
nearest-even, and the cast lowering differs between Triton versions, the CPU interpreter and GPU
generations; integer code rounds the same everywhere. Divisions that the reference performs (fp8
and nvfp4 scales) use `div_rn`: `/` lowers to an approximate division on NVIDIA GPUs.
Power-of-two scalings are multiplications by 2^-e, which are exact.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.triton.hadamard import fwht_rows

# Format ids (constexpr in the kernels); the indexer's bf16_i / fp32_i store like bf16 / fp32.
_FP8_DS, _BF16, _FP32, _MXFP4, _FP8, _NVFP4 = range(6)
FORMAT_ID = {"fp8_ds": _FP8_DS, "bf16": _BF16, "bf16_i": _BF16, "fp32": _FP32, "fp32_i": _FP32,
             "mxfp4": _MXFP4, "fp8": _FP8, "nvfp4": _NVFP4}


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
def _e2m1_value(code):
    """E2M1 code (int32 0..15) -> its fp32 value, exact (code 8 is -0.0)."""
    mag = code & 7
    normal = ((((mag >> 1) + 126) << 23) | ((mag & 1) << 22)).to(tl.float32, bitcast=True)
    v = tl.where(mag < 2, mag.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def _e4m3_signed_value(b):
    """e4m3fn byte (int32 0..255, no NaN) -> its fp32 value, exact."""
    v = _e4m3_value(b & 0x7F)
    return tl.where((b & 0x80) != 0, -v, v)


@triton.jit
def round_bf16(x):
    """fp32 -> the fp32 value of its bf16 rounding (nearest, ties to even)."""
    return (_bf16_bits(x) << 16).to(tl.float32, bitcast=True)


@triton.jit
def round_fp8_ds_tiles(x):
    """x [R, 64] fp32, one fp8_ds scale tile a row -> decode(encode(x)): `_encode_fp8_ds`'s scale and
    e4m3 codes, decoded (exact products)."""
    e = _ceil_log2_ratio(tl.maximum(tl.max(_finite_abs(x), axis=1), 1e-4), 9, 0x600000)[:, None]
    return _e4m3_signed_value(_e4m3_bits(_no_nan(x) * _pow2(-e))) * _pow2(e)


@triton.jit
def round_rows(x, FMT: tl.constexpr, R: tl.constexpr, D: tl.constexpr):
    """x [R, D] fp32 -> each row's decode(encode(row)) in indexer-key format FMT (FORMAT_ID: 1 bf16,
    3 mxfp4, 4 fp8, 5 nvfp4), bit for bit `quant.round_query`: the row encoders' arithmetic."""
    if FMT == 1:
        out = round_bf16(x)
    elif FMT == 3:
        g = _no_nan(tl.reshape(x, (R, D // 32, 32)))
        amax = tl.maximum(tl.max(_finite_abs(g), axis=2), 7.052966104933725e-38)   # 6 * 2^-126
        e = _ceil_log2_ratio(amax, 3, 0x400000)                                     # 6 = 0.75 * 2^3
        v = _e2m1_value(_e2m1_codes(g * _pow2(-e)[:, :, None])) * _pow2(e)[:, :, None]
        out = tl.reshape(v, (R, D))
    elif FMT == 4:
        c = tl.math.div_rn(tl.maximum(tl.max(_finite_abs(x), axis=1), 1e-4), 448.0)
        c2 = c[:, None] + 0.0 * x
        out = _e4m3_signed_value(_e4m3_bits(tl.math.div_rn(_no_nan(x), c2))) * c2
    else:
        grp = tl.reshape(x, (R, D // 16, 16))
        amax16 = tl.max(_finite_abs(grp), axis=2)                                   # [R, G]
        g = tl.math.div_rn(tl.maximum(tl.max(amax16, axis=1), 1e-4), 2688.0)       # 448 * 6
        s = _e4m3_bits(tl.math.div_rn(amax16, 6.0 * g[:, None] + 0.0 * amax16))
        s = tl.where(s == 0, 1, s)                                                  # 0x01 = 2^-9
        sg = (_e4m3_value(s) * g[:, None])[:, :, None] + 0.0 * grp
        v = _e2m1_value(_e2m1_codes(tl.math.div_rn(_no_nan(grp), sg))) * sg
        out = tl.reshape(v, (R, D))
    return out


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
def _encode_mxfp4(x, d_row, s_row, ok, D: tl.constexpr):
    """x [D] fp32 -> data row = D/2 packed E2M1 bytes, scale row = D/32 UE8M0 bytes."""
    G: tl.constexpr = D // 32
    g = tl.arange(0, G)
    x = _no_nan(tl.reshape(x, (G, 32)))
    amax = tl.maximum(tl.max(_finite_abs(x), axis=1), 7.052966104933725e-38)   # 6 * 2^-126
    e = _ceil_log2_ratio(amax, 3, 0x400000)                                     # 6 = 0.75 * 2^3
    _store_packed(d_row, _e2m1_codes(x * _pow2(-e)[:, None]), ok, G, 32)
    tl.store(s_row + g, (e + 127).to(tl.uint8), mask=g < G * ok)


@triton.jit
def _encode_fp8(x, d_row, s_row, ok, D: tl.constexpr):
    """x [D] fp32 -> data row = D e4m3 bytes of x / c, scale row = c = max(amax, 1e-4) / 448 as fp32 bytes."""
    k = tl.arange(0, D)
    c = tl.math.div_rn(tl.maximum(tl.max(_finite_abs(x), axis=0), 1e-4), 448.0)
    q = _e4m3_bits(tl.math.div_rn(_no_nan(x), c))
    tl.store(d_row + k, q.to(tl.uint8), mask=k < D * ok)
    _store_f32_bytes(s_row, c, ok)


@triton.jit
def _encode_nvfp4(x, d_row, s_row, g_row, ok, D: tl.constexpr):
    """x [D] fp32 -> data row = D/2 packed E2M1 bytes, scale row = D/16 e4m3 bytes, global row = fp32 g."""
    G: tl.constexpr = D // 16
    gi = tl.arange(0, G)
    x = tl.reshape(x, (G, 16))
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
                ROPE: tl.constexpr, ROPE_P2: tl.constexpr, SB: tl.constexpr, SB_P2: tl.constexpr,
                HAD: tl.constexpr, LOG_D: tl.constexpr, HSCALE: tl.constexpr):
    """Encode the row at x_ptr (element stride xs) into region rows r0, r1, r2 (byte pointers);
    HAD: rotate it by the Hadamard butterfly first (indexer formats: D a power of two).

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
    else:                                       # the indexer's quantised formats: one [D] row in registers
        k = tl.arange(0, D)
        x = tl.load(x_ptr + k * xs, mask=k < D * ok, other=0.0).to(tl.float32)
        if HAD:
            x = tl.reshape(fwht_rows(tl.reshape(x, (1, D)), 1, D, LOG_D, HSCALE), (D,))
        if FMT == 3:
            _encode_mxfp4(x, r0, r1, ok, D)
        elif FMT == 4:
            _encode_fp8(x, r0, r1, ok, D)
        else:
            _encode_nvfp4(x, r0, r1, r2, ok, D)


# ====================================================================== kernels
