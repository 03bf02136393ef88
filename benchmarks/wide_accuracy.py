"""The wide decode attention's error against the fp32 reference (CUDA, sm_90): max |out - want| /
max |want| over ragged requests (1 .. 20,000 tokens; the window, 63-65 / 127-129 / 255-257
boundaries) of the CSA and HCA layers, at the default and 1 / 5 / 40 key splits.

    python benchmarks/wide_accuracy.py

Uses the tests' case builders (tests/test_triton_decode.py), so run it from the repo root.
"""

from __future__ import annotations

import sys

sys.path.insert(0, "tests")

import test_triton_decode as t
from attn_helpers import max_rel

LENS = (1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 4097, 20000)


def main() -> int:
    for name, layer in (("csa", t.CSA), ("hca", t.HCA)):
        args = list(t.attention_args("real", "fp8_ds", layer, 64, LENS, topk=512))
        want = t.ref.decode_attention(*args)
        errs = [max_rel(t.tri.decode_attention(*args, scheme="wide", num_splits=s), want) for s in (None, 1, 5, 40)]
        print(name, "wide max_rel vs fp32 reference, splits default/1/5/40:", " ".join(f"{e:.2e}" for e in errs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
