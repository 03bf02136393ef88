"""transformers' `DeepseekV4Attention` (bf16, eager, `DynamicCache`) as the outside baseline.

The layer gets the very same weights as our `AttentionSubBlock` (the parameter names match).
For a decode step at context C its `DynamicCache` layer is synthesised directly, as a (C-1)-token
prefill would leave it (transformers 5.23 `DeepseekV4CSACache` / `DeepseekV4HCACache`):

    keys = values        [B, 1, min(C-1, W-1), D]   the sliding window (K = V)
    cumulative_length    C - 1
    compressed_kv[name]  [B, (C-1)//m, dim]          "compressor" (D) and, CSA, "indexer" (D_I)
    entry_count[name]    (C-1)//m
    buffer_kv / _gate    [B, (C-1) % m, width]       tokens of the open window (width 2·dim CSA)
    overlap_kv / _gate   [B, m, dim]                 CSA: the last closed window's first halves

Each timed call restores those references first (transformers grows its tensors by
concatenation and never writes them in place, so every call starts from the same state).
The attention mask is built once outside the timing, as the model does once per forward for
all layers: an eager float mask over the window (0 = visible, finfo.min = hidden).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dsv4.attention import AttentionSubBlock
from dsv4.model.config import DSV4Config
from dsv4.model.hf_config import CSA, quiet_transformers, to_hf_config

_STATE = ("keys", "values", "cumulative_length", "buffer_kv", "buffer_gate", "compressed_kv", "entry_count",
          "overlap_kv", "overlap_gate")


def import_hf() -> Any:
    """The transformers modeling module of DeepSeek-V4 (raises ImportError saying what is missing)."""
    import transformers
    try:
        from transformers.models.deepseek_v4 import modeling_deepseek_v4
    except ImportError as e:
        raise ImportError(f"transformers {transformers.__version__} has no DeepSeek-V4 model "
                          f"({e}); install transformers==5.23.0") from None
    return modeling_deepseek_v4


_quiet = quiet_transformers


def hf_config(cfg: DSV4Config) -> Any:
    """A `transformers.DeepseekV4Config` whose attention is `cfg`'s (eager attention)."""
    return to_hf_config(cfg, "eager")


class HFLayer:
    """One transformers attention layer with `blk`'s weights, parameters bf16 (rotary tables fp32)."""

    def __init__(self, cfg: DSV4Config, blk: AttentionSubBlock):
        mod = import_hf()
        self.mod, self.cfg, self.layer_idx = mod, cfg, blk.layer_idx
        self.hc = hf_config(cfg)
        dev = blk.q_a_proj.weight.device
        with _quiet():
            attn = mod.DeepseekV4Attention(self.hc, blk.layer_idx)
            self.rotary = mod.DeepseekV4RotaryEmbedding(self.hc).to(dev)
        attn = attn.to(dev)
        for p in attn.parameters():          # parameters only: HF keeps its inv_freq buffers in fp32
            p.data = p.data.to(torch.bfloat16)
        attn.load_state_dict(blk.state_dict(), strict=True)
        self.attn = attn.eval().requires_grad_(False)
        self.csa = self.hc.layer_types[blk.layer_idx] == CSA

    def _pe(self, x: torch.Tensor, pid: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {k: self.rotary(x, position_ids=pid, layer_type=k) for k in ("main", "compress")}

    def _mask(self, q_pos: torch.Tensor, kv_offset: int, kv_len: int, batch: int) -> torch.Tensor:
        """[batch, 1, q, kv_len] bf16: key j (position kv_offset + j) visible to query t iff t-W < s <= t."""
        s = torch.arange(kv_len, device=q_pos.device) + kv_offset
        t = q_pos[:, None]
        ok = (s[None, :] <= t) & (s[None, :] > t - self.cfg.sliding_window)
        m = torch.zeros(ok.shape, dtype=torch.bfloat16, device=q_pos.device)
        m = m.masked_fill(~ok, torch.finfo(torch.bfloat16).min)
        return m[None, None].expand(batch, 1, -1, -1)

    # ------------------------------------------------------------------ decode
    def decode_step(self, x: torch.Tensor, context: int, seed: int = 0) -> Callable[[], Any]:
        """A closure running one decode step at position context - 1 over a synthesised cache.

        Args:
            x: [B, hidden] bf16, the step's layer input (one token per request).
        """
        b, dev = x.shape[0], x.device
        t = context - 1
        from transformers.cache_utils import DynamicCache

        with _quiet():
            cache = DynamicCache(config=self.hc)
        lay = cache.layers[self.layer_idx]
        gen = torch.Generator(device=dev).manual_seed(seed)

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=dev, generator=gen).to(torch.bfloat16)

        w, d = self.cfg.sliding_window, self.cfg.head_dim
        win = min(t, w - 1)
        keys = rnd(b, 1, win, d)
        lay.lazy_initialization(keys, keys)
        lay.keys = lay.values = keys
        lay.cumulative_length = t
        m = lay.compress_rate
        comps = [("compressor", d)] + ([("indexer", self.cfg.indexer_head_dim)] if self.csa else [])
        for name, dim in comps:
            width = 2 * dim if self.csa else dim
            lay.compressed_kv[name] = rnd(b, t // m, dim)
            lay.entry_count[name] = t // m
            lay.buffer_kv[name], lay.buffer_gate[name] = rnd(b, t % m, width), rnd(b, t % m, width)
            if self.csa:
                closed = t // m > 0
                lay.overlap_kv[name] = rnd(b, m, dim) if closed else None
                lay.overlap_gate[name] = rnd(b, m, dim) if closed else None
        snap = {a: (dict(v) if isinstance(v, dict) else v) for a in _STATE if hasattr(lay, a)
                for v in [getattr(lay, a)]}

        xh = x.view(b, 1, -1)
        pid = torch.full((b, 1), t, dtype=torch.long, device=dev)
        pe = self._pe(xh, pid)
        mask = self._mask(pid[0], t - win, win + 1, b)

        def step() -> Any:
            for a, v in snap.items():
                setattr(lay, a, dict(v) if isinstance(v, dict) else v)
            return self.attn(xh, position_embeddings=pe, position_ids=pid, attention_mask=mask,
                             past_key_values=cache)[0]

        return step

    # ------------------------------------------------------------------ prefill
    def prefill_run(self, x: torch.Tensor, chunks: list[int]) -> Callable[[Callable[[Callable[[], Any]], None]], None]:
        """A `Timer.time_regions` run: a fresh DynamicCache, then one forward per chunk of x [T, hidden]."""
        from transformers.cache_utils import DynamicCache

        w = self.cfg.sliding_window

        def run(region: Callable[[Callable[[], Any]], None]) -> None:
            with _quiet():
                cache = DynamicCache(config=self.hc)
            t0 = 0
            for n in chunks:
                xc = x[t0:t0 + n][None]
                pid = torch.arange(t0, t0 + n, device=x.device)[None]
                cached = min(t0, w - 1)
                pe, mask = self._pe(xc, pid), self._mask(pid[0], t0 - cached, cached + n, 1)

                def fwd(xc=xc, pid=pid, pe=pe, mask=mask) -> None:
                    self.attn(xc, position_embeddings=pe, position_ids=pid, attention_mask=mask,
                              past_key_values=cache)

                region(fwd)
                del mask
                t0 += n

        return run
