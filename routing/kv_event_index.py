"""Precise mode without sockets: apply one replica's decoded KV events to the prefix table.

Events carry token IDs, so we rebuild OUR hash chain from them (DESIGN contract 2): our hash
of a stored block = hash_block(our hash of its parent, its tokens). The replica's own hashes
are only names (replica hash -> our hash), so its hash function or seed never matters.
Events are duck-typed (anything with vLLM's field names: BlockStored.block_hashes,
parent_block_hash, token_ids, block_size; BlockRemoved.block_hashes; AllBlocksCleared).
"""
from __future__ import annotations

from routing.hashing import ROOT_HASH, hash_block
from routing.prefix_table import PrefixTable


class KVEventIndex:
    def __init__(self, table: PrefixTable, replica: str, block_size: int = 16) -> None:
        self.table = table
        self.replica = replica
        self.block_size = block_size
        self.ours: dict[int, int] = {}  # replica's block hash -> our block hash; bounded by its cache
        self.next_seq: int | None = None
        self.orphans = 0  # stored blocks whose parent we never saw (skipped: unmatchable anyway)

    def apply(self, seq: int, batch, now: float) -> int | None:
        """Apply live batch `seq`. Returns the first missing seq when a gap is seen (ask the
        replay endpoint from there and feed its batches, in order, to `replay`), else None.
        The batch is applied anyway; replaying from the gap re-applies it in order, and
        stores/removes are idempotent, so the index ends equal to the replica's cache."""
        if self.next_seq is not None and seq < self.next_seq:
            return None  # already seen (replay overlap or duplicate)
        gap_from = self.next_seq if self.next_seq is not None and seq > self.next_seq else None
        self._apply_events(batch, now)
        self.next_seq = seq + 1
        return gap_from

    def replay(self, seq: int, batch, now: float) -> None:
        """One batch from the replay endpoint (they come in order from the requested seq)."""
        self._apply_events(batch, now)
        self.next_seq = max(self.next_seq or 0, seq + 1)

    def _apply_events(self, batch, now: float) -> None:
        for event in batch.events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(event, now)
            elif kind == "BlockRemoved":
                ours = [self.ours.pop(h) for h in event.block_hashes if h in self.ours]
                self.table.remove(self.replica, ours)
            elif kind == "AllBlocksCleared":
                self.ours.clear()
                self.table.clear(self.replica)

    def _stored(self, event, now: float) -> None:
        size = event.block_size
        if size % self.block_size:
            raise ValueError(f"replica block size {size} is not a multiple of ours ({self.block_size})")
        parent_theirs = event.parent_block_hash
        if parent_theirs is None:
            parent = ROOT_HASH
        elif parent_theirs in self.ours:
            parent = self.ours[parent_theirs]
        else:
            self.orphans += len(event.block_hashes)
            return
        tokens = event.token_ids
        ours: list[int] = []
        for i, theirs in enumerate(event.block_hashes):
            # A replica block of k * our block size covers k of our blocks; we name it by the last.
            for j in range(size // self.block_size):
                start = i * size + j * self.block_size
                parent = hash_block(parent, tokens[start:start + self.block_size])
                ours.append(parent)
            self.ours[theirs] = parent
        self.table.insert(self.replica, ours, guessed=False, now=now)
