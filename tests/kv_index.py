"""What a KV event subscriber holds after applying decoded batches in sequence order: the
simplest possible index, the reference the replica's own cache contents are compared with."""
from __future__ import annotations

from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def replay_into_index(batches_by_seq: dict[int, KVEventBatch]) -> set[int]:
    index: set[int] = set()
    for seq in sorted(batches_by_seq):
        for event in batches_by_seq[seq].events:
            if isinstance(event, BlockStored):
                index.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                index.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                index.clear()
    return index
