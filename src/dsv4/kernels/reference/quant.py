"""Reference codecs of the storage formats (DESIGN §4): float rows <-> region bytes.

Each `*_encode(x, rope_dim)` takes x [N, D] (any float dtype) and returns one uint8 tensor
[N, region_bytes] per region of the format, in the order of `dsv4.cache.formats`; each
`*_decode(*regions, rope_dim)` returns float32 [N, D]. They are the spec the Triton
kernels must match byte for byte.

Quantised formats (all arithmetic in fp32, IEEE round-to-nearest-even):

    fp8_ds  per 64 nope channels a power-of-two scale 2^e, byte e+127 (UE8M0); e4m3 data;
            trailing rope_dim channels kept as bf16 (DeepSeek FlashMLA "MODEL1" layout)
    fp8     one fp32 scale amax/448 per entry; e4m3 data
    mxfp4   per 32 channels a power-of-two scale (UE8M0 byte); E2M1 data, two per byte
    nvfp4   per entry an fp32 global scale g, per 16 channels an e4m3 scale s; E2M1 data

Rounding: e4m3 values come from torch's fp32 -> float8_e4m3fn cast (nearest, ties to
even) after clamping to ±448. E2M1 values are rounded to the nearest of
{0, 0.5, 1, 1.5, 2, 3, 4, 6} with ties to the even code (the code whose mantissa bit is
0, as IEEE round-half-even and the PTX cvt.rn E2M1 conversion do): 0.25 -> 0, 0.75 -> 1,
1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; magnitudes above 6 saturate to 6. An E2M1
code is sign << 3 | magnitude index; the sign is the sign bit of the input, so small
negative values (and -0.0) store -0 (code 8). Packing: element 2i in the low nibble of
byte i, element 2i+1 in the high nibble.

Non-finite inputs (quantised formats only; bf16/fp32, and the bf16 rope part of fp8_ds,
store values as they are): NaN is stored as 0; ±inf saturates to ± the largest magnitude
of its scale group (±448·scale for fp8_ds and fp8, ±6·scale for mxfp4, ±6·s·g for
nvfp4). Scales are computed from the finite values only, so a scale is never NaN or inf;
an all-zero (or all non-finite) group gets the smallest scale of its format, finite, and
decodes to exact zeros.
"""

from __future__ import annotations

import math

import torch


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """[N, C] tensor -> [N, C * itemsize] uint8 (a copy only if x is not contiguous)."""
    return x.contiguous().view(torch.uint8).reshape(x.shape[0], -1)


def bf16_encode(x: torch.Tensor, rope_dim: int = 0) -> tuple[torch.Tensor]:
    return (_as_bytes(x.to(torch.bfloat16)),)


def bf16_decode(data: torch.Tensor, rope_dim: int = 0) -> torch.Tensor:
    return data.contiguous().view(torch.bfloat16).float()


def fp32_encode(x: torch.Tensor, rope_dim: int = 0) -> tuple[torch.Tensor]:
    return (_as_bytes(x.to(torch.float32)),)


def fp32_decode(data: torch.Tensor, rope_dim: int = 0) -> torch.Tensor:
    return data.contiguous().view(torch.float32).clone()


_HADAMARD: dict[tuple[int, torch.device], torch.Tensor] = {}


def hadamard_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix [n, n] fp32 (symmetric, orthogonal: H @ H = I)."""
    key = (n, torch.device(device))
    if key not in _HADAMARD:
        assert n > 0 and n & (n - 1) == 0, "Hadamard size must be a power of two"
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD[key] = (h / math.sqrt(n)).to(device)
    return _HADAMARD[key]


def fwht(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] -> x @ H_n (fp32) by the butterfly: stages h = 1, 2, 4, .. n/2 turn each pair
    (a, b) = (x[i], x[i + h]) (bit h of i clear) into (a + b, a - b), then one multiply by
    fp32(1/sqrt(n)). Every output is a fixed sequence of fp32 adds, so the result (and the
    cache bytes encoded from it) is the same on every device and inside a kernel, which a
    matmul's BLAS-chosen summation order is not (`triton.hadamard.fwht_rows` is its twin)."""
    n = x.shape[-1]
    assert n > 0 and n & (n - 1) == 0, "Hadamard size must be a power of two"
    lead = x.shape[:-1]
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.reshape(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, n)
        h *= 2
    return (y * (1.0 / math.sqrt(n))).reshape(*lead, n)


# ------------------------------------------------------------------ shared helpers
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0 ** -9
E2M1_MAX = 6.0
AMAX_FLOOR = 1e-4                        # fp8_ds, fp8, nvfp4: amax below this is treated as this
MXFP4_AMAX_FLOOR = E2M1_MAX * 2.0 ** -126  # keeps the mxfp4 exponent >= -126 (byte >= 1)
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _finite_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dim, finite values only (0 if there are none). fp32."""
    return torch.where(torch.isfinite(x), x.abs(), 0.0).amax(-1)


def _no_nan(x: torch.Tensor) -> torch.Tensor:
    """x with NaN replaced by +0 (±inf kept: the clamp / rounding that follows saturates it)."""
    return torch.where(torch.isnan(x), 0.0, x)


def _ceil_log2_ratio(a: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest integer e with a <= qmax * 2^e, exactly, for a > 0 finite. int32.

    With a = m * 2^E and qmax = mq * 2^Eq (frexp, m and mq in [0.5, 1)): m/mq lies in
    (1/2, 2), so e = E - Eq if m <= mq, else E - Eq + 1. No log2 rounding involved.
    """
    m, ex = torch.frexp(a)
    mq, eq = math.frexp(qmax)
    return ex - eq + (m > mq).to(torch.int32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as fp32, exactly, for integer e in [-126, 127] (built from the exponent bits)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _ue8m0_decode(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (1..254) -> 2^(b - 127) fp32."""
    return _pow2(b.to(torch.int32) - 127)


def _div(a: torch.Tensor, c: float) -> torch.Tensor:
    """a / c, correctly rounded on every device. (`a / c` with a Python scalar runs as
    a * (1/c) on CUDA, which is off by one ulp for about half of all a.)"""
    return a / torch.full_like(a, c)


def _bytes_as(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, C * itemsize] uint8 (possibly a strided page view) -> [N, C] of `dtype`."""
    return b.contiguous().view(dtype)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """fp32 (no NaN) -> E2M1 codes uint8 in [0, 16): nearest value, ties to even code, saturating.

    Midpoint k lies between magnitude indices k and k+1; a value exactly on it goes up iff
    k+1 is even, i.e. k is odd.
    """
    a = v.abs().unsqueeze(-1)
    mids = torch.tensor(_E2M1_MIDPOINTS, device=v.device)
    tie_up = torch.arange(len(_E2M1_MIDPOINTS), device=v.device) % 2 == 1
    index = ((a > mids) | ((a == mids) & tie_up)).sum(-1)
    return (index | (torch.signbit(v).to(index.dtype) << 3)).to(torch.uint8)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> fp32 values (code 8 is -0.0)."""
    lut = torch.tensor(_E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), device=codes.device)
    return lut[codes.long()]


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, D] codes < 16 -> [N, D/2] uint8; element 2i in the low nibble, 2i+1 in the high."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[N, D/2] uint8 -> [N, D] codes (inverse of `_pack_nibbles`)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def _e4m3_bytes(v: torch.Tensor) -> torch.Tensor:
    """fp32 (no NaN) -> e4m3fn raw bytes, clamped to ±448 first (±inf saturates)."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    return _bytes_as(b, torch.float8_e4m3fn).float()


# ------------------------------------------------------------------ fp8_ds (main entries)
def fp8_ds_encode(x: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek "MODEL1" entries: e4m3 nope with a UE8M0 scale per 64 channels, bf16 rope.

    Args:
        x: [N, D] float; nope = D - rope_dim is a multiple of 64 (tiles = nope / 64).
    Returns:
        kv: [N, nope + 2*rope_dim] uint8 = e4m3 nope bytes | bf16 rope bytes (little-endian).
        scale: [N, ceil(tiles/8)*8] uint8; byte t = e_t + 127 for tile t, pad bytes 0.
    Per tile: e = ceil(log2(max(amax, 1e-4) / 448)) (exact), q = e4m3(clamp(x / 2^e, ±448)).
    """
    x = x.float()
    n, d = x.shape
    nope = d - rope_dim
    tiles = nope // 64
    xn = _no_nan(x[:, :nope]).view(n, tiles, 64)
    e = _ceil_log2_ratio(_finite_amax(xn).clamp_min(AMAX_FLOOR), E4M3_MAX)     # [N, tiles]
    q = _e4m3_bytes(xn / _pow2(e).unsqueeze(-1)).view(n, nope)
    rope = _as_bytes(x[:, nope:].to(torch.bfloat16)) if rope_dim else q.new_empty(n, 0)
    scale = torch.zeros(n, -(-tiles // 8) * 8, dtype=torch.uint8, device=x.device)
    scale[:, :tiles] = (e + 127).to(torch.uint8)
    return torch.cat([q, rope], dim=1), scale


def fp8_ds_decode(kv: torch.Tensor, scale: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """kv [N, nope + 2*rope_dim], scale [N, >= tiles] uint8 -> [N, nope + rope_dim] fp32 (exact products)."""
    n = kv.shape[0]
    nope = kv.shape[1] - 2 * rope_dim
    tiles = nope // 64
    q = _e4m3_decode(kv[:, :nope]).view(n, tiles, 64)
    nope_part = (q * _ue8m0_decode(scale[:, :tiles]).unsqueeze(-1)).view(n, nope)
    rope_part = _bytes_as(kv[:, nope:], torch.bfloat16).float()
    return torch.cat([nope_part, rope_part], dim=1)


# ------------------------------------------------------------------ fp8 (indexer keys)
def fp8_encode(x: torch.Tensor, rope_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-entry fp32 scale, e4m3 data. rope_dim is unused (indexer keys have no bf16 part).

    Returns:
        data: [N, D] uint8 = e4m3(clamp(x / scale, ±448)) raw bytes.
        scale: [N, 4] uint8 = the fp32 scale max(amax, 1e-4) / 448 as bytes.
    """
    x = x.float()
    scale = _div(_finite_amax(x).clamp_min(AMAX_FLOOR), E4M3_MAX)             # [N]
    data = _e4m3_bytes(_no_nan(x) / scale.unsqueeze(-1))
    return data, _as_bytes(scale.unsqueeze(-1))


def fp8_decode(data: torch.Tensor, scale: torch.Tensor, rope_dim: int = 0) -> torch.Tensor:
    """data [N, D], scale [N, 4] uint8 -> [N, D] fp32 = e4m3 * scale."""
    return _e4m3_decode(data) * _bytes_as(scale, torch.float32)


# ------------------------------------------------------------------ mxfp4 (indexer keys)
def mxfp4_encode(x: torch.Tensor, rope_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX FP4: E2M1 data with a UE8M0 scale per 32 channels. rope_dim is unused.

    Args:
        x: [N, D] float, D a multiple of 32.
    Returns:
        data: [N, D/2] uint8, two E2M1 codes per byte (element 2i low nibble, 2i+1 high).
        scale: [N, D/32] uint8 = e + 127, e = ceil(log2(max(amax, 6*2^-126) / 6)) (exact),
        so |x| / 2^e <= 6 for every finite x of the group.
    """
    x = x.float()
    n, d = x.shape
    g = _no_nan(x).view(n, d // 32, 32)
    e = _ceil_log2_ratio(_finite_amax(g).clamp_min(MXFP4_AMAX_FLOOR), E2M1_MAX)  # [N, D/32]
    codes = _e2m1_codes(g / _pow2(e).unsqueeze(-1)).view(n, d)
    return _pack_nibbles(codes), (e + 127).to(torch.uint8)


def mxfp4_decode(data: torch.Tensor, scale: torch.Tensor, rope_dim: int = 0) -> torch.Tensor:
    """data [N, D/2], scale [N, D/32] uint8 -> [N, D] fp32 = E2M1 value * 2^(byte - 127) (exact)."""
    v = _e2m1_values(_unpack_nibbles(data))
    n, d = v.shape
    return (v.view(n, d // 32, 32) * _ue8m0_decode(scale).unsqueeze(-1)).view(n, d)


# ------------------------------------------------------------------ nvfp4 (indexer keys)
def _nvfp4_group_scale(s_bytes: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """e4m3 group scales [N, G] uint8 and global scales g [N] -> s * g [N, G, 1] fp32."""
    return (_e4m3_decode(s_bytes) * g.unsqueeze(-1)).unsqueeze(-1)


def nvfp4_encode(x: torch.Tensor, rope_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVIDIA FP4: E2M1 data, an e4m3 scale s per 16 channels, an fp32 global scale g per entry.

    g = max(amax, 1e-4) / (448*6); s = e4m3(min(amax_16 / (6*g), 448)), and the smallest
    e4m3 subnormal 2^-9 where that rounds to 0; code = E2M1(x / (s*g)), with s*g one fp32
    product shared by encode and decode. rope_dim is unused.

    Args:
        x: [N, D] float, D a multiple of 16.
    Returns:
        data: [N, D/2] uint8 (packed as in mxfp4), scale: [N, D/16] uint8 e4m3 bytes,
        global: [N, 4] uint8 = g as fp32 bytes.
    """
    x = x.float()
    n, d = x.shape
    grp = _no_nan(x).view(n, d // 16, 16)
    g = _div(_finite_amax(x).clamp_min(AMAX_FLOOR), E4M3_MAX * E2M1_MAX)          # [N]
    s = _e4m3_bytes(_finite_amax(grp) / (E2M1_MAX * g).unsqueeze(-1))             # [N, D/16]
    s = torch.where(s == 0, torch.tensor(1, dtype=torch.uint8, device=x.device), s)  # 0x01 = 2^-9
    codes = _e2m1_codes(grp / _nvfp4_group_scale(s, g)).view(n, d)
    return _pack_nibbles(codes), s, _as_bytes(g.unsqueeze(-1))


def nvfp4_decode(data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                 rope_dim: int = 0) -> torch.Tensor:
    """data [N, D/2], scale [N, D/16], global [N, 4] uint8 -> [N, D] fp32 = value * (s*g)."""
    v = _e2m1_values(_unpack_nibbles(data))
    n, d = v.shape
    g = _bytes_as(global_scale, torch.float32).view(n)
    return (v.view(n, d // 16, 16) * _nvfp4_group_scale(scale, g)).view(n, d)


# ------------------------------------------------------------------ indexer queries
#: codecs whose rounding the indexer queries take (the keys' format; fp32 keys: queries unrounded)
_QUERY_CODECS = {"mxfp4": (mxfp4_encode, mxfp4_decode), "fp8": (fp8_encode, fp8_decode),
                 "nvfp4": (nvfp4_encode, nvfp4_decode), "bf16_i": (bf16_encode, bf16_decode)}


def round_query(name: str, x: torch.Tensor) -> torch.Tensor:
    """Indexer queries [..., D] (already in the keys' stored basis) -> fp32 decode(encode(x)) in the
    indexer-key format `name`, per row of D: DeepSeek-V4's indexer multiplies FP4 queries by FP4 keys
    (its QK path was trained quantisation-aware), so a query is rounded exactly as a key of the same
    format is. "fp32_i": x as fp32, unchanged."""
    if name not in _QUERY_CODECS:
        return x.float()
    encode, decode = _QUERY_CODECS[name]
    d = x.shape[-1]
    return decode(*encode(x.reshape(-1, d))).view(x.shape)
