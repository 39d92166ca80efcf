"""What a KV event subscriber holds after applying decoded batches in sequence order: the
simplest possible index, the reference the replica's own cache contents are compared with.
Events are read by class name, so batches decoded with kvgate's structs (protocol/kv_events.py)
and with vLLM's own (tests/vllm_kv_events_033.py) both work."""
from __future__ import annotations


def replay_into_index(batches_by_seq: dict) -> set[int]:
    index: set[int] = set()
    for seq in sorted(batches_by_seq):
        for event in batches_by_seq[seq].events:
            kind = type(event).__name__
            if kind == "BlockStored":
                index.update(event.block_hashes)
            elif kind == "BlockRemoved":
                index.difference_update(event.block_hashes)
            elif kind == "AllBlocksCleared":
                index.clear()
    return index
