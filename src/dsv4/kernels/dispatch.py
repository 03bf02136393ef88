"""Choose the implementation of the cache ops: the PyTorch reference or the Triton kernels.

Both namespaces export the same functions with the same signatures:
append_window, write_entries, roundtrip_rows, gather_window, gather_entries, gather_all_entries,
compress_update, compress_decode, paged_indexer_scores, topk_smaller_index, decode_indexer_topk,
prefill_indexer_topk, norm_rope,
rope_cos_sin, decode_attention, prefill_attention, linear, linear_fp8 and linear_pair (the layer's
projections: dense weights, FP8 block weights, one input by both). `auto` picks Triton on CUDA when
a Triton of `MIN_TRITON` or later is installed, else the reference, with a warning that says why.
"""

from __future__ import annotations

import functools
import re
import types
import warnings

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


#: the oldest Triton the kernels are written for. Older ones cannot import them: 3.2 and 3.3 lack the
#: programmatic-dependent-launch calls (`gdc_wait`), 3.4 Gluon's Hopper MMAs, 3.5 Gluon's API as written.
#: sm_90 compiles are checked on 3.6 to 3.9 (tests/test_gluon_compile.py on the installed one); the GPU
#: measurements in benchmarks/NOTES.md are on 3.6.
MIN_TRITON = (3, 6)


@functools.cache
def triton_problem() -> str | None:
    """Why the Triton kernels cannot run here, or None when they can (asked once a process)."""
    try:
        import triton
    except ImportError:
        return "the triton package is not installed (pip install 'triton>=3.6')"
    have = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
    if have < MIN_TRITON:
        return (f"triton {triton.__version__} is older than {'.'.join(map(str, MIN_TRITON))}, the oldest the "
                f"kernels are written for (pip install 'triton>=3.6')")
    return None


def triton_available() -> bool:
    return triton_problem() is None


@functools.cache
def _warn_reference_on(device_type: str, why: str) -> None:
    # once a process: a CUDA tensor served by the reference ops runs correctly but far slower
    warnings.warn(f"dsv4: the PyTorch reference ops serve {device_type} tensors, not the Triton kernels: {why}",
                  RuntimeWarning, stacklevel=3)


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
        if dev.type == "cuda" and backend == "reference":
            _warn_reference_on(dev.type, triton_problem())
    if backend == "triton" and (why := triton_problem()) is not None:
        raise ConfigError(f"backend='triton' cannot run: {why}")
    return _namespace(backend)
