"""ModelRunner: transformers' DeepSeek-V4 with its attention replaced by `AttentionSubBlock`.

`patch_attention` swaps every `layer.self_attn` (transformers' `DeepseekV4Attention`) for a
`PagedSelfAttention` holding an `AttentionSubBlock` with the same weights; the HF module is dropped,
so no second copy of the attention weights stays alive. Everything else (embedding, mHC
hyper-connections, hash / top-k MoE, final norm, head) is transformers' own code, called layer by
layer on the packed tokens of a whole batch as one [1, T] sequence:

    ids [T] --embed--> [1, T, d] --expand--> streams [1, T, hc, d]
    per layer: DeepseekV4DecoderLayer.forward(streams, input_ids=ids[None], batch=, cache=)
               (attn_hc -> input_layernorm -> PagedSelfAttention -> ffn_hc -> MoE, all per token)
    rows of the requests' last tokens --hc_head, norm, lm_head--> logits [B', vocab]

No dense attention mask is built: only the attention mixes tokens, and it reads the paged cache
through the step's `ForwardBatch`.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from dsv4.attention.sub_block import AttentionSubBlock
from dsv4.cache.batch import ForwardBatch
from dsv4.cache.manager import KVCacheManager
from dsv4.errors import CheckpointError
from dsv4.model.config import DSV4Config
from dsv4.model.fp8_weights import BlockFP8Linear

# Above this, a decode graph's expert gather costs more than the launches it saves.
_MAX_EXPERT_GATHER_BYTES = 1 << 30


class _experts:
    """Temporarily run every transformers experts module with another implementation."""

    def __init__(self, implementation: str, model: nn.Module):
        self.impl = implementation
        self.configs = {id(m.config): m.config for m in model.modules()
                        if hasattr(m, "config") and hasattr(m, "has_gate")}.values()

    def __enter__(self) -> None:
        self.saved = [c._experts_implementation for c in self.configs]
        for c in self.configs:
            c._experts_implementation = self.impl

    def __exit__(self, *exc) -> None:
        for c, v in zip(self.configs, self.saved):
            c._experts_implementation = v


class PagedSelfAttention(nn.Module):
    """Stands in for `DeepseekV4Attention` inside a `DeepseekV4DecoderLayer`."""

    def __init__(self, block: AttentionSubBlock):
        super().__init__()
        self.block = block

    def forward(self, hidden_states: torch.Tensor, *, batch: ForwardBatch, cache, **_) -> tuple[torch.Tensor, None]:
        """hidden_states [1, T, d] (the layer's normed input, packed) -> ([1, T, d], None), like HF's module."""
        return self.block(hidden_states[0], batch, cache)[None], None


def patch_attention(model: nn.Module, cfg: DSV4Config, dtype: torch.dtype) -> list[AttentionSubBlock]:
    """Replace each decoder layer's `self_attn` by a `PagedSelfAttention` (in place).

    The sub-block is built on the HF module's device, loads its state dict (strict), is cast to `dtype`,
    and the HF module is released. Returns the sub-blocks, one per layer.
    """
    check_patchable(model, cfg)
    blocks = []
    for i, layer in enumerate(model.model.layers):
        old = layer.self_attn
        device = next(old.parameters()).device
        with torch.device(device):
            block = AttentionSubBlock(cfg, i)
        block.load_hf_state_dict(old.state_dict())
        block.to(dtype)
        layer.self_attn = PagedSelfAttention(block)  # drops the last reference to the HF module
        blocks.append(block)
    return blocks


def weights_label(blocks: list[AttentionSubBlock]) -> str:
    """How the attention projections are held: "dense" or "fp8 blocks (n of m projections)"."""
    mods = [m for b in blocks for m in b.modules() if isinstance(m, nn.Linear | BlockFP8Linear)]
    fp8 = sum(isinstance(m, BlockFP8Linear) for m in mods)
    return "dense" if not fp8 else f"fp8 blocks ({fp8} of {len(mods)} projections)"


def check_patchable(model: nn.Module, cfg: DSV4Config) -> None:
    """Refuse (before anything changes) a model whose layers do not match `cfg` or that is already patched."""
    layers = model.model.layers
    if len(layers) != cfg.num_hidden_layers:
        raise CheckpointError(f"the model has {len(layers)} decoder layers but its config says "
                              f"{cfg.num_hidden_layers}; re-save the checkpoint")
    if any(isinstance(layer.self_attn, PagedSelfAttention) for layer in layers):
        raise CheckpointError("this model's attention is already patched by another Engine; "
                              "give each Engine its own model")


def _rms_norm_pinned(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers 5.23's `DeepseekV4RMSNorm.forward`: the fp32 weight times the fp32 normalised input,
    cast once to the input's dtype."""
    dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (self.weight * h).to(dtype)


def match_pinned_norms(model: nn.Module) -> int:
    """Give the model's RMSNorms the pinned transformers' output dtype; returns how many were changed.

    Releases before 5.23 cast the normalised input to its dtype first and multiply by the norm's fp32
    weight after, so a bf16 model's norms return fp32 and its MoE router (a bf16 linear) refuses
    them. A norm that does so on a probe gets 5.23's forward (one rounding, at the end)."""
    norms = [m for m in model.modules() if type(m).__name__ == "DeepseekV4RMSNorm"]
    if not norms or norms[0].weight.dtype != torch.float32:
        return 0
    probe = torch.ones(1, norms[0].weight.shape[-1], dtype=torch.bfloat16, device=norms[0].weight.device)
    with torch.no_grad():
        if norms[0](probe).dtype == torch.bfloat16:
            return 0
    for m in norms:
        m.forward = types.MethodType(_rms_norm_pinned, m)
    return len(norms)


def cast_like_transformers(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast `model` to `dtype`, keeping in fp32 what transformers keeps in fp32 when it loads in `dtype`.

    (`_keep_in_fp32_modules_strict`: the mHC weights, norms, sinks, position biases, router bias.)
    """
    model.to(dtype)
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float32 or not keep:
        return
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in keep:
            module.float()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.rsplit(".", 1)[-1] in keep and t.is_floating_point():
            t.data = t.data.float()


class ModelRunner:
    """One forward step of the patched model over a `ForwardBatch` of packed tokens.

    On CUDA, all-decode steps run as CUDA graphs, one per (batch size, seq_len_bound): the first
    step of a key runs eagerly (compiles kernels, fills lazy caches), the second captures the
    step, later ones replay it. The step reads only the manager's persistent metadata buffers and
    a static token buffer, so a replay is the eager step. transformers' default expert loop syncs
    with the host (`nonzero`), so decode steps use its capturable `batched_mm` experts. A capture
    that fails turns graphs off for the runner and says why in `graph_status`.
    """

    def __init__(self, model: nn.Module, cfg: DSV4Config, manager: KVCacheManager, *, cuda_graphs: bool = True):
        self.model, self.cfg, self.manager = model, cfg, manager
        self.hc_mult = int(model.config.hc_mult)
        self.use_graphs = cuda_graphs and manager.device.type == "cuda"
        self.graph_status = "on" if self.use_graphs else ("off" if manager.device.type == "cuda" else "n/a (cpu)")
        # key -> (graph, static token ids, static logit rows, static logits); the graph reads and
        # writes exactly these tensors' memory, so the entry keeps them alive.
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._warm: set[tuple[int, int]] = set()
        self._pool = None
        self.replays = 0

    def forward(self, token_ids: torch.Tensor, batch: ForwardBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        """Args as `forward_eager`; all-decode steps that want every row's logits may replay a graph."""
        if self.use_graphs and batch.is_decode and logit_rows.numel() == batch.num_requests:
            return self._forward_graph(token_ids, batch)
        return self.forward_eager(token_ids, batch, logit_rows)

    def _expert_gather_bytes(self, tokens: int) -> int:
        """Bytes transformers' `batched_mm` experts gather per step: every (token, expert) pair copies
        that expert's weights (gate_up + down) in every MoE layer."""
        total = 0
        for m in self.model.modules():
            if hasattr(m, "has_gate") and hasattr(m, "gate_up_proj") and hasattr(m, "down_proj"):
                per_expert = (m.gate_up_proj[0].numel() + m.down_proj[0].numel()) * m.gate_up_proj.element_size()
                total = max(total, per_expert * tokens * int(self.model.config.num_experts_per_tok))
        return total

    def _forward_graph(self, token_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        key = (batch.num_requests, batch.seq_len_bound)
        gather = self._expert_gather_bytes(batch.num_requests)
        if gather > _MAX_EXPERT_GATHER_BYTES:  # real MoE sizes: capturable experts would copy GiBs per step
            self.use_graphs = False
            self.graph_status = (f"off (transformers' capturable experts would gather {gather / 2**30:.1f} GiB of "
                                 f"expert weights per step at batch {batch.num_requests}; decode runs eagerly)")
            return self.forward_eager(token_ids, batch, torch.arange(batch.num_requests, device=token_ids.device))
        rows = torch.arange(batch.num_requests, device=token_ids.device)
        with _experts("batched_mm", self.model):
            if key not in self._graphs:
                if key not in self._warm:
                    self._warm.add(key)
                    return self.forward_eager(token_ids, batch, rows)
                static_ids = token_ids.clone()
                graph = torch.cuda.CUDAGraph()
                self._pool = self._pool or torch.cuda.graph_pool_handle()
                try:
                    with torch.cuda.graph(graph, pool=self._pool):
                        out = self.forward_eager(static_ids, batch, rows)
                except RuntimeError as e:  # capture refused: run eagerly from now on, and say so
                    self.use_graphs = False
                    self.graph_status = f"off (capture failed: {str(e).splitlines()[0][:120]})"
                    return self.forward_eager(token_ids, batch, rows)
                self._graphs[key] = (graph, static_ids, rows, out)
            graph, static_ids, _, out = self._graphs[key]
            static_ids.copy_(token_ids)
            graph.replay()
        self.replays += 1
        return out.clone()

    @torch.inference_mode()
    def forward_eager(self, token_ids: torch.Tensor, batch: ForwardBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run every layer on the step's tokens; the cache of each layer is read and written on the way.

        Args:
            token_ids: [T] int64 on the manager's device, packed in batch order (as `prepare_forward`).
            batch: the step's metadata from `manager.prepare_forward`.
            logit_rows: [B'] int64, the packed rows whose next-token logits are wanted (e.g. last tokens).
        Returns:
            [B', vocab] float32 logits.
        """
        inner = self.model.model
        ids = token_ids[None]                                               # [1, T]
        x = inner.embed_tokens(ids)                                         # [1, T, d]
        h = x.unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()    # [1, T, hc, d]
        for i, layer in enumerate(inner.layers):
            h = layer(h, input_ids=ids, batch=batch, cache=self.manager.acquire(i, batch))
        h = h[:, logit_rows]                                                # [1, B', hc, d]
        h = inner.norm(inner.hc_head(h))                                    # [1, B', d]
        return self.model.lm_head(h)[0].float()
