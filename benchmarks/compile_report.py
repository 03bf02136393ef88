"""Registers, spills and tensor-core instructions of the decode kernels' variants, without a GPU.

    python benchmarks/compile_report.py            # V4-Flash shapes, sm_90, the variants below
    SASS_DIR=dir [PTX=1] [TTGIR=1] python benchmarks/compile_report.py wide   # SASS (PTX, Triton's layouts) in dir
    python benchmarks/compile_report.py qnorm      # the fused attention's B = 1 tile with / without q_norm

Triton compiles for sm_90 on any machine (its wheel carries ptxas and cuobjdump): each op wrapper
is called on CPU tensors of a small V4-shaped cache with its kernel launch intercepted, the
captured arguments give the kernel signature, and the compiled cubin is read with
`cuobjdump -res-usage` / `-sass`; `wgmma_serialised` is ptxas's own note (C7512) that it put a wait
after every warpgroup MMA for want of registers. The Triton here may be newer than the device's
(`pip install --target` its version beside, then on PYTHONPATH): a lead for what to time there, not a
measurement.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import warnings
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.tensor_descriptor import TensorDescriptor

_DT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv",
       torch.uint8: "u8", torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.float64: "fp64"}


class _Capture:
    def __init__(self, fn: Any):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **kw: Any) -> None:
            self.calls.append((args, kw))
        return launch


def compile_info(fn: Any, args: tuple, kw: dict) -> dict[str, Any] | str:
    names = fn.arg_names
    sig, consts = {}, {}
    for name, a in zip(names, args):
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + _DT[a.dtype]
        elif isinstance(a, TensorDescriptor):
            sig[name] = f"tensordesc<{_DT[a.base.dtype]}[{', '.join(map(str, a.block_shape))}]>"
        elif type(a).__name__ == "TensorDescriptor":      # Gluon's: the shared layout is part of the type
            sig[name] = f"tensordesc<{_DT[a.base.dtype]}[{','.join(map(str, a.block_shape))}],{a.layout!r}>"
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i32" if abs(a) < 2**31 else "i64"
        else:
            sig[name] = "fp32"
    opts = {k: kw.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kw}
    kw.pop("launch_pdl", None)                      # a launch option, not a kernel argument
    for k, v in kw.items():
        sig[k], consts[k] = "constexpr", v
    # what the launcher specialises on: 16-byte aligned pointers, ints divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(args)
             if (isinstance(a, torch.Tensor) and a.data_ptr() % 16 == 0)
             or (isinstance(a, int) and not isinstance(a, bool) and a % 16 == 0 and a != 0)}
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource
        src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    else:
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    except Exception as e:
        while e.__cause__ is not None:      # Triton chains an error per inlined function: the innermost says why
            e = e.__cause__
        return f"{type(e).__name__}: {str(e)[-int(os.environ.get('ERR_CHARS', 300)):]}"
    binp = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    res = subprocess.run([f"{binp}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    sass = subprocess.run([f"{binp}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    if os.environ.get("SASS_DIR"):
        with open(os.path.join(os.environ["SASS_DIR"], f"{fn.__name__}.{len(os.listdir(os.environ['SASS_DIR']))}.sass"),
                  "w") as f:
            f.write(sass)
        if os.environ.get("TTGIR"):       # Triton's layouts: where a tile is converted or held
            with open(f.name[:-len(".sass")] + ".ttgir", "w") as g:
                g.write(k.asm["ttgir"])
        if os.environ.get("PTX"):         # the PTX beside it: which fence or wait ptxas was given
            with open(f.name[:-len(".sass")] + ".ptx", "w") as g:
                g.write(k.asm["ptx"])
    return {"reg": int(m[1]), "stack": int(m[2]), "smem": k.metadata.shared, "LDL": sass.count("LDL"),
            "STL": sass.count("STL"), "HGMMA": sass.count("HGMMA") + sass.count("IGMMA"), "HMMA": sass.count("HMMA"),
            "instr": len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+[A-Z@]", sass)),
            "wgmma_serialised": _wgmma_serialised(binp, k.asm["ptx"])}


def _wgmma_serialised(binp: str, ptx: str) -> bool:
    """Whether ptxas serialises the kernel's warpgroup MMAs (its C7512 note, which Triton does not show):
    decided for the whole function, so a rarely taken path's registers can put a wait after every wgmma
    of the hot loop (the TMA scan's bf16 fallback tile did: benchmarks/NOTES.md #224)."""
    if "wgmma" not in ptx:
        return False
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([f"{binp}/ptxas", "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    return "C7512" in log.stdout + log.stderr


@contextlib.contextmanager
def captured(module: Any, name: str):
    orig = getattr(module, name)
    cap = _Capture(orig)
    setattr(module, name, cap)
    try:
        yield cap
    finally:
        setattr(module, name, orig)


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any):
    orig = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, orig)


def report(label: str, module: Any, kname: str, call: Any, **gpu_kw: Any) -> None:
    """gpu_kw: launch options the wrapper passes on CUDA only (e.g. num_stages), added here."""
    with captured(module, kname) as cap:
        call()
    args, kw = cap.calls[0]
    kw = {**gpu_kw, **kw}
    if "NATIVE" in kw:          # the wrappers saw CPU tensors: compile the GPU code path
        kw["NATIVE"] = True
    if "ASM" in kw:             # inline PTX on CUDA: the scan's E2M1 decode (mxfp4), the FP8 GEMM's conversion
        kw["ASM"] = kw.get("FMT") == 3 if "FMT" in kw else True
    print(f"{label:<60} {compile_info(cap.fn, args, kw)}", flush=True)


def main() -> int:
    warnings.filterwarnings("ignore")
    from dsv4.bench import setup as bs
    from dsv4.bench.common import LAYER_INDEX, bench_config
    from dsv4.kernels.triton import decode_attention as att
    from dsv4.kernels.triton import decode_attention_2p as tp
    from dsv4.kernels.triton import indexer_scan as scn
    from dsv4.kernels.triton import indexer_scores as sc
    from dsv4.kernels.triton import topk

    cfg, tpb = bench_config(False)
    dev = torch.device("cpu")
    st = bs.build_decode_state(cfg, context=2048, batch=2, device=dev, tokens_per_block=tpb, kv_format="fp8_ds",
                               indexer_format="mxfp4")
    mgr, b = st.mgr, st.batch
    sch, pool = mgr.schemas[LAYER_INDEX["csa"]], mgr.paged[LAYER_INDEX["csa"]]
    ifmt = sch.indexer_format
    qi = torch.randn(2, 64, 128)
    g = torch.randn(2, 64)
    sargs = (qi, g, pool.indexer, ifmt, b.block_table, b.seq_lens // 4, b.seq_len_bound // 4, 64)
    which = sys.argv[1:] or ["scores", "scan", "attention", "topk", "cache", "fp8"]   # or "wide" alone
    if "scores" in which:
        for kw in [dict(precision="bf16x2", block_n=64, num_warps=8), dict(precision="bf16", block_n=64, num_warps=8),
                   dict(precision="bf16", block_n=128, num_warps=8), dict(precision="bf16", block_n=64, num_warps=4),
                   dict(precision="bf16", block_n=128, num_warps=4), dict(precision="bf16", block_n=32, num_warps=4),
                   dict(precision="bf16", block_n=64, num_warps=8, decode=1),
                   dict(precision="bf16", block_n=128, num_warps=8, decode=1)]:
            report(f"scores {kw}", sc, "_indexer_scores_kernel",
                   lambda kw=kw: sc.paged_indexer_scores(*sargs, num_programs=2, scan=False, **kw))
    if "scan" in which:
        for kw in [dict(precision="bf16x2", block_n=64), dict(precision="bf16x2", block_n=64, prefetch=False),
                   dict(precision="bf16x2", block_n=128), dict(precision="bf16", block_n=64),
                   dict(precision="bf16x2", block_n=128, keys_m=False, prefetch=False)]:
            report(f"scan {kw}", scn, "_indexer_scan_kernel",
                   lambda kw=kw: sc.paged_indexer_scores(*sargs, num_programs=2, num_warps=4, **kw))
        report("scan group maxima (bf16, block_n 64, 64 slots)", scn, "_indexer_scan_kernel",
               lambda: sc.scores_and_maxima(*sargs, num_programs=2, num_warps=4, precision="bf16", block_n=64,
                                            tma=False, group_max=True))
    if "scan" in which or "scan_tma" in which:
        from dsv4.kernels.triton import indexer_scan_tma as ts
        typed = ifmt.typed(pool.indexer)
        out = torch.empty(2, b.seq_len_bound // 4)
        def tma(**kw: Any) -> None:
            ts.launch(qi, g, out, typed["data"], typed["scale"], b.block_table, b.seq_lens // 4,
                      b.seq_len_bound // 4, 1.0, 8, **kw)
        with captured(ts, "_scan_tma_kernel"), captured(ts, "_scan_redo_kernel"):
            report("scan_tma queries (int8)", ts, "_q8_kernel", tma)
        gmax = torch.empty(2, 64 * ts.programs_per_request(8, b.seq_len_bound // 4), dtype=torch.int32)
        with captured(ts, "_q8_kernel"), captured(ts, "_scan_tma_kernel"):
            report("scan_tma redo (bf16 MMA) group maxima", ts, "_scan_redo_kernel", lambda: tma(gmax=gmax))
        with captured(ts, "_q8_kernel"), captured(ts, "_scan_redo_kernel"):
            for stages in (2, 4):
                report(f"scan_tma stages={stages}", ts, "_scan_tma_kernel", lambda stages=stages: tma(stages=stages))
            report("scan_tma int8=False", ts, "_scan_tma_kernel", lambda: tma(int8=False))
            report("scan_tma group maxima", ts, "_scan_tma_kernel", lambda: tma(gmax=gmax))
            report("scan_tma group maxima int8=False", ts, "_scan_tma_kernel", lambda: tma(gmax=gmax, int8=False))
            for nreg in (128, 96):
                report(f"scan_tma maxnreg={nreg}", ts, "_scan_tma_kernel", lambda nreg=nreg: tma(maxnreg=nreg))
    if "attention" in which or "wide" in which or "prefill_wide" in which:
        for kind in ("csa", "hca"):
            li = LAYER_INDEX[kind]
            s2, stt, p2 = mgr.schemas[li], mgr.states[li], mgr.paged[li]
            sel = torch.arange(512).repeat(2, 1) if kind == "csa" else None
            ne = None if kind == "csa" else b.seq_lens // s2.compress_ratio
            # a bf16 q, as the layer passes it
            aargs = (torch.randn(2, 64, 512).bfloat16(), stt.swa, s2.kv_format, stt.swa_pos, b.request_slots,
                     b.positions, 128,
                     p2.kv, b.block_table, s2.entries_per_block, sel, ne, b.seq_len_bound // s2.compress_ratio,
                     torch.randn(64), 512 ** -0.5)
            from dsv4.kernels.triton import decode_attention_wide as dw
            from dsv4.kernels.triton import decode_combine as dcm
            with contextlib.ExitStack() as es:        # the wide scheme's checks want a GPU: call it past them
                es.enter_context(_patched(dw, "supported", lambda *a: True))
                es.enter_context(_patched(att, "sm_count", lambda dev: 132))
                es.enter_context(captured(dcm, "_combine_kernel"))         # launched after it: intercepted too
                if "prefill_wide" not in which or "wide" in which:
                    report(f"attention wide {kind}", dw, "_wide_kernel",
                           lambda aargs=aargs: att.decode_attention(*aargs, scheme="wide"))
            if "prefill_wide" in which:     # the wide prefill kernel on 16 new tokens after 2,032 cached
                from dsv4.kernels.triton import prefill_attention as pa
                from dsv4.kernels.triton import prefill_attention_wide as pw
                n = 16
                pos = torch.arange(2032, 2032 + n, dtype=torch.int32)
                pargs = (torch.randn(n, 64, 512).bfloat16(), torch.randn(1, 128, 512).bfloat16(),
                         torch.arange(1904, 2032, dtype=torch.int32)[None], torch.randn(n, 512).bfloat16(), pos,
                         torch.zeros(n, dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), 128, p2.kv,
                         s2.kv_format, b.block_table[:1], s2.entries_per_block,
                         torch.arange(512).repeat(n, 1) if kind == "csa" else None, s2.compress_ratio,
                         2048 // s2.compress_ratio, torch.randn(64), 512 ** -0.5)
                fin = {"rope": (torch.rand(n, 32), torch.rand(n, 32)), "out_dtype": torch.bfloat16}
                with contextlib.ExitStack() as es:
                    es.enter_context(_patched(pw, "supported", lambda *a: True))
                    es.enter_context(_patched(pw, "sm_count", lambda dev: 132))
                    qn = {**fin, "q_norm": 1e-6}
                    for label, kw in (("", {}), (" rope bf16-out", fin), (" q_norm rope bf16-out", qn)):
                        report(f"prefill wide {kind}{label}", pw, "_prefill_wide_kernel",
                               lambda pargs=pargs, kw=kw: pa.prefill_attention(*pargs, scheme="wide", **kw))
            if "attention" not in which:
                continue
            for bh, bn, w in [(16, 32, 8), (16, 64, 8), (16, 16, 4), (16, 16, 8), (32, 16, 8), (32, 32, 8),
                              (64, 16, 8), (64, 16, 16), (16, 32, 4)]:
                report(f"attention {kind} block_h={bh} block_n={bn} warps={w}", att, "_decode_attn_kernel",
                       lambda bh=bh, bn=bn, w=w, aargs=aargs: att.decode_attention(
                           *aargs, block_h=bh, block_n=bn, num_warps=w, num_splits=1, precision="bf16"),
                       num_stages=att.NUM_STAGES)
            rope = (torch.rand(2, 32), torch.rand(2, 32))
            for r, dt in ((None, None), (rope, torch.bfloat16)):
                with captured(tp, "_scores_kernel"):            # pass 1 launches first: intercepted too
                    report(f"two-pass values {kind} rope={r is not None} out={dt}", tp, "_values_kernel",
                           lambda aargs=aargs, r=r, dt=dt: att.decode_attention(
                               *aargs, scheme="two_pass", score_block_n=32, score_warps=8, value_block_n=32,
                               value_block_d=128, value_warps=4, value_splits=1, rope=r, out_dtype=dt))
    if "qnorm" in which:        # the fused kernel's B = 1 tile (two splits), without and with the q norm inside
        li = LAYER_INDEX["hca"]
        s2, stt, p2 = mgr.schemas[li], mgr.states[li], mgr.paged[li]
        aargs = (torch.randn(2, 64, 512).bfloat16(), stt.swa, s2.kv_format, stt.swa_pos, b.request_slots,
                 b.positions, 128, p2.kv, b.block_table, s2.entries_per_block, None, b.seq_lens // 128,
                 b.seq_len_bound // 128, torch.randn(64), 512 ** -0.5)
        rope = (torch.rand(2, 32), torch.rand(2, 32))
        from dsv4.kernels.triton import decode_combine as dcm
        for qn, cap in ((None, {}), (1e-6, {}), (1e-6, {"maxnreg": 128})):
            with captured(dcm, "_combine_kernel"):             # launched after it: intercepted too
                report(f"attention hca block_h=16 block_n=32 warps=8 splits=2 q_norm={qn} {cap}", att,
                       "_decode_attn_kernel",
                       lambda qn=qn: att.decode_attention(*aargs, block_h=16, block_n=32, num_warps=8, num_splits=2,
                                                          precision="bf16", rope=rope, q_norm=qn),
                       num_stages=att.NUM_STAGES, **cap)
    if "topk" in which:
        s = torch.randn(2, 40000)
        for blk, w in [(16384, 16), (16384, 8), (8192, 16), (8192, 8), (4096, 8)]:
            report(f"topk block={blk} warps={w}", topk, "_topk_kernel",
                   lambda blk=blk, w=w: topk.topk_smaller_index(s, 512, block=blk, num_warps=w))
    if "cache" in which:
        from dsv4.kernels.reference.norm_rope import EntryFinish
        from dsv4.kernels.triton import cache_ops as co
        from dsv4.kernels.triton import compress as cmp
        rows, er, ei = torch.randn(8, 128), torch.zeros(8, dtype=torch.int64), torch.arange(8)
        report("write_entries mxfp4 (Hadamard)", co, "_write_entries_kernel",
               lambda: co.write_entries(pool.indexer, ifmt, rows, er, ei, b.block_table, 64))
        report("write_entries fp8_ds", co, "_write_entries_kernel",
               lambda: co.write_entries(pool.kv, sch.kv_format, torch.randn(8, 512), er, ei, b.block_table, 64))
        for name, views, fmt, d in (("fp8_ds", pool.kv, sch.kv_format, 512), ("mxfp4", pool.indexer, ifmt, 128)):
            fin = EntryFinish(torch.rand(d) + 0.5, 1e-6, torch.rand(32, dtype=torch.float64), 4)
            report(f"write_entries {name} finish", co, "_write_entries_kernel",
                   lambda views=views, fmt=fmt, d=d, fin=fin: co.write_entries(views, fmt, torch.randn(8, d), er, ei,
                                                                               b.block_table, 64, fin))
        for name, d, ratio, ov, kws in [
                ("csa main", 512, 4, True, [{}, dict(block_s=4), dict(num_warps=2)]),
                ("csa indexer", 128, 4, True, [{}, dict(block_s=4)]),
                ("hca", 512, 128, False, [{}, dict(split=16, num_warps=4, block_s=4), dict(num_warps=4)])]:
            dc = 2 * d if ov else d
            state = torch.zeros(2, 3, 2 if ov else 1, d)
            ns = 2 * ratio if ov else ratio
            segs, block_d, most, split, warps = cmp._tiles(d, ns, True)                      # the GPU defaults
            for kw in kws:           # as the layer calls it: bf16 projections, the position bias added inside
                kw = {**dict(segs=segs, block_d=block_d, split=split, num_warps=warps), **kw}
                kw.setdefault("block_s", cmp._largest_pow2_divisor(ns // kw["split"], most))
                report(f"compress {name} {kw}", cmp, "_compress_kernel",
                       lambda kw=kw, d=d, dc=dc, ratio=ratio, ov=ov, state=state: cmp.compress_update(
                           torch.randn(1024, dc).bfloat16(), torch.randn(1024, dc).bfloat16(), state,
                           torch.tensor([1]), (0,), (1024,), ratio, ov, z_bias=torch.randn(ratio, dc), **kw))
    if "fp8" in which:          # the FP8 block-weight projections (kernels.triton.fp8_linear) at V4-Flash shapes
        from dsv4.kernels.triton import fp8_linear as fl
        from dsv4.model.fp8_weights import quantize_blocks
        for rows, n, k, groups in [(1, 40960, 1024, 1), (1, 8192, 4096, 8), (1, 4096, 8192, 1), (16, 40960, 1024, 1),
                                   (64, 40960, 1024, 1), (64, 4096, 8192, 1), (200, 8192, 4096, 8)]:
            codes, scale = quantize_blocks(torch.randn(n, k) * 0.02)
            x = torch.randn(rows, groups * k).bfloat16()
            tiles = fl._gemv_tiles(n, k) if rows == 1 else fl._gemm_tiles(rows)
            for desc in (False, True) if rows > 1 else (False,):
                kname = "_gemv_kernel" if rows == 1 else ("_gemm_desc_kernel" if desc else "_gemm_kernel")
                report(f"linear_fp8 rows={rows} N={n} K={k} groups={groups} tiles={tiles}{' desc' * desc}", fl,
                       kname, lambda x=x, c=codes, s=scale, g=groups, d=desc: fl.linear_fp8(x, c, s, g, desc=d),
                       num_warps=tiles[2], num_stages=tiles[3])
    return 0


if __name__ == "__main__":
    sys.exit(main())
