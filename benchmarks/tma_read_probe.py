"""Probe (CUDA only): how fast can one 8K prefill chunk's HCA compressor inputs (c, z: bf16 [8192, 512]
each, 16.8 MB) be read cold through TMA copies that keep a program's whole share in flight?

    python benchmarks/tma_read_probe.py [--variants R,NS,P,W,F ...]

Timed as `read_floor.py` times a read (the L2 flushed by a 256 MB read, CUDA events around one
kernel). A variant: boxes of R rows x 256 channels (c and z alike), NS of them in flight a program,
P programs (program p takes a contiguous run of boxes: row block, then c / z, then channel half,
so P = 64 is one HCA entry's window a program), W warps, F = 1: every box read back from shared
memory into registers 16 rows at a time (what a compressor must do), 0: one row of it.
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from read_floor import timed_us, triton_read

from dsv4.kernels.triton.decode_attention_wide import _barrier

DEV = torch.device("cuda")
ROWS, D = 8192, 512


@gluon.jit
def _issue(c_desc, z_desc, buf, ready, s, item, BOX_R: gl.constexpr):
    rb = item // 4
    cb = item % 2
    mbarrier.expect(ready.index(s), BOX_R * 256 * 2)
    if (item // 2) % 2 == 0:
        tma.async_copy_global_to_shared(c_desc, [rb * BOX_R, cb * 256], ready.index(s), buf.index(s))
    else:
        tma.async_copy_global_to_shared(z_desc, [rb * BOX_R, cb * 256], ready.index(s), buf.index(s))


@gluon.jit
def _tma_read_kernel(c_desc, z_desc, out_ptr, n_items, BOX_R: gl.constexpr, NS: gl.constexpr,
                     FULL: gl.constexpr, num_warps: gl.constexpr):
    p = gl.program_id(0)
    npr = gl.num_programs(0)
    lo = p * n_items // npr
    hi = (p + 1) * n_items // npr
    buf = gl.allocate_shared_memory(gl.bfloat16, [NS, BOX_R, 256], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()
    for i in gl.static_range(NS):
        if lo + i < hi:
            _issue(c_desc, z_desc, buf, ready, i, lo + i, BOX_R)
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    acc = gl.zeros([16, 256], gl.float32, L)
    for it in range(0, hi - lo):
        s = it % NS
        mbarrier.wait(ready.index(s), (it // NS) & 1)
        if FULL:
            for r in gl.static_range(0, BOX_R, 16):
                acc += buf.index(s).slice(r, 16).load(L).to(gl.float32)
        else:
            acc += buf.index(s).slice(0, 16).load(L).to(gl.float32)
        _barrier()
        if lo + it + NS < hi:
            _issue(c_desc, z_desc, buf, ready, s, lo + it + NS, BOX_R)
    gl.store(out_ptr + p, gl.sum(gl.sum(acc, 1), 0))


def tma_read(c: torch.Tensor, z: torch.Tensor, box_r: int, ns: int, programs: int, warps: int, full: bool):
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    cd = TensorDescriptor.from_tensor(c, [box_r, 256], layout)
    zd = TensorDescriptor.from_tensor(z, [box_r, 256], layout)
    out = torch.empty(programs, dtype=torch.float32, device=c.device)
    n_items = (c.shape[0] // box_r) * 4
    _tma_read_kernel[(programs,)](cd, zd, out, n_items, BOX_R=box_r, NS=ns, FULL=full, num_warps=warps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="*", default=["64,3,64,4,1", "128,1,128,4,1", "64,2,128,4,1",
                                                      "64,3,132,4,1", "32,6,132,4,1", "64,3,64,4,0",
                                                      "64,2,128,4,0", "32,4,256,4,1", "64,3,128,8,1",
                                                      "64,6,64,4,1", "128,3,64,4,1", "64,6,64,4,0"])
    args = ap.parse_args()
    c = torch.randn(ROWS, D, device=DEV).to(torch.bfloat16)
    z = torch.randn(ROWS, D, device=DEV).to(torch.bfloat16)
    both = torch.cat([c, z], 1)
    ref = (c.float().sum() + z.float().sum()).item()
    print(f"one 8K chunk, c and z {2 * c.numel() * 2 / 1e6:.1f} MB, cold L2, µs (median of 60)")
    print(f"triton register read  {timed_us(lambda: triton_read(both)):7.2f}")
    print(f"torch sum             {timed_us(lambda: both.sum()):7.2f}")
    for v in args.variants:
        r, ns, p, w, f = (int(x) for x in v.split(","))
        fn = lambda r=r, ns=ns, p=p, w=w, f=f: tma_read(c, z, r, ns, p, w, bool(f))     # noqa: E731
        got = fn().sum().item()
        ok = abs(got - ref) < 1e-3 * abs(ref) + 10 if f else ""
        print(f"tma {v:16s}      {timed_us(fn):7.2f}  {'sum ok' if ok is True else ok}")


if __name__ == "__main__":
    main()
