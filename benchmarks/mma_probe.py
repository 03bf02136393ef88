"""Does a warpgroup MMA overlap other warps' ALU work on an SM? (CUDA, sm_90; Gluon)

    python benchmarks/mma_probe.py

One warpgroup a program, 4 programs an SM, `iters` iterations of ALU work (a chain of ALU
instructions of one kind, `OPS`, on each of 16 elements a thread) and / or 8 MMAs m64n64k16 bf16
(S^T [64, 64] = K [64, 128] . q^T, the indexer scan's tile) with K from registers (RS) or from
shared memory (SS), the result folded into a running sum. MODE: 0 ALU only, 1 ALU then RS MMA,
2 RS MMA only, 3 ALU then SS MMA, 4 SS MMA only, 5 the ALU work between an asynchronous RS MMA's
issue and its wait, 6 as 1 with odd programs running the MMA first (programs out of phase).
If the MMA and the ALU work overlap, time(1) ~ max(time(0), time(2)); if not, ~ the sum; the
ratios to both are printed (benchmarks/NOTES.md, #140).
"""
from __future__ import annotations

import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier


@gluon.constexpr_function
def _acc():
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])


#: ALU instructions by pipe: integer multiply-add (IMAD), logic (LOP3), shift (SHF), fp32 FMA (FFMA),
#: bf16x2 multiply (HMUL2), fp32 max (FMNMX)
OPS = {"IMAD": "mad.lo.u32 $0, $0, 3, $2;", "LOP3": "lop3.b32 $0, $0, $2, $1, 0x96;\nlop3.b32 $0, $0, $1, $2, 0xe8;",
       "IADD3": "add.u32 $0, $0, $2;\nxor.b32 $0, $0, $1;", "PRMT": "prmt.b32 $0, $0, $2, $1;",
       "SHF": "shf.l.wrap.b32 $0, $0, $2, 3;",
       "FFMA": "fma.rn.f32 $0, $0, $2, $2;", "HMUL2": "mul.rn.bf16x2 $0, $0, $2;", "FMNMX": "max.f32 $0, $0, $2;"}


def _alu_asm(n, op="IMAD"):
    return "{\nmov.b32 $0, $1;\n" + "".join(OPS[op] + "\n" for _ in range(n)) + "}"


@gluon.jit
def _probe(out_ptr, iters, MODE: gl.constexpr, ALU_ASM: gl.constexpr):
    ACC: gl.constexpr = _acc()
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [64, 128], Q_SL)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [64, 128], Q_SL)
    L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, L)), 1)
    c = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, L)), 0)
    vals = ((r * 7 + c * 3) % 11).to(gl.float32) * 0.125 - 0.5
    q_s.store(vals.to(gl.bfloat16))
    k_s.store((vals * 0.5).to(gl.bfloat16))
    fence_async_shared()
    _barrier()
    keys = gl.convert_layout((vals * 0.25).to(gl.bfloat16), A_L)
    qt = q_s.permute((1, 0))
    zero = gl.zeros([64, 64], gl.float32, layout=ACC)
    run = gl.zeros([64, 64], gl.float32, layout=ACC)
    IL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    x = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, IL)), 1) * 32 + \
        gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, IL)), 0) + gl.program_id(0)
    for it in range(iters):
        if MODE == 5:                     # RS MMA in flight while the same warps run the ALU work
            tok = warpgroup_mma(keys, qt, zero, use_acc=False, is_async=True)
            # not pure: kept between the MMA's issue and its wait
            x = gl.inline_asm_elementwise(ALU_ASM, "=r,r,r", [x, x + it], dtype=gl.int32, is_pure=False, pack=1)
            acc, _ = warpgroup_mma_wait(0, deps=[tok, keys])
            run = run + acc
        if MODE == 6 and gl.program_id(0) % 2 == 1:     # odd programs: the MMA first (programs out of phase)
            acc = warpgroup_mma(keys, qt, zero, use_acc=False)
            run = run + acc
        if MODE != 2 and MODE != 4 and MODE != 5:       # ALU work
            x = gl.inline_asm_elementwise(ALU_ASM, "=r,r,r", [x, x + it], dtype=gl.int32, is_pure=True, pack=1)
        if MODE == 1 or MODE == 2 or (MODE == 6 and gl.program_id(0) % 2 == 0):        # RS MMA
            acc = warpgroup_mma(keys, qt, zero, use_acc=False)
            run = run + acc
        if MODE == 3 or MODE == 4:        # SS MMA
            acc = warpgroup_mma(k_s, qt, zero, use_acc=False)
            run = run + acc
    tot = gl.sum(gl.sum(run, axis=1), axis=0) + gl.sum(gl.sum(x.to(gl.float32), axis=1), axis=0)
    gl.store(out_ptr + gl.program_id(0), tot)


def time_mode(mode: int, alu: int, iters: int, per_sm: int, op: str = "IMAD") -> float:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(per_sm * sms, device="cuda")
    asm = gl.constexpr(_alu_asm(alu, op))

    def go():
        _probe[(per_sm * sms,)](out, iters, MODE=mode, ALU_ASM=asm, num_warps=4, maxnreg=128)
    go()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench(go, warmup=5, rep=30, return_mode="median")


def main() -> int:
    iters = 2000
    names = {0: "ALU only", 1: "ALU + RS MMA", 2: "RS MMA only", 3: "ALU + SS MMA", 4: "SS MMA only"}
    print(torch.cuda.get_device_name(0))
    for per_sm in (4,):
        for alu in (8,):
            t = {m: time_mode(m, alu, iters, per_sm) for m in names}
            print(f"{per_sm} programs an SM, ALU {alu} x 16 IMAD a thread an iteration, {iters} iterations: "
                  + ", ".join(f"{names[m]} {t[m]:.1f}" for m in names) + " µs")
            flop = per_sm * torch.cuda.get_device_properties(0).multi_processor_count * iters * 64 * 64 * 128 * 2
            print(f"   MMA only: RS {flop / t[2] / 1e6:.0f} TFLOP/s, SS {flop / t[4] / 1e6:.0f} TFLOP/s;"
                  f" ALU+RS / (ALU + RS) {t[1] / (t[0] + t[2]):.2f}, / max {t[1] / max(t[0], t[2]):.2f};"
                  f" ALU+SS / (ALU + SS) {t[3] / (t[0] + t[4]):.2f}, / max {t[3] / max(t[0], t[4]):.2f}")
    for op in OPS:
        t = {m: time_mode(m, 12, iters, 4, op) for m in (0, 1, 2, 5, 6)}
        print(f"4 programs an SM, {op} 12 x 16 a thread an iteration: ALU only {t[0]:.1f}, ALU + RS MMA "
              f"{t[1]:.1f}, RS MMA only {t[2]:.1f}, ALU under an async RS MMA {t[5]:.1f} µs: "
              f"/ (ALU + MMA) {' / '.join(f'{t[m] / (t[0] + t[2]):.2f}' for m in (1, 5, 6))}, "
              f"/ max {' / '.join(f'{t[m] / max(t[0], t[2]):.2f}' for m in (1, 5, 6))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
