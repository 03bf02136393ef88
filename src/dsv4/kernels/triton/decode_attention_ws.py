"""Warp-specialised wide decode attention (Gluon, sm_90): the wide scheme's work (64 heads, all 512
value channels of one (request, key split), fp8_ds keys) split over three warpgroups that run side by
side instead of one after another.

    loader  (worker, 4 warps): row lookups three tiles ahead; per 64-key tile the e4m3 bytes, rope
            and scale words straight into registers, dequantised into one of two fp16 [64, 512]
            NVMMA key tiles, the key mask beside it; signals k_ready.
    scores  (default, 4 warps): S = q . K^T [64 heads, 64 keys] (one warpgroup MMA, q [64, 512]
            fp16 in shared memory), the online softmax, p (fp16) and the rescale factor into
            shared memory for the values warpgroup (p_ready), then acc[:, :256] += p . V.
    values  (worker, 4 warps): acc[:, 256:] rescaled, += p . V from shared memory.

Both MMA warpgroups free the key tile when their p . V is done (k_free, count 2); the values
warpgroup frees p (p_free). Two key tiles and two p tiles, so the loader's copies and
dequantisation of tile i + 1 and the values warpgroup's p . V of tile i run under the scores
warpgroup's S of tile i + 1. The split partials are the wide kernel's (`decode_combine`).
Static grid, no host reads: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dsv4.kernels.triton.decode_attention_wide import _BN, _barrier, _elements_between, _stage_index, _stage_page

#: registers a thread of the values and loader warpgroups; the scores warpgroup gets the rest of
#: MAXNREG x 12 warps (acc 128 + S 32 + p 16 a thread)
REGS = (160, 152)
MAXNREG = 168

@gluon.constexpr_function
def _chunks():
    """[BLOCK_N, 2, 64]: two 64-channel chunks of e4m3 bytes a row over one warpgroup, 16 consecutive
    bytes of each chunk a thread (four threads a row, eight rows a warp, two rows a thread)."""
    return gl.BlockedLayout([1, 2, 16], [8, 1, 4], [4, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def _rope():
    """[BLOCK_N, 2, 32] bf16 rope: its halves over the same threads and rows as `_chunks`."""
    return gl.BlockedLayout([1, 2, 8], [8, 1, 4], [4, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def _rows():
    """One value a key row (lookups, masks, scale words), held by the threads that load the row."""
    return gl.SliceLayout(1, gl.SliceLayout(2, _chunks()))


@gluon.jit
def _row3(v):
    """A [BLOCK_N] row value as [BLOCK_N, 1, 1] in `_chunks`."""
    return gl.expand_dims(gl.expand_dims(v, 1), 2)


@gluon.jit
def _load_chunks(ckv_ptr, kv3, ok3, C0: gl.constexpr, NOPE: gl.constexpr):
    """The e4m3 bytes of chunks C0, C0 + 1 of the tile's rows (kv3: row offsets; chunks past NOPE
    read as zeros), a load left in flight."""
    L: gl.constexpr = _chunks()
    c = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
    j = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    d = (gl.expand_dims(gl.expand_dims(c, 0), 2) + C0) * 64 + gl.expand_dims(gl.expand_dims(j, 0), 1)
    return gl.load(ckv_ptr + kv3 + d, mask=ok3 & (d < NOPE), other=0.0)


@gluon.jit
def _store_chunks(kt, x, sw3, C0: gl.constexpr, NOPE: gl.constexpr):
    """x [BLOCK_N, 2, 64] e4m3 -> fp16 x 2^(e - 127) per chunk (exact for scales 2^-15 .. 2^7, as
    `decode_common.key_operand`; a chunk past NOPE x 0) into columns C0 * 64 .. of the key tile."""
    L: gl.constexpr = _chunks()
    c = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, L))), 0), 2) + C0
    sb = ((sw3 >> (8 * c).to(gl.uint64)) & 0xFF).to(gl.int32)
    f = gl.where(c < NOPE // 64, (sb << 23).to(gl.float32, bitcast=True), 0.0).to(gl.float16)
    kt.slice(C0 * 64, 128, dim=1).store(gl.reshape(x.to(gl.float16) * f, [_BN, 128]))


@gluon.jit
def _loader(k_s, bias_s, k_ready, k_free, swa_pos_ptr, idx_ptr, bt_ptr, ckv_ptr, crope_ptr, csc_ptr,
            s_pos, s_idx, s_bt, s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr,
            ring_kv, ring_rope, ring_sc, b, slot, t, split, n_split, mine, n_wt, n_c, ring, window, epb, max_blocks,
            n_comp, MODE: gl.constexpr, NOPE: gl.constexpr):
    # the lookups run in the rows' threads: no layout conversion between them and the loads
    KL: gl.constexpr = _rows()
    RO: gl.constexpr = _rope()
    hr = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, RO)))
    jr = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, RO)))
    dr = gl.expand_dims(gl.expand_dims(hr, 0), 2) * 32 + gl.expand_dims(gl.expand_dims(jr, 0), 1)
    RO_ROWS: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, RO))
    wv, ev = _stage_index(split, b, slot, n_wt, swa_pos_ptr, idx_ptr, s_pos, s_idx, ring, n_comp, MODE, KL)
    blk, row, ok = _stage_page(split, wv, ev, b, t, n_wt, n_c, bt_ptr, s_bt, window, epb, max_blocks, MODE, KL)
    wv, ev = _stage_index(split + n_split, b, slot, n_wt, swa_pos_ptr, idx_ptr, s_pos, s_idx, ring, n_comp, MODE, KL)
    for it in range(0, mine):
        tile = split + it * n_split
        buf = it % 2
        win = tile < n_wt
        page = gl.maximum(blk, 0).to(gl.int64)
        r = row.to(gl.int64)
        # rows addressed from the pool's bases (the ring's at ring_* + the request's slot): no selects
        kv3 = _row3(gl.multiple_of(gl.where(win, ring_kv + slot * s_wkp + r * s_wkr, page * s_ckp + r * s_ckr), 16))
        rp = gl.multiple_of(gl.where(win, ring_rope + slot * s_wrp + r * s_wrr, page * s_crp + r * s_crr), 8)
        sc = gl.where(win, ring_sc + slot * s_wsp + r * s_wsr, page * s_csp + r * s_csr)
        ok3 = _row3(ok)
        # every load of the tile in flight at once (four pairs of chunks, the rope, the scales) ...
        sw3 = _row3(gl.load((csc_ptr + sc).to(gl.pointer_type(gl.uint64)), mask=ok, other=0))
        x0 = _load_chunks(ckv_ptr, kv3, ok3, 0, NOPE)
        x1 = _load_chunks(ckv_ptr, kv3, ok3, 2, NOPE)
        x2 = _load_chunks(ckv_ptr, kv3, ok3, 4, NOPE)
        x3 = _load_chunks(ckv_ptr, kv3, ok3, 6, NOPE)
        rp3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(rp, RO_ROWS), 1), 2)
        okr = gl.expand_dims(gl.expand_dims(gl.convert_layout(ok, RO_ROWS), 1), 2)
        xr = gl.load(crope_ptr + rp3 + dr, mask=okr & (dr < 64), other=0.0)
        bias = gl.where(ok, 0.0, float("-inf"))
        # ... and the lookups of the next tiles behind them
        blk, row, ok = _stage_page(tile + n_split, wv, ev, b, t, n_wt, n_c, bt_ptr, s_bt, window, epb, max_blocks,
                                   MODE, KL)
        wv, ev = _stage_index(tile + 2 * n_split, b, slot, n_wt, swa_pos_ptr, idx_ptr, s_pos, s_idx, ring, n_comp,
                              MODE, KL)
        # the tile's buffer is free once both MMA warpgroups are done with tile it - 2
        mbarrier.wait(k_free.index(buf), ((it // 2) & 1) ^ 1)
        kt = k_s.index(buf)
        bias_s.index(buf).store(bias)
        _store_chunks(kt, x3, sw3, 6, NOPE)       # chunk 7's zeros go where the rope goes ...
        _store_chunks(kt, x0, sw3, 0, NOPE)
        _store_chunks(kt, x1, sw3, 2, NOPE)
        _store_chunks(kt, x2, sw3, 4, NOPE)
        _barrier()                                # ... before the rope
        kt.slice(NOPE, 64, dim=1).store(gl.reshape(xr.to(gl.float16), [_BN, 64]))
        fence_async_shared()            # generic-proxy stores before the MMAs' async-proxy reads
        _barrier()                      # ... from all four warps before the one arrive
        mbarrier.arrive(k_ready.index(buf), count=1)


@gluon.jit
def _values(k_s, p_s, a_s, k_ready, k_free, p_ready, p_free, part_ptr, s_pb, s_ps, s_ph, b, split, mine,
            D: gl.constexpr, H: gl.constexpr):
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    acc = gl.zeros([H, D // 2], gl.float32, layout=O_L)
    for it in range(0, mine):
        buf = it % 2
        ph = (it // 2) & 1
        mbarrier.wait(k_ready.index(buf), ph)
        mbarrier.wait(p_ready.index(buf), ph)
        alpha = a_s.index(buf).load(gl.SliceLayout(1, O_L))
        acc = acc * gl.expand_dims(alpha, 1)
        acc = warpgroup_mma(p_s.index(buf), k_s.index(buf).slice(D // 2, D // 2, dim=1), acc)
        _barrier()
        mbarrier.arrive(k_free.index(buf), count=1)
        mbarrier.arrive(p_free.index(buf), count=1)
    ho = gl.arange(0, H, layout=gl.SliceLayout(1, O_L))
    do = gl.arange(0, D // 2, layout=gl.SliceLayout(0, O_L)) + D // 2
    gl.store(part_ptr + b * s_pb + split * s_ps + gl.expand_dims(ho, 1) * s_ph + gl.expand_dims(do, 0), acc)


@gluon.jit
def _scores(q_ptr, s_qb, s_qh, q_s, k_s, p_s, a_s, bias_s, k_ready, k_free, p_ready, p_free, part_ptr, pml_ptr,
            s_pb, s_ps, s_ph, b, split, n_split, mine, qk_scale, D: gl.constexpr, H: gl.constexpr):
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
        buf = it % 2
        ph = (it // 2) & 1
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
        mbarrier.wait(p_free.index(buf), ph ^ 1)        # the values warpgroup is done with tile it - 2's p
        p_s.index(buf).store(p16)
        a_s.index(buf).store(alpha)
        fence_async_shared()
        _barrier()
        mbarrier.arrive(p_ready.index(buf), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
        acc = warpgroup_mma(gl.convert_layout(p16, P_L), kt.slice(0, D // 2, dim=1), acc)
        _barrier()
        mbarrier.arrive(k_free.index(buf), count=1)
    ho = gl.arange(0, H, layout=gl.SliceLayout(1, O_L))
    do = gl.arange(0, D // 2, layout=gl.SliceLayout(0, O_L))
    gl.store(part_ptr + b * s_pb + split * s_ps + gl.expand_dims(ho, 1) * s_ph + gl.expand_dims(do, 0), acc)
    hs = gl.arange(0, H, layout=gl.SliceLayout(1, S_L))
    ml = pml_ptr + ((b * n_split + split) * H + hs) * 2
    gl.store(ml, m_i)
    gl.store(ml + 1, l_i)


@gluon.jit
def _ws_kernel(
        q_ptr, part_ptr, pml_ptr,
        wkv_ptr, wrope_ptr, wsc_ptr, swa_pos_ptr, slots_ptr, pos_ptr,
        ckv_ptr, crope_ptr, csc_ptr, bt_ptr, idx_ptr, nent_ptr,
        s_qb, s_qh, s_pb, s_ps, s_ph,
        s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_pos,
        s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, s_bt, s_idx,
        ring, window, epb, max_blocks, n_comp, qk_scale, ring_kv, ring_rope, ring_sc,
        H: gl.constexpr, D: gl.constexpr, NOPE: gl.constexpr, MODE: gl.constexpr, VALUE_REGS: gl.constexpr,
        LOADER_REGS: gl.constexpr):
    """Program (b, 0, split) -> part[b, split, :, :] (acc [H, D] fp32), pml[b, split, :, :] (m, l);
    the wide kernel's arguments (`decode_attention_wide._wide_kernel`)."""
    b = gl.program_id(0)
    split = gl.program_id(2)
    n_split = gl.num_programs(2)
    QS_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, D], gl.float16)
    K_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BN, D], gl.float16)
    P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, _BN], gl.float16)
    q_s = gl.allocate_shared_memory(gl.float16, [H, D], QS_L)
    k_s = gl.allocate_shared_memory(gl.float16, [2, _BN, D], K_SL)
    p_s = gl.allocate_shared_memory(gl.float16, [2, H, _BN], P_SL)
    a_s = gl.allocate_shared_memory(gl.float32, [2, H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bias_s = gl.allocate_shared_memory(gl.float32, [2, _BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_free.index(i), count=2)
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=1)

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
        (_scores, (q_ptr, s_qb, s_qh, q_s, k_s, p_s, a_s, bias_s, k_ready, k_free, p_ready, p_free, part_ptr,
                   pml_ptr, s_pb, s_ps, s_ph, b, split, n_split, mine, qk_scale, D, H)),
        (_values, (k_s, p_s, a_s, k_ready, k_free, p_ready, p_free, part_ptr, s_pb, s_ps, s_ph, b, split, mine, D, H)),
        (_loader, (k_s, bias_s, k_ready, k_free, swa_pos_ptr, idx_ptr, bt_ptr, ckv_ptr, crope_ptr, csc_ptr,
                   s_pos, s_idx, s_bt, s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_ckp, s_ckr, s_crp, s_crr, s_csp,
                   s_csr, ring_kv, ring_rope, ring_sc, b, slot, t, split, n_split, mine, n_wt, n_c, ring, window, epb,
                   max_blocks, n_comp, MODE, NOPE)),
    ], [4, 4], [VALUE_REGS, LOADER_REGS])


def value_ws(q: torch.Tensor, keys: tuple, meta: tuple, strides: tuple, ring: int, window: int, epb: int,
             max_blocks: int, n_comp: int, qk_scale: float, *, dim: int, nope: int, mode: int,
             splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the warp-specialised kernel; as `decode_attention_wide.value_wide`."""
    bsz, heads, _ = q.shape
    part = torch.empty(bsz, splits, heads, dim, dtype=torch.float32, device=q.device)
    pml = torch.empty(bsz, splits, heads, 2, dtype=torch.float32, device=q.device)
    wkv, wrope, wsc, ckv, crope, csc = keys
    _ws_kernel[(bsz, 1, splits)](
        q, part, pml, wkv, wrope, wsc, *meta[:3], ckv, crope, csc, *meta[3:],
        q.stride(0), q.stride(1), part.stride(0), part.stride(1), part.stride(2), *strides,
        ring, window, epb, max_blocks, n_comp, qk_scale,
        *(_elements_between(w, c) for w, c in ((wkv, ckv), (wrope, crope), (wsc, csc))),
        H=heads, D=dim, NOPE=nope, MODE=mode, VALUE_REGS=REGS[0], LOADER_REGS=REGS[1], num_warps=4,
        maxnreg=MAXNREG)
    return part, pml
