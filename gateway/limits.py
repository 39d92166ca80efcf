"""What one client may cost the gateway before a replica is involved: connections per IP, how long
a request head and body may take to arrive, header count and size, JSON shape, request ids.

Connection-level limits live in a RequestHandler subclass (aiohttp's per-connection protocol),
served by a TCPSite subclass that builds it:

  per-client cap     a connection from an IP that already holds `max_connections_per_client` is
                     answered 429 (raw HTTP, OpenAI's shape) and closed before any parsing
  header timeout     from a request head's first byte to its last: past `header_timeout_s` the
                     client gets 408 and the connection closes (a slowloris trickling headers
                     holds a connection for that long, not for an hour)
  keep-alive         aiohttp closes an idle connection after `keepalive_timeout_s`
  header size        aiohttp's parser (`max_headers`, `max_header_bytes`); its refusal is
                     a 431 in OpenAI's shape (protocol/http.py), not a text page

Request-level limits are checked by `read_body` before the body is decoded: the whole body must
arrive within `body_timeout_s` (408 and close), fit gateway.max_body_bytes (413), and nest no
deeper than `max_json_depth` with at most `max_json_containers` objects and arrays (400): msgspec
would refuse very deep nesting itself, but a body of many small containers decodes to ~40 times
its size in Python objects, on the event loop."""
from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import re
import secrets

import numpy as np
from aiohttp import web

from gateway.config import LimitsSection
from protocol.errors import APIError, BadRequest, PayloadTooLarge, RequestTimeout, error_body
from protocol.http import OpenAIErrorsHandler, OpenAIErrorsSite

# An id that is safe in a header, a log line and a file name; anything else is replaced.
_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:=+/@-]{0,127}")
MAX_SESSION_KEY_CHARS = 256


class ConnectionGuard:
    """Connection counts per client IP and the limits in force (a reload swaps `limits`)."""

    def __init__(self, limits: LimitsSection, max_body_bytes: int) -> None:
        self.limits = limits
        self.max_body_bytes = max_body_bytes
        self.per_ip: dict[str, int] = {}
        self.refused = 0
        self.head_timeouts = 0

    def apply(self, limits: LimitsSection) -> None:
        self.limits = limits

    def handler_kwargs(self) -> dict:
        """What aiohttp's handler takes from the limits (fixed at start: the listening socket's)."""
        limits = self.limits
        return {"max_headers": limits.max_headers, "max_line_size": limits.max_header_bytes,
                "max_field_size": limits.max_header_bytes, "keepalive_timeout": limits.keepalive_timeout_s}

    def open(self, ip: str) -> bool:
        held = self.per_ip.get(ip, 0)
        if held >= self.limits.max_connections_per_client:
            self.refused += 1
            return False
        self.per_ip[ip] = held + 1
        return True

    def close(self, ip: str) -> None:
        held = self.per_ip.get(ip, 0) - 1
        if held > 0:
            self.per_ip[ip] = held
        else:
            self.per_ip.pop(ip, None)


def admit_connection(guard, transport) -> str | None:
    """The client's IP if `guard` lets this connection open, else None: it got a 429 (too many
    connections from its IP) and closes a moment later, reading (and dropping) what the client
    sends meanwhile: closing a socket with unread data resets it, and the client would see a
    reset, not the 429."""
    peer = transport.get_extra_info("peername")
    ip = peer[0] if isinstance(peer, (tuple, list)) and peer else "unknown"
    if guard.open(ip):
        return ip
    limit = guard.limits.max_connections_per_client
    transport.write(_raw_error(429, "Too Many Requests",
                               f"Too many open connections from {ip} (limit {limit}); close some "
                               "or reuse them (keep-alive).", "too_many_connections", 1))
    asyncio.get_running_loop().call_later(0.5, transport.close)
    return None


def _raw_error(status: int, reason: str, message: str, code: str, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP response, written straight to a transport that has no aiohttp request."""
    body = json.dumps(error_body(message, "invalid_request_error" if status != 429 else "rate_limit_error",
                                 None, code)).encode()
    extra = f"Retry-After: {retry_after_s}\r\n" if retry_after_s else ""
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{extra}Connection: close\r\n\r\n").encode() + body


class GuardedHandler(OpenAIErrorsHandler):
    """aiohttp's connection protocol (refusals in OpenAI's shape), plus the per-client cap and the
    header timeout."""

    def __init__(self, manager, *, guard: ConnectionGuard, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._ip: str | None = None
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._heads = 0
        self.in_request = False  # a request of this connection is being handled (set by read_body's caller)

    def connection_made(self, transport) -> None:
        ip = admit_connection(self._guard, transport)
        self._refused = ip is None
        if ip is None:
            return
        self._ip = ip
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        heads = self._request_count
        super().data_received(data)
        if self._request_count != heads:  # a whole request head arrived
            self._disarm()
        elif self._head_timer is None and not self.in_request:
            self._arm()  # the first byte of a request head on a kept-alive connection

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._refused:
            return
        if self._ip is not None:
            self._guard.close(self._ip)
            self._ip = None
        super().connection_lost(exc)

    def request_started(self) -> None:
        self.in_request = True
        self._disarm()

    def request_done(self) -> None:
        self.in_request = False

    def close_after_response(self) -> None:
        """Close once the response is out, without aiohttp's lingering read of the unread body (up to
        10 s of reading whatever a too-slow client still trickles)."""
        self._lingering_time = 0.0
        self.close()

    def _arm(self) -> None:
        self._head_timer = self._loop.call_later(self._guard.limits.header_timeout_s, self._head_too_slow)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.in_request or self.transport is None:
            return
        self._guard.head_timeouts += 1
        seconds = self._guard.limits.header_timeout_s
        self.transport.write(_raw_error(408, "Request Timeout", f"The request head did not arrive within "
                                        f"{seconds:g} s (limits.header_timeout_s).", "header_timeout"))
        self.force_close()  # closes the transport once the 408 is written


class GuardedSite(OpenAIErrorsSite):
    """The gateway's site: its connections are GuardedHandlers built with the guard's limits; for an
    app with a proxy, they start on gateway/hot_path.py's protocol (same limits), which serves the
    completion endpoints itself and hands anything else to a GuardedHandler."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard, **kwargs) -> None:
        super().__init__(runner, host, port, handler_class=functools.partial(GuardedHandler, guard=guard),
                         handler_kwargs=guard.handler_kwargs(), **kwargs)
        self._guard = guard

    async def start(self) -> None:
        from gateway.hot_path import HotPath, HotProtocol  # it builds on this module
        app = getattr(self._runner, "app", None)
        hot = HotPath.of(app) if app is not None else None
        if hot is not None:
            guard = self._guard

            def hot_protocol(server, *, loop, **kwargs) -> HotProtocol:
                return HotProtocol(server, loop=loop, guard=guard, hot=hot, handler_kwargs=kwargs)
            self._handler_class = hot_protocol
        await super().start()


# ---- per request ---------------------------------------------------------------------------------

def checked_request_id(value: str | None) -> str | None:
    """The client's x-request-id if it is a sane id (1-128 of A-Z a-z 0-9 . _ : = + / @ -), else None."""
    return value if value and _REQUEST_ID.fullmatch(value) else None


def new_request_id() -> str:
    """32 hex digits, unique: 64 random bits per process (drawn again in a forked child) and a
    counter; a fraction of uuid4's cost (no urandom call per request)."""
    return f"{_id_prefix[0]}{next(_id_counter):016x}"


def _new_id_prefix() -> None:
    _id_prefix[0] = secrets.token_hex(8)


_id_prefix = [""]
_id_counter = itertools.count()
_new_id_prefix()
os.register_at_fork(after_in_child=_new_id_prefix)


async def read_body(request: web.Request, guard: ConnectionGuard) -> bytes:
    """The whole body, within the time and size limits, checked for JSON shape; aiohttp keeps it,
    so the handler's own `await request.read()` returns it at once."""
    limits = guard.limits
    length = request.content_length
    if length is not None and length > guard.max_body_bytes:
        raise _too_large(guard.max_body_bytes)
    try:
        body = await asyncio.wait_for(request.read(), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise RequestTimeout(f"The request body did not arrive within {limits.body_timeout_s:g} s "
                             "(limits.body_timeout_s).", code="body_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(guard.max_body_bytes) from None
    if len(body) > _CHUNK:  # the exact scan of a big body takes up to ~0.3 s: not on the loop
        await asyncio.get_running_loop().run_in_executor(
            None, check_json_shape, body, limits.max_json_depth, limits.max_json_containers)
    else:
        check_json_shape(body, limits.max_json_depth, limits.max_json_containers)
    return body


def _too_large(limit: int) -> APIError:
    return PayloadTooLarge(f"The request body is larger than {limit} bytes (gateway.max_body_bytes).",
                           code="body_too_large")


def check_json_shape(body: bytes, max_depth: int, max_containers: int) -> None:
    """400 if the JSON nests deeper than max_depth or holds more than max_containers objects and
    arrays. Cheap for ordinary bodies: a bracket count over the bytes (C speed) proves most of them
    fine; only bodies with many brackets get the exact scan (numpy, strings excluded)."""
    openers = body.count(b"[") + body.count(b"{")
    if openers <= min(max_depth, max_containers):
        return
    depth, containers = json_shape(body)
    if depth > max_depth:
        raise BadRequest(f"The JSON body nests {depth} levels deep; at most {max_depth} are allowed "
                         "(limits.max_json_depth).", code="json_too_deep")
    if containers > max_containers:
        raise BadRequest(f"The JSON body holds {containers} objects and arrays; at most {max_containers} "
                         "are allowed (limits.max_json_containers).", code="json_too_large")


_CHUNK = 1 << 20
_OPEN = np.zeros(256, np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_CLOSE = np.zeros(256, np.int8)
_CLOSE[[ord("]"), ord("}")]] = 1


def json_shape(body: bytes) -> tuple[int, int]:
    """(deepest nesting, containers) of a JSON text, not counting brackets inside strings. For valid
    JSON it is exact; for invalid JSON it is some number, and the decoder refuses the body anyway.

    Escapes are removed first: replacing `\\\\` pairs (left to right, as JSON pairs them) and then
    `\\"` leaves only the quotes that open or close strings. Then, 1 MiB at a time (bounded memory),
    a running parity of those quotes says what is inside a string, and a running sum of brackets
    outside strings is the depth."""
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = np.frombuffer(text, np.uint8)
    in_string = 0
    depth = 0
    deepest = 0
    containers = 0
    for start in range(0, len(data), _CHUNK):
        chunk = data[start:start + _CHUNK]
        quotes = (chunk == 34).astype(np.uint8)
        inside = np.bitwise_xor.accumulate(quotes) ^ in_string  # 1 within a string (and on its opening quote)
        in_string = int(inside[-1])
        outside = inside == 0
        opens = _OPEN[chunk] * outside
        steps = opens - _CLOSE[chunk] * outside
        running = np.cumsum(steps, dtype=np.int32) + depth
        deepest = max(deepest, int(running.max()))
        depth = int(running[-1])
        containers += int(np.count_nonzero(opens))
    return deepest, containers
