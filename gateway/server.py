"""The gateway's aiohttp application and its lifecycle (uvloop, signals, readiness).

One process serves by default. With `gateway.workers` > 1 each worker process runs this same app
on the same port (SO_REUSEPORT), started and supervised by gateway/workers.py, and a WorkerLink
(gateway/worker_bus.py) keeps it in step with the others: routing decisions and load shared,
config and drains from the parent, /metrics merged (gateway/worker_metrics.py)."""
from __future__ import annotations

import asyncio
import gc
import signal
import sys
import time
from typing import Callable

import structlog
from aiohttp import web

from gateway.auth import Gate, grant_of
from gateway.config import Config
from gateway.front_door import FrontDoor
from gateway.kv_subscriber import KVEventSubscribers
from gateway.limits import ConnectionGuard, GuardedSite
from gateway.proxy import Proxy
from gateway.reload import ConfigWatcher
from gateway.router import Router
from gateway.scraper import Scraper
from gateway.supervisor import Supervisor
from gateway.upstream import ReplicaPool
from gateway.worker_bus import WorkerLink, WorkerSpec
from gateway.worker_metrics import MetricsSnapshots
from observability.metrics import GatewayMetrics
from observability.request_log import RequestLog
from protocol.errors import NotFound
from protocol.http import openai_errors

log = structlog.get_logger("kvgate.gateway")


def build_app(config: Config, config_path: str | None = None, launcher=None,
              admin_token: str | None = None, worker: WorkerSpec | None = None) -> web.Application:
    """The gateway; with `config_path`, the YAML is watched and hot-reloaded; with `launcher`
    (`kvgate up`), the replicas it started are supervised (restarted when they exit);
    `admin_token` (the CLI reads KVGATE_ADMIN_TOKEN) opens /admin/* besides the YAML's token.
    `worker`: this is one of several worker processes (then the parent watches the YAML and
    supervises the replicas, and neither of the two arguments is given)."""
    metrics = GatewayMetrics()
    pool = ReplicaPool(config, metrics)
    router = Router(config, metrics)
    request_log = RequestLog(config.logging.token_ids, observe=metrics.observe_records)
    metrics.before_collect = request_log.flush_if_on_loop  # /metrics counts every request answered
    gate = Gate(config, admin_token)
    guard = ConnectionGuard(config.limits, config.gateway.max_body_bytes)
    door = FrontDoor(gate, guard, request_log, metrics, lambda: router.config.routing.session_header)
    app = web.Application(middlewares=[openai_errors, door.middleware], client_max_size=config.gateway.max_body_bytes)
    app.on_response_prepare.append(door.on_prepare)
    proxy = Proxy(pool, router, metrics, request_log)
    link: WorkerLink | None = None
    scraper = Scraper(pool, router, metrics, peers=(lambda name: link.peer_counts(name)) if worker else None)
    subscribers = KVEventSubscribers(router, metrics)
    app["pool"], app["metrics"], app["proxy"], app["router"] = pool, metrics, proxy, router
    app["gate"], app["guard"] = gate, guard
    supervisor = None
    if launcher is not None:
        supervisor = Supervisor(launcher, config, metrics, router.state.tracker.own_in_flight)
        app.on_startup.append(supervisor.start)
        app.on_cleanup.append(supervisor.close)

    def apply(new: Config) -> dict:
        # Router first: it raises on a policy it cannot build, before anything has changed.
        # All synchronous, on the loop: no request is routed half-way through a swap.
        router.apply(new)
        if link is not None:
            router.policy = link.share(router.policy)  # the others learn what this policy commits
        added, removed = pool.apply(new)
        subscribers.sync(new)
        request_log.token_ids = new.logging.token_ids
        gate.apply(new)
        guard.apply(new.limits)
        proxy.budget.fraction, proxy.budget.minimum = new.gateway.retry_budget, new.gateway.retry_budget_min
        if supervisor is not None:  # processes start/stop in the background (stopping waits for requests)
            app["supervisor_sync"] = asyncio.get_running_loop().create_task(supervisor.sync(new))
        return {"added": added, "removed": removed}
    started = int(time.time())
    if worker is not None:
        link = WorkerLink(worker, router, pool, scraper, apply)
        link.snapshots = MetricsSnapshots(worker.run_dir, str(worker.index), metrics.registry)
        router.policy = link.share(router.policy)
        app["link"] = link

        async def tag_worker(_request: web.Request, response: web.StreamResponse) -> None:
            response.headers["x-kvgate-worker"] = str(worker.index)  # which process answered
        app.on_response_prepare.append(tag_worker)

    async def models(request: web.Request) -> web.Response:
        entries: dict[str, dict] = {}
        key = grant_of(request).key
        for replica in pool.replicas:
            for model in replica.models or [replica.spec.model]:
                if key is not None and key.models is not None and model not in key.models:
                    continue  # a key sees the models it may use
                entry = entries.setdefault(model, {"id": model, "object": "model", "created": started,
                                                   "owned_by": "kvgate", "root": model,
                                                   "max_model_len": None, "replicas": []})
                entry["replicas"].append(replica.name)
                if replica.max_model_len:
                    current = entry["max_model_len"]
                    entry["max_model_len"] = min(current, replica.max_model_len) if current else replica.max_model_len
        return web.json_response({"object": "list", "data": list(entries.values())})

    async def health(_request: web.Request) -> web.Response:
        """Public: whether the gateway serves (some replica is ready) and whether all are; no names,
        URLs or errors (those are at /admin/health)."""
        ready = any(replica.ready for replica in pool.replicas)
        return web.json_response({"status": "ok" if ready else "unavailable", "all_ready": pool.all_ready.is_set()},
                                 status=200 if ready else 503)

    async def admin_health(_request: web.Request) -> web.Response:
        ready = any(replica.ready for replica in pool.replicas)
        tracker, now = router.state.tracker, router.state.clock()
        return web.json_response(
            {"status": "ok" if ready else "unavailable", "all_ready": pool.all_ready.is_set(),
             "replicas": {replica.name: {**replica.describe(), "in_flight": tracker.in_flight(replica.name, now)}
                          for replica in pool.replicas},
             "connections": {"clients": len(guard.per_ip), "open": sum(guard.per_ip.values()),
                             "refused": guard.refused, "header_timeouts": guard.head_timeouts}},
            status=200 if ready else 503)

    async def metrics_endpoint(_request: web.Request) -> web.Response:
        # Several workers: this one's live metrics merged with the others' last snapshots.
        body = metrics.render() if link is None else link.snapshots.render()
        return web.Response(body=body, headers={"content-type": metrics.content_type})

    def prefix_blocks(name: str) -> int | None:
        """Blocks the prefix table records for a replica (KV events' or guessed): what this process
        believes it caches (with several workers, each answers for itself)."""
        state = router.state
        model = state.model_of.get(name)
        return state.table(model).size(name) if model is not None else None

    async def admin_replicas(_request: web.Request) -> web.Response:
        tracker, now = router.state.tracker, router.state.clock()
        return web.json_response({"replicas": [
            {"name": replica.name, **replica.describe(), "in_flight": tracker.own_in_flight(replica.name),
             "load_in_flight": tracker.in_flight(replica.name, now),
             "mode": "precise" if router.precise.get(replica.name) else "approximate",
             "prefix_blocks": prefix_blocks(replica.name),
             **(supervisor.describe(replica.name) if supervisor is not None
                else link.process_of(replica.name) if link is not None else {})}
            for replica in pool.replicas]})

    async def admin_drain(request: web.Request) -> web.Response:
        name, action = request.match_info["name"], request.match_info["action"]
        if not (pool.drain(name) if action == "drain" else pool.undrain(name)):
            raise NotFound(f"No replica named {name!r}.", param="name", code="replica_not_found")
        if link is not None:
            link.drained(name, action == "drain")  # every other worker, through the parent
        replica = pool.by_name[name]
        return web.json_response({"name": name, **replica.describe(),
                                  "in_flight": router.state.tracker.own_in_flight(name)})

    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_get("/admin/health", admin_health)
    app.router.add_get("/admin/replicas", admin_replicas)
    app.router.add_post("/admin/replicas/{name}/{action:drain|undrain}", admin_drain)
    app.on_startup.append(pool.start)
    app.on_startup.append(proxy.start)
    app.on_startup.append(scraper.start)
    app.on_startup.append(subscribers.start)
    app.on_cleanup.append(subscribers.close)
    app.on_cleanup.append(scraper.close)
    app.on_cleanup.append(pool.close)
    if link is not None:
        app.on_startup.append(link.start)
        app.on_cleanup.insert(0, link.close)
    if config_path is not None:
        watcher = ConfigWatcher(config_path, config, apply, metrics)
        app["config_watcher"] = watcher
        app.on_startup.append(watcher.start)
        app.on_cleanup.insert(0, watcher.close)
    return app


def ready_line(config: Config) -> str:
    models = config.models()
    label = "model" if len(models) == 1 else "models"
    count = len(config.replicas)
    workers = config.gateway.workers
    return (f"kvgate ready: http://{config.gateway.host}:{config.gateway.port}/v1 "
            f"({label} {', '.join(models)}, {count} replica{'s' if count != 1 else ''}"
            f"{f', {workers} workers' if workers > 1 else ''})")


# The cyclic collector, in a process that is the gateway: collect once everything startup built is
# built and freeze it (later collections never walk it again), then collect the young generation
# every GC_YOUNG_THRESHOLD container allocations instead of CPython's 700. A request allocates a
# few hundred containers and frees nearly all of them by reference counting, so the default ran a
# young collection every couple of requests: 2-5% of the gateway's CPU under load (perf).
GC_YOUNG_THRESHOLD = 20000


def tune_gc() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)


async def serve(config: Config, on_ready: Callable[[], None] | None = None,
                stop: asyncio.Event | None = None, config_path: str | None = None, launcher=None,
                admin_token: str | None = None, worker: WorkerSpec | None = None,
                owns_process: bool = False) -> None:
    """Run until SIGINT/SIGTERM (or `stop` is set). `on_ready` runs once every replica is ready.
    Stopping drains: the listening socket closes at once, requests in flight get drain_grace_s
    to finish (aiohttp's graceful shutdown), and only then does the caller stop the replicas.
    `worker`: one of several processes on the port (gateway/workers.py starts them).
    `owns_process`: the process is this gateway (`run`), so its collector is tuned (tune_gc)
    once the gateway listens; never for a gateway run inside another program (tests)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    app = build_app(config, config_path, launcher, admin_token, worker)
    link: WorkerLink | None = app.get("link")
    # handler_cancellation: a client that hangs up cancels its handler, which closes the upstream
    # request so the replica stops generating for nobody.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                           shutdown_timeout=config.gateway.drain_grace_s)
    await runner.setup()
    try:
        # Connections are GuardedHandlers: per-client cap, header timeout, header limits (gateway/limits.py).
        # Workers share the port: the kernel spreads new connections over their sockets.
        site = GuardedSite(runner, config.gateway.host, config.gateway.port, app["guard"], reuse_address=True,
                           reuse_port=True if link is not None else None, backlog=1024)
        await site.start()
        if owns_process:
            tune_gc()
        if link is not None:
            link.listening = True
        log.info("gateway_listening", host=config.gateway.host, port=config.gateway.port,
                 replicas=[replica.name for replica in config.replicas], policy=config.routing.policy)

        async def announce() -> None:
            await app["pool"].all_ready.wait()
            log.info("gateway_ready", url=f"http://{config.gateway.host}:{config.gateway.port}/v1",
                     models=config.models(), replicas=len(config.replicas))
            if link is not None:
                link.ready = True  # the parent prints the ready line once every worker is
            if on_ready is not None:
                on_ready()

        announcer = asyncio.create_task(announce())
        await stop.wait()
        announcer.cancel()
        log.info("gateway_draining", in_flight=app["proxy"].active, grace_s=config.gateway.drain_grace_s)
    finally:
        started = time.monotonic()
        await runner.cleanup()
        app["proxy"].request_log.flush()  # the last loop turn's records, before the loop goes
        log.info("gateway_stopped", drain_s=round(time.monotonic() - started, 3))
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        # Join the tokenizer threads while the loop is alive: uvloop.run's own shutdown of the
        # default executor can race the loop's close and print a traceback on Ctrl-C.
        await loop.shutdown_default_executor()


def run(config: Config, on_ready: Callable[[], None] | None = None, config_path: str | None = None,
        launcher=None, admin_token: str | None = None, worker: WorkerSpec | None = None) -> int:
    main = serve(config, on_ready, config_path=config_path, launcher=launcher, admin_token=admin_token,
                 worker=worker, owns_process=True)
    try:
        import uvloop
    except ImportError:  # not on Windows; asyncio's loop works, slower
        asyncio.run(main)
    else:
        uvloop.run(main)
    return 0


def print_ready(config: Config) -> Callable[[], None]:
    def announce() -> None:
        print(ready_line(config), file=sys.stderr, flush=True)
    return announce
