"""Scoreboard waits and spills in the loops of a SASS listing (`cuobjdump -sass`, e.g. from
`SASS_DIR=dir python benchmarks/compile_report.py wide`).

    python benchmarks/sass_waits.py dir/_wide_kernel.1.sass            # every loop: size, spills
    python benchmarks/sass_waits.py dir/_wide_kernel.1.sass LDGSTS     # the innermost loop holding it:
                                                                       # waits on its loads' scoreboard

Each sm_70+ instruction carries control bits in the high word of its 128-bit encoding: the
scoreboard a variable-latency instruction signals on completion (write, bits 46-48 of the high word;
7 = none) and the scoreboards it waits for first (mask, bits 52-57). ptxas puts a warp's global
loads on one scoreboard, and a wait is for all of its loads: an instruction that waits on it after
newer loads were issued waits for those too (benchmarks/NOTES.md, forty-second round). A Triton
other than the device's compiles the same source differently; install the device's version
beside this one (`pip install --target dir triton==X`, then PYTHONPATH=dir) to see its SASS.
"""

from __future__ import annotations

import re
import sys
from typing import NamedTuple

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* 0x[0-9a-f]{16} \*/")
_HIGH = re.compile(r"/\* (0x[0-9a-f]{16}) \*/")


class Instr(NamedTuple):
    addr: int
    text: str
    write_sb: int | None
    wait_sbs: frozenset[int]


def parse(lines: list[str]) -> list[Instr]:
    out = []
    for i, line in enumerate(lines[:-1]):
        m = _INSTR.search(line)
        h = _HIGH.search(lines[i + 1]) if m else None
        if not (m and h):
            continue
        hi = int(h.group(1), 16)
        wb = (hi >> 46) & 7
        out.append(Instr(int(m.group(1), 16), m.group(2), None if wb == 7 else wb,
                         frozenset(s for s in range(6) if hi >> (52 + s) & 1)))
    return out


def loops(ins: list[Instr]) -> list[tuple[int, int]]:
    """(first, last) address of each backward branch's body."""
    res = []
    for x in ins:
        m = re.search(r"BRA 0x([0-9a-f]+)", x.text)
        if m and int(m.group(1), 16) < x.addr:
            res.append((int(m.group(1), 16), x.addr))
    return res


def main(argv: list[str]) -> int:
    ins = parse(open(argv[0]).read().splitlines())
    spans = loops(ins)
    if len(argv) == 1:
        for lo, hi in spans:
            body = [x for x in ins if lo <= x.addr <= hi]
            print(f"loop {lo:05x}-{hi:05x}: {len(body):4d} instructions, LDL {sum('LDL' in x.text for x in body)}, "
                  f"STL {sum('STL' in x.text for x in body)}")
        return 0
    mark = argv[1]
    inner = [(lo, hi) for lo, hi in spans if any(lo <= x.addr <= hi and mark in x.text for x in ins)]
    if not inner:
        print(f"no loop holds {mark}")
        return 1
    lo, hi = min(inner, key=lambda s: s[1] - s[0])
    body = [x for x in ins if lo <= x.addr <= hi]
    load_sbs = {x.write_sb for x in body
                if x.text.lstrip("@!P0123456789 ").startswith("LDG.") and x.write_sb is not None}
    print(f"loop {lo:05x}-{hi:05x}: {len(body)} instructions, LDL {sum('LDL' in x.text for x in body)}, "
          f"STL {sum('STL' in x.text for x in body)}, global loads on scoreboards {sorted(load_sbs)}")
    for x in body:
        if x.wait_sbs & load_sbs or "MEMBAR" in x.text or (x.write_sb in load_sbs and "LDG." in x.text):
            what = "waits" if x.wait_sbs & load_sbs else "     "
            print(f"  {x.addr:05x} {what} {x.text[:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
