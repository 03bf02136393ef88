"""DSV4 attention on the paged cache: compressor, indexer and the sub-block of one layer."""

from dsv4.attention.sub_block import AttentionSubBlock

__all__ = ["AttentionSubBlock"]
