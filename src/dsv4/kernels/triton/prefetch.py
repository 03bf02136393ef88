"""Weights into the L2 ahead of their GEMV, while the step's latency-bound kernels leave DRAM idle.

At a few decode rows a layer's step alternates between GEMVs that stream their weights from DRAM
and chains of small latency-bound kernels (norms, the attention and its combine) during which DRAM
is nearly idle. `l2_prefetch` fills that idle time: launched on a side stream beside such a chain,
it asks the memory system to bring a weight into the L2 (`cp.async.bulk.prefetch.L2.global`, sm_90:
one instruction per 64 KB piece, no shared memory, no registers held, no data into the SM), so the
GEMV that follows reads those bytes from the L2 instead of DRAM. The kernel ends as soon as its
requests are issued; it writes nothing, so results are unchanged whether it runs or not.

    grid (P,): program i asks for pieces i*32 .. i*32 + 31 of the byte range (one a thread)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: bytes a prefetch instruction asks for (a multiple of 16, as the instruction needs)
PIECE = 65536
_PIECES = 32            # pieces a program: one a thread of its one warp

#: `cp.async.bulk.prefetch.L2.global [addr], size` ($1, $2): size a multiple of 16, addr 16-byte aligned;
#: skipped where size is 0 (also the wide prefill kernel's next queries)
PREFETCH_L2_ASM = """{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}"""
_PREFETCH_ASM = tl.constexpr(PREFETCH_L2_ASM)


@triton.jit
def _prefetch_kernel(base_ptr, nbytes, PIECE_: tl.constexpr, PIECES: tl.constexpr):
    off = (tl.program_id(0).to(tl.int64) * PIECES + tl.arange(0, PIECES)) * PIECE_
    size = tl.minimum(nbytes - off, PIECE_).to(tl.int32)      # nbytes: a multiple of 16
    tl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,r", [base_ptr + off, size], dtype=tl.int32, is_pure=False,
                              pack=1)


def supported(device: torch.device) -> bool:
    """Bulk L2 prefetches need an sm_90 or later GPU."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def l2_prefetch(tensors: list[torch.Tensor], budget: int) -> int:
    """Ask for the first `budget` bytes of `tensors` (in order, each whole while the budget lasts, then
    the first part of the next; each share cut down to a multiple of 16 bytes) to be brought into the
    L2. Contiguous tensors on an sm_90+ GPU; elsewhere nothing is launched. Returns the bytes asked for."""
    asked = 0
    for t in tensors:
        if asked >= budget or not supported(t.device):
            break
        assert t.is_contiguous() and t.data_ptr() % 16 == 0, "l2_prefetch takes contiguous 16-byte aligned tensors"
        n = min(t.numel() * t.element_size(), budget - asked) & ~15
        if n:
            _prefetch_kernel[(triton.cdiv(n, PIECE * _PIECES),)](t.view(torch.uint8).view(-1), n, PIECE_=PIECE,
                                                                 PIECES=_PIECES, num_warps=1)
        asked += n
    return asked
