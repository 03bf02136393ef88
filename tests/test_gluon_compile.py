"""The Gluon kernels (the wide decode and prefill attention, the TMA indexer scan) compile for sm_90
with the installed Triton.

They run only on an sm_90 GPU, so the CPU suite's interpreter never traces them, and Gluon's API moves
between Triton releases (`_reinterpret` became `reinterpret`, TMA's `async_copy_global_to_shared`
became `async_load`): a kernel that compiled on the GPU machines' Triton could fail on the Triton a
fresh install pulls. Triton compiles for sm_90 without a GPU (its wheel carries ptxas), so
`benchmarks/compile_report.py` is run here on every variant the decode and prefill paths launch.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest
import triton

from dsv4.kernels.triton import decode_attention_wide as dw

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

LABELS = ["attention wide csa", "attention wide hca",
          *(f"prefill wide {k}{v}" for k in ("csa", "hca") for v in ("", " rope bf16-out", " q_norm rope bf16-out")),
          "scan_tma queries (int8)", "scan_tma redo (bf16 MMA) group maxima", "scan_tma stages=2",
          "scan_tma stages=4", "scan_tma int8=False", "scan_tma group maxima", "scan_tma group maxima int8=False"]


@pytest.mark.skipif(not dw.GLUON_OK, reason=f"Gluon as written needs Triton 3.6 or later (have {triton.__version__})")
@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this Triton wheel carries no ptxas: cannot compile for sm_90")
def test_gluon_kernels_compile_for_sm90():
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "ERR_CHARS": "600"}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compile_report.py"), "wide",
                          "prefill_wide", "scan_tma"], capture_output=True, text=True, env=env, timeout=600)
    rows = {m.group(1).strip(): m.group(2) for m in re.finditer(r"^(\S.*?)\s{2,}(\{.*\}|\w+Error.*)$", run.stdout,
                                                                 re.MULTILINE)}
    missing = [label for label in LABELS if label not in rows]
    assert not missing, f"no compile row for {missing}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    failed = {label: rows[label] for label in LABELS if not rows[label].startswith("{")}
    assert not failed, f"Triton {triton.__version__} failed to compile for sm_90: {failed}\n{run.stdout[-3000:]}"
    for label in LABELS:                # a compiled kernel: registers within the sm_90 file, some instructions
        info = ast.literal_eval(rows[label])
        assert 0 < info["reg"] <= 255 and info["instr"] > 0, (label, info)
