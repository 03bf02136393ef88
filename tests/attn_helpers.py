"""A driver for `AttentionSubBlock` on a `KVCacheManager`, shared by the attention tests.

    outs = run_dsv4(cfg, layer, weights, {"a": xa, "b": xb},
                    [{"a": 37, "b": 1}, {"b": 5}, {"a": 1, "b": 60}])

Each schedule step is one forward: the listed requests' next tokens packed in the dict's order.
Every request must be consumed exactly (its steps sum to its length). Returns each request's
outputs [S, hidden] in position order.
"""

from __future__ import annotations

import math

import torch

from dsv4 import DSV4Config, KVCacheManager
from dsv4.attention import AttentionSubBlock

__all__ = ["chunked", "indexer_scores", "make_block", "max_rel", "rel_l2", "run_dsv4", "topk_sets"]


def make_block(cfg: DSV4Config, layer: int, weights: dict[str, torch.Tensor]) -> AttentionSubBlock:
    blk = AttentionSubBlock(cfg, layer)
    blk.load_hf_state_dict(weights)
    return blk.eval()


def chunked(rid: str, chunks: list[int]) -> list[dict[str, int]]:
    """A single request's schedule: one forward per chunk."""
    return [{rid: n} for n in chunks]


def default_tokens_per_block(cfg: DSV4Config) -> int:
    ratios = [r for r in cfg.compress_ratios[: cfg.num_hidden_layers] if r]
    lcm = math.lcm(*ratios) if ratios else 1
    return lcm * -(-32 // lcm)  # the smallest multiple of lcm(m, m') >= 32: several blocks per request


def run_dsv4(
    cfg: DSV4Config,
    layer: int,
    weights: dict[str, torch.Tensor] | None,
    requests: dict[str, torch.Tensor],
    schedule: list[dict[str, int]],
    *,
    blk: AttentionSubBlock | None = None,
    mgr: KVCacheManager | None = None,
    kv_format: str = "fp32",
    indexer_format: str = "fp32",
    tokens_per_block: int | None = None,
    num_blocks: int = 64,
    max_requests: int = 4,
    capture_topk: bool = False,
) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run `schedule` through one layer; returns {rid: out [S, hidden]} (and {rid: top-k [S, k]}).

    blk / mgr: reuse a prebuilt block or manager (requests not yet in `mgr` are added to it).
    capture_topk: CSA only: also return what `blk.compressor.indexer.select` picked per token
      ([S, index_topk] int64, -1 padded, the library's order; -2 rows: tokens of all-decode steps,
      whose fast path selects without calling select()).
    """
    if blk is None:
        blk = make_block(cfg, layer, weights)
    if mgr is None:
        mgr = KVCacheManager(cfg, max_requests=max_requests, num_blocks=num_blocks, kv_format=kv_format,
                             indexer_format=indexer_format,
                             tokens_per_block=tokens_per_block or default_tokens_per_block(cfg))
    for rid in requests:
        if rid not in mgr.requests:
            mgr.add_request(rid)
    for rid, x in requests.items():
        total = sum(step.get(rid, 0) for step in schedule)
        assert total == x.shape[0], f"schedule gives {rid!r} {total} tokens, x has {x.shape[0]}"

    picks: list[torch.Tensor] = []
    restore = None
    if capture_topk:
        indexer = blk.compressor.indexer
        orig = indexer.select

        def _select(*a, **kw):
            out = orig(*a, **kw)
            picks.append(out.detach().clone())
            return out

        indexer.select = _select

        def restore():  # drop the instance attribute: the class method shows through again
            delattr(indexer, "select")

    done = dict.fromkeys(requests, 0)
    outs: dict[str, list[torch.Tensor]] = {rid: [] for rid in requests}
    tops: dict[str, list[torch.Tensor]] = {rid: [] for rid in requests}
    try:
        with torch.no_grad():
            for step in schedule:
                xs = []
                for rid, n in step.items():
                    xs.append(requests[rid][done[rid]:done[rid] + n])
                x = torch.cat(xs).to(blk.q_a_norm.weight.dtype)   # the layer dtype (FP8 projections keep their own)
                batch = mgr.prepare_forward(dict(step))
                out = blk(x, batch, mgr.acquire(layer, batch))
                assert out.shape == x.shape
                sel = None
                if capture_topk:
                    # The all-decode fast path scores inside its own kernel and does not call select():
                    # its rows are unknown (-2) to the capture.
                    sel = picks.pop() if picks else torch.full((x.shape[0], cfg.index_topk), -2, dtype=torch.long)
                    assert not picks, "select() ran more than once in one forward"
                t0 = 0
                for rid, n in step.items():
                    outs[rid].append(out[t0:t0 + n])
                    if sel is not None:
                        tops[rid].append(sel[t0:t0 + n])
                    done[rid] += n
                    t0 += n
    finally:
        if restore is not None:
            restore()
    result = {rid: torch.cat(o) for rid, o in outs.items()}
    if capture_topk:
        return result, {rid: torch.cat(t) for rid, t in tops.items()}
    return result


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| in float64 (the fp32 oracle metric of DESIGN §8)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (the metric for the quantised formats)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def topk_sets(sel: torch.Tensor) -> list[frozenset[int]]:
    """Rows of a -1-padded [S, k] selection as sets of entry indices."""
    return [frozenset(v for v in row.tolist() if v >= 0) for row in sel]


def indexer_scores(cfg: DSV4Config, layer: int, weights: dict[str, torch.Tensor], x: torch.Tensor,
                   indexer_format: str | None = None) -> torch.Tensor:
    """CSA lightning-indexer scores I[t, w] in float64 (DESIGN §3), -inf where w is not yet visible.

    Built from `dsv4.reference.dense`'s compressor and RoPE. indexer_format: if given, the keys go
    through that storage format's writer and reader, and queries into its stored basis (e.g. the
    Hadamard rotation of mxfp4) rounded as its keys are (`EntryFormat.round_query`, as the layer
    does), i.e. the scores the quantised cache gives in exact arithmetic.
    """
    from dsv4.cache.formats import indexer_format as make_format
    from dsv4.reference import dense

    w = {k: v.double() for k, v in weights.items()}
    x = x.double()
    S, m, eps = x.shape[0], cfg.csa_compression_ratio, cfg.rms_norm_eps
    n_heads, dim = cfg.index_n_heads, cfg.indexer_head_dim
    inv = dense.rope_inv_freq(cfg, compress=True)
    pos = torch.arange(S)
    p = "compressor.indexer."
    keys = dense._csa_entries(x, w[p + "kv_proj.weight"], w[p + "gate_proj.weight"], w[p + "position_bias"],
                              w[p + "kv_norm.weight"], m, inv, eps)
    q_res = dense._rms(x @ w["q_a_proj.weight"].T, w["q_a_norm.weight"], eps)
    q = dense._rope((q_res @ w[p + "q_b_proj.weight"].T).view(S, n_heads, dim), pos, inv)
    g = (x @ w[p + "scorer.weights_proj.weight"].T) * n_heads ** -0.5
    if indexer_format is not None:
        fmt = make_format(indexer_format, dim)
        keys = fmt.roundtrip(keys.float()).double()
        q = fmt.round_query(fmt.to_stored_basis(q.float())).double()
    score = (torch.einsum("thd,wd->thw", q, keys).relu() * g[..., None]).sum(1) * dim ** -0.5
    visible = torch.arange(keys.shape[0])[None, :] < ((pos + 1) // m)[:, None]
    return score.masked_fill(~visible, float("-inf"))
