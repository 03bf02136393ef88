"""Helpers shared by the Triton decode-step kernels (`indexer_scores`, `decode_attention`).

Precision ids (`precision=`): "ieee" = fp32 operands and fp32 FMA dots; "tf32x3" = fp32 operands
on tensor cores in three TF32 passes; "bf16" = bf16 tensor-core operands, fp32 accumulation;
"bf16x2" = the varying fp32 operand split into bf16 hi + lo, two dots (~1e-5). Dequantised keys
of every quantised format (and bf16) are exact in bf16, so only the fp32 operand is rounded.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from dsv4.errors import InputError

Views = dict[str, torch.Tensor]

LOG2E = 1.4426950408889634
PRECISIONS = {"ieee": 0, "bf16": 1, "bf16x2": 2, "tf32x3": 3}

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
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())
