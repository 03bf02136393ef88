"""Run statistics of a generate() call, and their table (rich) / JSON forms.

Timing: every step is timed with `time.perf_counter` (after a CUDA synchronize on GPU). A step may
mix prefill chunks and decode tokens (continuous batching); its time is split between the two in
proportion to their token counts. Time to first token runs from the start of the call (every
request arrives then) to the moment its first token is sampled.

Cache memory: after each step the manager's `memory_report()`; "used" counts the blocks held plus
the state slots of the active requests, "allocated" the whole pools. Bytes per token is the used
bytes at the peak divided by the tokens then held in the cache (state slots included, so short
contexts pay for their window).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(kw_only=True, slots=True)
class StatsRecorder:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    peak_bytes_used: int = 0
    tokens_at_peak: int = 0
    bytes_allocated: int = 0
    ttfts: list[float] = field(default_factory=list)

    def add_step(self, prefill: int, decode: int, seconds: float, memory: dict[str, int], held_tokens: int) -> None:
        total = prefill + decode
        self.steps += 1
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        self.prefill_s += seconds * prefill / total
        self.decode_s += seconds * decode / total
        self.bytes_allocated = memory["bytes_allocated"]
        if memory["bytes_used"] > self.peak_bytes_used:
            self.peak_bytes_used, self.tokens_at_peak = memory["bytes_used"], held_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class RunStats:
    model: str
    device: str
    dtype: str
    kv_format: str
    weights: str                     # the attention projections: "dense" or "fp8 blocks (...)"
    indexer_format: str
    cuda_graphs: str                 # decode graphs: on/off/n/a and how many steps replayed
    requests: int
    completed: int
    rejected: int
    prompt_tokens: int               # of the requests served (rejected ones excluded)
    generated_tokens: int
    steps: int
    wall_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    ttft_mean_s: float
    ttft_max_s: float
    peak_cache_bytes_used: int
    cache_bytes_allocated: int
    cache_bytes_per_token: float

    @classmethod
    def build(cls, rec: StatsRecorder, *, wall_s: float, requests: int, completed: int, rejected: int,
              prompt_tokens: int, generated_tokens: int, **labels: str) -> RunStats:
        ttfts = rec.ttfts or [0.0]
        return cls(
            **labels, requests=requests, completed=completed, rejected=rejected, prompt_tokens=prompt_tokens,
            generated_tokens=generated_tokens, steps=rec.steps, wall_s=wall_s,
            prefill_tokens_per_s=rec.prefill_tokens / rec.prefill_s if rec.prefill_s else 0.0,
            decode_tokens_per_s=rec.decode_tokens / rec.decode_s if rec.decode_s else 0.0,
            ttft_mean_s=sum(ttfts) / len(ttfts), ttft_max_s=max(ttfts),
            peak_cache_bytes_used=rec.peak_bytes_used, cache_bytes_allocated=rec.bytes_allocated,
            cache_bytes_per_token=rec.peak_bytes_used / rec.tokens_at_peak if rec.tokens_at_peak else 0.0,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def human_bytes(b: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:,.2f} {unit}"
    return f"{int(b)} B"


def stats_table(s: RunStats, title: str = "dsv4 run"):
    """A rich Table of the run (two columns: what, value)."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("model", s.model),
        ("device / dtype", f"{s.device} / {s.dtype}"),
        ("cache formats", f"kv {s.kv_format}, indexer {s.indexer_format}"),
        ("attention weights", s.weights),
        ("decode CUDA graphs", s.cuda_graphs),
        ("requests", f"{s.requests} ({s.completed} completed, {s.rejected} rejected)"),
        ("prompt tokens", f"{s.prompt_tokens:,}"),
        ("generated tokens", f"{s.generated_tokens:,}"),
        ("steps", f"{s.steps:,}"),
        ("prefill", f"{s.prefill_tokens_per_s:,.1f} tok/s"),
        ("decode", f"{s.decode_tokens_per_s:,.1f} tok/s"),
        ("time to first token", f"mean {s.ttft_mean_s:,.2f} s, max {s.ttft_max_s:,.2f} s"),
        ("peak cache used / allocated",
         f"{human_bytes(s.peak_cache_bytes_used)} / {human_bytes(s.cache_bytes_allocated)}"),
        ("cache bytes per token", f"{s.cache_bytes_per_token:,.1f} B"),
        ("wall time", f"{s.wall_s:,.2f} s"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t
