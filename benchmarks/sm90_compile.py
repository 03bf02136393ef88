"""The sm_90 compiles of `compile_report.py` and its `each` set (`compile_each.py`), on a machine without a GPU.

An op wrapper called on CPU tensors launches nothing here: `captured` swaps a kernel for a recorder,
`launched` returns the arguments of one launch as the GPU path would pass them, and `compile_info`
compiles those with Triton's compiler for sm_90 and reads the cubin with the wheel's cuobjdump
(registers, stack, spills, MMA and instruction counts, ptxas's C7512 note). With SASS_DIR set each
compile's SASS goes there, PTX=1 / TTGIR=1 adding its PTX / Triton's layouts. `on_sm90` makes a whole
call (several launches, device queries, CPU/GPU tile choices) take the H100's path; the builders at
the bottom give the op wrappers' arguments on a small V4-shaped cache as the layers pass them.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.tensor_descriptor import TensorDescriptor

#: the type names of Triton's kernel signatures, by tensor dtype
_DT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv",
       torch.uint8: "u8", torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.float64: "fp64"}


class _Capture:
    """A kernel's stand-in: `kernel[grid](...)` records the launch's arguments instead of running it."""

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
    cap = _Capture(orig.fn if isinstance(orig, _Capture) else orig)     # inside `on_sm90`: the kernel itself
    setattr(module, name, cap)
    try:
        yield cap
    finally:
        setattr(module, name, orig)


@contextlib.contextmanager
def patched(module: Any, name: str, value: Any):
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


#: the SMs of an H100 (SXM): what `sm_count` answers in `on_sm90` and the wide schemes' rows
SMS = 132


@contextlib.contextmanager
def on_sm90():
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
                    es.enter_context(patched(mod, name, answers[name]))
                elif (inspect.isfunction(v) and v.__module__.startswith(pkg.__name__)
                      and {"cuda", "native"} & set(inspect.signature(v).parameters)):
                    es.enter_context(patched(mod, name, on_gpu(v)))
        from dsv4.kernels.triton import prefetch
        es.enter_context(patched(prefetch, "supported", lambda dev: True))
        yield


def attention_args(mgr: Any, b: Any, kind: str, rows: int = 2) -> tuple:
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


def prefill_args(mgr: Any, b: Any, kind: str, n: int = 16) -> tuple[tuple, dict]:
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


def entry_finish(d: int) -> Any:
    """A compressor's entry finish (kv norm, RoPE at the window's first token) for rows of d channels."""
    from dsv4.kernels.reference.norm_rope import EntryFinish
    return EntryFinish(torch.rand(d) + 0.5, 1e-6, torch.rand(32, dtype=torch.float64), 4)


def compress_chunk(d: int, ratio: int, ov: bool, **tuning: Any) -> tuple[dict, Any]:
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


def tma_scan(qi: torch.Tensor, g: torch.Tensor, typed: dict, b: Any) -> Any:
    """`indexer_scan_tma.launch` over the state's indexer keys (8 programs a request; keywords: its tuning)."""
    from dsv4.kernels.triton import indexer_scan_tma as ts
    out = torch.empty(2, b.seq_len_bound // 4)
    return lambda **kw: ts.launch(qi, g, out, typed["data"], typed["scale"], b.block_table, b.seq_lens // 4,
                                  b.seq_len_bound // 4, 1.0, 8, **kw)

