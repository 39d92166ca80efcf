"""structlog setup: JSON lines on stdout for machines, a console renderer when a human is watching,
and optionally every event as a JSON line in a size-capped, rotated log file as well.

In JSON mode every line (structlog events, request records, the stdlib's records for the file)
goes through one LogWriter (observability/log_writer.py): encoded on the caller's thread, written
by a background thread in batches, in the order handed over. Request records skip structlog's
processor chain altogether (`json_sink()`, used by observability/request_log.py): the same
fields, the same line, at a fraction of the cost."""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import msgspec
import structlog

from observability.log_writer import LogWriter

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


class LogFile:
    """Appends JSON lines to `path`, rotating it at `max_bytes` (path -> path.1 -> ... -> path.keep).

    Unbuffered writes (one per line, or one per batch from the LogWriter, cut at rotation points):
    another process (`kvgate tail`) sees each line as soon as it is written, and no fsync (the page
    cache is enough for a log). Appends across restarts.
    A write that fails (disk full) drops the line and says so once on stderr: logging never
    fails a request. Meant for one writing process per file."""

    def __init__(self, path: str | Path, max_bytes: int = 0, keep: int = 5) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes  # 0: never rotate
        self.keep = keep
        self._lock = threading.Lock()  # tokenizer threads may log too; rotation must not interleave
        self._warned = False
        self._file = open(self.path, "ab", buffering=0)  # OSError here: the caller reports it at start
        self._size = os.fstat(self._file.fileno()).st_size

    def write_line(self, line: bytes) -> None:
        data = line + b"\n"
        with self._lock:
            try:
                if self.max_bytes and self._size and self._size + len(data) > self.max_bytes:
                    self._rotate()
                view = memoryview(data)
                while view:  # a regular file takes it in one call; the loop is for the odd short write
                    view = view[self._file.write(view):]
                self._size += len(data)
            except OSError as exc:
                self._warn(f"cannot write to {self.path}: {exc}; log lines are being dropped")

    def write_lines(self, lines: list[bytes]) -> None:
        """Several lines, in as few write() calls as rotation allows (it still happens between the
        same two lines as line by line)."""
        with self._lock:
            try:
                start, size = 0, self._size
                for index, line in enumerate(lines):
                    length = len(line) + 1
                    if self.max_bytes and size and size + length > self.max_bytes:
                        self._write(lines[start:index], size - self._size)
                        self._rotate()
                        start, size = index, self._size
                    size += length
                self._write(lines[start:], size - self._size)
            except OSError as exc:
                self._warn(f"cannot write to {self.path}: {exc}; log lines are being dropped")

    def _write(self, lines: list[bytes], length: int) -> None:
        if not lines:
            return
        view = memoryview(b"\n".join(lines) + b"\n")
        while view:
            view = view[self._file.write(view):]
        self._size += length

    def _rotate(self) -> None:
        self._file.close()
        try:
            if self.keep:
                for index in range(self.keep - 1, 0, -1):
                    older = self.path.with_name(f"{self.path.name}.{index}")
                    if older.exists():
                        os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
                os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
            else:
                self.path.unlink(missing_ok=True)
        except OSError as exc:
            self.max_bytes = 0  # rotation cannot work here: keep appending rather than lose lines
            self._warn(f"cannot rotate {self.path}: {exc}; appending without a size cap")
        self._file = open(self.path, "ab", buffering=0)
        self._size = os.fstat(self._file.fileno()).st_size

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            print(f"kvgate: {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def log_file_problem(path: Path) -> str | None:
    """Why a log file cannot be opened at `path` (checked before starting anything), or None."""
    if path.is_dir():
        return f"{path} is a directory; name a file in it"
    if not path.parent.is_dir():
        return f"directory {path.parent} does not exist"
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return f"{path} is not writable"
    return None


class _JsonToWriter:
    """Final processor in JSON mode: encode once, hand the line to the writer (stdout and file)."""

    def __init__(self, writer: LogWriter) -> None:
        self.writer = writer

    def __call__(self, logger, method, event_dict):
        self.writer.write(_json_line(logger, method, event_dict))
        raise structlog.DropEvent  # written by the writer thread, not by structlog's logger


class JsonSink:
    """Request records straight to the writer: the line structlog would make (event, level,
    timestamp first, then the fields), without its processor chain."""
    __slots__ = ("writer",)

    def __init__(self, writer: LogWriter) -> None:
        self.writer = writer

    def info(self, event: str, fields: dict) -> None:
        # One dict merged, then one encode. Encoding the fields alone and putting the head's bytes
        # in front saved 0.4-0.9 us on a short record but copies the line twice more: a record with
        # a 2,000-8,000-token prompt took as long or ~10 us longer (measured A/B, one process).
        head = {"event": event, "level": "info", "timestamp": datetime.now(_UTC)}
        context = structlog.contextvars.get_contextvars()
        if context:
            head.update(context)
        head.update(fields)
        self.writer.write(_encoder.encode(head))

    def line(self, event: str, line) -> None:
        """`line`, a Struct whose first fields are `event`, `level`, `timestamp` and `worker`
        (msgspec.UNSET: left out of the line until set here) and whose other UNSET fields are
        left out: the line info() would write for its fields, with no dict built or merged and
        each key written from the Struct's own encoded names. A context other than the worker's
        number (gateway/worker.py binds `worker`) takes info()'s way."""
        self.lines(event, [line])

    def lines(self, event: str, lines: list) -> None:
        """line() for several, handed to the writer together (one lock, one wake-up at most)."""
        context = structlog.contextvars.get_contextvars()
        worker = context.get("worker", msgspec.UNSET) if context else msgspec.UNSET
        if context and len(context) > (worker is not msgspec.UNSET):
            for line in lines:
                self.info(event, struct_fields(line))
            return
        now, encode = datetime.now(_UTC), _encoder.encode
        out = []
        for line in lines:
            line.worker = worker
            line.event = event
            line.level = "info"
            line.timestamp = now
            out.append(encode(line))
        self.writer.write_many(out)


_UTC = timezone.utc


def struct_fields(line) -> dict:
    """A Struct's fields that are set (not msgspec.UNSET), by name, in order."""
    unset = msgspec.UNSET
    return {name: value for name, value in zip(line.__struct_fields__, msgspec.structs.astuple(line))
            if value is not unset}


_sink: JsonSink | None = None


def json_sink() -> JsonSink | None:
    """Where request records go without structlog: set by configure_logging in JSON mode at
    level info or below; None otherwise (console mode, a quieter level, logging not configured)."""
    return _sink


class _TeeToFile:
    """Processor before the console renderer: the file still gets the event as a JSON line."""

    def __init__(self, log_file: LogFile) -> None:
        self.log_file = log_file

    def __call__(self, logger, method, event_dict):
        # A copy: the console renderer needs exc_info, which format_exc_info would consume.
        as_json = structlog.processors.format_exc_info(logger, method, dict(event_dict))
        self.log_file.write_line(_json_line(logger, method, as_json))
        return event_dict


class _StdlibToFile(logging.Handler):
    """aiohttp's and asyncio's own log records (errors, tracebacks) as JSON lines in the file too."""

    def __init__(self, log_file: LogFile | LogWriter, level: int) -> None:
        super().__init__(level)
        self.log_file = log_file

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = {"event": record.getMessage(), "level": record.levelname.lower(),
                      "timestamp": datetime.fromtimestamp(record.created, timezone.utc)
                      .isoformat().replace("+00:00", "Z"), "logger": record.name}
            if record.exc_info:
                fields["exception"] = logging.Formatter().formatException(record.exc_info)
            line = _encoder.encode(fields)
            if isinstance(self.log_file, LogWriter):
                self.log_file.write_line_to_file(line)
            else:
                self.log_file.write_line(line)
        except Exception:  # a log record that cannot be rendered must not take the server down
            self.handleError(record)


def configure_logging(level: str = "info", fmt: LogFormat = "auto", stream=None,
                      log_file: LogFile | None = None) -> None:
    """One JSON object per line ({event, level, timestamp ISO-8601 UTC, ...}) on stdout, or
    structlog's console renderer when fmt is "console" (or "auto" and stdout is a terminal).
    With `log_file`, every event also goes there as a JSON line, whatever the terminal shows."""
    stream = stream or sys.stdout
    level_no = _LEVELS.get(level.lower())
    if level_no is None:
        raise ValueError(f"unknown log level {level!r} (expected one of: {', '.join(_LEVELS)})")
    if fmt not in ("auto", "json", "console"):
        raise ValueError(f"unknown log format {fmt!r} (expected auto, json or console)")
    console = fmt == "console" or (fmt == "auto" and stream.isatty())
    global _sink, _writer
    if _writer is not None:  # configured again (tests): the old writer finishes first
        _writer.close()
        _sink = _writer = None
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if console:
        tee = [_TeeToFile(log_file)] if log_file is not None else []
        processors = shared + tee + [structlog.dev.ConsoleRenderer()]
        factory = structlog.PrintLoggerFactory(file=stream)
    else:
        _writer = LogWriter(getattr(stream, "buffer", None) or stream, log_file)
        atexit.register(_writer.close)
        if level_no <= logging.INFO:
            _sink = JsonSink(_writer)
        processors = shared + [structlog.processors.format_exc_info, _JsonToWriter(_writer)]
        factory = structlog.BytesLoggerFactory(file=getattr(stream, "buffer", None) or stream)
    structlog.configure(processors=processors,
                        wrapper_class=structlog.make_filtering_bound_logger(level_no),
                        logger_factory=factory, cache_logger_on_first_use=False)
    # Libraries that log through the stdlib (aiohttp, asyncio) go to stderr at the same level.
    logging.basicConfig(level=level_no, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if log_file is not None:
        target = log_file if console else _writer  # JSON mode: in order with the writer's other lines
        logging.getLogger().addHandler(_StdlibToFile(target, level_no))


_writer: LogWriter | None = None
