"""The fused prefill compress-and-write (`kernels.triton.compress_flush`) vs its reference twin
(`compress_update` then `write_entries`): ragged batches whose chunks start and end at, inside and
just around window boundaries (127/128/129, 255/256/257), chunks that close no window, several
chunks of one request in a row (the state and the kernel's counters carried over), the tiles,
every main format, with and without the entry finish (norm, RoPE). Pages are poisoned with random
bytes. CPU: Triton interpreter (small shapes); GPU: real, V4-Flash's HCA shape too."""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.formats import EntryFormat, main_format
from dsv4.errors import InputError
from dsv4.kernels.reference import cache_ops as ref_cache
from dsv4.kernels.reference import compress as ref_compress
from dsv4.kernels.reference.norm_rope import EntryFinish
from dsv4.kernels.triton import compress_flush as tri
from dsv4.model.config import DSV4Config
from dsv4.model.rope import RopeTable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPB = 4


def _state(r: int, d: int, g: torch.Generator) -> torch.Tensor:
    """A valid pending (M, S, A) per slot, slot 1 empty (-inf, 0, 0)."""
    st = torch.empty(r, 3, 1, d)
    st[:, 0] = torch.randn(r, 1, d, generator=g)
    st[:, 1] = torch.rand(r, 1, d, generator=g) + 0.5
    st[:, 2] = torch.randn(r, 1, d, generator=g)
    st[1, 0], st[1, 1:] = float("-inf"), 0.0
    return st.to(DEVICE)


def _finish(fmt: EntryFormat, ratio: int, g: torch.Generator) -> EntryFinish:
    rope = RopeTable.for_layer(DSV4Config.flash(), compressed=True)
    weight = (torch.rand(fmt.dim, generator=g) + 0.5).to(DEVICE)
    return EntryFinish(weight, 1e-6, rope.inv_freq_on(torch.device(DEVICE)), ratio)


def _touched(fmt: EntryFormat, pages: torch.Tensor, poison: torch.Tensor) -> torch.Tensor:
    """[blocks, EPB] bool: rows whose bytes differ from the poison in any region."""
    out = torch.zeros(pages.shape[0], EPB, dtype=torch.bool, device=pages.device)
    for name, view in fmt.views(pages, EPB).items():
        out |= (view != fmt.views(poison, EPB)[name]).any(-1)
    return out


def _run(fmt: EntryFormat, ratio: int, steps: list[tuple[tuple[int, ...], tuple[int, ...]]], finish: bool,
         seed: int, bias: bool = True, **tiles) -> None:
    """Each step (starts, lens) of the same requests through both ops on copies of one state and one
    poisoned page buffer; after every step the states, the set of written rows and the decoded
    rows agree, the quantised bytes almost all (the fused merge order rounds the fp32 entry
    differently in the last ulp, which can move a value across a rounding boundary)."""
    g = torch.Generator().manual_seed(seed)
    d = fmt.dim
    nreq = len(steps[0][0])
    slots = torch.randperm(nreq + 2, generator=g)[:nreq].to(DEVICE)
    st = _state(nreq + 2, d, g)
    cols = max(p0 + n for st_, ln in steps for p0, n in zip(st_, ln)) // ratio // EPB + 1
    blocks = 4 + nreq * (cols + 2)
    table = (torch.randperm(blocks - 1, generator=g)[:nreq * cols].view(nreq, cols) + 1).int().to(DEVICE)
    table[0, min(5, cols - 1)] = -1                # an unallocated block: its entries go to the null row
    poison = torch.randint(0, 256, (blocks, fmt.page_bytes(EPB)), dtype=torch.uint8, generator=g).to(DEVICE)
    fin = _finish(fmt, ratio, g) if finish else None
    zb = torch.randn(ratio, d, generator=g).to(DEVICE) if bias else None
    s_ref, s_tri, p_ref, p_tri = st.clone(), st.clone(), poison.clone(), poison.clone()
    for starts, lens in steps:
        t = sum(lens)
        c = torch.randn(t, d, generator=g).to(DEVICE)
        z = (torch.randn(t, d, generator=g) * 3).to(DEVICE)
        args = (slots, starts, lens, ratio, False)
        ref_compress.compress_flush(c, z, s_ref, *args, fmt.views(p_ref, EPB), fmt, table, EPB, z_bias=zb, finish=fin)
        tri.compress_flush(c, z, s_tri, *args, fmt.views(p_tri, EPB), fmt, table, EPB, z_bias=zb, finish=fin, **tiles)
        assert torch.equal(torch.isinf(s_ref), torch.isinf(s_tri))
        ok = torch.isfinite(s_ref)
        torch.testing.assert_close(s_tri[ok], s_ref[ok], rtol=1e-5, atol=1e-5)
        rows = _touched(fmt, p_ref, poison)
        assert torch.equal(rows, _touched(fmt, p_tri, poison)), "the ops wrote different rows"
        rows[0, 0] = False          # the null row: padding lands there in any order (never read)
        if fmt.name != "fp32":
            assert (p_ref[1:] != p_tri[1:]).float().mean().item() < 0.02
        blk, row = rows.nonzero(as_tuple=True)
        want = ref_cache.read_rows(fmt.views(p_ref, EPB), fmt, blk, row)
        got = ref_cache.read_rows(fmt.views(p_tri, EPB), fmt, blk, row)
        step = {"fp8_ds": 2 ** -3, "bf16": 2 ** -7}.get(fmt.name, 1e-5)
        torch.testing.assert_close(got, want, rtol=step, atol=step * want.abs().amax().item() if want.numel() else 0)
    assert not tri._counters(torch.device(DEVICE), 1).any(), "counters left set"


FORMATS = [main_format("fp8_ds", 128, 64), main_format("bf16", 128, 64), main_format("fp32", 128, 64)]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("finish", [True, False])
def test_ragged_batch_matches_reference(fmt, finish):
    """Six requests: chunks from a window's start, inside one, one or two tokens before a boundary,
    crossing one or two boundaries (a request with no finished entry and one with several)."""
    starts, lens = (0, 13, 126, 3, 254, 128), (37, 1, 2, 30, 3, 33)
    _run(fmt, 16, [(starts, lens)], finish, seed=len(fmt.name) + finish)


@pytest.mark.parametrize("tiles", [dict(tok=4, block_d=32), dict(tok=16, block_d=128, num_warps=2),
                                   dict(tok=8, block_d=64, single=False)])
def test_tiles_and_chunks_in_a_row(tiles):
    """One request's prompt in chunks that end at, before and after window boundaries (ratio 16:
    127 / 128 / 129 as 7 / 8 / 9 windows plus a slot), then decode-sized steps; every tile choice
    and the table path (single=False) give the reference's state and pages."""
    steps = [((0,), (127,)), ((127,), (1,)), ((128,), (129,)), ((257,), (1,)), ((258,), (30,))]
    _run(main_format("fp8_ds", 128, 64), 16, steps, True, seed=7, **tiles)


@pytest.mark.parametrize("start,n", [(0, 256), (127, 130), (255, 2), (129, 1)])
def test_hca_ratio_one_request(start, n):
    """HCA's ratio (128) and a long prompt's one-request chunk, around 127/128/129 and 255/256/257."""
    _run(main_format("fp8_ds", 128, 64), 128, [((start,), (n,))], True, seed=start + n)


def test_without_bias_and_batch_plan():
    """No position bias (z already has it), two requests and a plan passed in; a plan of another
    batch is refused."""
    _run(main_format("bf16", 128, 64), 16, [((5, 40), (20, 7))], True, seed=3, bias=False)
    from dsv4.kernels.compress_plan import make_plan
    d, fmt = 128, main_format("bf16", 128, 64)
    c = torch.randn(4, d, device=DEVICE)
    pages = torch.zeros(8, fmt.page_bytes(EPB), dtype=torch.uint8, device=DEVICE)
    table = torch.ones(1, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(InputError, match="does not describe this call"):
        tri.compress_flush(c, c, torch.zeros(1, 3, 1, d, device=DEVICE), torch.zeros(1, dtype=torch.int32,
                           device=DEVICE), (0,), (4,), 16, False, fmt.views(pages, EPB), fmt, table, EPB,
                           plan=make_plan((0,), (5,), 16, False, DEVICE))


@pytest.mark.parametrize("tiles", [dict(tok=3), dict(tok=32), dict(block_d=48), dict(block_d=256)])
def test_refuses_tiles_that_do_not_fit(tiles):
    """Tiles that would leave slots or channels out are refused, not silently rounded."""
    d, fmt = 128, main_format("bf16", 128, 64)
    c = torch.randn(4, d)
    pages = torch.zeros(8, fmt.page_bytes(EPB), dtype=torch.uint8)
    with pytest.raises(InputError, match="tiles"):
        tri.compress_flush(c, c, torch.zeros(1, 3, 1, d), torch.zeros(1, dtype=torch.int32), (0,), (4,), 16, False,
                           fmt.views(pages, EPB), fmt, torch.ones(1, 4, dtype=torch.int32), EPB, **tiles)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none here (run through the device tool)")
@pytest.mark.parametrize("steps", [[((0,), (8192,)), ((8192,), (8192,))], [((100, 3000), (4000, 5000))]])
def test_gpu_flash_hca_shape(steps):
    """V4-Flash's HCA compressor (D 512, ratio 128) on 8K prefill chunks: thousands of programs
    race to finish 64 entries a chunk."""
    _run(main_format("fp8_ds", 512, 64), 128, steps, True, seed=11)
