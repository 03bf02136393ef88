"""The Gluon kernels (the wide decode and prefill attention, the TMA indexer scan) compile for sm_90
with the installed Triton.

They run only on an sm_90 GPU, so the CPU suite's interpreter never traces them, and Gluon's API moves
between Triton releases (`_reinterpret` became `reinterpret`, TMA's `async_copy_global_to_shared`
became `async_load`): a kernel that compiled on the GPU machines' Triton could fail on the Triton a
fresh install pulls. Triton compiles for sm_90 without a GPU (its wheel carries ptxas), so
`benchmarks/compile_report.py` is run here on every variant the decode and prefill paths launch.
"""

from __future__ import annotations

import re

import pytest
import triton
from compile_helpers import assert_compiled, compile_report, needs_ptxas

from dsv4.kernels.triton import decode_attention_wide as dw

LABELS = ["attention wide csa", "attention wide hca",
          *(f"prefill wide {k}{v}" for k in ("csa", "hca") for v in ("", " rope bf16-out", " q_norm rope bf16-out")),
          "scan_tma queries (int8)", "scan_tma redo (bf16 MMA) group maxima", "scan_tma stages=2",
          "scan_tma stages=4", "scan_tma int8=False", "scan_tma group maxima", "scan_tma group maxima int8=False",
          "scan_tma prefill tokens=4"]


@pytest.mark.skipif(not dw.GLUON_OK, reason=f"Gluon as written needs Triton 3.6 or later (have {triton.__version__})")
@needs_ptxas
def test_gluon_kernels_compile_for_sm90():
    run = compile_report("wide", "prefill_wide", "scan_tma")
    rows = {m.group(1).strip(): m.group(2) for m in re.finditer(r"^(\S.*?)\s{2,}(\{.*\}|\w+Error.*)$", run.stdout,
                                                                 re.MULTILINE)}
    missing = [label for label in LABELS if label not in rows]
    assert not missing, f"no compile row for {missing}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    failed = {label: rows[label] for label in LABELS if not rows[label].startswith("{")}
    assert not failed, f"Triton {triton.__version__} failed to compile for sm_90: {failed}\n{run.stdout[-3000:]}"
    for label in LABELS:
        assert_compiled(label, rows[label])
