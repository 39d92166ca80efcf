"""Generation engine v0: one worker thread owns the model; asyncio submits and reads event streams.

The asyncio side calls `submit(prompt_token_ids, params)` and iterates the returned RequestStream
(one TokenEvent per generated token, the last one carrying finish_reason). The worker admits
waiting sequences up to `max_running`, then runs one step for each running sequence in turn
(prefill the first time, one decode token after), so concurrent requests all make progress.
Each sequence owns a contiguous KVCache sized prompt + max_tokens; the paged cache and batched
steps of the next version replace `_step` without changing this interface.

Thread boundary: the worker touches only its own lists plus `_waiting`/`_aborted` under `_cond`;
events cross to the loop with `loop.call_soon_threadsafe`. A failure inside one sequence's step
fails that request only.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections import deque
from dataclasses import dataclass, field

import structlog
import torch

from protocol.errors import Overloaded, Unavailable
from replica.model import KVCache
from replica.sampler import SamplingParams, sample
from tokenization.detokenizer import IncrementalDetokenizer

log = structlog.get_logger("kvgate.replica.engine")

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


@dataclass(slots=True)
class TokenEvent:
    token_id: int | None          # None only for abort/error events
    text: str                     # text delta released by this token (may be "" while held back)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token ID that ended it
    error: BaseException | None = None


class RequestStream:
    """Async iterator of one request's TokenEvents; ends after the event with a finish_reason.
    Raises the worker's exception if the request failed there."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._loop = loop
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._done = False

    def _push_threadsafe(self, event: TokenEvent) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # loop closed during shutdown: nobody is listening any more
            pass

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        event = await self._queue.get()
        if event.error is not None:
            self._done = True
            raise event.error
        if event.finish_reason is not None:
            self._done = True
        return event


@dataclass(eq=False)
class _Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    cache: object | None = None   # KVCache once prefilled
    emitted_chars: int = 0        # text released to the client so far
    finished: bool = False


class Engine:
    def __init__(self, model: torch.nn.Module, config, tokenizer, *, max_model_len: int,
                 max_waiting: int = 256, max_running: int = 8, dtype: torch.dtype | None = None):
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.max_running = max_running
        self.dtype = dtype or next(model.parameters()).dtype
        self._stop_token_ids = frozenset(tokenizer.stop_token_ids or [])
        self._cond = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._aborted: set[str] = set()
        self._running: list[_Sequence] = []
        self._stopping = False
        # Totals for /metrics, written by the worker only (reads from the loop are benign races).
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._ids = itertools.count()
        self._shared_generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self._thread = threading.Thread(target=self._run, name="replica-engine", daemon=True)

    # -- asyncio side ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request; call from the event loop. Raises Overloaded when the queue is full."""
        loop = asyncio.get_running_loop()
        request_id = f"seq-{next(self._ids)}"
        stream = RequestStream(request_id, prompt_token_ids, loop)
        sequence = _Sequence(request_id, prompt_token_ids, params, stream,
                             IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
                             params.make_generator())
        with self._cond:
            if self._stopping:
                raise Unavailable("The replica is shutting down.")
            if len(self._waiting) >= self.max_waiting:
                raise Overloaded(f"Too many waiting requests ({self.max_waiting}); retry shortly.",
                                 retry_after_s=1)
            self._waiting.append(sequence)
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Drop a request at the worker's next step and free its cache (idempotent)."""
        with self._cond:
            self._aborted.add(request_id)
            self._cond.notify()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # -- worker thread --------------------------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._stopping and not self._running and not self._waiting:
                        self._cond.wait()
                    if self._stopping:
                        break
                    aborted, self._aborted = self._aborted, set()
                    if aborted:
                        self._drop_aborted(aborted)
                    while self._waiting and len(self._running) < self.max_running:
                        self._running.append(self._waiting.popleft())
                # Round robin: one step per running sequence, then look at the queue again.
                for sequence in list(self._running):
                    if sequence.request_id in self._aborted:
                        continue  # dropped at the top of the next round
                    try:
                        self._step(sequence)
                    except Exception as exc:  # this request fails; the engine keeps serving
                        log.exception("sequence_failed", request_id=sequence.request_id)
                        sequence.finished = True
                        sequence.stream._push_threadsafe(TokenEvent(None, "", error=exc))
                    if sequence.finished:
                        sequence.cache = None
                        self._running.remove(sequence)
        self._fail_all(Unavailable("The replica shut down before the request finished."))

    def _drop_aborted(self, aborted: set[str]) -> None:
        """Called with _cond held."""
        for queue in (self._waiting, self._running):
            for sequence in [s for s in queue if s.request_id in aborted]:
                queue.remove(sequence)
                sequence.cache = None
                sequence.finished = True
                sequence.stream._push_threadsafe(TokenEvent(None, "", FINISH_ABORT))

    def _fail_all(self, error: Exception) -> None:
        with self._cond:
            pending = list(self._running) + list(self._waiting)
            self._running.clear()
            self._waiting.clear()
        for sequence in pending:
            sequence.stream._push_threadsafe(TokenEvent(None, "", error=error))

    def _step(self, sequence: _Sequence) -> None:
        if sequence.cache is None:  # prefill: the whole prompt in one forward
            sequence.cache = KVCache(self.config, len(sequence.prompt_token_ids) + sequence.params.max_tokens,
                                     self.dtype)
            input_ids = torch.tensor(sequence.prompt_token_ids, dtype=torch.long)
            self.prompt_tokens_total += len(sequence.prompt_token_ids)
        else:
            input_ids = torch.tensor(sequence.output_token_ids[-1:], dtype=torch.long)
        logits = self.model(input_ids, sequence.cache, last_only=True)
        token_id = sample(logits[-1], sequence.params, sequence.generator or self._shared_generator)
        self.generation_tokens_total += 1
        self._append_token(sequence, token_id)

    def _append_token(self, sequence: _Sequence, token_id: int) -> None:
        params = sequence.params
        sequence.output_token_ids.append(token_id)
        sequence.detokenizer.add(token_id)
        text = sequence.detokenizer.text
        finish, stop_reason = None, None
        if token_id in params.stop_token_ids:
            finish, stop_reason = FINISH_STOP, token_id
        elif not params.ignore_eos and token_id in self._stop_token_ids:
            finish = FINISH_STOP
        if params.stop:
            hit = find_stop_string(text, params.stop, sequence.emitted_chars)
            if hit is not None:
                cut_at, stop_string = hit
                text = text[:cut_at]
                finish, stop_reason = FINISH_STOP, stop_string
        if finish is None and len(sequence.output_token_ids) >= params.max_tokens:
            finish = FINISH_LENGTH
        release_to = len(text) if finish else len(text) - held_back_chars(text, params.stop)
        delta = text[sequence.emitted_chars:max(sequence.emitted_chars, release_to)]
        sequence.emitted_chars += len(delta)
        sequence.finished = finish is not None
        sequence.stream._push_threadsafe(TokenEvent(token_id, delta, finish, stop_reason))


def find_stop_string(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest stop string in text that ends after `search_from` (what was released is stop-free,
    so only its last len(stop)-1 characters can start a match)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, search_from - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def held_back_chars(text: str, stops: list[str]) -> int:
    """How many trailing characters could be the start of a stop string (and must wait)."""
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), held, -1):  # stops are short: cheap
            if text.endswith(stop[:size]):
                held = size
                break
    return held
