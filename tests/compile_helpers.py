"""Running `benchmarks/compile_report.py` from a test: its sm_90 compiles with the installed Triton,
without a GPU (`test_gluon_compile.py`, `test_triton_compile.py`)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

#: skips a test on a Triton wheel that cannot compile for sm_90
needs_ptxas = pytest.mark.skipif(not os.path.exists(PTXAS),
                                 reason="this Triton wheel carries no ptxas: cannot compile for sm_90")


def compile_report(*sets: str) -> subprocess.CompletedProcess:
    """`compile_report.py` on `sets` in a subprocess with Triton's real compiler (no interpreter), compile
    errors' last 600 characters in its rows."""
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "ERR_CHARS": "600"}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compile_report.py"), *sets],
                          capture_output=True, text=True, env=env, timeout=600)


def assert_compiled(label: str, info: str) -> None:
    """A row's compile info is a compiled kernel's: registers within the sm_90 file, some instructions."""
    c = ast.literal_eval(info)
    assert 0 < c["reg"] <= 255 and c["instr"] > 0, (label, c)
