"""The wide prefill attention alone (CUDA, sm_90) on the last 8K chunk of a 32K prompt, in the layer's
form (bf16 queries, inverse rotation, bf16 output): a few calls per layer kind, then their mean time;
QNORM=1: the raw queries, normalised and rotated in the kernel (`q_norm`), as the layer now calls it,
timed beside norm_rope + the kernel on normalised ones. For Nsight Compute through `ncu_wide.sh`:

    KINDS=csa SCRIPT=prefill_wide_probe.py KERNEL=_prefill_wide_kernel bash benchmarks/ncu_wide.sh
    KINDS=csa,hca REPS=4 python benchmarks/prefill_wide_probe.py
"""

from __future__ import annotations

import os

import torch
from tune_common import DEV
from tune_prefill import prefill_chunk_args

from dsv4.bench.common import bench_config
from dsv4.kernels.triton.norm_rope import norm_rope
from dsv4.kernels.triton.prefill_attention import prefill_attention


def main() -> None:
    kinds = os.environ.get("KINDS", "csa,hca").split(",")
    reps = int(os.environ.get("REPS", 4))
    cfg, tpb = bench_config(False)
    for kind, args in prefill_chunk_args(cfg, tpb):
        if kind not in kinds:
            continue
        args = (args[0].bfloat16(), *args[1:])
        n = args[0].shape[0]
        fin = {"rope": (torch.rand(n, 32, device=DEV), torch.rand(n, 32, device=DEV)), "out_dtype": torch.bfloat16}
        calls = {"wide prefill attention": lambda args=args, fin=fin: prefill_attention(*args, scheme="wide", **fin)}
        if os.environ.get("QNORM") == "1":
            raw = args[0] * 37.0

            def normed_first(raw=raw, args=args, fin=fin):
                q = norm_rope(raw, None, 1e-6, *fin["rope"], out_dtype=torch.bfloat16)
                return prefill_attention(q, *args[1:], scheme="wide", **fin)

            def inside(raw=raw, args=args, fin=fin):
                return prefill_attention(raw, *args[1:], scheme="wide", **fin, q_norm=1e-6)

            calls.update({"norm_rope + wide": normed_first, "wide, q_norm inside": inside})
        for label, call in calls.items():
            call()                                                  # compile
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                call()
            end.record()
            torch.cuda.synchronize()
            print(f"{kind} T={n} {label} {start.elapsed_time(end) * 1e3 / reps:,.1f} µs (mean of {reps})")


if __name__ == "__main__":
    main()
