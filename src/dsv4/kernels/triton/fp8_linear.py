"""Triton twin of `reference.linear.linear_fp8`: y = x W^T with W as FP8 e4m3 codes and one scale per
128 x 128 block (`dsv4.model.fp8_weights`), weights exact, activations as given, fp32 sums.

    one row of x (a batch-1 decode step)   `_gemv_kernel`: a stream over the codes, as `gemv`: each
                                           program BLOCK_N whole rows, K in BLOCK_K steps, the x
                                           slice pre-multiplied by its blocks' scales (a program's
                                           rows share one scale row) once for all of the rows a
                                           thread holds, one reduction at the end. `linear_pair`:
                                           this GEMV and a dense one of the same x in one grid
                                           (`gemv_pair`; an FP8 checkpoint's input projections)
    2 .. 256 rows (decode batches)         `_gemm_desc_kernel`: the weight rows on the dot's M side
                                           (64 a tile, the register operand, the codes converted by
                                           `_E4M3X2_TO_BF16`), the batch on N (x^T from shared
                                           memory, all rows in one tile), both tiles loaded through
                                           tensor descriptors (TMA), K in steps of one scale block
                                           (128), each step's dot times its scale; too few tiles for
                                           the SMs split K (`_k_splits`), the fp32 partials summed
                                           in split order (`_sum_splits_kernel`). `_gemm_kernel`,
                                           the same with pointer loads, below `_DESC_MIN_ROWS` rows
                                           and where descriptors do not fit (K off the 128 block,
                                           rows not 16-byte aligned)
    more rows (prefill chunks)             `dequantize`: W = codes x scale in x's dtype once
                                           (`_dequant_kernel`), then cuBLAS. A chunk's GEMM is
                                           compute-bound: cuBLAS runs it at ~3x the rate of a
                                           Triton GEMM on the codes (H100, 8K rows: 725-780 vs
                                           255-280 TFLOP/s, the batch-on-M form this module had),
                                           and the dequantisation adds ~5% (benchmarks/tune_fp8.py)

Up to 256 rows the weights are exact (W is never rounded). In the prefill regime W is rounded once to
x's dtype: exact for power-of-two scales (V4's UE8M0 scales, `quantize_blocks`' default), one bf16
rounding (2^-9 relative) of each weight for V3-style fp32 scales.

`groups` G: output group g (N/G columns) reads x's g-th K columns, the grouped o_a projection as
one launch. A program never straddles a group or a scale row: BLOCK_N divides 128 and N/G.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dsv4.errors import InputError
from dsv4.kernels.triton import gemv
from dsv4.kernels.triton.decode_common import TRITON_VERSION, pdl_enter, pdl_launch, sm_count
from dsv4.kernels.triton.gemv import _norm_args, gemv_rows, rms_apply, rms_rows, rms_scale
from dsv4.model.fp8_weights import BLOCK, scale_shape

_GEMM_MAX_ROWS = 256     # more rows: dequantise, then cuBLAS (module doc)
_SMEM_BUDGET = 224 * 1024   # the GEMM's pipelined tiles stay below Hopper's 227 KB per block
_SPLIT_MIN_K = 1024         # codes per K split at least (8 scale blocks: shorter loops lose to their prologue)
# rows from which the GEMM loads through tensor descriptors: H200, µs, pointer / descriptor form at the
# same splits (benchmarks/tune_fp8.py; q_a + kv, CSA q_b, HCA q_b, o_a, o_b): 2 rows 9.7 / 10.1, 16.3 /
# 16.7, 14.0 / 14.6, 15.4 / 15.1, 16.5 / 16.4; 8 rows 9.8 / 10.0, 16.4 / 15.7, 14.1 / 13.8, 15.6 / 15.4,
# 16.8 / 16.5; 64 rows 11.8 / 10.8, 24.0 / 21.1, 21.0 / 18.9, 23.1 / 19.2, 23.1 / 19.4
_DESC_MIN_ROWS = 8


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, nw_ptr, N, K, n_group, s_wn, s_sn, eps, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    gemv_fp8_rows(x_ptr, w_ptr, s_ptr, y_ptr, nw_ptr, tl.program_id(0), N, K, n_group, s_wn, s_sn, eps, BLOCK_N,
                  BLOCK_K, NORM, PDL)


@triton.jit
def gemv_fp8_rows(x_ptr, w_ptr, s_ptr, y_ptr, nw_ptr, pid, N, K, n_group, s_wn, s_sn, eps, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    # a K step is J scale blocks of 128: tiles [J, 128, BLOCK_N], so the J scales load as one vector
    # and scale x's [J, 128] slice by broadcast (no per-element gather of the scale). Rows last: the
    # 128 contiguous codes of a row spread over threads and J over the warp, so each thread holds
    # every row of the program for its codes and converts and scales each x element once for all
    # of them (rows first, the x slice was converted per row, after a shared-memory round trip).
    # NORM (one group): x is RMSNorm_nw(x) first, each program finding the row's scale itself
    J: tl.constexpr = BLOCK_K // 128
    n0 = pid * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, J)
    nm = rn < N
    xg = x_ptr + (n0 // n_group) * K
    srow = s_ptr + (n0 // 128) * s_sn
    wrow = w_ptr + rn[None, None, :].to(tl.int64) * s_wn
    # the first K step's codes and scales load before the wait (weights: no kernel of the step
    # writes them), so they stream in while the kernel before this one ends
    kk = rj[:, None] * 128 + tl.arange(0, 128)[None, :]                       # [J, 128]
    km = kk < K
    w0 = tl.load(wrow + kk[:, :, None], mask=km[:, :, None] & nm[None, None, :], other=0.0)
    sc0 = tl.load(srow + rj, mask=rj * 128 < K, other=0.0)
    pdl_enter(PDL)
    if NORM:
        inv = rms_scale(xg, K, eps, BLOCK_K)
    xs = tl.load(xg + kk, mask=km, other=0.0).to(tl.float32)
    if NORM:
        xs = rms_apply(xs, inv, nw_ptr, kk, km, x_ptr.dtype.element_ty)
    acc = w0.to(tl.float32) * (xs * sc0[:, None])[:, :, None]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + rj[:, None] * 128 + tl.arange(0, 128)[None, :]            # [J, 128]
        km = kk < K
        w = tl.load(wrow + kk[:, :, None], mask=km[:, :, None] & nm[None, None, :], other=0.0).to(tl.float32)
        sc = tl.load(srow + k0 // 128 + rj, mask=k0 + rj * 128 < K, other=0.0)
        xs = tl.load(xg + kk, mask=km, other=0.0).to(tl.float32)
        if NORM:
            xs = rms_apply(xs, inv, nw_ptr, kk, km, x_ptr.dtype.element_ty)
        acc += w * (xs * sc[:, None])[:, :, None]
    tl.store(y_ptr + rn, tl.sum(tl.sum(acc, 1), 0).to(y_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _gemv_pair_kernel(x_ptr, wd_ptr, yd_ptr, nd, s_wd, wf_ptr, s_ptr, yf_ptr, nf, s_wf, s_sn, K,
                      BN_D: tl.constexpr, BK_D: tl.constexpr, BN_F: tl.constexpr, BK_F: tl.constexpr,
                      PDL: tl.constexpr):
    """`linear_pair` at one row: the FP8 GEMV's programs, then the dense GEMV's, in one grid (each
    program the code of its own kernel), so both weights stream at once."""
    pid = tl.program_id(0)
    pf = tl.cdiv(nf, BN_F)
    if pid < pf:
        gemv_fp8_rows(x_ptr, wf_ptr, s_ptr, yf_ptr, x_ptr, pid, nf, K, nf, s_wf, s_sn, 0.0, BN_F, BK_F, False, PDL)
    else:
        gemv_rows(x_ptr, wd_ptr, yd_ptr, x_ptr, pid - pf, nd, K, nd, s_wd, 0.0, BN_D, BK_D, False, PDL)


# two e4m3 codes (one 16-bit register) -> a bf16x2, exact: e4m3 -> f16 pair, f16 -> f32 (HADD2.F32 on
# the FMA pipe), two f32 -> bf16x2. Triton's own conversion goes f16 -> bf16 by the quarter-rate
# F2F.BF16.F16 (sm_90, Triton 3.6): HCA q_b at 64 rows 26.3 -> 21.2 µs, CSA q_b 27.1 -> 24.2
_E4M3X2_TO_BF16 = tl.constexpr("""{
.reg .b16 a0, a1;
.reg .b32 h;
.reg .f32 f0, f1;
cvt.rn.f16x2.e4m3x2 h, $1;
mov.b32 {a0, a1}, h;
cvt.f32.f16 f0, a0;
cvt.f32.f16 f1, a1;
cvt.rn.bf16x2.f32 $0, f1, f0;
}""")


@triton.jit
def _to_bf16(w):
    """e4m3 codes -> bf16, exact (`_E4M3X2_TO_BF16`)."""
    return tl.inline_asm_elementwise(_E4M3X2_TO_BF16, "=r,h", [w], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _block_product(w, xt, NATIVE: tl.constexpr, ASM: tl.constexpr):
    """One scale block's W tile . x^T in fp32: bf16 / fp16 dots on the converted codes (ASM: bf16 x, the
    codes by `_E4M3X2_TO_BF16`), else (the interpreter, fp32 x) an exact fp32 dot."""
    if NATIVE and ASM:
        part = tl.dot(_to_bf16(w), xt)
    elif NATIVE:
        part = tl.dot(w.to(xt.dtype), xt)
    else:
        part = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
    return part


@triton.jit
def _store_tile(y_ptr, acc, rn, rm, M, N, s_ys, s_ym):
    """The y^T tile [rows rn, batch rm] into y (or K split program_id(1)'s fp32 partials)."""
    y_tile = y_ptr + tl.program_id(1).to(tl.int64) * s_ys + rm[None, :].to(tl.int64) * s_ym + rn[:, None]
    tl.store(y_tile, acc.to(y_ptr.dtype.element_ty), mask=(rm < M)[None, :] & (rn < N)[:, None])


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, K_SPLIT, n_group, s_xm, s_ys, s_ym, s_wn, s_sn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr, NATIVE: tl.constexpr,
                 ASM: tl.constexpr, PDL: tl.constexpr):
    """y^T tile [BLOCK_N, BLOCK_M] = W[n0 : n0 + BLOCK_N] . x^T: the weight rows on the dot's M side
    (its register operand, converted where they load: no shared-memory round trip of the converted
    codes, which the batch-on-M form paid as the dot's B operand), the batch's M <= BLOCK_M rows on N
    (x^T from shared memory). grid (N / BLOCK_N, K splits; with several, y is the fp32 partials [S, M,
    N]); BLOCK_N divides 128, so a program's rows share one scale row. EVEN: N a multiple of BLOCK_N
    and K of 128, so only the batch's rows are masked. ASM: bf16 x, the codes by `_E4M3X2_TO_BF16`."""
    pdl_enter(PDL)
    n0 = tl.program_id(0) * BLOCK_N
    k_lo = tl.program_id(1) * K_SPLIT
    rn = n0 + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, 128)
    mm, nm = rm < M, rn < N
    xg = x_ptr + (n0 // n_group) * K
    srow = s_ptr + (n0 // 128) * s_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), 128):
        kk = k0 + rk
        if EVEN:
            w = tl.load(w_ptr + rn[:, None].to(tl.int64) * s_wn + kk[None, :])
            xt = tl.load(xg + rm[None, :].to(tl.int64) * s_xm + kk[:, None], mask=mm[None, :], other=0.0)
        else:
            km = kk < K
            w = tl.load(w_ptr + rn[:, None].to(tl.int64) * s_wn + kk[None, :], mask=nm[:, None] & km[None, :],
                        other=0.0)
            xt = tl.load(xg + rm[None, :].to(tl.int64) * s_xm + kk[:, None], mask=mm[None, :] & km[:, None],
                         other=0.0)
        acc += _block_product(w, xt, NATIVE, ASM) * tl.load(srow + k0 // 128)
    _store_tile(y_ptr, acc, rn, rm, M, N, s_ys, s_ym)


@triton.jit
def _gemm_desc_kernel(x_desc, w_desc, s_ptr, y_ptr, M, N, K, K_SPLIT, n_group, s_ys, s_ym, s_sn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr, ASM: tl.constexpr,
                      PDL: tl.constexpr):
    """`_gemm_kernel` with the code and x tiles loaded through tensor descriptors (TMA on sm_90): no
    per-element address or mask arithmetic in the loop, rows past the batch and codes past N read
    as zeros. Needs K a multiple of 128 (a group's x columns never straddle the next group's)."""
    pdl_enter(PDL)
    n0 = tl.program_id(0) * BLOCK_N
    k_lo = tl.program_id(1) * K_SPLIT
    xk = (n0 // n_group) * K
    srow = s_ptr + (n0 // 128) * s_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), 128):
        w = w_desc.load([n0, k0])
        xt = x_desc.load([0, xk + k0]).T
        acc += _block_product(w, xt, NATIVE, ASM) * tl.load(srow + k0 // 128)
    _store_tile(y_ptr, acc, n0 + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_M), M, N, s_ys, s_ym)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, s_wn, s_sn, BLOCK_N: tl.constexpr):
    """One [BLOCK_N, 128] tile of W = codes x scale (BLOCK_N divides 128: one scale per tile)."""
    n0 = tl.program_id(0) * BLOCK_N
    k0 = tl.program_id(1) * 128
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = k0 + tl.arange(0, 128)
    ok = (rn < N)[:, None] & (rk < K)[None, :]
    sc = tl.load(s_ptr + (n0 // 128) * s_sn + k0 // 128)
    w = tl.load(w_ptr + rn[:, None].to(tl.int64) * s_wn + rk[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], (w * sc).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W = codes x scale [N, K] in dtype (the twin of `fp8_weights.dequantize_blocks`, one pass)."""
    n, k = codes.shape
    out = torch.empty(n, k, dtype=dtype, device=codes.device)
    _dequant_kernel[(triton.cdiv(n, 32), triton.cdiv(k, 128))](codes, scale, out, n, k, codes.stride(0),
                                                                scale.stride(0), BLOCK_N=32, num_warps=4)
    return out


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, size, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y = the sum of the K splits' fp32 partials [SPLITS, size], in split order (deterministic)."""
    pdl_enter(PDL)
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = o < size
    acc = tl.zeros([BLOCK], tl.float32)
    for sp in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + sp * size + o, mask=ok, other=0.0)
    tl.store(y_ptr + o, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _block_n(n_group: int, groups: int, most: int) -> int:
    """Rows per program: a power of two <= most that divides 128 and, with groups, the group's rows."""
    return min(most, BLOCK) if groups == 1 else min(most, n_group & -n_group, BLOCK)


def _check(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, groups: int) -> None:
    n, k = codes.shape
    if codes.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        raise InputError(f"FP8 weights must be float8_e4m3fn codes with fp32 scales, got {codes.dtype} / {scale.dtype}")
    if tuple(scale.shape) != scale_shape(n, k):
        raise InputError(f"scales of a [{n}, {k}] FP8 weight must be {list(scale_shape(n, k))}, "
                         f"got {list(scale.shape)}")
    if x.dim() != 2 or x.shape[1] != groups * k or n % groups:
        raise InputError(f"x must be [T, {groups} x {k}] for a [{n}, {k}] weight in {groups} group(s), "
                         f"got {list(x.shape)}")
    if groups > 1 and (n // groups) % 16:
        raise InputError(f"each of the {groups} output groups needs a multiple of 16 rows, got {n // groups}")


def linear_fp8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, groups: int = 1,
               norm: tuple[torch.Tensor, float] | None = None, tiles: tuple[int, int, int, int] | None = None,
               asm: bool = True, splits: int | None = None, desc: bool | None = None) -> torch.Tensor:
    """Same contract as `dsv4.kernels.reference.linear.linear_fp8`; the module doc gives the kernel by
    the number of rows. tiles: the launch's tiles instead of `_gemv_tiles` / `_gemm_tiles` (for
    benchmarks/tune_fp8.py): (BLOCK_N, BLOCK_K, warps, stages) for one row, else (BLOCK_M, BLOCK_N,
    warps, stages) with BLOCK_M >= the rows; asm=False: Triton's own e4m3 -> bf16 conversion instead
    of `_E4M3X2_TO_BF16`; splits: the GEMM's K splits instead of `_k_splits`'; desc: the GEMM's
    descriptor form wherever it fits (True) or its pointer form (False) instead of by the rows
    (`_DESC_MIN_ROWS`; tuning, tests). norm: inside the one-row kernel; more rows run the norm kernel
    first."""
    _check(x, codes, scale, groups)
    t = x.shape[0]
    if norm is not None and t != 1:
        x, norm = rms_rows(x, norm), None
    n, k = codes.shape
    n_group = n // groups
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    if x.stride(-1) != 1 or codes.stride(-1) != 1 or scale.stride(-1) != 1:
        x, codes, scale = x.contiguous(), codes.contiguous(), scale.contiguous()
    if t > _GEMM_MAX_ROWS and tiles is None:
        w = dequantize(codes, scale, x.dtype)
        if groups == 1:
            return torch.nn.functional.linear(x, w)
        torch.bmm(x.view(t, groups, k).transpose(0, 1), w.view(groups, n_group, k).transpose(1, 2),
                  out=y.view(t, groups, n_group).transpose(0, 1))
        return y
    launch = pdl_launch(x.device)
    if t == 1:
        bn, bk, warps, stages = tiles or _gemv_tiles(n, k)
        bn = _block_n(n_group, groups, bn)
        nw, eps = _norm_args(norm, groups, k, x)
        _gemv_kernel[(triton.cdiv(n, bn),)](x, codes, scale, y, nw, n, k, n_group, codes.stride(0), scale.stride(0),
                                            eps, BLOCK_N=bn, BLOCK_K=bk, NORM=norm is not None, num_warps=warps,
                                            num_stages=stages, **launch)
        return y
    bm, bn, warps, stages = tiles or _gemm_tiles(t, x.element_size())
    if bm < t:
        raise InputError(f"the GEMM holds all {t} rows in one tile: BLOCK_M {bm} is too small")
    bn = _block_n(n_group, groups, bn)
    native = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
    splits, k_split = _k_splits(triton.cdiv(n, bn), k, t, sm_count(x.device) if x.is_cuda else 4, splits)
    out = y if splits == 1 else torch.empty(splits, t, n, dtype=torch.float32, device=x.device)
    use_asm = native and x.dtype == torch.bfloat16 and asm
    if (t >= _DESC_MIN_ROWS if desc is None else desc) and _descriptors_fit(x, codes):
        _gemm_desc_kernel[(triton.cdiv(n, bn), splits)](
            TensorDescriptor.from_tensor(x, [bm, BLOCK]), TensorDescriptor.from_tensor(codes, [bn, BLOCK]),
            scale, out, t, n, k, k_split, n_group, t * n, n, scale.stride(0), BLOCK_M=bm, BLOCK_N=bn,
            NATIVE=native, ASM=use_asm, num_warps=warps, num_stages=stages, **launch)
    else:
        _gemm_kernel[(triton.cdiv(n, bn), splits)](
            x, codes, scale, out, t, n, k, k_split, n_group, x.stride(0), t * n, n, codes.stride(0), scale.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, EVEN=n % bn == 0 and k % BLOCK == 0, NATIVE=native, ASM=use_asm,
            num_warps=warps, num_stages=stages, **launch)
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(t * n, 1024),)](out, y, t * n, SPLITS=splits, BLOCK=1024, num_warps=4,
                                                         **launch)
    return y


def linear_pair(x: torch.Tensor, dense: torch.Tensor, codes: torch.Tensor,
                scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.linear.linear_pair`: one row on CUDA `gemv_pair` (one launch),
    otherwise `gemv.linear`, then `linear_fp8`."""
    if (x.shape[0] == 1 and x.is_cuda and x.is_contiguous() and dense.stride(-1) == 1 and codes.is_contiguous()
            and scale.is_contiguous() and dense.shape[1] == codes.shape[1]):
        return gemv_pair(x, dense, codes, scale)
    return gemv.linear(x, dense), linear_fp8(x, codes, scale)


def gemv_pair(x: torch.Tensor, dense: torch.Tensor, codes: torch.Tensor,
              scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, K] (contiguous) by a dense weight [N_d, K] (rows contiguous) and FP8 codes [N_f, K]
    (contiguous, with their scales) -> ([1, N_d], [1, N_f]) in x's dtype, in one launch
    (`_gemv_pair_kernel`: each program's code and tiles those of `gemv` and of `linear_fp8`'s GEMV,
    so the outputs are theirs bit for bit). As two kernels, the second one's programs start only
    once the first has finished: at the decode step's first stage (one row) a whole DRAM round trip
    for a few MB; in one grid both weights' loads are in flight together. H200, the V4-Flash HCA
    layer's FP8 q_a + kv beside its dense compressor projections, from a spin's end with the L2
    flushed (`benchmarks/gemv_stream_probe.py --inputs`): 9.7 µs as two kernels, 7.7 in the step's
    timeline as one; the layer at one row 63.7-63.8 -> 62.5-62.7 µs (benchmarks/NOTES.md #161)."""
    _check(x, codes, scale, 1)
    scale = scale.contiguous()
    n_d, k = dense.shape
    n_f = codes.shape[0]
    if x.shape != (1, k) or not x.is_contiguous() or dense.stride(-1) != 1 or not codes.is_contiguous():
        raise InputError(f"gemv_pair: x must be one contiguous row of {k} and both weights' rows contiguous; "
                         f"got x {list(x.shape)}, dense {list(dense.shape)}, codes {list(codes.shape)}")
    bn_d, bk_d, warps_d, stages_d = gemv._tiles(k)
    bn_f, bk_f, warps_f, stages_f = _gemv_tiles(n_f, k)
    y_d = torch.empty(1, n_d, dtype=x.dtype, device=x.device)
    y_f = torch.empty(1, n_f, dtype=x.dtype, device=x.device)
    grid = triton.cdiv(n_f, bn_f) + triton.cdiv(n_d, bn_d)
    _gemv_pair_kernel[(grid,)](x, dense, y_d, n_d, dense.stride(0), codes, scale, y_f, n_f,
                               codes.stride(0), scale.stride(0), k, BN_D=bn_d, BK_D=bk_d, BN_F=bn_f, BK_F=bk_f,
                               num_warps=max(warps_d, warps_f), num_stages=max(stages_d, stages_f),
                               **pdl_launch(x.device))
    return y_d, y_f


def _descriptors_fit(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """Tensor descriptors (TMA) need 16-byte aligned bases and row strides; K a multiple of 128 keeps
    each x tile inside its group's columns."""
    return (codes.shape[1] % BLOCK == 0 and x.data_ptr() % 16 == 0 and codes.data_ptr() % 16 == 0
            and (x.stride(0) * x.element_size()) % 16 == 0 and codes.stride(0) % 16 == 0)


def _k_splits(tiles_mn: int, k: int, rows: int, sms: int, want: int | None = None) -> tuple[int, int]:
    """(splits, codes per split). K is split (in powers of two, each split keeping at least
    `_SPLIT_MIN_K` codes) while the output tiles leave most SMs idle (fewer programs than half the
    SMs), then further while the programs stay within two per SM (four at up to 16 rows, where a
    program's dot is small) and the fp32 partials, written and read again, stay within half the
    codes' bytes (splits x rows x 8 <= K / 2). want: that many splits instead (tuning), fewer where
    the last would be empty. H200, descriptor GEMM, µs by splits (benchmarks/tune_fp8.py; the rule's
    choice in bold): q_a + kv (24 tiles, K 4096) 64 rows 2 14.4, **4 10.8**, 8 11.4; 200 rows 2 25.2,
    **4 18.2**, 8 22.4; o_a (128 tiles, K 4096) 16 rows 2 16.6, **4 15.5**; 64 rows 1 22.8, **2 19.2**,
    4 23.4; 128 rows 1 27.2, **2 25.8**, 4 33.4; 200 rows **1 40.5**, 2 49.4; o_b (64 tiles, K 8192)
    16 rows 2 22.5, 4 16.8, **8 16.8**; 64 rows 2 24.6, **4 19.4**, 8 23.9; 128 rows 2 29.7, **4 29.5**;
    200 rows 1 74.1, **2 45.5**, 4 52.1; q_b (512-640 tiles): 1 at every row count."""
    if want:
        splits = max(1, min(want, triton.cdiv(k, BLOCK)))
    else:
        splits = 1
        most = (4 if rows <= 16 else 2) * sms
        while k >= 2 * splits * _SPLIT_MIN_K and (
                tiles_mn * splits < sms // 2
                or (tiles_mn * 2 * splits <= most and 2 * splits * rows * 16 <= k)):
            splits *= 2
    k_split = triton.cdiv(triton.cdiv(k, splits), BLOCK) * BLOCK
    return triton.cdiv(k, k_split), k_split


def _gemm_tiles(t: int, x_bytes: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) for 2 .. 256 rows: all rows in one tile (the batch's power of
    two), 64 weight rows; 8 warps for 256 rows (4 spill there). 3 stages, fewer where a stage's x^T
    tile (128 x BLOCK_M of x_bytes each) would overflow the shared memory (fp32 x at 256 rows: one).
    H200, µs, the descriptor GEMM at `_k_splits`' splits / the pointer GEMM at the earlier splits rule /
    cuBLAS on the bf16 weights (benchmarks/tune_fp8.py; V4-Flash q_a + kv, CSA q_b, HCA q_b, o_a, o_b):
    16 rows 10.0 / 9.8 / 10.1, 15.8 / 16.6 / 25.5, 14.0 / 14.2 / 20.6, 15.8 / 15.9 / 21.0, 17.1 / 17.1 /
    23.9; 64 rows 11.1 / 12.4 / 11.6, 21.4 / 24.0 / 25.5, 19.2 / 21.0 / 21.6, 19.6 / 28.0 / 22.7, 19.7 /
    28.1 / 25.6; 128 rows 13.4 / 15.2 / 11.9, 32.2 / 37.1 / 27.1, 23.6 / 26.8 / 23.0, 26.9 / 37.0 / 23.8,
    29.2 / 37.3 / 28.7; 200 rows 18.3 / 24.4 / 13.5, 60.9 / 71.9 / 33.8, 48.8 / 58.5 / 24.5, 41.1 / 73.0
    / 26.1, 45.5 / 73.7 / 33.1. 128 weight rows a tile, or 8 warps below 256 rows: slower."""
    bm = max(16, triton.next_power_of_2(t))
    stage = 128 * (bm * x_bytes + 64)                      # the x^T tile and the codes' [64, 128]
    return bm, 64, 8 if bm > 128 else 4, max(1, min(3, _SMEM_BUDGET // stage))


#: Triton 3.7 or later: the one-row GEMV's tiles differ (`_gemv_tiles`)
_TRITON_3_7 = TRITON_VERSION >= (3, 7)


def _gemv_tiles(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages), BLOCK_K a multiple of 128: 16 rows x 512 codes where that
    still gives ~4 programs per SM (the q up-projection, the grouped o_a), else 4 x 2048 (q_a + kv,
    W_ob). H100, batch 1, µs (`benchmarks/tune_fp8.py`; plain read of the codes 15.0-15.2): o_a 16.6
    at 16 x 512 against 17.8 at 4 x 2048; W_ob 16.9 against 20.2; q_a + kv 6.9 against 10.6.

    Triton 3.7 compiles those tiles slower (H100, one round, 3.6 -> 3.7.1 at the 3.6 tiles: CSA q_b
    18.8 -> 21.7, HCA q_b 16.0 -> 18.4, o_a 16.2 -> 21.4, W_ob 16.8 -> 19.8; q_a + kv 7.3 -> 7.5); its
    best there: 16 x 256 for K 1,024 (19.9, 16.7) and 8 x 1024 over 3 stages for the wide ones (o_a
    17.0, W_ob 16.9). Benchmarks/NOTES.md, sixty-fifth round."""
    if _TRITON_3_7:
        if k <= 1024:
            return 16, 256, 4, 4
        return (8, 1024, 4, 3) if n >= 4096 else (4, 2048, 4, 3)
    if k <= 1024 or n >= 8192:
        return 16, 512, 4, 4
    return 4, 2048, 4, 3
