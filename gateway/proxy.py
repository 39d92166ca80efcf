"""The request path: validate, tokenize, admit, route, forward, relay, record; and when a replica
fails, try again elsewhere without the client noticing.

The client's JSON object is forwarded as sent (fields the gateway does not know still reach the
replica) plus `return_token_ids` and a streamed answer with usage (gateway/answer.py says why and
how it reaches the client). Each try is one `router.attempt(...)`:

  before its first token   connect error, timeout, a 5xx/429/503, a dropped connection: tried
                           again on the next-best replica (bounded attempts, under a retry budget)
  after k tokens           the replica died or stalled (no event for inter_token_timeout_s):
                           resumed on another replica from the k tokens (gateway/resume.py),
                           into the same client stream
  a 4xx                    the client's mistake: passed through unchanged

A request that waits for a replica with room waits in a bounded queue (429 past it, or past
queue_timeout_s); no healthy replica at all is a 503. Every request ends in exactly one record
with its real outcome, also when its 200 had already gone out."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Sequence

import msgspec
import structlog
from aiohttp import web

from gateway.answer import Answer, AnswerSpec, InBandError
from gateway.exchange import AiohttpExchange, ClientGone, Exchange
from gateway.http_client import ConnectFailed, HttpClientError, Response
from gateway.limits import new_request_id
from gateway.prompts import prompt_ids_now, prompt_token_ids
from gateway.resume import continuation_body, effective_max_tokens
from gateway.retry_budget import RetryBudget
from gateway.router import RoutedAttempt, Router
from gateway.pd import PDState, PrefillDecode, is_pd_error
from gateway.upstream import ReplicaPool, ReplicaState
from observability.metrics import GatewayMetrics
from observability.request_log import RequestLog, RequestRecord, ms
from protocol.errors import (APIError, BadRequest, InternalError, ModelNotFound, Overloaded, Unavailable,
                             UpstreamError, error_body, from_decode_error, normalize_upstream_error)
from protocol.requests import (UNHONOURED_NAMES, AnyRequest, ChatCompletionRequest, check_honoured, decode_chat,
                               decode_completion, fit_max_tokens, requested_max_tokens, stop_strings)
from protocol.sse import DONE_EVENT, EventSplitter, event
from protocol.stream_chunks import decode_answer, strip_prompt_token_ids, strip_token_ids


log = structlog.get_logger("kvgate.proxy")
_decode_json = msgspec.json.Decoder().decode
_encode_json = msgspec.json.Encoder().encode

# Statuses that say "this replica, now" rather than "this request": tried elsewhere.
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class TryFailed(Exception):
    """One try ended without a complete answer, for a reason that is the replica's, not the client's."""

    def __init__(self, reason: str, error: APIError, fatal: bool = False,
                 counts_against_replica: bool = True, kv_transfer: bool = False) -> None:
        super().__init__(reason)
        self.kv_transfer = kv_transfer  # a P/D decode leg could not get its KV: redo the prefill leg
        self.reason = reason
        self.error = error   # what the client gets if no other try succeeds
        self.fatal = fatal   # the replica is certainly gone (connection refused): eject it now
        self.counts_against_replica = counts_against_replica  # False: it is busy, not broken


class _Plan(msgspec.Struct, eq=False):
    """Everything about one request that every try of it reuses (a Struct: filled in C)."""
    parsed: AnyRequest
    _raw: dict | None      # None: `payload` is the client's body with return_token_ids spliced in
    _body: bytes
    model: str
    prompt_ids: list[int]
    _router: Router
    session_key: Any
    streamed_upstream: bool  # the replica streams (unless the answer has fields we cannot collect)
    payload: bytes
    deadline: float          # loop time by which the whole request is over
    pd: PDState | None       # set when the model is served by prefill/decode pools
    ttft_timeout_s: float
    inter_token_timeout_s: float
    max_new_tokens: int | None  # what the client asked for (requested_max_tokens)
    _hashes: Any = None

    @property
    def raw(self) -> dict:
        """The replica's copy of the request as a dict (a P/D leg and a resumed stream build their
        bodies from it), decoded from the client's body when its payload was spliced."""
        if self._raw is None:  # the splice's changes (see _with_token_ids)
            raw = self._raw = _decode_json(self._body)
            raw["return_token_ids"] = True
            if self.streamed_upstream:  # a streamed request whose body named no stream_options
                raw["stream_options"] = {"include_usage": True}
        return self._raw

    def hashes(self) -> Sequence[int]:
        """The prompt's block hashes for a try's routing: computed on the first try that needs them
        and reused by the others; () while the policy does not read prefixes (round robin, least
        load: not worth ~10 us a request)."""
        router = self._router
        if not router.reads_prefixes:
            return ()
        if self._hashes is None:
            self._hashes = router.hashes(self.prompt_ids, self.parsed.cache_salt)
        return self._hashes


class Proxy:
    def __init__(self, pool: ReplicaPool, router: Router, metrics: GatewayMetrics,
                 request_log: RequestLog) -> None:
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.request_log = request_log
        gateway = pool.config.gateway
        self.budget = RetryBudget(gateway.retry_budget, gateway.retry_budget_min)
        self.pd = PrefillDecode(pool, router, metrics)
        for role in ("prefill", "decode", "mixed"):  # queue depth per pool, read when /metrics is scraped
            metrics.pool_in_flight.labels(pool=role).set_function(lambda role=role: self._pool_in_flight(role))
        metrics.in_flight.source = self._replica_in_flight
        self.active = 0            # requests being handled (drain waits for 0)
        # The serving loop, set on startup (before any request): CPython 3.11's get_running_loop()
        # makes a getpid() system call each time, ~4 a streamed request.
        self.loop: asyncio.AbstractEventLoop | None = None
        self._context_of: tuple = (None, 0)  # (candidates tuple, its smallest max_model_len): _check_context
        self._queued = 0           # requests waiting for a replica with room
        self._room = asyncio.Event()  # replaced each time a try ends: waiters re-check

    async def start(self, app: web.Application | None = None) -> None:
        self.loop = self.router.loop = asyncio.get_running_loop()
        self.request_log.bind(self.loop)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._aiohttp(request, "/v1/completions", decode_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._aiohttp(request, "/v1/chat/completions", decode_chat)

    async def _aiohttp(self, request: web.Request, endpoint: str, decode) -> web.StreamResponse:
        """The routes on aiohttp's own connections (gateway/hot_path.py serves the others)."""
        exchange = AiohttpExchange(request, request.headers.get("x-request-id") or new_request_id())
        await self.handle(exchange, endpoint, decode)
        return exchange.response

    # ---- one request, one record ----------------------------------------------------------------

    async def handle(self, exchange: Exchange, endpoint: str, decode: Callable[[bytes], AnyRequest]) -> None:
        """Serve one request into `exchange`; emits its one record whatever happens, and settles
        the grant's tokens/min charge. One coroutine down to the tries: the steps before them are
        plain calls (a coroutine layer is ~2 us a request at this rate: bench/README)."""
        request_id = exchange.request_id
        record = RequestRecord(request_id, endpoint, exchange.arrived_s)
        reply_headers = {"x-request-id": request_id}
        self.active += 1
        try:
            try:
                body = exchange.body_bytes  # the hot path's, read already (None: aiohttp's request reads it)
                if body is None:
                    body = await exchange.body()
                parsed, candidates = self._parse(record, body, decode)
                bundle = candidates[0].tokenizer
                prompt_ids, pending = prompt_ids_now(parsed, bundle)
                if prompt_ids is None:  # much new text: tokenized after a few loop turns, or off the loop
                    prompt_ids = await prompt_token_ids(parsed, bundle, pending)
                plan, answer = self._plan(exchange, record, parsed, body, candidates, prompt_ids, reply_headers)
                await self._tries(exchange, record, plan, answer, reply_headers)
            except msgspec.DecodeError as exc:
                raise from_decode_error(exc) from None
        except APIError as err:
            record.fail(err.status, err.message)
            await self._refuse(exchange, err, reply_headers, record)
        except asyncio.CancelledError:
            record.fail(499, "client_disconnected")
            raise
        except ClientGone:  # it hung up while we wrote its stream: nothing more to send
            record.fail(499, "client_disconnected")
        except web.HTTPException as exc:  # e.g. 413 from the body size limit; the middleware renders it
            record.fail(exc.status, exc.reason)
            raise
        except Exception as exc:
            log.exception("proxy_error", request_id=request_id)
            record.fail(500, f"{type(exc).__name__}: {exc}")
            await self._refuse(exchange, InternalError(f"Internal error: {type(exc).__name__}: {exc}"),
                               reply_headers, record)
        finally:
            self.active -= 1
            exchange.grant.settle()
            self.request_log.emit(record)  # its metrics too (RequestLog.observe)

    @staticmethod
    async def _refuse(exchange: Exchange, err: APIError, headers: dict, record: RequestRecord) -> None:
        if not exchange.streaming:
            await exchange.respond_error(err, headers)
            return
        record.failed_after_headers = True  # its 200 is out: the error goes in-band, as vLLM does
        try:
            await exchange.close_stream(event(error_body(err.message, err.type, err.param, err.code)) + DONE_EVENT)
        except ClientGone:
            pass

    def _parse(self, record: RequestRecord, body: bytes, decode) -> tuple[AnyRequest, tuple[ReplicaState, ...]]:
        """The decoded request and its model's candidate replicas (the record learns the model)."""
        parsed = decode(body)  # proves the body is a JSON object
        record.stream = parsed.stream
        model = parsed.model
        # A model with candidates is served (the usual case: the pool's cached tuple); otherwise
        # which model is meant, or why none, is _resolve_model's to say.
        candidates = self.pool.candidates(model) if model is not None else ()
        if not candidates:
            model = self._resolve_model(model)
            candidates = self.pool.candidates(model)
            if not candidates:
                record.model = model
                raise Unavailable(f"No healthy replica serving `{model}`.", retry_after_s=1)
        record.model = model
        if self.pool.panicking and model in self.pool.panicking:
            record.panic_routing = True
            self.metrics.panic_routed.labels(model=model).inc()
        return parsed, candidates

    def _plan(self, exchange: Exchange, record: RequestRecord, parsed: AnyRequest, body: bytes,
              candidates: tuple[ReplicaState, ...], prompt_ids: list[int], reply_headers: dict) -> tuple:
        """(the request's _Plan, its Answer): what every try reuses, once the prompt's IDs are known.
        No Answer (None) for a non-streamed request whose replica's answer passes through as it is."""
        model = record.model
        record.prompt_token_ids = prompt_ids
        record.prompt_tokens = len(prompt_ids)
        # ---- auth hook (gateway/auth.py): the caller's key applies its model list, tenant cache_salt,
        # max_tokens cap, prompt limit and tokens/min, editing parsed/raw before routing hashes them.
        grant = exchange.grant
        raw = None if grant.key is None else _decode_json(body)  # the replica's copy, when a key edits it
        grant.admit(parsed, raw, record)
        chat = parsed.__class__ is ChatCompletionRequest
        self._check_context(parsed, prompt_ids, candidates)

        # A non-streaming client gets the replica's JSON answer passed through (a failure retries
        # from scratch). It is collected from a streamed upstream instead (a failure after k tokens
        # resumes from them) with gateway.resume_non_stream, and when the router wants it timed;
        # fields whose stream form we do not collect always pass through.
        gateway = self.pool.config.gateway
        router = self.router
        collectable = parsed.stream
        if not collectable and (gateway.resume_non_stream or router.times_non_stream(model)):
            raw = raw if raw is not None else _decode_json(body)
            collectable = _collectable(raw, body)
        # The replica's copy: the client's bytes with "return_token_ids": true (and, for a stream,
        # usage asked for) added when that is the only change (the usual request: no decode and
        # re-encode of a long prompt), else the edited dict.
        payload = None
        if raw is None and parsed.model == model and parsed.return_token_ids is None \
                and (not collectable or parsed.stream):
            payload = _with_token_ids(body, collectable)
        if payload is None:
            raw = raw if raw is not None else _decode_json(body)
            raw["return_token_ids"] = True
            raw["model"] = model
            if collectable:
                raw["stream"] = True
                raw["stream_options"] = {**(raw.get("stream_options") or {}), "include_usage": True}
            payload = _encode_json(raw)
        total_s, ttft_s, itl_s = gateway.timeouts(model)
        pd = self.pd.decode_pool(model)
        plan = _Plan(parsed, raw, body, model, prompt_ids, router,
                     router.session_key(exchange.headers, parsed.user), collectable, payload,
                     self.loop.time() + total_s, PDState() if pd else None, ttft_s, itl_s,
                     requested_max_tokens(parsed)[0])
        self.budget.on_request(time.monotonic())
        if not collectable and not pd:  # the replica's JSON passes through (_try_json): nothing to shape
            return plan, None
        echo_chars = 0
        if not chat and parsed.echo and isinstance(parsed.prompt, str):  # a chat request has no echo
            echo_chars = len(parsed.prompt)
        spec = AnswerSpec(chat, parsed.stream, model, bool(parsed.return_token_ids),
                          bool(parsed.stream_options and parsed.stream_options.include_usage),
                          [] if parsed.stop is None else stop_strings(parsed), parsed.skip_special_tokens is not False,
                          echo_chars)
        return plan, Answer(spec, record, reply_headers, exchange)

    # ---- tries ----------------------------------------------------------------------------------

    async def _tries(self, exchange: Exchange, record: RequestRecord, plan: _Plan, answer: Answer | None,
                     reply_headers: dict) -> None:
        max_attempts = self.pool.config.gateway.max_attempts
        failed: list[str] = []
        last: TryFailed | None = None
        failed_at = 0.0
        for number in range(1, max_attempts + 1):
            output_ids = record.output_token_ids
            resuming = bool(output_ids) and plan.streamed_upstream
            names = self._with_room(plan, failed)[0] or await self._admit(plan, failed, retry=number > 1)
            if resuming:
                prompt = answer.prompt_token_ids or plan.prompt_ids
                routed_ids = prompt + output_ids
                hashes = self.router.hashes(routed_ids, plan.parsed.cache_salt)
            else:
                routed_ids, hashes = plan.prompt_ids, plan.hashes()
            with self.router.attempt(names, plan.model, routed_ids, hashes, plan.session_key,
                                     plan.parsed.cache_salt, plan.max_new_tokens) as attempt:
                replica = self.pool.by_name[attempt.replica]
                record.replica = replica.name
                if record.routed_s is None:
                    record.routed_s = attempt.routed_s
                record.routing = attempt  # its explanation is built when the record is written
                if failed:
                    attempt.retried_after = list(failed)
                leg = None
                if resuming:
                    answer.start_resume(replica.tokenizer or self._any_tokenizer(plan.model))
                    endpoint, payload = "/v1/completions", self._continuation(plan, answer, replica)
                elif plan.pd is not None and replica.spec.role == "decode":
                    record.pd = plan.pd.record
                    matched = attempt.decision.matched_blocks.get(replica.name, 0)
                    leg = await self.pd.decode_leg(plan, record, replica, matched * self.router.state.block_size,
                                                   plan.pd)
                    endpoint, payload = record.endpoint, leg.payload
                else:
                    endpoint, payload = record.endpoint, plan.payload
                try:
                    if plan.streamed_upstream:
                        await self._try_stream(exchange, replica, endpoint, payload, plan, answer, attempt)
                        if not failed and record.first_token_s is not None:  # all of the answer came from this try
                            attempt.decode_sample = (len(record.output_token_ids) - 1,
                                                     record.last_token_s - record.first_token_s)
                    else:
                        return await self._try_json(exchange, replica, payload, plan, record, reply_headers, attempt)
                    self.pool.report(replica, ok=True)
                    if failed:
                        resume_s = (attempt.first_token_s or time.perf_counter()) - failed_at
                        record.failover[-1].update(resumed_on=replica.name, resume_ms=ms(resume_s))
                        self.metrics.resume_latency.observe(resume_s)
                    return await answer.finish()
                except TryFailed as failure:
                    failed_at = time.perf_counter()
                    if failure.kv_transfer and plan.pd is not None and plan.pd.record.get("prefill"):
                        plan.pd.prefill_failed.append(plan.pd.record["prefill"])  # next try: another prefill
                    if failure.counts_against_replica:
                        self.pool.report(replica, ok=False, reason=failure.reason, fatal=failure.fatal)
                    self.metrics.replica_counter(self.metrics.try_failures, replica.name).inc()
                    record.add_failover(replica.name, len(record.output_token_ids), failure.reason)
                    last = failure
                finally:
                    attempt.cached_tokens = record.cached_tokens
                    if self._queued:  # requests wait for room: they re-check
                        self._signal_room()
                    if leg is not None:
                        await leg.close(answered=answer.complete)
                    if answer is not None and answer.kv_stats:
                        self._take_kv_stats(record, answer)
            failed.append(replica.name)
            left = plan.deadline - self.loop.time()
            if number == max_attempts or left <= 0 or not self.budget.try_spend(time.monotonic()):
                break
            self.metrics.retries.labels(kind="resume" if record.output_token_ids else "retry").inc()
        await self._give_up(record, answer, last)

    def _take_kv_stats(self, record: RequestRecord, answer: Answer) -> None:
        stats = answer.kv_stats
        answer.kv_stats = None
        moved = stats.get("kv_transfer_bytes") or 0
        if record.pd is not None:
            record.pd.update(kv_bytes=moved, kv_seconds=stats.get("kv_transfer_seconds"),
                             kv_blocks_pulled=stats.get("blocks_pulled"), kv_blocks_local=stats.get("blocks_local"))
            if stats.get("recomputed"):
                record.pd.update(recomputed=True, kv_error=stats.get("error"))
        if moved:
            self.metrics.kv_transfer_bytes.inc(moved)
            self.metrics.kv_transfer_seconds.observe(stats.get("kv_transfer_seconds") or 0.0)

    async def _give_up(self, record: RequestRecord, answer: Answer | None, failure: TryFailed) -> None:
        error = failure.error
        record.fail(error.status, f"{failure.reason}; after {len(record.failover or [])} tries")
        if answer is None or not answer.response_started:
            raise error
        # The client has its 200 and part of the answer: say it in-band (as vLLM does); the
        # record keeps the real outcome.
        record.failed_after_headers = True
        await answer.fail_in_band(error.status, error.message)

    async def _admit(self, plan: _Plan, failed: list[str], retry: bool) -> list[str]:
        """Candidate replicas with room for one more request; waits in the bounded queue when all
        are full. A retry avoids the replicas that failed this request while others remain."""
        gateway = self.pool.config.gateway
        loop = self.loop
        queue_deadline = min(plan.deadline, loop.time() + gateway.queue_timeout_s)
        while True:
            names, ready = self._with_room(plan, failed)
            if names:
                return names
            if not ready and not retry:
                raise Unavailable(f"No healthy replica serving `{plan.model}`.", retry_after_s=1)
            if self._queued >= gateway.queue_size:
                raise Overloaded(f"All replicas are at max_in_flight_per_replica and the gateway queue is "
                                 f"full ({gateway.queue_size}); retry shortly.", retry_after_s=1)
            left = queue_deadline - loop.time()
            if left <= 0:
                if not ready:
                    raise Unavailable(f"No healthy replica serving `{plan.model}`.", retry_after_s=1)
                raise Overloaded(f"No replica had room within {gateway.queue_timeout_s:g} s; retry shortly.",
                                 retry_after_s=1)
            self._queued += 1
            self.metrics.queued.set(self._queued)
            try:
                await asyncio.wait_for(self._room.wait(), min(left, 0.5))  # also re-check health
            except asyncio.TimeoutError:
                pass
            finally:
                self._queued -= 1
                self.metrics.queued.set(self._queued)

    def _with_room(self, plan: _Plan, failed: list[str]) -> tuple:
        """(the candidates with room for one more request, the ready ones): _admit's check, which
        _tries makes first without a coroutine (the usual request has room at once)."""
        ready, ready_names = self.pool.main_pool(plan.model, plan.pd is not None)
        if failed:
            ready = [r for r in ready if r.name not in failed] or ready
            ready_names = [r.name for r in ready]
        limit = self.pool.config.gateway.max_in_flight_per_replica
        return self.router.state.tracker.with_room(ready_names, limit), ready

    def _replica_in_flight(self) -> list[tuple[str, int]]:
        tracker = self.router.state.tracker
        return [(r.name, tracker.own_in_flight(r.name)) for r in self.pool.replicas]

    def _pool_in_flight(self, role: str) -> int:
        tracker = self.router.state.tracker
        return sum(tracker.own_in_flight(r.name) for r in self.pool.replicas if r.spec.role == role)

    def _signal_room(self) -> None:
        """A try ended while requests are queued for room: they re-check."""
        room, self._room = self._room, asyncio.Event()
        room.set()

    @staticmethod
    def _continuation(plan: _Plan, answer: Answer, replica: ReplicaState) -> bytes:
        prompt = answer.prompt_token_ids or plan.prompt_ids
        done = answer.record.output_token_ids
        limit = effective_max_tokens(plan.parsed, len(prompt), replica.max_model_len, replica.default_max_tokens)
        return continuation_body(plan.raw, plan.model, prompt, done,
                                 None if limit is None else max(limit - len(done), 1))

    def _any_tokenizer(self, model: str):
        for replica in self.pool.replicas:
            if replica.tokenizer is not None and replica.serves(model):
                return replica.tokenizer
        raise Unavailable(f"No tokenizer for `{model}` to resume with.", retry_after_s=1)

    # ---- one try --------------------------------------------------------------------------------

    async def _try_stream(self, exchange: Exchange, replica: ReplicaState, endpoint: str, payload: bytes,
                          plan: _Plan, answer: Answer, attempt: RoutedAttempt) -> None:
        """Relay one streamed try into the answer; returns once the answer is complete, raises
        TryFailed when the replica cannot finish it.

        A silent stream is judged with the replica's other streams: if any of them moved within
        inter_token_timeout_s the replica is alive and busy (queued, preempted, a long prefill of
        someone else's), and this stream waits on (past ttft_timeout_s it moves to another
        replica, without counting against this one); if none did, the replica is stalled."""
        record = answer.record
        loop = self.loop
        first_deadline = min(plan.deadline, loop.time() + plan.ttft_timeout_s)
        upstream: Response | None = None
        finished = False
        try:
            upstream = await self._post(replica, endpoint, payload, record.request_id, first_deadline)
            if upstream.status != 200:
                raise await self._status_error(upstream, replica, first_deadline)
            replica.last_progress_s = loop.time()
            exchange.no_delay()
            await answer.open_stream(hold=upstream.body_at_hand)
            if exchange.pushes:
                await self._relay_pushed(exchange, replica, upstream, plan, answer, attempt, first_deadline)
            else:
                await self._relay_pulled(replica, upstream, plan, answer, attempt, first_deadline)
            finished = True
        except TimeoutError:  # the request itself (connect + headers) took past the first deadline
            if loop.time() >= plan.deadline:
                raise TryFailed("request_timeout", UpstreamError(
                    "The request did not finish within request_timeout_s.", status=504,
                    code="upstream_timeout")) from None
            raise TryFailed("no first token within ttft_timeout_s", UpstreamError(
                f"Replica {replica.name} did not answer in time.", status=504, code="upstream_timeout")) from None
        except InBandError as exc:
            raise TryFailed(f"replica error: {exc}", UpstreamError(str(exc), code="upstream_error")) from None
        except HttpClientError as exc:
            raise TryFailed(f"disconnected: {_reason(exc)}", UpstreamError(
                f"Replica {replica.name} failed mid-answer.", code="upstream_disconnected")) from None
        finally:
            if upstream is not None:
                if finished:
                    upstream.release()
                else:
                    upstream.close()  # the replica sees the connection drop and aborts the request
        if not answer.complete:
            raise TryFailed("stream ended without a finish_reason", UpstreamError(
                f"Replica {replica.name} ended the stream early.", code="upstream_disconnected"))

    async def _relay_pulled(self, replica: ReplicaState, upstream: Response, plan: _Plan, answer: Answer,
                            attempt: RoutedAttempt, first_deadline: float) -> None:
        """The stream read by this task, one wake-up per read (an exchange that writes with a wait)."""
        loop = self.loop
        itl_s = plan.inter_token_timeout_s
        record = answer.record
        splitter = EventSplitter()
        # Before the first token, wake every itl_s too: a replica that health checks took out
        # of rotation meanwhile (frozen, its engine dead) loses the request at once.
        wait_until = loop.time() + itl_s
        decoding = attempt.started_decoding  # this loop is what starts it (attempt.first_token)
        while True:
            deadline = min(plan.deadline, wait_until)
            try:
                # One wake-up per read from the replica, however many events it carries; the
                # deadline moves with each read once tokens flow (no timer per read).
                while data := await upstream.read_some(deadline):
                    now = replica.last_progress_s = loop.time()
                    events = splitter.feed(data)
                    if events:
                        await answer.on_events(events, last=upstream.complete)
                    if not decoding and record.first_token_s is not None:
                        attempt.first_token()  # prefilled: the load tracker now counts it decoding
                        decoding = True
                    if decoding:
                        deadline = min(plan.deadline, now + itl_s)
                break
            except TimeoutError:  # nothing was lost: what arrives stays for the next read
                wait_until = self._after_silence(replica, plan, attempt, first_deadline)
        rest = splitter.flush()
        if rest:
            await answer.on_events(rest)

    async def _relay_pushed(self, exchange: Exchange, replica: ReplicaState, upstream: Response, plan: _Plan,
                            answer: Answer, attempt: RoutedAttempt, first_deadline: float) -> None:
        """The stream relayed from the replica connection's data_received (_PushedRelay): each read
        goes to the client without waking this task, which waits for the end, a failure, the
        client's full buffer, or every itl_s for the stall checks (_after_silence)."""
        loop = self.loop
        itl_s = plan.inter_token_timeout_s
        relay = _PushedRelay(answer, attempt, replica, upstream, loop)
        upstream.push_to(relay.push)
        wait_until = loop.time() + itl_s
        while True:
            if relay.error is not None:
                raise relay.error
            if upstream.error is not None:
                raise upstream.error
            if relay.full:  # the client's buffer: reading from the replica waits with it
                relay.full = False
                await exchange.drain()
                upstream.resume_reading()
                continue
            if upstream.ended:
                break
            try:
                await upstream.wait(min(plan.deadline, wait_until))
            except TimeoutError:
                wait_until = self._after_silence(replica, plan, attempt, first_deadline)
        if relay.tail:  # the answer's last read, left to this task: its events go out with the stream's end
            events = relay.splitter.feed(relay.tail)
            if events:
                await answer.on_events(events, last=True)
            relay.started()
        rest = relay.splitter.flush()
        if rest:
            await answer.on_events(rest)

    @staticmethod
    def _after_silence(replica: ReplicaState, plan: _Plan, attempt: RoutedAttempt, first_deadline: float) -> float:
        """A stream's wait ran out: where the next one ends, or TryFailed (see _try_stream)."""
        now = asyncio.get_running_loop().time()
        itl_s = plan.inter_token_timeout_s
        if now >= plan.deadline:
            raise TryFailed("request_timeout", UpstreamError(
                "The request did not finish within request_timeout_s.", status=504,
                code="upstream_timeout")) from None
        alive = now - replica.last_progress_s < itl_s
        if not attempt.started_decoding and not alive and replica.health.state == "healthy" \
                and now < first_deadline:
            return min(now + itl_s, first_deadline)  # a long prefill, maybe: its probes say so
        if not alive:
            what = ("stalled" if attempt.started_decoding else "no first token within ttft_timeout_s"
                    if now >= first_deadline else f"no first token and {replica.health.state}")
            raise TryFailed(what, UpstreamError(f"Replica {replica.name} {what}.", status=504,
                                                code="upstream_timeout")) from None
        if not attempt.started_decoding and now >= first_deadline:
            raise TryFailed("slow: no first token within ttft_timeout_s", UpstreamError(
                f"Replica {replica.name} did not start the answer in time.", status=504,
                code="upstream_timeout"), counts_against_replica=False) from None
        return now + itl_s if attempt.started_decoding else min(now + itl_s, first_deadline)

    async def _post(self, replica: ReplicaState, endpoint: str, payload: bytes, request_id: str,
                    deadline: float) -> Response:
        """The replica's answer head; TryFailed ("connect: ...") when the request cannot get there."""
        try:
            return await self.pool.client.post(replica.origin, endpoint, payload, request_id, deadline)
        except HttpClientError as exc:
            raise _unreachable(replica, exc) from None

    async def _try_json(self, exchange: Exchange, replica: ReplicaState, payload: bytes, plan: _Plan,
                        record: RequestRecord, reply_headers: dict, attempt: RoutedAttempt) -> None:
        """A non-streamed answer passed through as is (without the token IDs the client did not ask
        for); a failure before all of it arrived is tried again from scratch."""
        upstream = None
        try:  # the client's post, not _post: one coroutine layer less on the usual request
            upstream = await self.pool.client.post(replica.origin, record.endpoint, payload, record.request_id,
                                                   plan.deadline)
            if upstream.status != 200:
                raise await self._status_error(upstream, replica, plan.deadline)
            body = upstream.body_now()
            if body is None:
                body = await upstream.read(plan.deadline)
        except TimeoutError:
            raise TryFailed("request_timeout", UpstreamError(
                "The request did not finish within request_timeout_s.", status=504, code="upstream_timeout")) from None
        except HttpClientError as exc:
            if upstream is None:  # the request did not get there
                raise _unreachable(replica, exc) from None
            raise TryFailed(f"disconnected: {_reason(exc)}", UpstreamError(
                f"Replica {replica.name} failed while answering.", code="upstream_disconnected"),
                fatal=isinstance(exc, ConnectFailed) and exc.refused) from None
        finally:
            if upstream is not None:
                upstream.release()
        wants_token_ids = bool(plan.parsed.return_token_ids)
        if not wants_token_ids:  # the prompt's IDs, echoed: cut before reading the rest (the record has ours)
            body = strip_prompt_token_ids(body)
        try:
            reply = decode_answer(body)
        except msgspec.DecodeError:
            raise TryFailed("unreadable answer", UpstreamError(
                f"Replica {replica.name} sent an answer that is not an OpenAI response.",
                code="upstream_error")) from None
        # The replica's bytes go through (fields the gateway does not know included), without the
        # token IDs the client did not ask for; the bookkeeping follows, off the client's wait
        # (and whatever became of the write: the record keeps what the replica answered).
        try:
            out = body if wants_token_ids else strip_token_ids(body)
            if not exchange.respond_now(200, out, reply_headers):
                await exchange.respond(200, out, reply_headers)
        finally:
            attempt.prefill_sample = False  # this "first token" is the whole answer, decode included
            attempt.first_token()
            self.pool.report(replica, ok=True)
            choice = reply.choices[0] if reply.choices else None
            record.output_token_ids = (choice.token_ids or []) if choice is not None else []  # the reply's own list
            record.finish_reason = choice.finish_reason if choice is not None else None
            record.completion_tokens = len(record.output_token_ids)
            details = reply.usage.prompt_tokens_details if reply.usage is not None else None
            record.cached_tokens = details.cached_tokens if details is not None else None

    async def _status_error(self, upstream: Response, replica: ReplicaState, deadline: float) -> Exception:
        """A replica's non-200: the client's error (4xx) to pass through, or TryFailed to try elsewhere."""
        try:
            body = await upstream.read(deadline)
        except HttpClientError:
            body = b""
        try:
            payload = _decode_json(body)
        except msgspec.DecodeError:
            payload = body
        error = normalize_upstream_error(upstream.status, payload)
        retry_after = upstream.headers.get("retry-after", "")
        if retry_after.isdigit():  # a replica's overload advice reaches the client (429/503)
            error.retry_after_s = float(retry_after)
        if is_pd_error(error.code):  # the KV pull of a decode leg: the prefill side's trouble
            return TryFailed(f"KV transfer: {error.code}: {error.message[:200]}", error,
                             counts_against_replica=False, kv_transfer=True)
        if upstream.status in _RETRY_STATUSES:
            return TryFailed(f"HTTP {upstream.status} from {replica.name}: {error.message[:200]}", error)
        return error

    # ---- checks ---------------------------------------------------------------------------------

    def _resolve_model(self, requested: str | None) -> str:
        if requested is not None and any(replica.serves(requested) for replica in self.pool.replicas):
            return requested  # the usual case, without building the list of every model
        known = self.pool.known_models()
        if requested is None:
            served = list(dict.fromkeys(spec.model for spec in self.pool.config.replicas))
            if len(served) == 1:
                return served[0]
            raise BadRequest(f"`model` is required (available: {', '.join(known)}).", param="model")
        if requested not in known:
            raise ModelNotFound(requested, known)
        return requested

    def _check_context(self, parsed: AnyRequest, prompt_ids: list[int], candidates: tuple[ReplicaState, ...]) -> None:
        """vLLM's context rule against the smallest context among the candidates, before routing:
        a request no replica could serve gets vLLM's 400 here, not after a round trip. The smallest
        is kept with the pool's candidates tuple it came from (a new tuple when a replica's
        max_model_len, models, tokenizer or health change)."""
        if candidates is self._context_of[0]:
            limit = self._context_of[1]
        else:
            limit = min([c.max_model_len for c in candidates if c.max_model_len] or [0])
            self._context_of = (candidates, limit)
        if limit:
            fit_max_tokens(parsed, len(prompt_ids), limit, None)


def _with_token_ids(body: bytes, stream: bool = False) -> bytes | None:
    """A JSON object's bytes with "return_token_ids": true as their last member (`stream`: then
    "stream_options": {"include_usage": true}), or None when that could clash with a member
    already there (the key appears in the body at all: as a key, or as a string that looks like
    one) or the object is empty. Unescaped, `"return_token_ids"` cannot appear inside a JSON string
    (its quotes would be escaped), so a body without it has no such key spelt plainly; a key spelt
    with escapes decodes to a value, which sends the request the other way."""
    # find, not `in` (see protocol/stream_chunks.py)
    if body.find(b'"return_token_ids"') >= 0 or (stream and body.find(b'"stream_options"') >= 0):
        return None
    end = body.rstrip()
    inner = end[:-1].rstrip()
    if not end.endswith(b"}") or inner.endswith(b"{"):
        return None
    return inner + (_STREAM_SPLICE if stream else b',"return_token_ids":true}')


_STREAM_SPLICE = b',"return_token_ids":true,"stream_options":{"include_usage":true}}'


def _collectable(raw: dict, body: bytes) -> bool:
    """Whether a non-streamed answer can be collected from a stream: no field whose stream form
    (tool-call deltas, logprob lists, ...) the gateway does not put back together."""
    if UNHONOURED_NAMES.isdisjoint(raw):  # the usual body: none of those fields at all
        return True
    try:
        check_honoured(body)
    except BadRequest:
        return False
    return True


def _unreachable(replica: ReplicaState, exc: HttpClientError) -> TryFailed:
    """A try whose request could not reach the replica (refused: it is certainly gone)."""
    return TryFailed(f"connect: {_reason(exc)}",
                     UpstreamError(f"Replica {replica.name} unreachable.", code="upstream_unreachable"),
                     fatal=isinstance(exc, ConnectFailed) and exc.refused)


def _reason(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _PushedRelay:
    """A stream's reads, handled where they arrive (the replica connection's data_received): the
    events to the answer and the client at once, the replica's progress, the first token. It
    never raises there: a failure (the replica's in-band error, the client gone) is kept for the
    request's task, woken to raise it, and reading from the replica stops. The answer's last read
    is left to the task (`tail`), which sends its events and the stream's end in one write."""
    __slots__ = ("answer", "attempt", "replica", "upstream", "loop", "splitter", "record", "decoding", "full",
                 "error", "tail")

    def __init__(self, answer: Answer, attempt: RoutedAttempt, replica: ReplicaState, upstream: Response,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.answer = answer
        self.attempt = attempt
        self.replica = replica
        self.upstream = upstream
        self.loop = loop
        self.splitter = EventSplitter()
        self.record = answer.record
        self.decoding = attempt.started_decoding
        self.full = False          # the client's buffer is full: the task drains it
        self.error: Exception | None = None
        self.tail = b""

    def push(self, data: bytes) -> None:
        if self.error is not None:
            return
        self.replica.last_progress_s = self.loop.time()
        if self.upstream.complete:  # the body's end came with it: the task, woken for it, takes it
            self.tail = data
            return
        try:
            events = self.splitter.feed(data)
            if events and self.answer.on_events_now(events):
                self.full = True
                self.upstream.pause_reading()
                self.upstream.wake()
            self.started()
        except Exception as exc:  # the task raises it (as its own read would have)
            self.error = exc
            self.upstream.pause_reading()
            self.upstream.wake()

    def started(self) -> None:
        if not self.decoding and self.record.first_token_s is not None:
            self.attempt.first_token()  # prefilled: the load tracker now counts it decoding
            self.decoding = True
