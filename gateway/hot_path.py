"""The two endpoints every request uses, POST /v1/completions and /v1/chat/completions, served on
the gateway's own HTTP/1.1 connection protocol; everything else is aiohttp's.

Why: aiohttp's server costs ~65 us per request on a 2-core box before any handler code runs (a
task per request, request and response objects, header multidicts, the middleware chain, the
response's prepare and writer), against ~10 us for a protocol that parses the head and writes the
answer in one transport.write (bench/vs_routers.py prints both). The gateway's budget per request
is about what a Rust router spends in all, so the hot path cannot afford it.

Every connection starts on `HotProtocol`. A request it takes is exactly this shape:

    POST /v1/completions (or /v1/chat/completions) HTTP/1.1, one Content-Length (within
    gateway.max_body_bytes), no Transfer-Encoding, Expect or Upgrade, header lines of printable
    ASCII within limits.max_headers / max_header_bytes

Anything else (another path or method, HTTP/1.0, chunked bodies, odd or oversized headers, bytes
that are not HTTP at all) hands the connection over to aiohttp for good: a GuardedHandler takes the
transport and gets the bytes received so far, so every refusal, limit and route stays aiohttp's
and the app's (gateway/limits.py, gateway/front_door.py); the proxy's aiohttp routes serve the
hot endpoints on such connections too. A hot request passes the same front door as on aiohttp
(request id, API key and requests/min, session header length, JSON shape, tokens/min settled
after), the app's on_response_prepare hooks add their headers, and the connection keeps every
limit GuardedHandler enforces (per-client cap, header timeout, body timeout, keep-alive timeout).
A client that hangs up cancels its request (the upstream request closes); a graceful shutdown
waits for the requests in flight (the connections are registered with aiohttp's server).

If the app has a middleware the hot path does not know, it serves nothing itself (HotPath.of)."""
from __future__ import annotations

import asyncio
import math
import os
import socket
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Coroutine

import msgspec
import httptools
from aiohttp import web
from aiohttp.tcp_helpers import tcp_keepalive
from multidict import CIMultiDict

from gateway.auth import GRANT
from gateway.exchange import ClientGone, Exchange
from gateway.front_door import REQUEST_ID, FrontDoor
from gateway.limits import (_CHUNK, GuardedHandler, _raw_error, admit_connection, check_json_shape,
                            checked_request_id, new_request_id)
from observability.request_log import RequestRecord
from protocol.errors import APIError, RequestTimeout
from protocol.http import openai_errors
from protocol.requests import decode_chat, decode_completion

try:  # gateway/_http_head.c: a plain head in one C pass, ~10x cheaper than llhttp's callbacks
    from gateway._http_head import parse as _plain_head, response_head as _native_response_head
except ImportError:  # no C compiler at install: every head goes through llhttp, every answer's head Python
    _plain_head = _native_response_head = None
# False: no sched_yield after a lone stream's first write (see HotExchange._first_out); off where
# the OS has none.
LET_CLIENT_RUN = hasattr(os, "sched_yield")
# A whole response whose body is shorter leaves with its head, in one bytes object and one write.
INLINE_BODY_BYTES = 65536
_TASK_NAME = "kvgate-request"  # every hot request's task (see HotProtocol._next)
NATIVE = True  # False: llhttp for every head even where the C reader was built (tests compare the two),
# and every response head made in Python

_ENDPOINTS = {b"/v1/completions": ("/v1/completions", decode_completion),
              b"/v1/chat/completions": ("/v1/chat/completions", decode_chat)}
_encode = msgspec.json.Encoder().encode


class HotPath:
    """The app's pieces a hot request goes through: the front door's steps, the proxy, the app's
    on_response_prepare hooks."""

    def __init__(self, app: web.Application, door: FrontDoor) -> None:
        self.app = app
        self.door = door
        self.proxy = app["proxy"]
        hooks = tuple(app.on_response_prepare)
        # The front door's own hook comes first (gateway/server.py): called directly on the
        # response's header dict; any other hook sees a response object, as on aiohttp.
        if hooks and getattr(hooks[0], "__func__", None) is FrontDoor.on_prepare and hooks[0].__self__ is door:
            self.hooks, self.door_headers = hooks[1:], door.add_headers
        else:
            self.hooks, self.door_headers = hooks, None

    @classmethod
    def of(cls, app: web.Application) -> "HotPath | None":
        """The app's hot path, or None when it has a middleware other than openai_errors and the
        front door's (a hot request would skip it) or no proxy."""
        door = None
        for middleware in app.middlewares:
            owner = getattr(middleware, "__self__", None)
            if middleware is openai_errors:
                continue
            if isinstance(owner, FrontDoor) and getattr(middleware, "__func__", None) is FrontDoor.middleware:
                door = owner
                continue
            return None
        if door is None or "proxy" not in app:
            return None
        return cls(app, door)

    def start(self, conn: "HotProtocol", target: bytes, headers: CIMultiDict, body: bytes,
              keep_alive: bool, arrived_s: float | None = None) -> Coroutine:
        """One request through the front door's steps (gateway/front_door.py, in its order), and
        what its task is to run: the proxy's handle(), or the refusal. Plain calls up to there, so
        the proxy's coroutine is the task's own (a coroutine layer less on every request).
        `arrived_s` (perf_counter): when its last byte was read; its record's times count from
        there, so they include the wait for the loop behind the requests that came with it."""
        endpoint, decode = _ENDPOINTS[target]
        door = self.door
        request_id = checked_request_id(headers.get("x-request-id")) or new_request_id()
        request = _HotRequest(headers, endpoint)
        request[REQUEST_ID] = request_id
        exchange = HotExchange(conn, request, request_id, keep_alive, self, arrived_s)
        try:
            grant = door.gate.authenticate(request)
        except APIError as err:
            return self.refuse(exchange, endpoint, err)
        request[GRANT] = exchange.grant = grant
        try:
            door._check_session_key(request)
            if len(body) > _CHUNK:  # the exact scan of a big body takes up to ~0.3 s: not on the loop
                return self._big(exchange, endpoint, decode, body)
            limits = door.guard.limits
            check_json_shape(body, limits.max_json_depth, limits.max_json_containers)
        except APIError as err:
            return self.refuse(exchange, endpoint, err, grant.key.name if grant.key else None)
        exchange.body_bytes = body
        return self.proxy.handle(exchange, endpoint, decode)

    async def _big(self, exchange: "HotExchange", endpoint: str, decode, body: bytes) -> None:
        """start()'s JSON shape check for a body over _CHUNK, in a thread; then the proxy."""
        limits = self.door.guard.limits
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, check_json_shape, body, limits.max_json_depth, limits.max_json_containers)
        except APIError as err:
            grant = exchange.grant
            await self.refuse(exchange, endpoint, err, grant.key.name if grant.key else None)
            return
        exchange.body_bytes = body
        await self.proxy.handle(exchange, endpoint, decode)

    async def refuse(self, exchange: "HotExchange", path: str, err: APIError, key: str | None = None) -> None:
        """What FrontDoor._refused does: the request's one record (its metrics with it), the error."""
        door = self.door
        record = RequestRecord(exchange.request_id, path, exchange.arrived_s)
        record.key = key
        record.fail(err.status, err.message)
        door.request_log.emit(record)  # its metrics too
        await exchange.respond_error(err, {})

    async def body_timed_out(self, conn: "HotProtocol", target: bytes, headers: CIMultiDict) -> None:
        """The head came, the body did not within limits.body_timeout_s: 408 (or the key's refusal,
        which the front door gives before it reads a body), and the connection closes."""
        endpoint, _ = _ENDPOINTS[target]
        request_id = checked_request_id(headers.get("x-request-id")) or new_request_id()
        request = _HotRequest(headers, endpoint)
        request[REQUEST_ID] = request_id
        exchange = HotExchange(conn, request, request_id, False, self)
        try:
            grant = self.door.gate.authenticate(request)
        except APIError as err:
            await self.refuse(exchange, endpoint, err)
            return
        request[GRANT] = grant
        limits = self.door.guard.limits
        await self.refuse(exchange, endpoint, RequestTimeout(
            f"The request body did not arrive within {limits.body_timeout_s:g} s (limits.body_timeout_s).",
            code="body_timeout"), grant.key.name if grant.key else None)


class _Head:
    """llhttp's callbacks for one request head: the target, the header pairs, whether it is
    HTTP/1.1 POST ASCII within the size limits."""
    __slots__ = ("url", "pairs", "longest", "ascii", "complete")

    def __init__(self) -> None:
        self.url = b""
        self.pairs: list[tuple[str, str]] = []
        self.longest = 0
        self.ascii = True
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + 2
        if size > self.longest:
            self.longest = size
        if not (name.isascii() and value.isascii()):
            self.ascii = False
        self.pairs.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.complete = True


class _HotRequest(dict):
    """What the front door's pieces and on_response_prepare hooks read of a request: its headers,
    path and method, and request state (this dict)."""
    __slots__ = ("headers", "path")
    method = "POST"

    def __init__(self, headers: CIMultiDict, path: str) -> None:  # empty as dict.__new__ made it
        self.headers = headers
        self.path = path

    def __hash__(self) -> int:  # hooks may keep requests in sets or as keys, as aiohttp's are
        return id(self)

    def __eq__(self, other) -> bool:
        return self is other


class _HotResponse:
    """What on_response_prepare hooks see of a response: its status and headers (to add to)."""
    __slots__ = ("status", "headers")

    def __init__(self, status: int, headers: CIMultiDict) -> None:
        self.status = status
        self.headers = headers


class HotExchange(Exchange):
    __slots__ = ("conn", "request", "request_id", "headers", "grant", "streaming", "body_bytes", "keep_alive",
                 "hot", "_held", "arrived_s", "_fresh")

    def __init__(self, conn: "HotProtocol", request: _HotRequest, request_id: str, keep_alive: bool,
                 hot: HotPath, arrived_s: float | None = None) -> None:
        self.arrived_s = time.perf_counter() if arrived_s is None else arrived_s
        self.conn = conn
        self.request = request
        self.request_id = request_id
        self.headers = request.headers
        self.grant = None
        self.streaming = False
        self.body_bytes = b""
        self.keep_alive = keep_alive
        self.hot = hot
        self._held = b""  # stream bytes written with the next write (see _hold)
        self._fresh = True  # nothing of the response sent yet (see _first_out)

    async def body(self) -> bytes:
        return self.body_bytes

    async def _head(self, status: int, headers: dict, framing: str, body: bytes = b"") -> bytes:
        """The response head (and `body` after it); `headers` is the caller's own new dict (added to
        here). Without hooks of the app's own, _head_now's."""
        hot = self.hot
        if not hot.hooks:
            return self._head_now(status, headers, framing, body)
        if hot.door_headers is not None:
            hot.door_headers(self.grant, self.request_id, headers)
        response = _HotResponse(status, CIMultiDict(headers))
        for hook in hot.hooks:
            await hook(self.request, response)
        return _response_head(status, response.headers, framing, not self.keep_alive or self.conn.closing, body)

    def _head_now(self, status: int, headers: dict, framing: str, body: bytes = b"") -> bytes:
        """_head where the app has no on_response_prepare hooks but the front door's (no await)."""
        hot = self.hot
        if hot.door_headers is not None:
            hot.door_headers(self.grant, self.request_id, headers)
        return _response_head(status, headers, framing, not self.keep_alive or self.conn.closing, body)

    async def open_stream(self, headers: dict[str, str], hold: bool = False) -> None:
        framing = "Transfer-Encoding: chunked"
        head = await self._head(200, headers, framing) if self.hot.hooks else self._head_now(200, headers, framing)
        self.streaming = True
        if hold:
            self._hold(head)
        else:
            self.conn.send(head)  # the head alone: _first_out waits for the first event

    pushes = True

    async def write(self, data: bytes, hold: bool = False) -> None:
        if self.write_now(data, hold):
            await self.conn.drain()

    def write_now(self, data: bytes, hold: bool = False) -> bool:
        chunk = b"%x\r\n%b\r\n" % (len(data), data)
        if hold:
            self._hold(chunk)
            return False
        conn = self.conn
        if self._held:
            chunk, self._held = self._held + chunk, b""
        self._send(chunk)
        return conn.write_paused

    async def drain(self) -> None:
        await self.conn.drain()

    async def close_stream(self, last: bytes = b"") -> None:
        held, self._held = self._held, b""
        if last:  # the final events and the end in one write (one syscall, one segment)
            self._send(b"%b%x\r\n%b\r\n0\r\n\r\n" % (held, len(last), last))
        else:
            try:
                self._send(held + b"0\r\n\r\n")
            except ClientGone:
                pass
        self.conn.response_done(self.keep_alive)

    def _send(self, data: bytes) -> None:
        """Send stream bytes: the first through _first_out."""
        if self._fresh:
            self._first_out(data)
        else:
            self.conn.send(data)

    def _first_out(self, data: bytes) -> None:
        """Send a stream's first events; when this is the process's only request in flight, give
        the core up once (sched_yield) before going on with the record, metrics and the connection.

        Why: with the client on the same machine (`kvgate up` and its users, an agent beside its
        gateway, a sidecar), the write wakes the client on the gateway's core (a socket's wake-up
        is a "sync" one: the kernel expects the writer to sleep next), but the gateway runs on:
        the client reads its first byte only after the gateway's ~100 us of post-write work. One
        yield lets it read first (the bench's streamed TTFB added: -0.01 to -0.19 ms at p50 in two
        A/B runs, bench/README "Twenty-eighth session"). Under load (another request in flight) it
        never yields, so it takes nothing from throughput; with nothing else runnable on the core,
        the call returns at once (~0.3 us). Not after a whole (non-streamed) answer: there the
        yield handed the core to a stub's turn with the record still to write, and the tails grew."""
        self._fresh = False
        self.conn.send(data)
        if LET_CLIENT_RUN and self.hot.proxy.active == 1:
            os.sched_yield()

    def _hold(self, data: bytes) -> None:
        """Keep `data` for the next write: a stream's head and its first events, or its last
        events and its end, leave in one syscall. The loop's next turn sends whatever is still
        held (the caller wrote nothing more after all)."""
        if not self._held:
            self.conn.loop.call_soon(self._send_held)
        self._held += data

    def _send_held(self) -> None:
        held, self._held = self._held, b""
        if held:
            try:
                self._send(held)
            except ClientGone:
                pass  # its next write says so

    def respond_now(self, status: int, body: bytes, headers: dict[str, str],
                    content_type: str = "application/json") -> bool:
        if self.hot.hooks:  # they are awaited: respond()
            return False
        small = len(body) < INLINE_BODY_BYTES
        head = self._head_now(status, {**headers, "Content-Type": content_type}, f"Content-Length: {len(body)}",
                              body if small else b"")
        self._send_whole(head, b"" if small else body)
        return True

    async def respond(self, status: int, body: bytes, headers: dict[str, str],
                      content_type: str = "application/json") -> None:
        if self.respond_now(status, body, headers, content_type):
            return
        small = len(body) < INLINE_BODY_BYTES
        head = await self._head(status, {**headers, "Content-Type": content_type}, f"Content-Length: {len(body)}",
                                body if small else b"")
        self._send_whole(head, b"" if small else body)

    def _send_whole(self, head: bytes, rest: bytes) -> None:
        """A whole response: its head (with the body, or its start), then `rest` of the body."""
        try:
            self.conn.send(head)
            if rest:
                self.conn.send(rest)
        except ClientGone:
            pass  # it hung up: nothing to answer (the record already has its outcome)
        self.conn.response_done(self.keep_alive)

    async def respond_error(self, err: APIError, headers: dict[str, str]) -> None:
        extra = dict(err.headers)
        if err.retry_after_s is not None:
            extra["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
        if isinstance(err, RequestTimeout):
            self.keep_alive = False
        await self.respond(err.status, _encode(err.body()), {**extra, **headers},
                           content_type="application/json; charset=utf-8")


_STATUS_LINES: dict[int, str] = {}


def _response_head(status: int, headers, framing: str, close: bool, body: bytes = b"") -> bytes:
    """Status line, `headers` (a dict or CIMultiDict), the framing and Date lines, "Connection:
    close" if `close`, the blank line, then `body`: in one C call (gateway/_http_head.c) where it
    was built and the headers are a plain dict of Latin-1 text without line breaks, else here."""
    status_line = _STATUS_LINES.get(status) or _status_line(status)
    if _native_response_head is not None and NATIVE:
        head = _native_response_head(status_line, headers, framing, _http_date(), close, body)
        if head is not None:
            return head
    lines = [status_line]
    for name, value in headers.items():
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}")
    lines.append(framing)
    lines.append(_http_date())
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _status_line(status: int) -> str:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {reason}"
    return line


_date = [0, ""]


def _http_date() -> str:
    now = int(time.time())
    if _date[0] != now:
        _date[0], _date[1] = now, "Date: " + formatdate(now, usegmt=True)
    return _date[1]


def set_no_delay(transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each event leaves at once


class HotProtocol(asyncio.Protocol):
    """One client connection: hot requests served here, anything else handed to aiohttp."""

    def __init__(self, server, *, loop: asyncio.AbstractEventLoop, guard, hot: HotPath, handler_kwargs: dict) -> None:
        self._server = server          # aiohttp's Server: its shutdown waits for our requests too
        self.loop = loop
        self._guard = guard
        self._hot = hot
        self._handler_kwargs = handler_kwargs
        self.transport: asyncio.Transport | None = None
        self._ip: str | None = None
        self._buffer = b""
        self._head: tuple | None = None       # a parsed head whose body is still arriving
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind = ""                 # "head", "body" or "idle": what _deadline is for
        self._deadline = 0.0
        self._handed = False
        self._refused = False
        self._read_paused = False
        self.write_paused = False
        self._drain_waiter: asyncio.Future | None = None
        self.closing = False                  # close once the current response is out
        self._task_handler = None             # what aiohttp's Server reads of its connections

    # ---- asyncio protocol ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        ip = admit_connection(self._guard, transport)
        if ip is None:
            self._refused = True
            return
        self._ip = ip
        self.transport = transport
        tcp_keepalive(transport)
        set_no_delay(transport)
        self._server.connection_made(self, transport)
        self._expect("head", self._guard.limits.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._refused or self._handed:
            return
        self._buffer = self._buffer + data if self._buffer else data
        if self._task is None:
            self._next()
        elif len(self._buffer) > self._guard.max_body_bytes + 65536 and not self._read_paused:
            self._read_paused = True  # a client pipelining more than a request ahead: wait for it
            self.transport.pause_reading()

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        if self._refused:
            return
        self.transport = None
        self._stop_timer()
        if self._ip is not None:
            self._guard.close(self._ip)
            self._ip = None
        self._server.connection_lost(self, exc)
        if self._task is not None:
            self._task.cancel()  # the client hung up: its handler is cancelled (the replica's request closes)
        self._wake_drain()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain()

    # ---- aiohttp's Server calls these at shutdown ------------------------------------------------
    def close(self) -> None:
        """Close once idle (now, if it is)."""
        self.closing = True
        if self._task is None and self.transport is not None:
            self.transport.close()

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        """Give the request in flight `timeout` seconds to finish, then cancel it; close."""
        self.closing = True
        self._stop_timer()
        task = self._task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
            if not task.done():
                task.cancel()
        if self.transport is not None:
            self.transport.close()

    # ---- writing (HotExchange) -------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ClientGone()
        transport.write(data)

    async def drain(self) -> None:
        while self.write_paused and self.transport is not None:
            waiter = self._drain_waiter = self.loop.create_future()
            await waiter
        if self.transport is None:
            raise ClientGone()

    def _wake_drain(self) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def response_done(self, keep_alive: bool) -> None:
        if not keep_alive:
            self.closing = True

    # ---- requests --------------------------------------------------------------------------------
    def _next(self) -> None:
        """Idle, with bytes in the buffer: take the next request if it is a hot one and complete."""
        buffer = self._buffer
        head = self._head
        if head is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > 16384 or buffer.find(b"\r\n", 0, 8192) < 0 and len(buffer) > 8192:
                    self._hand_over()  # a head this long is aiohttp's to refuse
                elif self._timer_kind != "head":
                    self._expect("head", self._guard.limits.header_timeout_s)  # a head has begun
                return
            head = self._parse_head(buffer, end)
            if head is None:
                self._hand_over()
                return
        target, headers, length, keep_alive, body_at = head
        if len(buffer) < body_at + length:
            self._head = head
            if self._timer_kind != "body":
                self._expect("body", self._guard.limits.body_timeout_s)
            return
        self._head = None
        self._timer_kind = ""  # disarmed (_disarm): the head's or body's deadline was met
        body = buffer[body_at:body_at + length]
        self._buffer = buffer[body_at + length:]
        # asyncio.Task with a name, not loop.create_task: Python 3.11 formats a "Task-N" name for
        # a task made without one (~1,800 instructions a request, a sprintf).
        task = self._task = asyncio.Task(self._hot.start(self, target, headers, body, keep_alive, time.perf_counter()),
                                         loop=self.loop, name=_TASK_NAME)
        task.add_done_callback(self._request_done)

    def _request_done(self, task: asyncio.Task) -> None:
        self._task = None
        if not task.cancelled() and task.exception() is not None:  # the proxy records its own errors
            self.loop.call_exception_handler({"message": "hot path request failed", "exception": task.exception(),
                                               "protocol": self})
            self.closing = True
        if self.transport is None:
            return
        if self.closing:
            self.transport.close()
            return
        if self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()
        if self._buffer:
            self._next()
        else:
            self._expect("idle", self._guard.limits.keepalive_timeout_s)

    def _parse_head(self, buffer: bytes, end: int) -> tuple | None:
        """(target, headers, content length, keep-alive, body offset) of a head the hot path
        serves, else None (aiohttp's). The head is checked by llhttp (httptools), the parser
        aiohttp itself runs on, so nothing it would refuse is taken here."""
        if not buffer.startswith(b"POST /v1/"):
            return None
        plain = _plain_head(buffer, end) if _plain_head is not None and NATIVE else None
        if plain is not None:  # the usual head, read and checked in C the way the lines below do
            target, pairs, longest, length, keep_alive = plain
            headers = CIMultiDict(pairs)
        else:
            head = _Head()
            parser = httptools.HttpRequestParser(head)
            try:
                parser.feed_data(buffer[:end + 4])
            except httptools.HttpParserError:
                return None
            target, pairs, longest = head.url, head.pairs, head.longest
            if target not in _ENDPOINTS or not head.complete or parser.get_http_version() != "1.1" \
                    or parser.get_method() != b"POST" or not head.ascii:
                return None
            headers = CIMultiDict(pairs)
            if "transfer-encoding" in headers or "expect" in headers or "upgrade" in headers:
                return None  # chunked bodies, 100-continue and upgrades are aiohttp's
            lengths = headers.getall("content-length", ())
            if len(lengths) != 1 or not lengths[0].isdigit():
                return None
            length = int(lengths[0])
            keep_alive = "close" not in headers.get("connection", "").lower()
        limits = self._guard.limits
        if len(pairs) > limits.max_headers or longest > limits.max_header_bytes:
            return None
        if length > self._guard.max_body_bytes:
            return None  # the front door's 413 (and its connection close) is aiohttp's to send
        return target, headers, length, keep_alive, end + 4

    def _hand_over(self) -> None:
        """From now on this connection is aiohttp's: a GuardedHandler takes the transport and the
        bytes received so far."""
        self._handed = True
        self._stop_timer()
        transport = self.transport
        handler = GuardedHandler(self._server, loop=self.loop, guard=self._guard, **self._handler_kwargs)
        self._guard.close(self._ip)  # the handler counts the connection itself
        self._ip = None
        self._server.connection_lost(self, None)
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self._read_paused:
            transport.resume_reading()
        data, self._buffer = self._buffer, b""
        if data:
            handler.data_received(data)

    # ---- timers ----------------------------------------------------------------------------------
    # One deadline per connection (head, body or idle) and at most one timer behind it, re-armed
    # when it fires early: a request that arrives whole costs two float stores, not a timer.
    def _expect(self, kind: str, seconds: float) -> None:
        at = self.loop.time() + seconds
        self._timer_kind, self._deadline = kind, at
        timer = self._timer
        if timer is None or timer.when() > at:
            if timer is not None:
                timer.cancel()
            self._timer = self.loop.call_at(at, self._timed_out)

    def _disarm(self) -> None:
        self._timer_kind = ""  # the timer, if any, finds nothing to do when it fires

    def _stop_timer(self) -> None:
        self._timer_kind = ""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        kind = self._timer_kind
        transport = self.transport
        if not kind or transport is None or self._task is not None or self._handed:
            return
        if self.loop.time() < self._deadline:  # the deadline moved since this timer was set
            self._timer = self.loop.call_at(self._deadline, self._timed_out)
            return
        self._timer_kind = ""
        if kind == "idle":
            transport.close()
        elif kind == "head":
            self._guard.head_timeouts += 1
            seconds = self._guard.limits.header_timeout_s
            transport.write(_raw_error(408, "Request Timeout", f"The request head did not arrive within "
                                       f"{seconds:g} s (limits.header_timeout_s).", "header_timeout"))
            transport.close()
        elif kind == "body" and self._head is not None:
            target, headers = self._head[0], self._head[1]
            self._head = None
            self._buffer = b""
            self.closing = True
            self.transport.pause_reading()
            task = self._task = self.loop.create_task(self._hot.body_timed_out(self, target, headers))
            task.add_done_callback(self._request_done)
