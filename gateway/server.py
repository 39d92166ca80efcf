"""The gateway's aiohttp application and its lifecycle (uvloop, signals, readiness)."""
from __future__ import annotations

import asyncio
import signal
import sys
import time
from typing import Callable

import structlog
from aiohttp import web

from gateway.config import Config
from gateway.proxy import Proxy
from gateway.upstream import ReplicaPool
from observability.metrics import GatewayMetrics
from observability.request_log import RequestLog
from protocol.http import openai_errors
from routing import make_policy

log = structlog.get_logger("kvgate.gateway")


def build_app(config: Config) -> web.Application:
    app = web.Application(middlewares=[openai_errors], client_max_size=config.gateway.max_body_bytes)
    pool = ReplicaPool(config)
    metrics = GatewayMetrics()
    proxy = Proxy(config, pool, make_policy(config.routing.policy), metrics,
                  RequestLog(config.logging.token_ids))
    app["pool"], app["metrics"], app["proxy"] = pool, metrics, proxy
    started = int(time.time())

    async def models(_request: web.Request) -> web.Response:
        entries: dict[str, dict] = {}
        for replica in pool.replicas:
            for model in replica.models or [replica.spec.model]:
                entry = entries.setdefault(model, {"id": model, "object": "model", "created": started,
                                                   "owned_by": "kvgate", "root": model,
                                                   "max_model_len": None, "replicas": []})
                entry["replicas"].append(replica.name)
                if replica.max_model_len:
                    current = entry["max_model_len"]
                    entry["max_model_len"] = min(current, replica.max_model_len) if current else replica.max_model_len
        return web.json_response({"object": "list", "data": list(entries.values())})

    async def health(_request: web.Request) -> web.Response:
        ready = any(replica.ready for replica in pool.replicas)
        return web.json_response(
            {"status": "ok" if ready else "unavailable", "all_ready": pool.all_ready.is_set(),
             "replicas": {replica.name: replica.describe() for replica in pool.replicas}},
            status=200 if ready else 503)

    async def metrics_endpoint(_request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"content-type": metrics.content_type})

    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    app.on_startup.append(pool.start)
    app.on_cleanup.append(pool.close)
    return app


def ready_line(config: Config) -> str:
    models = config.models()
    label = "model" if len(models) == 1 else "models"
    count = len(config.replicas)
    return (f"kvgate ready: http://{config.gateway.host}:{config.gateway.port}/v1 "
            f"({label} {', '.join(models)}, {count} replica{'s' if count != 1 else ''})")


async def serve(config: Config, on_ready: Callable[[], None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM (or `stop` is set). `on_ready` runs once every replica is ready."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    app = build_app(config)
    # handler_cancellation: a client that hangs up cancels its handler, which closes the upstream
    # request so the replica stops generating for nobody.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.gateway.host, config.gateway.port, reuse_address=True,
                           backlog=1024)
        await site.start()
        log.info("gateway_listening", host=config.gateway.host, port=config.gateway.port,
                 replicas=[replica.name for replica in config.replicas], policy=config.routing.policy)

        async def announce() -> None:
            await app["pool"].all_ready.wait()
            log.info("gateway_ready", url=f"http://{config.gateway.host}:{config.gateway.port}/v1",
                     models=config.models(), replicas=len(config.replicas))
            if on_ready is not None:
                on_ready()

        announcer = asyncio.create_task(announce())
        await stop.wait()
        announcer.cancel()
        log.info("gateway_stopping")
    finally:
        await runner.cleanup()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        # Join the tokenizer threads while the loop is alive: uvloop.run's own shutdown of the
        # default executor can race the loop's close and print a traceback on Ctrl-C.
        await loop.shutdown_default_executor()


def run(config: Config, on_ready: Callable[[], None] | None = None) -> int:
    try:
        import uvloop
    except ImportError:  # not on Windows; asyncio's loop works, slower
        asyncio.run(serve(config, on_ready))
    else:
        uvloop.run(serve(config, on_ready))
    return 0


def print_ready(config: Config) -> Callable[[], None]:
    def announce() -> None:
        print(ready_line(config), file=sys.stderr, flush=True)
    return announce
