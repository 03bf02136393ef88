"""Launch table of the Triton prefill compressor (`kernels.triton.compress`), planned on the host.

The table depends only on the batch (each request's first new position and token count) and on
the compressor kind (ratio m, overlap), not on the layer: `KVCacheManager.prepare_forward` builds
one per kind of the model and copies it with the rest of the batch's metadata, so a prefill chunk
runs every layer's compressors without a host-to-device copy of its own. Pure Python: the
manager imports it without Triton.

Request b (new tokens at positions [p0, p0 + n)) touches entries first = p0//m .. end + npend - 1
(end = (p0+n)//m, npend = 2 with overlap, else 1), one segment each; those below `end` finish and
are rows fin_base[b] + (w - first) of the kernel's `entries`; its tokens start at row tok0[b] of
c and z. Its first and last npend segments go to its boundary program; the ones between (middle
segments) are numbered from mid_base[b]. Table rows: mid_base (B + 1 values), first, end,
fin_base, tok0, p0, p1: 7 B + 1 int32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class CompressPlan:
    """The table of one batch for one compressor kind, on the device, with its host-side sizes."""

    ratio: int
    overlap: bool
    start_positions: tuple[int, ...]     # what the table was planned from (checked at launch)
    query_lens: tuple[int, ...]
    table: torch.Tensor                  # [7 B + 1] int32
    num_middle: int                      # middle segments (programs are cut from them)
    num_finished: int                    # entries this step finishes (rows of `entries`)

    def matches(self, start_positions: tuple[int, ...], query_lens: tuple[int, ...], ratio: int,
                overlap: bool) -> bool:
        return (self.ratio, self.overlap, self.start_positions, self.query_lens) == (
            ratio, overlap, tuple(start_positions), tuple(query_lens))


def plan_ints(start_positions: tuple[int, ...], query_lens: tuple[int, ...], ratio: int, overlap: bool
              ) -> tuple[list[int], int, int]:
    """The table's ints (7 B + 1), the number of middle segments and of finished entries."""
    npend = 2 if overlap else 1
    mid_base, first, end, fin_base, tok0, p1 = [0], [], [], [], [], []
    nfin = ntok = 0
    for p0, n in zip(start_positions, query_lens):
        f, e = p0 // ratio, (p0 + n) // ratio
        first.append(f)
        end.append(e)
        fin_base.append(nfin)
        tok0.append(ntok)
        p1.append(p0 + n)
        mid_base.append(mid_base[-1] + max(e - f - npend, 0))          # nseg = e + npend - f, minus 2 npend
        nfin += e - f
        ntok += n
    return mid_base + first + end + fin_base + tok0 + list(start_positions) + p1, mid_base[-1], nfin


def make_plan(start_positions: tuple[int, ...], query_lens: tuple[int, ...], ratio: int, overlap: bool,
              device: torch.device | str) -> CompressPlan:
    """A plan with its own table copy (one pinned asynchronous host-to-device copy on CUDA)."""
    ints, n_mid, n_fin = plan_ints(start_positions, query_lens, ratio, overlap)
    dev = torch.device(device)
    host = torch.tensor(ints, dtype=torch.int32, device="cpu", pin_memory=dev.type == "cuda")
    table = host.to(dev, non_blocking=True)
    return CompressPlan(ratio, overlap, tuple(start_positions), tuple(query_lens), table, n_mid, n_fin)
