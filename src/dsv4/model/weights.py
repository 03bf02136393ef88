"""Weight names: DeepSeek's own checkpoint names -> transformers' names (DESIGN §3)."""

from __future__ import annotations

import torch

# Longest prefixes first: the indexer's names must win over the compressor's.
_PREFIXES = (
    ("indexer.compressor.wkv.", "compressor.indexer.kv_proj."),
    ("indexer.compressor.wgate.", "compressor.indexer.gate_proj."),
    ("indexer.compressor.ape", "compressor.indexer.position_bias"),
    ("indexer.compressor.norm.", "compressor.indexer.kv_norm."),
    ("indexer.wq_b.", "compressor.indexer.q_b_proj."),
    ("indexer.weights_proj.", "compressor.indexer.scorer.weights_proj."),
    ("compressor.wkv.", "compressor.kv_proj."),
    ("compressor.wgate.", "compressor.gate_proj."),
    ("compressor.ape", "compressor.position_bias"),
    ("compressor.norm.", "compressor.kv_norm."),
    ("wq_a.", "q_a_proj."),
    ("q_norm.", "q_a_norm."),
    ("wq_b.", "q_b_proj."),
    ("wkv.", "kv_proj."),
    ("kv_norm.", "kv_norm."),
    ("wo_a.", "o_a_proj."),
    ("wo_b.", "o_b_proj."),
    ("attn_sink", "sinks"),
)


def deepseek_to_hf_name(name: str) -> str:
    """DeepSeek's name -> transformers'; an FP8 weight's `.scale` becomes `.weight_scale_inv`."""
    if name.endswith(".scale"):
        name = name.removesuffix(".scale") + ".weight_scale_inv"
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def deepseek_to_hf_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename one attention layer's DeepSeek-named weights to transformers' names."""
    return {deepseek_to_hf_name(k): v for k, v in state_dict.items()}
