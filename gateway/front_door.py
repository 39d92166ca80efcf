"""The front door: what every HTTP request passes before its handler runs.

In order, each step refusing as early (and as cheaply) as it can:

  request id   a client's x-request-id is kept if it is a sane id, else replaced by a fresh one
               (the response and the replica see the one used)
  /v1/*        an API key when keys are on (401), its requests/min (429), the session header's
               length (400), then the body: within limits.body_timeout_s (408, connection
               closed), gateway.max_body_bytes (413) and the JSON shape limits (400)
  /admin/*     the admin token (401/403); /metrics too when `auth.metrics: admin`
  after        the key's tokens/min charge is corrected to what the request used; responses
               carry the key's x-ratelimit-* headers and the request id

A request refused here still gets its one `request` log record (status, error, key name)."""
from __future__ import annotations

from typing import Callable

from aiohttp import web
from multidict import CIMultiDict

from gateway.auth import GRANT, Gate
from gateway.limits import (MAX_SESSION_KEY_CHARS, ConnectionGuard, GuardedHandler, checked_request_id,
                            new_request_id, read_body)
from observability.metrics import GatewayMetrics
from observability.request_log import RequestLog, RequestRecord
from protocol.errors import APIError, BadRequest, PayloadTooLarge, RequestTimeout
from protocol.http import error_response

REQUEST_ID = "kvgate.request_id"


class FrontDoor:
    def __init__(self, gate: Gate, guard: ConnectionGuard, request_log: RequestLog, metrics: GatewayMetrics,
                 session_header: Callable[[], str]) -> None:
        self.gate = gate
        self.guard = guard
        self.request_log = request_log
        self.metrics = metrics
        self.session_header = session_header

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        protocol = request.protocol
        guarded = isinstance(protocol, GuardedHandler)
        if guarded:
            protocol.request_started()  # the head arrived: the header timeout is over
        try:
            return await self._pass(request, handler)
        finally:
            if guarded:
                protocol.request_done()

    async def _pass(self, request: web.Request, handler):
        given = request.headers.get("x-request-id")
        request_id = checked_request_id(given) or new_request_id()
        request[REQUEST_ID] = request_id
        path = request.path
        if path.startswith("/v1/"):
            try:
                grant = self.gate.authenticate(request)
            except APIError as err:
                return self._refused(request, request_id, err)
            request[GRANT] = grant  # before the clone below, which copies the request's state
            if given != request_id:  # the proxy and the replica see the id the response carries
                request = request.clone(headers=_with_header(request, "x-request-id", request_id))
            try:
                self._check_session_key(request)
                if request.method == "POST":
                    await read_body(request, self.guard)
            except APIError as err:
                return self._refused(request, request_id, err, grant.key.name if grant.key else None)
            return await handler(request)  # the proxy settles the grant's tokens/min when it is done
        if path.startswith("/admin/") or (path == "/metrics" and self.gate.metrics_need_admin):
            self.gate.check_admin(request)
        if request.method == "POST":
            try:
                await read_body(request, self.guard)
            except (RequestTimeout, PayloadTooLarge) as err:
                if isinstance(err, RequestTimeout) and isinstance(request.protocol, GuardedHandler):
                    request.protocol.close_after_response()
                return _closing(err)
        return await handler(request)

    def _check_session_key(self, request: web.Request) -> None:
        value = request.headers.get(self.session_header())
        if value is not None and len(value) > MAX_SESSION_KEY_CHARS:
            raise BadRequest(f"The {self.session_header()} header may be at most {MAX_SESSION_KEY_CHARS} "
                             "characters long.", param=self.session_header(), code="session_key_too_long")

    def _refused(self, request: web.Request, request_id: str, err: APIError,
                 key: str | None = None) -> web.Response:
        record = RequestRecord(request_id, request.path)
        record.key = key
        record.fail(err.status, err.message)
        self.request_log.emit(record)  # its metrics too
        if isinstance(err, RequestTimeout) and isinstance(request.protocol, GuardedHandler):
            request.protocol.close_after_response()
        if isinstance(err, (RequestTimeout, PayloadTooLarge)):
            return _closing(err)
        return error_response(err)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        self.add_headers(request.get(GRANT), request.get(REQUEST_ID), response.headers)

    @staticmethod
    def add_headers(grant, request_id: str | None, headers) -> None:
        """What every response gets from the front door: the key's rate-limit headers and the
        request id, unless set already (the hot path calls this on its own response headers)."""
        if grant is not None and grant.key is not None:
            for name, value in grant.headers().items():
                headers.setdefault(name, value)
        if request_id is not None and "x-request-id" not in headers:
            headers["x-request-id"] = request_id


def _with_header(request: web.Request, name: str, value: str) -> CIMultiDict:
    """The request's headers with one replaced. clone() encodes every header back to UTF-8; a value
    aiohttp decoded from bytes that are not UTF-8 (surrogates) is kept as the same bytes, read as latin-1."""
    headers = CIMultiDict()
    for key, item in request.headers.items():
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            item = item.encode("utf-8", "surrogateescape").decode("latin-1")
        headers.add(key, item)
    headers[name] = value
    return headers


def _closing(err: APIError) -> web.Response:
    """An error after which the connection cannot be reused (the body was not read to its end)."""
    response = error_response(err)
    response.force_close()
    return response
