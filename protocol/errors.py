"""Typed API errors and their one rendering: OpenAI's `{"error": {message, type, param, code}}`."""
from __future__ import annotations

import re

import msgspec


class APIError(Exception):
    """An error a client should see. Raised anywhere inside a request; rendered once at the edge."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None, type: str | None = None,
                 retry_after_s: float | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.retry_after_s = retry_after_s
        self.headers = headers or {}  # extra response headers (WWW-Authenticate, x-ratelimit-*)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


class BadRequest(APIError):
    status = 400


class Unauthorized(APIError):
    """No credentials, or ones that are not valid (OpenAI: 401, invalid_request_error)."""
    status = 401


class Forbidden(APIError):
    """Valid credentials that may not do this."""
    status = 403
    type = "permission_error"


class RequestTimeout(APIError):
    """The client was too slow sending its request."""
    status = 408


class PayloadTooLarge(APIError):
    status = 413


class RateLimited(APIError):
    """A key's own requests/min or tokens/min limit, in OpenAI's shape (type `requests` or `tokens`,
    code `rate_limit_exceeded`); `headers` are the x-ratelimit-* values the response carries."""
    status = 429

    def __init__(self, message: str, *, kind: str, retry_after_s: float, headers: dict | None = None):
        super().__init__(message, type=kind, code="rate_limit_exceeded", retry_after_s=retry_after_s,
                         headers=headers)


class NotFound(APIError):
    status = 404
    type = "not_found_error"


class ModelNotFound(NotFound):
    def __init__(self, model: str, available: list[str]):
        super().__init__(f"The model `{model}` does not exist. Available: {', '.join(available) or 'none'}.",
                         param="model", code="model_not_found")


class Overloaded(APIError):
    status = 429
    type = "rate_limit_error"


class UpstreamError(APIError):
    status = 502
    type = "upstream_error"


class Unavailable(APIError):
    status = 503
    type = "service_unavailable"


class InternalError(APIError):
    status = 500
    type = "internal_error"


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def from_decode_error(exc: msgspec.DecodeError) -> BadRequest:
    """msgspec's messages already name the field (`... - at `$.max_tokens``): keep them, lift the param."""
    text = str(exc)
    match = _PATH.search(text)
    param = match.group(1) if match else None
    if isinstance(exc, msgspec.ValidationError):
        missing = _MISSING.search(text)
        if missing:
            field = ".".join(p for p in (param, missing.group(1)) if p)
            return BadRequest(f"Invalid request: {text}", param=field, code="missing_field")
        return BadRequest(f"Invalid request: {text}", param=param or None, code="invalid_type")
    return BadRequest(f"Invalid JSON body: {text}", code="invalid_json")


def normalize_upstream_error(status: int, payload: object) -> APIError:
    """Whatever shape a replica used (OpenAI, vLLM's flat `{"object":"error"}`, FastAPI `detail`,
    plain text), return an APIError in our shape with the same status."""
    message, type_, param, code = None, None, None, None
    if isinstance(payload, dict):
        inner = payload.get("error", payload)
        if isinstance(inner, dict):
            message = inner.get("message") or inner.get("detail")
            type_ = inner.get("type")
            param = inner.get("param")
            code = inner.get("code")
        elif isinstance(inner, str):
            message = inner
        if message is None and "detail" in payload:
            message = str(payload["detail"])
    elif isinstance(payload, (str, bytes)):
        message = payload.decode(errors="replace") if isinstance(payload, bytes) else payload
    message = (message or f"upstream answered HTTP {status}").strip()[:2000]
    if not isinstance(type_, str):
        type_ = "invalid_request_error" if 400 <= status < 500 else "upstream_error"
    return APIError(message, status=status, type=type_, param=param if isinstance(param, str) else None,
                    code=code if isinstance(code, (str, int)) else None)
