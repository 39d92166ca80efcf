"""Precise mode without sockets: apply one replica's decoded KV events to the prefix table.

Events carry token IDs, so we rebuild OUR hash chain from them (DESIGN contract 2): our hash
of a stored block = hash_block(our hash of its parent, its tokens), with the cache_salt that
vLLM reports in the first block's `extra_keys` entering block 0 as routing/hashing does it (a
salted block never matches an unsalted prompt). The replica's own hashes are only names
(replica hash -> our hash), so its hash function or seed never matters; names arrive as int or
as bytes (vLLM's sha256 digests) and are folded to vLLM's own int form (low 64 bits, big-endian).

Events are duck-typed (anything with vLLM's field names: BlockStored.block_hashes,
parent_block_hash, token_ids, block_size; BlockRemoved.block_hashes; AllBlocksCleared); the
optional fields of vLLM 0.33.0 are read when present:
  medium, group_idx, locality, ownership  who holds a block. A hybrid model stores the same
      block in each KV cache group and a sliding-window group drops it early; an offload tier
      (medium CPU) keeps it after the GPU evicts it. A block stays matchable while any holder
      has it; a removal drops only the holders it names.
  lora_name / lora_id  the block holds an adapter's KV, not the base model's: skipped.
  extra_keys  per block: the cache_salt (a string; vLLM sends it for a chain's first block) is
      hashed in; a multimodal item (mm_identifier, offset) or a prompt-embeds digest (bytes)
      makes the KV depend on more than the tokens: that block and the rest of its chain are
      skipped (unmatchable from token IDs).
A store without tokens (an offload tier reporting a block by hash only) adds a holder to a
block we already know and is otherwise skipped.
"""
from __future__ import annotations

from routing.hashing import ROOT_HASH, block_hashes, hash_block
from routing.prefix_table import PrefixTable

_LOW_64_BITS = (1 << 64) - 1


def block_name(block_hash: int | bytes) -> int:
    """A replica's block hash as an int, the way vLLM turns its digests into ints for events."""
    if type(block_hash) is int:
        return block_hash
    return int.from_bytes(block_hash, "big") & _LOW_64_BITS


class KVEventIndex:
    def __init__(self, table: PrefixTable, replica: str, block_size: int = 16) -> None:
        self.table = table
        self.replica = replica
        self.block_size = block_size
        self.ours: dict[int, int] = {}  # replica's block name -> our block hash; bounded by its cache
        # name -> its holder (medium, group_idx, locality, ownership), or a set when several hold it
        self.holders: dict[int, tuple | set[tuple]] = {}
        self.next_seq: int | None = None
        self.orphans = 0  # stored blocks whose parent we never saw (skipped: unmatchable anyway)
        self.unmatchable = 0  # stored blocks whose KV depends on more than tokens (LoRA, images)

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
                self._removed(event)
            elif kind == "AllBlocksCleared":
                self.ours.clear()
                self.holders.clear()
                self.table.clear(self.replica)

    def _stored(self, event, now: float) -> None:
        names = [block_name(h) for h in event.block_hashes]
        holder = _holder(event)
        size = event.block_size
        tokens = event.token_ids
        if not size or not tokens:  # known by hash only: another holder of a block we know
            for name in names:
                if name in self.ours:
                    self._hold(name, holder)
            return
        if size % self.block_size:
            raise ValueError(f"replica block size {size} is not a multiple of ours ({self.block_size})")
        if getattr(event, "lora_name", None) is not None or getattr(event, "lora_id", None) is not None:
            self.unmatchable += len(names)
            return
        parent_theirs = event.parent_block_hash
        if parent_theirs is None:
            parent = ROOT_HASH
        else:
            parent = self.ours.get(block_name(parent_theirs))
            if parent is None:
                self.orphans += len(names)
                return
        extra_keys = getattr(event, "extra_keys", None)
        count = min(len(names), len(tokens) // size)
        if size == self.block_size and not (extra_keys and any(extra_keys[1:count])):
            # The common event: our block size, no extra keys past the first block's cache_salt.
            # One block_hashes call for the chain (~1 us a block less than a call per block).
            first = extra_keys[0] if extra_keys and count else None
            if not first or _salt(first) is not None:  # no salt, or one cache_salt string
                ours = block_hashes(tokens[:count * size], size, first[0] if first else None, parent)
                for name, block in zip(names, ours):
                    self.ours[name] = block
                    self._hold(name, holder)
                self.table.insert(self.replica, ours, guessed=False, now=now)
                return
        ours: list[int] = []
        for i, name in enumerate(names[:count]):
            salt = b""
            if extra_keys and i < len(extra_keys) and extra_keys[i]:
                salt = _salt(extra_keys[i])
                if salt is None:
                    self.unmatchable += len(names) - i  # this block's KV and its children's
                    break
            # A replica block of k * our block size covers k of our blocks; we name it by the last.
            for j in range(size // self.block_size):
                start = i * size + j * self.block_size
                parent = hash_block(parent, tokens[start:start + self.block_size], salt if j == 0 else b"")
                ours.append(parent)
            self.ours[name] = parent
            self._hold(name, holder)
        self.table.insert(self.replica, ours, guessed=False, now=now)

    def _removed(self, event) -> None:
        holder = _holder(event)
        gone = []
        for name in map(block_name, event.block_hashes):
            if name in self.ours and self._release(name, holder):
                gone.append(self.ours.pop(name))
        self.table.remove(self.replica, gone)

    def _hold(self, name: int, holder: tuple) -> None:
        held = self.holders.get(name)
        if held is None or held == holder:
            self.holders[name] = holder  # the common case: one holder, no set allocated
        elif type(held) is set:
            held.add(holder)
        else:
            self.holders[name] = {held, holder}

    def _release(self, name: int, holder: tuple) -> bool:
        """Drop the holders a removal names; True when none is left (the block left the replica).
        A field the removal or the store left unset (None) matches any value: a producer that
        labels one and not the other must not leave blocks behind forever."""
        held = self.holders.get(name)
        if held == holder:  # the common case
            del self.holders[name]
            return True
        left = {h for h in (held if type(held) is set else (held,)) if not _same_holder(h, holder)}
        if left:
            self.holders[name] = left if len(left) > 1 else left.pop()
            return False
        del self.holders[name]
        return True


def _holder(event) -> tuple:
    return (getattr(event, "medium", None), getattr(event, "group_idx", None),
            getattr(event, "locality", None), getattr(event, "ownership", None))


def _same_holder(a: tuple, b: tuple) -> bool:
    return all(x is None or y is None or x == y for x, y in zip(a, b))


def _salt(keys) -> bytes | None:
    """The cache_salt's bytes from a block's (non-empty) untagged extra keys, or None when they
    hold anything but one cache_salt (images, prompt embeddings: KV not fixed by the tokens)."""
    if len(keys) != 1 or not isinstance(keys[0], str):
        return None
    return keys[0].encode()
