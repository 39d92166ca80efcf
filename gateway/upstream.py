"""The replicas behind the gateway: one keep-alive HTTP pool, and per replica what the gateway
has learned (health, served models, max_model_len, tokenizer), refreshed in the background."""
from __future__ import annotations

import asyncio
import gzip
import time

import aiohttp
import msgspec
import structlog

from gateway.config import Config, ReplicaSpec
from tokenization import TokenizerBundle

log = structlog.get_logger("kvgate.upstream")

PROBE_TIMEOUT_S = 5.0
PROBE_INTERVAL_READY_S = 5.0     # a healthy replica is re-checked this often
PROBE_INTERVAL_WAITING_S = 0.5   # one still loading (or down) is polled faster, backing off to 5 s


class ReplicaState:
    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.base_url = spec.url.rstrip("/")
        self.healthy = False
        self.models: list[str] = []
        self.max_model_len: int | None = None
        self.tokenizer: TokenizerBundle | None = None
        self.last_error: str | None = None
        self.poke = asyncio.Event()   # set to make the watcher re-probe now (e.g. after a failure)

    @property
    def ready(self) -> bool:
        return self.healthy and self.tokenizer is not None

    def serves(self, model: str) -> bool:
        return model == self.spec.model or model in self.models

    def describe(self) -> dict:
        return {"url": self.base_url, "healthy": self.healthy, "ready": self.ready,
                "models": self.models or [self.spec.model], "max_model_len": self.max_model_len,
                "tokenizer": self.tokenizer is not None, "error": self.last_error}


class ReplicaPool:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.replicas = [ReplicaState(spec) for spec in config.replicas]
        self.by_name = {replica.name: replica for replica in self.replicas}
        self.session: aiohttp.ClientSession | None = None
        self.all_ready = asyncio.Event()
        self._tasks: dict[str, asyncio.Task] = {}  # replica name -> its watcher

    async def start(self, _app=None) -> None:
        gateway = self.config.gateway
        # One pool for all replicas; generous limits because streams hold connections for minutes.
        connector = aiohttp.TCPConnector(limit=4096, limit_per_host=1024, keepalive_timeout=60,
                                         enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=gateway.request_timeout_s,
                                          connect=gateway.connect_timeout_s))
        self._tasks = {replica.name: asyncio.create_task(self._watch(replica), name=f"watch-{replica.name}")
                       for replica in self.replicas}

    async def close(self, _app=None) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def apply(self, config: Config) -> tuple[list[str], list[str]]:
        """Hot reload: follow the replica list (names added or removed; an entry whose url, model or
        tokenizer changed is replaced). A removed replica leaves `replicas` at once, so it gets no
        new request; requests already on it hold its ReplicaState and finish normally.
        Returns (added, removed) names."""
        old = {replica.name: replica for replica in self.replicas}
        wanted = {spec.name: spec for spec in config.replicas}
        removed = [name for name, replica in old.items()
                   if name not in wanted or _identity(replica.spec) != _identity(wanted[name])]
        kept: dict[str, ReplicaState] = {}
        for spec in config.replicas:
            replica = old.get(spec.name)
            if replica is not None and spec.name not in removed:
                replica.spec = spec  # same server; launch/capacity/kv_events edits need no re-probe
                kept[spec.name] = replica
            else:
                kept[spec.name] = ReplicaState(spec)
        for name in removed:
            task = self._tasks.pop(name, None)
            if task is not None:
                task.cancel()
        self.config = config
        self.replicas = list(kept.values())
        self.by_name = dict(kept)
        added = [name for name, replica in kept.items() if name not in self._tasks]
        if self.session is not None:
            for name in added:
                self._tasks[name] = asyncio.create_task(self._watch(kept[name]), name=f"watch-{name}")
        if not all(r.ready for r in self.replicas):
            self.all_ready.clear()
        return added, removed

    def mark_down_named(self, name: str, reason: str) -> None:
        """mark_down by name; a replica a reload removed meanwhile is ignored."""
        replica = self.by_name.get(name)
        if replica is not None:
            self.mark_down(replica, reason)

    def candidates(self, model: str) -> list[ReplicaState]:
        """Ready replicas serving `model`, in config order (policies rely on a stable order)."""
        return [replica for replica in self.replicas if replica.ready and replica.serves(model)]

    def known_models(self) -> list[str]:
        names: dict[str, None] = {}
        for replica in self.replicas:
            names[replica.spec.model] = None
            for model in replica.models:
                names[model] = None
        return list(names)

    def mark_down(self, replica: ReplicaState, reason: str) -> None:
        if replica.healthy:
            log.warning("replica_down", replica=replica.name, reason=reason)
        replica.healthy = False
        replica.last_error = reason
        self.all_ready.clear()
        replica.poke.set()

    # ---- background discovery -----------------------------------------------------------------

    async def _watch(self, replica: ReplicaState) -> None:
        if replica.spec.tokenizer:
            await self._load_local_tokenizer(replica)
        interval_s = PROBE_INTERVAL_WAITING_S
        while True:
            was_ready = replica.ready
            try:
                await self._probe(replica)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a probe failure is a state, not a crash
                if replica.healthy or replica.last_error is None:
                    log.info("replica_not_ready", replica=replica.name, reason=_reason(exc))
                replica.healthy = False
                replica.last_error = _reason(exc)
            if replica.ready and not was_ready:
                log.info("replica_ready", replica=replica.name, url=replica.base_url,
                         models=replica.models, max_model_len=replica.max_model_len)
            if all(r.ready for r in self.replicas):
                self.all_ready.set()
            else:
                self.all_ready.clear()
            interval_s = PROBE_INTERVAL_READY_S if replica.ready else min(interval_s * 1.5, 5.0)
            replica.poke.clear()
            try:
                await asyncio.wait_for(replica.poke.wait(), interval_s)
                interval_s = PROBE_INTERVAL_WAITING_S
            except asyncio.TimeoutError:
                pass

    async def _probe(self, replica: ReplicaState) -> None:
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S, connect=self.config.gateway.connect_timeout_s)
        async with self.session.get(replica.base_url + "/health", timeout=timeout) as resp:
            if resp.status != 200:
                raise RuntimeError(f"/health answered HTTP {resp.status}")
        if not replica.models:
            async with self.session.get(replica.base_url + "/v1/models", timeout=timeout) as resp:
                resp.raise_for_status()
                listing = msgspec.json.decode(await resp.read())
            entries = listing.get("data") or []
            replica.models = [entry["id"] for entry in entries if isinstance(entry, dict) and "id" in entry]
            lengths = [entry.get("max_model_len") for entry in entries if isinstance(entry, dict)]
            lengths = [length for length in lengths if isinstance(length, int) and length > 0]
            replica.max_model_len = min(lengths) if lengths else None
        if replica.tokenizer is None and not replica.spec.tokenizer:
            async with self.session.get(replica.base_url + "/kvgate/tokenizer", timeout=timeout) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"GET /kvgate/tokenizer answered HTTP {resp.status}; set `tokenizer:` "
                                       f"for replicas that are not kvgate's own")
                payload = await resp.read()
                gzipped = resp.headers.get("Content-Encoding", "").lower() == "gzip"  # the session does not inflate
            started = time.perf_counter()
            loop = asyncio.get_running_loop()
            replica.tokenizer = await loop.run_in_executor(
                None, TokenizerBundle.from_payload, gzip.decompress(payload) if gzipped else payload)
            log.info("tokenizer_loaded", replica=replica.name, source="replica",
                     load_ms=round((time.perf_counter() - started) * 1000, 1))
        replica.healthy = True
        replica.last_error = None

    async def _load_local_tokenizer(self, replica: ReplicaState) -> None:
        path = replica.spec.tokenizer
        loader = TokenizerBundle.from_gguf if path.endswith(".gguf") else TokenizerBundle.from_hf_dir
        try:
            replica.tokenizer = await asyncio.get_running_loop().run_in_executor(None, loader, path)
            log.info("tokenizer_loaded", replica=replica.name, source=path)
        except Exception as exc:
            replica.last_error = f"tokenizer {path}: {_reason(exc)}"
            log.error("tokenizer_load_failed", replica=replica.name, path=path, error=_reason(exc))


def _identity(spec: ReplicaSpec) -> tuple:
    return (spec.url.rstrip("/"), spec.model, spec.tokenizer)


def _reason(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
