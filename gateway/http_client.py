"""The gateway's HTTP/1.1 client to its replicas: pooled keep-alive connections on asyncio
protocols (uvloop's), built for one job: POST a JSON body, read a status, a few headers and a
body (Content-Length, chunked, or up to the close), often a stream of SSE events.

Why not aiohttp's client: per request it builds a ClientRequest, a ClientResponse, header
multidicts, a timer context, a StreamReader with its own buffer list, and it yields once per
chunk of the stream; that was ~150 us of the gateway's ~1.6 ms per request on a 2-core box
(py-spy, bench/vs_routers.py). Here a request is one write of the head and body, and the
response is parsed (llhttp) straight from the socket's reads: one wake-up per read, whatever
number of chunks it carries.

    client = UpstreamClient(connect_timeout_s=5)
    response = await client.post(origin, "/v1/completions", body, request_id)
    while data := await response.read_some(): ...   # decoded body bytes, as they arrive
    response.release()                               # back to the pool if complete, else closed

Connections are reused LIFO (the most recently used is the one least likely to have been closed
by the replica's idle timeout), closed after `idle_timeout_s` idle, and a request whose reused
connection turns out dead before any byte of its answer (closed by the replica meanwhile) is
sent once more on a fresh connection. Reads are cancellable without losing data: what arrived
stays buffered for the next `read_some`."""
from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Awaitable, Callable
from urllib.parse import urlsplit

import httptools

try:  # gateway/_http_head.c: a whole plain answer in one read, read in one C pass
    from gateway._http_head import parse_response as _plain_response
except ImportError:  # no C compiler at install: llhttp reads every answer
    _plain_response = None
NATIVE = True  # False: llhttp for every answer even where the C reader was built (tests compare the two)

# Body bytes buffered for a reader that does not keep up (a slow client downstream): past the
# high mark the socket stops being read, so a replica's stream backs up to the replica.
_HIGH_WATER = 1 << 20


class HttpClientError(Exception):
    """The exchange with the replica failed (no complete answer)."""


class ConnectFailed(HttpClientError):
    """No connection could be opened; `os_error` says why (ConnectionRefusedError: nothing listens)."""

    def __init__(self, message: str, os_error: BaseException | None = None) -> None:
        super().__init__(message)
        self.os_error = os_error

    @property
    def refused(self) -> bool:
        return isinstance(self.os_error, ConnectionRefusedError)


class ConnectTimeout(ConnectFailed):
    """The connection was not made within the connect timeout."""


class Disconnected(HttpClientError):
    """The connection closed (or reset) before the answer was complete."""


class BadResponse(HttpClientError):
    """The replica's answer is not HTTP/1.x as this client reads it."""


class Origin:
    """Where a replica listens, parsed once: scheme, host, port, path prefix, Host header."""
    __slots__ = ("host", "port", "tls", "prefix", "host_header", "key")

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        shown = f"[{self.host}]" if ":" in self.host else self.host
        default = (443 if self.tls else 80)
        self.host_header = shown if self.port == default else f"{shown}:{self.port}"
        self.key = (self.host, self.port, self.tls)


class UpstreamClient:
    def __init__(self, connect_timeout_s: float, idle_timeout_s: float = 60.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._idle: dict[tuple, list[_Connection]] = {}
        self._closed = False
        self._sweeper: asyncio.TimerHandle | None = None
        self._ssl: ssl.SSLContext | None = None

    async def post(self, origin: Origin, path: str, body: bytes, request_id: str | None = None,
                   deadline: float | None = None, content_type: str = "application/json") -> "Response":
        """Send one POST; returns once the status line and headers arrived. Raises ConnectFailed,
        Disconnected or BadResponse, and TimeoutError past `deadline` (loop time). The caller
        reads the body and then calls release() or close()."""
        head = (f"POST {origin.prefix}{path} HTTP/1.1\r\nHost: {origin.host_header}\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                + (f"x-request-id: {request_id}\r\n" if request_id else "") + "\r\n").encode("latin-1")
        while True:
            conn = self._take_idle(origin.key)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(origin, deadline)
            try:
                conn.send(head, body)
                while conn._state == _HEAD:  # until the answer's head is in (often its whole body too)
                    if conn.error is not None:
                        raise conn.error
                    if conn.lost:
                        raise Disconnected("connection closed by the replica")
                    await conn._wait(deadline)
            except Disconnected:
                conn.close()
                if reused and not conn.got_bytes:
                    continue  # the replica had closed that idle connection: once more, on a fresh one
                raise
            except BaseException:
                conn.close()
                raise
            return Response(self, conn)

    async def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    # ---- the pool --------------------------------------------------------------------------------
    def _take_idle(self, key: tuple) -> "_Connection | None":
        conns = self._idle.get(key)
        while conns:
            conn = conns.pop()
            # It was reusable() when given back; idle, only the replica can change that: its close
            # (lost) or bytes nobody asked for (keep-alive off).
            if conn._keep_alive and not conn.lost:
                return conn
            conn.close()
        return None

    def _give_back(self, conn: "_Connection") -> None:
        if self._closed or not conn.reusable():
            conn.close()
            return
        conn.idle_since = conn.loop.time()
        conns = self._idle.get(conn.key)
        if conns is None:
            conns = self._idle[conn.key] = []
        conns.append(conn)
        if self._sweeper is None:
            self._sweeper = conn.loop.call_later(self.idle_timeout_s / 2, self._sweep)

    def _sweep(self) -> None:
        """Close connections idle past idle_timeout_s; re-arm while any are left."""
        self._sweeper = None
        if not self._idle:
            return
        loop = asyncio.get_running_loop()
        oldest = loop.time() - self.idle_timeout_s
        for key in list(self._idle):
            keep = []
            for conn in self._idle[key]:
                if conn.idle_since < oldest or not conn.reusable():
                    conn.close()
                else:
                    keep.append(conn)
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        if self._idle:
            self._sweeper = loop.call_later(self.idle_timeout_s / 2, self._sweep)

    async def _connect(self, origin: Origin, deadline: float | None) -> "_Connection":
        loop = asyncio.get_running_loop()
        timeout_s = self.connect_timeout_s
        if deadline is not None and deadline - loop.time() < timeout_s:
            timeout_s = max(deadline - loop.time(), 0.0)
            if not timeout_s:
                raise TimeoutError()
        tls = None
        if origin.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        try:
            _transport, conn = await asyncio.wait_for(loop.create_connection(
                lambda: _Connection(loop, origin.key), origin.host, origin.port, ssl=tls), timeout_s)
        except asyncio.TimeoutError:
            if timeout_s < self.connect_timeout_s:
                raise TimeoutError() from None  # the caller's deadline, not the connect timeout
            raise ConnectTimeout(f"connection timeout to {origin.host}:{origin.port} after "
                                 f"{self.connect_timeout_s:g} s", TimeoutError()) from None
        except OSError as exc:
            raise ConnectFailed(f"connect to {origin.host}:{origin.port}: {exc.strerror or exc}", exc) from None
        return conn


class Response:
    """One answer: `status`, `headers` (lower-case names, last value wins), and its body."""
    __slots__ = ("_client", "_conn", "status", "headers")

    def __init__(self, client: UpstreamClient, conn: "_Connection") -> None:
        self._client = client
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers

    def read_some(self, deadline: float | None = None) -> Awaitable[bytes]:
        """Body bytes that arrived since the last call (waits for some); b"" once the body is
        complete. TimeoutError if nothing came by `deadline` (loop time). Cancelling it, or its
        timing out, loses nothing: what arrives stays for the next call. The connection's own
        coroutine, not one wrapped around it: a stream calls this once per token."""
        return self._conn.read_some(deadline)

    def body_now(self) -> bytes | None:
        """The whole body if all of it is here (no wait, no coroutine), else None: read() it."""
        conn = self._conn
        if conn._state == _DONE and conn.error is None and not conn._paused:
            return conn._take_body()
        return None

    async def read(self, deadline: float | None = None) -> bytes:
        """The whole body (waits for the rest of it)."""
        body = self.body_now()
        if body is not None:
            return body
        conn = self._conn
        parts = []
        while data := await conn.read_some(deadline):
            parts.append(data)
        return b"".join(parts)

    @property
    def complete(self) -> bool:
        """The whole body arrived and was read."""
        return self._conn.body_done

    # ---- push mode: a stream relayed from the connection's data_received -------------------------
    def push_to(self, handler: Callable[[bytes], None]) -> None:
        """From now on each read of the body goes to `handler` as it arrives, inside the
        connection's data_received, without waking the reader: a stream's relay, one call a token
        instead of a task's wake-up. `handler` must not raise (it keeps its own failure and calls
        wake()). What arrived before goes to it now. The reader waits with wait()."""
        conn = self._conn
        conn._push = handler
        if conn._body and conn.error is None:
            handler(conn._take_body())

    def wait(self, deadline: float | None) -> asyncio.Future:
        """Push mode: a future done at the body's end, the connection's failure (`error`) or a
        wake(); TimeoutError past `deadline` (loop time). Check `ended`, `error` and the handler's
        own state before each wait: what happened before it does not wake it."""
        return self._conn._wait(deadline)

    def wake(self) -> None:
        """Push mode: the handler needs the reader (its failure, the client's full buffer)."""
        self._conn._wake()

    @property
    def ended(self) -> bool:
        """Push mode: the body's end arrived (all of it went to the handler)."""
        return self._conn._state == _DONE

    @property
    def error(self) -> BaseException | None:
        """Push mode: why the answer cannot be read to its end (connection lost, unreadable)."""
        return self._conn.error

    def pause_reading(self) -> None:
        """Push mode: stop reading from the replica (the client's buffer is full, or the relay failed)."""
        conn = self._conn
        if not conn.lost and conn.transport is not None:
            conn.transport.pause_reading()

    def resume_reading(self) -> None:
        conn = self._conn
        if not conn.lost and conn.transport is not None:
            conn.transport.resume_reading()

    @property
    def body_at_hand(self) -> bool:
        """read_some() returns at once: body bytes (or the body's end) already arrived."""
        return self._conn.body_at_hand

    def release(self) -> None:
        """Done with it: the connection goes back to the pool if the answer was read to its end."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn._push = None
        if conn.body_done:
            self._client._give_back(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Abandon the answer: the connection closes (the replica sees it and stops generating)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn._push = None
            conn.close()


_HEAD, _BODY, _DONE = range(3)


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the parser of the answer it is reading (llhttp, through
    httptools: ~0.3 us a chunk where a Python chunk parser took ~1.5; one parser per connection,
    reused across its answers)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple) -> None:
        self.loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.error: BaseException | None = None
        self.idle_since = 0.0
        self._state = _DONE
        self._body: list[bytes] = []    # one list for the connection's life: on_body is its append
        self.on_body = self._body.append  # llhttp's body callback, a C call (no Python frame per chunk)
        self._parser = httptools.HttpResponseParser(self)
        self._paused = False
        self._waiter: asyncio.Future | None = None
        self._deadline: float | None = None         # the waiting read's, loop time
        self._timer: asyncio.TimerHandle | None = None  # at or before _deadline (see _wait)
        self._keep_alive = True
        self._to_eof = False       # no Content-Length, not chunked: the body ends with the connection
        self.got_bytes = False
        self.status = 0
        self.headers: dict[str, str] = {}
        self._push = None  # push mode (Response.push_to): each read of the body goes to it at once

    # ---- asyncio protocol ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc) -> None:
        self.lost = True
        if self._state == _BODY and self._to_eof:
            self._state = _DONE
            self._keep_alive = False
        elif self._state != _DONE and self.error is None:
            self.error = Disconnected(f"connection closed by the replica: {exc}" if exc
                                      else "connection closed by the replica")
        self._wake()
        self._stop_timer()

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self._state == _DONE:  # bytes nobody asked for: the connection is not reusable
            self._keep_alive = False
            return
        if self._state == _HEAD and _plain_response is not None and NATIVE:
            plain = _plain_response(data)  # the usual non-streamed answer: head and body in this read
            if plain is not None:  # read as llhttp reads it (llhttp's state stays at a message's start)
                self.status, self.headers, body = plain
                if body:
                    self._body.append(body)
                self._state = _DONE
                self._wake()
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = BadResponse(f"unreadable answer from the replica: {exc}")
            self._keep_alive = False
            self.transport.close()
        push = self._push
        if push is not None and self.error is None:  # a stream's relay: the reader waits for the end only
            if self._body:
                push(self._take_body())
            if self._state == _DONE:
                self._wake()
            return
        self._wake()
        body = self._body
        if len(body) > 64 and not self._paused and sum(map(len, body)) > _HIGH_WATER:
            self._paused = True
            self.transport.pause_reading()

    def eof_received(self):
        self._keep_alive = False  # not to be taken from the pool meanwhile (_take_idle)
        return False  # close the transport: connection_lost follows

    # ---- llhttp's callbacks ----------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue): the real head follows
            self.headers = {}
            return
        self.status = status
        headers = self.headers
        self._to_eof = ("content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "")
                        and status not in (204, 304))
        self._state = _BODY

    def on_message_complete(self) -> None:
        if self._state == _BODY:
            self._state = _DONE
            self._keep_alive = self._keep_alive and self._parser.should_keep_alive()

    # ---- one exchange ----------------------------------------------------------------------------
    def send(self, head: bytes, body: bytes) -> None:
        self._state = _HEAD
        self._push = None
        self._body.clear()
        self.got_bytes = False
        self.status = 0
        self.headers = {}
        self._to_eof = False
        transport = self.transport
        if self.lost or transport is None or transport.is_closing():
            raise Disconnected("connection closed by the replica")
        try:
            if len(body) <= 65536:
                transport.write(head + body)
            else:
                transport.writelines((head, body))
        except RuntimeError as exc:  # uvloop: the handle closed under us (the replica died just now)
            raise Disconnected(f"connection closed by the replica: {exc}") from None

    async def read_some(self, deadline: float | None) -> bytes:
        while not self._body:
            if self.error is not None:
                raise self.error
            if self._state == _DONE:
                return b""
            await self._wait(deadline)
        return self._take_body()

    def _take_body(self) -> bytes:
        """The body bytes arrived so far, taken (reading resumes if their amount had paused it)."""
        body = self._body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        if self._paused and not self.lost:
            self._paused = False
            self.transport.resume_reading()
        return data

    @property
    def body_at_hand(self) -> bool:
        return bool(self._body) or self._state == _DONE

    @property
    def body_done(self) -> bool:
        return self._state == _DONE and not self._body and self.error is None

    def reusable(self) -> bool:
        return (self._keep_alive and not self.lost and self.error is None and self._state == _DONE
                and self.transport is not None and not self.transport.is_closing())

    def close(self) -> None:
        self._keep_alive = False
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    def _wait(self, deadline: float | None) -> asyncio.Future:
        """To await until the next read (or close); TimeoutError past `deadline`. The waiter itself,
        not a coroutine around it (a stream waits once per token); once done it is left in place,
        where _wake and _timed_out skip it. One timer per connection, not per wait: it stays armed
        across waits and answers (a request's deadline is seconds to minutes away, its answer
        milliseconds), is moved only to an earlier deadline, and when it fires before the waiting
        read's deadline it re-arms for it (HotProtocol's timers, the same way): a request costs no
        timer of its own."""
        loop = self.loop
        waiter = self._waiter = loop.create_future()
        self._deadline = deadline
        if deadline is not None:
            timer = self._timer
            if timer is None or timer.when() > deadline:
                if timer is not None:
                    timer.cancel()
                self._timer = loop.call_at(deadline, self._timed_out)
        return waiter

    def _timed_out(self) -> None:
        self._timer = None
        waiter, deadline = self._waiter, self._deadline
        if waiter is None or waiter.done() or deadline is None:
            return  # nothing waits (the timer outlived its wait): the next wait arms one if needed
        if self.loop.time() < deadline:  # armed for an earlier wait's deadline
            self._timer = self.loop.call_at(deadline, self._timed_out)
            return
        waiter.set_exception(TimeoutError())

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
