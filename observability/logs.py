"""structlog setup: JSON lines on stdout for machines, a console renderer when a human is watching."""
from __future__ import annotations

import logging
import sys
from typing import Literal

import msgspec
import structlog

LogFormat = Literal["auto", "json", "console"]
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}
_encoder = msgspec.json.Encoder(enc_hook=repr)  # anything odd (exceptions, paths) becomes its repr


def _json_line(_logger, _method, event_dict) -> bytes:
    # msgspec rather than json.dumps: request records carry token-ID lists thousands long.
    # event, level, timestamp first: what a human scanning the raw lines reads.
    head = {key: event_dict.pop(key) for key in ("event", "level", "timestamp") if key in event_dict}
    head.update(event_dict)
    return _encoder.encode(head)


def configure_logging(level: str = "info", fmt: LogFormat = "auto", stream=None) -> None:
    """One JSON object per line ({event, level, timestamp ISO-8601 UTC, ...}) on stdout, or
    structlog's console renderer when fmt is "console" (or "auto" and stdout is a terminal)."""
    stream = stream or sys.stdout
    level_no = _LEVELS.get(level.lower())
    if level_no is None:
        raise ValueError(f"unknown log level {level!r} (expected one of: {', '.join(_LEVELS)})")
    if fmt not in ("auto", "json", "console"):
        raise ValueError(f"unknown log format {fmt!r} (expected auto, json or console)")
    console = fmt == "console" or (fmt == "auto" and stream.isatty())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if console:
        processors = shared + [structlog.dev.ConsoleRenderer()]
        factory = structlog.PrintLoggerFactory(file=stream)
    else:
        processors = shared + [structlog.processors.format_exc_info, _json_line]
        factory = structlog.BytesLoggerFactory(file=stream.buffer)
    structlog.configure(processors=processors,
                        wrapper_class=structlog.make_filtering_bound_logger(level_no),
                        logger_factory=factory, cache_logger_on_first_use=False)
    # Libraries that log through the stdlib (aiohttp, asyncio) go to stderr at the same level.
    logging.basicConfig(level=level_no, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
