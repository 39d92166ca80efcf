"""One worker process of a gateway with `gateway.workers` > 1: `python -m gateway.worker`, started
by gateway/workers.py, which writes its WorkerSpec (JSON) to the worker's stdin.

Its logs go to the parent, the one writer of each stream: every line on stdout (a pipe the parent
copies to its own stdout, whole lines only) and, when `logging.file` is set, every line as JSON
on a second pipe (`log_fd`) that the parent appends to the file, rotation included. Lines of any
length never interleave: each pipe has one writer, each line is one write on it. Every line
carries `worker` (this worker's index)."""
from __future__ import annotations

import errno
import os
import sys
import threading

import msgspec
import structlog

from gateway.worker_bus import WorkerSpec
from observability.logs import configure_logging

EXIT_CANNOT_LISTEN = 3


class PipeSink:
    """The log file's side of configure_logging, as a pipe to the parent: one write() per line, or
    per batch of lines (observability's writer thread batches them)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()  # tokenizer threads log too

    def write_line(self, line: bytes) -> None:
        self._write(line + b"\n")

    def write_lines(self, lines: list[bytes]) -> None:
        self._write(b"\n".join(lines) + b"\n")

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        with self._lock:
            try:
                while view:  # a line longer than the pipe's buffer goes in several calls, still in order
                    view = view[os.write(self.fd, view):]
            except OSError:
                pass  # the parent is gone: nobody reads the file's lines any more

    def close(self) -> None:
        os.close(self.fd)


def main() -> int:
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerSpec)
    config = spec.config
    sink = PipeSink(spec.log_fd) if spec.log_fd is not None else None
    configure_logging(config.logging.level, spec.log_format, log_file=sink)
    index = spec.index
    # Every line says which worker wrote it: bound in the context every task of the loop inherits
    # (request records are written from it), and added to events logged from other threads.
    structlog.contextvars.bind_contextvars(worker=index)

    def tag(_logger, _method, event_dict):
        event_dict.setdefault("worker", index)
        return event_dict

    structlog.configure(processors=[tag, *structlog.get_config()["processors"]])
    from gateway.server import run
    try:
        return run(config, admin_token=spec.admin_token, worker=spec)
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
            raise
        print(f"error: worker {index}: cannot listen on {config.gateway.host}:{config.gateway.port}: "
              f"{exc.strerror or exc}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_LISTEN


if __name__ == "__main__":
    sys.exit(main())
