"""Where the decode top-k's filtered path spends its time, read from clocks inside its kernels.

    python benchmarks/topk_trace.py [--batches 64] [--n 32768] [--k 512] [--reps 20]

A copy of `dsv4.kernels.triton.topk` with timer reads added (the module's source, patched as text
and imported from a temporary file; the library's kernels are not changed): the bound kernel's start
and end, the first eight filter programs' starts and the ends of their candidates, and the select
kernel's phases in SM clocks (counts loaded, first block loaded and the start bits found, each
select pass, the collect, the pads). The path runs as the decode step runs it: the TMA indexer
scan's scores of random keys and queries and its group maxima handed in, order "index", scores hot
in the L2; eager, so the gaps between launches are the host's. Prints medians over rows and
repetitions (µs from the bound kernel's start; clocks for the select's phases) and the select
passes a row took.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

import torch

from dsv4.kernels.triton import topk as tk

_CLOCKS = '''

@triton.jit
def _gt(dep):
    """%globaltimer (ns), read once dep is ready."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [dep], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _ck(dep):
    """%clock64 (SM cycles), read once dep is ready."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64; // $1", "=l,r", [dep], dtype=tl.int64,
                                     is_pure=False, pack=1)
'''

# (old text, new text): each must occur in the module's source exactly as many times as given
_PATCHES = [
    ("_NEG_INF_KEY = -2139095041          # the key of -inf: 0xFF800000 ^ 0x7FFFFFFF as int32\n",
     "_NEG_INF_KEY = -2139095041\n" + _CLOCKS, 1),
    # _topk_row: a trace pointer (slots 16-31 of row b), written by the filtered select only
    ("SEGS: tl.constexpr, CM: tl.constexpr, ORDER: tl.constexpr):\n",
     "SEGS: tl.constexpr, CM: tl.constexpr, ORDER: tl.constexpr, tr_ptr):\n", 1),
    ('BOUNDS, SEGS, "", ORDER)\n', 'BOUNDS, SEGS, "", ORDER, out_ptr)\n', 1),
    ('K, CH, 1, SEL_BLOCK, K_PAD, True, True, True, DIGIT, 8, 1, SEGS, ".cg", ORDER)\n',
     'K, CH, 1, SEL_BLOCK, K_PAD, True, True, True, DIGIT, 8, 1, SEGS, ".cg", ORDER, tr_ptr)\n', 1),
    ("def _filtered_select_kernel(s_ptr, cand_ptr, cnt_ptr, lb_ptr, out_ptr, ",
     "def _filtered_select_kernel(s_ptr, cand_ptr, cnt_ptr, lb_ptr, out_ptr, tr_ptr, ", 1),
    ("_filtered_select_kernel[(bsz,)](scores, cand, counts, bound, out, ",
     "_filtered_select_kernel[(bsz,)](scores, cand, counts, bound, out, TRACE[0], ", 1),
    ("    cnt_row = cnt_ptr + b * 2 * SEGS\n    if FILTERED:\n",
     "    cnt_row = cnt_ptr + b * 2 * SEGS\n    trow = tr_ptr + b * 64\n    if FILTERED:\n"
     "        tl.store(trow + 16, _gt(b.to(tl.int32)))\n        tl.store(trow + 17, _ck(b.to(tl.int32)))\n", 1),
    ("    kk = tl.minimum(K, n)\n",
     "    kk = tl.minimum(K, n)\n    if FILTERED:\n        tl.store(trow + 18, _ck(n + n_inf))\n", 1),
    ("    go = (need > 0) & (hi > 0)\n    while go:\n",
     "    go = (need > 0) & (hi > 0)\n    npass = tl.zeros([], tl.int32)\n"
     "    if FILTERED:\n        tl.store(trow + 19, _ck(hi + thr.to(tl.int32, bitcast=True)))\n    while go:\n", 1),
    ("        need, thr, go = _select_step(h, bins, need, thr, shift)\n        hi = shift\n",
     "        need, thr, go = _select_step(h, bins, need, thr, shift)\n        hi = shift\n"
     "        if FILTERED:\n            tl.store(trow + 20 + tl.minimum(npass, 7), _ck(need))\n"
     "        npass += 1\n", 1),
    ("    # ---- sort the picks in the reference's packed order",
     "    if FILTERED:\n        tl.store(trow + 28, npass.to(tl.int64))\n"
     "        tl.store(trow + 29, _ck(gt_seen + eq_seen))\n"
     "    # ---- sort the picks in the reference's packed order", 1),
    ("        tl.store(orow + j, tl.full([K_PAD], -1, tl.int64), mask=(j >= kk) & (j < K))\n",
     "        tl.store(orow + j, tl.full([K_PAD], -1, tl.int64), mask=(j >= kk) & (j < K))\n"
     "        tl.debug_barrier()\n        tl.store(trow + 30, _ck(kk))\n        tl.store(trow + 31, _gt(kk))\n", 1),
    # the filter kernel: slots 2 j (start) and 2 j + 1 (candidates stored) of program j
    ("def _filter_kernel(s_ptr, cand_ptr, cnt_ptr, lb_ptr, ",
     "def _filter_kernel(s_ptr, cand_ptr, cnt_ptr, lb_ptr, tr_ptr, ", 1),
    ("    thr = tl.load(lb_ptr + b).to(tl.uint32, bitcast=True)\n    neg = 8388607",
     "    tl.store(tr_ptr + b * 64 + 2 * j, _gt(j), mask=j < 8)\n"
     "    thr = tl.load(lb_ptr + b).to(tl.uint32, bitcast=True)\n    neg = 8388607", 1),
    ("    tl.store(cnt_ptr + b * 2 * SEGS + SEGS + j, n_inf)\n",
     "    tl.store(cnt_ptr + b * 2 * SEGS + SEGS + j, n_inf)\n"
     "    tl.store(tr_ptr + b * 64 + 2 * j + 1, _gt(seen), mask=j < 8)\n", 1),
    ("_filter_kernel[(bsz, p)](scores, cand, counts, bound, ",
     "_filter_kernel[(bsz, p)](scores, cand, counts, bound, TRACE[0], ", 1),
    # the bound kernel: slots 32 (start) and 33 (bound stored)
    ("def _bound_kernel(gmax_ptr, lb_ptr, ", "def _bound_kernel(gmax_ptr, lb_ptr, tr_ptr, ", 1),
    ("    b = tl.program_id(0).to(tl.int64)\n    ga = tl.arange(0, NG)\n",
     "    b = tl.program_id(0).to(tl.int64)\n    tl.store(tr_ptr + b * 64 + 32, _gt(b.to(tl.int32)))\n"
     "    ga = tl.arange(0, NG)\n", 1),
    ("    tl.store(lb_ptr + b, thr.to(tl.int32, bitcast=True))\n\n\n@triton.jit\ndef _filter_kernel",
     "    tl.store(lb_ptr + b, thr.to(tl.int32, bitcast=True))\n"
     "    tl.store(tr_ptr + b * 64 + 33, _gt(thr.to(tl.int32, bitcast=True)))\n"
     "\n\n@triton.jit\ndef _filter_kernel", 1),
    ("_bound_kernel[(bsz,)](group_max, bound, ", "_bound_kernel[(bsz,)](group_max, bound, TRACE[0], ", 1),
]


def traced_module():
    """The top-k module with the timer reads above, and its trace buffer slot (`mod.TRACE[0]`)."""
    src = inspect.getsource(tk)
    for old, new, count in _PATCHES:
        assert src.count(old) == count, f"patch target not found {count} time(s): {old[:60]!r}"
        src = src.replace(old, new)
    src += "\nTRACE = [None]\n"
    path = Path(tempfile.mkdtemp()) / "topk_traced.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("topk_traced", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["topk_traced"] = mod
    spec.loader.exec_module(mod)
    return mod


def scan_scores(b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The TMA indexer scan's scores of random mxfp4 keys and queries (n keys a request) and its group
    maxima, as the decode step hands them to the top-k."""
    from dsv4.cache.formats import indexer_format
    from dsv4.kernels.triton.indexer_scores import scores_and_maxima
    fmt, epb = indexer_format("mxfp4", 128), 64
    nb = b * (n // epb) + 1
    pages = torch.empty(nb, fmt.page_bytes(epb), dtype=torch.uint8, device="cuda")
    views = fmt.views(pages, epb)
    for name, t in fmt.encode(torch.randn(nb * epb, 128, device="cuda")).items():
        views[name].copy_(t.view(nb, epb, -1))
    bt = (1 + torch.arange(b * (n // epb), device="cuda", dtype=torch.int32)).view(b, n // epb)
    q = torch.randn(b, 64, 128, device="cuda")
    w = torch.rand(b, 64, device="cuda")
    ne = torch.full((b,), n, dtype=torch.int32, device="cuda")
    return scores_and_maxima(q, w, views, fmt, bt, ne, n, epb, 1.0, group_max=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="64")
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args(argv)
    mod = traced_module()
    torch.manual_seed(0)
    for b in (int(x) for x in a.batches.split(",")):
        s, gk = scan_scores(b, a.n)
        want = tk.topk_smaller_index(s, a.k, group_max=gk, order="index")
        tr = torch.zeros(b, 64, dtype=torch.int64, device="cuda")
        mod.TRACE[0] = tr
        runs = []
        for _ in range(a.reps):
            tr.zero_()
            got = mod.topk_smaller_index(s, a.k, group_max=gk, order="index")
            torch.cuda.synchronize()
            assert torch.equal(got, want), "the traced copy's picks differ from the library's"
            runs.append(tr.clone())
        t = torch.stack(runs).double()                                  # [reps, B, 64]
        p_ = min(8, triton_cdiv(a.n, tk.FILTER_CHUNK))      # programs 0-7 of a row are traced
        t0 = t[..., 32:33]                                               # the bound kernel's start
        ns = {"bound end": t[..., 33] - t0[..., 0],
              "filter first start": t[..., 0:2 * p_:2].min(-1).values - t0[..., 0],
              "filter last start": t[..., 0:2 * p_:2].max(-1).values - t0[..., 0],
              "candidates first end": t[..., 1:2 * p_:2].min(-1).values - t0[..., 0],
              "candidates last end": t[..., 1:2 * p_:2].max(-1).values - t0[..., 0],
              "select start": t[..., 16] - t0[..., 0], "select end": t[..., 31] - t0[..., 0],
              "rows' last select end": (t[..., 31].max(-1, keepdim=True).values - t0[..., 0]).expand_as(t[..., 31])}
        print(f"B={b} N={a.n} k={a.k} (the scan's scores, {gk.shape[1]} group maxima a row): µs from the "
              "bound kernel's start, median over rows and repetitions (min / max over rows)")
        for name, v in ns.items():
            v = v / 1e3
            print(f"  {name:<24} {v.median().item():8.2f}   ({v.amin().item():.2f} / {v.amax().item():.2f})")
        passes = t[..., 28]
        print(f"  select passes a row: median {passes.median().item():.0f}, min {passes.amin().item():.0f}, "
              f"max {passes.amax().item():.0f}")
        ck = {"counts": t[..., 18] - t[..., 17], "first block + start bits": t[..., 19] - t[..., 18]}
        last = t[..., 19]
        for i in range(7):
            done = passes > i
            d = torch.where(done, t[..., 20 + i] - last, torch.nan)
            ck[f"pass {i + 1}"] = d
            last = torch.where(done, t[..., 20 + i], last)
        ck["collect"] = t[..., 29] - last
        ck["pads"] = t[..., 30] - t[..., 29]
        ck["whole select"] = t[..., 30] - t[..., 17]
        print("  the select kernel's program of a row, SM clocks (median / max over rows and repetitions):")
        for name, v in ck.items():
            v = v[~torch.isnan(v)]
            if v.numel():
                print(f"    {name:<26} {v.median().item():8.0f} / {v.max().item():8.0f}")
    return 0


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if __name__ == "__main__":
    sys.exit(main())
