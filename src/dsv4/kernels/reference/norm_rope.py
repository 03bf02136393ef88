"""Reference fused RMSNorm + partial RoPE: the spec of the Triton `norm_rope` kernel.

    y = RoPE_pos(RMSNorm(x))        RMSNorm weighted (weight given) or unweighted (weight None),
                                    or skipped (normalize False); RoPE on the trailing 2*cos.shape[-1]
                                    channels, interleaved pairs (DESIGN §3), inverse when asked;
                                    cos/sin [N, 0]: no rotation (a plain RMSNorm).
    cos, sin = rope_cos_sin(inv_freq, positions, scale)
                                    the rotary table at max(positions, 0) * scale, float64 angles.

Computed in fp32 from end to end (one rounding to the output dtype at the end).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsv4.kernels.reference import quant
from dsv4.model.rope import apply_rope


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scale: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """inv_freq [r/2] float64, positions [...] int -> cos, sin [..., r/2] float32.

    Angles max(p, 0) * scale * inv_freq in float64 (at position 1e6 an fp32 angle is off by
    ~0.06 rad); negative positions (a decode step's "no entry" -1) read position 0.
    """
    ang = (positions.long().clamp(min=0) * scale).to(torch.float64)[..., None] * inv_freq
    return ang.cos().float(), ang.sin().float()


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, *,
              normalize: bool = True, inverse: bool = False, out_dtype: torch.dtype | None = None,
              hadamard: bool = False, round_to: str | None = None) -> torch.Tensor:
    """x [N, D] or [N, H, D]; cos/sin [N, r/2] (one position per row of N). Returns out_dtype (x's by
    default). hadamard: then each row times H_D (`quant.fwht`; the indexer queries' stored basis).
    round_to: an indexer-key format name; each row is then rounded as a key of that format
    (`quant.round_query`: the indexer queries of a quantised indexer)."""
    xf = x.float()
    if normalize:
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        if weight is not None:
            xf = xf * weight.float()
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    y = apply_rope(xf, cos, sin, inverse=inverse)
    y = quant.fwht(y) if hadamard else y
    if round_to is not None:
        y = quant.round_query(round_to, y)
    return y.to(out_dtype or x.dtype)


class EntryFinish(NamedTuple):
    """What turns a compressor's raw entry w (A/S) into the stored one, RoPE_{w*m}(RMSNorm_w(entry)),
    for `write_entries(finish=)`: the norm's weight [D] and eps, inv_freq [r/2] float64 and the
    compression ratio m (the rotation is at the window's first token w*m)."""
    weight: torch.Tensor
    eps: float
    inv_freq: torch.Tensor
    ratio: int


def finish_entries(rows: torch.Tensor, entry_index: torch.Tensor, finish: EntryFinish) -> torch.Tensor:
    """rows [E, D] raw entries -> RoPE_{w*m}(RMSNorm_w(rows)) fp32 (w = entry_index; -1 reads 0)."""
    cos, sin = rope_cos_sin(finish.inv_freq, entry_index, finish.ratio)
    return norm_rope(rows, finish.weight, finish.eps, cos, sin, out_dtype=torch.float32)
