"""`dsv4 bench`: decode and prefill of one CSA and one HCA layer at V4-Flash shapes.

    dsv4 bench                                   # contexts 8K,128K,1M x batches 1,16,64, prefill 32K
    dsv4 bench --contexts 128K --batches 64 --layers csa --no-hf --json out.json --plot out.png
    dsv4 bench --quick                           # tiny shapes: a smoke run that works on CPU

Every case reports the median µs after warm-up, the bytes and FLOPs it must move / do
(`dsv4.bench.counts`), the fraction of the card's measured copy bandwidth and bf16 matrix rate
(`dsv4.bench.ceilings`), and ratios against our PyTorch reference and transformers'
`DeepseekV4Attention` measured in the same run. Modules:

    common    options, result row, the benchmarked config      counts    bytes / FLOPs model
    timing    event medians, CUDA graphs, OOM per case        ceilings  copy + matmul ceilings
    setup     synthetic valid cache states, random layers      hf        transformers baseline
    decode    decode-step cases                                prefill   prefill cases
    runner    one run                                          report    table, JSON, PNG, targets
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

import torch

from dsv4.bench.common import BenchOptions
from dsv4.errors import DSV4Error

__all__ = ["BenchOptions", "build_parser", "main", "options_from_args"]

_FULL = {"contexts": (8192, 131072, 1048576), "batches": (1, 16, 64), "prefill": 32768, "chunk": 8192}
_QUICK = {"contexts": (64, 256), "batches": (1, 3), "prefill": 128, "chunk": 64}


def _tokens(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad token count {text!r}: give an integer or K / M (x1024 / x1048576)")
    return int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20}[m.group(2).upper()]


def _int_list(text: str) -> tuple[int, ...]:
    vals = tuple(_tokens(t) for t in text.split(",") if t.strip())
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list of positive integers")
    return vals


def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        vals = tuple(dict.fromkeys(t.strip().lower() for t in text.split(",") if t.strip()))
        bad = [v for v in vals if v not in allowed]
        if not vals or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(allowed)}")
        return vals
    parse.__name__ = "list"
    return parse


def build_parser(prog: str = "dsv4 bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Decode and prefill benchmarks of one CSA and one HCA layer (V4-Flash shapes): "
        "median µs, bytes, FLOPs, % of the card's measured bandwidth / matrix rate, and ratios against the "
        "PyTorch reference and transformers' DeepseekV4Attention.")
    p.add_argument("--contexts", type=_int_list, help="decode contexts, e.g. 8K,128K,1M (default 8192,131072,1048576)")
    p.add_argument("--batches", type=_int_list, help="decode batch sizes (default 1,16,64)")
    p.add_argument("--layers", type=_choices(("csa", "hca")), default=("csa", "hca"), help="csa,hca (default both)")
    p.add_argument("--backends", type=_choices(("triton", "reference")), default=("triton", "reference"),
                   help="our implementations to time (default triton,reference)")
    p.add_argument("--prefill", type=_tokens, help="prefill prompt length, 0 = none (default 32768)")
    p.add_argument("--prefill-chunk", type=_tokens, help="tokens per prefill forward (default 8192)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode cases")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' DeepseekV4Attention")
    p.add_argument("--no-reference", action="store_true", help="skip our PyTorch reference backend")
    p.add_argument("--no-fp8-weights", action="store_true",
                   help="skip the decode layer rows whose projections hold the checkpoint's FP8 block weights")
    p.add_argument("--no-graph", action="store_true", help="time Triton decode work eagerly, not as CUDA graphs")
    p.add_argument("--quick", action="store_true", help="tiny shapes and short timings (a CPU smoke run)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--kv-format", default="fp8_ds", choices=("fp8_ds", "bf16", "fp32"))
    p.add_argument("--indexer-format", default="mxfp4", choices=("mxfp4", "fp8", "nvfp4", "bf16", "fp32"))
    p.add_argument("--warmup-ms", type=float, help="warm-up budget per timed case, ms (default 25; quick 5)")
    p.add_argument("--rep-ms", type=float, help="repetition budget per timed case, ms (default 100; quick 20)")
    p.add_argument("--reps", type=int,
                   help="timed runs of multi-chunk prefills and of CPU timings (default 3; quick 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write every row, the ceilings and the targets as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="write a PNG chart (needs matplotlib)")
    return p


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    d = _QUICK if args.quick else _FULL
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DSV4Error("--device cuda: no CUDA device is visible; use --device cpu (with --quick)")
    backends = tuple(b for b in args.backends if not (args.no_reference and b == "reference"))
    prefill = d["prefill"] if args.prefill is None else args.prefill
    return BenchOptions(
        device=device, contexts=args.contexts or d["contexts"], batches=args.batches or d["batches"],
        layers=args.layers, backends=backends, prefill=prefill,
        prefill_chunk=args.prefill_chunk or d["chunk"], decode=not args.no_decode, hf=not args.no_hf,
        graph=not args.no_graph, quick=args.quick, kv_format=args.kv_format, indexer_format=args.indexer_format,
        warmup_ms=args.warmup_ms or (5.0 if args.quick else 25.0),
        rep_ms=args.rep_ms or (20.0 if args.quick else 100.0),
        host_warmup=1, host_reps=args.reps or (2 if args.quick else 3), seed=args.seed,
        fp8_weights=not args.no_fp8_weights)


def main(argv: Sequence[str] | None = None, prog: str = "dsv4 bench") -> int:
    """`dsv4 bench ARGS` (argv: the arguments after "bench"; None = sys.argv[1:]): run, print the
    tables, write --json / --plot. Returns the exit status (2 for a usage error)."""
    from rich.console import Console

    from dsv4.bench import report, runner

    args = build_parser(prog).parse_args(list(argv) if argv is not None else None)
    console = Console(highlight=False, stderr=False)
    try:
        opts = options_from_args(args)
        if args.plot:
            report.require_matplotlib()       # before a long run, not after it
        if opts.device.type == "cpu" and not opts.quick:
            console.print("[yellow]warning[/]: V4-Flash shapes on CPU are very slow; add --quick for a smoke run")
        result = runner.run(opts, lambda msg: console.print(msg, style="dim"))
        report.print_report(result)
        if args.json:
            report.write_json(result, args.json)
            console.print(f"wrote {args.json}")
        if args.plot:
            report.plot(result, args.plot)
            console.print(f"wrote {args.plot}")
    except DSV4Error as e:
        print("dsv4 bench: error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    return 0
