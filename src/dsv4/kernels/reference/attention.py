"""Reference core attention: shared-KV MQA with a per-head sink (DESIGN §3).

    logit[h, s] = q_h . k_s * D^-1/2
    p[h, s]     = exp(logit) / (exp(sink_h) + sum_s' exp(logit[h, s']))     (V = K)
"""

from __future__ import annotations

import torch

_QUERY_CHUNK = 512


def attention_with_sink(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """One request's queries against its keys.

    Args:
        q: [Tq, H, D] fp32; keys: [S, D] fp32 (also the values); mask: [Tq, S] bool, True = visible;
        sinks: [H] fp32 (not scaled).
    Returns:
        [Tq, H, D] fp32; a query that sees nothing attends only to the sink and gets 0.
    """
    out = torch.empty_like(q)
    sink = sinks.float()[None, :, None]
    for c0 in range(0, q.shape[0], _QUERY_CHUNK):
        c1 = min(c0 + _QUERY_CHUNK, q.shape[0])
        logits = torch.einsum("thd,sd->ths", q[c0:c1], keys) * scale
        logits = logits.masked_fill(~mask[c0:c1, None, :], float("-inf"))
        m = torch.maximum(logits.amax(-1, keepdim=True), sink)
        p = torch.exp(logits - m)
        denom = p.sum(-1, keepdim=True) + torch.exp(sink - m)
        out[c0:c1] = torch.einsum("ths,sd->thd", p / denom, keys)
    return out
