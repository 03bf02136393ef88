"""Prefill benchmark of one CSA and one HCA layer (V4-Flash shapes): `dsv4 bench` without decode.

    python benchmarks/bench_prefill.py                                 # a 32K prompt in 8K chunks
    python benchmarks/bench_prefill.py --prefill 64K --prefill-chunk 16K --json prefill.json

Compression + flush (compress_update + write_entries), the whole AttentionSubBlock prefill, and
transformers' DeepseekV4Attention (one shot, else chunked): median µs, bytes, FLOPs, % of the
card's measured bandwidth / matrix rate. Any `dsv4 bench` flag works here.
"""

from __future__ import annotations

import sys

from dsv4.bench import main

if __name__ == "__main__":
    sys.exit(main(["--no-decode", *sys.argv[1:]]))
