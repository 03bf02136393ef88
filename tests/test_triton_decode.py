"""Triton decode kernels (indexer scores, sink attention) against their PyTorch twins.

Caches are real: a KVCacheManager whose page buffers and window rings are first filled with
random bytes (NaN and inf patterns included), then written through the LayerCacheHandle, so
every byte a kernel may read without permission is garbage. Queries, weights and sinks are
fresh random tensors.

tiny_config (W 16, m 4, m' 16, D 128 = 64 + 64, D_I 64), tokens_per_block 32:
    lens    1   3  16  17  18  32  33  34  100      positions = len - 1
    CSA     0   0   4   4   4   8   8   8   25      entries (8 per block)
    HCA     0   0   1   1   1   2   2   2    6      entries (2 per block)
real_dims_config (W 128, m 4, m' 128, D 512 = 448 + 64, D_I 128), tokens_per_block 256:
    lens    3 128 129 130 256 257 258               positions 127/128/129, 255/256/257
    CSA     0  32  32  32  64  64  64
    HCA     0   1   1   1   2   2   2

Tolerances (max|a - b| / max|b|): exact modes ("ieee", fp32 entries) 1e-5; bf16x2 1e-4;
bf16 tensor-core operands 1e-2 (measured ~2-4e-3 on attention, ~3e-3 on scores). Indexer queries
are rounded to the key format (`EntryFormat.round_query`, as the layer does): for mxfp4 and bf16
keys the default "bf16" dot then has exact operands and is held to 1e-5.
On CPU the kernels run in Triton's interpreter (slow): small tiles, H <= 16, few requests.
"""

from __future__ import annotations

import functools
import zlib

import pytest
import torch
from attn_helpers import max_rel
from conftest import real_dims_config, tiny_config

from dsv4 import KVCacheManager
from dsv4.cache.batch import ForwardBatch
from dsv4.errors import FormatError, InputError
from dsv4.kernels.reference import decode as ref
from dsv4.kernels.triton import decode as tri
from dsv4.kernels.triton import decode_attention as att
from dsv4.kernels.triton import indexer_scan_tma as tma_scan
from dsv4.kernels.triton.decode_attention_halves import HALF_WAVE_TILES, LONG_KEYS, default_splits
from dsv4.kernels.triton.indexer_scores import DEFAULT_PRECISION, SCAN_SOME_TILES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SWA, CSA, HCA = 0, 1, 2
TINY_LENS = (1, 3, 16, 17, 18, 32, 33, 34, 100)
REAL_LENS = (3, 128, 129, 130, 256, 257, 258)
TOL = {"ieee": 1e-5, "tf32x3": 1e-5, "bf16x2": 1e-4, "bf16": 1e-2, "fp16": 1.5e-3}
#: the halves scheme's tolerance per key format: fp8_ds keys go to fp16 operands (queries and
#: probabilities rounded to fp16, not bf16: ~3e-4 of the output here against ~5e-3)
HALVES_TOL = {"fp8_ds": TOL["fp16"], "bf16": TOL["bf16"], "fp32": TOL["bf16"]}


def scores_tol(fmt: str) -> float:
    """Tolerance of paged_indexer_scores at its default precision for `fmt`, queries rounded by the
    format: mxfp4 / bf16 at "bf16" are then exact operands (fp32 summation only, as "ieee")."""
    prec = DEFAULT_PRECISION[{"bf16": "bf16_i", "fp32": "fp32_i"}.get(fmt, fmt)]
    return TOL["ieee"] if prec == "bf16" else TOL[prec]


@functools.cache
def cache(kind: str, kv_format: str, indexer_format: str, lens: tuple[int, ...], device: str = DEVICE
          ) -> tuple[KVCacheManager, ForwardBatch]:
    """A poisoned cache holding `lens` tokens per request in every layer (built once per key)."""
    cfg, tpb = (tiny_config(), 32) if kind == "tiny" else (real_dims_config(), 256)
    blocks = sum(-(-n // tpb) + 1 for n in lens) + 2
    mgr = KVCacheManager(cfg, max_requests=len(lens), num_blocks=blocks, device=device,
                         kv_format=kv_format, indexer_format=indexer_format, tokens_per_block=tpb,
                         max_batch_tokens=sum(lens))
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, kv_format, indexer_format, lens)).encode()))
    rids = [f"r{i}" for i in range(len(lens))]
    for rid in rids:
        mgr.add_request(rid)                      # (resets ring slots: poison after this)
    buffers = [p.kv_pages for p in mgr.paged.values()] + [p.indexer_pages for p in mgr.paged.values()]
    for buf in buffers + [s.swa_pages for s in mgr.states.values()]:
        if buf is not None:
            buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
    batch = mgr.prepare_forward(dict(zip(rids, lens)))
    for layer, sch in enumerate(mgr.schemas):
        h = mgr.acquire(layer, batch)
        h.write_swa(torch.randn(batch.num_tokens, cfg.head_dim, generator=gen).to(device) * 2)
        if sch.compress_ratio:
            req = [b for b, n in enumerate(lens) for _ in range(n // sch.compress_ratio)]
            idx = [w for n in lens for w in range(n // sch.compress_ratio)]
            rows = torch.randn(len(idx), cfg.head_dim, generator=gen).to(device) * 2
            keys = (torch.randn(len(idx), cfg.indexer_head_dim, generator=gen).to(device)
                    if sch.indexer_format is not None else None)
            h.flush_compression(rows, torch.tensor(req, device=device), torch.tensor(idx, device=device), keys)
    return mgr, batch


def close(out: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    """Same -inf pattern, finite everywhere else, max relative error <= tol. Returns the error."""
    assert out.shape == want.shape and out.dtype == torch.float32
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(out), fin), "masked / finite pattern differs"
    assert torch.equal(out[~fin], want[~fin])
    err = max_rel(out[fin], want[fin]) if fin.any() else 0.0
    assert err <= tol, f"max rel error {err:.3g} > {tol}"
    return err


# ====================================================================== indexer scores
def scores_args(kind: str, fmt: str, lens: tuple[int, ...], heads: int):
    mgr, batch = cache(kind, "bf16", fmt, lens)
    sch, pool = mgr.schemas[CSA], mgr.paged[CSA]
    g = torch.Generator().manual_seed(heads)
    q = sch.indexer_format.round_query(torch.randn(len(lens), heads, sch.indexer_head_dim, generator=g).to(DEVICE))
    w = torch.randn(len(lens), heads, generator=g).to(DEVICE)
    num_entries = batch.seq_lens // sch.compress_ratio
    return (q, w, pool.indexer, sch.indexer_format, batch.block_table, num_entries,
            batch.seq_len_bound // sch.compress_ratio, sch.entries_per_block)


@pytest.mark.parametrize("heads", [4, 16])
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8", "nvfp4", "bf16", "fp32"])
def test_indexer_scores_formats(fmt, heads):
    args = scores_args("tiny", fmt, TINY_LENS, heads)
    out = tri.paged_indexer_scores(*args)
    want = ref.paged_indexer_scores(*args)
    close(out, want, scores_tol(fmt))
    assert torch.isinf(out[0]).all() and torch.isinf(out[1]).all()     # requests with 0 entries
    if fmt != "fp32":
        close(tri.paged_indexer_scores(*args, precision="bf16x2"), want, TOL["bf16x2"])


@pytest.mark.parametrize("k", [5, 40])
def test_decode_indexer_topk_op(k):
    """The fused op of each backend is its top-k of its scores in index order (ragged requests, k past a
    request's entries: -1 padded), and both namespaces export the same ops."""
    from dsv4.kernels.dispatch import _reference
    from dsv4.kernels.triton.ops import namespace
    args = scores_args("tiny", "mxfp4", TINY_LENS, 16)
    for ns in (tri, ref):
        top = ns.decode_indexer_topk(*args, k)
        assert torch.equal(top, ref.topk_smaller_index(ns.paged_indexer_scores(*args), k, order="index"))
        assert (top[:, 1:] > top[:, :-1]).logical_or(top[:, 1:] == -1).all()
    assert set(vars(_reference())) == set(vars(namespace()))


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_indexer_scores_raw_weights(fmt):
    """weights given as the layer's raw projection (bf16 columns of a wider row, read in place) with
    weight_scale: the same scores, bit for bit, as weights.float() * weight_scale passed in fp32."""
    args = list(scores_args("tiny", fmt, TINY_LENS, 16))
    wide = torch.randn(args[1].shape[0], 40, device=DEVICE).to(torch.bfloat16)
    raw = wide[:, 7:23]                                                # [B, 16], row stride 40
    g = raw.float() * 0.25
    for impl in (tri, ref):
        a = impl.paged_indexer_scores(*args[:1], raw, *args[2:], 0.25)
        b = impl.paged_indexer_scores(*args[:1], g, *args[2:])
        assert torch.equal(a, b), impl
    close(tri.paged_indexer_scores(*args[:1], raw, *args[2:], 0.25),
          ref.paged_indexer_scores(*args[:1], raw, *args[2:], 0.25), scores_tol(fmt))


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "bf16x2", "bf16"])
def test_indexer_scores_real_dims(precision):
    args = scores_args("real", "mxfp4", REAL_LENS, 16)
    close(tri.paged_indexer_scores(*args, precision=precision), ref.paged_indexer_scores(*args), TOL[precision])


@pytest.mark.parametrize("block_n,num_programs", [(16, 1), (16, 3), (32, 2)])
def test_indexer_scores_tiling(block_n, num_programs):
    """Programs stride over key tiles; tiles past a request's end only write -inf."""
    args = scores_args("tiny", "mxfp4", TINY_LENS, 16)
    out = tri.paged_indexer_scores(*args, block_n=block_n, num_programs=num_programs, precision="bf16x2")
    close(out, ref.paged_indexer_scores(*args), TOL["bf16x2"])


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_indexer_scores_e2m1_decode_variants(fmt):
    """The fp8-based E2M1 decode (decode=1) gives the same scores as the fp16-based one."""
    args = scores_args("tiny", fmt, TINY_LENS, 16)
    want = ref.paged_indexer_scores(*args)
    close(tri.paged_indexer_scores(*args, precision="bf16x2", decode=1), want, TOL["bf16x2"])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8", "bf16", "fp32"])
def test_indexer_scores_64_heads_long(fmt):
    lens = (1, 129, 4097, 20000)
    args = scores_args("real", fmt, lens, 64)
    want = ref.paged_indexer_scores(*args)
    close(tri.paged_indexer_scores(*args), want, scores_tol(fmt))
    close(tri.paged_indexer_scores(*args, precision="bf16"), want, TOL["bf16"])
    if fmt != "fp32":
        close(tri.paged_indexer_scores(*args, precision="bf16x2"), want, TOL["bf16x2"])
        for decode in (0, 1):     # both E2M1 decodes (exact): the same scores
            close(tri.paged_indexer_scores(*args, precision="bf16x2", decode=decode), want, TOL["bf16x2"])


@pytest.mark.gpu
def test_indexer_scores_many_tiles():
    """Batches of SCAN_SOME_TILES key tiles or more (one request at 1M context) take 4 scan programs
    per SM instead of 2: a ragged end, tiles past a short request's end, against the reference."""
    lens = (1, 700_001)
    args = scores_args("real", "mxfp4", lens, 64)
    assert len(lens) * -(-args[6] // 64) >= SCAN_SOME_TILES
    out = tri.paged_indexer_scores(*args)
    close(out, ref.paged_indexer_scores(*args), scores_tol("mxfp4"))
    assert torch.isinf(out[0, lens[0] // 4:]).all()


def _slot_maxima(scores: torch.Tensor, num_entries: torch.Tensor, block_n: int, programs: int, slots: int):
    """torch's group maxima of the pointer scan's layout: program p scans tiles p, p + P, ... of
    block_n entries up to its request's last tile; entry i of a tile joins slot i mod `slots` of its
    program. As int32 keys (`topk._keys`), INT32_MIN for a slot that saw no tile."""
    bsz, n = scores.shape
    bits = scores.view(torch.int32)
    keys = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()
    i = torch.arange(n, device=scores.device)
    tile = i // block_n
    scanned = tile[None, :] < (num_entries.long()[:, None].clamp(max=n) + block_n - 1) // block_n
    keys = torch.where(scanned, keys, -2 ** 31)
    want = torch.full((bsz, programs * slots), -2 ** 31, dtype=torch.int64, device=scores.device)
    want.scatter_reduce_(1, ((tile % programs) * slots + i % block_n % slots).expand_as(keys), keys, "amax")
    return want


@pytest.mark.parametrize("groups", [16, 4096])
@pytest.mark.parametrize("block_n,programs", [(16, 1), (16, 3), (32, 2), (16, 300)])
def test_pointer_scan_group_maxima(block_n, programs, groups, monkeypatch):
    """The pointer scan's group maxima (`scores_and_maxima(group_max=True)` where it runs) against
    torch's over its own scores: requests of 0 .. 100 entries, ending inside and at tile boundaries
    (short ones leave programs without a tile), a program a tile (300 asked), slots folded below
    the tile (about 16 maxima a row) and not. The scores are the scan's without maxima."""
    from dsv4.kernels.triton import indexer_scores
    monkeypatch.setattr(indexer_scores, "SCAN_GROUPS", groups)
    args = scores_args("tiny", "mxfp4", TINY_LENS, 16)
    kw = dict(block_n=block_n, num_programs=programs, precision="bf16x2", tma=False)
    scores, gm = tri.scores_and_maxima(*args, group_max=True, **kw)
    assert torch.equal(scores, tri.paged_indexer_scores(*args, **kw))
    p = min(programs, -(-args[6] // block_n))
    slots = gm.shape[1] // p
    assert gm.shape[1] == p * slots and block_n % slots == 0 and slots & (slots - 1) == 0
    assert torch.equal(gm.long(), _slot_maxima(scores, args[5], block_n, p, slots))


def test_scan_maxima_min_groups():
    """`min_groups`: the scan keeps its maxima only where they are at least that many a row (the
    top-k's filter bounds loosely from fewer); the scores do not change either way."""
    args = scores_args("tiny", "mxfp4", TINY_LENS, 16)
    kw = dict(block_n=16, num_programs=3, precision="bf16x2", tma=False)
    scores, gm = tri.scores_and_maxima(*args, group_max=True, **kw)
    g = gm.shape[1]
    kept, gm2 = tri.scores_and_maxima(*args, group_max=True, min_groups=g, **kw)
    assert torch.equal(gm2, gm) and torch.equal(kept, scores)
    dropped, none = tri.scores_and_maxima(*args, group_max=True, min_groups=g + 1, **kw)
    assert none is None and torch.equal(dropped, scores)


@pytest.mark.gpu
def test_decode_indexer_topk_pointer_scan_maxima():
    """Few long requests (the pointer scan's batches) at V4 shapes: its group maxima as torch finds
    them, and `decode_indexer_topk` through the filter bounded by them equal to the reference top-k
    of its scores; maxima claimed too high change the picks (the given bound is read)."""
    from dsv4.kernels.triton import topk
    lens = tuple(4 * e + 3 for e in (9000, 8193, 20000))
    args = scores_args("real", "mxfp4", lens, 64)
    scores, gm = tri.scores_and_maxima(*args, tma=False, group_max=True)
    n = scores.shape[1]
    assert n > topk.FILTER_MIN_SCORES and 512 <= gm.shape[1] <= topk.GIVEN_GROUPS_MAX
    p = min(-(-n // 64), -(-2 * torch.cuda.get_device_properties(0).multi_processor_count // len(lens)))
    assert torch.equal(gm.long(), _slot_maxima(scores, args[5], 64, p, gm.shape[1] // p))
    top = tri.decode_indexer_topk(*args, 512, tma=False)
    assert torch.equal(top, ref.topk_smaller_index(scores, 512, order="index"))
    high = gm.clone()
    high[:, :600] = 2 ** 31 - 1
    assert not torch.equal(tri.topk_smaller_index(scores, 512, group_max=high, order="index"), top)


def _tma_args(ents: tuple[int, ...]):
    """V4 indexer shapes (64 heads, D_I 128, 64 keys a page) with these entry counts; skips where the
    TMA scan cannot run (it needs an sm_90 GPU)."""
    args = scores_args("real", "mxfp4", tuple(4 * e + 3 for e in ents), 64)
    typed = args[3].typed(args[2])
    if not tma_scan.supported(args[0], typed["data"], typed["scale"], "mxfp4", args[7], 1):
        pytest.skip("the TMA indexer scan needs an sm_90 GPU (Hopper) and Triton >= 3.6")
    return args


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("programs,stages", [(None, tma_scan.STAGES), (1, 2), (3, 3), (7, 6)])
def test_indexer_scan_tma(programs, stages, int8):
    """The TMA scan against the reference (exact operands: 1e-5) and the pointer scan (same
    operands, the dot in another K order: 1e-6), ragged requests ending at the page boundaries
    63 / 64 / 65, 127 / 128 / 129, 255 / 256 / 257 entries, empty and one-entry requests, programs sharing a
    request's pages (1 to 7), 2 to 6 pages in flight, with its int8 MMA and with its bf16 MMA alone.
    The output is poisoned (NaN) first."""
    args = _tma_args((0, 1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000))
    want = ref.paged_indexer_scores(*args)
    poison = torch.full_like(want, float("nan"))
    del poison                                        # the allocator hands the NaN block to the kernel's output
    out = tri.paged_indexer_scores(*args, tma=True, num_programs=programs, tma_stages=stages, tma_int8=int8)
    close(out, want, scores_tol("mxfp4"))
    ptr = tri.paged_indexer_scores(*args, tma=False)
    fin = torch.isfinite(want)
    assert max_rel(out[fin], ptr[fin]) <= 1e-6
    assert torch.isinf(out[0]).all() and torch.isfinite(out[1, :1]).all() and torch.isinf(out[1, 1:]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
def test_indexer_scan_tma_scale_spread(int8):
    """Each lane decodes one scale group of its keys: the pool's UE8M0 scale bytes rewritten at
    random over 2^-40 .. 2^8 (groups of one key up to 48 octaves apart, so every group's own factor
    shows in the scores) against the reference, which reads the same bytes."""
    args = _tma_args((5, 64, 200, 1000))
    scale = args[3].typed(args[2])["scale"]
    g = torch.Generator().manual_seed(11)
    scale.copy_(torch.randint(127 - 40, 127 + 9, scale.shape, generator=g, dtype=torch.uint8).to(scale.device))
    want = ref.paged_indexer_scores(*args)
    poison = torch.full_like(want, float("nan"))
    del poison
    close(tri.paged_indexer_scores(*args, tma=True, tma_int8=int8), want, scores_tol("mxfp4"))


def test_indexer_scan_tma_queries_int8():
    """`_q8_kernel` (the int8 scan's queries) against torch: q = q8 2^u a head with 2^(u + 7) above the
    head's largest |q|, columns in the int8 MMA's K order, the MMA's offset -64 sum q8, the weights
    times 2^(u + 100), and `fits` 0 for the head block (a program's) of a head that spreads 2^12
    between scale groups (not one unit) or whose weight would overflow; a zero head and a zero weight
    still fit."""
    from dsv4.cache.formats import indexer_format
    fmt = indexer_format("mxfp4", 128)
    g = torch.Generator().manual_seed(7)
    q = fmt.round_query(torch.randn(4, 64, 128, generator=g) * torch.rand(4, 64, 1, generator=g) * 4)
    w = torch.randn(4, 64, generator=g)
    q[1, 5, :32] *= 2.0 ** 12
    q[2, 3] = 0.0
    w[2, 4] = 0.0
    w[3, 0] = 1e30
    q, w = q.to(DEVICE), w.to(DEVICE)
    q8 = torch.full((4, 64, 128), 99, dtype=torch.int8, device=DEVICE)
    kw = torch.full((4, 128), -7, dtype=torch.int32, device=DEVICE)
    nb = tma_scan.Q8_BLOCKS
    fits = torch.full((4, nb), -1, dtype=torch.int32, device=DEVICE)
    tma_scan._q8_kernel[(4, nb)](q, w, q8, kw, fits, fits, q.stride(0), q.stride(1), w.stride(0), 0, 0.5, HB=64 // nb,
                                 REDO=False, PDL=False)
    k = torch.arange(128)
    dim = 32 * ((k >> 2) & 3) + 8 * (k >> 5) + 4 * ((k >> 4) & 1) + (k & 3)
    qc, wc = q.cpu().double(), w.cpu().double()
    amax = qc.abs().amax(-1)
    u = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 6, torch.zeros_like(amax))
    want = qc[:, :, dim] * torch.exp2(-u)[..., None]
    block0 = [1, 0, 1, 0]           # heads 5 (request 1) and 0 (request 3) lie in the first block
    assert fits.tolist() == [[f] + [1] * (nb - 1) for f in block0]
    for b in (0, 2):
        assert torch.equal(q8[b].cpu().double(), want[b])
        assert torch.equal(kw[b, :64].cpu(), (-64 * want[b].sum(-1)).int())
        w8 = kw[b, 64:].cpu().view(torch.float32).double()
        assert torch.equal(w8, (wc[b].float().double() * 0.5 * torch.exp2(u[b] + 100)))
    assert (want[1].abs() < 128).all() and want[0].abs().amax() >= 64


@pytest.mark.gpu
def test_indexer_scan_tma_int8_fallback():
    """The TMA scan's int8 MMA takes a tile whose keys' scale groups lie within 2^2 of each other, for
    requests whose queries are integers of one power-of-two unit a head; other tiles and requests take
    its bf16 MMA. Keys: groups 0..2 octaves apart at random, one key of every third page and one of
    every fifth 3 apart (rows 7 and 50: the first and the last warp's; the tile falls back); queries:
    one head of request 1 2^12 apart between groups (its programs fall back), request 2 with a zero
    head and a zero weight. Against the reference and the bf16 MMA alone. The fallback tiles run in a
    kernel of their own (`_scan_redo_kernel`): also their group maxima (against torch's over the
    scores, 1 and 3 programs a request) and a CUDA-graph replay (the tiles' list is reset each call)."""
    args = list(_tma_args((5, 64, 200, 1000, 257)))
    scale = args[3].typed(args[2])["scale"]
    g = torch.Generator().manual_seed(3)
    base = torch.randint(118, 134, scale.shape[:2] + (1,), generator=g)
    sc = base + torch.randint(0, 3, scale.shape, generator=g)
    sc[::3, 7] = base[::3, 7] + torch.tensor([0, 0, 3, 1])
    sc[1::5, 50] = base[1::5, 50] + torch.tensor([3, 0, 1, 0])     # a key of another warp's rows
    scale.copy_(sc.to(torch.uint8).to(scale.device))
    q, w = args[0].clone(), args[1].clone()
    q[1, 5, :32] *= 2.0 ** 12
    q[2, 3] = 0.0
    w[2, 4] = 0.0
    args[0], args[1] = q, w
    want = ref.paged_indexer_scores(*args)
    poison = torch.full_like(want, float("nan"))
    del poison
    out = tri.paged_indexer_scores(*args, tma=True, tma_int8=True)
    close(out, want, scores_tol("mxfp4"))
    bf16 = tri.paged_indexer_scores(*args, tma=True, tma_int8=False)
    fin = torch.isfinite(want)
    assert max_rel(out[fin], bf16[fin]) <= 1e-6
    assert torch.equal(torch.isinf(out), torch.isinf(want))
    n = out.shape[1]
    i = torch.arange(n, device=out.device)
    for programs in (1, 3):
        scores, gm = tri.scores_and_maxima(*args, tma=True, tma_int8=True, num_programs=programs, group_max=True)
        assert torch.equal(scores, out)
        p = gm.shape[1] // 64
        bits = scores.view(torch.int32)
        keys = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()
        scanned = (i // 64)[None, :] < (args[5].long()[:, None].clamp(max=n) + 63) // 64
        keys = torch.where(scanned, keys, -2 ** 31)
        gwant = torch.full((out.shape[0], 64 * p), -2 ** 31, dtype=torch.int64, device=out.device)
        gwant.scatter_reduce_(1, ((i // 64) % p * 64 + i % 64).expand_as(keys), keys, "amax")
        assert torch.equal(gm.long(), gwant)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = tri.paged_indexer_scores(*args, tma=True, tma_int8=True)
    for _ in range(3):
        replayed.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out)


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("programs", [None, 8, 9, 33])
def test_decode_indexer_topk_scan_maxima(programs, int8):
    """The TMA scan's group maxima (row slot r of program p: entries 64 (p + i P) + r of its tiles,
    as int32 keys) against torch's over its own scores, and `decode_indexer_topk` (the filter bounded
    by them, no maxima pass) against the reference top-k of those scores: 32 requests (long
    rows) ending at tile and chunk boundaries, empty and one-entry requests, top-512. Maxima claimed
    too high must change the picks (the given bound is read)."""
    from dsv4.kernels.triton import topk
    ents = (0, 1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513, 4095, 4096, 4097, 8191, 8192, 8193,
            9000, 700, 3000, 6000, 2, 1000, 5000, 7000, 8000, 600, 2048, 9001)
    args = _tma_args(ents)
    scores, gm = tri.scores_and_maxima(*args, tma=True, tma_int8=int8, num_programs=programs, group_max=True)
    bsz, n = scores.shape
    p = gm.shape[1] // 64
    assert gm.shape == (bsz, 64 * tma_scan.programs_per_request(programs or p, n))
    bits = scores.view(torch.int32)
    keys = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()
    i = torch.arange(n, device=scores.device)
    scanned = (i // 64)[None, :] < (args[5].long()[:, None].clamp(max=n) + 63) // 64
    keys = torch.where(scanned, keys, -2 ** 31)
    want = torch.full((bsz, 64 * p), -2 ** 31, dtype=torch.int64, device=scores.device)
    want.scatter_reduce_(1, ((i // 64) % p * 64 + i % 64).expand_as(keys), keys, "amax")
    assert torch.equal(gm.long(), want)
    assert 512 <= gm.shape[1] <= topk.GIVEN_GROUPS_MAX and n > topk.FILTER_MIN_SCORES
    top = tri.decode_indexer_topk(*args, 512, tma=True, tma_int8=int8, num_programs=programs)
    assert torch.equal(top, ref.topk_smaller_index(scores, 512, order="index"))
    high = gm.clone()
    high[:, :600] = 2 ** 31 - 1
    assert not torch.equal(tri.topk_smaller_index(scores, 512, group_max=high, order="index"), top)


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
def test_indexer_scan_tma_graph_replay(int8):
    """Captured once, replayed after the queries, weights and entry counts change in place (a shorter
    and a longer request): equal to eager calls on the new inputs. With its int8 MMA, the queries'
    kernel and the scan chained by programmatic dependent launch are captured too."""
    args = list(_tma_args((70, 300, 129, 1)))
    q, w, nent = args[0].clone(), args[1].clone(), args[5].clone()
    args[0], args[1], args[5] = q, w, nent
    tri.paged_indexer_scores(*args, tma=True, tma_int8=int8)       # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.paged_indexer_scores(*args, tma=True, tma_int8=int8)
    g = torch.Generator().manual_seed(5)
    q.copy_(args[3].round_query(torch.randn(q.shape, generator=g).to(DEVICE)))
    w.copy_(torch.randn(w.shape, generator=g).to(DEVICE))
    nent.copy_(torch.tensor([64, 257, 128, 0], device=DEVICE, dtype=nent.dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, tri.paged_indexer_scores(*args, tma=True, tma_int8=int8))
    close(out, ref.paged_indexer_scores(*args), scores_tol("mxfp4"))


# ====================================================================== decode attention
def csa_indices(num_entries: list[int], k: int, gen: torch.Generator) -> torch.Tensor:
    """[B, k] int64 of distinct random visible entries at random slots, -1 holes elsewhere."""
    out = torch.full((len(num_entries), k), -1, dtype=torch.long)
    for b, n in enumerate(num_entries):
        take = min(n, k) - (1 if n >= 2 else 0)            # leave at least one hole where possible
        slots = torch.randperm(k, generator=gen)[:take]
        out[b, slots] = torch.randperm(n, generator=gen)[:take]
    return out


def attention_args(kind: str, kv_format: str, layer: int, heads: int, lens: tuple[int, ...], *,
                   topk: int = 6, back: tuple[int, ...] | None = None, window: int | None = None):
    """Arguments of decode_attention for a query at position len - 1 - back[b] of each request."""
    mgr, batch = cache(kind, kv_format, "bf16", lens)
    cfg, sch, st, pool = mgr.cfg, mgr.schemas[layer], mgr.states[layer], mgr.paged.get(layer)
    g = torch.Generator().manual_seed(heads * 10 + layer)
    q = torch.randn(len(lens), heads, cfg.head_dim, generator=g).to(DEVICE)
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    pos = batch.seq_lens - 1 - (torch.tensor(back, device=DEVICE, dtype=torch.int32) if back else 0)
    indices = num_entries = None
    max_entries = 0
    if sch.compress_ratio:
        max_entries = batch.seq_len_bound // sch.compress_ratio
        num_entries = batch.seq_lens // sch.compress_ratio
        if sch.indexer_format is not None:
            indices = csa_indices([n // sch.compress_ratio for n in lens], topk, g).to(DEVICE)
            num_entries = None
    return (q, st.swa, sch.kv_format, st.swa_pos, batch.request_slots, pos.int(), window or cfg.sliding_window,
            pool.kv if pool is not None else None, batch.block_table if pool is not None else None,
            sch.entries_per_block, indices, num_entries, max_entries, sinks, cfg.head_dim ** -0.5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("layer", [SWA, CSA, HCA], ids=["swa", "csa", "hca"])
@pytest.mark.parametrize("kv_format", ["fp8_ds", "bf16", "fp32"])
def test_attention_tiny(kv_format, layer, num_splits):
    args = attention_args("tiny", kv_format, layer, 4, TINY_LENS)
    out = tri.decode_attention(*args, num_splits=num_splits)
    close(out, ref.decode_attention(*args), TOL["ieee" if kv_format == "fp32" else "bf16"])


@pytest.mark.parametrize("heads,block_h", [(16, 16), (64, 16), (64, 64)])
def test_attention_heads(heads, block_h):
    """Several head blocks per request (each program reads the same key tiles)."""
    args = attention_args("tiny", "fp8_ds", CSA, heads, TINY_LENS)
    close(tri.decode_attention(*args, block_h=block_h, num_splits=2), ref.decode_attention(*args), TOL["bf16"])


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "bf16x2", "bf16"])
def test_attention_precision(precision):
    args = attention_args("tiny", "bf16", HCA, 4, TINY_LENS)
    close(tri.decode_attention(*args, precision=precision), ref.decode_attention(*args), TOL[precision])


def test_attention_window_edges():
    """Queries behind the ring's newest row (rows with pos > t masked) and a window shorter than
    the ring (rows with pos <= t - window masked)."""
    back = (0, 2, 0, 1, 5, 0, 3, 1, 7)
    for window in (16, 9):
        args = attention_args("tiny", "fp32", HCA, 4, TINY_LENS, back=back, window=window)
        close(tri.decode_attention(*args), ref.decode_attention(*args), TOL["ieee"])


@pytest.mark.parametrize("layer,kv_format", [(SWA, "fp8_ds"), (CSA, "fp8_ds"), (HCA, "fp8_ds"), (CSA, "fp32"),
                                             (HCA, "bf16")], ids=["swa", "csa", "hca", "csa-fp32", "hca-bf16"])
def test_attention_real_dims(layer, kv_format):
    """D = 512 (448 e4m3 + 64 bf16), W = 128 and m' = 128 boundaries; K = 16 with holes."""
    args = attention_args("real", kv_format, layer, 8, REAL_LENS, topk=16)
    out = tri.decode_attention(*args, num_splits=2 if layer == HCA else 1)
    close(out, ref.decode_attention(*args), TOL["ieee" if kv_format == "fp32" else "bf16"])


def test_attention_real_dims_64_heads():
    """V4-Flash head count at D 512: four head blocks of 16, two splits, one combine."""
    args = attention_args("real", "fp8_ds", HCA, 64, REAL_LENS)
    close(tri.decode_attention(*args, num_splits=2, block_h=16), ref.decode_attention(*args), TOL["bf16"])


@pytest.mark.parametrize("layer", [SWA, CSA, HCA], ids=["swa", "csa", "hca"])
def test_attention_128_heads(layer):
    """V4-Pro's head count at D 512 (fp8_ds entries): the default scheme (halves at bf16 operands, two
    head blocks of 64 a program pair), the fused kernel over head blocks of 16 with three splits, and
    the two-pass scheme; ragged lengths across the 128 / 256 boundaries. The wide scheme takes 64
    heads only and says so."""
    args = attention_args("real", "fp8_ds", layer, 128, (3, 128, 129, 257), topk=48)
    want = ref.decode_attention(*args)
    close(tri.decode_attention(*args), want, TOL["fp16"])
    close(tri.decode_attention(*args, block_h=16, num_splits=3), want, TOL["bf16"])
    close(tri.decode_attention(*args, scheme="two_pass", value_splits=1), want, TOL["bf16"])
    with pytest.raises(InputError, match="64 heads"):
        tri.decode_attention(*args, scheme="wide")


@pytest.mark.parametrize("layer,precision", [(CSA, "bf16"), (HCA, "bf16x2")], ids=["csa-bf16", "hca-bf16x2"])
def test_attention_two_pass_tiles(layer, precision):
    """Two-pass scheme with pass-1 and pass-2 tiles of different sizes and three score splits."""
    args = attention_args("real", "fp8_ds", layer, 16, (3, 129, 257), topk=48)
    want = ref.decode_attention(*args)
    for sbn, vbn in ((32, 16), (16, 32)):
        out = tri.decode_attention(*args, scheme="two_pass", score_block_n=sbn, value_block_n=vbn, score_splits=3,
                                   value_splits=1, precision=precision)
        close(out, want, TOL[precision])


@pytest.mark.parametrize("layer,kv_format,heads", [(SWA, "fp8_ds", 16), (CSA, "fp8_ds", 8), (HCA, "fp8_ds", 80),
                                                   (CSA, "bf16", 16), (HCA, "fp32", 16)],
                         ids=["swa", "csa", "hca-80-heads", "csa-bf16", "hca-fp32"])
def test_attention_halves(layer, kv_format, heads):
    """Halves scheme (each half's program computes the logits of all channels, the values of its
    half): ring and entry tiles in one index space across the 128 / 256 boundaries, ragged
    requests, one or three key splits, 80 heads as two head blocks (the second part-masked)."""
    args = attention_args("real", kv_format, layer, heads, REAL_LENS, topk=48)
    want = ref.decode_attention(*args)
    for bn, splits in ((16, 1), (32, 3)):
        out = tri.decode_attention(*args, scheme="halves", block_n=bn, num_splits=splits, precision="bf16")
        close(out, want, HALVES_TOL[kv_format])


@pytest.mark.parametrize("lo,hi", [(112, 118), (119, 127), (128, 134)], ids=["2^-15", "2^-8", "2^7"])
@pytest.mark.parametrize("layer", [CSA, HCA], ids=["csa", "hca"])
def test_attention_halves_fp8_scale_range(layer, lo, hi):
    """The halves scheme takes fp8_ds keys as fp16 operands (`decode_common.key_operand`), exact
    while each 64-channel scale 2^(byte - 127) lies in [2^-15, 2^7]: every stored key (ring and
    pool) rewritten with random finite e4m3 bytes and scale bytes across [lo, hi], against the
    reference's fp32 dequantisation."""
    args = list(attention_args("real", "fp8_ds", layer, 64, REAL_LENS, topk=48))
    g = torch.Generator().manual_seed(lo)
    for i in (1, 7):                                    # the ring's and the pool's views
        views = {k: v.clone() for k, v in args[i].items()}
        kv, sc = views["kv"], views["scale"]
        # positive e4m3 (0x7F is NaN): outputs without cancellation, whose relative error is the
        # rounding of q and p alone
        kv[..., :448] = torch.randint(0, 0x7F, kv[..., :448].shape, generator=g).to(kv.dtype)
        rope = torch.rand(*kv.shape[:-1], 64, generator=g) * 2.0 ** ((lo + hi) // 2 - 127) * 64
        kv[..., 448:] = rope.to(torch.bfloat16).view(torch.uint8).to(kv.device)          # the keys' magnitude
        sc[..., :7] = torch.randint(lo, hi + 1, sc[..., :7].shape, generator=g).to(sc.dtype)
        args[i] = views
    # logits of a few units (keys up to 448 x scale), queries exact in fp16: the error left is p's rounding
    args[0] = (args[0] * 2.0 ** (127 - (lo + hi) // 2) / 64).half().float()
    want = ref.decode_attention(*args)
    assert torch.isfinite(want).all()
    for bn, splits in ((16, 1), (32, 3)):
        out = tri.decode_attention(*args, scheme="halves", block_n=bn, num_splits=splits, precision="bf16")
        close(out, want, 5e-4)          # ~1.3e-4 (bf16 operands: ~1e-2)


@pytest.mark.parametrize("knobs", [{}, {"scheme": "two_pass"}, {"scheme": "two_pass", "value_splits": 1},
                                   {"num_splits": 1}, {"num_splits": 3}, {"num_splits": 11},
                                   {"num_splits": 37, "topk": 512}, {"num_splits": 70, "topk": 512}],
                         ids=["halves", "two-pass", "two-pass-bf16-store", "fused", "combine", "combine-11",
                              "combine-trips", "combine-trips-70"])
def test_attention_inverse_rope_bf16(knobs):
    """rope=(cos, sin), out_dtype=bf16 and a bf16 q: the two-pass scheme's pass 2 rotates (two value
    splits: each partial, then fp32 adds; one: a bf16 store), so does the split combine (after the
    halves scheme or the fused kernel; up to 32 splits all loaded at once; 37, 70: trips, the last
    part-masked); a one-split fused kernel hands over to norm_rope."""
    knobs = dict(knobs)
    args = list(attention_args("real", "fp8_ds", CSA, 8, REAL_LENS, topk=knobs.pop("topk", 160)))
    g = torch.Generator().manual_seed(7)
    ang = torch.rand(len(REAL_LENS), 32, generator=g).to(DEVICE) * 6.3
    rope = (ang.cos(), ang.sin())
    args[0] = args[0].to(torch.bfloat16)
    out = tri.decode_attention(*args, rope=rope, out_dtype=torch.bfloat16, **knobs)
    assert out.dtype == torch.bfloat16
    want = ref.decode_attention(*args, rope=rope, out_dtype=torch.float32)
    close(out.float(), want, TOL["bf16"])
    plain = ref.decode_attention(*args)                 # the rotation moved the rope channels
    assert max_rel(out.float()[..., -64:], plain[..., -64:]) > 0.1


@pytest.mark.parametrize("layer,kv_format,knobs", [
    (HCA, "fp8_ds", {"num_splits": 1}), (HCA, "fp8_ds", {"num_splits": 3}), (CSA, "fp8_ds", {"num_splits": 2}),
    (SWA, "bf16", {"num_splits": 1}), (HCA, "fp32", {"num_splits": 2}), (HCA, "fp8_ds", {"scheme": "halves"}),
    (CSA, "fp8_ds", {"scheme": "two_pass"})],
    ids=["hca-fused", "hca-splits", "csa-splits", "swa-bf16", "hca-fp32", "hca-halves", "csa-two-pass"])
def test_attention_q_norm(layer, kv_format, knobs):
    """q_norm: the raw up-projection in. The fused kernel (one or several splits) rotates it where it
    loads it and scales the scores by the norm's 1 / rms: against the fp32 reference, at least as
    close as the norm kernel then the attention (its bf16 operand is rounded once, not twice); the
    other schemes run the norm kernel first, so equal it. Raw rows of different scales (the norm
    must act), ragged positions, rotation angles of every quadrant."""
    from dsv4.kernels.reference.norm_rope import norm_rope as ref_norm_rope
    from dsv4.kernels.triton.norm_rope import norm_rope as tri_norm_rope
    args = list(attention_args("real", kv_format, layer, 8, REAL_LENS, topk=160))
    g = torch.Generator().manual_seed(layer * 10 + len(knobs))
    raw = args[0] * (torch.rand(len(REAL_LENS), 8, 1, generator=g) * 20 + 0.1).to(DEVICE)
    ang = torch.rand(len(REAL_LENS), 32, generator=g).to(DEVICE) * 6.3
    rope, eps = (ang.cos(), ang.sin()), 1e-6
    bf16_q = kv_format != "fp32"
    if bf16_q:
        raw = raw.bfloat16()
    normed = tri_norm_rope(raw, None, eps, *rope, out_dtype=torch.bfloat16 if bf16_q else torch.float32)
    out = tri.decode_attention(raw, *args[1:], rope=rope, q_norm=eps, **knobs)
    two_kernels = tri.decode_attention(normed, *args[1:], rope=rope, **knobs)
    want = ref.decode_attention(raw.float(), *args[1:], rope=rope, q_norm=eps)
    tol = TOL["ieee" if kv_format == "fp32" else "bf16"]
    close(out, want, tol)
    if "scheme" not in knobs:       # the fused kernel
        assert max_rel(out, want) <= max(1.25 * max_rel(two_kernels, want), TOL["ieee"])
    else:
        assert torch.equal(out, two_kernels)
    # the norm and the rotation both matter here
    assert max_rel(ref.decode_attention(raw.float(), *args[1:], rope=rope), want) > 0.1
    unrotated = ref_norm_rope(raw.float(), None, eps, torch.ones_like(ang), torch.zeros_like(ang))
    assert max_rel(ref.decode_attention(unrotated, *args[1:], rope=rope), want) > 0.1
    with pytest.raises(InputError, match="q_norm"):
        tri.decode_attention(raw, *args[1:], q_norm=eps)


def test_q_norm_in_attention_reach():
    """The decode path hands one HCA row's raw queries to the attention only below the entry count from
    which another scheme than the fused kernel (whose q load normalises them) runs."""
    from dsv4.attention import decode_path
    n = decode_path.Q_NORM_IN_ATTENTION_MAX_ENTRIES
    assert n == LONG_KEYS
    rows = decode_path.Q_NORM_IN_ATTENTION_ROWS
    assert att._scheme(rows, 64, 8, 1, True, True, n - 1) == "fused"
    assert att._scheme(rows, 64, 8, 1, True, True, n) != "fused"


def test_fused_split_rule():
    """The fused kernel's default key splits (V4 shapes, 64 heads in 4 head blocks, 132 SMs): a 32-key
    tile a split while that stays within the combine's unrolled splits, else 64 keys a split; never
    more than two programs an SM; split_keys overrides."""
    from dsv4.kernels.triton.decode_combine import UNROLL_SPLITS
    sms, window = 132, 128
    assert att.fused_splits(window + 512, 4, sms) == 20                 # CSA: the window and a 512 top-k
    assert att.fused_splits(window + 8192 // 128, 4, sms) == 6          # HCA at 8K
    assert att.fused_splits(window + 131072 // 128, 4, sms) == 18       # HCA at 128K: 36 tiles > 32 splits
    assert att.fused_splits(window + 512, 2 * 4, sms) == 20
    assert att.fused_splits(window + 512, 16 * 4, sms) == 5             # two programs an SM
    assert att.fused_splits(window + 512, 4, sms, split_keys=128) == 5
    assert att.fused_splits(16, 4, sms) == 1
    for keys in range(32, 4096, 32):
        n = att.fused_splits(keys, 4, sms)
        assert n <= UNROLL_SPLITS or keys > 32 * UNROLL_SPLITS


def test_64_key_tile_rule():
    """The fused kernel's 64-key tiles (V4 shapes, 4 head blocks a request, 132 SMs): where a request
    has 512 keys or more and one such tile a split stays one wave of one program an SM."""
    sms, window = 132, 128
    assert att._tile_keys(window, 512, 4, sms) == 64              # CSA, B = 1: 40 programs
    assert att._tile_keys(window, 512, 3 * 4, sms) == 64          # B = 3: 120
    assert att._tile_keys(window, 512, 4 * 4, sms) == 32          # B = 4: 160, two waves
    assert att._tile_keys(window, 1024, 4, sms) == 64             # HCA 128K, B = 1: 72
    assert att._tile_keys(window, 1024, 2 * 4, sms) == 32         # B = 2: 144
    assert att._tile_keys(window, 64, 4, sms) == 32               # HCA 8K: 192 keys
    assert att._tile_keys(window, 384, 4, sms) == 64
    assert att._tile_keys(window, 383, 4, sms) == 64              # a partial tile counts
    assert att._tile_keys(window, 320, 4, sms) == 32


@pytest.mark.parametrize("splits", [2, 37])
def test_combine_normalised_fp16_partials(splits):
    """The split combine of the wide scheme's partials (fp16 acc_s / l_s, weighted by l_s) equals the
    combine of fp32 acc_s, and the sink-softmax written out in torch: splits that saw no key (m -inf,
    l 0, a zero partial), the inverse rotation, 2 splits (all loads at once) and 37 (trips)."""
    from dsv4.kernels.triton.decode_combine import combine
    g = torch.Generator().manual_seed(splits)
    bsz, heads, dim = 2, 8, 128
    m = torch.randn(bsz, splits, heads, generator=g) * 4
    l_s = torch.rand(bsz, splits, heads, generator=g) * 30 + 0.5
    m[:, 1::3], l_s[:, 1::3] = float("-inf"), 0.0
    o = torch.randn(bsz, splits, heads, dim, generator=g) * 5          # acc_s / l_s
    o[:, 1::3] = 0.0
    acc = o * l_s[..., None]
    pml = torch.stack([m, l_s], -1).to(DEVICE)
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    ang = torch.rand(bsz, 16, generator=g).to(DEVICE) * 6.3
    rope = (ang.cos(), ang.sin())
    cuda = DEVICE == "cuda"
    out32 = combine(acc.to(DEVICE), pml, sinks, rope, None, dim, dim // 64, cuda)
    out16 = combine(o.half().to(DEVICE), pml, sinks, rope, None, dim, dim // 64, cuda)
    sink2 = sinks.cpu().double() * 1.4426950408889634
    big = torch.maximum(m.double().amax(1), sink2)
    w = torch.exp2(m.double() - big[:, None])
    want = (w[..., None] * acc.double()).sum(1) / ((w * l_s.double()).sum(1) + torch.exp2(sink2 - big))[..., None]
    ev, od = want[..., -32::2].clone(), want[..., -31::2].clone()
    c, s_ = (t.cpu().double()[:, None, :] for t in rope)
    want[..., -32::2], want[..., -31::2] = ev * c + od * s_, od * c - ev * s_
    assert max_rel(out32.cpu(), want) <= 1e-5
    assert max_rel(out16.cpu(), want) <= 1e-3          # fp16 partials: ~2^-12 of each
    assert max_rel(out16.cpu(), want) > 0.0


@pytest.mark.parametrize("layer,lens", [(CSA, (3000, 300)), (HCA, (9000, 129))], ids=["csa", "hca"])
@pytest.mark.parametrize("kv_format", ["fp8_ds", "bf16"])
def test_attention_64_key_tile_splits(kv_format, layer, lens):
    """The fused kernel over 64-key tiles (16 heads, 8 warps, as `_tile_keys` picks on a GPU):
    one split, three, and one a tile; a ragged batch whose short request leaves most splits empty."""
    args = attention_args("real", kv_format, layer, 16, lens, topk=512)
    want = ref.decode_attention(*args)
    for splits in (1, 3, 11):
        out = tri.decode_attention(*args, block_n=64, block_h=16, num_warps=8, num_splits=splits)
        close(out, want, TOL["bf16"])


@pytest.mark.gpu
@pytest.mark.parametrize("layer,lens,keys", [(CSA, (5000,), 64), (CSA, (5000, 300), 64), (HCA, (70000,), 64),
                                             (HCA, (60000, 129), 64), (HCA, (70000, 129), 32)],
                         ids=["csa-1", "csa-2", "hca-1", "hca-2", "hca-2-two-waves"])
@pytest.mark.parametrize("kv_format", ["fp8_ds", "bf16"])
def test_attention_64_key_tiles(kv_format, layer, lens, keys, monkeypatch):
    """One or two requests of 64 heads with 512 keys or more: the fused kernel by default over 64-key
    tiles, one a split (`_tile_keys`), where those splits fit one wave (HCA's two requests at a
    131,072-token bound, 1,024 entries, would be 144 programs: 32-key tiles), against the reference;
    with the q norm inside too; the 32-key tiles asked for agree."""
    picked = []

    def spy(*a):
        picked.append(real(*a))
        return picked[-1]

    real = att._tile_keys
    monkeypatch.setattr(att, "_tile_keys", spy)
    args = list(attention_args("real", kv_format, layer, 64, lens, topk=512))
    want = ref.decode_attention(*args)
    close(tri.decode_attention(*args), want, TOL["bf16"])
    assert picked == [keys]
    close(tri.decode_attention(*args, block_n=32), want, TOL["bf16"])
    assert picked == [keys]                                 # knobs given: no rule
    g = torch.Generator().manual_seed(len(lens) + layer)
    raw = (args[0] * (torch.rand(len(lens), 64, 1, generator=g) * 20 + 0.1).to(DEVICE)).bfloat16()
    ang = torch.rand(len(lens), 32, generator=g).to(DEVICE) * 6.3
    rope = (ang.cos(), ang.sin())
    out = tri.decode_attention(raw, *args[1:], rope=rope, q_norm=1e-6)
    assert picked == [keys, keys]
    close(out, ref.decode_attention(raw.float(), *args[1:], rope=rope, q_norm=1e-6), TOL["bf16"])


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [SWA, CSA, HCA], ids=["swa", "csa", "hca"])
@pytest.mark.parametrize("kv_format", ["fp8_ds", "bf16", "fp32"])
def test_attention_64_heads_long(kv_format, layer):
    """V4-Flash shapes: 64 heads, D 512, K 512, long HCA lists (default tuning, split-K)."""
    lens = (1, 129, 4097, 20000)
    args = attention_args("real", kv_format, layer, 64, lens, topk=512)
    tol = TOL["ieee" if kv_format == "fp32" else "bf16"]
    close(tri.decode_attention(*args), ref.decode_attention(*args), tol)
    for splits in (1, 7, 11, 40):            # 11: the combine's second trip of 8 splits, part-masked
        close(tri.decode_attention(*args, num_splits=splits), ref.decode_attention(*args), tol)
    g = torch.Generator().manual_seed(layer)
    ang = torch.rand(len(lens), 32, generator=g).to(DEVICE) * 6.3
    rope = (ang.cos(), ang.sin())
    want = ref.decode_attention(*args, rope=rope, out_dtype=torch.float32)
    for splits in (None, 1, 40):
        out = tri.decode_attention(*args, rope=rope, out_dtype=torch.bfloat16,
                                   **({} if splits is None else {"num_splits": splits}))
        close(out.float(), want, TOL["bf16"])


@pytest.mark.gpu
def test_attention_halves_one_long_request():
    """One request with 4,097 HCA entries (524,417 tokens) takes the halves scheme by default (the
    wide one on sm_90), its keys spread over half a wave of splits (`default_splits`)."""
    args = attention_args("real", "fp8_ds", HCA, 64, (4097 * 128 + 1,))
    assert args[12] >= att.LONG_KEYS
    close(tri.decode_attention(*args), ref.decode_attention(*args), TOL["fp16"])


def test_halves_default_splits():
    """One wave of splits (a program of each half per SM), half a wave for a long request whose
    wave would leave each split fewer than HALF_WAVE_TILES key tiles; never fewer than one."""
    long_tiles = (8192 + 128) // 32
    assert default_splits(132, 1, long_tiles, 8192) == 66          # 1M, B = 1: 260 tiles < 4 x 132
    assert default_splits(132, 2, long_tiles, 8192) == 33
    assert default_splits(132, 4, long_tiles, 8192) == 33          # 8 tiles a split: the wave
    assert default_splits(132, 4, 20, 512) == 33                   # short requests: the wave
    assert default_splits(132, 1, 4 + 128, LONG_KEYS - 1) == 132
    assert default_splits(132, 1, HALF_WAVE_TILES * 132, LONG_KEYS) == 132
    assert default_splits(132, 200, 3, LONG_KEYS) == default_splits(1, 1, 1, LONG_KEYS) == 1


def graph_replay_matches(args: list, layer: int, scheme: str) -> None:
    """decode_attention(scheme) captured once in a CUDA graph replays to the reference after the
    positions (and HCA's entry counts) shrink and the queries change in place."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.decode_attention(*args, scheme=scheme)
    for shrink in (0, 1, 3):
        args[5].sub_(shrink)                            # positions
        if layer == HCA:
            args[11].copy_((args[5] + 1) // 128)        # num_entries
        args[0].normal_()
        graph.replay()
        close(out, ref.decode_attention(*args), TOL["fp16"])


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [SWA, CSA, HCA], ids=["swa", "csa", "hca"])
def test_attention_halves_default(layer):
    """From 4 requests of 64 heads, or one with 4,096 compressed keys (bf16 operands, D 512), the
    default is the halves scheme: two launches chained by programmatic dependent launch, then the
    split combine. Ragged lengths across the tile, window and 128 / 256 boundaries; eager, several
    splits, and a CUDA-graph replay after the metadata and the queries change in place. (On sm_90 the
    default for these fp8_ds entries is the wide scheme instead: `test_attention_wide`.)"""
    lens = (1, 127, 128, 129, 255, 256, 257, 4097, 20000)
    args = list(attention_args("real", "fp8_ds", layer, 64, lens, topk=512))
    assert att._scheme(len(lens), 64, 8, 1, True, True) == "halves"
    assert att._scheme(4, 64, 8, 1, True, True) == att._scheme(1, 64, 8, 1, True, True, 4096) == "halves"
    assert att._scheme(3, 64, 8, 1, True, True, 4095) == att._scheme(4, 64, 8, 0, True, True) == "fused"
    want = ref.decode_attention(*args)
    close(tri.decode_attention(*args), want, TOL["fp16"])
    for splits in (1, 5, 40):
        close(tri.decode_attention(*args, scheme="halves", num_splits=splits), want, TOL["fp16"])
    graph_replay_matches(args, layer, "halves")


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [SWA, CSA, HCA], ids=["swa", "csa", "hca"])
def test_attention_wide(layer):
    """The wide scheme (Gluon, one warp-specialised program per request and split: loader, scores and
    values warpgroups over two 64-key tiles) against the reference: ragged lengths across the tile,
    window and 128 / 256 boundaries, several splits (a split with no tile included), fp32 and bf16
    queries (a bf16 q is copied into shared memory as is and converted there), and a CUDA-graph
    replay after the metadata and the queries change in place."""
    if not (DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9 and att.dw is not None
            and att.dw.GLUON_OK):
        pytest.skip("the wide scheme needs an sm_90 GPU and Triton 3.6 or later")
    lens = (1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 4097, 20000)
    args = list(attention_args("real", "fp8_ds", layer, 64, lens, topk=512))
    want = ref.decode_attention(*args)
    for splits in (None, 1, 5, 40):
        close(tri.decode_attention(*args, scheme="wide", num_splits=splits), want, TOL["fp16"])
    bf = [args[0].bfloat16(), *args[1:]]
    want_bf = ref.decode_attention(*bf)
    for splits in (None, 5):
        close(tri.decode_attention(*bf, scheme="wide", num_splits=splits), want_bf, TOL["fp16"])
    # the default from 4 requests of 64 heads
    assert torch.equal(tri.decode_attention(*args), tri.decode_attention(*args, scheme="wide"))
    graph_replay_matches(args, layer, "wide")


@pytest.mark.gpu
def test_attention_wide_one_long_request():
    """One request with 4,097 HCA entries over the default splits, and bf16 queries."""
    if not (DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9 and att.dw is not None
            and att.dw.GLUON_OK):
        pytest.skip("the wide scheme needs an sm_90 GPU and Triton 3.6 or later")
    args = list(attention_args("real", "fp8_ds", HCA, 64, (4097 * 128 + 1,)))
    want = ref.decode_attention(*args)
    close(tri.decode_attention(*args, scheme="wide"), want, TOL["fp16"])
    args[0] = args[0].bfloat16()
    close(tri.decode_attention(*args, scheme="wide"), ref.decode_attention(*args), TOL["fp16"])


@pytest.mark.gpu
def test_cuda_graph_replay():
    """Both ops captured once replay correctly after the metadata changes in place."""
    args = list(attention_args("real", "fp8_ds", HCA, 64, (129, 4097, 20000)))
    sargs = list(scores_args("real", "mxfp4", (129, 4097, 20000), 64))
    for _ in range(2):      # compile and warm up outside the capture
        tri.decode_attention(*args), tri.paged_indexer_scores(*sargs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.decode_attention(*args)
        scores = tri.paged_indexer_scores(*sargs)
    for shrink in (0, 1, 3):
        args[5].sub_(shrink)                    # positions
        args[11].copy_((args[5] + 1) // 128)    # HCA num_entries
        sargs[5].copy_((args[5] + 1) // 4)      # CSA num_entries
        args[0].normal_(), sargs[0].copy_(sargs[3].round_query(torch.randn_like(sargs[0])))
        graph.replay()
        close(out, ref.decode_attention(*args), TOL["bf16"])
        close(scores, ref.paged_indexer_scores(*sargs), scores_tol("mxfp4"))


# ====================================================================== errors
def test_format_errors():
    sargs = scores_args("tiny", "mxfp4", TINY_LENS[:3], 4)
    mgr, _ = cache("tiny", "bf16", "mxfp4", TINY_LENS[:3])
    with pytest.raises(FormatError, match="indexer formats"):
        tri.paged_indexer_scores(sargs[0], sargs[1], sargs[2], mgr.schemas[CSA].kv_format, *sargs[4:])
    aargs = attention_args("tiny", "bf16", HCA, 4, TINY_LENS[:3])
    with pytest.raises(FormatError, match="main-entry formats"):
        tri.decode_attention(*aargs[:2], mgr.schemas[CSA].indexer_format, *aargs[3:])
    with pytest.raises(InputError, match="precision"):
        tri.decode_attention(*aargs, precision="fp16")
    with pytest.raises(InputError, match="scheme"):
        tri.decode_attention(*aargs, scheme="one_pass")
    with pytest.raises(InputError, match="halves scheme takes bf16"):
        tri.decode_attention(*aargs, scheme="halves", precision="ieee")
    with pytest.raises(InputError, match="kv_views"):
        tri.decode_attention(*aargs[:7], None, None, *aargs[9:])
    fargs = attention_args("tiny", "fp8_ds", HCA, 4, TINY_LENS[:3])
    shifted = {**fargs[7], "scale": fargs[7]["scale"][..., 1:]}     # the kernels read 8 scale bytes as one word
    with pytest.raises(InputError, match="8-byte"):
        tri.decode_attention(*fargs[:7], shifted, *fargs[8:])
