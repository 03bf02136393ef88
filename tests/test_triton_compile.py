"""Every plain-Triton kernel the package launches compiles for sm_90 with the installed Triton, in the
launch configuration the GPU path picks.

Without a GPU the suite runs these kernels in Triton's interpreter (TRITON_INTERPRET=1), which never
runs Triton's compiler, and with the CPU's tiles: a kernel whose GPU branches (native bf16 dots,
inline PTX, programmatic dependent launch, the GPU's tiles and splits) stopped compiling on a new
Triton would first fail on a GPU. Triton compiles for sm_90 without one (its wheel carries ptxas), so
`benchmarks/compile_report.py each` compiles one variant of each kernel as the decode and prefill
paths launch it at V4-Flash shapes; this test checks that every kernel launched in
`src/dsv4/kernels/triton` has a row there and that each row compiled. The Gluon kernels are
`test_gluon_compile.py`'s.
"""

from __future__ import annotations

import glob
import os
import re

import triton
from compile_helpers import ROOT, assert_compiled, compile_report, needs_ptxas


def launched_kernels() -> set[str]:
    """`module.kernel` of every `_name_kernel[grid](...)` launch in dsv4.kernels.triton whose kernel is
    a `@triton.jit` function of that module (not `@gluon.jit`)."""
    found = set()
    for path in sorted(glob.glob(os.path.join(ROOT, "src", "dsv4", "kernels", "triton", "*.py"))):
        with open(path) as f:
            src = f.read()
        module = os.path.basename(path)[:-3]
        for name in sorted(set(re.findall(r"\b(_\w+_kernel)\[", src))):
            jit = re.search(rf"^@(\w+)\.jit\b[^\n]*\ndef {name}\(", src, re.MULTILINE)
            assert jit, f"{module}.{name} is launched but not defined in {module} as a jit function"
            if jit[1] == "triton":
                found.add(f"{module}.{name}")
    return found


def test_launch_sites_found():
    """The coverage below is only as good as the launch-site scan: it must see the kernels it is known to."""
    kernels = launched_kernels()
    assert {"decode_attention._decode_attn_kernel", "fp8_linear._gemv_kernel", "gemv._gemv_kernel",
            "indexer_scan_tma._q8_kernel", "topk._filter_kernel"} <= kernels
    assert not {"decode_attention_wide._wide_kernel", "indexer_scan_tma._scan_tma_kernel"} & kernels


@needs_ptxas
def test_triton_kernels_compile_for_sm90():
    run = compile_report("each")
    assert run.returncode == 0, f"compile_report.py each failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    rows: dict[str, list[tuple[str, str]]] = {}     # kernel -> (variant, compile info or error)
    for block in re.split(r"^(?=each )", run.stdout, flags=re.MULTILINE):     # an error may span lines
        m = re.match(r"each (\S+) (.*?)\s+(\{'reg'.*\}|\w+: .*)", block, re.DOTALL)
        if m:
            rows.setdefault(m[1], []).append((m[2], m[3].strip()))
    launched = launched_kernels()
    missing, stale = sorted(launched - rows.keys()), sorted(rows.keys() - launched)
    assert not missing, f"kernels launched in src/dsv4/kernels/triton without an `each` row in " \
                        f"benchmarks/compile_each.py (add one, as the GPU path launches it): {missing}"
    assert not stale, f"`each` rows of kernels the package no longer launches: {stale}"
    failed = {f"{k} {variant}": info for k, variants in rows.items() for variant, info in variants
              if not info.startswith("{")}
    assert not failed, f"Triton {triton.__version__} failed to compile for sm_90: {failed}\n{run.stdout[-3000:]}"
    for k, variants in rows.items():
        for variant, info in variants:
            assert_compiled(f"{k} {variant}", info)
