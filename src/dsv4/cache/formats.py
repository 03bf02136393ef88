"""Storage formats of cache entries: byte layout of an entry and of a page of entries.

An entry format is a tuple of *regions*. A page of P entries stores region 0 for all P
entries, then region 1 for all P entries, and so on, then zero padding up to a multiple of
region 0's size (the data-row size):

    fp8_ds, P entries (DeepSeek FlashMLA "MODEL1", also vLLM/SGLang):
    byte 0                      576·P                 584·P      padded to k·576
    | P × [448 e4m3 | 64 bf16]  | P × [7 ue8m0 | pad] | 0 ...   |
      region "kv"                 region "scale"

`encode(x)` turns float rows into one uint8 tensor per region; `decode(parts)` turns them
back. Pools, the window ring and the handle only move region bytes, so every format works
everywhere; kernels specialise on the format they know.

Non-finite inputs (quantised formats; bf16/fp32 store values as they are): NaN is stored
as 0, ±inf saturates to ± the largest magnitude of its scale group; scales are computed
from the finite values only, so a scale is never NaN or inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.errors import FormatError
from dsv4.kernels.reference import quant


@dataclass(frozen=True, kw_only=True, slots=True)
class Region:
    name: str
    bytes_per_entry: int


@dataclass(frozen=True, kw_only=True, slots=True)
class EntryFormat:
    """Layout and codec of one entry of `dim` channels.

    Main-entry formats keep the trailing `rope_dim` channels in bf16 (`fp8_ds`); indexer
    formats with `hadamard=True` store keys rotated by the normalised Hadamard matrix:
    `decode` returns them in that rotated basis and `to_stored_basis(q)` rotates queries to
    match, so `q·k` is unchanged (the rotation is orthogonal).
    """

    name: str
    dim: int
    rope_dim: int = 0
    hadamard: bool = False

    def __post_init__(self) -> None:
        _check_dims(self.name, self.dim, self.rope_dim)

    # -------------------------------------------------------------- layout
    @property
    def regions(self) -> tuple[Region, ...]:
        return _REGIONS[self.name](self.dim, self.rope_dim)

    @property
    def entry_bytes(self) -> int:
        """Bytes one entry occupies (data and scales, pad bytes included; page padding excluded)."""
        return sum(r.bytes_per_entry for r in self.regions)

    def region_offsets(self, entries: int) -> dict[str, int]:
        offsets, at = {}, 0
        for r in self.regions:
            offsets[r.name] = at
            at += r.bytes_per_entry * entries
        return offsets

    def page_bytes(self, entries: int) -> int:
        """Bytes of a page of `entries` entries, padded to a multiple of the data-row size."""
        raw = self.entry_bytes * entries
        row = self.regions[0].bytes_per_entry
        return -(-raw // row) * row

    def views(self, pages: torch.Tensor, entries: int) -> dict[str, torch.Tensor]:
        """Region views of a page buffer.

        Args:
            pages: [N, page_bytes(entries)] uint8.
        Returns:
            {region name: [N, entries, bytes_per_entry] uint8 view (no copy)}.
        """
        if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != self.page_bytes(entries):
            raise FormatError(
                f"{self.name} pages of {entries} entries must be uint8 [N, {self.page_bytes(entries)}], "
                f"got {pages.dtype} {list(pages.shape)}")
        off = self.region_offsets(entries)
        return {r.name: pages[:, off[r.name]: off[r.name] + entries * r.bytes_per_entry].view(
            pages.shape[0], entries, r.bytes_per_entry) for r in self.regions}

    def typed(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Typed views over region views (no copy), for kernels and inspection.

        fp8_ds: `nope` [..., D-r] float8_e4m3fn, `rope` [..., r] bfloat16, `scale` [..., tiles] uint8
        (UE8M0 exponent + 127). bf16/fp32: `kv` or `data` [..., D]. mxfp4: `data` packed E2M1
        uint8 [..., D/2], `scale` UE8M0 uint8 [..., D/32]. fp8: `data` e4m3 [..., D], `scale` fp32 [..., 1].
        nvfp4: `data` [..., D/2] uint8, `scale` e4m3 [..., D/16], `global` fp32 [..., 1].
        """
        n = self.dim - self.rope_dim
        if self.name == "fp8_ds":
            kv = views["kv"]
            return {"nope": kv[..., :n].view(torch.float8_e4m3fn), "rope": kv[..., n:].view(torch.bfloat16),
                    "scale": views["scale"][..., : n // 64]}
        dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "bf16_i": torch.bfloat16,
                  "fp32_i": torch.float32, "fp8": torch.float8_e4m3fn}
        if self.name in ("bf16", "fp32"):
            return {"kv": views["kv"].view(dtypes[self.name])}
        if self.name in ("bf16_i", "fp32_i"):
            return {"data": views["data"].view(dtypes[self.name])}
        if self.name == "fp8":
            return {"data": views["data"].view(torch.float8_e4m3fn), "scale": views["scale"].view(torch.float32)}
        if self.name == "nvfp4":
            return {"data": views["data"], "scale": views["scale"].view(torch.float8_e4m3fn),
                    "global": views["global"].view(torch.float32)}
        return dict(views)  # mxfp4: packed nibbles and UE8M0 bytes are already their own types

    # -------------------------------------------------------------- codec
    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """[N, dim] float -> {region: [N, bytes] uint8}."""
        if x.shape[-1] != self.dim:
            raise FormatError(f"{self.name} entries have {self.dim} channels, got {x.shape[-1]}")
        x = x.reshape(-1, self.dim)
        if self.hadamard:
            x = quant.fwht(x)
        return dict(zip((r.name for r in self.regions), _ENCODE[self.name](x, self.rope_dim)))

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """{region: [N, bytes] uint8} -> [N, dim] float32 (in the stored basis, see class doc)."""
        return _DECODE[self.name](*(parts[r.name] for r in self.regions), self.rope_dim)

    def to_stored_basis(self, q: torch.Tensor) -> torch.Tensor:
        """[..., dim] -> the basis `decode` returns keys in (identity unless `hadamard`)."""
        return quant.fwht(q) if self.hadamard else q

    def round_query(self, q: torch.Tensor) -> torch.Tensor:
        """Indexer queries [..., dim] in the stored basis -> fp32, rounded as keys of this format are
        (`quant.round_query`): what the scorer multiplies. fp32 keys leave them unrounded."""
        return quant.round_query(self.name, q)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)) with x's leading shape; what a reader of the cache sees."""
        shape = x.shape
        return self.decode(self.encode(x.reshape(-1, self.dim))).view(shape)


def _check_dims(name: str, dim: int, rope_dim: int) -> None:
    if name not in _REGIONS:
        raise FormatError(f"unknown format {name!r}; main formats: {MAIN_FORMATS}, indexer formats: {INDEXER_FORMATS}")
    if name == "fp8_ds" and ((dim - rope_dim) % 64 or dim <= rope_dim):
        raise FormatError(f"fp8_ds needs head_dim - rope_dim to be a positive multiple of 64, got {dim} - {rope_dim}")
    if name in ("mxfp4", "nvfp4") and dim % 32:
        raise FormatError(f"{name} needs an indexer head dim that is a multiple of 32, got {dim}")
    if name in ("mxfp4", "nvfp4", "fp8") and (dim & (dim - 1)):
        raise FormatError(f"{name} rotates keys by a Hadamard matrix: indexer head dim must be a power of two, "
                          f"got {dim}")


def _fp8_ds_regions(dim: int, rope: int) -> tuple[Region, ...]:
    nope = dim - rope
    tiles = nope // 64
    return (Region(name="kv", bytes_per_entry=nope + 2 * rope),         # e4m3 nope | bf16 rope
            Region(name="scale", bytes_per_entry=-(-tiles // 8) * 8))   # ue8m0 per 64 nope channels, padded


_REGIONS = {
    # main-entry formats
    "fp8_ds": _fp8_ds_regions,
    "bf16": lambda dim, rope: (Region(name="kv", bytes_per_entry=2 * dim),),
    "fp32": lambda dim, rope: (Region(name="kv", bytes_per_entry=4 * dim),),
    # indexer-key formats
    "mxfp4": lambda dim, rope: (Region(name="data", bytes_per_entry=dim // 2),
                                Region(name="scale", bytes_per_entry=dim // 32)),
    "fp8": lambda dim, rope: (Region(name="data", bytes_per_entry=dim), Region(name="scale", bytes_per_entry=4)),
    "nvfp4": lambda dim, rope: (Region(name="data", bytes_per_entry=dim // 2),
                                Region(name="scale", bytes_per_entry=dim // 16),
                                Region(name="global", bytes_per_entry=4)),
    "bf16_i": lambda dim, rope: (Region(name="data", bytes_per_entry=2 * dim),),
    "fp32_i": lambda dim, rope: (Region(name="data", bytes_per_entry=4 * dim),),
}
_ENCODE = {
    "fp8_ds": quant.fp8_ds_encode, "bf16": quant.bf16_encode, "fp32": quant.fp32_encode,
    "mxfp4": quant.mxfp4_encode, "fp8": quant.fp8_encode, "nvfp4": quant.nvfp4_encode,
    "bf16_i": quant.bf16_encode, "fp32_i": quant.fp32_encode,
}
_DECODE = {
    "fp8_ds": quant.fp8_ds_decode, "bf16": quant.bf16_decode, "fp32": quant.fp32_decode,
    "mxfp4": quant.mxfp4_decode, "fp8": quant.fp8_decode, "nvfp4": quant.nvfp4_decode,
    "bf16_i": quant.bf16_decode, "fp32_i": quant.fp32_decode,
}

MAIN_FORMATS = ("fp8_ds", "bf16", "fp32")
INDEXER_FORMATS = ("mxfp4", "fp8", "nvfp4", "bf16", "fp32")


def main_format(name: str, dim: int, rope_dim: int) -> EntryFormat:
    """The format of compressed entries and window entries (`kv_format`)."""
    if name not in MAIN_FORMATS:
        raise FormatError(f"kv_format={name!r} is not one of {MAIN_FORMATS}")
    return EntryFormat(name=name, dim=dim, rope_dim=rope_dim)


def indexer_format(name: str, dim: int) -> EntryFormat:
    """The format of lightning-indexer keys (`indexer_format`). Quantised ones are Hadamard-rotated."""
    if name not in INDEXER_FORMATS:
        raise FormatError(f"indexer_format={name!r} is not one of {INDEXER_FORMATS}")
    internal = {"bf16": "bf16_i", "fp32": "fp32_i"}.get(name, name)
    return EntryFormat(name=internal, dim=dim, hadamard=internal in ("mxfp4", "fp8", "nvfp4"))
