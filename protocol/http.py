"""aiohttp glue every kvgate server uses: one middleware turns any failure into OpenAI's error shape."""
from __future__ import annotations

import math

import msgspec
import structlog
from aiohttp import web

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
