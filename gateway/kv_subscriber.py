"""Precise mode: one SUB per replica with `kv_events` (read off its fd on the gateway's loop), feeding routing's KVEventIndex.

Lifecycle of a replica's mode (kvgate_routing_mode{replica}: 1 precise, 0 approximate):
  connect  -> SUB connects, then a replay from seq 0 (the replica's buffered history: a gateway
              that starts late still learns what is cached) -> precise
  gap      -> sequence numbers jump: replay from the first missing seq (DEALER), stay precise
  silence  -> requests were prefilled there (new full blocks, so BlockStored must follow) but no
              batch came for `routing.kv_events_silence_s`, or the socket failed -> approximate:
              the replica's entries are cleared and the table learns from routing again
  resume   -> the next batch after a fallback: clear, replay from 0, precise again
Every transition is a log line; fallbacks are counted by reason.

With several gateway workers (gateway/workers.py) each runs its own subscribers: a replica's PUB
feeds any number of SUBs and its replay socket answers each, so every worker builds the same
table from the same events (and so does every gateway host in front of the same replicas)."""
from __future__ import annotations

import asyncio
import time

import structlog
import zmq
import zmq.asyncio

from gateway.config import Config, KVEventsSpec
from gateway.router import Router
from observability.metrics import GatewayMetrics
from routing.kv_event_index import KVEventIndex
from protocol.kv_events import END_SEQ, decode_batch, decode_seq, encode_seq

log = structlog.get_logger("kvgate.kv_events")

POLL_S = 0.5            # how often a quiet subscriber checks for silence
REPLAY_TIMEOUT_S = 2.0  # per reply frame of a replay
RETRY_S = 1.0           # after a socket error, before reconnecting (doubling up to RETRY_MAX_S)
RETRY_MAX_S = 30.0


class ReplayIncomplete(Exception):
    pass


class KVEventSubscriber:
    def __init__(self, replica: str, spec: KVEventsSpec, router: Router, metrics: GatewayMetrics,
                 context: zmq.asyncio.Context) -> None:
        self.replica = replica
        self.spec = spec
        self.router = router
        self.metrics = metrics
        self.context = context
        self.index: KVEventIndex | None = None
        self.index_state = None  # the RoutingState the index writes into (a reload may replace it)
        self.task: asyncio.Task | None = None
        self.last_batch_s = 0.0
        self.retry_s = RETRY_S
        self._batches = metrics.kv_event_batches.labels(replica=replica)  # one lookup, not one a batch
        self._set_mode(False, announce=False)

    # ---- mode -----------------------------------------------------------------------------------

    def _set_mode(self, precise: bool, announce: bool = True, reason: str | None = None) -> None:
        was = self.router.precise.get(self.replica, False)
        self.router.precise[self.replica] = precise
        self.metrics.routing_mode.labels(replica=self.replica).set(1 if precise else 0)
        if not precise:
            self.router.expect_events.pop(self.replica, None)
        if announce and was and not precise:
            self.metrics.kv_events_fallbacks.labels(replica=self.replica, reason=reason or "error").inc()
            log.warning("kv_events_fallback", replica=self.replica, mode="approximate", reason=reason)
        elif announce and precise and not was:
            log.info("kv_events_precise", replica=self.replica, mode="precise", endpoint=self.spec.endpoint)

    def _fall_back(self, reason: str) -> None:
        if self.router.precise.get(self.replica):
            self._set_mode(False, reason=reason)
            state = self.router.state
            model = state.model_of.get(self.replica)
            if model is not None:
                state.table(model).clear(self.replica)  # confirmed entries would go stale unseen
        self.index = None

    def _fresh_index(self) -> KVEventIndex | None:
        state = self.router.state
        model = state.model_of.get(self.replica)
        if model is None:
            return None
        state.table(model).clear(self.replica)
        self.index_state = state
        return KVEventIndex(state.table(model), self.replica, state.block_size)

    # ---- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            sub = self.context.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            try:
                sub.connect(self.spec.endpoint)
                log.info("kv_events_connecting", replica=self.replica, endpoint=self.spec.endpoint)
                await self._resync()
                await self._listen(sub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._fall_back(f"subscriber error: {type(exc).__name__}: {exc}")
                log.warning("kv_events_error", replica=self.replica, error=f"{type(exc).__name__}: {exc}",
                            retry_in_s=self.retry_s)
                await asyncio.sleep(self.retry_s)  # back off: a replica without events must not flood the log
                self.retry_s = min(self.retry_s * 2, RETRY_MAX_S)
            finally:
                sub.close(linger=0)

    async def _listen(self, sub) -> None:
        """Batches as they come, read straight off the socket: the loop watches the socket's fd and
        each wake-up takes every batch queued (zmq.asyncio's poll and recv cost ~75 us a batch on a
        2-core box, a replica publishes one per engine step, and the loop is the one that relays
        every stream; this costs ~10-15). Silence is checked every POLL_S."""
        loop = asyncio.get_running_loop()
        raw = zmq.Socket.shadow(sub.underlying)  # the same socket, without zmq.asyncio's futures
        fd = raw.getsockopt(zmq.FD)  # readable when the socket's events change (edge-triggered)
        waiter: list = [None]  # the future the loop is parked on, woken by the fd or by POLL_S

        def wake(readable: bool) -> None:
            if waiter[0] is not None and not waiter[0].done():
                waiter[0].set_result(readable)
        loop.add_reader(fd, wake, True)
        try:
            while True:
                try:
                    frames = raw.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    if raw.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # re-arms the edge; a batch came meanwhile
                        continue
                    waiter[0] = loop.create_future()
                    timer = loop.call_later(POLL_S, wake, False)
                    readable = await waiter[0]
                    timer.cancel()
                    if not readable:
                        self._check_silence()
                    continue
                await self._on_batch(frames)
        finally:
            loop.remove_reader(fd)

    def _check_silence(self) -> None:
        expected_since = self.router.expect_events.get(self.replica)
        silence_s = self.router.config.routing.kv_events_silence_s
        if expected_since is not None and time.monotonic() - expected_since > silence_s:
            self._fall_back(f"no KV events for {silence_s:g} s while serving")

    async def _on_batch(self, frames: list[bytes]) -> None:
        seq, payload = decode_seq(frames[-2]), frames[-1]
        self.router.expect_events.pop(self.replica, None)
        self.last_batch_s = time.monotonic()
        if self.index is None or self.index_state is not self.router.state:
            await self._resync()  # resume after a fallback, or a reload's new tables
            if self.index is None:
                return
            self.retry_s = RETRY_S
        batch = decode_batch(payload)  # vLLM 0.33.0's form, or an older one (protocol/kv_events.py)
        gap_from = self.index.apply(seq, batch, self.router.state.clock())
        self._batches.inc()
        if gap_from is not None:
            log.info("kv_events_gap", replica=self.replica, missing_from=gap_from, got=seq)
            self.metrics.kv_events_resyncs.labels(replica=self.replica).inc()
            await self._replay(gap_from)

    async def _resync(self) -> None:
        """A fresh index over a cleared table entry, filled from the replay buffer when there is one."""
        self.index = self._fresh_index()
        if self.index is None:
            return
        if self.spec.replay_endpoint:
            try:
                await self._replay(0)
            except ReplayIncomplete as exc:
                log.warning("kv_events_replay_incomplete", replica=self.replica, error=str(exc))
            if self.index.next_seq is None:
                self.index.next_seq = 0  # nothing published yet: a first live batch above 0 is a gap
        self._set_mode(True)
        self.retry_s = RETRY_S

    async def _replay(self, start_seq: int) -> None:
        if not self.spec.replay_endpoint:
            return  # no replay socket: live from here (a gap leaves some blocks unknown: fewer hits, no harm)
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.spec.replay_endpoint)
            await dealer.send_multipart((b"", encode_seq(start_seq)))
            first = None
            while True:
                if await dealer.poll(REPLAY_TIMEOUT_S * 1000) == 0:
                    raise TimeoutError(f"replay endpoint {self.spec.replay_endpoint} silent for {REPLAY_TIMEOUT_S} s")
                # [b"", topic, seq, payload] from vLLM 0.33.0 (and us), [b"", seq, payload] from
                # older vLLM; the end marker is [b"", b"", END_SEQ, b""] or [b"", END_SEQ, b""].
                frames = await dealer.recv_multipart()
                seq = decode_seq(frames[-2])
                if frames[-2] == END_SEQ:
                    break
                first = seq if first is None else first
                self.index.replay(seq, decode_batch(frames[-1]), self.router.state.clock())
            if start_seq > 0 and first is not None and first > start_seq:
                raise ReplayIncomplete(f"asked from seq {start_seq}, the replica's buffer starts at {first}")
        finally:
            dealer.close(linger=0)


class KVEventSubscribers:
    """One subscriber task per replica with `kv_events`; `sync(config)` follows hot reloads."""

    def __init__(self, router: Router, metrics: GatewayMetrics) -> None:
        self.router = router
        self.metrics = metrics
        self.context: zmq.asyncio.Context | None = None
        self.running: dict[str, KVEventSubscriber] = {}

    async def start(self, _app=None) -> None:
        self.context = zmq.asyncio.Context()
        self.sync(self.router.config)

    def sync(self, config: Config) -> None:
        if self.context is None:
            return
        wanted = {spec.name: spec.kv_events for spec in config.replicas if spec.kv_events is not None}
        for name, subscriber in list(self.running.items()):
            if wanted.get(name) != subscriber.spec:
                subscriber.task.cancel()
                del self.running[name]
                if name not in wanted:
                    self.router.precise.pop(name, None)
                    self.metrics.routing_mode.labels(replica=name).set(0)
        for name, spec in wanted.items():
            if name not in self.running:
                subscriber = KVEventSubscriber(name, spec, self.router, self.metrics, self.context)
                subscriber.task = asyncio.create_task(subscriber.run(), name=f"kv-events-{name}")
                self.running[name] = subscriber

    async def close(self, _app=None) -> None:
        tasks = [subscriber.task for subscriber in self.running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.running.clear()
        if self.context is not None:
            self.context.term()
