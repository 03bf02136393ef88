"""GPU: the whole attention sub-block with Triton kernels vs the PyTorch reference, and CUDA-graph
replay of decode steps vs eager decode. Skipped without a CUDA device (run through the device tool)."""

from __future__ import annotations

import hf_oracle
import pytest
import torch
from conftest import real_dims_config, tiny_config

from dsv4 import KVCacheManager
from dsv4.attention import AttentionSubBlock

pytestmark = pytest.mark.gpu

# fp32 formats: the Triton kernels do fp32 math -> tight; bf16/fp8 formats read bf16 operands into
# tensor cores (2^-9 relative per operand) -> a looser, still discriminating bound.
TOL = {("fp32", "fp32"): 1e-4, ("bf16", "bf16"): 2e-2, ("fp8_ds", "mxfp4"): 2e-2}


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _run(cfg, layer, weights, xs, schedule, backend, fmts, graph=False, fp8_weights=False, dtype=torch.float32,
         no_wait=False):
    """Serve `schedule` (list of {request: n_tokens}); return per-request outputs (cat over steps).
    fp8_weights: the projections DeepSeek ships in FP8 held as FP8 blocks (`quantize_weights`).
    no_wait: admissions and every forward run with torch's sync debug mode at "error" (a host wait on
    the device inside them raises)."""
    dev = torch.device("cuda")
    blk = AttentionSubBlock(cfg, layer).to(dev)
    blk.load_hf_state_dict({k: v.to(dev) for k, v in weights.items()})
    if fp8_weights:
        blk.quantize_weights()
    blk.to(dtype)
    mgr = KVCacheManager(cfg, max_requests=4, num_blocks=96, device=dev, kv_format=fmts[0], indexer_format=fmts[1],
                         tokens_per_block=256 if cfg.hca_compression_ratio == 128 else 32, backend=backend)
    torch.cuda.set_sync_debug_mode("error" if no_wait else "default")
    try:    # admission too: an engine admits requests while the GPU runs others' steps
        for r in xs:
            mgr.add_request(r)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    done = dict.fromkeys(xs, 0)
    outs = {r: [] for r in xs}
    graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
    for step in schedule:
        batch = mgr.prepare_forward(step)
        x = torch.cat([xs[r][done[r]:done[r] + n] for r, n in step.items()]).to(dev, dtype)
        handle = mgr.acquire(layer, batch)
        with torch.no_grad():
            if graph and batch.is_decode:
                key = (batch.num_requests, batch.seq_len_bound)
                if key not in graphs:
                    static_x = x.clone()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        static_out = blk(static_x, batch, handle)
                    graphs[key] = (g, static_x, static_out)
                g, static_x, static_out = graphs[key]
                static_x.copy_(x)
                g.replay()
                out = static_out.clone()
            else:
                torch.cuda.set_sync_debug_mode("error" if no_wait else "default")
                try:
                    out = blk(x, batch, handle)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        t0 = 0
        for r, n in step.items():
            outs[r].append(out[t0:t0 + n].float().cpu())
            t0 += n
            done[r] += n
    return {r: torch.cat(v) for r, v in outs.items()}


def _count_calls(monkeypatch, owner, name: str) -> list[int]:
    """Patch the method owner.name to count its calls: the list it appends one to per call."""
    calls: list[int] = []
    orig = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return orig(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _case(cfg, layer, lens, decode_steps, seed=0):
    torch.manual_seed(seed)
    w = hf_oracle.random_attention_weights(cfg, layer, seed=seed)
    xs = {r: torch.randn(n + decode_steps, cfg.hidden_size) for r, n in lens.items()}
    sched = [dict(lens)] + [dict.fromkeys(lens, 1)] * decode_steps
    return w, xs, sched


@pytest.mark.parametrize("fmts", list(TOL))
@pytest.mark.parametrize("layer", [0, 1, 2])
def test_triton_matches_reference_tiny(layer, fmts):
    cfg = tiny_config()
    w, xs, sched = _case(cfg, layer, {"a": 37, "b": 1, "c": 70}, 40)
    ref = _run(cfg, layer, w, xs, sched, "reference", fmts)
    tri = _run(cfg, layer, w, xs, sched, "triton", fmts)
    for r in xs:
        assert _rel_l2(tri[r], ref[r]) <= TOL[fmts], (r, _rel_l2(tri[r], ref[r]))


@pytest.mark.parametrize("fmts", [("fp32", "fp32"), ("fp8_ds", "mxfp4")])
@pytest.mark.parametrize("layer", [0, 1, 2])
def test_triton_matches_hf_real_dims(layer, fmts):
    """Real geometry (D 512, W 128, m 4, m' 128) across 127/128/129 and 255/256/257.

    fp32 formats: against HF fp32. Quantised formats: against the reference path with the same
    formats (FP4 indexer keys legitimately change CSA top-k sets vs fp32, by ~10% rel-L2 on the
    output; that is the format's effect, measured in tests/test_attention.py, not the kernels').
    """
    cfg = real_dims_config()
    w, xs, sched = _case(cfg, layer, {"a": 250, "b": 126}, 9)
    tri = _run(cfg, layer, w, xs, sched, "triton", fmts)
    ref_q = None if fmts[0] == "fp32" else _run(cfg, layer, w, xs, sched, "reference", fmts)
    for r, n in (("a", 250), ("b", 126)):
        if ref_q is None:
            err = _rel_l2(tri[r], hf_oracle.run_hf(cfg, layer, w, xs[r], [n] + [1] * 9))
            assert err <= 1e-4, (r, err)
        else:
            err = _rel_l2(tri[r], ref_q[r])
            assert err <= 2e-2, (r, err)


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_forward_never_waits_on_the_device(layer):
    """Prefill chunks (ragged, several requests, one batch mixed) and decode steps enqueue without the
    host waiting on the device: an engine's host runs ahead of the GPU. A wait inside a layer (a
    pageable copy, a read of a device value) raises under sync debug mode "error". The first run
    compiles."""
    cfg = real_dims_config()
    w, xs, sched = _case(cfg, layer, {"a": 700, "b": 129, "c": 300}, 3)
    # a chunked prefill beside a decoding request (a mixed batch), then decode steps
    sched = [{"a": 300, "b": 129, "c": 200}, {"a": 400, "b": 1, "c": 100}] + sched[2:]
    first = _run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"))
    checked = _run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"), no_wait=True)
    for r in xs:
        assert _rel_l2(checked[r], first[r]) <= 1e-5, r


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_cuda_graph_replay_equals_eager(layer):
    cfg = tiny_config()
    w, xs, sched = _case(cfg, layer, {"a": 37, "b": 5, "c": 70}, 30)
    eager = _run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"))
    graph = _run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"), graph=True)
    for r in xs:
        assert torch.equal(graph[r], eager[r]), (r, _rel_l2(graph[r], eager[r]))


@pytest.mark.parametrize("fp8_weights", [False, True])
def test_output_weight_prefetch_changes_nothing(fp8_weights, monkeypatch):
    """The L2 prefetch of an HCA layer's output projection weights (decode steps of up to
    PREFETCH_MAX_ROWS rows, on a branch of its own) leaves every output bit as it was, eager and
    replayed; `l2_prefetch` asks for whole tensors where they fit the budget (a prefix of the last
    one where they do not) and launches nothing for CPU tensors."""
    from dsv4.attention import decode_path
    from dsv4.kernels.triton import prefetch
    from dsv4.model.layer_schedule import AttentionType
    cfg = tiny_config()
    layer = 2
    assert cfg.layer_schedule()[layer].attn is AttentionType.HCA
    w, xs, sched = _case(cfg, layer, {"a": 37, "b": 5, "c": 70}, 12)
    monkeypatch.setattr(decode_path, "PREFETCH_MAX_ROWS", len(xs))
    kw = {"fp8_weights": fp8_weights, "dtype": torch.bfloat16}
    on = _run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"), graph=True, **kw)
    on_eager = _run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"), **kw)
    monkeypatch.setattr(decode_path, "PREFETCH_MAX_ROWS", 0)
    off = _run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"), graph=True, **kw)
    for r in xs:
        assert torch.equal(on[r], off[r]) and torch.equal(on_eager[r], off[r]), r
    ts = [torch.randn(n, device="cuda") for n in (3, 1000, 40_000, 300_001)]      # 12 B .. 1.2 MB, odd sizes
    total = sum(t.numel() * 4 & ~15 for t in ts)
    assert prefetch.l2_prefetch(ts, 1 << 30) == total
    assert prefetch.l2_prefetch(ts, 170_000) == 170_000
    assert prefetch.l2_prefetch([t.cpu() for t in ts], 1 << 30) == 0
    torch.cuda.synchronize()


@pytest.mark.parametrize("fp8_weights", [False, True])
def test_split_query_up_projection(fp8_weights, monkeypatch):
    """A CSA decode step of SPLIT_QUERY_UP rows runs the indexer's q up-projection alone and the
    attention's on a branch of its own: the same outputs as the one fused GEMM, eager and replayed
    (bit for bit with bf16 weights, whose GEMMs sum each output in one K order however the rows are
    grouped; FP8 blocks may split K differently by the GEMM's rows: close there), and the split is
    taken exactly where asked."""
    from dsv4.attention import decode_path
    cfg = real_dims_config()
    layer = 1
    w, xs, sched = _case(cfg, layer, {"a": 250, "b": 126}, 6)
    kw = {"fp8_weights": fp8_weights, "dtype": torch.bfloat16}
    parts = []
    part = AttentionSubBlock.query_up_part

    def counted(self, name, *args, **kwargs):
        parts.append(name)
        return part(self, name, *args, **kwargs)

    monkeypatch.setattr(AttentionSubBlock, "query_up_part", counted)
    outs = {}
    for split in (True, False):
        monkeypatch.setattr(decode_path, "SPLIT_QUERY_UP", (2, 2) if split else (3, 3))
        parts.clear()
        outs[split] = [_run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"), graph=g, **kw)
                       for g in (False, True)]
        # every decode step of 2 rows, eager and captured: the indexer's GEMM, then the attention's
        assert (parts == ["iq", "q"] * (len(parts) // 2) and len(parts) >= 2 * 6) if split else parts == [], parts
    for r in xs:
        for g in range(2):
            if fp8_weights:
                assert _rel_l2(outs[True][g][r], outs[False][g][r]) <= 1e-2, (r, g)
            else:
                assert torch.equal(outs[True][g][r], outs[False][g][r]), (r, g)


@pytest.mark.parametrize("fp8_weights", [False, True])
def test_csa_one_row_q_on_table_branch(fp8_weights, monkeypatch):
    """A CSA decode step of one row normalises the attention's q on the table branch
    (`Q_ON_TABLE_ROWS`) instead of the side branch: the same kernels on the same inputs, so the same
    output bits, eager and replayed (the capture also fails if the branch is not joined before the end)."""
    from dsv4.attention import decode_path
    from dsv4.model.layer_schedule import AttentionType
    cfg = real_dims_config()
    layer = 1
    assert cfg.layer_schedule()[layer].attn is AttentionType.CSA
    w, xs, sched = _case(cfg, layer, {"a": 250}, 8, seed=7)          # decode rows 250 .. 257: one at a time
    kw = {"fp8_weights": fp8_weights, "dtype": torch.bfloat16}
    calls = _count_calls(monkeypatch, AttentionSubBlock, "queries")
    on_table = [_run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"), graph=g, **kw) for g in (False, True)]
    assert len(calls) >= 8
    monkeypatch.setattr(decode_path, "Q_ON_TABLE_ROWS", 0)
    on_side = [_run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"), graph=g, **kw) for g in (False, True)]
    for g in range(2):
        assert torch.equal(on_table[g]["a"], on_side[g]["a"]), g
    assert torch.equal(on_table[0]["a"], on_table[1]["a"])


@pytest.mark.parametrize("fp8_weights", [False, True])
def test_hca_one_row_urgent_branches(fp8_weights, monkeypatch):
    """An HCA decode step of one row normalises q_a inside the q up-projection's GEMV and runs its
    side branches on urgent streams: the priority changes no output bit (eager and replayed); the
    in-GEMV norm is close to the norm kernel's path (its RMS sums in another order)."""
    from dsv4.attention import decode_path
    from dsv4.kernels.streams import side_stream
    from dsv4.model.layer_schedule import AttentionType
    cfg = real_dims_config()
    layer = 2
    assert cfg.layer_schedule()[layer].attn is AttentionType.HCA
    dev = torch.device("cuda")
    assert side_stream(dev, urgent=True) is not side_stream(dev)
    assert side_stream(dev, 1, urgent=True).priority < side_stream(dev, 1).priority
    assert side_stream(torch.device("cpu"), urgent=True) is None
    w, xs, sched = _case(cfg, layer, {"a": 250}, 8, seed=3)          # decode rows 250 .. 257: one at a time
    kw = {"fp8_weights": fp8_weights, "dtype": torch.bfloat16}
    normed = _count_calls(monkeypatch, AttentionSubBlock, "query_up_normed")
    default = [_run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"), graph=g, **kw) for g in (False, True)]
    assert len(normed) >= 8, "one-row HCA steps take the in-GEMV q_a norm"
    monkeypatch.setattr(decode_path, "URGENT_BRANCHES", ())
    plain = _run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"), graph=True, **kw)
    monkeypatch.setattr(decode_path, "QA_NORM_IN_GEMM", (AttentionType.CSA,))
    kernel_norm = _run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"), **kw)
    assert torch.equal(default[0]["a"], default[1]["a"]) and torch.equal(default[1]["a"], plain["a"])
    err = _rel_l2(default[0]["a"], kernel_norm["a"])
    assert 0 < err <= 1e-2 or torch.equal(default[0]["a"], kernel_norm["a"]), err


@pytest.mark.parametrize("fp8_weights", [False, True])
def test_hca_one_row_q_norm_in_attention(fp8_weights, monkeypatch):
    """An HCA decode step of one row hands the attention its raw queries (`Q_NORM_IN_ATTENTION`): no
    `queries` call (no norm kernel) in the decode steps, eager equal to replayed, and against the
    reference path at least as close as the norm kernel's path (the kernel rotates the raw bf16 row
    and scales its scores by 1 / rms: one rounding of q fewer)."""
    from dsv4.attention import decode_path
    cfg = real_dims_config()
    layer = 2
    w, xs, sched = _case(cfg, layer, {"a": 250}, 8, seed=5)          # decode rows 250 .. 257
    kw = {"fp8_weights": fp8_weights, "dtype": torch.bfloat16}
    calls = _count_calls(monkeypatch, AttentionSubBlock, "queries")
    folded = [_run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"), graph=g, **kw) for g in (False, True)]
    assert not calls, "no step calls `queries`: the prefill attention normalises q too (`q_norm`)"
    monkeypatch.setattr(decode_path, "Q_NORM_IN_ATTENTION", ())
    kernel_norm = _run(cfg, layer, w, xs, sched, "triton", ("fp8_ds", "mxfp4"), **kw)
    assert len(calls) == 8
    assert torch.equal(folded[0]["a"], folded[1]["a"])
    ref = _run(cfg, layer, w, xs, sched, "reference", ("fp8_ds", "mxfp4"), **kw)
    err, err_kernel = _rel_l2(folded[0]["a"], ref["a"]), _rel_l2(kernel_norm["a"], ref["a"])
    assert err <= 1.25 * err_kernel + 1e-4, (err, err_kernel)
    assert 0 < _rel_l2(folded[0]["a"], kernel_norm["a"]) <= 1e-2


@pytest.mark.parametrize("fp8_weights", [False, True])
def test_engine_cuda_graphs_generate_the_same_tokens(fp8_weights):
    """The engine's decode graphs (captured per batch size) give the eager engine's tokens, with dense
    or FP8 block projection weights."""
    from dsv4.engine import Engine
    from dsv4.engine.default_model import DEFAULT_SEED, build_default_model

    prompts = [list(range(3, 40)), list(range(5, 300)), [7] * 130]
    toks = {}
    for graphs in (False, True):
        eng = Engine(build_default_model(DEFAULT_SEED), device="cuda", kv_format="fp32", indexer_format="fp32",
                     cuda_graphs=graphs, fp8_weights=fp8_weights)
        assert eng.weights.startswith("fp8") == fp8_weights
        res = eng.run(prompts, max_new_tokens=40)
        toks[graphs] = res.outputs
        if graphs:
            assert res.stats.cuda_graphs.startswith("on"), res.stats.cuda_graphs
            assert not res.stats.cuda_graphs.startswith("on, 0 "), res.stats.cuda_graphs
    assert toks[True] == toks[False]
