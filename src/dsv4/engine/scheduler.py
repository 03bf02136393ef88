"""Scheduler: admission, chunked prefill and continuous batching over a `KVCacheManager`.

Every step packs at most `max_batch_tokens` new tokens, in this order:

    1. decoding requests, one token each (least recently scheduled first);
    2. requests part-way through their prompt, a chunk each from what is left of the budget;
    3. waiting requests, first come first served, while a state slot is free and the cache can
       hold them: admission reserves the blocks of the request's whole life
       (prompt + max_new_tokens - 1 tokens fed), so a running request never runs out of blocks
       and nothing has to be preempted. A request that cannot fit even in an empty cache is
       rejected at submission; it does not hold up the others.

A request's token sequence is prompt + generated; `computed` tokens of it are in the cache:

    seq       p0 p1 ... p_{P-1} g0 g1 ... g_{k-1}
    computed  |---- in the cache ----|            the next step feeds seq[computed:computed+n]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from dsv4.cache.manager import KVCacheManager


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"


@dataclass(kw_only=True, slots=True, eq=False)
class Request:
    index: int                      # position in the generate() call
    prompt: list[int]
    max_new_tokens: int
    max_len: int                    # most tokens the request may ever hold in the cache
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    computed: int = 0
    status: Status = Status.WAITING
    blocks_reserved: int = 0        # blocks of its whole life, reserved at admission
    last_step: int = -1
    first_token_s: float | None = None
    finish_reason: str = ""
    reject_reason: str = ""

    @property
    def rid(self) -> str:
        return f"req-{self.index}"

    @property
    def seq_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def in_prefill(self) -> bool:
        return self.computed < len(self.prompt)

    def tokens(self, n: int) -> list[int]:
        """The next n tokens to feed."""
        seq = self.prompt[self.computed:self.computed + n]
        if len(seq) < n:
            start = max(self.computed - len(self.prompt), 0)
            seq = seq + self.output[start:start + n - len(seq)]
        return seq


class Scheduler:
    def __init__(self, manager: KVCacheManager, max_batch_tokens: int):
        self.mgr = manager
        self.max_batch_tokens = max_batch_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.step_count = 0

    # ------------------------------------------------------------------ submission
    def lifetime_blocks(self, req: Request) -> int:
        """Blocks the request holds at its longest: all but the last generated token are fed."""
        return self.mgr.blocks_needed(min(len(req.prompt) + req.max_new_tokens - 1, req.max_len))

    def submit(self, req: Request) -> bool:
        """Queue a request; reject it (False) if it could never fit, even in an empty cache."""
        need, usable = self.lifetime_blocks(req), self.mgr.allocator.num_usable
        if need > usable:
            req.status = Status.REJECTED
            req.reject_reason = (f"needs {need} cache blocks ({len(req.prompt)} prompt + {req.max_new_tokens} "
                                 f"new tokens) but the cache has {usable}")
            return False
        self.waiting.append(req)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ planning
    def _free_unreserved(self) -> int:
        """Free blocks not promised to a running request's future growth."""
        promised = sum(r.blocks_reserved - len(self.mgr.block_ids(r.rid)) for r in self.running)
        return self.mgr.allocator.num_free - promised

    def schedule(self) -> list[tuple[Request, int]]:
        """This step's (request, new tokens) in packing order; admits waiting requests on the way."""
        budget = self.max_batch_tokens
        plan: list[tuple[Request, int]] = []
        decoding = sorted((r for r in self.running if not r.in_prefill), key=lambda r: r.last_step)
        for req in decoding:
            if budget == 0:
                break
            plan.append((req, 1))
            budget -= 1
        for req in (r for r in self.running if r.in_prefill):
            if budget == 0:
                break
            n = min(len(req.prompt) - req.computed, budget)
            plan.append((req, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.mgr.max_requests:
            req = self.waiting[0]
            need = self.lifetime_blocks(req)
            if need > self._free_unreserved():
                break  # first come, first served: wait for blocks to come back
            self.waiting.pop(0)
            self.mgr.add_request(req.rid)
            req.status, req.blocks_reserved = Status.RUNNING, need
            self.running.append(req)
            n = min(len(req.prompt), budget)
            plan.append((req, n))
            budget -= n
        assert plan or not self.has_work, "a non-empty queue must make progress (an empty cache fits the head)"
        for req, _ in plan:
            req.last_step = self.step_count
        self.step_count += 1
        return plan

    # ------------------------------------------------------------------ completion
    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = Status.FINISHED, reason
        self.running.remove(req)
        self.mgr.free_request(req.rid)
