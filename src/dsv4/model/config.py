"""DSV4Config: the architecture facts the cache and the attention need (DESIGN §2).

Build one with a preset (`DSV4Config.flash()`, `.pro()`), from a transformers config, a
`config.json` dict or a checkpoint directory (`from_hf`), or field by field for small test
models. Every field is checked at construction; an error names the field and what it must be.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from dsv4.errors import ConfigError
from dsv4.model.layer_schedule import AttentionType, LayerSpec

_HF_LAYER_TYPES = {
    "sliding_attention": 0,
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class DSV4Config:
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_topk: int
    compress_ratios: tuple[int, ...]  # per layer: 0 (SWA), csa_compression_ratio or hca_compression_ratio
    head_dim: int = 512
    rope_dim: int = 64
    sliding_window: int = 128
    csa_compression_ratio: int = 4
    hca_compression_ratio: int = 128
    index_n_heads: int = 64
    indexer_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # YaRN on the compress rope table; yarn_factor 1.0 means plain RoPE.
    yarn_factor: float = 16.0
    yarn_original_max_position: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        positive = ("num_hidden_layers", "hidden_size", "num_attention_heads", "q_lora_rank", "o_groups",
                    "o_lora_rank", "index_topk", "head_dim", "rope_dim", "sliding_window",
                    "csa_compression_ratio", "hca_compression_ratio", "index_n_heads", "indexer_head_dim",
                    "max_position_embeddings", "yarn_original_max_position")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"DSV4Config.{name} must be a positive integer, got {getattr(self, name)}")
        if len(self.compress_ratios) < self.num_hidden_layers:
            raise ConfigError(
                f"DSV4Config.compress_ratios has {len(self.compress_ratios)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}: give one ratio per layer")
        # A trailing entry (DeepSeek's MTP layer) is not a layer of this model: drop it.
        object.__setattr__(self, "compress_ratios", self.compress_ratios[: self.num_hidden_layers])
        allowed = {0, self.csa_compression_ratio, self.hca_compression_ratio}
        bad = sorted({r for r in self.compress_ratios if r not in allowed})
        if bad:
            raise ConfigError(
                f"DSV4Config.compress_ratios holds {bad}; each entry must be 0 (SWA), "
                f"csa_compression_ratio={self.csa_compression_ratio} or "
                f"hca_compression_ratio={self.hca_compression_ratio}")
        if self.csa_compression_ratio == self.hca_compression_ratio:
            raise ConfigError("DSV4Config.csa_compression_ratio and hca_compression_ratio must differ")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ConfigError(f"DSV4Config.rope_dim={self.rope_dim} must be even and at most head_dim={self.head_dim}")
        if self.rope_dim > self.indexer_head_dim:
            raise ConfigError(
                f"DSV4Config.rope_dim={self.rope_dim} must be at most indexer_head_dim={self.indexer_head_dim}")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(
                f"DSV4Config.o_groups={self.o_groups} must divide num_attention_heads={self.num_attention_heads}")
        if self.yarn_factor < 1.0:
            raise ConfigError(f"DSV4Config.yarn_factor must be >= 1 (1 = no YaRN), got {self.yarn_factor}")

    # ------------------------------------------------------------------ derived facts
    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def block_lcm(self) -> int:
        """tokens_per_block must be a multiple of this: lcm(m, m')."""
        return math.lcm(self.csa_compression_ratio, self.hca_compression_ratio)

    def layer_schedule(self) -> list[LayerSpec]:
        kinds = {0: AttentionType.SWA, self.csa_compression_ratio: AttentionType.CSA,
                 self.hca_compression_ratio: AttentionType.HCA}
        return [LayerSpec(layer_idx=i, attn=kinds[r], compress_ratio=r) for i, r in enumerate(self.compress_ratios)]

    def check_tokens_per_block(self, tokens_per_block: int) -> None:
        if tokens_per_block <= 0 or tokens_per_block % self.block_lcm:
            raise ConfigError(
                f"tokens_per_block={tokens_per_block} must be a positive multiple of "
                f"lcm(csa_compression_ratio, hca_compression_ratio) = {self.block_lcm}")

    def replace(self, **changes: Any) -> DSV4Config:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets
    @classmethod
    def flash(cls) -> DSV4Config:
        return cls(name="V4-Flash", num_hidden_layers=43, hidden_size=4096, num_attention_heads=64,
                   q_lora_rank=1024, o_groups=8, o_lora_rank=1024, index_topk=512,
                   compress_ratios=(0, 0) + (4, 128) * 20 + (4,))

    @classmethod
    def pro(cls) -> DSV4Config:
        return cls(name="V4-Pro", num_hidden_layers=61, hidden_size=7168, num_attention_heads=128,
                   q_lora_rank=1536, o_groups=16, o_lora_rank=1024, index_topk=1024,
                   compress_ratios=(128, 128) + (4, 128) * 29 + (4,))

    # ------------------------------------------------------------------ from transformers / checkpoints
    @classmethod
    def from_hf(cls, source: Any) -> DSV4Config:
        """From a transformers `DeepseekV4Config`, a `config.json` dict, or a checkpoint directory / file."""
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise ConfigError(f"no config.json at {os.fspath(source)!r}: pass a DeepSeek-V4 checkpoint directory")
            try:
                with open(path) as f:
                    d = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} is not valid JSON ({e}); re-save the checkpoint's config") from e
        elif isinstance(source, dict):
            d = dict(source)
        elif hasattr(source, "to_dict"):
            d = source.to_dict()
        else:
            raise ConfigError(f"from_hf takes a DeepseekV4Config, a dict or a path, not {type(source).__name__}")
        return cls(**_fields_from_hf_dict(d))


def _fields_from_hf_dict(d: dict[str, Any]) -> dict[str, Any]:
    model_type = d.get("model_type", "deepseek_v4")
    if model_type not in ("deepseek_v4", "deepseek_v4_flash", "deepseek_v4_pro"):
        raise ConfigError(f"model_type is {model_type!r}, not a DeepSeek-V4 config")
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads") if k not in d]
    if missing:
        raise ConfigError(f"config is missing {missing}; is this a DeepSeek-V4 config?")
    n = int(d["num_hidden_layers"])
    rates = dict(d.get("compress_rates") or {})
    csa = int(rates.get("compressed_sparse_attention", d.get("compress_rate_csa", 4)))
    hca = int(rates.get("heavily_compressed_attention", d.get("compress_rate_hca", 128)))
    if d.get("layer_types"):
        names = {"sliding_attention": 0, "compressed_sparse_attention": csa, "heavily_compressed_attention": hca}
        unknown = sorted(set(d["layer_types"]) - set(names))
        if unknown:
            raise ConfigError(f"layer_types holds {unknown}; expected one of {sorted(names)}")
        ratios = [names[t] for t in d["layer_types"]]
    elif d.get("compress_ratios") is not None:
        ratios = [int(r) for r in d["compress_ratios"]]
    else:
        # transformers' own default schedule: 2 HCA, then HCA/CSA interleaved.
        ratios = [hca] * min(n, 2) + [csa if i % 2 else hca for i in range(max(n - 2, 0))]
    head_dim = int(d.get("head_dim", 512))
    if "qk_rope_head_dim" in d:
        rope_dim = int(d["qk_rope_head_dim"])
    elif d.get("partial_rotary_factor") is not None:
        rope_dim = round(head_dim * float(d["partial_rotary_factor"]))
    else:
        rope_dim = 64
    out: dict[str, Any] = dict(
        num_hidden_layers=n, hidden_size=int(d["hidden_size"]), num_attention_heads=int(d["num_attention_heads"]),
        q_lora_rank=int(d.get("q_lora_rank", 1024)), o_groups=int(d.get("o_groups", 8)),
        o_lora_rank=int(d.get("o_lora_rank", 1024)), index_topk=int(d.get("index_topk", 512)),
        compress_ratios=tuple(ratios), head_dim=head_dim, rope_dim=rope_dim,
        sliding_window=int(d.get("sliding_window", 128)), csa_compression_ratio=csa, hca_compression_ratio=hca,
        index_n_heads=int(d.get("index_n_heads", 64)), indexer_head_dim=int(d.get("index_head_dim", 128)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(d.get("max_position_embeddings", 1048576)),
        name=str(d.get("_name_or_path") or "hf"),
    )
    rp = d.get("rope_parameters") or {}
    main = rp.get("main") if isinstance(rp.get("main"), dict) else None
    compress = rp.get("compress") if isinstance(rp.get("compress"), dict) else None
    out["rope_theta"] = float((main or {}).get("rope_theta", d.get("rope_theta", 10000.0)))
    out["compress_rope_theta"] = float((compress or {}).get("rope_theta", d.get("compress_rope_theta", 160000.0)))
    yarn = compress if compress is not None else (d.get("rope_scaling") or (rp if rp.get("rope_type") else {}))
    rope_type = (yarn or {}).get("rope_type", (yarn or {}).get("type", "default"))
    if rope_type == "yarn":
        out["yarn_factor"] = float(yarn.get("factor", 16.0))
        out["yarn_original_max_position"] = int(yarn.get("original_max_position_embeddings", 65536))
        out["yarn_beta_fast"] = float(yarn.get("beta_fast", 32.0))
        out["yarn_beta_slow"] = float(yarn.get("beta_slow", 1.0))
    elif compress is not None or "rope_parameters" in d:
        out["yarn_factor"] = 1.0  # the checkpoint asks for plain RoPE on the compress table
    return out
