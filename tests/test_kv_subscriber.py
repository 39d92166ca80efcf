"""The gateway's KV event subscriber against a real ZMQ publisher on loopback (PUB + replay
ROUTER in vLLM's wire shape, driven by the test so it can skip a sequence number or go quiet):
a gap is filled through the replay endpoint, silence while serving falls back to approximate
mode (log line + metric), and the next batch brings precise mode back."""
from __future__ import annotations

import asyncio
import time

import msgspec
import zmq
import zmq.asyncio

from gateway.config import parse_config
from gateway.kv_subscriber import KVEventSubscribers
from gateway.router import Router
from observability.metrics import GatewayMetrics
from routing.hashing import block_hashes
from protocol.kv_events import END_SEQ, BlockStored, KVEventBatch
from tests.servers import free_port

WAIT_S = 10.0
_encode = msgspec.msgpack.Encoder().encode


class ScriptedPublisher:
    """vLLM's publisher shape: PUB [topic, seq, payload]; ROUTER replay from a buffer."""

    def __init__(self, context: zmq.asyncio.Context, pub_endpoint: str, replay_endpoint: str) -> None:
        self.pub = context.socket(zmq.PUB)
        self.pub.bind(pub_endpoint)
        self.router = context.socket(zmq.ROUTER)
        self.router.bind(replay_endpoint)
        self.buffer: dict[int, bytes] = {}
        self.replays: list[int] = []
        self.task = asyncio.create_task(self._serve_replays())

    async def publish(self, seq: int, token_ids: list[int], send: bool = True) -> None:
        hashes = block_hashes(token_ids, 16)  # the replica's own names; the gateway recomputes its own
        payload = _encode(KVEventBatch(ts=time.time(), events=[BlockStored(hashes, None, token_ids, 16)]))
        self.buffer[seq] = payload
        if send:
            await self.pub.send_multipart((b"kv-events", seq.to_bytes(8, "big"), payload))

    async def _serve_replays(self) -> None:
        while True:
            identity, _empty, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replays.append(start_seq)
            for seq in sorted(self.buffer):
                if seq >= start_seq:
                    await self.router.send_multipart((identity, b"", seq.to_bytes(8, "big"), self.buffer[seq]))
            await self.router.send_multipart((identity, b"", END_SEQ, b""))

    def close(self) -> None:
        self.task.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def until(predicate, what: str) -> None:
    """The subscriber runs on this loop; yield to it until the condition holds (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_gap_is_replayed_silence_falls_back_and_events_bring_precise_mode_back(capsys):
    pub_endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = parse_config(
        "logging: {format: json}\nrouting: {policy: cache_aware, kv_events_silence_s: 0.3}\nreplicas:\n"
        f"  - {{name: r0, url: 'http://127.0.0.1:1', model: m, capacity_blocks: 64,\n"
        f"      kv_events: {{endpoint: '{pub_endpoint}', replay_endpoint: '{replay_endpoint}'}}}}\n")
    prompts = [[100 + 10 * p + i for i in range(32)] for p in range(3)]  # two full blocks each

    async def scenario() -> None:
        metrics = GatewayMetrics()
        router = Router(config, metrics)
        table = router.state.table("m")

        def matched(p: int) -> int:
            return table.match(block_hashes(prompts[p], 16), router.state.clock())["r0"]

        context = zmq.asyncio.Context()
        publisher = ScriptedPublisher(context, pub_endpoint, replay_endpoint)
        subscribers = KVEventSubscribers(router, metrics)
        try:
            await subscribers.start()
            await until(lambda: router.precise.get("r0"), "precise after the initial replay")
            assert publisher.replays == [0]
            await publisher.publish(0, prompts[0])
            await until(lambda: matched(0) == 2, "live batch 0 applied")
            await publisher.publish(1, prompts[1], send=False)  # lost on the wire
            await publisher.publish(2, prompts[2])
            await until(lambda: matched(1) == 2 and matched(2) == 2, "gap filled by replay")
            assert publisher.replays == [0, 1]
            assert metrics.kv_events_resyncs.labels(replica="r0")._value.get() == 1

            # Serving: a request prefilled new full blocks there, and no event follows.
            _decision, ticket, _log = router.route(["r0"], "m", list(range(48)), block_hashes(list(range(48)), 16),
                                                   None, None, 4)
            router.first_token(ticket)
            await until(lambda: not router.precise.get("r0"), "fallback to approximate")
            assert metrics.kv_events_fallbacks.labels(
                replica="r0", reason="no KV events for 0.3 s while serving")._value.get() == 1
            assert metrics.routing_mode.labels(replica="r0")._value.get() == 0
            assert matched(0) == 0  # confirmed entries are dropped: they would go stale unseen

            await publisher.publish(3, prompts[0][:16] + [7] * 16)
            await until(lambda: router.precise.get("r0") and matched(1) == 2, "precise again, rebuilt")
            assert publisher.replays[-1] == 0 and matched(0) == 2
            assert metrics.routing_mode.labels(replica="r0")._value.get() == 1
        finally:
            await subscribers.close()
            publisher.close()
            context.term()

    asyncio.run(scenario())
    out = capsys.readouterr().out
    assert "kv_events_fallback" in out and "no KV events for 0.3 s while serving" in out
