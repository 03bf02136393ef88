"""Interleaved partial RoPE on the trailing channels, main and compress tables (DESIGN §3).

For pair i (0 <= i < r/2) of the trailing r channels of a D-vector, channels a = D-r+2i and
b = a+1 rotate by angle pos * inv_freq[i]:

    x'_a = x_a cos - x_b sin,   x'_b = x_b cos + x_a sin        (inverse: sin -> -sin)

SWA-only layers use the main table (theta = rope_theta, no YaRN); CSA/HCA layers use the
compress table (theta = compress_rope_theta with YaRN) for everything in the layer.
Angles are computed in float64: at position 1e6 an fp32 angle is off by ~0.06 rad.
"""

from __future__ import annotations

import math

import torch

from dsv4.model.config import DSV4Config


def yarn_inv_freq(rope_dim: int, theta: float, factor: float, original_max_position: int,
                  beta_fast: float, beta_slow: float) -> torch.Tensor:
    """[rope_dim/2] float64 inverse frequencies; factor 1 gives plain RoPE."""
    i = torch.arange(rope_dim // 2, dtype=torch.float64)
    extrap = theta ** (-2.0 * i / rope_dim)
    if factor <= 1.0:
        return extrap
    interp = extrap / factor

    def corr_dim(beta: float) -> float:
        return rope_dim * math.log(original_max_position / (beta * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
    ramp = ((i - low) / max(high - low, 1e-3)).clamp(0.0, 1.0)
    e = 1.0 - ramp                   # 1: keep the extrapolated (original) frequency
    return interp * (1.0 - e) + extrap * e


class RopeTable:
    """One rotary table's inverse frequencies (float64); the op `rope_cos_sin` turns positions into
    cos/sin on the fly (`dsv4.kernels.reference.norm_rope`, and its Triton twin)."""

    def __init__(self, rope_dim: int, inv_freq: torch.Tensor):
        self.rope_dim = rope_dim
        self.inv_freq = inv_freq.to(torch.float64)
        self._on: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def for_layer(cls, cfg: DSV4Config, compressed: bool) -> RopeTable:
        """Compress table (YaRN) for CSA/HCA layers, main table for SWA-only layers."""
        if compressed:
            inv = yarn_inv_freq(cfg.rope_dim, cfg.compress_rope_theta, cfg.yarn_factor,
                                cfg.yarn_original_max_position, cfg.yarn_beta_fast, cfg.yarn_beta_slow)
        else:
            inv = yarn_inv_freq(cfg.rope_dim, cfg.rope_theta, 1.0, 1, 1.0, 1.0)
        return cls(cfg.rope_dim, inv)

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """[r/2] float64 inverse frequencies on `device` (copied once per device)."""
        if device not in self._on:   # pinned and asynchronous: a layer's first step must not wait on the device
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # a captured copy would read its pinned source again at every replay, long after it is freed
                raise RuntimeError("RopeTable: first use on a device inside a CUDA graph capture; run one step "
                                   "eagerly before capturing")
            src = self.inv_freq   # may already be on a device (a model built under `with torch.device(...)`)
            if device.type == "cuda" and src.device.type == "cpu":
                src = src.pin_memory()
            self._on[device] = src.to(device, non_blocking=True)
        return self._on[device]



def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x [..., D] in interleaved pairs (fp32 math).

    cos/sin broadcast against x's leading dims ([..., r/2]); returns x's dtype.
    """
    r = 2 * cos.shape[-1]
    if r == 0:
        return x
    if inverse:
        sin = -sin
    rope = x[..., -r:].float().unflatten(-1, (r // 2, 2))
    a, b = rope[..., 0], rope[..., 1]
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], rotated.to(x.dtype)), dim=-1)
