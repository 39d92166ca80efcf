"""Stream chunks as the gateway reads them: typed structs holding only the fields it uses (token
IDs, text, finish reason, usage, the response's id), decoded a whole read at a time.

A replica's read usually carries several events (`data: {...}\\n\\n` each); `decode_events` turns
them into one JSON array and decodes it in a single msgspec call into `Chunk`s (no dicts), keeping
each event's bytes for relaying as they are. Fields the gateway does
not know are skipped by the decoder and stay in the payload bytes the client gets.

`strip_token_ids` removes `token_ids` / `prompt_token_ids` from a payload without decoding it:
outside JSON strings a quote preceded by `,` or `{` only ever opens a key (inside a string every
quote is escaped), so the patterns below match keys, never text. Replicas write compact JSON
with the IDs after other members (vLLM, kvgate's), which a scan for the literal key cuts out
(protocol/_strip_ids.c; without a C compiler at install, a pattern with a literal start, or
_strip_compact on a long payload); the general pattern runs only on what that left behind."""
from __future__ import annotations

import re
from typing import Any

import msgspec

UNSET = msgspec.UNSET


class Delta(msgspec.Struct):
    content: str | None = None
    role: Any = UNSET   # present (any value) only in a chat stream's opening chunk


class Choice(msgspec.Struct):
    index: Any = 0
    text: str | None = None
    delta: Delta | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None


class PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: PromptDetails | None = None


class Chunk(msgspec.Struct):
    id: Any = None
    object: Any = None
    created: Any = None
    model: Any = None
    choices: list[Choice] | None = None
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None   # chat: vLLM puts them at the top level
    error: Any = None
    kv_transfer_stats: Any = None                # a P/D decode leg's, for the record only


class AnswerChoice(msgspec.Struct):
    token_ids: list[int] | None = None
    finish_reason: str | None = None


class AnswerUsage(msgspec.Struct):
    prompt_tokens_details: PromptDetails | None = None


class AnswerFacts(msgspec.Struct):
    """What the gateway reads of a non-streamed answer that passes through (decode_answer): the
    other members are skipped by the decoder, no object made for them."""
    choices: list[AnswerChoice] | None = None
    usage: AnswerUsage | None = None


_batch_decoder = msgspec.json.Decoder(list[Chunk])
_answer_decoder = msgspec.json.Decoder(AnswerFacts)
_one_decoder = msgspec.json.Decoder(Chunk)
_any_decoder = msgspec.json.Decoder()

_COMPACT_TOKEN_IDS = re.compile(rb',"token_ids":(?:\[[\d,]*\]|null)|,"prompt_token_ids":(?:\[[\d,]*\]|null)')
_TOKEN_IDS = re.compile(
    rb',\s*"(?:prompt_token_ids|token_ids)"\s*:\s*(?:\[[\d,\s]*\]|null)'
    rb'|"(?:prompt_token_ids|token_ids)"\s*:\s*(?:\[[\d,\s]*\]|null)\s*,?')


class MalformedEvent(ValueError):
    """An event's JSON is an object the gateway cannot read as a stream chunk."""


def decode_events(events: list[bytes]) -> tuple[list[bytes], list[Chunk]]:
    """The stream chunks of a read's events, and each one's event as the client may get it
    (`data: {...}`, without its blank line). `[DONE]`, comments and non-object JSON are skipped
    (as OpenAI's clients do). Raises MalformedEvent for an event that is not a chunk.

    The usual read (every event one `data: ` line) is one C-level join and replace into a JSON
    array and one decode; anything else is taken event by event."""
    if events and events[-1] == b"data: [DONE]":
        events = events[:-1]
    if not events:
        return [], []
    if len(events) == 1:  # one event a read, the usual token stream: its JSON decoded as it is
        only = events[0]
        if only.startswith(b"data: ") and only.find(b"\n") < 0:
            try:
                return events, [_one_decoder.decode(only[6:])]
            except msgspec.DecodeError:
                pass  # not a chunk: the general path below says what it is
    joined = b"\n\n".join(events)
    if joined.startswith(b"data: "):
        array = joined[6:].replace(b"\n\ndata: ", b",")
        if array.find(b"\n") < 0:  # every line break was a `data: ` event's start: one line each
            try:
                return events, _batch_decoder.decode(b"[" + array + b"]")
            except msgspec.DecodeError:
                pass  # one of them is odd: find which, one at a time
    kept, chunks = [], []
    for raw in events:
        lines = [line[5:].lstrip(b" ") for line in raw.split(b"\n") if line.startswith(b"data:")]
        if not lines:
            continue  # a comment or an event without data
        payload = b"\n".join(lines)
        if payload == b"[DONE]":
            continue
        try:
            chunk = _one_decoder.decode(payload)
        except msgspec.ValidationError as exc:
            if isinstance(_any_decoder.decode(payload), dict):
                raise MalformedEvent(f"unreadable stream chunk ({exc}): {payload[:200]!r}") from None
            continue  # JSON, but not an object: skipped
        except msgspec.DecodeError as exc:
            raise MalformedEvent(f"stream event that is not JSON ({exc}): {payload[:200]!r}") from None
        kept.append(b"data: " + payload.replace(b"\n", b"\ndata: "))
        chunks.append(chunk)
    return kept, chunks


try:  # protocol/_strip_ids.c: the compact members cut in C, at any size
    from protocol._strip_ids import strip as _native_strip
except ImportError:  # no C compiler at install: the regex, or a scan with bytes.find past FIND_ABOVE_BYTES
    _native_strip = None
NATIVE = True  # False: the Python cuts even where the C one was built (tests compare the two)

# Without the C cut: below this many bytes the compact pattern (one regex call) cuts faster; above it, bytes.find
# (a regex scan of a long prompt's IDs costs ~20 us per 1,000 of them).
FIND_ABOVE_BYTES = 4096


def strip_token_ids(payload: bytes) -> bytes:
    # bytes.find, not `in`: `in` first tries its operand as an int, which formats a TypeError
    # and throws it away (~2,000 instructions) before it searches.
    if payload.find(b'token_ids"') < 0:
        return payload
    if _native_strip is not None and NATIVE:  # _COMPACT_TOKEN_IDS's cut, by a scan for the key
        payload = _native_strip(payload, True)
    elif len(payload) < FIND_ABOVE_BYTES:
        payload = _COMPACT_TOKEN_IDS.sub(b"", payload)
    else:
        payload = _strip_compact(payload, b'token_ids":')
    return _TOKEN_IDS.sub(b"", payload) if payload.find(b'token_ids"') >= 0 else payload


def strip_prompt_token_ids(payload: bytes) -> bytes:
    """A long payload without its compact `,"prompt_token_ids":[...]` members (a non-streamed
    answer's echo of a long prompt: cut before decoding the rest); a short one as it is (its
    decode costs less than the cut)."""
    if len(payload) < FIND_ABOVE_BYTES or b'prompt_token_ids"' not in payload:
        return payload
    if _native_strip is not None and NATIVE:
        return _native_strip(payload, False)
    return _strip_compact(payload, b'prompt_token_ids":')


def _strip_compact(payload: bytes, key: bytes) -> bytes:
    """The compact members whose key ends with `key` (`,"token_ids":[1,2]`, `,"prompt_token_ids":null`)
    cut out with bytes.find: C speed over a long prompt's IDs, where the regex took ~20 us per
    1,000 IDs. A list is cut only when nothing in it could hold a `]` of its own (no string,
    list or object); anything else is left for _TOKEN_IDS."""
    pieces: list[bytes] = []
    copied = searched = 0
    find = payload.find
    both = key == b'token_ids":'  # then `,"prompt_token_ids":` is one of them too
    while (at := find(key, searched)) >= 0:
        searched = at + len(key)
        if payload[at - 2:at] == b',"':
            begin = at - 2
        elif both and payload[at - 9:at] == b',"prompt_':
            begin = at - 9
        else:
            continue
        if payload.startswith(b"null", searched):
            end = searched + 4
        elif payload.startswith(b"[", searched):
            close = find(b"]", searched)
            if close < 0 or find(b'"', searched, close) >= 0 or find(b"[", searched + 1, close) >= 0 \
                    or find(b"{", searched, close) >= 0:
                continue
            end = close + 1
        else:
            continue
        pieces.append(payload[copied:begin])
        copied = searched = end
    if not pieces:
        return payload
    pieces.append(payload[copied:])
    return b"".join(pieces)


def decode_answer(payload: bytes) -> AnswerFacts:
    """A non-streamed answer's choices (their token IDs and finish reasons) and its cached
    tokens; the rest (texts, a chat choice's `message`) is skipped. Raises msgspec.DecodeError
    (ValidationError included) for one that is not an OpenAI response."""
    return _answer_decoder.decode(payload)


def as_dict(payload: bytes) -> dict:
    return _any_decoder.decode(payload)
