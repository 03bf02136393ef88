"""Decode-step benchmark of one CSA and one HCA layer (V4-Flash shapes): `dsv4 bench` without prefill.

    python benchmarks/bench_decode.py                                  # 8K,128K,1M x batch 1,16,64
    python benchmarks/bench_decode.py --contexts 128K --batches 64 --json decode.json --plot decode.png

Cache-side ops (append_window, compress_decode + write_entries, paged_indexer_scores + top-k,
decode_attention), the whole AttentionSubBlock, and transformers' DeepseekV4Attention: median µs,
bytes, FLOPs, % of the card's measured bandwidth / matrix rate. Any `dsv4 bench` flag works here.
"""

from __future__ import annotations

import sys

from dsv4.bench import main

if __name__ == "__main__":
    sys.exit(main(["--prefill", "0", *sys.argv[1:]]))
