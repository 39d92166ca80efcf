"""The replicas behind the gateway: keep-alive HTTP pools (gateway/http_client.py's lean client for
the requests the gateway proxies; aiohttp's for probes, scrapes and prefill legs), and per replica
what the gateway has learned (served models, max_model_len, tokenizer, default max_tokens) and whether it is in
rotation (gateway/health.py: active probes every probe_interval_s, and what requests report)."""
from __future__ import annotations

import asyncio
import gzip
import time
from operator import attrgetter

import aiohttp
import msgspec
import structlog

from gateway.config import Config, HealthSection, ReplicaSpec
from gateway.health import CHANGES, DRAINING, STATES, HealthPolicy, ReplicaHealth
from gateway.http_client import Origin, UpstreamClient
from observability.metrics import GatewayMetrics
from tokenization import TokenizerBundle
from tokenization.token_cache import warmed

try:
    from asyncio import timeout_at
except ImportError:  # Python 3.10: aiohttp's dependency has the same context manager
    from async_timeout import timeout_at  # type: ignore[no-redef]  # noqa: F401  (used by proxy, pd)

log = structlog.get_logger("kvgate.upstream")

DISCOVERY_INTERVAL_S = 0.5   # a replica still loading is polled this often, backing off to 5 s


def health_policy(section: HealthSection) -> HealthPolicy:
    return HealthPolicy(healthy_threshold=section.healthy_threshold, unhealthy_threshold=section.unhealthy_threshold,
                        eject_consecutive_failures=section.eject_consecutive_failures,
                        eject_error_rate=section.eject_error_rate, error_window_s=section.error_window_s,
                        error_min_requests=section.error_min_requests, eject_base_s=section.eject_base_s,
                        eject_max_s=section.eject_max_s)


def _counted_field(attribute: str, doc: str) -> property:
    """A ReplicaState field whose every change is counted in CHANGES (ReplicaPool.candidates is
    kept until one); read in C (attrgetter), as often as every request."""
    def change(self, value) -> None:
        setattr(self, attribute, value)
        CHANGES[0] += 1
    return property(attrgetter(attribute), change, doc=doc)


class ReplicaState:
    def __init__(self, spec: ReplicaSpec, policy: HealthPolicy) -> None:
        self.spec = spec
        self.name = spec.name
        self.base_url = spec.url.rstrip("/")
        self.origin = Origin(self.base_url)   # where the proxy's client connects
        self.health = ReplicaHealth(policy, time.monotonic())
        self._models: list[str] = []
        self._max_model_len: int | None = None
        self.default_max_tokens: int | None = None  # the replica's own default (its generation config)
        self._tokenizer: TokenizerBundle | None = None
        self.last_error: str | None = None
        self.last_progress_s = 0.0    # loop time of the last byte any stream got from it
        self.poke = asyncio.Event()   # set to make the watcher re-probe now (e.g. after a failure)

    # What ReplicaPool.candidates depends on, besides health: each change is counted (CHANGES).
    # max_model_len too: Proxy._check_context keeps the candidates' context limit with them.
    models = _counted_field("_models", "Models the replica's server lists (its /v1/models).")
    max_model_len = _counted_field("_max_model_len", "The smallest max_model_len it lists, if any.")
    tokenizer = _counted_field("_tokenizer", "Its tokenizer bundle, once loaded.")

    @property
    def healthy(self) -> bool:
        return self.health.in_rotation

    @property
    def ready(self) -> bool:
        return self.health.in_rotation and self.tokenizer is not None

    def serves(self, model: str) -> bool:
        return model == self.spec.model or model in self.models

    def describe(self) -> dict:
        return {"url": self.base_url, **self.health.describe(time.monotonic()), "ready": self.ready,
                "models": self.models or [self.spec.model], "max_model_len": self.max_model_len,
                "tokenizer": self.tokenizer is not None, "error": self.last_error}


class ReplicaPool:
    def __init__(self, config: Config, metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self.policy = health_policy(config.health)
        self.replicas = [ReplicaState(spec, self.policy) for spec in config.replicas]
        self.by_name = {replica.name: replica for replica in self.replicas}
        self._candidates: dict[object, tuple] = {}  # candidates() by model, main_pool() by (model, decode_first)
        self._candidates_seen = -1
        self.panicking: set[str] = set()  # models whose candidates are a panic set (see candidates())
        self._candidates_of: list[ReplicaState] | None = None
        self.session: aiohttp.ClientSession | None = None
        self.client: UpstreamClient | None = None   # the proxied requests' pool
        self.all_ready = asyncio.Event()
        self._tasks: dict[str, asyncio.Task] = {}  # replica name -> its watcher

    async def start(self, _app=None) -> None:
        gateway = self.config.gateway
        # One pool for all replicas; generous limits because streams hold connections for minutes.
        connector = aiohttp.TCPConnector(limit=4096, limit_per_host=1024, keepalive_timeout=60,
                                         enable_cleanup_closed=True)
        # No total timeout here: the proxy holds each request to its own deadlines (first token,
        # between tokens, whole request), which a long stream would otherwise outlive.
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, connect=gateway.connect_timeout_s,
                                          sock_connect=gateway.connect_timeout_s))
        self.client = UpstreamClient(connect_timeout_s=gateway.connect_timeout_s, idle_timeout_s=60.0)
        for replica in self.replicas:
            self._show_state(replica)
        self._tasks = {replica.name: asyncio.create_task(self._watch(replica), name=f"watch-{replica.name}")
                       for replica in self.replicas}

    async def close(self, _app=None) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        if self.client is not None:
            await self.client.close()

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
                kept[spec.name] = ReplicaState(spec, self.policy)
        for name in removed:
            task = self._tasks.pop(name, None)
            if task is not None:
                task.cancel()
            for state in STATES:
                try:
                    self.metrics.replica_state.remove(name, state)
                except KeyError:
                    pass
        self.config = config
        self.policy = health_policy(config.health)
        for replica in kept.values():
            replica.health.policy = self.policy
        self.replicas = list(kept.values())
        self.by_name = dict(kept)
        added = [name for name, replica in kept.items() if name not in self._tasks]
        if self.session is not None:
            for name in added:
                self._show_state(kept[name])
                self._tasks[name] = asyncio.create_task(self._watch(kept[name]), name=f"watch-{name}")
        if not all(r.ready for r in self.replicas):
            self.all_ready.clear()
        return added, removed

    def candidates(self, model: str) -> tuple[ReplicaState, ...]:
        """Ready replicas serving `model`, in config order (policies rely on a stable order). Kept
        per model until a replica's health, tokenizer or models change or the replica list is
        replaced (a request asks twice, and each ask was ~4 property calls a replica).

        Panic routing (`health.panic_routing`, on by default): when none is ready, or fewer than
        `health.panic_threshold` of the model's replicas (those with a tokenizer, drained ones not
        counted), the ready ones and the replicas out of rotation that are not known to be gone
        (ReplicaHealth.may_answer) and have a tokenizer; the model is then in `panicking`."""
        if self._candidates_seen != CHANGES[0] or self._candidates_of is not self.replicas:
            self._candidates.clear()
            self.panicking.clear()
            self._candidates_seen, self._candidates_of = CHANGES[0], self.replicas
        found = self._candidates.get(model)
        if found is None:
            found = tuple(r for r in self.replicas if r.ready and r.serves(model))
            health = self.config.health
            if health.panic_routing and (not found or health.panic_threshold and len(found) < health.panic_threshold
                                         * self._countable(model)):
                ready = len(found)
                panic = tuple(r for r in self.replicas if r.tokenizer is not None and r.serves(model)
                              and (r.ready or r.health.may_answer))
                if len(panic) > ready:
                    found = panic
                    self.panicking.add(model)
                    log.warning("panic_routing", model=model, replicas=[r.name for r in found], in_rotation=ready,
                                why=("no replica in rotation" if not ready else
                                     f"{ready} of {self._countable(model)} in rotation, under "
                                     f"health.panic_threshold {health.panic_threshold:g}")
                                + "; trying those not known to be gone")
            if found:  # not a name nobody serves: clients choose those, the cache must not grow with them
                self._candidates[model] = found
        return found

    def _countable(self, model: str) -> int:
        """The replicas of `model` that panic_threshold's fraction is of: a tokenizer, not drained."""
        return sum(1 for r in self.replicas if r.tokenizer is not None and r.serves(model) and r.health.state != DRAINING)

    def main_pool(self, model: str, decode_first: bool) -> tuple[tuple[ReplicaState, ...], tuple[str, ...]]:
        """The candidates a request's answer can come from, and their names: the decode replicas
        of a P/D model (`decode_first`; its mixed replicas when no decode replica is ready), else
        the mixed replicas. Prefill replicas only ever get prefill legs. Kept as candidates() is."""
        ready = self.candidates(model)  # first: it clears what changed
        key = (model, decode_first)
        found = self._candidates.get(key)
        if found is None:
            main = tuple(r for r in ready if r.spec.role == "decode") if decode_first else ()
            if not main:
                main = tuple(r for r in ready if r.spec.role == "mixed")
            found = self._candidates[key] = main, tuple(r.name for r in main)
        return found

    def known_models(self) -> list[str]:
        names: dict[str, None] = {}
        for replica in self.replicas:
            names[replica.spec.model] = None
            for model in replica.models:
                names[model] = None
        return list(names)

    def report(self, replica: ReplicaState, ok: bool, reason: str | None = None, fatal: bool = False) -> None:
        """What a request saw of a replica (passive health): a failure may eject it; `fatal` (a
        refused connection) ejects it at once."""
        if ok:
            replica.health.succeeded(time.monotonic())
            return
        replica.last_error = reason
        replica.poke.set()  # probe it now rather than at the next interval
        self._transition(replica, replica.health.on_request(ok, time.monotonic(), reason, fatal))

    def drain(self, name: str) -> bool:
        replica = self.by_name.get(name)
        if replica is None:
            return False
        self._transition(replica, replica.health.drain(time.monotonic()))
        return True

    def undrain(self, name: str) -> bool:
        replica = self.by_name.get(name)
        if replica is None:
            return False
        self._transition(replica, replica.health.undrain(time.monotonic()))
        replica.poke.set()
        return True

    def _transition(self, replica: ReplicaState, old: str | None) -> None:
        if old is None:
            return
        health = replica.health
        fields = {"replica": replica.name, "from_state": old, "state": health.state}
        if health.reason:
            fields["reason"] = health.reason
        if health.state == "ejected":
            fields["back_in_s"] = round(health.ejected_until_s - time.monotonic(), 3)
            self.metrics.ejections.labels(replica=replica.name, reason="probe" if old == "probing" or
                                          "probe" in (health.reason or "") else "requests").inc()
            log.warning("replica_state", **fields)
        else:
            log.info("replica_state", **fields)
        self._show_state(replica)
        if not replica.ready:
            self.all_ready.clear()
        elif all(r.ready for r in self.replicas):
            self.all_ready.set()

    def _show_state(self, replica: ReplicaState) -> None:
        for state in STATES:
            self.metrics.replica_state.labels(replica=replica.name, state=state).set(
                1 if replica.health.state == state else 0)

    # ---- background discovery -----------------------------------------------------------------

    async def _watch(self, replica: ReplicaState) -> None:
        if replica.spec.tokenizer:
            await self._load_local_tokenizer(replica)
        interval_s = DISCOVERY_INTERVAL_S
        while True:
            was_ready = replica.ready
            try:
                await self._probe(replica)
                old = replica.health.on_probe(True, time.monotonic())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a probe failure is a state, not a crash
                replica.last_error = _reason(exc)
                old = replica.health.on_probe(False, time.monotonic(), f"health probe: {_reason(exc)}",
                                              fatal=refused(exc))
            self._transition(replica, old)
            if replica.ready and not was_ready:
                log.info("replica_ready", replica=replica.name, url=replica.base_url,
                         models=replica.models, max_model_len=replica.max_model_len)
            if all(r.ready for r in self.replicas):
                self.all_ready.set()
            else:
                self.all_ready.clear()
            if replica.health.state == "starting" or replica.tokenizer is None:
                interval_s = min(interval_s * 1.5, 5.0)  # still loading: poll fast, backing off
            else:
                interval_s = self.config.health.probe_interval_s
            replica.poke.clear()
            try:
                await asyncio.wait_for(replica.poke.wait(), interval_s)
                interval_s = DISCOVERY_INTERVAL_S
            except asyncio.TimeoutError:
                pass

    async def _probe(self, replica: ReplicaState) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health.probe_timeout_s,
                                        connect=self.config.gateway.connect_timeout_s)
        async with self.session.get(replica.base_url + "/health", timeout=timeout) as resp:
            if resp.status != 200:
                text = (await resp.read())[:200].decode(errors="replace")
                raise RuntimeError(f"/health answered HTTP {resp.status} {text}".strip())
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
                None, lambda: warmed(TokenizerBundle.from_payload(gzip.decompress(payload) if gzipped else payload)))
            log.info("tokenizer_loaded", replica=replica.name, source="replica",
                     load_ms=round((time.perf_counter() - started) * 1000, 1))
            # A built-in replica says its default sampling; a resumed answer keeps its max_tokens.
            async with self.session.get(replica.base_url + "/model_info", timeout=timeout) as resp:
                if resp.status == 200:
                    preferred = (msgspec.json.decode(await resp.read()) or {}).get("preferred_sampling_params")
                    if isinstance(preferred, dict) and isinstance(preferred.get("max_tokens"), int):
                        replica.default_max_tokens = preferred["max_tokens"]
        replica.last_error = None

    async def _load_local_tokenizer(self, replica: ReplicaState) -> None:
        path = replica.spec.tokenizer
        loader = TokenizerBundle.from_gguf if path.endswith(".gguf") else TokenizerBundle.from_hf_dir
        try:
            replica.tokenizer = await asyncio.get_running_loop().run_in_executor(None, lambda: warmed(loader(path)))
            log.info("tokenizer_loaded", replica=replica.name, source=path)
        except Exception as exc:
            replica.last_error = f"tokenizer {path}: {_reason(exc)}"
            log.error("tokenizer_load_failed", replica=replica.name, path=path, error=_reason(exc))


def refused(exc: BaseException) -> bool:
    """A refused connection: nothing listens on the replica's port (its process is gone)."""
    return isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ConnectionRefusedError)


def _identity(spec: ReplicaSpec) -> tuple:
    return (spec.url.rstrip("/"), spec.model, spec.tokenizer)


def _reason(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
