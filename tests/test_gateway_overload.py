"""A replica's overload reaches the client in OpenAI's shape with the replica's Retry-After.

Overload cannot be caused on demand on a real replica without racing its queue, so the upstream
here is a minimal OpenAI-shaped server that is always overloaded (vLLM's flat error shape); the
gateway in front of it is the real one, in its own process."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from replica.tiny import tiny_checkpoint_dir
from tests.servers import free_port, run_gateway


@contextlib.contextmanager
def overloaded_upstream():
    port = free_port()
    loop = asyncio.new_event_loop()
    app = web.Application()

    async def health(_):
        return web.Response(text="ok")

    async def models(_):
        return web.json_response({"object": "list",
                                  "data": [{"id": "busy", "object": "model", "max_model_len": 2048}]})

    async def completions(_):
        return web.json_response({"object": "error", "message": "Too many waiting requests",
                                  "type": "TooManyRequests", "code": 429},
                                 status=429, headers={"Retry-After": "7"})

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    started = threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_replica_overload_is_a_429_with_its_retry_after(tmp_path):
    with overloaded_upstream() as upstream:
        port = free_port()
        config = tmp_path / "gateway.yaml"
        config.write_text(
            f"gateway: {{host: 127.0.0.1, port: {port}}}\nlogging: {{format: json}}\n"
            f"routing: {{policy: round_robin}}\nreplicas:\n"
            f"  - {{name: busy-0, url: '{upstream}', model: busy, tokenizer: '{tiny_checkpoint_dir()}'}}\n")
        with run_gateway(config, port) as gateway:
            request = urllib.request.Request(gateway.url + "/v1/completions", method="POST",
                                             data=b'{"model": "busy", "prompt": "hi", "max_tokens": 4}',
                                             headers={"content-type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(request, timeout=30)
            error = caught.value
            body = json.loads(error.read())
            assert error.code == 429
            assert error.headers["Retry-After"] == "7"
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert "Too many waiting requests" in body["error"]["message"]
