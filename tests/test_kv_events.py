"""The built-in replica's KV events over real ZMQ sockets, checked against vLLM 0.33.0's own
struct definitions (tests/vllm_kv_events_033.py): what a vLLM subscriber decodes from our live
stream and from our replay socket, framed as vLLM frames them, is the replica's cache contents."""
import json
import time
import urllib.request

import msgspec
import pytest
import zmq

from replica.block_pool import BlockPool
from replica.kv_events import KVEventPublisher
from routing.hashing import block_hashes
from tests import vllm_kv_events_033 as vllm
from tests.kv_index import replay_into_index
from tests.servers import free_port, run_replica

TINY_KV_BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 tokens, 2 kv heads, dim 16, fp32
decode_as_vllm = msgspec.msgpack.Decoder(vllm.KVEventBatch).decode  # strict: vLLM's structs


@pytest.fixture
def publisher():
    pub_port, replay_port = free_port(), free_port()
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    try:
        yield publisher, pub_port, replay_port
    finally:
        publisher.close()


def subscribe(ctx, endpoint: str):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def collect(sub, received: dict, until_s: float, topic: bytes = b"kv-events", decode=decode_as_vllm) -> None:
    """Batches published until `until_s` into received[seq], decoded with vLLM's structs (or `decode`)."""
    while time.monotonic() < until_s and sub.poll(50):
        frames = sub.recv_multipart()
        assert len(frames) == 3 and frames[0] == topic
        received[int.from_bytes(frames[1], "big")] = decode(frames[2])


def replay(ctx, endpoint: str, start_seq: int, topic: bytes = b"kv-events", decode=decode_as_vllm) -> dict:
    """vLLM's replay protocol as its own subscribers speak it: [b"", start seq] to the ROUTER;
    back come [b"", topic, seq, payload] per batch and [b"", b"", END_SEQ, b""]. (A DEALER: the
    answer is many messages, a REQ socket would keep only the first.)"""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
    replayed = {}
    try:
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            if frames == [b"", b"", vllm.END_SEQ, b""]:
                return replayed
            empty, frame_topic, seq, payload = frames
            assert empty == b"" and frame_topic == topic
            replayed[int.from_bytes(seq, "big")] = decode(payload)
        raise AssertionError("replay socket did not answer END_SEQ")
    finally:
        dealer.close()


def test_vllm_decodes_the_publisher_and_replays_missed_batches(publisher):
    pub, pub_port, replay_port = publisher
    ctx = zmq.Context.instance()
    sub = subscribe(ctx, f"tcp://127.0.0.1:{pub_port}")
    pool = BlockPool(num_blocks=6, block_size=4)
    # PUB/SUB joins asynchronously, so the first batches may be lost to this subscriber:
    # exactly the gap the replay socket exists for.
    for prompt, salt in (([1] * 12, None), ([2] * 12, "tenant"), ([3] * 12, None)):  # 3 blocks into 6: evictions
        hashes = block_hashes(prompt, 4, cache_salt=salt)
        table = pool.allocate(3)
        parent = None
        for i, h in enumerate(hashes):
            pool.commit(table[i], h, parent, prompt[i * 4:(i + 1) * 4], cache_salt=salt if i == 0 else None)
            parent = h
        pool.release(table)
        pub.publish(pool.drain_events())

    received: dict = {}
    deadline = time.monotonic() + 2
    while 2 not in received and time.monotonic() < deadline:
        collect(sub, received, time.monotonic() + 0.1)
    first_missing = min([s for s in range(3) if s not in received] + [1])
    replayed = replay(ctx, f"tcp://127.0.0.1:{replay_port}", first_missing)
    assert sorted(replayed) == list(range(first_missing, 3))
    for seq in set(replayed) & set(received):
        assert replayed[seq] == received[seq]
    received.update(replayed)
    assert sorted(received) == [0, 1, 2]
    assert replay_into_index(received) == pool.cached_hashes()

    events = [event for seq in sorted(received) for event in received[seq].events]
    assert all(received[seq].data_parallel_rank == 0 for seq in received)
    salted = [e for e in events if isinstance(e, vllm.BlockStored) and e.extra_keys != [None]]
    assert [(e.token_ids, e.extra_keys) for e in salted] == [([2] * 4, [("tenant",)])]  # first block only
    assert any(isinstance(e, vllm.BlockRemoved) and e.medium == "GPU" and e.group_idx == 0 for e in events)
    sub.close()


def wake_ups(thread) -> int:
    """How many times `thread` has gone to sleep and woken (its voluntary context switches)."""
    with open(f"/proc/self/task/{thread.native_id}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))


def test_an_idle_publisher_sleeps_and_still_publishes_and_replays(publisher):
    pub, pub_port, replay_port = publisher
    thread = pub._thread
    before = wake_ups(thread)
    time.sleep(0.5)
    # A replica without traffic: its publisher thread waits for work (a 5 ms poll woke it ~100 times here).
    assert wake_ups(thread) - before <= 2
    ctx = zmq.Context.instance()
    sub = subscribe(ctx, f"tcp://127.0.0.1:{pub_port}")
    pool = BlockPool(num_blocks=4, block_size=4)
    received: dict = {}
    deadline = time.monotonic() + 5
    attempt = 0
    while not received and time.monotonic() < deadline:  # the SUB joins a moment after connect
        table = pool.allocate(1)
        pool.commit(table[0], block_hashes([attempt] * 4, 4)[0], None, [attempt] * 4)
        pool.release(table)
        pub.publish(pool.drain_events())
        collect(sub, received, time.monotonic() + 0.2)
        attempt += 1
    assert received, "no batch reached the subscriber"
    assert sorted(replay(ctx, f"tcp://127.0.0.1:{replay_port}", 0)) == list(range(attempt))
    sub.close()
    pub.close()
    assert not thread.is_alive()


def complete(url: str, prompt: list[int], **extra) -> None:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, **extra}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def test_live_replica_events_decode_with_vllm_033_structs_live_and_through_replay():
    pub_endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    kv_gb = 8 * TINY_KV_BYTES_PER_BLOCK / (1 << 30)  # 8 blocks of 16 tokens: the prompts below evict
    prompts = [[(7 * p + i) % 500 + 3 for i in range(40)] for p in range(5)]
    ctx = zmq.Context.instance()
    sub = subscribe(ctx, pub_endpoint)
    received: dict = {}
    try:
        with run_replica("tiny", extra_args=["--kv-cache-gb", f"{kv_gb:.12f}", "--kv-events-endpoint", pub_endpoint,
                                             "--kv-events-replay-endpoint", replay_endpoint]) as replica:
            # The SUB joins a moment after the replica binds: requests until one's batch arrives
            # live, so the subscription is in place before the requests whose events we check.
            for attempt in range(50):
                complete(replica.url, [(13 * attempt + i) % 400 + 50 for i in range(17)])
                collect(sub, received, time.monotonic() + 0.5)
                if received:
                    break
            assert received, "no live batch reached the subscriber"
            for prompt in prompts:
                complete(replica.url, prompt)
            complete(replica.url, prompts[-1], cache_salt="tenant-a")  # same tokens, salted: new blocks
            with urllib.request.urlopen(replica.url + "/kvgate/cache", timeout=10) as response:
                expected = set(json.loads(response.read())["block_hashes"])
            # Batches still in flight after the last step arrive within a moment; bounded wait.
            deadline = time.monotonic() + 10
            while replay_into_index(received) != expected and time.monotonic() < deadline:
                collect(sub, received, time.monotonic() + 0.2)
            replayed = replay(ctx, replay_endpoint, 0)
    finally:
        sub.close()
    first_live = min(received)
    assert sorted(received) == list(range(first_live, len(replayed)))  # nothing lost once subscribed
    assert sorted(replayed) == list(range(len(replayed)))
    for seq in received:
        assert received[seq] == replayed[seq]
    assert replay_into_index(replayed) == expected and expected

    events = [event for seq in sorted(replayed) for event in replayed[seq].events]
    stored = [e for e in events if isinstance(e, vllm.BlockStored)]
    assert stored and any(isinstance(e, vllm.BlockRemoved) for e in events)  # the run evicted blocks
    salted = [e for e in stored if e.extra_keys != [None] * len(e.block_hashes)]
    assert [(e.token_ids, e.extra_keys) for e in salted] == [(prompts[-1][:16], [("tenant-a",)])]  # block 0
    for event in stored:  # what vLLM's block pool sets for a request without LoRA or images
        assert (event.block_size, event.lora_id, event.lora_name, event.medium, event.group_idx) == \
            (16, None, None, "GPU", 0)
        assert all(type(h) is int for h in event.block_hashes)
    for event in events:
        if isinstance(event, vllm.BlockRemoved):
            assert (event.medium, event.group_idx) == ("GPU", 0)
