"""Next-token choice: greedy, or temperature + top-p (nucleus) sampling with a per-request generator.

Each request draws from its own `torch.Generator` seeded from (seed, request index), so what a
request samples does not depend on which other requests share its steps.
"""

from __future__ import annotations

import hashlib

import torch

from dsv4.errors import InputError


def check_sampling(temperature: float, top_p: float) -> None:
    if not temperature >= 0.0:
        raise InputError(f"temperature={temperature}: give 0 (greedy) or a positive number")
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p={top_p}: give a number in (0, 1]")


def request_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator for request `index` of a generate() call with `seed`."""
    digest = hashlib.sha256(f"dsv4-sample/{seed}/{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def sample(logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator | None]
           ) -> list[int]:
    """Pick one token per row.

    Args:
        logits: [B, V] float32 (any device).
        temperature: 0 = greedy (argmax, the lowest index on ties, as torch and transformers do).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p.
        generators: one CPU generator per row (ignored when greedy).
    Returns:
        B token ids.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)      # [B, V]
    out = []
    for row, g in zip(probs, generators):
        if top_p < 1.0:
            p, idx = row.sort(descending=True)
            keep = (p.cumsum(0) - p) < top_p                                 # always keeps the first
            row = torch.zeros_like(row).scatter_(0, idx[keep], p[keep])
        out.append(int(torch.multinomial(row, 1, generator=g)))
    return out
