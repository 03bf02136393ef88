"""The Triton op namespace: the same functions and signatures as the reference (see dispatch.py).

Everything that reads or writes cache bytes is a Triton kernel; so is `topk_smaller_index` (an
exact radix select, `dsv4.kernels.triton.topk`, identical to the reference's packed torch.topk).
"""

from __future__ import annotations

import types

from dsv4.kernels.triton import (
    cache_ops,
    compress,
    decode,
    fp8_linear,
    gather,
    gemv,
    indexer_prefill,
    norm_rope,
    prefill_attention,
)


def namespace() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name="triton", append_window=cache_ops.append_window, write_entries=cache_ops.write_entries,
        roundtrip_rows=cache_ops.roundtrip_rows,
        compress_update=compress.compress_update, gather_window=gather.gather_window,
        gather_entries=gather.gather_entries, gather_all_entries=gather.gather_all_entries,
        compress_decode=cache_ops.compress_decode, paged_indexer_scores=decode.paged_indexer_scores,
        topk_smaller_index=decode.topk_smaller_index, decode_indexer_topk=decode.decode_indexer_topk,
        decode_attention=decode.decode_attention,
        prefill_indexer_topk=indexer_prefill.prefill_indexer_topk, norm_rope=norm_rope.norm_rope,
        rope_cos_sin=norm_rope.rope_cos_sin, prefill_attention=prefill_attention.prefill_attention,
        linear=gemv.linear, linear_fp8=fp8_linear.linear_fp8,
        linear_pair=fp8_linear.linear_pair)
