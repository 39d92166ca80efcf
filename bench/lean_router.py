"""A second floor for bench/vs_routers.py: the work every kvgate round_robin request must do, in
the leanest Python this project knows how to write, and nothing else.

Per request, with kvgate's own C helpers where kvgate uses them: read the head
(gateway/_http_head.c), decode the body into the gateway's request struct (msgspec), take the
prompt's token IDs from the token cache (tokenization/token_cache.py), add "return_token_ids"
(gateway/proxy.py `_with_token_ids`), send it on a kept-alive connection to the next stub in turn,
read the answer whole (`_http_head.parse_response`), decode it for its output IDs and usage
(protocol/stream_chunks.py `decode_answer`), strip the IDs the client did not ask for
(protocol/_strip_ids.c), answer the client, and log one JSON line with both ID lists through
kvgate's record line and log writer thread (observability/request_log.py, log_writer.py).

What it leaves out is everything else kvgate does on a request: no API keys, limits or front
door, no metrics, no load tracking, health, retries or failover, no timeouts, no error answers (a
request it cannot take closes the connection), no chat, no streaming. It is a reference row, not a
router: the gap between it and kvgate round_robin is what kvgate's layering and features cost a
request; the gap between it and the byte pipe is what the essential work costs in Python.

    .venv/bin/python -m bench.lean_router --port 8100 --backend http://127.0.0.1:8001 --log-file /tmp/lean.jsonl
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import time
from collections import deque
from urllib.parse import urlsplit

import uvloop

from gateway._http_head import parse as parse_head, parse_response
from gateway.hot_path import _response_head
from gateway.proxy import _with_token_ids
from observability.log_writer import LogWriter
from observability.logs import JsonSink, LogFile
from observability.request_log import RequestRecord
from protocol.requests import decode_completion
from protocol.stream_chunks import decode_answer, strip_token_ids
from tokenization import TokenizerBundle
from tokenization.token_cache import token_cache


class _Upstream(asyncio.Protocol):
    """One kept-alive connection to a stub, one request at a time."""

    def __init__(self, idle: deque) -> None:
        self.idle = idle
        self.transport = None
        self.buffer = b""
        self.waiter: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        answer = parse_response(self.buffer)
        if answer is not None and self.waiter is not None:
            self.buffer = b""
            waiter, self.waiter = self.waiter, None
            waiter.set_result(answer)

    def connection_lost(self, exc) -> None:
        self.transport = None
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("upstream closed"))


class _Backend:
    def __init__(self, host: str, port: int, endpoint_head: bytes) -> None:
        self.host, self.port = host, port
        self.idle: deque[_Upstream] = deque()
        self.head = endpoint_head

    async def post(self, payload: bytes) -> tuple:
        loop = asyncio.get_running_loop()
        conn = None
        while self.idle:
            conn = self.idle.pop()
            if conn.transport is not None:
                break
            conn = None
        if conn is None:
            _, conn = await loop.create_connection(lambda: _Upstream(self.idle), self.host, self.port)
        conn.waiter = loop.create_future()
        conn.transport.write(self.head + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        answer = await conn.waiter
        self.idle.append(conn)
        return answer


class _Client(asyncio.Protocol):
    def __init__(self, router: "LeanRouter") -> None:
        self.router = router
        self.transport = None
        self.buffer = b""
        self.busy = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self._next()

    def connection_lost(self, exc) -> None:
        self.transport = None

    def _next(self) -> None:
        buffer = self.buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = parse_head(buffer, end)
        if head is None:  # GET /health answers (for whoever starts it); anything else is not served
            if buffer.startswith(b"GET /health "):
                self.buffer = buffer[end + 4:]
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            else:
                self.transport.close()
            return
        length = None
        for name, value in head[1]:
            if name.lower() == "content-length":
                length = int(value)
        if length is None:
            self.transport.close()
            return
        at = end + 4
        if len(buffer) < at + length:
            return
        self.buffer = buffer[at + length:]
        self.busy = True
        task = asyncio.Task(self.router.serve(self, buffer[at:at + length], time.perf_counter()),
                            loop=self.router.loop, name="lean")
        task.add_done_callback(self._done)

    def _done(self, task) -> None:
        self.busy = False
        if task.cancelled() or task.exception() is not None:
            if self.transport is not None:
                self.transport.close()
            return
        if self.buffer and self.transport is not None:
            self._next()


def answer_client(client: _Client, record: RequestRecord, answer: bytes) -> None:
    """A replica's whole answer to the client, without the token IDs it did not ask for, and
    what the record keeps of it (output IDs, finish reason, cached tokens)."""
    reply = decode_answer(answer)
    out = strip_token_ids(answer)
    client.transport.write(_response_head(200, {"Content-Type": "application/json", "x-request-id": record.request_id},
                                          f"Content-Length: {len(out)}", False, out))
    choice = reply.choices[0]
    record.output_token_ids = list(choice.token_ids or ())
    record.finish_reason = choice.finish_reason
    record.completion_tokens = len(record.output_token_ids)
    details = reply.usage.prompt_tokens_details if reply.usage is not None else None
    record.cached_tokens = details.cached_tokens if details is not None else None


class LeanRouter:
    def __init__(self, backends: list[_Backend], bundle: TokenizerBundle, writer: LogWriter) -> None:
        self.backends = backends
        self.turn = 0
        self.cache = token_cache(bundle)
        self.sink = JsonSink(writer)  # the gateway's JSON sink: the same line, event, level and time stamp
        self.loop = asyncio.get_running_loop()
        self.count = 0

    async def serve(self, client: _Client, body: bytes, arrived_s: float) -> None:
        parsed = decode_completion(body)
        self.count += 1
        record = RequestRecord(f"lean-{self.count}", "/v1/completions", arrived_s)
        record.model = parsed.model
        cache = self.cache
        record.prompt_token_ids = ids = cache.finish(cache.lookup(parsed.prompt), True)
        record.prompt_tokens = len(ids)
        backend = self.backends[self.turn % len(self.backends)]
        self.turn += 1
        record.replica = backend.host + ":" + str(backend.port)
        record.routed_s = time.perf_counter()
        status, _headers, answer = await backend.post(_with_token_ids(body))
        answer_client(client, record, answer)
        record.first_token_s = record.finished_s = time.perf_counter()
        self.sink.line("request", record.as_line("full"))


async def serve(port: int, backends: list[str], log_file: str) -> None:
    from replica.tiny import tiny_checkpoint_dir  # the stubs' tokenizer (bench/stub_backend.py)
    bundle = TokenizerBundle.from_hf_dir(tiny_checkpoint_dir())
    writer = LogWriter(None, LogFile(log_file))
    targets = []
    for url in backends:
        parts = urlsplit(url)
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: ").encode()
        targets.append(_Backend(parts.hostname, parts.port, head))
    router = LeanRouter(targets, bundle, writer)
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    for signum in (signal.SIGTERM, signal.SIGINT):  # stopped: every record handed over is written
        loop.add_signal_handler(signum, lambda: stop.done() or stop.set_result(None))
    server = await loop.create_server(lambda: _Client(router), "127.0.0.1", port)
    print(f"lean router on http://127.0.0.1:{port} -> {', '.join(backends)}", flush=True)
    async with server:
        await stop
    writer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="kvgate round_robin's essential work in lean Python.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", action="append", required=True, help="backend URL (repeat for more)")
    parser.add_argument("--log-file", required=True, help="where the request records go (JSON lines)")
    args = parser.parse_args(argv)
    uvloop.run(serve(args.port, args.backend, args.log_file))


if __name__ == "__main__":
    main()
