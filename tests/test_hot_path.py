"""The gateway's own HTTP/1.1 protocol for the completion endpoints (gateway/hot_path.py), on a
real gateway in front of stub replicas: requests that arrive pipelined or in pieces are answered
in order, a connection that asks for anything else is handed to aiohttp and keeps working, and
every request ends in exactly one record with its token IDs, however many run at once."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import time
import uuid

import pytest

from bench.stub_backend import StubProcess
from tests.servers import free_port, gateway_config_over, openai_upstream, run_gateway
from tests.test_gateway import Gateway, http


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with contextlib.ExitStack() as stack:
        stubs = [stack.enter_context(StubProcess(output_tokens=6)) for _ in range(2)]
        port = free_port()
        config = tmp_path_factory.mktemp("hot") / "gateway.yaml"
        config.write_text(
            f"gateway: {{host: 127.0.0.1, port: {port}}}\nlogging: {{format: json, token_ids: full}}\n"
            "limits: {body_timeout_s: 1}\nrouting: {policy: cache_aware}\nreplicas:\n"
            + "".join(f"  - {{name: s{i}, url: '{stub.url}', model: stub}}\n" for i, stub in enumerate(stubs)))
        server = stack.enter_context(run_gateway(config, port))
        yield Gateway(server, [])


def post(path: str, body: dict, request_id: str, extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nx-request-id: {request_id}\r\n"
            f"{extra}Content-Length: {len(data)}\r\n\r\n").encode() + data


def read_responses(sock: socket.socket, count: int) -> list[tuple[int, dict, bytes]]:
    """`count` HTTP responses (Content-Length or chunked bodies) read off one connection."""
    buffer, out = b"", []
    while len(out) < count:
        while b"\r\n\r\n" not in buffer:
            buffer += _recv(sock)
        head, buffer = buffer.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        if "content-length" in headers:
            length = int(headers["content-length"])
            while len(buffer) < length:
                buffer += _recv(sock)
            body, buffer = buffer[:length], buffer[length:]
        else:
            body = b""
            while True:
                while b"\r\n" not in buffer:
                    buffer += _recv(sock)
                size_line, rest = buffer.split(b"\r\n", 1)
                size = int(size_line, 16)
                while len(rest) < size + 2:
                    rest += _recv(sock)
                body, buffer = body + rest[:size], rest[size + 2:]
                if size == 0:
                    break
        out.append((status, headers, body))
    return out


def _recv(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    assert data, "the gateway closed the connection"
    return data


COMPLETION = {"model": "stub", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 4}


def test_pipelined_and_piecemeal_requests_are_answered_in_order(gateway):
    ids = [f"pipe-{uuid.uuid4().hex[:8]}-{n}" for n in range(4)]
    with socket.create_connection(("127.0.0.1", gateway.server.port), timeout=10) as sock:
        sock.sendall(post("/v1/completions", COMPLETION, ids[0]) + post("/v1/chat/completions", {
            "model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, ids[1]))
        piecemeal = post("/v1/completions", {**COMPLETION, "stream": True}, ids[2]) + post(
            "/v1/completions", COMPLETION, ids[3])
        for start in range(0, len(piecemeal), 37):  # heads and bodies cut anywhere
            sock.sendall(piecemeal[start:start + 37])
            time.sleep(0.002)
        answers = read_responses(sock, 4)
    assert [status for status, _, _ in answers] == [200] * 4
    assert [headers["x-request-id"] for _, headers, _ in answers] == ids
    assert json.loads(answers[1][2])["object"] == "chat.completion"
    assert answers[2][1]["content-type"] == "text/event-stream" and answers[2][2].endswith(b"data: [DONE]\n\n")
    assert b"token_ids" not in answers[2][2] and b"token_ids" not in answers[0][2]
    for request_id in ids:
        record = gateway.record(request_id)
        assert record["status"] == 200 and len(record["output_token_ids"]) in (3, 4) and record["prompt_token_ids"]


def test_metrics_asked_right_after_answers_count_them(gateway):
    """The request log writes its records (and folds them into the metrics) a moment after they
    end, off the answered client's wait; /metrics asked at once, pipelined behind the requests,
    must count every one of them all the same."""
    from tests.test_gateway import metric

    ids = [f"counted-{uuid.uuid4().hex[:8]}-{n}" for n in range(3)]
    before = metric(http("GET", gateway.server.url + "/metrics")[2], "kvgate_requests_total", status="200")
    with socket.create_connection(("127.0.0.1", gateway.server.port), timeout=10) as sock:
        sock.sendall(b"".join(post("/v1/completions", COMPLETION, request_id) for request_id in ids)
                     + b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n")
        answers = read_responses(sock, 4)
    assert [status for status, _, _ in answers] == [200] * 4
    assert metric(answers[3][2].decode(), "kvgate_requests_total", status="200") == before + 3


def test_a_connection_asking_for_anything_else_goes_to_aiohttp_and_keeps_working(gateway):
    request_id = f"after-health-{uuid.uuid4().hex[:8]}"
    with socket.create_connection(("127.0.0.1", gateway.server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n" + post("/v1/completions", COMPLETION, request_id))
        (health_status, _, health), (status, headers, body) = read_responses(sock, 2)
    assert health_status == 200 and json.loads(health)["status"] == "ok"
    assert status == 200 and headers["x-request-id"] == request_id and json.loads(body)["choices"][0]["text"]
    assert gateway.record(request_id)["output_token_ids"]
    # Shapes the hot path leaves to aiohttp: a chunked body, HTTP/1.0, Expect: 100-continue.
    data = json.dumps(COMPLETION).encode()
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
    http10 = post("/v1/completions", COMPLETION, "x").replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    expect = post("/v1/completions", COMPLETION, "y", "Expect: 100-continue\r\n")
    for raw in (chunked, http10, expect):
        with socket.create_connection(("127.0.0.1", gateway.server.port), timeout=10) as sock:
            sock.sendall(raw)
            reply = b""
            while b'"finish_reason"' not in reply:
                reply += _recv(sock)
        assert b" 200 " in reply.split(b"\r\n", 1)[0] or b"100 Continue" in reply
    # A stream aiohttp took (a chunked body) is relayed by the request's task read by read (the
    # hot path's are relayed from the replica connection): the same events, the same record.
    request_id = f"aiohttp-stream-{uuid.uuid4().hex[:8]}"
    data = json.dumps({**COMPLETION, "stream": True}).encode()
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
               b"x-request-id: " + request_id.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
    streamed = {}
    for raw, name in ((chunked, "aiohttp"), (post("/v1/completions", {**COMPLETION, "stream": True},
                                                  request_id + "-hot"), "hot")):
        with socket.create_connection(("127.0.0.1", gateway.server.port), timeout=10) as sock:
            sock.sendall(raw)
            status, headers, body = read_responses(sock, 1)[0]
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert body.endswith(b"data: [DONE]\n\n") and b"token_ids" not in body
        streamed[name] = [json.loads(line[6:])["choices"][0]["text"] for line in body.split(b"\n\n")
                          if line.startswith(b"data: {")]
    assert streamed["aiohttp"] == streamed["hot"] and "".join(streamed["hot"])
    assert gateway.record(request_id)["output_token_ids"] == gateway.record(request_id + "-hot")["output_token_ids"]


def test_a_body_that_stops_coming_is_a_408_with_its_record(gateway):
    request_id = f"slow-body-{uuid.uuid4().hex[:8]}"
    with socket.create_connection(("127.0.0.1", gateway.server.port), timeout=10) as sock:
        sock.sendall(post("/v1/completions", COMPLETION, request_id)[:-10])
        (status, headers, body), = read_responses(sock, 1)
        assert sock.recv(10) == b""  # and the connection is closed
    assert status == 408 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "body_timeout"
    assert gateway.record(request_id)["status"] == 408


def test_a_connection_serves_request_after_request_and_a_stop_waits_for_none_of_the_idle_ones(tmp_path):
    """One keep-alive connection: requests one after another, then a stream the client hangs up on
    (a 499, its replica request closed); the gateway serves on, and a SIGTERM with idle keep-alive
    connections open stops at once, not after drain_grace_s (30 s) or the keep-alive timeout."""
    with StubProcess(output_tokens=60, token_interval_ms=50) as stub:
        port = free_port()
        config = tmp_path / "gateway.yaml"
        config.write_text(f"gateway: {{host: 127.0.0.1, port: {port}}}\nlogging: {{format: json, token_ids: full}}\n"
                          f"replicas:\n  - {{name: s0, url: '{stub.url}', model: stub}}\n")
        with run_gateway(config, port) as server:
            gateway = Gateway(server, [])
            tag = uuid.uuid4().hex[:8]
            short = {**COMPLETION, "max_tokens": 2}
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                for n in range(3):
                    sock.sendall(post("/v1/completions", short, f"seq-{tag}-{n}"))
                    (status, headers, _), = read_responses(sock, 1)
                    assert status == 200 and headers["x-request-id"] == f"seq-{tag}-{n}"
                sock.sendall(post("/v1/completions", {**COMPLETION, "max_tokens": 60, "stream": True},
                                  f"gone-{tag}"))
                received = b""
                while received.count(b"data: ") < 2:  # it streams: then the client hangs up
                    received += _recv(sock)
            assert gateway.record(f"gone-{tag}")["status"] == 499
            idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
            try:
                for n, sock in enumerate(idle):
                    sock.sendall(post("/v1/completions", short, f"idle-{tag}-{n}"))
                    assert read_responses(sock, 1)[0][0] == 200
                for request_id in [f"seq-{tag}-{n}" for n in range(3)] + [f"idle-{tag}-{n}" for n in range(2)]:
                    assert gateway.record(request_id)["status"] == 200
                stopping = time.monotonic()
                server.proc.terminate()
                server.proc.wait(timeout=20)
                assert time.monotonic() - stopping < 10, "a stop waited on idle keep-alive connections"
                assert server.proc.returncode == 0
                for sock in idle:  # closed by the gateway
                    assert sock.recv(10) == b""
            finally:
                for sock in idle:
                    sock.close()


def test_every_request_ends_in_exactly_one_record_with_its_token_ids(gateway):
    tag = uuid.uuid4().hex[:8]

    def one(n: int) -> str:
        request_id = f"many-{tag}-{n}"
        stream, chat = n % 2 == 0, n % 3 == 0
        body = ({"model": "stub", "messages": [{"role": "user", "content": f"question {n}"}], "max_tokens": 5}
                if chat else {"model": "stub", "prompt": f"prompt {n} " * (n % 7 + 1), "max_tokens": 5})
        status, _, answer = http("POST", gateway.url + ("/v1/chat/completions" if chat else "/v1/completions"),
                                 {**body, "stream": stream}, {"x-request-id": request_id})
        assert status == 200, answer
        return request_id

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        ids = list(pool.map(one, range(200)))
    deadline = time.monotonic() + 10
    while True:
        records = [r for r in gateway.records() if r["request_id"].startswith(f"many-{tag}-")]
        if len(records) >= len(ids) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert sorted(r["request_id"] for r in records) == sorted(ids)  # one each, none twice
    assert all(r["status"] == 200 and len(r["output_token_ids"]) == 5 and r["prompt_token_ids"] for r in records)


def test_a_stream_head_held_for_events_that_carry_nothing_still_leaves_at_once(tmp_path):
    """The gateway holds a stream's head to send it with the first events when the replica's head
    came with body bytes; when those bytes give the client nothing (a keep-alive comment) the head
    must still go out at once, not when the first token does."""
    from aiohttp import web


    async def completions(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        response._send_headers_immediately = False  # aiohttp then sends the head with the comment, one write
        await response.prepare(request)
        await response.write(b": keep-alive\n\n")
        await asyncio.sleep(1.5)
        for text, finish in ((" a", None), (" b", "length")):
            chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "slow",
                     "choices": [{"index": 0, "text": text, "token_ids": [7], "finish_reason": finish}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    with openai_upstream("slow", completions) as upstream:
        config, port = gateway_config_over(tmp_path, upstream, "slow")
        with run_gateway(config, port), socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            started = time.monotonic()
            sock.sendall(post("/v1/completions", {"model": "slow", "prompt": "hi", "max_tokens": 2,
                                                  "stream": True}, "held-head"))
            head = b""
            while b"\r\n\r\n" not in head:
                head += _recv(sock)
            head_s = time.monotonic() - started
            assert head.startswith(b"HTTP/1.1 200"), head
            assert head_s < 1.0, f"the stream's head waited {head_s:.2f} s for the first token"
            rest = head.split(b"\r\n\r\n", 1)[1]
            while b"0\r\n\r\n" not in rest:
                rest += _recv(sock)
            assert b'" a"' in rest and b'" b"' in rest and b"[DONE]" in rest and b"token_ids" not in rest


@pytest.mark.parametrize("asks", ["nothing", "token_ids", "usage"])
def test_a_stream_that_arrives_in_one_read_reaches_the_client_whole_and_in_order(asks, tmp_path):
    """A replica that shares the gateway's cores often writes its whole answer before the gateway
    reads (bench/README, "Twenty-eighth session"): the gateway's first read then holds every
    event, and it sends the first on its own before taking the rest. The client must still get
    exactly the replica's events in order, with token IDs and the usage chunk only if it asked,
    and the record every output token ID. The replica is asked for both, whatever the client
    asked (the client's own bytes with the two fields spliced in when it named neither)."""
    from aiohttp import web

    texts, ids = [" a", " b", " c", " d"], [11, 12, 13, 14]
    received = []

    async def completions(request):
        received.append(await request.json())
        chunks = [{"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "whole",
                   "choices": [{"index": 0, "text": text, "token_ids": [token],
                                "finish_reason": "length" if i == len(texts) - 1 else None}]}
                  for i, (text, token) in enumerate(zip(texts, ids))]
        chunks.append({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "whole", "choices": [],
                       "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        response._send_headers_immediately = False  # the head, every event and the end in one write
        await response.prepare(request)
        await response.write_eof(b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
                                 + b"data: [DONE]\n\n")
        return response

    extra = {"nothing": {}, "token_ids": {"return_token_ids": True},
             "usage": {"stream_options": {"include_usage": True}}}[asks]
    with openai_upstream("whole", completions) as upstream:
        config, port = gateway_config_over(tmp_path, upstream, "whole")
        with run_gateway(config, port) as server, socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            request_id = f"whole-{asks}"
            sent = {"model": "whole", "prompt": "hi", "max_tokens": 4, "stream": True, **extra}
            sock.sendall(post("/v1/completions", sent, request_id))
            status, _headers, body = read_responses(sock, 1)[0]
            record = Gateway(server, []).record(request_id)
    assert status == 200
    assert received == [{**sent, "return_token_ids": True, "stream_options": {"include_usage": True}}]
    events = [line[6:] for line in body.split(b"\n\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    with_choices = [chunk for chunk in chunks if chunk["choices"]]
    assert [chunk["choices"][0]["text"] for chunk in with_choices] == texts
    assert with_choices[-1]["choices"][0]["finish_reason"] == "length"
    if asks == "token_ids":
        assert [chunk["choices"][0]["token_ids"] for chunk in with_choices] == [[token] for token in ids]
    else:
        assert b"token_ids" not in body
    usage = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
    assert (usage[-1]["completion_tokens"] == 4) if asks == "usage" else not usage
    assert record["status"] == 200 and record["output_token_ids"] == ids


def test_a_client_that_reads_slowly_holds_back_the_replica_and_still_gets_all_of_its_stream(tmp_path):
    """The gateway relays a stream as it arrives; when the client does not read, the gateway stops
    reading from the replica (its memory stays bounded) instead of buffering the answer, and the
    client later gets every event in order."""
    from aiohttp import web

    events, piece = 6000, "x" * 2000  # ~12 MB of events: more than the sockets' buffers hold
    finished = {}

    async def completions(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i in range(events):
            chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "big",
                     "choices": [{"index": 0, "text": f"{i:05d}{piece}", "token_ids": [i],
                                  "finish_reason": "length" if i == events - 1 else None}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        finished["at"] = time.monotonic()
        await response.write(b"data: [DONE]\n\n")
        return response

    with openai_upstream("big", completions) as upstream:
        config, port = gateway_config_over(tmp_path, upstream, "big")
        with run_gateway(config, port), socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            sock.settimeout(30)
            sock.connect(("127.0.0.1", port))
            sock.sendall(post("/v1/completions", {"model": "big", "prompt": "hi", "max_tokens": 1000,
                                                  "stream": True}, "slow-reader"))
            sent = time.monotonic()
            time.sleep(1.5)  # not reading: the gateway's and the replica's buffers fill
            reading_from = time.monotonic()
            status, _headers, body = read_responses(sock, 1)[0]
    assert status == 200
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in body.split(b"\n\n")
             if line.startswith(b"data: {")]
    assert [text[:5] for text in texts] == [f"{i:05d}" for i in range(events)]
    assert body.endswith(b"data: [DONE]\n\n") and b"token_ids" not in body
    # The replica could write its last event only once the client read: it was held back.
    assert finished["at"] >= reading_from - 0.05, (finished["at"] - sent, reading_from - sent)


def test_the_replica_gets_the_clients_body_with_return_token_ids_whatever_its_spelling(tmp_path):
    """The replica's copy of a request is the client's own bytes with "return_token_ids": true
    added, and for a stream "stream_options": {"include_usage": true} (or, when the body names
    either key or the gateway edits it, the edited object): every field the client sent arrives,
    the replica is always asked for token IDs (and a stream's usage), and the client gets them
    only if it asked."""
    from aiohttp import web

    received: list[dict] = []
    received_bytes: list[bytes] = []

    async def completions(request):
        received_bytes.append(await request.read())
        body = json.loads(received_bytes[-1])  # the replica's parser: last duplicate wins, as vLLM's
        received.append(body)
        ids = [5, 6, 7] if body.get("return_token_ids") else None
        if body.get("stream"):
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            for i, text in enumerate([" x", " y", " z"]):
                choice = {"index": 0, "text": text, "finish_reason": "length" if i == 2 else None}
                if ids:
                    choice["token_ids"] = [ids[i]]
                await response.write(b"data: " + json.dumps({"id": "cmpl-1", "object": "text_completion",
                                                             "created": 1, "model": "echo",
                                                             "choices": [choice]}).encode() + b"\n\n")
            if (body.get("stream_options") or {}).get("include_usage"):
                await response.write(b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"echo",'
                                     b'"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":3,'
                                     b'"total_tokens":5}}\n\n')
            await response.write(b"data: [DONE]\n\n")
            return response
        return web.json_response({
            "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "echo",
            "choices": [{"index": 0, "text": " x y z", "finish_reason": "length", "token_ids": ids,
                         "prompt_token_ids": [1, 2] if ids else None}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}})

    pretty = b'{\n  "model": "echo",\n  "prompt": "say \\"return_token_ids\\" twice",\n  "max_tokens": 3,\n' \
             b'  "top_k": 5,\n  "vendor_x": {"a": [1, 2], "b": "}"}\n}\n\n'
    bodies = {
        "pretty": (pretty, None),
        "asks": (b'{"model": "echo", "prompt": "hi", "max_tokens": 3, "return_token_ids": true}', True),
        "declines": (b'{"model": "echo", "prompt": "hi", "max_tokens": 3, "return_token_ids": false}', False),
        "value": (b'{"model": "echo", "prompt": "return_token_ids", "max_tokens": 3}', None),
        "no-model": (b'{"prompt": "hi", "max_tokens": 3, "vendor_y": null}', None),
        "stream": (pretty.replace(b'"max_tokens": 3,', b'"max_tokens": 3, "stream": true,'), None),
        "stream-asks": (b'{"model": "echo", "prompt": "hi", "max_tokens": 3, "stream": true, '
                        b'"stream_options": {"include_usage": true}, "return_token_ids": true}', True),
        "stream-no-usage": (b'{"model": "echo", "prompt": "hi", "max_tokens": 3, "stream": true, '
                            b'"stream_options": {"include_usage": false}}', False),
    }
    with openai_upstream("echo", completions) as upstream:
        config, port = gateway_config_over(tmp_path, upstream, "echo")
        with run_gateway(config, port) as server:
            gateway = Gateway(server, [])
            for name, (raw, asked) in bodies.items():
                status, _, reply = http("POST", server.url + "/v1/completions", raw,
                                        {"content-type": "application/json", "x-request-id": f"splice-{name}"})
                assert status == 200, (name, reply)
                sent = received[-1]
                client = json.loads(raw)
                assert sent["return_token_ids"] is True and sent["model"] == "echo", name
                assert all(sent[key] == value for key, value in client.items()
                           if key not in ("return_token_ids", "stream_options")), name
                record = gateway.record(f"splice-{name}")
                assert record["output_token_ids"] == [5, 6, 7], name
                if client.get("stream"):
                    assert sent["stream_options"] == {"include_usage": True}, name
                    chunks = [json.loads(line[6:]) for line in reply.split("\n\n") if line.startswith("data: {")]
                    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " x y z", name
                    assert any("token_ids" in c["choices"][0] for c in chunks if c["choices"]) == bool(asked), name
                    assert any(c.get("usage") for c in chunks) == bool(asked), name
                    assert record["completion_tokens"] == 3 and record["prompt_tokens"] == 2, name
                else:
                    assert ("token_ids" in reply["choices"][0]) == bool(asked), (name, reply)
            # The usual bodies went as the client wrote them (their spacing too), with the members added.
            assert received_bytes[0] == pretty.rstrip()[:-1].rstrip() + b',"return_token_ids":true}'
            assert received_bytes[5] == bodies["stream"][0].rstrip()[:-1].rstrip() + \
                b',"return_token_ids":true,"stream_options":{"include_usage":true}}'


def test_a_non_streamed_answer_goes_through_as_the_replicas_bytes_without_the_ids_not_asked_for(tmp_path):
    """A non-streamed answer reaches the client as the replica wrote it (its vendor fields and
    member order kept), less the token IDs the client did not ask for: a long prompt's echoed IDs
    too, in compact JSON (as vLLM writes) and spaced JSON alike. The record has the output IDs
    either way; an answer that is not an OpenAI response is the replica's fault, not a 200."""
    import msgspec
    from aiohttp import web

    prompt_ids = list(range(100, 3100))  # a ~15 KB echo: past the size where the IDs are cut by a scan

    async def completions(request):
        body = json.loads(await request.read())
        if body["prompt"] == "broken":
            return web.json_response({"id": "cmpl-x", "choices": 7})
        answer = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "echo",
                  "choices": [{"index": 0, "text": " x y z", "logprobs": None, "finish_reason": "length",
                               "stop_reason": None, "prompt_token_ids": prompt_ids, "token_ids": [5, 6, 7]}],
                  "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": 3, "total_tokens": 3003,
                            "prompt_tokens_details": {"cached_tokens": 48}},
                  "system_fingerprint": "fp-1", "kv_transfer_params": None}
        if body["prompt"] == "spaced":
            return web.json_response(answer)  # json.dumps: ", " and ": "
        return web.Response(body=msgspec.json.encode(answer), content_type="application/json")

    with openai_upstream("echo", completions) as upstream:
        config, port = gateway_config_over(tmp_path, upstream, "echo")
        with run_gateway(config, port) as server:
            gateway = Gateway(server, [])
            for prompt in ("compact", "spaced"):
                for asked in (False, True):
                    request_id = f"answer-{prompt}-{asked}"
                    body = {"model": "echo", "prompt": prompt, "max_tokens": 3}
                    if asked:
                        body["return_token_ids"] = True
                    status, _, reply = http("POST", server.url + "/v1/completions", json.dumps(body).encode(),
                                            {"content-type": "application/json", "x-request-id": request_id})
                    assert status == 200, (request_id, reply)
                    choice = reply["choices"][0]
                    assert list(reply) == ["id", "object", "created", "model", "choices", "usage",
                                           "system_fingerprint", "kv_transfer_params"], request_id
                    assert choice["text"] == " x y z" and choice["finish_reason"] == "length", request_id
                    if asked:
                        assert choice["prompt_token_ids"] == prompt_ids and choice["token_ids"] == [5, 6, 7]
                    else:
                        assert "prompt_token_ids" not in choice and "token_ids" not in choice, request_id
                        assert list(choice) == ["index", "text", "logprobs", "finish_reason", "stop_reason"]
                    record = gateway.record(request_id)
                    assert record["output_token_ids"] == [5, 6, 7] and record["cached_tokens"] == 48, request_id
                    assert record["finish_reason"] == "length" and record["completion_tokens"] == 3, request_id
            status, _, reply = http("POST", server.url + "/v1/completions",
                                    b'{"model": "echo", "prompt": "broken", "max_tokens": 3}',
                                    {"content-type": "application/json", "x-request-id": "answer-broken"})
            assert status == 502 and "not an OpenAI response" in reply["error"]["message"], (status, reply)
            assert gateway.record("answer-broken")["status"] == 502


@pytest.mark.parametrize("native", [True, False], ids=["C", "Python"])
def test_a_response_header_with_a_line_break_is_refused_not_written(native, monkeypatch):
    """A hook (or a header the gateway echoes) must not split the response: a CR or LF in any
    header's name or value refuses the head; clean headers make one CRLF-separated block. The C
    head (gateway/_http_head.c) and the Python one write the same bytes and refuse the same heads."""
    from types import SimpleNamespace

    from multidict import CIMultiDict

    from gateway import hot_path
    from gateway.hot_path import HotExchange, _HotRequest
    if native and hot_path._native_response_head is None:
        pytest.skip("gateway/_http_head.c was not built (no C compiler at install)")
    monkeypatch.setattr(hot_path, "NATIVE", native)

    def head(headers: dict, keep_alive: bool = True, body: bytes = b"") -> bytes:
        conn = SimpleNamespace(closing=False)
        hot = SimpleNamespace(hooks=(), door_headers=None)  # no front door, no app hooks
        exchange = HotExchange(conn, _HotRequest(CIMultiDict(), "/v1/completions"), "id", keep_alive, hot)
        return asyncio.run(exchange._head(200, headers, "Content-Length: 2", body))

    text = head({"x-request-id": "abc", "x-one": "1"}).decode()
    assert text.startswith("HTTP/1.1 200 OK\r\nx-request-id: abc\r\nx-one: 1\r\nContent-Length: 2\r\nDate: ")
    assert text.endswith("\r\n\r\n") and text.count("\r\n") == 6
    assert head({}).decode().startswith("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n")
    closing = head({"x-a": "caf\xe9"}, keep_alive=False, body=b"{}")  # Latin-1 text; the body after the head
    assert closing.startswith(b"HTTP/1.1 200 OK\r\nx-a: caf\xe9\r\nContent-Length: 2\r\nDate: ")
    assert closing.endswith(b"\r\nConnection: close\r\n\r\n{}")
    for bad in ({"x-a": "1", "x-evil": "v\r\nSet-Cookie: s=1"}, {"x-evil\n": "v"}, {"x-a": "1\r"}):
        with pytest.raises(ValueError, match="line break"):
            head(bad)
    with pytest.raises(UnicodeEncodeError):
        head({"x-a": "\u6f22"})


HEADS = [  # (head, whether the C reader takes it: the plain shape; the rest is llhttp's to read)
    (b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n", True),
    (b"POST /v1/chat/completions HTTP/1.1\r\nhost:gw\r\ncontent-length: 2\r\nConnection: close\r\n\r\n", True),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nX-Odd!#$%&'*+-.^_`|~: a\tb c\r\n\r\n", True),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length:\t2\r\n\r\n", True),
    # the C reader also leaves what the hot path gives aiohttp anyway (llhttp's reading says so too)
    (b"POST /v1/completions HTTP/1.1\r\n\r\n", False),                                  # no Content-Length
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2x\r\n\r\n", False),               # not a number
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nexpect: 100-continue\r\n\r\n", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nUPGRADE: h2c\r\n\r\n", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 0002\r\nconnection: Keep-Alive, CLOSE\r\n\r\n", True),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nConnection: keep-alive\r\n"
     b"Connection: close\r\n\r\n", True),                                               # the first one counts
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2 \r\n\r\n", False),           # trailing space
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length:  2\r\n\r\n", False),           # two spaces
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length : 2\r\n\r\n", False),           # space before colon
    (b"POST /v1/completions HTTP/1.1\r\nX-Empty:\r\nContent-Length: 2\r\n\r\n", False),
    (b"POST /v1/completions HTTP/1.1\r\nX-A: 1\r\n folded\r\nContent-Length: 2\r\n\r\n", False),
    (b"POST /v1/completions HTTP/1.1\r\nX-A: 1\nContent-Length: 2\r\n\r\n", False),    # bare LF
    (b"POST /v1/completions HTTP/1.1\r\nX-A: caf\xc3\xa9\r\nContent-Length: 2\r\n\r\n", False),
    (b"POST /v1/completions HTTP/1.1\r\nX-A: a\x01b\r\nContent-Length: 2\r\n\r\n", False),
    (b"POST /v1/completions HTTP/1.1\r\nX(A): 1\r\nContent-Length: 2\r\n\r\n", False),
    (b"POST /v1/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n", False),
    (b"POST /v1/completions?x=1 HTTP/1.1\r\nContent-Length: 2\r\n\r\n", False),
    (b"POST /v1/models HTTP/1.1\r\nContent-Length: 2\r\n\r\n", False),
    (b"POST  /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n" + b"X-Long: " + b"v" * 9000 + b"\r\n\r\n", True),
]


@pytest.mark.parametrize("head,plain", HEADS, ids=range(len(HEADS)))
def test_the_c_head_reader_reads_a_plain_head_as_llhttp_does_and_leaves_the_rest_to_it(head, plain, monkeypatch):
    from gateway import hot_path
    if hot_path._plain_head is None:
        pytest.skip("gateway/_http_head.c was not built (no C compiler at install)")

    class Guard:
        limits = type("Limits", (), {"max_headers": 100, "max_header_bytes": 8190})
        max_body_bytes = 1 << 20
    protocol = hot_path.HotProtocol.__new__(hot_path.HotProtocol)
    protocol._guard = Guard
    buffer, end = head + b"{}", head.find(b"\r\n\r\n")
    assert (hot_path._plain_head(buffer, end) is not None) == plain

    def parsed():
        result = protocol._parse_head(buffer, end)
        return None if result is None else (result[0], list(result[1].items()), *result[2:])
    native = parsed()
    monkeypatch.setattr(hot_path, "NATIVE", False)
    assert native == parsed()


def test_a_first_event_sent_ahead_undecoded_reaches_the_client_as_the_decoded_one_would(monkeypatch):
    """A stream's first read of several events sends the first one before decoding it when it can
    pass as it is (gateway/answer.py _passes_as_is): the client's bytes, the answer's state and
    the record must be what decoding it first gives, whatever the first event holds (a role chunk,
    no choice, usage, an error, a KV transfer's stats, loose spacing, echo, IDs asked for or not)."""
    from gateway import answer as answer_module
    from gateway.answer import Answer, AnswerSpec, InBandError
    from gateway.exchange import Exchange
    from observability.request_log import RequestRecord

    class Sink(Exchange):  # what the client's connection gets, write by write
        pushes = True

        def __init__(self):
            self.writes = []

        def write_now(self, data, hold=False):
            self.writes.append(data)
            return False

    def ev(obj, compact=True) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":") if compact else None).encode()

    base = {"id": "c-1", "object": "text_completion", "created": 1, "model": "m"}
    text = lambda t, i, **more: ev({**base, "choices": [{"index": 0, "text": t, "token_ids": [i], **more}]})
    role = ev({**base, "object": "chat.completion.chunk", "prompt_token_ids": [1, 2],
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    delta = lambda t, i: ev({**base, "object": "chat.completion.chunk",
                             "choices": [{"index": 0, "delta": {"content": t}, "token_ids": [i]}]})
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    firsts = {
        "plain": (False, text(" a", 5, prompt_token_ids=[1, 2])),
        "chat-role": (True, role),
        "no-choice": (False, ev({**base, "choices": []})),
        "usage": (False, ev({**base, "choices": [], "usage": usage})),
        "usage-in-choice": (False, ev({**base, "choices": [{"index": 0, "text": " a", "token_ids": [5]}],
                                       "usage": usage})),
        "error-text": (False, text(' an "error"', 5)),
        "error": (False, ev({**base, "error": {"message": "boom"}})),
        "kv-stats": (False, ev({**base, "kv_transfer_stats": {"kv_transfer_bytes": 9},
                                "choices": [{"index": 0, "text": " a", "token_ids": [5]}]})),
        "spaced": (False, ev({**base, "choices": [{"index": 0, "text": " a", "token_ids": [5]}]}, compact=False)),
        "finished": (False, text(" a", 5, finish_reason="stop")),
    }

    passes_as_is = answer_module._passes_as_is

    def run(chat, first, ids, usage_wanted, echo, ahead):
        monkeypatch.setattr(answer_module, "_passes_as_is", passes_as_is if ahead else lambda e: False)
        record = RequestRecord("r", "/v1/chat/completions" if chat else "/v1/completions", 0.0)
        sink = Sink()
        answer = Answer(AnswerSpec(chat, True, "m", ids, usage_wanted, [], True, echo), record, {}, sink)
        rest = [delta(" b", 6), delta(" c", 7)] if chat else [text(" b", 6), text(" c", 7, finish_reason="length")]
        try:
            answer.on_events_now([first] + rest)
            failed = None
        except InBandError as exc:
            failed = str(exc)
        return (sink.writes, failed, answer.finish_reason, answer.texts, answer.emitted_chars, answer.opening_sent,
                answer.prompt_token_ids, record.output_token_ids, record.prompt_tokens, record.error,
                record.first_token_s is not None)

    ahead_taken = 0
    for name, (chat, first) in firsts.items():
        for ids in (False, True):
            for usage_wanted in (False, True):
                for echo in (0, 1):
                    decoded = run(chat, first, ids, usage_wanted, echo, ahead=False)
                    ahead = run(chat, first, ids, usage_wanted, echo, ahead=True)
                    assert ahead == decoded, (name, ids, usage_wanted, echo)
                    ahead_taken += passes_as_is(first) and not echo
    assert ahead_taken == 4 * 4  # plain, chat-role, error-text, finished: IDs asked or not, usage or not
