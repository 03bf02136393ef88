"""Indexer scan for mxfp4 keys with pages copied by the tensor memory accelerator (Gluon, sm_90): the
decode scan of `indexer_scores.paged_indexer_scores` where a 64-key tile is one page of the
indexer pool.

    grid (B, P): program p scans key tiles p, p + P, ... of request b (tile i = block-table column
    i: 64 keys of 68 bytes, 4 KB of packed E2M1 then 256 B of UE8M0 scales), then writes -inf to
    its tiles past the request's entries.

One warpgroup a program. NS pages are in flight: per tile one copy of the page's key words and one
of its scale words into a stage (`tma.async_copy_global_to_shared`, completing on the stage's
mbarrier), issued NS tiles ahead when the stage is read. Per tile: each lane reads its own 16 bytes
of each of its two key rows (one scale group), decoded to bf16 keys scaled by 2^(e_g - e_max)
(exact, `_E2M1_WORD_ASM`) straight into the registers of the warpgroup MMA's A operand; the MMA's
K order is therefore a permutation of the key's dims (`_perm`), and q's columns are stored in that
order once. S^T [64 keys, 64 heads] = K . q^T (q [64 heads, 128] bf16 in shared memory), then
score[n] = 2^e_max[n] D^-1/2 sum_h w_h ReLU(S^T[n, h]). No key tile goes through shared memory: a
tile moves ~25 KB there (its copy, its words read, q read by the MMA) instead of ~57 KB when the
decoded keys are stored and read back. 25 KB of shared memory and 105 registers a thread: four
programs an SM.

Why: the pointer scan (`indexer_scan`) loads each tile into registers a tile ahead and computes
its addresses per key; no warp here waits on a global load (the copies run NS tiles ahead and
hold no registers) and a tile costs one block-table lookup. Two first forms were no faster than
the pointer scan (H100, 128K B = 64: 149 µs against 131): a warp-specialised one (a 1-warp copy
partition, padded by Triton to 8 warps a program: 2 programs an SM) and this one storing the
decoded keys to an NVMMA tile for the MMA (shared-memory bound). Now ~341 instructions a warp a
tile (sm_90 compile, Triton 3.6): 136 the decode, ~76 the ReLU and head sum, ~45 the two copies'
issue. A tile costs its MMA plus its instructions: on Hopper the warpgroup MMA and the SM's ALU
work do not overlap (`benchmarks/mma_probe.py`), so an asynchronous MMA under the previous tile's
epilogue, or a copy warp with no barrier a tile, measured no faster. When each lane decoded one
pair of every word of its rows (all 64 bytes read, the pairs gathered by scale group) it took 419.

Scores equal the pointer scan's to fp32 rounding (the same operands and fp32 accumulation; the
dot's K order and the head sum's order differ). Static grid, no host reads: capturable in a CUDA graph.
Measurements: benchmarks/NOTES.md.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dsv4.kernels.triton.decode_attention_wide import GLUON_OK, _barrier

#: keys a tile = indexer keys a page (the default 256 tokens a block, m = 4)
EPB = 64
_EPB = gl.constexpr(EPB)
#: bytes a page copies (64 keys of 16 words of 8 E2M1 codes, and their 4 scale bytes)
_PAGE_BYTES = gl.constexpr(EPB * (16 * 4 + 4))
#: pages in flight a program (H100, 128K, B = 64 / 16: 2 stages 1-5% faster than 3-4: more programs fit)
STAGES = 2
#: registers a thread: four programs an SM (96, five with no spills, and 104 measured no faster)
MAXNREG = 128


@gluon.constexpr_function
def _keys():
    """[4, 2, 8, 4, 4, 4] = (warp, row half, row group, word i, pair j, lane t): key row 16 w + 8 h + g
    as the warpgroup MMA's register operand holds it (rows g and g + 8 of each warp's 16, lane 4 g + t).
    Lane t decodes words 4 t .. 4 t + 3 of its two rows (its own 16 bytes: scale group t), pair j of
    word 4 t + i being codes j and j + 4; they are the operand's columns 8 (4 i + j) + 2 t + (0, 1),
    so the MMA's K order is a permutation of the key's dims (`_perm`), which q follows."""
    return gl.BlockedLayout([1, 2, 1, 4, 4, 1], [1, 1, 8, 1, 1, 4], [4, 1, 1, 1, 1, 1], [4, 3, 1, 5, 2, 0])


@gluon.jit
def _perm(k):
    """The key dim at MMA column k = 8 (4 i + j) + 2 t + e: code j + 4 e of word 4 t + i."""
    return 32 * ((k >> 1) & 3) + 8 * (k >> 5) + ((k >> 3) & 3) + 4 * (k & 1)


@gluon.constexpr_function
def _acc():
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])


@gluon.constexpr_function
def _flat(rank):
    """Shared layout of the copies' boxes: unswizzled, row-major."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=rank)


@gluon.jit
def _block(bt_row, tile, max_blocks):
    """The page of key tile `tile` (block-table column `tile`; a clamped, non-negative id)."""
    blk = gl.load(bt_row + gl.minimum(tile, max_blocks - 1))
    return gl.maximum(blk, 0)


@gluon.jit
def _issue(raw_d, raw_s, ready, d_desc, s_desc, s, blk):
    """The copies of page blk into stage s, completing on ready[s]."""
    mbarrier.expect(ready.index(s), _PAGE_BYTES)
    tma.async_copy_global_to_shared(d_desc, [blk, 0, 0], ready.index(s), raw_d.index(s))
    tma.async_copy_global_to_shared(s_desc, [blk, 0], ready.index(s), raw_s.index(s))


# One key word -> four bf16x2 (pack = 4: $4-$7 the word, $8-$11 the bf16x2 factor 2^(126 + e_g - e_max)
# of its scale group). Pair j is codes j and j + 4 (bits 4 j and 4 j + 16: one mask takes both, and
# codes 2-3 / 6-7 come from the word shifted right a byte); times 2^6 + 2^12 (2^2 + 2^8 for the odd
# pairs) each code's magnitude lands on bits 6-8 and its sign on bit 15 of its half, masked: the
# bf16 of value * 2^-126, exact (as `indexer_scan._E2M1_PAIR_ASM`), then times the factor.
# 17 instructions a word (22 for four pairs of four words gathered by scale group before).
_E2M1_WORD_ASM = gl.constexpr("{\n.reg .b32 h, x;\nshr.b32 h, $4, 8;\n"
                              + "".join(f"and.b32 x, {src}, {mask:#x};\nmul.lo.u32 x, x, {mul};\n"
                                        f"and.b32 x, x, 0x81C081C0;\nmul.rn.bf16x2 ${j}, x, $8;\n"
                                        for j, (src, mask, mul) in enumerate(
                                            [("$4", 0x000F000F, 4160), ("$4", 0x00F000F0, 260),
                                             ("h", 0x000F000F, 4160), ("h", 0x00F000F0, 260)]))
                              + "}")


@gluon.jit
def _decode(raw_d, raw_s, s):
    """Stage s's page -> (keys [64, 128] bf16 x 2^(e_g - e_max) in the MMA's register-operand
    layout, columns in `_perm` order; 2^e_max a key in the accumulator's row layout)."""
    K6: gl.constexpr = _keys()
    W5: gl.constexpr = gl.SliceLayout(4, K6)                                     # [w, h, g, i, t]
    R3: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, W5))                  # [w, h, g]
    # word 4 t + i of row (w, h, g): i runs fastest in memory
    page_d = raw_d.index(s)._reinterpret(gl.int32, [4, 2, 8, 4, 4], gl.SwizzledSharedLayout(1, 1, 1, [3, 4, 2, 1, 0]))
    page_s = raw_s.index(s)._reinterpret(gl.int32, [4, 2, 8], _flat(3))
    words = page_d.load(W5)                                                      # [4, 2, 8, 4, 4]
    srow = page_s.load(R3)                                                       # [4, 2, 8] scale words
    srow_acc = raw_s.index(s)._reinterpret(gl.int32, [_EPB], _flat(1)).load(gl.SliceLayout(1, _acc()))
    # the key's largest group scale e_max, and lane t's group factor 2^(126 + e_t - e_max) as bf16x2 bits
    smax = srow & 0xFF
    for g in gl.static_range(1, 4):
        smax = gl.maximum(smax, (srow >> 8 * g) & 0xFF)
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, W5)))))
    t = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(t, 0), 0), 0), 0)   # [1, 1, 1, 1, 4]
    byte = (gl.expand_dims(gl.expand_dims(srow, 3), 4) >> (8 * t)) & 0xFF
    fe = gl.maximum(byte - gl.expand_dims(gl.expand_dims(smax, 3), 4) + 253, 1)   # 2^252 below e_max: 0
    sc = gl.expand_dims(fe * 0x800080, 4)                                        # (fe << 7) | (fe << 23)
    amax = srow_acc & 0xFF
    for g in gl.static_range(1, 4):
        amax = gl.maximum(amax, (srow_acc >> 8 * g) & 0xFF)
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(
        5, K6))))))
    j = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(j, 0), 0), 0), 0), 5)
    pair = gl.inline_asm_elementwise(_E2M1_WORD_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r",
                                     [gl.expand_dims(words, 4) + 0 * j, sc + 0 * j],
                                     dtype=gl.int32, is_pure=True, pack=4)       # [4, 2, 8, 4, 4, 4]
    lo = pair.to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (pair >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    keys = gl.reshape(gl.join(lo, hi), [_EPB, 128])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_acc(), k_width=2)
    return gl.convert_layout(keys, A_L), (amax << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _take(raw_d, raw_s, ready, d_desc, s_desc, bt_row, p0, step, i, mine, max_blocks, NS: gl.constexpr):
    """Tile i's keys and key scales from its stage, which then refills with tile i + NS's page."""
    s = i % NS
    blk = _block(bt_row, p0 + (i + NS) * step, max_blocks)      # the refill's page, under the wait
    mbarrier.wait(ready.index(s), (i // NS) & 1)
    keys, glob = _decode(raw_d, raw_s, s)
    _barrier()                  # every warp has read stage s ...
    if i + NS < mine:           # ... so it refills, NS tiles ahead
        _issue(raw_d, raw_s, ready, d_desc, s_desc, s, blk)
    return keys, glob


@gluon.jit
def _score(acc, wts, glob, out_row, offs, n_b, max_entries, out_scale):
    score = gl.sum(gl.maximum(acc, 0.0) * wts, axis=1) * (glob * out_scale)      # glob > 0: after ReLU
    gl.store(out_row + offs, gl.where(offs < n_b, score, float("-inf")), mask=offs < max_entries)


@gluon.jit
def _scan_tma_kernel(q_ptr, w_ptr, out_ptr, d_desc, s_desc, bt_ptr, nent_ptr, s_qb, s_qh, s_wb, s_ob, s_bt,
                     num_tiles, max_entries, max_blocks, out_scale, w_scale, NS: gl.constexpr):
    b = gl.program_id(0)
    p0 = gl.program_id(1)
    step = gl.num_programs(1)
    n_b = gl.minimum(gl.load(nent_ptr + b), max_entries)
    mine = gl.cdiv(gl.maximum(gl.cdiv(n_b, _EPB) - p0, 0), step)
    Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [64, 128], Q_SL)
    raw_d = gl.allocate_shared_memory(gl.int32, [NS, 1, _EPB, 16], d_desc.layout)
    raw_s = gl.allocate_shared_memory(gl.int32, [NS, 1, _EPB], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()            # the barriers' initialisation before the copies use them
    bt_row = bt_ptr + b.to(gl.int64) * s_bt
    for i in gl.static_range(NS):   # the first NS pages in flight
        if i < mine:
            _issue(raw_d, raw_s, ready, d_desc, s_desc, i, _block(bt_row, p0 + i * step, max_blocks))

    ACC: gl.constexpr = _acc()
    Q_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    hq = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, Q_L)), 1)
    dq = gl.expand_dims(_perm(gl.arange(0, 128, layout=gl.SliceLayout(0, Q_L))), 0)
    q_s.store(gl.load(q_ptr + b * s_qb + hq * s_qh + dq).to(gl.bfloat16))      # columns in the keys' order
    fence_async_shared()            # q's generic-proxy stores before the MMAs' async-proxy reads
    _barrier()
    h = gl.arange(0, 64, layout=gl.SliceLayout(0, ACC))
    wts = gl.expand_dims(gl.load(w_ptr + b * s_wb + h).to(gl.float32) * w_scale, 0)
    rows = gl.arange(0, _EPB, layout=gl.SliceLayout(1, ACC))
    out_row = out_ptr + b.to(gl.int64) * s_ob
    qt = q_s.permute((1, 0))
    zero = gl.zeros([_EPB, 64], gl.float32, layout=ACC)
    for it in range(0, mine):
        keys, glob = _take(raw_d, raw_s, ready, d_desc, s_desc, bt_row, p0, step, it, mine, max_blocks, NS)
        acc = warpgroup_mma(keys, qt, zero, use_acc=False)
        _score(acc, wts, glob, out_row, (p0 + it * step) * _EPB + rows, n_b, max_entries, out_scale)
    # tiles past this request's entries: -inf only
    nt = gl.cdiv(n_b, _EPB)
    first = p0 + gl.cdiv(gl.maximum(nt - p0, 0), step) * step
    for tile in range(first, num_tiles, step):
        offs = tile * _EPB + rows
        gl.store(out_row + offs, gl.full([_EPB], float("-inf"), gl.float32, layout=gl.SliceLayout(1, ACC)),
                 mask=offs < max_entries)


def supported(q: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, fmt_name: str, epb: int, prec: int) -> bool:
    """Whether the TMA scan takes this call: mxfp4 keys at D_I = 128 and 64 heads, one
    bf16 dot (prec 1: queries rounded to mxfp4), 64 keys a page, pages whose key words and scale
    words the copies can address (16-byte aligned starts and page strides), an sm_90 GPU."""
    if not (GLUON_OK and fmt_name == "mxfp4" and prec == 1 and epb == EPB and q.is_cuda and q.shape[1:] == (64, 128)
            and torch.cuda.get_device_capability(q.device)[0] == 9):
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) == t.shape[2] and t.stride(2) == 1
               for t in (data, scale)) and data.shape[1:] == (EPB, 64) and scale.shape[1:] == (EPB, 4)


def _descriptors(data: torch.Tensor, scale: torch.Tensor) -> tuple[TensorDescriptor, TensorDescriptor]:
    """Copies of one page: its key words [1, 64, 16] int32 and its scale words [1, 64] int32."""
    nb = data.shape[0]
    words = torch.as_strided(data.view(torch.int32), (nb, EPB, 16), (data.stride(0) // 4, 16, 1))
    scales = torch.as_strided(scale.view(torch.int32), (nb, EPB), (scale.stride(0) // 4, 1))
    return (TensorDescriptor.from_tensor(words, [1, EPB, 16], _flat(3)),
            TensorDescriptor.from_tensor(scales, [1, EPB], _flat(2)))


def launch(q: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
           block_table: torch.Tensor, num_entries: torch.Tensor, max_entries: int, weight_scale: float,
           programs: int, *, stages: int = STAGES, maxnreg: int = MAXNREG):
    """Scores of q [B, 64, 128] (fp32 or bf16, rounded to mxfp4) into out [B, max_entries] fp32."""
    bsz = q.shape[0]
    tiles = triton.cdiv(max_entries, EPB)
    d_desc, s_desc = _descriptors(data, scale)
    return _scan_tma_kernel[(bsz, max(1, min(programs, tiles)))](
        q, weights, out, d_desc, s_desc, block_table, num_entries, q.stride(0), q.stride(1), weights.stride(0),
        out.stride(0), block_table.stride(0), tiles, max_entries, block_table.shape[1], 128 ** -0.5, weight_scale,
        NS=stages, num_warps=4, maxnreg=maxnreg)
