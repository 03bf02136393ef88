"""Reference projections (the layer's GEMMs), twins of `triton.gemv.linear` and `triton.fp8_linear.linear_fp8`."""

from __future__ import annotations

import torch

from dsv4.kernels.reference.norm_rope import norm_rope
from dsv4.model.fp8_weights import dequantize_blocks


def rms_rows(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None) -> torch.Tensor:
    """x's rows as RMSNorm_w(x) in x's dtype for norm = (w, eps) (the `norm` of `linear` /
    `linear_fp8`: the q_a norm before the q up-projection), x itself for None."""
    if norm is None:
        return x
    none = x.new_empty(x.shape[0], 0, dtype=torch.float32)
    return norm_rope(x, norm[0], norm[1], none, none)


def linear(x: torch.Tensor, weight: torch.Tensor, groups: int = 1,
           norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [T, G*K] @ weight [N, K]^T -> [T, N] in x's dtype; output group g (N/G columns) reads x's
    g-th K columns (the grouped o_a projection), as `linear_fp8`. G = 1 is a plain projection.
    norm = (w, eps): x's rows are RMSNorm_w(x), rounded to x's dtype, first (`rms_rows`)."""
    x = rms_rows(x, norm)
    if groups == 1:
        return torch.nn.functional.linear(x, weight)
    t, (n, k) = x.shape[0], weight.shape
    # each group's [T, N/G] product lands in its columns of y [T, G, N/G] (a strided batched GEMM
    # output): no copy after the GEMM
    y = torch.empty(t, groups, n // groups, dtype=x.dtype, device=x.device)
    torch.bmm(x.reshape(t, groups, k).transpose(0, 1), weight.view(groups, n // groups, k).transpose(1, 2),
              out=y.transpose(0, 1))
    return y.view(t, n)


def linear_fp8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, groups: int = 1,
               norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """y = x W^T with W [N, K] given as FP8 blocks (`dsv4.model.fp8_weights`), in fp32, cast to x's dtype.

    Args:
        x: [T, G*K]; codes: [N, K] float8_e4m3fn; scale: [ceil(N/128), ceil(K/128)] fp32;
        groups: G. Output group g (columns g*N/G ... (g+1)*N/G - 1) reads x's columns g*K ... (g+1)*K - 1
            (the grouped o_a projection); G = 1 is a plain projection.
        norm: (w, eps): x's rows are RMSNorm_w(x), rounded to x's dtype, first (`rms_rows`).
    Returns:
        [T, N] in x's dtype.
    """
    x = rms_rows(x, norm)
    w = dequantize_blocks(codes, scale)                       # [N, K] fp32, exact
    t, (n, k) = x.shape[0], w.shape
    xg = x.float().reshape(t, groups, k).transpose(0, 1)      # [G, T, K]
    y = torch.bmm(xg, w.view(groups, n // groups, k).transpose(1, 2))   # [G, T, N/G]
    return y.transpose(0, 1).reshape(t, n).to(x.dtype)


def linear_pair(x: torch.Tensor, dense: torch.Tensor, codes: torch.Tensor,
                scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The projections of one input by a dense weight and by an FP8 block weight of the same K, as a
    checkpoint with FP8 q_a / kv beside dense compressor weights holds them:
    (linear(x, dense), linear_fp8(x, codes, scale))."""
    return linear(x, dense), linear_fp8(x, codes, scale)

