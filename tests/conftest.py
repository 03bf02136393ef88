"""Shared fixtures: small DSV4 configs that keep every layer type and boundary cheap on CPU."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter; it must be chosen before
# triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))  # tests import their helpers (hf_oracle, ...) by name

from dsv4 import DSV4Config


def tiny_config(**over) -> DSV4Config:
    """All three layer types, a window of 16, m=4, m'=16: boundaries come every few tokens.

    Layers: 0 SWA, 1 CSA, 2 HCA. head_dim 128 = 64 nope (one FP8 tile) + 64 rope.
    """
    fields = dict(
        name="tiny", num_hidden_layers=3, hidden_size=64, num_attention_heads=4, q_lora_rank=32,
        o_groups=2, o_lora_rank=16, index_topk=6, compress_ratios=(0, 4, 16), head_dim=128,
        rope_dim=64, sliding_window=16, csa_compression_ratio=4, hca_compression_ratio=16,
        index_n_heads=16, indexer_head_dim=64, max_position_embeddings=4096,
    )
    fields.update(over)
    return DSV4Config(**fields)


def real_dims_config(**over) -> DSV4Config:
    """The real attention geometry (head_dim 512, rope 64, window 128, m 4, m' 128) on a small model."""
    fields = dict(
        name="real-dims", num_hidden_layers=3, hidden_size=256, num_attention_heads=8, q_lora_rank=64,
        o_groups=2, o_lora_rank=32, index_topk=16, compress_ratios=(0, 4, 128), head_dim=512,
        rope_dim=64, sliding_window=128, csa_compression_ratio=4, hca_compression_ratio=128,
        index_n_heads=16, indexer_head_dim=128,
    )
    fields.update(over)
    return DSV4Config(**fields)


@pytest.fixture
def tiny() -> DSV4Config:
    return tiny_config()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none here (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
