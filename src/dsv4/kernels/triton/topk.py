"""Triton twin of `reference.decode.topk_smaller_index`: exact per-row top-k by radix select.

Same result as the reference, element for element: the k largest scores of each row in
descending order, ties to the smaller index, -1 where the picked score is -inf (and past the
row's N columns when N < k). The order is the reference's packed int64 order, so the result is
identical, not just the same set.

One program per row (grid B), four phases over the row's N scores:

    keys      fp32 -> the reference's order-preserving int32 key (bits, or bits ^ 0x7FFFFFFF
              for negative floats); its digits are taken with the sign bit flipped, so they
              order as unsigned numbers
    select    seven histogram passes over 5, 5, 5, 5, 5, 5, 2 bits of the key (most significant
              first): each counts the keys that match the threshold's bits found so far and
              picks the digit of the k-th largest; 32 bins keep tl.histogram cheap (its cost
              grows with the bin count). Result: the exact key T of the k-th largest score and
              how many keys equal to T to take (the smallest indices among them)
    collect   one pass: keys > T, and the first `need` keys == T in index order, are written
              (as indices) into the output row at prefix-sum positions: exactly min(k, N)
    sort      the min(k, N) picks are reloaded, packed (key << 32 | 2^31 - 1 - index) as the
              reference does, sorted descending by tl.sort, unpacked and written

Rows up to BLOCK scores are loaded once and kept in registers across the passes; longer rows are
re-read per pass (from L2 while they fit). No host reads, fixed grid: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.errors import InputError

_NEG_INF_KEY = -2139095041          # the key of -inf: 0xFF800000 ^ 0x7FFFFFFF as int32


@triton.jit
def _keys(x):
    """fp32 -> the reference's order-preserving int32 key."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _digit_hist(key, valid, thr, P: tl.constexpr, SHIFT: tl.constexpr, WIDTH: tl.constexpr):
    """Histogram [32] of digit P (bits SHIFT .. SHIFT+WIDTH of the unsigned key) over the valid keys
    whose higher bits equal thr's. Excluded keys are counted in bin 0, then subtracted."""
    if P == 0:
        match = valid
        dig = ((key >> SHIFT) & 31) ^ 16                      # the sign bit flipped: unsigned order
    else:
        hi: tl.constexpr = SHIFT + WIDTH
        match = valid & ((key >> hi) == (thr >> hi))
        dig = (key >> SHIFT) & ((1 << WIDTH) - 1)
    dig = tl.where(match, dig, 0)
    h = tl.histogram(dig, 32)
    excluded = tl.sum((match == 0).to(tl.int32), 0)
    return h - tl.where(tl.arange(0, 32) == 0, excluded, 0)


@triton.jit
def _pick_digit(h, need, thr, P: tl.constexpr, SHIFT: tl.constexpr):
    """The digit d holding the need-th largest matching key: thr gets d, need drops by the count above d."""
    b = tl.arange(0, 32)
    suffix = tl.sum(h, 0) - tl.cumsum(h, 0) + h                # keys with digit >= b
    d = tl.sum((suffix >= need).to(tl.int32), 0) - 1
    need = need - tl.sum(tl.where(b > d, h, 0), 0)
    if P == 0:
        thr = thr | ((d ^ 16) << SHIFT)
    else:
        thr = thr | (d << SHIFT)
    return thr, need


@triton.jit
def _topk_kernel(s_ptr, out_ptr, s_row, o_row, N, K,
                 BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, K_PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    row = s_ptr + b * s_row
    orow = out_ptr + b * o_row
    kk = tl.minimum(K, N)
    offs = tl.arange(0, BLOCK)
    key = tl.zeros([BLOCK], tl.int32)
    valid = offs < N
    if ONE_BLOCK:
        key = _keys(tl.load(row + offs, mask=valid, other=0.0))

    # ---- select: the exact key of the kk-th largest, 32 bits in 7 digits
    thr = tl.zeros([], tl.int32)
    need = kk
    for p in tl.static_range(7):
        shift: tl.constexpr = 27 - 5 * p if p < 6 else 0
        width: tl.constexpr = 5 if p < 6 else 2
        if ONE_BLOCK:
            h = _digit_hist(key, valid, thr, p, shift, width)
        else:
            h = tl.zeros([32], tl.int32)
            for start in range(0, N, BLOCK):
                o = start + offs
                m = o < N
                h += _digit_hist(_keys(tl.load(row + o, mask=m, other=0.0)), m, thr, p, shift, width)
        thr, need = _pick_digit(h, need, thr, p, shift)

    # ---- collect: keys > thr, then the first `need` keys == thr by index, at prefix-sum positions
    taken = tl.zeros([], tl.int32)
    eq_seen = tl.zeros([], tl.int32)
    for start in range(0, N, BLOCK):
        o = start + offs
        m = o < N
        if ONE_BLOCK:
            k = key
        else:
            k = _keys(tl.load(row + o, mask=m, other=0.0))
        eq = (m & (k == thr)).to(tl.int32)
        take = (m & (k > thr)) | ((eq == 1) & (eq_seen + tl.cumsum(eq, 0) <= need))
        t = take.to(tl.int32)
        tl.store(orow + taken + tl.cumsum(t, 0) - 1, o.to(tl.int64), mask=take)
        taken += tl.sum(t, 0)
        eq_seen += tl.sum(eq, 0)
    tl.debug_barrier()          # the picks written by every thread, before any thread reloads them

    # ---- sort the picks in the reference's packed order, descending
    j = tl.arange(0, K_PAD)
    jm = j < kk
    idx = tl.load(orow + j, mask=jm, other=0)
    pk = _keys(tl.load(row + idx, mask=jm, other=0.0))
    packed = (pk.to(tl.int64) << 32) | (2147483647 - idx)
    packed = tl.where(jm, packed, -9223372036854775807 - 1)
    packed = tl.sort(packed, descending=True)
    sk = (packed >> 32).to(tl.int32)
    si = 2147483647 - (packed & 0xFFFFFFFF)
    res = tl.where((j < kk) & (sk != -2139095041), si, -1)
    tl.store(orow + j, res, mask=j < K)


def topk_smaller_index(scores: torch.Tensor, k: int, *, block: int | None = None,
                       num_warps: int | None = None) -> torch.Tensor:
    """[B, N] fp32 -> [B, k] int64 top-k indices, ties to the smaller index, -1 where the score is -inf.

    block, num_warps: scores per pass block (rows up to `block` stay in registers) and warps (tuning).
    """
    if scores.dim() != 2:
        raise InputError(f"scores must be [B, N], got {list(scores.shape)}")
    bsz, n = scores.shape
    out = torch.empty(bsz, k, dtype=torch.int64, device=scores.device)
    if bsz == 0 or k == 0:
        return out
    if n == 0:
        return out.fill_(-1)
    scores = scores.float().contiguous()
    cuda = scores.device.type == "cuda"
    blk = block or min(triton.next_power_of_2(n), 16384 if cuda else 1024)
    warps = num_warps or (16 if blk >= 8192 else 8) if cuda else 4
    _topk_kernel[(bsz,)](scores, out, scores.stride(0), out.stride(0), n, k,
                         BLOCK=blk, ONE_BLOCK=n <= blk, K_PAD=triton.next_power_of_2(k), num_warps=warps)
    return out


__all__ = ["topk_smaller_index"]
