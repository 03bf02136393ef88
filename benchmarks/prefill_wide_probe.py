"""The wide prefill attention alone (CUDA, sm_90) on the last 8K chunk of a 32K prompt, in the layer's
form (bf16 queries, inverse rotation, bf16 output): a few calls per layer kind, then their mean time.
For Nsight Compute through `ncu_wide.sh`:

    KINDS=csa SCRIPT=prefill_wide_probe.py KERNEL=_prefill_wide_kernel bash benchmarks/ncu_wide.sh
    KINDS=csa,hca REPS=4 python benchmarks/prefill_wide_probe.py
"""

from __future__ import annotations

import os

import torch
from tune_common import DEV
from tune_prefill import prefill_chunk_args

from dsv4.bench.common import bench_config
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
        prefill_attention(*args, scheme="wide", **fin)              # compile
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            prefill_attention(*args, scheme="wide", **fin)
        end.record()
        torch.cuda.synchronize()
        print(f"{kind} T={n} wide prefill attention {start.elapsed_time(end) * 1e3 / reps:,.1f} µs (mean of {reps})")


if __name__ == "__main__":
    main()
