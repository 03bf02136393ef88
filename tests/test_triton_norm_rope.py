"""Triton fused RMSNorm + RoPE vs its reference twin, and the reference vs the module composition
it replaces (RMSNorm module, then `dsv4.model.rope.apply_rope`). Fresh random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.attention.layers import RMSNorm, rms_unweighted
from dsv4.errors import InputError
from dsv4.kernels.reference import quant
from dsv4.kernels.reference.norm_rope import norm_rope as ref
from dsv4.kernels.reference.norm_rope import rope_cos_sin as ref_cos_sin
from dsv4.kernels.triton.norm_rope import HADAMARD_BLOCK_ROWS
from dsv4.kernels.triton.norm_rope import norm_rope as tri
from dsv4.kernels.triton.norm_rope import rope_cos_sin as tri_cos_sin
from dsv4.model.config import DSV4Config
from dsv4.model.rope import RopeTable, apply_rope

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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(5, 128), (3, 64, 128), (7, 5, 128), (2, 3, 64)])
def test_hadamard_queries(device, shape):
    """hadamard=True (the indexer queries' stored basis): RoPE, then each row times H_D, as the
    reference's butterfly; the reference equals RoPE followed by the Hadamard matmul."""
    x = (torch.randn(*shape, device=device) * 3).to(torch.bfloat16)     # a bf16 projection, read in place
    cos, sin = _angles(shape[0], 32, device)
    kw = dict(normalize=False, out_dtype=torch.float32)
    a = ref(x, None, 0.0, cos, sin, hadamard=True, **kw)
    b = tri(x, None, 0.0, cos, sin, hadamard=True, **kw)
    roped = ref(x, None, 0.0, cos, sin, **kw)
    tol = 2e-6 * a.abs().max().item()
    torch.testing.assert_close(b, a, rtol=2e-6, atol=tol)
    torch.testing.assert_close(a, roped @ quant.hadamard_matrix(shape[-1], device), rtol=1e-5, atol=tol)
    assert not torch.allclose(a, roped, atol=tol)                  # the rotation happened
    with pytest.raises(InputError):
        tri(torch.randn(3, 96, device=device), None, 0.0, cos[:3], sin[:3], hadamard=True, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_hadamard_block_rows(device):
    """A prefill chunk's Hadamard rows go HADAMARD_BLOCK_ROWS a program (the last block ragged here):
    bit for bit the 4-row programs' result, rounded to mxfp4 as the layer asks, and near the reference."""
    x = (torch.randn(7, 5, 128, device=device) * 3).to(torch.bfloat16)
    cos, sin = _angles(7, 32, device)
    kw = dict(normalize=False, out_dtype=torch.bfloat16, hadamard=True, round_to="mxfp4")
    a = tri(x, None, 0.0, cos, sin, block_rows=4, **kw)
    b = tri(x, None, 0.0, cos, sin, block_rows=HADAMARD_BLOCK_ROWS, **kw)
    assert HADAMARD_BLOCK_ROWS > 4 and 35 % HADAMARD_BLOCK_ROWS
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    r = ref(x, None, 0.0, cos, sin, **kw).float()
    torch.testing.assert_close(b.float(), r, rtol=0, atol=0.5 * r.abs().max().item())
    assert (b.float() == r).float().mean() > 0.9


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["mxfp4", "fp8", "nvfp4", "bf16_i", "fp32_i"])
def test_rounded_queries(device, name):
    """round_to (the indexer queries rounded as keys of that format): the kernel's rounding is bit for
    bit `quant.round_query` of its own unrounded rows, and the reference's of its own; rows over
    1e-30 .. 1e3 in magnitude and an all-zero row."""
    had = name in ("mxfp4", "fp8", "nvfp4")
    x = torch.randn(3, 6, 128, device=device) * torch.logspace(-3, 3, 6, device=device)[None, :, None]
    x[0, 0] = 0.0
    x[1, 1] *= 1e-27
    cos, sin = _angles(3, 32, device)
    kw = dict(normalize=False, out_dtype=torch.float32, hadamard=had)
    for fn in (ref, tri):
        plain, rounded = fn(x, None, 0.0, cos, sin, **kw), fn(x, None, 0.0, cos, sin, round_to=name, **kw)
        assert torch.equal(rounded, quant.round_query(name, plain)), (fn, name)
        assert torch.equal(rounded[0, 0], torch.zeros_like(rounded[0, 0]))
        assert torch.equal(rounded, plain) == (name == "fp32_i")
    tol = 2e-6 * plain.abs().max().item()
    if name != "fp32_i":     # a rounded format's step, relative: E2M1 1/4 of the group scale
        tol = {"bf16_i": 2 ** -8, "fp8": 2 ** -3}.get(name, 0.5) * plain.abs().max().item()
    torch.testing.assert_close(rounded, ref(x, None, 0.0, cos, sin, round_to=name, **kw), rtol=0, atol=tol)
    if name == "mxfp4":
        with pytest.raises(InputError):
            tri(x, None, 0.0, cos, sin, normalize=False, round_to=name)


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_and_no_rotation(device, dtype):
    """A 2-D column view of a wider projection is read in place; cos/sin of width 0 = plain RMSNorm."""
    wide = (torch.randn(6, 700, device=device) * 3).to(dtype)
    x = wide[:, 33:33 + 512]
    w = torch.rand(512, device=device) + 0.5
    cos, sin = _angles(6, 32, device)
    for c, s in ((cos, sin), (cos[:, :0], sin[:, :0])):
        a = ref(x.contiguous(), w, 1e-6, c, s)
        b = tri(x, w, 1e-6, c, s)
        tol = 2e-6 if dtype == torch.float32 else 2 ** -8
        torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol * a.float().abs().max().item())
    # [T, H, D] view of a column slice (token stride 4 * 128 + 40): read in place
    x3 = (torch.randn(6, 4 * 128 + 40, device=device) * 3).to(dtype)[:, 40:].view(6, 4, 128)
    assert not x3.is_contiguous()
    a = ref(x3.contiguous(), None, 1e-6, cos, sin, out_dtype=torch.float32)
    torch.testing.assert_close(tri(x3, None, 1e-6, cos, sin, out_dtype=torch.float32), a, rtol=2e-6,
                               atol=2e-6 * a.abs().max().item())
    norm = RMSNorm(512).to(device)
    norm.weight.data = w
    torch.testing.assert_close(ref(x, w, 1e-6, cos[:, :0], sin[:, :0]), norm(x), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1, 4, 128])
def test_rope_cos_sin(device, scale):
    """Triton table == the reference's float64 table (both: fp64 angles and cos/sin, one rounding),
    at positions far past 2^20 and at -1 (read as 0); the reference == Python's math.cos / math.sin."""
    rope = RopeTable.for_layer(DSV4Config.flash(), compressed=True)
    inv = rope.inv_freq_on(torch.device(device))
    pos = torch.cat([torch.tensor([-1, 0, 1, 127, 128, 129, 255, 256, 257, 2**20 - 1, 2**20]),
                     torch.randint(0, 2**20, (40,))]).to(device=device, dtype=torch.int32)
    c_ref, s_ref = ref_cos_sin(inv, pos, scale)
    c_tri, s_tri = tri_cos_sin(inv, pos, scale)
    torch.testing.assert_close(c_tri, c_ref, rtol=0, atol=2e-7)
    torch.testing.assert_close(s_tri, s_ref, rtol=0, atol=2e-7)
    ang = [[max(p, 0) * scale * f for f in inv.tolist()] for p in pos.tolist()]
    c_py = torch.tensor([[math.cos(a) for a in row] for row in ang], dtype=torch.float64).float()
    s_py = torch.tensor([[math.sin(a) for a in row] for row in ang], dtype=torch.float64).float()
    torch.testing.assert_close(c_ref.cpu(), c_py, rtol=0, atol=1e-7)
    torch.testing.assert_close(s_ref.cpu(), s_py, rtol=0, atol=1e-7)
    assert c_ref.shape == (pos.shape[0], rope.rope_dim // 2)
