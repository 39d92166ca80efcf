"""Hot reload of the routing YAML: poll the file's mtime (and size) about once a second; on a
change re-validate it, and either swap it in (policy, weights, replicas added or removed, token-ID
logging) or reject it with a `config_rejected` log line naming the key and line, keeping the old
config live. Requests in flight keep the replica they were sent to.

Polling, not inotify: one stat() a second is free, works on every filesystem (editors that
write a new file and rename it included) and needs no extra dependency."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Callable

import structlog

from gateway.background import BackgroundLoop
from gateway.config import Config, ConfigError, load_config
from observability.metrics import GatewayMetrics

log = structlog.get_logger("kvgate.reload")

POLL_S = 1.0
# What a reload cannot change: the listening socket and the logging setup, fixed at startup.
_RESTART_ONLY = ("gateway.host", "gateway.port", "gateway.max_body_bytes", "gateway.connect_timeout_s",
                 "gateway.drain_grace_s", "logging.level", "logging.format", "logging.file",
                 "logging.file_max_mb", "logging.file_keep")


class ConfigWatcher(BackgroundLoop):
    task_name = "config-watcher"

    def __init__(self, path: str | Path, current: Config, apply: Callable[[Config], dict],
                 metrics: GatewayMetrics, poll_s: float = POLL_S) -> None:
        self.path = Path(path)
        self.current = current
        self.apply = apply
        self.metrics = metrics
        self.poll_s = poll_s
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)  # a timer: the file changing has no event to await here
            stamp = self._stat()
            if stamp is None or stamp == self._stamp:
                continue
            self._stamp = stamp
            self.check_now()

    def check_now(self) -> bool:
        """Load, validate and apply the file now; True if the new config is live."""
        try:
            config = load_config(self.path)
        except (ConfigError, FileNotFoundError, OSError) as exc:
            return self._reject(str(exc))
        try:
            changes = self.apply(config)
        except (ValueError, ConfigError) as exc:  # e.g. a policy that cannot be built
            return self._reject(f"{self.path}: {exc}")
        ignored = [key for key in _RESTART_ONLY if _get(config, key) != _get(self.current, key)]
        self.current = config
        self.metrics.config_reloads.labels(result="applied").inc()
        log.info("config_reloaded", path=str(self.path), policy=config.routing.policy,
                 replicas=[spec.name for spec in config.replicas], **changes,
                 **({"needs_restart": ignored} if ignored else {}))
        return True

    def _reject(self, error: str) -> bool:
        self.metrics.config_reloads.labels(result="rejected").inc()
        log.error("config_rejected", path=str(self.path), error=error, kept_policy=self.current.routing.policy)
        return False


def _get(config: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)
