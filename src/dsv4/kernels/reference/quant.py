"""Reference codecs of the storage formats (DESIGN §4): float rows <-> region bytes.

Each `*_encode(x, rope_dim)` takes x [N, D] (any float dtype) and returns one uint8 tensor
[N, region_bytes] per region of the format, in the order of `dsv4.cache.formats`; each
`*_decode(*regions, rope_dim)` returns float32 [N, D]. They are the spec the Triton
kernels must match byte for byte.
"""

from __future__ import annotations

import math

import torch


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """[N, C] tensor -> [N, C * itemsize] uint8 (a copy only if x is not contiguous)."""
    return x.contiguous().view(torch.uint8).reshape(x.shape[0], -1)


def bf16_encode(x: torch.Tensor, rope_dim: int = 0) -> tuple[torch.Tensor]:
    return (_as_bytes(x.to(torch.bfloat16)),)


def bf16_decode(data: torch.Tensor, rope_dim: int = 0) -> torch.Tensor:
    return data.contiguous().view(torch.bfloat16).float()


def fp32_encode(x: torch.Tensor, rope_dim: int = 0) -> tuple[torch.Tensor]:
    return (_as_bytes(x.to(torch.float32)),)


def fp32_decode(data: torch.Tensor, rope_dim: int = 0) -> torch.Tensor:
    return data.contiguous().view(torch.float32).clone()


_HADAMARD: dict[tuple[int, torch.device], torch.Tensor] = {}


def hadamard_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix [n, n] fp32 (symmetric, orthogonal: H @ H = I)."""
    key = (n, torch.device(device))
    if key not in _HADAMARD:
        assert n > 0 and n & (n - 1) == 0, "Hadamard size must be a power of two"
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD[key] = (h / math.sqrt(n)).to(device)
    return _HADAMARD[key]


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] -> x @ H_n (fp32), the rotation DeepSeek applies before FP4 quantisation."""
    return x.float() @ hadamard_matrix(x.shape[-1], x.device)
