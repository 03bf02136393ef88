"""Derived columns, targets, the printed tables, the JSON file and the PNG chart.

Derived per row (from its median µs, its counted bytes and FLOPs, and the run's ceilings):

    gbps, tflops          bytes / time, FLOPs / time
    pct_bw, pct_mma       of the measured copy bandwidth / bf16 matrix rate
    roofline_us           max(bytes / bandwidth, FLOPs / matrix rate): the floor no version beats
    pct_roofline, bound   roofline_us / us, and which term sets the floor ("bandwidth" | "compute")
    x_vs_reference        reference µs / this row's µs, same (kind, layer, context, batch, op)
    x_vs_hf               transformers µs / this row's µs, same case, op "layer" only

JSON (schema "dsv4.bench/1"):

    {"schema": "dsv4.bench/1",
     "meta":     {versions, device, model, formats, contexts, batches, prefill, options ...},
     "ceilings": {"copy_gbps", "mma_tflops", "copy_bytes", "copy_us", "matmul_n", "matmul_us", "note"},
     "rows":     [{"kind", "layer", "context", "batch", "op", "impl", "status", "reason", "mode",
                   "us", "us_eager", "bytes", "flops", "bytes_detail", "flops_detail", "note",
                   "gbps", "tflops", "pct_bw", "pct_mma", "roofline_us", "pct_roofline", "bound",
                   "x_vs_reference", "x_vs_hf"}, ...],
     "targets":  [{"name", "layer", "goal", "value", "met", "note"}, ...],
     "skipped":  [{"what", "reason"}, ...]}

Numbers that do not apply or were not measured are null (e.g. every % on CPU).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from dsv4.bench.ceilings import Ceilings
from dsv4.bench.common import FP8_IMPL, Row
from dsv4.errors import DSV4Error, InputError

SCHEMA = "dsv4.bench/1"
#: transformers' layer at B = 1, C = 128K as measured for the issue (µs, on an H200): a fallback
#: reference point only when this run has no transformers number of its own.
ISSUE_HF_US = {"csa": 5700.0, "hca": 3300.0}


# ------------------------------------------------------------------------------------------ derived
def finalize(rows: list[Row], ceilings: Ceilings) -> None:
    """Fill every row's derived columns in place."""
    by_key = {(r.key(), r.impl): r for r in rows if r.status == "ok" and r.us}
    for r in rows:
        if r.status != "ok" or not r.us:
            continue
        sec = r.us * 1e-6
        r.gbps, r.tflops = r.bytes / sec / 1e9, r.flops / sec / 1e12
        if ceilings.copy_gbps and ceilings.mma_tflops:
            r.pct_bw = 100 * r.gbps / ceilings.copy_gbps
            r.pct_mma = 100 * r.tflops / ceilings.mma_tflops
            t_bw = r.bytes / (ceilings.copy_gbps * 1e9)
            t_mma = r.flops / (ceilings.mma_tflops * 1e12)
            r.roofline_us = 1e6 * max(t_bw, t_mma)
            r.pct_roofline = 100 * r.roofline_us / r.us
            r.bound = "bandwidth" if t_bw >= t_mma else "compute"
        ref = by_key.get((r.key(), "reference"))
        if ref is not None and r.impl != FP8_IMPL:        # the reference rows hold bf16 weights
            r.x_vs_reference = ref.us / r.us
        hf = by_key.get((r.key(), "hf"))
        if hf is not None and r.op == "layer":
            r.x_vs_hf = hf.us / r.us


def _find(rows: list[Row], **want: Any) -> Row | None:
    for r in rows:
        if all(getattr(r, k) == v for k, v in want.items()):
            return r
    return None


def targets(rows: list[Row]) -> list[dict[str, Any]]:
    """The issue's targets, reported (never asserted), for the Triton backend."""
    out = []
    layers = sorted({r.layer for r in rows}, key=["csa", "hca"].index)
    for layer in layers:
        r = _find(rows, kind="decode", layer=layer, context=131072, batch=64, op="cache", impl="triton")
        out.append(_target("decode cache-side work, B=64, C=128K: % of roofline", layer, ">= 70", r,
                           None if r is None else r.pct_roofline, 70.0))
    for layer in layers:
        r = _find(rows, kind="decode", layer=layer, context=131072, batch=1, op="layer", impl="triton")
        t = _target("decode whole layer, B=1, C=128K: x faster than transformers", layer, ">= 30", r,
                    None if r is None else r.x_vs_hf, 30.0)
        if r is not None and r.status == "ok" and r.us and r.x_vs_hf is None:
            t["note"] = (f"no transformers number in this run; vs the issue's {ISSUE_HF_US[layer] / 1e3:.1f} ms "
                         f"(H200): {ISSUE_HF_US[layer] / r.us:.1f}x")
        out.append(_with_floor_note(t, r, 30.0))
    for layer in layers:
        r = _find(rows, kind="decode", layer=layer, context=131072, batch=1, op="layer", impl=FP8_IMPL)
        if r is not None:
            out.append(_with_floor_note(_target("decode whole layer with the checkpoint's FP8 weights, B=1, C=128K: "
                                                "x faster than transformers", layer, ">= 30", r, r.x_vs_hf, 30.0),
                                        r, 30.0))
    for layer in layers:
        r = next((x for x in rows if x.kind == "prefill" and x.layer == layer and x.op == "compress_flush"
                  and x.impl == "triton"), None)
        out.append(_target("prefill compression + flush: % of bandwidth roofline", layer, ">= 50", r,
                           None if r is None else r.pct_bw, 50.0))
    return out


def _with_floor_note(t: dict[str, Any], row: Row | None, need: float) -> dict[str, Any]:
    """A missed speed-up over transformers, put beside what the layer's own bytes allow: transformers'
    eager step moves with the host's CPU (H100s of this project measured 1.9-3.8 ms for the same HCA
    layer), while the step asked for may lie below the time its bytes take at the card's copy ceiling."""
    if t["met"] is False and row is not None and row.us and row.x_vs_hf and row.pct_bw:
        asked = row.x_vs_hf * row.us / need
        floor = row.us * row.pct_bw / 100
        t["note"] = (f"{need:.0f}x asks for {asked:,.1f} µs; this layer's bytes take {floor:,.1f} µs at the copy "
                     f"ceiling" + (": out of reach for these weights on this host" if floor > asked else ""))
    return t


def _target(name: str, layer: str, goal: str, row: Row | None, value: float | None, need: float) -> dict[str, Any]:
    note = None
    if row is None:
        note = "not measured in this run"
    elif row.status != "ok":
        note = f"{row.status}: {row.reason}"
    elif value is None:
        note = "needs the card's ceilings (CUDA)" if "%" in name else "no comparison number"
    return {"name": name, "layer": layer, "goal": goal, "value": value,
            "met": None if value is None else value >= need, "note": note}


# ------------------------------------------------------------------------------------------ output
def to_json(result: Any) -> dict[str, Any]:
    return {"schema": SCHEMA, "meta": result.meta, "ceilings": result.ceilings.to_dict(),
            "rows": [r.to_dict() for r in result.rows], "targets": targets(result.rows),
            "skipped": result.skipped}


def write_json(result: Any, path: str) -> None:
    try:
        with open(path, "w") as f:
            json.dump(to_json(result), f, indent=1)
            f.write("\n")
    except OSError as e:
        raise InputError(f"cannot write JSON to {path!r}: {e.strerror or e}") from None


def _ctx(n: int) -> str:
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20}M"
    if n >= 2**10 and n % 2**10 == 0:
        return f"{n // 2**10}K"
    return str(n)


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _rate(x: float | None) -> str:
    """GB/s: thousands separators on a GPU, significant digits for the tiny CPU smoke numbers."""
    return "-" if x is None else format(x, ",.0f" if x >= 100 else ".3g")


def print_report(result: Any) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    c = result.ceilings
    head = (f"copy {c.copy_gbps:,.0f} GB/s, bf16 matmul {c.mma_tflops:,.0f} TFLOP/s (measured)"
            if c.copy_gbps else f"ceilings {c.note}")
    console.print(f"\n[bold]dsv4 bench[/] {result.meta['model']} on {result.meta['device']}: {head}")
    groups = [("decode: whole attention layer", lambda r: r.kind == "decode" and r.op == "layer"),
              ("decode: cache-side ops", lambda r: r.kind == "decode" and r.op != "layer"),
              ("prefill", lambda r: r.kind == "prefill")]
    cols = ("layer", "context", "batch", "op", "impl", "mode", "µs", "µs eager", "GB moved", "GFLOP", "GB/s", "% BW",
            "% MMA", "% roof", "× vs ref", "× vs HF")
    for title, pick in groups:
        rows = [r for r in result.rows if pick(r)]
        if not rows:
            continue
        t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
        for i, col in enumerate(cols):
            t.add_column(col, justify="left" if i in (0, 3, 4, 5) else "right")
        for r in rows:
            ok = r.status == "ok"
            t.add_row(r.layer.upper(), _ctx(r.context), str(r.batch), r.op, r.impl, r.mode or "",
                      _num(r.us, ",.1f") if ok else f"[red]{r.status.upper()}[/]", _num(r.us_eager, ",.1f"),
                      _num(r.bytes / 1e9, ".4g"), _num(r.flops / 1e9, ".4g"), _rate(r.gbps),
                      _num(r.pct_bw, ".1f"), _num(r.pct_mma, ".1f"), _num(r.pct_roofline, ".1f"),
                      _num(r.x_vs_reference, ".1f"), _num(r.x_vs_hf, ".1f"))
        console.print(t)
        console.print()
    console.print("[bold]targets[/] (reported, not asserted)")
    for tg in targets(result.rows):
        met = {True: "[green]met[/]", False: "[red]missed[/]", None: "n/a"}[tg["met"]]
        val = _num(tg["value"], ".1f")
        console.print(f"  {tg['layer'].upper()} {tg['name']} {tg['goal']}: {val} {met}"
                      + (f" ({tg['note']})" if tg["note"] else ""))
    for s in result.skipped:
        console.print(f"[yellow]skipped[/] {s['what']}: {s['reason']}")
    failed: dict[tuple[str, str], int] = {}
    for r in result.rows:
        if r.status != "ok":
            k = (r.status, f"{r.impl} {r.op}: {r.reason}")
            failed[k] = failed.get(k, 0) + 1
    if failed:
        n = sum(failed.values())
        console.print(f"{n} case(s) not measured (each row's status and reason are in the JSON):")
        for (status, why), count in list(failed.items())[:12]:
            console.print(f"  {status.upper()} x{count}: {why}")


# ------------------------------------------------------------------------------------------ chart
def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise DSV4Error("--plot needs matplotlib: pip install 'dsv4[plot]' (or pip install matplotlib)") from None


def plot(result: Any, path: str) -> None:
    """2x2 chart: layer decode µs vs context (CSA, HCA), cache-side % of roofline, prefill µs.

    Decode panels: colour = implementation (cache-side: layer), marker and line style = batch size
    (with one context the points have no lines between them, so the marker must tell the batches
    apart); hollow markers for the FP8-weight layer (it often sits on the BF16 one) and, cache-side,
    for the reference. Prefill: bars grouped by layer and op, coloured by implementation."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display

    rows = [r for r in result.rows if r.status == "ok" and r.us]
    fig = Figure(figsize=(13, 9), layout="constrained")
    axes = fig.subplots(2, 2)
    color = {"triton": "C0", FP8_IMPL: "C2", "reference": "C1", "hf": "C3"}
    styles, markers = ("-", "--", ":", "-."), ("o", "^", "s", "D", "v", "P")
    batch_style = {b: (styles[i % len(styles)], markers[i % len(markers)]) for i, b in enumerate(result.opts.batches)}
    for ax, layer in zip(axes[0], ("csa", "hca")):
        for impl in ("triton", FP8_IMPL, "reference", "hf"):
            for b in result.opts.batches:
                pts = sorted((r.context, r.us) for r in rows if r.kind == "decode" and r.op == "layer"
                             and r.layer == layer and r.impl == impl and r.batch == b)
                if pts:
                    ls, mk = batch_style[b]
                    ax.plot(*zip(*pts), ls, color=color[impl], marker=mk, markersize=8 if impl == FP8_IMPL else 6,
                            markerfacecolor="none" if impl == FP8_IMPL else color[impl], label=f"{impl} B={b}")
        _axes(ax, f"{layer.upper()} layer decode (projections included)", "µs (median)", result.opts.contexts)
    ax = axes[1][0]
    for layer, col in (("csa", "C0"), ("hca", "C4")):
        for impl in ("triton", "reference"):
            for b in result.opts.batches:
                pts = sorted((r.context, r.pct_roofline) for r in rows if r.kind == "decode" and r.op == "cache"
                             and r.layer == layer and r.impl == impl and r.batch == b and r.pct_roofline)
                if pts:
                    ls, mk = batch_style[b]
                    ax.plot(*zip(*pts), ls, color=col, marker=mk, markersize=7,
                            markerfacecolor=col if impl == "triton" else "none", label=f"{layer.upper()} {impl} B={b}")
    ax.axhline(70, color="gray", lw=0.8, ls=":")
    if not ax.get_legend_handles_labels()[0]:
        ax.text(0.5, 0.5, "no % of roofline: the ceilings are measured on CUDA only", ha="center",
                va="center", transform=ax.transAxes, color="gray")
    _axes(ax, "cache-side decode work: % of roofline (target 70%)", "% of roofline", result.opts.contexts,
          logy=False)
    _prefill_bars(axes[1][1], [r for r in rows if r.kind == "prefill"], color, result.opts.prefill)
    fig.suptitle(f"dsv4 bench: {result.meta['model']} on {result.meta['device']}")
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise InputError(f"cannot write plot to {path!r}: {e.strerror or e}") from None


def _prefill_bars(ax: Any, pre: list[Row], color: dict[str, str], tokens: int) -> None:
    """One group of bars per (layer, op), one bar per implementation, a legend of implementations."""
    groups = list(dict.fromkeys((r.layer, r.op) for r in pre))
    impls = [i for i in color if any(r.impl == i for r in pre)]
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        xs, ys = [], []
        for g, (layer, op) in enumerate(groups):
            r = next((r for r in pre if (r.layer, r.op, r.impl) == (layer, op, impl)), None)
            if r is not None:
                xs.append(g - 0.4 + width * (j + 0.5))
                ys.append(r.us / 1e3)
        ax.bar(xs, ys, width, color=color[impl], label=impl)
    ax.set_xticks(range(len(groups)), [f"{layer.upper()}\n{op.replace('_', ' + ')}" for layer, op in groups])
    ax.set_yscale("log")
    ax.set_ylabel("ms (median)")
    ax.set_title(f"prefill of {_ctx(tokens)} tokens" if tokens else "prefill (not run)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    if impls:
        ax.legend(fontsize=7)


def _axes(ax: Any, title: str, ylabel: str, contexts: tuple[int, ...], logy: bool = True) -> None:
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    if contexts:
        ax.set_xticks(list(contexts), [_ctx(c) for c in contexts])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
