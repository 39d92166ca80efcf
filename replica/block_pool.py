"""The paged KV cache's bookkeeping: a fixed pool of blocks, reference counts, and the prefix
cache (block hash -> block) with least-recently-used eviction. Pure Python, no tensors: the
tensors live in the model runner and are indexed by the block IDs handed out here.

A block is in exactly one of three states:
  in use      ref_count > 0 (some sequence's block table holds it)
  cached free ref_count == 0, has a hash, sits in the LRU queue: reusable by a prefix hit
              until it is evicted to serve an allocation
  empty free  ref_count == 0, no hash, sits at the front of the LRU queue (taken first)
Every change to the set of cached hashes is recorded as a KV event (contract 2), so a
subscriber that applies the events holds exactly `cached_hashes()`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


class NoFreeBlocks(Exception):
    """Raised when an allocation cannot be served; the scheduler preempts and retries."""


@dataclass
class StoredEvent:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    cache_salt: str | None = None  # the salt hashed into the first block (vLLM's extra_keys)


@dataclass
class RemovedEvent:
    block_hashes: list[int]


@dataclass
class ClearedEvent:
    pass


@dataclass
class _Block:
    ref_count: int = 0
    block_hash: int | None = None


@dataclass
class BlockPool:
    num_blocks: int
    block_size: int
    events: list = field(default_factory=list)  # drained by the engine after each step

    def __post_init__(self) -> None:
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        self._blocks = [_Block() for _ in range(self.num_blocks)]
        # Ordered oldest-first: allocation takes from the front, release appends at the back.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (what vLLM exports as kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    def cached_hashes(self) -> set[int]:
        return set(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def longest_cached_prefix(self, block_hashes: list[int]) -> list[int]:
        """Block IDs of the longest run of `block_hashes` (from the start) that is cached.
        Linear in the matched length; the chain property means one miss ends the prefix."""
        found = []
        for block_hash in block_hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    # ---- changes ---------------------------------------------------------------------
    def acquire(self, block_ids: list[int]) -> None:
        """Take a reference on blocks found by `longest_cached_prefix` (a prefix-cache hit)."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks, evicting the least recently used cached ones if needed."""
        if count > len(self._free):
            raise NoFreeBlocks(f"need {count} blocks, {len(self._free)} free")
        out = []
        evicted = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_count = 1
            out.append(block_id)
        if evicted:
            self.events.append(RemovedEvent(evicted))
        return out

    def commit(self, block_id: int, block_hash: int, parent_hash: int | None,
               token_ids: list[int], cache_salt: str | None = None) -> int:
        """Register a just-filled block in the prefix cache. If another block already holds the
        same hash (two sequences computed it concurrently) the existing one stays canonical and
        this block stays private; returns the block ID that is cached under the hash.
        `cache_salt`: the salt hashed into this block (a sequence's first block), for the event."""
        existing = self._cached.get(block_hash)
        if existing is not None:
            return existing
        block = self._blocks[block_id]
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        self.events.append(StoredEvent([block_hash], parent_hash, list(token_ids), self.block_size, cache_salt))
        return block_id

    def release(self, block_ids: list[int]) -> None:
        """Drop a sequence's references. Its cached blocks are queued tail-first, so a later block
        of a sequence is evicted before an earlier one (the earlier ones are shared by more
        prompts). A block without a hash (the partial last one, a private duplicate) holds nothing
        reusable: it goes to the front, the next allocation's, so it never pushes cached content
        out (at the back, each finished request's partial block took a slot from the cache until
        it aged out: ~2% of a small cache at a few requests a second)."""
        free = self._free
        for block_id in reversed(block_ids):
            block = self._blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} released more often than acquired")
            block.ref_count -= 1
            if block.ref_count == 0:
                free[block_id] = None
                if block.block_hash is None:
                    free.move_to_end(block_id, last=False)

    def touch(self, block_ids: list[int]) -> None:
        """Mark free cached blocks as recently used (a hit that did not take a reference)."""
        for block_id in block_ids:
            if block_id in self._free:
                self._free.move_to_end(block_id)

    def clear_cache(self) -> None:
        """Forget every cached hash (blocks in use stay allocated)."""
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()
        self.events.append(ClearedEvent())

    def drain_events(self) -> list:
        events, self.events = self.events, []
        return events
