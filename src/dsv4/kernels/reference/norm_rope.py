"""Reference fused RMSNorm + partial RoPE: the spec of the Triton `norm_rope` kernel.

    y = RoPE_pos(RMSNorm(x))        RMSNorm weighted (weight given) or unweighted (weight None),
                                    or skipped (normalize False); RoPE on the trailing 2*cos.shape[-1]
                                    channels, interleaved pairs (DESIGN §3), inverse when asked.

Computed in fp32 from end to end (one rounding to the output dtype at the end).
"""

from __future__ import annotations

import torch

from dsv4.model.rope import apply_rope


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, *,
              normalize: bool = True, inverse: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [N, D] or [N, H, D]; cos/sin [N, r/2] (one position per row of N). Returns out_dtype (x's by default)."""
    xf = x.float()
    if normalize:
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        if weight is not None:
            xf = xf * weight.float()
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return apply_rope(xf, cos, sin, inverse=inverse).to(out_dtype or x.dtype)
