"""Value-halves prefill attention: the decode halves scheme (`decode_attention_halves`) for every
new token of a prefill chunk, 64 heads and half of the value channels per program.

    grid (T * head blocks,), launched twice (half 0, then half 1): program (i, hb) of half c runs
    one online softmax over token i's key tiles (its window's tiles, then its entries' tiles),
    with logits s = q . K^T over all D channels as two dots of D/2 (its own half, which is also
    its value tile, and the other half) and acc [64, D/2] += p . V[:, half c]. Both halves
    compute the same logits, so each finishes its own columns: the sink, the inverse rotation
    (the rotated channels are all in the last half) and the output dtype, stored in place.

Against the fused prefill kernel (`prefill_attention`: 16 heads per program over all D channels)
each key tile is loaded and dequantised twice per token instead of four times, on one warpgroup
with 64-row tensor-core dots, and no [T, H, D] fp32 output makes a round trip for the layer's
inverse rotation. Window rows (bf16-exact formats: bf16) and pool entries (any main format)
come through one loop over one index space, as in the decode kernel (a loop per source made
ptxas keep the first loop's tensor-core descriptors and spill in the second); the source of a
tile is a uniform branch.

sm_90 compiles (Triton 3.6, ptxas): 32 keys x 4 warps 255 registers, no spill in the loop (CSA
1,290 / HCA 1,250 SASS instructions per 32-key tile, both sources' code counted); with positions
and entry counts in int64 the HCA loop spilled (80 LDL per tile). 64 keys spill (~200 LDL).

H200, an 8K chunk after 24K cached, fp8_ds, 64 heads, CUDA-graph replays (`benchmarks/tune_decode.py
--prefill-attention`), µs, fused -> halves: CSA 12,322 -> 4,681 (16 keys: 6,303), HCA 8,037 ->
3,020 (3,775); with the layer's inverse rotation and bf16 output (the fused kernel then hands over
to norm_rope): CSA 13,006 -> 4,633, HCA 8,699 -> 2,896. Since then the fused kernel reads its
window through `window_rows` too (one load per element instead of one per source): CSA 10,885,
HCA 6,586 against the halves' 4,650 / 3,009 in the same run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsv4.kernels.triton.decode_attention import with_sink
from dsv4.kernels.triton.decode_attention_halves import value_half_step
from dsv4.kernels.triton.decode_common import (
    CHUNK_MAJOR,
    dequant_entry_tile,
    inverse_rope,
    load_entry_tile,
    locate,
    note_compile,
    pdl_enter,
    pdl_launch,
)


@triton.jit
def window_rows(old_ptr, oldpos_ptr, new_ptr, b, i, t, p0, r0, window, ring, s_ob, s_or, s_opb, s_nt, c0,
                 D: tl.constexpr, NC: tl.constexpr, BLOCK_N: tl.constexpr):
    """Channels [c0 * 64, (c0 + NC) * 64) of window rows r0 .. r0 + BLOCK_N of token i, at positions
    p = t - W + 1 + r: p < p0 (the request's first new position) is ring row W - p0 + p of the old
    ring (gathered in position order before this step's writes, its stored position checked),
    p >= p0 is new row i - t + p of this step -> (rows [BLOCK_N, NC * 64] in their stored dtype,
    valid). Loaded as [rows, chunk, 64] in 8-element vectors, the layout `load_entry_tile` gives
    the pool's keys, so both sources of a halves key tile meet in one register layout."""
    r = r0 + tl.arange(0, BLOCK_N)
    p = t - window + 1 + r
    inside = (r < window) & (p >= 0)
    new = inside & (p >= p0)
    orow = ring - p0 + p
    maybe_old = inside & (p < p0) & (orow >= 0)
    opos = tl.load(oldpos_ptr + b * s_opb + orow, mask=maybe_old, other=-1)
    old = maybe_old & (opos == p)
    if CHUNK_MAJOR:     # as `load_entry_tile`: [chunk, rows, 64], then permuted
        d = (c0 + tl.arange(0, NC)[:, None, None]) * 64 + tl.arange(0, 64)[None, None, :]
    else:
        d = (c0 + tl.arange(0, NC)[None, :, None]) * 64 + tl.arange(0, 64)[None, None, :]
    d = tl.max_contiguous(d, [1, 1, 8])
    # one row pointer per key, from either source: one load per element
    rp = tl.where(new, new_ptr + (i - t + p).to(tl.int64) * s_nt, old_ptr + b * s_ob + orow.to(tl.int64) * s_or)
    if CHUNK_MAJOR:
        k = tl.permute(tl.load(rp[None, :, None] + d, mask=(new | old)[None, :, None] & (d < D), other=0.0), (1, 0, 2))
    else:
        k = tl.load(rp[:, None, None] + d, mask=(new | old)[:, None, None] & (d < D), other=0.0)
    return tl.reshape(k, [BLOCK_N, NC * 64]), new | old


@triton.jit
def _entry_rows(ckv_ptr, crope_ptr, csc_ptr, bt_row, idx_row, e0, n_c, epb, max_blocks, c0, s_ckp, s_ckr, s_crp,
                s_crr, s_csp, s_csr, FMT: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, NC: tl.constexpr,
                MODE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Channels [c0 * 64, (c0 + NC) * 64) of entries e0 .. e0 + BLOCK_N of the token's list (MODE 1:
    the selections idx_row[e], -1 masked; MODE 2: entry e itself, below n_c) -> (bf16, valid)."""
    e = e0 + tl.arange(0, BLOCK_N)
    if MODE == 1:
        w = tl.load(idx_row + e, mask=e < n_c, other=-1).to(tl.int32)
        ok = w >= 0
    else:
        w = e
        ok = e < n_c
    page, row = locate(bt_row, w, ok, epb, max_blocks)
    x, sb, rope = load_entry_tile(ckv_ptr, crope_ptr, csc_ptr, page, row, ok, c0, s_ckp, s_ckr, s_crp, s_crr,
                                  s_csp, s_csr, FMT, D, NOPE, NC)
    return dequant_entry_tile(x, sb, rope, c0, FMT, NOPE, NC, BLOCK_N).to(tl.bfloat16), ok


@triton.jit
def _prefill_halves_kernel(
        q_ptr, sinks_ptr, out_ptr, cos_ptr, sin_ptr, old_ptr, oldpos_ptr, new_ptr, pos_ptr, treq_ptr, cu_ptr,
        ckv_ptr, crope_ptr, csc_ptr, bt_ptr, idx_ptr,
        s_qt, s_qh, s_ot, s_oh, s_ob, s_or, s_opb, s_nt,
        s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, s_bt, s_idx,
        window, ring, epb, max_blocks, n_idx, ratio, qk_scale,
        H: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, HC: tl.constexpr,
        FMT: tl.constexpr, MODE: tl.constexpr, HALF: tl.constexpr, HALF_R: tl.constexpr, ROPE: tl.constexpr,
        BLOCK_N: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    """Program (i * head blocks + hb) of half HALF -> out[i, heads, HALF's HC * 64 channels], finished.
    MODE 0 SWA, 1 CSA (indices [T, K]), 2 HCA (the first (t + 1) // ratio entries)."""
    if HALF == 1 and PDL:
        gdc_launch_dependents()
    else:
        pdl_enter(PDL)
    n_hb = tl.cdiv(H, BLOCK_H)
    i = (tl.program_id(0) // n_hb).to(tl.int64)
    h = (tl.program_id(0) % n_hb) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    ca: tl.constexpr = HALF * HC            # this half's first 64-channel chunk, and the other's
    cb: tl.constexpr = (1 - HALF) * HC
    b = tl.load(treq_ptr + i).to(tl.int64)
    t = tl.load(pos_ptr + i).to(tl.int32)       # positions in int32: int64 entry indices spill (HCA)
    p0 = t - (i - tl.load(cu_ptr + b).to(tl.int64)).to(tl.int32)    # the request's first new position
    d = tl.arange(0, HC * 64)[None, :]
    qrow = q_ptr + i * s_qt + h[:, None] * s_qh
    qa = tl.load(qrow + ca * 64 + d, mask=hmask[:, None] & (ca * 64 + d < D), other=0.0).to(tl.bfloat16)
    qb = tl.load(qrow + cb * 64 + d, mask=hmask[:, None] & (cb * 64 + d < D), other=0.0).to(tl.bfloat16)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HC * 64], tl.float32)
    n_wt = tl.cdiv(window, BLOCK_N)
    if MODE == 2:
        n_c = (t + 1) // ratio
    elif MODE == 1:
        n_c = n_idx
    else:
        n_c = 0
    bt_row = bt_ptr + b * s_bt
    idx_row = idx_ptr + i * s_idx
    for tile in range(0, n_wt + tl.cdiv(n_c, BLOCK_N)):
        if tile < n_wt:
            ka, ok = window_rows(old_ptr, oldpos_ptr, new_ptr, b, i, t, p0, tile * BLOCK_N, window, ring, s_ob,
                                 s_or, s_opb, s_nt, ca, D, HC, BLOCK_N)
            kb, _ = window_rows(old_ptr, oldpos_ptr, new_ptr, b, i, t, p0, tile * BLOCK_N, window, ring, s_ob,
                                s_or, s_opb, s_nt, cb, D, HC, BLOCK_N)
            ka, kb = ka.to(tl.bfloat16), kb.to(tl.bfloat16)     # bf16 rows: no conversion
        else:
            e0 = (tile - n_wt) * BLOCK_N
            ka, ok = _entry_rows(ckv_ptr, crope_ptr, csc_ptr, bt_row, idx_row, e0, n_c, epb, max_blocks, ca, s_ckp,
                                 s_ckr, s_crp, s_crr, s_csp, s_csr, FMT, D, NOPE, HC, MODE, BLOCK_N)
            kb, _ = _entry_rows(ckv_ptr, crope_ptr, csc_ptr, bt_row, idx_row, e0, n_c, epb, max_blocks, cb, s_ckp,
                                s_ckr, s_crp, s_crr, s_csp, s_csr, FMT, D, NOPE, HC, MODE, BLOCK_N)
        m_i, l_i, acc = value_half_step(qa, qb, ka, kb, ok, m_i, l_i, acc, qk_scale, NATIVE)
    o = with_sink(acc, m_i, l_i, sinks_ptr, h, hmask)
    if ROPE and HALF == 1:      # the rotated channels are the trailing 2 HALF_R <= D / 2
        o = inverse_rope(o, i, ca * 64, cos_ptr, sin_ptr, BLOCK_H, HC * 64, D, HALF_R)
    tl.store(out_ptr + i * s_ot + h[:, None] * s_oh + ca * 64 + d, o.to(out_ptr.dtype.element_ty),
             mask=hmask[:, None] & (ca * 64 + d < D))
    if HALF == 1 and PDL:   # end only after half 0: the kernel after this one waits for this one
        gdc_wait()


def prefill_halves_tiles(cuda: bool) -> tuple[int, int]:
    """Default (BLOCK_N, num_warps): the decode halves kernel's (`halves_tiles`) on CUDA; 32 keys on
    the CPU interpreter too (whose time goes per operation, not per element)."""
    return 32, 4


def prefill_value_halves(q: torch.Tensor, sinks: torch.Tensor, out: torch.Tensor,
                         rope: tuple[torch.Tensor, torch.Tensor] | None, sources: tuple, geometry: tuple, *,
                         dim: int, nope: int, nch: int, fmt: int, mode: int, native: bool, block_n: int,
                         warps: int) -> None:
    """Launch both halves into out [T, H, D] (any float dtype): the finished attention output,
    RoPE_{-t} applied where rope = (cos, sin) [T, r/2] is given. sources (the tensors from old_kv
    to the indices) and geometry (their strides, then window .. qk_scale): as `prefill_attention`
    passes them to its fused kernel."""
    t_all, heads, _ = q.shape
    assert nch % 2 == 0, "two halves of 64-channel chunks"
    half_r = rope[0].shape[-1] if rope is not None else 0
    assert 2 * half_r <= nch * 32, "the rotated channels lie in the last half"
    cos, sin = (x.float().contiguous() for x in rope) if rope is not None else (out, out)
    block_h = min(64, max(16, triton.next_power_of_2(heads)))
    n_hb = triton.cdiv(heads, block_h)
    for half in (0, 1):
        k = _prefill_halves_kernel[(t_all * n_hb,)](
            q, sinks, out, cos, sin, *sources, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *geometry,
            H=heads, BLOCK_H=block_h, D=dim, NOPE=nope, HC=nch // 2, FMT=fmt, MODE=mode, HALF=half,
            HALF_R=half_r, ROPE=rope is not None, BLOCK_N=block_n, NATIVE=native, num_warps=warps,
            **({"num_stages": 1} if native else {}), **pdl_launch(q.device))
        note_compile(f"prefill_attention.half{half}", k)
