"""Reference cache reads and writes: scatter/gather of encoded rows, the window ring.

These are the spec for the Triton twins (same signatures, byte-identical writes). They are
vectorised over the batch and run on CPU and GPU. Region views are {name: [N, P, bytes] uint8}
as returned by `EntryFormat.views`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsv4.cache.formats import EntryFormat
from dsv4.errors import FormatError
from dsv4.kernels.reference.norm_rope import EntryFinish, finish_entries

Views = dict[str, torch.Tensor]


class EntryWrite(NamedTuple):
    """Where `compress_decode(write=)` stores the entries its tokens finish: `write_entries`'s
    arguments but the rows and their (request, index), which the compressor knows."""
    views: Views
    fmt: EntryFormat
    block_table: torch.Tensor
    epb: int
    finish: EntryFinish | None = None


def write_rows(views: Views, fmt: EntryFormat, rows: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor) -> None:
    """Encode rows [E, D] and store row e at (pages[e], slots[e]). pages/slots: [E] int."""
    if rows.shape[0] == 0:  # a step that finishes no entry (a shape, not a device value)
        return
    parts = fmt.encode(rows)
    pages, slots = pages.long(), slots.long()
    for name, v in views.items():
        v[pages, slots] = parts[name]


def read_rows(views: Views, fmt: EntryFormat, pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Decode the rows at (pages, slots) (any equal shapes S) -> float32 [*S, D]."""
    pages, slots = pages.long(), slots.long()
    if pages.numel() == 0:
        return torch.zeros(*pages.shape, fmt.dim, device=pages.device)
    parts = {name: v[pages, slots].reshape(-1, v.shape[-1]) for name, v in views.items()}
    return fmt.decode(parts).view(*pages.shape, fmt.dim)


# ---------------------------------------------------------------------- window ring
def roundtrip_rows(x: torch.Tensor, fmt: EntryFormat, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """decode(encode(x)) of rows x [N, D] (any float dtype) in main-entry format fmt: what a reader of
    the cache sees of them (`EntryFormat.roundtrip`), in out_dtype (default fp32; bf16 holds fp8_ds
    and bf16 rows exactly, so it is refused only for fp32 rows)."""
    return fmt.roundtrip(x.float()).to(roundtrip_dtype(fmt, out_dtype))


def roundtrip_dtype(fmt: EntryFormat, out_dtype: torch.dtype | None) -> torch.dtype:
    """`roundtrip_rows`' output dtype, checked: fp32 (the default), or bf16 for fp8_ds / bf16 rows."""
    out_dtype = out_dtype or torch.float32
    if fmt.name not in ("fp8_ds", "bf16", "fp32"):
        raise FormatError(f"roundtrip_rows reads main-entry formats, not {fmt.name!r}")
    if out_dtype not in (torch.float32, torch.bfloat16) or (out_dtype == torch.bfloat16 and fmt.name == "fp32"):
        raise FormatError(f"{fmt.name} rows round-trip exactly to fp32{'' if fmt.name == 'fp32' else ' or bf16'}, "
                          f"not {out_dtype}")
    return out_dtype


def append_window(swa: Views, fmt: EntryFormat, swa_pos: torch.Tensor, swa_head: torch.Tensor, kv: torch.Tensor,
                  positions: torch.Tensor, token_request: torch.Tensor, request_slots: torch.Tensor,
                  seq_lens: torch.Tensor) -> None:
    """Write each new token's kv into its request's ring, row = position % W.

    Only the last W tokens of each request can still be in the window, so only they are
    written: two tokens W apart map to the same row, and writing both would race.

    Args:
        swa: ring region views {name: [R, W, bytes]}; swa_pos [R, W] int32; swa_head [R] int32.
        kv: [T, D] new tokens' kv (after norm and RoPE).
        positions, token_request: [T] int32; request_slots, seq_lens: [B] int32.
    """
    w = swa_pos.shape[1]
    keep = positions >= (seq_lens[token_request.long()] - w)
    slot = request_slots[token_request.long()][keep].long()
    pos = positions[keep]
    row = (pos % w).long()
    write_rows(swa, fmt, kv[keep], slot, row)
    swa_pos[slot, row] = pos
    swa_head[request_slots.long()] = seq_lens


def gather_window(swa: Views, fmt: EntryFormat, swa_pos: torch.Tensor, request_slots: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ring of each request in position order.

    Returns:
        kv [B, W, D] float32, positions [B, W] int32 (-1 where empty), valid [B, W] bool.
        Empty rows come first; their kv is 0.
    """
    slots = request_slots.long()
    pos = swa_pos[slots]                                   # [B, W]
    order = torch.argsort(pos, dim=1, stable=True)
    pos = torch.gather(pos, 1, order)
    kv = read_rows(swa, fmt, slots[:, None].expand_as(order), order)
    valid = pos >= 0
    return kv.masked_fill(~valid[..., None], 0.0), pos, valid


# ---------------------------------------------------------------------- paged entries
def _locate(block_table: torch.Tensor, req: torch.Tensor, entry: torch.Tensor, epb: int, valid: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, entry index) -> (physical block, row); invalid ones go to the null block 0."""
    e = entry.clamp(min=0).long()
    col = e // epb
    inside = col < block_table.shape[1]          # past the table: padding, never a live block
    block = block_table[req.long(), col.clamp(max=block_table.shape[1] - 1)].long()
    ok = valid & inside & (block >= 0)
    return torch.where(ok, block, torch.zeros_like(block)), torch.where(ok, e % epb, torch.zeros_like(e))


def write_entries(views: Views, fmt: EntryFormat, rows: torch.Tensor, entry_request: torch.Tensor,
                  entry_index: torch.Tensor, block_table: torch.Tensor, epb: int,
                  finish: EntryFinish | None = None) -> None:
    """Scatter finished entries rows [E, D] of (batch request, entry index) into their blocks;
    with `finish`, rows are the compressor's raw entries and get RMSNorm + RoPE first."""
    if finish is not None:
        rows = finish_entries(rows, entry_index, finish)
    valid = entry_index >= 0
    block, row = _locate(block_table, entry_request, entry_index, epb, valid)
    write_rows(views, fmt, rows, block, row)


def gather_entries(views: Views, fmt: EntryFormat, indices: torch.Tensor, token_request: torch.Tensor,
                   block_table: torch.Tensor, epb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token selected entries.

    Args:
        indices: [T, k] entry indices per query token, -1 = masked.
        token_request: [T] batch index of each token.
    Returns:
        kv [T, k, D] float32 (0 where masked), valid [T, k] bool.
    """
    valid = indices >= 0
    req = token_request[:, None].expand_as(indices)
    block, row = _locate(block_table, req, indices, epb, valid)
    kv = read_rows(views, fmt, block, row)
    return kv.masked_fill(~valid[..., None], 0.0), valid


def gather_all_entries(views: Views, fmt: EntryFormat, num_entries: torch.Tensor, max_entries: int,
                       block_table: torch.Tensor, epb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finished entry of each request.

    Args:
        num_entries: [B] finished entries per request; max_entries: host bound on them.
    Returns:
        kv [B, max_entries, D] float32 (0 past num_entries), valid [B, max_entries] bool.
    """
    b = num_entries.shape[0]
    idx = torch.arange(max_entries, device=num_entries.device)[None, :].expand(b, -1)
    valid = idx < num_entries[:, None]
    req = torch.arange(b, device=num_entries.device)[:, None].expand_as(idx)
    block, row = _locate(block_table, req, idx, epb, valid)
    kv = read_rows(views, fmt, block, row)
    return kv.masked_fill(~valid[..., None], 0.0), valid
