"""A replica's overload reaches the client in OpenAI's shape with the replica's Retry-After.

Overload cannot be caused on demand on a real replica without racing its queue, so the upstream
here is a minimal OpenAI-shaped server that is always overloaded (vLLM's flat error shape); the
gateway in front of it is the real one, in its own process."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from tests.servers import gateway_config_over, openai_upstream, run_gateway


def overloaded_upstream():
    async def completions(_):
        return web.json_response({"object": "error", "message": "Too many waiting requests",
                                  "type": "TooManyRequests", "code": 429},
                                 status=429, headers={"Retry-After": "7"})

    return openai_upstream("busy", completions)


def test_replica_overload_is_a_429_with_its_retry_after(tmp_path):
    with overloaded_upstream() as upstream:
        config, port = gateway_config_over(tmp_path, upstream, "busy")
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
