"""AttentionSubBlock: one DSV4 layer's attention, reading and writing the paged cache.

    x [T, d] (packed new tokens of the batch's requests, in batch order)
      q_res = RMSNorm_w(x W_qa);  q = RoPE_t(RMSNorm_1((q_res W_qb).view(H, D)))
      kv    = RoPE_t(RMSNorm_w(x W_kv))          -> window ring
      CSA/HCA: compressor -> finished entries -> flush (CSA: with indexer keys)
      CSA: indexer top-k;  attention over window + selected (CSA) / all visible (HCA) entries
      o = RoPE_{-t}(attention) -> grouped output projection -> [T, d]

Parameter names are transformers' `DeepseekV4Attention.state_dict()` names.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from dsv4.attention.compressor import Compressor, compress_and_flush
from dsv4.attention.decode_path import decode_attend
from dsv4.attention.indexer import Indexer
from dsv4.attention.layers import FusedProjection, RMSNorm, grouped_output
from dsv4.cache.batch import ForwardBatch
from dsv4.cache.handle import LayerCacheHandle
from dsv4.errors import DeviceError, InputError
from dsv4.kernels.dispatch import ops_for
from dsv4.model.config import DSV4Config
from dsv4.model.fp8_weights import FP8_MODULES, SCALE_FORMATS, BlockFP8Linear
from dsv4.model.layer_schedule import AttentionType
from dsv4.model.rope import RopeTable
from dsv4.model.weights import deepseek_to_hf_names


class AttentionSubBlock(nn.Module):
    """One layer's attention.

    `backend` overrides the cache's kernels ("reference" or "triton"; None = the cache's choice,
    see KVCacheManager(backend=)); `decode_path=False` sends decode batches through the general
    path too (for tests).
    """

    def __init__(self, cfg: DSV4Config, layer_idx: int, *, backend: str | None = None, decode_path: bool = True):
        super().__init__()
        self.backend, self.decode_path = backend, decode_path
        self.cfg, self.layer_idx = cfg, layer_idx
        self.spec = cfg.layer_schedule()[layer_idx]
        h, d, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, d * dh, bias=False)
        self.kv_proj = nn.Linear(h, dh, bias=False)
        self.kv_norm = RMSNorm(dh, cfg.rms_norm_eps)
        self.o_a_proj = nn.Linear(d * dh // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.zeros(d))
        self.compressor: Compressor | None = None
        csa = self.spec.attn is AttentionType.CSA
        if self.spec.attn is not AttentionType.SWA:
            self.compressor = Compressor(h, dh, self.spec.compress_ratio, overlap=csa, eps=cfg.rms_norm_eps)
            if csa:
                self.compressor.indexer = Indexer(cfg)
        self.rope = RopeTable.for_layer(cfg, compressed=self.compressor is not None)
        self._fuse()

    def _fuse(self) -> None:
        """The fused projections of x and of q_res, over the current projection modules."""
        csa = self.spec.attn is AttentionType.CSA
        names, linears = ["q_a", "kv"], [self.q_a_proj, self.kv_proj]
        if self.compressor is not None:
            names += ["c", "z"]
            linears += [self.compressor.kv_proj, self.compressor.gate_proj]
            if csa:
                idx = self.compressor.indexer
                names += ["ic", "iz", "iw"]
                linears += [idx.kv_proj, idx.gate_proj, idx.scorer.weights_proj]
        self._input_names, self._inputs = names, FusedProjection(linears)
        ups = [self.q_b_proj] + ([self.compressor.indexer.q_b_proj] if csa else [])
        self._q_up_names, self._q_up = ["q", "iq"][:len(ups)], FusedProjection(ups)

    # ------------------------------------------------------------------ weights
    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load weights named as transformers' DeepseekV4Attention.state_dict() (strict).

        A projection given with a `<name>.weight_scale_inv` (an FP8 checkpoint: float8_e4m3fn codes,
        fp32 or UE8M0 scales per 128 x 128 block) is held in that format (`BlockFP8Linear`); one given
        without is held dense, in the weight's dtype as now. A refused state dict changes nothing."""
        swapped = []
        for name in self._projection_names():
            fp8 = name + ".weight_scale_inv" in state_dict
            if fp8 != isinstance(self.get_submodule(name), BlockFP8Linear):
                swapped.append((name, self.get_submodule(name)))
                self._swap(name, fp8)
        try:
            self._check_state_dict(state_dict)
        except InputError:
            for name, old in swapped:
                self.set_submodule(name, old)
            raise
        self.load_state_dict(state_dict, strict=True)
        self._fuse()

    def _check_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        own = self.state_dict()
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise InputError(f"layer {self.layer_idx} ({self.spec.attn.value}) weights do not match: "
                             f"missing {missing[:6]}, unexpected {unexpected[:6]}")
        for k, v in state_dict.items():
            if tuple(v.shape) != tuple(own[k].shape):
                raise InputError(f"weight {k}: expected shape {list(own[k].shape)}, got {list(v.shape)}")
            if own[k].dtype == torch.float8_e4m3fn and v.dtype != torch.float8_e4m3fn:
                raise InputError(f"weight {k} has a weight_scale_inv, so it must be float8_e4m3fn codes, got {v.dtype}")
            if own[k].dtype != torch.float8_e4m3fn and v.dtype == torch.float8_e4m3fn:
                raise InputError(f"weight {k} is float8_e4m3fn codes without their scales: give "
                                 f"{k.removesuffix('.weight')}.weight_scale_inv too (an FP8 checkpoint's scales)")

    def load_deepseek_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load weights named as DeepSeek's own checkpoint (wq_a, wkv, attn_sink, ...; FP8 scales `.scale`)."""
        self.load_hf_state_dict(deepseek_to_hf_names(state_dict))

    def quantize_weights(self, scale_format: str = "ue8m0", modules: tuple[str, ...] | None = None) -> None:
        """Hold `modules` (default: those of this layer that DeepSeek-V4 checkpoints ship in FP8,
        `FP8_MODULES`) as FP8 blocks, quantised from their current weights (`quantize_blocks`)."""
        known = self._projection_names()
        modules = tuple(m for m in FP8_MODULES if m in known) if modules is None else modules
        bad = [m for m in modules if m not in known]
        if bad:
            raise InputError(f"layer {self.layer_idx} ({self.spec.attn.value}) has no projection {bad[0]!r}; "
                             f"choose from {known}")
        if scale_format not in SCALE_FORMATS:
            raise InputError(f"scale_format {scale_format!r} is not one of {SCALE_FORMATS}")
        for name in modules:
            mod = self.get_submodule(name)
            if not isinstance(mod, BlockFP8Linear):
                self.set_submodule(name, BlockFP8Linear.from_linear(mod, scale_format))
        self._fuse()

    def dense_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """state_dict() with every FP8 projection dequantised to `dtype` (default: the layer's dtype) and
        no scales: what a dense layer (transformers' in bf16, the dense reference) loads."""
        dtype = dtype or self.q_a_norm.weight.dtype
        out = {}
        for k, v in self.state_dict().items():
            if k.endswith(".weight_scale_inv"):
                continue
            if v.dtype == torch.float8_e4m3fn:
                v = self.get_submodule(k.removesuffix(".weight")).dequantize(dtype)
            out[k] = v
        return out

    def _projection_names(self) -> tuple[str, ...]:
        return tuple(n for n, m in self.named_modules() if isinstance(m, nn.Linear | BlockFP8Linear))

    def _swap(self, name: str, fp8: bool) -> None:
        old = self.get_submodule(name)
        dev = old.weight.device
        if fp8:
            new = BlockFP8Linear(old.in_features, old.out_features, device=dev)
        else:
            new = nn.Linear(old.in_features, old.out_features, bias=False, device=dev,
                            dtype=self.q_a_norm.weight.dtype).requires_grad_(old.weight.requires_grad)
        self.set_submodule(name, new)

    # ------------------------------------------------------------------ forward
    def project(self, x: torch.Tensor, ops: types.SimpleNamespace | None = None,
                dense_on: torch.cuda.Stream | None = None) -> dict[str, torch.Tensor]:
        """Every projection of x in one GEMM per weight format (`ops`: an op namespace; default the
        reference's), as column views: q_a, kv; compressed layers c, z (the compressor's kv_proj /
        gate_proj); CSA ic, iz (the indexer's), iw (its weights_proj). dense_on: the dense GEMM on
        that stream where both formats are held (`FusedProjection.__call__`)."""
        return dict(zip(self._input_names, self._inputs(x, ops, dense_on=dense_on)))

    def project_names(self) -> list[str]:
        """`project`'s names, in order."""
        return list(self._input_names)

    def dense_inputs(self) -> frozenset[str]:
        """The input projections (`project`'s names) held dense; the others are FP8 blocks."""
        return frozenset(n for n, fp8 in zip(self._input_names, self._inputs.fp8_parts()) if not fp8)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCacheHandle) -> torch.Tensor:
        """x [T, d] packed in batch order -> [T, d]."""
        self._check(x, batch, cache)
        cfg = self.cfg
        ops = self._ops(cache)
        if self.decode_path and batch.is_decode:
            o = decode_attend(self, x, cache, ops)    # projects x itself; the attention op applies the inverse RoPE
        else:
            proj = self.project(x, ops)
            cos, sin = ops.rope_cos_sin(self.rope.inv_freq_on(x.device), batch.positions)
            q_up = self.query_up(self.q_residual(proj, ops), ops)
            # the attention op normalises and rotates the raw queries (`queries`: where its kernel
            # loads them, or by norm_rope first) and applies the inverse RoPE and the output dtype
            o = self._attend_general(proj, self.query_heads(q_up), q_up, self.window_kv(proj, cos, sin, ops), cos,
                                     sin, batch, cache, ops, x.dtype)
        return grouped_output(o, self.o_a_proj, self.o_b_proj, cfg.o_groups, ops)

    def output_weights(self) -> list[torch.Tensor]:
        """The output projection's weight tensors in the order its GEMMs read them (o_a, then W_ob;
        an FP8 block weight's codes, then its scales)."""
        return [t for m in (self.o_a_proj, self.o_b_proj)
                for t in ((m.weight, m.weight_scale_inv) if isinstance(m, BlockFP8Linear) else (m.weight,))]

    def q_residual(self, proj: dict[str, torch.Tensor], ops) -> torch.Tensor:
        """q_res = RMSNorm_w(x W_qa) [T, R_q] (norm_rope with no rotated channels)."""
        q_a = proj["q_a"]
        none = q_a.new_empty(q_a.shape[0], 0, dtype=torch.float32)
        return ops.norm_rope(q_a, self.q_a_norm.weight, self.cfg.rms_norm_eps, none, none)

    def query_up(self, q_res: torch.Tensor, ops: types.SimpleNamespace | None = None) -> dict[str, torch.Tensor]:
        """q_res W_qb ("q") and, CSA, the indexer's q_res W_qI ("iq"), in one GEMM per weight format
        (`ops`: an op namespace; default the reference's)."""
        return dict(zip(self._q_up_names, self._q_up(q_res, ops)))

    def query_up_normed(self, proj: dict[str, torch.Tensor], ops: types.SimpleNamespace) -> dict[str, torch.Tensor]:
        """`query_up(q_residual(proj))` with the q_a norm inside the GEMMs: a one-row GEMV normalises
        x itself, so no norm kernel runs between the input projections and the q up-projection."""
        return dict(zip(self._q_up_names, self._q_up(proj["q_a"], ops, self.qa_norm())))

    def query_up_part(self, name: str, q_res: torch.Tensor, ops: types.SimpleNamespace,
                      norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """`query_up(q_res)[name]` alone, one GEMM (norm: q_res is then x W_qa, normalised inside,
        as `query_up_normed`)."""
        return self._q_up.part(q_res, self._q_up_names.index(name), ops, norm)

    def qa_norm(self) -> tuple[torch.Tensor, float]:
        """The q_a norm's (weight, eps), for GEMMs that apply it themselves."""
        return self.q_a_norm.weight, self.cfg.rms_norm_eps

    def queries(self, q_up: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, ops,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """q = RoPE_t(RMSNorm_1((q_res W_qb).view(H, D))) [T, H, D] (fp32 unless asked)."""
        return ops.norm_rope(self.query_heads(q_up), None, self.cfg.rms_norm_eps, cos, sin, out_dtype=out_dtype)

    def query_heads(self, q_up: dict[str, torch.Tensor]) -> torch.Tensor:
        """(q_res W_qb).view(T, H, D): the queries before their norm and RoPE (`queries`)."""
        q = q_up["q"]
        return q.view(q.shape[0], self.cfg.num_attention_heads, self.cfg.head_dim)

    def window_kv(self, proj: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, ops) -> torch.Tensor:
        """kv = RoPE_t(RMSNorm_w(x W_kv)) [T, D], what the window ring stores."""
        return ops.norm_rope(proj["kv"], self.kv_norm.weight, self.cfg.rms_norm_eps, cos, sin)

    def _attend_general(self, proj: dict[str, torch.Tensor], q: torch.Tensor, q_up: dict[str, torch.Tensor],
                        kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                        cache: LayerCacheHandle, ops, out_dtype: torch.dtype) -> torch.Tensor:
        """Any mix of prefill chunks and decode tokens -> [T, H, D] out_dtype, after the inverse RoPE;
        q: the raw queries (`query_heads`), normalised and rotated by the attention op.

        Cache writes, gathers, compression, the indexer selection and the attention itself
        (`prefill_attention`: each token over its window and its selected / visible entries) use
        the cache's kernels (`ops`).
        """
        cfg = self.cfg
        # The window before this step's writes: a chunk longer than W would overwrite rows its
        # own early queries still need. The new tokens are read back as the ring stores them.
        win_kv, win_pos, _ = cache.gather_swa_kv()
        cache.write_swa(kv)
        fmt = cache.schema.kv_format
        # what the ring's readers see of this step's rows (bf16 holds fp8_ds and bf16 rows exactly)
        new_kv = ops.roundtrip_rows(kv, fmt, None if fmt.name == "fp32" else torch.bfloat16)

        selected = None
        ratio = max_entries = 0
        if self.compressor is not None:
            compress_and_flush(self.compressor, proj, batch, cache, self.rope, ops)   # norm + RoPE in the writes
            if self.spec.attn is AttentionType.CSA:
                selected = self.compressor.indexer.select(q_up["iq"], proj["iw"], cache, cos, sin, ops)
            ratio, max_entries = self.spec.compress_ratio, cache.max_entries()
        pool = cache.paged
        return ops.prefill_attention(q, win_kv, win_pos, new_kv, batch.positions, batch.token_request,
                                     batch.cu_seqlens, cfg.sliding_window, pool.kv if pool is not None else None, fmt,
                                     batch.block_table, cache.schema.entries_per_block, selected, ratio, max_entries,
                                     self.sinks, cfg.head_dim ** -0.5, rope=(cos, sin), out_dtype=out_dtype,
                                     q_norm=cfg.rms_norm_eps)

    def _ops(self, cache: LayerCacheHandle):
        return cache.ops if self.backend is None else ops_for(cache.state.device, self.backend)

    def _check(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCacheHandle) -> None:
        w = self.q_a_norm.weight          # the layer's dtype (an FP8 projection keeps its own)
        if x.device != w.device or x.device != cache.state.device:
            raise DeviceError(f"x is on {x.device}, weights on {w.device}, cache on {cache.state.device}; "
                              "put them on one device")
        if x.dtype != w.dtype:
            raise DeviceError(f"x is {x.dtype} but layer {self.layer_idx}'s weights are {w.dtype}; cast one")
        if x.dim() != 2 or x.shape != (batch.num_tokens, self.cfg.hidden_size):
            raise InputError(f"x must be [{batch.num_tokens}, {self.cfg.hidden_size}] (the batch's packed tokens), "
                             f"got {list(x.shape)}")
        if cache.schema.layer_idx != self.layer_idx or cache.batch is not batch:
            raise InputError(f"the cache handle is for layer {cache.schema.layer_idx} / another batch; "
                             f"use mgr.acquire({self.layer_idx}, batch)")
