"""Triton fused RMSNorm + RoPE vs its reference twin, and the reference vs the module composition
it replaces (RMSNorm module, then `dsv4.model.rope.apply_rope`). Fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from dsv4.attention.layers import RMSNorm, rms_unweighted
from dsv4.kernels.reference.norm_rope import norm_rope as ref
from dsv4.kernels.triton.norm_rope import norm_rope as tri
from dsv4.model.rope import apply_rope

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
SHAPES = [(5, 128), (3, 4, 512), (7, 16, 128), (2, 192), (1, 64, 512), (9, 64)]


def _angles(n: int, half: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(n, half, device=device) * 1e3     # large positions: angles far past 2π
    return ang.cos(), ang.sin()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", ["weighted", "unweighted", "rope_only", "inverse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(device, shape, mode, dtype):
    x = (torch.randn(*shape, device=device) * 3).to(dtype)
    w = torch.rand(shape[-1], device=device) + 0.5
    cos, sin = _angles(shape[0], 32, device)
    kw = dict(normalize=mode in ("weighted", "unweighted"), inverse=mode == "inverse")
    weight = w if mode == "weighted" else None
    for out_dtype in (None, torch.float32):
        a = ref(x, weight, 1e-6, cos, sin, out_dtype=out_dtype, **kw)
        b = tri(x, weight, 1e-6, cos, sin, out_dtype=out_dtype, **kw)
        assert a.dtype == b.dtype == (out_dtype or dtype)
        # fp32 math in both; they differ only by summation order and FMA contraction
        tol = 2e-6 if a.dtype == torch.float32 else 2 ** -8
        torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol * a.float().abs().max().item())


@pytest.mark.parametrize("shape", [(5, 128), (3, 4, 512)])
def test_reference_equals_module_composition(shape):
    x = torch.randn(*shape)
    cos, sin = _angles(shape[0], 32, "cpu")
    c, s = (cos[:, None], sin[:, None]) if len(shape) == 3 else (cos, sin)
    norm = RMSNorm(shape[-1])
    norm.weight.data = torch.rand(shape[-1]) + 0.5
    torch.testing.assert_close(ref(x, norm.weight, 1e-6, cos, sin), apply_rope(norm(x), c, s), rtol=0, atol=0)
    torch.testing.assert_close(ref(x, None, 1e-6, cos, sin), apply_rope(rms_unweighted(x), c, s), rtol=0, atol=0)
    torch.testing.assert_close(ref(x, None, 0.0, cos, sin, normalize=False, inverse=True),
                               apply_rope(x, c, s, inverse=True), rtol=0, atol=0)
    # the inverse undoes the rotation
    back = ref(ref(x, None, 0.0, cos, sin, normalize=False), None, 0.0, cos, sin, normalize=False, inverse=True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)
