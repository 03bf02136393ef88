"""Wide decode attention (Gluon, sm_90): all 64 heads and all 512 value channels of one (request,
key split) in one warp-specialised program, fp8_ds keys (the "wide" scheme of `decode_attention`).

    grid (B, 1, S): program (b, split) runs an online softmax over key tiles split, split + S, ...
    of one index space (the window ring's 64-key tiles, then the entries'), as the halves scheme
    (`decode_attention_halves`) does, and writes its split's partial for `decode_combine`: acc / l
    [H, D] as fp16 (`_store_part`) and the softmax stats (m, l). The normalised fp16 partial halves
    the bytes stored and combined (H200, 128K B = 64, op with its combine: CSA 34.9 -> 31.3 µs, HCA
    45.9 -> 42.8) for ~1.5e-4 more error against the fp32 reference (CSA 3.0e-4 -> 4.3e-4 of the
    largest output, `benchmarks/wide_accuracy.py`), below the layer's bf16 output rounding.

Three warpgroups run side by side (`gl.warp_specialize`), handing tiles over through mbarriers:

    loader  (4 warps): the row lookups (positions / CSA indices, then block-table rows) two tiles
            ahead; a 64-key tile's first four chunks of e4m3 bytes by cp.async into shared memory
            (16 KB) a tile ahead, its other chunks, rope and scale words into registers; all
            dequantised (e4m3 x 2^(e - 127) per 64 channels, as `decode_common.key_operand`) into
            one of two fp16 [64, 512] NVMMA key tiles, the key mask beside it; then k_ready.
    scores  (4 warps, the default partition): q [64, 512] fp16 into shared memory, then per tile
            S = q . K^T [64 heads, 64 keys] (one warpgroup MMA), the online softmax, p (fp16) and
            the rescale factor into shared memory for the values warpgroup (p_ready), and
            acc[:, :256] += p . V (V = the same key tile).
    values  (4 warps): acc[:, 256:] rescaled, += p . V with p from shared memory.

Both MMA warpgroups free a key tile when their p . V is done (k_free, count 2), the values one frees
p (p_free). Two key tiles and two p tiles: the loader fills tile i + 1 and the values warpgroup runs
p . V of tile i while the scores warpgroup computes. Registers are split 192 / 160 / 152 a thread
(scores: acc 128 + S 32 + p 16). Static grid, no host reads: capturable in a CUDA graph.

The loader bounds the loop: at HCA B = 64 on an H100 a tile took 3.0 µs a program, 1.75 with the
loader's loads and dequantisation taken out (1.27 with the softmax taken out too). With every load
of a tile in registers the loader waited out each tile's DRAM latency, since the proxy fence before
the MMAs read a tile waits for every load the thread has in flight; cp.async copies are not waited
for, so the staged chunks arrive under the previous tile's work: 2.65 µs a tile (H100,
`benchmarks/wide_phases.py`, HCA B = 64, op 128K 44.9 -> 40.9 µs, 512K 117.6 -> 104.0; CSA 33.0 ->
30.1). Staging six chunks in the room of one of the two p tiles was slower (HCA 128K 44.0 µs), and so
were L2 prefetches of the next tiles, other orders of the loop, the staged chunks read together, a
cp.async copy of a bf16 q, and the rope stored by the values warpgroup (benchmarks/NOTES.md, forty-first
round): the loader issues on ~15% of its cycles and waits out shared-memory and DRAM latency the rest.

Why: the first form of this scheme was one 8-warp program running each tile's steps one after
another (cp.async copies, dequantisation, S, softmax, p . V) with two warps a scheduler to hide
them; it spent ~4.2 µs a tile against ~2.95 here. Measured (H200, Triton 3.6, bf16 q, the op with
its combine, `benchmarks/wide_phases.py`), one-program / warp-specialised µs: 128K B = 64 CSA
39.2 / 35.5, HCA 56.0 / 46.2; B = 16 CSA 23.9 / 22.0, HCA 27.5 / 24.6; B = 4 CSA 15.8 / 16.0, HCA
17.9 / 17.2; 512K B = 64 HCA 156.4 / 117.3. See benchmarks/NOTES.md, thirty-first round.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dsv4.kernels.triton.decode_common import TRITON_VERSION, pdl_launch

# the CTA-wide barrier (a partition's own named barrier inside `warp_specialize`): `thread_barrier`
# in Triton 3.6, `barrier` from 3.7
_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
# cp.async into shared memory: `async_copy_global_to_shared` in Triton 3.6, `async_load` from 3.7
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# a shared buffer's bytes under another type and shape: `_reinterpret` in Triton 3.6, `reinterpret` in 3.9
_REINTERPRET_PUBLIC = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
#: Gluon's API as written here: Triton 3.6 (measured) to 3.9 (compiled); earlier ones differ
GLUON_OK = TRITON_VERSION >= (3, 6)


@gluon.jit
def _view(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """buf's bytes as a [shape] dtype buffer in layout (no copy), on either spelling of Gluon's call."""
    if _REINTERPRET_PUBLIC:
        return buf.reinterpret(dtype, shape, layout)
    else:
        return buf._reinterpret(dtype, shape, layout)

#: keys a tile
BLOCK_N = 64
_BN = gl.constexpr(BLOCK_N)
#: registers a thread of the values and loader warpgroups; the scores warpgroup gets the rest of
#: MAXNREG x 12 warps (192: acc 128 + S 32 + p 16 a thread; at 184 it spills its accumulator)
REGS = (160, 152)
MAXNREG = 168
#: chunks of a tile staged in shared memory by cp.async a tile ahead (chunks 4-6 and the rope go
#: through registers): 16 KB, what the queries, key and p tiles leave
_ST = gl.constexpr(4)


@gluon.jit
def _stage_index(tile, b, slot, n_wt, swa_pos_ptr, idx_ptr, s_pos, s_idx, ring, n_comp, MODE: gl.constexpr,
                 LAYOUT: gl.constexpr):
    """Stage 1 of a tile (three tiles ahead): the loads of its ring positions (window tiles) or
    selected entry indices (CSA), left in flight. One key a thread."""
    cw = tile * _BN + gl.arange(0, _BN, layout=LAYOUT)
    wv = gl.load(swa_pos_ptr + slot * s_pos + cw, mask=(cw < ring) & (tile < n_wt), other=-1)
    if MODE == 1:
        ce = cw - n_wt * _BN
        ev = gl.load(idx_ptr + b * s_idx + ce, mask=(ce >= 0) & (ce < n_comp), other=-1)
    else:
        ev = wv
    return wv, ev


@gluon.jit
def _stage_page(tile, wv, ev, b, t, n_wt, n_c, bt_ptr, s_bt, window, epb, max_blocks, MODE: gl.constexpr,
                LAYOUT: gl.constexpr):
    """Stage 2 (two tiles ahead): each key's ok and row (ring row or row in its block) from stage 1's
    values, and the block-table loads, left in flight."""
    cw = tile * _BN + gl.arange(0, _BN, layout=LAYOUT)
    win = tile < n_wt
    ok_w = (wv >= 0) & (wv <= t) & (wv > t - window)
    ce = cw - n_wt * _BN
    if MODE == 1:
        we = ev.to(gl.int32)
        ok_e = we >= 0
    else:
        we = ce
        ok_e = (ce >= 0) & (ce < n_c)
    we = gl.maximum(we, 0)
    if MODE == 0:
        blk = gl.zeros_like(we)
    else:
        blk = gl.load(bt_ptr + b * s_bt + gl.minimum(we // epb, max_blocks - 1), mask=ok_e & (tile >= n_wt), other=0)
    return blk, gl.where(win, cw, we % epb), gl.where(win, ok_w, ok_e)


@gluon.constexpr_function
def _chunk():
    """[BLOCK_N, 64]: one 64-channel chunk of e4m3 bytes a row over one warpgroup, 16 consecutive bytes
    a thread (four threads a row, eight rows a warp, two rows a thread)."""
    return gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])


@gluon.constexpr_function
def _rope():
    """[BLOCK_N, 64] bf16 rope over the same threads and rows as `_chunk`, 16 bytes a thread."""
    return gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])


@gluon.constexpr_function
def _rows():
    """One value a key row (lookups, masks, scale words), held by the threads that load the row."""
    return gl.SliceLayout(1, _chunk())


@gluon.constexpr_function
def _staged():
    """A staged chunk [BLOCK_N, 64] of e4m3 bytes in shared memory: 16-byte vectors, XOR-swizzled
    over four 64-byte rows so that a warp's eight rows of `_chunk` reads hit distinct banks."""
    return gl.SwizzledSharedLayout(16, 2, 4, [1, 0])


@gluon.jit
def _chunk_ptrs(ckv_ptr, kv, ok, C: gl.constexpr, NOPE: gl.constexpr):
    """Pointers and mask of chunk C of the tile's rows (kv: row offsets in bytes, `_rows`)."""
    j = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, _chunk())), 0) + C * 64
    return ckv_ptr + gl.expand_dims(kv, 1) + j, gl.expand_dims(ok, 1) & (j < NOPE)


@gluon.jit
def _store_chunk(kt, x, sw, C: gl.constexpr):
    """x [BLOCK_N, 64] e4m3 -> fp16 x 2^(e - 127), e the row's scale byte C (exact for scales 2^-15 ..
    2^7, as `decode_common.key_operand`) into columns C * 64 .. of the key tile."""
    e = ((sw >> (8 * C)) & 0xFF).to(gl.int32)
    f = (e << 23).to(gl.float32, bitcast=True).to(gl.float16)
    kt.slice(C * 64, 64, dim=1).store(x.to(gl.float16) * gl.expand_dims(f, 1))


@gluon.jit
def _stage_copies(raw_s, ckv_ptr, kv, ok, NOPE: gl.constexpr):
    """cp.async of chunks 0 .. 3 of a tile's rows into raw_s (one commit group). Copied and
    read back in the same layout, each thread's reads are its own copies: its wait_group suffices."""
    for c in gl.static_range(_ST):
        ptrs, m = _chunk_ptrs(ckv_ptr, kv, ok, c, NOPE)
        _async_load(raw_s.index(c), ptrs, mask=m)
    async_copy.commit_group()


@gluon.jit
def _tile_rows(tile, blk, row, ok, slot, n_wt, s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr,
               s_csp, s_csr, ring_kv, ring_rope, ring_sc):
    """A tile's row offsets (e4m3 bytes, rope, scale word) addressed from the pool's bases (the ring's
    at ring_* + the request's slot): no pointer selects."""
    win = tile < n_wt
    page = gl.maximum(blk, 0).to(gl.int64)
    r = row.to(gl.int64)
    kv = gl.multiple_of(gl.where(win, ring_kv + slot * s_wkp + r * s_wkr, page * s_ckp + r * s_ckr), 16)
    rp = gl.multiple_of(gl.where(win, ring_rope + slot * s_wrp + r * s_wrr, page * s_crp + r * s_crr), 8)
    sc = gl.where(win, ring_sc + slot * s_wsp + r * s_wsr, page * s_csp + r * s_csr)
    return kv, rp, sc


@gluon.jit
def _entry_prologue(raw_s, swa_pos_ptr, idx_ptr, bt_ptr, ckv_ptr, csc_ptr, s_pos, s_idx, s_bt, s_wkp, s_wkr, s_wrp,
                    s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, ring_kv, ring_rope, ring_sc, b, slot,
                    t, split, n_split, n_wt, n_c, ring, window, epb, max_blocks, n_comp, MODE: gl.constexpr,
                    NOPE: gl.constexpr):
    """The loader's start: tile `split`'s rows, staged chunks and scale words in flight, tile
    split + n_split's page lookups and tile split + 2 n_split's index lookups (`_loader_loop`'s state)."""
    KL: gl.constexpr = _rows()
    strides = (s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr)
    wv, ev = _stage_index(split, b, slot, n_wt, swa_pos_ptr, idx_ptr, s_pos, s_idx, ring, n_comp, MODE, KL)
    blk, row, ok = _stage_page(split, wv, ev, b, t, n_wt, n_c, bt_ptr, s_bt, window, epb, max_blocks, MODE, KL)
    wv, ev = _stage_index(split + n_split, b, slot, n_wt, swa_pos_ptr, idx_ptr, s_pos, s_idx, ring, n_comp, MODE, KL)
    kv, rp, sc = _tile_rows(split, blk, row, ok, slot, n_wt, *strides, ring_kv, ring_rope, ring_sc)
    _stage_copies(raw_s, ckv_ptr, kv, ok, NOPE)
    sw = gl.load((csc_ptr + sc).to(gl.pointer_type(gl.uint64)), mask=ok, other=0)
    blk_n, row_n, ok_n = _stage_page(split + n_split, wv, ev, b, t, n_wt, n_c, bt_ptr, s_bt, window, epb,
                                     max_blocks, MODE, KL)
    wv, ev = _stage_index(split + 2 * n_split, b, slot, n_wt, swa_pos_ptr, idx_ptr, s_pos, s_idx, ring, n_comp,
                          MODE, KL)
    return kv, rp, ok, sw, blk_n, row_n, ok_n, wv, ev


@gluon.jit
def _loader_loop(k_s, bias_s, raw_s, k_ready, k_free, swa_pos_ptr, idx_ptr, bt_ptr, ckv_ptr, crope_ptr, csc_ptr,
                 s_pos, s_idx, s_bt, s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr,
                 ring_kv, ring_rope, ring_sc, b, slot, t, split, n_split, mine, n_wt, n_c, ring, window, epb,
                 max_blocks, n_comp, kv, rp, ok, sw, blk_n, row_n, ok_n, wv, ev, it0, MODE: gl.constexpr,
                 NOPE: gl.constexpr):
    """The loader's `mine` tiles from `_entry_prologue`'s state; it0: tiles the key buffers took
    before (the prefill kernel's window tiles and earlier tokens), so each tile's buffer and phase
    continue theirs."""
    KL: gl.constexpr = _rows()
    RL: gl.constexpr = _rope()
    RROWS: gl.constexpr = gl.SliceLayout(1, RL)
    jr = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, RL)), 0)
    strides = (s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr)
    for it in range(0, mine):
        tile = split + it * n_split
        buf = (it + it0) % 2
        # this tile's register chunks and rope, and the next tile's scale words, in flight ...
        p4, m4 = _chunk_ptrs(ckv_ptr, kv, ok, 4, NOPE)
        p5, m5 = _chunk_ptrs(ckv_ptr, kv, ok, 5, NOPE)
        p6, m6 = _chunk_ptrs(ckv_ptr, kv, ok, 6, NOPE)
        x4 = gl.load(p4, mask=m4, other=0.0)
        x5 = gl.load(p5, mask=m5, other=0.0)
        x6 = gl.load(p6, mask=m6, other=0.0)
        rp2 = gl.expand_dims(gl.convert_layout(rp, RROWS), 1)
        okr = gl.expand_dims(gl.convert_layout(ok, RROWS), 1)
        xr = gl.load(crope_ptr + rp2 + jr, mask=okr & (jr < 64), other=0.0)
        kv_n, rp_n, sc_n = _tile_rows(tile + n_split, blk_n, row_n, ok_n, slot, n_wt, *strides, ring_kv, ring_rope,
                                      ring_sc)
        sw_n = gl.load((csc_ptr + sc_n).to(gl.pointer_type(gl.uint64)), mask=ok_n, other=0)
        # ... under the staged chunks' dequantisation, once both MMA warpgroups are done with tile it - 2
        async_copy.wait_group(0)
        mbarrier.wait(k_free.index(buf), (((it + it0) // 2) & 1) ^ 1)
        kt = k_s.index(buf)
        bias_s.index(buf).store(gl.where(ok, 0.0, float("-inf")))
        for c in gl.static_range(_ST):
            _store_chunk(kt, raw_s.index(c).load(_chunk()), sw, c)
        # the next tile's staged chunks (each thread overwrites only the bytes it has just read)
        _stage_copies(raw_s, ckv_ptr, kv_n, ok_n, NOPE)
        blk_n, row_n, ok_nn = _stage_page(tile + 2 * n_split, wv, ev, b, t, n_wt, n_c, bt_ptr, s_bt, window, epb,
                                          max_blocks, MODE, KL)
        wv, ev = _stage_index(tile + 3 * n_split, b, slot, n_wt, swa_pos_ptr, idx_ptr, s_pos, s_idx, ring, n_comp,
                              MODE, KL)
        _store_chunk(kt, x4, sw, 4)
        _store_chunk(kt, x5, sw, 5)
        _store_chunk(kt, x6, sw, 6)
        kt.slice(NOPE, 64, dim=1).store(xr.to(gl.float16))
        fence_async_shared()            # generic-proxy stores before the MMAs' async-proxy reads
        _barrier()                      # ... from all four warps before the one arrive
        mbarrier.arrive(k_ready.index(buf), count=1)
        kv, rp, ok, sw = kv_n, rp_n, ok_n, sw_n      # tile + n_split's
        ok_n = ok_nn                                # tile + 2 n_split's, with blk_n and row_n
    async_copy.wait_group(0)            # no copy outlives the program


@gluon.jit
def _loader(k_s, bias_s, raw_s, k_ready, k_free, swa_pos_ptr, idx_ptr, bt_ptr, ckv_ptr, crope_ptr, csc_ptr,
            s_pos, s_idx, s_bt, s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr,
            ring_kv, ring_rope, ring_sc, b, slot, t, split, n_split, mine, n_wt, n_c, ring, window, epb, max_blocks,
            n_comp, MODE: gl.constexpr, NOPE: gl.constexpr):
    # A tile's first four chunks reach shared memory by cp.async a tile ahead; its other chunks,
    # rope and key mask are loaded into registers at the top of its iteration and used after the
    # staged chunks are dequantised. The tile's proxy fence (before the MMAs read it) waits for every
    # load a thread has in flight, but not for cp.async copies: register loads cannot stay in flight
    # across it, the staged chunks do.
    # The lookups run in the rows' threads: no layout conversion between them and the loads.
    state = _entry_prologue(raw_s, swa_pos_ptr, idx_ptr, bt_ptr, ckv_ptr, csc_ptr, s_pos, s_idx, s_bt, s_wkp, s_wkr,
                            s_wrp, s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, ring_kv, ring_rope,
                            ring_sc, b, slot, t, split, n_split, n_wt, n_c, ring, window, epb, max_blocks, n_comp,
                            MODE, NOPE)
    _loader_loop(k_s, bias_s, raw_s, k_ready, k_free, swa_pos_ptr, idx_ptr, bt_ptr, ckv_ptr, crope_ptr, csc_ptr,
                 s_pos, s_idx, s_bt, s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr,
                 ring_kv, ring_rope, ring_sc, b, slot, t, split, n_split, mine, n_wt, n_c, ring, window, epb,
                 max_blocks, n_comp, *state, 0, MODE, NOPE)


@gluon.jit
def _store_part(part_ptr, acc, l_i, stage, b, split, s_pb, s_ps, s_ph, D0: gl.constexpr, O_L: gl.constexpr):
    """The normalised partial acc / l (0 where the split saw no key) as fp16 into channels D0 .. of
    part[b, split]: a convex combination of fp16 values (|v| <= 448 2^7), so fp16 holds it; half the
    bytes of fp32 partials for the kernel to store and the combine to read. Through shared memory
    (`stage`, the queries' tile, free once the scores warpgroup's MMAs are done): the accumulator's
    layout gives each row 16-byte pieces, half a sector, which the L2 would complete from DRAM."""
    H: gl.constexpr = acc.shape[0]
    W: gl.constexpr = acc.shape[1]
    inv = gl.where(l_i > 0.0, 1.0 / l_i, 0.0)
    stage.store((acc * gl.expand_dims(inv, 1)).to(gl.float16))
    _barrier()
    ST_L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    ho = gl.arange(0, H, layout=gl.SliceLayout(1, ST_L))
    do = gl.arange(0, W, layout=gl.SliceLayout(0, ST_L)) + D0
    gl.store(part_ptr + b * s_pb + split * s_ps + gl.expand_dims(ho, 1) * s_ph + gl.expand_dims(do, 0),
             stage.load(ST_L))


@gluon.jit
def _values_tile(k_s, p_s, a_s, k_ready, k_free, p_ready, p_free, g, acc, D: gl.constexpr, O_L: gl.constexpr):
    """The values warpgroup's step of key tile g (counted over the program's tiles): acc[:, D/2:]
    rescaled, += p . V with the scores warpgroup's p; frees the key and p buffers."""
    buf = g % 2
    ph = (g // 2) & 1
    mbarrier.wait(k_ready.index(buf), ph)
    mbarrier.wait(p_ready.index(buf), ph)
    alpha = a_s.index(buf).load(gl.SliceLayout(1, O_L))
    acc = acc * gl.expand_dims(alpha, 1)
    acc = warpgroup_mma(p_s.index(buf), k_s.index(buf).slice(D // 2, D // 2, dim=1), acc)
    _barrier()
    mbarrier.arrive(k_free.index(buf), count=1)
    mbarrier.arrive(p_free.index(buf), count=1)
    return acc


@gluon.jit
def _scores_tile(q_s, k_s, p_s, a_s, bias_s, k_ready, k_free, p_ready, p_free, g, m_i, l_i, acc, s0, qk_scale,
                 D: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr, P_L: gl.constexpr):
    """The scores warpgroup's step of key tile g: S = q . K^T, the online softmax, p and the rescale
    factor handed to the values warpgroup, acc[:, :D/2] += p . V -> (m_i, l_i, acc)."""
    buf = g % 2
    ph = (g // 2) & 1
    mbarrier.wait(k_ready.index(buf), ph)
    kt = k_s.index(buf)
    s = warpgroup_mma(q_s, kt.permute((1, 0)), s0, use_acc=False, is_async=True)
    bias = bias_s.index(buf).load(gl.SliceLayout(0, S_L))        # under the MMA
    s = warpgroup_mma_wait(0, deps=[s])
    s = s * qk_scale + gl.expand_dims(bias, 0)
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)     # no key yet: keep exp2 finite
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    m_i = m_new
    p16 = p.to(gl.float16)
    mbarrier.wait(p_free.index(buf), ph ^ 1)        # the values warpgroup is done with tile g - 2's p
    p_s.index(buf).store(p16)
    a_s.index(buf).store(alpha)
    fence_async_shared()
    _barrier()
    mbarrier.arrive(p_ready.index(buf), count=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
    acc = warpgroup_mma(gl.convert_layout(p16, P_L), kt.slice(0, D // 2, dim=1), acc)
    _barrier()
    mbarrier.arrive(k_free.index(buf), count=1)
    return m_i, l_i, acc


@gluon.jit
def _values(q_s, k_s, p_s, a_s, l_s, k_ready, k_free, p_ready, p_free, l_ready, part_ptr, s_pb, s_ps, s_ph, b, split,
            mine, D: gl.constexpr, H: gl.constexpr):
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    acc = gl.zeros([H, D // 2], gl.float32, layout=O_L)
    for it in range(0, mine):
        acc = _values_tile(k_s, p_s, a_s, k_ready, k_free, p_ready, p_free, it, acc, D, O_L)
    mbarrier.wait(l_ready.index(0), 0)              # the scores warpgroup's softmax sums, its MMAs done
    _store_part(part_ptr, acc, l_s.load(gl.SliceLayout(1, O_L)), q_s.slice(D // 2, D // 2, dim=1), b, split,
                s_pb, s_ps, s_ph, D // 2, O_L)


@gluon.jit
def _scores(q_ptr, s_qb, s_qh, q_s, k_s, p_s, a_s, bias_s, l_s, k_ready, k_free, p_ready, p_free, l_ready, part_ptr,
            pml_ptr, s_pb, s_ps, s_ph, b, split, n_split, mine, qk_scale, D: gl.constexpr, H: gl.constexpr):
    # q into shared memory as fp16, half the channels at a time, while the loader fetches the first tile
    Q_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    hq = gl.expand_dims(gl.arange(0, H, layout=gl.SliceLayout(1, Q_L)), 1)
    dq = gl.expand_dims(gl.arange(0, D // 2, layout=gl.SliceLayout(0, Q_L)), 0)
    for c in gl.static_range(2):
        q_s.slice(c * (D // 2), D // 2, dim=1).store(
            gl.load(q_ptr + b * s_qb + hq * s_qh + dq + c * (D // 2)).to(gl.float16))
    fence_async_shared()
    _barrier()
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    m_i = gl.full([H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([H], gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([H, D // 2], gl.float32, layout=O_L)
    s0 = gl.zeros([H, _BN], gl.float32, layout=S_L)
    for it in range(0, mine):
        m_i, l_i, acc = _scores_tile(q_s, k_s, p_s, a_s, bias_s, k_ready, k_free, p_ready, p_free, it, m_i, l_i, acc,
                                     s0, qk_scale, D, S_L, O_L, P_L)
    l_s.store(l_i)                                  # for the values warpgroup's half
    _barrier()
    mbarrier.arrive(l_ready.index(0), count=1)
    _store_part(part_ptr, acc, gl.convert_layout(l_i, gl.SliceLayout(1, O_L)), q_s.slice(0, D // 2, dim=1), b,
                split, s_pb, s_ps, s_ph, 0, O_L)
    hs = gl.arange(0, H, layout=gl.SliceLayout(1, S_L))
    ml = pml_ptr + ((b * n_split + split) * H + hs) * 2
    gl.store(ml, m_i)
    gl.store(ml + 1, l_i)


@gluon.jit
def _pdl_enter(PDL: gl.constexpr):
    """As `decode_common.pdl_enter`: wait for the kernel before, then let the one after launch."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _buffers(H: gl.constexpr, D: gl.constexpr):
    """The program's shared memory: q, two key tiles, two p tiles with their rescale factors, the key
    masks, the staged chunks, the softmax sums, and the hand-over mbarriers (initialised)."""
    QS_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, D], gl.float16)
    K_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BN, D], gl.float16)
    P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, _BN], gl.float16)
    q_s = gl.allocate_shared_memory(gl.float16, [H, D], QS_L)
    k_s = gl.allocate_shared_memory(gl.float16, [2, _BN, D], K_SL)
    p_s = gl.allocate_shared_memory(gl.float16, [2, H, _BN], P_SL)
    a_s = gl.allocate_shared_memory(gl.float32, [2, H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bias_s = gl.allocate_shared_memory(gl.float32, [2, _BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    raw_s = gl.allocate_shared_memory(gl.float8e4nv, [_ST, _BN, 64], _staged())
    l_s = gl.allocate_shared_memory(gl.float32, [H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    l_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(l_ready.index(0), count=1)
    for i in gl.static_range(2):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_free.index(i), count=2)
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=1)
    return q_s, k_s, p_s, a_s, bias_s, raw_s, l_s, k_ready, k_free, p_ready, p_free, l_ready


@gluon.jit
def _wide_kernel(
        q_ptr, part_ptr, pml_ptr,
        wkv_ptr, wrope_ptr, wsc_ptr, swa_pos_ptr, slots_ptr, pos_ptr,
        ckv_ptr, crope_ptr, csc_ptr, bt_ptr, idx_ptr, nent_ptr,
        s_qb, s_qh, s_pb, s_ps, s_ph,
        s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_pos,
        s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, s_bt, s_idx,
        ring, window, epb, max_blocks, n_comp, qk_scale, ring_kv, ring_rope, ring_sc,
        H: gl.constexpr, D: gl.constexpr, NOPE: gl.constexpr, MODE: gl.constexpr, VALUE_REGS: gl.constexpr,
        LOADER_REGS: gl.constexpr, PDL: gl.constexpr):
    """Program (b, 0, split) -> part[b, split, :, :] (acc / l [H, D] fp16), pml[b, split, :, :] (m, l).
    PDL: launched while the kernel before it runs; waits for it here, then lets the combine launch
    (as `decode_common.pdl_enter`). H200, 128K, layers: B = 64 CSA 242.3-242.9 -> 239.3-240.1 µs, HCA
    127.9 -> 126.3-126.6, B = 16 -1 µs each (the op alone +-0.4)."""
    _pdl_enter(PDL)
    b = gl.program_id(0)
    split = gl.program_id(2)
    n_split = gl.num_programs(2)
    (q_s, k_s, p_s, a_s, bias_s, raw_s, l_s, k_ready, k_free, p_ready, p_free, l_ready) = _buffers(H, D)

    slot = gl.load(slots_ptr + b).to(gl.int64)
    t = gl.load(pos_ptr + b)
    n_wt = gl.cdiv(ring, _BN)
    if MODE == 2:
        n_c = gl.minimum(gl.load(nent_ptr + b), n_comp)     # ragged: stop at this request's end
    elif MODE == 1:
        n_c = n_comp
    else:
        n_c = 0
    n_tiles = n_wt + gl.cdiv(n_c, _BN)
    mine = gl.cdiv(gl.maximum(n_tiles - split, 0), n_split)
    gl.warp_specialize([
        (_scores, (q_ptr, s_qb, s_qh, q_s, k_s, p_s, a_s, bias_s, l_s, k_ready, k_free, p_ready, p_free, l_ready,
                   part_ptr, pml_ptr, s_pb, s_ps, s_ph, b, split, n_split, mine, qk_scale, D, H)),
        (_values, (q_s, k_s, p_s, a_s, l_s, k_ready, k_free, p_ready, p_free, l_ready, part_ptr, s_pb, s_ps, s_ph,
                   b, split, mine, D, H)),
        (_loader, (k_s, bias_s, raw_s, k_ready, k_free, swa_pos_ptr, idx_ptr, bt_ptr, ckv_ptr, crope_ptr, csc_ptr,
                   s_pos, s_idx, s_bt, s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr, s_csp,
                   s_csr, ring_kv, ring_rope, ring_sc, b, slot, t, split, n_split, mine, n_wt, n_c, ring, window, epb,
                   max_blocks, n_comp, MODE, NOPE)),
    ], [4, 4], [VALUE_REGS, LOADER_REGS])


def _elements_between(ring: torch.Tensor, pool: torch.Tensor) -> int:
    """The ring view's start as an element offset from the pool view's: the kernel addresses both
    from the pool's pointer, so a tile's rows need no pointer select."""
    diff = ring.data_ptr() - pool.data_ptr()
    assert diff % ring.element_size() == 0
    return diff // ring.element_size()


def supported(q: torch.Tensor, keys: tuple, dim: int, nope: int, fmt_name: str) -> bool:
    """Whether the wide kernel takes this call: fp8_ds entries of 448 + 64 channels whose e4m3 and rope
    rows start on 16-byte boundaries (its 16-byte copies), 64 heads, an sm_90 GPU (warpgroup MMAs),
    Triton 3.6 or later."""
    if not (GLUON_OK and fmt_name == "fp8_ds" and q.is_cuda and q.shape[1] == 64 and dim == 512 and nope == 448
            and torch.cuda.get_device_capability(q.device)[0] == 9):
        return False
    rows = keys[:2] + keys[3:5]          # e4m3 and rope views of the ring and the pool
    return all(t.data_ptr() % 16 == 0 and all(t.stride(i) * t.element_size() % 16 == 0 for i in (0, 1))
               for t in rows)


def value_wide(q: torch.Tensor, keys: tuple, meta: tuple, strides: tuple, ring: int, window: int, epb: int,
               max_blocks: int, n_comp: int, qk_scale: float, *, dim: int, nope: int, mode: int,
               splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the wide kernel; returns (part [B, S, H, D] fp16, normalised: acc / l, pml [B, S, H, 2]) for
    the split combine.
    keys, meta, strides as `decode_attention_halves.value_halves`; q [B, H, D] fp32 or bf16."""
    bsz, heads, _ = q.shape
    part = torch.empty(bsz, splits, heads, dim, dtype=torch.float16, device=q.device)
    pml = torch.empty(bsz, splits, heads, 2, dtype=torch.float32, device=q.device)
    wkv, wrope, wsc, ckv, crope, csc = keys
    _wide_kernel[(bsz, 1, splits)](
        q, part, pml, wkv, wrope, wsc, *meta[:3], ckv, crope, csc, *meta[3:],
        q.stride(0), q.stride(1), part.stride(0), part.stride(1), part.stride(2), *strides,
        ring, window, epb, max_blocks, n_comp, qk_scale,
        *(_elements_between(w, c) for w, c in ((wkv, ckv), (wrope, crope), (wsc, csc))),
        H=heads, D=dim, NOPE=nope, MODE=mode, VALUE_REGS=REGS[0], LOADER_REGS=REGS[1], num_warps=4,
        maxnreg=MAXNREG, **pdl_launch(q.device))
    return part, pml
