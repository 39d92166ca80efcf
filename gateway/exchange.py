"""The client's side of one request, as the proxy sees it: its headers and body, the grant the
front door gave it, and the ways to answer (a whole response, or a stream of events).

Two implementations: `AiohttpExchange` wraps an aiohttp request (any connection aiohttp serves),
and gateway/hot_path.py writes straight to the connection's transport (the hot endpoints on the
gateway's own HTTP/1.1 protocol). The proxy and the answer only ever talk to this interface."""
from __future__ import annotations

import time

from aiohttp import web

from gateway.auth import Grant, grant_of
from protocol.errors import APIError
from protocol.http import error_response


class ClientGone(Exception):
    """Writing to the client failed: it hung up."""


class Exchange:
    """What every implementation provides."""
    request_id: str
    headers: object          # case-insensitive mapping: .get(name)
    grant: Grant
    streaming = False        # a stream's head went out
    arrived_s: float         # perf_counter when the whole request was in (hot path), or its handler began
    body_bytes: bytes | None = None  # the body, when it was read with the head (the hot path); else body()

    async def body(self) -> bytes:
        raise NotImplementedError

    async def open_stream(self, headers: dict[str, str], hold: bool = False) -> None:
        """Send a 200 with an event-stream body; writes follow. `hold`: the caller writes at once
        (the first events are at hand), so the head may go out with them in one write."""
        raise NotImplementedError

    async def write(self, data: bytes, hold: bool = False) -> None:
        """Part of the stream; raises ClientGone when the client hung up. `hold`: the caller
        writes again at once (close_stream follows), so the data may go out with that write.
        Held bytes never wait past the loop's next turn."""
        raise NotImplementedError

    # An exchange that writes without waiting (the hot path's): a stream is relayed from the
    # replica connection's data_received (gateway/proxy.py), write_now and drain in place of write.
    pushes = False

    def write_now(self, data: bytes, hold: bool = False) -> bool:
        """write() without the wait: True when the client's buffer is full (drain() before more)."""
        raise NotImplementedError

    async def drain(self) -> None:
        """Until the client's buffer has room again; ClientGone when it hung up."""

    async def close_stream(self, last: bytes = b"") -> None:
        """The stream's end, after `last` (its final events, sent with the end in one write; raises
        ClientGone like write() when they cannot be). Without `last`, a client that already hung up
        is not an error here."""
        raise NotImplementedError

    async def respond(self, status: int, body: bytes, headers: dict[str, str],
                      content_type: str = "application/json") -> None:
        """A whole response (before any stream was opened)."""
        raise NotImplementedError

    def respond_now(self, status: int, body: bytes, headers: dict[str, str],
                    content_type: str = "application/json") -> bool:
        """respond() without a coroutine, where it needs no wait: False when it does (the app's
        response hooks are awaited), and nothing was sent: call respond()."""
        return False

    async def respond_error(self, err: APIError, headers: dict[str, str]) -> None:
        """An error in OpenAI's shape (before any stream was opened)."""
        raise NotImplementedError

    def no_delay(self) -> None:
        """TCP_NODELAY on the client's socket: each event leaves at once."""


class AiohttpExchange(Exchange):
    """A request aiohttp parsed; the handler returns `response` once the proxy is done."""
    __slots__ = ("request", "request_id", "headers", "grant", "response", "streaming", "arrived_s")

    def __init__(self, request: web.Request, request_id: str) -> None:
        self.arrived_s = time.perf_counter()
        self.request = request
        self.request_id = request_id
        self.headers = request.headers
        self.grant = grant_of(request)
        self.response: web.StreamResponse | None = None
        self.streaming = False

    async def body(self) -> bytes:
        return await self.request.read()

    async def open_stream(self, headers: dict[str, str], hold: bool = False) -> None:
        response = web.StreamResponse(status=200, headers=headers)
        await response.prepare(self.request)
        self.response = response
        self.streaming = True

    async def write(self, data: bytes, hold: bool = False) -> None:
        try:
            await self.response.write(data)
        except ConnectionResetError:  # aiohttp's is also a ClientError: keep it apart from upstream's
            raise ClientGone() from None

    async def close_stream(self, last: bytes = b"") -> None:
        if last:
            await self.write(last)
        try:
            await self.response.write_eof()
        except ConnectionResetError:
            pass  # a client that hangs up right after [DONE] (the OpenAI SDK does) got everything

    async def respond(self, status: int, body: bytes, headers: dict[str, str],
                      content_type: str = "application/json") -> None:
        self.respond_now(status, body, headers, content_type)

    def respond_now(self, status: int, body: bytes, headers: dict[str, str],
                    content_type: str = "application/json") -> bool:
        self.response = web.Response(status=status, body=body, content_type=content_type, headers=headers)
        return True

    async def respond_error(self, err: APIError, headers: dict[str, str]) -> None:
        response = error_response(err)
        response.headers.update(headers)
        self.response = response

    def no_delay(self) -> None:
        from gateway.hot_path import set_no_delay
        transport = self.request.transport
        if transport is not None:
            set_no_delay(transport)
