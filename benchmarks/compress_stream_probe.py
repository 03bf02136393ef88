"""Probe (CUDA only): can HCA's prefill compressor stream an 8K chunk faster through tensor-descriptor
(TMA) loads than through the default kernel's register loads?

    python benchmarks/compress_stream_probe.py [--variants G,K,BC,warps,stages ...]

One request, an 8K chunk from position 0 (64 full windows of 128 slots, nothing pending), V4-Flash
HCA widths (D 512, bf16 c / z, a bf16 position bias). Timed as `read_floor.py` times a read (the L2
flushed by a 256 MB read, CUDA events around the one kernel): the chunk's read floor, the default
compressor (`compress_update`), and stream variants: a program per (window, BC channels) walks its
window's 128 rows G rows a load, K loads an iteration (group g of the G takes rows g, g + G, ...:
the log-sum-exp merge is order-free), through Triton's pipelined descriptor loads. A variant's
optional sixth field: r (a plain read of the same tiles, no math), n (no position bias), p (pointer
loads instead of descriptors). H100 results: benchmarks/NOTES.md #198 (forty-eighth round).
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dsv4.kernels.compress_plan import make_plan
from dsv4.kernels.triton.compress import compress_update

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from read_floor import timed_us, triton_read

DEV = torch.device("cuda")
D, RATIO, CHUNK = 512, 128, 8192


@triton.jit
def _stream_kernel(c_desc, z_desc, c_ptr, z_ptr, stride_t, zb_ptr, out_ptr, row0,
                   D: tl.constexpr, RATIO: tl.constexpr, G: tl.constexpr, K: tl.constexpr, BC: tl.constexpr,
                   STAGES: tl.constexpr, MATH: tl.constexpr = True, BIAS: tl.constexpr = True,
                   PLAIN: tl.constexpr = False):
    ncb: tl.constexpr = D // BC
    e = tl.program_id(0) // ncb
    col0 = (tl.program_id(0) % ncb) * BC
    cols = col0 + tl.arange(0, BC)
    g = tl.arange(0, G)
    m = tl.full([G, BC], float("-inf"), tl.float32)
    s = tl.zeros([G, BC], tl.float32)
    a = tl.zeros([G, BC], tl.float32)
    base = row0 + e * RATIO
    for j in tl.range(0, RATIO, G * K, num_stages=STAGES):
        zs = ()
        cs = ()
        for k in tl.static_range(K):
            rows = (base + j + k * G + g)[:, None] * stride_t + cols[None, :]
            if PLAIN:   # the same tiles through pointer loads
                z = tl.load(z_ptr + rows).to(tl.float32)
                cl = tl.load(c_ptr + rows).to(tl.float32)
            else:
                z = z_desc.load([base + j + k * G, col0]).to(tl.float32)
                cl = c_desc.load([base + j + k * G, col0]).to(tl.float32)
            if BIAS:
                z += tl.load(zb_ptr + (j + k * G + g)[:, None] * D + cols[None, :]).to(tl.float32)
            zs = zs + (z,)
            cs = cs + (cl,)
        if MATH:
            m2 = m
            for k in tl.static_range(K):
                m2 = tl.maximum(m2, zs[k])
            keep = tl.exp(m - m2)
            s = s * keep
            a = a * keep
            for k in tl.static_range(K):
                p = tl.exp(zs[k] - m2)
                s += p
                a += cs[k] * p
            m = m2
        else:           # a plain read of the same bytes (this form's floor)
            for k in tl.static_range(K):
                a += zs[k] + cs[k]
            m = tl.zeros([G, BC], tl.float32)
            s = tl.full([G, BC], 1.0, tl.float32)
    mf = tl.max(m, axis=0)
    w = tl.exp(m - mf[None, :])
    tl.store(out_ptr + e * D + cols, tl.sum(a * w, axis=0) / tl.sum(s * w, axis=0))


def stream(c: torch.Tensor, z: torch.Tensor, zb: torch.Tensor, g: int, k: int, bc: int, warps: int,
           stages: int, flags: str = "") -> torch.Tensor:
    n = c.shape[0] // RATIO
    out = torch.empty(n, D, dtype=torch.float32, device=c.device)
    cd = TensorDescriptor.from_tensor(c, [g, bc])
    zd = TensorDescriptor.from_tensor(z, [g, bc])
    _stream_kernel[(n * (D // bc),)](cd, zd, c, z, c.stride(0), zb, out, 0, D=D, RATIO=RATIO, G=g, K=k, BC=bc,
                                     STAGES=stages, MATH="r" not in flags, BIAS="n" not in flags,
                                     PLAIN="p" in flags, num_warps=warps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="*", default=[
        "8,4,256,8,3", "8,4,256,8,4", "8,2,256,8,4", "16,2,256,8,3", "4,8,256,8,3",
        "8,4,128,4,4", "8,4,64,4,4", "8,4,64,4,4,n", "8,4,64,4,4,r", "8,4,128,4,4,r", "8,4,256,8,3,r",
        "8,4,64,2,4", "8,2,64,4,2", "8,4,64,4,1", "8,4,32,2,4", "16,2,64,4,4", "8,4,64,4,2,p", "8,4,32,4,2,p",
        "8,4,64,4,2,pr", "8,8,32,4,2,p", "16,4,32,4,2,p"])
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    c = torch.randn(CHUNK, D, device=DEV, generator=gen).to(torch.bfloat16)
    z = (2 * torch.randn(CHUNK, D, device=DEV, generator=gen)).to(torch.bfloat16)
    zb = torch.randn(RATIO, D, device=DEV, generator=gen).to(torch.bfloat16)
    slots = torch.zeros(1, dtype=torch.int64, device=DEV)
    state = torch.empty(1, 3, 1, D, dtype=torch.float32, device=DEV)
    plan = make_plan((0,), (CHUNK,), RATIO, False, DEV)     # planned once, as the manager does per forward

    def default() -> torch.Tensor:    # a chunk from position 0 leaves the state empty, as it found it
        return compress_update(c, z, state, slots, (0,), (CHUNK,), RATIO, False, z_bias=zb, plan=plan)[0]

    state[:, 0] = float("-inf")
    state[:, 1:] = 0
    ref = default()
    both = torch.cat([c, z], 1)
    print(f"{'variant':22} {'µs':>7} {'max |diff|':>11}")
    print(f"{'read floor (c, z)':22} {timed_us(lambda: triton_read(both)):7.2f}")
    us = timed_us(default)
    print(f"{'default compressor':22} {us:7.2f}")
    for v in args.variants:
        parts = v.split(",")
        g, k, bc, warps, stages = (int(x) for x in parts[:5])
        flags = parts[5] if len(parts) > 5 else ""
        if bc > 256:
            print(f"{v:22} skipped (a descriptor box is at most 256 wide)")
            continue
        try:
            out = stream(c, z, zb, g, k, bc, warps, stages, flags)
            diff = (out - ref).abs().max().item() if flags in ("", "p") else float("nan")
            us = timed_us(lambda g=g, k=k, bc=bc, warps=warps, stages=stages, flags=flags: stream(
                c, z, zb, g, k, bc, warps, stages, flags))
            print(f"{v:22} {us:7.2f} {diff:11.2e}")
        except Exception as exc:   # a variant that does not compile is a row, not the end of the probe
            print(f"{v:22} failed: {type(exc).__name__}: {str(exc)[:200]}")


if __name__ == "__main__":
    main()
