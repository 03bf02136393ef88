"""Indexer scan for mxfp4 keys with pages copied by the tensor memory accelerator (Gluon, sm_90): the
decode scan of `indexer_scores.paged_indexer_scores` where a 64-key tile is one page of the
indexer pool.

    grid (B, P): program p scans key tiles p, p + P, ... of request b (tile i = block-table column
    i: 64 keys of 68 bytes, 4 KB of packed E2M1 then 256 B of UE8M0 scales), then writes -inf to
    its tiles past the request's entries.

One warpgroup a program. NS pages are in flight: per tile one copy of the page (its key words and
the scale words stored right after them) into a stage (a TMA copy, `_tma_load`, completing
on the stage's mbarrier), issued NS tiles ahead when the stage is read. Per tile: each lane reads its own 16 bytes
of each of its two key rows (one scale group), decoded to bf16 keys scaled by 2^(e_g - e_max)
(exact, `_E2M1_WORD_ASM`) straight into the registers of the warpgroup MMA's A operand; the MMA's
K order is therefore a permutation of the key's dims (`_perm`), and q's columns are stored in that
order once. S^T [64 keys, 64 heads] = K . q^T (q [64 heads, 128] bf16 in shared memory), then
score[n] = 2^e_max[n] D^-1/2 sum_h w_h ReLU(S^T[n, h]). No key tile goes through shared memory: a
tile moves ~25 KB there (its copy, its words read, q read by the MMA) instead of ~57 KB when the
decoded keys are stored and read back. 25 KB of shared memory and 105 registers a thread: four
programs an SM.

Why: the pointer scan (`indexer_scan`) loads each tile into registers a tile ahead and computes
its addresses per key; no warp here waits on a global load (the copies run NS tiles ahead and
hold no registers) and a tile costs one block-table lookup. Two first forms were no faster than
the pointer scan (H100, 128K B = 64: 149 µs against 131): a warp-specialised one (a 1-warp copy
partition, padded by Triton to 8 warps a program: 2 programs an SM) and this one storing the
decoded keys to an NVMMA tile for the MMA (shared-memory bound). Now ~341 instructions a warp a
tile (sm_90 compile, Triton 3.6): 136 the decode, ~76 the ReLU and head sum, ~45 the two copies'
issue. A tile costs its MMA plus its instructions: on Hopper the warpgroup MMA and the SM's ALU
work do not overlap (`benchmarks/mma_probe.py`), so an asynchronous MMA under the previous tile's
epilogue, or a copy warp with no barrier a tile, measured no faster. When each lane decoded one
pair of every word of its rows (all 64 bytes read, the pairs gathered by scale group) it took 419.

The int8 MMA (INT8, from `indexer_scores.TMA_INT8_TILES` tiles): twice an E2M1 code is an integer of
{0 .. 12}, so a key whose four scale groups lie within 2^2 of each other (e_g - e_min <= 2: every
key of a Hadamard-rotated vector in practice) is the int8 vector 2 code 2^(e_g - e_min) times
2^(e_min - 1), and an mxfp4-rounded query head is int8 integers of one power-of-two unit 2^u
(`_q8_kernel`, once a request, chained to the scan by programmatic dependent launch). The keys
are decoded by byte lookups (`_E2M1_INT8_ASM`: two `prmt` tables a row, 9 instructions a word
against 17) as 64 + k, an int8 MMA at twice the bf16 rate gives the dots exactly as integers (less
the offset 64 sum q), and ReLU(S) read as a denormal float times w 2^(u + 100) puts the head sum
in fp32 with no conversion instruction; both per-head factors are read from shared memory a tile
(in registers they held 32 a thread across the loop), so the int8 kernel runs at 80 registers, six
programs an SM (`MAXNREG_INT8`). A tile with a wider key (each warp stores the widest spread of
its 16 keys before the tile's CTA barrier and reads the four after it) or a request whose queries
are not such integers runs the bf16 MMA above, in a kernel of its own (below). H100:
-4 to -6% from 16,384 tiles (128K B = 64 93.2 against 98.7 µs, 1M B = 64 618 against 655); the MMA
at half its cost bought less than its share, as the tile's integer instructions (prmt, lop3 and
the max run at half the FMA pipe's rate) grew. Six programs an SM with the factors in shared memory,
against four with them in registers: -1 to -2% (H100, 128K B = 64 93.3-93.9 -> 91.4-92.5 µs, 1M
624-626 -> 611-620). The decode's join of its two lookups and the epilogue's offset and ReLU are
written so that ptxas issues them on the FMA pipe (IMAD.IADD, FADD.SAT) instead of the ALU pipe that
the lookups keep busy: -1.5% at 128K B = 64, -3% at 1M (`_RELU_DENORMAL_ASM`). The scan is
compute-bound: its page copies alone take 42-45% of its time (`benchmarks/scan_floor.py`).

The int8 kernel holds no bf16 tile: a tile it cannot take exactly (a key's groups spread past 2^2,
or queries that are not such integers) is appended to a per-request list, and `_scan_redo_kernel`
(chained by programmatic dependent launch; its programs exit at once on an empty list) scores those
tiles with the bf16 MMA and folds them into the group maxima by atomic max. Compiled in, the bf16
tile's registers made ptxas spill at 80 and serialise every int8 wgmma (a wait after each, C7512);
without it the kernel takes 77 registers with none spilled. H100, B = 64, indexer µs, two rounds:
128K 105.8 / 106.0 -> 100.3 / 100.7, 1M 654.3 / 652.9 -> 623.7 / 620.9 (benchmarks/NOTES.md #224).

A tile's page is one copy, and the next refill's block-table lookup goes out right after this
refill. Triton puts a CTA barrier before each copy, and a proxy fence that waits for the thread's
loads in flight; a second copy for the scale words cost a barrier a tile, and a lookup issued before
the fence was waited for on the tile's chain (ncu: ~3.7% of the scan's stall samples). H100, B = 64,
indexer µs, trees alternated: 128K 100.7 -> 99.5 / 99.8, 1M 619.5 / 628.6 -> 604.1 / 613.6 (#225).
The tile's int8-or-not decision rides on the barrier before its refill: a warp's spread reuses the decode's
e_min and one `redux`, where every warp reading all 64 scale words took ~20 instructions and two
loads a tile more (loop 385 -> 378). H100, B = 64, cache-side µs, trees alternated: 128K 134.5 /
134.5 -> 133.2 / 133.3, 1M 634.7 / 643.7 -> 635.1 / 633.4 (#226).

With `gmax` (GMAX) each program also keeps the maxima of its 64 row slots over its tiles (groups of
entries 64 P apart, P programs a request) and stores them as the top-k's int32 keys: the top-k's
filter bounds the k-th score from these instead of a pass over the scores for maxima of its own
(`decode.decode_indexer_topk`); the scan pays +1.2-2.2 µs at 128K B = 64 for the running maxima
(two spilled registers at 80), the step saves ~2 at 128K and ~14 at 1M (H100).

`_prefill_scan_tma_kernel` runs the same pages for a prefill chunk (`indexer_prefill.grouped_scores`):
a program a group of up to 4 consecutive tokens of one request (two programs a group), each page
copied and decoded once for the group, then one MMA and epilogue a token (`_scores8` / `_scores16`,
each token's int8 queries from `_q8_kernel`, one row a token). H100, the last 8K chunk of a 32K
prompt: 1,666 µs against the Triton grouped scan's 1,947 (benchmarks/NOTES.md #213).

Scores equal the pointer scan's to fp32 rounding (the same operands and fp32 accumulation; the
dot's K order and the head sum's order differ; the int8 MMA's dots are exact). Static grid, no host
reads: capturable in a CUDA graph.
Measurements: benchmarks/NOTES.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dsv4.kernels.triton.decode_attention_wide import GLUON_OK, _barrier, _view
from dsv4.kernels.triton.decode_common import pdl, pdl_enter

# a TMA copy into shared memory: `async_copy_global_to_shared` in Triton 3.6, `async_load` in 3.9
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
#: keys a tile = indexer keys a page (the default 256 tokens a block, m = 4)
EPB = 64
_EPB = gl.constexpr(EPB)
#: a page as rows of 64 words: rows 0-15 the key words (16 a key), row 16 the scale words; its copy
#: is a box of 32 rows (a power of two, as Triton's shapes are), rows 17-31 past the page's 17 filled
#: with zeros by the copy without a read
_PAGE_ROWS = gl.constexpr(32)
#: bytes a page's copy completes (the whole box)
_PAGE_BYTES = gl.constexpr(32 * EPB * 4)
#: pages in flight a program (H100, 128K, B = 64 / 16: 2 stages 1-5% faster than 3-4: more programs fit)
STAGES = 2
#: registers a thread of the bf16-only kernel: four programs an SM (96, five with no spills, and 104
#: measured no faster)
MAXNREG = 128
#: ... and of the int8 one: six programs an SM (77 used, no spill: its fallback tiles run in
#: `_scan_redo_kernel`). With the bf16 tile compiled in, it spilled at 80 and ptxas serialised every
#: int8 wgmma below 96 (C7512); H100, µs, 128 / 96 / 80: 128K B = 64 96.5 / 94.4 / 91.4, 1M B = 64
#: 652 / 641 / 614
MAXNREG_INT8 = 80
#: the int8 MMA where a tile's keys and the queries fit it (`_keys8`), else the bf16 one
#: (`indexer_scores.TMA_INT8_TILES` picks it by the batch's tiles)
INT8 = True
#: registers a thread of the prefill scan (`_prefill_scan_tma_kernel`; sm_90 compile at 4 rows a group: 8 bytes
#: of stack at 168, 88 at 128; its 60 KB of shared memory hold three programs an SM either way)
PREFILL_MAXNREG = 168
#: `_q8_kernel`'s programs a request (16 heads each)
Q8_BLOCKS = 4
_Q8_BLOCKS = gl.constexpr(Q8_BLOCKS)


@gluon.constexpr_function
def _keys():
    """[4, 2, 8, 4, 4, 4] = (warp, row half, row group, word i, pair j, lane t): key row 16 w + 8 h + g
    as the warpgroup MMA's register operand holds it (rows g and g + 8 of each warp's 16, lane 4 g + t).
    Lane t decodes words 4 t .. 4 t + 3 of its two rows (its own 16 bytes: scale group t), pair j of
    word 4 t + i being codes j and j + 4; they are the operand's columns 8 (4 i + j) + 2 t + (0, 1),
    so the MMA's K order is a permutation of the key's dims (`_perm`), which q follows."""
    return gl.BlockedLayout([1, 2, 1, 4, 4, 1], [1, 1, 8, 1, 1, 4], [4, 1, 1, 1, 1, 1], [4, 3, 1, 5, 2, 0])


@gluon.jit
def _perm(k):
    """The key dim at MMA column k = 8 (4 i + j) + 2 t + e: code j + 4 e of word 4 t + i."""
    return 32 * ((k >> 1) & 3) + 8 * (k >> 5) + ((k >> 3) & 3) + 4 * (k & 1)


@gluon.constexpr_function
def _keys8():
    """[4, 2, 8, 4, 2, 4, 4] = (warp, row half, row group, word i, half hh, lane t, code c): the int8
    MMA's register operand (rows as `_keys`; a register holds 4 consecutive K columns). Lane t
    decodes words 4 t .. 4 t + 3 of its two rows, codes 4 hh + c of word 4 t + i into K column
    32 i + 16 hh + 4 t + c, so the MMA's K order is a permutation of the key's dims that `_q8_kernel`
    stores the int8 queries in."""
    return gl.BlockedLayout([1, 2, 1, 4, 2, 1, 4], [1, 1, 8, 1, 1, 4, 1], [4, 1, 1, 1, 1, 1, 1],
                            [6, 1, 4, 3, 5, 2, 0])


@gluon.constexpr_function
def _acc():
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])


@gluon.constexpr_function
def _acc8():
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])


@gluon.constexpr_function
def _flat(rank):
    """Shared layout of the copies' boxes: unswizzled, row-major."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=rank)


@gluon.jit
def _block(bt_row, tile, max_blocks):
    """The page of key tile `tile` (block-table column `tile`; a clamped, non-negative id)."""
    blk = gl.load(bt_row + gl.minimum(tile, max_blocks - 1))
    return gl.maximum(blk, 0)


@gluon.jit
def _issue(raw, ready, desc, s, blk):
    """The copy of page blk (its key and scale words, one box: the page layout puts the scales right
    after the keys) into stage s, completing on ready[s]. One copy a page, not two: Triton's lowering
    puts a CTA barrier before each copy."""
    mbarrier.expect(ready.index(s), _PAGE_BYTES)
    _tma_load(desc, [blk, 0, 0], ready.index(s), raw.index(s))


@gluon.jit
def _first_pages(desc, bt_ptr, req, s_bt, p0, step, mine, max_blocks, NS: gl.constexpr):
    """The NS page stages and their barriers, the program's first NS pages (tiles p0, p0 + step, ..
    of the `mine` it scans, in request req's block-table row) in flight; returns the stages, the
    barriers, the warps' key spreads (`_load`) and that row."""
    raw = gl.allocate_shared_memory(gl.int32, [NS, 1, _PAGE_ROWS, _EPB], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    spread_s = gl.allocate_shared_memory(gl.int32, [2, 8, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()            # the barriers' initialisation before the copies use them
    bt_row = bt_ptr + req.to(gl.int64) * s_bt
    for i in gl.static_range(NS):
        if i < mine:
            _issue(raw, ready, desc, i, _block(bt_row, p0 + i * step, max_blocks))
    return raw, ready, spread_s, bt_row


# One key word -> four bf16x2 (pack = 4: $4-$7 the word, $8-$11 the bf16x2 factor 2^(126 + e_g - e_max)
# of its scale group). Pair j is codes j and j + 4 (bits 4 j and 4 j + 16: one mask takes both, and
# codes 2-3 / 6-7 come from the word shifted right a byte); times 2^6 + 2^12 (2^2 + 2^8 for the odd
# pairs) each code's magnitude lands on bits 6-8 and its sign on bit 15 of its half, masked: the
# bf16 of value * 2^-126, exact (as `indexer_scan._E2M1_PAIR_ASM`), then times the factor.
# 17 instructions a word (22 for four pairs of four words gathered by scale group before).
_E2M1_WORD_ASM = gl.constexpr("{\n.reg .b32 h, x;\nshr.b32 h, $4, 8;\n"
                              + "".join(f"and.b32 x, {src}, {mask:#x};\nmul.lo.u32 x, x, {mul};\n"
                                        f"and.b32 x, x, 0x81C081C0;\nmul.rn.bf16x2 ${j}, x, $8;\n"
                                        for j, (src, mask, mul) in enumerate(
                                            [("$4", 0x000F000F, 4160), ("$4", 0x00F000F0, 260),
                                             ("h", 0x000F000F, 4160), ("h", 0x00F000F0, 260)]))
                              + "}")


# Four E2M1 codes -> four int8 bytes 64 + 2 * value * 2^sh (pack = 4, one register; $1 the selector:
# the word, or the word >> 16; $5 / $9 the positive table's bytes for magnitudes 0-3 / 4-7, $13 / $17
# the negative table's). `prmt` picks byte m of a table for a code of magnitude m; where the
# selector nibble's bit 3 (the code's sign) is set it writes the picked byte's sign instead: 0, as
# every table byte is below 128. So the positive table gives the positive codes (0 for the others),
# the negative one under flipped signs the negative codes (0 for the others), and their sum the key's
# byte (one of each pair of bytes is 0: no carries): 4 instructions for four codes. A sum, not an OR:
# ptxas issues it as IMAD.IADD on the FMA pipe, where the OR took the ALU pipe beside the prmt and xor.
_E2M1_INT8_ASM = gl.constexpr("{\n.reg .b32 p, n, x;\nprmt.b32 p, $5, $9, $1;\nxor.b32 x, $1, 0x8888;\n"
                              "prmt.b32 n, $13, $17, x;\nadd.u32 $0, p, n;\n}")


# ReLU(S + offset) read as a float: the integer add, then a multiply by 1 saturated to [0, 1] (negative
# ints read as negative floats or NaNs, both 0 after .sat; values below 2^23 are denormals, unchanged).
# ptxas issues IMAD.IADD and FADD.SAT (the FMA pipe) where `max(S + offset, 0)` was one VIADDMNMX on
# the ALU pipe, which carries the decode: sm_90 (Triton 3.6) int8 tile ALU instructions ~160 -> ~110.
# H100, B = 64, indexer µs (two rounds): 128K 105.4 / 104.9 -> 103.4 / 104.3, 1M 664.2 / 674.9 -> 650.3 /
# 651.0 (benchmarks/NOTES.md #222).
_RELU_DENORMAL_ASM = gl.constexpr("{\n.reg .b32 t;\nadd.s32 t, $1, $2;\nmul.sat.f32 $0, t, 0f3F800000;\n}")


@gluon.jit
def _bytes_range(w):
    """The least and the greatest of a word's four bytes (a key's four scale exponents)."""
    lo = w & 0xFF
    hi = lo
    for g in gl.static_range(1, 4):
        byte = (w >> 8 * g) & 0xFF
        lo = gl.minimum(lo, byte)
        hi = gl.maximum(hi, byte)
    return lo, hi


@gluon.jit
def _load(raw, s, spread_s, it, INT8: gl.constexpr):
    """Stage s's page into registers: the key words of each lane's scale group (`_keys` rows) and the
    rows' scale words. INT8: each warp also stores the widest spread e_max - e_min of its 16 keys into
    slot it % 2 of spread_s, which every warp reads after the tile's CTA barrier (`_narrow`). Slot
    it % 2 is next written two tiles on, after the next tile's barrier, so no warp reads it late."""
    W5: gl.constexpr = gl.SliceLayout(4, _keys())                                # [w, h, g, i, t]
    R3: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, W5))                  # [w, h, g]
    # word 4 t + i of row (w, h, g): i runs fastest in memory (the page's first 1,024 words). The views
    # are of the whole allocation, then indexed: from Triton 3.8 a view must keep its source's size and
    # may not be of a subview
    NS: gl.constexpr = raw.shape[0]
    halves = _view(raw, gl.int32, [2 * NS, 4, 2, 8, 4, 4], gl.SwizzledSharedLayout(1, 1, 1, [3, 4, 2, 1, 0]))
    page_d = halves.index(2 * s)                                                 # [4, 2, 8, 4, 4]
    page_s = _view(raw, gl.int32, [_PAGE_ROWS * NS, 4, 2, 8], _flat(3)).index(_PAGE_ROWS * s + 16)  # row 16
    words = page_d.load(W5)                                                      # [4, 2, 8, 4, 4]
    srow = page_s.load(R3)                                                       # [4, 2, 8] scale words
    if INT8:
        lo, hi = _bytes_range(srow)
        spread = gl.max(hi - lo, axis=1)                                         # [w, g]: a lane's two keys
        # the warp's widest (every lane the same), one `redux` where Triton's reduction over the lanes
        # takes three shuffles and maxima
        spread = gl.inline_asm_elementwise("redux.sync.max.u32 $0, $1, 0xffffffff;", "=r,r", [spread],
                                           dtype=gl.int32, is_pure=True, pack=1)
        spread_s.index(it % 2).permute((1, 0)).store(spread)                     # [g, w]: row 0 every warp's
    return words, srow


@gluon.jit
def _narrow(spread_s, it):
    """Whether every key of the tile has its scale groups within 2^2 of each other (`_load`'s spreads
    of the four warps, read after the tile's CTA barrier)."""
    every = spread_s.index(it % 2).slice(0, 1).load(gl.BlockedLayout([1, 4], [32, 1], [4, 1], [1, 0]))  # [1, 4]
    return gl.max(gl.max(every, axis=1), axis=0) <= 2


@gluon.jit
def _next_page(raw, ready, spread_s, desc, bt_row, it, blk, p0, step, mine, max_blocks, NS: gl.constexpr,
               INT8: gl.constexpr):
    """The program's tile `it` from its stage (`_load`), once its copies land; the stage then refills
    with the page NS tiles ahead (blk, looked up an iteration before); returns the tile and the page
    of the next refill. Its lookup goes out after this refill: the proxy fence Triton puts before a
    copy waits for the thread's loads in flight, so a lookup issued before it would be waited for
    here, on the tile's chain (ncu: its latency was ~3.7% of the scan's stall samples)."""
    s = it % NS
    mbarrier.wait(ready.index(s), (it // NS) & 1)
    words, srow = _load(raw, s, spread_s, it, INT8)
    _barrier()                  # every warp has read stage s (and stored its spread) ...
    if it + NS < mine:          # ... so it refills, NS tiles ahead
        _issue(raw, ready, desc, s, blk)
    narrow = False
    if INT8:
        narrow = _narrow(spread_s, it)
    return words, srow, narrow, _block(bt_row, p0 + (it + NS + 1) * step, max_blocks)


@gluon.jit
def _rows_acc(x, ACC: gl.constexpr):
    """A [4, 2, 8] value of rows (w, h, g) (`_keys`' rows: row 16 w + 8 h + g, lane 4 g + t) as [64]
    in the accumulator's row layout, which puts the same rows in the same lanes."""
    return gl.convert_layout(gl.reshape(x, [_EPB]), gl.SliceLayout(1, ACC))


@gluon.jit
def _decode(words, srow):
    """A tile's words -> (keys [64, 128] bf16 x 2^(e_g - e_max) in the MMA's register-operand
    layout, columns in `_perm` order; 2^e_max a key in the accumulator's row layout)."""
    K6: gl.constexpr = _keys()
    W5: gl.constexpr = gl.SliceLayout(4, K6)                                     # [w, h, g, i, t]
    # the key's largest group scale e_max, and lane t's group factor 2^(126 + e_t - e_max) as bf16x2 bits
    smax = srow & 0xFF
    for g in gl.static_range(1, 4):
        smax = gl.maximum(smax, (srow >> 8 * g) & 0xFF)
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, W5)))))
    t = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(t, 0), 0), 0), 0)   # [1, 1, 1, 1, 4]
    byte = (gl.expand_dims(gl.expand_dims(srow, 3), 4) >> (8 * t)) & 0xFF
    fe = gl.maximum(byte - gl.expand_dims(gl.expand_dims(smax, 3), 4) + 253, 1)   # 2^252 below e_max: 0
    sc = gl.expand_dims(fe * 0x800080, 4)                                        # (fe << 7) | (fe << 23)
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(
        5, K6))))))
    j = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(j, 0), 0), 0), 0), 5)
    pair = gl.inline_asm_elementwise(_E2M1_WORD_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r",
                                     [gl.expand_dims(words, 4) + 0 * j, sc + 0 * j],
                                     dtype=gl.int32, is_pure=True, pack=4)       # [4, 2, 8, 4, 4, 4]
    lo = pair.to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (pair >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    keys = gl.reshape(gl.join(lo, hi), [_EPB, 128])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_acc(), k_width=2)
    return gl.convert_layout(keys, A_L), (_rows_acc(smax, _acc()) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _decode8(words, srow):
    """A tile's words -> (keys [64, 128] int8 64 + 2 * code * 2^(e_g - e_min), the int8 MMA's register
    operand, columns in `_keys8` order; 2^e_min a key in the accumulator's row layout). Exact where
    e_g - e_min <= 2 for every group (`_load`'s narrow)."""
    K7: gl.constexpr = _keys8()
    S6: gl.constexpr = gl.SliceLayout(6, K7)                                     # [w, h, g, i, hh, t]
    W5: gl.constexpr = gl.SliceLayout(4, S6)                                     # [w, h, g, i, t]
    words = gl.convert_layout(words, W5)
    srow = gl.convert_layout(srow, gl.SliceLayout(3, gl.SliceLayout(4, W5)))
    emin, _ = _bytes_range(srow)
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, W5)))))
    t = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(t, 0), 0), 0), 0)   # [1, 1, 1, 1, 4]
    byte = (gl.expand_dims(gl.expand_dims(srow, 3), 4) >> (8 * t)) & 0xFF
    sh = byte - gl.expand_dims(gl.expand_dims(emin, 3), 4)
    f = 1 + sh + (sh >> 1)      # 2^(e_t - e_min) for 0 .. 2, as a factor: the tables by IMAD, not shift and add
    full = gl.zeros([4, 2, 8, 4, 2, 4, 4], gl.int32, layout=K7)
    tabs = [gl.expand_dims(gl.expand_dims(0x40404040 + m * f, 4), 6) + full
            for m in (0x03020100, 0x0C080604, -0x03020100, -0x0C080604)]
    hh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(
        5, S6))))))
    hh = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(hh, 0), 0), 0), 0), 5)
    sel = gl.expand_dims(gl.expand_dims(words, 4) >> (16 * hh), 6) + full
    keys = gl.inline_asm_elementwise(_E2M1_INT8_ASM, "=r" + ",r" * 20, [sel] + tabs,
                                     dtype=gl.int8, is_pure=True, pack=4)        # [4, 2, 8, 4, 2, 4, 4]
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_acc8(), k_width=4)
    return gl.convert_layout(gl.reshape(keys, [_EPB, 128]), A_L), (_rows_acc(emin, _acc8()) << 23).to(gl.float32,
                                                                                                     bitcast=True)


@gluon.jit
def _store(out_row, score, offs, n_b, max_entries):
    """The tile's scores (-inf past the request's entries) into the row; returns them, for the group maxima."""
    score = gl.where(offs < n_b, score, float("-inf"))
    gl.store(out_row + offs, score, mask=offs < max_entries)
    return score


@gluon.jit
def _store_q16(q_s, q_ptr, b, s_qb, s_qh):
    """q [64, 128] as bf16 into q_s, columns in the bf16 MMA's K order (`_perm`)."""
    Q_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    hq = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, Q_L)), 1)
    dq = gl.expand_dims(_perm(gl.arange(0, 128, layout=gl.SliceLayout(0, Q_L))), 0)
    q_s.store(gl.load(q_ptr + b * s_qb + hq * s_qh + dq).to(gl.bfloat16))


@gluon.jit
def _tile16(words, srow, qt, wts, out_row, tile0, n_b, max_entries, out_scale):
    """A tile's scores by the bf16 MMA."""
    keys, glob = _decode(words, srow)
    return _scores16(keys, glob, qt, wts, out_row, tile0, n_b, max_entries, out_scale)


@gluon.jit
def _scores16(keys, glob, qt, wts, out_row, tile0, n_b, max_entries, out_scale):
    """One query row's scores of a decoded tile (`_decode`) by the bf16 MMA."""
    acc = warpgroup_mma(keys, qt, gl.zeros([_EPB, 64], gl.float32, layout=_acc()), use_acc=False)
    score = gl.sum(gl.maximum(acc, 0.0) * wts, axis=1) * (glob * out_scale)      # glob > 0: after ReLU
    return _store(out_row, score, tile0 + gl.arange(0, _EPB, layout=gl.SliceLayout(1, _acc())), n_b, max_entries)


@gluon.jit
def _tile8(words, srow, qt8, kw_s, out_row, tile0, n_b, max_entries, out_scale):
    """A tile's scores by the int8 MMA (exact integer dots S + k8's offset)."""
    keys8, glob8 = _decode8(words, srow)
    return _scores8(keys8, glob8, qt8, kw_s.index(0), kw_s.index(1), out_row, tile0, n_b, max_entries, out_scale)


@gluon.jit
def _scores8(keys8, glob8, qt8, off_s, w_s, out_row, tile0, n_b, max_entries, out_scale):
    """One query row's scores of a decoded tile (`_decode8`) by the int8 MMA; off_s, w_s its heads'
    offsets and weights."""
    acc8 = warpgroup_mma(keys8, qt8, gl.zeros([_EPB, 64], gl.int32, layout=_acc8()), use_acc=False)
    # the per-head offset and weight from shared memory a tile: held in registers across the loop
    # they would take 32 a thread (the fallback tile's peak included)
    k8 = gl.expand_dims(off_s.load(gl.SliceLayout(0, _acc8())), 0)
    wts8 = gl.expand_dims(w_s.load(gl.SliceLayout(0, _acc8())).to(gl.float32, bitcast=True), 0)
    # ReLU(S) < 2^23 (S = q8 . v, |S| <= 127 x 48 x 128) read as a float is the denormal ReLU(S) 2^-149,
    # exact, and fp32 FMAs keep denormals: w ReLU(S) 2^(u + 100 - 149) to fp32 rounding, 2^49 back with
    # the key's factor
    f8 = gl.inline_asm_elementwise(_RELU_DENORMAL_ASM, "=r,r,r", [acc8, k8 + 0 * acc8], dtype=gl.float32,
                                   is_pure=True, pack=1)
    score8 = gl.sum(f8 * wts8, axis=1) * (glob8 * (out_scale * 2.0 ** 48))
    return _store(out_row, score8, tile0 + gl.arange(0, _EPB, layout=gl.SliceLayout(1, _acc8())), n_b,
                  max_entries)


@gluon.jit
def _scan_tma_kernel(q_ptr, w_ptr, q8_ptr, kw_ptr, fits_ptr, redo_ptr, out_ptr, gmax_ptr, desc, bt_ptr,
                     nent_ptr, s_qb, s_qh, s_wb, s_ob, s_gb, s_bt, s_rb,
                     num_tiles, max_entries, max_blocks, out_scale, w_scale, NS: gl.constexpr,
                     INT8: gl.constexpr, GMAX: gl.constexpr, PDL: gl.constexpr):
    """Program (b, p): the scores of request b's tiles p, p + P, ... (P programs a request) into
    out[b]; GMAX: also the maxima of its 64 row slots over those tiles into gmax[b, 64 p ..] as the
    top-k's int32 keys (`topk._keys`; group 64 p + r holds entries 64 (p + i P) + r: disjoint groups
    64 P entries apart, for the top-k's filter). INT8: a tile the int8 MMA cannot take exactly is
    appended to redo[b] (a count, then tile indices; the count zeroed by `_q8_kernel`) for
    `_scan_redo_kernel`, and its scores are left to that kernel."""
    b = gl.program_id(0)
    p0 = gl.program_id(1)
    step = gl.num_programs(1)
    n_b = gl.minimum(gl.load(nent_ptr + b), max_entries)
    mine = gl.cdiv(gl.maximum(gl.cdiv(n_b, _EPB) - p0, 0), step)
    raw, ready, spread_s, bt_row = _first_pages(desc, bt_ptr, b, s_bt, p0, step, mine, max_blocks, NS)

    ACC: gl.constexpr = _acc()
    h = gl.arange(0, 64, layout=gl.SliceLayout(0, ACC))
    w_row = w_ptr + b * s_wb + h
    if INT8:
        if PDL:             # `_q8_kernel`'s results (the pages' copies above go out before it ends)
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
        Q8_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.int8)
        q8_s = gl.allocate_shared_memory(gl.int8, [64, 128], Q8_SL)
        Q8_L: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        h8q = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, Q8_L)), 1)
        k8q = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, Q8_L)), 0)
        q8_s.store(gl.load(q8_ptr + b * 8192 + h8q * 128 + k8q))
        KW_L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        kw_s = gl.allocate_shared_memory(gl.int32, [2, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        for i in gl.static_range(2):
            kw_s.index(i).store(gl.load(kw_ptr + b * 128 + i * 64 + gl.arange(0, 64, layout=KW_L)))
        q_fits = gl.load(fits_ptr + b * _Q8_BLOCKS) != 0        # every head block's flag (scalar loads)
        for i in gl.static_range(1, _Q8_BLOCKS):
            q_fits = q_fits & (gl.load(fits_ptr + b * _Q8_BLOCKS + i) != 0)
        qt8 = q8_s.permute((1, 0))
    else:
        Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
        q_s = gl.allocate_shared_memory(gl.bfloat16, [64, 128], Q_SL)
        _store_q16(q_s, q_ptr, b, s_qb, s_qh)
        wts_all = gl.expand_dims(gl.load(w_row).to(gl.float32) * w_scale, 0)
        qt = q_s.permute((1, 0))
    fence_async_shared()            # q's generic-proxy stores before the MMAs' async-proxy reads
    _barrier()
    rows = gl.arange(0, _EPB, layout=gl.SliceLayout(1, ACC))
    out_row = out_ptr + b.to(gl.int64) * s_ob
    GM_L: gl.constexpr = gl.SliceLayout(1, _acc8()) if INT8 else gl.SliceLayout(1, ACC)
    gm = gl.full([_EPB], -2147483648, gl.int32, layout=GM_L)       # the least key: a group with no score
    blk = _block(bt_row, p0 + NS * step, max_blocks)
    for it in range(0, mine):
        words, srow, narrow, blk = _next_page(raw, ready, spread_s, desc, bt_row, it, blk, p0, step, mine, max_blocks,
                                              NS, INT8)
        tile0 = (p0 + it * step) * _EPB
        if INT8:
            if narrow & q_fits:
                sc = _tile8(words, srow, qt8, kw_s, out_row, tile0, n_b, max_entries, out_scale)
            else:
                # the bf16 MMA's tile runs in `_scan_redo_kernel`: compiled in here, its registers made
                # ptxas serialise the int8 MMAs (C7512) and spill (#224)
                slot = gl.atomic_add(redo_ptr + b * s_rb, 1)
                gl.store(redo_ptr + b * s_rb + 1 + slot, p0 + it * step)
                sc = gl.full([_EPB], float("-inf"), gl.float32, layout=GM_L)
        else:
            sc = _tile16(words, srow, qt, wts_all, out_row, tile0, n_b, max_entries, out_scale)
        if GMAX:            # in the top-k's order-preserving int32 keys, so NaNs rank as the reference's do
            bits = sc.to(gl.int32, bitcast=True)
            gm = gl.maximum(gm, gl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF))
    if GMAX:
        gl.store(gmax_ptr + b.to(gl.int64) * s_gb + p0 * _EPB + gl.arange(0, _EPB, layout=GM_L), gm)
    # tiles past this request's entries: -inf only
    nt = gl.cdiv(n_b, _EPB)
    first = p0 + gl.cdiv(gl.maximum(nt - p0, 0), step) * step
    for tile in range(first, num_tiles, step):
        offs = tile * _EPB + rows
        gl.store(out_row + offs, gl.full([_EPB], float("-inf"), gl.float32, layout=gl.SliceLayout(1, ACC)),
                 mask=offs < max_entries)


@gluon.jit
def _scan_redo_kernel(q_ptr, w_ptr, redo_ptr, out_ptr, gmax_ptr, desc, bt_ptr, nent_ptr,
                      s_qb, s_qh, s_wb, s_ob, s_gb, s_bt, s_rb, n_prog, max_entries, max_blocks, out_scale, w_scale,
                      GMAX: gl.constexpr, PDL: gl.constexpr):
    """Program (b, r): the tiles the int8 scan left to the bf16 MMA in redo[b] (a count, then tile
    indices), entries r, r + R, ... (R programs a request); GMAX: each tile's scores also into the
    scan's group maxima (tile t's rows are group slots 64 (t mod n_prog) + r) by atomic max. One
    page in flight: the tiles are few (a key whose scale groups spread past 2^2, a request whose
    queries are not int8 integers of one unit a head)."""
    b = gl.program_id(0)
    r = gl.program_id(1)
    if PDL:                     # the scan's appends
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    cnt = gl.load(redo_ptr + b * s_rb)
    mine = gl.cdiv(gl.maximum(cnt - r, 0), gl.num_programs(1))
    if mine > 0:
        n_b = gl.minimum(gl.load(nent_ptr + b), max_entries)
        raw = gl.allocate_shared_memory(gl.int32, [1, 1, _PAGE_ROWS, _EPB], desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(ready.index(0), count=1)
        Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
        q_s = gl.allocate_shared_memory(gl.bfloat16, [64, 128], Q_SL)
        _store_q16(q_s, q_ptr, b, s_qb, s_qh)
        fence_async_shared()        # the barrier's initialisation and q's stores before the copies and MMAs
        _barrier()
        ACC: gl.constexpr = _acc()
        h = gl.arange(0, 64, layout=gl.SliceLayout(0, ACC))
        wts = gl.expand_dims(gl.load(w_ptr + b * s_wb + h).to(gl.float32) * w_scale, 0)
        rows = gl.arange(0, _EPB, layout=gl.SliceLayout(1, ACC))
        bt_row = bt_ptr + b.to(gl.int64) * s_bt
        out_row = out_ptr + b.to(gl.int64) * s_ob
        qt = q_s.permute((1, 0))
        for i in range(0, mine):
            tile = gl.load(redo_ptr + b * s_rb + 1 + r + i * gl.num_programs(1))
            _issue(raw, ready, desc, 0, _block(bt_row, tile, max_blocks))
            mbarrier.wait(ready.index(0), i & 1)
            words, srow = _load(raw, 0, raw, i, False)
            _barrier()              # every warp has read the page before the next copy
            sc = _tile16(words, srow, qt, wts, out_row, tile * _EPB, n_b, max_entries, out_scale)
            if GMAX:
                bits = sc.to(gl.int32, bitcast=True)
                gl.atomic_max(gmax_ptr + b.to(gl.int64) * s_gb + (tile % n_prog) * _EPB + rows,
                              gl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF))


@gluon.jit
def _prefill_scan_tma_kernel(q_ptr, w_ptr, q8_ptr, kw_ptr, fits_ptr, out_ptr, desc, bt_ptr, vis_ptr, grp_ptr,
                             s_qb, s_qh, s_wb, s_ob, s_bt, num_tiles, max_entries, max_blocks, out_scale, w_scale,
                             NS: gl.constexpr, TOKENS: gl.constexpr, PDL: gl.constexpr):
    """Program (g, p): rows r0 .. r0 + cnt - 1 of group g (grp[g] = (r0, cnt, request): up to TOKENS
    consecutive prefill tokens of one request, `indexer_prefill.token_groups`) on the request's tiles
    p, p + P, ..: each page copied and decoded once for all of the group's rows, then one MMA and
    epilogue a row (its int8 queries, offsets and weights from `_q8_kernel`, a row a token). Row r
    scores its first vis[r] entries, -inf past them. A tile whose keys are not narrow, or a group
    with a row whose queries are not int8 integers, takes the bf16 MMA (each row's bf16 queries
    stored in turn)."""
    g = gl.program_id(0)
    p0 = gl.program_id(1)
    step = gl.num_programs(1)
    r0 = gl.load(grp_ptr + 3 * g)
    cnt = gl.load(grp_ptr + 3 * g + 1)
    req = gl.load(grp_ptr + 3 * g + 2)
    ns = ()
    n_all = 0
    for t in gl.static_range(TOKENS):
        last = gl.minimum(r0 + t, r0 + cnt - 1)        # a short group's missing rows read its last (never stored)
        n_t = gl.where(t < cnt, gl.minimum(gl.load(vis_ptr + last), max_entries), 0)
        ns = ns + (n_t,)
        n_all = gl.maximum(n_all, n_t)
    mine = gl.cdiv(gl.maximum(gl.cdiv(n_all, _EPB) - p0, 0), step)
    raw, ready, spread_s, bt_row = _first_pages(desc, bt_ptr, req, s_bt, p0, step, mine, max_blocks, NS)
    if PDL:                         # `_q8_kernel`'s results (the pages' copies above go out before it ends)
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    Q8_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.int8)
    q8_s = gl.allocate_shared_memory(gl.int8, [TOKENS, 64, 128], Q8_SL)
    kw_s = gl.allocate_shared_memory(gl.int32, [2 * TOKENS, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [64, 128], Q_SL)
    Q8_L: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    h8q = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, Q8_L)), 1)
    k8q = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, Q8_L)), 0)
    KW_L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    q_fits = gl.load(fits_ptr + r0 * _Q8_BLOCKS) != 0
    for t in gl.static_range(TOKENS):
        row = gl.minimum(r0 + t, r0 + cnt - 1).to(gl.int64)
        q8_s.index(t).store(gl.load(q8_ptr + row * 8192 + h8q * 128 + k8q))
        for i in gl.static_range(2):
            kw_s.index(2 * t + i).store(gl.load(kw_ptr + row * 128 + i * 64 + gl.arange(0, 64, layout=KW_L)))
        for j in gl.static_range(_Q8_BLOCKS):     # every head block's flag (scalar loads)
            q_fits = q_fits & (gl.load(fits_ptr + row * _Q8_BLOCKS + j) != 0)
    fence_async_shared()            # the queries' generic-proxy stores before the MMAs' async-proxy reads
    _barrier()
    ACC: gl.constexpr = _acc()
    h = gl.arange(0, 64, layout=gl.SliceLayout(0, ACC))
    blk = _block(bt_row, p0 + NS * step, max_blocks)
    for it in range(0, mine):
        words, srow, narrow, blk = _next_page(raw, ready, spread_s, desc, bt_row, it, blk, p0, step, mine, max_blocks,
                                              NS, True)
        tile0 = (p0 + it * step) * _EPB
        if narrow & q_fits:
            keys8, glob8 = _decode8(words, srow)
            for t in gl.static_range(TOKENS):
                if t < cnt:
                    _scores8(keys8, glob8, q8_s.index(t).permute((1, 0)), kw_s.index(2 * t), kw_s.index(2 * t + 1),
                             out_ptr + (r0 + t).to(gl.int64) * s_ob, tile0, ns[t], max_entries, out_scale)
        else:
            keys, glob = _decode(words, srow)
            for t in gl.static_range(TOKENS):
                if t < cnt:
                    _store_q16(q_s, q_ptr, r0 + t, s_qb, s_qh)
                    fence_async_shared()
                    _barrier()
                    wts = gl.expand_dims(gl.load(w_ptr + (r0 + t) * s_wb + h).to(gl.float32) * w_scale, 0)
                    _scores16(keys, glob, q_s.permute((1, 0)), wts, out_ptr + (r0 + t).to(gl.int64) * s_ob, tile0,
                              ns[t], max_entries, out_scale)
                    _barrier()      # every warp's MMA has read q_s before the next row's queries go in
    # tiles past every row's entries: -inf only
    rows = gl.arange(0, _EPB, layout=gl.SliceLayout(1, ACC))
    nt = gl.cdiv(n_all, _EPB)
    first = p0 + gl.cdiv(gl.maximum(nt - p0, 0), step) * step
    for tile in range(first, num_tiles, step):
        offs = tile * _EPB + rows
        for t in gl.static_range(TOKENS):
            if t < cnt:
                gl.store(out_ptr + (r0 + t).to(gl.int64) * s_ob + offs,
                         gl.full([_EPB], float("-inf"), gl.float32, layout=gl.SliceLayout(1, ACC)),
                         mask=offs < max_entries)


@triton.jit
def _q8_kernel(q_ptr, w_ptr, q8_ptr, kw_ptr, fits_ptr, redo_ptr, s_qb, s_qh, s_wb, s_rb, w_scale, HB: tl.constexpr,
               REDO: tl.constexpr, PDL: tl.constexpr):
    """The int8 scan's queries of request b, program (b, j) its heads j HB .. j HB + HB - 1 (a short
    kernel: the scan's first tiles wait for it): q = q8 2^u a head, q8 integers below 128 in magnitude
    (2^u from the head's largest |q|), columns in the int8 MMA's K order (`_keys8`: dims 4 j .. 4 j + 3,
    j = 8 t + 2 i + hh, at columns 4 (8 i + 4 hh + t) ..); kw[b] = (the MMA's offset -64 sum_d q8 a
    head, w_scale w 2^(u + 100) a head as fp32 bits); fits[b, j] whether that is exact for every head of
    the block and each w ReLU(S) 2^(u + 100 - 149) a normal float (else the bf16 MMA). REDO: the
    count of redo[b] (`_scan_tma_kernel`'s tiles for the bf16 MMA) zeroed. PDL: see `pdl_enter`."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    if REDO:
        if tl.program_id(1) == 0:
            tl.store(redo_ptr + b * s_rb, 0)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    j = tl.arange(0, 32)[None, :, None]
    c = tl.arange(0, 4)[None, None, :]
    h3 = h[:, None, None]
    qf = tl.load(q_ptr + b * s_qb + h3 * s_qh + 4 * j + c).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(qf), axis=2), axis=1)
    u = tl.where(amax > 0, ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 133, 0)      # 2^(u + 7) > amax
    ok_u = (u >= -100) & (u <= 27)
    u = tl.where(ok_u, u, 0)
    qs = qf * ((127 - u) << 23).to(tl.float32, bitcast=True)[:, None, None]
    qi = qs.to(tl.int32)
    fits = (qi.to(tl.float32) == qs) & (qi < 128) & (qi > -128) & ok_u[:, None, None]
    col = 4 * (8 * ((j >> 1) & 3) + 4 * (j & 1) + (j >> 3)) + c
    tl.store(q8_ptr + b * 8192 + h3 * 128 + col, qi.to(tl.int8))
    w8 = tl.load(w_ptr + b * s_wb + h).to(tl.float32) * w_scale * ((u + 227) << 23).to(tl.float32, bitcast=True)
    w_ok = (w8 == 0.0) | ((tl.abs(w8) >= 2.0 ** 23) & (tl.abs(w8) < 2.0 ** 127))
    tl.store(kw_ptr + b * 128 + h, -64 * tl.sum(tl.sum(qi, axis=2), axis=1))
    tl.store(kw_ptr + b * 128 + 64 + h, w8.to(tl.int32, bitcast=True))
    fit = tl.min(tl.min(tl.min(fits.to(tl.int32), axis=2), axis=1), axis=0)
    fit = tl.minimum(fit, tl.min(w_ok.to(tl.int32), axis=0))
    tl.store(fits_ptr + b * tl.num_programs(1) + tl.program_id(1), fit)


def supported(q: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, fmt_name: str, epb: int, prec: int) -> bool:
    """Whether the TMA scan takes this call: mxfp4 keys at D_I = 128 and 64 heads, one
    bf16 dot (prec 1: queries rounded to mxfp4), 64 keys a page, pages whose key words and scale
    words the copies can address (16-byte aligned starts and page strides), an sm_90 GPU."""
    if not (GLUON_OK and fmt_name == "mxfp4" and prec == 1 and epb == EPB and q.is_cuda and q.shape[1:] == (64, 128)
            and torch.cuda.get_device_capability(q.device)[0] == 9):
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) == t.shape[2] and t.stride(2) == 1
               for t in (data, scale)) and data.shape[1:] == (EPB, 64) and scale.shape[1:] == (EPB, 4) and \
        scale.stride(0) == data.stride(0) and scale.data_ptr() == data.data_ptr() + EPB * 64   # one page, as stored


def _descriptor(data: torch.Tensor, scale: torch.Tensor) -> TensorDescriptor:
    """One copy a page: its key words and the scale words right after them, rows 0-16 of 64 int32 in
    a box of 32 (`_PAGE_ROWS`)."""
    nb = data.shape[0]
    page = torch.as_strided(data.view(torch.int32), (nb, 17, EPB), (data.stride(0) // 4, EPB, 1))
    return TensorDescriptor.from_tensor(page, [1, 32, EPB], _flat(3))


def programs_per_request(programs: int, max_entries: int) -> int:
    """The grid's programs a request (P): `programs`, at most one a tile."""
    return max(1, min(programs, triton.cdiv(max_entries, EPB)))


def launch(q: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
           block_table: torch.Tensor, num_entries: torch.Tensor, max_entries: int, weight_scale: float,
           programs: int, *, stages: int = STAGES, maxnreg: int | None = None, int8: bool = INT8,
           gmax: torch.Tensor | None = None):
    """Scores of q [B, 64, 128] (fp32 or bf16, rounded to mxfp4) into out [B, max_entries] fp32; with
    gmax [B, 64 P] int32 (P = `programs_per_request`) also the group maxima of each row (`_scan_tma_kernel`)."""
    bsz = q.shape[0]
    tiles = triton.cdiv(max_entries, EPB)
    nprog = programs_per_request(programs, max_entries)
    if gmax is not None:
        assert gmax.shape == (bsz, nprog * EPB) and gmax.dtype == torch.int32 and gmax.stride(1) == 1
    desc = _descriptor(data, scale)
    chain = int8 and pdl(q.device)    # the scan set up while `_q8_kernel` runs
    # the int8 scan's tiles for the bf16 MMA: a count (zeroed by `_q8_kernel`), then up to every tile
    redo = torch.empty(bsz, tiles + 1, dtype=torch.int32, device=q.device) if int8 else None
    q8, kw, fits = _queries8(q, weights, weight_scale, chain, run=int8, redo=redo)
    gm = gmax if gmax is not None else kw
    scan = (q, weights, q8, kw, fits, redo if int8 else kw, out, gm, desc, block_table, num_entries,
            q.stride(0), q.stride(1), weights.stride(0), out.stride(0), gmax.stride(0) if gmax is not None else 0,
            block_table.stride(0), redo.stride(0) if int8 else 0)
    k = _scan_tma_kernel[(bsz, nprog)](
        *scan, tiles, max_entries, block_table.shape[1], 128 ** -0.5, weight_scale,
        NS=stages, INT8=int8, GMAX=gmax is not None, PDL=chain, num_warps=4,
        maxnreg=maxnreg or (MAXNREG_INT8 if int8 else MAXNREG), **({"launch_pdl": True} if chain else {}))
    if int8:
        _scan_redo_kernel[(bsz, nprog)](
            q, weights, redo, out, gm, desc, block_table, num_entries, q.stride(0), q.stride(1),
            weights.stride(0), out.stride(0), gmax.stride(0) if gmax is not None else 0, block_table.stride(0),
            redo.stride(0), nprog, max_entries, block_table.shape[1], 128 ** -0.5, weight_scale,
            GMAX=gmax is not None, PDL=chain, num_warps=4, **({"launch_pdl": True} if chain else {}))
    return k


def _queries8(q: torch.Tensor, weights: torch.Tensor, weight_scale: float, chain: bool, run: bool = True,
              redo: torch.Tensor | None = None):
    """`_q8_kernel` over q's rows (run=False: the buffers alone, never read): q8 [R, 64, 128] int8,
    kw [R, 128] int32, fits [R, Q8_BLOCKS] int32; redo's counts (column 0) zeroed."""
    rows = q.shape[0]
    q8 = torch.empty(rows, 64, 128, dtype=torch.int8, device=q.device)
    kw = torch.empty(rows, 128, dtype=torch.int32, device=q.device)
    fits = torch.empty(rows, Q8_BLOCKS, dtype=torch.int32, device=q.device)
    if run:
        _q8_kernel[(rows, Q8_BLOCKS)](q, weights, q8, kw, fits, redo if redo is not None else fits, q.stride(0),
                                      q.stride(1), weights.stride(0), redo.stride(0) if redo is not None else 0,
                                      weight_scale, HB=64 // Q8_BLOCKS, REDO=redo is not None, PDL=chain, num_warps=4,
                                      **({"launch_pdl": True} if chain else {}))
    return q8, kw, fits


def launch_prefill(q: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, data: torch.Tensor,
                   scale: torch.Tensor, block_table: torch.Tensor, visible: torch.Tensor, groups: torch.Tensor,
                   max_entries: int, weight_scale: float, *, tokens: int, programs: int = 1, stages: int = STAGES,
                   maxnreg: int | None = None):
    """Scores of a prefill chunk's rows q [T, 64, 128] (fp32 or bf16, rounded to mxfp4) into out [T,
    max_entries] fp32 (`_prefill_scan_tma_kernel`): groups [G, 3] int32 as `indexer_prefill.token_groups`
    with at most `tokens` rows each, visible [T] int32, block_table rows per request."""
    tiles = triton.cdiv(max_entries, EPB)
    nprog = programs_per_request(programs, max_entries)
    desc = _descriptor(data, scale)
    chain = pdl(q.device)       # the scan set up while `_q8_kernel` runs
    q8, kw, fits = _queries8(q, weights, weight_scale, chain)
    return _prefill_scan_tma_kernel[(groups.shape[0], nprog)](
        q, weights, q8, kw, fits, out, desc, block_table, visible, groups,
        q.stride(0), q.stride(1), weights.stride(0), out.stride(0), block_table.stride(0), tiles, max_entries,
        block_table.shape[1], 128 ** -0.5, weight_scale, NS=stages, TOKENS=tokens, PDL=chain, num_warps=4,
        maxnreg=maxnreg or PREFILL_MAXNREG, **({"launch_pdl": True} if chain else {}))
