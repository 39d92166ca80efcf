"""aiohttp glue every kvgate server uses: one middleware turns any failure into OpenAI's error shape,
and a site whose connections answer what never reaches a handler (a request aiohttp's parser refuses:
a bad request line, too many or too long headers) in that shape too, not as a text page."""
from __future__ import annotations

import asyncio
import math

import msgspec
import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from protocol.errors import APIError, error_body, from_decode_error

log = structlog.get_logger("kvgate.http")


def error_response(err: APIError) -> web.Response:
    headers = dict(err.headers)
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    return web.json_response(err.body(), status=err.status, headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as err:
        return error_response(err)
    except msgspec.DecodeError as err:  # ValidationError is a DecodeError
        return error_response(from_decode_error(err))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        reason = exc.reason or "error"
        type_ = "not_found_error" if exc.status == 404 else "invalid_request_error"
        return web.json_response(error_body(f"{reason}: {request.method} {request.path}", type_),
                                 status=exc.status, headers={k: v for k, v in exc.headers.items()
                                                             if k.lower() == "allow"})
    except Exception as exc:  # never a bare 500 page, never a dead process
        log.exception("unhandled_error", path=request.path)
        return web.json_response(error_body(f"Internal error: {type(exc).__name__}: {exc}",
                                            "internal_error"), status=500)


class OpenAIErrorsHandler(RequestHandler):
    """aiohttp's connection protocol, rendering its own refusals in OpenAI's shape: 431 for headers
    over the limits (max_headers, max_line_size, max_field_size), else the parser's status (400)."""

    def handle_error(self, request, status: int = 500, exc=None, message=None) -> web.StreamResponse:
        if status >= 500:  # a handler failure that escaped every middleware (should not happen)
            super().handle_error(request, status, exc, message)  # logs it
            return _closing_json(status, "Internal error.", "internal_error", "internal_error")
        text = str(getattr(exc, "message", None) or message or exc or "Bad request")
        too_large = "Got more than" in text or "Too many headers" in text or "too long" in text.lower()
        log.debug("http_refused", status=431 if too_large else status, reason=text[:200])
        if too_large:
            return _closing_json(431, f"Request headers too large: {text[:300]}", "invalid_request_error",
                                 "headers_too_large")
        return _closing_json(status, f"Bad HTTP request: {text[:300]}", "invalid_request_error", "bad_http_request")


def _closing_json(status: int, message: str, type_: str, code: str) -> web.Response:
    response = web.json_response(error_body(message, type_, None, code), status=status)
    response.force_close()
    return response


class OpenAIErrorsSite(web.TCPSite):
    """A TCPSite whose connections are `handler_class` (OpenAIErrorsHandler by default), built with
    `handler_kwargs` (aiohttp's header limits, keep-alive, ...):
        site = OpenAIErrorsSite(runner, host, port)"""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, handler_class=OpenAIErrorsHandler,
                 handler_kwargs: dict | None = None, **kwargs) -> None:
        super().__init__(runner, host, port, **kwargs)
        self._handler_class = handler_class
        self._handler_kwargs = handler_kwargs or {}

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        loop = asyncio.get_running_loop()
        server = self._runner.server
        # The runner's own handler arguments (access_log=None, ...) first: a custom factory that
        # dropped them would switch aiohttp's access log back on (a stdlib log line per request).
        handler_class, kwargs = self._handler_class, {**server._kwargs, **self._handler_kwargs}

        def protocol() -> RequestHandler:
            return handler_class(server, loop=loop, **kwargs)

        self._server = await loop.create_server(protocol, self._host, self._port, backlog=self._backlog,
                                                reuse_address=self._reuse_address, reuse_port=self._reuse_port)
