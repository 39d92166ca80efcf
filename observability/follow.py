"""Where `kvgate tail` gets its lines: a file followed the way `tail -F` follows it (across
truncation and rotation), or stdin. Lines come in batches; an empty batch means "nothing new for
now", so the caller can flush output and print its periodic summary."""
from __future__ import annotations

import os
import select
import sys
import time
from pathlib import Path
from typing import BinaryIO, Iterator

POLL_S = 0.2               # how often a caught-up follower looks for new lines (tail -f's is 1 s)
READ_CHUNK_BYTES = 1 << 20  # per read: a long backlog is taken in bounded steps, output in between


class FileFollower:
    """Complete lines appended to `path`, like `tail -F`: reopens it when it is replaced (rotation:
    the old file is drained first) and rereads it from the top when it shrinks (truncation)."""

    def __init__(self, path: Path, from_start: bool) -> None:
        self.path = path
        self.from_start = from_start
        self.file: BinaryIO | None = None
        self.identity: tuple[int, int] | None = None
        self.partial = b""

    def open(self) -> bool:
        try:
            self.file = open(self.path, "rb")
        except FileNotFoundError:
            self.from_start = True  # it did not exist: when it appears, all of it is new
            return False
        stat = os.fstat(self.file.fileno())
        self.identity = (stat.st_dev, stat.st_ino)
        if not self.from_start:
            self.file.seek(0, os.SEEK_END)
        self.from_start = True  # a later reopen (rotation) reads the new file from its start
        return True

    def read_lines(self) -> list[bytes]:
        if self.file is None and not self.open():
            return []
        chunk = self.file.read(READ_CHUNK_BYTES)
        if chunk:
            return self._split(chunk)
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return []  # rotated away, the new file not there yet: keep the old one open
        if (stat.st_dev, stat.st_ino) != self.identity:
            rest = self.file.read()  # written to the old file between our EOF and its rename
            self.file.close()
            self.file = None  # if the new one is gone again before we open it, the next call retries
            lines = self._split(rest) + ([self.partial] if self.partial else [])
            self.partial = b""
            self.open()
            return lines
        if stat.st_size < self.file.tell():
            self.file.seek(0)
            self.partial = b""
        return []

    def read_to_end(self) -> Iterator[list[bytes]]:
        while chunk := self.file.read(READ_CHUNK_BYTES):
            yield self._split(chunk)
        if self.partial:
            yield [self.partial]

    def _split(self, chunk: bytes) -> list[bytes]:
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        return lines


def stdin_batches() -> Iterator[list[bytes]]:
    """Lines from stdin as they come; an empty batch when nothing came for POLL_S (time for the
    summary). Ends at EOF."""
    fd, partial = sys.stdin.fileno(), b""
    while True:
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if not ready:
            yield []
            continue
        chunk = os.read(fd, READ_CHUNK_BYTES)
        if not chunk:
            if partial:
                yield [partial]
            return
        lines = (partial + chunk).split(b"\n")
        partial = lines.pop()
        yield lines


def follow_batches(follower: FileFollower) -> Iterator[list[bytes]]:
    """Runs until Ctrl-C, SIGTERM or a closed pipe ends the process: following has no last line."""
    where = "the start" if follower.from_start else "the end"
    if follower.open():
        _note(f"following {follower.path} from {where}")
    else:
        _note(f"waiting for {follower.path} to appear")
    while True:
        lines = follower.read_lines()
        yield lines
        if not lines:
            time.sleep(POLL_S)


def _note(message: str) -> None:
    print(f"kvgate tail: {message}", file=sys.stderr, flush=True)
