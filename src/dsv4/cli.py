"""The `dsv4` command line.

    dsv4 plan --model flash --context 1048576 --memory 80GiB     # memory plan (dsv4.planner)
    dsv4 run                                                    # generate on the cache (dsv4.engine)

Each subcommand is a pair of functions: `_add_<name>(subparsers)` declares its arguments and
`_cmd_<name>(args) -> int` runs it. The math lives in library modules; this file parses, prints
and turns `dsv4.errors.DSV4Error` into one line `dsv4: error: ...` on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation

from dsv4 import __version__
from dsv4.errors import ConfigError, DSV4Error, InputError
from dsv4.model.config import DSV4Config

EXIT_USAGE = 2

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


# ------------------------------------------------------------------------------------------ parsing
def parse_size(text: str) -> int:
    """'80GiB' -> 85899345920. Plain bytes, KiB/MiB/GiB/TiB (binary) or KB/MB/GB/TB (decimal)."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise InputError(f"bad memory size {text!r}: give bytes or a number with KiB/MiB/GiB/TiB (binary) "
                         "or KB/MB/GB/TB (decimal), e.g. 80GiB")
    try:
        return int(Decimal(m.group(1)) * _SIZE_UNITS[unit])
    except InvalidOperation:  # pragma: no cover - the regex admits only decimal numbers
        raise InputError(f"bad memory size {text!r}") from None


def parse_tokens(text: str) -> int:
    """'1048576', '128K' or '1M' (binary: 1K = 1024 tokens) -> a token count."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m:
        raise InputError(f"bad token count {text!r}: give an integer, or K/M (x1024, x1048576), e.g. 1M")
    return int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20}[m.group(2).upper()]


def load_model(spec: str) -> DSV4Config:
    """`flash`, `pro`, or a checkpoint directory / config.json path."""
    presets = {"flash": DSV4Config.flash, "pro": DSV4Config.pro}
    if spec.lower() in presets:
        return presets[spec.lower()]()
    if not os.path.exists(spec):
        raise ConfigError(f"unknown model {spec!r}: use flash, pro, or a checkpoint directory or config.json path")
    return DSV4Config.from_hf(spec)


def _arg(parse):
    """Adapt a parser raising InputError to argparse (its message, not 'invalid value')."""
    def wrapped(text: str):
        try:
            return parse(text)
        except InputError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    wrapped.__name__ = parse.__name__
    return wrapped


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, like every other dsv4 error
        self.exit(EXIT_USAGE, f"dsv4: error: {message} (see '{self.prog} --help')\n")


# ------------------------------------------------------------------------------------------ dsv4 plan
def _add_plan(sub: argparse._SubParsersAction) -> None:
    from dsv4.cache.formats import INDEXER_FORMATS, MAIN_FORMATS

    p = sub.add_parser("plan", help="memory plan: bytes per token and request, concurrent requests",
                       description="Price the compressed KV cache of a DSV4 model at one context and memory "
                                   "budget, next to a BF16 cache, an uncompressed cache and a V3.2-style cache.")
    p.add_argument("--model", default="flash", help="flash, pro, or a checkpoint directory / config.json")
    p.add_argument("--context", type=_arg(parse_tokens), default=2**20,
                   help="tokens per request (1M = 1048576; default 1M)")
    p.add_argument("--memory", type=_arg(parse_size), default=80 * 2**30,
                   help="cache memory budget, e.g. 80GiB or 141GB (default 80GiB)")
    p.add_argument("--kv-format", choices=MAIN_FORMATS, default="fp8_ds")
    p.add_argument("--indexer-format", choices=INDEXER_FORMATS, default="mxfp4")
    p.add_argument("--tokens-per-block", type=int, default=256)
    p.add_argument("--max-requests", type=int, default=None,
                   help="fixed number of request slots (KVCacheManager max_requests=); default: as many as fit")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--plot", metavar="FILE.png", help="draw memory per request vs context (needs matplotlib)")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from dsv4 import planner

    if args.plot:
        _require_matplotlib()  # check before printing anything
    cfg = load_model(args.model)
    plan = planner.plan_memory(cfg, context=args.context, memory_bytes=args.memory, kv_format=args.kv_format,
                               indexer_format=args.indexer_format, tokens_per_block=args.tokens_per_block,
                               max_requests=args.max_requests)
    rows = planner.compare(cfg, plan)
    if args.plot:
        _plot(cfg, args.plot, args.tokens_per_block)
    if args.json:
        out = plan.to_dict() | {"comparisons": [dataclasses.asdict(r) for r in rows]}
        if args.plot:
            out["plot"] = args.plot
        print(json.dumps(out, indent=2))
    else:
        _print_plan(plan, rows, plot=args.plot)
    return 0


def _print_plan(plan, rows, *, plot: str | None) -> None:
    """Tables sized for an 80-column terminal."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    def n(x: float, nd: int = 0) -> str:
        return f"{x:,.{nd}f}"

    def table(title: str, cols: tuple[str, ...]) -> Table:
        t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
        for i, col in enumerate(cols):
            t.add_column(col, justify="right" if i else "left")
        return t

    console = Console(highlight=False)
    console.print(f"[bold]dsv4 plan[/] {plan.model}: kv {plan.kv_format}, indexer {plan.indexer_format}, "
                  f"{plan.tokens_per_block} tokens/block\n"
                  f"context {n(plan.context)} tokens, memory {_human(plan.memory_bytes)}\n")
    t = table("Per layer type (history bytes per token = entry bytes / ratio)",
              ("type", "layers", "ratio", "entry B", "B/token\nper layer", "B/token", "state B\nper layer",
               "state B\nper request"))
    for lt in plan.layer_types:
        entry = "-" if not lt.compress_ratio else f"{lt.main_entry_bytes}" + (
            f"+{lt.indexer_entry_bytes}" if lt.indexer_entry_bytes else "")
        t.add_row(lt.attn_type.upper(), str(lt.layers), str(lt.compress_ratio or "-"), entry,
                  f"{lt.bytes_per_token_per_layer:,.6g}" if lt.compress_ratio else "-", n(lt.bytes_per_token, 2),
                  n(lt.state_bytes_per_layer),
                  n(lt.state_bytes_per_layer * lt.layers))
    t.add_row("total", str(sum(lt.layers for lt in plan.layer_types)), "", "", "",
              n(plan.compressed_bytes_per_token, 2), "", n(plan.state_bytes_per_request), style="bold")
    console.print(t)
    console.print()
    facts = [
        ("compressed history", (f"{n(plan.compressed_bytes_per_token, 2)} B/token "
                                f"({n(plan.paged_bytes_per_token, 2)} with page padding)")),
        ("state per request", (f"{n(plan.state_bytes_per_request)} B = {_human(plan.state_bytes_per_request)} "
                               "(window ring + compressor state)")),
        ("block", f"{n(plan.block_bytes)} B = {plan.tokens_per_block} tokens in every compressed layer"),
        ("blocks per request", n(plan.blocks_per_request)),
        ("bytes per request", f"{n(plan.bytes_per_request)} B = {_human(plan.bytes_per_request)}"),
        ("max concurrent requests", f"[bold]{plan.max_concurrent_requests}[/] in {_human(plan.memory_bytes)}"),
    ]
    if plan.max_requests:  # the KVCacheManager(max_requests=..., memory_bytes=...) that realises the plan
        facts += [("manager max_requests", str(plan.max_requests)),
                  ("manager num_blocks", f"{n(plan.num_blocks)} (null block included)")]
    for key, value in facts:
        console.print(f"{key:<24} {value}")
    console.print()
    c = table(f"Same context and memory ({n(plan.context)} tokens, {_human(plan.memory_bytes)})",
              ("cache", "B/token", "state B\nper request", "blocks\nper request", "bytes\nper request",
               "max\nrequests"))
    for r in rows:
        c.add_row(r.name, n(r.bytes_per_token, 2), n(r.state_bytes_per_request), n(r.blocks_per_request),
                  _human(r.bytes_per_request), str(r.max_concurrent_requests))
    console.print(c)
    if plot:
        console.print(f"wrote {plot}")


def _human(b: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:,.2f} {unit}"
    return f"{int(b)} B"


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise DSV4Error("--plot needs matplotlib: pip install 'dsv4[plot]' (or pip install matplotlib)") from None


def _plot(cfg: DSV4Config, path: str, tokens_per_block: int) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend

    from dsv4 import planner

    contexts = [2**k for k in range(10, 21) if 2**k <= cfg.max_position_embeddings]
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for name, ys in planner.context_sweep(cfg, contexts, tokens_per_block=tokens_per_block).items():
        ax.plot(contexts, [y / 2**30 for y in ys], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(contexts, [f"{c // 2**20}M" if c >= 2**20 else f"{c // 2**10}K" for c in contexts])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("KV cache per request (GiB)")
    ax.set_title(f"{cfg.name}: KV cache memory per request")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise InputError(f"cannot write plot to {path!r}: {e.strerror or e}") from None


# ------------------------------------------------------------------------------------------ dsv4 run
def _add_run(sub: argparse._SubParsersAction) -> None:
    from dsv4.cache.formats import INDEXER_FORMATS, MAIN_FORMATS

    p = sub.add_parser("run", help="generate with continuous batching on the compressed cache (dsv4.engine)",
                       description="Serve prompts through dsv4.engine.Engine and report throughput, time to first "
                                   "token and cache memory. With no arguments: a built-in tiny random DSV4 model "
                                   "and built-in prompts, on the CPU in seconds.")
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (config.json + *.safetensors, "
                                                  "transformers or DeepSeek weight names); default: built-in model")
    p.add_argument("--prompts", metavar="FILE", help="one prompt per line: text (needs the checkpoint's tokenizer) "
                                                     'or space-separated token ids; or JSONL {"ids": [...]} / '
                                                     '{"text": ...}; default: built-in prompts')
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    p.add_argument("--max-batch-tokens", type=int, default=1024,
                   help="tokens per forward step, summed over requests; prompts prefill in chunks (default 1024)")
    p.add_argument("--max-requests", type=int, default=8, help="requests served at once (default 8)")
    p.add_argument("--kv-format", choices=MAIN_FORMATS, default="fp8_ds")
    p.add_argument("--indexer-format", choices=INDEXER_FORMATS, default="mxfp4")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda, cuda:N")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="compute dtype (auto: the checkpoint's; float32 for the built-in model)")
    p.add_argument("--memory", type=_arg(parse_size), default=None,
                   help="cache memory budget, e.g. 4GiB (default: enough for the requests served at once)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: 1 for the built-in model, whose ops are too small to "
                        "share; torch's default otherwise)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on CUDA")
    p.add_argument("--fp8-weights", action="store_true",
                   help="hold the attention projections DeepSeek-V4 ships in FP8 as FP8 blocks (e4m3 + a scale per "
                        "128x128): half their memory and batch-1 read time; an FP8 checkpoint's own weights are kept")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    from dsv4.engine.command import run_from_args

    return run_from_args(args)


# ------------------------------------------------------------------------------------------ entry point
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dsv4", description="Paged, compressed KV cache for DeepSeek-V4 attention.")
    parser.add_argument("--version", action="version", version=f"dsv4 {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    _add_plan(sub)
    _add_run(sub)
    # `dsv4 bench` parses its own arguments (dsv4.bench.main); listed here for --help.
    sub.add_parser("bench", help="time the kernels and the attention layer (dsv4 bench --help)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from dsv4.bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DSV4Error as e:
        print("dsv4: error: " + " ".join(str(e).split()), file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
