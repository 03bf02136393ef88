"""What every benchmark module shares: the run's options, the result row, the bench models.

A `Row` is one measured case: (kind, layer, context, batch, op, impl). Its time is filled by the
module that ran it; bytes and FLOPs come from `dsv4.bench.counts`; the derived columns
(GB/s, % of the card's ceilings, ratios against the reference and transformers) are filled by
`dsv4.bench.report.finalize` once every row of the run exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv4.model.config import DSV4Config

#: Layer index of each benchmarked layer type in the 2-layer slice built by `bench_config`.
LAYER_INDEX = {"csa": 0, "hca": 1}
#: impl name of the decode layer rows whose projections hold the checkpoint's FP8 block weights
FP8_IMPL = "triton-fp8w"


@dataclass(kw_only=True, slots=True)
class BenchOptions:
    device: torch.device
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    layers: tuple[str, ...]                 # subset of ("csa", "hca")
    backends: tuple[str, ...]               # subset of ("triton", "reference")
    prefill: int                            # prompt length; 0 = no prefill benchmark
    prefill_chunk: int
    decode: bool = True
    hf: bool = True
    graph: bool = True                      # time Triton decode work as CUDA-graph replays
    quick: bool = False
    kv_format: str = "fp8_ds"
    indexer_format: str = "mxfp4"
    warmup_ms: float = 25.0                 # warm-up / repetition budgets (bench.timing)
    rep_ms: float = 100.0
    host_warmup: int = 1                    # CPU (or multi-step prefill) timing: runs discarded / kept
    host_reps: int = 3
    seed: int = 0
    fp8_weights: bool = True                # also time the Triton decode layer with FP8 block weights


@dataclass(kw_only=True, slots=True)
class Row:
    """One benchmark case. `status`: ok | oom | skipped | error (then `reason` says why)."""

    kind: str                               # "decode" | "prefill"
    layer: str                              # "csa" | "hca"
    context: int                            # decode: tokens in the cache after the step; prefill: prompt
    batch: int
    op: str                                 # append | flush | indexer | attention | cache | layer | compress_flush
    impl: str                               # triton | reference | hf
    status: str = "ok"
    reason: str | None = None
    mode: str | None = None                 # graph | eager | host | device
    us: float | None = None                 # median microseconds
    us_eager: float | None = None           # Triton rows timed as graphs: the same work launched eagerly
    bytes: int = 0
    flops: int = 0
    bytes_detail: dict[str, int] = field(default_factory=dict)
    flops_detail: dict[str, int] = field(default_factory=dict)
    note: str | None = None
    # derived (report.finalize)
    gbps: float | None = None
    tflops: float | None = None
    pct_bw: float | None = None
    pct_mma: float | None = None
    roofline_us: float | None = None
    pct_roofline: float | None = None
    bound: str | None = None
    x_vs_reference: float | None = None
    x_vs_hf: float | None = None

    def key(self) -> tuple[str, str, int, int, str]:
        return (self.kind, self.layer, self.context, self.batch, self.op)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def bench_config(quick: bool) -> tuple[DSV4Config, int]:
    """(config, tokens_per_block) of the benchmarked 2-layer slice: layer 0 CSA, layer 1 HCA.

    Full: V4-Flash shapes (DESIGN §2). Quick: a tiny model with every geometry rule intact
    (fp8_ds nope part of one 64-wide tile, a power-of-two indexer head), for CPU smoke runs.
    """
    if not quick:
        cfg = DSV4Config.flash().replace(num_hidden_layers=2, compress_ratios=(4, 128))
        return cfg, 256
    cfg = DSV4Config(name="quick", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, q_lora_rank=32,
                     o_groups=2, o_lora_rank=16, index_topk=6, compress_ratios=(4, 16), head_dim=128, rope_dim=64,
                     sliding_window=16, csa_compression_ratio=4, hca_compression_ratio=16, index_n_heads=16,
                     indexer_head_dim=64, max_position_embeddings=4096)
    return cfg, 32


class Unavailable(RuntimeError):
    """A case cannot run here (a missing package or model class): its rows become "skipped"."""


def short_reason(exc: BaseException, limit: int = 160) -> str:
    """One line naming the exception, for a row's `reason`."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
