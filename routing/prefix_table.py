"""Which replica holds (or probably holds) which prefix blocks: the cache-aware router's memory.

One table per model pool. Layout, chosen for bytes per cached block and vectorised lookups:
  - a bucketed hash table in flat numpy arrays: 8 slots per bucket, two candidate buckets
    per key (low bits, high bits of the 64-bit block hash), so a lookup is one gather of 16
    slots per prompt block and no probe loop. Per slot: key (uint64, 0 = empty), `held`
    (uint64 bitmask of replicas holding the block), `guessed` (bitmask: held only because
    we routed there, not confirmed by a KV event), `stamp` (uint32 ticks of 10 ms: last
    time any replica inserted or touched the block).
  - per replica a ring of its block hashes with a CLOCK hand (second chance: a block
    touched since the hand last passed it survives one more round) - the standard
    constant-memory approximation of LRU. The ring length is the replica's capacity in
    blocks, so memory per replica is bounded by construction.
Guessed entries expire `guess_ttl_s` after the block was last touched (the stamp is per
block, shared by replicas: a block routed to B keeps A's guess of it alive; a
`correct()` from A's reported cached tokens removes it). Up to 64 replicas per table.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

SLOTS_PER_BUCKET = 8
MAX_REPLICAS = 64
TICKS_PER_S = 100  # stamp resolution 10 ms; uint32 ticks wrap after ~497 days
MAX_LOAD = 0.80    # table slots >= total capacity / MAX_LOAD: two-choice buckets rarely overflow

_U64 = np.uint64
_ONE = np.uint64(1)


class PrefixTableError(ValueError):
    pass


def as_block_keys(hashes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block hashes as the table's uint64 keys (0 is the empty marker, so it becomes 1)."""
    keys = np.asarray(hashes, dtype=_U64) if not isinstance(hashes, np.ndarray) else hashes.astype(_U64, copy=False)
    if keys.size and not keys.all():
        keys = np.where(keys == 0, _ONE, keys)
    return keys


class _Ring:
    """One replica's blocks in CLOCK order. Entries whose replica bit is gone are free."""
    __slots__ = ("hashes", "seen", "fill", "hand")

    def __init__(self, capacity_blocks: int) -> None:
        self.hashes = np.zeros(capacity_blocks, dtype=_U64)
        self.seen = np.zeros(capacity_blocks, dtype=np.uint32)  # tick the entry was written or passed
        self.fill = 0
        self.hand = 0


class PrefixTable:
    def __init__(self, expected_blocks: int = 1 << 16, guess_ttl_s: float = 300.0, clock=None) -> None:
        self.guess_ttl_ticks = int(guess_ttl_s * TICKS_PER_S)
        self._t0: float | None = None
        self._index: dict[str, int] = {}      # replica name -> bit
        self._bits = [None] * MAX_REPLICAS    # bit -> replica name
        self._rings: dict[str, _Ring] = {}
        self._sizes: dict[str, int] = {}
        self._alloc(self._buckets_for(expected_blocks))

    # ---- replicas ---------------------------------------------------------------------
    def add_replica(self, replica: str, capacity_blocks: int) -> None:
        """Register a replica with room for `capacity_blocks` blocks (its KV capacity)."""
        if capacity_blocks <= 0:
            raise PrefixTableError(f"capacity_blocks must be positive, got {capacity_blocks}")
        if replica in self._index:
            return
        free = [i for i, name in enumerate(self._bits) if name is None]
        if not free:
            raise PrefixTableError(f"at most {MAX_REPLICAS} replicas per prefix table")
        self._index[replica] = free[0]
        self._bits[free[0]] = replica
        self._rings[replica] = _Ring(capacity_blocks)
        self._sizes[replica] = 0
        total = sum(len(r.hashes) for r in self._rings.values())
        if self._buckets_for(total) > self._nb:
            self._grow(self._buckets_for(total))

    def remove_replica(self, replica: str) -> None:
        if replica not in self._index:
            return
        self.clear(replica)
        bit = self._index.pop(replica)
        self._bits[bit] = None
        del self._rings[replica], self._sizes[replica]

    def replicas(self) -> list[str]:
        return list(self._index)

    def capacity(self, replica: str) -> int:
        return len(self._rings[replica].hashes)

    def size(self, replica: str) -> int:
        """Blocks the table records for this replica (guessed ones included until evicted)."""
        return self._sizes[replica]

    def memory_bytes(self) -> int:
        """Bytes held by the table's arrays (slots + rings); Python object overhead is constant."""
        total = self._keys.nbytes + self._held.nbytes + self._guessed.nbytes + self._stamp.nbytes
        return total + sum(r.hashes.nbytes + r.seen.nbytes for r in self._rings.values())

    # ---- lookups ----------------------------------------------------------------------
    def match(self, hashes, now: float, candidates: Iterable[str] | None = None) -> dict[str, int]:
        """Matched prefix length in blocks for every candidate (default: every replica).

        Cost is linear in the prompt's blocks (one 16-slot gather each), independent of the
        table's size. A replica's match ends at its first missing block (chain property)."""
        names = self._index if candidates is None else candidates
        result = {name: 0 for name in names}
        keys = as_block_keys(hashes)
        # Galloping: look up 32 blocks, then 64, 128, ... and stop at the first chunk where no
        # replica still matches; a prompt that shares a short prefix never pays for its tail.
        alive_before = -1
        matched_by_bit: dict[int, int] = {}
        start, chunk = 0, 32
        while start < keys.size and alive_before:
            stop = min(start + chunk, keys.size)
            prefix_and = self._held_prefix(keys[start:stop], now)
            if alive_before != -1:
                prefix_and &= _U64(alive_before)
            # prefix_and only loses bits, so it changes at most 64 times: a short Python loop.
            alive = int(prefix_and[0]) if alive_before == -1 else alive_before
            for change in [0] + list(np.flatnonzero(prefix_and[1:] != prefix_and[:-1]) + 1):
                now_alive = int(prefix_and[change])
                dropped = alive & ~now_alive
                while dropped:
                    low = dropped & -dropped
                    matched_by_bit[low.bit_length() - 1] = start + int(change)
                    dropped ^= low
                alive = now_alive
            alive_before = alive
            start, chunk = stop, chunk * 2
        alive = max(alive_before, 0)
        while alive:
            low = alive & -alive
            matched_by_bit[low.bit_length() - 1] = int(keys.size)
            alive ^= low
        for name in result:
            bit = self._index.get(name)
            if bit is not None:
                result[name] = matched_by_bit.get(bit, 0)
        return result

    def _held_prefix(self, keys: np.ndarray, now: float) -> np.ndarray:
        """Running AND of the replicas holding each block (guesses past their TTL ignored)."""
        pos, found = self._find(keys)
        held = np.where(found, self._held[pos], _U64(0))
        if self.guess_ttl_ticks:
            expired = (self._tick(now) - self._stamp[pos].astype(np.int64)) > self.guess_ttl_ticks
            if expired.any():
                held = np.where(expired, held & ~self._guessed[pos], held)
        return np.bitwise_and.accumulate(held)

    def holds(self, replica: str, hashes) -> np.ndarray:
        """Per block: does the table record it for this replica (TTL not applied)."""
        keys = as_block_keys(hashes)
        pos, found = self._find(keys)
        bit = _ONE << _U64(self._index[replica])
        return found & ((self._held[pos] & bit) != 0)

    # ---- updates ----------------------------------------------------------------------
    def insert(self, replica: str, hashes, guessed: bool, now: float) -> None:
        """Record that `replica` holds these blocks (guessed: from a routing decision).

        A guess never downgrades a block a KV event confirmed; a confirmation clears the guess."""
        ring = self._rings[replica]
        bit = _ONE << _U64(self._index[replica])
        keys = np.unique(as_block_keys(hashes))
        if keys.size == 0:
            return
        if keys.size > len(ring.hashes):  # more than fits: keep what fits (any subset is a valid cache state)
            keys = keys[:len(ring.hashes)]
        tick = self._tick(now)
        pos, found = self._find(keys)
        # Existing slots: touch, and set the replica's bit where it was missing.
        fpos = pos[found]
        was_held = (self._held[fpos] & bit) != 0
        self._held[fpos] |= bit
        if guessed:
            newly = fpos[~was_held]
            self._guessed[newly] |= bit
        else:
            self._guessed[fpos] &= ~bit
        self._stamp[fpos] = tick
        new_keys = keys[~found]
        ring_entries = np.concatenate([keys[found][~was_held], new_keys])
        if ring_entries.size == 0:
            return
        slots = self._ring_slots(replica, ring, bit, ring_entries.size, tick, protect=keys)
        ring.hashes[slots] = ring_entries
        ring.seen[slots] = tick
        self._sizes[replica] += int(ring_entries.size)
        if new_keys.size:
            self._place(new_keys, bit, bit if guessed else _U64(0), tick)

    def remove(self, replica: str, hashes) -> None:
        """The replica evicted these blocks (BlockRemoved)."""
        keys = as_block_keys(hashes)
        if keys.size == 0:
            return
        pos, found = self._find(np.unique(keys))
        self._drop_bit(replica, pos[found])

    def clear(self, replica: str) -> None:
        """The replica dropped its whole cache (AllBlocksCleared, restart)."""
        bit = _ONE << _U64(self._index[replica])
        occupied = np.flatnonzero((self._held & bit) != 0)  # O(table): rare operation
        self._drop_bit(replica, occupied)
        ring = self._rings[replica]
        ring.fill = ring.hand = 0

    def correct(self, replica: str, hashes, cached_blocks: int) -> None:
        """The replica reported it held only `cached_blocks` of the blocks the table claimed for
        it (`hashes`: the claimed prefix); the claims beyond that were wrong, drop them."""
        keys = as_block_keys(hashes)
        if cached_blocks < keys.size:
            self.remove(replica, keys[max(cached_blocks, 0):])

    # ---- internals --------------------------------------------------------------------
    def _tick(self, now: float) -> int:
        if self._t0 is None:
            self._t0 = now
        return max(int((now - self._t0) * TICKS_PER_S), 0)

    @staticmethod
    def _buckets_for(blocks: int) -> int:
        return max(-(-int(blocks / MAX_LOAD) // SLOTS_PER_BUCKET), 8)

    def _alloc(self, buckets: int) -> None:
        self._nb = buckets
        self._nb_u64 = _U64(buckets)
        n = buckets * SLOTS_PER_BUCKET
        self._keys = np.zeros(n, dtype=_U64)
        self._held = np.zeros(n, dtype=_U64)
        self._guessed = np.zeros(n, dtype=_U64)
        self._stamp = np.zeros(n, dtype=np.uint32)
        self._lane = np.arange(SLOTS_PER_BUCKET, dtype=np.intp)

    def _grow(self, buckets: int) -> None:
        live = np.flatnonzero(self._keys)
        keys, held, guessed, stamp = (a[live] for a in (self._keys, self._held, self._guessed, self._stamp))
        self._alloc(buckets)
        self._place(keys, held, guessed, stamp)

    def _buckets(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # Modulo, not a power-of-two mask: the table is sized to the load, not rounded up 2x.
        first = (keys % self._nb_u64).astype(np.intp)
        second = ((keys >> _U64(32)) % self._nb_u64).astype(np.intp)
        return first, second

    def _find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Flat slot index and found flag per key: two row gathers of 8 slots, no probe loop."""
        first, second = self._buckets(keys)
        table = self._keys.reshape(self._nb, SLOTS_PER_BUCKET)
        column = keys[:, None]
        eq1 = table[first] == column
        eq2 = table[second] == column
        found1 = eq1.any(axis=1)
        pos = np.where(found1, first * SLOTS_PER_BUCKET + eq1.argmax(axis=1),
                       second * SLOTS_PER_BUCKET + eq2.argmax(axis=1))
        return pos, found1 | eq2.any(axis=1)

    def _place(self, keys, held, guessed, stamp) -> None:
        """Put keys that are not in the table into free slots of their less-full bucket."""
        n = len(keys)
        held, guessed, stamp = (np.broadcast_to(np.asarray(a), (n,)) for a in (held, guessed, stamp))
        pending = np.arange(n)
        for attempt in range(2):  # less-full bucket first, then the other one
            if pending.size == 0:
                return
            first, second = self._buckets(keys[pending])
            fill1 = (self._keys.reshape(self._nb, -1)[first] != 0).sum(axis=1)
            fill2 = (self._keys.reshape(self._nb, -1)[second] != 0).sum(axis=1)
            prefer_first = fill1 <= fill2 if attempt == 0 else fill1 > fill2
            bucket = np.where(prefer_first, first, second)
            order = np.argsort(bucket, kind="stable")
            sb = bucket[order]
            group_start = np.flatnonzero(np.r_[True, sb[1:] != sb[:-1]])
            rank = np.arange(sb.size) - np.repeat(group_start, np.diff(np.r_[group_start, sb.size]))
            free = self._keys.reshape(self._nb, -1)[sb] == 0
            free_rank = np.cumsum(free, axis=1)
            ok = free_rank[:, -1] > rank
            lane = np.argmax((free_rank == (rank + 1)[:, None]) & free, axis=1)
            slot = sb * SLOTS_PER_BUCKET + lane
            who = pending[order][ok]
            slot = slot[ok]
            self._keys[slot] = keys[who]
            self._held[slot] = held[who]
            self._guessed[slot] = guessed[who]
            self._stamp[slot] = stamp[who]
            pending = np.sort(pending[order][~ok])
        for i in pending:  # both buckets full: drop their least recently touched block (rare)
            first, second = self._buckets(keys[i:i + 1])
            idx = np.r_[first[0] * SLOTS_PER_BUCKET + self._lane, second[0] * SLOTS_PER_BUCKET + self._lane]
            victim = idx[np.argmin(self._stamp[idx])]
            self._forget_slot(int(victim))
            self._keys[victim], self._held[victim] = keys[i], held[i]
            self._guessed[victim], self._stamp[victim] = guessed[i], stamp[i]

    def _forget_slot(self, slot: int) -> None:
        mask = int(self._held[slot])
        while mask:
            low = mask & -mask
            self._sizes[self._bits[low.bit_length() - 1]] -= 1
            mask ^= low
        self._keys[slot] = self._held[slot] = self._guessed[slot] = 0

    def _drop_bit(self, replica: str, pos: np.ndarray) -> None:
        bit = _ONE << _U64(self._index[replica])
        pos = np.unique(pos[(self._held[pos] & bit) != 0])
        if pos.size == 0:
            return
        self._held[pos] &= ~bit
        self._guessed[pos] &= ~bit
        emptied = pos[self._held[pos] == 0]
        self._keys[emptied] = 0
        self._sizes[replica] -= int(pos.size)

    def _ring_slots(self, replica: str, ring: _Ring, bit, need: int, tick: int, protect) -> np.ndarray:
        """`need` ring positions for new entries: unused ones first, then CLOCK victims."""
        capacity = len(ring.hashes)
        take = min(need, capacity - ring.fill)
        slots = [np.arange(ring.fill, ring.fill + take)]
        ring.fill += take
        need -= take
        passes = 0
        while need > 0:
            window = (ring.hand + np.arange(min(capacity, max(2 * need, 64)))) % capacity
            hashes = ring.hashes[window]
            pos, found = self._find(as_block_keys(hashes))
            live = found & ((self._held[pos] & bit) != 0)
            recent = live & (self._stamp[pos] > ring.seen[window]) & (passes < 2)
            if passes < 3:  # never evict what is being inserted now (unless nothing else is left)
                recent |= live & np.isin(hashes, protect)
            evictable = ~recent
            chosen = np.flatnonzero(evictable)[:need]
            last = int(chosen[-1]) + 1 if chosen.size else len(window)
            passed = window[:last]
            ring.seen[passed[recent[:last]]] = tick  # second chance used up
            victims = window[chosen]
            self._drop_bit(replica, pos[chosen][live[chosen]])
            slots.append(victims)
            need -= chosen.size
            ring.hand = (ring.hand + last) % capacity
            passes += 1 if last == len(window) else 0
        return np.concatenate(slots)
