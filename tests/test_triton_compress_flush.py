"""`compress_flush`: a compressor's step and the write of the entries it finishes, as one op.

The Triton twin runs HCA's one-request chunks as one Gluon kernel (`compress_flush._hca_kernel`,
GPU only: sm_90 and Triton 3.6+); elsewhere it is the two kernels. Both are checked against the
reference op (`compress_update` then `write_entries(finish=)`, fp32 on the same device) over
chains of chunks that start and end on both sides of window edges (127 / 128 / 129, 255 / 256 /
257), a chunk inside one window, a long chunk, positions past 2^20, from a random stored state,
c / z as bf16 column views of a wider buffer (the layer's fused projection). The pages start as
random bytes; the fused kernel's sums run in another order than the reference's, so its entries
decode to the reference's within an e4m3 step and almost all their bytes agree, and its state
agrees to fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.formats import main_format
from dsv4.errors import InputError
from dsv4.kernels.reference import cache_ops as ref_cache
from dsv4.kernels.reference import compress as ref
from dsv4.kernels.reference.norm_rope import EntryFinish
from dsv4.model.config import DSV4Config
from dsv4.model.rope import RopeTable

RATIO, D, EPB = 128, 512, 4
FMT = main_format("fp8_ds", D, 64)


def _fused_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from dsv4.kernels.triton.decode_attention_wide import GLUON_OK
    return GLUON_OK and torch.cuda.get_device_capability()[0] == 9


needs_gpu = pytest.mark.skipif(not _fused_ready(), reason="the fused HCA kernel needs an sm_90 GPU and Triton 3.6+")


def _inputs(n: int, g: torch.Generator, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    """c, z [n, 512] bf16: column views of one [n, 1056] buffer (row stride 1056, 16-byte aligned)."""
    buf = (torch.randn(n, 1056, generator=g) * 2).to(torch.bfloat16).to(dev)
    return buf[:, 16:16 + D], buf[:, 528:528 + D]


def _state(g: torch.Generator, dev: str) -> torch.Tensor:
    st = torch.empty(3, 3, 1, D)
    st[:, 0] = torch.randn(3, 1, D, generator=g) * 2
    st[:, 1] = torch.rand(3, 1, D, generator=g) * 3 + 0.5
    st[:, 2] = torch.randn(3, 1, D, generator=g) * 2
    return st.to(dev)


def _run(chunks: list[tuple[int, int]], bias: bool, seed: int) -> None:
    from dsv4.kernels.triton import compress_flush as tri
    dev = "cuda"
    g = torch.Generator().manual_seed(seed)
    rope = RopeTable.for_layer(DSV4Config.flash(), compressed=True)
    fin = EntryFinish((torch.rand(D, generator=g) + 0.5).to(dev), 1e-6, rope.inv_freq_on(torch.device(dev)), RATIO)
    z_bias = (torch.randn(RATIO, D, generator=g)).to(torch.bfloat16).to(dev) if bias else None
    last = (chunks[-1][0] + chunks[-1][1]) // RATIO
    cols = last // EPB + 1
    nblocks = cols + 2
    table = (torch.randperm(nblocks - 1, generator=g)[:cols] + 1).to(torch.int32)[None].to(dev)
    slots = torch.tensor([1], device=dev)
    poison = torch.randint(0, 256, (nblocks, FMT.page_bytes(EPB)), generator=g, dtype=torch.uint8).to(dev)
    pages = {k: poison.clone() for k in ("ref", "fused", "two")}
    state0 = _state(g, dev)
    states = {k: state0.clone() for k in pages}
    for p0, n in chunks:
        c, z = _inputs(n, g, dev)
        common = (slots, (p0,), (n,), RATIO, False)
        ref.compress_flush(c, z, states["ref"], *common, FMT.views(pages["ref"], EPB), FMT, table, EPB,
                           z_bias=z_bias, finish=fin)
        for k, fused in (("fused", True), ("two", False)):
            tri.compress_flush(c, z, states[k], *common, FMT.views(pages[k], EPB), FMT, table, EPB, z_bias=z_bias,
                               finish=fin, fused=fused)
        torch.cuda.synchronize()
        for k in ("fused", "two"):
            where = f"{k}, chunk ({p0}, {n})"
            torch.testing.assert_close(states[k], states["ref"], rtol=2e-5, atol=2e-5,
                                       msg=lambda m, where=where: f"{where}: {m}")
    # every entry finished so far, decoded; the pages' other bytes untouched
    first = chunks[0][0] // RATIO
    idx = torch.arange(first, last, device=dev)
    req = torch.zeros_like(idx)
    blk, row = ref_cache._locate(table, req, idx, EPB, idx >= 0)
    got = {k: ref_cache.read_rows(FMT.views(p, EPB), FMT, blk, row) for k, p in pages.items()}
    assert torch.isfinite(got["ref"]).all()
    assert not torch.allclose(got["ref"], ref_cache.read_rows(FMT.views(poison, EPB), FMT, blk, row))
    for k in ("fused", "two"):
        torch.testing.assert_close(got[k], got["ref"], rtol=2 ** -3, atol=2 ** -3 * got["ref"].abs().max().item(),
                                   msg=lambda m, k=k: f"{k} entries: {m}")
        diff = pages[k] != pages["ref"]
        assert diff.float().sum().item() <= 0.02 * len(idx) * FMT.entry_bytes, f"{k}: too many bytes differ"
        written = torch.zeros_like(pages[k])
        for v in FMT.views(written, EPB).values():
            v[blk, row] = 1
        assert not (diff & (written == 0)).any(), f"{k}: bytes outside the written entries changed"


@needs_gpu
@pytest.mark.parametrize("chunks", [
    [(0, 8192)],                                           # the bench's chunk: 64 windows and an empty one
    [(0, 127), (127, 2), (129, 127), (256, 1), (257, 255)],  # ends and starts around 128 / 256
    [(5, 40), (45, 3)],                                    # inside one window, twice
    [(255, 258), (513, 640)],
    [(2 ** 20 - 129, 300)],                                # far positions: the fp64 angles
], ids=["8k", "edges", "inside", "mid", "far"])
def test_hca_compress_flush_matches_reference(chunks):
    _run(chunks, bias=True, seed=len(chunks) * 7 + chunks[0][0] % 97)


@needs_gpu
def test_hca_compress_flush_without_bias():
    _run([(100, 300), (400, 128)], bias=False, seed=3)


@needs_gpu
def test_compress_flush_fused_refuses_what_it_cannot_run():
    """fused=True where the one kernel does not apply (CSA's overlap, two requests, bf16 entries) is
    an error, not the other path."""
    from dsv4.kernels.triton import compress_flush as tri
    dev = "cuda"
    g = torch.Generator().manual_seed(0)
    c, z = _inputs(256, g, dev)
    rope = RopeTable.for_layer(DSV4Config.flash(), compressed=True)
    fin = EntryFinish(torch.ones(D, device=dev), 1e-6, rope.inv_freq_on(torch.device(dev)), RATIO)
    table = torch.arange(1, 3, dtype=torch.int32, device=dev)[None]
    pages = torch.zeros(4, FMT.page_bytes(EPB), dtype=torch.uint8, device=dev)
    st = _state(g, dev)
    slot = torch.tensor([0], device=dev)
    with pytest.raises(InputError, match="fused"):
        tri.compress_flush(c, z, st, slot, (0,), (256,), RATIO, True, FMT.views(pages, EPB), FMT, table, EPB,
                           finish=fin, fused=True)
    bf16 = main_format("bf16", D, 64)
    with pytest.raises(InputError, match="fused"):
        tri.compress_flush(c, z, st, slot, (0,), (256,), RATIO, False, bf16.views(pages, EPB), bf16, table, EPB,
                           finish=fin, fused=True)
