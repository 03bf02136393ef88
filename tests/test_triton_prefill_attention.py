"""Triton prefill attention (`kernels/triton/prefill_attention.py`: the fused kernel and the value
halves scheme, `prefill_attention_halves.py`) against its PyTorch twin
(`reference.attention.prefill_attention`, the masked dense pass of the general path).

Each case is a real cache: every request first caches `before` tokens (window ring written), then
a step of `new` tokens is planned; its ring is gathered before the step's writes, the step's rows
are random and round-tripped through the format, and every entry the request has after the step
is flushed with random rows. Page buffers and rings start as random bytes (NaN / inf patterns
included). Queries, sinks and CSA selections are fresh random draws; selections hold holes (-1).

tiny_config (W 16, m 4, m' 16, D 128), tokens_per_block 32; real_dims_config (W 128, m 4, m' 128,
D 512 = 448 + 64). The (before, new) pairs put queries at 0, at 15/16/17 (127/128/129, 255/256/257
at real dims), chunks longer than the window, one-token steps, and a request whose new rows
start mid-ring. Tolerances as the decode attention's (tests/test_triton_decode.py). On the CPU
interpreter the default scheme is the halves one for bf16 operands (fp8_ds, bf16), the fused
kernel for fp32; scheme="fused" or a fused-kernel knob covers the fused kernel on bf16 operands.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from conftest import real_dims_config, tiny_config
from test_triton_decode import TOL, close, max_rel

from dsv4 import KVCacheManager
from dsv4.errors import InputError
from dsv4.kernels.reference.attention import prefill_attention as ref_prefill_attention
from dsv4.kernels.triton.prefill_attention import prefill_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SWA, CSA, HCA = 0, 1, 2
TINY_STEPS = ((0, 20), (3, 5), (15, 3), (16, 17), (30, 40), (100, 1))
REAL_STEPS = ((0, 130), (127, 3), (250, 8))
# the halves scheme's real-dims steps: fewer tokens (it is the slower one in the interpreter), the
# same boundaries: 127/128/129 in a chunk that starts mid-ring, 255/256/257
REAL_STEPS_HALVES = ((0, 20), (110, 20), (250, 8))


def selections(positions: torch.Tensor, ratio: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[T, k] distinct random entries visible at each position ((t + 1) // ratio of them), -1 holes."""
    out = torch.full((positions.shape[0], k), -1, dtype=torch.long)
    for j, t in enumerate(positions.tolist()):
        n = (t + 1) // ratio
        take = min(n, k) - (1 if n >= 2 else 0)            # leave a hole where possible
        out[j, torch.randperm(k, generator=gen)[:take]] = torch.randperm(n, generator=gen)[:take]
    return out


def prefill_args(kind: str, kv_format: str, layer: int, heads: int, steps: tuple[tuple[int, int], ...], *,
                 topk: int = 6, window: int | None = None):
    """Arguments of prefill_attention for one step of steps[b][1] new tokens after steps[b][0] cached."""
    cfg, tpb = (tiny_config(), 32) if kind == "tiny" else (real_dims_config(), 256)
    total = sum(a + n for a, n in steps)
    mgr = KVCacheManager(cfg, max_requests=len(steps), num_blocks=sum(-(-(a + n) // tpb) + 1 for a, n in steps) + 2,
                         device=DEVICE, kv_format=kv_format, indexer_format="bf16", tokens_per_block=tpb,
                         max_batch_tokens=total)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, kv_format, layer, heads, steps)).encode()))
    rids = [f"r{i}" for i in range(len(steps))]
    for rid in rids:
        mgr.add_request(rid)
    for buf in [p.kv_pages for p in mgr.paged.values()] + [s.swa_pages for s in mgr.states.values()]:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
    sch, pool = mgr.schemas[layer], mgr.paged.get(layer)
    cached = {r: a for r, (a, _) in zip(rids, steps) if a}
    if cached:
        b1 = mgr.prepare_forward(cached)
        mgr.acquire(layer, b1).write_swa(torch.randn(b1.num_tokens, cfg.head_dim, generator=gen).to(DEVICE) * 2)
    batch = mgr.prepare_forward({r: n for r, (_, n) in zip(rids, steps)})
    h = mgr.acquire(layer, batch)
    old_kv, old_pos, _ = h.gather_swa_kv()
    kv = torch.randn(batch.num_tokens, cfg.head_dim, generator=gen).to(DEVICE) * 2
    h.write_swa(kv)
    new_kv = sch.kv_format.roundtrip(kv)
    ratio = sch.compress_ratio
    indices = None
    if ratio:
        req = [b for b, (a, n) in enumerate(steps) for _ in range((a + n) // ratio)]
        idx = [w for a, n in steps for w in range((a + n) // ratio)]
        rows = torch.randn(len(idx), cfg.head_dim, generator=gen).to(DEVICE) * 2
        keys = (torch.randn(len(idx), cfg.indexer_head_dim, generator=gen).to(DEVICE)
                if sch.indexer_format is not None else None)
        h.flush_compression(rows, torch.tensor(req, device=DEVICE), torch.tensor(idx, device=DEVICE), keys)
        if sch.indexer_format is not None:
            indices = selections(batch.positions.cpu(), ratio, topk, gen).to(DEVICE)
    q = torch.randn(batch.num_tokens, heads, cfg.head_dim, generator=gen).to(DEVICE)
    sinks = torch.randn(heads, generator=gen).to(DEVICE)
    return (q, old_kv, old_pos, new_kv, batch.positions, batch.token_request, batch.cu_seqlens,
            window or cfg.sliding_window, pool.kv if pool is not None else None, sch.kv_format, batch.block_table,
            sch.entries_per_block, indices, ratio, h.max_entries() if ratio else 0, sinks, cfg.head_dim ** -0.5)


def tol(kv_format: str) -> float:
    return TOL["ieee" if kv_format == "fp32" else "bf16"]


@pytest.mark.parametrize("layer", [SWA, CSA, HCA], ids=["swa", "csa", "hca"])
@pytest.mark.parametrize("kv_format", ["fp8_ds", "bf16", "fp32"])
def test_prefill_attention_tiny(kv_format, layer):
    args = prefill_args("tiny", kv_format, layer, 4, TINY_STEPS)
    close(prefill_attention(*args), ref_prefill_attention(*args), tol(kv_format))


@pytest.mark.parametrize("layer", [SWA, CSA, HCA], ids=["swa", "csa", "hca"])
def test_prefill_attention_tiny_fused(layer):
    """The fused kernel on bf16 operands (the CPU default is the halves scheme there)."""
    args = prefill_args("tiny", "fp8_ds", layer, 4, TINY_STEPS)
    close(prefill_attention(*args, scheme="fused"), ref_prefill_attention(*args), tol("fp8_ds"))


def test_prefill_attention_short_window_and_head_blocks():
    """A window shorter than the ring (rows at p <= t - window masked), 32 heads in blocks of 16."""
    args = prefill_args("tiny", "fp8_ds", HCA, 32, TINY_STEPS, window=9)
    close(prefill_attention(*args, block_h=16), ref_prefill_attention(*args), tol("fp8_ds"))


def test_prefill_attention_halves_head_blocks():
    """The halves scheme with 80 heads: two 64-head blocks, the second part-masked; a short window."""
    args = prefill_args("tiny", "bf16", CSA, 80, TINY_STEPS[:4], window=9)
    close(prefill_attention(*args, scheme="halves"), ref_prefill_attention(*args), tol("bf16"))


def finish_args(n: int, seed: int) -> dict:
    """rope = (cos, sin) [n, 32] of random angles, bf16 output: the layer's form of the op."""
    ang = torch.rand(n, 32, generator=torch.Generator().manual_seed(seed)).to(DEVICE) * 6.3
    return {"rope": (ang.cos(), ang.sin()), "out_dtype": torch.bfloat16}


@pytest.mark.parametrize("scheme", ["halves", "fused"])
def test_prefill_attention_inverse_rope_bf16(scheme):
    """rope=(cos, sin), out_dtype=bf16 and a bf16 q (as the layer calls it): the halves kernel rotates
    and converts in its epilogue (tiny dims: the rope channels are all of the second half; at
    D 512 in the GPU test below), the fused kernel hands over to norm_rope."""
    args = list(prefill_args("tiny", "fp8_ds", CSA, 8, TINY_STEPS))
    args[0] = args[0].to(torch.bfloat16)
    fin = finish_args(args[0].shape[0], 3)
    out = prefill_attention(*args, scheme=scheme, **fin)
    assert out.dtype == torch.bfloat16
    want = ref_prefill_attention(*args, rope=fin["rope"], out_dtype=torch.float32)
    close(out.float(), want, tol("fp8_ds"))
    plain = ref_prefill_attention(*args)                # the rotation moved the rope channels
    assert max_rel(out.float()[..., -64:], plain[..., -64:]) > 0.1


def raw_queries(q: torch.Tensor, seed: int, extra: int = 96) -> torch.Tensor:
    """q [T, H, D] as the layer's raw up-projection: bf16, per-row magnitudes 2^-8 .. 2^14 (some rows
    past fp16's range, so a kernel must normalise before it rounds to fp16), a column view of a wider
    buffer (CSA's q_b columns beside the indexer's)."""
    t, h, d = q.shape
    g = torch.Generator().manual_seed(seed)
    scale = 2.0 ** torch.randint(-8, 15, (t, h, 1), generator=g).float()
    wide = torch.randn(t, h * d + extra, generator=g).to(q.device, torch.bfloat16)
    wide[:, :h * d] = (q.float().cpu() * scale).reshape(t, h * d).to(q.device, torch.bfloat16)
    return wide[:, :h * d].view(t, h, d)


@pytest.mark.parametrize("scheme", ["halves", "fused"])
def test_prefill_attention_q_norm(scheme):
    """q_norm: raw queries (a strided bf16 view, rows far outside fp16's range) normalised and rotated
    by the op: the reference's q_norm is its norm_rope first, bit for bit, and the kernels match it.
    Then the kernels' own form: equal to the same call on norm_rope's bf16 queries."""
    from dsv4.kernels.reference.norm_rope import norm_rope as ref_norm_rope
    from dsv4.kernels.triton.norm_rope import norm_rope
    args = list(prefill_args("tiny", "fp8_ds", HCA, 8, TINY_STEPS))
    args[0] = raw_queries(args[0], 11)
    fin = finish_args(args[0].shape[0], 5)
    want = ref_prefill_attention(*args, rope=fin["rope"], out_dtype=torch.float32, q_norm=1e-6)
    normed = ref_norm_rope(args[0], None, 1e-6, *fin["rope"], out_dtype=torch.float32)
    assert torch.equal(want, ref_prefill_attention(normed, *args[1:], rope=fin["rope"], out_dtype=torch.float32))
    out = prefill_attention(*args, scheme=scheme, **fin, q_norm=1e-6)
    close(out.float(), want, tol("fp8_ds"))
    q_bf16 = norm_rope(args[0], None, 1e-6, *fin["rope"], out_dtype=torch.bfloat16)
    assert torch.equal(out, prefill_attention(q_bf16, *args[1:], scheme=scheme, **fin))
    with pytest.raises(InputError, match="q_norm rotates q"):
        prefill_attention(*args, q_norm=1e-6)
    with pytest.raises(InputError, match="q_norm rotates q"):
        ref_prefill_attention(*args, q_norm=1e-6)


@pytest.mark.parametrize("scheme", ["halves", "fused"])
@pytest.mark.parametrize("layer,kv_format", [(CSA, "fp8_ds"), (HCA, "fp8_ds")], ids=["csa", "hca"])
def test_prefill_attention_real_dims(layer, kv_format, scheme):
    """D 512 (448 e4m3 + 64 bf16), W 128, m' 128: queries at 127/128/129 and 255/256/257."""
    args = prefill_args("real", kv_format, layer, 8, REAL_STEPS_HALVES if scheme == "halves" else REAL_STEPS, topk=16)
    close(prefill_attention(*args, scheme=scheme), ref_prefill_attention(*args), tol(kv_format))


@pytest.mark.parametrize("kv_format", ["fp32", "bf16"], ids=["fused", "halves"])
def test_prefill_attention_empty_batch(kv_format):
    """No tokens: an empty output in the asked dtype from either scheme."""
    args = list(prefill_args("tiny", kv_format, HCA, 4, ((0, 3),)))
    for k in (0, 3, 4, 5):                  # q, new_kv, positions, token_request
        args[k] = args[k][:0]
    out = prefill_attention(*args, out_dtype=torch.bfloat16)
    assert out.shape == (0, 4, 128) and out.dtype == torch.bfloat16


def test_prefill_attention_scheme_errors():
    args = prefill_args("tiny", "fp32", SWA, 4, ((0, 3),))
    with pytest.raises(InputError, match="scheme="):
        prefill_attention(*args, scheme="two_pass")
    with pytest.raises(InputError, match="halves scheme takes bf16 operands"):
        prefill_attention(*args, scheme="halves")
    with pytest.raises(InputError, match="wide scheme takes"):
        prefill_attention(*args, scheme="wide")
    if not wide_ok():       # bf16 operands, but no sm_90 GPU (or a small head count): refused, not run elsewhere
        fp8 = prefill_args("tiny", "fp8_ds", CSA, 4, ((0, 3),))
        with pytest.raises(InputError, match="wide scheme takes fp8_ds entries"):
            prefill_attention(*fp8, scheme="wide")
    with pytest.raises(InputError, match="rope"):
        prefill_attention(*args, rope=(torch.ones(3, 32, device=DEVICE), torch.ones(2, 32, device=DEVICE)))


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [SWA, CSA, HCA], ids=["swa", "csa", "hca"])
@pytest.mark.parametrize("kv_format", ["fp8_ds", "bf16", "fp32"])
def test_prefill_attention_v4_flash_shapes(kv_format, layer):
    """64 heads, D 512, K 512: a long first chunk, a chunk after 4K cached, a short one after 20K.
    The default (wide for fp8_ds on sm_90, halves for bf16 and elsewhere, fused for fp32), in the
    layer's form (rotation, bf16 output, bf16 q where the format is bf16-exact), and the fused kernel
    on bf16 operands."""
    args = list(prefill_args("real", kv_format, layer, 64, ((0, 1000), (4000, 700), (20000, 129)), topk=512))
    want = ref_prefill_attention(*args)
    close(prefill_attention(*args), want, tol(kv_format))
    if kv_format != "fp32":
        close(prefill_attention(*args, scheme="fused"), want, tol(kv_format))
        args[0] = args[0].to(torch.bfloat16)
    fin = finish_args(args[0].shape[0], layer)
    want = ref_prefill_attention(*args, rope=fin["rope"], out_dtype=torch.float32)
    out = prefill_attention(*args, **fin)
    assert out.dtype == torch.bfloat16
    close(out.float(), want, tol("bf16"))


def wide_ok() -> bool:
    from dsv4.kernels.triton import prefill_attention as pa
    return DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9 and pa.pw is not None and pa.pw.dw.GLUON_OK


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [SWA, CSA, HCA], ids=["swa", "csa", "hca"])
def test_prefill_attention_wide(layer):
    """The wide scheme (Gluon: the decode wide kernel's warp-specialised program for each token, its
    window's bf16 rows as its first tiles) against the reference at 64 heads, D 512, top-512: requests
    whose queries cross 127/128/129 and 255/256/257, chunks that start mid-ring, a long first chunk,
    chunks after 4K and 20K cached, a one-token step; fp32 queries, then the layer's form (bf16 q,
    rotation, bf16 output)."""
    if not wide_ok():
        pytest.skip("the wide scheme needs an sm_90 GPU and Triton 3.6 or later")
    steps = ((0, 300), (110, 20), (250, 8), (4000, 700), (20000, 129), (127, 1))
    args = list(prefill_args("real", "fp8_ds", layer, 64, steps, topk=512))
    want = ref_prefill_attention(*args)
    close(prefill_attention(*args, scheme="wide"), want, TOL["fp16"])
    assert torch.equal(prefill_attention(*args), prefill_attention(*args, scheme="wide"))    # the default here
    args[0] = args[0].to(torch.bfloat16)
    fin = finish_args(args[0].shape[0], 7 + layer)
    want = ref_prefill_attention(*args, rope=fin["rope"], out_dtype=torch.float32)
    out = prefill_attention(*args, scheme="wide", **fin)
    assert out.dtype == torch.bfloat16
    close(out.float(), want, TOL["bf16"])
    # raw queries normalised and rotated in the kernel (rows past fp16's range; a strided view)
    args[0] = raw_queries(args[0], 13 + layer)
    want = ref_prefill_attention(*args, rope=fin["rope"], out_dtype=torch.float32, q_norm=1e-6)
    out = prefill_attention(*args, scheme="wide", **fin, q_norm=1e-6)
    close(out.float(), want, TOL["bf16"])
    assert torch.equal(prefill_attention(*args, **fin, q_norm=1e-6), out)     # the default here


def test_prefill_attention_default_picks_wide_where_it_runs(monkeypatch):
    """The default scheme rule, on any machine: where the halves scheme would be the default and the
    wide kernel takes the call (`prefill_attention_wide.supported`, stubbed here), the wide scheme
    runs instead; an explicit scheme, a fused-kernel knob or a refusing `supported` keep theirs."""
    from dsv4.kernels.triton import prefill_attention as pa
    if pa.pw is None:
        pytest.skip("Gluon (Triton 3.6+) is not installed")
    calls = []

    def fake_wide(q, *a, **k):
        calls.append("wide")
        return torch.zeros(q.shape, dtype=k.get("out_dtype") or torch.float32)

    monkeypatch.setattr(pa.pw, "prefill_wide",
                        lambda q, sinks, rope, out_dtype, *a, **k: fake_wide(q, out_dtype=out_dtype))
    args = prefill_args("tiny", "fp8_ds", CSA, 4, ((0, 3),))
    # as on a GPU at 64 heads: the halves scheme unless a fused-kernel knob is given
    monkeypatch.setattr(pa, "_prefill_scheme", lambda heads, nch, prec, cuda, plain: "halves" if plain else "fused")
    monkeypatch.setattr(pa.pw, "supported", lambda *a: True)
    prefill_attention(*args)
    assert calls == ["wide"]
    prefill_attention(*args, scheme="halves")
    prefill_attention(*args, block_h=16)       # a fused-kernel knob: the fused kernel, as asked
    assert calls == ["wide"]
    monkeypatch.setattr(pa.pw, "supported", lambda *a: False)
    prefill_attention(*args)
    assert calls == ["wide"]
