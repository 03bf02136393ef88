"""Triton twin of `reference.attention.prefill_attention`: sink attention of every new token of a
prefill (or mixed) batch over its window and its compressed entries. Three schemes: the fused
kernel below (any precision, any head count); the value halves (`prefill_attention_halves`), the
default for bf16 operands at D 512 with 64 or more heads on CUDA (H200, an 8K chunk after 24K
cached: 2.3x (CSA) and 2.2x (HCA) faster than the fused kernel); and where its conditions hold
(fp8_ds entries, 64 heads, an sm_90 GPU), the wide scheme in its place (`prefill_attention_wide`,
Gluon: H100, the same chunk in the layer's form, 2.0x (CSA) and 1.8x (HCA) faster than the halves).

    grid (T, head blocks): program (i, hb) is token i's BLOCK_H heads; one online softmax over
        window     positions t - W + 1 .. t in key tiles: position p < p0 (the request's first
                   new position) is ring row W - p0 + p of the old ring (gathered in position
                   order before this step's writes, its stored position checked), p >= p0 is
                   new row i - t + p of this step (the same request, packed before token i)
        entries    CSA: the token's selected entries; HCA: the first (t + 1) // ratio; read from
                   the paged pool through the request's block-table row and dequantised in
                   registers (decode_attention's loads and online-softmax step, one split)
    then the sink, once, in the epilogue.

A token's keys are at most W + K (CSA) or W + t / ratio (HCA), so the work is linear in the
chunk: the reference's masked dense pass over every key of the request is quadratic. Window rows
of fp8_ds / bf16 caches are bf16-exact, so they are read as bf16 (half the bytes); fp32 caches
keep fp32 rows. Tiles and precision follow decode_attention's fused kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.cache.formats import EntryFormat
from dsv4.errors import FormatError, InputError
from dsv4.kernels.triton.decode_attention import (
    _MAIN_FMT,
    NUM_STAGES,
    _attend,
    _attention_tiles,
    _finish,
    attend_entries,
    with_sink,
)
from dsv4.kernels.triton.decode_common import LOG2E, Views, note_compile, precision_id, rows, split_operand
from dsv4.kernels.triton.norm_rope import norm_rope
from dsv4.kernels.triton.prefill_attention_halves import prefill_halves_tiles, prefill_value_halves, window_rows

try:        # Gluon (Triton 3.6+): the wide scheme
    from dsv4.kernels.triton import prefill_attention_wide as pw
except ImportError:
    pw = None


@triton.jit
def _prefill_attn_kernel(
        q_ptr, sinks_ptr, out_ptr, old_ptr, oldpos_ptr, new_ptr, pos_ptr, treq_ptr, cu_ptr,
        ckv_ptr, crope_ptr, csc_ptr, bt_ptr, idx_ptr,
        s_qt, s_qh, s_ot, s_oh, s_ob, s_or, s_opb, s_nt,
        s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, s_bt, s_idx,
        window, ring, epb, max_blocks, n_idx, ratio, qk_scale,
        H: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, NCH: tl.constexpr,
        FMT: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, NATIVE: tl.constexpr, BLOCK_N: tl.constexpr):
    """MODE 0 SWA, 1 CSA (indices [T, K]), 2 HCA (the first (t + 1) // ratio entries). out [T, H, D]."""
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    b = tl.load(treq_ptr + i).to(tl.int64)
    t = tl.load(pos_ptr + i).to(tl.int64)
    p0 = t - (i - tl.load(cu_ptr + b).to(tl.int64))            # the request's first new position
    d = tl.arange(0, NCH * 64)[None, :]
    q = tl.load(q_ptr + i * s_qt + h[:, None] * s_qh + d, mask=hmask[:, None] & (d < D), other=0.0)
    q_hi, q_lo = split_operand(q, PREC)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, NCH * 64], tl.float32)

    for tile in range(0, tl.cdiv(window, BLOCK_N)):
        k, valid = window_rows(old_ptr, oldpos_ptr, new_ptr, b, i, t, p0, tile * BLOCK_N, window, ring,
                                s_ob, s_or, s_opb, s_nt, 0, D, NCH, BLOCK_N)
        m_i, l_i, acc = _attend(q_hi, q_lo, k.to(q_hi.dtype), valid, m_i, l_i, acc, qk_scale, PREC, NATIVE)

    if MODE != 0:
        if MODE == 2:
            n_c = (t + 1) // ratio
        else:
            n_c = n_idx
        m_i, l_i, acc = attend_entries(
            q_hi, q_lo, m_i, l_i, acc, ckv_ptr, crope_ptr, csc_ptr, bt_ptr + b * s_bt, idx_ptr + i * s_idx,
            n_c, n_idx, 0, 1, s_ckp, s_ckr, s_crp, s_crr, s_csp, s_csr, epb, max_blocks, qk_scale,
            FMT, D, NOPE, NCH, MODE, PREC, NATIVE, BLOCK_N)

    out = with_sink(acc, m_i, l_i, sinks_ptr, h, hmask)
    tl.store(out_ptr + i * s_ot + h[:, None] * s_oh + d, out, mask=hmask[:, None] & (d < D))


def prefill_attention(q: torch.Tensor, old_kv: torch.Tensor, old_pos: torch.Tensor, new_kv: torch.Tensor,
                      positions: torch.Tensor, token_request: torch.Tensor, cu_seqlens: torch.Tensor, window: int,
                      kv_views: Views | None, kv_fmt: EntryFormat, block_table: torch.Tensor | None,
                      epb: int, indices: torch.Tensor | None, ratio: int, max_entries: int, sinks: torch.Tensor,
                      scale: float, *, precision: str | None = None, block_h: int | None = None,
                      block_n: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, scheme: str | None = None,
                      rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                      out_dtype: torch.dtype | None = None, q_norm: float | None = None) -> torch.Tensor:
    """Attention of every new token of a batch over its window and entries (see the reference).

    Args: as `reference.attention.prefill_attention` (max_entries is not needed here: every bound
    is device-side), plus
        precision, block_h, block_n, num_warps, num_stages: tuning knobs of the fused kernel
            (block_n, num_warps also the halves scheme's);
        scheme: "fused" (the kernel above) or "halves" (`prefill_attention_halves`); default: see
            `_prefill_scheme`;
        rope: (cos, sin) [T, r/2]: return RoPE_{-t}(o) (in the halves kernel's epilogue; by
            `norm_rope` after the fused kernel); out_dtype: the output's dtype (default fp32);
        q_norm: q is the raw up-projection (any token stride), taken as RoPE_t(RMSNorm_1(q)) with this
            eps and rope's cos / sin: normalised where the wide kernel loads it, else by `norm_rope`
            first (rounded to bf16 for bf16 operands, as the layer's queries were).
    Returns:
        [T, H, D] out_dtype.
    """
    if kv_fmt.name not in _MAIN_FMT:
        raise FormatError(f"prefill_attention reads main-entry formats {tuple(_MAIN_FMT)}, got {kv_fmt.name!r}")
    if kv_fmt.name == "fp8_ds" and kv_fmt.rope_dim > 64:
        raise FormatError(f"prefill_attention reads fp8_ds entries with rope_dim <= 64, got {kv_fmt.rope_dim}")
    if scheme is not None and scheme not in PREFILL_SCHEMES:
        raise InputError(f"scheme={scheme!r} is not one of {PREFILL_SCHEMES}")
    t_all, heads, dim = q.shape
    mode = 0 if not ratio else (1 if indices is not None else 2)
    if mode and (kv_views is None or block_table is None):
        raise InputError("compressed keys (ratio > 0) need kv_views and block_table")
    if dim != kv_fmt.dim or sinks.shape != (heads,) or new_kv.shape != (t_all, dim) or old_kv.shape[-1] != dim:
        raise InputError(f"q [T, H, {kv_fmt.dim}], new_kv [T, D], old_kv [B, W, D], sinks [H] expected; got "
                         f"{list(q.shape)}, {list(new_kv.shape)}, {list(old_kv.shape)}, {list(sinks.shape)}")
    if rope is not None and (rope[0].shape != rope[1].shape or rope[0].shape[0] != t_all
                             or 2 * rope[0].shape[-1] > kv_fmt.rope_dim):
        raise InputError(f"rope: cos, sin [T, <= {kv_fmt.rope_dim // 2}] expected; got {list(rope[0].shape)}, "
                         f"{list(rope[1].shape)}")
    if q_norm is not None and rope is None:
        raise InputError("q_norm rotates q: it needs rope=(cos, sin) of the tokens' positions")
    cuda = q.device.type == "cuda"
    prec = precision_id(precision, "ieee" if kv_fmt.name == "fp32" else "bf16")
    nch = triton.next_power_of_2(triton.cdiv(dim, 64))
    default = scheme is None
    scheme = scheme or _prefill_scheme(heads, nch, prec, cuda, block_h is None and num_stages is None)
    if scheme in ("halves", "wide") and (prec != 1 or nch % 2):
        raise InputError(f"the {scheme} scheme takes bf16 operands and an even number of 64-channel chunks, not "
                         f"precision {precision or 'default'} at D {dim}")
    halves = scheme in ("halves", "wide")
    if t_all == 0:
        return torch.empty(t_all, heads, dim, dtype=out_dtype or torch.float32, device=q.device)
    row_dtype = torch.float32 if kv_fmt.name == "fp32" else torch.bfloat16    # exact for fp8_ds / bf16 rows
    old_kv, new_kv = old_kv.to(row_dtype).contiguous(), new_kv.to(row_dtype).contiguous()
    old_pos = old_pos.contiguous()
    if q.stride(2) != 1 or q.stride(1) != dim:      # a token's queries in one run (any token stride)
        q = q.contiguous()
    if mode:
        ct = kv_fmt.typed(kv_views)
        ckv = ct["nope"] if kv_fmt.name == "fp8_ds" else ct["kv"]
        crope, csc = (ct["rope"], ct["scale"]) if kv_fmt.name == "fp8_ds" else (ckv, ckv)
        bt = block_table
    else:                      # no entries: placeholders the kernel never reads
        ckv = crope = csc = old_kv
        bt = positions
    idx = indices if indices is not None else positions
    sources = (old_kv, old_pos, new_kv, positions, token_request, cu_seqlens, ckv, crope, csc, bt, idx)
    geometry = (old_kv.stride(0), old_kv.stride(1), old_pos.stride(0), new_kv.stride(0),
                *(rows(ckv) if mode else (0, 0)), *(rows(crope) if mode else (0, 0)),
                *(rows(csc) if mode else (0, 0)), bt.stride(0), idx.stride(0),
                window, old_pos.shape[1], epb, bt.shape[-1] if bt.dim() == 2 else 1,
                indices.shape[1] if indices is not None else 0, max(ratio, 1), scale * LOG2E)
    consts = {"D": dim, "NOPE": kv_fmt.dim - kv_fmt.rope_dim, "FMT": _MAIN_FMT[kv_fmt.name], "MODE": mode,
              "NATIVE": cuda}
    nope = kv_fmt.dim - kv_fmt.rope_dim
    if default and scheme == "halves" and pw is not None and pw.supported(q, old_kv, new_kv, (ckv, crope, csc), dim,
                                                                          nope, kv_fmt.name):
        # H100, an 8K chunk after 24K cached, bf16 q, rotation and bf16 output (the layer's form;
        # `benchmarks/tune_decode.py --prefill-attention`): halves / wide CSA 3,951 / 1,931 µs, HCA 2,248 / 1,271
        scheme = "wide"
    if scheme == "wide":
        if pw is None or not pw.supported(q, old_kv, new_kv, (ckv, crope, csc), dim, nope, kv_fmt.name):
            raise InputError("the wide scheme takes fp8_ds entries of 448 + 64 channels (16-byte aligned rows) and "
                             "64 heads on an sm_90 GPU, with Triton 3.6 or later")
        return pw.prefill_wide(q, sinks, rope, out_dtype, sources, geometry, dim=dim, nope=nope, mode=mode,
                               q_norm=q_norm)
    if q_norm is not None:
        q = norm_rope(q, None, q_norm, *rope, out_dtype=torch.bfloat16 if prec == 1 else torch.float32)
    q = q.contiguous() if halves else q.float().contiguous()    # the halves kernel rounds q to bf16 itself
    out = torch.empty(t_all, heads, dim, dtype=(out_dtype or torch.float32) if halves else torch.float32,
                      device=q.device)
    if halves:
        bn, warps = prefill_halves_tiles(cuda)
        prefill_value_halves(q, sinks, out, rope, sources, geometry, dim=dim, nope=consts["NOPE"], nch=nch,
                             fmt=consts["FMT"], mode=mode, native=cuda, block_n=block_n or bn,
                             warps=num_warps or warps)
        return out
    bh, bn, warps = _prefill_tiles(heads, nch, prec, cuda)
    bh, bn, warps = block_h or bh, block_n or bn, num_warps or warps
    k = _prefill_attn_kernel[(t_all, triton.cdiv(heads, bh))](
        q, sinks, out, *sources, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *geometry,
        H=heads, BLOCK_H=bh, NCH=nch, PREC=prec, BLOCK_N=bn, **consts,
        num_warps=warps, **({"num_stages": num_stages or NUM_STAGES} if cuda else {}))
    note_compile("prefill_attention", k)
    return _finish(out, rope, out_dtype)


#: the schemes of prefill_attention
PREFILL_SCHEMES = ("fused", "halves", "wide")
#: the halves scheme from this many heads on CUDA (one warpgroup's 64 rows)
HALVES_MIN_HEADS = 64


def _prefill_scheme(heads: int, nch: int, prec: int, cuda: bool, no_fused_knobs: bool) -> str:
    """Default scheme: the halves scheme for bf16 operands at D 512 with 64 or more heads on CUDA,
    else the fused kernel; the CPU interpreter takes the halves scheme for bf16 operands whenever
    no fused-kernel knob is given, so the tests cover both. H200, V4-Flash shapes: the halves
    scheme takes the 32K prefill layer from 79.4 to 41.8 ms (CSA) and 41.9 to 18.7 ms (HCA)."""
    if prec != 1 or nch % 2:
        return "fused"
    if not cuda:
        return "halves" if no_fused_knobs else "fused"
    return "halves" if nch >= 8 and heads >= HALVES_MIN_HEADS else "fused"


def _prefill_tiles(heads: int, nch: int, prec: int, cuda: bool) -> tuple[int, int, int]:
    """Default (BLOCK_H, BLOCK_N, num_warps): decode_attention's fused-kernel tiles, except bf16
    operands at D 512 on CUDA take 64-key tiles (more gathered rows in flight per trip; the kernel
    is latency-bound at one 8-warp program per SM). H200, Triton 3.6, an 8K chunk after 24K cached,
    fp8_ds, 64 heads (`benchmarks/tune_decode.py --prefill-attention`): CSA 13.6 ms vs 19.2 at 32
    keys and 16.4 at 16 keys x 4 warps; HCA 8.9 vs 11.1 / 9.2; 32 or 64 heads per program spill.
    """
    if cuda and prec == 1 and nch >= 8:
        return 16, 64, 8
    return _attention_tiles(heads, nch, prec, cuda)


__all__ = ["prefill_attention"]
