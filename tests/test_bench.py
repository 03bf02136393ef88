"""`dsv4 bench` on CPU: a quick run end to end (JSON, chart), the byte / FLOP model by hand, the
synthetic cache state, and the Triton backend under the interpreter on one tiny case."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from dsv4.attention import AttentionSubBlock
from dsv4.bench import main
from dsv4.bench.common import LAYER_INDEX, bench_config
from dsv4.bench.counts import Geometry, decode_work, fp8_layer_params, layer_params, param_bytes, prefill_work
from dsv4.bench.setup import build_decode_state, make_block
from dsv4.model.fp8_weights import FP8_MODULES

OPS = {"csa": {"append", "flush", "indexer", "attention", "cache", "layer"},
       "hca": {"append", "flush", "attention", "cache", "layer"}}


@pytest.fixture
def one_thread():
    # Tiny shapes: extra intra-op threads only add synchronisation (and stall on a busy machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _rows(doc: dict, **want) -> list[dict]:
    return [r for r in doc["rows"] if all(r[k] == v for k, v in want.items())]


def test_quick_run_writes_well_formed_json(tmp_path, one_thread, capsys):
    out = tmp_path / "bench.json"
    args = ["--quick", "--backends", "reference", "--json", str(out)]
    plot = importlib.util.find_spec("matplotlib") is not None
    if plot:
        args += ["--plot", str(tmp_path / "bench.png")]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "decode: whole attention layer" in printed and "targets" in printed

    doc = json.loads(out.read_text())
    assert doc["schema"] == "dsv4.bench/1"
    assert set(doc) == {"schema", "meta", "ceilings", "rows", "targets", "skipped"}
    assert doc["meta"]["model"] == "quick" and doc["meta"]["contexts"] == [64, 256]
    on_gpu = torch.cuda.is_available()   # the ceilings, and the shares of them, exist only on a GPU
    if not on_gpu:
        assert doc["ceilings"]["copy_gbps"] is None and doc["ceilings"]["mma_tflops"] is None
    row_keys = {"kind", "layer", "context", "batch", "op", "impl", "status", "reason", "mode", "us", "us_eager",
                "bytes", "flops", "bytes_detail", "flops_detail", "note", "gbps", "tflops", "pct_bw", "pct_mma",
                "roofline_us", "pct_roofline", "bound", "x_vs_reference", "x_vs_hf"}
    for r in doc["rows"]:
        assert set(r) == row_keys
        assert r["status"] == "ok", r
        assert r["us"] > 0 and r["bytes"] > 0 and r["bytes"] == sum(r["bytes_detail"].values())
        assert r["flops"] == sum(r["flops_detail"].values())
        if on_gpu:
            assert r["pct_bw"] > 0 and r["pct_roofline"] > 0
        else:
            assert r["pct_bw"] is None and r["pct_roofline"] is None
    # every case: our reference per op, transformers for the whole layer
    for layer in ("csa", "hca"):
        for ctx in (64, 256):
            for b in (1, 3):
                case = _rows(doc, kind="decode", layer=layer, context=ctx, batch=b)
                assert {r["op"] for r in case if r["impl"] == "reference"} == OPS[layer]
                hf = [r for r in case if r["impl"] == "hf"]
                assert [r["op"] for r in hf] == ["layer"]
                ours = next(r for r in case if r["impl"] == "reference" and r["op"] == "layer")
                assert ours["x_vs_hf"] == pytest.approx(hf[0]["us"] / ours["us"])
                assert ours["x_vs_reference"] == pytest.approx(1.0)
        assert {(r["op"], r["impl"]) for r in _rows(doc, kind="prefill", layer=layer)} == {
            ("compress_flush", "reference"), ("layer", "reference"), ("layer", "hf")}
    # one case by hand (quick model: D 128, H 4, W 16, m' 16, fp8_ds entry 64 + 2*64 + 8 = 200 B):
    # HCA attention at C = 256, B = 3 reads q and writes o (bf16, as the step passes them on the GPU),
    # the 16-row ring and its positions, and all 256 // 16 = 16 entries; 4*H*D FLOPs per key
    (att,) = _rows(doc, kind="decode", layer="hca", context=256, batch=3, op="attention", impl="reference")
    assert att["bytes"] == 3 * (2 * 4 * 128 * 2 + 16 * 200 + 16 * 4 + 16 * 200)
    assert att["flops"] == 3 * 4 * 4 * 128 * (16 + 16)
    assert [t["layer"] for t in doc["targets"]] == ["csa", "hca"] * 3
    assert all(t["met"] is None for t in doc["targets"])        # 128K / batch 64 is not in a quick run
    if plot:
        assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_counts_by_hand():
    cfg, _ = bench_config(quick=True)     # D 128 (64 nope + 64 rope), W 16, H 4, m 4, m' 16, k 6, H_I 16 x 64
    e, e_i = 64 + 2 * 64 + 8, 64 // 2 + 64 // 32                # fp8_ds 200 B, mxfp4 34 B
    hca = Geometry.of(cfg, "hca")
    csa = Geometry.of(cfg, "csa")
    assert (hca.entry_bytes, csa.idx_entry_bytes) == (e, e_i)

    # HCA attention, C = 64, B = 1: q + o bf16, 16 ring rows + positions, 64 // 16 = 4 entries
    w = decode_work(hca, batch=1, context=64, score_width=4)["attention"]
    assert w.total_bytes == 2 * 4 * 128 * 2 + 16 * e + 16 * 4 + 4 * e
    # fp32 entries: the step passes fp32 queries (the output stays in the layer's bf16)
    w = decode_work(Geometry.of(cfg, "hca", kv_format="fp32"), batch=1, context=64, score_width=4)["attention"]
    assert w.bytes["q_read"] == 4 * 128 * 4 and w.bytes["o_write"] == 4 * 128 * 2
    assert w.total_flops == 4 * 4 * 128 * (16 + 4)
    # CSA indexer, C = 256, B = 3: 64 keys scanned, 64-wide scores, top-6
    w = decode_work(csa, batch=3, context=256, score_width=64)["indexer"]
    assert w.total_bytes == 3 * (16 * 64 * 4 + 16 * 4 + 64 * e_i + 64 * 4 + 64 * 4 + 6 * 8)
    assert w.total_flops == 3 * 2 * 16 * 64 * 64
    # CSA attention reads W + min(k, N_I) entries (+ the int64 indices); the layer adds the weights once
    ops = decode_work(csa, batch=3, context=256, score_width=64)
    assert ops["attention"].total_bytes == 3 * (2 * 4 * 128 * 2 + (16 + 6) * e + 16 * 4 + 6 * 8)
    assert ops["cache"].total_bytes == sum(ops[k].total_bytes for k in ("append", "flush", "indexer", "attention"))
    assert ops["layer"].total_bytes == ops["cache"].total_bytes + 2 * csa.params + 2 * 3 * 64 * 2
    assert ops["layer"].total_flops == ops["cache"].total_flops + 2 * 3 * csa.proj_params

    # V4-Flash: the per-request counts
    flash, _ = bench_config(quick=False)
    f = decode_work(Geometry.of(flash, "csa"), batch=64, context=131072, score_width=32768)
    assert f["indexer"].bytes["keys_read"] == 64 * 32768 * 68
    assert f["attention"].bytes["entries_read"] + f["attention"].bytes["ring_read"] == 64 * (128 + 512) * 584
    g = decode_work(Geometry.of(flash, "hca"), batch=1, context=131072, score_width=1024)
    assert g["attention"].total_flops == 4 * 64 * 512 * (128 + 1024)

    # prefill: window + visible entries per query, summed
    p = prefill_work(hca, tokens=64, chunk=32)["layer"].flops["attention"]
    assert p == 4 * 4 * 128 * sum(min(16, t + 1) + (t + 1) // 16 for t in range(64))


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_parameter_count_matches_the_layer(kind):
    cfg, _ = bench_config(quick=True)
    blk = AttentionSubBlock(cfg, LAYER_INDEX[kind])
    proj, other = layer_params(cfg, kind)
    assert proj + other == sum(p.numel() for p in blk.parameters())
    assert proj == sum(p.numel() for n, p in blk.named_parameters() if n.endswith("proj.weight"))
    fp8 = sum(p.numel() for n, p in blk.named_parameters() if n.removesuffix(".weight") in FP8_MODULES)
    assert fp8_layer_params(cfg, kind) == fp8
    geo = Geometry.of(cfg, kind)
    # FP8 blocks: one byte a weight plus an fp32 scale per 128 x 128 block, the rest bf16
    assert param_bytes(geo, True) == param_bytes(geo, False) - fp8 + fp8 // 16384 * 4


def test_synthetic_decode_state_is_valid(one_thread):
    cfg, tpb = bench_config(quick=True)
    st = build_decode_state(cfg, context=64, batch=2, device=torch.device("cpu"), tokens_per_block=tpb,
                            kv_format="fp8_ds", indexer_format="mxfp4")
    b = st.batch
    assert b.is_decode and b.seq_lens_host == (64, 64) and b.positions.tolist() == [63, 63]
    for rid in st.request_ids:
        assert st.mgr.seq_len(rid) == 64
    for li, ring in st.mgr.states.items():
        slots = torch.tensor(b.slots_host)
        held = ring.swa_pos[slots].sort(dim=1).values
        assert held.tolist() == [list(range(47, 63))] * 2              # the last W positions before 63
        assert ring.swa_head[slots].tolist() == [63, 63]
        pool = st.mgr.paged[li]
        keys = pool.schema.kv_format.decode({k: v.reshape(-1, v.shape[-1]) for k, v in pool.kv.items()})
        assert torch.isfinite(keys).all()
        assert torch.isfinite(ring.comp_state[slots, 1:]).all()
        assert not torch.isnan(ring.comp_state[slots, 0]).any()
    for kind in ("csa", "hca"):
        blk = make_block(cfg, LAYER_INDEX[kind], torch.device("cpu"))
        blk.backend = "reference"
        with torch.no_grad():
            out = blk(st.x, b, st.mgr.acquire(LAYER_INDEX[kind], b))
        assert out.shape == (2, cfg.hidden_size) and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_attention_op_takes_what_the_layer_passes(backend, one_thread):
    """The attention and cache rows time the attention as `decode_path.decode_attend` calls it: q in
    `query_dtype` (bf16 on Triton for the bf16-exact formats), the output in x's dtype and de-rotated
    by the op at the step's positions. The call is recorded, not run (the Triton namespace's name is
    all that changes q's dtype)."""
    import types

    from dsv4.attention.decode_path import query_dtype
    from dsv4.bench.decode import op_closures
    from dsv4.kernels.dispatch import ops_for

    cfg, tpb = bench_config(quick=True)
    st = build_decode_state(cfg, context=64, batch=2, device=torch.device("cpu"), tokens_per_block=tpb,
                            kv_format="fp8_ds", indexer_format="mxfp4")
    ops = types.SimpleNamespace(**vars(ops_for("cpu", "reference")))
    ops.name = backend
    calls = []
    ops.decode_attention = lambda *args, **kwargs: calls.append((args, kwargs))
    for kind in ("csa", "hca"):
        li = LAYER_INDEX[kind]
        blk = make_block(cfg, li, torch.device("cpu"))
        calls.clear()
        op_closures(blk, st, ops, li)["attention"]()
        ((args, kwargs),) = calls
        want_q = query_dtype(ops, st.mgr.schemas[li].kv_format)
        assert want_q == (torch.bfloat16 if backend == "triton" else torch.float32)
        assert args[0].dtype == want_q and kwargs["out_dtype"] == st.x.dtype == torch.bfloat16
        cos, sin = ops.rope_cos_sin(blk.rope.inv_freq_on(torch.device("cpu")), st.batch.positions)
        assert torch.equal(kwargs["rope"][0], cos) and torch.equal(kwargs["rope"][1], sin)


def test_synthetic_indexer_keys_do_not_repeat_within_a_request(one_thread, monkeypatch):
    """The synthetic cache tiles a pattern of encoded rows over the pages; the indexer's pattern covers
    a whole request, so no key (and no score) repeats within a request's row, while a pattern shorter
    than a request (here 64 rows, 8 pages) is tiled for the main entries."""
    from dsv4.bench import setup
    monkeypatch.setattr(setup, "_PATTERN_ROWS", 64)
    cfg, tpb = bench_config(quick=True)
    st = build_decode_state(cfg, context=1024, batch=2, device=torch.device("cpu"), tokens_per_block=tpb,
                            kv_format="fp8_ds", indexer_format="mxfp4")
    b = st.batch
    checked = 0
    for pool in st.mgr.paged.values():
        if pool.indexer is None:
            continue
        for r in range(b.num_requests):
            pages = b.block_table[r][b.block_table[r] >= 0].long()
            assert len(pages) * pool.schema.entries_per_block > 64        # longer than the short pattern
            rows = torch.cat([v[pages].reshape(-1, v.shape[-1]) for v in pool.indexer.values()], 1)
            assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]
            main = next(iter(pool.kv.values()))[pages]
            assert torch.equal(main[:8], main[8:16])                      # the main entries' short pattern
            checked += 1
    assert checked == 2


def test_bad_arguments_exit_with_usage_status():
    with pytest.raises(SystemExit) as e:
        main(["--contexts", "lots"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["--layers", "swa"])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
                    reason="the Triton backend runs on CPU only under TRITON_INTERPRET=1")
def test_triton_backend_under_the_interpreter(tmp_path, one_thread):
    out = tmp_path / "triton.json"
    assert main(["--quick", "--backends", "triton", "--contexts", "64", "--batches", "1", "--layers", "hca",
                 "--prefill", "0", "--no-hf", "--reps", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = _rows(doc, impl="triton")
    if not rows:   # the Triton kernels did not import: the run says why and measures nothing
        assert any(s["what"] == "backend triton" for s in doc["skipped"])
        return
    assert {r["op"] for r in rows} == OPS["hca"]
    for r in rows:
        assert (r["status"] == "ok" and r["us"] > 0 and r["mode"] == "host") or r["reason"], r
    # the same layer with the checkpoint's FP8 projections: one more layer row, fewer bytes
    (fp8,) = _rows(doc, impl="triton-fp8w")
    (dense,) = _rows(doc, impl="triton", op="layer")
    assert fp8["op"] == "layer" and fp8["status"] == "ok" and fp8["us"] > 0
    assert fp8["bytes"] < dense["bytes"] and fp8["flops"] == dense["flops"]


def test_failures_become_row_statuses(tmp_path, one_thread, monkeypatch):
    """An OOM while building a case's cache, or a transformers without DeepSeek-V4, end no run."""
    from dsv4.bench import decode, hf

    def no_model():
        raise ImportError("transformers 0.0 has no DeepSeek-V4 model")

    monkeypatch.setattr(hf, "import_hf", no_model)
    real = decode.build_decode_state

    def oom_at_256(cfg, *, context, **kw):
        if context == 256:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real(cfg, context=context, **kw)

    monkeypatch.setattr(decode, "build_decode_state", oom_at_256)
    out = tmp_path / "fail.json"
    assert main(["--quick", "--backends", "reference", "--contexts", "64,256", "--batches", "1", "--layers", "hca",
                 "--prefill", "0", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {r["status"] for r in _rows(doc, context=256)} == {"oom"}
    assert {r["status"] for r in _rows(doc, context=64, impl="reference")} == {"ok"}
    (hf_row,) = _rows(doc, context=64, impl="hf")
    assert hf_row["status"] == "skipped" and "DeepSeek-V4" in hf_row["reason"]
    assert any("DeepSeek-V4" in s["reason"] for s in doc["skipped"])


def test_missed_speedup_target_names_the_layers_byte_floor():
    """A missed "x faster than transformers" target says what step the goal asks for and how long the
    layer's own bytes take at the copy ceiling (and that the goal is out of reach when the second is
    longer); a met target, or one without a transformers number, carries no such note."""
    from dsv4.bench.common import FP8_IMPL, Row
    from dsv4.bench.report import targets

    def layer_row(layer: str, impl: str, us: float, pct_bw: float, x_vs_hf: float | None) -> Row:
        return Row(kind="decode", layer=layer, context=131072, batch=1, op="layer", impl=impl, us=us,
                   pct_bw=pct_bw, x_vs_hf=x_vs_hf)

    rows = [layer_row("hca", "triton", 96.4, 76.4, 1878.5 / 96.4),        # bytes 73.6 µs > 62.6 asked
            layer_row("hca", FP8_IMPL, 80.0, 40.0, 1878.5 / 80.0),        # bytes 32.0 µs < 62.6 asked
            layer_row("csa", "triton", 122.8, 68.5, 4870.9 / 122.8),      # met
            layer_row("csa", FP8_IMPL, 87.3, 52.9, None)]                 # no transformers number
    got = {(t["layer"], "FP8" in t["name"]): t for t in targets(rows) if "transformers" in t["name"]}
    bf16_hca, fp8_hca = got[("hca", False)], got[("hca", True)]
    assert bf16_hca["met"] is False and fp8_hca["met"] is False
    assert "asks for 62.6 µs" in bf16_hca["note"] and "take 73.6 µs" in bf16_hca["note"]
    assert "out of reach" in bf16_hca["note"]
    assert "asks for 62.6 µs" in fp8_hca["note"] and "take 32.0 µs" in fp8_hca["note"]
    assert "out of reach" not in fp8_hca["note"]
    assert got[("csa", False)]["met"] is True and got[("csa", False)]["note"] is None
    assert got[("csa", True)]["met"] is None and "no comparison number" in got[("csa", True)]["note"]


@pytest.mark.gpu
def test_time_regions_notes_host_waits():
    """A prefill-style region whose host waits on the device (a device value read) gets a note saying
    so; one that only enqueues kernels gets none (GPU: sync debug mode is CUDA's)."""
    from dsv4.bench.common import BenchOptions
    from dsv4.bench.timing import Timer

    dev = torch.device("cuda")
    timer = Timer(BenchOptions(device=dev, contexts=(), batches=(), layers=(), backends=(), prefill=0,
                               prefill_chunk=0, warmup_ms=1, rep_ms=1))
    x = torch.randn(1 << 16, device=dev)

    def run(region, read: bool):
        for _ in range(3):                  # three regions a run, as three chunks
            region(lambda: (x * 2).sum().item() if read else (x * 2).sum())

    waited = timer.time_regions(lambda region: run(region, True))
    clean = timer.time_regions(lambda region: run(region, False))
    assert waited.note is not None and "3x" in waited.note, waited.note
    assert clean.note is None, clean.note
    assert clean.mode == waited.mode == "device"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_cache_row_branches_equal_the_ops_in_order(kind):
    """The cache row runs its ops on the decode step's branches. Eager and replayed from a CUDA graph,
    it must return the same attention output and leave the same cache and state bytes as the same
    ops one after another: no branch may read what another has not written yet. V4-Flash shapes,
    8 requests at position 4,095, where both compressors finish an entry. Each compressor starts only
    after a spin of ~30 µs on its stream, so a missing wait for its results shows as a wrong read."""
    import types

    from dsv4.bench.decode import op_closures
    from dsv4.kernels.dispatch import ops_for

    dev = torch.device("cuda")
    cfg, tpb = bench_config(quick=False)
    st = build_decode_state(cfg, context=4096, batch=8, device=dev, tokens_per_block=tpb, kv_format="fp8_ds",
                            indexer_format="mxfp4", seed=3)
    li = LAYER_INDEX[kind]
    ops = types.SimpleNamespace(**vars(ops_for(dev, "triton")))
    compress = ops.compress_decode

    def late_compress(*args, **kwargs):
        torch.cuda._sleep(50_000)
        return compress(*args, **kwargs)

    ops.compress_decode = late_compress
    fns = op_closures(make_block(cfg, li, dev), st, ops, li)
    ring, pool = st.mgr.states[li], st.mgr.paged[li]
    bufs = [t for t in (ring.swa_pages, ring.swa_pos, ring.swa_head, ring.comp_state, ring.idx_state,
                        pool.kv_pages, pool.indexer_pages) if t is not None]
    start = [t.clone() for t in bufs]

    def from_start(run) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for t, s in zip(bufs, start):
            t.copy_(s)
        out = run().clone()
        torch.cuda.synchronize()
        return out, [t.clone() for t in bufs]

    want, want_bufs = from_start(lambda: fns["cache"](branches=False))
    assert torch.isfinite(want.float()).all()
    assert any(not torch.equal(a, b) for a, b in zip(want_bufs, start)), "the ops wrote nothing"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fns["cache"]()                          # warm-up off the capturing stream, as PyTorch asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fns["cache"]()
    for run in (fns["cache"], lambda: (graph.replay(), replayed)[1]):
        got, got_bufs = from_start(run)
        assert torch.equal(got, want)
        for a, b in zip(got_bufs, want_bufs):
            assert torch.equal(a, b)
