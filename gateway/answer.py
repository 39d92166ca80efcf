"""What the client receives for one request, across every try that produced it.

The gateway asks replicas to stream (return_token_ids, usage), whatever the client asked, so it
always knows how far an answer got. Three ways out:

  relay     a streaming client, nothing failed yet: the replica's events go through as they are
            (token IDs and the usage chunk stripped when the client did not ask for them)
  collect   a non-streaming client: events are gathered into one JSON answer at the end
  resumed   a try died after k tokens and the next is a continuation (prompt + those k token
            IDs as a /v1/completions prompt): the gateway writes the text itself from the
            continuation's token IDs, with its own detokenizer primed with the k tokens (a
            character split across the seam comes out whole) and its own stop-string check over
            the whole answer (a stop string across the seam ends it). Usage counts the whole answer.

A try that dies before its first token is simply tried again; the client never sees it."""
from __future__ import annotations

import time
from typing import Any

import msgspec
import structlog

from gateway.exchange import Exchange
from observability.request_log import RequestRecord
from protocol.errors import error_body
from protocol.responses import chunk_base, full_response, text_chunk, usage_chunk, usage_of
from protocol.sse import DONE_EVENT, event
from protocol.stream_chunks import UNSET, Chunk, Choice, MalformedEvent, as_dict, decode_events, strip_token_ids
from tokenization import IncrementalDetokenizer, TokenizerBundle
from tokenization.stop_strings import find_stop_string, held_back_chars

log = structlog.get_logger("kvgate.proxy")


class AnswerSpec(msgspec.Struct, eq=False):
    """What the client asked for, as far as shaping the answer goes."""
    chat: bool
    stream: bool
    model: str
    wants_token_ids: bool
    wants_usage: bool
    stops: list[str]
    skip_special_tokens: bool
    echo_chars: int = 0  # completions with echo: the prompt text that leads the first chunk


class Answer(msgspec.Struct, eq=False):
    """A Struct (compared by identity): one per request, its fields filled in C."""
    spec: AnswerSpec
    record: RequestRecord
    reply_headers: dict
    exchange: Exchange
    texts: list[str] = []                # output text so far (collect mode, and for the seam)
    emitted_chars: int = 0               # output characters the client has or the answer holds
    opening_sent: bool = False           # a chat stream's role chunk went out
    finish_reason: str | None = None
    stop_reason: Any = None
    base: dict | None = None             # id/object/created/model of the first chunk seen
    prompt_token_ids: list[int] | None = None
    delivered: bool = False              # [DONE] (or the whole JSON answer) went out
    _echoed: int = 0                     # echo characters taken off the output (spec.echo_chars in all)
    kv_stats: dict | None = None         # a P/D decode leg's kv_transfer_stats (bytes pulled, seconds)
    _detok: IncrementalDetokenizer | None = None  # resumed mode
    _led: bool = False                   # a read of this answer's events was taken (see _lead)

    @property
    def complete(self) -> bool:
        return self.finish_reason is not None

    @property
    def resumed(self) -> bool:
        return self._detok is not None

    @property
    def response_started(self) -> bool:
        return self.exchange.streaming

    # ---- the client's stream -------------------------------------------------------------------
    async def open_stream(self, hold: bool = False) -> None:
        """Send the client's SSE head (once, when the first try answers 200); `hold` as in
        Exchange.open_stream."""
        if self.exchange.streaming or not self.spec.stream:
            return
        await self.exchange.open_stream({**self.reply_headers, "content-type": "text/event-stream",
                                         "cache-control": "no-cache"}, hold)

    # ---- upstream events -----------------------------------------------------------------------
    async def on_events(self, events: list[bytes], last: bool = False) -> None:
        """The events of one read from the replica, in order; what the client gets of them goes
        out in one write (token IDs cut out of the whole batch at once when the client did not
        ask for them). `last`: the replica's answer ended with this read, so when it is complete
        the write waits for the stream's end to go out with it."""
        now = time.perf_counter()
        first = None
        if not self._led:
            lead, events, first = self._lead(events, now)
            if lead:
                await self.exchange.write(lead)
        out: list[bytes] = []
        try:
            self._take_events(events, out, now)
        finally:
            if first is not None and out and out[0] is first:
                del out[0]  # it went out ahead (_lead)
            if out and self.spec.stream:
                await self.exchange.write(self._for_client(out), hold=last and self.finish_reason is not None)

    def on_events_now(self, events: list[bytes]) -> bool:
        """on_events for an exchange that writes without waiting (Exchange.pushes), called from the
        replica connection's data_received for a read that does not end the answer: True when the
        client's buffer is full (drain first)."""
        full = False
        now = time.perf_counter()
        first = None
        if not self._led:
            lead, events, first = self._lead(events, now)
            if lead:
                full = self.exchange.write_now(lead)
        out: list[bytes] = []
        try:
            self._take_events(events, out, now)
        finally:
            if first is not None and out and out[0] is first:
                del out[0]  # it went out ahead (_lead)
            if out and self.spec.stream:
                full = self.exchange.write_now(self._for_client(out)) or full
        return full

    def _lead(self, events: list[bytes], now: float) -> tuple[bytes, list[bytes], bytes | None]:
        """For the answer's first read: (the client's bytes of its first event, the events left
        to take, the first event when it is among them) when a stream's read holds more than one,
        so that the first goes out before the rest are decoded and recorded; else (b"", events,
        None). A replica that shares the gateway's cores often runs its whole turn before the
        gateway reads (its wake-up preempts the gateway mid-write: bench/README, "Twenty-eighth
        session"), so the first read can hold the whole answer; the client's first token then no
        longer waits for the other events' work (18 events: 203 -> 117 us from the replica's bytes
        to the client's first write, on the bench's stub). An event that can pass as it is
        (_passes_as_is) goes out before it is decoded too: it stays first in the events to take,
        and the caller drops it from what they give the client."""
        self._led = True
        if len(events) < 2 or not self.spec.stream:
            return b"", events, None
        first = events[0]
        if not self.spec.echo_chars and _passes_as_is(first):
            return self._for_client([first]), events, first
        out: list[bytes] = []
        self._take_events(events[:1], out, now)
        return (self._for_client(out) if out else b""), events[1:], None

    def _take_events(self, events: list[bytes], out: list[bytes], now: float | None = None) -> None:
        try:
            kept, chunks = decode_events(events)
        except MalformedEvent as exc:
            raise InBandError(f"malformed stream event: {exc}"[:300]) from None
        self._on_chunks(kept, chunks, time.perf_counter() if now is None else now, out)

    def _for_client(self, out: list[bytes]) -> bytes:
        """A read's kept events as the client's bytes (token IDs cut when it did not ask for them)."""
        data = b"\n\n".join(out) + b"\n\n"
        return data if self.spec.wants_token_ids else strip_token_ids(data)

    def _on_chunks(self, events: list[bytes], chunks: list[Chunk], now: float, out: list[bytes]) -> None:
        """The chunks of one read, in order: the record and the answer learn from each, and `out`
        gets each event as the client receives it (if it does). One loop for the read, not a call
        per chunk, with what stays the same across it in locals: a stream's cost is mostly this,
        once per token."""
        record = self.record
        spec = self.spec
        chat, stream, resumed, wants_usage = spec.chat, spec.stream, self._detok is not None, spec.wants_usage
        keep = out.append if stream else None
        arrived: list[int] = []  # the read's token IDs in order (one record update for the read)
        arriving = 0              # how many events brought them
        texts = self.texts
        emitted = self.emitted_chars
        try:
            for event_bytes, chunk in zip(events, chunks):
                rebuild = False  # the event holds something the client must not get as is
                if chunk.error is not None or chunk.kv_transfer_stats is not None:
                    if chunk.error is not None:
                        error = chunk.error
                        record.error = error.get("message") if isinstance(error, dict) else str(error)
                        raise InBandError(record.error)
                    # a decode leg's KV transfer stats: for the record, not the client's
                    self.kv_stats = chunk.kv_transfer_stats if isinstance(chunk.kv_transfer_stats, dict) else None
                    rebuild = True
                if self.base is None and chunk.id is not None:
                    self.base = {"id": chunk.id, "object": chunk.object, "created": chunk.created, "model": chunk.model}
                choices = chunk.choices
                usage = chunk.usage
                if usage is not None:
                    _take_usage(record, usage, keep_counts=resumed)
                if self.prompt_token_ids is None:
                    ids = chunk.prompt_token_ids or (choices[0].prompt_token_ids if choices else None)
                    if ids:
                        self.prompt_token_ids = _take_prompt_ids(record, ids)
                if not choices:
                    if usage is not None and not resumed and stream and wants_usage:
                        keep(self._relayed(event_bytes, rebuild, drop_usage=False))
                    continue
                choice = choices[0]
                token_ids = choice.token_ids
                if resumed:
                    self.emitted_chars = emitted
                    self._on_resumed_tokens(token_ids or (), choice, now, out)
                    emitted = self.emitted_chars
                    continue
                if token_ids:
                    arrived += token_ids
                    arriving += 1
                if chat:
                    delta = choice.delta
                    text = (delta.content or "") if delta is not None else ""
                    if delta is not None and delta.role is not UNSET:
                        if self.opening_sent:
                            continue  # a retried try's role chunk: the client has one already
                        self.opening_sent = True
                else:
                    text = choice.text or ""
                if text:
                    echo_left = spec.echo_chars - self._echoed
                    if echo_left:
                        echoed = min(echo_left, len(text))
                        self._echoed += echoed
                        text = text[echoed:]
                    texts.append(text)
                    emitted += len(text)
                if choice.finish_reason:
                    self.finish_reason = record.finish_reason = choice.finish_reason
                    self.stop_reason = choice.stop_reason
                if keep is None:
                    continue
                if rebuild or (usage is not None and not wants_usage):
                    keep(self._relayed(event_bytes, rebuild, usage is not None and not wants_usage))
                else:
                    keep(event_bytes)
        finally:  # what came before an error too: a resumed try continues after it
            self.emitted_chars = emitted
            if arrived:
                record.tokens_arrived(arrived, now, arriving)

    @staticmethod
    def _relayed(event_bytes: bytes, rebuild: bool, drop_usage: bool) -> bytes:
        """An event that carries something the client must not get (usage it did not ask for, a
        decode leg's KV stats), rebuilt from its JSON without it (`data: {...}`, no blank line).
        Every other event goes out as the replica's bytes (fields the gateway does not know pass
        unchanged)."""
        if not rebuild and not drop_usage:
            return event_bytes
        chunk = as_dict(b"\n".join(line[5:].lstrip(b" ") for line in event_bytes.split(b"\n")))
        chunk.pop("kv_transfer_stats", None)
        if drop_usage:
            chunk.pop("usage", None)
        return event(chunk)[:-2]

    # ---- resuming ------------------------------------------------------------------------------
    def start_resume(self, bundle: TokenizerBundle) -> None:
        """The next try continues after the tokens the record holds: from here on the gateway
        writes the text itself (see the module docstring)."""
        if self._detok is None:
            detok = IncrementalDetokenizer(bundle, self.spec.skip_special_tokens)
            for token_id in self.record.output_token_ids:
                detok.add(token_id)
            self._detok = detok
        if self.base is None:
            self.base = {"id": f"{'chatcmpl' if self.spec.chat else 'cmpl'}-{self.record.request_id}",
                         "object": None, "created": int(time.time()), "model": self.spec.model}

    def _on_resumed_tokens(self, token_ids, choice: Choice, now: float, out: list[bytes]) -> None:
        if self.complete:
            return
        record, detok, stops = self.record, self._detok, self.spec.stops
        record.tokens_arrived(token_ids, now)
        for token_id in token_ids:
            detok.add(token_id)
        full = detok.text
        already = "".join(self.texts)
        if not full.startswith(already):  # the replica's own text differed; keep what the client has
            full = already + full[len(already):]
        finish, stop_reason = None, None
        hit = find_stop_string(full, stops, self.emitted_chars) if stops else None
        if hit is not None:
            full = full[:hit[0]]
            finish, stop_reason = "stop", hit[1]
        elif choice.finish_reason:
            finish, stop_reason = choice.finish_reason, choice.stop_reason
        release_to = len(full) if finish else len(full) - held_back_chars(full, stops)
        delta = full[self.emitted_chars:max(self.emitted_chars, release_to)]
        if delta:
            self.texts.append(delta)
            self.emitted_chars += len(delta)
        if finish:
            self.finish_reason, self.stop_reason = finish, stop_reason
            record.finish_reason = finish
        if self.spec.stream and (delta or finish or (self.spec.wants_token_ids and token_ids)):
            base = chunk_base(self.base["id"], self.base["created"], self.spec.model, self.spec.chat)
            out.append(event(text_chunk(base, self.spec.chat, delta, finish, stop_reason,
                                        list(token_ids) if self.spec.wants_token_ids else None))[:-2])

    # ---- the end ---------------------------------------------------------------------------------
    def _usage(self) -> dict:
        record = self.record
        prompt_tokens = len(self.prompt_token_ids or record.prompt_token_ids or [])
        return usage_of(prompt_tokens, len(record.output_token_ids), record.cached_tokens)

    async def finish(self) -> None:
        """The answer is complete: close the stream (usage chunk, [DONE]) or send the JSON."""
        record = self.record
        record.completion_tokens = len(record.output_token_ids)
        base = self.base or {"id": f"{'chatcmpl' if self.spec.chat else 'cmpl'}-{record.request_id}",
                             "created": int(time.time())}
        if not self.spec.stream:
            usage = self._usage()
            answer = full_response(chunk_base(base["id"], base["created"], self.spec.model, self.spec.chat),
                                   self.spec.chat, "".join(self.texts), self.finish_reason, self.stop_reason,
                                   usage, list(record.output_token_ids) if self.spec.wants_token_ids else None,
                                   self.prompt_token_ids if self.spec.wants_token_ids else None)
            if not self.spec.wants_token_ids:
                _strip_token_ids(answer)
            self.delivered = True
            await self.exchange.respond(200, msgspec.json.encode(answer), self.reply_headers)
            return
        tail = DONE_EVENT
        if self.resumed and self.spec.wants_usage:
            chunk = usage_chunk(chunk_base(base["id"], base["created"], self.spec.model, self.spec.chat),
                                self._usage())
            tail = event(chunk) + DONE_EVENT
        await self.exchange.close_stream(tail)
        self.delivered = True

    async def fail_in_band(self, status: int, message: str) -> None:
        """Headers went out, and the answer cannot be finished: say so in the stream, as vLLM does."""
        await self.exchange.close_stream(event(error_body(message, "upstream_error", None, status)) + DONE_EVENT)


def _passes_as_is(event: bytes) -> bool:
    """A stream's first event that the client may get before it is decoded: one data line of one
    JSON object, with no member that _on_chunks would act on before relaying it (an in-band error,
    usage, a decode leg's KV stats: any spelling of those keys sends it the decoded way). The
    first event of an answer needs nothing else: no role chunk was sent yet, nothing echoed. It
    must hold a choice, spelt compactly (an event with none, and no usage, is not relayed)."""
    return (event.startswith(b"data: {") and event.endswith(b"}") and event.find(b"\n") < 0
            and event.find(b'"choices":[{') >= 0 and event.find(b'"error"') < 0 and event.find(b'"usage"') < 0 and event.find(b'"kv_transfer_stats"') < 0)


class InBandError(Exception):
    """The replica reported an error inside its stream (after its 200), or sent one it cannot read."""


def _take_prompt_ids(record: RequestRecord, ids: list[int]) -> list[int]:
    """The replica's prompt IDs are the truth for the record (the gateway's are for routing)."""
    ids = list(ids)
    if record.prompt_token_ids is not None and ids != record.prompt_token_ids:
        log.warning("prompt_ids_mismatch", request_id=record.request_id,
                    gateway_tokens=len(record.prompt_token_ids), replica_tokens=len(ids))
    record.prompt_token_ids = ids
    return ids


def _take_usage(record: RequestRecord, usage, keep_counts: bool) -> None:
    """The replica's usage: cached tokens from the first try; counts only while nothing resumed
    (a continuation's own usage counts its prompt as prompt tokens)."""
    if not keep_counts and usage.prompt_tokens is not None:
        record.prompt_tokens = usage.prompt_tokens
    details = usage.prompt_tokens_details
    if details is not None and details.cached_tokens is not None and record.cached_tokens is None:
        record.cached_tokens = details.cached_tokens


def _strip_token_ids(obj: dict) -> None:
    obj.pop("prompt_token_ids", None)
    for choice in obj.get("choices") or []:
        if isinstance(choice, dict):
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
