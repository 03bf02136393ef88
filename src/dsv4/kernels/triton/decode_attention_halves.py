"""Value-halves decode attention for many (request, head) pairs: 64 heads and half of the value
channels per program, one pass over the keys (the default from 4 requests of 64 heads, or one
with many entries; see `decode_attention._scheme`).

    grid (B * head blocks, 1, S), launched twice (half 0, then half 1): program (b, hb, split) of
    half c runs an online softmax over key tiles split, split + S, ... of one index space (the
    window ring's tiles, then the entries'), with logits s = q . K^T over all D channels as two
    dots of D/2 (its own half, which is also its value tile, and the other half) and
    acc [64, D/2] += p . V[:, half c]. Both halves compute the same logits; half 0 stores the
    split's softmax stats (m, l), each half its acc columns, and the split combine (`decode_combine`)
    adds the sink, the inverse rotation and the output dtype.

Why this shape (H200, Triton 3.6, sm_90 compiles with ptxas register counts):
- All 64 heads on one warpgroup (4 warps, 16 rows each) is the layout Triton gives two chained
  dots (q . K^T feeding p . V in one iteration: every warp along M). With 8 or 16 warps the
  warpgroups repeat the logits (`benchmarks/wide_attention_check.py`). The [64, D] accumulator
  does not fit one warpgroup at D 512; [64, 256] is 128 registers per thread.
- One loop over both key sources: with a loop for the ring and one for the entries, ptxas kept
  the tensor-core descriptors of the first loop in registers for the second, which then spilled.
- The half as a compile-time constant (two launches rather than a grid axis): the channel
  offsets and the rope masks fold (1,200 instead of 1,650 instructions per 32-key tile; the
  other half's copy of the loop, in one kernel, spilled as above).
- Two launches, one wave: programmatic dependent launch lets half 1 start while half 0 runs (it
  needs nothing from half 0: it is launched only once every half-0 program has passed its wait
  on the kernel before), and half 1 waits for half 0 before it ends, so the combine after it
  sees both. S = SMs // (B * head blocks): two 4-warp programs per SM (255 registers, 96 KB
  shared at 32 keys), one program of each half.
- No prefetch of the next tile's bytes: in registers it spills; an L2 prefetch
  (`prefetch.global.L2` per line or a bulk prefetch per row) measured slower.

Measured against the two-pass scheme (`decode_attention_2p`, the previous default) and the fused
kernel, V4-Flash shapes, 128K, CUDA-graph replays with the L2 flushed
(`benchmarks/attention_schemes.py`, µs, halves / two-pass / fused): B = 64 CSA 57.4 / 78.2 / 148.7,
HCA 72.8 / 105.5 / 247.5; B = 16 CSA 27.7 / 35.6 / 44.6, HCA 31.5 / 47.5 / 64.1; B = 8 CSA
23.3 / 33.8 / 28.4, HCA 25.0 / 44.4 / 41.3; B = 4 CSA 20.7 / 28.3 / 19.1, HCA 29.8 / 48.3 / 28.4.
Max error vs the fp32 reference 0.5-1.1e-3 of its largest output (two-pass 0.8-1.2e-3; all round
q and p to bf16 for the dots). Since: fp8_ds keys go to fp16 operands (`decode_common.key_operand`:
one conversion and one multiply a pair of elements instead of ~3 instructions an element; exact
keys while the scales lie in [2^-15, 2^7]), with q and p in fp16 too: 1,199 -> 1,024 SASS
instructions per 32-key tile, B = 64 CSA 58.4 -> 56.1 µs, HCA 77.6 -> 75.9 (H200; inside the
layer no faster), and the error ~3e-4 of the largest output instead of ~5e-3
(tests/test_triton_decode.py).

Static grids and buffer sizes, no host reads: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsv4.kernels.triton.decode_common import (
    as_operand,
    key_operand,
    load_entry_tile,
    locate,
    note_compile,
    pdl_enter,
    pdl_launch,
    sm_count,
)


@triton.jit
def _mm(a, b, NATIVE: tl.constexpr):
    """a @ b on bf16 operands with fp32 accumulation; the interpreter (whose bf16 dot is wrong)
    runs the same bf16-rounded operands through an fp32 dot."""
    if NATIVE:
        return tl.dot(a, b)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def value_half_step(qa, qb, ka, kb, ok, m_i, l_i, acc, qk_scale, NATIVE: tl.constexpr):
    """One key tile of a value-halves program: logits over all D channels as two dots of D/2 (ka,
    this half's keys, also the value tile; kb the other half's), masked by ok, then the online
    softmax step (log2 domain) -> (m_i, l_i, acc)."""
    s = (_mm(qa, tl.trans(ka), NATIVE) + _mm(qb, tl.trans(kb), NATIVE)) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)      # no key yet: keep exp2 finite
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _mm(p.to(ka.dtype), ka, NATIVE)
    return m_new, l_i, acc


@triton.jit
def _tile_idx(swa_pos_ptr, idx_ptr, b, s_pos, s_idx, slot, t, window, ring, n_comp, n_c, n_wt, tile,
              MODE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stage 1 of key tile `tile` (ring tiles [0, n_wt), then entry tiles): (ring row or entry
    index [BLOCK_N], valid). Tiles past the end come out all invalid."""
    win = tile < n_wt
    cw = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ce = cw - n_wt * BLOCK_N
    wpos = tl.load(swa_pos_ptr + slot * s_pos + cw, mask=cw < ring, other=-1)     # ring <= n_wt * BLOCK_N
    ok_w = (wpos >= 0) & (wpos <= t) & (wpos > t - window)     # ring rows with t - W < pos <= t
    if MODE == 1:
        we = tl.load(idx_ptr + b * s_idx + ce, mask=(ce >= 0) & (ce < n_comp), other=-1).to(tl.int32)
        ok_e = we >= 0
    else:
        we = ce
        ok_e = (ce >= 0) & (ce < n_c)
    return tl.where(win, cw, we), tl.where(win, ok_w, ok_e)


@triton.jit
def _tile_page(bt_row, w, ok, slot, epb, max_blocks, tile, n_wt, MODE: tl.constexpr):
    """Stage 2: (page int64, row) of each key; the ring's page is the request's slot."""
    if MODE == 0:   # no entries (and no block table to look in)
        return tl.zeros_like(w).to(tl.int64) + slot, w
    ent = w * 0 + tile >= n_wt      # a tensor: the interpreter masks with tensors only
    page, row = locate(bt_row, w, ok & ent, epb, max_blocks)
    return tl.where(ent, page, slot), tl.where(ent, row, w)


@triton.jit
def _tile_bytes(tile, n_wt, page, row, ok, c0, wkv_ptr, wrope_ptr, wsc_ptr, ckv_ptr, crope_ptr, csc_ptr,
                s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr,
                FMT: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, HC: tl.constexpr):
    """Stage 3: the stored bytes of channel chunks [c0, c0 + HC) of the tile's keys (ring or pool)."""
    win = tile < n_wt
    return load_entry_tile(tl.where(win, wkv_ptr, ckv_ptr), tl.where(win, wrope_ptr, crope_ptr),
                           tl.where(win, wsc_ptr, csc_ptr), page, row, ok, c0,
                           tl.where(win, s_wkp, s_ckp), tl.where(win, s_wkr, s_ckr), tl.where(win, s_wrp, s_crp),
                           tl.where(win, s_wrr, s_crr), tl.where(win, s_wsp, s_csp), tl.where(win, s_wsr, s_csr),
                           FMT, D, NOPE, HC)


@triton.jit
def _halves_kernel(
        q_ptr, part_ptr, pml_ptr,
        wkv_ptr, wrope_ptr, wsc_ptr, swa_pos_ptr, slots_ptr, pos_ptr,
        ckv_ptr, crope_ptr, csc_ptr, bt_ptr, idx_ptr, nent_ptr,
        s_qb, s_qh, s_pb, s_ps, s_ph,
        s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_pos,
        s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, s_bt, s_idx,
        ring, window, epb, max_blocks, n_comp, qk_scale,
        H: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, HC: tl.constexpr,
        FMT: tl.constexpr, MODE: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
        NATIVE: tl.constexpr, PDL: tl.constexpr):
    """Program (b * head blocks + hb, 0, split) of half HALF -> part[b, split, heads, HALF's HC * 64
    channels]; half 0 also (m, l) -> pml[b, split, heads]. Per iteration tile i's bytes load and
    compute while tile i + S's pages and tile i + 2S's indices are in flight."""
    if HALF == 1 and PDL:
        gdc_launch_dependents()
    else:
        pdl_enter(PDL)
    n_hb = tl.cdiv(H, BLOCK_H)
    b = tl.program_id(0) // n_hb
    h = (tl.program_id(0) % n_hb) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    n_split = tl.num_programs(2)
    ca: tl.constexpr = HALF * HC            # this half's first 64-channel chunk, and the other's
    cb: tl.constexpr = (1 - HALF) * HC
    hmask = h < H
    d = tl.arange(0, HC * 64)[None, :]
    qrow = q_ptr + b * s_qb + h[:, None] * s_qh
    qa = as_operand(tl.load(qrow + ca * 64 + d, mask=hmask[:, None] & (ca * 64 + d < D), other=0.0), FMT)
    qb = as_operand(tl.load(qrow + cb * 64 + d, mask=hmask[:, None] & (cb * 64 + d < D), other=0.0), FMT)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HC * 64], tl.float32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    t = tl.load(pos_ptr + b)
    n_wt = tl.cdiv(ring, BLOCK_N)
    if MODE == 2:
        n_c = tl.minimum(tl.load(nent_ptr + b), n_comp)     # ragged: stop at this request's end
    elif MODE == 1:
        n_c = n_comp
    else:
        n_c = 0
    bt_row = bt_ptr + b * s_bt
    w0, ok0 = _tile_idx(swa_pos_ptr, idx_ptr, b, s_pos, s_idx, slot, t, window, ring, n_comp, n_c, n_wt, split,
                        MODE, BLOCK_N)
    p0, r0 = _tile_page(bt_row, w0, ok0, slot, epb, max_blocks, split, n_wt, MODE)
    w1, ok1 = _tile_idx(swa_pos_ptr, idx_ptr, b, s_pos, s_idx, slot, t, window, ring, n_comp, n_c, n_wt,
                        split + n_split, MODE, BLOCK_N)
    for tile in range(split, n_wt + tl.cdiv(n_c, BLOCK_N), n_split):
        xa, sa, ra = _tile_bytes(tile, n_wt, p0, r0, ok0, ca, wkv_ptr, wrope_ptr, wsc_ptr, ckv_ptr, crope_ptr,
                                 csc_ptr, s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr,
                                 s_csp, s_csr, FMT, D, NOPE, HC)
        xb, sb, rb = _tile_bytes(tile, n_wt, p0, r0, ok0, cb, wkv_ptr, wrope_ptr, wsc_ptr, ckv_ptr, crope_ptr,
                                 csc_ptr, s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr,
                                 s_csp, s_csr, FMT, D, NOPE, HC)
        p1, r1 = _tile_page(bt_row, w1, ok1, slot, epb, max_blocks, tile + n_split, n_wt, MODE)
        w2, ok2 = _tile_idx(swa_pos_ptr, idx_ptr, b, s_pos, s_idx, slot, t, window, ring, n_comp, n_c, n_wt,
                            tile + 2 * n_split, MODE, BLOCK_N)
        ka = key_operand(xa, sa, ra, ca, FMT, NOPE, HC, BLOCK_N)
        kb = key_operand(xb, sb, rb, cb, FMT, NOPE, HC, BLOCK_N)
        m_i, l_i, acc = value_half_step(qa, qb, ka, kb, ok0, m_i, l_i, acc, qk_scale, NATIVE)
        p0, r0, ok0 = p1, r1, ok1
        w1, ok1 = w2, ok2
    tl.store(part_ptr + b * s_pb + split * s_ps + h[:, None] * s_ph + ca * 64 + d, acc, mask=hmask[:, None])
    if HALF == 0:
        ml = pml_ptr + ((b * n_split + split) * H + h) * 2
        tl.store(ml, m_i, mask=hmask)
        tl.store(ml + 1, l_i, mask=hmask)
    if HALF == 1 and PDL:   # end only after half 0: the kernel after this one waits for this one
        gdc_wait()


def halves_tiles(cuda: bool) -> tuple[int, int]:
    """Default (BLOCK_N, num_warps). sm_90, D 512: 32 keys x 4 warps 255 registers with 12 spilled
    (outside the loop's hot path), 96 KB shared; 16 keys no spills but slower (B = 64 CSA 62.6 vs
    55.3 µs, HCA 93.1 vs 74.1); 64 keys spill in the loop (120-165 spills)."""
    return (32, 4) if cuda else (16, 4)


#: a request with this many compressed keys is long (HCA at 1M: 8,192 entries); `decode_attention`
#: takes the halves scheme for it at any batch
LONG_KEYS = 4096
#: a long request's splits keep at least this many key tiles each, else half a wave of splits
HALF_WAVE_TILES = 4


def default_splits(sms: int, rows: int, tiles: int, n_comp: int) -> int:
    """Key splits per (request, head block) for `rows` of them: one wave (a program of each half
    per SM), or half a wave (one program per SM) where a long request's tiles would leave each split
    fewer than HALF_WAVE_TILES: each split's partials (H x D fp32, 128 KB for 64 heads x 512) then
    outweigh its keys (~21 KB a 32-key tile of fp8_ds) and the combine reading them sets the time.

    H200, HCA, the op with its combine (`tune_decode.py --only attention`), µs by splits: 1M B = 1
    (260 tiles) 132 37.6, 88 30.6, **66 29.7**, 44 33.0, 33 35.6; 512K B = 2 (132 tiles) 66 31.2,
    44 28.1, **33 26.0**, 20 32.6; 1M B = 2 66 38.4, **33 36.7**; but 1M B = 4 **33 47.8**, 16
    62.3, 66 66.7 (8 tiles a split) and 128K B = 16 **8 35.6**, 4 39.4. Short requests keep the
    wave: CSA 128K B = 4 (20 tiles) 19.5 at 20 splits, 21.0 at 16."""
    splits = max(1, sms // rows)
    if n_comp >= LONG_KEYS and tiles < HALF_WAVE_TILES * splits:
        splits = max(1, splits // 2)
    return splits


def value_halves(q: torch.Tensor, keys: tuple, meta: tuple, strides: tuple, ring: int, window: int, epb: int,
                 max_blocks: int, n_comp: int, qk_scale: float, *, dim: int, nope: int, nch: int, fmt: int, mode: int,
                 native: bool, block_n: int, warps: int, splits: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch both halves; returns (part [B, S, H, nch * 64] fp32, pml [B, S, H, 2]) for the split
    combine. keys, meta, strides as `decode_attention_2p.two_pass`; q [B, H, D] (read as bf16).
    splits: key splits per (request, head block); default `default_splits`."""
    bsz, heads, _ = q.shape
    assert nch % 2 == 0, "two halves of 64-channel chunks"
    block_h = min(64, max(16, triton.next_power_of_2(heads)))
    n_hb = triton.cdiv(heads, block_h)
    tiles = triton.cdiv(ring, block_n) + triton.cdiv(n_comp, block_n)
    if splits is None:
        splits = default_splits(sm_count(q.device), bsz * n_hb, tiles, n_comp) if native else 2
    splits = max(1, min(splits, tiles))
    part = torch.empty(bsz, splits, heads, nch * 64, dtype=torch.float32, device=q.device)
    pml = torch.empty(bsz, splits, heads, 2, dtype=torch.float32, device=q.device)
    wkv, wrope, wsc, ckv, crope, csc = keys
    for half in (0, 1):
        k = _halves_kernel[(bsz * n_hb, 1, splits)](
            q, part, pml, wkv, wrope, wsc, *meta[:3], ckv, crope, csc, *meta[3:],
            q.stride(0), q.stride(1), part.stride(0), part.stride(1), part.stride(2), *strides,
            ring, window, epb, max_blocks, n_comp, qk_scale,
            H=heads, BLOCK_H=block_h, D=dim, NOPE=nope, HC=nch // 2, FMT=fmt, MODE=mode, HALF=half,
            BLOCK_N=block_n, NATIVE=native, num_warps=warps, **({"num_stages": 1} if native else {}),
            **pdl_launch(q.device))
        note_compile(f"decode_attention.half{half}", k)
    return part, pml
