"""A dense, non-cached, full-precision reference of one DSV4 attention layer (DESIGN §3).

`dense_attention` computes the layer's output for every position 0..S-1 of ONE request at once,
straight from the math: no cache, no ring, no online compressor state, no quantisation. It is
written from the specification and shares no code with the rest of dsv4 (only `DSV4Config`), nor
with transformers, so that agreeing with both the cached kernels and the HF oracle means something.

Shapes (S tokens, d hidden, H heads, D head_dim, r rope_dim, N compressed entries, k index_topk):

    x             [S, d]           the layer's normed input, positions 0..S-1
    q             [S, H, D]        q_res = RMSNorm_w(x W_qa) [S, R_q]; q = RoPE_t(RMSNorm_1(q_res W_qb))
    kv            [S, D]           RoPE_t(RMSNorm_w(x W_kv)); one head, K = V
    entries       [N, D]           compressed entries (CSA: N = floor(S/m), HCA: N = floor(S/m'))
    index keys    [N, D_I]         CSA only: the lightning indexer's own compressed keys
    visible       [S, N] bool      which entries each query attends to (HCA causal; CSA its top-k)
    out           [S, d]

Weights are a dict in transformers' `DeepseekV4Attention.state_dict()` key names (DESIGN §3).
"""

from __future__ import annotations

import math

import torch

from dsv4.model.config import DSV4Config

__all__ = ["dense_attention", "rope_inv_freq", "yarn_correction_range"]

_QUERY_BLOCK = 128  # queries per attention block: bounds memory at [H, block, W + block + N]


# ------------------------------------------------------------------------------------------ RoPE
def yarn_correction_range(cfg: DSV4Config) -> tuple[int, int]:
    """(low, high) pair indices of YaRN's ramp on the compress table (θ = 160000: (15, 25))."""
    r, theta, orig = cfg.rope_dim, cfg.compress_rope_theta, cfg.yarn_original_max_position

    def dim_for(rotations: float) -> float:
        # the pair index whose wavelength makes `rotations` turns over the original context
        return r * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_for(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(dim_for(cfg.yarn_beta_slow)), r - 1)
    return low, high


def rope_inv_freq(cfg: DSV4Config, compress: bool, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """inv_freq [rope_dim/2] of the main table (θ = rope_theta, no YaRN) or of the compress table
    (θ = compress_rope_theta with YaRN when yarn_factor > 1), per DESIGN §3."""
    r = cfg.rope_dim
    i = torch.arange(r // 2, dtype=torch.float64)
    theta = cfg.compress_rope_theta if compress else cfg.rope_theta
    extrap = theta ** (-2.0 * i / r)
    if not compress or cfg.yarn_factor == 1.0:
        return extrap.to(dtype)
    interp = extrap / cfg.yarn_factor
    low, high = yarn_correction_range(cfg)
    span = (high - low) if high != low else 0.001  # degenerate ramp: a step at `low`
    e = 1.0 - ((i - low) / span).clamp(0.0, 1.0)  # 1 = keep the original (high) frequency
    return (interp * (1.0 - e) + extrap * e).to(dtype)


def _rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the TRAILING 2·len(inv_freq) channels of x as interleaved pairs (a, b) = (2i, 2i+1).

    x: [P, ..., C] with one position per leading index; pos: [P]. inverse=True rotates by -pos
    (undoes the rotation that V = K carried into the attention output).
    """
    half = inv_freq.numel()
    ang = pos.to(inv_freq.dtype)[:, None] * inv_freq[None, :]  # [P, r/2]
    if inverse:
        ang = -ang
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = ang.cos().view(view).to(x.dtype), ang.sin().view(view).to(x.dtype)
    nope, rot = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half:]
    a, b = rot[..., 0::2], rot[..., 1::2]
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated), dim=-1)


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; weight None = the unweighted RMSNorm_1."""
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


# ------------------------------------------------------------------------------------------ compressors
def _hca_entries(x, wc, wz, ape, norm_w, m, inv_freq, eps) -> torch.Tensor:
    """HCA entry w: per channel, softmax over the m' tokens of window w of z, applied to c.

    Only complete windows produce an entry (the window's last token closes it). Returns [N, D]
    after RMSNorm_w and RoPE at the window's first token, position w·m'.
    """
    n = x.shape[0] // m
    if n == 0:
        return x.new_zeros(0, wc.shape[0])
    xs = x[: n * m]
    c = (xs @ wc.T).view(n, m, -1)
    z = (xs @ wz.T).view(n, m, -1) + ape  # ape[j mod m'] = ape[slot]
    entry = (torch.softmax(z, dim=1) * c).sum(dim=1)
    return _rope(_rms(entry, norm_w, eps), torch.arange(n) * m, inv_freq)


def _csa_entries(x, wc, wz, ape, norm_w, m, inv_freq, eps) -> torch.Tensor:
    """CSA entry w: per channel, softmax over 2m slots = window w-1's [:D] halves and window w's [D:] halves.

    c, z are [S, 2D]: a token's [:D] half feeds the NEXT window's entry, its [D:] half its own
    window's. Entry 0 has no window -1 and is a softmax over window 0's m [D:] slots only.
    Returns [N, D] after RMSNorm_w and RoPE at position w·m.
    """
    n = x.shape[0] // m
    D = wc.shape[0] // 2
    if n == 0:
        return x.new_zeros(0, D)
    xs = x[: n * m]
    c = (xs @ wc.T).view(n, m, 2 * D)
    z = (xs @ wz.T).view(n, m, 2 * D) + ape
    # Slots of entry w: window w-1's [:D] halves, then window w's [D:] halves -> [n, 2m, D].
    # Entry 0 has no window -1: its first m slots get gate -inf, i.e. softmax weight exactly 0.
    prev_c = torch.cat((c.new_zeros(1, m, D), c[:-1, :, :D]), dim=0)
    prev_z = torch.cat((z.new_full((1, m, D), float("-inf")), z[:-1, :, :D]), dim=0)
    slots_c = torch.cat((prev_c, c[:, :, D:]), dim=1)
    slots_z = torch.cat((prev_z, z[:, :, D:]), dim=1)
    entry = (torch.softmax(slots_z, dim=1) * slots_c).sum(dim=1)
    return _rope(_rms(entry, norm_w, eps), torch.arange(n) * m, inv_freq)


# ------------------------------------------------------------------------------------------ the layer
def dense_attention(
    cfg: DSV4Config,
    layer_idx: int,
    weights: dict[str, torch.Tensor],
    x: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float64,
    return_topk: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
    """Outputs of attention layer `layer_idx` for all positions 0..S-1 of one request, computed densely.

    Args:
        cfg: the model's DSV4Config (layer type = cfg.compress_ratios[layer_idx]).
        weights: the layer's weights in HF `DeepseekV4Attention.state_dict()` names (any float dtype).
        x: [S, hidden_size], the layer's normed input at positions 0..S-1.
        dtype: compute dtype (default float64, so the reference's own rounding is negligible).
        return_topk: also return the CSA selection, [S, index_topk] int64, best first (score
            descending, ties to the smaller entry index), -1 padded; None for SWA / HCA layers.

    Returns:
        out [S, hidden_size] in `dtype` (and the top-k tensor when asked).
    """
    ratio = cfg.compress_ratios[layer_idx]
    is_csa, is_hca = ratio == cfg.csa_compression_ratio, ratio == cfg.hca_compression_ratio
    if x.dim() != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"x must be [S, {cfg.hidden_size}], got {tuple(x.shape)}")
    w = {k: v.to(dtype) for k, v in weights.items()}
    x = x.to(dtype)
    S, H, D, eps = x.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    pos = torch.arange(S)
    # SWA-only layers use the main table for everything; CSA/HCA layers the compress table
    # (θ = compress_rope_theta + YaRN) for everything: q, window kv, entries, indexer q and k.
    inv_freq = rope_inv_freq(cfg, compress=ratio != 0, dtype=dtype)

    # -- query and window kv
    q_res = _rms(x @ w["q_a_proj.weight"].T, w["q_a_norm.weight"], eps)  # [S, R_q], shared with the indexer
    q = _rope(_rms((q_res @ w["q_b_proj.weight"].T).view(S, H, D), None, eps), pos, inv_freq)  # [S, H, D]
    kv = _rope(_rms(x @ w["kv_proj.weight"].T, w["kv_norm.weight"], eps), pos, inv_freq)  # [S, D]

    # -- compressed entries and which of them each query sees
    entries = x.new_zeros(0, D)
    visible = torch.zeros(S, 0, dtype=torch.bool)
    topk = None
    if is_hca or is_csa:
        m = ratio
        make = _csa_entries if is_csa else _hca_entries
        entries = make(x, w["compressor.kv_proj.weight"], w["compressor.gate_proj.weight"],
                       w["compressor.position_bias"], w["compressor.kv_norm.weight"], m, inv_freq, eps)
        N = entries.shape[0]
        # entry w exists for query t once its window closed: w < floor((t+1)/m)
        causal = torch.arange(N)[None, :] < ((pos + 1) // m)[:, None]  # [S, N]
        if is_hca:
            visible = causal
        else:
            visible, topk = _indexer_select(cfg, w, x, q_res, pos, inv_freq, causal, eps)

    # -- core attention: shared-KV MQA over window keys + visible entries, with a per-head sink
    sink = w["sinks"]  # [H], not scaled
    scale = D ** -0.5
    W = cfg.sliding_window
    o = torch.empty(S, H, D, dtype=dtype)
    for a in range(0, S, _QUERY_BLOCK):
        b = min(S, a + _QUERY_BLOCK)
        lo = max(0, a - W + 1)  # oldest raw token any query of this block can see
        keys = torch.cat((kv[lo:b], entries), dim=0)  # [K, D], also the values (V = K)
        t, s = pos[a:b, None], pos[None, lo:b]
        in_window = (s <= t) & (s > t - W)  # W raw tokens including t itself
        ok = torch.cat((in_window, visible[a:b]), dim=1)  # [q, K]
        logits = torch.einsum("thd,kd->htk", q[a:b], keys) * scale
        logits = logits.masked_fill(~ok[None], float("-inf"))
        # p = exp(l) / (exp(sink) + Σ exp(l)), shifted by max(l, sink) for range
        top = torch.maximum(logits.amax(dim=-1), sink[:, None])  # [H, q]
        e = torch.exp(logits - top[..., None])
        p = e / (torch.exp(sink[:, None] - top) + e.sum(dim=-1))[..., None]
        o[a:b] = torch.einsum("htk,kd->thd", p, keys)

    # V = K carried RoPE_s into the output: rotate back by -t so only relative position remains.
    o = _rope(o, pos, inv_freq, inverse=True)

    # -- grouped output projection: heads are split into o_groups contiguous groups; group g goes
    # through rows g·R_o:(g+1)·R_o of W_oa, the concatenation through W_ob.
    G, Ro = cfg.o_groups, cfg.o_lora_rank
    per_group = H * D // G
    o_groups = o.reshape(S, G, per_group)
    w_oa = w["o_a_proj.weight"].view(G, Ro, per_group)
    mid = torch.einsum("sgi,gri->sgr", o_groups, w_oa).reshape(S, G * Ro)
    out = mid @ w["o_b_proj.weight"].T
    if return_topk:
        return out, topk
    return out


def _indexer_select(cfg, w, x, q_res, pos, inv_freq, causal, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """The lightning indexer: per query, the top-min(k, V) of its V visible entries.

    Returns (visible [S, N] bool, topk [S, k] int64 best first, -1 padded).
    """
    S, N = causal.shape
    nI, DI, k, m = cfg.index_n_heads, cfg.indexer_head_dim, cfg.index_topk, cfg.csa_compression_ratio
    pre = "compressor.indexer."
    # its own CSA-style compressor at D_I (own weights), same windows, same compress rope table
    keys = _csa_entries(x, w[pre + "kv_proj.weight"], w[pre + "gate_proj.weight"], w[pre + "position_bias"],
                        w[pre + "kv_norm.weight"], m, inv_freq, eps)  # [N, D_I]
    qI = _rope((q_res @ w[pre + "q_b_proj.weight"].T).view(S, nI, DI), pos, inv_freq)  # [S, nI, D_I]
    g = (x @ w[pre + "scorer.weights_proj.weight"].T) * nI ** -0.5  # [S, nI] from x; may be negative
    dots = torch.einsum("thd,wd->thw", qI, keys)  # [S, nI, N]
    score = (torch.relu(dots) * g[..., None]).sum(dim=1) * DI ** -0.5  # [S, N]
    score = score.masked_fill(~causal, float("-inf"))
    # Deterministic order: score descending, ties to the smaller index. A stable sort keeps equal
    # scores in index order.
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices  # [S, N]
    if N < k:
        order = torch.cat((order, order.new_full((S, k - N), -1)), dim=1)
    order = order[:, :k]
    n_take = causal.sum(dim=-1).clamp(max=k)  # min(k, V)
    chosen = torch.arange(k)[None, :] < n_take[:, None]
    topk = torch.where(chosen, order, torch.full_like(order, -1))
    visible = torch.zeros(S, N + 1, dtype=torch.bool)
    visible.scatter_(1, torch.where(chosen, order, torch.full_like(order, N)), True)  # N = discard column
    return visible[:, :N], topk
