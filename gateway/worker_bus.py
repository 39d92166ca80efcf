"""How the processes of one gateway (`gateway.workers` > 1, gateway/workers.py) stay one gateway:
a ZMQ bus over ipc sockets in the gateway's private run directory (mode 0700). Every process
binds one PUB socket (`w0.sock`, `w1.sock`, ..., `parent.sock`) and subscribes to the others'.

  commit  worker -> workers   a routing decision's share (routing/peer_decisions.py): the block
                              hashes cache_aware guesses on the chosen replica and where the match
                              ended, a session's replica. Each worker adopts it as if it had routed
                              the request itself, so a prefix that worker 0 sent to r1 is found on
                              r1 by worker 1 at once (approximate mode has no other way to know;
                              precise mode gets the same from the KV events a moment later)
  load    worker -> all       its own in-flight requests per replica, within 20 ms of a change, else
                              once a second; also whether it listens and is ready (its replicas
                              ready, and a load message heard from every other worker: its
                              subscriptions are connected, so no commit of theirs is lost).
                              Workers count them as load they did not route (gateway/scraper.py),
                              the parent waits for them before stopping a removed replica
  drain   worker -> parent    an operator's drain/undrain that reached this worker, numbered, re-sent
                              each beat until the parent's state says it folded it in
  state   parent -> workers   the authoritative part, on change and every second: the config (its
                              generation), the drained replicas, the launched replica processes.
                              A worker that missed a message, or started late, catches up from it

PUB/SUB drops messages to a subscriber that is not connected yet or is too slow (a lost guess or
load report costs one decision's accuracy; state is re-sent). Nothing here is on the decision
path: a commit is published once the request is on its way (the policy's commit), messages are
applied between requests on each worker's loop."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Callable

import msgspec
import structlog
import zmq
import zmq.asyncio

from gateway.config import Config
from routing.peer_decisions import SharedDecision, adopt, block_keys, key_bytes, shareable
from routing.policies import CacheAware, SessionAffinity

log = structlog.get_logger("kvgate.workers")

LOAD_PERIOD_S = 0.02     # a worker's in-flight counts go out at most this often (when they changed) ...
HEARTBEAT_S = 1.0        # ... and at least this often (also the parent's state, the metrics snapshot)
PEER_STALE_S = 3.0       # a worker silent this long is gone: its counts no longer count
SEND_HWM = 100_000       # messages queued per subscriber before PUB drops (a stalled peer)

COMMIT, LOAD, DRAIN, STATE = b"c", b"l", b"d", b"s"


class WorkerSpec(msgspec.Struct, kw_only=True):
    """What the parent hands a worker on its stdin when it starts it."""
    index: int
    count: int
    run_dir: str
    generation: int
    config: Config
    drained: list[str] = []
    processes: dict[str, dict] = {}
    admin_token: str | None = None
    log_format: str = "json"
    log_fd: int | None = None   # the log file's lines go here (the parent writes the file)


class Commit(msgspec.Struct, array_like=True):
    worker: int
    model: str
    replica: str
    hashes: bytes
    deepest_matched: int
    session_key: str | None


class Load(msgspec.Struct, array_like=True):
    worker: int
    listening: bool
    ready: bool
    counts: dict[str, tuple[int, int]]   # replica -> (waiting for a first token, in flight)


class Drain(msgspec.Struct, array_like=True):
    worker: int
    seq: int           # per worker: the parent's state says which of them it has applied
    replica: str
    drained: bool


class State(msgspec.Struct, array_like=True):
    generation: int
    config: bytes                 # msgspec JSON of the Config, decoded only when the generation is new
    drained: list[str]
    drain_seen: dict[int, int]    # worker -> last Drain seq folded into `drained`
    processes: dict[str, dict]    # launched replica -> its process (pid, restarts, log): /admin/replicas


_encoder = msgspec.msgpack.Encoder()
DECODERS = {COMMIT: msgspec.msgpack.Decoder(Commit), LOAD: msgspec.msgpack.Decoder(Load),
            DRAIN: msgspec.msgpack.Decoder(Drain), STATE: msgspec.msgpack.Decoder(State)}


def endpoint(run_dir: str | Path, process: str) -> str:
    return f"ipc://{Path(run_dir) / process}.sock"


def encode(message) -> bytes:
    return _encoder.encode(message)


class Publisher:
    """This process's PUB socket: a plain (not asyncio) socket; a send never blocks (PUB drops)."""

    def __init__(self, run_dir: str | Path, process: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.socket.bind(endpoint(run_dir, process))

    def send(self, topic: bytes, message) -> None:
        try:
            self.socket.send_multipart((topic, encode(message)), flags=zmq.DONTWAIT)
        except zmq.ZMQError:
            pass  # dropped, as PUB drops for a slow subscriber

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def subscriber(context: zmq.asyncio.Context, run_dir: str | Path, processes: list[str],
               topics: tuple[bytes, ...]) -> zmq.asyncio.Socket:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, SEND_HWM)
    for topic in topics:
        sub.setsockopt(zmq.SUBSCRIBE, topic)
    for process in processes:
        sub.connect(endpoint(run_dir, process))  # before the peer binds is fine: ZMQ reconnects
    return sub


class _SharedPolicy:
    """The live policy, whose commits are also published to the other workers. `choose` is the
    policy's own bound method (no extra call on the decision path), except for session_affinity,
    which needs the request's session key at commit time."""

    def __init__(self, inner, publish: Callable) -> None:
        self.inner = inner
        self.name = inner.name
        self.timed = inner.timed
        self.reads_prefixes = inner.reads_prefixes
        # a session's key is published (and _sessions emptied) at commit, whatever the fallback
        self.learns = inner.learns or isinstance(inner, SessionAffinity)
        self._publish = publish
        self._sessions: dict[int, str] = {}  # id(decision) -> session key, until its commit
        self.choose = self._choose_with_session if isinstance(inner, SessionAffinity) else inner.choose

    def _choose_with_session(self, candidates, request):
        decision = self.inner.choose(candidates, request)
        if request.session_key:
            self._sessions[id(decision)] = request.session_key
        return decision

    def commit(self, decision) -> None:
        self.inner.commit(decision)
        shared = shareable(self.inner, decision, self._sessions.pop(id(decision), None))
        if shared is not None:
            self._publish(shared)


class WorkerLink:
    """A worker's side of the bus. server.build_app makes one per worker: `share(policy)` wraps
    each live policy, `drained()` reports an admin drain, `listening`/`ready` are set by serve."""

    def __init__(self, spec: WorkerSpec, router, pool, scraper, apply: Callable[[Config], dict]) -> None:
        self.spec = spec
        self.index = spec.index
        self.router = router
        self.pool = pool
        self.scraper = scraper
        self.apply = apply
        self.generation = spec.generation
        self.processes = spec.processes
        self.listening = False
        self.ready = False
        self._inner = None
        self._drain_seq = 0
        self._unacked: list[Drain] = []  # drains the parent's state has not confirmed: re-sent each beat
        self._peers: dict[int, tuple[float, dict[str, tuple[int, int]]]] = {}  # worker -> (received at, counts)
        self._publisher: Publisher | None = None
        self._context: zmq.asyncio.Context | None = None
        self._sub = None
        self._tasks: list[asyncio.Task] = []
        self.snapshots = None  # gateway.worker_metrics.MetricsSnapshots, set by build_app

    # ---- what the server calls ------------------------------------------------------------------

    def share(self, policy):
        """The policy the router should use: `policy`, its decisions published if others need them."""
        self._inner = policy
        if isinstance(policy, (CacheAware, SessionAffinity)):
            return _SharedPolicy(policy, self._publish_commit)
        return policy

    def drained(self, replica: str, drained: bool) -> None:
        """An operator drained (or undrained) `replica` here; the parent tells every worker."""
        self._drain_seq += 1
        message = Drain(self.index, self._drain_seq, replica, drained)
        self._unacked.append(message)
        if self._publisher is not None:
            self._publisher.send(DRAIN, message)

    def process_of(self, replica: str) -> dict:
        process = self.processes.get(replica)
        return {"process": process} if process else {}

    def peer_counts(self, replica: str) -> tuple[int, int]:
        """(waiting, in flight) of the other workers on `replica`, as they last said."""
        waiting = in_flight = 0
        for _at, counts in self._peers.values():
            pair = counts.get(replica)
            if pair is not None:
                waiting += pair[0]
                in_flight += pair[1]
        return waiting, in_flight

    # ---- lifecycle --------------------------------------------------------------------------------

    async def start(self, _app=None) -> None:
        run_dir = self.spec.run_dir
        self._publisher = Publisher(run_dir, f"w{self.index}")
        self._context = zmq.asyncio.Context()
        peers = [f"w{i}" for i in range(self.spec.count) if i != self.index]
        self._sub = subscriber(self._context, run_dir, ["parent", *peers], (COMMIT, LOAD, STATE))
        for name in self.spec.drained:
            self.pool.drain(name)
        self._tasks = [asyncio.create_task(self._receive(), name="worker-bus"),
                       asyncio.create_task(self._heartbeat(), name="worker-heartbeat")]

    async def close(self, _app=None) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.snapshots is not None:
            self.snapshots.write()  # what this worker counted, for the others' /metrics and a successor
        if self._sub is not None:
            self._sub.close(linger=0)
            self._context.term()
        if self._publisher is not None:
            self._publisher.close()

    # ---- sending ----------------------------------------------------------------------------------

    def _publish_commit(self, shared: SharedDecision) -> None:
        model = self.router.state.model_of.get(shared.replica)
        if model is not None and self._publisher is not None:
            self._publisher.send(COMMIT, Commit(self.index, model, shared.replica, key_bytes(shared.hashes),
                                                shared.deepest_matched, shared.session_key))

    def _own_counts(self) -> dict[str, tuple[int, int]]:
        replicas = self.router.state.tracker.replicas
        out = {}
        for name in self.router.state.model_of:
            load = replicas.get(name)
            out[name] = (load.waiting, load.waiting + load.decoding) if load is not None else (0, 0)
        return out

    async def _heartbeat(self) -> None:
        last_sent, last_beat = None, 0.0
        while True:
            now = time.monotonic()
            # Ready once this worker also hears every other worker: a SUB connected before its
            # peer bound reconnects some time later, and a decision published meanwhile is lost
            # (the peer then routes that prefix without knowing where it went).
            report = (self.listening, self.ready and len(self._peers) == self.spec.count - 1, self._own_counts())
            if report != last_sent or now - last_beat >= HEARTBEAT_S:
                self._publisher.send(LOAD, Load(self.index, *report))
                last_sent = report
            if now - last_beat >= HEARTBEAT_S:
                last_beat = now
                for message in self._unacked:  # PUB/SUB drops what a peer missed (a parent reconnecting)
                    self._publisher.send(DRAIN, message)
                gone = [w for w, (at, _counts) in self._peers.items() if now - at > PEER_STALE_S]
                for worker in gone:
                    del self._peers[worker]
                self.scraper.refresh()  # keeps the merged load fresh (and forgets the gone)
                if self.snapshots is not None:
                    self.snapshots.write()
            await asyncio.sleep(LOAD_PERIOD_S)  # a timer: counts change with every request, no event to await

    # ---- receiving --------------------------------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            topic, payload = await self._sub.recv_multipart()
            try:
                message = DECODERS[topic].decode(payload)
                if topic == COMMIT:
                    self._adopt(message)
                elif topic == LOAD:
                    self._peers[message.worker] = (time.monotonic(), message.counts)
                    self.scraper.refresh()
                elif topic == STATE:
                    self._follow(message)
            except Exception as exc:  # noqa: BLE001 - one bad message must not end the bus
                log.warning("worker_bus_message_failed", topic=topic.decode(), error=f"{type(exc).__name__}: {exc}")

    def _adopt(self, commit: Commit) -> None:
        if self._inner is None:
            return
        adopt(self._inner, self.router.state, commit.model,
              SharedDecision(commit.replica, block_keys(commit.hashes), commit.deepest_matched, commit.session_key))

    def _follow(self, state: State) -> None:
        """The parent's state: a new config generation, the drained replicas, the processes."""
        self.processes = state.processes
        if state.generation > self.generation:
            self.generation = state.generation
            try:
                config = msgspec.json.decode(state.config, type=Config)
                changes = self.apply(config)
            except Exception as exc:  # noqa: BLE001 - the parent checked it; keep serving the old one
                log.error("config_rejected", generation=state.generation, error=f"{type(exc).__name__}: {exc}")
            else:
                log.info("config_applied", generation=state.generation, policy=config.routing.policy, **changes)
        seen = state.drain_seen.get(self.index, 0)
        self._unacked = [message for message in self._unacked if message.seq > seen]
        if seen < self._drain_seq:
            return  # the parent has not seen this worker's latest drain yet: its list is older than ours
        drained = set(state.drained)
        for replica in self.pool.replicas:
            draining = replica.health.state == "draining"
            if replica.name in drained and not draining:
                self.pool.drain(replica.name)
            elif draining and replica.name not in drained:
                self.pool.undrain(replica.name)
