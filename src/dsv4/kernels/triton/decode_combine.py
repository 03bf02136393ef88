"""The split combine of the decode attention's key-split partials (the fused kernel with S > 1,
the halves scheme): the sink, the inverse rotation and the output dtype in one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.decode_common import inverse_rope, pdl_enter, pdl_launch, sm_count, split_stats


@triton.jit
def _combine_kernel(part_ptr, pml_ptr, sinks_ptr, cos_ptr, sin_ptr, out_ptr, s_pb, s_ps, s_ph, s_ob, s_oh,
                    H: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, HALF_R: tl.constexpr, ROPE: tl.constexpr,
                    UNROLL: tl.constexpr, TRIP: tl.constexpr, NORMED: tl.constexpr, PDL: tl.constexpr):
    """out = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s + 2^(sink - M)), M = max(m_s, sink)
    (NORMED: the partials are acc_s / l_s, weighted by l_s 2^(m_s - M));
    ROPE: then the inverse rotation RoPE_{-t} of the trailing 2 HALF_R channels (interleaved pairs,
    as `norm_rope`), so the layer needs no separate pass over the output. Stored in out's dtype.

    Program (b, head block, 64-channel block). UNROLL (S <= 32): every split's load is issued at
    once (a static loop), else TRIP splits' loads are in flight per trip (one load per trip left
    B = 1 with 4 programs waiting on each split in turn; trips of 8 over the fused kernel's 66
    splits at B = 1, 1M, HCA: 19.3 µs of a 123 µs layer, H200). H200, B = 1, 128K, profile: unrolled with
    8-head programs (small grids) the combine takes CSA 2.4 / HCA 3.9 µs, vs 4.4 / 7.7 µs in trips
    of 8 over 16-head programs (3.3 / 5.7 unrolled at 16 heads); 4-head programs with a
    [16 splits, 4, 64] tile were slower still. The rotation pairs channels in registers after the
    sum (`inverse_rope`): loading each rotated channel's partner d ^ 1 in the loop instead took the
    combine from 3.6 to 8.2 µs (CSA, B = 1)."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    m_f, den = split_stats(pml_ptr, sinks_ptr, b, h, hmask, H, S, S_PAD)
    d0 = tl.program_id(2) * BLOCK_D
    d = d0 + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if UNROLL:
        for si in tl.static_range(S):
            wgt = tl.exp2(tl.load(pml_ptr + ((b * S + si) * H + h) * 2, mask=hmask, other=float("-inf")) - m_f)
            if NORMED:
                wgt *= tl.load(pml_ptr + ((b * S + si) * H + h) * 2 + 1, mask=hmask, other=0.0)
            part = tl.load(part_ptr + b * s_pb + si * s_ps + h[:, None] * s_ph + d[None, :], mask=hmask[:, None],
                           other=0.0)
            acc += wgt[:, None] * part.to(tl.float32)
    else:
        for s0 in range(0, S, TRIP):                    # TRIP splits' loads in flight per trip
            for u in tl.static_range(TRIP):
                si = s0 + u
                ok = hmask & (si + 0 * h < S)
                wgt = tl.exp2(tl.load(pml_ptr + ((b * S + si) * H + h) * 2, mask=ok, other=float("-inf")) - m_f)
                if NORMED:
                    wgt *= tl.load(pml_ptr + ((b * S + si) * H + h) * 2 + 1, mask=ok, other=0.0)
                # no channel mask: the partials are padded to NCH * 64 channels (a per-channel mask cost
                # ~4 µs at B = 1, H200)
                part = tl.load(part_ptr + b * s_pb + si * s_ps + h[:, None] * s_ph + d[None, :], mask=ok[:, None],
                               other=0.0)
                acc += wgt[:, None] * part.to(tl.float32)
    o = acc / den[:, None]
    if ROPE:
        o = inverse_rope(o, b, d0, cos_ptr, sin_ptr, BLOCK_H, BLOCK_D, D, HALF_R)
    tl.store(out_ptr + b * s_ob + h[:, None] * s_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=hmask[:, None] & (d < D)[None, :])



#: splits whose loads one combine trip issues together, past UNROLL_SPLITS splits (`_combine_kernel`)
COMBINE_TRIP = 8
#: up to this many splits the combine issues every split's loads at once (a static loop)
UNROLL_SPLITS = 32


def combine(part: torch.Tensor, pml: torch.Tensor, sinks: torch.Tensor,
             rope: tuple[torch.Tensor, torch.Tensor] | None, out_dtype: torch.dtype | None,
             dim: int, nch: int, cuda: bool, trip: int | None = None, block_h: int | None = None,
             block_d: int | None = None) -> torch.Tensor:
    """The split combine of key-split partials part [B, S, H, nch * 64] (fp32 acc_s, or fp16 acc_s / l_s)
    and stats pml [B, S, H, 2]: the sink, the inverse rotation, the output dtype -> [B, H, D]. trip
    (splits per trip past 32 splits; COMBINE_TRIP), block_h, block_d: tuning."""
    bsz, n_split, heads, _ = part.shape
    out = torch.empty(bsz, heads, dim, dtype=out_dtype or torch.float32, device=part.device)
    bhc, bdc = min(16, triton.next_power_of_2(heads)), 64 if cuda else nch * 64
    if cuda and bsz * triton.cdiv(heads, bhc) * nch < sm_count(part.device):
        # a grid smaller than the GPU: a program per (head, 128 channels) keeps the most partial bytes
        # in flight (benchmarks/combine_trip.py, H200, 66 splits at B = 1: 18.2 µs against 42.0 at
        # 8 heads x 64 channels, 22.7 at 2 x 64; 33 splits at B = 2: 10.9 against 21.5)
        bhc, bdc = 1, 128
    bhc, bdc = block_h or bhc, block_d or bdc
    # without rope, any fp32 tensor stands in for cos / sin (never read): no conversion kernel
    cos, sin = (t.float().contiguous() for t in rope) if rope is not None else (pml, pml)
    _combine_kernel[(bsz, triton.cdiv(heads, bhc), triton.cdiv(nch * 64, bdc))](
        part, pml, sinks, cos, sin, out,
        part.stride(0), part.stride(1), part.stride(2), out.stride(0), out.stride(1),
        H=heads, S=n_split, S_PAD=triton.next_power_of_2(n_split), BLOCK_H=bhc, D=dim, BLOCK_D=bdc,
        HALF_R=rope[0].shape[-1] if rope is not None else 0, ROPE=rope is not None, UNROLL=n_split <= UNROLL_SPLITS,
        TRIP=trip or COMBINE_TRIP, NORMED=part.dtype == torch.float16, num_warps=4, **pdl_launch(part.device))
    return out
