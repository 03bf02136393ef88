"""One benchmark run: ceilings, the layers, the backends, then the decode and prefill cases.

    run(opts) -> BenchResult
      ceilings      copy bandwidth and matrix rate of the card (dsv4.bench.ceilings)
      backends      "triton" / "reference" op namespaces; one that does not import is skipped
                    with its reason (the Triton kernels are optional on a CPU machine)
      layers        one CSA and one HCA AttentionSubBlock of the 2-layer V4-Flash slice, bf16,
                    shared by every backend (the backend is switched per timing)
      decode        dsv4.bench.decode.run_decode
      prefill       dsv4.bench.prefill.run_prefill
      finalize      derived columns and ratios (dsv4.bench.report.finalize)
"""

from __future__ import annotations

import os
import platform
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv4.attention import AttentionSubBlock
from dsv4.bench.ceilings import Ceilings, measure_ceilings
from dsv4.bench.common import LAYER_INDEX, BenchOptions, Row, Unavailable, bench_config, short_reason
from dsv4.bench.setup import make_block
from dsv4.bench.timing import Timer
from dsv4.model.config import DSV4Config


@dataclass(kw_only=True, slots=True)
class BenchContext:
    opts: BenchOptions
    cfg: DSV4Config
    tokens_per_block: int
    timer: Timer
    log: Callable[[str], None]
    ops: dict[str, types.SimpleNamespace] = field(default_factory=dict)
    blocks: dict[str, AttentionSubBlock] = field(default_factory=dict)
    fp8_blocks: dict[str, AttentionSubBlock] = field(default_factory=dict)   # FP8-weight twins (Triton only)
    skipped: list[dict[str, str]] = field(default_factory=list)
    _hf: dict[str, Any] = field(default_factory=dict)
    _hf_failure: dict[str, str] = field(default_factory=dict)

    def hf_layer(self, kind: str) -> Any:
        """The transformers layer for `kind` (built on first use); raises if it cannot be built."""
        if kind not in self._hf:
            from dsv4.bench.hf import HFLayer
            try:
                self._hf[kind] = HFLayer(self.cfg, self.blocks[kind])
            except Exception as e:
                self._hf[kind] = None
                self._hf_failure[kind] = short_reason(e)
                self.skip(f"transformers {kind} layer", self._hf_failure[kind])
        layer = self._hf[kind]
        if layer is None:
            raise Unavailable(f"transformers layer unavailable: {self._hf_failure[kind]}")
        return layer

    def skip(self, what: str, reason: str) -> None:
        self.skipped.append({"what": what, "reason": reason})
        self.log(f"[yellow]skip[/] {what}: {reason}")


@dataclass(kw_only=True, slots=True)
class BenchResult:
    opts: BenchOptions
    cfg: DSV4Config
    tokens_per_block: int
    ceilings: Ceilings
    rows: list[Row]
    skipped: list[dict[str, str]]
    meta: dict[str, Any]


def probe_backends(opts: BenchOptions, skip: Callable[[str, str], None]) -> dict[str, types.SimpleNamespace]:
    """The op namespaces that import and can run on opts.device; the others are skipped with a reason."""
    from dsv4.kernels.dispatch import ops_for

    out = {}
    for name in opts.backends:
        if name == "triton" and opts.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            skip("backend triton", f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1 for the CPU "
                                   f"interpreter); device is {opts.device.type}")
            continue
        try:
            out[name] = ops_for(opts.device, name)
        except Exception as e:
            skip(f"backend {name}", f"import failed: {short_reason(e)}")
    return out


def run(opts: BenchOptions, log: Callable[[str], None]) -> BenchResult:
    from dsv4.bench.decode import run_decode
    from dsv4.bench.prefill import run_prefill
    from dsv4.bench.report import finalize

    cfg, tpb = bench_config(opts.quick)
    ctx = BenchContext(opts=opts, cfg=cfg, tokens_per_block=tpb, timer=Timer(opts), log=log)
    with torch.no_grad():
        ceilings = measure_ceilings(opts)
        if ceilings.copy_gbps is not None:
            log(f"ceilings: copy {ceilings.copy_gbps:,.0f} GB/s, bf16 matmul {ceilings.mma_tflops:,.0f} TFLOP/s")
        else:
            log(f"ceilings: {ceilings.note}")
        ctx.ops = probe_backends(opts, ctx.skip)
        if not opts.hf:
            ctx.skip("transformers baseline", "--no-hf")
        for kind in opts.layers:
            ctx.blocks[kind] = make_block(cfg, LAYER_INDEX[kind], opts.device, opts.seed)
            if opts.fp8_weights and "triton" in ctx.ops:
                ctx.fp8_blocks[kind] = make_block(cfg, LAYER_INDEX[kind], opts.device, opts.seed)
                ctx.fp8_blocks[kind].quantize_weights()
        rows = run_decode(ctx) if opts.decode else []
        if opts.prefill:
            rows += run_prefill(ctx)
    finalize(rows, ceilings)
    return BenchResult(opts=opts, cfg=cfg, tokens_per_block=tpb, ceilings=ceilings, rows=rows,
                       skipped=ctx.skipped, meta=_meta(opts, cfg, tpb))


def _meta(opts: BenchOptions, cfg: DSV4Config, tpb: int) -> dict[str, Any]:
    import dsv4

    def version(mod: str) -> str | None:
        try:
            return __import__(mod).__version__
        except ImportError:
            return None

    dev = opts.device
    return {
        "dsv4": getattr(dsv4, "__version__", None), "torch": torch.__version__, "triton": version("triton"),
        "transformers": version("transformers"), "python": platform.python_version(),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type,
        "cuda": torch.version.cuda if dev.type == "cuda" else None,
        "model": cfg.name, "layers": {k: LAYER_INDEX[k] for k in opts.layers}, "tokens_per_block": tpb,
        "kv_format": opts.kv_format, "indexer_format": opts.indexer_format, "dtype": "bfloat16",
        "quick": opts.quick, "contexts": list(opts.contexts), "batches": list(opts.batches),
        "prefill": opts.prefill, "prefill_chunk": opts.prefill_chunk, "backends": list(opts.backends),
        "hf": opts.hf, "fp8_weights": opts.fp8_weights, "cuda_graphs": opts.graph, "warmup_ms": opts.warmup_ms,
        "rep_ms": opts.rep_ms,
    }
