"""Triton cache writes and compress_decode against their PyTorch twins.

Cache writes (append_window, write_entries) must match the reference byte for byte: every test
starts from page buffers (and ring positions / heads) filled with random bytes, runs the same
sequence of calls through both implementations on copies, and compares the whole buffers.
Every format is a Triton kernel (fp8_ds, bf16, fp32; mxfp4, fp8, nvfp4, bf16_i, fp32_i).

compress_decode is fp32 math: after one step from the same state, entries and the (M, S, A)
state must agree to 1e-6 relative, with an absolute floor of 1e-6 x the tensor's largest
magnitude (A's terms can cancel, so a small A carries the rounding of its large terms): the
kernel's exp (ex2.approx on NVIDIA GPUs, ~2 ulp) and fused multiply-adds differ from torch's in
the last ulps. entry_index exactly.

Not compared byte for byte: NaN stored as bf16 (fp32/bf16 formats and the fp8_ds rope part).
torch's own bf16 NaN pattern depends on the conversion path (0x7FC0 scalar CPU, 0xFFFF
vectorised CPU, 0x7FFF CUDA); the kernel stores 0x7FC0 and the test checks it decodes as NaN.
The null block's row 0 is not compared when several padding rows race for it.

Without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so
shapes are small: a few rows at the real head size (D=512, W=128), more at D=128. On a CUDA
machine the same tests run on the GPU, plus a CUDA-graph replay test.
"""

from __future__ import annotations

import math
from decimal import Decimal, getcontext

import pytest
import torch
import triton
import triton.language as tl

from dsv4.cache.formats import EntryFormat, indexer_format, main_format
from dsv4.errors import FormatError, InputError
from dsv4.kernels.reference import cache_ops as ref
from dsv4.kernels.reference import decode as ref_decode
from dsv4.kernels.reference.norm_rope import EntryFinish, finish_entries
from dsv4.kernels.triton import cache_ops as tri
from dsv4.kernels.triton.cache_ops import cos_sin64
from dsv4.model.config import DSV4Config
from dsv4.model.rope import RopeTable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DEVICES = [pytest.param(DEVICE, id=DEVICE)]

MAIN = [main_format(n, d, 64) for d in (128, 512) for n in ("fp8_ds", "bf16", "fp32")]
INDEXER = [indexer_format(n, d) for d in (64, 128) for n in ("mxfp4", "fp8", "nvfp4", "bf16", "fp32")]


def _fid(f: EntryFormat) -> str:
    return f"{f.name}-{f.dim}" + ("-h" if f.hadamard else "")


def _pages(fmt: EntryFormat, n: int, entries: int, device: str) -> torch.Tensor:
    """Page buffer [n, page_bytes] of random bytes (not zeros: a missed write must show)."""
    return torch.randint(0, 256, (n, fmt.page_bytes(entries)), dtype=torch.uint8, device=device)


def _rows(n: int, fmt: EntryFormat, device: str, nonfinite: bool = True) -> torch.Tensor:
    """[n, D] fp32 rows that stress quantisation: a zero row, a tiny row, an outlier row, a wide
    dynamic range, and (in the quantised part only) inf / -inf / NaN / -0.0."""
    d = fmt.dim
    x = torch.randn(n, d) * torch.exp(torch.randn(n, 1) * 3) * torch.exp(torch.randn(n, d))
    x[0] = 0.0
    if n > 1:
        x[1] = torch.randn(d) * 1e-7
    if n > 2:
        x[2, :: 17] *= 1000.0
    if n > 3 and nonfinite:
        q = d - fmt.rope_dim if fmt.name == "fp8_ds" else d   # the part that is quantised
        if fmt.name not in ("bf16", "fp32", "bf16_i", "fp32_i"):
            x[3, [0, 5, q - 1, 7]] = torch.tensor([float("inf"), float("nan"), -float("inf"), -0.0])
        else:
            x[3, [0, q - 1, 7]] = torch.tensor([float("inf"), -float("inf"), -0.0])
    return x.to(device)


# ---------------------------------------------------------------------------- write_entries
def _write_both(fmt: EntryFormat, rows: torch.Tensor, ereq: torch.Tensor, eidx: torch.Tensor,
                block_table: torch.Tensor, epb: int, nblocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = rows.device
    poison = _pages(fmt, nblocks, epb, str(dev))
    a, b = poison.clone(), poison.clone()
    ref.write_entries(fmt.views(a, epb), fmt, rows, ereq, eidx, block_table, epb)
    tri.write_entries(fmt.views(b, epb), fmt, rows, ereq, eidx, block_table, epb)
    return poison, a, b


def _assert_bytes_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.equal(a, b):
        bad = (a != b).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} bytes differ, first at {bad[:4].tolist()}: "
                             f"reference {a[tuple(bad[:4].T)].tolist()} triton {b[tuple(bad[:4].T)].tolist()}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", MAIN + INDEXER, ids=_fid)
def test_write_entries_matches_reference_bytes(fmt: EntryFormat, device: str):
    """Ragged requests, entries on block edges (epb-1, epb), one padding row: whole pages equal."""
    epb = 4
    n = 4 if fmt.dim == 512 else 8
    rows = _rows(n, fmt, device)
    # request 0 -> blocks [3, 1, 5], request 1 -> [2, 4, -1] (-1: not allocated), request 2 -> [6, -1, -1]
    block_table = torch.tensor([[3, 1, 5], [2, 4, -1], [6, -1, -1]], dtype=torch.int32, device=device)
    ereq = torch.tensor([0, 1, 0, 2, 1, 0, 1, 2][:n], device=device)
    eidx = torch.tensor([3, 4, 4, 0, 7, -1, 0, 1][:n], device=device)
    if n == 4:
        eidx[3] = -1  # keep a padding row in the short D=512 batch too
    _, a, b = _write_both(fmt, rows, ereq, eidx, block_table, epb, nblocks=7)
    _assert_bytes_equal(a, b, f"{fmt.name} pages")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", [main_format("fp8_ds", 512, 64), main_format("bf16", 512, 64),
                                 main_format("fp32", 512, 64), indexer_format("mxfp4", 128),
                                 indexer_format("fp8", 128), indexer_format("fp32", 128)], ids=_fid)
def test_write_entries_finish(fmt: EntryFormat, device: str):
    """finish=: raw compressor entries get kv_norm and RoPE at w*m inside the write. The reference
    applies `finish_entries` and writes (equal to the unfused path by construction); the kernel's
    fused fp32 arithmetic may round an ulp differently (on GPUs its sqrt and division too), so its
    pages decode to the reference's within a quantisation step and almost all bytes of the
    quantised formats agree. Positions past 2^17 (w * m) too."""
    epb, n = 4, 6
    g = torch.Generator().manual_seed(fmt.dim + len(fmt.name))
    rows = (torch.randn(n, fmt.dim, generator=g) * torch.exp(torch.randn(n, 1, generator=g))).to(device)
    rope = RopeTable.for_layer(DSV4Config.flash(), compressed=True)
    weight = (torch.rand(fmt.dim, generator=g) + 0.5).to(device)
    fin = EntryFinish(weight, 1e-6, rope.inv_freq_on(torch.device(device)), 4)
    block_table = torch.tensor([[3, 1, 5], [2, 4, -1]], dtype=torch.int32, device=device)
    ereq = torch.tensor([0, 1, 0, 1, 0, 1], device=device)
    eidx = torch.tensor([3, 4, 9, 0, -1, 5], device=device)
    big = torch.tensor([[3, 1, 5] + [0] * 40000], dtype=torch.int32, device=device)[:, :40000]
    poison = _pages(fmt, 7, epb, device)
    a, b, c = poison.clone(), poison.clone(), poison.clone()
    ref.write_entries(fmt.views(a, epb), fmt, rows, ereq, eidx, block_table, epb, fin)
    tri.write_entries(fmt.views(b, epb), fmt, rows, ereq, eidx, block_table, epb, fin)
    ref.write_entries(fmt.views(c, epb), fmt, finish_entries(rows, eidx, fin), ereq, eidx, block_table, epb)
    _assert_bytes_equal(a, c, "reference finish vs finish_entries + write")
    if fmt.name not in ("fp32", "fp32_i"):     # fp32 rows store every ulp: compared as values below
        assert (a != b).float().mean().item() < 0.02, "fused kernel pages differ from the reference's"
    ok = eidx >= 0
    blk, row = ref._locate(block_table, ereq, eidx, epb, ok)
    da, db = (ref.read_rows(fmt.views(p, epb), fmt, blk[ok], row[ok]) for p in (a, b))
    step = {"fp8_ds": 2 ** -3, "bf16": 2 ** -7, "fp8": 2 ** -3, "mxfp4": 0.5}.get(fmt.name, 1e-5)
    torch.testing.assert_close(db, da, rtol=step, atol=step * da.abs().max().item())
    assert not torch.allclose(da, ref.read_rows(fmt.views(poison.clone(), epb), fmt, blk[ok], row[ok]))
    # far positions: entry 30000 at ratio 4 (position 120000), the kernel's fp64 angles
    fa, fb = poison.clone(), poison.clone()
    far = torch.tensor([30000, 30001], device=device)
    two = torch.zeros(2, dtype=torch.long, device=device)
    big[0, 30000 // epb] = 6
    ref.write_entries(fmt.views(fa, epb), fmt, rows[:2], two, far, big, epb, fin)
    tri.write_entries(fmt.views(fb, epb), fmt, rows[:2], two, far, big, epb, fin)
    fblk, frow = ref._locate(big, two, far, epb, far >= 0)
    torch.testing.assert_close(ref.read_rows(fmt.views(fb, epb), fmt, fblk, frow),
                               ref.read_rows(fmt.views(fa, epb), fmt, fblk, frow), rtol=step, atol=step * 8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", [main_format("fp8_ds", 128, 64), indexer_format("mxfp4", 64),
                                 indexer_format("nvfp4", 64)], ids=_fid)
def test_write_entries_padding_only_touches_null_row(fmt: EntryFormat, device: str):
    """entry_index -1, unallocated blocks (-1) and entries past the block table go to block 0
    row 0 and nowhere else."""
    epb = 4
    rows = _rows(7, fmt, device)
    block_table = torch.tensor([[1, -1], [2, 3]], dtype=torch.int32, device=device)
    ereq = torch.tensor([0, 1, 0, 1, 0, 1, 1], device=device)
    # 6 -> block -1 (row 0, not 2); 13 -> column 3 of a 2-column table (not block 3, row 1)
    eidx = torch.tensor([-1, 5, 6, -1, 1, -7, 13], device=device)
    poison, a, b = _write_both(fmt, rows, ereq, eidx, block_table, epb, nblocks=4)
    _assert_bytes_equal(a[1:], b[1:], "real blocks")
    for name, v in fmt.views(b, epb).items():   # block 0: only row 0 may change (the rows race for it)
        _assert_bytes_equal(fmt.views(poison, epb)[name][0, 1:], v[0, 1:], f"null block {name} rows 1..")
    first = fmt.regions[0].name
    assert not torch.equal(fmt.views(poison, epb)[first][0, 0], fmt.views(b, epb)[first][0, 0])


def _e4m3_ties() -> torch.Tensor:
    """Every e4m3 value, every midpoint between neighbours, and the floats next to each midpoint."""
    vals = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (vals[:-1] + vals[1:]) / 2
    c = torch.cat([vals, mids, torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))])
    return torch.cat([c, -c])


def _e2m1_ties() -> torch.Tensor:
    v = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mids = (v[:-1] + v[1:]) / 2
    c = torch.cat([v, mids, torch.nextafter(mids, torch.tensor(9.0)), torch.nextafter(mids, torch.tensor(-9.0)),
                   torch.tensor([7.0, 1e30, 1e-40, 2.0 ** -126])])
    return torch.cat([c, -c])


def _tile_rows(values: torch.Tensor, group: int, amax: float) -> torch.Tensor:
    """Rows of `group` values whose first is `amax`, so the group scale is 2^0 and the other
    values reach the rounding unscaled."""
    per = group - 1
    n = -(-values.numel() // per)
    v = torch.cat([values, torch.zeros(n * per - values.numel())]).view(n, per)
    return torch.cat([torch.full((n, 1), amax), v], 1)


@pytest.mark.parametrize("device", DEVICES)
def test_rounding_ties_match_reference(device: str):
    """e4m3 and E2M1 rounding at every tie and next to it, subnormal inputs, nvfp4 scale edges
    (formats without the Hadamard rotation, so crafted values reach the rounding as they are)."""
    e4 = _tile_rows(_e4m3_ties(), 64, 448.0)
    rows = torch.cat([e4, torch.randn(e4.shape[0], 64)], 1).to(device)            # + a bf16 rope part
    fp8_ds = EntryFormat(name="fp8_ds", dim=128, rope_dim=64)
    fp8 = EntryFormat(name="fp8", dim=128)          # scale max(448, 1e-4) / 448 = 1
    e2 = _tile_rows(_e2m1_ties(), 32, 6.0).to(device)
    mxfp4 = EntryFormat(name="mxfp4", dim=32)
    # mxfp4 groups of fp32 subnormals: scale 2^-126, so x * 2^126 reaches E2M1 codes up to 6
    # (a flush-to-zero multiply would store zeros).
    sub = torch.rand(4, 32) * 2.0 ** -126 * torch.tensor([1.0, 0.5, 0.1, 0.01])[:, None]
    sub[:, ::3] *= -1
    # nvfp4 groups whose e4m3 scale is normal, subnormal, or rounds to 0 (stored as 2^-9).
    nv = torch.randn(2, 128) * torch.tensor([1e4, 1.0, 0.1, 0.01, 1e-3, 1e-4, 0.0, 3.0]).repeat_interleave(16)
    for fmt, x in ((fp8_ds, rows), (fp8, torch.cat([e4, e4], 1).to(device)), (mxfp4, torch.cat([e2, sub.to(device)])),
                   (EntryFormat(name="nvfp4", dim=128), nv.to(device))):
        n = x.shape[0]
        block_table = torch.tensor([[1]], dtype=torch.int32, device=device)
        eidx = torch.arange(n, device=device)
        _, a, b = _write_both(fmt, x, torch.zeros_like(eidx), eidx, block_table, n, nblocks=2)
        _assert_bytes_equal(a, b, f"{fmt.name} ties")


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_nan_is_stored_as_nan(device: str):
    fmt = main_format("bf16", 128, 64)
    x = torch.randn(1, 128, device=device)
    x[0, 3] = float("nan")
    pages = _pages(fmt, 2, 2, device)
    tri.write_entries(fmt.views(pages, 2), fmt, x, torch.zeros(1, device=device, dtype=torch.long),
                      torch.ones(1, device=device, dtype=torch.long), torch.ones(1, 1, dtype=torch.int32,
                                                                                 device=device), 2)
    back = fmt.typed(fmt.views(pages, 2))["kv"][1, 1].float()
    assert torch.isnan(back[3]) and torch.equal(back[torch.arange(128, device=device) != 3],
                                                x[0, torch.arange(128, device=device) != 3].bfloat16().float())


@pytest.mark.parametrize("device", DEVICES)
def test_write_entries_accepts_strided_and_bf16_rows(device: str):
    fmt = main_format("fp8_ds", 128, 64)
    wide = _rows(3, EntryFormat(name="fp8_ds", dim=256, rope_dim=64), device, nonfinite=False)
    block_table = torch.tensor([[1, 2]], dtype=torch.int32, device=device)
    for rows in (wide[:, 64:192], wide[:, :128].bfloat16()):
        eidx = torch.tensor([0, 3, 2], device=device)
        _, a, b = _write_both(fmt, rows, torch.zeros_like(eidx), eidx, block_table, 2, nblocks=3)
        _assert_bytes_equal(a, b, f"{rows.dtype} stride {rows.stride()}")


def _same_values(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Equal values and dtypes, NaN where NaN (the bf16 NaN pattern is torch's conversion path's)."""
    assert a.dtype == b.dtype, what
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", MAIN, ids=_fid)
def test_roundtrip_rows_matches_reference(fmt: EntryFormat, device: str):
    """What the cache's readers see of rows (the prefill layer's window rows): the reference's
    decode(encode(x)), value for value, from fp32, bf16 and strided rows, in fp32 and (where exact) bf16;
    rows across the kernel's 16-row blocks (37), the e4m3 ties and nonfinite values of the writes."""
    x = _rows(37, fmt, device)
    if fmt.name == "fp8_ds" and fmt.dim == 128:
        ties = _tile_rows(_e4m3_ties(), 64, 448.0)
        x = torch.cat([x, torch.cat([ties, torch.randn(ties.shape[0], 64)], 1).to(device)])
    wide = torch.cat([torch.randn(x.shape[0], 8, device=device), x], 1)
    for rows in (x, x.bfloat16(), wide[:, 8:]):
        for dt in (None, torch.bfloat16) if fmt.name != "fp32" else (None,):
            want = ref.roundtrip_rows(rows, fmt, dt)
            got = tri.roundtrip_rows(rows, fmt, dt)
            _same_values(got, want, f"{rows.dtype} {rows.stride()} -> {dt}")
            assert got.data_ptr() != rows.data_ptr()
    if fmt.name == "fp8_ds":                        # the rows did change: the round trip is not the identity
        assert not torch.equal(torch.nan_to_num(tri.roundtrip_rows(x, fmt)), torch.nan_to_num(x))


def test_roundtrip_rows_errors():
    x = torch.randn(3, 128)
    for impl in (ref, tri):
        with pytest.raises(FormatError, match="fp32 rows round-trip exactly to fp32, not"):
            impl.roundtrip_rows(x, main_format("fp32", 128, 64), torch.bfloat16)
        with pytest.raises(FormatError, match="main-entry formats"):
            impl.roundtrip_rows(x, indexer_format("mxfp4", 128))
        with pytest.raises(FormatError, match="or bf16, not"):
            impl.roundtrip_rows(x, main_format("fp8_ds", 128, 64), torch.float16)
    with pytest.raises(FormatError, match="128 channels"):
        tri.roundtrip_rows(torch.randn(3, 64), main_format("fp8_ds", 128, 64))


def test_write_entries_rejects_wrong_width():
    fmt = main_format("fp8_ds", 128, 64)
    pages = _pages(fmt, 2, 4, "cpu")
    with pytest.raises(FormatError, match="128 channels"):
        tri.write_entries(fmt.views(pages, 4), fmt, torch.zeros(2, 64), torch.zeros(2, dtype=torch.long),
                          torch.zeros(2, dtype=torch.long), torch.ones(1, 1, dtype=torch.int32), 4)


# ---------------------------------------------------------------------------- append_window
def _batch(chunks: list[tuple[int, int, int]], device: str, shuffle: bool) -> tuple[torch.Tensor, ...]:
    """chunks: (slot, first position, tokens) per request -> positions, token_request, request_slots, seq_lens.

    shuffle permutes the packed tokens: nothing may depend on token order, and with newest-last
    order a missing keep mask would go unnoticed (the interpreter runs programs in order, so the
    newest token would win every ring-row collision anyway).
    """
    pos = torch.cat([torch.arange(p, p + n) for _, p, n in chunks])
    treq = torch.cat([torch.full((n,), i) for i, (_, _, n) in enumerate(chunks)])
    if shuffle:
        perm = torch.randperm(pos.shape[0])
        pos, treq = pos[perm], treq[perm]
    slots = torch.tensor([s for s, _, _ in chunks])
    seq = torch.tensor([p + n for _, p, n in chunks])
    return tuple(t.to(device=device, dtype=torch.int32) for t in (pos, treq, slots, seq))


def _run_window(fmt: EntryFormat, w: int, steps: list[list[tuple[int, int, int]]], device: str,
                kv_dtype: torch.dtype = torch.float32, shuffle: bool = True) -> None:
    r = 5
    poison = _pages(fmt, r, w, device)
    pos0 = torch.randint(-1, 1000, (r, w), dtype=torch.int32, device=device)
    head0 = torch.randint(0, 1000, (r,), dtype=torch.int32, device=device)
    state = {k: (poison.clone(), pos0.clone(), head0.clone()) for k in ("ref", "tri")}
    for step in steps:
        pos, treq, slots, seq = _batch(step, device, shuffle)
        kv = _rows(pos.shape[0], fmt, device, nonfinite=False).to(kv_dtype)
        for k, impl in (("ref", ref), ("tri", tri)):
            pages, swa_pos, swa_head = state[k]
            impl.append_window(fmt.views(pages, w), fmt, swa_pos, swa_head, kv, pos, treq, slots, seq)
        for i, what in enumerate(("ring pages", "swa_pos", "swa_head")):
            _assert_bytes_equal(state["ref"][i], state["tri"][i], f"{fmt.name} {what} after {step}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["fp8_ds", "bf16", "fp32"])
def test_append_window_ragged_chunks_tiny(name: str, device: str):
    """W=16, D=128: chunks longer than W (the in-kernel keep mask), a request crossing 127/128/129,
    decode steps, a request with one token; slots out of batch order."""
    w = 16
    steps = [[(2, 0, 5), (0, 0, w + 5), (3, 120, 10)],                  # 21 > W tokens: 5 dropped
             [(0, w + 5, 1), (3, 130, 1), (2, 5, 1)],                      # decode
             [(3, 131, 2 * w + 3), (4, 0, 1), (2, 6, w)]]                  # 35 tokens, 19 dropped
    _run_window(main_format(name, 128, 64), w, steps, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["fp8_ds", "bf16", "fp32"])
def test_append_window_real_dims(name: str, device: str):
    """D=512, W=128: positions 127/128/129 and 255/256/257 (a few tokens: interpreter time)."""
    steps = [[(1, 126, 3), (3, 254, 3)], [(1, 129, 1), (3, 257, 1), (0, 0, 2)]]
    _run_window(main_format(name, 512, 64), 128, steps, device)


@pytest.mark.parametrize("device", DEVICES)
def test_append_window_bf16_input(device: str):
    _run_window(main_format("fp8_ds", 128, 64), 8, [[(0, 0, 11), (1, 3, 2)]], device, kv_dtype=torch.bfloat16)


# ---------------------------------------------------------------------------- compress_decode
def _fresh_state(r: int, p: int, d: int, device: str) -> torch.Tensor:
    """Random pending entries; slot 0 empty (-inf, 0, 0) as after a reset."""
    st = torch.empty(r, 3, p, d)
    st[:, 0] = torch.randn(r, p, d) * 2
    st[:, 1] = torch.rand(r, p, d) * 3 + 0.5
    st[:, 2] = torch.randn(r, p, d) * 2
    st[0, 0], st[0, 1:] = float("-inf"), 0.0
    return st.to(device)


def _assert_fp32_close(t: torch.Tensor, r: torch.Tensor, what: str) -> None:
    """|t - r| <= 1e-6 |r| + 1e-6 max|r| (finite values; infinities must match exactly)."""
    fin = torch.isfinite(r)
    scale = r[fin].abs().max().item() if fin.any() else 0.0
    torch.testing.assert_close(t, r, rtol=1e-6, atol=1e-6 * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d,ratio,overlap", [(128, 4, True), (512, 4, True), (128, 16, False), (512, 128, False)])
def test_compress_decode_matches_reference(d: int, ratio: int, overlap: bool, device: str):
    """Several decode steps: positions that close a window ((p+1) % m == 0) and that do not,
    around 127/128/129 and 255/256/257; state compared after every step."""
    r = 6
    slots = torch.tensor([4, 0, 2, 5, 1], dtype=torch.int32, device=device)
    pos = torch.tensor([2, 126, 254, 0, 15], dtype=torch.int32, device=device)
    st_ref = _fresh_state(r, 2 if overlap else 1, d, device)
    st_tri = st_ref.clone()
    dc = 2 * d if overlap else d
    closed = open_ = False
    for _ in range(4):                                             # 2,3,4,5 / 126..129 / 254..257 / 0..3 / 15..18
        c = torch.randn(slots.shape[0], dc, device=device) * 3
        z = torch.randn(slots.shape[0], dc, device=device) * 4
        e_ref, i_ref = ref_decode.compress_decode(c, z, st_ref, slots, pos, ratio, overlap)
        e_tri, i_tri = tri.compress_decode(c, z, st_tri, slots, pos, ratio, overlap)
        assert i_tri.dtype == torch.int64 and torch.equal(i_ref, i_tri)
        _assert_fp32_close(e_tri, e_ref, "entries")
        for k, what in enumerate("MSA"):
            _assert_fp32_close(st_tri[:, k], st_ref[:, k], what)
        st_tri.copy_(st_ref)                                       # compare single steps: no drift
        closed, open_ = closed or bool((i_ref >= 0).any()), open_ or bool((i_ref < 0).any())
        pos = pos + 1
    assert closed and open_, "the steps must include closing and non-closing tokens"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d,ratio,overlap", [(128, 4, True), (512, 128, False)])
def test_compress_decode_raw_projection_inputs(d: int, ratio: int, overlap: bool, device: str):
    """c, z as bf16 column views of one wider projection and the position bias given separately
    (what the layer's decode step passes) == fp32 contiguous inputs with the bias added first."""
    r, b = 6, 5
    slots = torch.tensor([4, 0, 2, 5, 1], dtype=torch.int32, device=device)
    pos = torch.tensor([2, 126, 254, 0, 255], dtype=torch.int32, device=device)
    dc = 2 * d if overlap else d
    wide = (torch.randn(b, 2 * dc + 24, device=device) * 3).to(torch.bfloat16)
    c, z = wide[:, 7:7 + dc], wide[:, 7 + dc + 9:7 + 2 * dc + 9]         # odd offsets: strided views
    bias = torch.randn(ratio, dc, device=device).to(torch.bfloat16)
    z_full = z.float() + bias.float()[pos.long() % ratio]
    st0 = _fresh_state(r, 2 if overlap else 1, d, device)
    for impl in (ref_decode, tri):
        st_a, st_b = st0.clone(), st0.clone()
        e_a, i_a = impl.compress_decode(c.float().contiguous(), z_full, st_a, slots, pos, ratio, overlap)
        e_b, i_b = impl.compress_decode(c, z, st_b, slots, pos, ratio, overlap, z_bias=bias)
        assert torch.equal(i_a, i_b)
        _assert_fp32_close(e_b, e_a, f"{impl.__name__} entries")
        _assert_fp32_close(st_b, st_a, f"{impl.__name__} state")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt,ratio,overlap,finish", [
    (main_format("fp8_ds", 512, 64), 128, False, True), (main_format("fp8_ds", 512, 64), 4, True, False),
    (main_format("bf16", 512, 64), 4, True, True), (main_format("fp32", 128, 64), 16, False, True),
    (indexer_format("mxfp4", 128), 4, True, True), (indexer_format("fp8", 128), 4, True, False)],
    ids=lambda v: _fid(v) if isinstance(v, EntryFormat) else str(v))
def test_compress_decode_write(fmt: EntryFormat, ratio: int, overlap: bool, finish: bool, device: str):
    """compress_decode(write=) == compress_decode then write_entries: the Triton kernel that does
    both against the two Triton kernels (the same arithmetic: entries, state and every page byte
    but the null block's equal) and the reference op (which composes the reference's two) within
    fp32 rounding and a quantisation step. Steps cross 127/128/129 and 255/256/257; one request's
    block is unallocated (its entry goes nowhere), another's entry lies past its table."""
    d, epb, r = fmt.dim, 4, 7
    g = torch.Generator().manual_seed(d + ratio)
    slots = torch.tensor([4, 0, 2, 6, 1], dtype=torch.int32, device=device)
    pos = torch.tensor([125, 253, 1276, 0, 1280], dtype=torch.int32, device=device)
    # ratio 4: request 2's entry 319 goes to its last column, unallocated; request 4's entry 320 lies
    # past the table; request 3's entry 0 to its first column
    cols = 80
    block_table = torch.randperm(5 * cols, generator=g).view(5, cols).add(1).to(torch.int32).to(device)
    block_table[3, 1:] = -1
    block_table[2, cols - 1] = -1
    nblocks = 5 * cols + 1
    fin = None
    if finish:
        rope = RopeTable.for_layer(DSV4Config.flash(), compressed=True)
        fin = EntryFinish((torch.rand(d, generator=g) + 0.5).to(device), 1e-6, rope.inv_freq_on(torch.device(device)),
                          ratio)
    dc = 2 * d if overlap else d
    st0 = _fresh_state(r, 2 if overlap else 1, d, device)
    poison = _pages(fmt, nblocks, epb, device)
    pages = {k: poison.clone() for k in ("two", "one", "ref")}
    state = {k: st0.clone() for k in pages}
    rows = torch.arange(slots.shape[0], device=device)
    wrote = 0
    for _ in range(4):
        c = (torch.randn(slots.shape[0], dc, generator=g) * 3).to(device)
        z = (torch.randn(slots.shape[0], dc, generator=g) * 4).to(device)
        bias = torch.randn(ratio, dc, generator=g).to(device)
        e2, i2 = tri.compress_decode(c, z, state["two"], slots, pos, ratio, overlap, z_bias=bias)
        tri.write_entries(fmt.views(pages["two"], epb), fmt, e2, rows, i2, block_table, epb, fin)
        e1, i1 = tri.compress_decode(c, z, state["one"], slots, pos, ratio, overlap, z_bias=bias,
                                     write=ref.EntryWrite(fmt.views(pages["one"], epb), fmt, block_table, epb, fin))
        er, ir = ref_decode.compress_decode(c, z, state["ref"], slots, pos, ratio, overlap, z_bias=bias,
                                            write=ref.EntryWrite(fmt.views(pages["ref"], epb), fmt, block_table, epb,
                                                                 fin))
        assert torch.equal(i1, i2) and torch.equal(i1, ir)
        closed = i1 >= 0
        assert torch.equal(e1[closed], e2[closed]) and torch.equal(state["one"], state["two"])
        _assert_fp32_close(e1[closed], er[closed], "entries")
        _assert_fp32_close(state["one"], state["ref"], "state")
        _assert_bytes_equal(pages["two"][1:], pages["one"][1:], f"{fmt.name} pages, one kernel vs two")
        ok = closed & (block_table.gather(1, (i1.clamp(min=0) // epb).clamp(max=cols - 1)[:, None])[:, 0] >= 0)
        ok &= i1 // epb < cols
        if ok.any():
            blk, row = ref._locate(block_table, rows, i1, epb, ok)
            da, db = (ref.read_rows(fmt.views(pages[k], epb), fmt, blk[ok], row[ok]) for k in ("ref", "one"))
            step = {"fp8_ds": 2 ** -3, "bf16": 2 ** -7, "fp8": 2 ** -3, "mxfp4": 0.5}.get(fmt.name, 1e-5)
            torch.testing.assert_close(db, da, rtol=step, atol=step * da.abs().max().item())
            wrote += int(ok.sum())
        state["one"].copy_(state["ref"])                           # compare single steps: no drift
        state["two"].copy_(state["ref"])
        pos = pos + 1
    assert wrote >= 2, "the steps must write entries"
    assert not torch.equal(pages["one"][1:], poison[1:])


def test_compress_decode_write_finish_ratio():
    fmt = main_format("fp8_ds", 128, 64)
    fin = EntryFinish(torch.ones(128), 1e-6, torch.ones(32, dtype=torch.float64), 4)
    with pytest.raises(InputError, match="ratio"):
        tri.compress_decode(torch.randn(1, 128), torch.randn(1, 128), _fresh_state(1, 1, 128, "cpu"),
                            torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 128, False,
                            write=ref.EntryWrite(fmt.views(_pages(fmt, 2, 4, "cpu"), 4), fmt,
                                                 torch.ones(1, 1, dtype=torch.int32), 4, fin))


# ---------------------------------------------------------------------------- CUDA graph (GPU only)
@pytest.mark.gpu
def test_decode_writes_replay_in_cuda_graph():
    """append_window + compress_decode + write_entries captured once and replayed for later steps."""
    dev = "cuda"
    fmt, ifmt, w, epb, d = main_format("fp8_ds", 512, 64), indexer_format("mxfp4", 128), 128, 64, 512
    b, r = 4, 6
    slots = torch.tensor([3, 0, 5, 1], dtype=torch.int32, device=dev)
    block_table = torch.arange(1, 1 + b * 8, dtype=torch.int32, device=dev).view(b, 8)
    pos = torch.tensor([124, 250, 3, 127], dtype=torch.int32, device=dev)
    treq = torch.arange(b, dtype=torch.int32, device=dev)
    kv, c, z = (torch.empty(b, d, device=dev), torch.empty(b, 2 * d, device=dev), torch.empty(b, 2 * d, device=dev))
    keys = torch.empty(b, 128, device=dev)

    def make():
        return {"swa": _pages(fmt, r, w, dev), "swa_pos": torch.full((r, w), -1, dtype=torch.int32, device=dev),
                "head": torch.zeros(r, dtype=torch.int32, device=dev), "st": _fresh_state(r, 2, d, dev),
                "kvp": _pages(fmt, 1 + b * 8, epb, dev), "idx": _pages(ifmt, 1 + b * 8, epb, dev)}

    def triton_step(s):
        tri.append_window(fmt.views(s["swa"], w), fmt, s["swa_pos"], s["head"], kv, pos, treq, slots, pos + 1)
        e, i = tri.compress_decode(c, z, s["st"], slots, pos, 4, True)
        tri.write_entries(fmt.views(s["kvp"], epb), fmt, e, treq, i, block_table, epb)
        tri.write_entries(ifmt.views(s["idx"], epb), ifmt, keys, treq, i, block_table, epb)
        return e, i

    s_ref, s_tri = make(), make()
    for k in s_ref:
        s_tri[k].copy_(s_ref[k])
    fill = [kv, c, z, keys]
    for x in fill:
        x.normal_()
    triton_step({k: v.clone() for k, v in s_tri.items()})      # warm-up: compiles, off the real state
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        e_tri, i_tri = triton_step(s_tri)
    for _ in range(6):                                            # crosses 127/128 and 255/256
        for x in fill:
            x.normal_()
        graph.replay()
        ref.append_window(fmt.views(s_ref["swa"], w), fmt, s_ref["swa_pos"], s_ref["head"], kv, pos, treq, slots,
                          pos + 1)
        e_ref, i_ref = ref_decode.compress_decode(c, z, s_ref["st"], slots, pos, 4, True)
        # Quantise the kernel's own entries in the reference: entries agree to ~1 ulp, bytes must agree exactly.
        ref.write_entries(fmt.views(s_ref["kvp"], epb), fmt, e_tri, treq, i_tri, block_table, epb)
        ref.write_entries(ifmt.views(s_ref["idx"], epb), ifmt, keys, treq, i_tri, block_table, epb)
        torch.cuda.synchronize()
        assert torch.equal(i_ref, i_tri)
        _assert_fp32_close(e_tri, e_ref, "entries")
        for k, what in enumerate("MSA"):
            _assert_fp32_close(s_tri["st"][:, k], s_ref["st"][:, k], what)
        s_tri["st"].copy_(s_ref["st"])                             # single-step comparisons
        for k in ("swa", "swa_pos", "head"):
            _assert_bytes_equal(s_ref[k], s_tri[k], k)
        for k in ("kvp", "idx"):   # block 0 row 0 takes every padding row: compare real blocks
            _assert_bytes_equal(s_ref[k][1:], s_tri[k][1:], k)
        pos += 1


@triton.jit
def _cos_sin64_probe(x_ptr, c_ptr, s_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c, s = cos_sin64(tl.load(x_ptr + i, mask=i < n, other=0.0))
    tl.store(c_ptr + i, c, mask=i < n)
    tl.store(s_ptr + i, s, mask=i < n)


@triton.jit
def _fma_probe(a_ptr, o_ptr):
    a = tl.load(a_ptr)
    tl.store(o_ptr, tl.fma(a, a, -tl.load(a_ptr + 1)))


def _fma_is_fused(device: str) -> bool:
    """Whether tl.fma rounds once: (1 + 2^-30)^2 - (1 + 2^-29) is 2^-60 fused and 0 as a multiply then an
    add. The GPU's is fused; Triton's interpreter before 3.9 computes a * b + c with two roundings."""
    a = torch.tensor([1 + 2.0**-30, 1 + 2.0**-29], dtype=torch.float64, device=device)
    out = torch.full((1,), float("nan"), dtype=torch.float64, device=device)
    _fma_probe[(1,)](a, out)
    return out.item() == 2.0**-60


@pytest.mark.parametrize("device", DEVICES)
def test_cos_sin64_float32_exact(device: str):
    """`cos_sin64` (the entry write's float64 cos / sin, no coefficient table) against torch's
    float64 cos / sin: within 4 float64 ulps (relative) everywhere, at the quadrant edges too
    (where the reduced angle cancels: down to 1e-15 at the integers closest to multiples of pi/2),
    and the same float32 values at every RoPE angle of the V4 tables (fresh positions up to 2^24,
    scales 1 / 4 / 128). On a GPU this also catches constants compiled as float32."""
    if device == "cpu" and not _fma_is_fused(device):    # the reduction's first step: exact only fused
        pytest.skip(f"Triton {triton.__version__}'s interpreter rounds tl.fma twice (a multiply, then an add); "
                    "cos_sin64's quadrant reduction needs the fused FMA of the GPU (and of Triton 3.9's interpreter)")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    inv = RopeTable.for_layer(DSV4Config.flash(), compressed=True).inv_freq_on(torch.device("cpu"))
    pos = torch.cat([torch.tensor([0, 1, 127, 128, 129, 255, 256, 257, 2**20, 2**24 - 1]),
                     torch.randint(0, 2**24, (300,), generator=g)])
    rope = torch.cat([(pos * s).to(torch.float64)[:, None] * inv for s in (1, 4, 128)]).flatten()
    k = torch.randint(0, 2**30, (2000,), generator=g).to(torch.float64)
    edges = k * (math.pi / 2) + (torch.rand(2000, generator=g, dtype=torch.float64) - 0.5) * 1e-6
    wide = torch.rand(2000, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(-20, 41, (2000,), generator=g)
    x = torch.cat([rope, edges, wide, torch.tensor(_near_quadrant_edges(), dtype=torch.float64)])
    c = torch.full(x.shape, float("nan"), dtype=torch.float64, device=device)
    s = torch.full(x.shape, float("nan"), dtype=torch.float64, device=device)
    _cos_sin64_probe[(triton.cdiv(x.numel(), 256),)](x.to(device), c, s, x.numel(), BLOCK=256)
    c, s = c.cpu(), s.cpu()
    ulp = torch.finfo(torch.float64).eps
    for got, want in ((c, x.cos()), (s, x.sin())):
        assert ((got - want).abs() <= 4 * ulp * want.abs()).all(), "beyond 4 float64 ulps"
        assert torch.equal(got[:rope.numel()].float(), want[:rope.numel()].float()), "a float32 RoPE value differs"


def _near_quadrant_edges() -> list[float]:
    """The integers p below 2^52 closest to multiples q pi/2 (the continued fraction's convergents
    p / q of pi/2): |p - q pi/2| ~ 1 / q, where every part of the reduction's pi/2 counts."""
    getcontext().prec = 80
    half_pi = Decimal("1.5707963267948966192313216916397514420985846996875529104874722961539082031431045")
    out, (p0, q0, p1, q1), f = [], (0, 1, 1, 0), half_pi
    while True:
        a = int(f)
        p0, q0, p1, q1 = p1, q1, a * p1 + p0, a * q1 + q0
        if p1 >= 2**52:
            return out
        out.append(float(p1))
        f = 1 / (f - a)
