"""Hot reload of the routing YAML: poll the file's mtime (and size) about once a second; on a
change re-validate it, and either swap it in (policy, weights, replicas added or removed, token-ID
logging, timeouts, health, keys and limits) or reject it with a `config_rejected` log line naming
the key and line, keeping the old config live. Requests in flight keep the replica they were sent to.

The watcher never dies: whatever goes wrong reading, decoding, validating or applying a file (a
byte that is not UTF-8, a file replaced by a directory, ...) is a `config_rejected` line, and the
next good edit is applied. Keys that only a restart can change are named in `needs_restart`.

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
# What a reload cannot change, fixed at startup: the listening socket(s) and what its connections
# were built with (aiohttp's body size, header limits and keep-alive), the replica connection
# pool's connect timeout, the drain on SIGTERM, the logging setup. Every other key is read per
# request or pushed by `apply` (server.py).
RESTART_ONLY = ("gateway.host", "gateway.port", "gateway.workers", "gateway.max_body_bytes",
                "gateway.connect_timeout_s", "gateway.drain_grace_s", "logging.level", "logging.format",
                "logging.file", "logging.file_max_mb", "logging.file_keep", "limits.max_headers",
                "limits.max_header_bytes", "limits.keepalive_timeout_s")


class ConfigWatcher(BackgroundLoop):
    task_name = "config-watcher"

    def __init__(self, path: str | Path, current: Config, apply: Callable[[Config], dict],
                 metrics: GatewayMetrics, poll_s: float = POLL_S) -> None:
        self.path = Path(path)
        self.current = current
        self.started = current  # restart-only keys stay at these values, whatever later reloads say
        self.apply = apply
        self.metrics = metrics
        self.poll_s = poll_s
        self._stamp = self._stat()
        self._empty: tuple[int, int] | None = None  # an empty file seen once (see _run)

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
            if stamp[1] == 0 and stamp != self._empty:
                # Truncated, maybe mid-write (an editor's or a script's save): judged on the next
                # poll, when the rest has come or it is still empty (then rejected as such).
                self._empty = stamp
                continue
            self._stamp = stamp
            try:
                self.check_now()
            except Exception as exc:  # noqa: BLE001 - the watcher outlives any bad file
                self._reject(f"{self.path}: {type(exc).__name__}: {exc}")

    def check_now(self) -> bool:
        """Load, validate and apply the file now; True if the new config is live."""
        try:
            config = load_config(self.path)
        except ConfigError as exc:
            return self._reject(str(exc))
        except UnicodeDecodeError as exc:
            line = exc.object[:exc.start].count(b"\n") + 1
            return self._reject(f"{self.path}:{line}: not UTF-8 (byte 0x{exc.object[exc.start]:02x}); "
                                "nothing was applied")
        except Exception as exc:  # noqa: BLE001 - unreadable, gone, a directory, ...
            return self._reject(f"{self.path}: cannot read it: {type(exc).__name__}: {exc}")
        try:
            changes = self.apply(config)
        except Exception as exc:  # noqa: BLE001 - e.g. a policy that cannot be built (raised before any change)
            return self._reject(f"{self.path}: {exc}")
        ignored = [key for key in RESTART_ONLY if _get(config, key) != _get(self.started, key)]
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
