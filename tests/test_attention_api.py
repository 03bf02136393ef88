"""The attention sub-block's API: input checks (each a dsv4.errors exception that changes nothing)
and weight loading by transformers' names and by DeepSeek's own checkpoint names."""

from __future__ import annotations

import functools

import hf_oracle as hfo
import pytest
import torch
from attn_helpers import chunked, make_block, run_dsv4
from conftest import tiny_config

from dsv4 import KVCacheManager
from dsv4.attention import AttentionSubBlock
from dsv4.errors import DeviceError, InputError

LAYERS = {"swa": 0, "csa": 1, "hca": 2}  # tiny_config: layer 0 SWA, 1 CSA, 2 HCA


# ------------------------------------------------------------------------------------------ errors and weights
@functools.cache
def _tiny(kind: str):
    """(cfg, weights, x [60, d]) of one tiny layer."""
    cfg = tiny_config()
    w = hfo.random_attention_weights(cfg, LAYERS[kind], seed=1)
    return cfg, w, torch.randn(60, cfg.hidden_size, generator=torch.Generator().manual_seed(11))


def _one_step(kind="csa", n=5):
    cfg, w, x = _tiny(kind)
    blk = make_block(cfg, LAYERS[kind], w)
    mgr = KVCacheManager(cfg, max_requests=2, num_blocks=8, kv_format="fp32", indexer_format="fp32",
                         tokens_per_block=32)
    mgr.add_request("a")
    batch = mgr.prepare_forward({"a": n})
    return cfg, x[:n], blk, mgr, batch


def test_wrong_dtype_is_device_error():
    _, x, blk, mgr, batch = _one_step()
    with pytest.raises(DeviceError, match="float64"):
        blk(x.double(), batch, mgr.acquire(1, batch))


def test_wrong_shape_is_input_error():
    cfg, x, blk, mgr, batch = _one_step()
    h = mgr.acquire(1, batch)
    with pytest.raises(InputError):
        blk(x[:4], batch, h)  # one token short of the batch
    with pytest.raises(InputError):
        blk(torch.zeros(5, cfg.hidden_size + 1), batch, h)
    with pytest.raises(InputError):
        blk(x[None], batch, h)  # [1, 5, d]


def test_handle_of_another_layer_is_input_error():
    _, x, blk, mgr, batch = _one_step()
    for other in (0, 2):
        with pytest.raises(InputError, match="layer"):
            blk(x, batch, mgr.acquire(other, batch))


@pytest.mark.parametrize("kind", list(LAYERS))
def test_load_hf_state_dict_rejects_bad_weights(kind):
    cfg, w = _tiny(kind)[:2]
    blk = make_block(cfg, LAYERS[kind], w)
    for key in ("q_a_proj.weight", "sinks", "compressor.position_bias" if kind != "swa" else "kv_norm.weight"):
        missing = {k: v for k, v in w.items() if k != key}
        with pytest.raises(InputError, match="missing"):
            blk.load_hf_state_dict(missing)
        bad = dict(w)
        bad[key] = torch.zeros(*w[key].shape[:-1], w[key].shape[-1] + 1)
        with pytest.raises(InputError, match="shape"):
            blk.load_hf_state_dict(bad)
    extra = dict(w, **{"bogus.weight": torch.zeros(1)})
    with pytest.raises(InputError):
        blk.load_hf_state_dict(extra)


# HF name -> DeepSeek checkpoint name, written out by hand (DESIGN §3), independent of dsv4.model.weights
_HF_TO_DEEPSEEK = {
    "q_a_proj.weight": "wq_a.weight",
    "q_a_norm.weight": "q_norm.weight",
    "q_b_proj.weight": "wq_b.weight",
    "kv_proj.weight": "wkv.weight",
    "kv_norm.weight": "kv_norm.weight",
    "o_a_proj.weight": "wo_a.weight",
    "o_b_proj.weight": "wo_b.weight",
    "sinks": "attn_sink",
    "compressor.kv_proj.weight": "compressor.wkv.weight",
    "compressor.gate_proj.weight": "compressor.wgate.weight",
    "compressor.position_bias": "compressor.ape",
    "compressor.kv_norm.weight": "compressor.norm.weight",
    "compressor.indexer.kv_proj.weight": "indexer.compressor.wkv.weight",
    "compressor.indexer.gate_proj.weight": "indexer.compressor.wgate.weight",
    "compressor.indexer.position_bias": "indexer.compressor.ape",
    "compressor.indexer.kv_norm.weight": "indexer.compressor.norm.weight",
    "compressor.indexer.q_b_proj.weight": "indexer.wq_b.weight",
    "compressor.indexer.scorer.weights_proj.weight": "indexer.weights_proj.weight",
}


@pytest.mark.parametrize("kind", list(LAYERS))
def test_load_deepseek_state_dict_same_output(kind):
    cfg, w, x = _tiny(kind)[:3]
    layer = LAYERS[kind]
    assert set(w) <= set(_HF_TO_DEEPSEEK)
    ds = {_HF_TO_DEEPSEEK[k]: v.clone() for k, v in w.items()}
    blk = make_block(cfg, layer, w)
    blk_ds = AttentionSubBlock(cfg, layer).eval()
    blk_ds.load_deepseek_state_dict(ds)
    sched = chunked("a", [40, 1, 1, 18])
    a = run_dsv4(cfg, layer, None, {"a": x[:60]}, sched, blk=blk)["a"]
    b = run_dsv4(cfg, layer, None, {"a": x[:60]}, sched, blk=blk_ds)["a"]
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------ fused input projection
@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_fused_input_projection(kind):
    """project(x) == each projection of x on its own; the modules' weights live in the fused buffer
    (not held twice); loading new weights and moving the block both reach the fused GEMM."""
    cfg, w, x = _tiny(kind)
    blk = make_block(cfg, LAYERS[kind], w)
    mods = {"q_a": blk.q_a_proj, "kv": blk.kv_proj}
    if blk.compressor is not None:
        mods |= {"c": blk.compressor.kv_proj, "z": blk.compressor.gate_proj}
        if kind == "csa":
            idx = blk.compressor.indexer
            mods |= {"ic": idx.kv_proj, "iz": idx.gate_proj, "iw": idx.scorer.weights_proj}

    def check(xx: torch.Tensor) -> None:
        proj = blk.project(xx)
        assert list(proj) == list(mods)
        for name, mod in mods.items():
            torch.testing.assert_close(proj[name], mod(xx), rtol=1e-6, atol=1e-6)

    check(x)
    fused = blk._inputs.weight()
    lo, hi = fused.data_ptr(), fused.data_ptr() + fused.numel() * fused.element_size()
    assert all(lo <= m.weight.data_ptr() < hi for m in mods.values())
    w2 = {k: v + 0.5 if k.endswith("proj.weight") else v for k, v in w.items()}
    blk.load_hf_state_dict(w2)
    torch.testing.assert_close(blk.project(x)["kv"], x @ w2["kv_proj.weight"].T, rtol=1e-6, atol=1e-5)
    check(x)
    blk.to(torch.float64)                                     # every weight replaced: rebuilt on next use
    check(x.double())
    assert blk._inputs.weight().dtype == torch.float64
