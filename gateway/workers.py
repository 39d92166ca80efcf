"""`gateway.workers: N` (N > 1): N gateway processes on one port, each with its own event loop, and
the parent that starts them (`kvgate serve` and `kvgate up` become that parent).

    kvgate serve|up        this parent: no HTTP of its own
      worker 0..N-1        `python -m gateway.worker`: the whole gateway app (gateway/server.py),
                           each binding host:port with SO_REUSEPORT; Linux spreads new
                           connections over them by a hash of the connection's addresses (macOS
                           and the BSDs hand them all to one socket: workers help on Linux only)
      replicas             `kvgate up` only: launched, health-waited and restarted by this parent
                           (gateway/launcher.py, gateway/supervisor.py), never by a worker

A worker that exits is restarted (after 1 s, doubling while it keeps dying, up to 30 s); one that
exits before it ever listened, at startup, stops everything (the port taken by another program).
SIGTERM or Ctrl-C: every worker gets SIGTERM and drains as a single gateway does (no new
connections, drain_grace_s for its requests in flight), then the replicas stop. The ready line
is printed once, when every worker has every replica ready.

One gateway, several processes (gateway/worker_bus.py carries what they share):
  precise mode   every worker subscribes to every replica's KV events itself (a PUB serves any
                 number of SUBs, the replay socket answers each): the same events make the same
                 tables, nothing to share. Decisions are shared all the same, for the moment
                 between a decision and the BlockStored events its prefill publishes
  approximate    a worker's table knows only what was routed, and each worker routes only its
                 own connections' requests: without sharing, a conversation whose turns come
                 on different connections would scatter. So each worker publishes what its
                 policy commits (cache_aware's guessed prefix, session_affinity's session) and
                 every other worker adopts it as its own (routing/peer_decisions.py)
  load           each worker counts its own requests exactly and adds the others' as they
                 report them, within 20 ms of a change (gateway/scraper.py merges them with the
                 replicas' /metrics, which then counts only traffic from outside this gateway)
  config         this parent alone reads the YAML (polled, as gateway/reload.py does), checks it
                 (a bad edit is rejected once, here) and hands the same decoded config to every
                 worker; workers never read the file, so they never disagree on what it said
  drain          POST /admin/replicas/NAME/drain reaches one worker, which applies it and tells
                 the parent; the parent's state (re-sent every second) carries it to every
                 worker, a restarted one included
  metrics        one /metrics for the gateway: counters summed, gauges per worker
                 (gateway/worker_metrics.py)
  logs           each worker's lines come through pipes to this parent, the single writer of
                 stdout and of logging.file (gateway/worker.py): no torn lines, one rotation

Per worker, as independent gateways would be (a client's connection stays on one worker):
replica health (each probes and ejects on what it sees), max_in_flight_per_replica and the
queue (each admits up to that many per replica), API keys' rate limits (each worker has its
own buckets: N workers admit up to N times a key's rpm/tpm), the retry budget.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Callable

import msgspec
import structlog
import zmq
import zmq.asyncio

from gateway.config import Config
from gateway.launcher import die_with_parent
from gateway.reload import ConfigWatcher
from gateway.supervisor import Supervisor
from gateway.worker_bus import (DECODERS, DRAIN, HEARTBEAT_S, LOAD, PEER_STALE_S, STATE, Publisher, State,
                                WorkerSpec, subscriber)
from gateway.worker_metrics import MetricsSnapshots
from observability.metrics import GatewayMetrics

log = structlog.get_logger("kvgate.workers")

RESTART_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0   # a worker up this long restarts, if it dies, after the first backoff again
STOP_MARGIN_S = 10.0    # past drain_grace_s, a worker that has not exited is killed
RELAY_CHUNK = 1 << 16


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.started_s = 0.0
        self.heard_s = float("-inf")   # last load report
        self.listening = False
        self.ready = False
        self.counts: dict[str, tuple[int, int]] = {}
        self.backoff_s = RESTART_BACKOFF_S


class Workers:
    def __init__(self, config: Config, config_path: str | None, launcher, admin_token: str | None,
                 log_file, on_ready: Callable[[], None] | None) -> None:
        self.config = config
        self.config_json = msgspec.json.encode(config)
        self.generation = 0
        self.config_path = config_path
        self.launcher = launcher
        self.admin_token = admin_token
        self.log_file = log_file   # observability.logs.LogFile or None: the workers' file lines go here
        self.on_ready = on_ready
        fmt = config.logging.format
        self.log_format = "console" if fmt == "console" or (fmt == "auto" and sys.stdout.isatty()) else "json"
        self.workers = [_Worker(i) for i in range(config.gateway.workers)]
        self.drained: set[str] = set()
        self.drain_seen: dict[int, int] = {}
        self.stopping = False
        self.failure: str | None = None
        self.announced = False
        self.metrics = GatewayMetrics()  # this process's: config reloads, replica restarts
        self.supervisor: Supervisor | None = None
        self.watcher: ConfigWatcher | None = None
        self._stop = asyncio.Event()
        self._background: set[asyncio.Task] = set()

    # ---- the whole life ---------------------------------------------------------------------------

    async def run(self) -> int:
        gateway = self.config.gateway
        if problem := port_problem(gateway.host, gateway.port):
            print(f"error: {problem}", file=sys.stderr, flush=True)
            return 1
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        self.run_dir = tempfile.mkdtemp(prefix="kvgate-workers-")  # 0700: only this user reaches the bus
        self.publisher = Publisher(self.run_dir, "parent")
        self.context = zmq.asyncio.Context()
        self.sub = subscriber(self.context, self.run_dir, [f"w{w.index}" for w in self.workers], (LOAD, DRAIN))
        self.snapshots = MetricsSnapshots(self.run_dir, "parent", self.metrics.registry, counters_only=True)
        if self.launcher is not None:
            self.supervisor = Supervisor(self.launcher, self.config, self.metrics, self.in_flight)
            await self.supervisor.start()
        if self.config_path is not None:
            self.watcher = ConfigWatcher(self.config_path, self.config, self._apply, self.metrics)
            await self.watcher.start()
        log.info("workers_starting", workers=len(self.workers), host=gateway.host, port=gateway.port,
                 run_dir=self.run_dir)
        keepers = [asyncio.create_task(self._keep(worker), name=f"worker-{worker.index}") for worker in self.workers]
        helpers = [asyncio.create_task(self._receive(), name="workers-bus"),
                   asyncio.create_task(self._heartbeat(), name="workers-heartbeat")]
        try:
            await self._stop.wait()
        finally:
            await self._shutdown(keepers, helpers)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if self.failure is not None:
            print(f"error: {self.failure}", file=sys.stderr, flush=True)
            return 1
        return 0

    async def _shutdown(self, keepers: list[asyncio.Task], helpers: list[asyncio.Task]) -> None:
        self.stopping = True
        alive = [w for w in self.workers if w.proc is not None and w.proc.returncode is None]
        log.info("workers_stopping", workers=len(alive), grace_s=self.config.gateway.drain_grace_s)
        for worker in alive:
            _signal(worker, signal.SIGTERM)  # each drains its requests, as a single gateway does
        _done, pending = await asyncio.wait(keepers, timeout=self.config.gateway.drain_grace_s + STOP_MARGIN_S)
        if pending:
            for worker in self.workers:
                if worker.proc is not None and worker.proc.returncode is None:
                    log.warning("worker_killed", worker=worker.index, reason="still running after the drain")
                    _signal(worker, signal.SIGKILL)
            await asyncio.wait(pending, timeout=STOP_MARGIN_S)
        for task in [*helpers, *self._background, *pending]:
            task.cancel()
        await asyncio.gather(*helpers, *self._background, *pending, return_exceptions=True)
        for loop_owner in (self.watcher, self.supervisor):
            if loop_owner is not None:
                await loop_owner.close()
        self.sub.close(linger=0)
        self.context.term()
        self.publisher.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        log.info("workers_stopped")

    # ---- one worker, restarted while the gateway runs ------------------------------------------------

    async def _keep(self, worker: _Worker) -> None:
        while not self.stopping:
            try:
                relays = await self._spawn(worker)
            except OSError as exc:
                return self._fail(f"cannot start worker {worker.index}: {exc}")
            code = await worker.proc.wait()
            await asyncio.wait(relays, timeout=STOP_MARGIN_S)  # its last lines (the pipes close at exit)
            if self.stopping:
                log.info("worker_stopped", worker=worker.index, exit_code=code)
                return
            if not worker.listening and not self.announced and worker.heard_s == float("-inf"):
                return self._fail(f"worker {worker.index} exited with code {code} before it listened "
                                  f"on {self.config.gateway.host}:{self.config.gateway.port}")
            now = time.monotonic()
            if now - worker.started_s >= STABLE_AFTER_S:
                worker.backoff_s = RESTART_BACKOFF_S
            log.warning("worker_exited", worker=worker.index, exit_code=code, restart_in_s=worker.backoff_s)
            try:
                await asyncio.wait_for(self._stop.wait(), worker.backoff_s)
                return  # stopping meanwhile
            except asyncio.TimeoutError:
                pass
            worker.backoff_s = min(worker.backoff_s * 2, MAX_BACKOFF_S)

    async def _spawn(self, worker: _Worker) -> list[asyncio.Task]:
        """Start worker `index` (again): its spec on stdin, its output on pipes relayed here."""
        read_fd = write_fd = None
        if self.log_file is not None:
            read_fd, write_fd = os.pipe()
        spec = WorkerSpec(index=worker.index, count=len(self.workers), run_dir=self.run_dir,
                          generation=self.generation, config=self.config, drained=sorted(self.drained),
                          processes=self.processes(), admin_token=self.admin_token, log_format=self.log_format,
                          log_fd=write_fd)
        worker.listening = worker.ready = False
        worker.counts, worker.heard_s = {}, float("-inf")
        self.drain_seen[worker.index] = 0  # its drain reports count from 1 again
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway.worker", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, pass_fds=(write_fd,) if write_fd is not None else (),
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,  # Ctrl-C reaches the parent only; it stops the workers in order
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
        except BaseException:
            if read_fd is not None:
                os.close(read_fd)
            raise
        finally:
            if write_fd is not None:
                os.close(write_fd)
        worker.proc, worker.started_s = proc, time.monotonic()
        relays = [asyncio.create_task(_relay(proc.stdout, _to_stdout))]
        if read_fd is not None:
            reader = asyncio.StreamReader()
            await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                               os.fdopen(read_fd, "rb", buffering=0))
            relays.append(asyncio.create_task(_relay(reader, self._to_file)))
        try:
            proc.stdin.write(msgspec.json.encode(spec))
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died at once: _keep sees its exit code
        log.info("worker_started", worker=worker.index, pid=proc.pid)
        if self.stopping:
            _signal(worker, signal.SIGTERM)
        return relays

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
        self._stop.set()

    def _to_file(self, data: bytes) -> None:
        # Whole lines, as one write: the file rotates between two reads' lines, not mid-line.
        self.log_file.write_line(data[:-1])

    # ---- the bus ----------------------------------------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            topic, payload = await self.sub.recv_multipart()
            try:
                message = DECODERS[topic].decode(payload)
                worker = self.workers[message.worker]
            except (msgspec.DecodeError, KeyError, IndexError):
                continue
            if topic == LOAD:
                worker.heard_s, worker.counts = time.monotonic(), message.counts
                worker.listening, worker.ready = message.listening, message.ready
                if not self.announced and all(w.ready for w in self.workers):
                    self.announced = True
                    log.info("workers_ready", workers=len(self.workers))
                    if self.on_ready is not None:
                        self.on_ready()
            elif topic == DRAIN and message.seq == self.drain_seen.get(worker.index, 0) + 1:  # in order; re-sent
                self.drain_seen[worker.index] = message.seq
                (self.drained.add if message.drained else self.drained.discard)(message.replica)
                log.info("replica_drain_shared", replica=message.replica, drained=message.drained,
                         from_worker=worker.index)
                self._broadcast()

    def _broadcast(self) -> None:
        self.publisher.send(STATE, State(self.generation, self.config_json, sorted(self.drained),
                                         dict(self.drain_seen), self.processes()))

    async def _heartbeat(self) -> None:
        while True:
            self._broadcast()
            self.snapshots.write()
            await asyncio.sleep(HEARTBEAT_S)  # a timer: state is re-sent for workers that missed it

    def processes(self) -> dict[str, dict]:
        if self.supervisor is None:
            return {}
        return {name: described["process"] for name in self.supervisor.children
                if (described := self.supervisor.describe(name))}

    def in_flight(self, replica: str) -> int:
        """The workers' requests on `replica` (the supervisor lets them finish before stopping it)."""
        now = time.monotonic()
        return sum(w.counts.get(replica, (0, 0))[1] for w in self.workers if now - w.heard_s <= PEER_STALE_S)

    def _apply(self, config: Config) -> dict:
        """A new, valid YAML (ConfigWatcher): check that a worker can apply it, then hand it to all."""
        from gateway.router import Router  # numpy and routing: loaded only when a reload comes
        Router(config, GatewayMetrics())  # raises, as a worker's apply would, on a policy it cannot build
        self.generation += 1
        self.config, self.config_json = config, msgspec.json.encode(config)
        self._broadcast()
        if self.supervisor is not None:  # processes start/stop in the background (stopping waits for requests)
            task = asyncio.get_running_loop().create_task(self.supervisor.sync(config))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return {"generation": self.generation}


def _signal(worker: _Worker, sig: int) -> None:
    try:
        worker.proc.send_signal(sig)
    except ProcessLookupError:
        pass


async def _relay(reader: asyncio.StreamReader, write: Callable[[bytes], None]) -> None:
    """Copy a worker's output as whole lines (a line split across reads waits for its end)."""
    pending = bytearray()
    while chunk := await reader.read(RELAY_CHUNK):
        pending += chunk
        end = pending.rfind(b"\n")
        if end >= 0:
            write(bytes(pending[:end + 1]))
            del pending[:end + 1]
    if pending:
        write(bytes(pending) + b"\n")


def _to_stdout(data: bytes) -> None:
    try:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    except OSError:
        pass  # stdout closed: the file still gets every line


def port_problem(host: str, port: int) -> str | None:
    """Why the workers could not have host:port to themselves, or None. SO_REUSEPORT would let them
    share it with another program's socket that set it too (a stale kvgate): refuse a port anything
    listens on."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"gateway.host {host!r}: {exc}"
    for family, kind, proto, _name, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def run_workers(config: Config, config_path: str | None = None, launcher=None, admin_token: str | None = None,
                log_file=None, on_ready: Callable[[], None] | None = None) -> int:
    try:
        import uvloop
    except ImportError:  # not on Windows; asyncio's loop works
        return asyncio.run(Workers(config, config_path, launcher, admin_token, log_file, on_ready).run())
    return uvloop.run(Workers(config, config_path, launcher, admin_token, log_file, on_ready).run())
