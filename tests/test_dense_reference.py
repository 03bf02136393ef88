"""The dense reference (`dsv4.reference.dense`) against the HF oracle (`hf_oracle`), and the oracle itself.

Tolerance: both sides are exact-arithmetic implementations of the same math (dense in float64, HF
in fp32), so they must agree to max|a - b| / max|b| <= 1e-4 (measured: ~1e-6).
"""

from __future__ import annotations

import functools
import math

import hf_oracle as hfo
import pytest
import torch
from conftest import real_dims_config, tiny_config
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_sliding_window_causal_mask

from dsv4.reference.dense import dense_attention, rope_inv_freq, yarn_correction_range

TOL = 1e-4
LAYERS = {"swa": 0, "csa": 1, "hca": 2}  # both test configs: layers 0 SWA, 1 CSA, 2 HCA
# tiny: crosses 4 HCA windows (m' = 16), the window of 16 and 17 CSA windows; real dims: crosses the
# window of 128 and 8 HCA windows of 128 (positions 127/128/129 included), 275 CSA entries for k = 16.
SEQ = {"tiny": 70, "real": 1100}
CONFIGS = {"tiny": tiny_config, "real": real_dims_config}


def _x(cfg, S, seed=5):
    return torch.randn(S, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))


@functools.cache
def _case(cfg_name: str, kind: str):
    """(cfg, weights, x, dense out, dense top-k, HF one-shot out, HF top-k), computed once per module."""
    cfg = CONFIGS[cfg_name]()
    layer = LAYERS[kind]
    w = hfo.random_attention_weights(cfg, layer, seed=1)
    x = _x(cfg, SEQ[cfg_name])
    ref, ref_topk = dense_attention(cfg, layer, w, x, return_topk=True)
    hf, hf_topk = hfo.run_hf(cfg, layer, w, x, [x.shape[0]], return_topk=True)
    return cfg, w, x, ref, ref_topk, hf, hf_topk


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> int:
    """Rows of two [S, k] -1-padded selections that hold the same set of entries."""
    return sum(set(r.tolist()) == set(s.tolist()) for r, s in zip(a, b))


# ------------------------------------------------------------------------------------------ RoPE tables
def test_hf_compress_inv_freq_matches_design_formula():
    for cfg in (tiny_config(), real_dims_config()):
        assert cfg.compress_rope_theta == 160000.0 and cfg.rope_dim == 64
        # DESIGN §3, written out literally
        low = max(math.floor(64 * math.log(65536 / (32 * 2 * math.pi)) / (2 * math.log(160000))), 0)
        high = min(math.ceil(64 * math.log(65536 / (1 * 2 * math.pi)) / (2 * math.log(160000))), 63)
        assert (low, high) == (15, 25) == yarn_correction_range(cfg)
        i = torch.arange(32, dtype=torch.float64)
        extrap = 160000.0 ** (-2 * i / 64)
        e = 1 - ((i - low) / (high - low)).clamp(0, 1)
        design = extrap / 16 * (1 - e) + extrap * e
        rot = hfo.hf_rotary(cfg)
        torch.testing.assert_close(rot.compress_inv_freq.double(), design, rtol=1e-6, atol=0)
        torch.testing.assert_close(rope_inv_freq(cfg, compress=True), design, rtol=1e-12, atol=0)
        main = 10000.0 ** (-2 * i / 64)
        torch.testing.assert_close(rot.main_inv_freq.double(), main, rtol=1e-6, atol=0)
        torch.testing.assert_close(rope_inv_freq(cfg, compress=False), main, rtol=1e-12, atol=0)
        assert rot.compress_attention_scaling == 1.0  # V4 does not scale cos/sin by YaRN's mscale
    # yarn_factor 1 means plain RoPE on the compress table, on both sides
    plain = tiny_config(yarn_factor=1.0)
    assert hfo.hf_config(plain).rope_parameters["compress"]["rope_type"] == "default"
    torch.testing.assert_close(hfo.hf_rotary(plain).compress_inv_freq.double(),
                               160000.0 ** (-2 * torch.arange(32, dtype=torch.float64) / 64), rtol=1e-6, atol=0)


def test_weights_match_hf_state_dict():
    cfg = tiny_config()
    for layer in LAYERS.values():
        w = hfo.random_attention_weights(cfg, layer, seed=3)
        attn = hfo.hf_attention(cfg, layer, w)  # strict load: same keys and shapes
        assert set(w) == set(attn.state_dict())
        assert all(v.dtype == torch.float32 for v in w.values())
        torch.testing.assert_close(attn.sinks.detach(), w["sinks"])
    assert not torch.equal(hfo.random_attention_weights(cfg, 1, 0)["sinks"],
                           hfo.random_attention_weights(cfg, 1, 1)["sinks"])


# ------------------------------------------------------------------------------------------ dense vs HF
@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("cfg_name", ["tiny", "real"])
def test_dense_matches_hf(cfg_name, kind):
    cfg, _, x, ref, ref_topk, hf, hf_topk = _case(cfg_name, kind)
    assert ref.shape == hf.shape == x.shape
    err = hfo.rel_err(ref, hf)
    assert err <= TOL, f"{cfg_name}/{kind}: max rel err {err:.2e}"
    # activations are O(1) and not collapsed, so the bound means something
    assert 0.5 < hf.abs().max() < 10 and hf.std() > 0.05
    if kind == "csa":
        # >= 16 indexer heads: no ties in practice, so the selected sets must agree exactly
        assert cfg.index_n_heads >= 16
        assert ref_topk.shape == hf_topk.shape == (x.shape[0], cfg.index_topk)
        assert _same_sets(ref_topk, hf_topk) == x.shape[0]
        # and the selection is a real one: later queries pick k of many visible entries
        assert (ref_topk[-1] >= 0).all() and x.shape[0] // cfg.csa_compression_ratio > 2 * cfg.index_topk
    else:
        assert ref_topk is None and hf_topk is None


def test_dense_topk_order_and_padding():
    cfg, _, x, _, topk, _, _ = _case("tiny", "csa")
    m, k = cfg.csa_compression_ratio, cfg.index_topk
    for t in range(x.shape[0]):
        n_vis = (t + 1) // m
        row = topk[t]
        assert (row[: min(k, n_vis)] >= 0).all() and (row[min(k, n_vis):] == -1).all()
        assert (row[row >= 0] < n_vis).all()  # only entries whose window has closed


# ------------------------------------------------------------------------------------------ the oracle itself
@pytest.mark.parametrize("kind", list(LAYERS))
def test_hf_chunked_equals_one_shot_tiny(kind):
    cfg, w, x, ref, ref_topk, hf, _ = _case("tiny", kind)
    # prefill 40, two decode steps, a 13-token chunk straddling CSA/HCA windows (42..54), the rest
    chunks = [40, 1, 1, 13, 15]
    out, topk = hfo.run_hf(cfg, LAYERS[kind], w, x, chunks, return_topk=True)
    assert hfo.rel_err(out, hf) <= TOL
    assert hfo.rel_err(out, ref) <= TOL
    if kind == "csa":
        assert _same_sets(topk, ref_topk) == x.shape[0]
    # our own mask builder gives the same run as HF's mask function
    own = hfo.run_hf(cfg, LAYERS[kind], w, x, chunks, mask="own")
    assert hfo.rel_err(own, out) <= 1e-6


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_hf_chunked_equals_one_shot_real_dims(kind):
    cfg = real_dims_config()
    layer = LAYERS[kind]
    w = hfo.random_attention_weights(cfg, layer, seed=2)
    x = _x(cfg, 300, seed=7)
    one = hfo.run_hf(cfg, layer, w, x, [300])
    # decode steps at positions 127, 128 (first HCA boundary / window edge) and 255; a chunk
    # straddling the 256 boundary
    chunks = [127, 1, 1, 126, 1, 44]
    out = hfo.run_hf(cfg, layer, w, x, chunks)
    assert hfo.rel_err(out, one) <= TOL


def test_hf_eager_mask_is_a_tensor_at_decode():
    """HF applies CSA's block_bias only when attention_mask is a tensor. Eager always builds one
    (one query on an empty or short cache included); sdpa would return None there."""
    cfg = tiny_config()
    x1 = torch.randn(1, 1, cfg.hidden_size)
    pid = torch.tensor([[0]])
    for impl, expect_tensor in (("eager", True), ("sdpa", False)):
        hc = hfo.hf_config(cfg, attn_implementation=impl)
        m = create_sliding_window_causal_mask(config=hc, inputs_embeds=x1, attention_mask=None,
                                              past_key_values=DynamicCache(config=hc), position_ids=pid,
                                              layer_idx=LAYERS["csa"])
        assert isinstance(m, torch.Tensor) == expect_tensor, impl


def test_hf_without_mask_sees_every_compressed_entry():
    """Documents the pitfall: with attention_mask=None, HF's CSA ignores its top-k (and causality)."""
    cfg, w, x, _, _, hf, _ = _case("tiny", "csa")
    unmasked = hfo.run_hf(cfg, LAYERS["csa"], w, x, [x.shape[0] - 2, 1, 1], mask="none")
    assert hfo.rel_err(unmasked, hf) > 1e-2


# ------------------------------------------------------------------------------------------ wrong tables fail
def test_wrong_rope_base_or_yarn_is_detected():
    _, w, x, _, _, hf_csa, _ = _case("tiny", "csa")
    cfg = tiny_config()
    csa = LAYERS["csa"]
    assert hfo.rel_err(dense_attention(cfg.replace(yarn_factor=1.0), csa, w, x), hf_csa) > 1e-2
    assert hfo.rel_err(dense_attention(cfg.replace(compress_rope_theta=10000.0), csa, w, x), hf_csa) > 1e-1
    # HF must really put YaRN on the compress table: without it, it moves away from the dense reference
    ref = _case("tiny", "csa")[3]
    assert hfo.rel_err(hfo.run_hf(cfg.replace(yarn_factor=1.0), csa, w, x), ref) > 1e-2
    _, w0, x0, _, _, hf_swa, _ = _case("tiny", "swa")
    assert hfo.rel_err(dense_attention(cfg.replace(rope_theta=160000.0), LAYERS["swa"], w0, x0), hf_swa) > 1e-1
