"""KV events over real ZMQ sockets, in vLLM's wire shape, with replay for gaps."""
import socket
import time

import pytest
import zmq

from replica.block_pool import BlockPool
from protocol.kv_events import END_SEQ, decode_batch
from replica.kv_events import KVEventPublisher
from routing.hashing import block_hashes
from tests.kv_index import replay_into_index


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def publisher():
    pub_port, replay_port = free_port(), free_port()
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    try:
        yield publisher, pub_port, replay_port
    finally:
        publisher.close()


def test_subscriber_rebuilds_cache_contents_and_replays_missed_batches(publisher):
    pub, pub_port, replay_port = publisher
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    pool = BlockPool(num_blocks=6, block_size=4)
    # PUB/SUB joins asynchronously, so the first batches may be lost to this subscriber:
    # exactly the gap the replay socket exists for.
    for prompt in ([1] * 12, [2] * 12, [3] * 12):  # 3 blocks each into 6 slots: evictions
        hashes = block_hashes(prompt, 4)
        table = pool.allocate(3)
        parent = None
        for i, h in enumerate(hashes):
            pool.commit(table[i], h, parent, prompt[i * 4:(i + 1) * 4])
            parent = h
        pool.release(table)
        pub.publish(pool.drain_events())

    received = {}
    deadline = time.monotonic() + 2
    while 2 not in received and time.monotonic() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events"
            received[int.from_bytes(seq, "big")] = decode_batch(payload)

    # Ask the replay socket from seq 1 on (or from the first batch this subscriber missed).
    # The ROUTER answers one message per batch, so the client is a DEALER (REQ keeps one).
    first_missing = min([s for s in range(3) if s not in received] + [1])
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(f"tcp://127.0.0.1:{replay_port}")
    req.send_multipart((b"", first_missing.to_bytes(8, "big")))
    replayed = {}
    while req.poll(2000):
        _, seq, payload = req.recv_multipart()
        if seq == END_SEQ:
            assert payload == b""
            break
        replayed[int.from_bytes(seq, "big")] = decode_batch(payload)
    assert sorted(replayed) == list(range(first_missing, 3))
    for seq in set(replayed) & set(received):
        assert replayed[seq] == received[seq]
    received.update(replayed)
    assert sorted(received) == [0, 1, 2]

    assert replay_into_index(received) == pool.cached_hashes()
    sub.close()
    req.close()
