"""`kvgate tail`: the gateway's JSON log as one readable line per request, with filters and a
rolling summary (requests/s, prefix-cache hit rate, TTFT p50/p99 per replica).

The pure parts (parse_record, StatusFilter, RecordFilter, format_record, WindowStats) work on
plain values and are unit-tested without files; the loop around them takes batches of lines from
observability.follow (a file followed like `tail -F`, or stdin). Imports msgspec and, only when
colouring a terminal, rich: no aiohttp, no torch."""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator

import msgspec

from observability.follow import FileFollower, follow_batches, stdin_batches


class Record(msgspec.Struct):
    """The fields of a `request` line that tail shows; the token-ID arrays are skipped, not built."""
    event: str | None = None
    timestamp: str | None = None
    request_id: str | None = None
    model: str | None = None
    replica: str | None = None
    endpoint: str | None = None
    stream: bool | None = None
    status: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    error: str | None = None
    routing: dict | None = None


_decoder = msgspec.json.Decoder(Record)


@dataclass
class LineCounts:
    requests: int = 0
    other_events: int = 0  # JSON lines that are not request records (gateway_ready, ...)
    not_json: int = 0      # console-rendered lines, stderr noise, a torn line


def parse_record(line: bytes, counts: LineCounts | None = None) -> Record | None:
    """The request record on this line, or None (counted in `counts`) for anything else."""
    counts = counts if counts is not None else LineCounts()
    line = line.strip()
    if not line.startswith(b"{"):
        if line:
            counts.not_json += 1
        return None
    try:
        record = _decoder.decode(line)
    except msgspec.ValidationError:  # valid JSON, other shape: some other event's fields
        counts.other_events += 1
        return None
    except msgspec.DecodeError:
        counts.not_json += 1
        return None
    if record.event != "request":
        counts.other_events += 1
        return None
    counts.requests += 1
    return record


def is_error(record: Record) -> bool:
    return record.status >= 400 or record.error is not None


STATUS_HELP = ("comma list of: a code (404), a class (4xx), `errors` (status >= 400 or an error "
               "recorded) or `ok` (the rest); `!` before a term excludes it. A record shows if it "
               "matches any plain term (or there is none) and no `!` term: --status 5xx,429, "
               "--status errors, --status '!200'. Repeat the flag to add terms")


class StatusFilter:
    def __init__(self, spec: str) -> None:
        self.include: list[Callable[[Record], bool]] = []
        self.exclude: list[Callable[[Record], bool]] = []
        for raw in spec.split(","):
            term = raw.strip().lower()
            negate = term.startswith("!")
            term = term.lstrip("!").strip()
            (self.exclude if negate else self.include).append(self._term(term, raw))

    @staticmethod
    def _term(term: str, raw: str) -> Callable[[Record], bool]:
        if term == "errors":
            return is_error
        if term == "ok":
            return lambda record: not is_error(record)
        if len(term) == 3 and term[0] in "12345" and term[1:] == "xx":
            status_class = int(term[0])
            return lambda record: record.status // 100 == status_class
        if len(term) == 3 and term.isdigit():
            code = int(term)
            return lambda record: record.status == code
        raise ValueError(f"bad status term {raw.strip()!r}: expected a code (404), a class (4xx), "
                         "errors or ok, optionally after `!`")

    def __call__(self, record: Record) -> bool:
        return ((not self.include or any(term(record) for term in self.include))
                and not any(term(record) for term in self.exclude))


@dataclass
class RecordFilter:
    replicas: frozenset[str] = frozenset()  # empty: any
    models: frozenset[str] = frozenset()
    status: StatusFilter | None = None
    slow_ms: float | None = None            # end-to-end milliseconds, at least

    def __call__(self, record: Record) -> bool:
        if self.replicas and record.replica not in self.replicas:
            return False
        if self.models and record.model not in self.models:
            return False
        if self.status is not None and not self.status(record):
            return False
        return self.slow_ms is None or (record.e2e_ms is not None and record.e2e_ms >= self.slow_ms)


# ---- one line per record -------------------------------------------------------------------------

Segments = list[tuple[str, str | None]]  # (text, style name); plain output joins the texts


def clock(timestamp: str | None) -> str:
    """HH:MM:SS.mmm of an ISO timestamp, in the log's own zone (UTC for kvgate's logs)."""
    if not timestamp or "T" not in timestamp:
        return "??:??:??.???"
    time_part = timestamp.split("T", 1)[1].rstrip("Z")
    time_part = time_part.split("+")[0].split("-")[0]
    head, _, fraction = time_part.partition(".")
    return f"{head}.{(fraction + '000')[:3]}"


def duration(ms: float | None) -> str:
    if ms is None:
        return "      -   "
    return f"{ms:7.1f} ms" if ms < 10_000 else f"{ms / 1000:7.2f} s "


def _count(value: int | None, width: int) -> str:
    return ("-" if value is None else str(value)).rjust(width)


def status_style(record: Record) -> str:
    if record.status >= 500 or (record.error is not None and record.status < 400):
        return "red"
    return "yellow" if record.status >= 400 else "green"


def routing_reason(record: Record) -> str:
    routing = record.routing or {}
    reason = str(routing.get("reason") or "-")
    if routing.get("retried_after"):
        reason += f" (retried after {', '.join(map(str, routing['retried_after']))})"
    return reason


def format_record(record: Record, replica_width: int = 8, wide: bool = False) -> Segments:
    segments: Segments = [
        (clock(record.timestamp), "dim"), ("  ", None),
        ((record.replica or "-").ljust(replica_width), "cyan"), ("  ", None),
        (str(record.status).rjust(3), status_style(record)),
        (f"  in {_count(record.prompt_tokens, 5)} cached {_count(record.cached_tokens, 5)} "
         f"out {_count(record.completion_tokens, 4)}", None),
        (f"  ttft {duration(record.ttft_ms)}  e2e {duration(record.e2e_ms)}", None),
    ]
    if record.routing or record.error is None:
        segments.append((f"  {routing_reason(record)}", "dim"))
    if record.error is not None:
        segments.append((f"  error: {record.error}", "red"))
    if wide:
        kind = "stream" if record.stream else "unary"
        segments.append((f"  [{record.model or '-'} {record.endpoint or '-'} {kind} id={record.request_id}]", "dim"))
    return segments


# ---- the rolling summary -------------------------------------------------------------------------

def percentile(values: list[float], p: float) -> float | None:
    """Nearest rank: the smallest value with at least p% of the values at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _hit_rate(cached: int, prompt: int) -> str:
    return f"{100 * cached / prompt:.1f}%" if prompt else "-"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


@dataclass
class ReplicaWindow:
    requests: int = 0
    prompt_tokens: int = 0  # of the requests whose cached tokens the replica reported
    cached_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)


class WindowStats:
    """What the records of one window (or the whole run) add up to. Hit rate: cached / prompt
    tokens over the requests whose replica reported cached tokens."""

    def __init__(self) -> None:
        self.requests = 0
        self.failed = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.replicas: dict[str, ReplicaWindow] = {}
        self.first_ts: str | None = None
        self.last_ts: str | None = None

    def add(self, record: Record) -> None:
        self.requests += 1
        self.failed += is_error(record)
        self.first_ts = self.first_ts or record.timestamp
        self.last_ts = record.timestamp or self.last_ts
        replica = self.replicas.setdefault(record.replica, ReplicaWindow()) if record.replica else None
        if replica is not None:
            replica.requests += 1
            if record.ttft_ms is not None:
                replica.ttft_ms.append(record.ttft_ms)
        if record.prompt_tokens is not None and record.cached_tokens is not None:
            self.prompt_tokens += record.prompt_tokens
            self.cached_tokens += record.cached_tokens
            if replica is not None:
                replica.prompt_tokens += record.prompt_tokens
                replica.cached_tokens += record.cached_tokens

    def log_span_s(self) -> float | None:
        """Seconds between the first and the last record's timestamps (None if unknown)."""
        try:
            first = datetime.fromisoformat(self.first_ts.replace("Z", "+00:00"))
            last = datetime.fromisoformat(self.last_ts.replace("Z", "+00:00"))
        except (AttributeError, ValueError):
            return None
        return (last - first).total_seconds()

    def summary(self, label: str, elapsed_s: float | None) -> str:
        rate = f", {self.requests / elapsed_s:.2f}/s" if elapsed_s else ""
        hits = (f"hit rate {_hit_rate(self.cached_tokens, self.prompt_tokens)} "
                f"({self.cached_tokens}/{self.prompt_tokens} prompt tokens cached)" if self.prompt_tokens
                else "hit rate -")
        parts = [f"-- {label}: {plural(self.requests, 'request')}{rate}, {self.failed} failed, {hits}"]
        for name in sorted(self.replicas):
            stats = self.replicas[name]
            parts.append(f"{name}: {stats.requests} req, hit {_hit_rate(stats.cached_tokens, stats.prompt_tokens)}, "
                         f"TTFT p50 {_ms(percentile(stats.ttft_ms, 50))} p99 {_ms(percentile(stats.ttft_ms, 99))}")
        return " | ".join(parts)


# ---- output ------------------------------------------------------------------------------------

class Output:
    """Plain text, or rich colours when stdout is a terminal (or --color always)."""

    def __init__(self, color: bool) -> None:
        self.console = None
        if color:
            from rich.console import Console
            self.console = Console(highlight=False, soft_wrap=True, force_terminal=True)

    def line(self, segments: Segments) -> None:
        if self.console is None:
            sys.stdout.write("".join(text for text, _style in segments) + "\n")
        else:
            from rich.text import Text
            self.console.print(Text.assemble(*((text, style or "") for text, style in segments)))

    def summary(self, text: str) -> None:
        self.line([(text, "bold")])

    def flush(self) -> None:
        (self.console.file if self.console is not None else sys.stdout).flush()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate tail",
        description="Show the gateway's JSON request log (logging.file in the routing YAML, or its "
                    "stdout) as one line per request: time (as logged, UTC), replica, status, prompt / "
                    "cached / completion tokens, TTFT, end-to-end latency, routing reason, and the error "
                    "of a failed request. Lines that are not request records are skipped.",
        epilog="Examples: kvgate tail kvgate-requests.jsonl --status errors;  "
               "kvgate tail kvgate-requests.jsonl --from-start --replica smol-0 --slow-ms 2000;  "
               "kvgate serve --config x.yaml | kvgate tail -")
    parser.add_argument("file", nargs="?", default=None,
                        help="the JSON log file, followed like `tail -F` (across truncation and rotation); "
                             "`-` reads stdin until it ends (the default when stdin is not a terminal)")
    parser.add_argument("--no-follow", action="store_true",
                        help="read the whole file once, print a final summary, exit")
    parser.add_argument("--from-start", action="store_true",
                        help="when following a file, show what it already holds first (default: only new lines)")
    parser.add_argument("--replica", action="append", default=[], metavar="NAME",
                        help="only requests served by NAME (repeat, or a comma list)")
    parser.add_argument("--model", action="append", default=[], metavar="NAME",
                        help="only requests for model NAME (repeat, or a comma list)")
    parser.add_argument("--status", action="append", default=[], metavar="TERMS", help=STATUS_HELP)
    parser.add_argument("--slow-ms", type=float, default=None, metavar="N",
                        help="only requests whose end-to-end latency (e2e_ms) is at least N ms")
    parser.add_argument("--summary-every-s", type=float, default=5.0, metavar="S",
                        help="a summary line of the last S seconds' shown requests (requests/s, hit rate "
                             "= cached / prompt tokens, TTFT p50/p99 per replica), printed when the window "
                             "had any; 0 = none (default 5). A final summary of everything shown ends "
                             "--no-follow and stdin")
    parser.add_argument("--wide", action="store_true", help="also show model, endpoint, stream and request id")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                        help="colour the status (auto: when stdout is a terminal and NO_COLOR is unset)")
    return parser


def _names(values: list[str]) -> frozenset[str]:
    return frozenset(name.strip() for value in values for name in value.split(",") if name.strip())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = StatusFilter(",".join(args.status)) if args.status else None
    except ValueError as exc:
        parser.error(f"--status: {exc}")
    if args.summary_every_s < 0:
        parser.error("--summary-every-s must be >= 0")
    record_filter = RecordFilter(_names(args.replica), _names(args.model), status, args.slow_ms)
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty()
                                       and not os.environ.get("NO_COLOR"))
    if args.file is None and sys.stdin.isatty():
        parser.error("name the log file (logging.file in the routing YAML), or pipe the log into `kvgate tail -`")
    if args.file in (None, "-"):
        batches, ends = stdin_batches(), True
    else:
        follower = FileFollower(Path(args.file), from_start=args.from_start or args.no_follow)
        if args.no_follow:
            if not follower.open():
                print(f"kvgate tail: {args.file}: no such file", file=sys.stderr)
                return 2
            batches = follower.read_to_end()
        else:
            batches = follow_batches(follower)
        ends = args.no_follow

    def stop(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # a supervisor's stop: the same quiet exit as Ctrl-C
    try:
        return _run(batches, ends, record_filter, Output(color), args.summary_every_s, args.wide)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `| head` has read enough: stop quietly, and let exit not flush into the pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _run(batches: Iterator[list[bytes]], ends: bool, record_filter: RecordFilter, out: Output,
         summary_every_s: float, wide: bool) -> int:
    counts, total, window = LineCounts(), WindowStats(), WindowStats()
    window_started = time.monotonic()
    replica_width = 8
    for batch in batches:
        for line in batch:
            record = parse_record(line, counts)
            if record is None or not record_filter(record):
                continue
            replica_width = min(24, max(replica_width, len(record.replica or "")))
            out.line(format_record(record, replica_width, wide))
            total.add(record)
            window.add(record)
        now = time.monotonic()
        if summary_every_s and now - window_started >= summary_every_s:
            if window.requests:
                elapsed_s = now - window_started
                out.summary(window.summary(f"last {elapsed_s:.1f} s", elapsed_s))
            window, window_started = WindowStats(), now
        out.flush()
    if ends:
        span_s = total.log_span_s()
        span_s = span_s if span_s is not None and span_s >= 1.0 else None  # a rate over less is noise
        label = f"total over {span_s:.1f} s of log" if span_s else "total"
        skipped = (f" | skipped {plural(counts.other_events, 'other event')}, "
                   f"{plural(counts.not_json, 'non-JSON line')}" if counts.other_events or counts.not_json else "")
        out.summary(total.summary(label, span_s) + skipped)
        out.flush()
    return 0
