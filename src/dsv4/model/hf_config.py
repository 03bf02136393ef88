"""DSV4Config -> transformers' DeepseekV4Config, with the attention fields mapped exactly.

The inverse of `DSV4Config.from_hf`. Used to build transformers' own attention (the test oracle,
the benchmark's comparison) for any dsv4 configuration. YaRN goes on the compress table only:
transformers nests a flat YaRN `rope_parameters` dict into {"main": plain RoPE, "compress": YaRN
with attention_factor 1.0}; without it transformers would use plain RoPE for the compress table.
"""

from __future__ import annotations

import contextlib
from typing import Any

from dsv4.model.config import DSV4Config

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# Non-attention fields: tiny by default (only the attention is built from such a config); override them.
_SMALL_MODEL = {"vocab_size": 64, "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "n_shared_experts": 1}


@contextlib.contextmanager
def quiet_transformers():
    """transformers warns that YaRN's factor differs from max_position / original for small test
    models, then uses the explicit factor (what we want): keep logs clean."""
    import transformers

    old = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(old)


def to_hf_config(cfg: DSV4Config, attn_implementation: str = "eager", **fields: Any):
    """A `transformers.DeepseekV4Config` whose attention is exactly `cfg`'s; `fields` set the rest."""
    import transformers

    names = {0: SWA, cfg.csa_compression_ratio: CSA, cfg.hca_compression_ratio: HCA}
    rope = None
    if cfg.yarn_factor > 1.0:
        rope = {"rope_type": "yarn", "factor": float(cfg.yarn_factor),
                "original_max_position_embeddings": int(cfg.yarn_original_max_position),
                "beta_fast": float(cfg.yarn_beta_fast), "beta_slow": float(cfg.yarn_beta_slow)}
    attention = dict(
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=1, head_dim=cfg.head_dim,
        q_lora_rank=cfg.q_lora_rank, layer_types=[names[r] for r in cfg.compress_ratios],
        compress_rates={CSA: cfg.csa_compression_ratio, HCA: cfg.hca_compression_ratio},
        partial_rotary_factor=cfg.rope_dim / cfg.head_dim, sliding_window=cfg.sliding_window,
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.indexer_head_dim, index_topk=cfg.index_topk, rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta, rope_parameters=rope,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        attn_implementation=attn_implementation)
    with quiet_transformers():
        return transformers.DeepseekV4Config(**(_SMALL_MODEL | attention | fields))
