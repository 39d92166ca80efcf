"""Server-sent events framing as OpenAI streams use it: `data: {json}\n\n`, `data: [DONE]` last."""
from __future__ import annotations

import msgspec

DONE_LINE = b"data: [DONE]"
DONE_EVENT = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


def event(obj) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


class EventSplitter:
    """Cuts a byte stream into complete SSE events (split on blank lines), whatever the TCP
    chunking: one split per read, however many events it carries."""
    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._buffer + chunk if self._buffer else chunk
        if data.find(b"\r") >= 0:  # CRLF framing (a CR held back at the end joins its LF next time)
            data = data.replace(b"\r\n", b"\n")
        end = data.find(b"\n\n")
        if end < 0:
            self._buffer = data
            return []
        if end == len(data) - 2 and end:  # one whole event, the usual read of a token stream: no split
            self._buffer = b""
            return [data[:-2]] if data[0] > 32 or data[:-2].strip() else []  # (blank: none)
        *events, self._buffer = data.split(b"\n\n")
        return [e for e in events if e.strip()]

    def flush(self) -> list[bytes]:
        rest, self._buffer = self._buffer.strip(), b""
        return [rest] if rest else []
