"""LayerCacheHandle gather/scatter on ragged batches against a plain dense reference.

The reference keeps, per request, Python lists of the rows written through the handle: the
window rows of every layer, the entries of each compressed layer and the CSA indexer keys.
Expected values are `fmt.roundtrip` of the written rows (what a reader of the cache sees), so
quantised formats compare exactly.

tiny_config: layer 0 SWA, 1 CSA (m = 4), 2 HCA (m' = 16); head_dim 128, window 16, indexer 64.
tokens_per_block 32: 8 CSA entries per block, 2 HCA entries per block.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from dsv4 import KVCacheManager
from dsv4.cache.batch import ForwardBatch
from dsv4.cache.formats import EntryFormat
from dsv4.errors import DeviceError, InputError

SWA, CSA, HCA = 0, 1, 2
D, D_I, W, ROPE = 128, 64, 16, 64

# Each step: request id -> new tokens, or ("free" | "add", id). Ragged prefill, decodes, a second
# prefill chunk, subsets in a different order, a finished request whose slot and blocks are reused.
STEPS: list = [
    {"a": 37, "b": 1, "c": 70, "d": 5},
    {"a": 1, "b": 1, "c": 1, "d": 1},
    {"d": 1, "b": 1},
    {"b": 20, "d": 1, "a": 3},
    {"a": 1, "b": 1, "c": 1, "d": 1},
    ("free", "c"),
    ("add", "e"),
    {"e": 17, "a": 1},
    {"e": 1, "d": 30, "b": 1},
    {"a": 1, "b": 1, "d": 1, "e": 1},
]


class DenseReference:
    """Rows per (layer, request): raw fp32 rows as written and their expected decoded values.

    Decoded values are taken at write time from `roundtrip` of exactly the tensor written: the
    Hadamard rotation of the quantised indexer formats is a matmul whose last bits could depend
    on how many rows it sees at once.
    """

    def __init__(self):
        self.raw: dict[tuple[str, int, str], list[torch.Tensor]] = {}
        self.want: dict[tuple[str, int, str], list[torch.Tensor]] = {}

    def add(self, rid: str) -> None:
        for kind, layer in (("win", SWA), ("win", CSA), ("win", HCA), ("kv", CSA), ("kv", HCA), ("idx", CSA)):
            self.raw[kind, layer, rid] = []
            self.want[kind, layer, rid] = []

    def drop(self, rid: str) -> None:
        for store in (self.raw, self.want):
            for key in [k for k in store if k[2] == rid]:
                del store[key]

    def put(self, kind: str, layer: int, rid: str, raw: torch.Tensor, want: torch.Tensor) -> None:
        self.raw[kind, layer, rid].extend(raw)
        self.want[kind, layer, rid].extend(want)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _span(batch: ForwardBatch, b: int) -> slice:
    return slice(batch.cu_seqlens[b].item(), batch.cu_seqlens[b + 1].item())


def _check_typed_equal(got: dict[str, torch.Tensor], fmt: EntryFormat, encoded: dict[str, torch.Tensor],
                       index: tuple, i: int) -> None:
    """The typed view at `index` holds the bytes `fmt.encode` gave for row i."""
    want = fmt.typed(encoded)
    assert set(got) == set(want)
    for k in got:
        assert torch.equal(_bytes(got[k][index]), _bytes(want[k][i])), k


# ---------------------------------------------------------------------- window
def write_and_check_window(mgr: KVCacheManager, ref: DenseReference, batch: ForwardBatch, layer: int) -> None:
    h = mgr.acquire(layer, batch)
    fmt = h.schema.kv_format
    kv = torch.randn(batch.num_tokens, D) * 3
    h.write_swa(kv)
    decoded = fmt.roundtrip(kv)
    for b, rid in enumerate(batch.request_ids):
        ref.put("win", layer, rid, kv[_span(batch, b)], decoded[_span(batch, b)])

    got, pos, valid = h.gather_swa_kv()
    assert got.shape == (batch.num_requests, W, D) and got.dtype == torch.float32
    assert pos.dtype == torch.int32 and valid.dtype == torch.bool
    view = h.read_swa_view()
    assert torch.equal(view.slots, batch.request_slots)
    for b, rid in enumerate(batch.request_ids):
        seq_len = mgr.seq_len(rid)
        n = min(W, seq_len)
        assert len(ref.want["win", layer, rid]) == seq_len
        # exactly the last n tokens, in position order, after n - W empty rows
        assert torch.equal(got[b, W - n:], torch.stack(ref.want["win", layer, rid][-n:])), (rid, layer)
        assert torch.equal(got[b, :W - n], torch.zeros(W - n, D))
        assert pos[b].tolist() == [-1] * (W - n) + list(range(seq_len - n, seq_len))
        assert valid[b].tolist() == [False] * (W - n) + [True] * n
        # the typed ring view: row p % W holds position p, with the bytes of its encoding
        slot = batch.slots_host[b]
        assert view.head[slot].item() == seq_len
        raw = torch.stack(ref.raw["win", layer, rid][-n:])
        enc = fmt.encode(raw)
        for j, p in enumerate(range(seq_len - n, seq_len)):
            assert view.positions[slot, p % W].item() == p
            _check_typed_equal(view.entries, fmt, enc, (slot, p % W), j)
        rows = torch.arange(seq_len - n, seq_len) % W
        if fmt.name == "fp8_ds":
            assert torch.equal(view.entries["rope"][slot, rows], raw[:, D - ROPE:].to(torch.bfloat16))
        elif fmt.name == "bf16":
            assert torch.equal(view.entries["kv"][slot, rows], raw.to(torch.bfloat16))
        else:
            assert torch.equal(view.entries["kv"][slot, rows], raw)


# ---------------------------------------------------------------------- compressed entries
def flush_and_check_pages(mgr: KVCacheManager, ref: DenseReference, batch: ForwardBatch, layer: int,
                          old_lens: dict[str, int]) -> None:
    """Flush each request's newly closed entries (shuffled, plus one padding row) and check that
    the page buffers changed exactly at those entries' rows and at the null block's row 0."""
    h = mgr.acquire(layer, batch)
    sch, pool = h.schema, mgr.paged[layer]
    m, epb = sch.compress_ratio, sch.entries_per_block
    req, idx = [], []
    for b, rid in enumerate(batch.request_ids):
        for w in range(old_lens[rid] // m, mgr.seq_len(rid) // m):
            req.append(b), idx.append(w)
    req.append(int(torch.randint(batch.num_requests, ())))   # padding: any request, entry -1
    idx.append(-1)
    perm = torch.randperm(len(idx))
    entry_request = torch.tensor(req, dtype=torch.int32)[perm]
    entry_index = torch.tensor(idx, dtype=torch.int32)[perm]
    e = len(idx)
    rows = torch.randn(e, D) * 2
    keys = torch.randn(e, D_I) if sch.indexer_format is not None else None

    pages_before = pool.kv_pages.clone()
    idx_before = pool.indexer_pages.clone() if pool.indexer_pages is not None else None
    h.flush_compression(rows, entry_request, entry_index, keys)

    targets = []   # (block, row) per flushed row; the padding row goes to (0, 0)
    for i in range(e):
        rid, w = batch.request_ids[entry_request[i]], int(entry_index[i])
        targets.append((mgr.block_ids(rid)[w // epb], w % epb) if w >= 0 else (0, 0))
    for fmt, data, before, after, view in (
            (sch.kv_format, rows, pages_before, pool.kv_pages, h.read_classical_view().entries),
            (sch.indexer_format, keys, idx_before, pool.indexer_pages,
             h.read_indexer_view().keys if keys is not None else None)):
        if data is None:
            continue
        enc = fmt.encode(data)
        expected = before.clone()
        exp_views = fmt.views(expected, epb)
        for i, (blk, row) in enumerate(targets):
            for name, v in exp_views.items():
                v[blk, row] = enc[name][i]
            _check_typed_equal(view, fmt, enc, (blk, row), i)
        assert torch.equal(after, expected), "a flush wrote somewhere else than its entries and block 0 row 0"
        assert targets.count((0, 0)) == 1, "only the padding row may land in the null block"
        if fmt.name == "fp8_ds":
            for i, (blk, row) in enumerate(targets):
                assert torch.equal(view["rope"][blk, row], data[i, D - ROPE:].to(torch.bfloat16))
        elif fmt.name in ("bf16", "bf16_i"):
            name = "kv" if fmt.name == "bf16" else "data"
            for i, (blk, row) in enumerate(targets):
                assert torch.equal(view[name][blk, row], data[i].to(torch.bfloat16))

    decoded = sch.kv_format.roundtrip(rows)
    decoded_keys = sch.indexer_format.roundtrip(keys) if keys is not None else None
    for i in sorted(range(e), key=lambda i: int(entry_index[i])):
        if int(entry_index[i]) < 0:
            continue
        rid = batch.request_ids[entry_request[i]]
        assert len(ref.want["kv", layer, rid]) == int(entry_index[i])
        ref.put("kv", layer, rid, rows[i:i + 1], decoded[i:i + 1])
        if keys is not None:
            ref.put("idx", layer, rid, keys[i:i + 1], decoded_keys[i:i + 1])


def check_gathers(mgr: KVCacheManager, ref: DenseReference, batch: ForwardBatch, layer: int) -> None:
    h = mgr.acquire(layer, batch)
    sch = h.schema
    counts = [mgr.seq_len(rid) // sch.compress_ratio for rid in batch.request_ids]
    n_max = max(counts)
    assert h.num_entries().tolist() == counts and h.max_entries() == n_max

    out = h.gather_all_compressed_kv()
    assert len(out) == 2, "one kv tensor (K = V) and a valid mask"
    kv, valid = out
    assert kv.shape == (batch.num_requests, n_max, D) and kv.dtype == torch.float32 and valid.dtype == torch.bool
    for b, rid in enumerate(batch.request_ids):
        n = counts[b]
        assert valid[b].tolist() == [True] * n + [False] * (n_max - n)
        if n:
            assert torch.equal(kv[b, :n], torch.stack(ref.want["kv", layer, rid])), (rid, layer)
        assert not kv[b, n:].any()

    # per-token random entry sets with -1 holes (as the indexer's top-k would give)
    k = 6
    sel = torch.full((batch.num_tokens, k), -1, dtype=torch.int32)
    for b in range(batch.num_requests):
        for t in range(_span(batch, b).start, _span(batch, b).stop):
            if counts[b]:
                pick = torch.randint(0, counts[b], (k,), dtype=torch.int32)
                sel[t] = torch.where(torch.rand(k) < 0.3, -1, pick)
    out = h.gather_compressed_kv(sel)
    assert len(out) == 2, "one kv tensor (K = V) and a valid mask"
    kv, valid = out
    assert kv.shape == (batch.num_tokens, k, D) and valid.dtype == torch.bool
    assert torch.equal(valid, sel >= 0)
    for t in range(batch.num_tokens):
        rid = batch.request_ids[batch.token_request[t]]
        for j in range(k):
            w = int(sel[t, j])
            want = ref.want["kv", layer, rid][w] if w >= 0 else torch.zeros(D)
            assert torch.equal(kv[t, j], want), (rid, t, j, w)

    view = h.read_classical_view()
    assert view.block_table is batch.block_table and view.block_lens is batch.block_lens
    assert view.entries_per_block == sch.entries_per_block
    if sch.indexer_format is not None:
        keys, kvalid = h.gather_all_indexer_keys()
        assert keys.shape == (batch.num_requests, n_max, D_I) and torch.equal(kvalid, valid_all(counts, n_max))
        for b, rid in enumerate(batch.request_ids):
            if counts[b]:
                assert torch.equal(keys[b, :counts[b]], torch.stack(ref.want["idx", layer, rid])), rid
            assert not keys[b, counts[b]:].any()
        iview = h.read_indexer_view()
        assert iview.block_table is batch.block_table and iview.entries_per_block == sch.entries_per_block


def valid_all(counts: list[int], n_max: int) -> torch.Tensor:
    return torch.arange(n_max)[None, :] < torch.tensor(counts)[:, None]


@pytest.mark.parametrize("indexer_format", ["fp32", "bf16", "mxfp4"])
@pytest.mark.parametrize("kv_format", ["fp32", "bf16", "fp8_ds"])
def test_ragged_batches_match_dense_reference(kv_format: str, indexer_format: str):
    mgr = KVCacheManager(tiny_config(), max_requests=4, num_blocks=40, device="cpu", kv_format=kv_format,
                         indexer_format=indexer_format, tokens_per_block=32)
    ref = DenseReference()
    freed: list[int] = []
    for rid in "abcd":
        mgr.add_request(rid)
        ref.add(rid)
    for step in STEPS:
        if isinstance(step, tuple):
            op, rid = step
            if op == "free":
                freed = mgr.block_ids(rid)
                mgr.free_request(rid)
                ref.drop(rid)
            else:
                mgr.add_request(rid)
                ref.add(rid)
            continue
        old_lens = {rid: mgr.seq_len(rid) for rid in step}
        batch = mgr.prepare_forward(step)
        for layer in (SWA, CSA, HCA):
            write_and_check_window(mgr, ref, batch, layer)
        for layer in (CSA, HCA):
            flush_and_check_pages(mgr, ref, batch, layer, old_lens)
        for layer in (CSA, HCA):
            check_gathers(mgr, ref, batch, layer)
    # "e" took "c"'s slot and (LIFO) c's last block, whose stale entries the valid masks hid.
    assert mgr.requests["e"].slot == 2
    assert len(freed) == 3 and mgr.block_ids("e")[0] == freed[-1]


def test_padding_entries_only_touch_the_null_block():
    mgr = KVCacheManager(tiny_config(), max_requests=2, num_blocks=6, device="cpu", kv_format="fp8_ds",
                         indexer_format="mxfp4", tokens_per_block=32)
    mgr.add_request("a")
    mgr.add_request("b")
    batch = mgr.prepare_forward({"a": 40, "b": 33})         # a: blocks [1, 2], b: [3]
    assert (mgr.block_ids("a"), mgr.block_ids("b")) == ([1, 2], [3])
    for layer in (CSA, HCA):
        h = mgr.acquire(layer, batch)
        pool = mgr.paged[layer]
        before = [p.clone() for p in (pool.kv_pages, pool.indexer_pages) if p is not None]
        n = 5
        keys = torch.randn(n, D_I) if layer == CSA else None
        h.flush_compression(torch.randn(n, D), torch.tensor([0, 1, 0, 1, 1]), torch.full((n,), -1), keys)
        after = [p for p in (pool.kv_pages, pool.indexer_pages) if p is not None]
        for p0, p1 in zip(before, after):
            assert torch.equal(p0[1:], p1[1:]), "a padding write left the null block"
            assert p1[0].any(), "the padding rows went to block 0"
        # and gathers never read block 0 for a valid entry: nothing was flushed, data stays zero
        kv, valid = h.gather_all_compressed_kv()
        assert valid.any() and not kv.any()


def tiny(num_blocks: int = 12, max_requests: int = 4, tokens_per_block: int = 32, **kw) -> KVCacheManager:
    """A tiny-config manager (layers SWA, CSA, HCA) with bf16 formats on the CPU unless given."""
    kw.setdefault("kv_format", "bf16")
    kw.setdefault("indexer_format", "bf16")
    kw.setdefault("device", "cpu")
    cfg = kw.pop("cfg", None) or tiny_config()
    return KVCacheManager(cfg, max_requests=max_requests, num_blocks=num_blocks,
                          tokens_per_block=tokens_per_block, **kw)


# ---------------------------------------------------------------------- handle argument checks
def test_handle_rejects_wrong_device_dtype_and_shape():
    mgr = tiny()
    mgr.add_request("a")
    batch = mgr.prepare_forward({"a": 5})
    for layer in range(3):
        h = mgr.acquire(layer, batch)
        pos_before = mgr.states[layer].swa_pos.clone()
        with pytest.raises(DeviceError, match="meta"):
            h.write_swa(torch.empty(5, 128, device="meta"))
        with pytest.raises(DeviceError, match="floating"):
            h.write_swa(torch.ones(5, 128, dtype=torch.int32))
        with pytest.raises(InputError, match=r"\[5, 128\]"):
            h.write_swa(torch.ones(4, 128))
        with pytest.raises(InputError):
            h.write_swa(torch.ones(5, 64))
        assert torch.equal(mgr.states[layer].swa_pos, pos_before)
    with pytest.raises(InputError, match="layer_idx=3"):
        mgr.acquire(3, batch)
    with pytest.raises(InputError):
        mgr.acquire(-1, batch)


def test_handle_refused_flush_writes_nothing():
    mgr = tiny()
    mgr.add_request("a")
    batch = mgr.prepare_forward({"a": 8})             # 2 CSA entries in block 1
    req, idx = torch.tensor([0, 0]), torch.tensor([0, 1])
    swa, csa, hca = (mgr.acquire(i, batch) for i in range(3))
    with pytest.raises(InputError, match="SWA-only"):
        swa.flush_compression(torch.randn(2, 128), req, idx)
    with pytest.raises(InputError, match="no indexer"):
        hca.gather_all_indexer_keys()
    with pytest.raises(InputError, match="no indexer"):
        hca.read_indexer_view()
    pool = mgr.paged[1]
    kv0, ix0 = pool.kv_pages.clone(), pool.indexer_pages.clone()
    with pytest.raises(InputError, match="indexer_keys"):
        csa.flush_compression(torch.randn(2, 128), req, idx)              # CSA needs indexer keys
    with pytest.raises(InputError, match="indexer_keys"):
        csa.flush_compression(torch.randn(2, 128), req, idx, torch.randn(2, 32))
    with pytest.raises(DeviceError):
        csa.flush_compression(torch.randn(2, 128), req, idx, torch.randn(2, 64, device="meta"))
    with pytest.raises(InputError, match="compressed"):
        csa.flush_compression(torch.randn(3, 128), req, idx, torch.randn(2, 64))
    assert torch.equal(pool.kv_pages, kv0) and torch.equal(pool.indexer_pages, ix0)


def test_flush_halves_write_what_flush_compression_writes():
    """flush_entries + flush_indexer_keys (the layer's two stream chains) leave the pages byte for
    byte as one flush_compression of the same rows; the halves refuse what does not fit them."""
    pages = []
    for split in (False, True):
        mgr = tiny(kv_format="fp8_ds", indexer_format="mxfp4")
        mgr.add_request("a")
        mgr.add_request("b")
        batch = mgr.prepare_forward({"a": 13, "b": 26})           # 3 + 6 CSA entries
        gen = torch.Generator().manual_seed(5)
        req = torch.tensor([0] * 3 + [1] * 6)
        idx = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 5])
        rows, keys = torch.randn(9, D, generator=gen), torch.randn(9, D_I, generator=gen)
        h = mgr.acquire(CSA, batch)
        if split:
            h.flush_indexer_keys(keys, req, idx)
            h.flush_entries(rows, req, idx)
        else:
            h.flush_compression(rows, req, idx, keys)
        pages.append((mgr.paged[CSA].kv_pages.clone(), mgr.paged[CSA].indexer_pages.clone()))
        if split:
            with pytest.raises(InputError, match="not CSA"):
                mgr.acquire(HCA, batch).flush_indexer_keys(keys, req, idx)
            with pytest.raises(InputError, match="indexer_keys"):
                h.flush_indexer_keys(rows, req, idx)
            with pytest.raises(InputError, match="compressed"):
                h.flush_entries(keys, req, idx)
    assert pages[0][0].any() and pages[0][1].any()
    assert torch.equal(pages[0][0], pages[1][0]) and torch.equal(pages[0][1], pages[1][1])


def test_cache_device_given_with_an_index():
    """A cache made on "cpu:0" (like "cuda" vs "cuda:0") accepts tensors on that same device."""
    mgr = tiny(device="cpu:0")
    mgr.add_request("a")
    batch = mgr.prepare_forward({"a": 3})
    h = mgr.acquire(0, batch)
    kv = torch.randn(3, 128)
    h.write_swa(kv)
    got, pos, _ = h.gather_swa_kv()
    assert torch.equal(got[0, -3:], kv.to(torch.bfloat16).float()) and pos[0, -3:].tolist() == [0, 1, 2]


@pytest.mark.gpu
def test_cuda_cache_accepts_cuda_tensors():
    mgr = tiny(device="cuda")
    mgr.add_request("a")
    batch = mgr.prepare_forward({"a": 3})
    assert batch.device.type == "cuda"
    h = mgr.acquire(1, batch)
    kv = torch.randn(3, 128, device="cuda")
    h.write_swa(kv)
    got, _, valid = h.gather_swa_kv()
    assert torch.equal(got[0, -3:], kv.to(torch.bfloat16).float()) and valid[0].sum().item() == 3
    with pytest.raises(DeviceError):
        h.write_swa(kv.cpu())
