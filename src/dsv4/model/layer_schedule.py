"""Which attention each layer runs: SWA-only, CSA (4x + indexer) or HCA (128x, dense)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class AttentionType(str, enum.Enum):
    SWA = "swa"  # sliding window only (compress ratio 0)
    CSA = "csa"  # compressed sparse attention: ratio m, lightning indexer, top-k
    HCA = "hca"  # heavily compressed attention: ratio m', dense over all entries


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerSpec:
    """One layer's attention type and compression ratio (0 for SWA-only)."""

    layer_idx: int
    attn: AttentionType
    compress_ratio: int

    @property
    def is_compressed(self) -> bool:
        return self.attn is not AttentionType.SWA

    @property
    def has_indexer(self) -> bool:
        return self.attn is AttentionType.CSA
