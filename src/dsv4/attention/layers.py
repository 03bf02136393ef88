"""Small layers of the attention sub-block: RMS norms and the grouped output projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
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


def grouped_output(o: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor, groups: int,
                   linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear) -> torch.Tensor:
    """out = W_ob · concat_g(W_oa[g] · concat(o_h for h in group g)); heads grouped contiguously.

    Args:
        o: [T, H, D] attention outputs; w_a: [G*R_o, H*D/G] (rows g*R_o:(g+1)*R_o belong to group g);
        w_b: [d, G*R_o]; linear: the W_ob projection (an ops namespace's `linear`).
    Returns:
        [T, d]
    """
    t = o.shape[0]
    x = o.reshape(t, groups, -1).transpose(0, 1)                 # [G, T, H*D/G]
    wa = w_a.view(groups, -1, w_a.shape[-1])                     # [G, R_o, H*D/G]
    # each group's [T, R_o] product lands in its columns of y [T, G, R_o] (a strided batched GEMM
    # output): no copy between the two GEMMs
    y = torch.empty(t, groups, wa.shape[1], dtype=o.dtype, device=o.device)
    torch.bmm(x, wa.transpose(1, 2), out=y.transpose(0, 1))
    return linear(y.view(t, -1), w_b)


class FusedProjection:
    """Several projections of one input as one GEMM: x @ [W_1; ...; W_n]^T, split into column views.

    A decode step of a few tokens reads each weight once; separate GEMMs would cost a launch each
    (a CSA layer has seven projections of x). On first use, and again whenever a module's weight
    was replaced (`.to()`, `.cuda()`), the weights are concatenated once and each nn.Linear's
    weight is re-pointed into the fused buffer (`.data`): memory is not held twice, and
    `load_state_dict` (an in-place copy) keeps writing into the buffer.
    """

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        self._fused: torch.Tensor | None = None
        self._ptrs: list[int] = []

    def weight(self) -> torch.Tensor:
        ptrs = [lin.weight.data_ptr() for lin in self.linears]
        if self._fused is None or ptrs != self._ptrs:
            if self.linears[0].weight.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("FusedProjection: run the layer once eagerly before capturing it in a CUDA graph "
                                   "(the fused weight is built on first use)")
            fused = torch.cat([lin.weight.detach() for lin in self.linears])
            for lin, part in zip(self.linears, fused.split(self.sizes)):
                lin.weight.data = part
            self._fused, self._ptrs = fused, [lin.weight.data_ptr() for lin in self.linears]
        return self._fused

    def __call__(self, x: torch.Tensor, linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
                 ) -> tuple[torch.Tensor, ...]:
        """linear: the GEMM (an ops namespace's `linear`)."""
        return linear(x, self.weight()).split(self.sizes, dim=-1)
