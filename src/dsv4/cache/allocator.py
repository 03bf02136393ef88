"""Block and slot allocators: O(1) free lists, checked before anything changes.

Block 0 is the null block: never handed out, never read; padded writes may land there.
Blocks carry reference counts so a prefix can be shared between requests.
"""

from __future__ import annotations

from dsv4.errors import OutOfBlocksError, OutOfSlotsError

NULL_BLOCK = 0


class BlockAllocator:
    def __init__(self, num_blocks: int):
        assert num_blocks >= 2, "need the null block plus at least one usable block"
        self.num_blocks = num_blocks
        # LIFO free list: the most recently freed block is reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self._refs = [0] * num_blocks

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int, what: str = "") -> list[int]:
        """Take n blocks, all or none."""
        if not self.can_allocate(n):
            raise OutOfBlocksError(n, len(self._free), what)
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            assert self._refs[b] == 0, "a free block had references"
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> None:
        """Add a reference to each block (prefix sharing)."""
        for b in blocks:
            assert b != NULL_BLOCK and self._refs[b] > 0, "can only share a live block"
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; a block is free again when none remain."""
        for b in blocks:
            assert b != NULL_BLOCK and self._refs[b] > 0, "double free or free of the null block"
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._refs[block]


class SlotAllocator:
    """Request slots of the state cache: one per active request, fixed for its lifetime."""

    def __init__(self, num_slots: int):
        assert num_slots >= 1, "need at least one request slot"
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlotsError(
                f"all {self.num_slots} request slots are taken; free a finished request or raise max_requests")
        return self._free.pop()

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free, "double free of a request slot"
        self._free.append(slot)
