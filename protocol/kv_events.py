"""KV event wire structs in vLLM's shape (DESIGN contract 2): the one definition, used by the
replica's publisher and the gateway's subscriber.

What vLLM 0.33.0 publishes (vllm/distributed/kv_events.py in its wheel), and what we publish:
  KVEventBatch  msgpack ARRAY [ts, events, data_parallel_rank]
  each event    msgpack MAP tagged by class name under "type" (msgspec `tag=True`), fields in
                declaration order, defaults omitted (`omit_defaults`) except lora_id, medium,
                lora_name, which have no default and are always written (null when unset):
                {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
                 "block_size", "lora_id", "medium", "lora_name", "extra_keys"?, "group_idx"?, ...}
  block hashes  int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default: the low 64 bits of the
                digest, big-endian) or bytes (the raw sha256 digest when that is 0)
  extra_keys    one entry per block, None or a tuple of untagged keys: the LoRA name (when
                lora_name is set), (mm_identifier, offset) pairs, the cache_salt (first block of
                a chain only), prompt-embeds digests (bytes)

`decode_batch` reads that, and the older forms: events as msgpack arrays tagged by class name
as their first element (vLLM before the map events; SGLang) with fields in the same order, and
a batch written as a map. Fields we do not know are ignored; an event type we do not know is
dropped (a newer replica's extra event kind must not stop precise routing).

Wire: PUB multipart [topic, seq (8 bytes big-endian), payload]. Replay: a ROUTER socket; a client
sends [b"", first wanted seq (8 bytes BE)] (a DEALER; a REQ adds the empty frame itself) and gets,
per buffered batch from there on, [b"", topic, seq, payload], then [b"", b"", END_SEQ, b""]. Older
vLLM answered without the topic frame: read the last two frames and both forms work.
"""
from __future__ import annotations

from typing import Any

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_TOPIC = "kv-events"
MEDIUM_GPU = "GPU"  # vLLM's label for the engine's own KV cache tier (its block pool), on any device

BlockHash = int | bytes


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# ---- the older forms, read only ------------------------------------------------------------------
# Array events: the same fields in the same order (vLLM only ever appended), every one after
# block_size optional because older releases stopped earlier. Decoded, they become the structs above.

class _ArrayBlockStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _ArrayBlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _ArrayAllBlocksCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _RawMapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_EVENT_KINDS = frozenset(("BlockStored", "BlockRemoved", "AllBlocksCleared"))
_decode_current = msgspec.msgpack.Decoder(KVEventBatch).decode
_decode_raw_batch = msgspec.msgpack.Decoder(_RawBatch).decode
_decode_raw_map_batch = msgspec.msgpack.Decoder(_RawMapBatch).decode
_decode_map_event = msgspec.msgpack.Decoder(KVEvent).decode
_decode_array_event = msgspec.msgpack.Decoder(_ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared).decode
_decode_any = msgspec.msgpack.Decoder().decode
_FROM_ARRAY = {_ArrayBlockStored: BlockStored, _ArrayBlockRemoved: BlockRemoved,
               _ArrayAllBlocksCleared: AllBlocksCleared}

encode_batch = msgspec.msgpack.Encoder().encode


def decode_batch(payload: bytes) -> KVEventBatch:
    """A KVEventBatch in any form a vLLM (or SGLang) replica sends. Raises msgspec.DecodeError /
    ValidationError on a payload that is none of them."""
    try:
        return _decode_current(payload)  # vLLM 0.33.0's form and ours: one call
    except msgspec.ValidationError:
        pass
    # Per event, slower: older forms, a batch written as a map, or an event type we do not know.
    raw = (_decode_raw_map_batch if _is_map(payload) else _decode_raw_batch)(payload)
    events = [event for event in map(_decode_event, raw.events) if event is not None]
    return KVEventBatch(raw.ts, events, raw.data_parallel_rank)


def _decode_event(raw: msgspec.Raw) -> KVEvent | None:
    try:
        if _is_map(raw):
            return _decode_map_event(raw)
        legacy = _decode_array_event(raw)
        return _FROM_ARRAY[type(legacy)](*msgspec.structs.astuple(legacy))
    except msgspec.ValidationError:
        value = _decode_any(raw)
        kind = value.get("type") if isinstance(value, dict) else value[0] if isinstance(value, list) and value else None
        if kind in _EVENT_KINDS:
            raise  # a kind we know, malformed: the batch is bad
        return None  # a kind we do not know: skipped


def _is_map(data) -> bool:
    """msgpack map markers: fixmap 0x80-0x8f, map16 0xde, map32 0xdf."""
    first = memoryview(data)[0]
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
