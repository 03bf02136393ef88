"""Indexer scan for mxfp4 keys on FP8 tensor cores: `indexer_scan`'s loop with the E2M1 keys
decoded to e4m3 instead of bf16 and one K = 32 fp8 dot per scale group.

    grid (B, P) as `indexer_scan._indexer_scan_kernel`: program p scans key tiles p, p+P, ...

Why it is exact (the scores equal the bf16 scan's to fp32 rounding):
- An E2M1 code is an e4m3 byte: (sign << 7) | (magnitude << 2) is value * 2^-6 (0.5 lands on
  e4m3's subnormal 2^-7). Per key word (8 codes, low nibble first) the even codes and the odd
  codes are four such bytes each, a few integer operations per word; each key's 128 elements then
  sit in the order (word, even/odd, byte), and q is loaded in the same order.
- The query arrives rounded to mxfp4 (`EntryFormat.round_query`): per head, one power of two c_h
  takes its largest value into [128, 256), and every value is then exact in e4m3 as long as the
  head's group scales lie within 2^13 of each other (checked in the kernel, see below).
- One dot per 32-element scale group: the products of two e4m3 values holding E2M1 codes are
  multiples of one unit (0.25 x the two groups' scales), at most 144 units each, so a group's sum
  is an integer below 2^13 units, which Hopper's fp8 accumulator holds exactly. The key's group
  scales then multiply the group sums in fp32 (relative to its largest group: exact powers of
  two), as the bf16 scan's decode multiplies the keys.

A query whose heads' group scales differ by more than 2^13 (values that would fall below e4m3's
subnormals) is not scored here: the program finds it in its query load and runs the bf16 scan's
loop instead (`indexer_scan.scan_tiles`), so nothing is rounded.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.triton.decode_common import pdl_enter, pdl_launch
from dsv4.kernels.triton.indexer_scan import _locate, scan_tiles

_MAG: tl.constexpr = tl.constexpr(0x1C1C1C1C)      # three magnitude bits at 2-4 of every byte
_SIGN: tl.constexpr = tl.constexpr(-0x7F7F7F80)    # 0x80808080 as an int32


@triton.jit
def _group_loads(data_ptr, scale_ptr, page, row, valid, s_dp, s_dr, s_sp, s_sr, WPG: tl.constexpr,
                 SCALE_T: tl.constexpr):
    """The tile's key words as four [N, WPG] int32 groups and each key's scale word."""
    base = (data_ptr + page[:, None] * s_dp + row[:, None] * s_dr).to(tl.pointer_type(tl.int32))
    j = tl.arange(0, WPG)[None, :]
    v2 = valid[:, None]
    w0 = tl.load(base + j, mask=v2, other=0)
    w1 = tl.load(base + WPG + j, mask=v2, other=0)
    w2 = tl.load(base + 2 * WPG + j, mask=v2, other=0)
    w3 = tl.load(base + 3 * WPG + j, mask=v2, other=0)
    srow = tl.load((scale_ptr + page * s_sp + row * s_sr).to(tl.pointer_type(SCALE_T)), mask=valid, other=0)
    return w0, w1, w2, w3, srow


@triton.jit
def _e4m3(w, BLOCK_N: tl.constexpr, WPG: tl.constexpr, NATIVE: tl.constexpr):
    """[N, WPG] key words -> [N, 8 WPG] e4m3 of value * 2^-6 (exact), each word's even codes, then
    its odd codes. On the GPU the bytes are formed four per 32-bit word and handed to the dot as
    they are (one inline `mov` reinterprets a word as four bytes)."""
    if NATIVE:
        ev = ((w << 2) & _MAG) | ((w << 4) & _SIGN)
        od = ((w >> 2) & _MAG) | (w & _SIGN)
        x = tl.join(ev, od)                                                     # [N, WPG, 2]
        b = ((x[:, :, :, None] >> (8 * tl.arange(0, 4))[None, None, None, :]) & 0xFF).to(tl.uint8)
    else:
        p = tl.arange(0, 8)[None, None, :]
        code = (w[:, :, None] >> (4 * (2 * (p % 4) + p // 4))) & 15
        b = (((code & 8) << 4) | ((code & 7) << 2)).to(tl.uint8)
    return tl.reshape(b, [BLOCK_N, 8 * WPG]).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _dot8(k, q, NATIVE: tl.constexpr):
    if NATIVE:
        return tl.dot(k, q)
    return tl.dot(k.to(tl.float32), q.to(tl.float32), input_precision="ieee")   # exact: small integers


@triton.jit
def _group_scale(srow, G: tl.constexpr, smax):
    """2^(e_g - e_max) of each key as fp32 (0 for a group 2^126 below the key's largest)."""
    e = ((srow >> 8 * G) & 0xFF).to(tl.int32)
    return (tl.maximum(e - smax + 127, 0) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _query_group(q_ptr, b, h, hmask, s_qb, s_qh, G: tl.constexpr):
    """Query elements of scale group G as [32, H] fp32, rows in the keys' decoded order."""
    r = tl.arange(0, 32)
    e = 32 * G + 8 * (r // 8) + 2 * (r % 4) + (r % 8) // 4
    return tl.load(q_ptr + b * s_qb + h[None, :] * s_qh + e[:, None], mask=hmask[None, :], other=0.0)


@triton.jit
def _fits(x, c):
    """x * c (fp32) -> (e4m3, whether every value was exact)."""
    y = x * c[None, :]
    x8 = y.to(tl.float8e4nv)
    return x8, tl.sum((x8.to(tl.float32) != y).to(tl.int32))


@triton.jit
def _indexer_scan8_kernel(
        q_ptr, w_ptr, out_ptr, data_ptr, scale_ptr, glob_ptr, bt_ptr, nent_ptr,
        s_qb, s_qh, s_wb, s_ob, s_dp, s_dr, s_sp, s_sr, s_gp, s_gr, s_bt,
        num_tiles, max_entries, max_blocks, out_scale, w_scale, EPB: tl.constexpr,
        NATIVE: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr,
        D: tl.constexpr, NW: tl.constexpr, WPG: tl.constexpr, BLOCK_N: tl.constexpr,
        SCALE_T: tl.constexpr, FALLBACK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0)
    p0 = tl.program_id(1)
    step = tl.num_programs(1)
    h = tl.arange(0, BLOCK_H)
    hmask = h < H
    wts = tl.load(w_ptr + b * s_wb + h, mask=hmask, other=0.0).to(tl.float32) * w_scale
    q0 = _query_group(q_ptr, b, h, hmask, s_qb, s_qh, 0)
    q1 = _query_group(q_ptr, b, h, hmask, s_qb, s_qh, 1)
    q2 = _query_group(q_ptr, b, h, hmask, s_qb, s_qh, 2)
    q3 = _query_group(q_ptr, b, h, hmask, s_qb, s_qh, 3)
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(q0), axis=0), tl.max(tl.abs(q1), axis=0)),
                      tl.maximum(tl.max(tl.abs(q2), axis=0), tl.max(tl.abs(q3), axis=0)))
    ebits = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    c = (tl.minimum(tl.maximum(261 - ebits, 1), 254) << 23).to(tl.float32, bitcast=True)   # amax * c in [128, 256)
    q0, m0 = _fits(q0, c)
    q1, m1 = _fits(q1, c)
    q2, m2 = _fits(q2, c)
    q3, m3 = _fits(q3, c)
    wq = wts / c            # ReLU(x / c) = ReLU(x) / c: the query's scale joins the head weight
    n_b = tl.minimum(tl.load(nent_ptr + b), max_entries)
    nt = tl.cdiv(n_b, BLOCK_N)
    bt_row = bt_ptr + b * s_bt
    ar = tl.arange(0, BLOCK_N)
    out_row = out_ptr + b * s_ob

    if (m0 + m1 + m2 + m3 == 0) or not FALLBACK:
        o0 = p0 * BLOCK_N + ar
        pg, rw = _locate(bt_row, o0, o0 < n_b, EPB, max_blocks)
        w0, w1, w2, w3, srow = _group_loads(data_ptr, scale_ptr, pg, rw, o0 < n_b, s_dp, s_dr, s_sp, s_sr, WPG,
                                            SCALE_T)
        o1 = o0 + step * BLOCK_N
        pg_n, rw_n = _locate(bt_row, o1, o1 < n_b, EPB, max_blocks)
        for tile in range(p0, nt, step):
            offs = tile * BLOCK_N + ar
            valid = offs < n_b
            o2 = offs + 2 * step * BLOCK_N
            pg_nn, rw_nn = _locate(bt_row, o2, o2 < n_b, EPB, max_blocks)
            o1 = offs + step * BLOCK_N
            n0, n1, n2, n3, srow_n = _group_loads(data_ptr, scale_ptr, pg_n, rw_n, o1 < n_b, s_dp, s_dr, s_sp, s_sr,
                                                  WPG, SCALE_T)
            smax = (srow & 0xFF).to(tl.int32)
            for g in tl.static_range(1, 4):
                smax = tl.maximum(smax, ((srow >> 8 * g) & 0xFF).to(tl.int32))
            s = _dot8(_e4m3(w0, BLOCK_N, WPG, NATIVE), q0, NATIVE) * _group_scale(srow, 0, smax)[:, None]
            s += _dot8(_e4m3(w1, BLOCK_N, WPG, NATIVE), q1, NATIVE) * _group_scale(srow, 1, smax)[:, None]
            s += _dot8(_e4m3(w2, BLOCK_N, WPG, NATIVE), q2, NATIVE) * _group_scale(srow, 2, smax)[:, None]
            s += _dot8(_e4m3(w3, BLOCK_N, WPG, NATIVE), q3, NATIVE) * _group_scale(srow, 3, smax)[:, None]
            # key = e4m3 * 2^6 * 2^(e_g - 127): 2^(e_max - 121) after the ReLU (> 0)
            gl = (smax << 23).to(tl.float32, bitcast=True) * 64.0
            score = tl.sum(tl.maximum(s, 0.0) * wq[None, :], axis=1) * (gl * out_scale)
            tl.store(out_row + offs, tl.where(valid, score, float("-inf")), mask=offs < max_entries)
            w0, w1, w2, w3, srow = n0, n1, n2, n3, srow_n
            pg_n, rw_n = pg_nn, rw_nn
    else:
        scan_tiles(q_ptr, wts, out_row, data_ptr, scale_ptr, glob_ptr, bt_row, b, p0, step, n_b, nt, s_qb, s_qh,
                   s_dp, s_dr, s_sp, s_sr, s_gp, s_gr, max_entries, max_blocks, out_scale, EPB, 3, 1, NATIVE, H,
                   BLOCK_H, D, NW, WPG, BLOCK_N, 14, 2.0 ** 14, SCALE_T, NATIVE)
    # tiles past this request's entries: -inf only
    first = p0 + tl.cdiv(tl.maximum(nt - p0, 0), step) * step
    for tile in range(first, num_tiles, step):
        offs = tile * BLOCK_N + ar
        tl.store(out_row + offs, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=offs < max_entries)


def launch_scan8(grid, q, weights, out, data, scale, glob, block_table, num_entries, tiles, max_entries, epb,
                 weight_scale, *, cuda: bool, block_n: int, num_warps: int, fallback: bool = True):
    """`_indexer_scan8_kernel` over mxfp4 keys (`indexer_scan.scan_supported` holds)."""
    heads, dim = q.shape[1], q.shape[2]
    assert dim == 128, "four 32-element groups per key"
    return _indexer_scan8_kernel[grid](
        q, weights, out, data, scale, glob, block_table, num_entries,
        q.stride(0), q.stride(1), weights.stride(0), out.stride(0), data.stride(0), data.stride(1),
        scale.stride(0), scale.stride(1), glob.stride(0), glob.stride(1), block_table.stride(0),
        tiles, max_entries, block_table.shape[1], dim ** -0.5, weight_scale, EPB=epb, NATIVE=cuda, H=heads,
        BLOCK_H=max(16, triton.next_power_of_2(heads)), D=dim, NW=dim // 8, WPG=4, BLOCK_N=block_n,
        SCALE_T=tl.uint32, FALLBACK=fallback, num_warps=num_warps, **pdl_launch(q.device))
