"""Triton twins of the prefill-side ops vs their PyTorch references: the chunked compressor state
update (`compress_update`), the row gather/dequantise (`gather.read_rows` and the three gathers),
and the indexer selection for prefill chunks (`prefill_indexer_topk`). Fresh random inputs,
ragged batches, window-closing boundaries; poisoned buffers. CPU: Triton interpreter; GPU: real."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from dsv4 import KVCacheManager
from dsv4.cache.formats import indexer_format, main_format
from dsv4.errors import FormatError, InputError
from dsv4.kernels.reference import cache_ops as ref_cache
from dsv4.kernels.reference import compress as ref_compress
from dsv4.kernels.reference import indexer as ref_indexer
from dsv4.kernels.triton import compress as tri_compress
from dsv4.kernels.triton import gather as tri_gather
from dsv4.kernels.triton import indexer_prefill as tri_indexer

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _state(r: int, p: int, d: int, dev: str) -> torch.Tensor:
    """Valid (M, S, A) pending state, some slots empty (-inf, 0, 0)."""
    st = torch.empty(r, 3, p, d, device=dev)
    st[:, 0] = torch.randn(r, p, d, device=dev)
    st[:, 1] = torch.rand(r, p, d, device=dev) + 0.5
    st[:, 2] = torch.randn(r, p, d, device=dev)
    st[1, 0], st[1, 1:] = float("-inf"), 0.0
    return st


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap,ratio,d", [(True, 4, 64), (False, 16, 128), (False, 128, 64)])
@pytest.mark.parametrize("tiles", [{}, dict(segs=4, block_d=32, block_s=2),
                                   dict(segs=1, block_d=32, split=4, block_s=2),
                                   dict(segs=2, block_d=64, split=2, block_s=1)])
def test_compress_update_matches_reference(device, overlap, ratio, d, tiles):
    """Ragged chunks around window boundaries; tiles: several segments per program (a program's
    segments spanning requests), channel blocks, a window's slots in one or several groups of
    threads, reduced one or several slots at a time."""
    dc = 2 * d if overlap else d
    # Ragged chunks starting at, inside and just before window boundaries (127/128/129, 255/256/257).
    starts = (0, 13, 127, 3, 255, 128)
    lens = (37, 1, 2, 130, 3, 129)
    t = sum(lens)
    c = torch.randn(t, dc, device=device)
    z = torch.randn(t, dc, device=device) * 3
    slots = torch.tensor([3, 0, 1, 5, 2, 4], device=device)
    st = _state(6, 2 if overlap else 1, d, device)
    s_ref, s_tri = st.clone(), st.clone()
    e_ref, r_ref, i_ref = ref_compress.compress_update(c, z, s_ref, slots, starts, lens, ratio, overlap)
    e_tri, r_tri, i_tri = tri_compress.compress_update(c, z, s_tri, slots, starts, lens, ratio, overlap, **tiles)
    assert torch.equal(r_ref, r_tri) and torch.equal(i_ref, i_tri)
    torch.testing.assert_close(e_tri, e_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isinf(s_ref), torch.isinf(s_tri))
    fin = torch.isfinite(s_ref)
    torch.testing.assert_close(s_tri[fin], s_ref[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap,ratio,d", [(True, 4, 64), (False, 16, 128)])
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_compress_update_bf16_views_with_bias(device, overlap, ratio, d, bias_dtype):
    """What the layer passes: bf16 column views of one fused projection (row stride > width), the
    position bias added inside; the same as the reference on those inputs, and as the fp32 inputs
    with the bias already added (the fp32 add is the same either way)."""
    dc = 2 * d if overlap else d
    starts, lens = (0, 13, 127, 255), (37, 1, 130, 3)
    t = sum(lens)
    proj = (torch.randn(t, 2 * dc + 24, device=device) * 3).to(torch.bfloat16)   # [other | c | z] columns
    c, z = proj[:, 24:24 + dc], proj[:, 24 + dc:]
    bias = torch.randn(ratio, dc, device=device).to(bias_dtype)     # a bf16 model's bias is read as it is
    pos = torch.cat([torch.arange(p0, p0 + n) for p0, n in zip(starts, lens)]).to(device)
    slots = torch.tensor([3, 0, 1, 2], device=device)
    st = _state(4, 2 if overlap else 1, d, device)
    s_ref, s_tri, s_f32 = st.clone(), st.clone(), st.clone()
    e_ref, _, _ = ref_compress.compress_update(c, z, s_ref, slots, starts, lens, ratio, overlap, z_bias=bias)
    e_tri, _, _ = tri_compress.compress_update(c, z, s_tri, slots, starts, lens, ratio, overlap, z_bias=bias)
    e_f32, _, _ = tri_compress.compress_update(c.float(), z.float() + bias.float()[pos % ratio], s_f32, slots, starts,
                                               lens, ratio, overlap)
    torch.testing.assert_close(e_tri, e_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(e_tri, e_f32) and torch.equal(s_tri, s_f32)
    fin = torch.isfinite(s_ref)
    torch.testing.assert_close(s_tri[fin], s_ref[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap,ratio,d", [(True, 4, 64), (False, 128, 64)])
@pytest.mark.parametrize("start,n", [(0, 300), (127, 130), (129, 1), (254, 259)])
@pytest.mark.parametrize("single", [True, False])
def test_compress_update_one_request(device, overlap, ratio, d, start, n, single):
    """A one-request chunk (a long prompt's): its ints passed as arguments (single) or read from the
    table as in a batch; both equal the reference, the state included."""
    dc = 2 * d if overlap else d
    c = torch.randn(n, dc, device=device)
    z = torch.randn(n, dc, device=device) * 3
    slots = torch.tensor([1], device=device)
    st = _state(2, 2 if overlap else 1, d, device)
    s_ref, s_tri = st.clone(), st.clone()
    e_ref, r_ref, i_ref = ref_compress.compress_update(c, z, s_ref, slots, (start,), (n,), ratio, overlap)
    e_tri, r_tri, i_tri = tri_compress.compress_update(c, z, s_tri, slots, (start,), (n,), ratio, overlap,
                                                       single=single)
    assert torch.equal(r_ref, r_tri) and torch.equal(i_ref, i_tri)
    torch.testing.assert_close(e_tri, e_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isinf(s_ref), torch.isinf(s_tri))
    fin = torch.isfinite(s_ref)
    torch.testing.assert_close(s_tri[fin], s_ref[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tiles", [dict(split=3), dict(split=16), dict(block_s=3), dict(segs=3)])
def test_compress_update_refuses_tiles_that_do_not_divide(tiles):
    """Tiles that would leave slots or segments out are refused, not silently rounded."""
    c = torch.randn(8, 16)
    with pytest.raises(InputError, match="compressor tiles"):
        tri_compress.compress_update(c, c, _state(2, 2, 8, "cpu"), torch.tensor([0]), (0,), (8,), 4, True, **tiles)


@pytest.mark.parametrize("device", DEVICES)
def test_compress_update_with_batch_plan(device):
    """The manager's plan (`ForwardBatch.compress_plans`, one table copy per forward) gives what the
    kernel plans for itself; a plan of another batch or kind is refused, not silently used."""
    cfg = tiny_config()
    mgr = KVCacheManager(cfg, max_requests=3, num_blocks=64, device=device, max_batch_tokens=512)
    for rid, n in (("a", 126), ("b", 3)):
        mgr.add_request(rid)
        mgr.prepare_forward({rid: n})
    mgr.add_request("c")
    batch = mgr.prepare_forward({"a": 5, "b": 130, "c": 37})          # a crosses 128, b crosses 128 and 132
    starts, lens = batch.start_positions_host, batch.query_lens_host
    for (ratio, overlap), plan in batch.compress_plans.items():
        d = 32
        dc = 2 * d if overlap else d
        c = torch.randn(batch.num_tokens, dc, device=device)
        z = torch.randn(batch.num_tokens, dc, device=device) * 3
        st = _state(3, 2 if overlap else 1, d, device)
        s_own, s_plan = st.clone(), st.clone()
        got_own = tri_compress.compress_update(c, z, s_own, batch.request_slots, starts, lens, ratio, overlap)
        got_plan = tri_compress.compress_update(c, z, s_plan, batch.request_slots, starts, lens, ratio, overlap,
                                                plan=plan)
        assert got_own[0].shape[0] == plan.num_finished > 0
        for a, b in zip(got_own, got_plan):
            assert torch.equal(a, b)
        assert torch.equal(s_own, s_plan)
        with pytest.raises(InputError, match="compress plan"):
            tri_compress.compress_update(c, z, st.clone(), batch.request_slots, starts, lens, ratio, not overlap,
                                         plan=plan)
        with pytest.raises(InputError, match="compress plan"):
            tri_compress.compress_update(c[1:], z[1:], st.clone(), batch.request_slots, starts,
                                         (lens[0] - 1, *lens[1:]), ratio, overlap, plan=plan)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,dim,rope", [("fp8_ds", 128, 64), ("fp8_ds", 512, 64), ("bf16", 128, 64),
                                           ("fp32", 128, 64), ("mxfp4", 64, 0)])
def test_read_rows_matches_reference(device, name, dim, rope):
    fmt = main_format(name, dim, rope) if name != "mxfp4" else indexer_format(name, dim)
    pages = torch.randint(0, 256, (5, fmt.page_bytes(8)), dtype=torch.uint8, device=device)  # poison
    views = fmt.views(pages, 8)
    rows = torch.randn(24, dim, device=device) * torch.rand(24, 1, device=device) * 100
    pg, sl = torch.randint(0, 5, (24,), device=device), torch.randperm(40, device=device)[:24] % 8
    ref_cache.write_rows(views, fmt, rows, pg, sl)
    assert torch.equal(tri_gather.read_rows(views, fmt, pg, sl), ref_cache.read_rows(views, fmt, pg, sl))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmts", [("fp32", "fp32"), ("fp8_ds", "mxfp4")])
def test_handle_gathers_match_reference(device, fmts):
    """The three gathers through a real cache after ragged prefill steps, Triton vs reference."""
    cfg = tiny_config()
    mgr = KVCacheManager(cfg, max_requests=3, num_blocks=16, device=device, kv_format=fmts[0],
                         indexer_format=fmts[1], tokens_per_block=32)
    for r in "abc":
        mgr.add_request(r)
    for step in ({"a": 37, "b": 1, "c": 70}, {"a": 1, "b": 20, "c": 1}):
        batch = mgr.prepare_forward(step)
        h = mgr.acquire(1, batch)
        h.write_swa(torch.randn(batch.num_tokens, cfg.head_dim, device=device))
        ne = [s // 4 for s in batch.seq_lens_host]
        prev = [(s - q) // 4 for s, q in zip(batch.seq_lens_host, batch.query_lens_host)]
        req = torch.tensor([b for b in range(3) for _ in range(prev[b], ne[b])], device=device)
        idx = torch.tensor([w for b in range(3) for w in range(prev[b], ne[b])], device=device)
        h.flush_compression(torch.randn(len(idx), cfg.head_dim, device=device), req, idx,
                            torch.randn(len(idx), cfg.indexer_head_dim, device=device))
    st, pool, sch = h.state, h.paged, h.schema
    for a, b in zip(ref_cache.gather_window(st.swa, sch.kv_format, st.swa_pos, batch.request_slots),
                    tri_gather.gather_window(st.swa, sch.kv_format, st.swa_pos, batch.request_slots)):
        assert torch.equal(a, b)
    sel = torch.randint(-1, max(ne), (batch.num_tokens, 5), device=device)
    for a, b in zip(ref_cache.gather_entries(pool.kv, sch.kv_format, sel, batch.token_request, batch.block_table, 8),
                    tri_gather.gather_entries(pool.kv, sch.kv_format, sel, batch.token_request, batch.block_table, 8)):
        assert torch.equal(a, b)
    n = batch.seq_lens // 4
    for a, b in zip(ref_cache.gather_all_entries(pool.indexer, sch.indexer_format, n, max(ne), batch.block_table, 8),
                    tri_gather.gather_all_entries(pool.indexer, sch.indexer_format, n, max(ne), batch.block_table, 8)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ifmt,tokens,slice_rows", [("fp32", None, None), ("mxfp4", None, None), ("mxfp4", 0, None),
                                                    ("mxfp4", None, 7), ("fp32", None, 7)])
def test_prefill_indexer_topk_matches_reference(device, ifmt, tokens, slice_rows, monkeypatch):
    """Selections for ragged prefill chunks (plus a decode token) equal the reference's exactly,
    away from near-ties (queries rounded as the layer rounds them; the Triton scores then differ from
    the reference's by fp32 summation order only). slice_rows: score buffers of 7 rows, so slices
    cut requests and groups of tokens."""
    cfg = tiny_config(index_topk=5)
    mgr = KVCacheManager(cfg, max_requests=3, num_blocks=16, device=device, kv_format="fp32",
                         indexer_format=ifmt, tokens_per_block=32)
    for r in "abc":
        mgr.add_request(r)
    batch = mgr.prepare_forward({"a": 70, "b": 9, "c": 1})
    h = mgr.acquire(1, batch)
    ne = tuple(s // 4 for s in batch.seq_lens_host)
    req = torch.tensor([b for b in range(3) for _ in range(ne[b])], device=device)
    idx = torch.tensor([w for b in range(3) for w in range(ne[b])], device=device)
    h.flush_compression(torch.randn(len(idx), cfg.head_dim, device=device), req, idx,
                        torch.randn(len(idx), cfg.indexer_head_dim, device=device))
    t = batch.num_tokens
    fmt = h.schema.indexer_format
    q = fmt.round_query(fmt.to_stored_basis(torch.randn(t, cfg.index_n_heads, cfg.indexer_head_dim, device=device)))
    g = torch.randn(t, cfg.index_n_heads, device=device)
    args = (q, g, h.paged.indexer, h.schema.indexer_format, batch.block_table, batch.token_request, batch.positions,
            batch.query_lens_host, ne, 4, cfg.index_topk, h.schema.entries_per_block)
    if slice_rows:
        monkeypatch.setattr(tri_indexer, "_SCORE_BYTES", 4 * max(ne) * slice_rows)
        monkeypatch.setattr(tri_indexer, "_MIN_ROWS", 1)
    a = ref_indexer.prefill_indexer_topk(*args)
    b = tri_indexer.prefill_indexer_topk(*args, tokens=tokens)     # mxfp4: grouped scan (default), per row (0)
    assert a.shape == b.shape == (t, cfg.index_topk)
    assert torch.equal(a < 0, b < 0)                     # visibility: the same number of picks per token
    same = (a.sort(1).values == b.sort(1).values).all(1)
    assert same.float().mean() >= 0.97, same.float().mean()
    if ifmt == "mxfp4":     # the layer hands mxfp4-rounded queries over as bf16 (exact): the same picks
        q16 = q.bfloat16()
        assert torch.equal(q16.float(), q)
        assert torch.equal(tri_indexer.prefill_indexer_topk(q16, *args[1:], tokens=tokens), b)
        assert torch.equal(ref_indexer.prefill_indexer_topk(q16, *args[1:]), a)


# ====================================================================== grouped prefill scan
def test_token_groups_cut_runs_of_one_request():
    g = tri_indexer.token_groups((5, 3, 9), 0, 17, 4, "cpu").tolist()
    assert g == [[0, 4, 0], [4, 1, 0], [5, 3, 1], [8, 4, 2], [12, 4, 2], [16, 1, 2]]
    # a slice [6, 12): rows relative to its start, cut at its edges
    assert tri_indexer.token_groups((5, 3, 9), 6, 12, 4, "cpu").tolist() == [[0, 2, 1], [2, 4, 2]]
    assert tri_indexer.token_groups((0, 2), 0, 2, 4, "cpu").tolist() == [[0, 2, 1]]


def _chunk_rows(lens: tuple[int, ...], chunk: tuple[int, ...], ratio: int, dev: str):
    """Query rows of a prefill chunk per request: the last chunk[b] positions before lens[b]."""
    pos = torch.cat([torch.arange(n - c, n) for n, c in zip(lens, chunk)])
    req = torch.cat([torch.full((c,), b) for b, c in enumerate(chunk)])
    return pos.to(dev), req.to(dev), ((pos + 1) // ratio).to(torch.int32).to(dev)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,fmt,lens,chunk", [
    ("tiny", "mxfp4", (17, 100, 3, 34, 64), (17, 37, 3, 5, 2)),
    ("tiny", "nvfp4", (100, 33, 18), (9, 33, 6)),
    ("real", "mxfp4", (129, 258, 257, 128), (3, 130, 11, 128)),
])
@pytest.mark.parametrize("tokens,programs,prefetch", [(1, 1, False), (2, 2, True), (4, 1, False), (4, 3, True),
                                                     (8, 3, False)])
def test_grouped_scan_matches_reference_scores(device, kind, fmt, lens, chunk, tokens, programs, prefetch):
    """Each row of a group scores exactly its own visible entries (positions across 4-entry and
    tile boundaries, 127/128/129, 255/256/257), -inf past them; output poisoned first."""
    from test_triton_decode import TOL, cache, close

    from dsv4.kernels.reference import decode as ref_decode
    from dsv4.kernels.triton.indexer_scores import DEFAULT_PRECISION

    mgr, batch = cache(kind, "bf16", fmt, lens, device)
    sch, pool = mgr.schemas[1], mgr.paged[1]
    pos, req, visible = _chunk_rows(lens, chunk, sch.compress_ratio, device)
    gen = torch.Generator().manual_seed(tokens * 100 + len(lens))
    heads = 16
    q = sch.indexer_format.round_query(torch.randn(len(pos), heads, sch.indexer_head_dim, generator=gen).to(device))
    w = torch.randn(len(pos), heads, generator=gen).to(device)
    n_max = max(n // sch.compress_ratio for n in lens)
    want = ref_decode.paged_indexer_scores(q, w, pool.indexer, sch.indexer_format, batch.block_table[req.long()],
                                           visible, n_max, sch.entries_per_block)
    groups = tri_indexer.token_groups(chunk, 0, len(pos), tokens, device)
    out = torch.full((len(pos), n_max), float("nan"), device=device)
    got = tri_indexer.grouped_scores(q, w, pool.indexer, sch.indexer_format, batch.block_table, visible, groups,
                                     n_max, sch.entries_per_block, tokens=tokens, programs=programs, prefetch=prefetch,
                                     out=out)
    assert got.data_ptr() == out.data_ptr()
    tol = TOL["ieee"] if DEFAULT_PRECISION[fmt] == "bf16" else TOL[DEFAULT_PRECISION[fmt]]
    close(got, want, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,programs", [(1, 1), (2, 3), (4, 1), (4, 2), (8, 1)])
def test_grouped_scan_tma(tokens, programs):
    """The TMA prefill scan (pages by the tensor memory accelerator; the int8 MMA where a tile's keys
    and a group's queries allow it, else the bf16 one) against the reference scores (exact operands)
    and the Triton grouped scan: real-size rows whose visible entries cross 63 / 64 / 65, 127 / 128 /
    129 and 255 / 256 / 257, groups cut short by a request's end, 1-3 programs a group, output
    poisoned. Scale groups 0-2 octaves apart at random, one key of every third page (row 7) and of
    every fifth (row 50) 3 apart (those tiles take the bf16 MMA); one row's queries a head 2^12 apart
    between groups (its group takes the bf16 MMA) and a zero weight."""
    from test_triton_decode import TOL, cache, close, max_rel

    from dsv4.kernels.reference import decode as ref_decode
    from dsv4.kernels.triton import indexer_scan_tma

    dev = "cuda"
    lens, chunk = (1029, 1300, 520, 263), (9, 300, 7, 11)
    mgr, batch = cache("real", "bf16", "mxfp4", lens, dev)
    sch, pool = mgr.schemas[1], mgr.paged[1]
    fmt, epb = sch.indexer_format, sch.entries_per_block
    typed = fmt.typed(pool.indexer)
    pos, req, visible = _chunk_rows(lens, chunk, sch.compress_ratio, dev)
    gen = torch.Generator().manual_seed(7)
    q = fmt.round_query(torch.randn(len(pos), 64, sch.indexer_head_dim, generator=gen).to(dev))
    if not indexer_scan_tma.supported(q, typed["data"], typed["scale"], fmt.name, epb, 1):
        pytest.skip("the TMA prefill scan needs an sm_90 GPU (Hopper), 64 indexer heads and 64 keys a page")
    scale = typed["scale"]
    base = torch.randint(118, 134, scale.shape[:2] + (1,), generator=gen)
    sc = base + torch.randint(0, 3, scale.shape, generator=gen)
    sc[::3, 7] = base[::3, 7] + torch.tensor([0, 0, 3, 1])
    sc[1::5, 50] = base[1::5, 50] + torch.tensor([3, 0, 1, 0])     # a key of another warp's rows
    scale.copy_(sc.to(torch.uint8).to(dev))
    q[20, 5, :32] *= 2.0 ** 12
    w = torch.randn(len(pos), 64, generator=gen).to(dev)
    w[30, 4] = 0.0
    n_max = max(lens) // sch.compress_ratio
    want = ref_decode.paged_indexer_scores(q, w, pool.indexer, fmt, batch.block_table[req.long()], visible, n_max,
                                           epb)
    groups = tri_indexer.token_groups(chunk, 0, len(pos), tokens, dev)
    triton_grouped = tri_indexer.grouped_scores(q, w, pool.indexer, fmt, batch.block_table, visible, groups, n_max,
                                                epb, tokens=tokens, tma=False)
    out = torch.full((len(pos), n_max), float("nan"), device=dev)
    got = tri_indexer.grouped_scores(q, w, pool.indexer, fmt, batch.block_table, visible, groups, n_max, epb,
                                     tokens=tokens, programs=programs, tma=True, out=out)
    close(got, want, TOL["ieee"])
    fin = torch.isfinite(want)
    assert max_rel(got[fin], triton_grouped[fin]) <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("slice_rows", [None, 97])
def test_prefill_indexer_topk_tma(slice_rows, monkeypatch):
    """The prefill selection at V4 indexer shapes (64 heads of 128, mxfp4, 64 keys a page), which takes
    the TMA prefill scan, against the same selection with the Triton grouped scan: two requests' chunks
    after cached tokens (one whose visible entries cross 255 / 256 / 257), score buffers of 97 rows so
    slices cut requests and groups. The same picks per token away from near-ties; visibility exactly."""
    from test_triton_decode import cache

    from dsv4.kernels.triton import indexer_scan_tma

    dev = "cuda"
    lens, chunk = (1040, 2100), (60, 170)
    mgr, batch = cache("real", "bf16", "mxfp4", lens, dev)
    sch, pool = mgr.schemas[1], mgr.paged[1]
    fmt, epb = sch.indexer_format, sch.entries_per_block
    pos, req, _ = _chunk_rows(lens, chunk, sch.compress_ratio, dev)
    gen = torch.Generator().manual_seed(11)
    q = fmt.round_query(torch.randn(len(pos), 64, sch.indexer_head_dim, generator=gen).to(dev)).bfloat16()
    typed = fmt.typed(pool.indexer)
    if not indexer_scan_tma.supported(q, typed["data"], typed["scale"], fmt.name, epb, 1):
        pytest.skip("the TMA prefill scan needs an sm_90 GPU (Hopper), 64 indexer heads and 64 keys a page")
    w = torch.randn(len(pos), 64, generator=gen).to(dev)
    ne = tuple(n // sch.compress_ratio for n in lens)
    args = (q, w, pool.indexer, fmt, batch.block_table, req.to(torch.int32), pos.to(torch.int32), chunk, ne,
            sch.compress_ratio, 512, epb)
    if slice_rows:
        monkeypatch.setattr(tri_indexer, "_SCORE_BYTES", 4 * max(ne) * slice_rows)
        monkeypatch.setattr(tri_indexer, "_MIN_ROWS", 1)
    got = tri_indexer.prefill_indexer_topk(*args)
    with monkeypatch.context() as m:
        m.setattr(indexer_scan_tma, "supported", lambda *a, **k: False)
        want = tri_indexer.prefill_indexer_topk(*args)
    assert torch.equal(got < 0, want < 0)
    same = (got.sort(1).values == want.sort(1).values).all(1)
    assert same.float().mean() >= 0.99, same.float().mean()


def test_grouped_scan_tma_refused_where_it_cannot_run():
    """tma=True raises where the TMA prefill scan cannot run (here: 16 heads of 64, and no sm_90 GPU on
    CPU tensors) instead of falling back; the default takes the Triton grouped scan there."""
    mgr = KVCacheManager(tiny_config(), max_requests=1, num_blocks=4, device=DEVICES[0], kv_format="bf16",
                         indexer_format="mxfp4", tokens_per_block=32)
    sch, pool = mgr.schemas[1], mgr.paged[1]
    args = (torch.randn(2, 16, sch.indexer_head_dim, device=DEVICES[0]), torch.randn(2, 16, device=DEVICES[0]),
            pool.indexer, sch.indexer_format, torch.zeros(1, 4, dtype=torch.int32, device=DEVICES[0]),
            torch.ones(2, dtype=torch.int32, device=DEVICES[0]),
            torch.tensor([[0, 2, 0]], dtype=torch.int32, device=DEVICES[0]), 4, sch.entries_per_block)
    with pytest.raises(FormatError, match="TMA"):
        tri_indexer.grouped_scores(*args, tokens=2, tma=True)
    assert tri_indexer.grouped_scores(*args, tokens=2).shape == (2, 4)


def test_grouped_scan_refuses_other_formats():
    mgr = KVCacheManager(tiny_config(), max_requests=1, num_blocks=4, device="cpu", kv_format="bf16",
                         indexer_format="fp8", tokens_per_block=32)
    sch, pool = mgr.schemas[1], mgr.paged[1]
    with pytest.raises(FormatError, match="E2M1"):
        tri_indexer.grouped_scores(torch.randn(2, 16, 64), torch.randn(2, 16), pool.indexer, sch.indexer_format,
                                   torch.zeros(1, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                                   torch.tensor([[0, 2, 0]], dtype=torch.int32), 4, 8, tokens=2)
