"""KVCacheManager scenarios with exact block ids and counts (DSV4 Flash geometry and tiny_config).

Flash, tokens_per_block 256: the CSA layers (m = 4) fill blocks first, 64 entries per block, so a
request of L tokens holds ceil((L // 4) / 64) blocks:

    L      3   4   255  256  257  259  260  300  512  515  516
    blocks 0   1   1    1    1    1    2    2    2    2    3

Flash's pools for 43 layers cost 1.7 MB per block in bf16, so these tests keep num_blocks <= 8.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from dsv4 import DSV4Config, KVCacheManager
from dsv4.errors import ConfigError, InputError, OutOfBlocksError, OutOfSlotsError, RequestError

# Flash in bf16 (hand-derived so sizing bugs cannot cancel out):
#   21 CSA layers: main 64 entries x 512 ch x 2 B = 65536, indexer 64 x 128 x 2 = 16384
#   20 HCA layers: 2 entries x 512 x 2 = 2048
FLASH_BF16_BLOCK_BYTES = 21 * (65536 + 16384) + 20 * 2048                        # 1_761_280
#   43 window rings: 128 x 512 x 2 + 128 int32 positions + int32 head = 131588
#   CSA state: (M, S, A) x 2 pending x (512 + 128) ch x 4 B = 15360; HCA: 3 x 1 x 512 x 4 = 6144
FLASH_BF16_STATE_BYTES = 43 * 131588 + 21 * 15360 + 20 * 6144                     # 6_103_724


def flash(num_blocks: int | None = 6, max_requests: int = 2, **kw) -> KVCacheManager:
    kw.setdefault("kv_format", "bf16")
    kw.setdefault("indexer_format", "bf16")
    return KVCacheManager(DSV4Config.flash(), max_requests=max_requests, num_blocks=num_blocks, device="cpu",
                          tokens_per_block=256, **kw)


def tiny(num_blocks: int = 12, max_requests: int = 4, tokens_per_block: int = 32, **kw) -> KVCacheManager:
    kw.setdefault("kv_format", "bf16")
    kw.setdefault("indexer_format", "bf16")
    kw.setdefault("device", "cpu")
    cfg = kw.pop("cfg", None) or tiny_config()
    return KVCacheManager(cfg, max_requests=max_requests, num_blocks=num_blocks,
                          tokens_per_block=tokens_per_block, **kw)


def snapshot(mgr: KVCacheManager):
    a = mgr.allocator
    return ({r: (mgr.seq_len(r), mgr.block_ids(r)) for r in mgr.requests}, a.num_free, a.num_used,
            mgr.slots.num_free)


# ---------------------------------------------------------------------- admit, grow, free, reuse
def test_flash_grow_across_block_boundaries():
    mgr = flash(num_blocks=6)
    assert [mgr.blocks_needed(n) for n in (0, 3, 4, 255, 256, 257, 259, 260, 300, 512, 515, 516)] == \
        [0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert mgr.add_request("a") == 0
    assert mgr.block_ids("a") == [] and mgr.seq_len("a") == 0
    b = mgr.prepare_forward({"a": 255})
    assert mgr.block_ids("a") == [1] and b.block_lens_host == (1,)
    for step, (seq_len, blocks) in enumerate([(256, [1]), (257, [1]), (259, [1]), (260, [1, 2])]):
        n = seq_len - mgr.seq_len("a")
        free_before = mgr.allocator.num_free
        expected_new = mgr.blocks_needed(seq_len) - len(mgr.block_ids("a"))
        b = mgr.prepare_forward({"a": n})
        assert mgr.seq_len("a") == seq_len, step
        assert mgr.block_ids("a") == blocks, step
        assert free_before - mgr.allocator.num_free == expected_new
        assert b.block_lens.tolist() == [len(blocks)]
        assert b.block_table[0, :len(blocks) + 1].tolist() == blocks + [-1]
        assert b.positions.tolist() == list(range(seq_len - n, seq_len))
    assert mgr.allocator.num_free == 3
    mgr.prepare_forward({"a": 256})   # 516 tokens: 129 entries -> a third block
    assert mgr.block_ids("a") == [1, 2, 3]


def test_tiny_grow_across_block_boundaries():
    # tokens_per_block 32, m = 4: 8 CSA entries per block; entry 8 closes at token 35 (seq_len 36).
    mgr = tiny(num_blocks=6)
    assert [mgr.blocks_needed(n) for n in (3, 4, 31, 32, 33, 35, 36, 67, 68)] == [0, 1, 1, 1, 1, 1, 2, 2, 3]
    mgr.add_request("a")
    mgr.add_request("b")
    got = []
    for n in (31, 1, 1, 2, 1):
        mgr.prepare_forward({"a": n})
        got.append((mgr.seq_len("a"), mgr.block_ids("a")))
    assert got == [(31, [1]), (32, [1]), (33, [1]), (35, [1]), (36, [1, 2])]
    mgr.prepare_forward({"b": 3})
    assert mgr.block_ids("b") == []            # no closed entry yet: no block
    mgr.prepare_forward({"b": 1, "a": 32})
    assert mgr.block_ids("b") == [3] and mgr.block_ids("a") == [1, 2, 4]


def test_free_returns_blocks_and_reuse_is_lifo():
    mgr = flash(num_blocks=6)
    mgr.add_request("a")
    mgr.add_request("b")
    mgr.prepare_forward({"a": 300, "b": 256})      # a: 75 entries -> [1, 2]; b: 64 -> [3]
    assert (mgr.block_ids("a"), mgr.block_ids("b")) == ([1, 2], [3])
    assert (mgr.allocator.num_free, mgr.allocator.num_used) == (2, 3)
    mgr.free_request("a")
    assert mgr.allocator.num_free == 4 and mgr.allocator.num_used == 1
    assert mgr.block_ids("b") == [3]
    with pytest.raises(RequestError):
        mgr.seq_len("a")
    # a's blocks were freed in order [1, 2]: 2 is on top of the free list, then 1, then 4.
    assert mgr.add_request("c") == 0                # a's slot
    mgr.prepare_forward({"c": 600})                 # 150 entries -> 3 blocks
    assert mgr.block_ids("c") == [2, 1, 4]
    mgr.free_request("b")
    mgr.add_request("d")
    mgr.prepare_forward({"d": 4})
    assert mgr.block_ids("d") == [3]


def test_out_of_blocks_names_needed_and_free_and_touches_nothing():
    mgr = flash(num_blocks=4)                       # 3 usable
    mgr.add_request("a")
    mgr.add_request("b")
    mgr.prepare_forward({"a": 300})                 # [1, 2]
    before = snapshot(mgr)
    with pytest.raises(OutOfBlocksError) as ei:
        mgr.prepare_forward({"b": 600})             # needs 3, 1 free
    assert (ei.value.needed, ei.value.free) == (3, 1)
    assert "need 3 free cache blocks" in str(ei.value) and "only 1 are free" in str(ei.value)
    assert snapshot(mgr) == before
    assert mgr.seq_len("b") == 0 and mgr.block_ids("a") == [1, 2] and mgr.seq_len("a") == 300
    assert not mgr.can_grow({"b": 600}) and mgr.can_grow({"b": 259})
    mgr.prepare_forward({"b": 259})                 # exactly the one free block
    assert mgr.block_ids("b") == [3] and mgr.allocator.num_free == 0
    before = snapshot(mgr)
    with pytest.raises(OutOfBlocksError) as ei:
        mgr.prepare_forward({"a": 212, "b": 1})     # a: 512 tokens -> 2 blocks (0 new); b: 260 -> 1 new
    assert (ei.value.needed, ei.value.free) == (1, 0)
    assert snapshot(mgr) == before


def test_two_requests_second_cannot_fit_allocates_nothing():
    mgr = flash(num_blocks=4)                       # 3 usable
    mgr.add_request("a")
    mgr.add_request("b")
    assert mgr.can_grow({"a": 256}) and not mgr.can_grow({"a": 256, "b": 600})
    before = snapshot(mgr)
    with pytest.raises(OutOfBlocksError) as ei:
        mgr.prepare_forward({"a": 256, "b": 600})   # a alone fits (1 block), b needs 3: 4 > 3
    assert (ei.value.needed, ei.value.free) == (4, 3)
    assert snapshot(mgr) == before
    assert mgr.block_ids("a") == [] and mgr.seq_len("a") == 0 and mgr.allocator.num_free == 3
    batch = mgr.prepare_forward({"a": 256, "b": 300})  # 1 + 2 = 3: fits exactly
    assert (mgr.block_ids("a"), mgr.block_ids("b")) == ([1], [2, 3])
    assert batch.block_lens.tolist() == [1, 2]


# ---------------------------------------------------------------------- refused calls
def test_unknown_and_duplicate_request_ids():
    mgr = tiny()
    assert mgr.add_request("a") == 0
    mgr.prepare_forward({"a": 40})
    before = snapshot(mgr)
    with pytest.raises(RequestError, match="already active"):
        mgr.add_request("a")
    for call in (lambda: mgr.prepare_forward({"zz": 1}), lambda: mgr.prepare_forward({"a": 1, "zz": 1}),
                 lambda: mgr.free_request("zz"), lambda: mgr.seq_len("zz"), lambda: mgr.block_ids("zz"),
                 lambda: mgr.can_grow({"zz": 1})):
        with pytest.raises(RequestError, match="unknown request 'zz'"):
            call()
    assert snapshot(mgr) == before
    mgr.free_request("a")
    with pytest.raises(RequestError):
        mgr.free_request("a")                        # freed twice
    assert mgr.add_request("a") == 0                 # the id can be used again after free


@pytest.mark.parametrize("n", [0, -1, -300, 1.0, 2.5, "3", None])
def test_bad_token_counts(n):
    mgr = tiny()
    mgr.add_request("a")
    mgr.add_request("b")
    mgr.prepare_forward({"a": 9})
    before = snapshot(mgr)
    with pytest.raises(InputError, match="positive int"):
        mgr.prepare_forward({"b": n})
    with pytest.raises(InputError):
        mgr.prepare_forward({"a": 40, "b": n})       # the valid first request is not applied either
    assert snapshot(mgr) == before


def test_empty_step_and_too_many_requests_in_one_step():
    mgr = tiny(max_requests=2)
    mgr.add_request("a")
    mgr.add_request("b")
    with pytest.raises(InputError):
        mgr.prepare_forward({})
    with pytest.raises(InputError, match="max_requests=2"):
        mgr.prepare_forward({"a": 1, "b": 1, "c": 1})


def test_past_max_position_embeddings():
    mgr = tiny(cfg=tiny_config(max_position_embeddings=256), num_blocks=12, tokens_per_block=64)
    assert mgr.max_blocks_per_request == 4          # 256 // 4 = 64 entries, 16 per block
    mgr.add_request("a")
    mgr.add_request("b")
    mgr.prepare_forward({"a": 250})
    before = snapshot(mgr)
    with pytest.raises(InputError, match="max_position_embeddings=256"):
        mgr.prepare_forward({"a": 7})
    with pytest.raises(InputError, match="would reach 257 tokens"):
        mgr.prepare_forward({"b": 1, "a": 7})
    with pytest.raises(InputError):
        mgr.prepare_forward({"b": 257})
    assert snapshot(mgr) == before
    batch = mgr.prepare_forward({"a": 6, "b": 256})  # exactly the limit is fine
    assert batch.seq_lens.tolist() == [256, 256] and batch.block_lens.tolist() == [4, 4]
    assert batch.block_table.shape == (2, 4)


def test_too_many_tokens_for_max_batch_tokens():
    mgr = tiny(max_batch_tokens=64)
    mgr.add_request("a")
    mgr.add_request("b")
    before = snapshot(mgr)
    with pytest.raises(InputError, match="max_batch_tokens=64"):
        mgr.prepare_forward({"a": 40, "b": 25})
    with pytest.raises(InputError):
        mgr.prepare_forward({"a": 65})
    assert snapshot(mgr) == before
    assert mgr.prepare_forward({"a": 40, "b": 24}).num_tokens == 64


def test_out_of_slots():
    mgr = tiny(max_requests=2)
    assert (mgr.add_request("a"), mgr.add_request("b")) == (0, 1)
    mgr.prepare_forward({"a": 33})
    before = snapshot(mgr)
    with pytest.raises(OutOfSlotsError, match="all 2 request slots"):
        mgr.add_request("c")
    assert snapshot(mgr) == before and "c" not in mgr.requests
    mgr.free_request("a")
    assert mgr.add_request("c") == 0


def test_config_errors():
    cfg = tiny_config()
    with pytest.raises(ConfigError, match="exactly one"):
        KVCacheManager(cfg, tokens_per_block=32)
    with pytest.raises(ConfigError, match="exactly one"):
        KVCacheManager(cfg, num_blocks=4, memory_bytes=1 << 30, tokens_per_block=32)
    with pytest.raises(ConfigError, match="null block"):
        KVCacheManager(cfg, num_blocks=1, tokens_per_block=32)
    with pytest.raises(ConfigError):
        KVCacheManager(cfg, num_blocks=4, max_requests=0, tokens_per_block=32)
    with pytest.raises(ConfigError):
        KVCacheManager(cfg, num_blocks=4, max_batch_tokens=0, tokens_per_block=32)
    with pytest.raises(ConfigError, match="tokens_per_block=40"):
        KVCacheManager(cfg, num_blocks=4, tokens_per_block=40)


# ---------------------------------------------------------------------- sizing and reporting
def test_memory_bytes_sizing():
    cfg = DSV4Config.flash()
    state = 2 * FLASH_BF16_STATE_BYTES
    mem = state + 5 * FLASH_BF16_BLOCK_BYTES + 1234
    mgr = KVCacheManager(cfg, max_requests=2, memory_bytes=mem, kv_format="bf16", indexer_format="bf16")
    assert (mgr.block_bytes, mgr.state_bytes_per_request) == (FLASH_BF16_BLOCK_BYTES, FLASH_BF16_STATE_BYTES)
    assert mgr.allocator.num_blocks == (mem - state) // FLASH_BF16_BLOCK_BYTES == 5
    assert mgr.memory_report()["total_blocks"] == 4
    assert mgr.memory_report()["bytes_allocated"] == 5 * FLASH_BF16_BLOCK_BYTES + state <= mem
    for too_little in (state + 2 * FLASH_BF16_BLOCK_BYTES - 1, state, 0):
        with pytest.raises(ConfigError, match="memory_bytes"):
            KVCacheManager(cfg, max_requests=2, memory_bytes=too_little, kv_format="bf16", indexer_format="bf16")
    # exactly two blocks is the smallest budget accepted
    assert mgr.blocks_for_memory(state + 2 * FLASH_BF16_BLOCK_BYTES) == 2


def test_memory_report_exact():
    mgr = flash(num_blocks=6, max_requests=2)
    rep = mgr.memory_report()
    assert {k: rep[k] for k in ("total_blocks", "free_blocks", "used_blocks", "bytes_allocated", "bytes_used")} == {
        "total_blocks": 5, "free_blocks": 5, "used_blocks": 0,
        "bytes_allocated": 6 * FLASH_BF16_BLOCK_BYTES + 2 * FLASH_BF16_STATE_BYTES, "bytes_used": 0}
    mgr.add_request("a")
    mgr.add_request("b")
    mgr.prepare_forward({"a": 260, "b": 3})          # a: 2 blocks, b: none yet
    rep = mgr.memory_report()
    assert (rep["total_blocks"], rep["free_blocks"], rep["used_blocks"], rep["active_requests"]) == (5, 3, 2, 2)
    assert rep["bytes_allocated"] == 6 * FLASH_BF16_BLOCK_BYTES + 2 * FLASH_BF16_STATE_BYTES
    assert rep["bytes_allocated"] == rep["paged_bytes_allocated"] + rep["state_bytes_allocated"]
    assert rep["bytes_used"] == 2 * FLASH_BF16_BLOCK_BYTES + 2 * FLASH_BF16_STATE_BYTES
    mgr.free_request("a")
    rep = mgr.memory_report()
    assert (rep["free_blocks"], rep["used_blocks"], rep["bytes_used"]) == (5, 0, FLASH_BF16_STATE_BYTES)


def test_default_formats_block_bytes():
    # fp8_ds: 584 B per entry, a page of 64 padded to a multiple of 576 -> 65 * 576 = 37440 (HCA: 3 * 576);
    # mxfp4 indexer: 64 + 4 = 68 B per key -> 4352 per page.
    mgr = KVCacheManager(DSV4Config.flash(), max_requests=1, num_blocks=2)
    assert mgr.block_bytes == 21 * (37440 + 4352) + 20 * 1728 == 912192


# ---------------------------------------------------------------------- ForwardBatch metadata
def test_forward_batch_worked_example():
    """batch.py's example: "a" 37 new tokens, "b" 1 new token after 300 (tokens_per_block 256)."""
    mgr = flash(num_blocks=6)
    mgr.add_request("a")
    mgr.add_request("b")
    mgr.prepare_forward({"b": 300})                  # b: 75 entries -> blocks [1, 2]
    batch = mgr.prepare_forward({"a": 37, "b": 1})   # a: 9 entries -> block [3]
    i32 = {"dtype": torch.int32}
    assert torch.equal(batch.positions, torch.tensor(list(range(37)) + [300], **i32))
    assert torch.equal(batch.token_request, torch.tensor([0] * 37 + [1], **i32))
    assert torch.equal(batch.cu_seqlens, torch.tensor([0, 37, 38], **i32))
    assert torch.equal(batch.seq_lens, torch.tensor([37, 301], **i32))
    assert torch.equal(batch.block_lens, torch.tensor([1, 2], **i32))
    assert torch.equal(batch.request_slots, torch.tensor([0, 1], **i32))
    # seq_len // m for the model's two compression ratios, filled on the host
    assert sorted(batch.visible_entries) == [4, 128]
    assert torch.equal(batch.visible_entries[4], torch.tensor([9, 75], **i32))
    assert torch.equal(batch.visible_entries[128], torch.tensor([0, 2], **i32))
    # the prefill compressor's launch tables, one per compressor kind, planned and copied here:
    # rows mid_base (B + 1), first, end, fin_base, tok0, p0, p1 (dsv4.kernels.compress_plan)
    assert sorted(batch.compress_plans) == [(4, True), (128, False)]
    csa, hca = batch.compress_plans[(4, True)], batch.compress_plans[(128, False)]
    assert csa.table.tolist() == [0, 7, 7, 0, 75, 9, 75, 0, 9, 0, 37, 0, 300, 37, 301]
    assert (csa.num_middle, csa.num_finished) == (7, 9)            # a: entries 0..10, 2 + 2 at the ends
    assert hca.table.tolist() == [0, 0, 0, 0, 2, 0, 2, 0, 0, 0, 37, 0, 300, 37, 301]
    assert (hca.num_middle, hca.num_finished) == (0, 0)
    assert csa.table.dtype == torch.int32 and (csa.start_positions, csa.query_lens) == ((0, 300), (37, 1))
    width = mgr.max_blocks_per_request
    assert width == 4096                             # 2^20 tokens / 256
    table = torch.full((2, width), -1, **i32)
    table[0, 0] = 3
    table[1, :2] = torch.tensor([1, 2])
    assert torch.equal(batch.block_table, table)
    assert batch.request_ids == ("a", "b") and batch.tokens_per_block == 256
    assert (batch.query_lens_host, batch.seq_lens_host, batch.slots_host, batch.block_lens_host) == \
        ((37, 1), (37, 301), (0, 1), (1, 2))
    assert batch.start_positions_host == (0, 300)
    assert (batch.num_tokens, batch.num_requests, batch.is_decode) == (38, 2, False)
    assert batch.device == torch.device("cpu")
    # the next step reuses the buffers: a shorter batch does not leak the previous rows
    batch = mgr.prepare_forward({"b": 1})
    assert batch.positions.tolist() == [301] and batch.token_request.tolist() == [0]
    assert batch.cu_seqlens.tolist() == [0, 1] and batch.request_slots.tolist() == [1]
    assert batch.visible_entries[4].tolist() == [75] and batch.visible_entries[128].tolist() == [2]
    assert batch.compress_plans[(4, True)].table.tolist() == [0, 0, 75, 75, 0, 0, 301, 302]
    assert batch.block_table.shape == (1, width) and batch.block_table[0, :3].tolist() == [1, 2, -1]
    assert batch.is_decode


# ---------------------------------------------------------------------- slot reuse
def test_reused_slot_state_is_fully_reset():
    mgr = tiny(max_requests=2)
    assert (mgr.add_request("a"), mgr.add_request("c")) == (0, 1)
    batch = mgr.prepare_forward({"a": 20, "c": 7})
    for layer in range(3):
        mgr.acquire(layer, batch).write_swa(torch.randn(27, 128))
        st = mgr.states[layer]
        for s in (st.comp_state, st.idx_state):      # what the compressor would leave behind
            if s is not None:
                s.normal_()
    kept = {layer: {k: v[1].clone() for k, v in vars_of(mgr.states[layer]).items()} for layer in range(3)}
    assert mgr.states[0].swa_head.tolist() == [20, 7] and (mgr.states[0].swa_pos[0] >= 0).all()
    mgr.free_request("a")
    assert mgr.add_request("b") == 0
    for layer in range(3):
        st = mgr.states[layer]
        assert (st.swa_pos[0] == -1).all() and st.swa_head[0].item() == 0
        assert (st.swa_pages[0] == 0).all()
        for s in (st.comp_state, st.idx_state):
            if s is not None:
                assert torch.isneginf(s[0, 0]).all(), "M must be -inf"
                assert (s[0, 1:] == 0).all(), "S and A must be 0"
        for k, v in vars_of(st).items():             # the other request's slot is untouched
            assert torch.equal(v[1], kept[layer][k]), (layer, k)
    assert (mgr.states[0].comp_state, mgr.states[2].idx_state) == (None, None)
    assert mgr.states[1].idx_state is not None and mgr.states[2].comp_state is not None
    batch = mgr.prepare_forward({"b": 2})
    h = mgr.acquire(1, batch)
    h.write_swa(torch.randn(2, 128))
    _, pos, valid = h.gather_swa_kv()
    assert valid[0].tolist() == [False] * 14 + [True] * 2 and pos[0, -2:].tolist() == [0, 1]


def vars_of(st) -> dict[str, torch.Tensor]:
    out = {"swa_pages": st.swa_pages, "swa_pos": st.swa_pos, "swa_head": st.swa_head}
    if st.comp_state is not None:
        out["comp_state"] = st.comp_state
    if st.idx_state is not None:
        out["idx_state"] = st.idx_state
    return out


def test_planning_ignores_a_default_device_context():
    """A caller inside `with torch.device(...)` (as a model is often built) still gets the manager's
    host buffers, plans and block tables on the host: nothing lands on the context's device."""
    steps = [{"a": 70, "b": 5}, {"a": 1, "b": 40}, {"a": 1, "b": 1}]
    plain, ctx = tiny(), None
    with torch.device("meta"):
        ctx = tiny()
    for mgr in (plain, ctx):
        mgr.add_request("a")
        mgr.add_request("b")
    for step in steps:
        want = plain.prepare_forward(step)
        with torch.device("meta"):
            got = ctx.prepare_forward(step)
        for name in ("positions", "token_request", "cu_seqlens", "seq_lens", "request_slots", "block_table",
                     "block_lens"):
            a, b = getattr(got, name), getattr(want, name)
            assert b.device.type == "cpu" and a.device.type == "cpu", name
            assert torch.equal(a, b), name
        assert got.visible_entries.keys() == want.visible_entries.keys()
        for k in want.visible_entries:
            assert torch.equal(got.visible_entries[k], want.visible_entries[k]), k
        assert got.compress_plans.keys() == want.compress_plans.keys()
        for k in want.compress_plans:
            assert torch.equal(got.compress_plans[k].table, want.compress_plans[k].table), k
