"""Wide decode attention (Gluon, sm_90): all 64 heads and all 512 value channels of one (request,
key split) in one program of two warpgroups, fp8_ds keys (the "wide" scheme of `decode_attention`).

    grid (B, 1, S): program (b, split) runs an online softmax over key tiles split, split + S, ...
    of one index space (the window ring's tiles, then the entries'), as the halves scheme
    (`decode_attention_halves`) does, and writes the same split partials (acc [H, D] fp32 and the
    softmax stats (m, l)) for `decode_combine`.

Why a second kernel, in Gluon: the halves scheme runs two 4-warp programs per (request, split),
one per half of the value channels, and each loads and dequantises every key and computes every
logit; its loop is a chain of dependent steps (load, convert, dot, softmax, dot) with nothing in
flight across tiles (a register prefetch spills at 255 registers). Here one 8-warp program owns
the pair: per 64-key tile

    - the next tile's bytes go to shared memory by cp.async while this tile computes (two
      stages; e4m3 bytes [64, 8, 64] and the bf16 rope [64, 64]), and the next tile's scale words
      and row lookups are in flight in registers;
    - the tile is dequantised once (e4m3 -> fp16 times 2^(e - 127) per 64 channels, as
      `decode_common.key_operand`) into one fp16 [64, 512] shared tile that serves as K^T for
      S = q . K^T and as V for acc += p . V;
    - S [64 heads, 64 keys] is one warpgroup MMA with the two warpgroups on 32 keys each (q
      [64, 512] fp16 stays in shared memory), the row maxima and sums cross the warpgroups, and
      p . V puts each warpgroup on 256 of the 512 value channels (acc 128 registers a thread).

Layout choices are explicit (Gluon), so no conversion goes through shared memory except p's
(the warpgroups exchange their 32 keys' probabilities) and the cross-warpgroup reductions.
Static grid, no host reads: capturable in a CUDA graph.

Measured (H200, Triton 3.6, the op with its combine, CUDA-graph replays, L2 flushed), halves /
wide µs: 128K B = 64 CSA 60.4 / 42.9, HCA 80.2 / 59.3; B = 16 CSA 30.6 / 26.2, HCA 35.3 / 30.4;
B = 4 CSA 19.9 / 17.7, HCA 24.7 / 20.0; HCA 1M B = 1 29.9 / 28.0. sm_90 compile: 255 registers,
217 KB shared memory (one program per SM), 947 instructions a tile. What bounds it (ncu): the steps
of a tile run one after another, two warps per scheduler, 23 barriers a tile; see
benchmarks/NOTES.md, thirtieth round.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, warpgroup_mma

# the CTA-wide barrier: `thread_barrier` in Triton 3.6, `barrier` from 3.7
_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
# cp.async into shared memory: `async_copy_global_to_shared` in Triton 3.6, `async_load` from 3.7
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
#: Gluon's API as written here: Triton 3.6 (measured) to 3.9 (compiled); earlier ones differ
GLUON_OK = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 6)
#: keys a tile, warps a program (two warpgroups)
BLOCK_N = 64
WARPS = 8
_BN = gl.constexpr(BLOCK_N)
_W = gl.constexpr(WARPS)


@gluon.constexpr_function
def _bytes_layout(nc):
    """[BLOCK_N, nc, 64] e4m3 bytes: 16 consecutive bytes a thread, a warp over whole 64-byte chunks."""
    return gl.BlockedLayout([1, 1, 16], [32 // (4 * nc), nc, 4], [WARPS, 1, 1], [2, 1, 0])


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


@gluon.jit
def _issue(raw_s, rope_s, tile, blk, row, ok, slot, n_wt, ckv_ptr, crope_ptr, csc_ptr,
           s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr,
           ring_kv, ring_rope, ring_sc, NOPE: gl.constexpr):
    """Stage 3 (one tile ahead): cp.async of the tile's e4m3 bytes into raw_s [BLOCK_N, 8, 64] and its
    rope into rope_s [BLOCK_N, 64] (one commit group), addressed from the pool's bases (the ring's
    rows at ring_* + the request's slot); returns its scale words (a load in flight) and ok."""
    win = tile < n_wt
    page = gl.maximum(blk, 0).to(gl.int64)
    r = row.to(gl.int64)
    kv = gl.where(win, ring_kv + slot * s_wkp + r * s_wkr, page * s_ckp + r * s_ckr)
    rp = gl.where(win, ring_rope + slot * s_wrp + r * s_wrr, page * s_crp + r * s_crr)
    sc = gl.where(win, ring_sc + slot * s_wsp + r * s_wsr, page * s_csp + r * s_csr)
    # rows start on 16-byte boundaries (the wrapper checks): 16-byte copies
    kv = gl.multiple_of(kv, 16)
    rp = gl.multiple_of(rp, 8)
    sw = gl.load((csc_ptr + sc).to(gl.pointer_type(gl.uint64)), mask=ok, other=0)
    L8: gl.constexpr = _bytes_layout(8)
    ROWS: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L8))
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L8)))
    j = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, L8)))
    d = gl.expand_dims(gl.expand_dims(c, 0), 2) * 64 + gl.expand_dims(gl.expand_dims(j, 0), 1)
    kv3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(kv, ROWS), 1), 2)
    ok3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(ok, ROWS), 1), 2)
    _async_load(raw_s, ckv_ptr + kv3 + d, mask=ok3 & (d < NOPE))
    RL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [_W, 1], [1, 0])
    jr = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, RL)), 0)
    rp2 = gl.expand_dims(gl.convert_layout(rp, gl.SliceLayout(1, RL)), 1)
    okr = gl.expand_dims(gl.convert_layout(ok, gl.SliceLayout(1, RL)), 1)
    _async_load(rope_s, crope_ptr + rp2 + jr, mask=okr & (jr < 64))
    async_copy.commit_group()
    return sw, ok


@gluon.jit
def _dequant(raw_s, rope_s, k_s, sw, NOPE: gl.constexpr):
    """The tile's keys into k_s [BLOCK_N, 512] fp16: e4m3 x 2^(e - 127) per 64 channels (exact for
    scales 2^-15 .. 2^7, as `decode_common.key_operand`), then the rope channels."""
    L8: gl.constexpr = _bytes_layout(8)
    x = raw_s.load(L8).to(gl.float16)
    c = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L8))), 0), 2)
    sw3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(sw, gl.SliceLayout(1, gl.SliceLayout(2, L8))), 1), 2)
    sb = ((sw3 >> (8 * c).to(gl.uint64)) & 0xFF).to(gl.int32)
    # the rope chunk's factor 0 (its bytes arrive as zeros), so the tile takes one multiply, no select
    f = gl.where(c < NOPE // 64, (sb << 23).to(gl.float32, bitcast=True), 0.0).to(gl.float16)
    k_s.store(gl.reshape(x * f, [_BN, 512]))
    _barrier()                          # the rope channels' zeros above are written before the rope
    RL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [_W, 1], [1, 0])
    k_s.slice(NOPE, 64, dim=1).store(rope_s.load(RL).to(gl.float16))


@gluon.jit
def _wide_kernel(
        q_ptr, part_ptr, pml_ptr,
        wkv_ptr, wrope_ptr, wsc_ptr, swa_pos_ptr, slots_ptr, pos_ptr,
        ckv_ptr, crope_ptr, csc_ptr, bt_ptr, idx_ptr, nent_ptr,
        s_qb, s_qh, s_pb, s_ps, s_ph,
        s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_pos,
        s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, s_bt, s_idx,
        ring, window, epb, max_blocks, n_comp, qk_scale, ring_kv, ring_rope, ring_sc,
        H: gl.constexpr, D: gl.constexpr, NOPE: gl.constexpr, MODE: gl.constexpr):
    """Program (b, 0, split) -> part[b, split, :, :] (acc [H, D] fp32), pml[b, split, :, :] (m, l)."""
    b = gl.program_id(0)
    split = gl.program_id(2)
    n_split = gl.num_programs(2)
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    Q_L: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [_W, 1], [1, 0])
    RAW_SL: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[2, 1, 0])
    ROPE_SL: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=1, order=[1, 0])
    K_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BN, D], gl.float16)
    QS_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, D], gl.float16)

    hq = gl.arange(0, H, layout=gl.SliceLayout(1, Q_L))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, Q_L))
    q = gl.load(q_ptr + b * s_qb + gl.expand_dims(hq, 1) * s_qh + gl.expand_dims(dq, 0)).to(gl.float16)
    q_s = gl.allocate_shared_memory(gl.float16, [H, D], QS_L, q)
    k_s = gl.allocate_shared_memory(gl.float16, [_BN, D], K_SL)
    raw = gl.allocate_shared_memory(gl.float8e4nv, [2, _BN, 8, 64], RAW_SL)
    rope = gl.allocate_shared_memory(gl.bfloat16, [2, _BN, 64], ROPE_SL)

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

    m_i = gl.full([H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([H], gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([H, D], gl.float32, layout=O_L)
    s0 = gl.zeros([H, _BN], gl.float32, layout=S_L)

    KL: gl.constexpr = gl.BlockedLayout([1], [32], [_W], [0])
    # the three stages of tiles split, split + S, split + 2S before the loop (see _issue)
    wv, ev = _stage_index(split, b, slot, n_wt, swa_pos_ptr, idx_ptr, s_pos, s_idx, ring, n_comp, MODE, KL)
    blk, row, okp = _stage_page(split, wv, ev, b, t, n_wt, n_c, bt_ptr, s_bt, window, epb, max_blocks, MODE, KL)
    sw, ok = _issue(raw.index(0), rope.index(0), split, blk, row, okp, slot, n_wt, ckv_ptr, crope_ptr, csc_ptr,
                    s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr,
                    ring_kv, ring_rope, ring_sc, NOPE)
    wv, ev = _stage_index(split + n_split, b, slot, n_wt, swa_pos_ptr, idx_ptr, s_pos, s_idx, ring, n_comp, MODE, KL)
    blk, row, okp = _stage_page(split + n_split, wv, ev, b, t, n_wt, n_c, bt_ptr, s_bt, window, epb, max_blocks,
                                MODE, KL)
    wv, ev = _stage_index(split + 2 * n_split, b, slot, n_wt, swa_pos_ptr, idx_ptr, s_pos, s_idx, ring, n_comp,
                          MODE, KL)
    for it in range(0, mine):
        stage = it % 2
        tile = split + it * n_split
        sw_n, ok_n = _issue(raw.index(1 - stage), rope.index(1 - stage), tile + n_split, blk, row, okp, slot, n_wt,
                            ckv_ptr, crope_ptr, csc_ptr, s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr,
                            s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, ring_kv, ring_rope, ring_sc, NOPE)
        blk, row, okp = _stage_page(tile + 2 * n_split, wv, ev, b, t, n_wt, n_c, bt_ptr, s_bt, window, epb,
                                    max_blocks, MODE, KL)
        wv, ev = _stage_index(tile + 3 * n_split, b, slot, n_wt, swa_pos_ptr, idx_ptr, s_pos, s_idx, ring, n_comp,
                              MODE, KL)
        async_copy.wait_group(1)        # this tile's copies (the next tile's stay in flight)
        _barrier()             # ... from every thread; and the last tile's MMAs are done with k_s
        _dequant(raw.index(stage), rope.index(stage), k_s, sw, NOPE)
        fence_async_shared()            # generic-proxy stores before the MMAs' async-proxy reads
        _barrier()
        s = warpgroup_mma(q_s, k_s.permute((1, 0)), s0, use_acc=False) * qk_scale
        s = gl.where(gl.expand_dims(gl.convert_layout(ok, gl.SliceLayout(0, S_L)), 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)     # no key yet: keep exp2 finite
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - gl.expand_dims(m_safe, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(gl.float16), P_L), k_s, acc)
        sw, ok = sw_n, ok_n
    async_copy.wait_group(0)

    ho = gl.arange(0, H, layout=gl.SliceLayout(1, O_L))
    do = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
    gl.store(part_ptr + b * s_pb + split * s_ps + gl.expand_dims(ho, 1) * s_ph + gl.expand_dims(do, 0), acc)
    hs = gl.arange(0, H, layout=gl.SliceLayout(1, S_L))
    ml = pml_ptr + ((b * n_split + split) * H + hs) * 2
    gl.store(ml, m_i)
    gl.store(ml + 1, l_i)


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
    """Launch the wide kernel; returns (part [B, S, H, D] fp32, pml [B, S, H, 2]) for the split combine.
    keys, meta, strides as `decode_attention_halves.value_halves`; q [B, H, D] fp32 or bf16."""
    bsz, heads, _ = q.shape
    part = torch.empty(bsz, splits, heads, dim, dtype=torch.float32, device=q.device)
    pml = torch.empty(bsz, splits, heads, 2, dtype=torch.float32, device=q.device)
    wkv, wrope, wsc, ckv, crope, csc = keys
    _wide_kernel[(bsz, 1, splits)](
        q, part, pml, wkv, wrope, wsc, *meta[:3], ckv, crope, csc, *meta[3:],
        q.stride(0), q.stride(1), part.stride(0), part.stride(1), part.stride(2), *strides,
        ring, window, epb, max_blocks, n_comp, qk_scale,
        *(_elements_between(w, c) for w, c in ((wkv, ckv), (wrope, crope), (wsc, csc))),
        H=heads, D=dim, NOPE=nope, MODE=mode, num_warps=WARPS)
    return part, pml
