"""Where the wide decode attention's time goes at V4-Flash shapes (CUDA): the op (kernel + split
combine), the kernel alone, the kernel with no key tile (its fixed cost: q, the epilogue's partial
stores, launch), and the combine alone, per scheme and split count.

    CTX=131072 BATCHES=64 SCHEMES="wide;halves" SPLITS="1,2" KINDS="csa,hca" python benchmarks/wide_phases.py

(SPLITS 0: the default split count.) The op and the combine take the output as the decode layer asks
for it: bf16, de-rotated by the combine (`LAYER_FORM=0`: fp32 and not rotated, the form of the earlier
rounds' rows).

Times are CUDA-graph replays with the L2 flushed (`dsv4.bench.timing.Timer`), µs.
"""

from __future__ import annotations

import os
import types

import torch
from tune_common import attention_case

from dsv4.bench import setup as bs
from dsv4.bench.common import bench_config
from dsv4.bench.timing import Timer
from dsv4.kernels.triton import decode_attention as att
from dsv4.kernels.triton import decode_combine as dcm


def _phases(timer: Timer, mod, name: str, aargs: tuple, scheme: str, splits: int,
            sinks: torch.Tensor, form: dict) -> tuple[float, ...]:
    """µs of the op, its kernel (the arguments the op passed, caught by a spy), the kernel with no
    key tile (ring 0, no entries: every split's loop empty), and the combine of its partials."""
    seen = {}
    real = getattr(mod, name)

    def spy(*a, **kw):
        seen["args"], seen["kw"] = a, kw
        seen["out"] = real(*a, **kw)
        return seen["out"]

    setattr(mod, name, spy)
    try:
        op = timer.time(lambda: att.decode_attention(*aargs, scheme=scheme, num_splits=splits or None, **form),
                        graph=True)
    finally:
        setattr(mod, name, real)
    a, kw = seen["args"], seen["kw"]
    kernel = timer.time(lambda: real(*a, **kw), graph=True)
    empty = a[:4] + (0,) + a[5:8] + (0,) + a[9:]
    fixed = timer.time(lambda: real(*empty, **kw), graph=True)
    part, pml = seen["out"]
    comb = timer.time(lambda: dcm.combine(part, pml, sinks, form.get("rope"), form.get("out_dtype"), 512, 8, True),
                      graph=True)
    return op.us, kernel.us, fixed.us, comb.us


def main() -> int:
    dev = torch.device("cuda")
    ctx = int(os.environ.get("CTX", 131072))
    batches = [int(x) for x in os.environ.get("BATCHES", "64").split(",")]
    schemes = os.environ.get("SCHEMES", "wide").split(";")
    splits = [int(x) for x in os.environ.get("SPLITS", "1,2").split(",")]
    timer = Timer(types.SimpleNamespace(device=dev, warmup_ms=10, rep_ms=50, host_warmup=3, host_reps=15, graph=True))
    cfg, tpb = bench_config(False)
    values = {"wide": (att.dw, "value_wide"), "halves": (att.dh, "value_halves")}
    for bsz in batches:
        st = bs.build_decode_state(cfg, context=ctx, batch=bsz, device=dev, tokens_per_block=tpb,
                                   kv_format="fp8_ds", indexer_format="mxfp4")
        for kind in os.environ.get("KINDS", "csa,hca").split(","):
            aargs = attention_case(st, kind, bsz, ctx, dev)
            sinks = aargs[13]
            form = {}
            if os.environ.get("LAYER_FORM", "1") == "1":   # the angles' values do not change the work
                ang = torch.rand(bsz, 32, device=dev) * 6.28
                form = {"rope": (ang.cos(), ang.sin()), "out_dtype": torch.bfloat16}
            for label in schemes:
                mod, name = values[label]
                scheme = label
                for s in splits:
                    op, kernel, fixed, comb = _phases(timer, mod, name, aargs, scheme, s, sinks, form)
                    print(f"{kind} B={bsz} C={ctx} {label:12} splits={s}: op {op:6.1f}  kernel {kernel:6.1f}"
                          f"  no-tile kernel {fixed:6.1f}  combine {comb:6.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
