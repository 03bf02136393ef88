"""Triton twin of `reference.decode.topk_smaller_index`: exact per-row top-k by radix select.

Same result as the reference, element for element: the k largest scores of each row in
descending order, ties to the smaller index, -1 where the picked score is -inf (and past the
row's N columns when N < k). The order is the reference's packed int64 order, so the result is
identical, not just the same set. order="index" (the decode step's, `decode_indexer_topk`): the same
picks above -inf by ascending index, then -1; the filter's select then skips its final sort, since its
collect writes the picks in index order already (H100, CSA B = 64 128K cache-side 160.3 -> 154.5 µs:
benchmarks/NOTES.md, forty-third round).

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

Long rows take one of two paths before the final select:

    filter       (on CUDA, rows of more than FILTER_MIN_SCORES) grid B x P, a program per
                 4096-score chunk of a row:
                 `_group_max_kernel` finds the maxima of 4k / P groups of its chunk, and the row's
                 last program to finish bounds the row's k-th score from below by the k-th largest
                 of the row's 4k maxima; then `_filter_kernel` keeps its chunk's scores at or above
                 the bound (about 1.15 k a row on random rows) as candidates, each stored with its
                 key, and `_filtered_select_kernel` (a program a row) runs the select over them,
                 started below the bits shared by the bound and the largest candidate
                 (benchmarks/NOTES.md, twenty-fourth and twenty-sixth rounds; the select in a kernel
                 of its own and the candidates' keys stored, forty-fourth round: the filter's
                 programs fit four an SM, H100, CSA B = 64 cache-side 1M 839.7 -> 757.7 µs).
                 With the maxima handed in (`group_max`: the TMA indexer scan's row slots,
                 `decode.decode_indexer_topk`) `_bound_kernel` finds the bound from them, a program
                 a row, and the maxima pass over the scores goes (H100, B = 64, indexer 128K
                 118.8 -> 116.7 µs, 1M 810 -> 796; thirty-sixth round)
    two stages   (with `chunk`) grid B x chunks: each chunk's exact picks (in index order,
                 unsorted) and a lower bound of its k-th key; then grid B: the picks among all
                 chunks' picks, whose select starts below the bits shared by the largest chunk
                 bound and the largest candidate

The first block of BLOCK elements is loaded once and kept in registers across the passes (all of
the row when it fits); later blocks are re-read per pass (from L2 while they fit). No host reads,
fixed grid: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.errors import InputError
from dsv4.kernels.reference.decode import TOPK_ORDERS
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
def _seg_offsets(o, cnt_row, CH, SEGS: tl.constexpr, CM: tl.constexpr):
    """Positions o among the candidates of SEGS segments of CH slots (`_filter_kernel`'s: segment s
    holds cnt[s] of them) -> their offsets in the segmented buffer: o plus the unused slots
    (CH - cnt[s]) of every segment that ends at or before o."""
    if SEGS == 1:
        return o
    add = tl.zeros_like(o)
    incl = tl.zeros([], tl.int32)
    for s in tl.static_range(SEGS - 1):
        c = tl.load(cnt_row + s, cache_modifier=CM)
        incl += c
        add += tl.where(o >= incl, CH - c, 0)
    return o + add


@triton.jit
def _load(row, irow, o, m, INDIRECT: tl.constexpr, cnt_row, CH, SEGS: tl.constexpr, CM: tl.constexpr,
          PACKED: tl.constexpr):
    """Elements o of the program's row -> (unsigned keys, original indices): scores[o], or scores[cand[o]]
    (cand in SEGS segments of CH slots: `_seg_offsets`); PACKED: cand[o] holds key << 32 | index
    (`_filter_kernel`'s candidates: no gather from the scores)."""
    if INDIRECT:
        idx = tl.load(irow + _seg_offsets(o, cnt_row, CH, SEGS, CM), mask=m, other=0, cache_modifier=CM)
        if PACKED:
            return (idx >> 32).to(tl.int32).to(tl.uint32, bitcast=True), idx.to(tl.int32).to(tl.int64)
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
def _select_step(h, bins, need, thr, shift):
    """One select pass from its digit histogram h: the digit d holding the need-th largest of the keys
    still in play, how many keys above thr | d are still to take, thr with d in place, and whether
    another pass is needed (the keys of digit d are more than those still to take)."""
    suffix = tl.sum(h, 0) - tl.cumsum(h, 0) + h                # keys with digit >= bin
    d = tl.sum((suffix >= need).to(tl.int32), 0) - 1
    need = need - tl.sum(tl.where(bins > d, h, 0), 0)
    thr = thr | (d.to(tl.uint32) << shift.to(tl.uint32))
    go = (shift > 0) & (tl.sum(tl.where(bins == d, h, 0), 0) > need)
    return need, thr, go


@triton.jit
def _collect_block(orow, k, idx, m, t_hi, hi, need, gt_seen, eq_seen):
    """One block of the collect: its keys above thr (bits above hi) and its first keys equal to it
    (while fewer than `need` are taken) written as indices at their slots in the output row. One scan
    of (above << 16 | equal) over the [rows, ROW] block places both kinds (counts < 2^16: blocks of
    at most 32768)."""
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
    return gt_seen + (tot >> 16), eq_seen + (tot & 0xFFFF)


@triton.jit
def _topk_kernel(s_ptr, i_ptr, out_ptr, lb_ptr, cnt_ptr, s_row, i_row, o_row, N, K, CHUNK, NB,
                 BLOCK: tl.constexpr, K_PAD: tl.constexpr, INDIRECT: tl.constexpr, FINAL: tl.constexpr,
                 FILTERED: tl.constexpr, DIGIT: tl.constexpr, ROW: tl.constexpr, BOUNDS: tl.constexpr,
                 SEGS: tl.constexpr, ORDER: tl.constexpr, PDL: tl.constexpr):
    """Program (b, g): `_topk_row` of row b, chunk g. PDL: see `pdl_enter`."""
    pdl_enter(PDL)
    _topk_row(tl.program_id(0).to(tl.int64), tl.program_id(1), s_ptr, i_ptr, out_ptr, lb_ptr, cnt_ptr, s_row, i_row,
              o_row, N, K, CHUNK, NB, BLOCK, K_PAD, INDIRECT, FINAL, FILTERED, DIGIT, ROW, BOUNDS, SEGS, "", ORDER)


@triton.jit
def _topk_row(b, g, s_ptr, i_ptr, out_ptr, lb_ptr, cnt_ptr, s_row, i_row, o_row, N, K, CHUNK, NB,
              BLOCK: tl.constexpr, K_PAD: tl.constexpr, INDIRECT: tl.constexpr, FINAL: tl.constexpr,
              FILTERED: tl.constexpr, DIGIT: tl.constexpr, ROW: tl.constexpr, BOUNDS: tl.constexpr,
              SEGS: tl.constexpr, CM: tl.constexpr, ORDER: tl.constexpr):
    """The top-min(K, n) of elements [g*CHUNK, g*CHUNK + n) of row b (n <= CHUNK),
    written sorted to out[b, g*K : g*K + K]. Elements are scores[b, j] (INDIRECT: scores[b, cand[b, j]],
    whose original index cand[b, j] is the one compared and written). FINAL: sorted, -1 for -inf picks
    and pads; else the picks in index order (a first stage). FILTERED: the candidates of
    `_filter_kernel` in SEGS segments of CHUNK slots, the segments' candidate and -inf counts at
    cnt[b, 0:SEGS] and cnt[b, SEGS:2 SEGS], the row's bound at lb[b]. A block
    of elements is a [BLOCK // ROW, ROW] tile, ROW consecutive elements per row: the collect's scan runs
    along the rows in registers, then over the row totals. The first block stays in registers across
    the passes (all of the row when n <= BLOCK); later blocks are re-read. CM: the cache modifier of
    the candidate and count loads (".cg" where other programs of the same kernel wrote them). ORDER (FINAL):
    0 the picks by descending score, 1 the picks above -inf in ascending index order, then -1 (FILTERED:
    no candidate is at or below -inf, and the collect has written the picks in index order already)."""
    row = s_ptr + b * s_row
    irow = i_ptr + b * i_row + g * CHUNK
    orow = out_ptr + b * o_row + g * K
    if not INDIRECT:
        row_e = row + g * CHUNK               # element j of the program is scores[b, g*CHUNK + j]
    else:
        row_e = row
    cnt_row = cnt_ptr + b * 2 * SEGS
    if FILTERED:
        n = tl.zeros([], tl.int32)
        n_inf = tl.zeros([], tl.int32)
        for sg in tl.static_range(SEGS):
            n += tl.load(cnt_row + sg, cache_modifier=CM)
            n_inf += tl.load(cnt_row + SEGS + sg, cache_modifier=CM)
    else:
        n = tl.minimum(N - g * CHUNK, CHUNK)
        n_inf = 0
    kk = tl.minimum(K, n)
    offs = tl.arange(0, BLOCK // ROW)[:, None] * ROW + tl.arange(0, ROW)[None, :]
    valid = offs < n
    key, idx0 = _load(row_e, irow, offs, valid, INDIRECT, cnt_row, CHUNK, SEGS, CM, FILTERED)

    # ---- select, most significant digit first: thr collects the kk-th largest key's digits, need
    # counts how many keys sharing thr's bits above `hi` are still to take. It stops once every key
    # of the chosen digit is taken (need == its count): the keys are then split by their bits above
    # hi alone (all 7 passes only when keys near the k-th tie)
    NBINS: tl.constexpr = 1 << DIGIT
    bins = tl.arange(0, NBINS)
    thr = tl.zeros([], tl.uint32)
    need = kk
    hi = tl.full([], 32, tl.int32)
    if INDIRECT and BOUNDS > 0:
        # The first stage's chunks with K picks each (or the filter's K group maxima) bound the k-th
        # largest key from below (K keys of the row are at least their threshold); the largest
        # candidate bounds it from above. The bits the two bounds share are the k-th key's, and no
        # candidate lies above them: the select starts below them with nothing taken yet (when the
        # candidates fit one block: `top` is the first block's)
        c = tl.arange(0, BOUNDS)
        lo = tl.max(tl.load(lb_ptr + b * NB + c, mask=c < NB, other=0).to(tl.uint32, bitcast=True), 0)
        top = tl.max(tl.max(tl.where(valid, key, 0), 1), 0)
        diff = lo ^ top
        # bits below and at diff's highest set bit: from its float exponent, which may round up
        # (hi one too high is still correct)
        hb = tl.where(diff == 0, 0, ((diff.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126)
        hb = tl.minimum(hb, 32)
        hs = (tl.maximum(hb, 1) - 1).to(tl.uint32)
        one = n <= BLOCK
        hi = tl.where(one, hb, hi)
        thr = tl.where(one, tl.where(hb == 0, top, (((top >> hs) >> 1) << hs) << 1), thr)
    go = (need > 0) & (hi > 0)
    while go:
        shift = tl.maximum(hi - DIGIT, 0)
        h = _digit_hist(key, valid, thr, hi, shift, NBINS, BLOCK)
        for start in range(BLOCK, n, BLOCK):
            o = start + offs
            m = o < n
            k, _ = _load(row_e, irow, o, m, INDIRECT, cnt_row, CHUNK, SEGS, CM, FILTERED)
            h += _digit_hist(k, m, thr, hi, shift, NBINS, BLOCK)
        need, thr, go = _select_step(h, bins, need, thr, shift)
        hi = shift
    if BOUNDS > 0 and not INDIRECT:     # a first stage's bound for the second (0: none, the least key)
        tl.store(lb_ptr + b * NB + g, tl.where(kk == K, thr, 0).to(tl.int32, bitcast=True))

    # ---- collect: keys above thr (bits above hi), then the first `need` keys equal to it by position
    # (positions follow the original indices: rows directly, candidates in their stored order)
    t_hi = thr >> hi.to(tl.uint32)
    if FILTERED:
        idx = idx0              # packed with the keys: held since the first load
    elif INDIRECT:
        idx = tl.load(irow + _seg_offsets(offs, cnt_row, CHUNK, SEGS, CM), mask=valid, other=0, cache_modifier=CM)
    else:
        idx = offs.to(tl.int64) + g * CHUNK
    gt_seen, eq_seen = _collect_block(orow, key, idx, valid, t_hi, hi, need, tl.zeros([], tl.int32),
                                      tl.zeros([], tl.int32))
    for start in range(BLOCK, n, BLOCK):
        o = start + offs
        m = o < n
        k, idx = _load(row_e, irow, o, m, INDIRECT, cnt_row, CHUNK, SEGS, CM, FILTERED)
        if not INDIRECT:
            idx = idx + g * CHUNK
        gt_seen, eq_seen = _collect_block(orow, k, idx, m, t_hi, hi, need, gt_seen, eq_seen)

    # ---- sort the picks in the reference's packed order, descending (FINAL only: a first stage's picks
    # stay in index order, which is what the second stage's tie rule needs)
    if FINAL and ORDER == 1 and FILTERED:
        j = tl.arange(0, K_PAD)
        tl.store(orow + j, tl.full([K_PAD], -1, tl.int64), mask=(j >= kk) & (j < K))
    elif FINAL and ORDER == 1:
        # the picks above -inf by ascending index, -1 after them: 2^31 - 1 - index sorted descending
        tl.debug_barrier()      # the picks written by every thread, before any thread reloads them
        j = tl.arange(0, K_PAD)
        jm = j < kk
        idx = tl.load(orow + j, mask=jm, other=0)
        pk = _keys(tl.load(row + idx, mask=jm, other=0.0))
        packed = tl.sort(tl.where(jm & (pk > -2139095041), 2147483647 - idx, -1), descending=True)
        tl.debug_barrier()      # every thread has read the picks before any overwrites them
        tl.store(orow + j, tl.where(packed >= 0, 2147483647 - packed, -1), mask=j < K)
    elif FINAL:
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
        si = tl.where(jm & (sk != -2139095041), si, -1)
        tl.debug_barrier()      # every thread has read the picks before any overwrites them
        if FILTERED:
            # -inf scores are not candidates: the reference has them (as -1) after the picks above
            # -inf and before any below it (negative NaNs)
            low = jm & (sk < -2139095041)
            n_top = tl.sum((jm & ~low).to(tl.int32), 0)
            pos = tl.where(low, j + n_inf, j)
            tl.store(orow + pos, si, mask=jm & (pos < K))
            fill = ((j >= n_top) & (j < n_top + n_inf)) | (j >= kk + n_inf)
            tl.store(orow + j, tl.full([K_PAD], -1, tl.int64), mask=fill & (j < K))
        else:
            tl.store(orow + j, si, mask=j < K)


@triton.jit
def _row_bound(gmax, K, NG: tl.constexpr, PASSES: tl.constexpr, DIGIT: tl.constexpr):
    """The K-th largest of the group maxima gmax [NG] (unsigned keys), its bits below the first PASSES
    select digits cleared: at least K maxima are >= it."""
    NBINS: tl.constexpr = 1 << DIGIT
    bins = tl.arange(0, NBINS)
    valid = tl.arange(0, NG) < NG
    thr = tl.zeros([], tl.uint32)
    need = K
    hi = tl.full([], 32, tl.int32)
    go = need > 0
    while go:
        shift = tl.maximum(hi - DIGIT, 0)
        h = _digit_hist(gmax, valid, thr, hi, shift, NBINS, NG)
        need, thr, go = _select_step(h, bins, need, thr, shift)
        go = go & (shift > 32 - PASSES * DIGIT)      # a few digits bound tightly enough
        hi = shift
    return thr


@triton.jit
def _group_max_kernel(s_ptr, gmax_ptr, lb_ptr, arrive_ptr, s_row, g_row, N, K, CH, n_groups, G: tl.constexpr,
                      SKEW: tl.constexpr, STEPS: tl.constexpr, NG: tl.constexpr, PASSES: tl.constexpr,
                      DIGIT: tl.constexpr, PDL: tl.constexpr):
    """Program (b, j): the maxima of chunk j's G groups (chunk j: scores [j*CH, j*CH + CH) of row b)
    -> gmax[b, j*G : j*G + G] as unsigned keys (0, the least key, for a group with no score); the
    row's last program to finish (counted in at arrive[b], zero before the launch) then reads all
    n_groups <= NG maxima of the row and writes the bound `_row_bound` to lb[b].

    Step i of a chunk reads its scores [i*G, i*G + G) (one coalesced block), and score i*G + p
    joins group (p + i*SKEW) mod G. The skew spreads both a periodic row (the same scores every G
    or 2 G: unskewed, a group would hold copies of few values) and a monotone or locally smooth one
    (neighbours in one group) over many groups. STEPS steps load at once. PDL: see `pdl_enter`."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    row = s_ptr + b * s_row
    lo = j * CH
    end = tl.minimum(lo + CH, N)
    gj = tl.arange(0, G)[None, :]
    st = tl.arange(0, STEPS)[:, None]
    gmax = tl.zeros([G], tl.uint32)
    for i0 in range(0, tl.cdiv(CH, G), STEPS):
        i = i0 + st
        o = lo + i * G + ((gj - i * SKEW) & (G - 1))
        m = o < end
        gmax = tl.maximum(gmax, tl.max(tl.where(m, _ukeys(tl.load(row + o, mask=m, other=0.0)), 0), 0))
    tl.store(gmax_ptr + b * g_row + j * G + tl.arange(0, G), gmax.to(tl.int32, bitcast=True))
    # the CUB last-block pattern: every thread's stores, then one acq_rel count per program
    tl.debug_barrier()
    if tl.atomic_add(arrive_ptr + b, 1, sem="acq_rel") == tl.num_programs(1) - 1:
        ga = tl.arange(0, NG)
        gall = tl.load(gmax_ptr + b * g_row + ga, mask=ga < n_groups, other=0, cache_modifier=".cg")
        thr = _row_bound(gall.to(tl.uint32, bitcast=True), K, NG, PASSES, DIGIT)
        tl.store(lb_ptr + b, thr.to(tl.int32, bitcast=True))


@triton.jit
def _bound_kernel(gmax_ptr, lb_ptr, g_row, n_groups, K, NG: tl.constexpr, FOLDS: tl.constexpr,
                  PASSES: tl.constexpr, DIGIT: tl.constexpr, PDL: tl.constexpr):
    """Program b: row b's bound `_row_bound` from its n_groups group maxima given as int32 keys
    (gmax[b], e.g. the indexer scan's), those past NG folded onto the first (n_groups <= FOLDS NG;
    a merged group's maximum is the largest one) -> lb[b]. PDL: see `pdl_enter`."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    ga = tl.arange(0, NG)
    row = gmax_ptr + b * g_row
    gk = tl.load(row + ga, mask=ga < n_groups, other=-2147483648)
    for f in tl.static_range(1, FOLDS):
        gk = tl.maximum(gk, tl.load(row + f * NG + ga, mask=f * NG + ga < n_groups, other=-2147483648))
    thr = _row_bound((gk ^ -2147483648).to(tl.uint32, bitcast=True), K, NG, PASSES, DIGIT)
    tl.store(lb_ptr + b, thr.to(tl.int32, bitcast=True))


@triton.jit
def _filter_kernel(s_ptr, cand_ptr, cnt_ptr, lb_ptr, s_row, c_row, N, CH, SEGS: tl.constexpr, BLOCK: tl.constexpr,
                   ROW: tl.constexpr, ORDER: tl.constexpr, PDL: tl.constexpr):
    """Program (b, j): chunk j's candidates, the scores at or above row b's bound lb[b]
    (`_group_max_kernel` or `_bound_kernel`), stored as key << 32 | index (the select then reads their
    keys without a gather from the scores) to cand[b, j*CH ...] in index order
    (-inf scores left out and counted instead; ORDER 1: every score at or below -inf left out), their
    count to cnt[b, j] and the -inf count to cnt[b, SEGS + j]; BLOCK scores at a time, ROW consecutive
    scores a thread (ROW = BLOCK / threads: the compaction's scan runs along each thread's row, then
    across the threads; at BLOCK 1,024 and 8 warps 40 registers and 8 barriers against 64 and 16 at
    rows of 32). No select here: its registers would hold the kernel to two programs an SM (H100, 128
    a thread), and a row's programs to two waves at B = 64. PDL: see `pdl_enter`."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    row = s_ptr + b * s_row
    thr = tl.load(lb_ptr + b).to(tl.uint32, bitcast=True)
    neg = 8388607               # the unsigned key of -inf (0x007FFFFF)
    offs = tl.arange(0, BLOCK // ROW)[:, None] * ROW + tl.arange(0, ROW)[None, :]
    lo = j * CH
    end = tl.minimum(lo + CH, N)
    crow = cand_ptr + b * c_row + lo
    seen = tl.zeros([], tl.int32)
    n_inf = tl.zeros([], tl.int32)
    nxt = _ukeys(tl.load(row + lo + offs, mask=lo + offs < end, other=0.0))
    for start in range(lo, end, BLOCK):
        o = start + offs
        m = o < end
        k = nxt
        # the next tile's scores asked for before this one's compaction (its barriers do not wait on them)
        nxt = _ukeys(tl.load(row + o + BLOCK, mask=o + BLOCK < end, other=0.0))
        is_inf = m & (k == neg)
        if ORDER == 1:
            v = (m & (k >= thr) & (k > neg)).to(tl.int32)
        else:
            v = (m & (k >= thr) & ~is_inf).to(tl.int32)
        row_tot = tl.sum(v, 1)
        before = (tl.cumsum(row_tot, 0) - row_tot)[:, None] + tl.cumsum(v, 1) - v
        tl.store(crow + seen + before, (k.to(tl.int64) << 32) | o, mask=v == 1)
        seen += tl.sum(row_tot, 0)
        n_inf += tl.sum(tl.sum(is_inf.to(tl.int32), 1), 0)
    tl.store(cnt_ptr + b * 2 * SEGS + j, seen)
    tl.store(cnt_ptr + b * 2 * SEGS + SEGS + j, n_inf)


@triton.jit
def _filtered_select_kernel(s_ptr, cand_ptr, cnt_ptr, lb_ptr, out_ptr, s_row, c_row, o_row, N, K, CH,
                            SEGS: tl.constexpr, SEL_BLOCK: tl.constexpr, K_PAD: tl.constexpr, DIGIT: tl.constexpr,
                            ORDER: tl.constexpr, PDL: tl.constexpr):
    """Program b: the exact select over row b's candidates of `_filter_kernel` (launched after it;
    `_topk_row`, SEL_BLOCK candidates held in registers) -> out[b]. PDL: see `pdl_enter`."""
    pdl_enter(PDL)
    _topk_row(tl.program_id(0).to(tl.int64), 0, s_ptr, cand_ptr, out_ptr, lb_ptr, cnt_ptr, s_row, c_row, o_row, N,
              K, CH, 1, SEL_BLOCK, K_PAD, True, True, True, DIGIT, 8, 1, SEGS, ".cg", ORDER)


def topk_smaller_index(scores: torch.Tensor, k: int, *, block: int | None = None, num_warps: int | None = None,
                       chunk: int | None = None, digit: int | None = None, groups: int | None = None,
                       filter_chunk: int | None = None, group_max: torch.Tensor | None = None,
                       order: str = "score") -> torch.Tensor:
    """[B, N] fp32 -> [B, k] int64 top-k indices, ties to the smaller index, -1 where the score is -inf.
    order: the reference's ("score": by descending score; "index": the picks above -inf ascending,
    then -1, which spares the final sort of the filter's select).

    Long rows of a large batch on CUDA run through a filter (`groups` group maxima per row, default
    FILTER_GROUPS x k, see `_filter_kernel`): the K-th largest maximum bounds the row's K-th score from
    below, the scores at or above it (about 1.15 k on random rows; more on rows built to defeat the
    grouping, all of them at worst, still exact) are the candidates, and the exact select runs over
    those alone. The row's chunks of `filter_chunk` scores (`filter_layout`) find their maxima and
    candidates in programs side by side. With `chunk` given instead, long rows run in two stages: chunks of `chunk`
    scores each give their exact top-k (grid B x chunks), then the top-k of those candidates (every
    global pick is among its chunk's picks; candidates keep index order chunk by chunk, so ties still
    go to the smaller index); chunk 0 = one stage. block, num_warps, digit (bits per select pass): tuning.

    group_max: [B, G] int32, the maxima of G disjoint groups of each row's scores as `_keys` (each the
    key of a score of its group, or INT32_MIN for an empty group), e.g. from the indexer scan
    (`indexer_scores.scores_and_maxima`). Where the filter runs and k <= G <= GIVEN_GROUPS_MAX, its
    bound comes from these (no pass over the scores for maxima); otherwise they are not read.
    """
    if scores.dim() != 2:
        raise InputError(f"scores must be [B, N], got {list(scores.shape)}")
    if order not in TOPK_ORDERS:
        raise InputError(f"order must be one of {TOPK_ORDERS}, got {order!r}")
    order_id = TOPK_ORDERS.index(order)
    bsz, n = scores.shape
    out = torch.empty(bsz, k, dtype=torch.int64, device=scores.device)
    if bsz == 0 or k == 0:
        return out
    if n == 0:
        return out.fill_(-1)
    scores = scores.float().contiguous()
    cuda = scores.device.type == "cuda"
    if groups is None:
        groups = FILTER_GROUPS * k if cuda and chunk is None and n > FILTER_MIN_SCORES else 0
    ng = triton.next_power_of_2(groups) if groups else 0
    if ng >= k and n > ng:          # K groups to bound the K-th score with
        given = group_max is not None and group_max.shape[0] == bsz and k <= group_max.shape[1] <= GIVEN_GROUPS_MAX
        if given:
            assert group_max.dtype == torch.int32 and group_max.stride(1) == 1, "group_max: [B, G] int32 keys"
        _filter(scores, out, k, ng, filter_chunk, block, num_warps, cuda, digit, group_max if given else None,
                order_id)
        return out
    if chunk is None:      # CUDA: >= 4096 per chunk, at most 32 chunks (the second stage fits one block)
        ch = max(DEFAULT_CHUNK, triton.next_power_of_2(triton.cdiv(n, 32))) if cuda else 0
    else:
        ch = chunk
    if ch and n > 2 * ch and ch >= k:
        g = triton.cdiv(n, ch)
        cand = torch.empty(bsz, g * k, dtype=torch.int64, device=scores.device)
        bounds = torch.empty(bsz, g, dtype=torch.int32, device=scores.device)     # each chunk's k-th, from below
        _launch(scores, scores, cand, bounds, n, k, ch, g, False, False, block, num_warps, cuda, digit, order_id)
        n2 = (g - 1) * k + min(k, n - (g - 1) * ch)             # only the last chunk can be short
        _launch(scores, cand, out, bounds, n2, k, n2, 1, True, True, block, num_warps, cuda, digit, order_id)
    else:
        _launch(scores, scores, out, None, n, k, n, 1, False, True, block, num_warps, cuda, digit, order_id)
    return out


#: chunk length of the two-stage path's first stage (on CUDA, rows longer than twice this are filtered)
DEFAULT_CHUNK = 4096
#: group maxima per pick in the filter (4: about 1.15 k candidates on random rows)
FILTER_GROUPS = 4
#: select digits the filter's bound keeps (3: within about 1% of the k-th group maximum)
FILTER_PASSES = 3
#: scores a CUDA row needs for the filter to be its path (shorter: one select; with `chunk` given: two
#: stages). Every batch since the forty-fifth round; rows of 4,097-8,192 since the forty-sixth. CSA decode,
#: H100, indexer µs: 128K (32,768 scores) two stages -> filter B = 1 26.0 -> 22.7, B = 16 52.6 -> 41.2;
#: 32K (8,192) one select -> filter B = 1 26.3 -> 16.9, B = 32 46.7 -> 34.5, B = 64 59.2 -> 55.5;
#: 20K B = 64 50.8 -> 43.4
FILTER_MIN_SCORES = DEFAULT_CHUNK
#: scan maxima a pick worth handing to the filter (`decode.decode_indexer_topk`): fewer bound the k-th
#: score loosely, so many scores pass as candidates. 64K decode at B = 48, the TMA scan's 704 maxima a
#: row (1.4 a pick), H100, indexer µs: given 128.4, the filter's own 58.3 (forty-sixth round)
FILTER_GIVEN_MIN = 2
#: scores per filter program on CUDA (a row's chunks are filtered side by side)
FILTER_CHUNK = 4096
#: given group maxima a row `_bound_kernel` takes (more: the top-k finds its own maxima)
GIVEN_GROUPS_MAX = 65536
#: ... folded onto half their power of two, at most this many (the bound's select runs over them)
BOUND_GROUPS = 4096
#: candidates the filter's select holds in registers (more are re-read per pass)
FILTER_BLOCK = 1024
#: scores a filter program compacts at a time on CUDA (H100, CSA B = 64 cache-side 128K / 1M, µs, at rows
#: of 32 scores: 512 165.1 / 774.0, 1,024 152.8 / 757.7, 2,048 155.2 / 777.1; then rows of 4 a thread:
#: 150.0 / 724.7; forty-fourth round)
FILTER_TILE = 1024
#: bits per select pass (2^DIGIT histogram bins; at most 32 / DIGIT passes, rounded up)
DIGIT = 5


def _warps(num_warps: int | None, cuda: bool, programs: int, blk: int, device: torch.device) -> int:
    """Few programs (small batch): latency-bound, more warps each; many: 8 warps share the SMs."""
    if num_warps:
        return num_warps
    if not cuda:
        return 4
    return 16 if blk >= 8192 or programs < sm_count(device) else 8


def _launch(scores: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, bounds: torch.Tensor | None, n: int, k: int,
            chunk: int, groups: int, indirect: bool, final: bool, block: int | None, num_warps: int | None,
            cuda: bool, digit: int | None, order: int = 0) -> None:
    """bounds [B, chunks] int32: a first stage writes each chunk's lower bound of the k-th key there,
    the second stage reads them (None: one stage)."""
    blk = block or min(triton.next_power_of_2(chunk), 16384 if cuda else 1024)
    assert blk <= 32768, "the collect packs two counts of one block into an int32"
    nb = bounds.shape[1] if bounds is not None else 0
    _topk_kernel[(scores.shape[0], groups)](
        scores, idx, out, bounds if bounds is not None else out, out, scores.stride(0), idx.stride(0),
        out.stride(0), n, k, chunk, nb, BLOCK=blk, K_PAD=triton.next_power_of_2(k), INDIRECT=indirect,
        FINAL=final, FILTERED=False, DIGIT=digit or DIGIT, ROW=min(8, blk),
        BOUNDS=triton.next_power_of_2(nb) if nb else 0, SEGS=1, ORDER=order,
        num_warps=_warps(num_warps, cuda, scores.shape[0] * groups, blk, scores.device), **pdl_launch(scores.device))


def filter_layout(n: int, ng: int, chunk: int | None, cuda: bool) -> tuple[int, int, int]:
    """(chunk length CH, chunks P, groups per chunk G) of the filter over rows of n scores with about
    ng group maxima: CH = `chunk`, else 4,096 on CUDA (one program per 4,096 scores: the row's
    chunks run side by side) and the whole row on the interpreter; G the power of two nearest
    ng / P from below, at most CH."""
    ch = min(chunk or (FILTER_CHUNK if cuda else n), n)
    p = triton.cdiv(n, ch)
    g = max(1, min(ng // triton.next_power_of_2(p), 1 << (ch.bit_length() - 1)))
    return ch, p, g


def _filter(scores: torch.Tensor, out: torch.Tensor, k: int, ng: int, chunk: int | None, block: int | None,
            num_warps: int | None, cuda: bool, digit: int | None, group_max: torch.Tensor | None = None,
            order: int = 0) -> None:
    """Three launches: the group maxima and the row's bound (with group_max given: the bound alone, a
    program a row), the candidates, the exact select."""
    bsz, n = scores.shape
    dev = scores.device
    ch, p, g = filter_layout(n, ng, chunk, cuda)
    cand = torch.empty(bsz, p * ch, dtype=torch.int64, device=dev)     # key << 32 | index
    counts = torch.empty(bsz, 2 * p, dtype=torch.int32, device=dev)
    bound = torch.empty(bsz, 1, dtype=torch.int32, device=dev)
    if group_max is None:
        arrive = torch.zeros(bsz, dtype=torch.int32, device=dev)       # the row's programs done
        gmax = torch.empty(bsz, p * g, dtype=torch.int32, device=dev)
        steps = max(1, min(triton.cdiv(ch, g), 4096 // g))
        _group_max_kernel[(bsz, p)](scores, gmax, bound, arrive, scores.stride(0), gmax.stride(0), n, k, ch,
                                    p * g, G=g, SKEW=int(0.618 * g) | 1 if g > 1 else 0,
                                    STEPS=triton.next_power_of_2(steps), NG=triton.next_power_of_2(p * g),
                                    PASSES=FILTER_PASSES, DIGIT=digit or DIGIT, num_warps=4, **pdl_launch(dev))
    else:
        # the given groups folded to a power of two (the scan's 64 P: 2,112 at B = 64 -> 2,048), at most
        # BOUND_GROUPS (33,792 from a one-row TMA scan at 1M -> 4,096)
        ng_given = group_max.shape[1]
        kp = triton.next_power_of_2(k)
        ngf = min(max(triton.next_power_of_2(ng_given) // 2, kp), max(BOUND_GROUPS, kp))
        _bound_kernel[(bsz,)](group_max, bound, group_max.stride(0), ng_given, k, NG=ngf,
                              FOLDS=triton.cdiv(ng_given, ngf),
                              PASSES=FILTER_PASSES, DIGIT=digit or DIGIT, num_warps=4, **pdl_launch(dev))
    blk = block or min(triton.next_power_of_2(ch), FILTER_TILE if cuda else 1024)
    assert blk <= 32768, "the collect packs two counts of one block into an int32"
    warps = num_warps or (8 if cuda else 4)
    _filter_kernel[(bsz, p)](scores, cand, counts, bound, scores.stride(0), cand.stride(0), n, ch, SEGS=p, BLOCK=blk,
                             ROW=max(1, blk // (32 * warps)), ORDER=order, num_warps=warps, **pdl_launch(dev))
    _filtered_select_kernel[(bsz,)](scores, cand, counts, bound, out, scores.stride(0), cand.stride(0), out.stride(0),
                                    n, k, ch, SEGS=p, SEL_BLOCK=block or FILTER_BLOCK,
                                    K_PAD=triton.next_power_of_2(k), DIGIT=digit or DIGIT, ORDER=order,
                                    num_warps=warps, **pdl_launch(dev))


__all__ = ["topk_smaller_index"]
