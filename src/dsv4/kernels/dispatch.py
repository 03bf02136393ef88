"""Choose the implementation of the cache ops: the PyTorch reference or the Triton kernels.

Both namespaces export the same functions with the same signatures:
append_window, write_entries, roundtrip_rows, gather_window, gather_entries, gather_all_entries,
compress_update, compress_decode, paged_indexer_scores, topk_smaller_index, decode_indexer_topk,
prefill_indexer_topk, norm_rope,
rope_cos_sin, decode_attention, prefill_attention, linear, linear_fp8 and linear_pair (the layer's
projections: dense weights, FP8 block weights, one input by both). `auto` picks Triton on CUDA when
Triton is importable, else the reference.
"""

from __future__ import annotations

import functools
import types

import torch

from dsv4.errors import ConfigError

BACKENDS = ("auto", "reference", "triton")


def _reference() -> types.SimpleNamespace:
    from dsv4.kernels.reference import attention, cache_ops, compress, decode, indexer, linear, norm_rope
    return types.SimpleNamespace(
        name="reference", append_window=cache_ops.append_window, write_entries=cache_ops.write_entries,
        roundtrip_rows=cache_ops.roundtrip_rows,
        compress_update=compress.compress_update, gather_window=cache_ops.gather_window,
        gather_entries=cache_ops.gather_entries, gather_all_entries=cache_ops.gather_all_entries,
        compress_decode=decode.compress_decode, paged_indexer_scores=decode.paged_indexer_scores,
        topk_smaller_index=decode.topk_smaller_index, decode_indexer_topk=decode.decode_indexer_topk,
        decode_attention=decode.decode_attention,
        prefill_indexer_topk=indexer.prefill_indexer_topk, norm_rope=norm_rope.norm_rope,
        rope_cos_sin=norm_rope.rope_cos_sin, prefill_attention=attention.prefill_attention, linear=linear.linear,
        linear_fp8=linear.linear_fp8, linear_pair=linear.linear_pair)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _namespace(kind: str) -> types.SimpleNamespace:
    if kind == "reference":
        return _reference()
    from dsv4.kernels.triton import ops
    return ops.namespace()


def ops_for(device: torch.device | str, backend: str = "auto") -> types.SimpleNamespace:
    """The op namespace for tensors on `device` (cached: one lookup per call site is cheap)."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r} is not one of {BACKENDS}")
    dev = torch.device(device)
    if backend == "auto":
        backend = "triton" if dev.type == "cuda" and triton_available() else "reference"
    if backend == "triton" and not triton_available():
        raise ConfigError("backend='triton' needs the triton package (pip install triton)")
    return _namespace(backend)
