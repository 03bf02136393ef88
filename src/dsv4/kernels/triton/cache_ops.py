"""Triton twins of the cache writes and of the decode-step compressor update.

Same signatures and results as `dsv4.kernels.reference.cache_ops.append_window`,
`...cache_ops.write_entries` and `dsv4.kernels.reference.decode.compress_decode`: the cache
bytes they write are identical to the reference's, byte for byte, for every format (fp8_ds,
bf16, fp32; mxfp4, fp8, nvfp4, bf16_i, fp32_i); compress_decode matches within fp32 rounding
(exp and fused multiply-adds may differ in the last ulp).

One program encodes and stores one entry row: it computes the destination (page, row) from
device metadata, quantises the row in registers and writes every region of the row. No host
reads, no boolean-mask indexing, fixed grids: a decode step built from these launches can be
captured in a CUDA graph.

The row encoders (integer-exact conversions) live in `dsv4.kernels.triton.encode`.

Region views arrive as {name: [N, P, bytes] uint8} strided views of a page buffer; kernels take
each view's base pointer and its (page, row) strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsv4.cache.formats import EntryFormat
from dsv4.errors import FormatError, InputError
from dsv4.kernels.reference.cache_ops import EntryWrite, roundtrip_dtype
from dsv4.kernels.reference.norm_rope import EntryFinish
from dsv4.kernels.triton.decode_common import pdl, pdl_launch
from dsv4.kernels.triton.encode import FORMAT_ID, _encode_row, round_bf16, round_fp8_ds_tiles
from dsv4.kernels.triton.hadamard import fwht_constants

Views = dict[str, torch.Tensor]

_WRITE_WARPS = 2  # a row is 0.1-2 KB: one or two warps of 16-byte stores cover it
_FUSED_WARPS = 4  # `compress_decode(write=)`: a request's whole compressor row and its entry in one program


def _write_warps(dim: int) -> int:
    """Warps per written row: one for rows of up to 128 channels (indexer keys), else two. A CSA
    prefill chunk writes its indexer keys beside the main entries (2,048 rows each per 8K chunk):
    at one warp more of both writes' programs are resident at once (H200, 32K-token prompt: CSA
    compress_flush 98.6 / 98.7 -> 96.1 / 95.7 µs; the main entries at one warp too: 101.2 / 101.5)."""
    return 1 if dim <= 128 else _WRITE_WARPS


@triton.jit
def _append_window_kernel(
        kv_ptr, kv_s0, kv_s1, pos_ptr, treq_ptr, rslot_ptr, seq_ptr, swa_pos_ptr, sp_s0, sp_s1, head_ptr,
        r0, r0_s0, r0_s1, r1, r1_s0, r1_s1, r2, r2_s0, r2_s1, T, B, W,
        FMT: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, ROPE: tl.constexpr, ROPE_P2: tl.constexpr,
        SB: tl.constexpr, SB_P2: tl.constexpr, HAD: tl.constexpr, LOG_D: tl.constexpr, HSCALE: tl.constexpr):
    """Program i: token i (if i < T) into its ring row, and request i's head (if i < B)."""
    i = tl.program_id(0)
    is_tok = i < T
    req = tl.load(treq_ptr + i, mask=is_tok, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + i, mask=is_tok, other=0)
    seq = tl.load(seq_ptr + req, mask=is_tok, other=0)
    slot = tl.load(rslot_ptr + req, mask=is_tok, other=0).to(tl.int64)
    keep = is_tok & (pos >= seq - W)          # only the last W tokens of a request can stay in the ring
    row = pos % W
    row = tl.where(row < 0, row + W, row).to(tl.int64)   # floor modulo, as torch's %
    x_ptr = kv_ptr + i.to(tl.int64) * kv_s0
    _encode_row(x_ptr, kv_s1, r0 + slot * r0_s0 + row * r0_s1, r1 + slot * r1_s0 + row * r1_s1,
                r2 + slot * r2_s0 + row * r2_s1, keep.to(tl.int32), FMT, D, D_P2, ROPE, ROPE_P2, SB, SB_P2,
                HAD, LOG_D, HSCALE)
    tl.store(swa_pos_ptr + slot * sp_s0 + row * sp_s1, pos.to(swa_pos_ptr.dtype.element_ty), mask=keep)
    is_req = i < B
    hslot = tl.load(rslot_ptr + i, mask=is_req, other=0).to(tl.int64)
    hseq = tl.load(seq_ptr + i, mask=is_req, other=0)
    tl.store(head_ptr + hslot, hseq.to(head_ptr.dtype.element_ty), mask=is_req)


@triton.jit
def _finish_loads(x_row, xs, w_ptr, inv_ptr, D: tl.constexpr, HALF_R: tl.constexpr):
    """What `_finish_math` reads of one row: its nope part, the rope part's even and odd channels
    (fp32), their RMSNorm weights and the rope pairs' inverse frequencies."""
    NOPE: tl.constexpr = D - 2 * HALF_R
    k = tl.arange(0, triton.next_power_of_2(max(NOPE, 1)))
    km = k < NOPE
    p = tl.arange(0, triton.next_power_of_2(max(HALF_R, 1)))
    pm = p < HALF_R
    xn = tl.load(x_row + k * xs, mask=km, other=0.0).to(tl.float32)
    even = tl.load(x_row + (NOPE + 2 * p) * xs, mask=pm, other=0.0).to(tl.float32)
    odd = tl.load(x_row + (NOPE + 2 * p + 1) * xs, mask=pm, other=0.0).to(tl.float32)
    wn = tl.load(w_ptr + k, mask=km, other=0.0).to(tl.float32)
    we = tl.load(w_ptr + NOPE + 2 * p, mask=pm, other=0.0).to(tl.float32)
    wo = tl.load(w_ptr + NOPE + 2 * p + 1, mask=pm, other=0.0).to(tl.float32)
    inv_f = tl.load(inv_ptr + p, mask=pm, other=0.0)
    return xn, even, odd, wn, we, wo, inv_f


@triton.jit
def _f64(v: tl.constexpr):
    """A float64 constant: a bare Python float in a kernel is a float32 one (rounded) even beside
    float64 tensors."""
    return tl.full([], v, tl.float64)


@triton.jit
def cos_sin64(x):
    """cos(x), sin(x) in float64 for RoPE angles 0 <= x < 2^52: x less k pi/2 (k the nearest
    quadrant; pi/2 as three float64 parts, each step one FMA, the first exact), then fdlibm's
    kernel polynomials on [-pi/4, pi/4] with their coefficients as immediates. Within a few
    float64 ulps of torch's, so the float32 values kept are the same (`test_cos_sin64_float32_exact`).

    Why not tl.cos / tl.sin: libdevice's load their coefficients from a global table addressed by
    the quadrant, two dependent round trips (DRAM after a prefill chunk's compressor) on the entry
    write's chain; and its wide-range path gives the write a 48-byte stack (sm_90: 1,008 -> 768
    instructions without them). H100, 32K prompt: HCA compress_flush 61.1 -> 57.4 µs (NOTES.md #194).
    The decode step's rotary table (`norm_rope._cos_sin_kernel`) keeps libdevice's: there this
    measured slower (HCA layer B = 1 +1.8 µs)."""
    ki = (x * _f64(0.6366197723675814) + 0.5).to(tl.int64)
    k = ki.to(tl.float64)
    r = tl.fma(-k, _f64(1.5707963267948966), x)
    r = tl.fma(-k, _f64(6.123233995736766e-17), r)
    r = tl.fma(-k, _f64(-1.4973849048591698e-33), r)
    z = r * r
    ps = _f64(-2.50507602534068634195e-08) + z * _f64(1.58969099521155010221e-10)
    ps = _f64(2.75573137070700676789e-06) + z * ps
    ps = _f64(-1.98412698298579493134e-04) + z * ps
    ps = _f64(8.33333333332248946124e-03) + z * ps
    ps = _f64(-1.66666666666666324348e-01) + z * ps
    sin_r = r + r * z * ps
    pc = _f64(2.08757232129817482790e-09) + z * _f64(-1.13596475577881948265e-11)
    pc = _f64(-2.75573143513906633035e-07) + z * pc
    pc = _f64(2.48015872894767294178e-05) + z * pc
    pc = _f64(-1.38888888888741095749e-03) + z * pc
    pc = _f64(4.16666666666666019037e-02) + z * pc
    cos_r = 1.0 - 0.5 * z + z * z * pc
    q = (ki & 3).to(tl.int32)
    cos_x = tl.where(q == 0, cos_r, tl.where(q == 1, -sin_r, tl.where(q == 2, -cos_r, sin_r)))
    sin_x = tl.where(q == 0, sin_r, tl.where(q == 1, cos_r, tl.where(q == 2, -sin_r, -cos_r)))
    return cos_x, sin_x


@triton.jit
def _finish_math(xn, even, odd, wn, we, wo, inv_f, out_row, eps, w, RATIO, D: tl.constexpr, HALF_R: tl.constexpr):
    """out_row[:D] = RoPE_{w*RATIO}(RMSNorm_weight(row)) fp32 from `_finish_loads`: `norm_rope`'s
    arithmetic, the rotation on the trailing 2 HALF_R channels' interleaved (even, odd) pairs with
    cos / sin from float64 angles as `rope_cos_sin` (by `cos_sin64`). Only those pairs get angles: float64 cos / sin
    is long code on the FP64 units, and it used to run for all D/2 pairs (masked to 1 / 0 outside
    the rope part): 8x the work at D 512 (H200, 32K-token prefill: CSA compress_flush 138 -> 130
    µs, benchmarks/NOTES.md #66). Returns out_row once every thread's stores are visible to the
    program (the encoders read it back)."""
    NOPE: tl.constexpr = D - 2 * HALF_R
    k = tl.arange(0, triton.next_power_of_2(max(NOPE, 1)))
    km = k < NOPE
    p = tl.arange(0, triton.next_power_of_2(max(HALF_R, 1)))
    pm = p < HALF_R
    # the angles first: they need only w and inv_f, not the norm's two reductions (barriers)
    c, s = cos_sin64((tl.maximum(w, 0) * RATIO).to(tl.float64) * inv_f)
    c = c.to(tl.float32)
    s = s.to(tl.float32)
    inv = 1.0 / tl.sqrt((tl.sum(xn * xn, axis=0) + tl.sum(even * even, axis=0) + tl.sum(odd * odd, axis=0)) / D
                        + eps)
    xn = xn * inv * wn
    even = even * inv * we
    odd = odd * inv * wo
    tl.store(out_row + k, xn, mask=km)
    tl.store(out_row + NOPE + 2 * p, even * c - odd * s, mask=pm)
    tl.store(out_row + NOPE + 2 * p + 1, odd * c + even * s, mask=pm)
    tl.debug_barrier()
    return out_row


@triton.jit
def _write_entries_kernel(
        x_ptr, x_s0, x_s1, ereq_ptr, eidx_ptr, bt_ptr, bt_s0, bt_s1, bt_cols, epb,
        r0, r0_s0, r0_s1, r1, r1_s0, r1_s1, r2, r2_s0, r2_s1, fin_ptr, w_ptr, inv_ptr, eps, RATIO,
        FMT: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, ROPE: tl.constexpr, ROPE_P2: tl.constexpr,
        SB: tl.constexpr, SB_P2: tl.constexpr, HAD: tl.constexpr, LOG_D: tl.constexpr, HSCALE: tl.constexpr,
        FINISH: tl.constexpr, HALF_R: tl.constexpr, PDL: tl.constexpr):
    """Program i: entry row i (`_write_row`). PDL: launched with programmatic dependent launch
    (`pdl`): the launch is set up while the kernel before it (the compressor that made the rows)
    runs, and the programs wait for its results here, before any load or store."""
    if PDL:
        gdc_wait()
    i = tl.program_id(0)
    req = tl.load(ereq_ptr + i).to(tl.int64)
    idx = tl.load(eidx_ptr + i).to(tl.int64)
    _write_row(x_ptr + i.to(tl.int64) * x_s0, x_s1, req, idx, bt_ptr, bt_s0, bt_s1, bt_cols, epb,
               r0, r0_s0, r0_s1, r1, r1_s0, r1_s1, r2, r2_s0, r2_s1, fin_ptr + i.to(tl.int64) * D, w_ptr, inv_ptr,
               eps, RATIO, FMT, D, D_P2, ROPE, ROPE_P2, SB, SB_P2, HAD, LOG_D, HSCALE, FINISH, HALF_R)


@triton.jit
def _write_row(
        x_row, xs, req, idx, bt_ptr, bt_s0, bt_s1, bt_cols, epb,
        r0, r0_s0, r0_s1, r1, r1_s0, r1_s1, r2, r2_s0, r2_s1, fin_row, w_ptr, inv_ptr, eps, RATIO,
        FMT: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, ROPE: tl.constexpr, ROPE_P2: tl.constexpr,
        SB: tl.constexpr, SB_P2: tl.constexpr, HAD: tl.constexpr, LOG_D: tl.constexpr, HSCALE: tl.constexpr,
        FINISH: tl.constexpr, HALF_R: tl.constexpr):
    """Entry row x_row of request req, index idx into (block_table[req, idx // epb], idx % epb), or
    the null row (0, 0) (the reference's `_locate`). FINISH: the row is a raw compressor entry; its
    finished form (norm, RoPE) goes to fin_row first and is encoded from there (L2-resident)."""
    if FINISH:      # the row's loads first: they need no index
        xn, even, odd, wn, we, wo, inv_f = _finish_loads(x_row, xs, w_ptr, inv_ptr, D, HALF_R)
    # the destination while the row is in flight (after the finish, its barrier held it back: one
    # more L2 round trip on the row's chain)
    e = tl.maximum(idx, 0)
    col = e // epb
    block = tl.load(bt_ptr + req * bt_s0 + tl.minimum(col, bt_cols - 1) * bt_s1).to(tl.int64)
    if FINISH:
        x_row = _finish_math(xn, even, odd, wn, we, wo, inv_f, fin_row, eps, idx, RATIO, D, HALF_R)
        xs = 1
    ok = (idx >= 0) & (col < bt_cols) & (block >= 0)           # past the table: padding as well
    page = tl.where(ok, block, 0)
    row = tl.where(ok, e % epb, 0)
    _encode_row(x_row, xs, r0 + page * r0_s0 + row * r0_s1,
                r1 + page * r1_s0 + row * r1_s1, r2 + page * r2_s0 + row * r2_s1, 1,
                FMT, D, D_P2, ROPE, ROPE_P2, SB, SB_P2, HAD, LOG_D, HSCALE)


@triton.jit
def _merge(m, s, a, z, c):
    """Add slot (c, z) to the online softmax (m, s, a): DESIGN §5 (empty m = -inf keeps nothing)."""
    m2 = tl.maximum(m, z)
    keep = tl.where(m == float("-inf"), 0.0, tl.exp(m - m2))
    add = tl.exp(z - m2)
    return m2, s * keep + add, a * keep + c * add


@triton.jit
def _compress_decode_kernel(
        c_ptr, c_s0, c_s1, z_ptr, z_s0, z_s1, bias_ptr, bias_s0, st_ptr, st_s0, st_s1, st_s2, st_s3, rslot_ptr,
        pos_ptr, out_ptr, idx_ptr, D, RATIO, OVERLAP: tl.constexpr, P: tl.constexpr, BIAS: tl.constexpr,
        BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (b, j): channels [j*BLOCK, (j+1)*BLOCK) of request b's pending entries
    (`_compress_channels`). PDL: the entries' write (launched after it with programmatic dependent
    launch) may start its programs as soon as every program here runs (they wait for these results
    in `gdc_wait`). The prefill compressor does not do this: its early trigger cost HCA
    compress_flush 74 -> 84 µs (benchmarks/NOTES.md #67)."""
    if PDL:
        gdc_launch_dependents()
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    idx = _compress_channels(b, d, d < D, c_ptr, c_s0, c_s1, z_ptr, z_s0, z_s1, bias_ptr, bias_s0, st_ptr, st_s0,
                             st_s1, st_s2, st_s3, rslot_ptr, pos_ptr, out_ptr, D, RATIO, OVERLAP, P, BIAS)
    tl.store(idx_ptr + b, idx, mask=tl.program_id(1) == 0)


@triton.jit
def _compress_decode_write_kernel(
        c_ptr, c_s0, c_s1, z_ptr, z_s0, z_s1, bias_ptr, bias_s0, st_ptr, st_s0, st_s1, st_s2, st_s3, rslot_ptr,
        pos_ptr, out_ptr, idx_ptr, RATIO, bt_ptr, bt_s0, bt_s1, bt_cols, epb,
        r0, r0_s0, r0_s1, r1, r1_s0, r1_s1, r2, r2_s0, r2_s1, fin_ptr, w_ptr, inv_ptr, eps,
        OVERLAP: tl.constexpr, P: tl.constexpr, BIAS: tl.constexpr,
        FMT: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, ROPE: tl.constexpr, ROPE_P2: tl.constexpr,
        SB: tl.constexpr, SB_P2: tl.constexpr, HAD: tl.constexpr, LOG_D: tl.constexpr, HSCALE: tl.constexpr,
        FINISH: tl.constexpr, HALF_R: tl.constexpr, PDL: tl.constexpr):
    """Program b: all D channels of request b's pending entries, then, where its token closes a
    window, the finished entry's write (`_write_row`) from the row just stored (this program's
    own stores, made visible to its threads by a barrier): one launch and one program's chain
    where `compress_decode` then `write_entries` take two kernels and a grid-wide wait between
    them. A request that finishes nothing writes no padding row."""
    if PDL:
        gdc_launch_dependents()
    b = tl.program_id(0)
    d = tl.arange(0, D_P2)
    idx = _compress_channels(b, d, d < D, c_ptr, c_s0, c_s1, z_ptr, z_s0, z_s1, bias_ptr, bias_s0, st_ptr, st_s0,
                             st_s1, st_s2, st_s3, rslot_ptr, pos_ptr, out_ptr, D, RATIO, OVERLAP, P, BIAS)
    tl.store(idx_ptr + b, idx)
    if idx >= 0:
        tl.debug_barrier()          # the row's channels were stored by other threads
        _write_row(out_ptr + b.to(tl.int64) * D, 1, b.to(tl.int64), idx, bt_ptr, bt_s0, bt_s1, bt_cols, epb,
                   r0, r0_s0, r0_s1, r1, r1_s0, r1_s1, r2, r2_s0, r2_s1, fin_ptr + b.to(tl.int64) * D, w_ptr, inv_ptr,
                   eps, RATIO, FMT, D, D_P2, ROPE, ROPE_P2, SB, SB_P2, HAD, LOG_D, HSCALE, FINISH, HALF_R)


@triton.jit
def _compress_channels(
        b, d, md, c_ptr, c_s0, c_s1, z_ptr, z_s0, z_s1, bias_ptr, bias_s0, st_ptr, st_s0, st_s1, st_s2, st_s3,
        rslot_ptr, pos_ptr, out_ptr, D, RATIO, OVERLAP: tl.constexpr, P: tl.constexpr, BIAS: tl.constexpr):
    """Channels d (mask md) of request b's pending entries: the token's (c, z) folded in, A/S of
    `cur` to out's row b; returns the finished entry's index (floor(pos / RATIO)) where the token
    closes its window, else -1. c, z in any float dtype (fp32 math); BIAS: z += bias[pos % RATIO]
    (fp32)."""
    slot = tl.load(rslot_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    closes = (pos + 1) % RATIO == 0
    cb = c_ptr + b.to(tl.int64) * c_s0
    zb = z_ptr + b.to(tl.int64) * z_s0
    sb = st_ptr + slot * st_s0 + d * st_s3                         # (M, S, A) at st_s1 apart, pages st_s2
    hi = D if OVERLAP else 0                                       # CSA: the [D:] slot feeds cur
    z_cur = tl.load(zb + (d + hi) * z_s1, mask=md).to(tl.float32)
    if BIAS:
        brow = pos % RATIO
        brow = tl.where(brow < 0, brow + RATIO, brow)              # floor modulo, as torch's %
        bb = bias_ptr + brow * bias_s0
        z_cur = z_cur + tl.load(bb + d + hi, mask=md).to(tl.float32)
    m, s, a = _merge(tl.load(sb, mask=md), tl.load(sb + st_s1, mask=md), tl.load(sb + 2 * st_s1, mask=md),
                     z_cur, tl.load(cb + (d + hi) * c_s1, mask=md).to(tl.float32))
    tl.store(out_ptr + b.to(tl.int64) * D + d, tl.math.div_rn(a, s), mask=md)
    if OVERLAP:
        nb = sb + st_s2
        z_next = tl.load(zb + d * z_s1, mask=md).to(tl.float32)
        if BIAS:
            z_next = z_next + tl.load(bb + d, mask=md).to(tl.float32)
        nm, ns, na = _merge(tl.load(nb, mask=md), tl.load(nb + st_s1, mask=md), tl.load(nb + 2 * st_s1, mask=md),
                            z_next, tl.load(cb + d * c_s1, mask=md).to(tl.float32))
        # On close: cur <- next, next <- empty (the seeds' rotation).
        tl.store(sb, tl.where(closes, nm, m), mask=md)
        tl.store(sb + st_s1, tl.where(closes, ns, s), mask=md)
        tl.store(sb + 2 * st_s1, tl.where(closes, na, a), mask=md)
        tl.store(nb, tl.where(closes, float("-inf"), nm), mask=md)
        tl.store(nb + st_s1, tl.where(closes, 0.0, ns), mask=md)
        tl.store(nb + 2 * st_s1, tl.where(closes, 0.0, na), mask=md)
    else:
        for p in tl.static_range(P):                               # the reference broadcasts over pages
            pb = sb + p * st_s2
            tl.store(pb, tl.where(closes, float("-inf"), m), mask=md)
            tl.store(pb + st_s1, tl.where(closes, 0.0, s), mask=md)
            tl.store(pb + 2 * st_s1, tl.where(closes, 0.0, a), mask=md)
    q = pos // RATIO
    q = tl.where((q * RATIO != pos) & (pos < 0), q - 1, q)        # floor division, as torch's //
    return tl.where(closes, q, -1)


# ====================================================================== host wrappers
def _p2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def _format_meta(fmt: EntryFormat) -> dict[str, int]:
    """Constexpr parameters of `_encode_row` for `fmt`."""
    if fmt.name not in FORMAT_ID:
        raise FormatError(f"the Triton cache writes do not know format {fmt.name!r}")
    sb = fmt.regions[1].bytes_per_entry if fmt.name == "fp8_ds" else 0
    fid = FORMAT_ID[fmt.name]
    if fmt.hadamard and (fid < 3 or fmt.dim & (fmt.dim - 1)):
        raise FormatError(f"the Triton cache writes rotate only power-of-two indexer rows, not {fmt.name}-{fmt.dim}")
    return {"FMT": fid, "D": fmt.dim, "D_P2": _p2(fmt.dim), "ROPE": fmt.rope_dim,
            "ROPE_P2": _p2(fmt.rope_dim), "SB": sb, "SB_P2": _p2(sb), "HAD": fmt.hadamard,
            **fwht_constants(fmt.dim)}


def _region_args(views: Views, fmt: EntryFormat, n: int) -> list:
    """(view, page stride, row stride) for the first n regions; missing ones repeat region 0 (unused)."""
    names = [r.name for r in fmt.regions]
    args = []
    for k in range(n):
        v = views[names[min(k, len(names) - 1)]]
        if v.dtype != torch.uint8 or v.dim() != 3 or v.stride(2) != 1:
            raise FormatError(f"{fmt.name} region views must be uint8 [N, P, bytes] with unit byte stride")
        args += [v, v.stride(0), v.stride(1)]
    return args


def _check_rows(fmt: EntryFormat, rows: torch.Tensor) -> None:
    if rows.dim() != 2 or rows.shape[-1] != fmt.dim:
        raise FormatError(f"{fmt.name} entries have {fmt.dim} channels, got rows of shape {list(rows.shape)}")


@triton.jit
def _roundtrip_kernel(x_ptr, x_s0, out_ptr, n, FP8_DS: tl.constexpr, NOPE: tl.constexpr, REST: tl.constexpr,
                      REST_P2: tl.constexpr, R: tl.constexpr):
    """Rows r0 .. r0 + R - 1: FP8_DS, NOPE e4m3 channels a 64-channel tile at a time, then REST bf16
    ones (the rope); else all REST channels bf16."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    rm = rows[:, None] < n
    src = x_ptr + rows.to(tl.int64)[:, None] * x_s0
    dst = out_ptr + rows.to(tl.int64)[:, None] * (NOPE + REST)
    if FP8_DS:
        j = tl.arange(0, 64)[None, :]
        for t in tl.static_range(NOPE // 64):
            x = tl.load(src + t * 64 + j, mask=rm, other=0.0).to(tl.float32)
            tl.store(dst + t * 64 + j, round_fp8_ds_tiles(x).to(out_ptr.dtype.element_ty), mask=rm)
    k = tl.arange(0, REST_P2)[None, :]
    km = rm & (k < REST)
    x = tl.load(src + NOPE + k, mask=km, other=0.0).to(tl.float32)
    tl.store(dst + NOPE + k, round_bf16(x).to(out_ptr.dtype.element_ty), mask=km)


def roundtrip_rows(x: torch.Tensor, fmt: EntryFormat, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Same contract as the reference `roundtrip_rows`: one kernel where the format's torch encode
    and decode take ~20 (an 8K prefill chunk's window rows)."""
    _check_rows(fmt, x)
    out_dtype = roundtrip_dtype(fmt, out_dtype)
    if fmt.name == "fp32":
        return x.to(torch.float32, copy=True)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    nope = fmt.dim - fmt.rope_dim if fmt.name == "fp8_ds" else 0
    rows = 16
    if x.shape[0]:
        _roundtrip_kernel[(triton.cdiv(x.shape[0], rows),)](
            x, x.stride(0), out, x.shape[0], FP8_DS=fmt.name == "fp8_ds", NOPE=nope, REST=fmt.dim - nope,
            REST_P2=_p2(fmt.dim - nope), R=rows, num_warps=4)
    return out


def append_window(swa: Views, fmt: EntryFormat, swa_pos: torch.Tensor, swa_head: torch.Tensor, kv: torch.Tensor,
                  positions: torch.Tensor, token_request: torch.Tensor, request_slots: torch.Tensor,
                  seq_lens: torch.Tensor) -> None:
    """Write each new token's kv into its request's ring, row = position % W (reference twin).

    Only tokens with position >= seq_len - W are written (decided in the kernel):

        request tokens  ... | s-W-1 | s-W | ... | s-1 |      s = seq_lens[request]
                              dropped  <---- written ---->   W rows, no two on one row

    Args:
        swa: ring region views {name: [R, W, bytes] uint8}; swa_pos [R, W] int32; swa_head [R] int32.
        kv: [T, D] float (fp32, bf16 or fp16) new tokens' kv (after norm and RoPE).
        positions, token_request: [T] int32; request_slots, seq_lens: [B] int32.
    """
    _check_rows(fmt, kv)
    t, b = kv.shape[0], seq_lens.shape[0]
    if max(t, b) == 0:
        return
    w = swa_pos.shape[1]
    regions = _region_args(swa, fmt, 3)
    _append_window_kernel[(max(t, b),)](
        kv, kv.stride(0), kv.stride(1), positions, token_request, request_slots, seq_lens,
        swa_pos, swa_pos.stride(0), swa_pos.stride(1), swa_head, *regions, t, b, w,
        **_format_meta(fmt), num_warps=_WRITE_WARPS)


def write_entries(views: Views, fmt: EntryFormat, rows: torch.Tensor, entry_request: torch.Tensor,
                  entry_index: torch.Tensor, block_table: torch.Tensor, epb: int,
                  finish: EntryFinish | None = None) -> None:
    """Quantise finished entries and scatter them into their blocks (reference twin).

        entry w of request r -> block block_table[r, w // epb], row w % epb
        w < 0, w // epb past the table, or block < 0 -> null block 0, row 0 (padding; never read)

    Args:
        views: pool region views {name: [N, epb, bytes] uint8}.
        rows: [E, D] float entries; entry_request [E] int (batch index), entry_index [E] int (-1 = padding).
        block_table: [B, max_blocks] int32 (-1 = none); epb: entries per block.
        finish: rows are the compressor's raw entries: each becomes RoPE_{w*m}(RMSNorm(row)) in
            the kernel first (no rotary table, no norm_rope kernel, no fp32 round trip between
            kernels). The result equals `norm_rope` on the rows to fp32 rounding (same operations;
            the compiler may contract them differently), so a cache byte can differ from the
            unfused path's where a value sits on a quantisation boundary.
    Indexer formats with `fmt.hadamard` rotate each row by the butterfly in the kernel (the
    reference's `quant.fwht`, the same adds in the same order).
    """
    _check_rows(fmt, rows)
    e = rows.shape[0]
    if e == 0:  # a step that finishes no entry (a shape, not a device value)
        return
    if finish is not None:
        fin = torch.empty(e, fmt.dim, dtype=torch.float32, device=rows.device)
        extra = (fin, finish.weight, finish.inv_freq, finish.eps, finish.ratio)
        half_r = finish.inv_freq.shape[0]
    else:       # never read
        extra, half_r = (rows, rows, rows, 0.0, 1), 0
    _write_entries_kernel[(e,)](
        rows, rows.stride(0), rows.stride(1), entry_request, entry_index, block_table,
        block_table.stride(0), block_table.stride(1), block_table.shape[1], epb,
        *_region_args(views, fmt, 3), *extra, **_format_meta(fmt), FINISH=finish is not None, HALF_R=half_r,
        num_warps=_write_warps(fmt.dim), **pdl_launch(rows.device))


def compress_decode(c: torch.Tensor, z: torch.Tensor, state: torch.Tensor, request_slots: torch.Tensor,
                    positions: torch.Tensor, ratio: int, overlap: bool, *, z_bias: torch.Tensor | None = None,
                    write: EntryWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one token per request into its pending entries (DESIGN §5 online softmax; reference twin).

    Args:
        c, z: [B, Dc] float, any row stride (column slices of one projection are read in place);
            Dc = 2D (CSA, overlap) or D (HCA). z includes the position bias unless z_bias
            [ratio, Dc] is given, which is then added at row positions % ratio (fp32 math).
        state: [R, 3, P, D] fp32 (M, S, A), updated in place; request_slots, positions: [B] int.
        write: also store the finished entries (`write_entries` on the rows, request i's token
            being row i), in the same kernel: a program per request folds all D channels in, then
            finishes and encodes its entry. No padding row is written for a request that finishes
            none (the reference's goes to the null block, which nothing reads).
    Returns:
        entries [B, D] fp32 = A/S of `cur` after the update (meaningful where the token closes
        its window), entry_index [B] int64: the finished entry position // ratio, or -1.
    """
    bsz, d, p = c.shape[0], state.shape[-1], state.shape[2]
    assert state.dtype == torch.float32, "the compressor state is fp32"
    assert p >= (2 if overlap else 1), "CSA keeps two pending entries (cur, next), HCA one"
    entries = torch.empty(bsz, d, dtype=torch.float32, device=c.device)
    entry_index = torch.empty(bsz, dtype=torch.int64, device=c.device)
    if bsz == 0:
        return entries, entry_index
    if write is not None:
        _compress_decode_write(c, z, state, request_slots, positions, ratio, overlap, z_bias, write, entries,
                               entry_index)
        return entries, entry_index
    block = min(_p2(d), 256)
    _compress_decode_kernel[(bsz, triton.cdiv(d, block))](
        c, c.stride(0), c.stride(1), z, z.stride(0), z.stride(1), z_bias if z_bias is not None else z,
        z_bias.stride(0) if z_bias is not None else 0, state, *state.stride(), request_slots, positions,
        entries, entry_index, d, ratio, OVERLAP=overlap, P=p, BIAS=z_bias is not None, BLOCK=block,
        PDL=pdl(c.device), num_warps=2)
    return entries, entry_index


def _compress_decode_write(c: torch.Tensor, z: torch.Tensor, state: torch.Tensor, request_slots: torch.Tensor,
                           positions: torch.Tensor, ratio: int, overlap: bool, z_bias: torch.Tensor | None,
                           write: EntryWrite, entries: torch.Tensor, entry_index: torch.Tensor) -> None:
    fmt, finish = write.fmt, write.finish
    _check_rows(fmt, entries)
    if finish is not None and finish.ratio != ratio:
        raise InputError(f"the entries' finish rotates at ratio {finish.ratio}, the compressor's is {ratio}")
    bt = write.block_table
    if finish is not None:
        fin = torch.empty_like(entries)
        extra, half_r = (fin, finish.weight, finish.inv_freq, finish.eps), finish.inv_freq.shape[0]
    else:       # never read
        extra, half_r = (entries, entries, entries, 0.0), 0
    _compress_decode_write_kernel[(c.shape[0],)](
        c, c.stride(0), c.stride(1), z, z.stride(0), z.stride(1), z_bias if z_bias is not None else z,
        z_bias.stride(0) if z_bias is not None else 0, state, *state.stride(), request_slots, positions,
        entries, entry_index, ratio, bt, bt.stride(0), bt.stride(1), bt.shape[1], write.epb,
        *_region_args(write.views, fmt, 3), *extra, OVERLAP=overlap, P=state.shape[2], BIAS=z_bias is not None,
        **_format_meta(fmt), FINISH=finish is not None, HALF_R=half_r, PDL=pdl(c.device),
        num_warps=_FUSED_WARPS)


__all__ = ["append_window", "compress_decode", "write_entries"]
