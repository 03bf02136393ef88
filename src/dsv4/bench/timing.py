"""Timing: medians after warm-up, CUDA graphs for launch-bound work, OOM caught per case.

On CUDA, a single launchable region is timed as `triton.testing.do_bench(return_mode="median")`
does it: CUDA events around each call, the L2 cache flushed before every call (cold inputs), warm-up
and repetition budgets in milliseconds. The flush reads a 256 MB buffer rather than writing one (as
do_bench does): a written flush leaves the L2 full of dirty lines that the timed call's own reads
evict, so DRAM writes them back inside the timed region (benchmarks/l2_flush_check.py: a 32 MB read
19.7 µs after a written flush, 16.6 µs after a read one, H200). The read flush leaves clean lines:
the call still finds none of its data in the L2. Work that must replan on the host between device regions
(a multi-chunk prefill) is timed region by region with CUDA events and summed per run, each
region's kernels queued behind a spin kernel so the host's enqueue latency is not counted (an
engine's host runs ahead of the GPU); the median is over runs. On CPU everything uses
`time.perf_counter` medians (for smoke runs only).
"""

from __future__ import annotations

import gc
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dsv4.bench.common import BenchOptions, Unavailable, short_reason


@dataclass(kw_only=True, slots=True)
class Timing:
    us: float
    mode: str                     # graph | eager | host | device
    us_eager: float | None = None
    note: str | None = None


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()  # CPU allocator failures and some CUDA paths raise a plain RuntimeError
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def free_memory(collect: bool = False) -> None:
    """Return cached CUDA blocks to the driver; collect=True first breaks reference cycles (slow with
    transformers imported: only after a failure, whose traceback may hold tensors)."""
    if collect:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def guarded(fn: Callable[[], Any]) -> tuple[str, Any, str | None]:
    """Run fn() -> ("ok", result, None) | ("oom" | "skipped" | "error", None, reason). Never raises
    (KeyboardInterrupt excepted): one case failing must not end the run."""
    try:
        return "ok", fn(), None
    except Unavailable as e:
        return "skipped", None, str(e)
    except Exception as e:
        status, reason = ("oom" if is_oom(e) else "error"), short_reason(e)
    free_memory(collect=True)  # after the except block: the traceback's frames (and tensors) are gone
    return status, None, reason


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    def __init__(self, opts: BenchOptions):
        self.device = opts.device
        self.warmup_ms, self.rep_ms = opts.warmup_ms, opts.rep_ms
        self.host_warmup, self.host_reps = opts.host_warmup, opts.host_reps
        self.graph = opts.graph and self.device.type == "cuda"

    # ------------------------------------------------------------------ one region
    def time(self, fn: Callable[[], Any], *, graph: bool = False) -> Timing:
        """Median µs of fn(). graph=True (CUDA): also capture fn in a CUDA graph and report the
        replay time (the eager time goes to `us_eager`); a failed capture falls back to eager."""
        if self.device.type != "cuda":
            return Timing(us=self._host_median(fn), mode="host")
        eager = self._median(fn)
        if not (graph and self.graph):
            return Timing(us=eager, mode="eager")
        try:
            g = _capture(fn)
        except Exception as e:
            free_memory(collect=True)
            return Timing(us=eager, mode="eager", note=f"graph capture failed: {short_reason(e, 100)}")
        try:
            return Timing(us=self._median(g.replay), mode="graph", us_eager=eager)
        finally:
            del g
            free_memory()

    def _median(self, fn: Callable[[], Any]) -> float:
        return _event_median(fn, self.warmup_ms, self.rep_ms, self.device)

    def _host_median(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.host_warmup):
            fn()
        samples = []
        for _ in range(self.host_reps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(samples)

    # ------------------------------------------------------------------ several regions per run
    def time_regions(self, run: Callable[[Callable[[Callable[[], Any]], None]], None], *,
                     synced_too: bool = False) -> Timing:
        """Median over runs of the summed device time of the regions one run marks.

        `run(region)` does one whole run (e.g. a chunked prefill of a fresh request); it calls
        `region(fn)` around each piece of device work to time, doing host planning in between.

        On CUDA each region is device time: the L2 is flushed, then a spin kernel
        (`torch.cuda._sleep`, longer than the host takes to enqueue the region) runs ahead of the
        start event, so the region's kernels run back to back as in an engine whose host runs
        ahead of the GPU (mode "device"). synced_too: also time runs whose regions start right
        after a synchronize, host enqueue latency included (`us_eager`).
        """
        cuda = self.device.type == "cuda"
        flush = _flush_buffer(self.device) if cuda else None
        host_s = 1e-3                          # the host's enqueue time of the longest region so far
        waits = 0                              # host waits on the device inside the calibration run's regions

        def one_run(ahead: bool, calibrate: bool = False) -> float:
            nonlocal host_s
            total = 0.0

            def region(fn: Callable[[], Any]) -> None:
                nonlocal total, host_s, waits
                _sync(self.device)
                if not cuda:
                    t0 = time.perf_counter()
                    fn()
                    total += 1e6 * (time.perf_counter() - t0)
                    return
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if ahead:
                    flush.sum()
                    torch.cuda._sleep(int(2e9 * 2 * host_s))    # ~2 GHz SM clock: twice the enqueue time
                a.record()
                t0 = time.perf_counter()
                if calibrate:
                    waits += _host_waits(fn)
                    host_s = max(host_s, time.perf_counter() - t0)
                else:
                    fn()
                b.record()
                b.synchronize()
                total += 1e3 * a.elapsed_time(b)

            run(region)
            return total

        # The spin ahead of a region lasts twice the longest enqueue time of the calibration run: a
        # run without spins after a first one that compiles. Timed runs do not resize it: a region
        # that synchronises inside (the reference's host reads) would see the spin in its host time
        # and double it run after run.
        one_run(False)
        one_run(False, calibrate=True)
        for _ in range(self.host_warmup):
            one_run(True)
        samples = [one_run(True) for _ in range(self.host_reps)]
        synced = [one_run(False) for _ in range(self.host_reps)] if cuda and synced_too else []
        # A region whose host waits on the device lets the spin run out: its kernels after the wait
        # go at the host's pace, so the row is not device time alone (benchmarks/prefill_gaps.py)
        note = f"the host waited on the device {waits}x inside a run's regions" if waits else None
        return Timing(us=statistics.median(samples), mode="device" if cuda else "host",
                      us_eager=statistics.median(synced) if synced else None, note=note)


def _host_waits(fn: Callable[[], Any]) -> int:
    """Run fn() (CUDA), counting the synchronizing calls torch makes inside it (sync debug mode "warn")."""
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    return sum("synchronizing" in str(w.message) for w in seen)


def _capture(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph (warmed up on a side stream first, as PyTorch requires)."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def _flush_buffer(device: torch.device) -> torch.Tensor:
    """256 MB whose `sum()` (a read) evicts the L2 (50 MB on an H200) and leaves it clean."""
    return torch.ones(64 * 2**20, dtype=torch.int32, device=device)


def _event_median(fn: Callable[[], Any], warmup_ms: float, rep_ms: float, device: torch.device) -> float:
    """do_bench's method (median of per-call CUDA event times after warm-up), the L2 flushed by a
    256 MB read before each timed call."""
    flush = _flush_buffer(device)
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        flush.sum()
        fn()
    b.record()
    torch.cuda.synchronize()
    est = max(a.elapsed_time(b) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    samples = []
    for _ in range(max(1, int(rep_ms / est))):
        flush.sum()
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b))
    return 1e3 * statistics.median(samples)
