"""Server-sent events framing as OpenAI streams use it: `data: {json}\n\n`, `data: [DONE]` last."""
from __future__ import annotations

import msgspec

DONE_LINE = b"data: [DONE]"
DONE_EVENT = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


def event(obj) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


class EventSplitter:
    """Cuts a byte stream into complete SSE events (split on blank lines), whatever the TCP chunking."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        if b"\n\n" not in self._buffer and b"\r\n\r\n" not in self._buffer:
            return []
        data = self._buffer.replace(b"\r\n", b"\n")
        *events, self._buffer = data.split(b"\n\n")
        return [e for e in events if e.strip()]

    def flush(self) -> list[bytes]:
        rest, self._buffer = self._buffer.strip(), b""
        return [rest] if rest else []


def data_of(event_bytes: bytes) -> bytes | None:
    """The payload of an event's `data:` lines joined, or None for comments/empty events."""
    parts = []
    for line in event_bytes.split(b"\n"):
        if line.startswith(b"data:"):
            parts.append(line[5:].lstrip(b" "))
    return b"\n".join(parts) if parts else None
