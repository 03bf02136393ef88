"""Byte layout of the storage formats: rows written through `EntryFormat.views` read back by hand
at the documented offsets, exact scale bytes, nibble order and rounding ties (DESIGN §4)."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from format_helpers import (
    _E2M1,
    ALL_FORMATS,
    _e2m1_from_nibbles,
    _e4m3_from_bits,
    _f32,
    _fid,
    _pow2,
    _rows,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.cache.formats import main_format
from dsv4.kernels.reference import quant


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


