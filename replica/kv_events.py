"""The replica's KV event publisher (DESIGN contract 2): block-pool events go out over ZMQ as
vLLM 0.33.0's engine publishes them (protocol/kv_events.py holds the structs and the framing):
the fields its block pool sets, with the values it sets for a request without LoRA or images."""
from __future__ import annotations

import os
import threading
import time
from collections import deque

import zmq

from protocol.kv_events import (DEFAULT_TOPIC, END_SEQ, MEDIUM_GPU, AllBlocksCleared, BlockRemoved,
                                BlockStored, KVEventBatch, encode_batch, encode_seq)
from replica.block_pool import ClearedEvent, RemovedEvent, StoredEvent


GROUP_IDX = 0  # one KV cache group (full attention), as vLLM numbers it
DATA_PARALLEL_RANK = 0  # vLLM's publisher stamps its rank on every batch


def to_wire(event) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """Block-pool event (plain dataclass) -> wire struct."""
    if isinstance(event, StoredEvent):
        # vLLM sends one extra_keys entry per block, None when a block has none; the
        # cache_salt belongs to the first block of a sequence (parent None) only.
        extra_keys: list[tuple | None] = [None] * len(event.block_hashes)
        if event.cache_salt and event.parent_block_hash is None:
            extra_keys[0] = (event.cache_salt,)
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                           lora_id=None, medium=MEDIUM_GPU, lora_name=None, extra_keys=extra_keys,
                           group_idx=GROUP_IDX)
    if isinstance(event, RemovedEvent):
        return BlockRemoved(event.block_hashes, medium=MEDIUM_GPU, group_idx=GROUP_IDX)
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
        # The thread sleeps in one poll on the replay socket and this counter (publish adds 1, the
        # thread's read takes them all); no timeout: an idle replica's publisher does not wake (a
        # 5 ms poll woke it 200 times a second).
        self._wake = os.eventfd(0, os.EFD_NONBLOCK)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=10)
        if self._error is not None:
            self._close_wake()
            raise self._error

    def publish(self, events: list) -> None:
        if not events:
            return
        batch = KVEventBatch(ts=time.time(), events=[to_wire(e) for e in events],
                             data_parallel_rank=DATA_PARALLEL_RANK)
        payload = encode_batch(batch)
        with self._lock:
            self._pending.append(payload)
            self._signal()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._signal()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._close_wake()

    def _signal(self) -> None:
        """Wake the thread (the caller holds the lock: the counter may be closed)."""
        if self._wake >= 0:
            os.eventfd_write(self._wake, 1)

    def _close_wake(self) -> None:
        with self._lock:
            if self._wake >= 0:
                os.close(self._wake)
            self._wake = -1

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
                # A full replay plus its end marker must fit the send queue (ROUTER drops, not
                # blocks, past it; ZMQ acks reads every HWM/2 messages), as vLLM sizes it.
                router.setsockopt(zmq.SNDHWM, 2 * (self._buffer.maxlen + 1))
                router.bind(self.replay_endpoint)
        except BaseException as exc:  # surfaced to the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        if router is not None:
            poller.register(router, zmq.POLLIN)
        wake = self._wake  # closed only once this thread has ended
        poller.register(wake, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll())
                if router is not None and router in ready:
                    self._serve_replay(router)
                if wake in ready:
                    os.eventfd_read(wake)  # takes every wake-up so far
                while True:
                    with self._lock:
                        if not self._pending:
                            break
                        payload = self._pending.popleft()
                    seq_bytes = encode_seq(self._seq)
                    self._buffer.append((self._seq, payload))
                    self._seq += 1
                    pub.send_multipart((self.topic, seq_bytes, payload), copy=False)
        finally:
            pub.close()
            if router is not None:
                router.close()

    def _serve_replay(self, router) -> None:
        """vLLM's replay: a request is [identity, b"", start seq]; each buffered batch from there
        goes back as [identity, b"", topic, seq, payload], then [identity, b"", b"", END_SEQ, b""]."""
        frames = router.recv_multipart()
        if len(frames) != 3:
            return  # not a replay request (vLLM logs and ignores it too)
        identity, _empty, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                router.send_multipart((identity, b"", self.topic, encode_seq(seq), payload))
        router.send_multipart((identity, b"", b"", END_SEQ, b""))
