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
from dataclasses import dataclass

import msgspec
import structlog
from aiohttp import web

from observability.request_log import RequestRecord
from protocol.responses import chunk_base, full_response, text_chunk, usage_chunk, usage_of
from protocol.sse import DONE_EVENT, data_of, event
from tokenization import IncrementalDetokenizer, TokenizerBundle
from tokenization.stop_strings import find_stop_string, held_back_chars

_decode_json = msgspec.json.Decoder().decode
log = structlog.get_logger("kvgate.proxy")


@dataclass
class AnswerSpec:
    """What the client asked for, as far as shaping the answer goes."""
    chat: bool
    stream: bool
    model: str
    wants_token_ids: bool
    wants_usage: bool
    stops: list[str]
    skip_special_tokens: bool
    echo_chars: int = 0   # completions with echo: the prompt text that leads the first chunk


class Answer:
    def __init__(self, spec: AnswerSpec, record: RequestRecord, reply_headers: dict) -> None:
        self.spec = spec
        self.record = record
        self.reply_headers = reply_headers
        self.response: web.StreamResponse | None = None  # the client's SSE response, once prepared
        self.texts: list[str] = []      # output text so far (collect mode, and for the seam)
        self.emitted_chars = 0          # output characters the client has or the answer holds
        self.opening_sent = False       # a chat stream's role chunk went out
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.base: dict | None = None   # id/object/created/model of the first chunk seen
        self.prompt_token_ids: list[int] | None = None
        self.delivered = False          # [DONE] (or the whole JSON answer) went out
        self._echo_left = spec.echo_chars
        self.kv_stats: dict | None = None  # a P/D decode leg's kv_transfer_stats (bytes pulled, seconds)
        self._detok: IncrementalDetokenizer | None = None  # resumed mode
        self._resume_text = ""          # the detokenizer's text beyond what was emitted before the seam

    @property
    def complete(self) -> bool:
        return self.finish_reason is not None

    @property
    def resumed(self) -> bool:
        return self._detok is not None

    # ---- the client's stream -------------------------------------------------------------------
    async def open_stream(self, request: web.Request) -> None:
        """Prepare the client's SSE response (once, when the first try answers 200)."""
        if self.response is not None or not self.spec.stream:
            return
        response = web.StreamResponse(status=200, headers={
            **self.reply_headers, "content-type": "text/event-stream", "cache-control": "no-cache"})
        await response.prepare(request)
        self.response = response

    async def _write(self, data: bytes) -> None:
        if self.response is not None:
            try:
                await self.response.write(data)
            except ConnectionResetError:  # aiohttp's is also a ClientError: keep it apart from upstream's
                raise ClientGone(self.response) from None

    # ---- one upstream event --------------------------------------------------------------------
    async def on_event(self, raw_event: bytes) -> None:
        data = data_of(raw_event)
        if data is None or data == b"[DONE]":
            return  # the gateway writes its own [DONE] when the answer is complete
        chunk = _decode_json(data)  # small objects: microseconds with msgspec
        if not isinstance(chunk, dict):
            return
        record = self.record
        if "error" in chunk:
            error = chunk["error"]
            record.error = error.get("message") if isinstance(error, dict) else str(error)
            raise InBandError(record.error)
        stats = chunk.pop("kv_transfer_stats", None)  # a decode leg's, for the record; not the client's
        if stats is not None:
            self.kv_stats = stats if isinstance(stats, dict) else None
            raw_event = b"data: " + msgspec.json.encode(chunk)
        if self.base is None and "id" in chunk:
            self.base = {key: chunk.get(key) for key in ("id", "object", "created", "model")}
        choices = chunk.get("choices") or []
        usage = chunk.get("usage")
        if usage:
            _take_usage(record, usage, keep_counts=self.resumed)
        ids = chunk.get("prompt_token_ids") or (choices[0].get("prompt_token_ids") if choices else None)
        if ids and self.prompt_token_ids is None:
            self.prompt_token_ids = _take_prompt_ids(record, ids)
        if not choices:
            if usage and not self.resumed and self.spec.stream and self.spec.wants_usage:
                await self._write(raw_event + b"\n\n")  # the client asked for the usage chunk
            return
        choice = choices[0]
        token_ids = choice.get("token_ids") or []
        if self.resumed:
            await self._on_resumed_tokens(token_ids, choice)
            return
        record.tokens_arrived(token_ids, time.perf_counter())
        text = _text_of(choice, self.spec.chat)
        if "role" in (choice.get("delta") or {}):
            if self.opening_sent:
                return  # a retried try's role chunk: the client has one already
            self.opening_sent = True
        if self._echo_left and text:
            echoed = min(self._echo_left, len(text))
            self._echo_left -= echoed
            output_text = text[echoed:]
        else:
            output_text = text
        if output_text:
            self.texts.append(output_text)
            self.emitted_chars += len(output_text)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")
            record.finish_reason = self.finish_reason
        if not self.spec.stream:
            return
        if self.spec.wants_token_ids and (self.spec.wants_usage or not usage):
            await self._write(raw_event + b"\n\n")
            return
        _strip_token_ids(chunk)
        if not self.spec.wants_usage:
            chunk.pop("usage", None)
        await self._write(event(chunk))

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

    async def _on_resumed_tokens(self, token_ids: list[int], choice: dict) -> None:
        if self.complete:
            return
        record, detok, stops = self.record, self._detok, self.spec.stops
        record.tokens_arrived(token_ids, time.perf_counter())
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
        elif choice.get("finish_reason"):
            finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
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
            await self._write(event(text_chunk(base, self.spec.chat, delta, finish, stop_reason,
                                               token_ids if self.spec.wants_token_ids else None)))

    # ---- the end ---------------------------------------------------------------------------------
    def _usage(self) -> dict:
        record = self.record
        prompt_tokens = len(self.prompt_token_ids or record.prompt_token_ids or [])
        return usage_of(prompt_tokens, len(record.output_token_ids), record.cached_tokens)

    async def finish(self) -> web.StreamResponse | web.Response:
        """The answer is complete: close the stream (usage chunk, [DONE]) or build the JSON."""
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
            return web.Response(body=msgspec.json.encode(answer), content_type="application/json",
                                headers=self.reply_headers)
        if self.resumed and self.spec.wants_usage:
            chunk = usage_chunk(chunk_base(base["id"], base["created"], self.spec.model, self.spec.chat),
                                self._usage())
            await self._write(event(chunk))
        await self._write(DONE_EVENT)
        self.delivered = True
        try:
            await self.response.write_eof()
        except ConnectionResetError:
            pass  # a client that hangs up right after [DONE] (the OpenAI SDK does) got everything
        return self.response

    async def fail_in_band(self, status: int, message: str) -> web.StreamResponse:
        """Headers went out, and the answer cannot be finished: say so in the stream, as vLLM does."""
        from protocol.errors import error_body
        await self._write(event(error_body(message, "upstream_error", None, status)))
        await self._write(DONE_EVENT)
        try:
            await self.response.write_eof()
        except ConnectionResetError:
            pass
        return self.response


class InBandError(Exception):
    """The replica reported an error inside its stream (after its 200)."""


class ClientGone(Exception):
    """Writing to the client failed: it hung up. Carries its (prepared) response."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


def _take_prompt_ids(record: RequestRecord, ids: list[int]) -> list[int]:
    """The replica's prompt IDs are the truth for the record (the gateway's are for routing)."""
    ids = list(ids)
    if record.prompt_token_ids is not None and ids != record.prompt_token_ids:
        log.warning("prompt_ids_mismatch", request_id=record.request_id,
                    gateway_tokens=len(record.prompt_token_ids), replica_tokens=len(ids))
    record.prompt_token_ids = ids
    return ids


def _text_of(choice: dict, chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _take_usage(record: RequestRecord, usage, keep_counts: bool) -> None:
    """The replica's usage: cached tokens from the first try; counts only while nothing resumed
    (a continuation's own usage counts its prompt as prompt tokens)."""
    if not isinstance(usage, dict):
        return
    if not keep_counts:
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None and record.cached_tokens is None:
        record.cached_tokens = details["cached_tokens"]


def _strip_token_ids(obj: dict) -> None:
    obj.pop("prompt_token_ids", None)
    for choice in obj.get("choices") or []:
        if isinstance(choice, dict):
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
