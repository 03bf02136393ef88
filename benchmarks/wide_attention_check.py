"""A one-pass decode attention with all 64 heads per program, against the default scheme (CUDA; CPU: a check).

    python benchmarks/wide_attention_check.py            # V4-Flash shapes, 128K, B = 64 and 16
    VARIANTS="16,8;32,8" BATCHES=64 python benchmarks/wide_attention_check.py

The default at B >= 8 is the two-pass scheme (`decode_attention_2p`): pass 1 the logits of all
heads, pass 2 the values per 128-channel slice. A fused kernel with every head in one program
would read and dequantise each key tile once and keep no scores buffer, but Triton lays out two
chained dots (q . K^T feeding p . V in one loop iteration) with all warps along M, so 8 warps
repeat the 64-head logits and hold a [64, 512] fp32 accumulator per warpgroup (the fused kernel
spills at 64 heads). Here each iteration runs q . K^T of tile i and p . V of tile i - 1 (p, the
dequantised tile and the rescale factor travel to the next iteration), so the two dots are not
chained in one iteration and the compiler lays each out by itself: with 16 warps the accumulator
is [64, 128] per warpgroup. Key tiles stream through the two-pass scheme's pipelined loads; the
fused kernel's split combine adds the sink. Prints µs (CUDA-graph replays, L2 flushed by
`dsv4.bench.timing.Timer`), the max error against the default scheme relative to its largest
output, registers and spills per (keys per tile, warps).
"""

from __future__ import annotations

import os
import types

import torch
import triton
import triton.language as tl
from tune_common import attention_case

from dsv4.bench import setup as bs
from dsv4.bench.common import bench_config
from dsv4.bench.timing import Timer
from dsv4.kernels.triton import decode_attention as att
from dsv4.kernels.triton import decode_combine
from dsv4.kernels.triton.decode_attention_2p import _src_idx, _src_page
from dsv4.kernels.triton.decode_common import (
    LOG2E,
    dequant_entry_tile,
    load_entry_tile,
    pdl_enter,
    pdl_launch,
    rows,
    sm_count,
)


@triton.jit
def _mm(a, b, NATIVE: tl.constexpr):
    """a @ b: bf16 tensor cores, or fp32 under the interpreter (whose bf16 dot is wrong)."""
    if NATIVE:
        return tl.dot(a, b)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _wide_src(q, m_i, l_i, acc, p_prev, k_prev, a_prev, kv_ptr, rope_ptr, sc_ptr, s_kp, s_kr, s_rp, s_rr, s_sp, s_sr,
              pos_ptr, idx_ptr, bt_row, b, s_pi, slot, t, window, limit, n_c, epb, max_blocks,
              first, end, step, qk_scale, WIN: tl.constexpr, MODE: tl.constexpr, FMT: tl.constexpr,
              D: tl.constexpr, NOPE: tl.constexpr, NCH: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr):
    w0, ok0 = _src_idx(pos_ptr, idx_ptr, b, s_pi, slot, t, window, limit, n_c, first, WIN, MODE, BLOCK_N)
    p0, r0 = _src_page(bt_row, w0, ok0, slot, epb, max_blocks, WIN)
    x0, sb0, rp0 = load_entry_tile(kv_ptr, rope_ptr, sc_ptr, p0, r0, ok0, 0, s_kp, s_kr, s_rp, s_rr, s_sp, s_sr,
                                   FMT, D, NOPE, NCH)
    w1, ok1 = _src_idx(pos_ptr, idx_ptr, b, s_pi, slot, t, window, limit, n_c, first + step, WIN, MODE, BLOCK_N)
    p1, r1 = _src_page(bt_row, w1, ok1, slot, epb, max_blocks, WIN)
    w2, ok2 = _src_idx(pos_ptr, idx_ptr, b, s_pi, slot, t, window, limit, n_c, first + 2 * step, WIN, MODE,
                       BLOCK_N)
    for tile in range(first, end, step):
        x1, sb1, rp1 = load_entry_tile(kv_ptr, rope_ptr, sc_ptr, p1, r1, ok1, 0, s_kp, s_kr, s_rp, s_rr, s_sp,
                                       s_sr, FMT, D, NOPE, NCH)
        p2, r2 = _src_page(bt_row, w2, ok2, slot, epb, max_blocks, WIN)
        w3, ok3 = _src_idx(pos_ptr, idx_ptr, b, s_pi, slot, t, window, limit, n_c, tile + 3 * step, WIN, MODE,
                           BLOCK_N)
        k = dequant_entry_tile(x0, sb0, rp0, 0, FMT, NOPE, NCH, BLOCK_N).to(tl.bfloat16)
        s = _mm(q, tl.trans(k), NATIVE) * qk_scale
        s = tl.where(ok0[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        # the previous tile's p . V: its dot is not fed by this tile's q . K^T in this iteration,
        # so the compiler lays the two dots out independently
        acc = acc * a_prev[:, None] + _mm(p_prev, k_prev, NATIVE)
        p_prev, k_prev, a_prev = p.to(tl.bfloat16), k, alpha
        x0, sb0, rp0, ok0 = x1, sb1, rp1, ok1
        p1, r1, ok1 = p2, r2, ok2
        w2, ok2 = w3, ok3
    return m_i, l_i, acc, p_prev, k_prev, a_prev


@triton.jit
def _wide_kernel(
        q_ptr, part_ptr, pml_ptr,
        wkv_ptr, wrope_ptr, wsc_ptr, swa_pos_ptr, slots_ptr, pos_ptr,
        ckv_ptr, crope_ptr, csc_ptr, bt_ptr, idx_ptr, nent_ptr,
        s_qb, s_qh, s_pb, s_ps, s_ph,
        s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, s_pos,
        s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, s_bt, s_idx,
        ring, window, epb, max_blocks, n_comp, qk_scale,
        H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, NCH: tl.constexpr,
        FMT: tl.constexpr, MODE: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0)
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    h = tl.arange(0, HP)
    hmask = h < H
    d = tl.arange(0, NCH * 64)[None, :]
    q = tl.load(q_ptr + b * s_qb + h[:, None] * s_qh + d, mask=hmask[:, None] & (d < D), other=0.0)
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, NCH * 64], tl.float32)
    p_prev = tl.zeros([HP, BLOCK_N], tl.bfloat16)
    k_prev = tl.zeros([BLOCK_N, NCH * 64], tl.bfloat16)
    a_prev = tl.zeros([HP], tl.float32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    t = tl.load(pos_ptr + b)
    n_wt = tl.cdiv(ring, BLOCK_N)
    m_i, l_i, acc, p_prev, k_prev, a_prev = _wide_src(
        q, m_i, l_i, acc, p_prev, k_prev, a_prev, wkv_ptr, wrope_ptr, wsc_ptr,
        s_wkp, s_wkr, s_wrp, s_wrr, s_wsp, s_wsr, swa_pos_ptr, idx_ptr, bt_ptr, b, s_pos, slot, t,
        window, ring, 0, epb, max_blocks, split, n_wt, n_split, qk_scale, True, MODE, FMT, D, NOPE, NCH, BLOCK_N,
        NATIVE)
    if MODE != 0:
        if MODE == 2:
            n_c = tl.minimum(tl.load(nent_ptr + b), n_comp)
        else:
            n_c = n_comp
        m_i, l_i, acc, p_prev, k_prev, a_prev = _wide_src(
            q, m_i, l_i, acc, p_prev, k_prev, a_prev, ckv_ptr, crope_ptr, csc_ptr,
            s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, swa_pos_ptr, idx_ptr, bt_ptr + b * s_bt, b,
            s_idx, slot, t, window, n_comp, n_c, epb, max_blocks,
            (split + n_split - n_wt % n_split) % n_split, tl.cdiv(n_c, BLOCK_N), n_split,
            qk_scale, False, MODE, FMT, D, NOPE, NCH, BLOCK_N, NATIVE)
    acc = acc * a_prev[:, None] + _mm(p_prev, k_prev, NATIVE)
    tl.store(part_ptr + b * s_pb + split * s_ps + h[:, None] * s_ph + d, acc, mask=hmask[:, None])
    ml = pml_ptr + ((b * n_split + split) * H + h) * 2
    tl.store(ml, m_i, mask=hmask)
    tl.store(ml + 1, l_i, mask=hmask)



LAST = None


def wide_attention(q, swa, kv_fmt, swa_pos, request_slots, positions, window, kv_views, block_table, epb,
                   indices, num_entries, max_entries, sinks, scale, *, block_n=32, num_warps=16, splits=None,
                   rope=None, out_dtype=None):
    """`decode_attention`'s arguments (fp8_ds entries) -> [B, H, D]: the one-pass kernel, one program
    per (request, key split), then the fused kernel's split combine (sink, rope, dtype)."""
    mode = 0 if indices is None and num_entries is None else (1 if indices is not None else 2)
    bsz, heads, dim = q.shape
    cuda = q.device.type == "cuda"
    nch = triton.next_power_of_2(triton.cdiv(dim, 64))
    ring = swa_pos.shape[1]
    n_comp = 0 if mode == 0 else (indices.shape[1] if mode == 1 else max_entries)
    wt = kv_fmt.typed(swa)
    ct = kv_fmt.typed(kv_views)
    wkv, ckv, wrope, crope, wsc, csc = wt["nope"], ct["nope"], wt["rope"], ct["rope"], wt["scale"], ct["scale"]
    bt = block_table
    idx = indices if indices is not None else swa_pos
    nent = num_entries if num_entries is not None else request_slots
    q = q.to(torch.bfloat16).contiguous()
    tiles = triton.cdiv(ring, block_n) + triton.cdiv(n_comp, block_n)
    n_split = splits or (max(1, sm_count(q.device) // bsz) if cuda else 2)
    n_split = max(1, min(n_split, tiles))
    hp = max(16, triton.next_power_of_2(heads))
    part = torch.empty(bsz, n_split, heads, nch * 64, dtype=torch.float32, device=q.device)
    pml = torch.empty(bsz, n_split, heads, 2, dtype=torch.float32, device=q.device)
    global LAST
    LAST = _wide_kernel[(bsz, n_split)](
        q, part, pml, wkv, wrope, wsc, swa_pos, request_slots, positions, ckv, crope, csc, bt, idx, nent,
        q.stride(0), q.stride(1), part.stride(0), part.stride(1), part.stride(2),
        *rows(wkv), *rows(wrope), *rows(wsc), swa_pos.stride(0),
        *rows(ckv), *rows(crope), *rows(csc), bt.stride(0), idx.stride(0),
        ring, window, epb, bt.shape[-1], n_comp, scale * LOG2E,
        H=heads, HP=hp, D=dim, NOPE=kv_fmt.dim - kv_fmt.rope_dim, NCH=nch, FMT=2, MODE=mode, BLOCK_N=block_n,
        NATIVE=cuda,
        num_warps=num_warps, **({"num_stages": 1} if cuda else {}), **pdl_launch(q.device))
    return decode_combine.combine(part, pml, sinks, rope, out_dtype, dim, nch, cuda)


def main() -> int:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    ctx = int(os.environ.get("CTX", 131072 if cuda else 2051))
    batches = [int(x) for x in os.environ.get("BATCHES", "64,16" if cuda else "3").split(",")]
    variants = [tuple(map(int, v.split(","))) for v in
                os.environ.get("VARIANTS", "16,16;32,16;64,16;16,8;32,8" if cuda else "16,4").split(";")]
    timer = Timer(types.SimpleNamespace(device=dev, warmup_ms=10, rep_ms=50, host_warmup=3, host_reps=15, graph=True))
    cfg, tpb = bench_config(False)
    for bsz in batches:
        st = bs.build_decode_state(cfg, context=ctx, batch=bsz, device=dev, tokens_per_block=tpb,
                                   kv_format="fp8_ds", indexer_format="mxfp4")
        for kind in ("csa", "hca"):
            aargs = attention_case(st, kind, bsz, ctx, dev)
            ref = att.decode_attention(*aargs)
            row = [f"default {timer.time(lambda a=aargs: att.decode_attention(*a), graph=True).us:6.1f}"]
            for bn, w in variants:
                o = wide_attention(*aargs, block_n=bn, num_warps=w)
                err = ((o - ref).abs().max() / ref.abs().max()).item()
                us = timer.time(lambda a=aargs, bn=bn, w=w: wide_attention(*a, block_n=bn, num_warps=w), graph=True).us
                regs = (getattr(LAST, "n_regs", 0), getattr(LAST, "n_spills", 0))
                row.append(f"{bn} keys x {w} warps {us:6.1f} (err {err:.1e}, {regs[0]} regs, {regs[1]} spills)")
            print(f"{kind} B={bsz} C={ctx}: " + "; ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
