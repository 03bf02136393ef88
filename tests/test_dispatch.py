"""Which op namespace serves a device: the Triton kernels only on a Triton they are written for.

Triton 3.2-3.4 (what torch 2.6-2.8 pin) cannot import the kernels at all; before the floor, `auto`
on CUDA picked them anyway and the first op raised an ImportError deep in the model.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from dsv4.errors import ConfigError
from dsv4.kernels import dispatch


@pytest.fixture
def fake_triton(monkeypatch):
    """Set the installed Triton's version (None: not installed), with the dispatcher's caches cleared."""
    import triton

    def use(version: str | None) -> None:
        if version is None:
            monkeypatch.setitem(sys.modules, "triton", None)       # `import triton` raises ImportError
        else:
            monkeypatch.setattr(triton, "__version__", version)
        dispatch.triton_problem.cache_clear()
        dispatch._warn_reference_on.cache_clear()

    yield use
    dispatch.triton_problem.cache_clear()
    dispatch._warn_reference_on.cache_clear()


@pytest.mark.parametrize("version", ["3.2.0", "3.4.0", "3.5.1"])
def test_a_triton_older_than_the_floor_is_refused(fake_triton, version):
    fake_triton(version)
    assert not dispatch.triton_available()
    with pytest.raises(ConfigError, match=f"triton {version} is older than 3.6"):
        dispatch.ops_for("cpu", "triton")
    with pytest.warns(RuntimeWarning, match=f"reference ops serve cuda tensors.*triton {version}"):
        ops = dispatch.ops_for(torch.device("cuda"), "auto")
    assert ops.name == "reference"
    with warnings.catch_warnings():          # said once a process, not at every call site's lookup
        warnings.simplefilter("error")
        assert dispatch.ops_for("cuda:0").name == "reference"


@pytest.mark.parametrize("version", ["3.6.0", "3.9.0", "3.10.1", "4.0.0+git1234abcd"])
def test_a_triton_at_or_past_the_floor_serves_cuda(fake_triton, version):
    pytest.importorskip("triton")
    fake_triton(version)
    assert dispatch.triton_available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.ops_for(torch.device("cuda"), "auto").name == "triton"
        assert dispatch.ops_for("cpu", "auto").name == "reference"      # CPU tensors: the reference, quietly


def test_no_triton_at_all(fake_triton):
    fake_triton(None)
    with pytest.raises(ConfigError, match="not installed"):
        dispatch.ops_for("cpu", "triton")
    with pytest.warns(RuntimeWarning, match="not installed"):
        assert dispatch.ops_for("cuda", "auto").name == "reference"
    assert dispatch.ops_for("cpu", "reference").name == "reference"
