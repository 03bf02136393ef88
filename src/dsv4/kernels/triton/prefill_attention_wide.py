"""Wide prefill attention (Gluon, sm_90): the decode wide kernel's program (`decode_attention_wide`:
loader, scores and values warpgroups over all 64 heads and 512 channels) for each new token of a
prefill chunk, fp8_ds entries (the "wide" scheme of `prefill_attention`).

    grid (T,): program i runs one online softmax over token i's key tiles: its window's 64-row
    tiles first (bf16 rows of this step, `new_kv`, or of the ring gathered before the step,
    `old_kv`, picked as `prefill_attention_halves.window_rows` picks them), then its entries'
    tiles (CSA: its selected indices; HCA: the first (t + 1) // m entries) through the decode
    loader's pipeline. It stores its normalised partial as one split of the decode kernel does,
    and the decode split combine (`decode_combine.combine`) adds the sink, applies the inverse
    rotation and writes the output dtype.

Against the value-halves scheme (`prefill_attention_halves`: two programs a token, each computing
every logit and half the values on one warpgroup, 32-key tiles) each key tile is dequantised once
and its logits computed once, on warpgroup MMAs fed by a loader warpgroup of their own. Operands
are fp16, as the decode wide kernel's: e4m3 x 2^(e - 127) is fp16-exact (`_store_chunk`), and the
window's bf16 rows convert exactly above 2^-14 in magnitude (below, fp16's subnormals keep fewer
bits: an error under 2^-25 a channel).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from dsv4.kernels.triton import decode_attention_wide as dw
from dsv4.kernels.triton.decode_combine import combine

#: keys a tile, as the decode wide kernel's
BLOCK_N = dw.BLOCK_N
_BN = gl.constexpr(BLOCK_N)


@gluon.jit
def _window_tiles(k_s, bias_s, k_ready, k_free, old_ptr, oldpos_ptr, new_ptr, s_ob, s_or, s_opb, s_nt, b, i, t,
                  p0, ring, WINDOW: gl.constexpr, D: gl.constexpr):
    """Tiles 0 .. cdiv(W, 64) - 1: window rows r at positions p = t - W + 1 + r, p >= p0 new row
    i - t + p, p < p0 ring row W - p0 + p of the gathered ring (its stored position checked); bf16
    rows into the fp16 key tiles, four 64-channel chunks of loads in flight at a time."""
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
        rowp = gl.expand_dims(rowp, 1) + jr
        okr = gl.expand_dims(ok, 1)
        mbarrier.wait(k_free.index(w % 2), ((w // 2) & 1) ^ 1)
        kt = k_s.index(w % 2)
        bias_s.index(w % 2).store(gl.where(ok, 0.0, float("-inf")))
        for h in gl.static_range(D // 256):
            x0 = gl.load(rowp + (4 * h) * 64, mask=okr, other=0.0)
            x1 = gl.load(rowp + (4 * h + 1) * 64, mask=okr, other=0.0)
            x2 = gl.load(rowp + (4 * h + 2) * 64, mask=okr, other=0.0)
            x3 = gl.load(rowp + (4 * h + 3) * 64, mask=okr, other=0.0)
            kt.slice((4 * h) * 64, 64, dim=1).store(x0.to(gl.float16))
            kt.slice((4 * h + 1) * 64, 64, dim=1).store(x1.to(gl.float16))
            kt.slice((4 * h + 2) * 64, 64, dim=1).store(x2.to(gl.float16))
            kt.slice((4 * h + 3) * 64, 64, dim=1).store(x3.to(gl.float16))
        fence_async_shared()            # generic-proxy stores before the MMAs' async-proxy reads
        dw._barrier()                   # ... from all four warps before the one arrive
        mbarrier.arrive(k_ready.index(w % 2), count=1)


@gluon.jit
def _prefill_loader(k_s, bias_s, raw_s, k_ready, k_free, old_ptr, oldpos_ptr, new_ptr, s_ob, s_or, s_opb, s_nt,
                    idx_row, bt_row, ckv_ptr, crope_ptr, csc_ptr, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr,
                    b, i, t, p0, ring, n_et, n_c, epb, max_blocks, n_idx,
                    WINDOW: gl.constexpr, D: gl.constexpr, MODE: gl.constexpr, NOPE: gl.constexpr):
    _window_tiles(k_s, bias_s, k_ready, k_free, old_ptr, oldpos_ptr, new_ptr, s_ob, s_or, s_opb, s_nt, b, i, t,
                  p0, ring, WINDOW, D)
    if MODE != 0:
        # the decode loader over the entry tiles alone: no ring (n_wt 0), one split, the token's
        # index row and its request's block-table row as rows 0
        dw._loader(k_s, bias_s, raw_s, k_ready, k_free, oldpos_ptr, idx_row, bt_row, ckv_ptr, crope_ptr, csc_ptr,
                   0, 0, 0, 0, 0, 0, 0, 0, 0, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, 0, 0, 0,
                   0, 0, t, 0, 1, n_et, 0, n_c, 0, WINDOW, epb, max_blocks, n_idx, MODE, NOPE,
                   (WINDOW + _BN - 1) // _BN)


@gluon.jit
def _prefill_wide_kernel(
        q_ptr, part_ptr, pml_ptr, old_ptr, oldpos_ptr, new_ptr, pos_ptr, treq_ptr, cu_ptr,
        ckv_ptr, crope_ptr, csc_ptr, bt_ptr, idx_ptr,
        s_qt, s_qh, s_pb, s_ps, s_ph, s_ob, s_or, s_opb, s_nt,
        s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, s_bt, s_idx,
        window, ring, epb, max_blocks, n_idx, ratio, qk_scale,
        H: gl.constexpr, D: gl.constexpr, NOPE: gl.constexpr, MODE: gl.constexpr, WINDOW: gl.constexpr,
        VALUE_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, PDL: gl.constexpr):
    """Program i -> part[i, 0] (acc / l [H, D] fp16), pml[i, 0] (m, l). MODE 0 SWA, 1 CSA (indices
    [T, K]), 2 HCA (the first (t + 1) // ratio entries). `window` equals WINDOW (kept as the other
    prefill kernels' argument)."""
    dw._pdl_enter(PDL)
    i = gl.program_id(0).to(gl.int64)
    (q_s, k_s, p_s, a_s, bias_s, raw_s, l_s, k_ready, k_free, p_ready, p_free,
     l_ready) = dw._buffers(H, D)
    b = gl.load(treq_ptr + i).to(gl.int64)
    t = gl.load(pos_ptr + i).to(gl.int32)
    p0 = t - (i - gl.load(cu_ptr + b).to(gl.int64)).to(gl.int32)    # the request's first new position
    if MODE == 2:
        n_c = (t + 1) // ratio
    elif MODE == 1:
        n_c = n_idx
    else:
        n_c = t * 0
    n_et = gl.cdiv(n_c, _BN)
    mine = (WINDOW + _BN - 1) // _BN + n_et
    gl.warp_specialize([
        (dw._scores, (q_ptr, s_qt, s_qh, q_s, k_s, p_s, a_s, bias_s, l_s, k_ready, k_free, p_ready, p_free, l_ready,
                      part_ptr, pml_ptr, s_pb, s_ps, s_ph, i, 0, 1, mine, qk_scale, D, H)),
        (dw._values, (q_s, k_s, p_s, a_s, l_s, k_ready, k_free, p_ready, p_free, l_ready, part_ptr, s_pb, s_ps, s_ph,
                      i, 0, mine, D, H)),
        (_prefill_loader, (k_s, bias_s, raw_s, k_ready, k_free, old_ptr, oldpos_ptr, new_ptr, s_ob, s_or, s_opb,
                           s_nt, idx_ptr + i * s_idx, bt_ptr + b * s_bt, ckv_ptr, crope_ptr, csc_ptr, s_ckp, s_ckr,
                           s_crp, s_crr, s_csp, s_csr, b, i, t, p0, ring, n_et, n_c, epb, max_blocks, n_idx,
                           WINDOW, D, MODE, NOPE)),
    ], [4, 4], [VALUE_REGS, LOADER_REGS])


def supported(q: torch.Tensor, old_kv: torch.Tensor, new_kv: torch.Tensor, entries: tuple, dim: int, nope: int,
              fmt_name: str) -> bool:
    """Whether the wide kernel takes this call: the decode wide kernel's conditions on q and the
    entries (`decode_attention_wide.supported`), and bf16 window rows on 16-byte boundaries."""
    if not dw.supported(q, (*entries, *entries), dim, nope, fmt_name):
        return False
    return all(x.dtype == torch.bfloat16 and x.stride(-1) == 1 and x.data_ptr() % 16 == 0
               and all(s * 2 % 16 == 0 for s in x.stride()[:-1]) for x in (old_kv, new_kv))


def prefill_wide(q: torch.Tensor, sinks: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                 out_dtype: torch.dtype | None, sources: tuple, geometry: tuple, *, dim: int, nope: int,
                 mode: int) -> torch.Tensor:
    """Launch the wide kernel and the split combine -> out [T, H, D] (out_dtype, default fp32), the
    finished attention output, RoPE_{-t} applied where rope = (cos, sin) [T, r/2] is given.
    sources, geometry: as `prefill_attention` passes them to its other kernels; q [T, H, D] bf16 or fp32."""
    t_all, heads, _ = q.shape
    part = torch.empty(t_all, 1, heads, dim, dtype=torch.float16, device=q.device)
    pml = torch.empty(t_all, 1, heads, 2, dtype=torch.float32, device=q.device)
    window = geometry[-7]
    _prefill_wide_kernel[(t_all,)](
        q, part, pml, *sources, q.stride(0), q.stride(1), part.stride(0), part.stride(1), part.stride(2), *geometry,
        H=heads, D=dim, NOPE=nope, MODE=mode, WINDOW=window, VALUE_REGS=dw.REGS[0], LOADER_REGS=dw.REGS[1],
        PDL=False, num_warps=4, maxnreg=dw.MAXNREG)
    return combine(part, pml, sinks, rope, out_dtype, dim, dim // 64, True)


__all__ = ["BLOCK_N", "prefill_wide", "supported"]
