"""KV event wire structs in vLLM's shape (DESIGN contract 2): the one definition, used by the
replica's publisher and the gateway's subscriber.

msgpack, array_like, tagged by class name, so a vLLM subscriber decodes ours and ours decodes
vLLM's; trailing fields that newer vLLM versions add are ignored (array_like allows them).

Wire: PUB multipart [topic, seq (8 bytes big-endian), msgpack(KVEventBatch)]. Replay: a ROUTER
socket; a DEALER sends [b"", first wanted seq (8 bytes BE)] and gets [b"", seq, payload] for each
buffered batch from there on, then [b"", END_SEQ, b""]. (A REQ socket would keep only the first.)
"""
from __future__ import annotations

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_TOPIC = "kv-events"


class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, tag=True, gc=False):
    block_hashes: list[int | bytes]  # vLLM >= 0.10 may send bytes
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag=True, gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, tag=True, gc=False):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


encode_batch = msgspec.msgpack.Encoder().encode
decode_batch = msgspec.msgpack.Decoder(KVEventBatch).decode


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
