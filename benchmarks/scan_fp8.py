"""The indexer scan on FP8 tensor cores against the bf16 scan (`indexer_scan_fp8`, `indexer_scan`).

    python benchmarks/scan_fp8.py [--contexts 131072] [--batches 1,64] [--warps 4] [--block-n 64]

Per (context, batch), on the bench's cache (mxfp4 keys) and queries rounded as the layer rounds
them: the largest difference between the two scans' scores relative to the largest score, the
same with one query head whose first scale group lies 2^20 below the others (the fp8 kernel's
fallback), and each scan's time (CUDA-graph replays, L2 flushed before each, as tune_decode times).
"""

from __future__ import annotations

import argparse
import sys

import torch
from tune_common import graph_us

from dsv4.bench import setup as bench_setup
from dsv4.bench.common import LAYER_INDEX, bench_config
from dsv4.kernels.triton import indexer_scores as sc
from dsv4.kernels.triton.decode_common import COMPILE_INFO


def diff(a: torch.Tensor, b: torch.Tensor) -> str:
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb):
        return "finite entries differ"
    d = (a[fa] - b[fa]).abs().max().item() / a[fa].abs().max().item()
    return f"{d:.2e} (bit-identical {torch.equal(a, b)})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="131072")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--block-n", type=int, default=64)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("scan_fp8: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    cfg, tpb = bench_config(False)
    block = bench_setup.make_block(cfg, LAYER_INDEX["csa"], dev)
    idx = block.compressor.indexer
    with torch.no_grad():
        for ctx in (int(x) for x in a.contexts.split(",")):
            for bsz in (int(x) for x in a.batches.split(",")):
                st = bench_setup.build_decode_state(cfg, context=ctx, batch=bsz, device=dev, tokens_per_block=tpb,
                                                    kv_format="fp8_ds", indexer_format="mxfp4", seed=0)
                mgr, b = st.mgr, st.batch
                li = LAYER_INDEX["csa"]
                sch, pool = mgr.schemas[li], mgr.paged[li]
                ifmt = sch.indexer_format
                gen = torch.Generator(device=dev).manual_seed(1)
                raw = ifmt.to_stored_basis(torch.randn(bsz, idx.heads, idx.dim, device=dev, generator=gen))
                g = torch.randn(bsz, idx.heads, device=dev, generator=gen)
                nent, nmax = b.seq_lens // sch.compress_ratio, b.seq_len_bound // sch.compress_ratio
                wide = raw.clone()
                wide[:, 3, :32] *= 2.0 ** -20
                kw = dict(num_warps=a.warps, block_n=a.block_n)
                for label, q in (("one head 2^20 apart", ifmt.round_query(wide)), ("queries", ifmt.round_query(raw))):
                    args = (q, g, pool.indexer, ifmt, b.block_table, nent, nmax, sch.entries_per_block)
                    base = sc.paged_indexer_scores(*args, **kw)
                    out8 = sc.paged_indexer_scores(*args, fp8=True, **kw)
                    print(f"C={ctx // 1024}K B={bsz} {label}: fp8 vs bf16 scan {diff(base, out8)} "
                          f"({COMPILE_INFO.get('indexer_scores')})", flush=True)
                t16 = graph_us(lambda args=args, kw=kw: sc.paged_indexer_scores(*args, **kw))
                t8 = graph_us(lambda args=args, kw=kw: sc.paged_indexer_scores(*args, fp8=True, **kw))
                print(f"C={ctx // 1024}K B={bsz}: bf16 scan {t16:.1f} us, fp8 scan {t8:.1f} us "
                      f"(x{t16 / t8:.2f})", flush=True)
                for mr in (112, 96, 80):
                    for per in (None, 8, 33, 66):
                        o = sc.paged_indexer_scores(*args, maxnreg=mr, num_programs=per, **kw)
                        t = graph_us(lambda args=args, kw=kw, mr=mr, per=per: sc.paged_indexer_scores(
                            *args, maxnreg=mr, num_programs=per, **kw))
                        print(f"C={ctx // 1024}K B={bsz}: bf16 scan maxnreg {mr} programs/request {per}: {t:.1f} us "
                              f"(x{t16 / t:.2f}; {COMPILE_INFO.get('indexer_scores')}; same {torch.equal(o, base)})",
                              flush=True)
                del st, mgr
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
