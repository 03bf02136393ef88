"""Summarise one kernel's Nsight Compute source page (`ncu --page source --print-source sass --csv`,
as benchmarks/ncu_step.sh writes it): where the warps stalled, by reason, by opcode, and the
instructions with the most stall samples.

    python benchmarks/ncu_sass.py sass__indexer_scan_kernel.csv [top instructions, default 25]

A warp-specialised kernel's partitions are consecutive code regions, each starting at the
`USETMAXREG.TRY_ALLOC` that sets its registers: for such a kernel the samples are also split by
region (its register count names it, e.g. the wide attention's values 160, loader 152, and the
default partition, the parent's code with it, last).
"""

from __future__ import annotations

import collections
import csv
import itertools
import sys


def main() -> None:
    rows = list(csv.reader(open(sys.argv[1])))
    hdr, data = rows[1], rows[2:]
    ix = {h: i for i, h in enumerate(hdr)}

    def num(r: list[str], k: str) -> float:
        try:
            return float(r[ix[k]].replace(",", ""))
        except (KeyError, ValueError):
            return 0.0

    samples = "Warp Stall Sampling (All Samples)"
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(num(r, samples) for r in data) or 1.0
    by_reason = collections.Counter({s: sum(num(r, s) for r in data) for s in stalls})
    print(f"{total:.0f} stall samples over {len(data)} instructions")
    for s, v in by_reason.most_common(10):
        print(f"  {s:28s} {v:8.0f} {100 * v / total:5.1f}%")
    by_op, executed = collections.Counter(), collections.Counter()
    for r in data:
        words = r[ix["Source"]].split()
        op = (words[1] if words and words[0].startswith("@") else words[0] if words else "?").split(".")[0]
        by_op[op] += num(r, samples)
        executed[op] += num(r, "Instructions Executed")
    print("opcode: % of samples, warp instructions executed")
    for op, v in by_op.most_common(25):
        print(f"  {op:12s} {100 * v / total:5.1f}%  {executed[op]:12.0f}")
    _by_region(data, ix, num, samples, stalls)
    print("instructions with the most samples (top three reasons)")
    for r in sorted(data, key=lambda r: -num(r, samples))[:int(sys.argv[2]) if len(sys.argv) > 2 else 25]:
        top = sorted(((num(r, s), s[6:]) for s in stalls), reverse=True)[:3]
        print(f"  {r[0][-5:]} {num(r, samples):7.0f} {r[ix['Source']].strip()[:60]:60s} "
              + " ".join(f"{k}:{v:.0f}" for v, k in top))


def _by_region(data: list, ix: dict, num, samples: str, stalls: list[str]) -> None:
    """Samples, warp instructions executed and the top stall reasons per warp-specialised partition
    (regions from each `USETMAXREG.TRY_ALLOC`, named by the registers it asks for); nothing for a
    kernel without them."""
    starts = [i for i, r in enumerate(data) if "USETMAXREG.TRY_ALLOC" in r[ix["Source"]]]
    if len(starts) < 2:
        return
    print("by partition (code from each USETMAXREG.TRY_ALLOC to the next)")
    bounds = [0, *starts[1:], len(data)]
    for a, b in itertools.pairwise(bounds):
        rows = data[a:b]
        regs = int(data[starts[0] if a == 0 else a][ix["Source"]].split(",")[-1].strip(" ;"), 16)
        got = sum(num(r, samples) for r in rows)
        why = collections.Counter({s[6:]: sum(num(r, s) for r in rows) for s in stalls}).most_common(4)
        print(f"  {data[a][0][-5:]}.. regs {regs:4d} {got:7.0f} samples "
              f"{sum(num(r, 'Instructions Executed') for r in rows):11.0f} executed  "
              + " ".join(f"{k}:{v:.0f}" for k, v in why))


if __name__ == "__main__":
    main()
