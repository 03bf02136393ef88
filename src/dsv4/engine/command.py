"""The `dsv4 run` subcommand: serve prompts through the Engine, then print a table or JSON.

    dsv4 run                                  # built-in random model and prompts (CPU, seconds)
    dsv4 run --model CKPT_DIR --prompts prompts.jsonl --max-new-tokens 128 --memory 8GiB --json

Prompts file: one prompt per line, as text (needs the checkpoint's tokenizer) or as space-separated
token ids; or JSON lines {"ids": [...]} / {"text": "..."}. Blank lines are skipped.
`--seed` seeds sampling; the built-in model's weights always use the same fixed seed.
"""

from __future__ import annotations

import json

import torch

from dsv4.engine.default_model import DEFAULT_SEED, build_default_model, default_prompts
from dsv4.engine.engine import Engine, GenerationResult
from dsv4.errors import DSV4Error, InputError, OutOfBlocksError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise InputError(f"--device {name!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {name} but no CUDA device is available here: use --device cpu")
    return dev


def read_prompts(path: str, tokenizer) -> list[list[int]]:
    """Token ids per prompt from a text / ids / JSONL file (format of the module docstring)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read prompts file {path!r} ({getattr(e, 'strerror', None) or e}): "
                         "give a UTF-8 text file, one prompt per line") from None
    prompts = []
    for no, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        where = f"{path}:{no}"
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where} is not valid JSON ({e.msg}): write {{\"ids\": [...]}} or "
                                 "{\"text\": \"...\"}") from None
            if isinstance(obj.get("ids"), list) and all(isinstance(t, int) for t in obj["ids"]):
                prompts.append(obj["ids"])
            elif isinstance(obj.get("text"), str):
                prompts.append(_encode(obj["text"], tokenizer, where))
            else:
                raise InputError(f"{where}: a JSON prompt needs \"ids\" (a list of ints) or \"text\" (a string)")
        elif all(part.isdigit() for part in line.split()):
            prompts.append([int(part) for part in line.split()])
        else:
            prompts.append(_encode(line, tokenizer, where))
    if not prompts:
        raise InputError(f"prompts file {path!r} holds no prompt: write one per line")
    return prompts


def _encode(text: str, tokenizer, where: str) -> list[int]:
    if tokenizer is None:
        raise InputError(f"{where} is text but the model has no tokenizer: write the prompt as space-separated "
                         "token ids, or use a checkpoint with tokenizer files")
    return list(tokenizer(text)["input_ids"])


def run_from_args(args) -> int:
    """Run `dsv4 run` with parsed arguments (see `dsv4.cli._add_run` for the flags)."""
    device = resolve_device(args.device)
    threads = args.threads if args.threads is not None else (1 if args.model is None else None)
    if threads is not None:  # this is the process's entry point: the library itself never does this
        if threads < 1:
            raise InputError(f"--threads {threads}: give a positive number of CPU threads")
        torch.set_num_threads(threads)
    dtype = None if args.dtype == "auto" else DTYPES[args.dtype]
    opts = {"kv_format": args.kv_format, "indexer_format": args.indexer_format, "memory_bytes": args.memory,
            "max_requests": args.max_requests, "device": device, "max_batch_tokens": args.max_batch_tokens,
            "dtype": dtype, "cuda_graphs": not args.no_cuda_graphs, "fp8_weights": args.fp8_weights}
    if args.model is None:
        engine = Engine(build_default_model(DEFAULT_SEED), **opts)
        engine.name = "built-in random DSV4 (4 layers: SWA, CSA, HCA, CSA)"
    else:
        engine = Engine(args.model, **opts)
    prompts = (read_prompts(args.prompts, engine.tokenizer) if args.prompts
               else default_prompts(engine.vocab_size))
    try:
        result = engine.run(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, progress=True)
    except OutOfBlocksError as e:  # the same failure, in the command line's words
        raise DSV4Error(f"no request fits in the cache: the smallest needs {e.needed} blocks but the cache has "
                        f"{e.free}; give more --memory, leave --memory out (the cache is then sized to the "
                        "requests), or lower --max-new-tokens") from None
    if args.json:
        print(json.dumps(to_json(result, prompts, engine.tokenizer), indent=2))
    else:
        print_result(result)
    return 0


def to_json(result: GenerationResult, prompts: list[list[int]], tokenizer) -> dict:
    reqs = []
    for i, (p, out, why) in enumerate(zip(prompts, result.outputs, result.finish_reasons)):
        r = {"index": i, "prompt_tokens": len(p), "generated_tokens": len(out), "finish_reason": why,
             "generated_ids": out}
        if why == "rejected":
            r["rejected_because"] = result.rejected[i]
        if tokenizer is not None:
            r["generated_text"] = tokenizer.decode(out)
        reqs.append(r)
    return result.stats.to_dict() | {"per_request": reqs}


def print_result(result: GenerationResult) -> None:
    from rich.console import Console

    from dsv4.engine.report import stats_table

    console = Console(highlight=False, width=max(100, Console().width))
    console.print(stats_table(result.stats))
    for i, why in sorted(result.rejected.items()):
        console.print(f"request {i} rejected: {why} (give more --memory or fewer --max-new-tokens)")

