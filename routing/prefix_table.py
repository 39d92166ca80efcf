"""Which replica holds (or probably holds) which prefix blocks: the cache-aware router's memory.

One table per model pool. Layout, chosen for bytes per cached block and vectorised lookups:
  - a bucketed hash table in flat numpy arrays: 4 slots per bucket, two candidate buckets
    per key (the two 32-bit halves of the mixed 64-bit block hash), so a lookup is one gather
    of 8 slots per prompt block and no probe loop; a whole prompt is matched in one pass.
    Per slot: key (uint64, 0 = empty) and `held` (uint64 bitmask of replicas holding the
    block), interleaved in one 64-byte row per bucket; then, packed in one 12-byte record per
    slot (a second [buckets, 4] array the expiry check gathers row by row), `guessed`
    (bitmask: held only because we routed there, not confirmed by a KV event) and `stamp`
    (uint32 ticks of 10 ms: last time any replica inserted or touched it).
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

try:  # the lookup loop in C, compiled by `pip install` where a C compiler is found (optional)
    from routing import _prefix_match as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

# match_lengths(hashes, now, candidates) and insert(replica, hashes, guessed=True, now) of a table
# (its first argument) in one C call each, for cache_aware's choose and commit on every request:
# Hashes: a uint64 array or a list of ints (read in C, no array made). None where the method must
# serve instead (no C build, the table's native switch off, hashes of another kind, candidates the
# table has not memoised yet).
native_match = native_guess = None
if _native is not None:
    native_match, native_guess = _native.table_match, _native.table_guess

SLOTS_PER_BUCKET = 4  # 4 keys + their 4 `held` masks: one 64-byte line per bucket; shifts (>> 2, & 3) assume 4
_LANE_BITS = 2
MAX_REPLICAS = 64
TICKS_PER_S = 100  # stamp resolution 10 ms; uint32 ticks wrap after ~497 days
MAX_LOAD = 0.60    # table slots >= total capacity / MAX_LOAD: two-choice 4-slot buckets rarely overflow

_U64 = np.uint64
_ONE = np.uint64(1)
_MIX_INT = 0x9E37_79B9_7F4A_7C15  # odd (2**64 / golden ratio): bucket mixing
_MIX = np.uint64(_MIX_INT)
_MASK64 = (1 << 64) - 1
_SHIFT32 = np.uint64(32)
_ZERO = np.uint64(0)
_GUESS_RECORD = np.dtype([("guessed", _U64), ("stamp", np.uint32)])  # packed: 12 bytes
_SMALL_INSERT = 16  # inserts of at most this many blocks take the scalar path (see _insert_small)


def _cell(slot):
    """(bucket, lane) of a flat slot index, to index the [buckets, 4] key and held views."""
    return slot >> _LANE_BITS, slot & (SLOTS_PER_BUCKET - 1)


def _int_keys(hashes) -> list[int]:
    """as_block_keys for the scalar paths: the keys as Python ints, 0 made 1."""
    return [int(key) or 1 for key in (hashes.tolist() if isinstance(hashes, np.ndarray) else hashes)]


def _u64(hashes) -> np.ndarray:
    """Block hashes as a uint64 array for the C calls (which read a 0 as the 1 it is stored as)."""
    return hashes if isinstance(hashes, np.ndarray) and hashes.dtype == _U64 else np.asarray(hashes, dtype=_U64)


class PrefixTableError(ValueError):
    pass


def _ring_order(keys: np.ndarray, capacity: int) -> np.ndarray:
    """A prompt's distinct block keys in the order its replica's ring takes them: last block
    first, so the CLOCK hand reaches a prompt's tail before its head, as a replica frees a
    sequence's blocks tail-first (vLLM, kvgate): a partly evicted prompt keeps a prefix, in the
    table as on the replica. Written in hash order, the hand took blocks from anywhere in the
    prompt, and losing its first block lost the table's whole match while the replica still held
    most of it. Beyond `capacity`, the earliest blocks are kept."""
    ordered = keys[np.sort(np.unique(keys, return_index=True)[1])[::-1]]
    return ordered[max(ordered.size - capacity, 0):]


def as_block_keys(hashes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block hashes as the table's uint64 keys (0 is the empty marker, so it becomes 1)."""
    keys = np.asarray(hashes, dtype=_U64) if not isinstance(hashes, np.ndarray) else hashes.astype(_U64, copy=False)
    if keys.size and not keys.all():
        keys = np.where(keys == 0, _ONE, keys)
    return keys


class _Ring:
    """One replica's blocks in CLOCK order. Entries whose replica bit is gone are free."""
    __slots__ = ("hashes", "seen", "pos")

    def __init__(self, capacity_blocks: int) -> None:
        self.hashes = np.zeros(capacity_blocks, dtype=_U64)
        self.seen = np.zeros(capacity_blocks, dtype=np.uint32)  # tick the entry was written or passed
        self.pos = np.zeros(2, dtype=np.int64)  # [fill, hand], in an array the C insert updates

    @property
    def fill(self) -> int:
        """Positions used so far (they fill in order, then the CLOCK hand reuses them)."""
        return int(self.pos[0])

    @fill.setter
    def fill(self, value: int) -> None:
        self.pos[0] = value

    @property
    def hand(self) -> int:
        return int(self.pos[1])

    @hand.setter
    def hand(self, value: int) -> None:
        self.pos[1] = value


class PrefixTable:
    native = True  # use routing/_prefix_match.c when built; False: the numpy path (tests compare)

    def __init__(self, expected_blocks: int = 1 << 16, guess_ttl_s: float = 300.0, clock=None) -> None:
        self.guess_ttl_ticks = int(guess_ttl_s * TICKS_PER_S)
        self._t0: float | None = None
        self._index: dict[str, int] = {}      # replica name -> bit
        self._bits = [None] * MAX_REPLICAS    # bit -> replica name
        self._rings: dict[str, _Ring] = {}
        # Per replica bit: blocks the table records for it, and blocks that ever became its (its
        # cache turnover), in one array the C insert updates.
        self._counts = np.zeros((2, MAX_REPLICAS), dtype=np.int64)
        self._sizes, self._written = self._counts
        self._capacities: dict[str, int] = {}
        self._bits_memo: dict[tuple[str, ...], tuple[tuple[int, ...], int]] = {}
        self._guessing = 0  # bits of replicas that may hold guesses (set by guessed inserts)
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
        self._bits_memo.clear()
        self._bits[free[0]] = replica
        self._rings[replica] = _Ring(capacity_blocks)  # its counts are 0: remove_replica zeroes a freed bit's
        self._capacities[replica] = capacity_blocks
        total = sum(len(r.hashes) for r in self._rings.values())
        if self._buckets_for(total) > self._nb:
            self._grow(self._buckets_for(total))

    def remove_replica(self, replica: str) -> None:
        if replica not in self._index:
            return
        self.clear(replica)
        bit = self._index.pop(replica)
        self._bits_memo.clear()
        self._bits[bit] = None
        self._guessing &= ~(1 << bit)
        self._counts[:, bit] = 0
        del self._rings[replica], self._capacities[replica]

    def resize(self, replica: str, capacity_blocks: int, now: float) -> None:
        """Give the replica a ring of `capacity_blocks` (its real KV capacity, learned late),
        keeping the blocks the table holds for it (the most recently written first, up to the
        new capacity; confirmed ones stay confirmed; guesses' TTL restarts). O(table): a
        once-per-replica event."""
        ring = self._rings[replica]
        if capacity_blocks == len(ring.hashes):
            return
        bit = _ONE << _U64(self._index[replica])
        capacity = len(ring.hashes)
        # Newest first, approximately: positions fill in order, then the CLOCK hand writes behind it.
        order = (np.arange(ring.fill)[::-1] if ring.fill < capacity
                 else (ring.hand - 1 - np.arange(capacity)) % capacity)
        keys = as_block_keys(ring.hashes[order])
        pos, found = self._find(keys)
        live = found & ((self._held[_cell(pos)] & bit) != 0)
        guessed = live & ((self._guessed[pos] & bit) != 0)
        keep_confirmed, keep_guessed = keys[live & ~guessed], keys[guessed]
        self.remove_replica(replica)
        self.add_replica(replica, capacity_blocks)
        for keys, is_guess in ((keep_guessed, True), (keep_confirmed, False)):  # confirmed: newer in the ring
            if keys.size:
                self.insert(replica, keys[:capacity_blocks], guessed=is_guess, now=now)  # newest first: written last

    def replicas(self) -> list[str]:
        return list(self._index)

    def capacity(self, replica: str) -> int:
        return self._capacities[replica]

    def capacities(self, replicas: Sequence[str]) -> list[int]:
        """capacity() of each replica, in one call."""
        capacities = self._capacities
        return [capacities[name] for name in replicas]

    def has_replica(self, replica: str) -> bool:
        return replica in self._index

    def fills(self, replicas: Sequence[str]) -> list[float]:
        """Fraction of each replica's capacity the table records as held (0 = empty cache)."""
        sizes, capacities, index = self._sizes.tolist(), self._capacities, self._index
        return [sizes[index[name]] / capacities[name] for name in replicas]

    def written(self, replicas: Sequence[str]) -> list[int]:
        """Blocks recorded as newly held by each replica since it was added (guessed or from its KV
        events, each block once until it is evicted): what its cache has taken in."""
        written, index = self._written.tolist(), self._index
        return [written[index[name]] for name in replicas]

    def size(self, replica: str) -> int:
        """Blocks the table records for this replica (guessed ones included until evicted)."""
        return int(self._sizes[self._index[replica]])

    def memory_bytes(self) -> int:
        """Bytes held by the table's arrays (slots + rings); Python object overhead is constant."""
        total = self._lines.nbytes + self._guessed.nbytes + self._stamp.nbytes
        return total + sum(r.hashes.nbytes + r.seen.nbytes for r in self._rings.values())

    # ---- lookups ----------------------------------------------------------------------
    def match(self, hashes, now: float, candidates: Iterable[str] | None = None) -> dict[str, int]:
        """Matched prefix length in blocks for every candidate (default: every replica)."""
        names = list(self._index if candidates is None else candidates)
        return dict(zip(names, self.match_lengths(hashes, now, names)))

    def match_lengths(self, hashes, now: float, candidates: Sequence[str]) -> list[int]:
        """Matched prefix length in blocks of each candidate, in the candidates' order.

        Per prompt block: its replica bitmask (0 when absent, guesses past their TTL removed),
        AND-accumulated along the prompt; a replica's match ends where its bit first drops (chain
        property). Cost is linear in the prompt's blocks, independent of the table's size, and
        stops once no candidate is left. One C call (routing/_prefix_match.c) where it was built,
        else the numpy path (`_match_numpy`, the reference; same answers).
        `hashes`: pass a uint64 array (a list costs a conversion, ~20 us for 500 blocks)."""
        bits, want = self._candidate_bits(candidates)
        # A uint64 array is used as is (no scan for zeros, ~1.5 us): a 0 in a lookup finds only
        # empty slots, whose bitmask is 0, so a block hashed to exactly 0 (odds 2**-64) reads as
        # absent instead of matching the 1 it was stored as.
        keys = hashes if isinstance(hashes, np.ndarray) and hashes.dtype == _U64 else as_block_keys(hashes)
        if self.native and _native is not None:
            return _native.match_lengths(self._lines, self._gs, keys, want, self._oldest_live(now, want), bits)
        return self._match_numpy(keys, now, bits, want)

    def _oldest_live(self, now: float, want: int) -> int:
        """Stamps below this are expired guesses; 0 when none can be (no TTL, or no candidate
        ever guessed, or the table younger than the TTL)."""
        if not self.guess_ttl_ticks or not self._guessing & want:
            return 0
        oldest = self._tick(now) - self.guess_ttl_ticks
        return oldest if oldest > 0 else 0

    def _match_numpy(self, keys: np.ndarray, now: float, bits: tuple[int, ...], want: int) -> list[int]:
        """match_lengths in numpy. Block 0 first, as one scalar probe: a prompt nobody holds (a
        new prefix) ends there. Otherwise one vectorised pass over all the prompt's blocks (~25
        numpy calls, no per-block Python)."""
        n = keys.size
        oldest_live = self._oldest_live(now, want)
        if not want or n == 0 or not self._probe(int(keys[0]), oldest_live) & want:
            return [0] * len(bits)
        prefix = np.bitwise_and.accumulate(self._held_per_key(keys, oldest_live))
        # prefix only loses bits along the prompt, so it changes value at most 64 times: a
        # short Python loop over those changes (not over blocks) turns them into lengths.
        ends = (prefix[1:] != prefix[:-1]).nonzero()[0]
        length_by_bit: dict[int, int] = {}
        alive = int(prefix[0]) & want
        for end, after in zip(ends.tolist(), prefix[1:].take(ends).tolist()):
            dropped = alive & ~after
            alive &= after
            while dropped:
                low = dropped & -dropped
                length_by_bit[low.bit_length() - 1] = end + 1
                dropped ^= low
            if not alive:
                break
        while alive:
            low = alive & -alive
            length_by_bit[low.bit_length() - 1] = n
            alive ^= low
        get = length_by_bit.get
        return [get(bit, 0) for bit in bits]

    def _candidate_bits(self, candidates: Sequence[str]) -> tuple[tuple[int, ...], int]:
        """Each candidate's bit (-1: unknown) and the bitmask of them all, memoised per candidate
        list (the pool rarely changes; add/remove_replica clear the memo)."""
        key = tuple(candidates)
        memo = self._bits_memo.get(key)
        if memo is None:
            bits = tuple([self._index.get(name, -1) for name in key])
            want = 0
            for bit in bits:
                if bit >= 0:
                    want |= 1 << bit
            if len(self._bits_memo) >= 64:
                self._bits_memo.clear()
            memo = self._bits_memo[key] = (bits, want)
        return memo

    def _probe(self, key: int, oldest_live: int) -> int:
        """One block's replica bitmask (guesses stamped before `oldest_live` removed; 0: none
        expire), in scalar Python."""
        slot, held = self._find_one(key)
        if slot >= 0 and oldest_live and int(self._stamp[slot]) < oldest_live:
            held &= ~int(self._guessed[slot])
        return held

    def _held_per_key(self, keys: np.ndarray, oldest_live: int) -> np.ndarray:
        """Replica bitmask of each key (0 where absent), guesses stamped before `oldest_live`
        removed (0: none expire).

        ~11 numpy calls, each over one long 1-D array (per-call overhead, ~1 us, is most of the
        cost; 2-D ops with 4- or 8-wide rows measured several times slower): one row gather of
        both candidate buckets of every key brings keys and held masks together (one 64-byte
        line per bucket), one compare of the gathered keys against each key repeated 8 times."""
        n = keys.size
        halves = (keys * _MIX).view(np.uint32) * self._nb_u64  # [2n]: both choices of every key
        halves >>= _SHIFT32
        buckets = halves.view(np.intp)
        lanes = self._lines.take(buckets, axis=0).reshape(-1)  # [2n * 8]: key, held, key, held...
        hits = (lanes[0::2] == keys.repeat(2 * SLOTS_PER_BUCKET)).nonzero()[0]
        # hit h: key h // 8, bucket buckets[h // 4] (= 2 * key + choice), lane h % 4
        found = lanes[1::2].take(hits)
        which = hits >> (_LANE_BITS + 1)
        if oldest_live:
            # The same rows' (guessed, stamp) records: hit h is record h of the gathered [2n, 4].
            records = self._gs_rows.take(buckets, axis=0).reshape(-1).take(hits)
            np.bitwise_and(found, ~records["guessed"], out=found, where=records["stamp"] < oldest_live)
        held = np.zeros(n, dtype=_U64)
        held[which] = found
        return held

    def holds(self, replica: str, hashes) -> np.ndarray:
        """Per block: does the table record it for this replica (TTL not applied)."""
        keys = as_block_keys(hashes)
        pos, found = self._find(keys)
        bit = _ONE << _U64(self._index[replica])
        return found & ((self._held[_cell(pos)] & bit) != 0)

    # ---- updates ----------------------------------------------------------------------
    def insert(self, replica: str, hashes, guessed: bool, now: float) -> None:
        """Record that `replica` holds these blocks (guessed: from a routing decision).

        A guess never downgrades a block a KV event confirmed; a confirmation clears the guess.
        One C call where routing/_prefix_match.c was built (a few us; the Python paths below, the
        reference, took 150-200 us for a 14-block prompt new to the replica, on every request)."""
        ring = self._rings[replica]  # KeyError: not a replica of this table
        if self.native and _native is not None:
            keys = _u64(hashes)
            if keys.size:
                index = self._index[replica]
                if guessed:
                    self._guessing |= 1 << index
                _native.insert(self._lines, self._gs, ring.hashes, ring.seen, ring.pos, self._counts, keys, index,
                               guessed, self._tick(now))
            return
        if len(hashes) <= _SMALL_INSERT:
            self._insert_small(replica, ring, hashes, guessed, now)
            return
        bit = _ONE << _U64(self._index[replica])
        keys = _ring_order(as_block_keys(hashes), len(ring.hashes))
        if keys.size == 0:
            return
        tick = self._tick(now)
        if guessed:
            self._guessing |= 1 << self._index[replica]
        pos, found = self._find(keys)
        # Existing slots: touch, and set the replica's bit where it was missing.
        fpos = pos[found]
        fcell = _cell(fpos)
        was_held = (self._held[fcell] & bit) != 0
        self._held[fcell] |= bit
        if guessed:
            newly = fpos[~was_held]
            self._guessed[newly] |= bit
        else:
            self._guessed[fpos] &= ~bit
        self._stamp[fpos] = tick
        new_keys = keys[~found]
        entering = ~found
        entering[np.flatnonzero(found)[~was_held]] = True
        ring_entries = keys[entering]  # in ring order (see _ring_order)
        if ring_entries.size == 0:
            return
        if ring_entries.size <= _SMALL_INSERT:  # a long prompt mostly held already: a few new entries
            slots = self._ring_slots_small(replica, ring, 1 << self._index[replica], ring_entries.size, tick,
                                           protect=set(keys.tolist()))
        else:
            slots = self._ring_slots(replica, ring, bit, ring_entries.size, tick, protect=keys)
        ring.hashes[slots] = ring_entries
        ring.seen[slots] = tick
        index = self._index[replica]
        self._sizes[index] += int(ring_entries.size)
        self._written[index] += int(ring_entries.size)
        if new_keys.size:
            self._place(np.sort(new_keys), bit, bit if guessed else _U64(0), tick)

    def _insert_small(self, replica: str, ring: _Ring, hashes, guessed: bool, now: float) -> None:
        """insert() of a few blocks in scalar Python: the same steps as the numpy path, whose ~40
        array calls cost ~150 us however few the blocks (a short prompt's guess, on every request;
        a replica's KV event batch of one engine step): ~1 us a block the replica holds already (a
        repeated prompt: stamps touched, a confirmation clears the guess), a few more for a block
        new to it (the ring's CLOCK in scalar too, _ring_slots_small)."""
        index = self._index[replica]
        bit = 1 << index
        keys = list(dict.fromkeys(reversed(_int_keys(hashes))))  # _ring_order's, in Python
        if not keys:
            return
        keys = keys[max(len(keys) - len(ring.hashes), 0):]
        tick = self._tick(now)
        if guessed:
            self._guessing |= bit
        lines, gs_guessed, stamp = self._lines, self._guessed, self._stamp
        entries, new_keys = [], []
        for key in keys:
            slot, held = self._find_one(key)
            if slot < 0:
                new_keys.append(key)
                entries.append(key)
                continue
            if not held & bit:
                lines[slot >> _LANE_BITS, 2 * (slot & (SLOTS_PER_BUCKET - 1)) + 1] = held | bit
                entries.append(key)
                if guessed:
                    gs_guessed[slot] = int(gs_guessed[slot]) | bit
            if not guessed:
                gs_guessed[slot] = int(gs_guessed[slot]) & ~bit
            stamp[slot] = tick
        if not entries:
            return
        slots = self._ring_slots_small(replica, ring, bit, len(entries), tick, protect=set(keys))
        for slot, key in zip(slots, entries):
            ring.hashes[slot] = key
            ring.seen[slot] = tick
        self._sizes[index] += len(entries)
        self._written[index] += len(entries)
        if new_keys:
            self._place_small(sorted(new_keys), bit, bit if guessed else 0, tick)

    def _choices(self, key: int) -> tuple[int, int]:
        """A key's two buckets, as _buckets computes them (scalar)."""
        mixed = (key * _MIX_INT) & _MASK64
        nb = self._nb
        return ((mixed & 0xFFFF_FFFF) * nb) >> 32, ((mixed >> 32) * nb) >> 32

    def _find_one(self, key: int) -> tuple[int, int]:
        """(flat slot, replica bitmask) of `key`, or (-1, 0) when absent (scalar _lookup)."""
        for bucket in self._choices(key):
            row = self._lines[bucket].tolist()  # key, held, key, held, ...
            lanes = row[0::2]
            if key in lanes:
                lane = lanes.index(key)
                return bucket * SLOTS_PER_BUCKET + lane, row[2 * lane + 1]
        return -1, 0

    def _place_small(self, keys: list[int], held: int, guessed: int, stamp: int) -> None:
        """_place for a few keys not in the table, in scalar Python, slot for slot as _place puts
        them: each key's less-full bucket as both stood before this call (the first choice when
        equally full), lanes in key order; the keys that found it full, then the other bucket as
        the buckets stand after that round; still no room (rare): _evict_into."""
        lines = self._lines
        pending = [(key, *self._choices(key)) for key in keys]
        for attempt in range(2):
            if not pending:
                return
            fills = [(int(np.count_nonzero(lines[first, 0::2])), int(np.count_nonzero(lines[second, 0::2])))
                     for _, first, second in pending]
            left = []
            for (key, first, second), (fill1, fill2) in zip(pending, fills):
                bucket = first if (fill1 <= fill2 if attempt == 0 else fill1 > fill2) else second
                row = lines[bucket, 0::2].tolist()
                if 0 not in row:
                    left.append((key, first, second))
                    continue
                lane = row.index(0)
                slot = bucket * SLOTS_PER_BUCKET + lane
                lines[bucket, 2 * lane] = key
                lines[bucket, 2 * lane + 1] = held
                self._guessed[slot] = guessed
                self._stamp[slot] = stamp
            pending = left
        for key, _, _ in pending:
            self._evict_into(key, held, guessed, stamp)

    def remove(self, replica: str, hashes) -> None:
        """The replica evicted these blocks (BlockRemoved)."""
        if self.native and _native is not None:
            keys = _u64(hashes)
            _native.remove(self._lines, self._gs, self._counts, keys, self._index[replica])
            return
        if len(hashes) <= _SMALL_INSERT:  # one engine step's evictions: scalar (numpy's calls cost ~40 us)
            slots = {self._find_one(key)[0] for key in _int_keys(hashes)}
            slots.discard(-1)
            self._drop_bit_small(replica, slots)
            return
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
        tick = int((now - self._t0) * TICKS_PER_S)
        return tick if tick > 0 else 0  # a conditional, not max(): ~4x cheaper, twice a request

    @staticmethod
    def _buckets_for(blocks: int) -> int:
        return max(-(-int(blocks / MAX_LOAD) // SLOTS_PER_BUCKET), 8)

    def _alloc(self, buckets: int) -> None:
        self._nb = buckets
        self._nb_u64 = _U64(buckets)
        n = buckets * SLOTS_PER_BUCKET
        # One 64-byte row per bucket: key, held, key, held, ... so the lookup's one row gather
        # brings both, and the gathered keys are one strided 1-D view (long numpy loops, not
        # 4-wide ones). _keys and _held are [buckets, 4] views, indexed by _cell(slot).
        self._lines = np.zeros((buckets, 2 * SLOTS_PER_BUCKET), dtype=_U64)
        self._keys = self._lines[:, 0::2]
        self._held = self._lines[:, 1::2]
        # Per slot, read only when a guess may expire: `guessed` and `stamp` packed side by side in
        # one 12-byte record (no padding: the same bytes as two arrays), so the match's expiry
        # check is one row gather of both choices' 4 records (aligned with the key lanes: a hit's
        # index picks its record) instead of slot arithmetic and two gathers. _guessed and _stamp
        # are flat [slots] views of the two fields.
        self._gs = np.zeros(n, dtype=_GUESS_RECORD)
        self._gs_rows = self._gs.reshape(buckets, SLOTS_PER_BUCKET)
        self._guessed = self._gs["guessed"]
        self._stamp = self._gs["stamp"]
        self._lane = np.arange(SLOTS_PER_BUCKET, dtype=np.intp)

    def _grow(self, buckets: int) -> None:
        live = np.flatnonzero(self._keys)  # flat slot indices (C order of the [buckets, 4] view)
        cell = _cell(live)
        keys, held = self._keys[cell], self._held[cell]
        guessed, stamp = self._guessed[live], self._stamp[live]
        self._alloc(buckets)
        self._place(keys, held, guessed, stamp)

    def _buckets(self, keys: np.ndarray) -> np.ndarray:
        """[n, 2] bucket indices per key (first, second choice), as intp.

        Multiply-shift, not modulo (64-bit division is the slow part of a lookup): the key is
        mixed by an odd multiplier, and each 32-bit half h of the product picks h * nb >> 32.
        The low half depends only on the key's low bits, the high half on all of them, so
        the two choices are independent and keys with zero top bits still spread evenly."""
        mixed = keys * _MIX
        halves = mixed.view(np.uint32).reshape(-1, 2) * self._nb_u64  # uint32 x uint64 -> uint64, < 2**64
        halves >>= _U64(32)
        return halves.view(np.intp)

    def _lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which keys are in the table, their flat slot indices): one row gather of both
        candidate buckets (16 slots) per key, one compare, one nonzero; no probe loop.
        A key sits in at most one slot; when both choices are the same bucket it shows up
        twice, with the same slot, which every caller tolerates."""
        buckets = self._buckets(keys).reshape(-1)
        rows = self._lines.take(buckets, axis=0)[:, 0::2]  # take on the strided view would copy the table
        hits = np.flatnonzero(rows.reshape(keys.size, 2 * SLOTS_PER_BUCKET) == keys[:, None])
        # hit h: key h // 8, bucket buckets[h // 4] (= 2 * key + choice), lane h % 4
        pos = (buckets.take(hits >> 2) << 2) | (hits & 3)
        return hits >> 3, pos

    def _find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Flat slot index and found flag per key (slot 0 where not found)."""
        which, slots = self._lookup(keys)
        pos = np.zeros(keys.size, dtype=np.intp)
        found = np.zeros(keys.size, dtype=bool)
        pos[which] = slots
        found[which] = True
        return pos, found

    def _place(self, keys, held, guessed, stamp) -> None:
        """Put keys that are not in the table into free slots of their less-full bucket."""
        n = len(keys)
        held, guessed, stamp = (np.broadcast_to(np.asarray(a), (n,)) for a in (held, guessed, stamp))
        pending = np.arange(n)
        for attempt in range(2):  # less-full bucket first, then the other one
            if pending.size == 0:
                return
            first, second = self._buckets(keys[pending]).T
            fill1 = (self._keys[first] != 0).sum(axis=1)
            fill2 = (self._keys[second] != 0).sum(axis=1)
            prefer_first = fill1 <= fill2 if attempt == 0 else fill1 > fill2
            bucket = np.where(prefer_first, first, second)
            order = np.argsort(bucket, kind="stable")
            sb = bucket[order]
            group_start = np.flatnonzero(np.r_[True, sb[1:] != sb[:-1]])
            rank = np.arange(sb.size) - np.repeat(group_start, np.diff(np.r_[group_start, sb.size]))
            free = self._keys[sb] == 0
            free_rank = np.cumsum(free, axis=1)
            ok = free_rank[:, -1] > rank
            lane = np.argmax((free_rank == (rank + 1)[:, None]) & free, axis=1)
            slot = sb * SLOTS_PER_BUCKET + lane
            who = pending[order][ok]
            slot = slot[ok]
            cell = _cell(slot)
            self._keys[cell] = keys[who]
            self._held[cell] = held[who]
            self._guessed[slot] = guessed[who]
            self._stamp[slot] = stamp[who]
            pending = np.sort(pending[order][~ok])
        for i in pending:
            self._evict_into(keys[i], held[i], guessed[i], stamp[i])

    def _evict_into(self, key, held, guessed, stamp) -> None:
        """A key that found no room in its two buckets (rare) takes the slot of their least
        recently touched block (the first such of the 8), which every holder loses."""
        first, second = self._choices(int(key))
        idx = np.r_[first * SLOTS_PER_BUCKET + self._lane, second * SLOTS_PER_BUCKET + self._lane]
        victim = idx[np.argmin(self._stamp[idx])]
        self._forget_slot(int(victim))
        self._keys[_cell(victim)], self._held[_cell(victim)] = key, held
        self._guessed[victim], self._stamp[victim] = guessed, stamp

    def _forget_slot(self, slot: int) -> None:
        cell = _cell(slot)
        mask = int(self._held[cell])
        while mask:
            low = mask & -mask
            self._sizes[low.bit_length() - 1] -= 1
            mask ^= low
        self._keys[cell] = self._held[cell] = self._guessed[slot] = 0

    def _drop_bit(self, replica: str, pos: np.ndarray) -> None:
        bit = _ONE << _U64(self._index[replica])
        pos = np.unique(pos[(self._held[_cell(pos)] & bit) != 0])
        if pos.size == 0:
            return
        cell = _cell(pos)
        self._held[cell] &= ~bit
        self._guessed[pos] &= ~bit
        emptied = pos[self._held[cell] == 0]
        self._keys[_cell(emptied)] = 0
        self._sizes[self._index[replica]] -= int(pos.size)

    def _drop_bit_small(self, replica: str, slots) -> None:
        """_drop_bit for a few distinct flat slots, in scalar Python."""
        bit = 1 << self._index[replica]
        lines, guessed = self._lines, self._guessed
        dropped = 0
        for slot in slots:
            bucket, lane = slot >> _LANE_BITS, slot & (SLOTS_PER_BUCKET - 1)
            held = int(lines[bucket, 2 * lane + 1])
            if not held & bit:
                continue
            held &= ~bit
            lines[bucket, 2 * lane + 1] = held
            guessed[slot] = int(guessed[slot]) & ~bit
            if not held:
                lines[bucket, 2 * lane] = 0
            dropped += 1
        self._sizes[self._index[replica]] -= dropped

    def _ring_slots_small(self, replica: str, ring: _Ring, bit: int, need: int, tick: int,
                          protect: set[int]) -> list[int]:
        """_ring_slots for a few entries, in scalar Python, position for position what it hands
        out and marks: the same windows and passes, but a window's positions are looked at only
        up to the last one it takes (numpy looks at 64 to take one: ~80 us), and the bits of its
        victims dropped once the window is done, as numpy does."""
        capacity = len(ring.hashes)
        take = min(need, capacity - ring.fill)
        slots = list(range(ring.fill, ring.fill + take))
        ring.fill += take
        need -= take
        if need <= 0:
            return slots
        given = set(slots)
        hashes, seen, stamp, find = ring.hashes, ring.seen, self._stamp, self._find_one
        passes = 0
        while need > 0:
            width = min(capacity, max(2 * need, 64))
            victims, recent_at = [], []  # (offset, ring position, flat slot or -1 when dead); (offset, position)
            for offset in range(width):
                position = (ring.hand + offset) % capacity
                key = int(hashes[position]) or 1
                slot, held = find(key)
                live = slot >= 0 and held & bit
                if live and ((passes < 2 and int(stamp[slot]) > int(seen[position]))
                             or (passes < 3 and key in protect)):  # never what is being inserted now
                    recent_at.append((offset, position))
                elif position not in given:
                    victims.append((offset, position, slot if live else -1))
                    if len(victims) == need:
                        break
            last = victims[-1][0] + 1 if victims else width  # the window ends at its last victim
            for offset, position in recent_at:
                if offset < last:
                    seen[position] = tick  # second chance used up
            positions = [position for _, position, _ in victims]
            given.update(positions)
            self._drop_bit_small(replica, {slot for _, _, slot in victims if slot >= 0})
            slots.extend(positions)
            need -= len(victims)
            ring.hand = (ring.hand + last) % capacity
            passes += 1 if last == width else 0
        return slots

    def _ring_slots(self, replica: str, ring: _Ring, bit, need: int, tick: int, protect) -> np.ndarray:
        """`need` ring positions for new entries: unused ones first, then CLOCK victims."""
        capacity = len(ring.hashes)
        take = min(need, capacity - ring.fill)
        slots = [np.arange(ring.fill, ring.fill + take)]
        ring.fill += take
        need -= take
        passes = 0
        given = None  # positions handed out by this call: hold no live entry yet, must not be handed out twice
        if need > 0:
            given = np.zeros(capacity, dtype=bool)
            given[slots[0]] = True
        while need > 0:
            window = (ring.hand + np.arange(min(capacity, max(2 * need, 64)))) % capacity
            hashes = ring.hashes[window]
            pos, found = self._find(as_block_keys(hashes))
            live = found & ((self._held[_cell(pos)] & bit) != 0)
            recent = live & (self._stamp[pos] > ring.seen[window]) & (passes < 2)
            if passes < 3:  # never evict what is being inserted now (unless nothing else is left)
                recent |= live & np.isin(hashes, protect)
            evictable = ~recent & ~given[window]
            chosen = np.flatnonzero(evictable)[:need]
            last = int(chosen[-1]) + 1 if chosen.size else len(window)
            passed = window[:last]
            ring.seen[passed[recent[:last]]] = tick  # second chance used up
            victims = window[chosen]
            given[victims] = True
            self._drop_bit(replica, pos[chosen][live[chosen]])
            slots.append(victims)
            need -= chosen.size
            ring.hand = (ring.hand + last) % capacity
            passes += 1 if last == len(window) else 0
        return np.concatenate(slots)
