"""ForwardBatch: the metadata of one forward step, filled by `KVCacheManager.prepare_forward`.

The vocabulary (all int32 device tensors, views into buffers the manager owns, valid until the
next `prepare_forward`):

    positions      [T]          absolute position of each packed new token
    token_request  [T]          batch index (0..B-1) of each token
    cu_seqlens     [B+1]        token offsets: request b owns tokens cu_seqlens[b]:cu_seqlens[b+1]
    seq_lens       [B]          tokens of the request after this step (last position + 1)
    request_slots  [B]          state-cache slot of each request
    block_table    [B, max_blocks]  physical block ids, -1 past block_lens
    block_lens     [B]          valid blocks per request
    visible_entries {m: [B]}    seq_lens // m for each compression ratio m of the model
    compress_plans {(m, overlap): CompressPlan}   the prefill compressor's launch table per
                                compressor kind of the model (`dsv4.kernels.compress_plan`)

Worked example: requests "a" (37 new tokens, none before) and "b" (1 new token after 300),
tokens_per_block 256, m = 4:

    positions      = [0, 1, ..., 36, 300]     T = 38
    token_request  = [0] * 37 + [1]
    cu_seqlens     = [0, 37, 38]
    seq_lens       = [37, 301]
    block_lens     = [1, 2]      a: entries 0..8 -> block 0 of a; b: entries 0..74 -> 2 blocks
    visible_entries[4] = [9, 75]
    compress_plans[(4, True)]: first = [0, 75], end = [9, 75], 9 + 0 entries finish

The same numbers are kept on the host (`*_host` tuples) for planning and reference code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.kernels.compress_plan import CompressPlan


@dataclass(frozen=True, kw_only=True, slots=True)
class ForwardBatch:
    request_ids: tuple[str, ...]
    tokens_per_block: int
    positions: torch.Tensor
    token_request: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor
    request_slots: torch.Tensor
    block_table: torch.Tensor
    block_lens: torch.Tensor
    # host copies (no device sync needed to read them)
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    slots_host: tuple[int, ...]
    block_lens_host: tuple[int, ...]
    # Static bound on seq_lens for fixed-shape (CUDA-graph) decode: a power of two >= max(seq_lens).
    seq_len_bound: int
    visible_entries: dict[int, torch.Tensor]
    compress_plans: dict[tuple[int, bool], CompressPlan]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host)

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def start_positions_host(self) -> tuple[int, ...]:
        return tuple(s - q for s, q in zip(self.seq_lens_host, self.query_lens_host))

    @property
    def is_decode(self) -> bool:
        """Every request brings exactly one token."""
        return all(q == 1 for q in self.query_lens_host)

    @property
    def device(self) -> torch.device:
        return self.positions.device
