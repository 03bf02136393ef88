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

import pytest
import torch
from format_helpers import (
    ALL_FORMATS,
    INDEXER_DIMS,
    MAIN_DIMS,
    QUANTISED_INDEXER,
    _check_roundtrip,
    _e4m3_from_bits,
    _error_bound,
    _f32,
    _fid,
    _pow2,
    _rows,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.cache.formats import INDEXER_FORMATS, MAIN_FORMATS, EntryFormat, indexer_format, main_format
from dsv4.errors import FormatError
from dsv4.kernels.reference import quant

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
    assert torch.allclose(rotated, x @ h, atol=1e-6) and torch.allclose(h @ h, torch.eye(128), atol=1e-6)
    # queries and keys are rotated by the same butterfly, and encoding its output without the
    # rotation gives the same bytes
    keys = quant.fwht(x)
    assert torch.equal(keys, rotated)
    direct = quant.fp8_encode(keys)
    assert all(torch.equal(a, b) for a, b in zip(fmt.encode(x).values(), direct))


@pytest.mark.parametrize("name", INDEXER_FORMATS)
@pytest.mark.parametrize("dim", INDEXER_DIMS)
def test_round_query_rounds_as_keys(name, dim):
    """A query rounded by `round_query` (in the stored basis) is what a key of the same values decodes
    to; mxfp4 / bf16 rounding is idempotent; fp32 keys leave queries alone. And the rounded query's scores stay
    within the keys' error bound of the exact ones, on both sides."""
    fmt = indexer_format(name, dim)
    x = _rows(32, dim)
    q = fmt.round_query(fmt.to_stored_basis(x))
    assert q.dtype == torch.float32 and torch.equal(q, fmt.roundtrip(x))
    if name in ("mxfp4", "bf16", "fp32"):       # power-of-two scales: rounding is idempotent
        assert torch.equal(fmt.round_query(q), q)
    if name == "fp32":
        assert torch.equal(q, x)
    else:
        assert not torch.equal(q, fmt.to_stored_basis(x))
    k = torch.randn(64, dim)
    exact = x.double() @ k.double().T
    got = q.double() @ fmt.roundtrip(k).double().T
    bq = _error_bound(fmt, fmt.to_stored_basis(x).float(), fmt.encode(x)).double().norm(dim=1)[:, None]
    bk = _error_bound(fmt, fmt.to_stored_basis(k).float(), fmt.encode(k)).double().norm(dim=1)[None, :]
    qn, kn = x.double().norm(dim=1)[:, None], k.double().norm(dim=1)[None, :]
    assert ((got - exact).abs() <= qn * bk + bq * kn + bq * bk + 1e-5 * qn * kn).all()


@pytest.mark.parametrize("n", [1, 2, 16, 128, 512])
def test_fwht_is_the_hadamard_product_in_a_fixed_order(n):
    x = torch.randn(3, 5, n) * torch.exp(3 * torch.randn(3, 5, n))
    got = quant.fwht(x)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert torch.allclose(got, x @ quant.hadamard_matrix(n), rtol=1e-5, atol=1e-5 * x.abs().max().item())
    # its own inverse (H is symmetric and orthogonal), to rounding
    assert torch.allclose(quant.fwht(got), x, rtol=1e-4, atol=1e-5 * x.abs().max().item())


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
