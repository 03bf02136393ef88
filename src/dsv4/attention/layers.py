"""Small layers of the attention sub-block: RMS norms and the grouped output projection."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Weighted RMSNorm over the last dim, computed in fp32, cast back once at the end."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def rms_unweighted(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm without weight over the last dim (fp32 math)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def grouped_output(o: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor, groups: int) -> torch.Tensor:
    """out = W_ob · concat_g(W_oa[g] · concat(o_h for h in group g)); heads grouped contiguously.

    Args:
        o: [T, H, D] attention outputs; w_a: [G*R_o, H*D/G] (rows g*R_o:(g+1)*R_o belong to group g);
        w_b: [d, G*R_o].
    Returns:
        [T, d]
    """
    t = o.shape[0]
    x = o.reshape(t, groups, -1).transpose(0, 1)                 # [G, T, H*D/G]
    wa = w_a.view(groups, -1, w_a.shape[-1])                     # [G, R_o, H*D/G]
    y = torch.bmm(x, wa.transpose(1, 2)).transpose(0, 1)         # [T, G, R_o]
    return y.reshape(t, -1) @ w_b.t()
