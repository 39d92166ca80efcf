"""A replica that answers at once: vLLM's OpenAI dialect with no model behind it.

It exists to measure the gateway alone. Every endpoint the gateway relies on is here with
vLLM's shapes (`return_token_ids`, streamed usage with `prompt_tokens_details.cached_tokens`,
`max_model_len` in /v1/models, `vllm:` gauges in /metrics, the tokenizer bundle at
/kvgate/tokenizer), and every answer is deterministic: the output token IDs depend only on
the prompt's token IDs. A request gets `--output-tokens` tokens, or `max_tokens` if smaller.
Its usage reports the cached tokens a prefix cache of `--prefix-cache-blocks` 16-token blocks
would have held (vLLM's rule: full blocks, never the prompt's last token; LRU; 0: always 0), so a
router that checks its predictions against them sees what a real replica would tell it.

    .venv/bin/python -m bench.stub_backend --port 8101 [--model stub] [--output-tokens 16]

It prints `stub listening on http://HOST:PORT` once it accepts connections (`--port 0`: any free port).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import msgspec
from aiohttp import web

from protocol.errors import ModelNotFound
from protocol.http import openai_errors
from protocol.requests import (ChatCompletionRequest, CompletionRequest, decode_chat, decode_completion,
                               message_dicts, requested_max_tokens, single_prompt)
from protocol.sse import DONE_EVENT, event
from replica.cpu_policy import POLICIES, apply_to_current_thread
from tokenization.bundle import TokenizerBundle

_json = msgspec.json.Encoder()
_OUTPUT_POOL_SIZE = 64
BLOCK_TOKENS = 16


class PrefixCache:
    """Which full 16-token prompt blocks a replica with prefix caching would hold (LRU)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def serve(self, prompt_ids: list[int]) -> int:
        """Cached tokens of this prompt (vLLM: full blocks, never its last token); then it is cached."""
        if not self.capacity_blocks:
            return 0
        keys, parent = [], 0
        for start in range(0, len(prompt_ids) // BLOCK_TOKENS * BLOCK_TOKENS, BLOCK_TOKENS):
            parent = hash((parent, tuple(prompt_ids[start:start + BLOCK_TOKENS])))
            keys.append(parent)
        usable = (len(prompt_ids) - 1) // BLOCK_TOKENS
        hits = 0
        while hits < usable and keys[hits] in self._blocks:
            hits += 1
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
        return hits * BLOCK_TOKENS


class StubModel:
    """What the stub knows about its "model": a name, a tokenizer, and a fixed output vocabulary."""

    def __init__(self, name: str, bundle: TokenizerBundle, output_tokens: int, max_model_len: int,
                 prefix_cache_blocks: int = 0):
        self.prefix_cache = PrefixCache(prefix_cache_blocks)
        self.name = name
        self.bundle = bundle
        self.output_tokens = output_tokens
        self.max_model_len = max_model_len
        self.tokenizer_payload = bundle.to_payload()
        self.created = int(time.time())
        # Whole words (" the", " gateway") when the vocabulary has them, else any printable ASCII token,
        # so every streamed delta is clean text.
        special = set(bundle.stop_token_ids) | {bundle.bos_token_id}
        printable = [(token_id, text) for token_id in range(bundle.vocab_size) if token_id not in special
                     for text in (bundle.decode([token_id]),) if text and text.isascii() and text.isprintable()]
        words = [(token_id, text) for token_id, text in printable if text[0] == " " and text[1:].isalpha()]
        pool = (words if len(words) >= 8 else printable)[:_OUTPUT_POOL_SIZE]
        if not pool:
            raise ValueError("tokenizer has no printable ASCII tokens to emit")
        self.pool = pool

    def prompt_ids(self, request: CompletionRequest | ChatCompletionRequest) -> list[int]:
        if isinstance(request, ChatCompletionRequest):
            text = self.bundle.apply_chat_template(message_dicts(request), request.add_generation_prompt)
            return self.bundle.encode(text, add_special_tokens=False)
        prompt = single_prompt(request)
        return list(prompt) if isinstance(prompt, list) else self.bundle.encode(prompt)

    def output(self, prompt_ids: list[int], count: int) -> list[tuple[int, str]]:
        """`count` (token id, text) pairs; same prompt, same output."""
        start = sum(prompt_ids) % len(self.pool)
        return [self.pool[(start + i) % len(self.pool)] for i in range(count)]

    def plan(self, request) -> tuple[list[int], list[tuple[int, str]], str, int]:
        """(prompt IDs, output (id, text) pairs, finish reason, cached prompt tokens)."""
        prompt_ids = self.prompt_ids(request)
        limit = requested_max_tokens(request)[0] or self.output_tokens
        count = min(limit, self.output_tokens)
        finish_reason = "length" if count == limit else "stop"
        return prompt_ids, self.output(prompt_ids, count), finish_reason, self.prefix_cache.serve(prompt_ids)

    def usage(self, prompt_ids: list[int], completion_tokens: int, cached_tokens: int = 0) -> dict:
        return {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + completion_tokens,
                "completion_tokens": completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def check_model(self, request) -> None:
        if request.model is not None and request.model != self.name:
            raise ModelNotFound(request.model, [self.name])


def _json_response(obj) -> web.Response:
    return web.Response(body=_json.encode(obj), content_type="application/json")


async def _sse_response(request: web.Request, events, interval_s: float = 0.0) -> web.StreamResponse:
    """`interval_s`: the time between two events (a decode step), 0: all at once."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await response.prepare(request)
        for index, item in enumerate(events):  # one write per chunk, as a real server flushes each token
            if interval_s and index:
                await asyncio.sleep(interval_s)
            await response.write(event(item))
        await response.write(DONE_EVENT)
        await response.write_eof()
    except ConnectionResetError:  # the client (a router whose own client left) hung up: not an error
        pass
    return response


def build_app(model: StubModel, fail_status: int | None = None, token_interval_s: float = 0.0) -> web.Application:
    """`fail_status`: every generation request answers that HTTP status (a replica that is up and
    healthy but failing its work, for failover tests and benches). `token_interval_s`: a streamed
    answer's events that far apart (a real engine's decode step), each then its own read."""
    middlewares = [openai_errors] + ([_failing(fail_status)] if fail_status else [])
    app = web.Application(middlewares=middlewares)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = decode_completion(await request.read())
        model.check_model(body)
        prompt_ids, output, finish_reason, cached = model.plan(body)
        with_ids = bool(body.return_token_ids)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if not body.stream:
            choice = {"index": 0, "text": "".join(text for _, text in output), "logprobs": None,
                      "finish_reason": finish_reason, "stop_reason": None, "prompt_logprobs": None}
            if with_ids:
                choice["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = [token_id for token_id, _ in output]
            return _json_response({"id": request_id, "object": "text_completion", "created": created,
                                   "model": model.name, "choices": [choice],
                                   "usage": model.usage(prompt_ids, len(output), cached)})

        def events():
            for i, (token_id, text) in enumerate(output):
                choice = {"index": 0, "text": text, "logprobs": None,
                          "finish_reason": finish_reason if i == len(output) - 1 else None, "stop_reason": None}
                if with_ids:
                    if i == 0:  # vLLM puts the prompt IDs in the first chunk's choice
                        choice["prompt_token_ids"] = prompt_ids
                    choice["token_ids"] = [token_id]
                yield {"id": request_id, "object": "text_completion", "created": created,
                       "model": model.name, "choices": [choice]}
            if body.stream_options is not None and body.stream_options.include_usage:
                yield {"id": request_id, "object": "text_completion", "created": created, "model": model.name,
                       "choices": [], "usage": model.usage(prompt_ids, len(output), cached)}

        return await _sse_response(request, events(), token_interval_s)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        body = decode_chat(await request.read())
        model.check_model(body)
        prompt_ids, output, finish_reason, cached = model.plan(body)
        with_ids = bool(body.return_token_ids)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if not body.stream:
            choice = {"index": 0, "message": {"role": "assistant", "content": "".join(t for _, t in output),
                                              "tool_calls": []},
                      "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
            response = {"id": request_id, "object": "chat.completion", "created": created, "model": model.name,
                        "choices": [choice], "usage": model.usage(prompt_ids, len(output), cached)}
            if with_ids:  # chat: prompt IDs at the top level, output IDs in the choice
                response["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = [token_id for token_id, _ in output]
            return _json_response(response)

        def events():
            first = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model.name,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]}
            if with_ids:
                first["prompt_token_ids"] = prompt_ids
            yield first
            for i, (token_id, text) in enumerate(output):
                choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
                          "finish_reason": finish_reason if i == len(output) - 1 else None}
                if with_ids:
                    choice["token_ids"] = [token_id]
                yield {"id": request_id, "object": "chat.completion.chunk", "created": created,
                       "model": model.name, "choices": [choice]}
            if body.stream_options is not None and body.stream_options.include_usage:
                yield {"id": request_id, "object": "chat.completion.chunk", "created": created,
                       "model": model.name, "choices": [], "usage": model.usage(prompt_ids, len(output), cached)}

        return await _sse_response(request, events(), token_interval_s)

    models_body = _json.encode({"object": "list", "data": [{
        "id": model.name, "object": "model", "created": model.created, "owned_by": "vllm", "root": model.name,
        "parent": None, "max_model_len": model.max_model_len, "permission": []}]})

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=models_body, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(request: web.Request) -> web.Response:
        # The load signals the gateway scrapes (contract 3), all idle: the stub never queues.
        label = f'{{model_name="{model.name}"}}'
        # Counters are named with `_total` in the TYPE line too, as prometheus_client writes them.
        lines = []
        for name, kind in (("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                           ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:prefix_cache_queries_total", "counter"),
                           ("vllm:prefix_cache_hits_total", "counter")):
            lines += [f"# TYPE {name} {kind}", f"{name}{label} 0.0"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")

    async def tokenizer(request: web.Request) -> web.Response:
        return web.Response(body=model.tokenizer_payload, content_type="application/json")

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/kvgate/tokenizer", tokenizer)
    return app


def _failing(status: int):
    @web.middleware
    async def fail(request: web.Request, handler):
        if request.path.startswith("/v1/") and request.method == "POST":
            return web.json_response({"error": {"message": f"stub configured to fail with {status}",
                                                "type": "internal_error", "param": None, "code": status}},
                                     status=status)
        return await handler(request)
    return fail


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="OpenAI-shaped backend that answers at once (vLLM dialect).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8101)
    parser.add_argument("--model", default="stub", help="model name served and checked")
    parser.add_argument("--tokenizer-dir", default=None, help="HF checkpoint dir (default: the tiny checkpoint)")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens per answer (max_tokens caps it)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--prefix-cache-blocks", type=int, default=8192,
                        help="16-token blocks of the prefix cache whose hits usage reports (0: report none)")
    parser.add_argument("--token-interval-ms", type=float, default=0.0,
                        help="time between a streamed answer's events (0: all at once)")
    parser.add_argument("--fail-status", type=int, default=None,
                        help="answer every generation request with this HTTP status (failover tests)")
    parser.add_argument("--cpu-policy", choices=POLICIES, default="normal",
                        help="'batch': the stub runs as a built-in replica's compute does (SCHED_BATCH, nice 5; "
                             "replica/cpu_policy.py), so that a router on the same cores is not preempted by "
                             "the backend it wakes, as it would not be by a backend on another machine")
    args = parser.parse_args(argv)
    if args.cpu_policy == "batch":
        apply_to_current_thread("batch")
    if args.output_tokens < 1:
        parser.error("--output-tokens must be at least 1")
    if not 0 <= args.token_interval_ms <= 10_000:
        parser.error("--token-interval-ms must be between 0 and 10000")

    tokenizer_dir = args.tokenizer_dir
    if tokenizer_dir is None:
        from replica.tiny import tiny_checkpoint_dir  # builds it once per machine (needs torch the first time)
        tokenizer_dir = tiny_checkpoint_dir()
    model = StubModel(args.model, TokenizerBundle.from_hf_dir(tokenizer_dir), args.output_tokens,
                      args.max_model_len, args.prefix_cache_blocks)
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    run(serve(build_app(model, args.fail_status, args.token_interval_ms / 1000), args.host, args.port))


async def serve(app: web.Application, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM. Prints the bound address first (port 0 picks a free one)."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        print(f"stub listening on http://{bound_host}:{bound_port}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()



OUTPUT_KEPT = 200  # lines of a StubProcess's stdout kept for a report


class StubProcess:
    """The stub as a child process, for benches and tests: `with StubProcess() as stub: stub.url`.

    Ready means it printed its address, i.e. it accepts connections; stopped on exit, always."""

    def __init__(self, *, port: int = 0, model: str = "stub", output_tokens: int = 16, tokenizer_dir=None,
                 stderr=None, ready_timeout_s: float = 120.0, fail_status: int | None = None,
                 cpu_policy: str | None = None, token_interval_ms: float = 0.0):
        self.argv = [sys.executable, "-m", "bench.stub_backend", "--port", str(port), "--model", model,
                     "--output-tokens", str(output_tokens)]
        if token_interval_ms:
            self.argv += ["--token-interval-ms", str(token_interval_ms)]
        if fail_status is not None:
            self.argv += ["--fail-status", str(fail_status)]
        if cpu_policy is not None:
            self.argv += ["--cpu-policy", cpu_policy]
        if tokenizer_dir is not None:
            self.argv += ["--tokenizer-dir", str(tokenizer_dir)]
        self.stderr = stderr
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.output: collections.deque[str] = collections.deque(maxlen=OUTPUT_KEPT)

    @property
    def pid(self) -> int:
        return self.process.pid

    def __enter__(self) -> "StubProcess":
        repo_root = Path(__file__).resolve().parent.parent
        self.process = subprocess.Popen(self.argv, cwd=repo_root, stdout=subprocess.PIPE, stderr=self.stderr,
                                        stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        try:
            line = _read_line(self.process, self.ready_timeout_s)
            if not line.startswith("stub listening on "):
                raise RuntimeError(f"stub did not start (exit code {self.process.poll()}): {line!r}")
            self.url = line.removeprefix("stub listening on ").strip()
        except BaseException:
            self.stop()
            raise
        # Keep reading its stdout (the lines it logs, a traceback per failed request): a pipe
        # nobody reads fills up at 64 KiB and the stub then blocks in its next log write, for good.
        threading.Thread(target=self._drain, args=(self.process.stdout,), daemon=True,
                         name=f"stub-{self.process.pid}-stdout").start()
        return self

    def _drain(self, stdout) -> None:
        for raw in iter(stdout.readline, b""):
            self.output.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def output_tail(self) -> list[str]:
        """Its last OUTPUT_KEPT lines of stdout (after the ready line)."""
        return list(self.output)

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


def die_with_parent() -> None:
    """In a child between fork and exec: ask Linux to SIGTERM it when its parent dies, so a bench
    killed with SIGKILL leaves no server behind. A no-op elsewhere."""
    if sys.platform != "linux":
        return
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    """One line of the child's stdout, or what it wrote before exiting or before the deadline."""
    deadline = time.monotonic() + timeout_s
    buffer = b""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while b"\n" not in buffer:  # bounded by the deadline
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if not selector.select(timeout=min(remaining, 1.0)):
                continue
            chunk = os.read(process.stdout.fileno(), 4096)
            if not chunk:  # EOF: the child exited
                break
            buffer += chunk
    return buffer.decode(errors="replace").split("\n")[0]


if __name__ == "__main__":
    main()
