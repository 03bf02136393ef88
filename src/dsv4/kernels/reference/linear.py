"""Reference projection y = x W^T (the layer's GEMMs): torch's matmul, the twin of `triton.gemv.linear`."""

from __future__ import annotations

import torch


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T -> [T, N] in x's dtype."""
    return torch.nn.functional.linear(x, weight)
