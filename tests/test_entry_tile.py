"""The attention kernels' key-tile loader (`decode_common.load_entry_tile`) in both of its load orders,
against the stored bytes decoded in torch.

The loader builds its tile rows-major ([rows, chunk, 64]) on Triton 3.6 and chunk-major then permuted
on 3.7+ (`CHUNK_MAJOR`: the releases order a tie between equally contiguous dims differently, and the
other order made the compiler convert every key tile). Both orders must give the same keys bit for
bit; the interpreter runs either one whatever the installed release (`CHUNK_MAJOR` patched), a GPU
run checks the order its release compiles. The prefill window's row loader (`window_rows`), which follows
the same order, is checked through the prefill attention tests.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dsv4.kernels.triton import decode_common as dc

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NOPE, ROPE = 448, 64


@triton.jit
def _tile_kernel(kv_ptr, rope_ptr, sc_ptr, page_ptr, row_ptr, ok_ptr, out_ptr, c0, s_kp, s_kr, s_rp, s_rr, s_sp, s_sr,
                 FMT: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, NC: tl.constexpr, N: tl.constexpr):
    n = tl.arange(0, N)
    page = tl.load(page_ptr + n).to(tl.int64)
    row = tl.load(row_ptr + n)
    ok = tl.load(ok_ptr + n) != 0
    x, sb, rope = dc.load_entry_tile(kv_ptr, rope_ptr, sc_ptr, page, row, ok, c0, s_kp, s_kr, s_rp, s_rr, s_sp, s_sr,
                                     FMT, D, NOPE, NC)
    k = dc.dequant_entry_tile(x, sb, rope, c0, FMT, NOPE, NC, N)
    tl.store(out_ptr + n[:, None] * (NC * 64) + tl.arange(0, NC * 64)[None, :], k)


def _orders(monkeypatch, chunk_major: bool) -> None:
    """Use the order under test: any in the interpreter, only the release's own on a GPU (a compiled
    kernel keeps the order it was built with)."""
    if DEVICE == "cuda":
        if chunk_major != bool(dc.CHUNK_MAJOR):
            pytest.skip(f"on a GPU only Triton {triton.__version__}'s own order compiles "
                        f"(chunk-major {bool(dc.CHUNK_MAJOR)})")
        return
    monkeypatch.setattr(dc, "CHUNK_MAJOR", tl.constexpr(chunk_major))


def _rows(gen: torch.Generator, pages: int, per_page: int, n: int):
    page = torch.randint(0, pages, (n,), generator=gen, dtype=torch.int32)
    row = torch.randint(0, per_page, (n,), generator=gen, dtype=torch.int32)
    ok = (torch.rand(n, generator=gen) < 0.8).to(torch.int32)
    ok[0], ok[-1] = 1, 0
    return page, row, ok


@pytest.mark.parametrize("chunk_major", [False, True])
@pytest.mark.parametrize("c0,nc", [(0, 8), (0, 4), (4, 4), (6, 2)])
def test_fp8_ds_tile_decodes_the_stored_bytes(chunk_major, c0, nc, monkeypatch):
    """fp8_ds: e4m3 codes x 2^(scale byte - 127) per 64 channels, the bf16 rope at chunk 7, 0 past it
    and on masked rows; any window of chunks (the halves kernels load 4 from c0 = 0 or 4)."""
    _orders(monkeypatch, chunk_major)
    gen = torch.Generator().manual_seed(1000 * c0 + nc + chunk_major)
    pages, per_page, n = 5, 8, 16
    codes = (torch.randn(pages, per_page, NOPE, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    rope = torch.randn(pages, per_page, ROPE, generator=gen).to(torch.bfloat16)
    scales = torch.randint(110, 140, (pages, per_page, 8), generator=gen, dtype=torch.uint8)
    page, row, ok = _rows(gen, pages, per_page, n)
    keys = torch.cat([codes.float().view(pages, per_page, 7, 64) * torch.exp2(scales[..., :7].float() - 127)[..., None],
                      rope.float()[:, :, None]], 2).view(pages, per_page, 512)
    want = keys[page.long(), row.long()][:, c0 * 64:(c0 + nc) * 64] * ok[:, None]
    dev = [t.to(DEVICE) for t in (codes, rope, scales, page, row, ok)]
    out = torch.full((n, nc * 64), float("nan"), device=DEVICE)
    _tile_kernel[(1,)](*dev, out, c0, codes.stride(0), codes.stride(1), rope.stride(0), rope.stride(1),
                       scales.stride(0), scales.stride(1), FMT=dc.FP8_DS_ID.value, D=512, NOPE=NOPE, NC=nc, N=n)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("chunk_major", [False, True])
def test_bf16_tile(chunk_major, monkeypatch):
    """bf16 entries (no scales, no separate rope): the stored values, 0 on masked rows and past D."""
    _orders(monkeypatch, chunk_major)
    gen = torch.Generator().manual_seed(7 + chunk_major)
    pages, per_page, n, d, nc = 4, 8, 16, 448, 8
    kv = torch.randn(pages, per_page, d, generator=gen).to(torch.bfloat16)
    page, row, ok = _rows(gen, pages, per_page, n)
    want = torch.zeros(n, nc * 64)
    want[:, :d] = kv[page.long(), row.long()].float() * ok[:, None]
    kv_d, page_d, row_d, ok_d = (t.to(DEVICE) for t in (kv, page, row, ok))
    out = torch.full((n, nc * 64), float("nan"), device=DEVICE)
    _tile_kernel[(1,)](kv_d, kv_d, kv_d, page_d, row_d, ok_d, out, 0, kv.stride(0), kv.stride(1), 0, 0, 0, 0,
                       FMT=1, D=d, NOPE=d, NC=nc, N=n)
    assert torch.equal(out.cpu(), want)

