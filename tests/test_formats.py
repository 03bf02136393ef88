"""Storage formats: sizes, codec round trips within stated bounds, byte layout, non-finite policy.

Error bounds (per element, x in the stored basis, i.e. after the Hadamard rotation for the
quantised indexer formats; all derived from round-to-nearest-even):

* fp8_ds nope, tile scale 2^e: x / 2^e is exact and |x / 2^e| <= 448 (e is the smallest
  exponent with amax <= 448 * 2^e), so the only error is the e4m3 rounding: half a step,
  i.e. <= |v| / 16 for normal e4m3 (3 mantissa bits) and <= 2^-10 for subnormals
  (step 2^-9). Decoding multiplies by 2^e exactly, so |err| <= max(|x| / 16, 2^e * 2^-10)
  with no slack. The rope part equals x.to(bf16) exactly.
* fp8, fp32 scale c = amax / 448: the same bound max(|x| / 16, c * 2^-10), plus fp32 slack
  for the division x / c, the clamp to 448 and the product q * c (a few 2^-24 relative).
* mxfp4, group scale 2^e with amax <= 6 * 2^e, so v = x / 2^e never saturates. E2M1 rounding:
  half the gap is 1/4 below 2 and at most v / 5 above (worst cases at the ties 1.25, 2.5, 5),
  so |err| <= max(|x| / 5, 2^e / 4), exact (power-of-two scaling).
* nvfp4, sg = s * g: as mxfp4 with sg, |err| <= max(|x| / 5, sg / 4) when |x / sg| <= 6. A
  group saturates only because its e4m3 scale s rounded down: for normal s by <= 1/16
  relative, so |x / sg| <= 6.4 and the error (<= 0.4 sg) is below |x| / 5; for subnormal s
  (step 2^-9) by <= 2^-10, so the error is <= 6 g 2^-10. Bound:
  max(|x| / 5, sg / 4, 6 g 2^-10), plus fp32 slack.
* bf16 / fp32: exact against x.to(bf16) / x.

Scores: decode error e = k_hat - H k is bounded per element by b, so
|(H q) . k_hat - q . k| <= ||q|| ||b|| (Cauchy-Schwarz, H orthogonal) plus fp32 rounding of
the rotation.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.cache.formats import INDEXER_FORMATS, MAIN_FORMATS, EntryFormat, indexer_format, main_format
from dsv4.errors import FormatError
from dsv4.kernels.reference import quant

MAIN_DIMS = [(512, 64), (128, 64), (192, 64), (640, 64)]   # 7, 1, 2 and 9 fp8 tiles
INDEXER_DIMS = [128, 64]
QUANTISED_INDEXER = ("mxfp4", "fp8", "nvfp4")

ALL_FORMATS = ([main_format(n, d, r) for n in MAIN_FORMATS for d, r in MAIN_DIMS]
               + [indexer_format(n, d) for n in INDEXER_FORMATS for d in INDEXER_DIMS])


def _fid(f: EntryFormat) -> str:
    return f"{f.name}-{f.dim}-{f.rope_dim}"


# ------------------------------------------------------------------ helpers
def _rows(n: int, d: int) -> torch.Tensor:
    """Random rows: a zero row, a tiny row (1e-6), a half-tiny row, outliers (x1000)."""
    x = torch.randn(n, d)
    x[0] = 0
    x[1] = torch.randn(d) * 1e-6
    x[2, : d // 2] *= 1e-6
    rows = torch.randint(3, n, (max(1, n // 4),))
    x[rows, torch.randint(0, d, rows.shape)] *= 1000
    return x


def _f32(b: torch.Tensor) -> torch.Tensor:
    """[N, 4k] uint8 -> [N, k] fp32."""
    return b.contiguous().view(torch.float32)


def _e4m3_from_bits(b: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes -> float64, decoded from the bit fields (independent of torch's fp8 type)."""
    b = b.long()
    sign = 1.0 - 2.0 * (b >> 7)
    exp, man = (b >> 3) & 0xF, b & 0x7
    normal = torch.ldexp(1.0 + man.double() / 8, exp - 7)
    sub = man.double() / 8 * 2.0**-6
    return sign * torch.where(exp > 0, normal, sub)


_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e2m1_from_nibbles(b: torch.Tensor) -> torch.Tensor:
    """[N, D/2] packed bytes -> [N, D] float64: low nibble first (by hand, with a table)."""
    lut = torch.tensor(_E2M1 + [-v for v in _E2M1], dtype=torch.float64)
    lo, hi = lut[(b & 0xF).long()], lut[(b >> 4).long()]
    return torch.stack([lo, hi], -1).reshape(b.shape[0], -1)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e (integer tensor e) as float64, exactly."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float64), e.long())


def _finite_amax(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x.abs(), 0.0).amax(-1)


def _error_bound(fmt: EntryFormat, ref: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-element bound of |decode - ref| (float64 [N, D]); see the module docstring."""
    a = ref.double().abs()
    if fmt.name == "fp8_ds":
        nope = fmt.dim - fmt.rope_dim
        scale = _pow2(parts["scale"][:, : nope // 64].long() - 127)
        b = a * 2.0**-8                                    # rope: bf16 rounding (checked exactly too)
        b[:, :nope] = torch.maximum(a[:, :nope] / 16, scale.repeat_interleave(64, 1) * 2.0**-10)
        return b
    if fmt.name == "fp8":
        c = _f32(parts["scale"]).double()
        return torch.maximum(a / 16, c * 2.0**-10) * (1 + 1e-5) + a * 1e-6
    if fmt.name == "mxfp4":
        scale = _pow2(parts["scale"].long() - 127)
        return torch.maximum(a / 5, scale.repeat_interleave(32, 1) / 4)
    if fmt.name == "nvfp4":
        g = _f32(parts["global"]).double()
        sg = _e4m3_from_bits(parts["scale"]).repeat_interleave(16, 1) * g
        return torch.maximum(torch.maximum(a / 5, sg / 4), 6 * g * 2.0**-10) * (1 + 1e-5) + a * 1e-6
    if fmt.name in ("bf16", "bf16_i"):
        return a * 2.0**-8
    return torch.zeros_like(a)


def _check_scales(fmt: EntryFormat, ref: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
    """The stored scales are the ones the format's docstring specifies (float64 arithmetic)."""
    n = ref.shape[0]
    if fmt.name in ("fp8_ds", "mxfp4"):
        group, qmax, floor = (64, 448.0, 1e-4) if fmt.name == "fp8_ds" else (32, 6.0, 6 * 2.0**-126)
        quantised = ref[:, : fmt.dim - fmt.rope_dim]
        groups = quantised.shape[1] // group
        amax = _finite_amax(quantised.reshape(n, groups, group)).double().clamp_min(torch.tensor(floor).float())
        sb = parts["scale"]
        e = sb[:, :groups].long() - 127
        assert (qmax * _pow2(e) >= amax).all()
        assert (qmax * _pow2(e - 1) < amax).all()
        assert (sb[:, groups:] == 0).all()                # pad bytes
    elif fmt.name == "fp8":
        expected = _finite_amax(ref).clamp_min(1e-4) / 448.0
        assert torch.equal(_f32(parts["scale"]).view(n), expected)
    elif fmt.name == "nvfp4":
        g = _finite_amax(ref).clamp_min(1e-4) / 2688.0
        assert torch.equal(_f32(parts["global"]).view(n), g)
        t = (_finite_amax(ref.reshape(n, -1, 16)) / (6 * g[:, None])).clamp_max(448.0)
        s = t.to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(parts["scale"], torch.where(s == 0, 1, s).to(torch.uint8))


def _check_roundtrip(fmt: EntryFormat, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Encode/decode x [N, dim]; check shapes, exact parts, scales and the error bound."""
    parts = fmt.encode(x)
    n = x.shape[0]
    assert list(parts) == [r.name for r in fmt.regions]
    for r in fmt.regions:
        assert parts[r.name].dtype == torch.uint8 and parts[r.name].shape == (n, r.bytes_per_entry)
    y = fmt.decode(parts)
    ref = fmt.to_stored_basis(x).float()
    assert y.dtype == torch.float32 and y.shape == x.shape
    if fmt.name in ("bf16", "bf16_i"):
        assert torch.equal(y, ref.to(torch.bfloat16).float())
    elif fmt.name in ("fp32", "fp32_i"):
        assert torch.equal(y, ref)
    else:
        _check_scales(fmt, ref, parts)
        if fmt.name == "fp8_ds":
            nope = fmt.dim - fmt.rope_dim
            assert torch.equal(y[:, nope:], ref[:, nope:].to(torch.bfloat16).float())
        err = (y.double() - ref.double()).abs()
        bound = _error_bound(fmt, ref, parts)
        worst = (err - bound).max().item()
        assert worst <= 0, f"{fmt.name}: error exceeds bound by {worst}"
    return y, ref, parts


# ------------------------------------------------------------------ sizes
MAIN_ENTRY = {
    "fp8_ds": {(512, 64): 584, (128, 64): 200, (192, 64): 264, (640, 64): 720},
    "bf16": {(512, 64): 1024, (128, 64): 256, (192, 64): 384, (640, 64): 1280},
    "fp32": {(512, 64): 2048, (128, 64): 512, (192, 64): 768, (640, 64): 2560},
}
INDEXER_ENTRY = {
    "mxfp4": {128: 68, 64: 34}, "fp8": {128: 132, 64: 68}, "nvfp4": {128: 76, 64: 40},
    "bf16": {128: 256, 64: 128}, "fp32": {128: 512, 64: 256},
}


@pytest.mark.parametrize("name", MAIN_FORMATS)
@pytest.mark.parametrize("dims", MAIN_DIMS)
def test_main_entry_and_page_bytes(name, dims):
    fmt = main_format(name, *dims)
    assert fmt.entry_bytes == MAIN_ENTRY[name][dims]
    row = fmt.regions[0].bytes_per_entry
    for p in (1, 7, 16, 64, 128):
        assert fmt.page_bytes(p) == math.ceil(fmt.entry_bytes * p / row) * row


@pytest.mark.parametrize("name", INDEXER_FORMATS)
@pytest.mark.parametrize("dim", INDEXER_DIMS)
def test_indexer_entry_and_page_bytes(name, dim):
    fmt = indexer_format(name, dim)
    assert fmt.entry_bytes == INDEXER_ENTRY[name][dim]
    assert fmt.hadamard == (name in QUANTISED_INDEXER)
    row = fmt.regions[0].bytes_per_entry
    for p in (1, 7, 16, 64, 128):
        assert fmt.page_bytes(p) == math.ceil(fmt.entry_bytes * p / row) * row


def test_fp8_ds_model1_layout_numbers():
    fmt = main_format("fp8_ds", 512, 64)
    assert [(r.name, r.bytes_per_entry) for r in fmt.regions] == [("kv", 576), ("scale", 8)]
    assert fmt.page_bytes(64) == math.ceil(584 * 64 / 576) * 576 == 37440
    assert fmt.region_offsets(64) == {"kv": 0, "scale": 576 * 64}
    assert main_format("fp8_ds", 640, 64).regions[1].bytes_per_entry == 16   # 9 tiles -> 16 bytes
    assert indexer_format("mxfp4", 128).page_bytes(64) == 68 * 64
    assert indexer_format("nvfp4", 128).page_bytes(3) == 256                 # 228 raw, rows of 64


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=_fid)
def test_roundtrip_within_bounds(fmt):
    x = _rows(32, fmt.dim)
    y, _, _ = _check_roundtrip(fmt, x)
    assert torch.equal(y[0], torch.zeros(fmt.dim))        # zero row decodes to exact zeros
    assert torch.isfinite(y).all()
    assert torch.equal(fmt.roundtrip(x.view(4, 8, fmt.dim)), y.view(4, 8, fmt.dim))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=_fid)
def test_roundtrip_bf16_input(fmt):
    _check_roundtrip(fmt, _rows(16, fmt.dim).to(torch.bfloat16))


_HYPO_FORMATS = [f for f in ALL_FORMATS if f.dim in (128, 192)]


@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(_HYPO_FORMATS), seed=st.integers(0, 2**31 - 1),
       log_mag=st.floats(-30, 30), outlier=st.sampled_from([1.0, 1e3, 1e6]))
def test_roundtrip_bounds_property(fmt, seed, log_mag, outlier):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, fmt.dim, generator=gen) * 10.0**log_mag
    x[torch.arange(8), torch.randint(0, fmt.dim, (8,), generator=gen)] *= outlier
    _check_roundtrip(fmt, x)


@pytest.mark.parametrize("name", INDEXER_FORMATS)
@pytest.mark.parametrize("dim", INDEXER_DIMS)
def test_indexer_scores_preserved(name, dim):
    fmt = indexer_format(name, dim)
    q, k = torch.randn(8, dim), _rows(64, dim)
    k_hat = fmt.roundtrip(k)
    parts = fmt.encode(k)
    bound = _error_bound(fmt, fmt.to_stored_basis(k).float(), parts)
    exact = q.double() @ k.double().T
    got = fmt.to_stored_basis(q).double() @ k_hat.double().T
    qn, kn = q.double().norm(dim=1)[:, None], k.double().norm(dim=1)[None, :]
    allowed = qn * bound.norm(dim=1)[None, :] + 1e-5 * qn * kn
    assert ((got - exact).abs() <= allowed).all()
    # and on plain gaussian keys the scores stay well correlated
    kg = torch.randn(256, dim)
    s_ref = (q @ kg.T).flatten()
    s_hat = (fmt.to_stored_basis(q) @ fmt.roundtrip(kg).T).flatten()
    corr = torch.corrcoef(torch.stack([s_ref, s_hat]))[0, 1].item()
    assert corr > {"mxfp4": 0.98, "nvfp4": 0.98, "fp8": 0.998}.get(name, 0.9999)


def test_hadamard_rotation_is_orthogonal_and_applied():
    fmt = indexer_format("fp8", 128)
    x = torch.randn(4, 128)
    rotated = fmt.to_stored_basis(x)
    h = quant.hadamard_matrix(128)
    assert torch.allclose(rotated, x @ h) and torch.allclose(h @ h, torch.eye(128), atol=1e-6)
    # keys are stored rotated: encoding rotated keys without the rotation gives the same bytes
    direct = quant.fp8_encode(rotated)
    assert all(torch.equal(a, b) for a, b in zip(fmt.encode(x).values(), direct))


# ------------------------------------------------------------------ byte layout
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=_fid)
def test_page_views_at_documented_offsets(fmt):
    p, nblocks = 16, 3
    n = p * nblocks
    x = _rows(n, fmt.dim)
    parts = fmt.encode(x)
    pages = torch.zeros(nblocks, fmt.page_bytes(p), dtype=torch.uint8)
    views = fmt.views(pages, p)
    where = torch.randperm(n)                              # row r goes to (block, slot) = divmod(where[r], p)
    blk, slot = where // p, where % p
    for name, v in views.items():
        v[blk, slot] = parts[name]
    # by hand: region j of every entry sits after regions 0..j-1 of all p entries
    off = 0
    for r in fmt.regions:
        for i in range(n):
            b, s = int(blk[i]), int(slot[i])
            at = off + s * r.bytes_per_entry
            assert torch.equal(pages[b, at: at + r.bytes_per_entry], parts[r.name][i])
        off += r.bytes_per_entry * p
    assert off == fmt.entry_bytes * p and (pages[:, off:] == 0).all()
    # reading through the (strided) views decodes to the same values
    back = {name: v[blk, slot] for name, v in views.items()}
    assert torch.equal(fmt.decode(back), fmt.decode(parts))


def test_fp8_ds_page_bytes_by_hand():
    fmt, p = main_format("fp8_ds", 512, 64), 64
    x = _rows(2 * p, 512)
    parts = fmt.encode(x)
    pages = torch.zeros(2, fmt.page_bytes(p), dtype=torch.uint8)
    v = fmt.views(pages, p)
    v["kv"][:] = parts["kv"].view(2, p, 576)
    v["scale"][:] = parts["scale"].view(2, p, 8)
    y = fmt.decode(parts)
    for b in range(2):
        for i in range(p):
            row = b * p + i
            nope = _e4m3_from_bits(pages[b, 576 * i: 576 * i + 448]).view(7, 64)
            rope = pages[b, 576 * i + 448: 576 * i + 576].view(torch.bfloat16).double()
            sbytes = pages[b, 576 * p + 8 * i: 576 * p + 8 * i + 8]
            assert sbytes[7] == 0
            scale = _pow2(sbytes[:7].long() - 127)
            by_hand = torch.cat([(nope * scale[:, None]).flatten(), rope])
            assert torch.equal(by_hand, y[row].double())
    assert (pages[:, 584 * p:] == 0).all()


@pytest.mark.parametrize("k", [-20, -5, 0, 3, 20])
def test_fp8_ds_scale_byte_exact_powers(k):
    x = torch.randn(3, 128) * 2.0**k                         # |x| < 448 * 2^k
    x[:, 0] = 448 * 2.0**k                                   # tile amax exactly 448 * 2^k
    x[1, 0] = torch.nextafter(torch.tensor(448 * 2.0**k), torch.tensor(math.inf))   # just above
    x[2, 0] = -448 * 2.0**k
    kv, scale = quant.fp8_ds_encode(x, 64)
    assert scale[:, 0].tolist() == [127 + k, 128 + k, 127 + k]
    assert kv[0, 0] == 0x7E and kv[2, 0] == 0xFE              # ±448: the largest e4m3
    y = quant.fp8_ds_decode(kv, scale, 64)
    assert y[0, 0] == x[0, 0] and y[2, 0] == x[2, 0]


def test_fp8_ds_known_value():
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1] = 1.0, -0.5                             # tile amax 1: scale 2^ceil(log2(1/448)) = 2^-8
    x[0, 64], x[0, 65] = 1.0, -2.0                           # rope channels, bf16
    kv, scale = quant.fp8_ds_encode(x, 64)
    assert scale[0].tolist() == [119, 0, 0, 0, 0, 0, 0, 0]
    assert kv[0, 0] == 0x78 and kv[0, 1] == 0xF0             # 256 = 2^8 -> 0x78; -128 -> 0xF0
    assert kv[0, 64:68].tolist() == [0x80, 0x3F, 0x00, 0xC0]  # bf16 1.0, -2.0 little-endian
    assert torch.equal(quant.fp8_ds_decode(kv, scale, 64), x)


def test_fp8_ds_zero_row_scale():
    kv, scale = quant.fp8_ds_encode(torch.zeros(2, 192), 64)
    assert (scale[:, :2] == 127 - 22).all()                  # ceil(log2(1e-4 / 448)) = -22
    assert (kv == 0).all()


def test_mxfp4_nibble_order_and_ties():
    x = torch.zeros(3, 64)
    x[0, :2] = torch.tensor([0.5, 6.0])
    x[1, :4] = torch.tensor([-0.5, -6.0, -0.0, 0.0])        # the sign bit of -0.0 is kept
    x[2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0,
                              -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0])
    x[2, 32:34] = torch.tensor([3.0, 1.5 * 2**-4])           # second group: amax 3 -> scale 2^-1
    data, scale = quant.mxfp4_encode(x)
    assert data[0, 0] == 0x71 and data[1, 0] == 0xF9        # low nibble = element 0
    assert data[1, 1] == 0x08
    assert scale[0].tolist() == [127, 1] and scale[2].tolist() == [127, 126]   # zero group: floor
    # ties to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    codes = [int(c) for b in data[2, :8] for c in (b & 0xF, b >> 4)]
    assert codes == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 15]
    y = quant.mxfp4_decode(data, scale)
    assert y[2, :16].tolist() == [0, 1, 1, 2, 2, 4, 4, 6, -0.0, -1, -1, -2, -2, -4, -4, -6]
    assert y[2, 32:34].tolist() == [3.0, 0.0]               # 1.5*2^-4 / 2^-1 = 0.1875 -> 0
    assert torch.equal(_e2m1_from_nibbles(data) * _pow2(scale.long() - 127).repeat_interleave(32, 1), y.double())


@pytest.mark.parametrize("k", [-100, -3, 0, 5, 100])
def test_mxfp4_scale_byte_exact_powers(k):
    x = torch.zeros(2, 32)
    x[0, 0] = 6 * 2.0**k
    x[1, 0] = torch.nextafter(torch.tensor(6 * 2.0**k), torch.tensor(math.inf))
    data, scale = quant.mxfp4_encode(x)
    assert scale[:, 0].tolist() == [127 + k, 128 + k]
    assert quant.mxfp4_decode(data, scale)[0, 0] == 6 * 2.0**k


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.sampled_from([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 1.0, 3.0]),
                          st.floats(-7.0, 7.0, width=32)), min_size=31, max_size=31))
def test_mxfp4_rounds_to_nearest_ties_even(values):
    x = torch.tensor([[6.0] + values])                       # amax 6 (or up to 7): scale 1 or 2
    data, scale = quant.mxfp4_encode(x)
    s = 2.0 ** (int(scale[0, 0]) - 127)
    got = _e2m1_from_nibbles(data)[0].tolist()
    for v, g in zip(x[0].tolist(), got):
        mag = abs(v) / s
        dist = [abs(mag - m) for m in _E2M1]
        best = min(dist)
        cands = [i for i, d in enumerate(dist) if d == best]
        idx = next((i for i in cands if i % 2 == 0), cands[0])
        assert g == math.copysign(_E2M1[idx], v)


def test_fp8_scale_bytes_and_values():
    x = torch.randn(2, 64)
    x[1] = 0
    data, scale = quant.fp8_encode(x)
    c = float(x[0].abs().max()) / 448
    assert bytes(scale[0].tolist()) == struct.pack("<f", struct.unpack("<f", struct.pack("<f", c))[0])
    assert _f32(scale)[1, 0].item() == pytest.approx(1e-4 / 448)
    assert (data[1] == 0).all()
    y = quant.fp8_decode(data, scale)
    assert torch.equal(y.double(), _e4m3_from_bits(data) * _f32(scale).double())


def test_nvfp4_layout_by_hand():
    x = torch.zeros(2, 64)
    x[0, :16] = torch.linspace(-3, 3, 16)
    x[0, 16] = 12.0                                          # row amax 12: g = 12 / 2688
    x[0, 17] = 1.0                                           # second group amax 12 -> s = 448
    data, scale, glob = quant.nvfp4_encode(x)
    g = struct.unpack("<f", bytes(glob[0].tolist()))[0]
    assert g == torch.tensor(12.0 / 2688, dtype=torch.float32).item()
    assert scale[0, 1] == 0x7E                               # e4m3 448
    assert scale[0, 2] == 0x01 and scale[0, 3] == 0x01       # zero groups: smallest subnormal
    assert scale[1].tolist() == [1, 1, 1, 1]
    assert (data[0, 8] & 0xF) == 7                           # 12 -> 6 * s * g, code 7 in the low nibble
    y = quant.nvfp4_decode(data, scale, glob)
    sg = (_e4m3_from_bits(scale).float() * g).repeat_interleave(16, 1)
    assert torch.equal(y, _e2m1_from_nibbles(data).float() * sg)
    assert y[0, 16] == pytest.approx(12.0, rel=1e-6) and torch.equal(y[1], torch.zeros(64))


# ------------------------------------------------------------------ non-finite inputs
CODECS = {
    "fp8_ds": (lambda x: quant.fp8_ds_encode(x, 64), lambda p: quant.fp8_ds_decode(*p, 64)),
    "fp8": (quant.fp8_encode, lambda p: quant.fp8_decode(*p)),
    "mxfp4": (quant.mxfp4_encode, lambda p: quant.mxfp4_decode(*p)),
    "nvfp4": (quant.nvfp4_encode, lambda p: quant.nvfp4_decode(*p)),
}


def _group_max(name: str, parts: tuple[torch.Tensor, ...], d: int) -> torch.Tensor:
    """The largest representable magnitude for every element's scale group, [N, d] float32."""
    if name == "fp8_ds":
        return 448 * _pow2(parts[1][:, : (d - 64) // 64].long() - 127).float().repeat_interleave(64, 1)
    if name == "fp8":
        return 448 * _f32(parts[1]).expand(-1, d)
    if name == "mxfp4":
        return 6 * _pow2(parts[1].long() - 127).float().repeat_interleave(32, 1)
    return 6 * (_e4m3_from_bits(parts[1]).float() * _f32(parts[2])).repeat_interleave(16, 1)


@pytest.mark.parametrize("name", CODECS)
def test_non_finite_inputs(name):
    encode, decode = CODECS[name]
    d = 128
    q = d - 64 if name == "fp8_ds" else d                    # quantised channels
    x = torch.randn(6, d)
    x[0, 3], x[0, 40] = math.nan, math.inf
    x[1, 5], x[1, 6] = -math.inf, math.nan
    x[2, :q] = math.nan                                      # a whole row of NaN
    x[3, :q:2], x[3, 1:q:2] = math.inf, -math.inf            # a whole row of ±inf
    x[4, 0] = math.inf                                       # inf next to a finite group
    parts = encode(x)
    clean = encode(torch.where(torch.isfinite(x), x, 0.0))
    for a, b in zip(parts[1:], clean[1:]):                   # scales ignore non-finite values
        assert torch.equal(a, b)
    y = decode(parts)
    top = _group_max(name, parts, d)
    assert torch.isfinite(top).all() and (top > 0).all()
    yq, xq = y[:, :q], x[:, :q]
    assert not torch.isnan(yq).any() and torch.isfinite(yq).all()
    assert (yq[torch.isnan(xq)] == 0).all()
    assert torch.equal(yq[xq == math.inf], top[:, :q][xq == math.inf])
    assert torch.equal(yq[xq == -math.inf], -top[:, :q][xq == -math.inf])
    finite = torch.isfinite(xq)
    assert torch.equal(yq[finite], decode(clean)[:, :q][finite])


def test_fp8_ds_rope_keeps_non_finite_as_bf16():
    x = torch.randn(1, 128)
    x[0, 64], x[0, 65] = math.nan, -math.inf
    y = quant.fp8_ds_decode(*quant.fp8_ds_encode(x, 64), 64)
    assert torch.isnan(y[0, 64]) and y[0, 65] == -math.inf


@pytest.mark.parametrize("name", QUANTISED_INDEXER)
def test_indexer_non_finite_row_decodes_finite(name):
    fmt = indexer_format(name, 64)
    x = torch.randn(3, 64)
    x[0, 7] = math.nan                                       # the rotation spreads it over the row
    x[1, 2] = math.inf
    y = fmt.roundtrip(x)
    assert torch.isfinite(y).all()
    assert torch.equal(y[0], torch.zeros(64))


# ------------------------------------------------------------------ errors
def test_format_errors():
    with pytest.raises(FormatError):
        main_format("fp8_ds", 100, 64)                       # nope not a multiple of 64
    with pytest.raises(FormatError):
        main_format("fp8_ds", 64, 64)                        # no nope channels
    with pytest.raises(FormatError):
        main_format("fp4", 512, 64)
    with pytest.raises(FormatError):
        main_format("mxfp4", 512, 64)                        # an indexer format
    with pytest.raises(FormatError):
        indexer_format("fp8_ds", 128)
    with pytest.raises(FormatError):
        indexer_format("int4", 128)
    with pytest.raises(FormatError):
        indexer_format("mxfp4", 96)                          # not a power of two
    with pytest.raises(FormatError):
        indexer_format("nvfp4", 48)
    with pytest.raises(FormatError):
        EntryFormat(name="nope", dim=128)
    fmt = main_format("fp8_ds", 512, 64)
    with pytest.raises(FormatError):
        fmt.encode(torch.randn(2, 256))
    with pytest.raises(FormatError):
        fmt.views(torch.zeros(2, fmt.page_bytes(16) - 1, dtype=torch.uint8), 16)
    with pytest.raises(FormatError):
        fmt.views(torch.zeros(2, fmt.page_bytes(16), dtype=torch.int8), 16)
