"""The lightning indexer of CSA layers: its own compressor, a scorer and top-k (DESIGN §3).

Keys K_w come from a CSA-style compressor at indexer_head_dim; queries
qI = RoPE_t((q_res W_qI).view(H_I, D_I)); weights g = (x W_w) * H_I^-1/2 (from x, not q_res).
Quantised indexer formats store keys Hadamard-rotated; queries are rotated the same way, which
leaves every score unchanged in exact arithmetic. Queries are then rounded to the keys' format
(`EntryFormat.round_query`): DeepSeek-V4's indexer QK path runs on FP4 activations on both sides
and was trained that way. fp32 keys leave queries unrounded.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from dsv4.attention.compressor import Compressor
from dsv4.cache.formats import EntryFormat
from dsv4.cache.handle import LayerCacheHandle
from dsv4.model.config import DSV4Config


class _Scorer(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.weights_proj = nn.Linear(hidden, heads, bias=False)


class Indexer(Compressor):
    """Parameters named as transformers' DeepseekV4Indexer (compressor weights + q_b_proj + scorer)."""

    def __init__(self, cfg: DSV4Config):
        super().__init__(cfg.hidden_size, cfg.indexer_head_dim, cfg.csa_compression_ratio, overlap=True,
                         eps=cfg.rms_norm_eps)
        self.heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.indexer_head_dim, bias=False)
        self.scorer = _Scorer(cfg.hidden_size, cfg.index_n_heads)

    def queries(self, iq: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fmt: EntryFormat,
                ops: types.SimpleNamespace, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Queries [T, H_I, D_I] (fp32 unless asked) in the keys' stored basis from iq = q_b_proj(q_res)
        [T, H_I*D_I] (the layer computes it with its own q_b_proj in one GEMM); cos/sin [T, r/2] of the tokens."""
        q = iq.view(iq.shape[0], self.heads, self.dim)
        # the stored basis (Hadamard-rotated E2M1 / fp8 keys), then rounded as the keys are (DeepSeek-V4
        # scores FP4 queries against FP4 keys), in the same kernel as the rotation
        return ops.norm_rope(q, None, 0.0, cos, sin, normalize=False, out_dtype=out_dtype, hadamard=fmt.hadamard,
                             round_to=fmt.name)

    @property
    def weight_scale(self) -> float:
        """g = weights_proj(x) * H_I^-1/2: the factor (decode passes it to the scorer with the raw
        projection, which the kernel reads in place)."""
        return self.heads ** -0.5

    def weights(self, w: torch.Tensor) -> torch.Tensor:
        """g = weights_proj(x) * H_I^-1/2 [T, H_I] fp32, from w = weights_proj(x)."""
        return w.float() * self.weight_scale

    def select(self, iq: torch.Tensor, w: torch.Tensor, cache: LayerCacheHandle, cos: torch.Tensor,
               sin: torch.Tensor, ops: types.SimpleNamespace) -> torch.Tensor:
        """Top-k entries per query token, after this step's keys were flushed.

        Args:
            iq: [T, H_I*D_I] q_b_proj(q_res); w: [T, H_I] weights_proj(x); cos/sin: [T, r/2] of the tokens.
        Returns:
            [T, index_topk] int64 entry indices, -1 = nothing selected.
        """
        b, pool, sch = cache.batch, cache.paged, cache.schema
        # queries rounded to mxfp4 (E2M1 times a power of two) are bf16-exact: half the bytes the scan reads
        q_dtype = torch.bfloat16 if sch.indexer_format.name == "mxfp4" else torch.float32
        q, g = self.queries(iq, cos, sin, sch.indexer_format, ops, q_dtype), self.weights(w)
        n_entries = tuple(s // self.ratio for s in b.seq_lens_host)
        return ops.prefill_indexer_topk(q, g, pool.indexer, sch.indexer_format, b.block_table, b.token_request,
                                        b.positions, b.query_lens_host, n_entries, self.ratio, self.topk,
                                        sch.entries_per_block)
