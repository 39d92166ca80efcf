"""Prefix table and KV event index: matches, bounds, eviction, TTL, precise mode (pure, no sockets)."""
import time
import tracemalloc
from types import SimpleNamespace as NS

import numpy as np

from routing.hashing import block_hashes
from routing.kv_event_index import KVEventIndex
from routing.prefix_table import PrefixTable


def _table(*replicas, capacity=1000, ttl=300.0):
    table = PrefixTable(expected_blocks=capacity * len(replicas), guess_ttl_s=ttl)
    for name in replicas:
        table.add_replica(name, capacity)
    return table


def test_match_returns_each_replicas_prefix_up_to_its_first_miss():
    table = _table("a", "b", "c")
    prompt = block_hashes(list(range(160)))  # 10 blocks
    table.insert("a", prompt[:7], guessed=False, now=0)
    table.insert("b", prompt[:3], guessed=True, now=0)
    table.insert("c", prompt[1:10], guessed=False, now=0)  # no block 0: matches nothing
    assert table.match(prompt, now=1) == {"a": 7, "b": 3, "c": 0}
    table.remove("a", prompt[4:5])
    assert table.match(prompt, now=1)["a"] == 4


def test_guesses_expire_but_confirmed_blocks_do_not():
    table = _table("a", "b", ttl=10)
    prompt = block_hashes(list(range(64)))
    table.insert("a", prompt, guessed=True, now=0)
    table.insert("b", prompt, guessed=False, now=0)
    assert table.match(prompt, now=5) == {"a": 4, "b": 4}
    assert table.match(prompt, now=11) == {"a": 0, "b": 4}


def test_correct_drops_claims_beyond_reported_cached_blocks():
    table = _table("a")
    prompt = block_hashes(list(range(160)))
    table.insert("a", prompt, guessed=True, now=0)
    table.correct("a", prompt, cached_blocks=6)
    assert table.match(prompt, now=0) == {"a": 6}


def test_capacity_bounds_each_replica_with_lru_like_eviction():
    table = _table("a", "b", capacity=100)
    hot = block_hashes(list(range(16 * 20)))
    table.insert("a", hot, guessed=False, now=0)
    rng = np.random.default_rng(1)
    for step in range(1, 30):
        table.insert("a", hot, guessed=False, now=step)  # touched every round: survives
        table.insert("a", rng.integers(1, 2**63, 20, dtype=np.uint64), guessed=False, now=step)
        assert table.size("a") <= 100
    assert table.match(hot, now=30)["a"] == 20
    assert table.size("b") == 0


def test_removed_replica_disappears_from_matches():
    table = _table("a", "b")
    prompt = block_hashes(list(range(64)))
    table.insert("a", prompt, guessed=False, now=0)
    table.remove_replica("a")
    assert table.match(prompt, now=0) == {"b": 0}
    table.add_replica("c", 10)
    assert table.match(prompt, now=0) == {"b": 0, "c": 0}


def test_memory_stays_under_bound_through_1m_random_inserts():
    replicas = [f"r{i}" for i in range(16)]
    capacity = 40_000  # 640k blocks in total: 1M inserts force evictions on every replica
    tracemalloc.start()
    table = _table(*replicas, capacity=capacity)
    bound = table.memory_bytes()
    rng = np.random.default_rng(0)
    for i in range(500):  # 500 x 2,000 = 1M block inserts
        table.insert(replicas[i % 16], rng.integers(1, 2**63, 2000, dtype=np.uint64), guessed=True, now=i)
    traced, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert all(table.size(r) <= capacity for r in replicas)
    assert table.memory_bytes() == bound  # preallocated: nothing grows
    assert traced < bound * 1.1
    assert bound / (16 * capacity) <= 64


def test_lookup_cost_grows_with_prompt_blocks_not_table_size():
    def per_call(table, prompt):
        table.match(prompt, now=0)
        started = time.perf_counter()
        for _ in range(50):
            table.match(prompt, now=0)
        return (time.perf_counter() - started) / 50
    small, big = _table("a", capacity=1_000), _table("a", capacity=400_000)
    rng = np.random.default_rng(2)
    for _ in range(800):
        big.insert("a", rng.integers(1, 2**63, 500, dtype=np.uint64), guessed=False, now=0)
    prompt = block_hashes(list(range(16 * 512)))
    for table in (small, big):
        table.insert("a", prompt, guessed=False, now=0)
    # 400x the entries, well under 4x the time (cache misses cost something, scans would cost 400x).
    assert per_call(big, prompt) < 4 * per_call(small, prompt) + 1e-4


class BlockStored(NS): pass
class BlockRemoved(NS): pass
class AllBlocksCleared(NS): pass


def test_kv_event_index_equals_replica_contents_whatever_its_hash_function():
    from replica.block_pool import BlockPool
    pool = BlockPool(num_blocks=6, block_size=4)
    table = _table("r", capacity=6)
    index = KVEventIndex(table, "r", block_size=4)
    prompts = ([1] * 12, [2] * 12, [3] * 12, [1] * 8 + [5] * 4)
    seq = 0
    for prompt in prompts:
        theirs = [h ^ 0xDEADBEEF for h in block_hashes(prompt, 4, cache_salt="their seed")]  # not our hashes
        slots, parent = pool.allocate(3), None
        for i, h in enumerate(theirs):
            pool.commit(slots[i], h, parent, prompt[i * 4:(i + 1) * 4])
            parent = h
        pool.release(slots)
        events = []
        for e in pool.drain_events():
            kind = type(e).__name__
            if kind.startswith("Stored"):
                events.append(BlockStored(block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash,
                                          token_ids=e.token_ids, block_size=e.block_size))
            elif kind.startswith("Removed"):
                events.append(BlockRemoved(block_hashes=e.block_hashes))
            else:
                events.append(AllBlocksCleared())
        assert index.apply(seq, NS(events=events), now=0) is None
        seq += 1
    for prompt in prompts:
        ours = block_hashes(prompt, 4)
        theirs = [h ^ 0xDEADBEEF for h in block_hashes(prompt, 4, cache_salt="their seed")]
        expected = len(pool.longest_cached_prefix(theirs))
        assert table.match(ours, now=0)["r"] == expected
    assert table.size("r") <= 6


def test_kv_event_gap_is_reported_and_replay_fills_it():
    table = _table("r")
    index = KVEventIndex(table, "r", block_size=4)
    tokens = list(range(8))
    ours = block_hashes(tokens, 4)
    first = NS(events=[BlockStored(block_hashes=[11], parent_block_hash=None, token_ids=tokens[:4], block_size=4)])
    second = NS(events=[BlockStored(block_hashes=[12], parent_block_hash=11, token_ids=tokens[4:], block_size=4)])
    third = NS(events=[BlockRemoved(block_hashes=[12])])
    assert index.apply(0, first, now=0) is None
    assert index.apply(2, third, now=0) == 1  # seq 1 missed
    assert index.apply(2, third, now=0) is None  # duplicate ignored
    for seq, batch in ((1, second), (2, third)):
        index.replay(seq, batch, now=0)
    assert table.match(ours, now=0) == {"r": 1}
    index.apply(3, NS(events=[AllBlocksCleared()]), now=0)
    assert table.match(ours, now=0) == {"r": 0}
