"""Registers, spills and tensor-core instructions of the decode kernels' variants, without a GPU.

    python benchmarks/compile_report.py            # V4-Flash shapes, sm_90, the variants below
    SASS_DIR=dir [PTX=1] [TTGIR=1] python benchmarks/compile_report.py wide   # SASS (PTX, Triton's layouts) in dir
    python benchmarks/compile_report.py qnorm      # the fused attention's B = 1 tile with / without q_norm
    python benchmarks/compile_report.py each       # one variant of every plain-Triton kernel, as the GPU launches it

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
import multiprocessing
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
    cap = _Capture(orig.fn if isinstance(orig, _Capture) else orig)     # inside `_on_sm90`: the kernel itself
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


def launched(module: Any, kname: str, call: Any, launch: int = 0, **gpu_kw: Any) -> tuple[Any, tuple, dict]:
    """(kernel, args, keywords) of kernel `kname`'s launch number `launch` in `call`, as a GPU compiles it.
    gpu_kw: launch options the wrapper passes on CUDA only (e.g. num_stages), added here."""
    with captured(module, kname) as cap:
        call()
    args, kw = cap.calls[launch]
    kw = {**gpu_kw, **kw}
    if "NATIVE" in kw:          # the wrappers saw CPU tensors: compile the GPU code path
        kw["NATIVE"] = True
    if "ASM" in kw:             # inline PTX on CUDA: the scan's E2M1 decode (mxfp4), the FP8 GEMM's conversion
        kw["ASM"] = kw.get("FMT") == 3 if "FMT" in kw else True
    return cap.fn, args, kw


def report(label: str, module: Any, kname: str, call: Any, **gpu_kw: Any) -> None:
    """Print `label` and the compile of kname's first launch in `call` (`launched`)."""
    print(f"{label:<60} {compile_info(*launched(module, kname, call, **gpu_kw))}", flush=True)


#: the SMs of an H100 (SXM): what `sm_count` answers in `_on_sm90` and the wide schemes' rows
SMS = 132


@contextlib.contextmanager
def _on_sm90():
    """The op wrappers called as on an H100: every kernel of `dsv4.kernels.triton` intercepted (a call
    launches several, and none may run on CPU tensors), the device queries answered as there
    (`sm_count` 132, `pdl` and `prefetch.supported` True) and every helper that takes the wrappers'
    `cuda` / `native` flag (tiles, schemes, launchers) called with True. The checks a wrapper makes
    on its tensors' device inline cannot be patched: `each` passes the GPU's choice for those."""
    import importlib
    import inspect
    import pkgutil

    import dsv4.kernels.triton as pkg

    def on_gpu(fn: Any) -> Any:
        sig = inspect.signature(fn)

        def call(*a: Any, **kw: Any) -> Any:
            bound = sig.bind(*a, **kw)
            bound.arguments.update({k: True for k in ("cuda", "native") if k in sig.parameters})
            return fn(*bound.args, **bound.kwargs)
        return call

    answers = {"sm_count": lambda dev: SMS, "pdl": lambda dev: True}
    with contextlib.ExitStack() as es:
        for info in pkgutil.iter_modules(pkg.__path__):
            try:
                mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
            except ImportError:         # the Gluon modules on a Triton without Gluon
                continue
            for name, v in list(vars(mod).items()):
                if re.fullmatch(r"_\w+_kernel", name) and isinstance(v, triton.runtime.JITFunction):
                    es.enter_context(captured(mod, name))
                elif name in answers:
                    es.enter_context(_patched(mod, name, answers[name]))
                elif (inspect.isfunction(v) and v.__module__.startswith(pkg.__name__)
                      and {"cuda", "native"} & set(inspect.signature(v).parameters)):
                    es.enter_context(_patched(mod, name, on_gpu(v)))
        from dsv4.kernels.triton import prefetch
        es.enter_context(_patched(prefetch, "supported", lambda dev: True))
        yield


def _attention_args(mgr: Any, b: Any, kind: str, rows: int = 2) -> tuple:
    """decode_attention's positional arguments on the state's first `rows` requests of layer `kind` (a bf16 q, as
    the layer passes it): CSA with 512 selected entries a request, HCA with all of its entries."""
    from dsv4.bench.common import LAYER_INDEX
    li = LAYER_INDEX[kind]
    s2, stt, p2 = mgr.schemas[li], mgr.states[li], mgr.paged[li]
    sel = torch.arange(512).repeat(rows, 1) if kind == "csa" else None
    ne = None if kind == "csa" else (b.seq_lens // s2.compress_ratio)[:rows]
    return (torch.randn(rows, 64, 512).bfloat16(), stt.swa, s2.kv_format, stt.swa_pos, b.request_slots[:rows],
            b.positions[:rows], 128, p2.kv, b.block_table[:rows], s2.entries_per_block, sel, ne,
            b.seq_len_bound // s2.compress_ratio, torch.randn(64), 512 ** -0.5)


def _prefill_args(mgr: Any, b: Any, kind: str, n: int = 16) -> tuple[tuple, dict]:
    """prefill_attention's positional arguments for n new tokens of one request after 2,048 - n cached, and the
    finish the layer asks of it (the inverse rotation, bf16 output)."""
    from dsv4.bench.common import LAYER_INDEX
    li = LAYER_INDEX[kind]
    s2, p2 = mgr.schemas[li], mgr.paged[li]
    pos = torch.arange(2048 - n, 2048, dtype=torch.int32)
    pargs = (torch.randn(n, 64, 512).bfloat16(), torch.randn(1, 128, 512).bfloat16(),
             torch.arange(2048 - n - 128, 2048 - n, dtype=torch.int32)[None], torch.randn(n, 512).bfloat16(), pos,
             torch.zeros(n, dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), 128, p2.kv,
             s2.kv_format, b.block_table[:1], s2.entries_per_block,
             torch.arange(512).repeat(n, 1) if kind == "csa" else None, s2.compress_ratio,
             2048 // s2.compress_ratio, torch.randn(64), 512 ** -0.5)
    return pargs, {"rope": (torch.rand(n, 32), torch.rand(n, 32)), "out_dtype": torch.bfloat16}


def _finish(d: int) -> Any:
    """A compressor's entry finish (kv norm, RoPE at the window's first token) for rows of d channels."""
    from dsv4.kernels.reference.norm_rope import EntryFinish
    return EntryFinish(torch.rand(d) + 0.5, 1e-6, torch.rand(32, dtype=torch.float64), 4)


def _compress(d: int, ratio: int, ov: bool, **tuning: Any) -> tuple[dict, Any]:
    """(tiles, call) of `compress_update` over a 1,024-token chunk of one request with the GPU's tiles (tuning:
    some of them instead), as the layer calls it: bf16 projections, the position bias added inside."""
    from dsv4.kernels.triton import compress as cmp
    dc, ns = (2 * d, 2 * ratio) if ov else (d, ratio)
    state = torch.zeros(2, 3, 2 if ov else 1, d)
    segs, block_d, most, split, warps = cmp._tiles(d, ns, True)                      # the GPU defaults
    kw = {**dict(segs=segs, block_d=block_d, split=split, num_warps=warps), **tuning}
    kw.setdefault("block_s", cmp._largest_pow2_divisor(ns // kw["split"], most))
    return kw, lambda: cmp.compress_update(torch.randn(1024, dc).bfloat16(), torch.randn(1024, dc).bfloat16(), state,
                                           torch.tensor([1]), (0,), (1024,), ratio, ov, z_bias=torch.randn(ratio, dc),
                                           **kw)


def _tma_scan(qi: torch.Tensor, g: torch.Tensor, typed: dict, b: Any) -> Any:
    """`indexer_scan_tma.launch` over the state's indexer keys (8 programs a request; keywords: its tuning)."""
    from dsv4.kernels.triton import indexer_scan_tma as ts
    out = torch.empty(2, b.seq_len_bound // 4)
    return lambda **kw: ts.launch(qi, g, out, typed["data"], typed["scale"], b.block_table, b.seq_lens // 4,
                                  b.seq_len_bound // 4, 1.0, 8, **kw)


def each(st: Any, cfg: Any, tpb: int, sargs: tuple, scan_maxima: Any, tma: Any, write_finish: Any) -> None:
    """`each`: one variant of every plain-Triton kernel the package launches, as the GPU path launches it
    at V4-Flash shapes (`_on_sm90`), a row `each <module>.<kernel> <variant>` each
    (tests/test_triton_compile.py checks that every launched kernel has one). The decode step is
    `attention.decode_path`'s, the prefill chunk `AttentionSubBlock._attend_general`'s (16 new tokens
    after 2,032 cached). The Gluon kernels are the `wide`, `prefill_wide` and `scan_tma` rows'."""
    from dsv4.bench import setup as bs
    from dsv4.bench.common import LAYER_INDEX
    from dsv4.kernels.reference.cache_ops import EntryWrite
    from dsv4.kernels.triton import cache_ops as co
    from dsv4.kernels.triton import compress as cmp
    from dsv4.kernels.triton import decode_attention as att
    from dsv4.kernels.triton import decode_attention_2p as tp
    from dsv4.kernels.triton import decode_attention_halves as dh
    from dsv4.kernels.triton import decode_combine as dcm
    from dsv4.kernels.triton import fp8_linear as fl
    from dsv4.kernels.triton import gather, gemv, topk
    from dsv4.kernels.triton import indexer_prefill as ip
    from dsv4.kernels.triton import indexer_scan as scn
    from dsv4.kernels.triton import indexer_scan_tma as ts
    from dsv4.kernels.triton import indexer_scores as sc
    from dsv4.kernels.triton import norm_rope as nr
    from dsv4.kernels.triton import prefetch as pf
    from dsv4.kernels.triton import prefill_attention as pa
    from dsv4.kernels.triton import prefill_attention_halves as pah
    from dsv4.kernels.triton import skinny_gemm as sk

    mgr, b = st.mgr, st.batch
    csa = LAYER_INDEX["csa"]
    sch, stt, pool = mgr.schemas[csa], mgr.states[csa], mgr.paged[csa]
    fmt = sch.kv_format
    # fp8 indexer keys: the format the pointer scorer (not the E2M1 scan) reads on the GPU
    st8 = bs.build_decode_state(cfg, context=2048, batch=2, device=torch.device("cpu"), tokens_per_block=tpb,
                                kv_format="fp8_ds", indexer_format="fp8")
    sch8, b8 = st8.mgr.schemas[csa], st8.batch
    cos, sin = torch.rand(2, 32), torch.rand(2, 32)

    def row(variant: str, module: Any, kname: str, call: Any, **gpu_kw: Any) -> None:
        _ROWS.append((f"each {module.__name__.rsplit('.', 1)[1]}.{kname} {variant}",
                      launched(module, kname, call, **gpu_kw)))

    with _on_sm90():
        # the decode step of the CSA layer (HCA for the fused attention's one-row form), 2 requests at 2,048
        row("decode positions", nr, "_cos_sin_kernel",
            lambda: nr.rope_cos_sin(torch.rand(32, dtype=torch.float64), b.positions))
        row("indexer queries (Hadamard, mxfp4 rounding)", nr, "_norm_rope_kernel",
            lambda: nr.norm_rope(torch.randn(2, 64, 128).bfloat16(), None, 0.0, cos, sin, normalize=False,
                                 out_dtype=torch.float32, hadamard=True, round_to="mxfp4"))
        row("fp8_ds", co, "_append_window_kernel",
            lambda: co.append_window(stt.swa, fmt, stt.swa_pos, stt.swa_head, torch.randn(2, 512), b.positions,
                                     b.token_request, b.request_slots, b.seq_lens))
        c, z = torch.randn(2, 1024).bfloat16(), torch.randn(2, 1024).bfloat16()
        fold = lambda **kw: co.compress_decode(c, z, stt.comp_state, b.request_slots, b.positions, 4, True,  # noqa: E731
                                               z_bias=torch.randn(4, 1024), **kw)
        row("csa main", co, "_compress_decode_kernel", fold)
        row("csa main fp8_ds finish", co, "_compress_decode_write_kernel",
            lambda: fold(write=EntryWrite(pool.kv, fmt, b.block_table, 64, _finish(512))))
        row("int8 queries", ts, "_q8_kernel", tma)
        row("mxfp4 bf16 block_n 64 group maxima", scn, "_indexer_scan_kernel", scan_maxima)
        row("fp8 keys bf16x2 block_n 64", sc, "_indexer_scores_kernel",
            lambda: sc.paged_indexer_scores(*sargs[:2], st8.mgr.paged[csa].indexer, sch8.indexer_format,
                                            b8.block_table, b8.seq_lens // 4, b8.seq_len_bound // 4, 64, block_n=64))
        # the top-k over 128K-token rows (32,768 scores): the filter (its 2,048 groups), bounded by the scan's
        # maxima at decode, by its own in a prefill chunk; 16K rows (4,096) take one select
        scores = torch.randn(2, 32768)
        filtered = lambda **kw: topk.topk_smaller_index(scores, 512, groups=topk.FILTER_GROUPS * 512,  # noqa: E731
                                                        **kw)
        given = lambda: filtered(group_max=torch.randint(-2**31, 2**31 - 1, (2, 2112), dtype=torch.int32),  # noqa: E731
                                 order="index")
        row("128K decode, the scan's maxima", topk, "_bound_kernel", given)
        row("128K decode", topk, "_filter_kernel", given)
        row("128K decode", topk, "_filtered_select_kernel", given)
        row("128K prefill rows", topk, "_group_max_kernel", filtered)
        row("16K decode, one select", topk, "_topk_kernel",
            lambda: topk.topk_smaller_index(torch.randn(2, 4096), 512, order="index"))
        # one HCA row: the q norm inside the fused kernel (decode_path.Q_NORM_IN_ATTENTION), split keys
        # (decode_attention's GPU choices past its inline device checks: the tiles of 64 heads x 8 chunks of 64
        # channels at bf16 operands, the key tile and the splits for 128 window rows + 16 entries)
        hca = _attention_args(mgr, b, "hca", rows=1)
        entries = hca[12]
        bh, bn, warps = att._attention_tiles(64, 8, 1, True)
        bn = att._tile_keys(128, entries, 64 // bh, SMS)
        splits = att.fused_splits((triton.cdiv(128, bn) + triton.cdiv(entries, bn)) * bn, 64 // bh, SMS)
        one_row = lambda: att.decode_attention(*hca, rope=(cos[:1], sin[:1]), out_dtype=torch.bfloat16,  # noqa: E731
                                               q_norm=1e-6, block_h=bh, block_n=bn, num_warps=warps,
                                               num_splits=splits)
        row(f"hca one row q_norm block_h={bh} block_n={bn} warps={warps} splits={splits}", att,
            "_decode_attn_kernel", one_row, num_stages=att.NUM_STAGES)
        row(f"hca one row {splits} splits rope bf16-out", dcm, "_combine_kernel", one_row)
        aargs = _attention_args(mgr, b, "csa")
        # the halves kernels' second half: the programmatic dependent launch, the prefill's inverse rotation
        row("csa fp8_ds half 1", dh, "_halves_kernel", lambda: att.decode_attention(*aargs, scheme="halves"),
            launch=1)
        two_pass = lambda: att.decode_attention(*aargs, scheme="two_pass", score_splits=SMS // 2,  # noqa: E731
                                                value_splits=2, rope=(cos, sin), out_dtype=torch.bfloat16)
        row(f"csa {SMS // 2} splits", tp, "_scores_kernel", two_pass)
        row("csa 2 value splits rope", tp, "_values_kernel", two_pass)
        row("hca o_a weights, 0.4 of a 50 MB L2", pf, "_prefetch_kernel",
            lambda: pf.l2_prefetch([torch.empty(8192, 4096, dtype=torch.bfloat16)], int(0.4 * 50e6)))
        # a prefill chunk of the CSA layer
        row("fp8_ds window", gather, "_read_fp8_ds_kernel",
            lambda: gather.gather_window(stt.swa, fmt, stt.swa_pos, b.request_slots))
        row("fp8_ds -> bf16", co, "_roundtrip_kernel",
            lambda: co.roundtrip_rows(torch.randn(16, 512), fmt, torch.bfloat16))
        kw, call = _compress(512, 4, True)
        row("csa main " + " ".join(f"{k}={v}" for k, v in kw.items()), cmp, "_compress_kernel", call)
        row("fp8_ds finish", co, "_write_entries_kernel", write_finish(pool.kv, fmt, 512))
        row("mxfp4 4 tokens block_n 64", scn, "_prefill_scan_kernel",
            lambda: ip.grouped_scores(torch.randn(16, 64, 128).bfloat16(), torch.randn(16, 64), pool.indexer,
                                      sch.indexer_format, b.block_table[:1], torch.full((16,), 508, dtype=torch.int32),
                                      ip.token_groups((16,), 0, 16, ip.TOKENS, "cpu"), 512, 64, tokens=ip.TOKENS,
                                      block_n=64))
        pargs, fin = _prefill_args(mgr, b, "csa")
        row("csa fp8_ds half 1 q_norm rope bf16-out", pah, "_prefill_halves_kernel",
            lambda: pa.prefill_attention(*pargs, **fin, q_norm=1e-6), launch=1)
        row("csa fp8_ds " + "block_h={} block_n={} warps={}".format(*pa._prefill_tiles(64, 8, 1, True)), pa,
            "_prefill_attn_kernel", lambda: pa.prefill_attention(*pargs, scheme="fused", **fin),
            num_stages=att.NUM_STAGES)
        # the V4-Flash projections: q up (+ the indexer's, N 40,960, K 1,024), q_a + kv (N 1,536, K 4,096), W_ob
        x1, x4, x16 = torch.randn(1, 1024).bfloat16(), torch.randn(4, 4096).bfloat16(), torch.randn(16, 1024).bfloat16()
        w_up, norm = torch.empty(40960, 1024, dtype=torch.bfloat16), (torch.rand(1024).bfloat16(), 1e-6)
        up8 = torch.empty(40960, 1024, dtype=torch.float8_e4m3fn), torch.empty(320, 8)
        in8 = torch.empty(1536, 4096, dtype=torch.float8_e4m3fn), torch.empty(12, 32)
        row("one row q up, q_a norm inside", gemv, "_gemv_kernel", lambda: gemv.gemv(x1, w_up, norm=norm))
        row("16 rows q up", sk, "_skinny_kernel", lambda: sk.skinny_gemm(x16, w_up))
        row("one row q up, q_a norm inside", fl, "_gemv_kernel", lambda: fl.linear_fp8(x1, *up8, norm=norm))
        row("16 rows q up", fl, "_gemm_desc_kernel", lambda: fl.linear_fp8(x16, *up8))
        k_splits = fl._k_splits(triton.cdiv(1536, fl._gemm_tiles(4)[1]), 4096, 4, SMS)[0]
        inputs = lambda: fl.linear_fp8(x4, *in8, splits=k_splits)     # noqa: E731
        row(f"4 rows q_a + kv, {k_splits} K splits", fl, "_gemm_kernel", inputs)
        row(f"4 rows q_a + kv, {k_splits} K splits", fl, "_sum_splits_kernel", inputs)
        row("W_ob for a prefill chunk", fl, "_dequant_kernel",
            lambda: fl.dequantize(torch.empty(4096, 8192, dtype=torch.float8_e4m3fn), torch.empty(32, 64),
                                  torch.bfloat16))
        row("one row hca q_a + kv beside the dense compressor", fl, "_gemv_pair_kernel",
            lambda: fl.gemv_pair(torch.randn(1, 4096).bfloat16(), torch.empty(1024, 4096, dtype=torch.bfloat16),
                                 *in8))
    # compiled on every core (forked workers share the captured arguments): ~40 s -> ~25 s on 2 cores
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as workers:
        for (label, _), info in zip(_ROWS, workers.imap(_compile_row, range(len(_ROWS)))):
            print(f"{label:<60} {info}", flush=True)


#: `each`'s rows (label, `launched`), read by the forked compile workers
_ROWS: list[tuple[str, tuple]] = []


def _compile_row(i: int) -> dict[str, Any] | str:
    return compile_info(*_ROWS[i][1])


def main() -> int:
    warnings.filterwarnings("ignore")
    from dsv4.bench import setup as bs
    from dsv4.bench.common import LAYER_INDEX, bench_config
    from dsv4.kernels.triton import cache_ops as co
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
    scan_maxima = lambda: sc.scores_and_maxima(*sargs, num_programs=2, num_warps=4, precision="bf16",  # noqa: E731
                                               block_n=64, tma=False, group_max=True)
    er, ei = torch.zeros(8, dtype=torch.int64), torch.arange(8)
    write_finish = lambda views, fmt, d: lambda: co.write_entries(views, fmt, torch.randn(8, d), er, ei,  # noqa: E731
                                                                   b.block_table, 64, _finish(d))
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
        report("scan group maxima (bf16, block_n 64, 64 slots)", scn, "_indexer_scan_kernel", scan_maxima)
    if "scan" in which or "scan_tma" in which:
        from dsv4.kernels.triton import indexer_scan_tma as ts
        tma = _tma_scan(qi, g, ifmt.typed(pool.indexer), b)
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
        # a prefill chunk's scan (16 tokens, 4 a group, 2 programs a group), as `indexer_prefill.grouped_scores`
        # launches it on sm_90, its queries' kernel chained (PDL)
        from dsv4.kernels.triton import indexer_prefill as ip
        typed = ifmt.typed(pool.indexer)
        with captured(ts, "_q8_kernel"), _patched(ts, "pdl", lambda dev: True):
            report("scan_tma prefill tokens=4", ts, "_prefill_scan_tma_kernel", lambda: ts.launch_prefill(
                torch.randn(16, 64, 128).bfloat16(), torch.randn(16, 64), torch.empty(16, 512), typed["data"],
                typed["scale"], b.block_table[:1], torch.full((16,), 508, dtype=torch.int32),
                ip.token_groups((16,), 0, 16, ip.TOKENS, "cpu"), 512, 1.0, tokens=ip.TOKENS,
                programs=ip.TMA_PROGRAMS))
    if "attention" in which or "wide" in which or "prefill_wide" in which:
        for kind in ("csa", "hca"):
            aargs = _attention_args(mgr, b, kind)
            from dsv4.kernels.triton import decode_attention_wide as dw
            from dsv4.kernels.triton import decode_combine as dcm
            with contextlib.ExitStack() as es:        # the wide scheme's checks want a GPU: call it past them
                es.enter_context(_patched(dw, "supported", lambda *a: True))
                es.enter_context(_patched(att, "sm_count", lambda dev: SMS))
                es.enter_context(captured(dcm, "_combine_kernel"))         # launched after it: intercepted too
                if "prefill_wide" not in which or "wide" in which:
                    report(f"attention wide {kind}", dw, "_wide_kernel",
                           lambda aargs=aargs: att.decode_attention(*aargs, scheme="wide"))
            if "prefill_wide" in which:     # the wide prefill kernel on 16 new tokens after 2,032 cached
                from dsv4.kernels.triton import prefill_attention as pa
                from dsv4.kernels.triton import prefill_attention_wide as pw
                pargs, fin = _prefill_args(mgr, b, kind)
                with contextlib.ExitStack() as es:
                    es.enter_context(_patched(pw, "supported", lambda *a: True))
                    es.enter_context(_patched(pw, "sm_count", lambda dev: SMS))
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
        aargs = _attention_args(mgr, b, "hca")
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
        rows = torch.randn(8, 128)
        report("write_entries mxfp4 (Hadamard)", co, "_write_entries_kernel",
               lambda: co.write_entries(pool.indexer, ifmt, rows, er, ei, b.block_table, 64))
        report("write_entries fp8_ds", co, "_write_entries_kernel",
               lambda: co.write_entries(pool.kv, sch.kv_format, torch.randn(8, 512), er, ei, b.block_table, 64))
        for name, views, fmt, d in (("fp8_ds", pool.kv, sch.kv_format, 512), ("mxfp4", pool.indexer, ifmt, 128)):
            report(f"write_entries {name} finish", co, "_write_entries_kernel", write_finish(views, fmt, d))
        from dsv4.kernels.triton import compress as cmp
        for name, d, ratio, ov, tunings in [
                ("csa main", 512, 4, True, [{}, dict(block_s=4), dict(num_warps=2)]),
                ("csa indexer", 128, 4, True, [{}, dict(block_s=4)]),
                ("hca", 512, 128, False, [{}, dict(split=16, num_warps=4, block_s=4), dict(num_warps=4)])]:
            for tuning in tunings:
                kw, call = _compress(d, ratio, ov, **tuning)
                report(f"compress {name} {kw}", cmp, "_compress_kernel", call)
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
    if "each" in which:
        each(st, cfg, tpb, sargs, scan_maxima, _tma_scan(qi, g, ifmt.typed(pool.indexer), b), write_finish)
    return 0


if __name__ == "__main__":
    sys.exit(main())
