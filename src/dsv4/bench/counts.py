"""Bytes moved and FLOPs of each benchmarked op: the work the op must do, counted at its interface.

Every op reads its inputs once and writes its outputs once, in the dtypes the interfaces use
(`dsv4.kernels.reference.decode` / `cache_ops`): activations bf16 (2 B), compressor inputs and
states fp32 (4 B), the attention's queries and output as the decode step passes them on the GPU
(`decode_path.query_dtype`: bf16 q, fp32 for the fp32 format; the output in the layer's bf16), stored
entries in their format
(fp8_ds main entry E = 584 B, mxfp4 indexer key E_I = 68 B at V4 shapes). Metadata of a few bytes
per request (positions, slots, block tables) is left out. FLOPs count the matrix work only:
elementwise exp / norm / RoPE / ReLU are not counted (they are far below either ceiling).

Decode step of B requests, query token at position t = C - 1 (after it, C tokens are cached;
C a multiple of m' makes the token close a CSA and an HCA window: the step flushes an entry).
N_I = C // m indexer keys and CSA entries, k' = min(k, N_I) selected, N_H = C // m' HCA entries,
W' = min(W, C) window keys, N_s = the static score width (ForwardBatch.seq_len_bound // m):

    append      read kv B·D·2                       write ring entry + position B·(E + 4), head B·4
    flush       per compressor (main: D, width Dc = 2D CSA / D HCA, P = 2 CSA / 1 HCA pending
                entries, E; CSA indexer: D_I, 2·D_I, 2, E_I):
                  compress_decode  read c, z 2·B·Dc·4   state read + write 2·B·3·P·D·4   write A/S B·D·4
                  write_entries    read B·D·4           write B·E
    indexer     read q B·H_I·D_I·4, g B·H_I·4, keys B·N_I·E_I;  write scores B·N_s·4
                top-k: read B·N_s·4, write B·k·8                    FLOPs 2·H_I·D_I·N_I·B
    attention   read q B·H·D·Q (Q = 2, 4 for fp32 entries), ring B·W'·E + positions B·W·4, entries
                B·S·E (S = k' CSA, N_H HCA), CSA indices B·k·8;  write o B·H·D·2
                                                                    FLOPs 4·H·D·(W' + S)·B
    cache       the sum of the above (the target: >= 70% of roofline at B = 64, C = 128K)
    layer       cache + every parameter once (bf16) + x read and out written B·d·2 each;
                FLOPs cache + 2·B·(projection weights)

Prefill of one T-token prompt in chunks of c tokens (n = ceil(T / c) forwards):

    compress_flush  per compressor: read c, z 2·T·Dc·2 (bf16 projections), state 2·3·P·D·4 per
                    chunk, A/S entries written by the compressor and read by the write (which
                    finishes them: RMSNorm, RoPE) 2·(T//m)·D·4, stored entries (T//m)·E
    layer           compress_flush + parameters once per chunk + x, out T·d·2 each + window ring
                    written (min(W, c)·(E + 4) per chunk) and read back (W·E per chunk) +
                    per chunk, every entry visible at its end read once (E_I for CSA keys,
                    E for entries: CSA min(N, c·k), HCA N);
                    FLOPs 2·T·(projection weights) + Σ_t 4·H·D·(min(W, t+1) + S(t))
                    (+ CSA Σ_t 2·H_I·D_I·((t+1) // m)), S(t) = min(k, (t+1)//m) CSA, (t+1)//m' HCA
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4.cache.formats import indexer_format, main_format
from dsv4.model.config import DSV4Config

F32, BF16, I64 = 4, 2, 8


@dataclass(kw_only=True, slots=True)
class Work:
    bytes: dict[str, int] = field(default_factory=dict)
    flops: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    def merged(self, *others: Work) -> Work:
        out = Work(bytes=dict(self.bytes), flops=dict(self.flops))
        for o in others:
            for k, v in o.bytes.items():
                out.bytes[k] = out.bytes.get(k, 0) + v
            for k, v in o.flops.items():
                out.flops[k] = out.flops.get(k, 0) + v
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Geometry:
    """The shapes one layer's work depends on (V4-Flash CSA: D 512, W 128, m 4, k 512, E 584, E_I 68)."""

    kind: str                  # "csa" | "hca"
    hidden: int
    heads: int
    head_dim: int
    window: int
    ratio: int
    topk: int
    idx_heads: int
    idx_dim: int
    entry_bytes: int
    query_bytes: int           # of a query element as the step passes it (bf16; fp32 for fp32 entries)
    idx_entry_bytes: int       # 0 for HCA
    params: int                # every parameter of the layer's attention
    proj_params: int           # the matmul weights among them
    fp8_params: int            # the weights among those that DeepSeek's checkpoints ship in FP8

    @classmethod
    def of(cls, cfg: DSV4Config, kind: str, kv_format: str = "fp8_ds", idx_format: str = "mxfp4") -> Geometry:
        csa = kind == "csa"
        proj, other = layer_params(cfg, kind)
        return cls(kind=kind, hidden=cfg.hidden_size, heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                   window=cfg.sliding_window, ratio=cfg.csa_compression_ratio if csa else cfg.hca_compression_ratio,
                   topk=cfg.index_topk, idx_heads=cfg.index_n_heads, idx_dim=cfg.indexer_head_dim,
                   entry_bytes=main_format(kv_format, cfg.head_dim, cfg.rope_dim).entry_bytes,
                   query_bytes=F32 if kv_format == "fp32" else BF16,
                   idx_entry_bytes=indexer_format(idx_format, cfg.indexer_head_dim).entry_bytes if csa else 0,
                   params=proj + other, proj_params=proj, fp8_params=fp8_layer_params(cfg, kind))

    @property
    def csa(self) -> bool:
        return self.kind == "csa"

    def compressors(self) -> list[tuple[str, int, int, int, int]]:
        """(name, dim, input width, pending entries, stored entry bytes) of each compressor."""
        if self.csa:
            return [("main", self.head_dim, 2 * self.head_dim, 2, self.entry_bytes),
                    ("indexer", self.idx_dim, 2 * self.idx_dim, 2, self.idx_entry_bytes)]
        return [("main", self.head_dim, self.head_dim, 1, self.entry_bytes)]


def layer_params(cfg: DSV4Config, kind: str) -> tuple[int, int]:
    """(matmul weights, other parameters) of one CSA / HCA attention layer (names as transformers')."""
    d, h, dh, rq = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    g, ro = cfg.o_groups, cfg.o_lora_rank
    proj = d * rq + rq * h * dh + d * dh + (h * dh // g) * g * ro + g * ro * d   # q_a q_b kv o_a o_b
    other = rq + dh + h                                                          # q_a_norm kv_norm sinks
    if kind == "csa":
        m, hi, di = cfg.csa_compression_ratio, cfg.index_n_heads, cfg.indexer_head_dim
        proj += 2 * d * 2 * dh + 2 * d * 2 * di + rq * hi * di + d * hi   # comp kv/gate, idx kv/gate, q_b, w
        other += m * 2 * dh + dh + m * 2 * di + di                         # position_bias, kv_norm (x2)
    else:
        m = cfg.hca_compression_ratio
        proj += 2 * d * dh
        other += m * dh + dh
    return proj, other


def fp8_layer_params(cfg: DSV4Config, kind: str) -> int:
    """Weights of the projections `dsv4.model.fp8_weights.FP8_MODULES` names: q_a q_b kv o_a o_b (+ the
    indexer's q_b)."""
    d, h, dh, rq = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    n = d * rq + rq * h * dh + d * dh + h * dh * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d
    return n + (rq * cfg.index_n_heads * cfg.indexer_head_dim if kind == "csa" else 0)


def param_bytes(g: Geometry, fp8_weights: bool) -> int:
    """Bytes of the layer's parameters: bf16, or the FP8 projections as 1-byte codes + an fp32 scale
    per 128 x 128 block."""
    if not fp8_weights:
        return g.params * BF16
    return (g.params - g.fp8_params) * BF16 + g.fp8_params + g.fp8_params // (128 * 128) * F32


# ---------------------------------------------------------------------------------------- decode
def decode_work(g: Geometry, batch: int, context: int, score_width: int, fp8_weights: bool = False
                ) -> dict[str, Work]:
    """Work of each decode op for `batch` requests at `context` (see the module docstring); the
    "layer" op's parameters as bf16 or as FP8 blocks (`param_bytes`)."""
    b, d, e = batch, g.head_dim, g.entry_bytes
    ops: dict[str, Work] = {}
    ops["append"] = Work(bytes={"kv_in": b * d * BF16, "ring_write": b * (e + 4), "head": b * 4})
    flush = Work()
    for name, dim, width, pend, eb in g.compressors():
        flush = flush.merged(Work(bytes={
            f"{name}_cz_read": 2 * b * width * F32, f"{name}_state_rw": 2 * b * 3 * pend * dim * F32,
            f"{name}_entry_f32_rw": 2 * b * dim * F32, f"{name}_entry_write": b * eb}))
    ops["flush"] = flush
    n_i = context // g.ratio
    w_eff = min(g.window, context)
    if g.csa:
        ops["indexer"] = Work(
            bytes={"q_read": b * g.idx_heads * g.idx_dim * F32, "weights_read": b * g.idx_heads * F32,
                   "keys_read": b * n_i * g.idx_entry_bytes, "scores_write": b * score_width * F32,
                   "topk_scores_read": b * score_width * F32, "topk_write": b * g.topk * I64},
            flops={"indexer": 2 * g.idx_heads * g.idx_dim * n_i * b})
        s = min(g.topk, n_i)
    else:
        s = n_i
    att = {"q_read": b * g.heads * d * g.query_bytes, "ring_read": b * w_eff * e, "ring_pos_read": b * g.window * 4,
           "entries_read": b * s * e, "o_write": b * g.heads * d * BF16}
    if g.csa:
        att["indices_read"] = b * g.topk * I64
    ops["attention"] = Work(bytes=att, flops={"attention": 4 * g.heads * d * (w_eff + s) * b})
    ops["cache"] = Work().merged(*ops.values())
    ops["layer"] = ops["cache"].merged(Work(
        bytes={"params": param_bytes(g, fp8_weights), "x_read": b * g.hidden * BF16,
               "out_write": b * g.hidden * BF16},
        flops={"projections": 2 * b * g.proj_params}))
    return ops


# ---------------------------------------------------------------------------------------- prefill
def prefill_work(g: Geometry, tokens: int, chunk: int) -> dict[str, Work]:
    """Work of a `tokens`-token prefill from an empty cache, in chunks of `chunk` (module docstring)."""
    t_all, e = tokens, g.entry_bytes
    n_chunks = -(-t_all // chunk)
    cf = Work()
    for name, dim, width, pend, eb in g.compressors():
        n_e = t_all // g.ratio
        cf = cf.merged(Work(bytes={
            f"{name}_cz_read": 2 * t_all * width * BF16, f"{name}_state_rw": n_chunks * 2 * 3 * pend * dim * F32,
            f"{name}_entry_f32_rw": 2 * n_e * dim * F32, f"{name}_entry_write": n_e * eb}))
    ring_w = ring_r = keys_r = ent_r = 0
    for c0 in range(0, t_all, chunk):
        c1 = min(c0 + chunk, t_all)
        ring_w += min(g.window, c1 - c0) * (e + 4)
        ring_r += min(g.window, c0) * e
        n_end = c1 // g.ratio
        if g.csa:
            keys_r += n_end * g.idx_entry_bytes
            ent_r += min(n_end, (c1 - c0) * g.topk) * e
        else:
            ent_r += n_end * e
    flops = {"projections": 2 * t_all * g.proj_params, **_prefill_attention_flops(g, t_all)}
    layer = cf.merged(Work(
        bytes={"params": n_chunks * g.params * BF16, "x_read": t_all * g.hidden * BF16,
               "out_write": t_all * g.hidden * BF16, "ring_write": ring_w, "ring_read": ring_r,
               "keys_read": keys_r, "entries_read": ent_r},
        flops=flops))
    return {"compress_flush": cf, "layer": layer}


def _prefill_attention_flops(g: Geometry, tokens: int) -> dict[str, int]:
    """Attention (and CSA indexer) FLOPs summed over the query positions t < tokens."""
    win = sum(min(g.window, t + 1) for t in range(tokens))
    visible = sum((t + 1) // g.ratio for t in range(tokens))               # entries visible to each query
    attended = sum(min(g.topk, (t + 1) // g.ratio) for t in range(tokens)) if g.csa else visible
    out = {"attention": 4 * g.heads * g.head_dim * (win + attended)}
    if g.csa:
        out["indexer"] = 2 * g.idx_heads * g.idx_dim * visible
    return out
