"""One `request` log record per request: who served it, its token IDs, its latencies, its fate.

The record is filled as the request progresses and emitted exactly once, from the handler's
`finally`, whatever happened (success, upstream error, client disconnect)."""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from array import array
from typing import Any, Literal

import msgspec
from msgspec import UNSET
import structlog
import xxhash

from observability.logs import json_sink, struct_fields

try:  # observability/_record_line.c: as_line in one C call
    from observability._record_line import line as _native_line, set_parts as _set_line_parts
except ImportError:  # built without a C compiler: as_line's Python lines
    _native_line = None
NATIVE = True  # False: the Python lines even where the C call was built (tests compare the two)

TokenIdPolicy = Literal["full", "hashed", "off"]


def ms(seconds: float) -> float:
    """Seconds as milliseconds to the microsecond, for a log line: what round(seconds * 1000, 3)
    gives, at half its cost (a record carries several; round with digits formats and parses)."""
    return round(seconds * 1e6) / 1000


def hashed_ids(ids: list[int]) -> str:
    """A short, stable fingerprint of a token-ID list: 16 hex digits of xxh3_64 plus the length."""
    return f"{xxhash.xxh3_64_hexdigest(array('q', ids).tobytes())}:{len(ids)}"


class RequestRecord(msgspec.Struct, eq=False):
    """A Struct (compared by identity), not a class with an __init__: one is made per request and
    msgspec fills its 27 fields in C, where a Python __init__ ran ~85 opcodes."""
    request_id: str
    endpoint: str
    started_s: float = msgspec.field(default_factory=time.perf_counter)  # its times count from here
    model: str | None = None
    replica: str | None = None
    stream: bool = False
    status: int = 200
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] = []         # msgspec copies an empty default for each record
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    routing: Any = None                      # a dict, or an object whose .log is one (the gateway's try, read at emit)
    routed_s: float | None = None            # its first try's replica chosen (then sent at once)
    first_token_s: float | None = None
    last_token_s: float | None = None
    itl_s: list[float] = []
    finished_s: float | None = None
    failover: list[dict] | None = None       # one entry per failed try: replica, after_tokens, reason
    failed_after_headers: bool = False       # its 200 had gone out before it failed (status is the truth)
    pd: dict | None = None                   # P/D: prefill and decode replica, KV moved, skips, fallbacks
    key: str | None = None                   # the API key's NAME (never the key), when keys are on
    tenant: str | None = None                # whose prefix cache it used
    panic_routing: bool = False              # sent while no replica of its model was in rotation
    _emitted: bool = False

    def tokens_arrived(self, ids: list[int], now_s: float, events: int = 1) -> None:
        """`events` streamed events of one read (at `now_s`) carried `ids` between them: extend
        the output and time the gaps, the first since the last token, the others 0 (they came
        together)."""
        if not ids:
            return
        if self.first_token_s is None:
            self.first_token_s = now_s
            events -= 1
        elif self.last_token_s is not None:
            self.itl_s.append(now_s - self.last_token_s)
            events -= 1
        if events > 0:
            self.itl_s += [0.0] * events
        self.last_token_s = now_s
        self.output_token_ids += ids

    def add_failover(self, replica: str, after_tokens: int, reason: str) -> None:
        """A try on `replica` failed after `after_tokens` output tokens; the next try continues."""
        if self.failover is None:
            self.failover = []
        self.failover.append({"replica": replica, "after_tokens": after_tokens, "reason": reason})

    def fail(self, status: int, error: str) -> None:
        self.status = status
        self.error = error

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.started_s

    @property
    def e2e_s(self) -> float:
        end = self.finished_s if self.finished_s is not None else time.perf_counter()
        return end - self.started_s

    def as_fields(self, token_ids: TokenIdPolicy) -> dict:
        """The record's fields by name (structlog's keyword arguments)."""
        return struct_fields(self.as_line(token_ids))

    def as_line(self, token_ids: TokenIdPolicy, routing_json: bool = False) -> "RecordLine":
        """The record as its log line; `routing_json`: the routing field as JSON ready for msgspec's
        encoder where the try can write it so (RoutedAttempt.log_json), not a dict. The lines
        below in one C call (observability/_record_line.c) but for hashed token IDs."""
        if _native_line is not None and NATIVE and token_ids != "hashed":
            line = _native_line(self, token_ids == "full", routing_json)
            if line is not None:
                return line
        first, started, itl, routed = self.first_token_s, self.started_s, self.itl_s, self.routed_s
        routing = self.routing
        if routing is not None and routing.__class__ is not dict:
            routing = routing.log_json() if routing_json and hasattr(routing, "log_json") else routing.log
        end = self.finished_s if self.finished_s is not None else time.perf_counter()
        line = RecordLine(
            request_id=self.request_id, model=self.model, replica=self.replica,
            endpoint=self.endpoint, stream=self.stream, status=self.status,
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            routed_ms=None if routed is None else ms(routed - started),
            ttft_ms=None if first is None else ms(first - started),
            e2e_ms=ms(end - started),
            itl_mean_ms=ms(sum(itl) / len(itl)) if itl else None,
            itl_max_ms=ms(max(itl)) if itl else None,
            finish_reason=self.finish_reason, routing=routing)
        if self.key is not None:
            line.key, line.tenant = self.key, self.tenant
        if self.error is not None:
            line.error = self.error
        if self.failover:
            line.failover = self.failover
        if self.failed_after_headers:
            line.failed_after_headers = True
        if self.pd is not None:
            line.pd = self.pd
        if self.panic_routing:
            line.panic_routing = True
        if token_ids == "full":
            line.prompt_token_ids = self.prompt_token_ids
            line.output_token_ids = self.output_token_ids
        elif token_ids == "hashed":
            prompt_ids = self.prompt_token_ids
            line.prompt_token_ids = None if prompt_ids is None else hashed_ids(prompt_ids)
            line.output_token_ids = hashed_ids(self.output_token_ids)
        return line


class RecordLine(msgspec.Struct, kw_only=True, gc=False):
    """A request record's log line, its keys in this order; a field left UNSET is left out. A
    Struct, not a dict: made in C from keywords, and encoded with its keys written once for the
    class (a dict's keys are checked and escaped on every line). `event` to `worker`: the JSON
    sink's (observability/logs.py JsonSink.line), set as it writes the line."""
    event: Any = UNSET
    level: Any = UNSET
    timestamp: Any = UNSET
    worker: Any = UNSET
    request_id: Any
    model: Any
    replica: Any
    endpoint: Any
    stream: Any
    status: Any
    prompt_tokens: Any
    completion_tokens: Any
    cached_tokens: Any
    routed_ms: Any
    ttft_ms: Any
    e2e_ms: Any
    itl_mean_ms: Any
    itl_max_ms: Any
    finish_reason: Any
    routing: Any
    key: Any = UNSET
    tenant: Any = UNSET
    error: Any = UNSET
    failover: Any = UNSET
    failed_after_headers: Any = UNSET
    pd: Any = UNSET
    panic_routing: Any = UNSET
    prompt_token_ids: Any = UNSET
    output_token_ids: Any = UNSET


if _native_line is not None:  # what the C line reads and makes
    _set_line_parts(RequestRecord, RecordLine, RecordLine.__struct_fields__[4:], msgspec.structs.astuple,
                    time.perf_counter)


# How long a bound request log gathers records before writing them (see RequestLog).
FLUSH_DELAY_S = 0.001


class RequestLog:
    """Emits records with the configured token-ID policy; a second emit of one record is a no-op.

    In JSON mode a record goes to the log writer (observability/logs.py json_sink: msgspec
    encodes on the loop, the write on the writer thread); otherwise, or with a `logger` of its
    own, through structlog. Bound to the serving loop (`bind`), the records emitted on it are
    written together FLUSH_DELAY_S after the first of them (`flush`): a record's line, its
    encoding and the writer's handover each cost ~3x more one at a time between requests than run
    back to back (CPU a request at saturation, bench/README, "Thirty-third session"), and a lone
    request's client, woken onto the gateway's core by its answer, reads it before the gateway
    writes the record rather than after (a timer, not the loop's next turn: the loop sleeps first).
    `flush()` writes what is pending at once (the gateway's shutdown, the process's exit, and the
    metrics' collection: `flush_if_on_loop`)."""

    def __init__(self, token_ids: TokenIdPolicy = "full", logger=None, observe=None) -> None:
        self.token_ids = token_ids
        self.observe = observe   # takes the records as they are written (the gateway's metrics)
        self._own_logger = logger is not None
        self._log = logger or structlog.get_logger("kvgate.request")
        self._loop = None        # the serving loop (bind): its records are written once a turn
        self._loop_thread = None
        self._pending: list[RequestRecord] = []

    def bind(self, loop) -> None:
        """Batch the records emitted on `loop`'s thread from now on (the gateway's startup)."""
        self._loop, self._loop_thread = loop, threading.get_ident()
        _bound.add(self)

    def emit(self, record: RequestRecord) -> bool:
        if record._emitted:
            return False
        record._emitted = True
        if record.finished_s is None:
            record.finished_s = time.perf_counter()
        if self._loop is not None and threading.get_ident() == self._loop_thread:
            pending = self._pending
            pending.append(record)
            if len(pending) == 1:
                self._loop.call_later(FLUSH_DELAY_S, self.flush)
            return True
        self._finish([record])
        return True

    def flush_if_on_loop(self) -> None:
        """flush(), when called on the loop's thread (or unbound): the metrics' collection calls it,
        so that /metrics counts every answered request; another thread's collection (none in the
        gateway) leaves the pending records to the loop."""
        if self._loop is None or threading.get_ident() == self._loop_thread:
            self.flush()

    def flush(self) -> None:
        """Write the records emitted and not written yet, in order."""
        pending = self._pending
        if pending:
            self._pending = []
            self._finish(pending)

    def _finish(self, records: list[RequestRecord]) -> None:
        if self.observe is not None:
            self.observe(records)
        self._write(records)

    def _write(self, records: list[RequestRecord]) -> None:
        """Their lines, in order. One that cannot be written (a bug) costs its own line only: it
        is logged, and the others are written."""
        sink = None if self._own_logger else json_sink()
        token_ids = self.token_ids
        # as_line's C call, made here (no Python frame a record); None: as_line serves
        line_of = _native_line if _native_line is not None and NATIVE and token_ids != "hashed" else None
        full = token_ids == "full"
        lines = []  # for the JSON sink, handed over together
        for record in records:
            try:
                if sink is not None:
                    line = line_of(record, full, True) if line_of is not None else None
                    lines.append(line if line is not None else record.as_line(token_ids, routing_json=True))
                else:
                    self._log.info("request", **record.as_fields(token_ids))
            except Exception:
                structlog.get_logger("kvgate").exception("request_record_unwritable", request_id=record.request_id)
        if lines:
            sink.lines("request", lines)


# Request logs bound to a loop: what they hold is written at the process's exit, before the log
# writer closes (atexit runs in reverse order of registration; a line handed to a closed writer is
# written at once all the same).
_bound: "weakref.WeakSet[RequestLog]" = weakref.WeakSet()


@atexit.register
def _flush_bound() -> None:
    for request_log in list(_bound):
        request_log.flush()
