"""BlockAllocator / SlotAllocator with exact ids, and a random walk over a KVCacheManager.

The random walk (hypothesis, rule based) admits, grows and frees requests on a tiny cache and
checks after every step that blocks are conserved, never shared between requests, never the
null block, exactly `blocks_needed(seq_len)` per request, and that a refused call changed nothing.
"""

from __future__ import annotations

import pytest
from conftest import tiny_config
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dsv4 import KVCacheManager
from dsv4.cache.allocator import NULL_BLOCK, BlockAllocator, SlotAllocator
from dsv4.errors import InputError, OutOfBlocksError, OutOfSlotsError, RequestError


# ---------------------------------------------------------------------- BlockAllocator
def test_first_allocations_are_1_2_3():
    a = BlockAllocator(8)
    assert (a.num_usable, a.num_free, a.num_used) == (7, 7, 0)
    assert a.allocate(1) == [1]
    assert a.allocate(3) == [2, 3, 4]
    assert (a.num_free, a.num_used) == (3, 4)
    assert [a.ref_count(b) for b in range(8)] == [0, 1, 1, 1, 1, 0, 0, 0]


def test_allocate_zero_is_a_no_op():
    a = BlockAllocator(4)
    assert a.allocate(0) == []
    assert a.num_free == 3


def test_lifo_reuse_most_recently_freed_first():
    a = BlockAllocator(8)
    assert a.allocate(4) == [1, 2, 3, 4]
    a.free([2])
    a.free([4])
    # 4 was freed last: it comes back first, then 2, then the never-used 5.
    assert a.allocate(3) == [4, 2, 5]
    a.free([1, 3])  # freed in list order: 3 is on top
    assert a.allocate(2) == [3, 1]


def test_share_and_free_refcounts():
    a = BlockAllocator(6)
    blocks = a.allocate(2)
    assert blocks == [1, 2]
    a.share(blocks)
    a.share([1])
    assert (a.ref_count(1), a.ref_count(2)) == (3, 2)
    a.free(blocks)
    assert (a.ref_count(1), a.ref_count(2)) == (2, 1)
    assert a.num_free == 3  # still held
    a.free([2])
    assert a.ref_count(2) == 0 and a.num_free == 4
    a.free([1])
    a.free([1])
    assert a.ref_count(1) == 0 and a.num_free == 5
    assert a.allocate(2) == [1, 2]  # 1 freed last -> first


def test_share_of_free_or_null_block_asserts():
    a = BlockAllocator(4)
    with pytest.raises(AssertionError):
        a.share([1])  # not allocated
    a.allocate(1)
    with pytest.raises(AssertionError):
        a.share([NULL_BLOCK])


def test_can_allocate():
    a = BlockAllocator(5)
    assert a.can_allocate(0) and a.can_allocate(4)
    assert not a.can_allocate(5)
    assert not a.can_allocate(-1)
    a.allocate(3)
    assert a.can_allocate(1) and not a.can_allocate(2)


def test_allocate_past_free_raises_and_allocates_nothing():
    a = BlockAllocator(5)
    assert a.allocate(2) == [1, 2]
    with pytest.raises(OutOfBlocksError) as ei:
        a.allocate(3, "request 'x'")
    err = ei.value
    assert (err.needed, err.free) == (3, 2)
    msg = str(err)
    assert "need 3" in msg and "only 2 are free" in msg and "request 'x'" in msg
    assert (a.num_free, a.num_used) == (2, 2)
    assert [a.ref_count(b) for b in range(5)] == [0, 1, 1, 0, 0]
    assert a.allocate(2) == [3, 4]  # the free list is intact and in order


def test_double_free_asserts():
    a = BlockAllocator(4)
    a.allocate(1)
    a.free([1])
    with pytest.raises(AssertionError):
        a.free([1])
    with pytest.raises(AssertionError):
        a.free([2])  # never allocated
    with pytest.raises(AssertionError):
        a.free([NULL_BLOCK])
    assert a.num_free == 3


def test_null_block_never_handed_out():
    a = BlockAllocator(6)
    for _ in range(3):
        got = a.allocate(5)
        assert sorted(got) == [1, 2, 3, 4, 5]
        assert NULL_BLOCK not in got
        with pytest.raises(OutOfBlocksError):
            a.allocate(1)
        a.free(got[::-1])
    assert a.ref_count(NULL_BLOCK) == 0


def test_too_few_blocks_asserts():
    with pytest.raises(AssertionError):
        BlockAllocator(1)


# ---------------------------------------------------------------------- SlotAllocator
def test_slots_first_ids_lifo_and_exhaustion():
    s = SlotAllocator(3)
    assert [s.allocate() for _ in range(3)] == [0, 1, 2]
    assert s.num_free == 0
    with pytest.raises(OutOfSlotsError) as ei:
        s.allocate()
    assert "3 request slots" in str(ei.value)
    assert s.num_free == 0
    s.free(1)
    s.free(0)
    assert s.allocate() == 0
    assert s.allocate() == 1


def test_slot_double_free_and_out_of_range_assert():
    s = SlotAllocator(2)
    slot = s.allocate()
    s.free(slot)
    with pytest.raises(AssertionError):
        s.free(slot)
    with pytest.raises(AssertionError):
        s.free(2)
    with pytest.raises(AssertionError):
        s.free(-1)
    assert s.num_free == 2


# ---------------------------------------------------------------------- manager random walk
_IDS = ("r0", "r1", "r2", "r3", "r4", "r5")   # more ids than slots: duplicates and unknowns happen
_REFUSED = (OutOfBlocksError, OutOfSlotsError, RequestError, InputError)


class ManagerWalk(RuleBasedStateMachine):
    """tiny_config, tokens_per_block 32 (8 CSA entries per block), 11 usable blocks, 4 slots."""

    def __init__(self):
        super().__init__()
        self.mgr = KVCacheManager(tiny_config(), max_requests=4, num_blocks=12, device="cpu", kv_format="bf16",
                                  indexer_format="bf16", tokens_per_block=32, max_batch_tokens=160)
        self.lens: dict[str, int] = {}   # the model: request id -> seq_len

    def _snapshot(self):
        m = self.mgr
        return ({r: (m.seq_len(r), m.block_ids(r)) for r in m.requests},
                m.allocator.num_free, m.allocator.num_used, m.slots.num_free)

    def _refusable(self, call):
        before = self._snapshot()
        try:
            call()
        except _REFUSED:
            assert self._snapshot() == before, "a refused call changed the cache"
            return False
        return True

    @initialize(n0=st.integers(1, 120), n1=st.integers(1, 40))
    def start(self, n0, n1):
        """Begin with two running requests, so most random calls get past the id checks."""
        for rid, n in (("r0", n0), ("r1", n1)):
            self.mgr.add_request(rid)
            self.mgr.prepare_forward({rid: n})
            self.lens[rid] = n

    @rule(data=st.data())
    def add(self, data):
        fresh = [r for r in _IDS if r not in self.lens]
        rid = data.draw(st.sampled_from(fresh if fresh and data.draw(st.integers(0, 5), label="dup?") < 5
                                        else _IDS), label="add")
        expect_ok = rid not in self.lens and len(self.lens) < 4
        ok = self._refusable(lambda: self.mgr.add_request(rid))
        assert ok == expect_ok
        if ok:
            self.lens[rid] = 0

    def _some_id(self, data, label: str) -> str:
        """Mostly an active request (so calls get past the id check), sometimes any id."""
        active = sorted(self.lens)
        if active and data.draw(st.integers(0, 5), label=f"{label} any id?") < 5:
            return data.draw(st.sampled_from(active), label=label)
        return data.draw(st.sampled_from(_IDS), label=label)

    @rule(data=st.data())
    def free(self, data):
        rid = self._some_id(data, "free")
        ok = self._refusable(lambda: self.mgr.free_request(rid))
        assert ok == (rid in self.lens)
        if ok:
            del self.lens[rid]

    @rule(data=st.data())
    def extend(self, data):
        m = self.mgr
        steps: dict[str, int] = {}
        for i in range(data.draw(st.integers(1, 3), label="requests")):
            steps[self._some_id(data, f"id{i}")] = data.draw(st.integers(-1, 120), label=f"n{i}")
        valid = (all(r in self.lens and n >= 1 for r, n in steps.items())
                 and sum(steps.values()) <= m.max_batch_tokens)
        need = sum(m.blocks_needed(self.lens[r] + n) - m.blocks_needed(self.lens[r])
                   for r, n in steps.items()) if valid else 0
        fits = need <= m.allocator.num_free
        ok = self._refusable(lambda: m.prepare_forward(steps))
        assert ok == (valid and fits)
        if ok:
            for r, n in steps.items():
                self.lens[r] += n

    @rule(data=st.data(), n=st.sampled_from([0, -1, 2.0, "3", None]))
    def bad_count(self, data, n):
        rid = self._some_id(data, "bad")
        assert not self._refusable(lambda: self.mgr.prepare_forward({rid: n}))

    @invariant()
    def consistent(self):
        m, a = self.mgr, self.mgr.allocator
        assert a.num_free + a.num_used == a.num_usable == 11
        assert {r: m.seq_len(r) for r in m.requests} == self.lens
        held = [b for r in m.requests for b in m.block_ids(r)]
        assert len(held) == len(set(held)) == a.num_used, "a block is in two requests' lists or leaked"
        assert NULL_BLOCK not in held
        assert all(0 < b < a.num_blocks and a.ref_count(b) == 1 for b in held)
        for r, n in self.lens.items():
            assert len(m.block_ids(r)) == m.blocks_needed(n)
        assert m.slots.num_free == 4 - len(self.lens)
        assert len({req.slot for req in m.requests.values()}) == len(self.lens)


ManagerWalk.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestManagerWalk = ManagerWalk.TestCase
