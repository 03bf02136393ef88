"""DSV4 attention on the paged cache (`AttentionSubBlock` + `KVCacheManager`), verified against the
reference model: transformers' `DeepseekV4Attention` in fp32 (`hf_oracle.run_hf`) and the
independent float64 dense reference (`dsv4.reference.dense.dense_attention`).

Tolerances (DESIGN §8)
----------------------
* kv_format = indexer_format = "fp32": the cache stores exact fp32, so the only differences are
  fp32 rounding of the same math: max|ours - ref| / max|ref| <= 1e-4 against both oracles
  (measured: ~1e-6 vs HF, ~6e-7 vs dense).
* Quantised formats, relative L2 error ||ours - dense|| / ||dense|| (see `FORMAT_BOUNDS`):
  - "bf16" (main and indexer): 8 mantissa bits, per-element relative rounding <= 2^-9 ~ 0.2%; K = V,
    so each key's error enters both the logits and the weighted sum. Bound 4 * 2^-9 = 7.8e-3
    (measured ~2.1e-3 on SWA / HCA / CSA-with-stable-selection outputs).
  - "fp8_ds" main entries: the nope part in e4m3 with power-of-two (UE8M0) scales per 64-element
    tile: 3 mantissa bits, per-element relative rounding <= 2^-4 = 6.25% (uniform rounding: RMS
    ~2^-4/sqrt(3) ~ 3.6%); the RoPE part stays bf16. Averaged over many keys and channels the
    output moves by ~2-3.5% rel-L2 (DESIGN §8). Bound 2^-4 = 0.0625: the per-element worst case,
    which an average of independent rounding errors does not reach (measured: 2.4% tiny, 3.2% real).
    The indexer keys ("mxfp4") only change which entries CSA selects: that is covered by the top-k
    agreement test, and the output bound is checked where the selection is unchanged.
* CSA top-k (`test_csa_topk_agreement_quantised`): a query is near-tied for a format when some
  entry of the exact (float64) top-k and some entry outside it can swap under the key rounding
  of that format, i.e. min_{i in top}(I_i - |dI_i|) <= max_{j not in top}(I_j + |dI_j|) + 1e-5*max|I|,
  where dI is the score change that the format's writer/reader round trip of the keys causes
  (computed exactly, float64). On all other queries the quantised selection must agree with the
  fp32 path's on >= 99% of entries (measured: 100%). Non-tied share: bf16 93-99%, mxfp4 8-27%
  (FP4 keys move scores by ~10% of max|I|). Sharper, on every query not tied at fp32 resolution:
  the quantised selection equals the exact top-k of the scores its format gives (measured: 100%).
* fp32 selections vs HF / dense: identical sets on every query whose float64 gap between the k-th
  and (k+1)-th score exceeds 1e-5 * max|I| (fp32 rounding of scores is ~1e-7 relative).

Measured values are printed at the end of the module's run (terminal summary lines "attention:").
"""

from __future__ import annotations

import functools
import math

import hf_oracle as hfo
import pytest
import torch
from attn_helpers import chunked, indexer_scores, make_block, max_rel, rel_l2, run_dsv4, topk_sets
from conftest import real_dims_config, tiny_config

from dsv4 import KVCacheManager
from dsv4.reference.dense import dense_attention

TOL = 1e-4            # fp32 formats vs HF and vs dense, max-relative
TIE_REL = 1e-5        # fp32 score-gap threshold (relative to max|I| of the query) for exact top-k checks
AGREE_MIN = 0.99      # quantised vs fp32 top-k entry agreement on non-tied queries
BF16_BOUND = 4 * 2.0 ** -9
FP8_BOUND = 2.0 ** -4
# (kv_format, indexer_format) -> rel-L2 bound on outputs whose CSA selection is unchanged.
FORMAT_BOUNDS = {("bf16", "bf16"): BF16_BOUND, ("fp8_ds", "mxfp4"): FP8_BOUND}
# Whole-output rel-L2 of CSA with k = index_topk < entries: a swapped entry changes the output of
# that query by O(1), so this is not derived from the formats; it is a regression guard at 2-4x the
# measured values (bf16 0.2% tiny / 1.3% real, fp8_ds/mxfp4 19% tiny / 12% real); the selection
# itself is checked by the top-k test.
CSA_GUARD = {("bf16", "bf16"): 0.05, ("fp8_ds", "mxfp4"): 0.40}
QUANT_FORMATS = list(FORMAT_BOUNDS)

LAYERS = {"swa": 0, "csa": 1, "hca": 2}  # both test configs: layer 0 SWA, 1 CSA, 2 HCA
S_TINY = 300
SCHEDULES = {
    "oneshot": [S_TINY],
    # prefill, then 40 decode steps (more than the window of 16; crosses HCA windows at 272, 288)
    "prefill_decode": [260] + [1] * 40,
    "uneven": [7, 93, 100, 61, 39],
    # chunks ending exactly at positions 127, 128, 129 and 255, 256, 257
    "boundaries": [128, 1, 1, 126, 1, 1, 42],
    # small chunks: the window of 16 and the compressor windows (4, 16) straddle several chunks
    "straddle": [3, 5, 2, 9, 1, 1, 14, 6, 2, 13, 5, 3, 16, 220],
}
# real geometry: chunk ends at 127, 128, 129 (first HCA boundary, window edge), 600/601, 1100-1102
REAL_S = 1150
REAL_CHUNKS = [127, 1, 1, 471, 1, 499, 1, 1, 48]

MEASURED: list[tuple[str, str, str, float, float | None]] = []  # (case, layer, metric, value, bound)


def _record(case: str, kind: str, metric: str, value: float, bound: float | None = None) -> None:
    MEASURED.append((case, kind, metric, value, bound))
    print(f"{case:36s} {kind:4s} {metric:30s} {value:.3e}" + (f"  (bound {bound:.3e})" if bound else ""))


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    cap = request.config.pluginmanager.get_plugin("capturemanager")
    if tr is None or cap is None or not MEASURED:
        return
    with cap.global_and_fixture_disabled():
        tr.write_line("")
        for case, kind, metric, value, bound in MEASURED:
            b = f"  (bound {bound:.2e})" if bound else ""
            tr.write_line(f"attention: {case:36s} {kind:4s} {metric:30s} {value:.3e}{b}")


# ------------------------------------------------------------------------------------------ shared data
def _x(cfg, S, seed):
    return torch.randn(S, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))


@functools.cache
def _tiny(kind: str, **over):
    """(cfg, weights, x [300, d], dense out, dense top-k) of one tiny layer, computed once."""
    cfg = tiny_config(**over)
    layer = LAYERS[kind]
    w = hfo.random_attention_weights(cfg, layer, seed=1)
    x = _x(cfg, S_TINY, seed=11)
    ref, ref_topk = dense_attention(cfg, layer, w, x, return_topk=True)
    return cfg, w, x, ref, ref_topk


@functools.cache
def _ref_scores(cfg_name: str, kind: str) -> torch.Tensor:
    cfg, w, x = (_tiny(kind) if cfg_name == "tiny" else _real(kind))[:3]
    return indexer_scores(cfg, LAYERS[kind], w, x)


def _exact_topk(score: torch.Tensor, k: int) -> tuple[list[frozenset[int]], torch.Tensor]:
    """Exact top-k sets of float64 scores [S, N] (-inf = invisible) and the k-th/(k+1)-th gap
    relative to max|I| per query (+inf when at most k entries are visible)."""
    S, N = score.shape
    if N == 0:
        return [frozenset()] * S, torch.full((S,), math.inf, dtype=torch.float64)
    srt, order = torch.sort(score, dim=1, descending=True, stable=True)
    nvis = torch.isfinite(score).sum(1)
    sets = [frozenset(order[t, :min(k, int(nvis[t]))].tolist()) for t in range(S)]
    scale = torch.where(torch.isfinite(score), score.abs(), torch.zeros_like(score)).amax(1).clamp_min(1e-300)
    gap = torch.full((S,), math.inf, dtype=torch.float64)
    many = nvis > k
    if N > k:
        gap[many] = (srt[many, k - 1] - srt[many, k]) / scale[many]
    return sets, gap


def _check_fp32_topk(case: str, ours: torch.Tensor, score: torch.Tensor, k: int,
                     others: dict[str, torch.Tensor]) -> None:
    """Our fp32 selection, the exact one and each oracle's agree on every query that is not tied."""
    exact, gap = _exact_topk(score, k)
    known = ours[:, 0] != -2  # rows of all-decode steps are not captured
    clear = (gap > TIE_REL) & known
    mine = topk_sets(ours)
    assert clear.float().mean() > 0.5, "too many tied or uncaptured queries for a meaningful check"
    for t in torch.nonzero(clear).flatten().tolist():
        assert mine[t] == exact[t], f"{case}: query {t} picked {sorted(mine[t])}, exact top-k {sorted(exact[t])}"
    for name, sel in others.items():
        theirs = topk_sets(sel)
        for t in torch.nonzero(gap > TIE_REL).flatten().tolist():
            assert theirs[t] == exact[t], (
                f"{case}: {name} query {t} picked {sorted(theirs[t])}, exact {sorted(exact[t])}")
    _record(case, "csa", "topk == exact (non-tied)", float(clear.sum()), None)


# ------------------------------------------------------------------------------------------ fp32 vs HF and dense
@pytest.mark.parametrize("sched", list(SCHEDULES))
@pytest.mark.parametrize("kind", list(LAYERS))
def test_fp32_matches_hf_and_dense(kind, sched):
    cfg, w, x, ref, ref_topk = _tiny(kind)
    layer, chunks = LAYERS[kind], SCHEDULES[sched]
    csa = kind == "csa"
    got = run_dsv4(cfg, layer, w, {"a": x}, chunked("a", chunks), capture_topk=csa)
    ours, sel = (got[0]["a"], got[1]["a"]) if csa else (got["a"], None)
    hf = hfo.run_hf(cfg, layer, w, x, chunks, return_topk=csa)
    hf, hf_topk = hf if csa else (hf, None)
    e_hf, e_dense = max_rel(ours, hf), max_rel(ours, ref)
    _record(f"tiny/{sched}", kind, "fp32 max-rel vs HF", e_hf, TOL)
    _record(f"tiny/{sched}", kind, "fp32 max-rel vs dense", e_dense, TOL)
    assert e_hf <= TOL and e_dense <= TOL
    if sched == "boundaries":  # chunks end exactly at positions 127, 128, 129 and 255, 256, 257
        ends = torch.tensor(chunks).cumsum(0) - 1
        assert {127, 128, 129, 255, 256, 257} <= set(ends.tolist())
        rows = [126, 127, 128, 129, 130, 254, 255, 256, 257, 258]
        e_rows = max_rel(ours[rows], ref[rows])
        _record(f"tiny/{sched} rows 126-130,254-258", kind, "fp32 max-rel vs dense", e_rows, TOL)
        assert e_rows <= TOL
    if csa:
        _check_fp32_topk(f"tiny/{sched}", sel, _ref_scores("tiny", kind), cfg.index_topk,
                         {"HF": hf_topk, "dense": ref_topk})


# ------------------------------------------------------------------------------------------ several requests
MULTI_LENS = {"a": 78, "b": 73, "c": 93}
MULTI_SCHEDULE = [
    {"a": 37, "b": 1, "c": 70},            # three prefills of different lengths in one batch
    {"a": 1, "b": 20, "c": 1},             # a and c decode while b prefills a chunk
    {"c": 1, "a": 1, "b": 1},              # all decode, another order
    {"b": 30, "a": 1},                     # c idle this step
    {"a": 18, "c": 1, "b": 1},
] + [{"a": 1, "b": 1, "c": 1}] * 20        # 20 decode steps: more than the window of 16


@functools.cache
def _multi_inputs(kind: str):
    cfg = tiny_config()
    w = _tiny(kind)[1]
    xs = {rid: _x(cfg, n, seed=100 + i) for i, (rid, n) in enumerate(MULTI_LENS.items())}
    return cfg, w, xs


@functools.cache
def _multi_packed(kind: str) -> dict[str, torch.Tensor]:
    cfg, w, xs = _multi_inputs(kind)
    return run_dsv4(cfg, LAYERS[kind], w, xs, MULTI_SCHEDULE)


def _own_chunks(rid: str) -> list[int]:
    return [step[rid] for step in MULTI_SCHEDULE if rid in step]


@pytest.mark.parametrize("kind", list(LAYERS))
def test_mixed_batch_matches_hf_per_request(kind):
    cfg, w, xs = _multi_inputs(kind)
    layer = LAYERS[kind]
    outs = _multi_packed(kind)
    attn = hfo.hf_attention(cfg, layer, w)
    worst_hf = worst_dense = 0.0
    for rid, x in xs.items():
        hf = hfo.run_hf(cfg, layer, w, x, _own_chunks(rid), attn=attn)
        ref = dense_attention(cfg, layer, w, x)
        e_hf, e_dense = max_rel(outs[rid], hf), max_rel(outs[rid], ref)
        assert e_hf <= TOL, f"request {rid}: {e_hf:.2e} vs HF"
        assert e_dense <= TOL, f"request {rid}: {e_dense:.2e} vs dense"
        worst_hf, worst_dense = max(worst_hf, e_hf), max(worst_dense, e_dense)
    _record("tiny/mixed batch a,b,c", kind, "fp32 max-rel vs HF", worst_hf, TOL)
    _record("tiny/mixed batch a,b,c", kind, "fp32 max-rel vs dense", worst_dense, TOL)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_batch_independence(kind):
    """A request's outputs do not depend on what else is packed in its batches (fp32)."""
    cfg, w, xs = _multi_inputs(kind)
    packed = _multi_packed(kind)
    worst = 0.0
    for rid, x in xs.items():
        alone = run_dsv4(cfg, LAYERS[kind], w, {rid: x}, chunked(rid, _own_chunks(rid)))[rid]
        e = max_rel(packed[rid], alone)
        assert e <= 1e-6, f"request {rid}: packed vs alone differ by {e:.2e}"
        worst = max(worst, e)
    _record("tiny/packed vs alone", kind, "fp32 max-rel", worst, 1e-6)


# ------------------------------------------------------------------------------------------ slot reuse
@pytest.mark.parametrize("fmt", [("fp32", "fp32"), ("fp8_ds", "mxfp4")], ids=["fp32", "fp8_ds-mxfp4"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_slot_and_block_reuse(kind, fmt):
    """After free_request, a new request in the same slot and the same blocks sees no stale state."""
    cfg, w, _, _, _ = _tiny(kind)
    layer, tpb = LAYERS[kind], 32
    blk = make_block(cfg, layer, w)
    old, other, new = _x(cfg, 90, 21), _x(cfg, 20, 22), _x(cfg, 77, 23)
    new_sched = chunked("new", [30, 1, 1, 45])
    probe = KVCacheManager(cfg, max_requests=2, num_blocks=64, tokens_per_block=tpb)
    need = probe.blocks_needed(90) + probe.blocks_needed(20)
    # just enough blocks (block 0 is the null block) that "new" can only get the ones "old" freed
    mgr = KVCacheManager(cfg, max_requests=2, num_blocks=need + 1, kv_format=fmt[0], indexer_format=fmt[1],
                         tokens_per_block=tpb)
    # 90 tokens: not a multiple of 4 or 16, so the compressor state is mid-window and the ring full
    run_dsv4(cfg, layer, None, {"old": old, "other": other}, [{"old": 45, "other": 20}, {"old": 45}],
             blk=blk, mgr=mgr)
    old_slot = mgr.requests["old"].slot
    old_blocks = set(mgr.block_ids("old"))
    mgr.free_request("old")
    assert mgr.add_request("new") == old_slot
    reused = run_dsv4(cfg, layer, None, {"new": new}, new_sched, blk=blk, mgr=mgr)["new"]
    if old_blocks:  # SWA-only layers of this model still hold blocks for the compressed layers
        assert set(mgr.block_ids("new")) <= old_blocks, "the new request should live in the freed blocks"
    fresh = run_dsv4(cfg, layer, w, {"new": new}, new_sched, kv_format=fmt[0], indexer_format=fmt[1],
                     tokens_per_block=tpb)["new"]
    e = max_rel(reused, fresh)
    _record(f"tiny/slot reuse {fmt[0]}", kind, "max-rel reused vs fresh", e, 1e-6)
    assert e <= 1e-6


# ------------------------------------------------------------------------------------------ quantised formats
def _quant_case(kind: str):
    """CSA with index_topk >= every entry count: selection cannot flip, so the error is the formats' alone."""
    return _tiny(kind, index_topk=128) if kind == "csa" else _tiny(kind)


@pytest.mark.parametrize("sched", ["oneshot", "prefill_decode", "uneven"])
@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("fmt", QUANT_FORMATS, ids=lambda f: "-".join(f))
def test_quantised_formats_within_bound(fmt, kind, sched):
    cfg, w, x, ref, _ = _quant_case(kind)
    if kind == "csa":
        assert cfg.index_topk >= S_TINY // cfg.csa_compression_ratio
    ours = run_dsv4(cfg, LAYERS[kind], w, {"a": x}, chunked("a", SCHEDULES[sched]), kv_format=fmt[0],
                    indexer_format=fmt[1])["a"]
    e = rel_l2(ours, ref)
    bound = FORMAT_BOUNDS[fmt]
    _record(f"tiny/{sched}" + ("/k>=N" if kind == "csa" else ""), kind, f"{'-'.join(fmt)} rel-L2", e, bound)
    assert e <= bound
    # and not suspiciously exact: the quantised path really quantises
    assert e > 1e-4


@functools.cache
def _real(kind: str):
    cfg = real_dims_config()
    layer = LAYERS[kind]
    w = hfo.random_attention_weights(cfg, layer, seed=2)
    x = _x(cfg, REAL_S, seed=12)
    return cfg, w, x, dense_attention(cfg, layer, w, x)


@functools.cache
def _run_captured(cfg_name: str, kind: str, fmt: tuple[str, str]):
    if cfg_name == "tiny":
        cfg, w, x = _tiny(kind)[:3]
        chunks = SCHEDULES["uneven"]
    else:
        cfg, w, x = _real(kind)[:3]
        chunks = REAL_CHUNKS
    return run_dsv4(cfg, LAYERS[kind], w, {"a": x}, chunked("a", chunks), kv_format=fmt[0],
                    indexer_format=fmt[1], capture_topk=kind == "csa", num_blocks=128)


def _top_mask(sets: list[frozenset[int]], shape: tuple[int, int]) -> torch.Tensor:
    mask = torch.zeros(shape, dtype=torch.bool)
    for t, st in enumerate(sets):
        mask[t, list(st)] = True
    return mask


@pytest.mark.parametrize("cfg_name", ["tiny", "real"])
@pytest.mark.parametrize("fmt", QUANT_FORMATS, ids=lambda f: "-".join(f))
def test_csa_topk_agreement_quantised(fmt, cfg_name):
    cfg, w, x, ref = (_tiny("csa")[:4] if cfg_name == "tiny" else _real("csa"))
    k = cfg.index_topk
    out32, sel32 = (v["a"] for v in _run_captured(cfg_name, "csa", ("fp32", "fp32")))
    outq, selq = (v["a"] for v in _run_captured(cfg_name, "csa", fmt))
    # rows of all-decode steps (-2) are not captured; the real schedule has 5 such tokens
    known = (sel32[:, 0] != -2) & (selq[:, 0] != -2)
    assert known.float().mean() > 0.99

    score = _ref_scores(cfg_name, "csa")                                # exact, float64
    qscore = indexer_scores(cfg, LAYERS["csa"], w, x, fmt[1])           # keys through the format
    fin = torch.isfinite(score)
    dI = torch.where(fin, (qscore - score).abs(), torch.zeros_like(score))
    scale = torch.where(fin, score.abs(), torch.zeros_like(score)).amax(1)
    exact, _ = _exact_topk(score, k)
    top = _top_mask(exact, score.shape)
    rest = fin & ~top
    inf = torch.tensor(math.inf, dtype=torch.float64)
    low = torch.where(top, score - dI, inf).amin(1)      # weakest selected entry, pushed down
    high = torch.where(rest, score + dI, -inf).amax(1)   # strongest unselected entry, pushed up
    clear = known & ((~rest.any(1)) | (low > high + 1e-5 * scale))  # no swap possible under the rounding

    s32, sq = topk_sets(sel32), topk_sets(selq)
    agree = torch.tensor([len(a & b) / len(a) if a else 1.0 for a, b in zip(s32, sq)], dtype=torch.float64)
    same_set = torch.tensor([a == b for a, b in zip(s32, sq)]) & known
    case = f"{cfg_name}/topk {'-'.join(fmt)}"
    non_tied = float(clear.sum() / known.sum())
    _record(case, "csa", "non-tied query fraction", non_tied)
    _record(case, "csa", "entry agreement (non-tied)", float(agree[clear].mean()), AGREE_MIN)
    _record(case, "csa", "entry agreement (all)", float(agree[known].mean()))
    _record(case, "csa", "same-set query fraction", float(same_set.sum() / known.sum()))
    # FP4 keys move scores by ~10% of max|I|: with 75-287 entries most queries then have a possible
    # swap, so few are "non-tied" for mxfp4 (measured ~8%); demand enough for the check to bite.
    assert non_tied >= (0.5 if fmt[1] == "bf16" else 0.05)
    assert float(agree[clear].mean()) >= AGREE_MIN
    # the fp32 path itself picks the exact sets on those queries
    assert all(s32[t] == exact[t] for t in torch.nonzero(clear).flatten().tolist())

    # Sharper, for every query: the quantised path picks the top-k of the scores its format gives in
    # exact arithmetic (a wrong nibble order / scale / Hadamard basis would break this), except where
    # those scores are themselves tied at fp32 resolution.
    qexact, qgap = _exact_topk(qscore, k)
    qclear = known & (qgap > TIE_REL)
    emul = torch.tensor([sq[t] == qexact[t] for t in range(len(sq))])
    _record(case, "csa", "== top-k of format's scores", float(emul[qclear].float().mean()), AGREE_MIN)
    assert float(emul[qclear].float().mean()) >= AGREE_MIN and qclear.float().mean() > 0.9

    bound = FORMAT_BOUNDS[fmt]
    e_same = rel_l2(outq[same_set], ref[same_set])
    e_all = rel_l2(outq, ref)
    _record(case, "csa", "rel-L2 rows w/ same selection", e_same, bound)
    _record(case, "csa", "rel-L2 all rows (guard)", e_all, CSA_GUARD[fmt])
    assert e_same <= bound and e_all <= CSA_GUARD[fmt]
    assert max_rel(out32, ref) <= TOL


# ------------------------------------------------------------------------------------------ real geometry
@pytest.mark.parametrize("kind", list(LAYERS))
def test_real_dims_chunked_matches_hf_and_dense(kind):
    """head_dim 512, window 128, m 4, m' 128; 1150 tokens with chunk ends at 127/128/129."""
    cfg, w, x, ref = _real(kind)
    layer = LAYERS[kind]
    csa = kind == "csa"
    got = _run_captured("real", kind, ("fp32", "fp32"))
    out, sel = (got[0]["a"], got[1]["a"]) if csa else (got["a"], None)
    hf = hfo.run_hf(cfg, layer, w, x, REAL_CHUNKS, return_topk=csa)
    hf, hf_topk = hf if csa else (hf, None)
    e_hf, e_dense = max_rel(out, hf), max_rel(out, ref)
    _record("real/1150 chunked", kind, "fp32 max-rel vs HF", e_hf, TOL)
    _record("real/1150 chunked", kind, "fp32 max-rel vs dense", e_dense, TOL)
    assert e_hf <= TOL and e_dense <= TOL
    # the first HCA boundary / window edge: positions 126..131 must not diverge
    scale = ref.abs().max()
    edge = float((out[120:140] - ref[120:140].float()).abs().max() / scale)
    assert edge <= TOL, f"divergence right after 128/129: {edge:.2e}"
    if csa:
        _check_fp32_topk("real/1150 chunked", sel, _ref_scores("real", kind), cfg.index_topk,
                         {"HF": hf_topk})


@pytest.mark.parametrize("kind", ["swa", "hca"])
@pytest.mark.parametrize("fmt", QUANT_FORMATS, ids=lambda f: "-".join(f))
def test_real_dims_quantised(fmt, kind):
    """Real geometry (448 e4m3 + 64 bf16 per entry). CSA is covered by the top-k agreement test."""
    ref = _real(kind)[3]
    out = _run_captured("real", kind, fmt)["a"]
    e = rel_l2(out, ref)
    _record("real/1150 chunked", kind, f"{'-'.join(fmt)} rel-L2", e, FORMAT_BOUNDS[fmt])
    assert 1e-4 < e <= FORMAT_BOUNDS[fmt]
