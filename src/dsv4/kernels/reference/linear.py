"""Reference projections (the layer's GEMMs), twins of `triton.gemv.linear` and `triton.fp8_linear.linear_fp8`."""

from __future__ import annotations

import torch

from dsv4.model.fp8_weights import dequantize_blocks


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T -> [T, N] in x's dtype."""
    return torch.nn.functional.linear(x, weight)


def linear_fp8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """y = x W^T with W [N, K] given as FP8 blocks (`dsv4.model.fp8_weights`), in fp32, cast to x's dtype.

    Args:
        x: [T, G*K]; codes: [N, K] float8_e4m3fn; scale: [ceil(N/128), ceil(K/128)] fp32;
        groups: G. Output group g (columns g*N/G ... (g+1)*N/G - 1) reads x's columns g*K ... (g+1)*K - 1
            (the grouped o_a projection); G = 1 is a plain projection.
    Returns:
        [T, N] in x's dtype.
    """
    w = dequantize_blocks(codes, scale)                       # [N, K] fp32, exact
    t, (n, k) = x.shape[0], w.shape
    xg = x.float().reshape(t, groups, k).transpose(0, 1)      # [G, T, K]
    y = torch.bmm(xg, w.view(groups, n // groups, k).transpose(1, 2))   # [G, T, N/G]
    return y.transpose(0, 1).reshape(t, n).to(x.dtype)
