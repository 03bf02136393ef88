"""Triton twin of `reference.decode.topk_smaller_index`: exact per-row top-k by radix select.

Same result as the reference, element for element: the k largest scores of each row in
descending order, ties to the smaller index, -1 where the picked score is -inf (and past the
row's N columns when N < k). The order is the reference's packed int64 order, so the result is
identical, not just the same set.

One program per row (grid B), four phases over the row's N scores:

    keys      fp32 -> the reference's order-preserving int32 key (bits, or bits ^ 0x7FFFFFFF
              for negative floats), held as uint32 with the sign bit flipped so that unsigned
              order is the key's order and digits are plain bit fields
    select    histogram passes over 5-bit digits of the key, most significant first (32 bins keep
              tl.histogram cheap: its cost grows with the bin count); keys not sharing the bits
              chosen so far are masked out of the histogram. Each pass picks the digit of the
              k-th largest and how many keys with that prefix are still to take; it stops as soon
              as all keys of the chosen digit are taken (all 7 passes only when keys near the
              k-th tie), leaving a threshold prefix T and a count `need`
    collect   one pass: keys whose prefix is above T, and the first `need` keys whose prefix equals
              T in index order, are written (as indices) into the output row at their slots,
              found by one scan of (above << 16 | equal) counts over a [rows, 8] tile (the scan
              runs along each thread's row, then over the row totals): exactly min(k, N)
    sort      the min(k, N) picks are reloaded, packed (key << 32 | 2^31 - 1 - index) as the
              reference does, sorted descending by tl.sort, unpacked and written

Rows longer than 2 x 4096 run in two stages (grid B x chunks, then B): each chunk's picks (in
index order, unsorted) and a lower bound of its k-th key, then the picks among all chunks' picks,
whose select starts below the bits shared by the largest chunk bound and the largest candidate
(see topk_smaller_index).

Rows up to BLOCK scores are loaded once and kept in registers across the passes; longer rows are
re-read per pass (from L2 while they fit). No host reads, fixed grid: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.errors import InputError
from dsv4.kernels.triton.decode_common import pdl_enter, pdl_launch, sm_count

_NEG_INF_KEY = -2139095041          # the key of -inf: 0xFF800000 ^ 0x7FFFFFFF as int32


@triton.jit
def _keys(x):
    """fp32 -> the reference's order-preserving int32 key."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _ukeys(x):
    """fp32 -> the reference's key with its sign bit flipped, as uint32: unsigned order is the key's
    order, and digits are plain bit fields (shifts are logical)."""
    return (_keys(x) ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _load(row, irow, o, m, INDIRECT: tl.constexpr):
    """Elements o of the program's row -> (unsigned keys, original indices): scores[o], or scores[cand[o]]."""
    if INDIRECT:
        idx = tl.load(irow + o, mask=m, other=0)
    else:
        idx = o.to(tl.int64)
    return _ukeys(tl.load(row + idx, mask=m, other=0.0)), idx


@triton.jit
def _digit_hist(key, valid, thr, hi, shift, NBINS: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram [NBINS] of bits shift .. hi of the valid keys ([BLOCK // ROW, ROW]) whose bits above
    hi equal thr's."""
    match = valid & ((((key ^ thr) >> (hi - 1).to(tl.uint32)) >> 1) == 0)     # two shifts: hi may be 32
    dig = ((key >> shift.to(tl.uint32)) & (NBINS - 1)).to(tl.int32)
    return tl.histogram(tl.reshape(dig, [BLOCK]), NBINS,
                        mask=tl.reshape(match, [BLOCK]))


@triton.jit
def _topk_kernel(s_ptr, i_ptr, out_ptr, lb_ptr, s_row, i_row, o_row, N, K, CHUNK, NB,
                 BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, K_PAD: tl.constexpr, INDIRECT: tl.constexpr,
                 FINAL: tl.constexpr, DIGIT: tl.constexpr, ROW: tl.constexpr, BOUNDS: tl.constexpr,
                 PDL: tl.constexpr):
    """Program (b, g): the top-min(K, n) of elements [g*CHUNK, g*CHUNK + n) of row b (n <= CHUNK),
    written sorted to out[b, g*K : g*K + K]. Elements are scores[b, j] (INDIRECT: scores[b, cand[b, j]],
    whose original index cand[b, j] is the one compared and written). FINAL: sorted, -1 for -inf picks
    and pads; else the picks in index order (a first stage). A block of elements is a [BLOCK // ROW, ROW]
    tile, ROW consecutive elements per row: the collect's scan runs along the rows in registers, then
    over the row totals. PDL: see `pdl_enter`."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    row = s_ptr + b * s_row
    irow = i_ptr + b * i_row + g * CHUNK
    orow = out_ptr + b * o_row + g * K
    if not INDIRECT:
        row_e = row + g * CHUNK               # element j of the program is scores[b, g*CHUNK + j]
    else:
        row_e = row
    n = tl.minimum(N - g * CHUNK, CHUNK)
    kk = tl.minimum(K, n)
    offs = tl.arange(0, BLOCK // ROW)[:, None] * ROW + tl.arange(0, ROW)[None, :]
    valid = offs < n
    key = tl.zeros([BLOCK // ROW, ROW], tl.uint32)
    if ONE_BLOCK:
        key, _ = _load(row_e, irow, offs, valid, INDIRECT)

    # ---- select, most significant digit first: thr collects the kk-th largest key's digits, need
    # counts how many keys sharing thr's bits above `hi` are still to take. It stops once every key
    # of the chosen digit is taken (need == its count): the keys are then split by their bits above
    # hi alone (all 7 passes only when keys near the k-th tie)
    NBINS: tl.constexpr = 1 << DIGIT
    bins = tl.arange(0, NBINS)
    thr = tl.zeros([], tl.uint32)
    need = kk
    hi = tl.full([], 32, tl.int32)
    if INDIRECT and ONE_BLOCK and BOUNDS > 0:
        # The first stage's chunks with K picks each bound the k-th largest key from below (K keys
        # of the row are at least their threshold); the largest candidate bounds it from above.
        # The bits the two bounds share are the k-th key's, and no candidate lies above them: the
        # select starts below them with nothing taken yet
        c = tl.arange(0, BOUNDS)
        lo = tl.max(tl.load(lb_ptr + b * NB + c, mask=c < NB, other=0).to(tl.uint32, bitcast=True), 0)
        top = tl.max(tl.max(tl.where(valid, key, 0), 1), 0)
        diff = lo ^ top
        # bits below and at diff's highest set bit: from its float exponent, which may round up
        # (hi one too high is still correct)
        hi = tl.where(diff == 0, 0, ((diff.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126)
        hi = tl.minimum(hi, 32)
        hs = (tl.maximum(hi, 1) - 1).to(tl.uint32)
        thr = tl.where(hi == 0, top, (((top >> hs) >> 1) << hs) << 1)
    go = (need > 0) & (hi > 0)
    while go:
        shift = tl.maximum(hi - DIGIT, 0)
        if ONE_BLOCK:
            h = _digit_hist(key, valid, thr, hi, shift, NBINS, BLOCK)
        else:
            h = tl.zeros([NBINS], tl.int32)
            for start in range(0, n, BLOCK):
                o = start + offs
                m = o < n
                k, _ = _load(row_e, irow, o, m, INDIRECT)
                h += _digit_hist(k, m, thr, hi, shift, NBINS, BLOCK)
        suffix = tl.sum(h, 0) - tl.cumsum(h, 0) + h                # keys with digit >= bin
        d = tl.sum((suffix >= need).to(tl.int32), 0) - 1
        need = need - tl.sum(tl.where(bins > d, h, 0), 0)
        thr = thr | (d.to(tl.uint32) << shift.to(tl.uint32))
        go = (shift > 0) & (tl.sum(tl.where(bins == d, h, 0), 0) > need)
        hi = shift
    if BOUNDS > 0 and not INDIRECT:     # a first stage's bound for the second (0: none, the least key)
        tl.store(lb_ptr + b * NB + g, tl.where(kk == K, thr, 0).to(tl.int32, bitcast=True))

    # ---- collect: keys above thr (bits above hi), then the first `need` keys equal to it by position.
    # One scan of (above << 16 | equal) places both: a pick's slot is the keys above before it plus
    # the equal ones taken before it (positions follow the original indices: rows directly,
    # candidates chunk by chunk in that order; counts < 2^16 as BLOCK <= 32768)
    t_hi = thr >> hi.to(tl.uint32)
    gt_seen = tl.zeros([], tl.int32)
    eq_seen = tl.zeros([], tl.int32)
    for start in range(0, n, BLOCK):
        o = start + offs
        m = o < n
        if ONE_BLOCK:
            k = key
            if INDIRECT:
                idx = tl.load(irow + o, mask=m, other=0)
            else:
                idx = o.to(tl.int64)
        else:
            k, idx = _load(row_e, irow, o, m, INDIRECT)
        if not INDIRECT:
            idx = idx + g * CHUNK
        k_hi = k >> hi.to(tl.uint32)
        gt = (m & (k_hi > t_hi)).to(tl.int32)
        eq = (m & (k_hi == t_hi)).to(tl.int32)
        v = (gt << 16) | eq
        row_tot = tl.sum(v, 1)
        before = (tl.cumsum(row_tot, 0) - row_tot)[:, None] + tl.cumsum(v, 1) - v
        eq_before = eq_seen + (before & 0xFFFF)
        take = (gt == 1) | ((eq == 1) & (eq_before < need))
        slot = gt_seen + (before >> 16) + tl.minimum(eq_before, need)
        tl.store(orow + slot, idx, mask=take)
        tot = tl.sum(row_tot, 0)
        gt_seen += tot >> 16
        eq_seen += tot & 0xFFFF

    # ---- sort the picks in the reference's packed order, descending (FINAL only: a first stage's picks
    # stay in index order, which is what the second stage's tie rule needs)
    if FINAL:
        tl.debug_barrier()      # the picks written by every thread, before any thread reloads them
        j = tl.arange(0, K_PAD)
        jm = j < kk
        idx = tl.load(orow + j, mask=jm, other=0)
        pk = _keys(tl.load(row + idx, mask=jm, other=0.0))
        packed = (pk.to(tl.int64) << 32) | (2147483647 - idx)
        packed = tl.where(jm, packed, -9223372036854775807 - 1)
        packed = tl.sort(packed, descending=True)
        sk = (packed >> 32).to(tl.int32)
        si = 2147483647 - (packed & 0xFFFFFFFF)
        si = tl.where((j < kk) & (sk != -2139095041), si, -1)
        tl.debug_barrier()      # every thread has read the picks before any overwrites them
        tl.store(orow + j, si, mask=j < K)


def topk_smaller_index(scores: torch.Tensor, k: int, *, block: int | None = None, num_warps: int | None = None,
                       chunk: int | None = None, digit: int | None = None) -> torch.Tensor:
    """[B, N] fp32 -> [B, k] int64 top-k indices, ties to the smaller index, -1 where the score is -inf.

    Long rows run in two stages: chunks of `chunk` scores each give their exact top-k (grid B x chunks,
    the whole GPU busy even at B = 1), then the top-k of those candidates (every global pick is among
    its chunk's picks; candidates keep index order chunk by chunk, so ties still go to the smaller
    index). block, num_warps, chunk, digit (bits per select pass): tuning (chunk 0 = always one stage).
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
    if chunk is None:      # CUDA: >= 4096 per chunk, at most 32 chunks (the second stage fits one block)
        ch = max(DEFAULT_CHUNK, triton.next_power_of_2(triton.cdiv(n, 32))) if cuda else 0
    else:
        ch = chunk
    if ch and n > 2 * ch and ch >= k:
        g = triton.cdiv(n, ch)
        cand = torch.empty(bsz, g * k, dtype=torch.int64, device=scores.device)
        bounds = torch.empty(bsz, g, dtype=torch.int32, device=scores.device)     # each chunk's k-th, from below
        _launch(scores, scores, cand, bounds, n, k, ch, g, False, False, block, num_warps, cuda, digit)
        n2 = (g - 1) * k + min(k, n - (g - 1) * ch)             # only the last chunk can be short
        _launch(scores, cand, out, bounds, n2, k, n2, 1, True, True, block, num_warps, cuda, digit)
    else:
        _launch(scores, scores, out, None, n, k, n, 1, False, True, block, num_warps, cuda, digit)
    return out


#: chunk length of the first stage on CUDA (rows longer than twice this run in two stages)
DEFAULT_CHUNK = 4096
#: bits per select pass (2^DIGIT histogram bins; at most 32 / DIGIT passes, rounded up)
DIGIT = 5


def _launch(scores: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, bounds: torch.Tensor | None, n: int, k: int,
            chunk: int, groups: int, indirect: bool, final: bool, block: int | None, num_warps: int | None,
            cuda: bool, digit: int | None) -> None:
    """bounds [B, chunks] int32: a first stage writes each chunk's lower bound of the k-th key there,
    the second stage reads them (None: one stage)."""
    blk = block or min(triton.next_power_of_2(chunk), 16384 if cuda else 1024)
    assert blk <= 32768, "the collect packs two counts of one block into an int32"
    if num_warps:
        warps = num_warps
    elif not cuda:
        warps = 4
    else:   # few programs (small batch): latency-bound, more warps each; many: 8 warps share the SMs
        few = scores.shape[0] * groups < sm_count(scores.device)
        warps = 16 if blk >= 8192 or few else 8
    nb = bounds.shape[1] if bounds is not None else 0
    _topk_kernel[(scores.shape[0], groups)](
        scores, idx, out, bounds if bounds is not None else out, scores.stride(0), idx.stride(0), out.stride(0),
        n, k, chunk, nb, BLOCK=blk, ONE_BLOCK=chunk <= blk, K_PAD=triton.next_power_of_2(k), INDIRECT=indirect,
        FINAL=final, DIGIT=digit or DIGIT, ROW=min(8, blk), BOUNDS=triton.next_power_of_2(nb) if nb else 0,
        num_warps=warps, **pdl_launch(scores.device))


__all__ = ["topk_smaller_index"]
