"""Block-by-block accounting of the simulator's KV cache (vLLM BlockPool rules)."""

from __future__ import annotations

import pytest

from servegate.simulator.kv_cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCache,
    SeqBlocks,
    block_hashes_of,
    hash_block,
)

BS = 4
ROOT = 7


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def run_seq(kv: KVCache, ids: list[int], lora: int = 0) -> SeqBlocks:
    """Admit a sequence like the engine does: look up, allocate, cache full blocks."""
    seq = SeqBlocks()
    hashes = block_hashes_of(ids, BS, ROOT, lora)
    hits = kv.find_cached_prefix(hashes, len(ids))
    computed = len(hits) * BS
    assert kv.allocate(seq, computed, len(ids) - computed, hits)
    kv.cache_full_blocks(seq, hashes, ids, len(ids))
    return seq


def test_hashes_chain_from_parent() -> None:
    ids = tokens(9)
    hashes = block_hashes_of(ids, BS, ROOT)
    # 9 tokens = 2 full blocks (the 9th token is a partial block, never hashed)
    assert hashes == [
        hash_block(ROOT, ids[0:4], 0),
        hash_block(hash_block(ROOT, ids[0:4], 0), ids[4:8], 0),
    ]
    assert block_hashes_of(ids, BS, ROOT, extra=5) != hashes
    assert block_hashes_of([*ids, 1, 2, 3], BS, ROOT, prev=hashes)[:2] == hashes


def test_allocation_usage_and_stored_event() -> None:
    kv = KVCache(num_blocks=5, block_size=BS)
    ids = tokens(10)
    seq = run_seq(kv, ids)
    # 10 tokens need ceil(10/4) = 3 blocks; ids 1, 2, 3 (block 0 is reserved)
    assert seq.block_ids == [1, 2, 3]
    # usage = 1 - free/usable = 1 - 1/4
    assert kv.usage == pytest.approx(0.75)
    hashes = block_hashes_of(ids, BS, ROOT)
    assert kv.drain_events() == [
        BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=ids[:8],
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
    ]
    assert kv.cached_hashes() == set(hashes)


@pytest.mark.parametrize(
    ("prompt_len", "expected_hit_blocks"),
    [
        pytest.param(12, 2, id="exact-3-blocks-last-token-recomputed"),  # (12-1)//4 = 2
        pytest.param(13, 2, id="2-shared-blocks-hit"),  # 2 cached blocks, (13-1)//4 = 3 allowed
        pytest.param(8, 1, id="exact-2-blocks"),  # (8-1)//4 = 1
        pytest.param(4, 0, id="one-block-never-hits"),  # (4-1)//4 = 0
    ],
)
def test_prefix_hits_leave_last_token(prompt_len: int, expected_hit_blocks: int) -> None:
    kv = KVCache(num_blocks=16, block_size=BS)
    run_seq(kv, tokens(10))  # caches 2 full blocks: tokens 100..107
    ids = tokens(prompt_len)
    hits = kv.find_cached_prefix(block_hashes_of(ids, BS, ROOT), len(ids))
    assert len(hits) == expected_hit_blocks


def test_free_keeps_hashes_and_evicts_tail_first() -> None:
    kv = KVCache(num_blocks=5, block_size=BS)
    ids = tokens(12)
    a = run_seq(kv, ids)  # blocks 1, 2, 3 all full and cached
    h = block_hashes_of(ids, BS, ROOT)
    kv.drain_events()
    kv.free(a)
    # freed last-to-first: queue was [4], then 3, 2, 1 are appended
    assert kv.free_queue() == [4, 3, 2, 1]
    assert kv.usage == 0.0
    assert kv.cached_hashes() == set(h)

    b = SeqBlocks()
    assert kv.allocate(b, 0, 5)  # 2 blocks: 4 (no hash), then 3 (holds h[2])
    assert b.block_ids == [4, 3]
    assert kv.drain_events() == [BlockRemoved(block_hashes=[h[2]], medium="GPU")]
    # the head of the old prompt is still cached
    assert kv.find_cached_prefix(h, 12) == [kv.block(1), kv.block(2)]


def test_hit_on_free_block_takes_it_out_of_the_queue() -> None:
    kv = KVCache(num_blocks=5, block_size=BS)
    a = run_seq(kv, tokens(9))
    kv.free(a)
    # partial block 3 (no hash) to the head, cached 2 then 1 to the tail
    assert kv.free_queue() == [3, 4, 2, 1]
    b = run_seq(kv, tokens(9))  # hits blocks 1 and 2, needs one new block: the head, 3
    assert b.block_ids == [1, 2, 3]
    assert [kv.block(i).ref_cnt for i in (1, 2, 3)] == [1, 1, 1]
    assert kv.free_queue() == [4]


@pytest.mark.parametrize(
    ("caching", "queue"),
    [
        # a's cached 2, 1 to the tail, its partial 3 to the head; then b's partial 6 to
        # the head and its cached 5, 4 to the tail
        pytest.param(True, [6, 3, 7, 2, 1, 5, 4], id="uncached-reused-before-any-eviction"),
        # nothing is cached: each sequence's blocks go to the head, last block first
        pytest.param(False, [6, 5, 4, 3, 2, 1, 7], id="no-prefix-caching-lifo"),
    ],
)
def test_uncached_blocks_go_to_the_head_of_the_free_queue(caching: bool, queue: list[int]) -> None:
    """vLLM's `free_blocks`: blocks without a hash are reused first (LIFO), cached ones last."""
    kv = KVCache(num_blocks=8, block_size=BS, enable_prefix_caching=caching)
    a = run_seq(kv, tokens(9))  # blocks 1, 2 full, 3 partial
    b = run_seq(kv, tokens(9, start=500))  # blocks 4, 5 full, 6 partial
    kv.free(a)
    kv.free(b)
    assert kv.free_queue() == queue
    kv.drain_events()
    c = SeqBlocks()
    assert kv.allocate(c, 0, 3 * BS)  # 3 blocks from the head: no cached block evicted
    assert c.block_ids == queue[:3]
    assert not [e for e in kv.drain_events() if isinstance(e, BlockRemoved)]


def test_shared_blocks_are_reference_counted() -> None:
    kv = KVCache(num_blocks=8, block_size=BS)
    a = run_seq(kv, tokens(9))
    b = run_seq(kv, tokens(9))
    first = a.block_ids[0]
    assert b.block_ids[:2] == a.block_ids[:2]
    assert kv.block(first).ref_cnt == 2
    kv.free(a)
    assert kv.block(first).ref_cnt == 1
    assert first not in kv.free_queue()


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCache(num_blocks=4, block_size=BS)  # 3 usable blocks
    a = run_seq(kv, tokens(8))
    kv.free(a)
    queue, events = kv.free_queue(), list(kv.events)
    b = SeqBlocks()
    # 13 tokens need 4 blocks > 3 usable
    assert not kv.allocate(b, 0, 13)
    assert b.blocks == []
    assert kv.free_queue() == queue
    assert kv.events == events


def test_evictable_hits_count_against_free_blocks() -> None:
    kv = KVCache(num_blocks=4, block_size=BS)  # 3 usable
    a = run_seq(kv, tokens(9))  # 3 blocks, 2 cached
    kv.free(a)
    ids = tokens(13)
    hashes = block_hashes_of(ids, BS, ROOT)
    hits = kv.find_cached_prefix(hashes, len(ids))
    assert len(hits) == 2
    # 13 tokens need 4 blocks: 2 hits + 2 new, but only 1 block is free besides the hits
    assert not kv.allocate(SeqBlocks(), 8, 5, hits)


def test_concurrent_duplicates_share_a_hash() -> None:
    kv = KVCache(num_blocks=8, block_size=BS)
    ids = tokens(5)
    hashes = block_hashes_of(ids, BS, ROOT)
    a, b = SeqBlocks(), SeqBlocks()
    for seq in (a, b):  # both computed before either was cached: no hits
        assert kv.allocate(seq, 0, 5)
    for seq in (a, b):
        kv.cache_full_blocks(seq, hashes, ids, 5)
    assert kv.num_cached_blocks == 2
    stored = [e for e in kv.drain_events() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [hashes, hashes]


def test_lora_blocks_carry_adapter_and_differ() -> None:
    kv = KVCache(num_blocks=8, block_size=BS)
    seq = SeqBlocks(lora_id=1, lora_name="a1")
    ids = tokens(4)
    hashes = block_hashes_of(ids, BS, ROOT, extra=99)
    assert kv.allocate(seq, 0, 4)
    kv.cache_full_blocks(seq, hashes, ids, 4)
    (event,) = kv.drain_events()
    assert isinstance(event, BlockStored)
    assert (event.lora_id, event.lora_name) == (1, "a1")
    assert kv.find_cached_prefix(block_hashes_of([*ids, 1], BS, ROOT), 5) == []


def test_reset_only_when_idle() -> None:
    kv = KVCache(num_blocks=8, block_size=BS)
    a = run_seq(kv, tokens(9))
    assert not kv.reset()
    kv.free(a)
    kv.drain_events()
    assert kv.reset()
    assert kv.cached_hashes() == set()
    assert kv.drain_events() == [AllBlocksCleared()]


def test_prefix_caching_off_caches_nothing() -> None:
    kv = KVCache(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    run_seq(kv, tokens(9))
    assert kv.events == []
    assert kv.find_cached_prefix(block_hashes_of(tokens(9), BS, ROOT), 9) == []
