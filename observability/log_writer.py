"""Log lines written by a background thread, so the event loop never waits on a write().

The loop thread (or any thread) encodes a line and hands it over (`write`, a list append under a
lock, ~0.3 us); one writer thread takes everything pending and writes it in one write() per sink
(stdout, and the log file when there is one). While lines keep coming, the writer looks every
LINGER_S and writes what gathered, so a request costs a fraction of a syscall instead of two, and
the producer never wakes it (no futex call, no thread switch per line: at 200 requests/s one
wake-up per handover cost the writer ~140 us of CPU a request, more than it spent writing). After
IDLE_AFTER_S without a line it sleeps until the next line wakes it, and writes that one at once.

Guarantees: every line handed over is written, in the order handed over (one queue, one
writer); nothing is dropped when the sinks are slow: past `max_pending_bytes` a producer waits
for the writer (back-pressure instead of loss, or of unbounded memory). `flush()` returns once
everything handed over so far is written; `close()` flushes and stops the thread (registered
with atexit by configure_logging, so a normal exit, Ctrl-C and SIGTERM included, loses nothing).
A process killed with SIGKILL loses at most the last LINGER_S of lines."""
from __future__ import annotations

import os
import sys
import threading
from typing import BinaryIO

LINGER_S = 0.02
IDLE_AFTER_S = 1.0
MAX_PENDING_BYTES = 64 << 20


class LogWriter:
    def __init__(self, stream: BinaryIO | None, log_file=None, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self._stream = stream
        self._log_file = log_file                   # observability.logs.LogFile (rotation, errors)
        self._max_pending = max_pending_bytes
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)    # the writer waits here when idle
        self._drained = threading.Condition(self._lock)  # producers and flush() wait here
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._handed = 0      # lines handed over so far
        self._written = 0     # lines written so far
        self._idle = False    # the writer sleeps until woken
        self._closing = False
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="kvgate-log-writer", daemon=True)
        self._thread.start()

    def write(self, line: bytes) -> None:
        """Hand one line over (without its newline)."""
        self.write_many([line])

    def write_many(self, lines: list) -> None:
        """Hand lines over, in order (each without its newline)."""
        with self._lock:
            if self._closing:  # after close (interpreter shutdown): write them ourselves, in order
                self._write_batch(lines)
                return
            self._pending += lines
            self._pending_bytes += sum([len(line) + 1 if type(line) is bytes else len(line[0]) + 1 for line in lines])
            self._handed += len(lines)
            if self._idle:
                self._idle = False
                self._wake.notify()
            while self._pending_bytes > self._max_pending and not self._closing:
                self._wake.notify()  # write now rather than at the end of the linger
                self._drained.wait()  # the sinks are behind: wait rather than drop or grow

    def write_line_to_file(self, line: bytes) -> None:
        """A line for the log file only (the stdlib's records, which go to stderr on their own)."""
        if self._log_file is not None:
            self.write((line,))  # type: ignore[arg-type]  # a tuple marks it file-only

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every line handed over so far is written; False on timeout."""
        with self._lock:
            target = self._handed
            if self._pending:  # idle or lingering: write now
                self._idle = False
                self._wake.notify()
            return self._drained.wait_for(lambda: self._written >= target or not self._thread.is_alive(),
                                          timeout_s)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self.flush(10.0)
        with self._lock:
            self._closing = True
            self._wake.notify()
        self._thread.join(10.0)

    def _run(self) -> None:
        quiet = 0  # lingers in a row that found nothing
        while True:
            with self._lock:
                while not self._pending and not self._closing:
                    if quiet * LINGER_S >= IDLE_AFTER_S:
                        self._idle = True  # the next write() wakes us
                        self._wake.wait()
                    else:
                        self._wake.wait(LINGER_S)
                        quiet += 1
                batch, self._pending, self._pending_bytes = self._pending, [], 0
                closing = self._closing
            quiet = 0
            if batch:
                self._write_batch(batch)
                with self._lock:
                    self._written += len(batch)
                    self._drained.notify_all()
            if closing:
                with self._lock:
                    if not self._pending:
                        return
                continue
            with self._lock:  # let the next lines gather: one write per batch, not per line
                if not self._closing:
                    self._wake.wait(LINGER_S)

    def _write_batch(self, lines: list) -> None:
        to_file = lines
        if any(type(line) is tuple for line in lines):
            to_file = [line[0] if type(line) is tuple else line for line in lines]
            lines = [line for line in lines if type(line) is not tuple]
        if self._stream is not None and lines:
            try:
                _write_all(self._stream, b"\n".join(lines) + b"\n")
            except (OSError, ValueError) as exc:  # a closed or broken stdout must not stop the file
                self._warn(f"cannot write log lines to stdout: {exc}")
        if self._log_file is not None:
            self._log_file.write_lines(to_file)

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            print(f"kvgate: {message}", file=sys.stderr, flush=True)


def _write_all(stream: BinaryIO, data: bytes) -> None:
    fileno = getattr(stream, "fileno", None)
    try:
        fd = fileno() if fileno is not None else None
    except (OSError, ValueError):  # io.BytesIO and friends: no descriptor
        fd = None
    if fd is None:
        stream.write(data)
        stream.flush()
        return
    stream.flush()  # anything written through the stream's own buffer goes first
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
