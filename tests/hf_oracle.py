"""The Hugging Face oracle (DESIGN §8): transformers' `DeepseekV4Attention`, fp32, on CPU.

One attention layer of a `DSV4Config`, driven standalone with its own `DynamicCache`, for ONE
request starting at position 0. Tests use it as the numerical ground truth:

    w   = random_attention_weights(cfg, layer_idx, seed=0)   # HF state-dict key names, fp32
    out = run_hf(cfg, layer_idx, w, x, chunks=[S])           # x: [S, hidden] -> [S, hidden]
    out = run_hf(cfg, layer_idx, w, x, chunks=[S - 3, 1, 1, 1])   # prefill, then 3 decode steps
    out, topk = run_hf(cfg, layer_idx, w, x, [S], return_topk=True)   # CSA: [S, index_topk], -1 padded

What we found about HF's masks (transformers 5.23.0), and why `run_hf` always hands a tensor:

* `DeepseekV4Attention.forward` only applies the compressor's `block_bias` (CSA: the indexer's
  top-k selection plus causality; HCA: causality) when `attention_mask` is a tensor. With
  `attention_mask=None` every compressed entry in the cache is attended to: a CSA query would see
  all entries instead of its top-k, and a prefill query would also see entries of windows that
  close after it.
* With `attn_implementation="eager"`, `create_sliding_window_causal_mask` always returns a float
  tensor (0 / finfo.min), decode (one query) included: `eager_mask` calls `sdpa_mask` with
  `allow_is_causal_skip=False`. So the eager oracle is right as HF ships it. With "sdpa" it
  returns None for a prefill from an empty cache and for a decode step while the window is not
  full (and a bool tensor otherwise, which the float `block_bias` concatenation does not expect).
  `run_hf` therefore builds the same sliding-window mask itself whenever the HF function does not
  give a float tensor, so the oracle stays right whatever the mask backend does.
* HCA's `block_bias` is None when a forward has one query; HF then zero-pads the mask, i.e. the
  query sees every compressed entry. That is correct: at decode every entry already produced has
  w < floor((t+1)/m').
"""

from __future__ import annotations

import hashlib
import math

import torch
import transformers
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention,
    DeepseekV4RotaryEmbedding,
)

from dsv4 import DSV4Config
from dsv4.model.hf_config import quiet_transformers, to_hf_config

__all__ = [
    "HF_LAYER_TYPES",
    "hf_attention",
    "hf_config",
    "hf_rotary",
    "random_attention_weights",
    "rel_err",
    "run_hf",
    "run_hf_topk",
]

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HF_LAYER_TYPES = (SWA, CSA, HCA)


def _layer_type(cfg: DSV4Config, layer_idx: int) -> str:
    r = cfg.compress_ratios[layer_idx]
    if r == 0:
        return SWA
    return CSA if r == cfg.csa_compression_ratio else HCA


_quiet_transformers = quiet_transformers


def hf_config(cfg: DSV4Config, attn_implementation: str = "eager") -> transformers.DeepseekV4Config:
    """A `transformers.DeepseekV4Config` whose attention is exactly `cfg`'s (`dsv4.model.hf_config`),
    checked here: rope dims and the compress table's YaRN are what the oracle relies on."""
    hc = to_hf_config(cfg, attn_implementation)
    assert hc.qk_rope_head_dim == cfg.rope_dim, (hc.qk_rope_head_dim, cfg.rope_dim)
    assert hc.rope_parameters["compress"]["rope_type"] == ("yarn" if cfg.yarn_factor > 1.0 else "default")
    assert hc.layer_types == [_layer_type(cfg, i) for i in range(cfg.num_hidden_layers)]
    return hc


def hf_rotary(cfg: DSV4Config) -> DeepseekV4RotaryEmbedding:
    """HF's rotary module for `cfg` (buffers `main_inv_freq`, `compress_inv_freq`, [rope_dim/2])."""
    with _quiet_transformers():
        return DeepseekV4RotaryEmbedding(hf_config(cfg))


# ------------------------------------------------------------------------------------------ weights
def _weight_shapes(cfg: DSV4Config, layer_idx: int) -> dict[str, tuple[int, ...]]:
    d, H, D, Rq = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, Ro = cfg.o_groups, cfg.o_lora_rank
    shapes: dict[str, tuple[int, ...]] = {
        "sinks": (H,),
        "q_a_proj.weight": (Rq, d),
        "q_a_norm.weight": (Rq,),
        "q_b_proj.weight": (H * D, Rq),
        "kv_proj.weight": (D, d),
        "kv_norm.weight": (D,),
        "o_a_proj.weight": (G * Ro, H * D // G),
        "o_b_proj.weight": (d, G * Ro),
    }
    kind = _layer_type(cfg, layer_idx)
    if kind == HCA:
        m = cfg.hca_compression_ratio
        shapes.update({
            "compressor.kv_proj.weight": (D, d),
            "compressor.gate_proj.weight": (D, d),
            "compressor.position_bias": (m, D),
            "compressor.kv_norm.weight": (D,),
        })
    elif kind == CSA:
        m, nI, DI = cfg.csa_compression_ratio, cfg.index_n_heads, cfg.indexer_head_dim
        shapes.update({
            "compressor.kv_proj.weight": (2 * D, d),
            "compressor.gate_proj.weight": (2 * D, d),
            "compressor.position_bias": (m, 2 * D),
            "compressor.kv_norm.weight": (D,),
            "compressor.indexer.kv_proj.weight": (2 * DI, d),
            "compressor.indexer.gate_proj.weight": (2 * DI, d),
            "compressor.indexer.position_bias": (m, 2 * DI),
            "compressor.indexer.kv_norm.weight": (DI,),
            "compressor.indexer.q_b_proj.weight": (nI * DI, Rq),
            "compressor.indexer.scorer.weights_proj.weight": (nI, d),
        })
    return shapes


def random_attention_weights(cfg: DSV4Config, layer_idx: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A full random state dict for layer `layer_idx`, in `DeepseekV4Attention.state_dict()` key names, fp32.

    Scales keep everything O(1) for x ~ N(0, 1) inputs and the softmaxes away from one-hot or uniform:
    projections ~ N(0, 1/fan_in); norm weights ~ U(0.7, 1.3); sinks ~ N(0, 1); position_bias ~ N(0, 0.5²)
    (HF initialises sinks / position_bias to zero and norms to one, which would hide bugs in them).
    Deterministic in (cfg shapes, layer_idx, seed).
    """
    digest = hashlib.sha256(f"dsv4-attn/{layer_idx}/{seed}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    out: dict[str, torch.Tensor] = {}
    for name, shape in _weight_shapes(cfg, layer_idx).items():
        if name.endswith("norm.weight"):
            t = 0.7 + 0.6 * torch.rand(shape, generator=g)
        elif name == "sinks":
            t = torch.randn(shape, generator=g)
        elif name.endswith("position_bias"):
            t = 0.5 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
        out[name] = t.to(torch.float32).contiguous()
    return out


def hf_attention(cfg: DSV4Config, layer_idx: int, weights: dict[str, torch.Tensor]) -> DeepseekV4Attention:
    """transformers' `DeepseekV4Attention` for `layer_idx`, fp32, eval mode, with `weights` loaded (strict)."""
    with _quiet_transformers():
        attn = DeepseekV4Attention(hf_config(cfg), layer_idx)
    missing, unexpected = attn.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    assert not missing and not unexpected
    return attn.float().eval()


# ------------------------------------------------------------------------------------------ running
def _sliding_mask(cache: DynamicCache, layer_idx: int, pid: torch.Tensor, window: int) -> torch.Tensor:
    """The sliding-window causal mask HF's eager path builds, [1, 1, q, kv] float 0 / -inf.

    Key j of the keys the cache layer will return (cached tail + this chunk) sits at position
    kv_offset + j; query t sees key s iff t - W < s <= t.
    """
    q_len = pid.shape[-1]
    kv_len, kv_offset = cache.layers[layer_idx].get_mask_sizes(q_len)
    s = torch.arange(kv_len) + kv_offset
    t = pid.reshape(-1, 1)
    ok = (s[None, :] <= t) & (s[None, :] > t - window)
    mask = torch.zeros(q_len, kv_len).masked_fill(~ok, float("-inf"))
    return mask[None, None]


def run_hf(
    cfg: DSV4Config,
    layer_idx: int,
    weights: dict[str, torch.Tensor],
    x: torch.Tensor,
    chunks: list[int] | None = None,
    *,
    return_topk: bool = False,
    attn: DeepseekV4Attention | None = None,
    mask: str = "hf",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
    """Run HF's attention layer over one request, chunk by chunk, with its own `DynamicCache`.

    x: [S, hidden] (any float dtype; run in fp32), the layer's normed input for positions 0..S-1.
    chunks: lengths of the successive forwards, summing to S (default [S]: one-shot prefill);
      e.g. [S - 3, 1, 1, 1] is a prefill followed by three decode steps.
    return_topk: also return the CSA indexer's selection per query, [S, index_topk] int64 in HF's
      order (best first), -1 where fewer than index_topk entries were visible; None for SWA / HCA.
    attn: a prebuilt `hf_attention(cfg, layer_idx, weights)` to reuse (its weights win).
    mask: "hf" (default): HF's `create_sliding_window_causal_mask`, replaced by our own sliding-window
      mask if it ever is not a float tensor; "own": always our own; "none": pass attention_mask=None,
      which reproduces HF's unmasked behaviour (wrong for CSA / HCA: only for tests that document it).
    Returns out [S, hidden] fp32 (and the top-k tensor when asked).
    """
    if x.dim() != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"x must be [S, {cfg.hidden_size}], got {tuple(x.shape)}")
    S = x.shape[0]
    chunks = [S] if chunks is None else list(chunks)
    if sum(chunks) != S or any(c <= 0 for c in chunks):
        raise ValueError(f"chunks {chunks} must be positive and sum to S={S}")
    if mask not in ("hf", "own", "none"):
        raise ValueError(f"mask must be 'hf', 'own' or 'none', not {mask!r}")
    hc = hf_config(cfg)
    if attn is None:
        attn = hf_attention(cfg, layer_idx, weights)
    rot = hf_rotary(cfg)
    with _quiet_transformers():
        cache = DynamicCache(config=hc)
    kind = _layer_type(cfg, layer_idx)

    picks: list[torch.Tensor] = []
    hook = None
    if return_topk and kind == CSA:
        def _grab(_mod, _inp, out):
            picks.append(out[0].detach().clone())  # [q, min(index_topk, entries so far)]
        hook = attn.compressor.indexer.register_forward_hook(_grab)

    outs = []
    start = 0
    try:
        with torch.no_grad():
            for n in chunks:
                xc = x[start:start + n].to(torch.float32)[None]  # [1, n, hidden]
                pid = torch.arange(start, start + n)[None]
                if mask == "none":
                    am = None
                elif mask == "own":
                    am = _sliding_mask(cache, layer_idx, pid, cfg.sliding_window)
                else:
                    am = create_sliding_window_causal_mask(
                        config=hc, inputs_embeds=xc, attention_mask=None, past_key_values=cache,
                        position_ids=pid, layer_idx=layer_idx)
                    if not (isinstance(am, torch.Tensor) and am.is_floating_point()):
                        # Not reached with eager (see the module docstring); a None here would make HF
                        # drop CSA's top-k / causal block_bias and attend to every compressed entry.
                        am = _sliding_mask(cache, layer_idx, pid, cfg.sliding_window)
                pe = {
                    "main": rot(xc, position_ids=pid, layer_type="main"),
                    "compress": rot(xc, position_ids=pid, layer_type="compress"),
                }
                out, _ = attn(xc, position_embeddings=pe, position_ids=pid, attention_mask=am,
                              past_key_values=cache)
                outs.append(out[0])
                start += n
    finally:
        if hook is not None:
            hook.remove()
    result = torch.cat(outs, dim=0)
    if not return_topk:
        return result
    if kind != CSA:
        return result, None
    topk = torch.full((S, cfg.index_topk), -1, dtype=torch.int64)
    row = 0
    for p in picks:
        topk[row:row + p.shape[0], :p.shape[1]] = p
        row += p.shape[0]
    assert row == S
    return result, topk


def run_hf_topk(cfg: DSV4Config, layer_idx: int, weights: dict[str, torch.Tensor], x: torch.Tensor,
                chunks: list[int] | None = None) -> torch.Tensor:
    """The CSA indexer's selected entries per query, [S, index_topk] int64, -1 padded (HF order)."""
    _, topk = run_hf(cfg, layer_idx, weights, x, chunks, return_topk=True)
    if topk is None:
        raise ValueError(f"layer {layer_idx} is not a CSA layer")
    return topk


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
