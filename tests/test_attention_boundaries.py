"""Bugs seen in other DSV4 implementations (DESIGN §8), one test each: the RoPE table per layer
type, RoPE on compressed entries at the window's first token, and a compressor window that
straddles chunk boundaries. fp32 formats; oracles: HF fp32 and the dense float64 reference."""

from __future__ import annotations

import functools

import hf_oracle as hfo
import pytest
import torch
from attn_helpers import chunked, make_block, max_rel, run_dsv4
from conftest import tiny_config

from dsv4 import KVCacheManager
from dsv4.reference import dense as dense_mod
from dsv4.reference.dense import dense_attention

TOL = 1e-4
LAYERS = {"swa": 0, "csa": 1, "hca": 2}  # tiny_config: layer 0 SWA, 1 CSA, 2 HCA


def _x(cfg, S, seed):
    return torch.randn(S, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))


@functools.cache
def _tiny(kind: str):
    """(cfg, weights, x [300, d]) of one tiny layer (same seeds as test_attention.py)."""
    cfg = tiny_config()
    return cfg, hfo.random_attention_weights(cfg, LAYERS[kind], seed=1), _x(cfg, 300, seed=11)


# ------------------------------------------------------------------------------------------ boundary bugs (DESIGN §8)
def test_rope_table_per_layer_type(monkeypatch):
    """SWA-only layers use the main table (θ = 10000), CSA/HCA the compress table (θ = 160000 + YaRN),
    and the test can tell the two apart."""
    cfg = tiny_config()
    rot = hfo.hf_rotary(cfg)
    S = 48
    orig = dense_mod.rope_inv_freq

    def swapped(c, compress, dtype=torch.float64):  # the OTHER table of the two
        return orig(c, not compress, dtype)

    for kind, layer in LAYERS.items():
        w = _tiny(kind)[1]
        x = _x(cfg, S, seed=31)
        blk = make_block(cfg, layer, w)
        want = rot.main_inv_freq if kind == "swa" else rot.compress_inv_freq
        torch.testing.assert_close(blk.rope.inv_freq.double(), want.double(), rtol=1e-6, atol=0)
        ours = run_dsv4(cfg, layer, None, {"a": x}, chunked("a", [20, 1, 27]), blk=blk)["a"]
        right = dense_attention(cfg, layer, w, x)
        with monkeypatch.context() as mp:  # the reference with the other layer type's table
            mp.setattr(dense_mod, "rope_inv_freq", swapped)
            wrong = dense_attention(cfg, layer, w, x)
        assert max_rel(ours, right) <= TOL
        sep = max_rel(wrong, right)
        assert sep > 1e-2, f"{kind}: the two tables give nearly the same output ({sep:.1e}); test is blind"
        assert max_rel(ours, wrong) > 100 * TOL


def _rope_ref(v: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE of the trailing 2*len(inv_freq) channels (DESIGN §3), float64."""
    r = 2 * inv_freq.numel()
    ang = pos.double()[:, None] * inv_freq.double()[None, :]
    a, b = v[..., -r::2], v[..., -r + 1::2]
    rot = torch.stack((a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()), -1).flatten(-2)
    return torch.cat((v[..., :-r], rot), -1)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_compressed_entries_carry_rope_at_window_start(kind):
    """The stored compressed entries (and CSA indexer keys) are RoPE'd at their window's first token."""
    cfg, w, x = _tiny(kind)[:3]
    layer = LAYERS[kind]
    m = cfg.compress_ratios[layer]
    S = 70
    w64 = {k: v.double() for k, v in w.items()}
    blk = make_block(cfg, layer, w)
    mgr = KVCacheManager(cfg, max_requests=1, num_blocks=16, kv_format="fp32", indexer_format="fp32",
                         tokens_per_block=32)
    mgr.add_request("a")
    batch = mgr.prepare_forward({"a": S})
    handle = mgr.acquire(layer, batch)
    with torch.no_grad():
        blk(x[:S], batch, handle)
    stored, valid = handle.gather_all_compressed_kv()
    n = S // m
    assert stored.shape[1] == n and valid[0].all()
    inv = hfo.hf_rotary(cfg).compress_inv_freq.double()
    make = dense_mod._csa_entries if kind == "csa" else dense_mod._hca_entries
    pre = "compressor."
    checks = [("entries", stored[0], pre, cfg.head_dim)]
    if kind == "csa":
        keys, _ = handle.gather_all_indexer_keys()
        checks.append(("indexer keys", keys[0], pre + "indexer.", cfg.indexer_head_dim))
    for what, got, p, dim in checks:
        plain = make(x[:S].double(), w64[p + "kv_proj.weight"], w64[p + "gate_proj.weight"], w64[p + "position_bias"],
                     w64[p + "kv_norm.weight"], m, torch.zeros_like(inv), cfg.rms_norm_eps)  # no RoPE
        assert plain.shape == (n, dim)
        start = torch.arange(n) * m
        want = _rope_ref(plain, start, inv)
        e = max_rel(got, want)
        assert e <= 1e-5, f"{kind} {what}: {e:.2e} from RoPE at w*m"
        assert max_rel(got, plain) > 1e-2, f"{kind} {what}: stored without RoPE"
        assert max_rel(got, _rope_ref(plain, start + m - 1, inv)) > 1e-3, (
            f"{kind} {what}: RoPE at the window's last token")


@pytest.mark.parametrize("kind,chunks", [("csa", [3, 5, 2]), ("csa", [3, 5, 2, 9, 13]),
                                          ("hca", [3, 5, 2, 9, 13]), ("hca", [5, 6, 7, 6, 8])])
def test_compressor_window_straddles_chunks(kind, chunks):
    """A compressor window split over several forwards (CSA m = 4: 3+5+2; HCA m' = 16)."""
    cfg, w, x = _tiny(kind)[:3]
    layer = LAYERS[kind]
    S = sum(chunks)
    xs = x[:S]
    ours = run_dsv4(cfg, layer, w, {"a": xs}, chunked("a", chunks))["a"]
    e_hf = max_rel(ours, hfo.run_hf(cfg, layer, w, xs, chunks))
    e_dense = max_rel(ours, dense_attention(cfg, layer, w, xs))
    assert e_hf <= TOL and e_dense <= TOL, (e_hf, e_dense)
