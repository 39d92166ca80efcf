"""KV events in vLLM's wire shape (DESIGN contract 2), published over ZMQ.

Wire format, as vLLM's ZmqEventPublisher:
  PUB socket      multipart [topic, seq (8 bytes big-endian), msgpack(KVEventBatch)]
  replay socket   ROUTER; a REQ client sends the first seq it wants (8 bytes big-endian)
                  and gets [seq, payload] replies for every buffered batch from there on,
                  then [END_SEQ, b""] (END_SEQ = -1 as 8 signed bytes).
Structs are array_like msgspec Structs with tags (the class name), so a vLLM subscriber
decodes ours and ours decodes vLLM's.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from replica.block_pool import ClearedEvent, RemovedEvent, StoredEvent

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_TOPIC = "kv-events"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of all KV cache events; the tag is the class name, as in vLLM."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def to_wire(event) -> KVCacheEvent:
    """Block-pool event (plain dataclass) -> wire struct."""
    if isinstance(event, StoredEvent):
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size)
    if isinstance(event, RemovedEvent):
        return BlockRemoved(event.block_hashes)
    if isinstance(event, ClearedEvent):
        return AllBlocksCleared()
    raise TypeError(f"not a KV event: {event!r}")


class KVEventPublisher:
    """Publishes batches on a PUB socket and answers replay requests from a ring buffer.

    `publish` is called from the engine thread; a background thread owns both sockets (ZMQ
    sockets are not thread-safe), fed through a queue so the engine never blocks on I/O."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None,
                 topic: str = DEFAULT_TOPIC, buffer_steps: int = 10_000):
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pending: deque[bytes] = deque()
        self._seq = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=10)
        if self._error is not None:
            raise self._error

    def publish(self, events: list) -> None:
        if not events:
            return
        batch = KVEventBatch(ts=time.time(), events=[to_wire(e) for e in events])
        payload = _encoder.encode(batch)
        with self._lock:
            self._pending.append(payload)
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        context = zmq.Context.instance()
        try:
            pub = context.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(self.endpoint)
            router = None
            if self.replay_endpoint:
                router = context.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.bind(self.replay_endpoint)
        except BaseException as exc:  # surfaced to the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        if router is not None:
            poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                # Short polls: replay requests are rare, published batches are the hot path.
                if router is not None and poller.poll(timeout=5):
                    self._serve_replay(router)
                elif router is None:
                    self._wake.wait(timeout=0.05)
                self._wake.clear()
                while True:
                    with self._lock:
                        if not self._pending:
                            break
                        payload = self._pending.popleft()
                    seq_bytes = self._seq.to_bytes(8, "big")
                    self._buffer.append((self._seq, payload))
                    self._seq += 1
                    pub.send_multipart((self.topic, seq_bytes, payload), copy=False)
        finally:
            pub.close()
            if router is not None:
                router.close()

    def _serve_replay(self, router) -> None:
        frames = router.recv_multipart()
        identity, start = frames[0], frames[-1]
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                router.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        router.send_multipart((identity, b"", END_SEQ, b""))
