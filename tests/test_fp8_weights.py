"""FP8 block weights (the checkpoint's format): quantise / dequantise, `linear_fp8` (Triton twin vs the
reference, on CPU under the interpreter and on a GPU at V4-Flash shapes), and the attention layer
holding them: same outputs as a dense layer with the dequantised weights, loading FP8 state dicts
by transformers' and DeepSeek's names, CUDA-graph replay."""

from __future__ import annotations

import hf_oracle as hfo
import pytest
import torch
from attn_helpers import default_tokens_per_block, make_block, rel_l2, run_dsv4
from conftest import real_dims_config, tiny_config

from dsv4 import KVCacheManager
from dsv4.attention import AttentionSubBlock
from dsv4.errors import InputError
from dsv4.kernels.reference.linear import linear_fp8 as ref_linear_fp8
from dsv4.kernels.reference.linear import linear_pair as ref_linear_pair
from dsv4.kernels.reference.linear import rms_rows
from dsv4.kernels.triton import fp8_linear, gemv
from dsv4.kernels.triton.fp8_linear import linear_fp8 as tri_linear_fp8
from dsv4.model.fp8_weights import BlockFP8Linear, dequantize_blocks, quantize_blocks
from dsv4.model.layer_schedule import AttentionType

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run through the device tool)")


def _weight(n: int, k: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w fp32, codes, fp32 scales): rows of different magnitudes so that blocks get different scales."""
    w = torch.randn(n, k, device=device) * torch.logspace(-3, 1, n, device=device)[:, None]
    codes, scale = quantize_blocks(w, "fp32")
    return w, codes, scale


# ------------------------------------------------------------------------------------------ the format
@pytest.mark.parametrize("scale_format", ["ue8m0", "fp32"])
@pytest.mark.parametrize("n,k", [(256, 384), (200, 300), (1, 129), (130, 7)])
def test_quantize_error_within_e4m3_rounding(n, k, scale_format):
    w = torch.randn(n, k) * torch.logspace(-4, 2, n)[:, None]
    codes, scale = quantize_blocks(w, scale_format)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (n, k)
    assert scale.shape == (-(-n // 128), -(-k // 128)) and scale.dtype == torch.float32
    if scale_format == "ue8m0":
        assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))          # powers of two
    assert codes.float().abs().max() <= 448
    back = dequantize_blocks(codes, scale)
    s = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    # e4m3: 3 mantissa bits (half an ulp = 2^-4 relative); subnormals below 2^-6: steps of 2^-9
    bound = torch.maximum(w.abs() * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)
    assert ((back - w).abs() <= bound).all()
    assert rel_l2(back, w) < 0.05


def test_quantize_dequantize_round_trip_is_exact():
    """Codes with a ±448 in every block and UE8M0 scales: dequantise, re-quantise -> the same bytes."""
    n, k = 300, 260
    codes = (torch.randn(n, k) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    codes[::128, ::128] = 448.0
    scale = torch.exp2(torch.randint(-12, 4, (3, 3)).float())
    c2, s2 = quantize_blocks(dequantize_blocks(codes, scale), "ue8m0")
    assert torch.equal(s2, scale)
    assert torch.equal(c2.view(torch.uint8), codes.view(torch.uint8))


def test_module_keeps_its_format_across_to():
    lin = torch.nn.Linear(200, 160, bias=False)
    mod = BlockFP8Linear.from_linear(lin)
    codes = mod.weight.detach().clone()
    mod.to(torch.bfloat16)
    assert mod.weight.dtype == torch.float8_e4m3fn and mod.weight_scale_inv.dtype == torch.float32
    assert torch.equal(mod.weight.view(torch.uint8), codes.view(torch.uint8))
    x = torch.randn(3, 200)
    torch.testing.assert_close(mod(x), x @ mod.dequantize().T, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ linear_fp8
def _assert_close_to_product(y, want, x, codes, scale, groups):
    """y (x's dtype) vs the fp32 reference `want`: summation order moves a sum by a few fp32 ulps of
    the sum of its terms' magnitudes (|x| |W|^T); a bf16 y adds its own rounding, one ulp (2^-7
    relative: the CPU interpreter's fp32 -> bf16 cast truncates, the GPU's rounds, half of that)."""
    mag = ref_linear_fp8(x.float().abs(), codes.float().abs().to(codes.dtype), scale, groups)
    bound = 1e-5 * mag + (2.0**-7 * want.abs() if y.dtype == torch.bfloat16 else 0)
    excess = (y.float() - want).abs() - bound
    assert excess.max() <= 0, (excess.max(), bound.max())


def test_reference_equals_float64_product():
    _, codes, scale = _weight(192, 256)
    x = torch.randn(7, 2 * 256)
    y = ref_linear_fp8(x, codes, scale, groups=2)
    wd = dequantize_blocks(codes, scale).double().view(2, 96, 256)
    want = torch.cat([x[:, :256].double() @ wd[0].T, x[:, 256:].double() @ wd[1].T], dim=1)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


# rows: 1 (the GEMV), 2-256 (the GEMM kernel: all rows in one tile of 16 .. 256), > 256 (dequantise, then torch's
# GEMM); N and K off the 128 block, a group of 16 rows, several groups; K 1100 / 2200: split K (on the CPU,
# 2 and 4 splits, the last one partial)
_CASES = [(1, 200, 300, 1), (1, 64, 96, 4), (1, 1, 129, 1), (3, 200, 300, 1), (17, 48, 130, 3), (40, 256, 256, 2),
          (70, 130, 70, 1), (200, 96, 256, 1), (300, 96, 160, 2), (5, 64, 1100, 1), (2, 32, 2200, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,n,k,groups", _CASES)
def test_triton_linear_fp8_matches_reference(t, n, k, groups, dtype):
    """UE8M0 scales: the prefill regime's bf16 W is exact too, so every regime meets the same bound."""
    w = torch.randn(n, k, device=DEVICE) * torch.logspace(-3, 1, n, device=DEVICE)[:, None]
    codes, scale = quantize_blocks(w, "ue8m0")
    x = torch.randn(t, groups * k, device=DEVICE).to(dtype)
    y = tri_linear_fp8(x, codes, scale, groups)
    want = ref_linear_fp8(x.float(), codes, scale, groups)          # fp32, not yet rounded to dtype
    assert y.dtype == dtype and y.shape == (t, n)
    _assert_close_to_product(y, want, x, codes, scale, groups)


# the GEMM's two forms (tensor descriptors, pointer loads) at given K splits: 1, 2 and 4 (9 scale blocks
# in 4: three splits of 384 codes, none empty), N off the 64-row tile, groups, 129-256 rows in one tile
_SPLIT_CASES = [(3, 200, 1152, 1), (40, 96, 768, 2), (130, 64, 512, 1), (16, 48, 384, 3)]


@pytest.mark.parametrize("desc", [True, False], ids=["descriptors", "pointers"])
@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("t,n,k,groups", _SPLIT_CASES)
def test_gemm_forms_and_k_splits(t, n, k, groups, splits, desc):
    w = torch.randn(n, k, device=DEVICE) * torch.logspace(-3, 1, n, device=DEVICE)[:, None]
    codes, scale = quantize_blocks(w, "ue8m0")
    x = torch.randn(t, groups * k, device=DEVICE).to(torch.bfloat16)
    assert fp8_linear._descriptors_fit(x, codes)
    y = tri_linear_fp8(x, codes, scale, groups, splits=splits, desc=desc)
    _assert_close_to_product(y, ref_linear_fp8(x.float(), codes, scale, groups), x, codes, scale, groups)


@pytest.mark.parametrize("rows", [2, 16, 17, 64, 128, 200, 256])
@pytest.mark.parametrize("tiles,k", [(1, 128), (2, 2200), (24, 4096), (64, 8192), (128, 4096), (640, 1024)])
def test_k_splits_cover_k_once(rows, tiles, k):
    """Every split has codes (none empty), together exactly K's scale blocks, and a split the rule makes
    on its own keeps at least `_SPLIT_MIN_K` codes."""
    for sms in (4, 132):
        splits, k_split = fp8_linear._k_splits(tiles, k, rows, sms)
        assert k_split % 128 == 0 and (splits - 1) * k_split < k <= splits * k_split
        assert splits == 1 or k_split >= fp8_linear._SPLIT_MIN_K
        for want in (1, 3, 64):
            s, ks = fp8_linear._k_splits(tiles, k, rows, sms, want)
            assert ks % 128 == 0 and (s - 1) * ks < k <= s * ks and s <= want


def test_gemm_needs_all_rows_in_one_tile():
    codes, scale = quantize_blocks(torch.randn(128, 128, device=DEVICE))
    x = torch.randn(40, 128, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(InputError, match="BLOCK_M 32"):
        tri_linear_fp8(x, codes, scale, tiles=(32, 64, 4, 3))


def test_prefill_regime_with_fp32_scales_rounds_weights_once():
    """V3-style fp32 scales: over 256 rows W is rounded once to bf16 (2^-9 relative per weight), so
    the output moves by at most 2^-9 of |x| |W|^T beyond the bf16 output rounding."""
    _, codes, scale = _weight(96, 384, DEVICE)
    x = torch.randn(300, 384, device=DEVICE).to(torch.bfloat16)
    y = tri_linear_fp8(x, codes, scale)
    want = ref_linear_fp8(x.float(), codes, scale)
    mag = ref_linear_fp8(x.float().abs(), codes.float().abs().to(codes.dtype), scale)
    assert ((y.float() - want).abs() <= 2.0**-9 * mag + 2.0**-7 * want.abs() + 1e-6).all()
    torch.testing.assert_close(fp8_linear.dequantize(codes, scale, torch.float32), dequantize_blocks(codes, scale),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,n,k", [(1, 200, 300), (1, 64, 1024), (3, 200, 300)])
def test_triton_linear_fp8_applies_the_rms_norm(t, n, k, dtype):
    """norm = (w, eps): one row normalises x inside the GEMV, more rows run the norm kernel first; both
    against the reference (the norm rounded to x's dtype, then the product). x's RMS is ~37 and the norm
    weight not all ones: a missing scale or weight fails by far; each normalised element may differ by
    one rounding step of x's dtype (the interpreter's bf16 cast truncates)."""
    w = torch.randn(n, k, device=DEVICE) * torch.logspace(-3, 1, n, device=DEVICE)[:, None]
    codes, scale = quantize_blocks(w, "ue8m0")
    x = (37 * torch.randn(t, k, device=DEVICE)).to(dtype)
    norm = ((1 + 0.5 * torch.randn(k, device=DEVICE)).to(dtype), 1e-6)
    y = tri_linear_fp8(x, codes, scale, norm=norm)
    xn = rms_rows(x, norm)
    want = ref_linear_fp8(xn.float(), codes, scale)
    torch.testing.assert_close(ref_linear_fp8(x, codes, scale, norm=norm), want.to(dtype), rtol=0, atol=0)
    mag = ref_linear_fp8(xn.float().abs(), codes.float().abs().to(codes.dtype), scale)
    step = 1e-5 if dtype == torch.float32 else 2.0**-7
    assert y.dtype == dtype and y.shape == (t, n)
    excess = (y.float() - want).abs() - step * (mag + want.abs())
    assert excess.max() <= 0, excess.max()
    assert (tri_linear_fp8(x, codes, scale).float() - want).abs().max() > 10 * step * mag.max()


def test_linear_fp8_rejects_bad_arguments():
    _, codes, scale = _weight(64, 128)
    x = torch.randn(2, 128)
    for fn in (tri_linear_fp8,):
        with pytest.raises(InputError, match="scales"):
            fn(x, codes, scale[:, :0])
        with pytest.raises(InputError, match="float8_e4m3fn"):
            fn(x, codes.float(), scale)
        with pytest.raises(InputError, match="x must be"):
            fn(torch.randn(2, 100), codes, scale)
        with pytest.raises(InputError, match="multiple of 16"):
            fn(torch.randn(2, 8 * 128), codes, scale, groups=8)
    assert tri_linear_fp8(x[:0], codes, scale).shape == (0, 64)


# ------------------------------------------------------------------------------------------ the layer
def _fp8_and_dense(cfg, layer: int, seed: int = 3, scale_format: str = "ue8m0"):
    """(FP8 block, dense fp32 block with the dequantised weights)."""
    w = hfo.random_attention_weights(cfg, layer, seed=seed)
    fp8 = make_block(cfg, layer, w)
    fp8.quantize_weights(scale_format)
    dense = make_block(cfg, layer, fp8.dense_state_dict(torch.float32))
    return fp8, dense


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_layer_with_fp8_weights_equals_dense_dequantised(layer):
    """Prefill chunks (the general path) and decode steps (the decode path) of two requests, reference
    and Triton kernels: an FP8 layer gives what a dense layer holding W = codes x scales gives."""
    cfg = tiny_config()
    fp8, dense = _fp8_and_dense(cfg, layer)
    mods = [n for n, m in fp8.named_modules() if isinstance(m, BlockFP8Linear)]
    want = {"q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj"} | ({"compressor.indexer.q_b_proj"} if layer == 1
                                                                          else set())
    assert set(mods) == want
    fp8.to(DEVICE)
    dense.to(DEVICE)
    g = torch.Generator().manual_seed(5)
    xs = {"a": torch.randn(24, cfg.hidden_size, generator=g), "b": torch.randn(9, cfg.hidden_size, generator=g)}
    xs = {r: x.to(DEVICE) for r, x in xs.items()}
    sched = [{"a": 17, "b": 3}, {"b": 4}, {"a": 1, "b": 1}, {"a": 5}, {"a": 1, "b": 1}]

    def run(blk: AttentionSubBlock) -> dict[str, torch.Tensor]:
        mgr = KVCacheManager(cfg, max_requests=2, num_blocks=16, device=DEVICE, kv_format="fp32",
                             indexer_format="fp32", tokens_per_block=default_tokens_per_block(cfg))
        return run_dsv4(cfg, layer, None, xs, sched, blk=blk, mgr=mgr)

    fp8.backend = dense.backend = "reference"
    got_ref, want_out = run(fp8), run(dense)
    for r in xs:
        assert rel_l2(got_ref[r], want_out[r]) < 1e-5, (r, rel_l2(got_ref[r], want_out[r]))
    fp8.backend = "triton"
    got_tri = run(fp8)
    for r in xs:
        assert rel_l2(got_tri[r], want_out[r]) < 1e-4, (r, rel_l2(got_tri[r], want_out[r]))


def test_fp8_projections_share_the_fused_buffers():
    """FP8 parts of a fused projection live in one code buffer (padded to 128-row starts), the dense
    parts in another; the column views are each module's own output."""
    cfg = tiny_config()
    fp8, _ = _fp8_and_dense(cfg, 1)
    x = torch.randn(6, cfg.hidden_size)
    proj = fp8.project(x)
    codes, scale = fp8._inputs._fp8
    assert codes.shape[0] == 2 * 128 and scale.shape[0] == 2     # q_a (32 rows) padded, kv (128 rows)
    for name, mod in (("q_a", fp8.q_a_proj), ("kv", fp8.kv_proj), ("c", fp8.compressor.kv_proj),
                      ("iw", fp8.compressor.indexer.scorer.weights_proj)):
        torch.testing.assert_close(proj[name], mod(x), rtol=1e-5, atol=1e-6)
    lo, hi = codes.data_ptr(), codes.data_ptr() + codes.numel()
    assert lo <= fp8.kv_proj.weight.data_ptr() < hi
    assert fp8._inputs.weight() is not None and fp8._q_up.weight() is None      # q_b, indexer q_b: all FP8


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fused_projection_part_is_its_column_view(backend):
    """`FusedProjection.part(x, i)` (one GEMM over part i's rows of the fused buffers) gives the i-th
    output of the fused GEMM: dense parts beside FP8 ones (an FP8 layer's input projection: padded
    FP8 starts), the all-FP8 q up-projection, with and without the norm applied inside."""
    from dsv4.kernels.dispatch import ops_for
    cfg = tiny_config()
    fp8, _ = _fp8_and_dense(cfg, 1)
    fp8.to(DEVICE)
    ops = ops_for(torch.device(DEVICE), backend)
    x = torch.randn(3, cfg.hidden_size, device=DEVICE)
    q_a = torch.randn(3, cfg.q_lora_rank, device=DEVICE) * 5
    norm = fp8.qa_norm()
    for fused, src, nrm in ((fp8._inputs, x, None), (fp8._q_up, q_a, None), (fp8._q_up, q_a, norm)):
        whole = fused(src, ops, nrm)
        assert len(whole) == len(fused.sizes) > 1
        for i, want in enumerate(whole):
            got = fused.part(src, i, ops, nrm)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    normed = fp8.query_up_normed({"q_a": q_a}, ops)
    for name in ("q", "iq"):
        torch.testing.assert_close(fp8.query_up_part(name, q_a, ops, norm), normed[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
def test_load_fp8_state_dicts(scale_dtype):
    """An FP8 checkpoint's state dict (transformers' names, V3 fp32 or V4 UE8M0 scales; DeepSeek's
    names with `.scale`) loads into a dense block as FP8 blocks; a dense one turns them dense again."""
    cfg = tiny_config()
    fp8, dense = _fp8_and_dense(cfg, 1)
    sd = {k: (v.to(scale_dtype) if k.endswith("weight_scale_inv") else v) for k, v in fp8.state_dict().items()}
    blk = AttentionSubBlock(cfg, 1)
    blk.load_hf_state_dict(sd)
    assert isinstance(blk.o_b_proj, BlockFP8Linear) and isinstance(blk.compressor.kv_proj, torch.nn.Linear)
    x = torch.randn(4, cfg.hidden_size)
    torch.testing.assert_close(blk.project(x)["q_a"], fp8.project(x)["q_a"], rtol=0, atol=0)
    ds = {k.replace("q_a_proj.", "wq_a.").replace(".weight_scale_inv", ".scale"): v for k, v in sd.items()}
    blk2 = AttentionSubBlock(cfg, 1)
    blk2.load_deepseek_state_dict(ds)
    assert isinstance(blk2.q_a_proj, BlockFP8Linear)
    assert torch.equal(blk2.q_a_proj.weight_scale_inv, fp8.q_a_proj.weight_scale_inv)
    blk2.load_hf_state_dict(dense.state_dict())
    assert isinstance(blk2.q_a_proj, torch.nn.Linear)
    torch.testing.assert_close(blk2.project(x)["q_a"], fp8.project(x)["q_a"], rtol=1e-5, atol=1e-6)


def test_fp8_load_errors():
    cfg = tiny_config()
    fp8, _ = _fp8_and_dense(cfg, 2)
    sd = fp8.state_dict()
    bad = dict(sd, **{"kv_proj.weight": sd["kv_proj.weight"].float()})
    with pytest.raises(InputError, match="float8_e4m3fn"):
        AttentionSubBlock(cfg, 2).load_hf_state_dict(bad)
    bad = dict(sd, **{"kv_proj.weight_scale_inv": sd["kv_proj.weight_scale_inv"][:, :0]})
    with pytest.raises(InputError, match=r"kv_proj\.weight_scale_inv"):
        AttentionSubBlock(cfg, 2).load_hf_state_dict(bad)
    bad = {k: v for k, v in sd.items() if k != "o_b_proj.weight_scale_inv"}
    with pytest.raises(InputError, match="without their scales"):
        AttentionSubBlock(cfg, 2).load_hf_state_dict(bad)
    # a refused state dict changes nothing: the dense block keeps its modules and its outputs
    blk = make_block(cfg, 2, hfo.random_attention_weights(cfg, 2, seed=4))
    x = torch.randn(3, cfg.hidden_size)
    before = blk.project(x)["q_a"].clone()
    with pytest.raises(InputError, match="do not match"):
        blk.load_hf_state_dict({k: v for k, v in sd.items() if k != "sinks"})
    assert isinstance(blk.q_a_proj, torch.nn.Linear) and torch.equal(blk.project(x)["q_a"], before)
    with pytest.raises(InputError, match="no projection"):
        fp8.quantize_weights(modules=("compressor.indexer.q_b_proj",))
    with pytest.raises(InputError, match="scale_format"):
        fp8.quantize_weights("e4m3")


def _assert_pair_is_both_gemvs(x: torch.Tensor, dense: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor):
    """gemv_pair's outputs are those of the two one-row GEMVs bit for bit (each of its programs runs
    their code at their tiles), and these are near the float64 products."""
    y_d, y_f = fp8_linear.gemv_pair(x, dense, codes, scale)
    assert torch.equal(y_d, gemv.gemv(x, dense)) and torch.equal(y_f, tri_linear_fp8(x, codes, scale))
    want_d = (x.double() @ dense.double().T)
    tol = 2e-6 if x.dtype == torch.float32 else 2 ** -7
    assert (y_d.double() - want_d).abs().max() <= tol * want_d.abs().max()
    _assert_close_to_product(y_f, ref_linear_fp8(x.float(), codes, scale, 1), x, codes, scale, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_d,n_f,k", [(70, 200, 300), (16, 130, 1024), (37, 64, 2050), (5, 1, 129)])
def test_gemv_pair_is_both_gemvs(n_d, n_f, k, dtype):
    """One launch of a dense and an FP8 one-row GEMV of one x: N off both row blocks, K off the K
    blocks (300, 2050, 129), one FP8 row."""
    g = torch.Generator().manual_seed(n_d * 7919 + k)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    dense = (torch.randn(n_d, k, generator=g) * torch.logspace(-2, 1, n_d)[:, None]).to(DEVICE, dtype)
    _, codes, scale = _weight(n_f, k, DEVICE)
    _assert_pair_is_both_gemvs(x, dense, codes, scale)


def test_linear_pair_dispatch():
    """Off the one-row CUDA case (several rows, the CPU) `linear_pair` is the two projections; the
    reference's is its linear and linear_fp8; mismatched K is refused."""
    g = torch.Generator().manual_seed(3)
    _, codes, scale = _weight(40, 256, DEVICE)
    dense = torch.randn(24, 256, generator=g).to(DEVICE)
    for t in (1, 3):
        x = torch.randn(t, 256, generator=g).to(DEVICE)
        y_d, y_f = fp8_linear.linear_pair(x, dense, codes, scale)
        assert torch.equal(y_f, tri_linear_fp8(x, codes, scale))
        assert torch.equal(y_d, gemv.linear(x, dense) if t > 1 or DEVICE == "cpu" else gemv.gemv(x, dense))
        r_d, r_f = ref_linear_pair(x, dense, codes, scale)
        assert torch.equal(r_d, x @ dense.T) and torch.equal(r_f, ref_linear_fp8(x, codes, scale))
    with pytest.raises(InputError):
        fp8_linear.gemv_pair(torch.randn(1, 128, device=DEVICE), dense[:, :128], codes, scale)


# ------------------------------------------------------------------------------------------ GPU
@_GPU
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 16, 64, 200, 300])
@pytest.mark.parametrize("n,k,groups", [(4160, 4096, 1), (40960, 1024, 1), (8192, 4096, 8), (4096, 8192, 1)])
def test_gpu_linear_fp8_flash_shapes(t, n, k, groups):
    """V4-Flash's FP8 projections (fused input, q up, grouped o_a, o_b) with bf16 activations."""
    dev = torch.device("cuda")
    codes, scale = quantize_blocks(torch.randn(n, k, device=dev) * 0.02, "ue8m0")      # V4's scales
    x = torch.randn(t, groups * k, device=dev).to(torch.bfloat16)
    y = tri_linear_fp8(x, codes, scale, groups)
    _assert_close_to_product(y, ref_linear_fp8(x.float(), codes, scale, groups), x, codes, scale, groups)


@_GPU
@pytest.mark.gpu
@pytest.mark.parametrize("n_d", [1024, 2624], ids=["hca", "csa"])
def test_gpu_gemv_pair_flash_inputs(n_d):
    """The decode step's first stage at one row with an FP8 checkpoint: FP8 q_a + kv (1,536 rows) beside
    the dense compressor projections (HCA 1,024 rows, CSA 2,624), K 4,096, bf16."""
    dev = torch.device("cuda")
    x = torch.randn(1, 4096, device=dev).to(torch.bfloat16)
    dense = (torch.randn(n_d, 4096, device=dev) * 0.02).to(torch.bfloat16)
    codes, scale = quantize_blocks(torch.randn(1536, 4096, device=dev) * 0.02, "ue8m0")
    _assert_pair_is_both_gemvs(x, dense, codes, scale)
    y_d, y_f = fp8_linear.linear_pair(x, dense, codes, scale)      # the dispatch takes the pair at one row
    assert torch.equal(y_d, gemv.gemv(x, dense)) and torch.equal(y_f, tri_linear_fp8(x, codes, scale))


@_GPU
@pytest.mark.gpu
@pytest.mark.parametrize("desc", [True, False], ids=["descriptors", "pointers"])
@pytest.mark.parametrize("asm", [True, False], ids=["asm", "triton-cvt"])
def test_gpu_linear_fp8_every_code_exact(asm, desc):
    """Every finite e4m3 code through the GEMM's conversion (`_E4M3X2_TO_BF16` on bf16 x, or Triton's),
    either form: x the identity, so y is W^T, each entry one exact product: the decoded codes bit for bit."""
    dev = torch.device("cuda")
    byte = torch.arange(256 * 128, device=dev).view(256, 128) % 256
    byte[(byte & 0x7F) == 0x7F] = 0                                                      # NaN codes
    codes = byte.to(torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.ones(2, 1, device=dev)
    x = torch.eye(128, device=dev, dtype=torch.bfloat16)
    y = tri_linear_fp8(x, codes, scale, asm=asm, desc=desc)
    assert torch.equal(y, codes.float().T.to(torch.bfloat16))


@_GPU
@pytest.mark.gpu
@pytest.mark.parametrize("layer", [0, 1, 2])
def test_gpu_fp8_layer_graph_replay_and_reference(layer):
    """Real dims on the GPU, bf16 activations, FP8 weights, fp8_ds + mxfp4 cache: Triton decode steps
    replayed from CUDA graphs equal eager ones, and stay within the formats' tolerance of the reference."""
    from test_gpu_decode import _case, _rel_l2, _run

    cfg = real_dims_config()
    w, xs, sched = _case(cfg, layer, {"a": 250, "b": 126}, 6)
    fmts = ("fp8_ds", "mxfp4")
    kw = dict(fp8_weights=True, dtype=torch.bfloat16)
    eager = _run(cfg, layer, w, xs, sched, "triton", fmts, **kw)
    graph = _run(cfg, layer, w, xs, sched, "triton", fmts, graph=True, **kw)
    ref = _run(cfg, layer, w, xs, sched, "reference", fmts, **kw)
    for r in xs:
        assert torch.equal(graph[r], eager[r]), (r, _rel_l2(graph[r], eager[r]))
        assert _rel_l2(eager[r], ref[r]) <= 2e-2, (r, _rel_l2(eager[r], ref[r]))


@_GPU
@pytest.mark.gpu
@pytest.mark.parametrize("layer", [1, 2], ids=["csa", "hca"])
def test_gpu_fp8_split_input_gemms_change_nothing(layer, monkeypatch):
    """FP8 q_a / kv beside dense compressor weights: the compressors' input GEMM on the decode step's side
    branch (`decode_path.SPLIT_INPUT_GEMMS`) gives the one-stream projections' outputs bit for bit, eager
    and replayed from CUDA graphs (the same kernels; only their streams and the events between them
    differ), and the split is taken."""
    from test_gpu_decode import _case, _run

    import dsv4.attention.decode_path as dp

    cfg = real_dims_config()
    w, xs, sched = _case(cfg, layer, {"a": 250, "b": 126}, 6)
    kw = dict(fp8_weights=True, dtype=torch.bfloat16)
    split_calls = []
    project = AttentionSubBlock.project

    def counted(self, x, ops=None, dense_on=None):
        split_calls.append(dense_on is not None)
        return project(self, x, ops, dense_on)

    monkeypatch.setattr(AttentionSubBlock, "project", counted)
    outs = {}
    for split in (True, False):
        monkeypatch.setattr(dp, "SPLIT_INPUT_GEMMS", {AttentionType.CSA: 1, AttentionType.HCA: 1} if split else {})
        split_calls.clear()
        outs[split] = [_run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"), graph=g, **kw)
                       for g in (False, True)]
        assert any(split_calls) == split, split_calls
    for r in xs:
        for eager_or_graph in range(2):
            assert torch.equal(outs[True][eager_or_graph][r], outs[False][eager_or_graph][r]), (r, eager_or_graph)


def test_dense_inputs_of_an_fp8_checkpoint():
    """Held as DeepSeek ships them, a layer's dense input projections are exactly the compressors' (the
    decode step's split of its input GEMMs keys on this)."""
    cfg = tiny_config()
    for layer, want in ((1, {"c", "z", "ic", "iz", "iw"}), (2, {"c", "z"})):
        blk = make_block(cfg, layer, hfo.random_attention_weights(cfg, layer, seed=5))
        assert blk.dense_inputs() == frozenset(blk.project_names())
        blk.quantize_weights()
        assert blk.dense_inputs() == want, (layer, blk.dense_inputs())
