"""Helpers shared by the Triton decode-step kernels (`indexer_scores`, `decode_attention`).

Precision ids (`precision=`): "ieee" = fp32 operands and fp32 FMA dots; "tf32x3" = fp32 operands
on tensor cores in three TF32 passes; "bf16" = bf16 tensor-core operands, fp32 accumulation;
"bf16x2" = the varying fp32 operand split into bf16 hi + lo, two dots (~1e-5). Dequantised keys
of every quantised format (and bf16) are exact in bf16, so only the fp32 operand is rounded.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsv4.errors import InputError

Views = dict[str, torch.Tensor]

LOG2E = 1.4426950408889634
PRECISIONS = {"ieee": 0, "bf16": 1, "bf16x2": 2, "tf32x3": 3}

#: the fp8_ds format id of the attention kernels' FMT constexpr (2: fp32, 1: bf16)
FP8_DS_ID: tl.constexpr = tl.constexpr(2)

#: (major, minor) of the Triton in use: some tiles and load shapes compile best per release
TRITON_VERSION = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])

#: Whether the coalescing pass breaks a tie between equally contiguous dims toward the outer one
#: (Triton 3.7+; 3.6 toward the inner one): `load_entry_tile` then loads chunk-major (below)
CHUNK_MAJOR: tl.constexpr = tl.constexpr(TRITON_VERSION >= (3, 7))

#: Registers and spills of the last compile of each kernel (name -> {"regs", "spills"}), for tuning
#: scripts; filled only on CUDA, where a launch returns the compiled kernel.
COMPILE_INFO: dict[str, dict[str, int]] = {}


def note_compile(name: str, compiled: Any) -> None:
    regs, spills = getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)
    if regs is not None:
        COMPILE_INFO[name] = {"regs": int(regs), "spills": int(spills or 0)}


@triton.jit
def split_operand(x, PREC: tl.constexpr):
    """fp32 operand -> (hi, lo) in the dot's operand type (lo used only by bf16x2)."""
    if PREC == 0 or PREC == 3:
        hi = x
        lo = x
    else:
        hi = x.to(tl.bfloat16)
        lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def dot_prec(a_hi, a_lo, b, PREC: tl.constexpr, NATIVE: tl.constexpr):
    """a @ b with a given as split_operand(a); b already in the operand type (exact in bf16 unless ieee).

    NATIVE=False (the CPU interpreter, whose bf16 dot is wrong) runs the same bf16-rounded
    operands through an fp32 dot."""
    if PREC == 0:
        out = tl.dot(a_hi, b, input_precision="ieee")
    elif PREC == 3:
        out = tl.dot(a_hi, b, input_precision="tf32x3")
    elif NATIVE:
        out = tl.dot(a_hi, b)
        if PREC == 2:
            out += tl.dot(a_lo, b)
    else:
        bf = b.to(tl.float32)
        out = tl.dot(a_hi.to(tl.float32), bf, input_precision="ieee")
        if PREC == 2:
            out += tl.dot(a_lo.to(tl.float32), bf, input_precision="ieee")
    return out


@triton.jit
def split_stats(pml_ptr, sinks_ptr, b, h, hmask, H: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr):
    """Final max M = max(m_s, sink) and denominator sum_s 2^(m_s - M) l_s + 2^(sink - M) of the key
    splits' softmax stats pml [B, S, H, 2] (log2 domain) for request b's heads h."""
    s = tl.arange(0, S_PAD)[:, None]
    ml = pml_ptr + ((b * S + s) * H + h[None, :]) * 2
    smask = (s < S) & hmask[None, :]
    ms = tl.load(ml, mask=smask, other=float("-inf"))
    ls = tl.load(ml + 1, mask=smask, other=0.0)
    sink = tl.load(sinks_ptr + h, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_f = tl.maximum(tl.max(ms, axis=0), sink)
    return m_f, tl.sum(tl.exp2(ms - m_f[None, :]) * ls, axis=0) + tl.exp2(sink - m_f)


@triton.jit
def inverse_rope(o, b, d0, cos_ptr, sin_ptr, ROWS: tl.constexpr, WIDTH: tl.constexpr, D: tl.constexpr,
                 HALF_R: tl.constexpr):
    """RoPE_{-t} of request b's [ROWS, WIDTH] tile o of channels d0 .. d0 + WIDTH (d0 even): the pairs
    (e, o) among the trailing 2 HALF_R of D channels (interleaved, as `norm_rope`) become
    (e cos + o sin, o cos - e sin); cos, sin [B, HALF_R]. The pairs are split in registers, so no
    partner channel is loaded twice."""
    ev, od = tl.split(tl.reshape(o, [ROWS, WIDTH // 2, 2]))
    j = d0 // 2 + tl.arange(0, WIDTH // 2) - (D // 2 - HALF_R)
    rot = (j >= 0) & (j < HALF_R)
    cs = tl.load(cos_ptr + b * HALF_R + j, mask=rot, other=1.0)[None, :]
    sn = tl.load(sin_ptr + b * HALF_R + j, mask=rot, other=0.0)[None, :]
    return tl.reshape(tl.join(ev * cs + od * sn, od * cs - ev * sn), [ROWS, WIDTH])


@triton.jit
def locate(bt_row, w, valid, epb, max_blocks):
    """Entry indices w [N] -> (physical block int64, row), as the reference: masked -> block 0."""
    wc = tl.maximum(w, 0)
    col = tl.minimum(wc // epb, max_blocks - 1)
    blk = tl.load(bt_row + col, mask=valid, other=0)
    blk = tl.where(blk >= 0, blk, 0)
    return blk.to(tl.int64), wc % epb


def precision_id(name: str | None, default: str) -> int:
    name = name or default
    if name not in PRECISIONS:
        raise InputError(f"precision={name!r} is not one of {tuple(PRECISIONS)}")
    return PRECISIONS[name]


def rows(t: torch.Tensor) -> tuple[int, int]:
    """(page, row) strides of a typed region view [N, P, C]; its channels must be contiguous."""
    assert t.stride(-1) == 1, "region views have contiguous channels"
    return t.stride(0), t.stride(1)


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a static property: no sync, capturable)."""
    return _sm_count_of(_index(device))


@functools.cache
def _pdl_of(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` may use programmatic dependent launch (sm_90+: `griddepcontrol`):
    a cache write launched with it is set up while the compressor before it runs and waits in
    `gdc_wait` for that kernel's results (no sync; CUDA graphs capture it)."""
    return device.type == "cuda" and _pdl_of(_index(device))


def pdl_launch(device: torch.device) -> dict:
    """Launch options of a kernel that starts with `pdl_enter`: PDL=True and programmatic dependent
    launch where the device has it, else PDL=False (the kernel then starts as any other)."""
    return {"PDL": True, "launch_pdl": True} if pdl(device) else {"PDL": False}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """The first statement of a kernel launched with `pdl_launch`: wait until the kernel before it
    in the stream has finished and its writes are visible, then let the kernel after it launch.
    A chain of such kernels (the decode step's scan, top-k, attention) sets each launch up while
    the kernel before it runs, instead of ~1 µs of idle GPU between them."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@triton.jit
def load_entry_tile(kv_ptr, rope_ptr, sc_ptr, page, row, ok, c0, s_kp, s_kr, s_rp, s_rr, s_sp, s_sr,
                    FMT: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, NC: tl.constexpr):
    """The stored bytes of channels [c0 * 64, (c0 + NC) * 64) of each key, as loaded (fp8 / bf16 /
    fp32 [N, NC, 64], fp8_ds scale bytes [N, NC, 1] and bf16 rope [N, 1, 64]); 0 where masked.
    Built as [rows, chunk, 64] so each fp8_ds 64-channel tile meets its one scale byte by
    broadcasting; chunk NOPE // 64 comes from the rope part.

    Every part is loaded in one register layout, so that joining them moves no data: x in 8-element
    vectors like the bf16 rope, the scale bytes as one word per key split in x's layout. Otherwise
    the compiler converts x to the layout of the rope / scale loads through shared memory (H200,
    two-pass attention pass 1: 1,080 -> 870 SASS instructions and 15 -> 10 barriers per key tile,
    255 -> 201 registers)."""
    # CHUNK_MAJOR: loaded as [chunk, rows, 64] (rope [1, rows, 64], scale bytes [chunk, rows, 1]), then
    # permuted: on 3.7+'s tie-break that is 3.6's layout, the same registers per thread
    if CHUNK_MAJOR:
        c = c0 + tl.arange(0, NC)[:, None, None]
        d = c * 64 + tl.arange(0, 64)[None, None, :]
        p3 = page[None, :, None]
        r3 = row[None, :, None]
        v3 = ok[None, :, None]
    else:
        c = c0 + tl.arange(0, NC)[None, :, None]
        d = c * 64 + tl.arange(0, 64)[None, None, :]
        p3 = page[:, None, None]
        r3 = row[:, None, None]
        v3 = ok[:, None, None]
    if FMT == FP8_DS_ID:
        # 8-element (not 16-byte) vectors: the layout of the bf16 rope load below, which x joins
        dx = tl.max_contiguous(d, [1, 1, 8])
        x = tl.load(kv_ptr + p3 * s_kp + r3 * s_kr + dx, mask=v3 & (d < NOPE), other=0.0)
        if NOPE // 64 <= 8:     # the scale bytes as one word per key (the wrapper checks the alignment)
            sw = tl.load((sc_ptr + page * s_sp + row * s_sr).to(tl.pointer_type(tl.uint64)), mask=ok, other=0)
            if CHUNK_MAJOR:
                sb = ((sw[None, :, None] >> (8 * c).to(tl.uint64)) & 0xFF).to(tl.uint8)
            else:
                sb = ((sw[:, None, None] >> (8 * c).to(tl.uint64)) & 0xFF).to(tl.uint8)
        else:
            sb = tl.load(sc_ptr + p3 * s_sp + r3 * s_sr + c, mask=v3 & (c < NOPE // 64), other=0)
        j = tl.arange(0, 64)[None, None, :]
        c0t = tl.zeros([1, 1, 1], tl.int32) + c0           # a tensor: the interpreter masks with tensors only
        has_rope = (c0t <= NOPE // 64) & (c0t + NC > NOPE // 64)
        rope = tl.load(rope_ptr + p3 * s_rp + r3 * s_rr + j, mask=v3 & (j < D - NOPE) & has_rope, other=0.0)
    else:
        x = tl.load(kv_ptr + p3 * s_kp + r3 * s_kr + d, mask=v3 & (d < D), other=0.0)
        sb = tl.zeros_like(p3).to(tl.uint8)
        rope = sb
    if CHUNK_MAJOR:
        x, sb, rope = tl.permute(x, (1, 0, 2)), tl.permute(sb, (1, 0, 2)), tl.permute(rope, (1, 0, 2))
    return x, sb, rope


@triton.jit
def dequant_entry_tile(x, sb, rope, c0, FMT: tl.constexpr, NOPE: tl.constexpr, NC: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """`load_entry_tile`'s bytes -> keys [BLOCK_N, NC * 64] fp32 (exact: UE8M0 scales are 2^(byte - 127))."""
    x = x.to(tl.float32)
    if FMT == FP8_DS_ID:
        c = c0 + tl.arange(0, NC)[None, :, None]
        x = x * (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        x = tl.where(c < NOPE // 64, x, tl.where(c == NOPE // 64, rope.to(tl.float32), 0.0))
    return tl.reshape(x, [BLOCK_N, NC * 64])


@triton.jit
def key_operand(x, sb, rope, c0, FMT: tl.constexpr, NOPE: tl.constexpr, NC: tl.constexpr, BLOCK_N: tl.constexpr):
    """`load_entry_tile`'s bytes -> the keys [BLOCK_N, NC * 64] as a tensor-core operand: fp16 for
    fp8_ds, bf16 for the other formats (queries and probabilities: `as_operand`).

    fp8_ds in fp16: e4m3 -> fp16 is one conversion a pair, and times the UE8M0 scale 2^e one
    multiply a pair; the fp32 route (`dequant_entry_tile`, then bf16) takes ~3 instructions an
    element instead of ~1. The keys are exact for scales from 2^-15 to 2^7 (every element then
    within fp16's range). Below 2^-15 (a 64-channel chunk's amax under 448 x 2^-16) they round to
    fp16 subnormals, an absolute error <= 2^-25 per element, far below the bf16 rounding of the
    queries this replaces. Past fp16's range (an element over 65,504, which a normalised key never
    has) they overflow to inf and the output is not finite. The rope part, bf16, rounds to fp16
    the same way."""
    if FMT == FP8_DS_ID:
        c = c0 + tl.arange(0, NC)[None, :, None]
        k = x.to(tl.float16) * (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True).to(tl.float16)
        k = tl.where(c < NOPE // 64, k, tl.where(c == NOPE // 64, rope.to(tl.float16), 0.0))
        k = tl.reshape(k, [BLOCK_N, NC * 64])
    else:
        k = dequant_entry_tile(x, sb, rope, c0, FMT, NOPE, NC, BLOCK_N).to(tl.bfloat16)
    return k


@triton.jit
def as_operand(v, FMT: tl.constexpr):
    """Queries or probabilities in the dot operand type of `key_operand`'s keys."""
    if FMT == FP8_DS_ID:
        out = v.to(tl.float16)
    else:
        out = v.to(tl.bfloat16)
    return out
