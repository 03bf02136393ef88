"""The embedded default model of `dsv4 run`: a tiny random-weight DeepSeek-V4, made on the fly.

It keeps the real attention geometry (head_dim 512 = 448 nope + 64 RoPE, window 128, CSA m = 4,
HCA m' = 128, YaRN compress rope, 1M positions) and all three layer types, but a tiny hidden size,
vocabulary and MoE, so a CPU serves a few thousand tokens in seconds:

    layer     0     1     2     3
    type      SWA   CSA   HCA   CSA          compress_ratios [0, 4, 128, 4]
    MoE       hash  hash  hash  top-k        (transformers' default: the first 3 layers hash-routed)

transformers initialises sinks / position_bias to 0, norms to 1, mHC biases to 0 and the hash
table `tid2eid` to 0 (every token on expert 0); `randomize_` draws every parameter and buffer
instead, at scales that keep activations O(1) and the logits spread (greedy decoding is then not a
constant token). Deterministic in `seed`.
"""

from __future__ import annotations

import hashlib
import math
import random

import torch
import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

DEFAULT_SEED = 0

#: The built-in prompt lengths of `dsv4 run` (tokens): mixed, two past 1,000 tokens.
DEFAULT_PROMPT_LENGTHS = (1200, 1030, 520, 260, 129, 64, 17, 3)


def default_config(**overrides) -> DeepseekV4Config:
    """transformers config of the embedded model; keyword arguments override fields."""
    fields = {
        "vocab_size": 512, "hidden_size": 64, "moe_intermediate_size": 64, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32,
        "compress_ratios": [0, 4, 128, 4], "sliding_window": 128, "index_n_heads": 16, "index_head_dim": 128,
        "index_topk": 16, "max_position_embeddings": 1048576, "bos_token_id": 0, "eos_token_id": 1,
        "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                            "beta_fast": 32.0, "beta_slow": 1.0},
        # eager: transformers then always builds a float mask, so its CSA top-k / causal block_bias applies
        "attn_implementation": "eager",
    } | overrides
    old = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # small models: HF warns about the YaRN factor
    try:
        return DeepseekV4Config(**fields)
    finally:
        transformers.logging.set_verbosity(old)


def build_default_model(seed: int = DEFAULT_SEED, dtype: torch.dtype = torch.float32,
                        **overrides) -> DeepseekV4ForCausalLM:
    """The embedded default model (eval mode, randomised by `randomize_(model, seed)`)."""
    cfg = default_config(**overrides)
    with torch.random.fork_rng(devices=[]):  # HF's own init draws from the global RNG: leave it as it was
        torch.manual_seed(seed)
        model = DeepseekV4ForCausalLM(cfg)
    randomize_(model, seed)
    model.generation_config.pad_token_id = cfg.eos_token_id  # quiets generate()'s pad warning
    return model.to(dtype).eval()


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"dsv4-default/{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


@torch.no_grad()
def randomize_(model: DeepseekV4ForCausalLM, seed: int = DEFAULT_SEED) -> None:
    """Draw every parameter and persistent buffer of `model` (in place), one generator per name.

    Projections ~ N(0, 1/fan_in); the embedding ~ N(0, 1); lm_head ~ N(0, 4/fan_in) (logits std ~2);
    norm weights ~ U(0.7, 1.3); sinks ~ N(0, 1); position_bias ~ N(0, 0.5^2); mHC `base` ~ N(0, 0.5^2),
    `scale` ~ U(0.5, 1.5); router correction bias ~ N(0, 0.1^2); `tid2eid` = distinct random experts.
    """
    n_experts = model.config.n_routed_experts
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        leaf = name.rsplit(".", 1)[-1]
        g = _generator(seed, name)
        if leaf == "tid2eid":
            picks = torch.rand(t.shape[0], n_experts, generator=g).argsort(dim=-1)[:, :t.shape[1]]
            t.copy_(picks)
        elif "inv_freq" in leaf:
            continue  # rotary tables: not weights
        elif name.endswith(("norm.weight", "layernorm.weight")):
            t.copy_(0.7 + 0.6 * torch.rand(t.shape, generator=g))
        elif leaf in ("sinks",):
            t.copy_(torch.randn(t.shape, generator=g))
        elif leaf == "position_bias" or leaf in ("base", "hc_base"):
            t.copy_(0.5 * torch.randn(t.shape, generator=g))
        elif leaf in ("scale", "hc_scale"):
            t.copy_(0.5 + torch.rand(t.shape, generator=g))
        elif leaf == "e_score_correction_bias":
            t.copy_(0.1 * torch.randn(t.shape, generator=g))
        elif name == "model.embed_tokens.weight":
            t.copy_(torch.randn(t.shape, generator=g))
        elif t.dim() >= 2:
            fan_in = t.shape[-1]
            gain = 2.0 if name == "lm_head.weight" else 1.0
            t.copy_(gain * torch.randn(t.shape, generator=g) / math.sqrt(fan_in))
        else:  # pragma: no cover - every 1-D tensor of the model is named above
            raise AssertionError(f"randomize_: no rule for {name} {tuple(t.shape)}")


def default_prompts(vocab_size: int, lengths: tuple[int, ...] = DEFAULT_PROMPT_LENGTHS,
                    seed: int = DEFAULT_SEED) -> list[list[int]]:
    """Built-in prompts: token ids drawn uniformly from [2, vocab_size) (0 = BOS, 1 = EOS), one per length."""
    rng = random.Random(f"dsv4-prompts/{seed}")
    return [[rng.randrange(2, vocab_size) for _ in range(n)] for n in lengths]
