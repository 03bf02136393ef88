"""Wide prefill attention (Gluon, sm_90): the decode wide kernel's program (`decode_attention_wide`:
loader, scores and values warpgroups over all 64 heads and 512 channels) for the new tokens of a
prefill chunk, fp8_ds entries (the "wide" scheme of `prefill_attention`).

    grid (G,), G = min(T, SMs), persistent: program j takes tokens j, j + G, ...; for each, one
    online softmax over its key tiles: its window's 64-row tiles first (rows of this step, `new_kv`,
    or of the ring gathered before the step, `old_kv`, picked as `prefill_attention_halves.window_rows`
    picks them; converted to fp16 before the launch and copied into the key tiles by cp.async), then
    its entries' tiles (CSA: its selected
    indices; HCA: the first (t + 1) // m entries) through the decode loader's pipeline. Each
    warpgroup finishes its half of the channels: the sink, the inverse rotation, out's dtype.

The key buffers' hand-over runs on across tokens (one tile count for the program), so the loader
starts a token's tiles while the MMA warpgroups finish the last one's; between two tokens the
scores warpgroup stores its half of the output and loads the next queries (asked into the L2 by
the values warpgroup as the token before started). Shared memory is the decode kernel's plus
the maxima and a `q_free` barrier: the output goes out through the queries' tile, so the next
queries wait until the values warpgroup has read its half. With `q_norm` the scores warpgroup
normalises and rotates the raw queries itself as it stores them (`_store_normed_q`), so the layer
runs no norm kernel over them (an 8K chunk's 1.07 GB): H100, the chunk below, `norm_rope` + this
kernel / the norm inside, µs: CSA 2,300 / 2,099, HCA 1,623 / 1,470.

Against the value-halves scheme (`prefill_attention_halves`: two programs a token, each computing
every logit and half the values on one warpgroup, 32-key tiles) each key tile is dequantised once
and its logits computed once, on warpgroup MMAs fed by a loader warpgroup of their own. H100, an
8K chunk after 24K cached, bf16 q, rotation and bf16 output, µs (`benchmarks/tune_decode.py
--prefill-attention`): halves / a program a token with the decode split combine / persistent: CSA
3,951 / 2,323 / 1,931, HCA 2,248 / 1,719 / 1,271.

Operands are fp16, as the decode wide kernel's: e4m3 x 2^(e - 127) is fp16-exact (`_store_chunk`),
and the window's bf16 rows convert exactly above 2^-14 in magnitude (below, fp16's subnormals keep
fewer bits: an error under 2^-25 a channel). The window rows reached the key tiles through the
loader's registers (converted there) until cp.async of fp16 rows measured ~2% faster on HCA (H100,
the chunk below: 1,476 / 1,464 -> 1,446 / 1,429 µs; CSA even). The output passes through fp16 on its way out, as
the decode kernel's normalised partials do.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from dsv4.kernels.triton import decode_attention_wide as dw
from dsv4.kernels.triton.decode_common import sm_count
from dsv4.kernels.triton.prefetch import PREFETCH_L2_ASM

#: keys a tile, as the decode wide kernel's
BLOCK_N = dw.BLOCK_N
_BN = gl.constexpr(BLOCK_N)


@gluon.jit
def _token(i, treq_ptr, pos_ptr, cu_ptr, n_idx, ratio, MODE: gl.constexpr, WINDOW: gl.constexpr):
    """Token i's request b, position t, its request's first new position p0, its entries n_c (MODE 0
    SWA: none; 1 CSA: its n_idx selections; 2 HCA: the first (t + 1) // ratio) and key tiles."""
    b = gl.load(treq_ptr + i).to(gl.int64)
    t = gl.load(pos_ptr + i).to(gl.int32)
    p0 = t - (i - gl.load(cu_ptr + b).to(gl.int64)).to(gl.int32)
    if MODE == 2:
        n_c = (t + 1) // ratio
    elif MODE == 1:
        n_c = t * 0 + n_idx
    else:
        n_c = t * 0
    return b, t, p0, n_c, (WINDOW + _BN - 1) // _BN + gl.cdiv(n_c, _BN)


@gluon.jit
def _window_tiles(k_s, bias_s, k_ready, k_free, old_ptr, oldpos_ptr, new_ptr, s_ob, s_or, s_opb, s_nt, b, i, t,
                  p0, ring, g, WINDOW: gl.constexpr, D: gl.constexpr):
    """Key tiles g .. g + cdiv(W, 64) - 1: window rows r at positions p = t - W + 1 + r, p >= p0 new
    row i - t + p, p < p0 ring row W - p0 + p of the gathered ring (its stored position checked);
    fp16 rows (`prefill_wide` converts them) copied into the key tiles by cp.async, masked rows
    zero-filled."""
    RL: gl.constexpr = dw._rope()
    ROWS: gl.constexpr = gl.SliceLayout(1, RL)
    jr = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, RL)), 0)
    for w in gl.static_range((WINDOW + _BN - 1) // _BN):
        r = w * _BN + gl.arange(0, _BN, layout=ROWS)
        p = t - WINDOW + 1 + r
        inside = (r < WINDOW) & (p >= 0)
        new = inside & (p >= p0)
        orow = ring - p0 + p
        maybe_old = inside & (p < p0) & (orow >= 0)
        opos = gl.load(oldpos_ptr + b * s_opb + orow, mask=maybe_old, other=-1)
        ok = new | (maybe_old & (opos == p))
        rowp = gl.where(new, new_ptr + (i - t + p).to(gl.int64) * s_nt, old_ptr + b * s_ob + orow.to(gl.int64) * s_or)
        rowp = gl.expand_dims(gl.multiple_of(rowp, 16), 1) + jr       # rows on 16-byte boundaries (`supported`)
        okr = gl.expand_dims(ok, 1) & (jr < 64)
        buf = (g + w) % 2
        mbarrier.wait(k_free.index(buf), (((g + w) // 2) & 1) ^ 1)
        kt = k_s.index(buf)
        bias_s.index(buf).store(gl.where(ok, 0.0, float("-inf")))
        for c in gl.static_range(D // 64):
            dw._async_load(kt.slice(c * 64, 64, dim=1), rowp + c * 64, mask=okr)
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()            # generic-proxy stores before the MMAs' async-proxy reads
        dw._barrier()                   # ... from all four warps before the one arrive
        mbarrier.arrive(k_ready.index(buf), count=1)


@gluon.jit
def _loader(k_s, bias_s, raw_s, k_ready, k_free, old_ptr, oldpos_ptr, new_ptr, treq_ptr, pos_ptr, cu_ptr, idx_ptr,
            bt_ptr, ckv_ptr, crope_ptr, csc_ptr, s_ob, s_or, s_opb, s_nt, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr,
            s_bt, s_idx, t_all, ring, epb, max_blocks, n_idx, ratio, WINDOW: gl.constexpr, D: gl.constexpr,
            MODE: gl.constexpr, NOPE: gl.constexpr):
    """Per token: its entry tiles' lookups and first staged copies in flight (the decode loader's
    start, one split, no ring, its index row and its request's block-table row as rows 0), under
    its window tiles, then its entry tiles (the decode loader's loop)."""
    N_WT: gl.constexpr = (WINDOW + _BN - 1) // _BN
    g = 0
    for i in range(gl.program_id(0), t_all, gl.num_programs(0)):
        b, t, p0, n_c, n_tiles = _token(i, treq_ptr, pos_ptr, cu_ptr, n_idx, ratio, MODE, WINDOW)
        if MODE != 0:
            idx_row = idx_ptr + i.to(gl.int64) * s_idx
            bt_row = bt_ptr + b * s_bt
            state = dw._entry_prologue(raw_s, oldpos_ptr, idx_row, bt_row, ckv_ptr, csc_ptr, 0, 0, 0, 0, 0, 0, 0, 0,
                                       0, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, 0, 0, 0, 0, 0, t, 0, 1, 0, n_c,
                                       0, WINDOW, epb, max_blocks, n_idx, MODE, NOPE)
            _window_tiles(k_s, bias_s, k_ready, k_free, old_ptr, oldpos_ptr, new_ptr, s_ob, s_or, s_opb, s_nt, b, i,
                          t, p0, ring, g, WINDOW, D)
            dw._loader_loop(k_s, bias_s, raw_s, k_ready, k_free, oldpos_ptr, idx_row, bt_row, ckv_ptr, crope_ptr,
                            csc_ptr, 0, 0, 0, 0, 0, 0, 0, 0, 0, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, 0, 0, 0,
                            0, 0, t, 0, 1, n_tiles - N_WT, 0, n_c, 0, WINDOW, epb, max_blocks, n_idx, *state,
                            g + N_WT, MODE, NOPE)
        else:
            _window_tiles(k_s, bias_s, k_ready, k_free, old_ptr, oldpos_ptr, new_ptr, s_ob, s_or, s_opb, s_nt, b, i,
                          t, p0, ring, g, WINDOW, D)
        g += n_tiles


@gluon.jit
def _finish(out_ptr, s_ot, s_oh, sinks_ptr, cos_ptr, sin_ptr, acc, m_i, l_i, stage, i, D0: gl.constexpr,
            D: gl.constexpr, HALF_R: gl.constexpr, ROPE: gl.constexpr, O_L: gl.constexpr):
    """Channels D0 .. D0 + W of token i's output: acc / (l + 2^(sink - m)) (log2 domain, as
    `decode_attention.with_sink`), through shared memory (`stage`: fp16, as the decode kernel's
    partials), then RoPE_{-t} of the trailing 2 HALF_R of D channels (interleaved pairs, as
    `decode_common.inverse_rope`), stored in out's dtype. m_i, l_i in SliceLayout(1, O_L)."""
    H: gl.constexpr = acc.shape[0]
    W: gl.constexpr = acc.shape[1]
    h = gl.arange(0, H, layout=gl.SliceLayout(1, O_L))
    sink = gl.load(sinks_ptr + h).to(gl.float32) * 1.4426950408889634
    m_f = gl.maximum(m_i, sink)
    alpha = gl.exp2(m_i - m_f)
    inv = alpha / (l_i * alpha + gl.exp2(sink - m_f))
    stage.store((acc * gl.expand_dims(inv, 1)).to(gl.float16))
    dw._barrier()
    R: gl.constexpr = 16                                        # rows a pass
    ST_L: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [4, 1], [1, 0])
    PR_L: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 32, 1], [4, 1, 1], [2, 1, 0])
    for r0 in gl.static_range(0, H, R):
        ho = gl.arange(0, R, layout=gl.SliceLayout(1, ST_L)) + r0
        o = stage.slice(r0, R, dim=0).load(ST_L).to(gl.float32)
        if ROPE and D0 + W > D - 2 * HALF_R:            # this half holds rotated channels
            ev, od = gl.split(gl.convert_layout(gl.reshape(o, [R, W // 2, 2]), PR_L))
            jp = gl.arange(0, W // 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, PR_L))) + (D0 // 2 - (D // 2 - HALF_R))
            rot = (jp >= 0) & (jp < HALF_R)
            cs = gl.expand_dims(gl.load(cos_ptr + i * HALF_R + jp, mask=rot, other=1.0), 0)
            sn = gl.expand_dims(gl.load(sin_ptr + i * HALF_R + jp, mask=rot, other=0.0), 0)
            o = gl.convert_layout(gl.reshape(gl.join(ev * cs + od * sn, od * cs - ev * sn), [R, W]), ST_L)
        do = gl.arange(0, W, layout=gl.SliceLayout(0, ST_L)) + D0
        gl.store(out_ptr + i.to(gl.int64) * s_ot + gl.expand_dims(ho, 1) * s_oh + gl.expand_dims(do, 0),
                 o.to(out_ptr.dtype.element_ty))
    dw._barrier()                       # every thread's reads of the stage done before it is written again


_PREFETCH_ASM = gl.constexpr(PREFETCH_L2_ASM)


@gluon.jit
def _prefetch_l2(q_ptr, i, s_qt, t_all, NBYTES: gl.constexpr):
    """Token i's queries (NBYTES contiguous bytes, a multiple of 2,048) asked into the L2, a
    piece a thread of one warpgroup; nothing past the last token."""
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    piece = gl.arange(0, 128, layout=L)
    base = (q_ptr + i.to(gl.int64) * s_qt).to(gl.pointer_type(gl.int8))
    size = gl.where(i < t_all, NBYTES // 128, 0) + piece * 0
    gl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,r", [base + piece.to(gl.int64) * (NBYTES // 128), size],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _values(q_ptr, s_qt, out_ptr, s_ot, s_oh, sinks_ptr, cos_ptr, sin_ptr, q_s, k_s, p_s, a_s, l_s, m_s, k_ready,
            k_free, p_ready, p_free, l_ready, q_free, treq_ptr, pos_ptr, cu_ptr, t_all, n_idx, ratio, D: gl.constexpr,
            H: gl.constexpr, MODE: gl.constexpr, WINDOW: gl.constexpr, HALF_R: gl.constexpr, ROPE: gl.constexpr,
            Q_BYTES: gl.constexpr):
    # the idle warpgroup asks for the program's next token's queries into the L2 as a token starts,
    # so the scores warpgroup's load of them between two tokens does not wait on DRAM
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    g = 0
    k = 0
    for i in range(gl.program_id(0), t_all, gl.num_programs(0)):
        _, _, _, _, n_tiles = _token(i, treq_ptr, pos_ptr, cu_ptr, n_idx, ratio, MODE, WINDOW)
        _prefetch_l2(q_ptr, i + gl.num_programs(0), s_qt, t_all, Q_BYTES)
        acc = gl.zeros([H, D // 2], gl.float32, layout=O_L)
        for it in range(0, n_tiles):
            acc = dw._values_tile(k_s, p_s, a_s, k_ready, k_free, p_ready, p_free, g + it, acc, D, O_L)
        g += n_tiles
        mbarrier.wait(l_ready.index(0), k & 1)          # the scores warpgroup's stats, its MMAs over q done
        _finish(out_ptr, s_ot, s_oh, sinks_ptr, cos_ptr, sin_ptr, acc, m_s.load(gl.SliceLayout(1, O_L)),
                l_s.load(gl.SliceLayout(1, O_L)), q_s.slice(D // 2, D // 2, dim=1), i, D // 2, D, HALF_R, ROPE, O_L)
        mbarrier.arrive(q_free.index(0), count=1)       # q's tile may take the next token's queries
        k += 1


@gluon.jit
def _squares(x):
    """x^2 in fp32 of bf16 x, by its own instructions: a conversion shared with the scaling below
    would keep every fp32 channel of the 64 rows live between the two (sm_90: 856 bytes of spills)."""
    return gl.inline_asm_elementwise("{ cvt.f32.bf16 $0, $1; mul.f32 $0, $0, $0; }", "=f,h", [x],
                                     dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _store_normed_q(q_s, inv_s, q0, q1, cos_ptr, sin_ptr, i, eps, D: gl.constexpr, HALF_R: gl.constexpr,
                    Q_L: gl.constexpr):
    """RoPE_t(RMSNorm_1(q)) of token i's raw queries (halves q0, q1 [H, D / 2], bf16, in Q_L) into
    q_s as fp16: `norm_rope`'s math (fp32; the row times 1 / sqrt(mean(q^2) + eps), then the
    interleaved pairs of the trailing 2 HALF_R channels rotated), rounded once, to fp16. A normalised
    row has no channel above sqrt(D) in magnitude, so fp16 holds it; the raw row need not fit.

    The rows' sums come from the registers; the raw rows wait in q_s as bf16 and are scaled, rotated
    and rounded in place 16 rows at a time, each thread on the channels it stored (Q_L over 16 rows
    is Q_L over 64 rows' first quarter): no barrier between. Scaling all 64 rows in registers spilled
    (sm_90: ~240 spill stores). inv_s [H] fp32: the rows' factors on their way to the passes."""
    H: gl.constexpr = q0.shape[0]
    W: gl.constexpr = q0.shape[1]
    ss = gl.sum(_squares(q0), axis=1) + gl.sum(_squares(q1), axis=1)
    QL: gl.constexpr = q_s.layout
    raw = dw._view(q_s, gl.bfloat16, [H, D], QL)
    raw.slice(0, W, dim=1).store(q0)
    raw.slice(W, W, dim=1).store(q1)
    inv_s.store(1.0 / gl.sqrt(ss / D + eps))
    dw._barrier()                                               # the factors, from the rows' other lanes
    PR_L: gl.constexpr = gl.BlockedLayout([1, 4, 2], [4, 8, 1], [4, 1, 1], [2, 1, 0])     # Q_L's pairs
    jp = gl.arange(0, W // 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, PR_L))) - (W // 2 - HALF_R)
    rot = jp >= 0
    cs = gl.expand_dims(gl.load(cos_ptr + i * HALF_R + jp, mask=rot, other=1.0), 0)
    sn = gl.expand_dims(gl.load(sin_ptr + i * HALF_R + jp, mask=rot, other=0.0), 0)
    R: gl.constexpr = 16                                        # rows a pass: Q_L's rows
    for r0 in gl.static_range(0, H, R):
        inv = gl.expand_dims(inv_s.slice(r0, R).load(gl.SliceLayout(1, Q_L)), 1)
        lo = raw.slice(r0, R, dim=0).slice(0, W, dim=1)
        x = lo.load(Q_L).to(gl.float32) * inv
        q_s.slice(r0, R, dim=0).slice(0, W, dim=1).store(x.to(gl.float16))
        hi = raw.slice(r0, R, dim=0).slice(W, W, dim=1)
        x = hi.load(Q_L).to(gl.float32) * inv
        ev, od = gl.split(gl.convert_layout(gl.reshape(x, [R, W // 2, 2]), PR_L))
        x = gl.convert_layout(gl.reshape(gl.join(ev * cs - od * sn, od * cs + ev * sn), [R, W]), Q_L)
        q_s.slice(r0, R, dim=0).slice(W, W, dim=1).store(x.to(gl.float16))


@gluon.jit
def _scores(q_ptr, s_qt, s_qh, out_ptr, s_ot, s_oh, sinks_ptr, cos_ptr, sin_ptr, q_s, k_s, p_s, a_s, bias_s, l_s,
            m_s, k_ready, k_free, p_ready, p_free, l_ready, q_free, treq_ptr, pos_ptr, cu_ptr, t_all, n_idx, ratio,
            qk_scale, q_eps, D: gl.constexpr, H: gl.constexpr, MODE: gl.constexpr, WINDOW: gl.constexpr,
            HALF_R: gl.constexpr, ROPE: gl.constexpr, QNORM: gl.constexpr):
    Q_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    hq = gl.expand_dims(gl.arange(0, H, layout=gl.SliceLayout(1, Q_L)), 1)
    dq = gl.expand_dims(gl.arange(0, D // 2, layout=gl.SliceLayout(0, Q_L)), 0)
    s0 = gl.zeros([H, _BN], gl.float32, layout=S_L)
    g = 0
    k = 0
    for i in range(gl.program_id(0), t_all, gl.num_programs(0)):
        _, _, _, _, n_tiles = _token(i, treq_ptr, pos_ptr, cu_ptr, n_idx, ratio, MODE, WINDOW)
        qrow = q_ptr + i.to(gl.int64) * s_qt + hq * s_qh + dq
        q0 = gl.load(qrow)
        q1 = gl.load(qrow + D // 2)
        mbarrier.wait(q_free.index(0), (k & 1) ^ 1)     # the values warpgroup is done with the last stage
        if QNORM:
            _store_normed_q(q_s, m_s, q0, q1, cos_ptr, sin_ptr, i, q_eps, D, HALF_R, Q_L)
        else:
            q_s.slice(0, D // 2, dim=1).store(q0.to(gl.float16))
            q_s.slice(D // 2, D // 2, dim=1).store(q1.to(gl.float16))
        fence_async_shared()
        dw._barrier()
        m_i = gl.full([H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([H], gl.float32, layout=gl.SliceLayout(1, S_L))
        acc = gl.zeros([H, D // 2], gl.float32, layout=O_L)
        for it in range(0, n_tiles):
            m_i, l_i, acc = dw._scores_tile(q_s, k_s, p_s, a_s, bias_s, k_ready, k_free, p_ready, p_free, g + it,
                                            m_i, l_i, acc, s0, qk_scale, D, S_L, O_L, P_L)
        g += n_tiles
        l_s.store(l_i)                                  # for the values warpgroup's half
        m_s.store(m_i)
        dw._barrier()
        mbarrier.arrive(l_ready.index(0), count=1)
        _finish(out_ptr, s_ot, s_oh, sinks_ptr, cos_ptr, sin_ptr, acc, gl.convert_layout(m_i, gl.SliceLayout(1, O_L)),
                gl.convert_layout(l_i, gl.SliceLayout(1, O_L)), q_s.slice(0, D // 2, dim=1), i, 0, D, HALF_R, ROPE,
                O_L)
        k += 1


@gluon.jit
def _prefill_wide_kernel(
        q_ptr, out_ptr, sinks_ptr, cos_ptr, sin_ptr, old_ptr, oldpos_ptr, new_ptr, pos_ptr, treq_ptr, cu_ptr,
        ckv_ptr, crope_ptr, csc_ptr, bt_ptr, idx_ptr,
        s_qt, s_qh, s_ot, s_oh, s_ob, s_or, s_opb, s_nt,
        s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, s_bt, s_idx,
        window, ring, epb, max_blocks, n_idx, ratio, qk_scale, t_all, q_eps,
        H: gl.constexpr, D: gl.constexpr, NOPE: gl.constexpr, MODE: gl.constexpr, WINDOW: gl.constexpr,
        HALF_R: gl.constexpr, ROPE: gl.constexpr, QNORM: gl.constexpr, VALUE_REGS: gl.constexpr,
        LOADER_REGS: gl.constexpr):
    """Persistent: program j takes tokens j, j + G, ... (G programs) -> out[i] (finished, out's dtype).
    MODE 0 SWA, 1 CSA (indices [T, K]), 2 HCA. `window` equals WINDOW (the other prefill kernels' argument).
    QNORM: q is the raw up-projection, normalised (eps q_eps) and rotated here as it is loaded."""
    (q_s, k_s, p_s, a_s, bias_s, raw_s, l_s, k_ready, k_free, p_ready, p_free, l_ready) = dw._buffers(H, D)
    m_s = gl.allocate_shared_memory(gl.float32, [H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_free.index(0), count=1)
    gl.warp_specialize([
        (_scores, (q_ptr, s_qt, s_qh, out_ptr, s_ot, s_oh, sinks_ptr, cos_ptr, sin_ptr, q_s, k_s, p_s, a_s, bias_s,
                   l_s, m_s, k_ready, k_free, p_ready, p_free, l_ready, q_free, treq_ptr, pos_ptr, cu_ptr, t_all,
                   n_idx, ratio, qk_scale, q_eps, D, H, MODE, WINDOW, HALF_R, ROPE, QNORM)),
        (_values, (q_ptr, s_qt, out_ptr, s_ot, s_oh, sinks_ptr, cos_ptr, sin_ptr, q_s, k_s, p_s, a_s, l_s, m_s,
                   k_ready, k_free, p_ready, p_free, l_ready, q_free, treq_ptr, pos_ptr, cu_ptr, t_all, n_idx, ratio,
                   D, H, MODE, WINDOW, HALF_R, ROPE, H * D * q_ptr.dtype.element_ty.primitive_bitwidth // 8)),
        (_loader, (k_s, bias_s, raw_s, k_ready, k_free, old_ptr, oldpos_ptr, new_ptr, treq_ptr, pos_ptr, cu_ptr,
                   idx_ptr, bt_ptr, ckv_ptr, crope_ptr, csc_ptr, s_ob, s_or, s_opb, s_nt, s_ckp, s_ckr, s_crp, s_crr,
                   s_csp, s_csr, s_bt, s_idx, t_all, ring, epb, max_blocks, n_idx, ratio, WINDOW, D, MODE, NOPE)),
    ], [4, 4], [VALUE_REGS, LOADER_REGS])


def supported(q: torch.Tensor, old_kv: torch.Tensor, new_kv: torch.Tensor, entries: tuple, dim: int, nope: int,
              fmt_name: str) -> bool:
    """Whether the wide kernel takes this call: the decode wide kernel's conditions on q and the
    entries (`decode_attention_wide.supported`), and bf16 window rows on 16-byte boundaries."""
    if not dw.supported(q, (*entries, *entries), dim, nope, fmt_name):
        return False
    # a token's queries: one run of H D values on 16-byte boundaries (its loads and its L2 prefetch)
    if q.stride(2) != 1 or q.stride(1) != dim or q.data_ptr() % 16 or q.stride(0) * q.element_size() % 16:
        return False
    return all(x.dtype == torch.bfloat16 and x.stride(-1) == 1 and x.data_ptr() % 16 == 0
               and all(s * 2 % 16 == 0 for s in x.stride()[:-1]) for x in (old_kv, new_kv))


def prefill_wide(q: torch.Tensor, sinks: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                 out_dtype: torch.dtype | None, sources: tuple, geometry: tuple, *, dim: int, nope: int,
                 mode: int, q_norm: float | None = None) -> torch.Tensor:
    """Launch the wide kernel -> out [T, H, D] (out_dtype, default fp32), the finished attention output,
    RoPE_{-t} applied where rope = (cos, sin) [T, r/2] is given. sources, geometry: as
    `prefill_attention` passes them to its other kernels; q [T, H, D] bf16 or fp32 (`supported`'s
    strides); q_norm: q is the raw up-projection, taken as RoPE_t(RMSNorm_1(q)) with this eps."""
    t_all, heads, _ = q.shape
    assert q_norm is None or (rope is not None and 4 * rope[0].shape[-1] <= dim), "q_norm rotates the second half"
    out = torch.empty(t_all, heads, dim, dtype=out_dtype or torch.float32, device=q.device)
    cos, sin = (x.float().contiguous() for x in rope) if rope is not None else (out, out)
    window = geometry[-7]
    # the window's rows as fp16, the key tiles' type (cp.async copies them as they are): the same values
    # the kernel's conversion of bf16 rows gave
    sources = (sources[0].to(torch.float16), sources[1], sources[2].to(torch.float16), *sources[3:])
    _prefill_wide_kernel[(min(t_all, sm_count(q.device)),)](
        q, out, sinks, cos, sin, *sources, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *geometry, t_all,
        q_norm or 0.0, H=heads, D=dim, NOPE=nope, MODE=mode, WINDOW=window,
        HALF_R=rope[0].shape[-1] if rope is not None else 0, ROPE=rope is not None, QNORM=q_norm is not None,
        VALUE_REGS=dw.REGS[0], LOADER_REGS=dw.REGS[1], num_warps=4, maxnreg=dw.MAXNREG)
    return out


__all__ = ["BLOCK_N", "prefill_wide", "supported"]
