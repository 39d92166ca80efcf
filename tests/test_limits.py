"""Limits that keep one client from costing the gateway more than its share: slow clients (a
slowloris trickling its head, a body that never ends), too many connections, too many or too long
headers, deep or wide JSON, long prompts, stop strings, ids; and a reload that really applies what
it says it applies. Pure pieces first, then a real gateway with tight limits in front of a real
tiny replica, and one in front of an upstream that never answers."""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import time

import pytest

from gateway.limits import check_json_shape, checked_request_id, json_shape
from protocol.errors import BadRequest
from replica.tiny import tiny_checkpoint_dir
from tests.servers import free_port, openai_upstream, run_gateway, run_replica
from tests.test_cache_routing import poll
from tests.test_gateway import Gateway, http
from tests.test_hot_reload import log_events


# ---- pure pieces ---------------------------------------------------------------------------------

def _shape(value) -> tuple[int, int]:
    if isinstance(value, (list, dict)):
        children = [_shape(v) for v in (value.values() if isinstance(value, dict) else value)]
        return 1 + max([c[0] for c in children] or [0]), 1 + sum(c[1] for c in children)
    return 0, 0


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if depth < 6 and kind < 0.3:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 6 and kind < 0.6:
        return {rng.choice(["a", "[", '"', "\\", "}"]) * rng.randint(1, 3): _random_json(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    return rng.choice([1, "x", "[[{", '"]"', "\\\\", "\\\"[", None, 2.5, "\u00e9{"])


def test_json_shape_ignores_brackets_and_escapes_inside_strings():
    rng = random.Random(7)
    for _ in range(300):
        value = _random_json(rng)
        assert json_shape(json.dumps(value).encode()) == _shape(value), value
    deep = b'{"a":' + b"[" * 70 + b"]" * 70 + b"}"
    with pytest.raises(BadRequest, match="nests 71 levels"):
        check_json_shape(deep, 64, 100_000)
    wide = b'{"a":[' + b"[]," * 200 + b"[]]}"
    with pytest.raises(BadRequest, match="holds 203 objects and arrays"):
        check_json_shape(wide, 64, 100)
    check_json_shape(b'{"prompt": "' + b"[" * 5000 + b'"}', 64, 100)  # brackets in a string are text


def test_request_ids_are_kept_when_sane():
    assert checked_request_id("abc-123_X.y:z") == "abc-123_X.y:z"
    for bad in ("", " ", "a b", "x" * 129, "é", "a\r\nb", "-leading"):
        assert checked_request_id(bad) is None


# ---- a gateway with tight limits -----------------------------------------------------------------

LIMITS = ("limits: {header_timeout_s: 2, body_timeout_s: 2, max_connections_per_client: 16, max_json_depth: 8, "
          "max_json_containers: 1000, max_prompt_tokens: 64, max_headers: 20, max_header_bytes: 2048}\n")


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    with contextlib.ExitStack() as stack:
        replica = stack.enter_context(run_replica("tiny"))
        port = free_port()
        config = tmp_path_factory.mktemp("limits") / "gateway.yaml"
        config.write_text(f"gateway: {{host: 127.0.0.1, port: {port}, max_body_bytes: 65536}}\n"
                          "logging: {format: json}\nrouting: {policy: round_robin}\n" + LIMITS +
                          f"replicas:\n  - {{name: r0, url: '{replica.url}', model: tiny}}\n")
        yield Gateway(stack.enter_context(run_gateway(config, port)), [replica])


def _good(gateway: Gateway) -> None:
    status, _, answer = http("POST", gateway.url + "/v1/completions",
                             {"model": "tiny", "prompt": "hi", "max_tokens": 1})
    assert status == 200, answer


def _connect(gateway: Gateway) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gateway.server.port), timeout=5)


def _read_until_closed(sock: socket.socket, limit_s: float = 10.0) -> bytes:
    data, deadline = b"", time.monotonic() + limit_s
    sock.settimeout(0.5)
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def _error_of(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_a_slowloris_is_cut_off_while_other_clients_are_served(tight):
    slow = _connect(tight)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    slow.settimeout(0.5)
    answer, served = b"", 0
    for _ in range(60):  # a header byte every half second: cut off after header_timeout_s (2 s)
        try:
            slow.sendall(b"X")
            answer = slow.recv(65536)
        except socket.timeout:
            _good(tight)  # everyone else is served meanwhile
            served += 1
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        break
    answer += _read_until_closed(slow)
    slow.close()
    status, error = _error_of(answer)
    assert status == 408 and error["code"] == "header_timeout", answer
    assert served >= 1
    _good(tight)


def test_a_body_that_never_ends_is_cut_off(tight):
    slow = _connect(tight)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"model\": \"tiny\", ")
    slow.settimeout(0.5)
    answer = b""
    for _ in range(60):
        try:
            slow.sendall(b" ")
            answer = slow.recv(65536)
            break
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
    answer += _read_until_closed(slow)
    slow.close()
    status, error = _error_of(answer)
    assert status == 408 and error["code"] == "body_timeout"
    _good(tight)


def test_connections_past_the_per_client_cap_are_refused_with_a_429(tight):
    held = [_connect(tight) for _ in range(16)]
    try:
        extra = _connect(tight)
        status, error = _error_of(_read_until_closed(extra))
        extra.close()
        assert status == 429 and error["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    poll(lambda: http("GET", tight.url + "/v1/models")[0] == 200, "a connection again", tight.server)


def test_too_many_or_too_long_headers_are_a_431_in_openais_shape(tight):
    for headers in ({f"x-h{i}": "v" for i in range(30)}, {"x-long": "v" * 4096}):
        status, _, answer = http("GET", tight.url + "/v1/models", headers=headers)
        assert status == 431 and answer["error"]["code"] == "headers_too_large", answer
    _good(tight)


BAD_BODIES = [
    ({"model": "tiny", "prompt": "x", "z": [[[[[[[[[1]]]]]]]]]}, 400, "json_too_deep"),
    ({"model": "tiny", "prompt": "x", "z": [[]] * 1200}, 400, "json_too_large"),
    ({"model": "tiny", "prompt": "x" * 70_000}, 413, "body_too_large"),
    ({"model": "tiny", "prompt": [5] * 65}, 400, "prompt_too_long"),
    ({"model": "tiny", "prompt": [10 ** 30]}, 400, "invalid_type"),
    ({"model": "tiny", "prompt": "x", "seed": 10 ** 30}, 400, "invalid_type"),
    ({"model": "tiny", "prompt": "x", "stop": ["s" * 300]}, 400, "stop_too_long"),
    ({"model": "tiny", "prompt": "x", "stop": ["s"] * 17}, 400, None),
    ({"model": "tiny", "prompt": "x", "user": "u" * 300}, 400, "invalid_type"),
    ({"model": "tiny", "prompt": "x", "cache_salt": "c" * 300}, 400, "invalid_type"),
]


@pytest.mark.parametrize("body,status,code", BAD_BODIES, ids=[c or str(s) for _, s, c in BAD_BODIES])
def test_each_limit_is_a_clear_4xx(tight, body, status, code):
    got, _, answer = http("POST", tight.url + "/v1/completions", body)
    assert got == status and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert answer["error"]["code"] == code
    if code in ("invalid_type", "stop_too_long"):  # the same rule at the replica (protocol/requests.py)
        got, _, direct = http("POST", tight.replicas["r0"].url + "/v1/completions", body)
        assert got == 400 and direct["error"]["code"] == code
    _good(tight)


def test_a_bad_request_id_is_replaced_and_a_long_session_key_refused(tight):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    status, headers, _ = http("POST", tight.url + "/v1/completions", body, {"x-request-id": "x" * 300})
    assert status == 200 and len(headers["x-request-id"]) == 32 and headers["x-request-id"] != "x" * 300
    tight.record(headers["x-request-id"])
    status, headers, _ = http("POST", tight.url + "/v1/completions", body, {"x-request-id": "mine-1"})
    assert headers["x-request-id"] == "mine-1"
    status, _, answer = http("POST", tight.url + "/v1/completions", body, {"x-session-id": "s" * 300})
    assert status == 400 and answer["error"]["code"] == "session_key_too_long"


# ---- reload applies what it says ------------------------------------------------------------------

def silent_upstream():
    """An OpenAI-shaped server that never answers a completion (the request hangs until dropped)."""
    async def completions(request):
        await request.read()
        await asyncio.Event().wait()  # cancelled when the gateway hangs up

    return openai_upstream("tiny", completions, handler_cancellation=True)


def test_a_reloaded_request_timeout_applies_and_restart_only_keys_are_named(tmp_path):
    with silent_upstream() as upstream:
        port = free_port()
        config = tmp_path / "gateway.yaml"
        replica = f"  - {{name: s0, url: '{upstream}', model: tiny, tokenizer: '{tiny_checkpoint_dir()}'}}\n"
        config.write_text(f"gateway: {{host: 127.0.0.1, port: {port}, request_timeout_s: 600, ttft_timeout_s: 300}}\n"
                          f"logging: {{format: json}}\nreplicas:\n{replica}")
        with run_gateway(config, port) as server:
            gateway = Gateway(server, [])
            config.write_text(f"gateway: {{host: 127.0.0.1, port: {port}, request_timeout_s: 1, ttft_timeout_s: 300}}\n"
                              f"logging: {{format: json}}\nlimits: {{max_headers: 50}}\nreplicas:\n{replica}")
            poll(lambda: log_events(gateway, "config_reloaded"), "config_reloaded", server)
            reloaded = log_events(gateway, "config_reloaded")[-1]
            assert reloaded["needs_restart"] == ["limits.max_headers"]
            status, _, answer = http("POST", server.url + "/v1/completions", {"model": "tiny", "prompt": "hi"})
            assert status == 504 and "request_timeout_s" in answer["error"]["message"], answer
