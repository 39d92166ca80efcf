"""One HTTP/1.1 POST whose 200 answer is a known number of raw bytes, received straight into a
preallocated buffer (the decode side's KV pull).

Why not aiohttp's client: it hands the body over in socket-sized bytes objects that must be copied
again; on a loopback pull of 94 MB it topped at ~0.45 GB/s where `sock_recv_into` on the event
loop reaches ~0.9 (same aiohttp server, this 2-core machine). The request asks `Connection: close`,
so any answer ends at EOF whatever its framing; only a 200 must carry the expected Content-Length.
Bound the whole exchange with `asyncio.timeout` around the call.
"""
from __future__ import annotations

import asyncio
import socket

import numpy as np

MAX_HEAD_BYTES = 64 << 10
MAX_ERROR_BYTES = 1 << 20


class BadAnswer(Exception):
    """The answer is not a well-formed HTTP/1.1 response, or a 200 of another size than expected."""


class ErrorAnswer(Exception):
    """A non-200 answer: its status and (up to 1 MB of) its body."""

    def __init__(self, status: int, reason: str, body: bytes):
        super().__init__(f"HTTP {status} {reason}")
        self.status = status
        self.reason = reason
        self.body = body


class CutShort(Exception):
    def __init__(self, received: int, expected: int):
        super().__init__(f"connection closed after {received} of {expected} bytes")
        self.received = received
        self.expected = expected


async def post_for_bytes(host: str, port: int, path: str, body: bytes, buffer: np.ndarray,
                         progress: list[int] | None = None) -> None:
    """POST `body` (JSON) and fill `buffer` (uint8) with the 200 answer's bytes. Raises OSError
    (connect/transport), ErrorAnswer, BadAnswer or CutShort. `progress[0]` tracks bytes received
    (for a timeout's message)."""
    loop = asyncio.get_running_loop()
    family, kind, proto, _, address = (await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, address)
        host_header = f"[{host}]" if ":" in host else host
        await loop.sock_sendall(sock, (f"POST {path} HTTP/1.1\r\nHost: {host_header}:{port}\r\n"
                                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                                       f"Connection: close\r\n\r\n").encode() + body)
        head, rest = await _read_head(loop, sock)
        status, reason, length = _parse_head(head)
        if status != 200:
            while len(rest) < MAX_ERROR_BYTES and (length is None or len(rest) < length):
                more = await loop.sock_recv(sock, 65536)
                if not more:
                    break
                rest += more
            raise ErrorAnswer(status, reason, bytes(rest[:length]))
        expected = buffer.nbytes
        if length != expected:
            raise BadAnswer(f"a 200 of {length} bytes, expected {expected}")
        view = memoryview(buffer)
        filled = min(len(rest), expected)
        view[:filled] = rest[:filled]
        while filled < expected:  # one recv_into per socket read: the kernel copies into `buffer`
            received = await loop.sock_recv_into(sock, view[filled:])
            if received == 0:
                raise CutShort(filled, expected)
            filled += received
            if progress is not None:
                progress[0] = filled
    finally:
        sock.close()


async def _read_head(loop, sock: socket.socket) -> tuple[bytes, bytearray]:
    data = bytearray()
    while True:
        end = data.find(b"\r\n\r\n")
        if end != -1:
            return bytes(data[:end]), data[end + 4:]
        if len(data) > MAX_HEAD_BYTES:
            raise BadAnswer("no end of headers in 64 KB")
        more = await loop.sock_recv(sock, 65536)
        if not more:
            raise BadAnswer(f"connection closed before the headers ended ({len(data)} bytes)")
        data += more


def _parse_head(head: bytes) -> tuple[int, str, int | None]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise BadAnswer(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    length = None
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            if not value.strip().isdigit():
                raise BadAnswer(f"bad Content-Length {value.strip()[:40]!r}")
            length = int(value)
    return int(parts[1]), parts[2] if len(parts) > 2 else "", length
