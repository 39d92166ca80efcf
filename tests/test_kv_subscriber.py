"""The gateway's KV event subscriber against a real ZMQ publisher on loopback (PUB + replay
ROUTER framed as vLLM 0.33.0 frames them, driven by the test so it can skip a sequence number or
go quiet): a gap is filled through the replay endpoint, silence while serving falls back to
approximate mode (log line + metric), and the next batch brings precise mode back.

The batches are written with vLLM 0.33.0's own struct definitions (tests/vllm_kv_events_033.py:
events as maps tagged by class name, every field vLLM sets) or, for older replicas, as plain
msgpack arrays; what the gateway holds afterwards is read from its prefix table."""
from __future__ import annotations

import asyncio
import hashlib
import time

import msgspec
import zmq
import zmq.asyncio

from gateway.config import parse_config
from gateway.kv_subscriber import KVEventSubscribers
from gateway.router import Router
from observability.metrics import GatewayMetrics
from routing.hashing import block_hashes
from tests import vllm_kv_events_033 as vllm
from tests.servers import free_port

WAIT_S = 10.0
_encode = msgspec.msgpack.Encoder().encode


class ScriptedPublisher:
    """vLLM 0.33.0's publisher framing: PUB [topic, seq, payload]; ROUTER replay from a buffer,
    answering [b"", topic, seq, payload] per batch and [b"", b"", END_SEQ, b""] at the end."""

    def __init__(self, context: zmq.asyncio.Context, pub_endpoint: str, replay_endpoint: str) -> None:
        self.pub = context.socket(zmq.PUB)
        self.pub.bind(pub_endpoint)
        self.router = context.socket(zmq.ROUTER)
        self.router.bind(replay_endpoint)
        self.topic = b""  # vLLM's default topic
        self.buffer: dict[int, bytes] = {}
        self.replays: list[int] = []
        self.task = asyncio.create_task(self._serve_replays())

    async def publish(self, seq: int, token_ids: list[int], send: bool = True) -> None:
        """A BlockStored of `token_ids`' full blocks, as vLLM's block pool writes it."""
        await self.publish_events(seq, [stored(token_ids)], send)

    async def publish_events(self, seq: int, events: list, send: bool = True) -> None:
        await self.publish_payload(seq, _encode(vllm.KVEventBatch(ts=time.time(), events=events,
                                                                  data_parallel_rank=0)), send)

    async def publish_payload(self, seq: int, payload: bytes, send: bool = True) -> None:
        self.buffer[seq] = payload
        if send:
            await self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    async def _serve_replays(self) -> None:
        while True:
            identity, _empty, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replays.append(start_seq)
            for seq in sorted(self.buffer):
                if seq >= start_seq:
                    await self.router.send_multipart((identity, b"", self.topic, seq.to_bytes(8, "big"),
                                                      self.buffer[seq]))
            await self.router.send_multipart((identity, b"", b"", vllm.END_SEQ, b""))

    def close(self) -> None:
        self.task.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)


def their_hashes(token_ids: list[int], cache_salt: str | None = None) -> list[bytes]:
    """vLLM's default: sha256 over the parent digest and the block (not our function, not our type)."""
    out, parent = [], b"vllm-none-hash"
    for start in range(0, len(token_ids) - len(token_ids) % 16, 16):
        salt = cache_salt.encode() if cache_salt and start == 0 else b""
        parent = hashlib.sha256(parent + salt + repr(token_ids[start:start + 16]).encode()).digest()
        out.append(parent)
    return out


def stored(token_ids: list[int], cache_salt: str | None = None, *, first_block: int = 0,
           **fields) -> vllm.BlockStored:
    """BlockStored of full blocks [first_block, ...) of `token_ids` with every field vLLM 0.33.0's
    block pool sets for a plain request (extra_keys: one entry per block, the salt on block 0)."""
    hashes = their_hashes(token_ids, cache_salt)
    extra = [(cache_salt,) if cache_salt and first_block + i == 0 else None for i in range(len(hashes) - first_block)]
    values = dict(block_hashes=hashes[first_block:],
                  parent_block_hash=hashes[first_block - 1] if first_block else None,
                  token_ids=token_ids[first_block * 16:len(hashes) * 16], block_size=16,
                  lora_id=None, medium="GPU", lora_name=None, extra_keys=extra, group_idx=0,
                  session_id="session-1")
    values.update(fields)
    return vllm.BlockStored(**values)


async def until(predicate, what: str) -> None:
    """The subscriber runs on this loop; yield to it until the condition holds (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def run_against_publisher(scenario, silence_s: float = 10.0) -> None:
    """`scenario(publisher, router, metrics, matched)` with the gateway's real subscriber task
    following a scripted publisher; matched(prompt, salt=None) is the blocks r0 holds for it."""
    pub_endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = parse_config(
        f"logging: {{format: json}}\nrouting: {{policy: cache_aware, kv_events_silence_s: {silence_s}}}\n"
        f"replicas:\n  - {{name: r0, url: 'http://127.0.0.1:1', model: m, capacity_blocks: 64,\n"
        f"      kv_events: {{endpoint: '{pub_endpoint}', replay_endpoint: '{replay_endpoint}'}}}}\n")

    async def main() -> None:
        metrics = GatewayMetrics()
        router = Router(config, metrics)

        def matched(prompt: list[int], cache_salt: str | None = None) -> int:
            return router.state.table("m").match(block_hashes(prompt, 16, cache_salt), router.state.clock())["r0"]

        context = zmq.asyncio.Context()
        publisher = ScriptedPublisher(context, pub_endpoint, replay_endpoint)
        subscribers = KVEventSubscribers(router, metrics)
        try:
            await subscribers.start()
            await until(lambda: router.precise.get("r0"), "precise after the initial replay")
            await scenario(publisher, router, metrics, matched)
        finally:
            await subscribers.close()
            publisher.close()
            context.term()

    asyncio.run(main())


def prompt(n: int, blocks: int = 2) -> list[int]:
    return [1000 * n + i for i in range(16 * blocks)]


def test_gap_is_replayed_silence_falls_back_and_events_bring_precise_mode_back(capsys):
    prompts = [prompt(p) for p in range(3)]  # two full blocks each

    async def scenario(publisher, router, metrics, matched) -> None:
        assert publisher.replays == [0]
        await publisher.publish(0, prompts[0])
        await until(lambda: matched(prompts[0]) == 2, "live batch 0 applied")
        await publisher.publish(1, prompts[1], send=False)  # lost on the wire
        await publisher.publish(2, prompts[2])
        await until(lambda: matched(prompts[1]) == 2 and matched(prompts[2]) == 2, "gap filled by replay")
        assert publisher.replays == [0, 1]
        assert metrics.kv_events_resyncs.labels(replica="r0")._value.get() == 1

        # Serving: a request prefilled new full blocks there, and no event follows.
        with router.attempt(["r0"], "m", list(range(48)), block_hashes(list(range(48)), 16),
                            None, None, 4) as attempt:
            attempt.first_token()
        await until(lambda: not router.precise.get("r0"), "fallback to approximate")
        assert metrics.kv_events_fallbacks.labels(
            replica="r0", reason="no KV events for 0.3 s while serving")._value.get() == 1
        assert metrics.routing_mode.labels(replica="r0")._value.get() == 0
        assert matched(prompts[0]) == 0  # confirmed entries are dropped: they would go stale unseen

        await publisher.publish(3, prompts[0][:16] + [7] * 16)
        await until(lambda: router.precise.get("r0") and matched(prompts[1]) == 2, "precise again, rebuilt")
        assert publisher.replays[-1] == 0 and matched(prompts[0]) == 2
        assert metrics.routing_mode.labels(replica="r0")._value.get() == 1

    run_against_publisher(scenario, silence_s=0.3)
    out = capsys.readouterr().out
    assert "kv_events_fallback" in out and "no KV events for 0.3 s while serving" in out


def test_vllm_033_batches_store_remove_and_clear_blocks_in_the_gateway_index():
    a, b, c = prompt(1, 3), prompt(2), prompt(3)

    async def scenario(publisher, router, metrics, matched) -> None:
        # Two events for one prompt (a chain continued in a later step), every 0.33.0 field set.
        await publisher.publish_events(0, [
            stored(a[:32], kv_cache_spec_kind="full_attention", locality="LOCAL", ownership="tier-0",
                   lookahead_token_ids=None),
            stored(a, first_block=2, kv_cache_spec_kind="full_attention", locality="LOCAL", ownership="tier-0"),
            stored(b)])
        await until(lambda: matched(a) == 3 and matched(b) == 2, "stored blocks matched")
        await publisher.publish_events(1, [
            vllm.BlockRemoved(block_hashes=their_hashes(a)[2:], medium="GPU", group_idx=0, locality="LOCAL",
                              ownership="tier-0"),
            vllm.BlockRemoved(block_hashes=their_hashes(b)[1:], medium="GPU", group_idx=0)])
        await until(lambda: matched(a) == 2 and matched(b) == 1, "removed blocks dropped")
        await publisher.publish_events(2, [vllm.AllBlocksCleared(), stored(c)])
        await until(lambda: matched(c) == 2, "batch after the clear applied")
        assert matched(a) == 0 and matched(b) == 0
        assert router.precise.get("r0")

    run_against_publisher(scenario)


def test_salted_block_matches_only_prompts_with_the_same_salt():
    shared, tenant = prompt(4), prompt(5)

    async def scenario(publisher, router, metrics, matched) -> None:
        await publisher.publish_events(0, [stored(tenant, cache_salt="tenant-a"), stored(shared)])
        await until(lambda: matched(shared) == 2, "batch applied")
        assert matched(tenant, cache_salt="tenant-a") == 2
        assert matched(tenant) == 0  # an unsalted prompt with the same tokens is not served from it
        assert matched(tenant, cache_salt="tenant-b") == 0
        assert matched(shared, cache_salt="tenant-a") == 0

    run_against_publisher(scenario)


def test_older_all_array_batches_still_decode():
    a, b = prompt(6), prompt(7)
    hashes_a = [int.from_bytes(h[-8:], "big") for h in their_hashes(a)]  # older vLLM: int hashes
    hashes_b = [int.from_bytes(h[-8:], "big") for h in their_hashes(b)]

    async def scenario(publisher, router, metrics, matched) -> None:
        # vLLM <= 0.10 (array events, no data_parallel_rank), then with medium, as SGLang sends them.
        await publisher.publish_payload(0, _encode([time.time(), [
            ["BlockStored", hashes_a, None, a, 16, None],
            ["BlockStored", hashes_b, None, b, 16, None, "GPU"]]]))
        await until(lambda: matched(a) == 2 and matched(b) == 2, "array batch applied")
        await publisher.publish_payload(1, _encode([time.time(), [["BlockRemoved", hashes_a[1:], "GPU"]], 0]))
        await until(lambda: matched(a) == 1, "array removal applied")
        await publisher.publish_payload(2, _encode([time.time(), [["AllBlocksCleared"]], 0]))
        await until(lambda: matched(b) == 0, "array clear applied")
        assert router.precise.get("r0")

    run_against_publisher(scenario)


def test_blocks_stay_while_any_group_or_tier_holds_them_and_unmatchable_blocks_are_skipped():
    a, lora, image = prompt(8), prompt(9), prompt(10)
    hashes = their_hashes(a)

    async def scenario(publisher, router, metrics, matched) -> None:
        await publisher.publish_events(0, [
            stored(a, group_idx=0), stored(a, group_idx=1, kv_cache_spec_kind="sliding_window",
                                           kv_cache_spec_sliding_window=128),
            stored(lora, lora_id=1, lora_name="adapter", extra_keys=[("adapter",), ("adapter",)]),
            stored(image, extra_keys=[None, (["image-hash", 3],)]),
            vllm.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=0,
                             lora_id=None, medium="CPU", lora_name=None, group_idx=0)])  # offload tier
        await until(lambda: matched(a) == 2, "stored")
        assert matched(lora) == 0  # the adapter's KV, not the base model's
        assert matched(image) == 1  # the block holding an image is not identified by its tokens
        # The sliding-window group and then the GPU drop the blocks: the CPU tier still holds them.
        await publisher.publish_events(1, [vllm.BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=1),
                                           vllm.BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=0)])
        await publisher.publish(2, prompt(11))
        await until(lambda: matched(prompt(11)) == 2, "later batch applied")
        assert matched(a) == 2
        await publisher.publish_events(3, [vllm.BlockRemoved(block_hashes=hashes, medium="CPU", group_idx=0)])
        await until(lambda: matched(a) == 0, "last holder gone")

    run_against_publisher(scenario)
