"""Paged KV cache bookkeeping: prefix hits, reference counts, LRU eviction, events."""
import random

import pytest

from replica.block_pool import BlockPool, NoFreeBlocks, RemovedEvent, StoredEvent
from routing.hashing import block_hashes

BS = 4


def fill(pool: BlockPool, tokens: list[int]) -> list[int]:
    """What the engine does for a new prompt: reuse the cached prefix, allocate the rest,
    commit every full block."""
    hashes = block_hashes(tokens, BS)
    hit = pool.longest_cached_prefix(hashes)
    pool.acquire(hit)
    need = -(-len(tokens) // BS) - len(hit)
    try:
        table = hit + pool.allocate(need)
    except NoFreeBlocks:
        pool.release(hit)
        raise
    parent = hashes[len(hit) - 1] if hit else None
    for i in range(len(hit), len(hashes)):
        pool.commit(table[i], hashes[i], parent, tokens[i * BS:(i + 1) * BS])
        parent = hashes[i]
    return table


def test_shared_prefix_reuses_blocks_and_counts_references():
    pool = BlockPool(num_blocks=16, block_size=BS)
    a = fill(pool, list(range(12)))
    b = fill(pool, list(range(8)) + [99, 98, 97, 96, 95])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert pool.ref_count(a[0]) == 2 and pool.ref_count(a[2]) == 1
    pool.release(a)
    assert pool.ref_count(a[0]) == 1
    pool.release(b)
    assert pool.num_free == 16
    # Freed blocks stay cached until evicted.
    assert pool.longest_cached_prefix(block_hashes(list(range(12)), BS)) == a


def test_eviction_is_least_recently_used_and_emits_removed():
    pool = BlockPool(num_blocks=4, block_size=BS)
    old = fill(pool, [1] * 8)
    pool.release(old)
    new = fill(pool, [2] * 8)
    pool.release(new)
    pool.drain_events()
    fill(pool, [3] * 8)  # needs 2 blocks: the oldest released ones go first
    removed = [e for e in pool.drain_events() if isinstance(e, RemovedEvent)]
    assert removed and set(removed[0].block_hashes) == set(block_hashes([1] * 8, BS))
    assert pool.longest_cached_prefix(block_hashes([2] * 8, BS)) == new


def test_a_released_partial_block_is_reused_before_any_cached_block_is_evicted():
    pool = BlockPool(num_blocks=5, block_size=BS)
    old = fill(pool, list(range(8)))             # 2 full blocks, cached
    pool.release(old)
    partial = fill(pool, list(range(100, 110)))  # 2 full blocks and a partial one: the pool is full
    pool.release(partial)
    pool.drain_events()
    fresh = pool.allocate(1)
    assert fresh == [partial[2]] and pool.drain_events() == []  # the empty block, nothing evicted
    assert len(pool.longest_cached_prefix(block_hashes(list(range(8)), BS))) == 2


def test_pool_exhaustion_raises_instead_of_overwriting():
    pool = BlockPool(num_blocks=2, block_size=BS)
    fill(pool, list(range(8)))
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)


def test_duplicate_commit_keeps_one_canonical_block():
    pool = BlockPool(num_blocks=4, block_size=BS)
    first, second = pool.allocate(2)
    h = block_hashes([5] * 4, BS)[0]
    assert pool.commit(first, h, None, [5] * 4) == first
    assert pool.commit(second, h, None, [5] * 4) == first
    stored = [e for e in pool.drain_events() if isinstance(e, StoredEvent)]
    assert len(stored) == 1


def test_events_replayed_into_an_index_equal_the_cache_after_random_churn():
    rng = random.Random(7)
    pool = BlockPool(num_blocks=24, block_size=BS)
    index: set[int] = set()
    live = []
    for _ in range(400):
        if live and (rng.random() < 0.5 or pool.num_free < 6):
            pool.release(live.pop(rng.randrange(len(live))))
        else:
            prefix = [rng.randrange(3)] * 8  # a few hot prefixes
            tokens = prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            try:
                live.append(fill(pool, tokens))
            except NoFreeBlocks:
                pass
        for event in pool.drain_events():
            if isinstance(event, StoredEvent):
                index.update(event.block_hashes)
            elif isinstance(event, RemovedEvent):
                index.difference_update(event.block_hashes)
            else:
                index.clear()
    assert index == pool.cached_hashes()
