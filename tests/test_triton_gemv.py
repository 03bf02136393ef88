"""Triton batch-1 projection (`dsv4.kernels.triton.gemv`) against the reference GEMM.

Both accumulate in fp32; they differ only in summation order, so fp32 outputs agree to ~1e-6
relative and bf16 outputs to one bf16 rounding step. Shapes cover K not a multiple of the
kernel's K block, N not a multiple of its row block, and weight rows with a row stride wider
than K (a column slice of a bigger matrix). CPU: the Triton interpreter on small shapes; GPU:
the V4-Flash projections and the dispatch of `linear` (one row: the kernel; more: the GEMM).
"""

from __future__ import annotations

import pytest
import torch

from dsv4.errors import InputError
from dsv4.kernels.reference.linear import linear as ref_linear
from dsv4.kernels.reference.linear import rms_rows
from dsv4.kernels.triton import gemv, skinny_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(x: torch.Tensor, w: torch.Tensor, groups: int = 1) -> None:
    got = gemv.gemv(x, w, groups)
    n, k = w.shape
    xg = x.double().view(groups, 1, k)          # group g: rows g*N/G.. of w against x's g-th K columns
    want = torch.bmm(xg, w.double().view(groups, n // groups, k).transpose(1, 2)).view(1, n)
    assert got.shape == (1, w.shape[0]) and got.dtype == x.dtype
    tol = 2e-6 if x.dtype == torch.float32 else 2 ** -7     # bf16: one step at the largest output
    scale = want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= tol * scale, f"max error {err:.3g} > {tol * scale:.3g}"
    torch.testing.assert_close(got.float(), ref_linear(x, w, groups).float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("n,k", [(37, 1000), (16, 1024), (5, 2050), (64, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_reference(n, k, dtype):
    g = torch.Generator().manual_seed(n * 7919 + k)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    _check(x, w)
    wide = torch.randn(n, k + 24, generator=g).to(DEVICE, dtype)   # rows of a wider matrix, read in place
    _check(x, wide[:, 10:10 + k])


@pytest.mark.parametrize("groups,n,k", [(8, 128, 1000), (4, 64, 2050), (2, 32, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_grouped(groups, n, k, dtype):
    """groups: output group g reads x's g-th K columns (the grouped o_a product); the groups' x
    slices differ, so reading the wrong one fails."""
    g = torch.Generator().manual_seed(groups * 31 + n + k)
    x = torch.randn(1, groups * k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    _check(x, w, groups)
    with pytest.raises(InputError, match="rows per group"):
        gemv.gemv(torch.randn(1, 32 * k).to(DEVICE, dtype), torch.randn(96, k).to(DEVICE, dtype), 32)  # 3 a group
    with pytest.raises(InputError, match="x must be"):
        gemv.gemv(x[:, :-1], w, groups)                                         # x one column short


@pytest.mark.parametrize("n,k", [(24, 1024), (7, 1000), (40, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_applies_the_rms_norm(n, k, dtype):
    """norm = (w, eps): the kernel normalises x itself (the q_a norm before the q up-projection). x's
    RMS is ~37 and the norm weight is not all ones, so a missing scale or weight is off by far more than
    the bound; the bound allows each x element one rounding step of x's dtype (the interpreter's bf16
    cast truncates) on top of `_check`'s."""
    g = torch.Generator().manual_seed(n * 131 + k)
    x = (37 * torch.randn(1, k, generator=g)).to(DEVICE, dtype)
    nw = (1 + 0.5 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    norm = (nw, 1e-6)
    xn = rms_rows(x, norm)
    want = xn.double() @ w.double().T
    mag = xn.double().abs() @ w.double().abs().T
    step = 2e-6 if dtype == torch.float32 else 2 ** -7
    for got in (gemv.gemv(x, w, norm=norm), gemv.linear(x, w, norm=norm)):
        assert got.shape == (1, n) and got.dtype == dtype
        excess = (got.double() - want).abs() - step * (mag + want.abs())
        assert excess.max() <= 0, excess.max()
    assert (gemv.gemv(x, w).double() - want).abs().max() > 10 * step * mag.max()   # the norm did something
    x3 = (37 * torch.randn(3, k, generator=g)).to(DEVICE, dtype)                  # more rows: norm, then GEMM
    torch.testing.assert_close(gemv.linear(x3, w, norm=norm).float(), ref_linear(x3, w, norm=norm).float(),
                               rtol=step, atol=step * mag.max().item())
    with pytest.raises(InputError, match="one group"):
        gemv.gemv(torch.randn(1, 2 * k).to(DEVICE, dtype), torch.randn(32, k).to(DEVICE, dtype), 2, norm=norm)


@pytest.mark.parametrize("rows", [2, 5, 16, 17, 32])
@pytest.mark.parametrize("n,k,groups", [(192, 256, 1), (100, 200, 1), (128, 256, 2)])
def test_skinny_gemm_matches_reference(rows, n, k, groups):
    """The decode-batch GEMM (weights on the MMA's M side, tensor descriptors) against the float64
    product: rows padded up to the MMA's 16 or 32, N and K off the tiles where one group allows it (the
    descriptors read zeros past them), two groups reading their own x columns; output in bf16."""
    g = torch.Generator().manual_seed(rows * 31 + n + k)
    x = torch.randn(rows, groups * k, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(DEVICE, torch.bfloat16)
    fits = skinny_gemm.fits(x, w, groups)
    assert not skinny_gemm.fits(torch.cat([x] * 17), w, groups)            # more than 32 rows: cuBLAS
    assert fits == (n // groups % skinny_gemm.BLOCK_N == 0)
    if not fits:
        return
    got = skinny_gemm.skinny_gemm(x, w, groups)
    want = torch.bmm(x.double().view(rows, groups, k).transpose(0, 1),
                     w.double().view(groups, n // groups, k).transpose(1, 2)).transpose(0, 1).reshape(rows, n)
    mag = torch.bmm(x.double().abs().view(rows, groups, k).transpose(0, 1),
                    w.double().abs().view(groups, n // groups, k).transpose(1, 2)).transpose(0, 1).reshape(rows, n)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    # bf16 output: one rounding step (the interpreter's cast truncates)
    excess = (got.double() - want).abs() - (1e-5 * mag + 2 ** -7 * want.abs())
    assert excess.max() <= 0, excess.max()
    assert not skinny_gemm.fits(x.float(), w.float(), groups)              # fp32: the reference's GEMM


@pytest.mark.gpu
def test_gemv_grouped_v4_o_a():
    """The o_a product at V4-Flash shapes (8 groups of 1,024 rows, K 4,096) through `linear`."""
    x = torch.randn(1, 8 * 4096, device="cuda").bfloat16()
    w = torch.randn(8192, 4096, device="cuda").bfloat16() * 0.02
    _check(x, w, 8)
    assert torch.equal(gemv.linear(x, w, 8), gemv.gemv(x, w, 8))
    x2 = torch.randn(3, 8 * 4096, device="cuda").bfloat16()
    torch.testing.assert_close(gemv.linear(x2, w, 8), ref_linear(x2, w, 8), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4160, 4096), (4096, 8192), (40960, 1024)])
def test_gemv_v4_shapes_and_dispatch(n, k):
    x = torch.randn(1, k, device="cuda").bfloat16()
    w = torch.randn(n, k, device="cuda").bfloat16()
    _check(x, w)
    assert torch.equal(gemv.linear(x, w), gemv.gemv(x, w))              # one row: the kernel
    x2 = torch.randn(2, k, device="cuda").bfloat16()
    assert torch.equal(gemv.linear(x2, w), skinny_gemm.skinny_gemm(x2, w))    # two rows: the batch GEMM
    torch.testing.assert_close(gemv.linear(x2, w).float(), ref_linear(x2, w).float(), rtol=2 ** -7, atol=1e-2)
    x33 = torch.randn(33, k, device="cuda").bfloat16()
    assert torch.equal(gemv.linear(x33, w), ref_linear(x33, w))         # more than 32 rows: cuBLAS
