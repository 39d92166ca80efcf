"""The request path: validate, tokenize, route, forward, relay, record.

The client's JSON object is forwarded as sent (fields the gateway does not know still reach the
replica) plus `return_token_ids` (and usage for streams), so the gateway learns the token IDs
without tokenizing the output. Streams are relayed event by event, never buffered."""
from __future__ import annotations

import asyncio
import socket
import time
import uuid
from typing import Callable

import aiohttp
import msgspec
import structlog
from aiohttp import web

from gateway.prompts import prompt_token_ids
from gateway.router import RoutedAttempt, Router
from gateway.upstream import ReplicaPool, ReplicaState
from observability.metrics import GatewayMetrics
from observability.request_log import RequestLog, RequestRecord
from protocol.errors import (APIError, BadRequest, InternalError, ModelNotFound, Unavailable,
                             UpstreamError, error_body, from_decode_error, normalize_upstream_error)
from protocol.http import error_response
from protocol.requests import AnyRequest, decode_chat, decode_completion, fit_max_tokens, requested_max_tokens
from protocol.sse import DONE_EVENT, EventSplitter, data_of, event

log = structlog.get_logger("kvgate.proxy")
_decode_json = msgspec.json.Decoder().decode
_encode_json = msgspec.json.Encoder().encode

# Connection-level failures that prove the replica never produced an answer: safe to retry.
_RETRYABLE = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError,
              aiohttp.ClientOSError)


class Proxy:
    def __init__(self, pool: ReplicaPool, router: Router, metrics: GatewayMetrics,
                 request_log: RequestLog) -> None:
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.request_log = request_log

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/completions", decode_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/chat/completions", decode_chat)

    # ---- one request, one record ----------------------------------------------------------------

    async def _handle(self, request: web.Request, endpoint: str,
                      decode: Callable[[bytes], AnyRequest]) -> web.StreamResponse:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        record = RequestRecord(request_id, endpoint)
        reply_headers = {"x-request-id": request_id}
        try:
            try:
                return await self._serve(request, record, decode, reply_headers)
            except msgspec.DecodeError as exc:
                raise from_decode_error(exc) from None
        except APIError as err:
            record.fail(err.status, err.message)
            response = error_response(err)
            response.headers.update(reply_headers)
            return response
        except asyncio.CancelledError:
            record.fail(499, "client_disconnected")
            raise
        except web.HTTPException as exc:  # e.g. 413 from the body size limit; the middleware renders it
            record.fail(exc.status, exc.reason)
            raise
        except Exception as exc:
            log.exception("proxy_error", request_id=request_id)
            record.fail(500, f"{type(exc).__name__}: {exc}")
            response = error_response(InternalError(f"Internal error: {type(exc).__name__}: {exc}"))
            response.headers.update(reply_headers)
            return response
        finally:
            self.request_log.emit(record)
            self.metrics.observe_request(
                replica=record.replica, status=record.status, ttft_s=record.ttft_s, itl_s=record.itl_s,
                e2e_s=record.e2e_s, prompt_tokens=record.prompt_tokens,
                completion_tokens=record.completion_tokens)

    async def _serve(self, request: web.Request, record: RequestRecord, decode,
                     reply_headers: dict) -> web.StreamResponse:
        body = await request.read()
        parsed = decode(body)
        raw = _decode_json(body)  # decode() proved it is a JSON object
        record.stream = parsed.stream
        record.model = parsed.model
        model = self._resolve_model(parsed.model)
        record.model = model
        candidates = self.pool.candidates(model)
        if not candidates:
            raise Unavailable(f"No replica serving `{model}` is ready yet.", retry_after_s=1)

        prompt_ids = await prompt_token_ids(parsed, candidates[0].tokenizer)
        record.prompt_token_ids = prompt_ids
        record.prompt_tokens = len(prompt_ids)
        self._check_context(parsed, prompt_ids, candidates)

        wants_token_ids = bool(parsed.return_token_ids)
        wants_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        raw["return_token_ids"] = True
        raw["model"] = model
        if parsed.stream:
            raw["stream_options"] = {**(raw.get("stream_options") or {}), "include_usage": True}
        payload = _encode_json(raw)
        upstream_headers = {"content-type": "application/json", "x-request-id": record.request_id}
        router = self.router
        hashes = router.hashes(prompt_ids, parsed.cache_salt)  # once; a retry reuses them
        session_key = router.session_key(request.headers, parsed.user)
        new_tokens = requested_max_tokens(parsed)[0]

        failures: list[str] = []
        for _try in range(2):  # the first choice, then once more on another replica
            pool = [c.name for c in self.pool.candidates(model) if c.name not in failures]
            if not pool:
                break
            with router.attempt(pool, model, prompt_ids, hashes, session_key, parsed.cache_salt,
                                new_tokens) as attempt:
                replica = self.pool.by_name[attempt.replica]
                record.replica = replica.name
                record.routing = attempt.log
                if failures:
                    record.routing["retried_after"] = list(failures)
                try:
                    upstream = await self.pool.session.post(
                        replica.base_url + record.endpoint, data=payload, headers=upstream_headers)
                except _RETRYABLE as exc:
                    self.pool.mark_down(replica, f"{type(exc).__name__}: {exc}")
                    failures.append(replica.name)
                    continue
                except asyncio.TimeoutError:
                    raise UpstreamError(f"Replica {replica.name} did not answer within the timeout.",
                                        status=504, code="upstream_timeout") from None
                try:
                    if parsed.stream:
                        return await self._relay_stream(request, upstream, record, reply_headers,
                                                        wants_token_ids, wants_usage, attempt)
                    response = await self._relay_json(upstream, record, reply_headers, wants_token_ids)
                    attempt.first_token()  # the whole answer: it was prefilled
                    return response
                finally:
                    attempt.cached_tokens = record.cached_tokens
        if failures:
            raise UpstreamError(f"Replica(s) unreachable: {', '.join(failures)}.", code="upstream_unreachable")
        raise Unavailable(f"No replica serving `{model}` is ready.", retry_after_s=1)

    def _resolve_model(self, requested: str | None) -> str:
        known = self.pool.known_models()
        if requested is None:
            served = list(dict.fromkeys(spec.model for spec in self.pool.config.replicas))
            if len(served) == 1:
                return served[0]
            raise BadRequest(f"`model` is required (available: {', '.join(known)}).", param="model")
        if requested not in known:
            raise ModelNotFound(requested, known)
        return requested

    @staticmethod
    def _check_context(parsed: AnyRequest, prompt_ids: list[int], candidates: list[ReplicaState]) -> None:
        """vLLM's context rule against the smallest context among the candidates, before routing:
        a request no replica could serve gets vLLM's 400 here, not after a round trip."""
        lengths = [c.max_model_len for c in candidates if c.max_model_len]
        if lengths:
            fit_max_tokens(parsed, len(prompt_ids), min(lengths), None)

    # ---- relaying ---------------------------------------------------------------------------------

    async def _upstream_error(self, upstream: aiohttp.ClientResponse) -> APIError:
        try:
            body = await upstream.read()
        finally:
            upstream.release()
        try:
            payload = _decode_json(body)
        except msgspec.DecodeError:
            payload = body
        error = normalize_upstream_error(upstream.status, payload)
        retry_after = upstream.headers.get("Retry-After", "")
        if retry_after.isdigit():  # a replica's overload advice reaches the client (429/503)
            error.retry_after_s = float(retry_after)
        return error

    async def _relay_json(self, upstream: aiohttp.ClientResponse, record: RequestRecord,
                          reply_headers: dict, wants_token_ids: bool) -> web.Response:
        if upstream.status >= 400:
            raise await self._upstream_error(upstream)
        try:
            body = await upstream.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            upstream.close()
            self.pool.mark_down_named(record.replica, f"{type(exc).__name__}: {exc}")
            raise UpstreamError(f"Replica {record.replica} failed while answering: {type(exc).__name__}.",
                                code="upstream_disconnected") from None
        except BaseException:
            upstream.close()  # unread body: drop the connection so the replica sees us leave
            raise
        upstream.release()
        answer = _decode_json(body)
        choice = (answer.get("choices") or [{}])[0]
        record.output_token_ids = list(choice.get("token_ids") or [])
        record.finish_reason = choice.get("finish_reason")
        _take_prompt_ids(record, answer, choice)
        _take_usage(record, answer.get("usage"))
        if not wants_token_ids:
            _strip_token_ids(answer)
            body = _encode_json(answer)
        record.status = upstream.status
        return web.Response(body=body, status=upstream.status, content_type="application/json",
                            headers=reply_headers)

    async def _relay_stream(self, request: web.Request, upstream: aiohttp.ClientResponse,
                            record: RequestRecord, reply_headers: dict, wants_token_ids: bool,
                            wants_usage: bool, attempt: RoutedAttempt) -> web.StreamResponse:
        if upstream.status >= 400:
            raise await self._upstream_error(upstream)
        response = web.StreamResponse(status=200, headers={
            **reply_headers, "content-type": "text/event-stream", "cache-control": "no-cache"})
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each event leaves at once
        finished = False   # the replica's stream was read to its end
        delivered = False  # [DONE] went out: the client has the whole answer
        try:
            await response.prepare(request)
            splitter = EventSplitter()
            try:
                async for chunk in upstream.content.iter_any():
                    for raw_event in splitter.feed(chunk):
                        delivered = await self._relay_event(response, raw_event, record, wants_token_ids,
                                                            wants_usage) or delivered
                    if record.first_token_s is not None and not attempt.started_decoding:
                        attempt.first_token()  # prefilled: the load tracker now counts it decoding
                for raw_event in splitter.flush():
                    delivered = await self._relay_event(response, raw_event, record, wants_token_ids,
                                                        wants_usage) or delivered
                finished = True
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                    asyncio.TimeoutError) as exc:
                # The replica went away mid-stream; the client already has a 200, so say it in-band.
                record.error = f"upstream_disconnected: {type(exc).__name__}: {exc}"
                self.pool.mark_down(self.pool.by_name[record.replica], record.error)
                await response.write(event(error_body("The replica serving this request failed "
                                                       "mid-stream.", "upstream_error", None, 502)))
                await response.write(DONE_EVENT)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError) as exc:  # ConnectionReset: on write
            # A client that hangs up right after [DONE] (the OpenAI SDK does) got everything.
            if not delivered:
                record.fail(499, "client_disconnected")
                if isinstance(exc, asyncio.CancelledError):
                    raise
        finally:
            if finished:
                upstream.release()
            else:
                upstream.close()  # the replica sees the connection drop and aborts the request
        if record.completion_tokens is None:
            record.completion_tokens = len(record.output_token_ids)
        return response

    async def _relay_event(self, response: web.StreamResponse, raw_event: bytes, record: RequestRecord,
                           wants_token_ids: bool, wants_usage: bool) -> bool:
        """Send one event on (if the client should see it); True when it was the closing [DONE]."""
        out = self._on_event(raw_event, record, wants_token_ids, wants_usage)
        if out is None:
            return False
        await response.write(out)
        return out == DONE_EVENT

    def _on_event(self, raw_event: bytes, record: RequestRecord, wants_token_ids: bool,
                  wants_usage: bool) -> bytes | None:
        """Collect what the record needs from one SSE event; return the bytes to send (or None)."""
        data = data_of(raw_event)
        if data is None or data == b"[DONE]":
            return raw_event + b"\n\n"
        chunk = _decode_json(data)  # small objects: microseconds with msgspec
        if not isinstance(chunk, dict):
            return raw_event + b"\n\n"
        if "error" in chunk and record.error is None:
            error = chunk["error"]
            record.error = error.get("message") if isinstance(error, dict) else str(error)
        choices = chunk.get("choices") or []
        if choices:
            choice = choices[0]
            record.tokens_arrived(choice.get("token_ids") or [], time.perf_counter())
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
            _take_prompt_ids(record, chunk, choice)
        elif "prompt_token_ids" in chunk:
            _take_prompt_ids(record, chunk, {})
        usage = chunk.get("usage")
        if usage:
            _take_usage(record, usage)
            if not choices and not wants_usage:
                return None  # the usage-only chunk we asked for, not the client
        if wants_token_ids and (wants_usage or not usage):
            return raw_event + b"\n\n"
        _strip_token_ids(chunk)
        if not wants_usage:
            chunk.pop("usage", None)
        return event(chunk)


def _take_prompt_ids(record: RequestRecord, obj: dict, choice: dict) -> None:
    """The replica's prompt IDs are the truth for the record (the gateway's are for routing)."""
    ids = obj.get("prompt_token_ids") or choice.get("prompt_token_ids")
    if ids:
        if record.prompt_token_ids is not None and list(ids) != record.prompt_token_ids:
            log.warning("prompt_ids_mismatch", request_id=record.request_id,
                        gateway_tokens=len(record.prompt_token_ids), replica_tokens=len(ids))
        record.prompt_token_ids = list(ids)


def _take_usage(record: RequestRecord, usage) -> None:
    if not isinstance(usage, dict):
        return
    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
    record.completion_tokens = usage.get("completion_tokens", record.completion_tokens)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        record.cached_tokens = details["cached_tokens"]


def _strip_token_ids(obj: dict) -> None:
    obj.pop("prompt_token_ids", None)
    for choice in obj.get("choices") or []:
        if isinstance(choice, dict):
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
