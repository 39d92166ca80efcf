"""`kvgate up` keeps its replicas alive: a replica process that exits is restarted after a backoff
(restart_backoff_s, doubling while it keeps dying, reset once it has run a minute), at most
max_restarts_per_minute times a minute (past that it stays down and says so); a reload that adds
a `launch` entry starts it, one that removes an entry stops it (after the gateway stops routing
to it). Every event is a log line and kvgate_replica_restarts_total counts restarts.

While a replica is down the gateway's health checks have already taken it out of rotation and
its requests have moved on (gateway/proxy.py); once restarted, probes bring it back."""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable

import structlog

from gateway.background import BackgroundLoop
from gateway.config import Config
from gateway.launcher import LaunchedReplica, Launcher, STOP_GRACE_S, kill_leftovers, stop_process
from observability.metrics import GatewayMetrics

log = structlog.get_logger("kvgate.supervisor")

POLL_S = 0.25           # another process's exit has no event on this loop: poll, cheaply
STABLE_AFTER_S = 60.0   # running this long resets the backoff
MAX_BACKOFF_S = 30.0


class _Child:
    def __init__(self, launched: LaunchedReplica, backoff_s: float) -> None:
        self.launched = launched
        self.backoff_s = backoff_s
        self.restart_at: float | None = None   # set while it waits to be restarted
        self.restarts: deque[float] = deque()  # restart times within the last minute
        self.gave_up = False


class Supervisor(BackgroundLoop):
    task_name = "replica-supervisor"

    def __init__(self, launcher: Launcher, config: Config, metrics: GatewayMetrics,
                 in_flight: Callable[[str], int] = lambda name: 0) -> None:
        self.launcher = launcher
        self.config = config
        self.metrics = metrics
        self.in_flight = in_flight  # the gateway's requests on a replica: a removed one finishes them first
        base = config.health.restart_backoff_s
        self.children: dict[str, _Child] = {r.spec.name: _Child(r, base) for r in launcher.replicas}

    def describe(self, name: str) -> dict:
        """For /admin/replicas: the process behind a launched replica."""
        child = self.children.get(name)
        if child is None:
            return {}
        proc = child.launched.proc
        return {"process": {"pid": proc.pid, "running": proc.poll() is None, "log": str(child.launched.log_path),
                            "restarts_last_minute": len(child.restarts), "gave_up": child.gave_up}}

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            self.check(time.monotonic())

    def check(self, now_s: float) -> None:
        """One pass: notice exits, restart the replicas whose backoff is over."""
        for name, child in self.children.items():
            proc = child.launched.proc
            code = proc.poll()
            if code is None:
                if now_s - child.launched.started_s >= STABLE_AFTER_S:
                    child.backoff_s = self.config.health.restart_backoff_s
                continue
            if child.gave_up:
                continue
            if child.restart_at is None:
                self._exited(name, child, code, now_s)
            elif now_s >= child.restart_at:
                self._restart(name, child, now_s)

    def _exited(self, name: str, child: _Child, code: int, now_s: float) -> None:
        kill_leftovers(child.launched)  # a server that died leaves its own children (vLLM, SGLang)
        while child.restarts and child.restarts[0] < now_s - 60.0:
            child.restarts.popleft()
        limit = self.config.health.max_restarts_per_minute
        tail = child.launched.output_tail(5)
        if len(child.restarts) >= limit:
            child.gave_up = True
            log.error("replica_restart_limit", replica=name, exit_code=code, restarts_last_minute=len(child.restarts),
                      log=str(child.launched.log_path), output_tail=tail,
                      hint="it keeps dying: read its log; fix and edit the config (or restart kvgate up)")
            return
        child.restart_at = now_s + child.backoff_s
        log.warning("replica_exited", replica=name, exit_code=code, restart_in_s=round(child.backoff_s, 3),
                    log=str(child.launched.log_path), output_tail=tail)
        child.backoff_s = min(child.backoff_s * 2, MAX_BACKOFF_S)

    def _restart(self, name: str, child: _Child, now_s: float) -> None:
        spec = child.launched.spec
        try:
            launched = self.launcher.launch(spec)
        except OSError as exc:
            child.restart_at = now_s + child.backoff_s
            log.error("replica_restart_failed", replica=name, error=str(exc))
            return
        self._replace(child.launched, launched)
        child.launched, child.restart_at = launched, None
        child.restarts.append(now_s)
        self.metrics.restarts.labels(replica=name).inc()
        log.info("replica_restarted", replica=name, pid=launched.proc.pid, restarts_last_minute=len(child.restarts))

    def _replace(self, old: LaunchedReplica, new: LaunchedReplica) -> None:
        replicas = self.launcher.replicas
        replicas[replicas.index(old)] = new

    async def sync(self, config: Config) -> None:
        """A reload: start the `launch` entries it added, stop the ones it removed or whose command
        changed (anything in the entry it is built from, or routing.block_size)."""
        self.config = config
        self.launcher.config = config
        wanted = {spec.name: spec for spec in config.replicas if spec.launch is not None}
        for name in [n for n, child in self.children.items()
                     if n not in wanted or self.launcher.command(wanted[n]) != child.launched.command]:
            child = self.children.pop(name)
            self.launcher.replicas.remove(child.launched)
            # The gateway routes nothing new to it any more; the requests it runs finish first.
            drain_until = time.monotonic() + self.config.gateway.drain_grace_s
            while self.in_flight(name) and time.monotonic() < drain_until:
                await asyncio.sleep(POLL_S)
            log.info("replica_stopping", replica=name, reason="removed from the config",
                     unfinished_requests=self.in_flight(name))
            await asyncio.get_running_loop().run_in_executor(
                None, stop_process, child.launched, time.monotonic() + STOP_GRACE_S)
            log.info("replica_stopped", replica=name, exit_code=child.launched.proc.returncode)
        for name, spec in wanted.items():
            if name not in self.children:
                launched = self.launcher.launch(spec)
                self.launcher.replicas.append(launched)
                self.children[name] = _Child(launched, config.health.restart_backoff_s)
                log.info("replica_launched", replica=name, pid=launched.proc.pid, log=str(launched.log_path))
