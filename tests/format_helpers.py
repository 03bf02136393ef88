"""Shared helpers of the storage-format tests: the format matrix, random rows, independent
bit-level decoders, and the per-format error bounds (derived in tests/test_formats.py)."""

from __future__ import annotations

import torch

from dsv4.cache.formats import INDEXER_FORMATS, MAIN_FORMATS, EntryFormat, indexer_format, main_format
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
    ref = (quant.fwht(x) if fmt.hadamard else x).float()      # keys are stored rotated by the butterfly
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
