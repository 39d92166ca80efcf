"""The built-in replica's OpenAI-compatible HTTP server (aiohttp), speaking vLLM's dialect.

A thin shell around the Engine: validate at the edge (protocol/requests.py), tokenize (off the
loop when long), submit, and shape the engine's TokenEvents into vLLM's response and SSE chunk
shapes (replica/shapes.py). Errors render once, in protocol/http.py's middleware.
`kv_transfer_params` (disaggregated prefill/decode) are handled by replica/kv_transfer.py.
"""
from __future__ import annotations

import asyncio
import functools
import gzip
import time
import uuid

import msgspec
from aiohttp import web

from protocol.errors import BadRequest, InternalError, ModelNotFound, error_body
from protocol.http import openai_errors
from protocol.kv_transfer import PULL_PATH, FailurePolicy, KVTransferParams, decode_kv_transfer_params
from protocol.requests import (AnyRequest, ChatCompletionRequest, ChatMessage, CompletionRequest,
                               check_honoured, decode_chat, decode_completion, fit_max_tokens,
                               message_dicts, single_prompt, stop_strings)
from protocol.sse import DONE_EVENT, event
from replica.engine import FINISH_ABORT, Engine
from replica.generation_config import SamplingDefaults
from replica.kv_transfer import DEFAULT_PULL_TIMEOUT_S, KVTransfer
from replica.metrics import CONTENT_TYPE, ReplicaMetrics
from replica.sampler import SamplingParams
from replica.shapes import ResponseShaper

# Texts longer than this are tokenized / templated in a worker thread, not on the event loop.
OFF_LOOP_CHARS = 4096
COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's (and OpenAI's) default for /v1/completions
_encoder = msgspec.json.Encoder()


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=_encoder.encode(obj), status=status, content_type="application/json")


class ReplicaServer:
    def __init__(self, engine: Engine, tokenizer, *, model_name: str, source: str, vocab_size: int,
                 sampling_defaults: SamplingDefaults | None = None, role: str = "mixed",
                 kv_pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S, kv_load_failure_policy: FailurePolicy = "fail"):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.source = source
        self.max_model_len = engine.max_model_len  # capped to what the KV cache holds for one sequence
        self.vocab_size = vocab_size
        self.defaults = sampling_defaults or SamplingDefaults()
        self.created = int(time.time())
        self.metrics = ReplicaMetrics(model_name, engine)
        self.role = role
        self.kv = KVTransfer(engine, self.metrics, role=role, pull_timeout_s=kv_pull_timeout_s,
                             failure_policy=kv_load_failure_policy)
        # Kept gzipped (2.2 MB -> 0.6 MB for SmolLM2): fetched once per gateway start, resident always.
        self._tokenizer_payload_gz = gzip.compress(tokenizer.to_payload(), 6)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[request_ids, openai_errors], client_max_size=64 << 20)
        app.on_response_prepare.append(_echo_request_id)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/kvgate/tokenizer", self.tokenizer_payload)
        app.router.add_get("/kvgate/cache", self.cache_contents)
        app.router.add_post(PULL_PATH, self.kv.handle_pull)
        # Registration probes of other routers (SGLang router, vLLM router): they read these.
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self.model_info)
        return app

    # -- small endpoints ------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        problem = self.engine.health_problem()
        if problem is not None:  # the process answers, but its engine cannot make progress
            return web.json_response(error_body(problem, "service_unavailable", None, "engine_unhealthy"),
                                     status=503)
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvgate",
                "root": self.source, "parent": None, "max_model_len": self.max_model_len, "permission": []}
        return json_response({"object": "list", "data": [card]})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def cache_contents(self, request: web.Request) -> web.Response:
        """The prefix cache's block hashes now: what a KV event subscriber should hold."""
        hashes = await asyncio.get_running_loop().run_in_executor(None, self.engine.cached_block_hashes)
        return json_response({"block_size": self.engine.block_size, "block_hashes": sorted(hashes)})

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response({"model_path": self.source, "tokenizer_path": self.source,
                              "served_model_name": self.model_name, "is_generation": True,
                              "max_model_len": self.max_model_len,
                              "preferred_sampling_params": self.defaults.as_dict(),
                              "weight_version": "default"})

    async def server_info(self, request: web.Request) -> web.Response:
        engine = self.engine
        return json_response({"model_path": self.source, "tokenizer_path": self.source,
                              "served_model_name": self.model_name, "is_generation": True,
                              "max_model_len": self.max_model_len, "context_length": self.max_model_len,
                              "page_size": engine.block_size, "block_size": engine.block_size,
                              "max_total_num_tokens": engine.pool.num_blocks * engine.block_size,
                              "max_running_requests": engine.scheduler.max_num_seqs,
                              "chunked_prefill_size": engine.scheduler.max_num_batched_tokens,
                              "disaggregation_mode": "null" if self.role == "mixed" else self.role,
                              "engine": "kvgate", "kv_engine_id": self.kv.engine_id,
                              "vocab_size": self.vocab_size, "weight_bytes": engine.weight_bytes,
                              "kv_cache_bytes": engine.runner.kv_cache_bytes,
                              "num_requests_running": engine.num_running,
                              "num_requests_waiting": engine.num_waiting})

    async def tokenizer_payload(self, request: web.Request) -> web.Response:
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            return web.Response(body=self._tokenizer_payload_gz, content_type="application/json",
                                headers={"Content-Encoding": "gzip"})
        return web.Response(body=gzip.decompress(self._tokenizer_payload_gz), content_type="application/json")

    async def tokenize(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read(), type=TokenizeRequest)
        self._check_model(body.model)
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
            add_special = bool(body.add_special_tokens)
            ids = await self._off_loop(_chat_chars(chat), self._render_chat, chat, add_special)
        elif body.prompt is not None:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await self._off_loop(len(body.prompt), self.tokenizer.encode, body.prompt, add_special)
        else:
            raise BadRequest("Either `prompt` or `messages` is required.", param="prompt")
        token_strs = [self.tokenizer.tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
        return json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                              "token_strs": token_strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read(), type=DetokenizeRequest)
        self._check_model(body.model)
        self._check_token_ids(body.tokens, "tokens")
        return json_response({"prompt": self.tokenizer.decode(body.tokens)})

    # -- generation -----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival_s = time.monotonic()
        raw = await request.read()
        body = decode_completion(raw)
        check_honoured(raw)
        self._check_model(body.model)
        prompt = single_prompt(body)
        if isinstance(prompt, str):
            prompt_ids = await self._off_loop(len(prompt), self.tokenizer.encode, prompt, True)
        else:
            self._check_token_ids(prompt, "prompt")
            prompt_ids = list(prompt)
        params = self._sampling_params(body, len(prompt_ids))
        echo_text = ""
        if body.echo:
            echo_text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids)
        return await self._generate(request, body, prompt_ids, params, arrival_s, chat=False,
                                    echo_text=echo_text, kv_params=decode_kv_transfer_params(raw))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrival_s = time.monotonic()
        raw = await request.read()
        body = decode_chat(raw)
        check_honoured(raw)
        self._check_model(body.model)
        prompt_ids = await self._off_loop(_chat_chars(body), self._render_chat, body, False)
        params = self._sampling_params(body, len(prompt_ids))
        return await self._generate(request, body, prompt_ids, params, arrival_s, chat=True,
                                    kv_params=decode_kv_transfer_params(raw))

    async def _generate(self, request: web.Request, body: AnyRequest, prompt_ids: list[int],
                        params: SamplingParams, arrival_s: float, *, chat: bool, echo_text: str = "",
                        kv_params: KVTransferParams | None = None) -> web.StreamResponse:
        pin_id, staged, kv_stats = None, None, None
        if kv_params is not None:  # P/D: pin for a pull (prefill leg) or pull first (decode leg)
            pin_id, staged, kv_stats = await self.kv.prepare(request, kv_params, prompt_ids, body.cache_salt)
        stream = self.engine.submit(prompt_ids, params, cache_salt=body.cache_salt, kv_pin_id=pin_id,
                                    staged_kv=staged)
        finished = False
        try:
            shaper = ResponseShaper(self, body, request, prompt_ids, chat, kv_stats)
            events = _timed(stream, self.metrics, arrival_s)
            if not body.stream:
                output_ids, text, last = [], [echo_text], None
                async for ev in events:
                    output_ids.append(ev.token_id)
                    text.append(ev.text)
                    last = ev
                finished = True
                return json_response(shaper.full_response("".join(text), output_ids, last))
            first = await anext(events)  # before prepare: an early failure still gets its HTTP status
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                for chunk in shaper.opening_chunks():
                    await response.write(event(chunk))
                output_ids = [first.token_id]
                await response.write(event(shaper.token_chunk(first, echo_text + first.text, 1)))
                if first.finish_reason is None:
                    async for ev in events:
                        output_ids.append(ev.token_id)
                        await response.write(event(shaper.token_chunk(ev, ev.text, len(output_ids))))
                finished = True
                if shaper.include_usage:
                    await response.write(event(shaper.usage_chunk(len(output_ids))))
            except ConnectionResetError:
                return response  # client went away; `finally` aborts the sequence
            except Exception as exc:  # headers are sent: report in-band, as vLLM does
                finished = True
                err = exc if isinstance(exc, BadRequest) else InternalError(f"{type(exc).__name__}: {exc}")
                await response.write(event(err.body()))
            await response.write(DONE_EVENT)
            await response.write_eof()
            return response
        finally:
            if not finished:  # client went away (or we failed): stop spending compute on it
                self.engine.abort(stream.request_id)

    # -- helpers --------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFound(model, [self.model_name])

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        # Vectorised enough: min/max are C loops over the list.
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if i < 0 or i >= self.vocab_size)
            raise BadRequest(f"Token ID {bad} is out of vocabulary (vocab size {self.vocab_size}).",
                             param=param, code="invalid_token_id")

    def _render_chat(self, body: ChatCompletionRequest, add_special_tokens: bool) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(message_dicts(body),
                                                      add_generation_prompt=body.add_generation_prompt)
        except ValueError as exc:
            raise BadRequest(str(exc), param="messages") from exc
        # The template already wrote BOS where the model wants it (vLLM does the same).
        return self.tokenizer.encode(text, add_special_tokens)

    async def _off_loop(self, size_chars: int, fn, *args):
        if size_chars < OFF_LOOP_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))

    def _sampling_params(self, body: AnyRequest, prompt_len: int) -> SamplingParams:
        """The request's fields, with the replica's defaults (vLLM's, or the model's recommendation)
        for those it leaves out; max_tokens by vLLM's rule (left out: up to the context)."""
        defaults = self.defaults
        default_max = defaults.max_tokens
        if isinstance(body, CompletionRequest) and default_max is None:
            default_max = COMPLETION_DEFAULT_MAX_TOKENS
        return SamplingParams(
            max_tokens=fit_max_tokens(body, prompt_len, self.max_model_len, default_max),
            temperature=defaults.temperature if body.temperature is None else body.temperature,
            top_p=defaults.top_p if body.top_p is None else body.top_p,
            top_k=defaults.top_k if body.top_k is None else (body.top_k or -1),
            seed=body.seed,
            stop=stop_strings(body),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            skip_special_tokens=defaults.skip_special_tokens if body.skip_special_tokens is None
            else body.skip_special_tokens,
        )


def _chat_chars(body: ChatCompletionRequest) -> int:
    return sum(len(m["content"]) for m in message_dicts(body))


async def _timed(stream, metrics: ReplicaMetrics, arrival_s: float):
    """The engine's events, with vLLM's latency metrics recorded on the way."""
    last_s = None
    async for ev in stream:
        if ev.finish_reason == FINISH_ABORT:
            return
        now_s = time.monotonic()
        if last_s is None:
            metrics.time_to_first_token.observe(now_s - arrival_s)
        else:
            metrics.inter_token_latency.observe(now_s - last_s)
        last_s = now_s
        if ev.finish_reason is not None:
            metrics.e2e_request_latency.observe(now_s - arrival_s)
            metrics.request_success(ev.finish_reason)
        yield ev


@web.middleware
async def request_ids(request: web.Request, handler):
    """Accept the caller's x-request-id (the gateway sets one) or mint one; echoed on the response."""
    given = request.headers.get("x-request-id", "")
    request["request_id"] = given[:128] if given.isprintable() and given else uuid.uuid4().hex
    return await handler(request)


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    if "request_id" in request:
        response.headers["x-request-id"] = request["request_id"]
