"""KV event wire structs in vLLM's shape (DESIGN contract 2), for decoding only: msgpack,
array_like, tagged by class name, so a vLLM publisher and kvgate's replica decode the same.
Trailing fields added by newer vLLM versions are ignored (array_like structs allow them).

Wire: PUB multipart [topic, seq (8 bytes big-endian), msgpack(KVEventBatch)]; replay: a
DEALER sends [b"", start_seq 8 bytes BE] and gets [b"", seq, payload]... then [b"", END_SEQ, b""].
"""
from __future__ import annotations

import msgspec

END_SEQ = -1  # as 8 signed big-endian bytes on the wire


class BlockStored(msgspec.Struct, array_like=True, tag=True, gc=False):
    block_hashes: list[int | bytes]  # vLLM >= 0.10 may send bytes
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, array_like=True, tag=True, gc=False):
    block_hashes: list[int | bytes]  # vLLM >= 0.10 may send bytes
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, array_like=True, tag=True, gc=False):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


decode_batch = msgspec.msgpack.Decoder(KVEventBatch).decode


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
