"""Triton gather/dequantise of cache rows, used by prefill (twins of the reference gathers).

Only the row decode is a kernel (`read_rows`): locating rows through block tables and ordering
the window ring are index arithmetic shared with the reference, so both paths read exactly the
same rows.

    fp8_ds row:  kv   [ nope e4m3 (D-r B) | rope bf16 (2r B) ]   scale [ ue8m0 per 64 nope ]
                 value = e4m3 * 2^(byte - 127)  (exact),  rope as stored
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.cache.formats import EntryFormat
from dsv4.errors import FormatError
from dsv4.kernels.reference import cache_ops as ref

Views = dict[str, torch.Tensor]


@triton.jit
def _read_fp8_ds_kernel(kv_ptr, scale_ptr, page_ptr, slot_ptr, out_ptr, n_rows,
                        stride_kp, stride_ks, stride_sp, stride_ss,
                        NOPE: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    page = tl.load(page_ptr + r, mask=rmask, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + r, mask=rmask, other=0).to(tl.int64)
    kv_row = kv_ptr + page * stride_kp + slot * stride_ks
    out_row = out_ptr + r.to(tl.int64) * (NOPE + ROPE)
    ch = tl.arange(0, 64)
    for tile in tl.static_range(NOPE // 64):   # one UE8M0 scale per 64 nope channels
        q = tl.load(kv_row[:, None] + tile * 64 + ch[None, :], mask=rmask[:, None], other=0)
        x = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        sc = tl.load(scale_ptr + page * stride_sp + slot * stride_ss + tile, mask=rmask, other=127)
        x = x * tl.exp2(sc.to(tl.float32) - 127.0)[:, None]
        tl.store(out_row[:, None] + tile * 64 + ch[None, :], x, mask=rmask[:, None])
    rc = tl.arange(0, ROPE)
    lo = tl.load(kv_row[:, None] + NOPE + 2 * rc[None, :], mask=rmask[:, None], other=0).to(tl.uint16)
    hi = tl.load(kv_row[:, None] + NOPE + 2 * rc[None, :] + 1, mask=rmask[:, None], other=0).to(tl.uint16)
    rope = (lo | (hi << 8)).to(tl.bfloat16, bitcast=True).to(tl.float32)
    tl.store(out_row[:, None] + NOPE + rc[None, :], rope, mask=rmask[:, None])


def read_rows(views: Views, fmt: EntryFormat, pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Decode the rows at (pages, slots) -> float32 [*S, D].

    fp8_ds is a Triton kernel; bf16/fp32 are plain typed gathers (no arithmetic to fuse). Indexer
    formats (mxfp4, fp8, nvfp4) decode with the reference codec: prefill reads them once per
    chunk, while the hot decode scan reads them inside the Triton scoring kernel.
    """
    shape = pages.shape
    pages, slots = pages.reshape(-1), slots.reshape(-1)
    if fmt.name == "fp8_ds":
        n = pages.numel()
        out = torch.empty(n, fmt.dim, dtype=torch.float32, device=pages.device)
        if n:
            kv, sc = views["kv"], views["scale"]
            block_r = 16
            _read_fp8_ds_kernel[(triton.cdiv(n, block_r),)](
                kv, sc, pages.to(torch.int32).contiguous(), slots.to(torch.int32).contiguous(), out, n,
                kv.stride(0), kv.stride(1), sc.stride(0), sc.stride(1),
                NOPE=fmt.dim - fmt.rope_dim, ROPE=fmt.rope_dim, BLOCK_R=block_r)
        return out.view(*shape, fmt.dim)
    if fmt.name in ("bf16", "fp32", "bf16_i", "fp32_i"):
        typed = next(iter(fmt.typed(views).values()))                  # [N, P, D]
        return typed[pages.long(), slots.long()].float().view(*shape, fmt.dim)
    if fmt.name in ("mxfp4", "fp8", "nvfp4"):
        return ref.read_rows(views, fmt, pages, slots).view(*shape, fmt.dim)
    raise FormatError(f"no row decoder for format {fmt.name}")


def gather_window(swa: Views, fmt: EntryFormat, swa_pos: torch.Tensor, request_slots: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as the reference `gather_window`."""
    slots = request_slots.long()
    pos = swa_pos[slots]
    order = torch.argsort(pos, dim=1, stable=True)
    pos = torch.gather(pos, 1, order)
    kv = read_rows(swa, fmt, slots[:, None].expand_as(order), order)
    valid = pos >= 0
    return kv.masked_fill(~valid[..., None], 0.0), pos, valid


def gather_entries(views: Views, fmt: EntryFormat, indices: torch.Tensor, token_request: torch.Tensor,
                   block_table: torch.Tensor, epb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the reference `gather_entries`."""
    valid = indices >= 0
    block, row = ref._locate(block_table, token_request[:, None].expand_as(indices), indices, epb, valid)
    return read_rows(views, fmt, block, row).masked_fill(~valid[..., None], 0.0), valid


def gather_all_entries(views: Views, fmt: EntryFormat, num_entries: torch.Tensor, max_entries: int,
                       block_table: torch.Tensor, epb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the reference `gather_all_entries`."""
    b = num_entries.shape[0]
    idx = torch.arange(max_entries, device=num_entries.device)[None, :].expand(b, -1)
    valid = idx < num_entries[:, None]
    req = torch.arange(b, device=num_entries.device)[:, None].expand_as(idx)
    block, row = ref._locate(block_table, req, idx, epb, valid)
    return read_rows(views, fmt, block, row).masked_fill(~valid[..., None], 0.0), valid
