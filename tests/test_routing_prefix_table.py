"""Prefix table and KV event index: matches, bounds, eviction, TTL, precise mode (pure, no sockets)."""
import shutil
import time
import tracemalloc
from types import SimpleNamespace as NS

import numpy as np
import pytest

from routing import prefix_table
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


@pytest.mark.parametrize("blocks", [4, 40])  # the scalar path for a few blocks, numpy's for more
def test_written_counts_each_block_a_replica_takes_in_once_until_it_is_evicted(blocks):
    table = _table("a", "b", capacity=100)
    prompt = block_hashes(list(range(16 * blocks)))
    table.insert("a", prompt, guessed=True, now=0)
    table.insert("a", prompt, guessed=False, now=1)  # its KV events confirm the guess: nothing new
    table.insert("b", prompt[:2], guessed=False, now=1)
    assert table.written(["a", "b"]) == [blocks, 2]
    table.remove("a", prompt)
    table.insert("a", prompt, guessed=False, now=2)  # recomputed after an eviction: taken in again
    assert table.written(["a", "b"]) == [2 * blocks, 2]


@pytest.mark.parametrize("blocks", [10, 40])  # the scalar path for a few blocks, numpy's for more
def test_a_partly_evicted_prompt_keeps_its_first_blocks_as_its_replica_does(blocks):
    """A replica frees a sequence's blocks tail-first, so when it must evict part of an old
    prompt it loses the prompt's last blocks and still serves a prefix of it. The table's ring
    evicts the same way (in hash order it lost random blocks, the first one often among them,
    and with it the whole match)."""
    table = PrefixTable(expected_blocks=1 << 14)  # roomy buckets: only the ring evicts here
    table.add_replica("a", 2 * blocks)
    old = block_hashes(list(range(16 * blocks)))
    table.insert("a", old, guessed=False, now=0)
    table.insert("a", block_hashes(list(range(10**6, 10**6 + 24 * blocks))), guessed=False, now=1)
    assert table.match(old, now=2)["a"] == blocks // 2  # its last half made room, its first half stays


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


def test_resize_keeps_what_the_table_holds_for_the_replica():
    """A replica's real capacity is learned from its /metrics after traffic started: the table
    resizes its ring without forgetting (or unconfirming) what it already learned."""
    table = _table("a", "b", capacity=1000)
    confirmed, guessed = block_hashes(list(range(160))), block_hashes(list(range(1000, 1160)))
    table.insert("a", confirmed, guessed=False, now=0)
    table.insert("a", guessed, guessed=True, now=0)
    table.insert("b", confirmed[:3], guessed=False, now=0)
    table.resize("a", 500, now=1)
    assert table.capacity("a") == 500 and table.size("a") == 20
    assert table.match(confirmed, now=1) == {"a": 10, "b": 3}
    assert table.match(guessed, now=1) == {"a": 10, "b": 0}
    assert table.match(guessed, now=1000)["a"] == 0 and table.match(confirmed, now=1000)["a"] == 10  # TTL: guesses only
    table.resize("a", 4, now=2)  # smaller than what it holds: keeps what fits
    assert table.size("a") <= 4


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
    def per_call(table, prompt):  # the best of 7 rounds: a preemption by a neighbour inflates one round only
        table.match(prompt, now=0)
        rounds = []
        for _ in range(7):
            started = time.perf_counter()
            for _ in range(20):
                table.match(prompt, now=0)
            rounds.append((time.perf_counter() - started) / 20)
        return min(rounds)
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


class _ReferenceTable:
    """The table's semantics in plain dicts: per replica {block: guessed}, per block the tick it
    was last inserted by any replica (the TTL clock of guesses is per block, shared)."""

    def __init__(self, replicas, ttl_ticks):
        self.blocks = {name: {} for name in replicas}
        self.stamp = {}
        self.ttl_ticks = ttl_ticks

    def insert(self, replica, hashes, guessed, tick):
        held = self.blocks[replica]
        for h in hashes:
            self.stamp[h] = tick
            if not guessed:
                held[h] = False
            elif h not in held:
                held[h] = True  # a guess never downgrades a confirmed block

    def remove(self, replica, hashes):
        for h in hashes:
            self.blocks[replica].pop(h, None)

    def match(self, hashes, tick, candidates):
        result = {}
        for name in candidates:
            held, length = self.blocks.get(name, {}), 0
            for h in hashes:
                if h not in held or (held[h] and tick - self.stamp[h] > self.ttl_ticks):
                    break
                length += 1
            result[name] = length
        return result

    def sync_evictions(self, table):
        """Drop what the table evicted (CLOCK victims, full buckets), read by brute force over its
        slots (no bucket arithmetic), and check it never holds a block it was not given."""
        for name, held in self.blocks.items():
            bit = np.uint64(1) << np.uint64(table._index[name])
            present = set(table._keys[(table._held & bit) != 0].tolist())
            assert present <= set(held), "table holds blocks never inserted (or already removed)"
            for h in set(held) - present:
                del held[h]
            assert table.size(name) == len(held) <= table.capacity(name)


_NEEDS_C = pytest.mark.skipif(prefix_table._native is None, reason="routing/_prefix_match.c not built")
LOOKUPS = [pytest.param(False, id="numpy"), pytest.param(True, id="C", marks=_NEEDS_C)]


def test_the_c_lookup_is_built_where_a_compiler_is():
    """`pip install` compiles routing/_prefix_match.c when it can (optional: numpy serves without)."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    assert prefix_table._native is not None


class _TableCalls:
    """The table driven as cache_aware drives it on every request: its guesses and matches
    through the one-call native_guess / native_match (the methods serve only what those decline),
    the hashes as the gateway's list of ints or as a uint64 array, in turns."""

    def __init__(self, table):
        self.table = table
        self.calls = 0

    def _given(self, hashes):
        self.calls += 1
        return list(hashes) if self.calls % 2 else np.array(hashes, dtype=np.uint64)

    def insert(self, name, hashes, guessed, now):
        if not guessed:
            return self.table.insert(name, hashes, guessed=False, now=now)
        assert prefix_table.native_guess(self.table, name, self._given(hashes), now) is not None

    def match(self, hashes, now, candidates=None):
        names = list(self.table.replicas() if candidates is None else candidates)
        keys = self._given(hashes)
        lengths = prefix_table.native_match(self.table, keys, now, names)
        if lengths is None:  # candidates the table has not memoised yet: the method serves, and memoises them
            assert self.table.match_lengths(keys, now, names) is not None
            lengths = prefix_table.native_match(self.table, keys, now, names)
        return dict(zip(names, lengths))

    def __getattr__(self, name):
        return getattr(self.table, name)


@pytest.mark.parametrize("native", LOOKUPS + [pytest.param("calls", id="C-one-call", marks=_NEEDS_C)])
def test_match_equals_reference_through_evictions_and_ttl(native):
    rng = np.random.default_rng(7)
    replicas = ["a", "b", "c", "d"]
    table = _table(*replicas, capacity=48, ttl=3.0)  # ~24 buckets: ring and bucket evictions both happen
    table.native = bool(native)
    if native == "calls":
        table = _TableCalls(table)
    ref = _ReferenceTable(replicas, ttl_ticks=300)
    # Prompts share prefixes: 6 documents, each prompt a document's first L blocks + a random tail.
    documents = [rng.integers(0, 50, 16 * 30).tolist() for _ in range(6)]

    def prompt():
        doc = documents[rng.integers(len(documents))]
        shared = int(rng.integers(0, 31)) * 16
        tail = rng.integers(0, 50, int(rng.integers(0, 10)) * 16).tolist()
        return block_hashes(doc[:shared] + tail)

    now, evicted_before = 0, 0
    for step in range(1500):
        now += int(rng.integers(0, 2))
        tick = now * 100  # the table's first call is at now=0, so its ticks are now * TICKS_PER_S
        op = rng.random()
        name = replicas[rng.integers(len(replicas))]
        hashes = prompt()
        if op < 0.45 and hashes:
            guessed = bool(rng.random() < 0.6)
            table.insert(name, hashes, guessed=guessed, now=now)
            ref.insert(name, hashes, guessed, tick)
        elif op < 0.55 and hashes:
            gone = [h for h in hashes if rng.random() < 0.3]
            table.remove(name, gone)
            ref.remove(name, gone)
        elif op < 0.60 and hashes:
            cached = int(rng.integers(0, len(hashes) + 1))
            table.correct(name, hashes, cached)
            ref.remove(name, hashes[cached:])
        elif op < 0.61:
            table.clear(name)
            ref.remove(name, list(ref.blocks[name]))
        inserted = sum(len(held) for held in ref.blocks.values())
        ref.sync_evictions(table)
        evicted_before += inserted - sum(len(held) for held in ref.blocks.values())
        candidates = [r for r in replicas + ["gone"] if rng.random() < 0.8]
        for probe in (hashes, prompt()):
            assert table.match(probe, now=now, candidates=candidates) == ref.match(probe, tick, candidates)
        assert table.match(hashes, now=now) == ref.match(hashes, tick, replicas)
    assert evicted_before > 500  # evictions were exercised, not just inserts
    expired = sum(1 for held in ref.blocks.values() for h, g in held.items() if g and tick - ref.stamp[h] > 300)
    assert expired or step < 100  # and some matches ran into expired guesses


def test_block_hashes_are_the_same_for_list_array_and_numpy_token_ids():
    # routing.hashing packs array('I') and uint32 numpy input without converting: same bytes, same hashes.
    from array import array
    tokens = np.random.default_rng(3).integers(0, 2**32, 16 * 9 + 5, dtype=np.uint64).tolist()
    for salt in (None, "tenant"):
        expected = block_hashes(tokens, cache_salt=salt)
        assert block_hashes(array("I", tokens), cache_salt=salt) == expected
        assert block_hashes(np.array(tokens, dtype=np.uint32), cache_salt=salt) == expected
        assert block_hashes(tuple(tokens), block_size=16, cache_salt=salt) == expected


def test_full_table_loses_few_blocks_to_full_buckets_and_keeps_the_bound():
    # 4-slot buckets, two choices, load <= MAX_LOAD: a key whose two buckets are both full evicts
    # the least recently touched of their 8 entries (counted: size() drops with it).
    replicas = [f"r{i}" for i in range(8)]
    table = _table(*replicas, capacity=25_000)
    rng = np.random.default_rng(3)
    inserted = []
    for i in range(400):  # 200k blocks: every replica exactly full
        keys = rng.integers(1, 2**63, 500, dtype=np.uint64)
        inserted.append(keys)
        table.insert(replicas[i % 8], keys, guessed=False, now=i)
    held = sum(table.size(r) for r in replicas)
    assert 200_000 * 0.998 <= held <= 200_000
    present = int(np.count_nonzero(table._keys))
    assert present == held  # one replica per block here: every slot counted once
    found = sum(int(table.holds(replicas[i % 8], keys).sum()) for i, keys in enumerate(inserted))
    assert found == held
    assert table.memory_bytes() / (8 * 25_000) <= 64


@pytest.mark.skipif(prefix_table._native is None, reason="routing/_prefix_match.c not built")
def test_the_one_call_match_reads_a_list_of_ints_as_the_uint64_array_it_stands_for():
    """native_match/native_guess read the gateway's list of hash ints in place: every 64-bit value
    (one, two and three 30-bit digits, the top bit set) as the array holding it, 0 as the 1 it is
    stored as; an int outside [0, 2**64) is left to the method (None), which refuses it."""
    table = _table("a", "b")
    edges = [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63, 2**64 - 1, 12345678901234567890]
    assert prefix_table.native_guess(table, "a", list(edges), 1.0) is not None
    as_array = np.array([e or 1 for e in edges], dtype=np.uint64)
    table.match_lengths(as_array, 1.0, ["a", "b"])  # memoises the candidates
    assert prefix_table.native_match(table, list(edges), 1.0, ["a", "b"]) == \
        prefix_table.native_match(table, as_array, 1.0, ["a", "b"]) == [len(edges), 0]
    for wrong in (2**64, -1, 2**90):
        assert prefix_table.native_match(table, [1, wrong], 1.0, ["a", "b"]) is None
        assert prefix_table.native_guess(table, "b", [1, wrong], 1.0) is None
        with pytest.raises(OverflowError):
            table.match_lengths([1, wrong], 1.0, ["a", "b"])
