"""Generation engine: one worker thread runs scheduler steps over the paged model; asyncio submits
requests and reads event streams.

The asyncio side calls `submit(prompt_token_ids, params)` and iterates the returned RequestStream
(one TokenEvent per generated token, the last one carrying finish_reason). Each worker step:
take new requests and aborts from the inbox, let the scheduler pick this step's chunks (decodes,
prefill chunks, admissions, preemptions), run ONE batched forward through the model runner,
sample, let the scheduler commit full blocks, emit tokens, free finished sequences, and publish
the block pool's KV events.

Thread boundary: the asyncio side touches only `_inbox`/`_aborted` under `_cond`; the scheduler
and block pool belong to the worker, which holds `_state_lock` while it changes them so a reader
(`cached_block_hashes`) sees a consistent pool. Events cross to the loop with
`loop.call_soon_threadsafe`. A failed forward fails the requests in that step only.

Disaggregation (see protocol/kv_transfer.py): a request submitted with `kv_pin_id` (prefill side)
keeps its blocks when it finishes, pinned in `pins` until a pull claims them or the lease runs out;
the final event carries the pin. A pull copies pinned blocks from the loop's side (nothing writes
a pinned block) and hands them back with `release_pinned`; the worker releases them, so the pool
keeps one writer. A request submitted with `staged_kv` (decode side) carries prompt blocks already
pulled; the worker writes them into the blocks admission gave it, before the step's forward, so
the copy never races a forward. The loop's other pool calls (`local_prefix_blocks`: a lookup and an
LRU touch; `claim_pin`) take `_state_lock` and allocate or free nothing.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

import structlog
import torch

from protocol.errors import BadRequest, Overloaded, Unavailable
from replica.block_pool import BlockPool
from replica.cpu_policy import apply_to_current_thread, checked
from replica.kv_codec import StagedKV, unpack_blocks
from replica.kv_pins import DEFAULT_LEASE_S, KVPin, PinTable, prompt_digest
from replica.liveness import EngineLiveness
from replica.model_runner import DEFAULT_BLOCK_SIZE, ModelRunner, StepItem, fit_context, num_blocks_for_budget
from replica.sampler import SamplingParams, sample
from replica.scheduler import RemoteKV, Scheduler, Sequence
from tokenization.stop_strings import find_stop_string, held_back_chars
from tokenization.detokenizer import IncrementalDetokenizer

log = structlog.get_logger("kvgate.replica.engine")

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
DEFAULT_KV_CACHE_GB = 0.25


@dataclass(slots=True)
class TokenEvent:
    token_id: int | None          # None only for abort/error events
    text: str                     # text delta released by this token (may be "" while held back)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token ID that ended it
    error: BaseException | None = None
    num_cached_tokens: int = 0    # prompt tokens served from the prefix cache (or pulled)
    kv_pin: KVPin | None = None   # final event of a kv_pin_id request: its blocks, pinned for a pull
    kv_staged_stale: bool = False  # staged KV could not be used: the prompt was computed here


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
class _Request:
    sequence: Sequence
    params: SamplingParams
    stream: RequestStream
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    emitted_chars: int = 0        # text released to the client so far
    pin_id: str | None = None     # pin the blocks under this id when finished (prefill side)
    staged: StagedKV | None = None  # pulled prompt blocks to write at admission (decode side)
    staged_stale: bool = False

    @property
    def request_id(self) -> str:
        return self.sequence.request_id


class Engine:
    def __init__(self, model: torch.nn.Module, config, tokenizer, *, max_model_len: int,
                 max_waiting: int = 256, max_running: int = 64, dtype: torch.dtype | None = None,
                 kv_cache_gb: float = DEFAULT_KV_CACHE_GB, num_blocks: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, max_num_batched_tokens: int = 512,
                 kv_events=None, max_model_len_requested: bool = False, kv_lease_s: float = DEFAULT_LEASE_S,
                 liveness: EngineLiveness | None = None, on_fatal=None, cpu_policy: str | None = None):
        """`max_model_len`: the model's context, or the user's `--max-model-len` when
        `max_model_len_requested`; see `fit_context` for how it meets the KV cache's size.
        `cpu_policy`: the worker thread's scheduling policy (replica/cpu_policy.py), None to keep
        the starting thread's."""
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self.dtype = dtype or next(model.parameters()).dtype
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if num_blocks is None:
            num_blocks = num_blocks_for_budget(config, block_size, self.dtype, kv_cache_gb)
        self.runner = ModelRunner(model, config, num_blocks, block_size, self.dtype)
        self.pool = BlockPool(num_blocks, block_size)
        self.model_max_len = max_model_len
        self.max_model_len = fit_context(max_model_len, num_blocks, block_size, requested=max_model_len_requested,
                                         block_bytes=self.runner.kv_cache_bytes // num_blocks)
        self.scheduler = Scheduler(self.pool, max_num_batched_tokens=max_num_batched_tokens,
                                   max_num_seqs=max_running)
        self.kv_events = kv_events
        self.pins = PinTable(kv_lease_s)  # under _state_lock
        self._unpinned: list[list[int]] = []  # claimed pins' blocks for the worker to release (under _cond)
        self.kv_staged_loaded_total = 0   # decode side: requests admitted with pulled KV
        self.kv_staged_stale_total = 0    # ... whose pulled KV came too late to use (recomputed)
        self._stop_token_ids = frozenset(tokenizer.stop_token_ids or [])
        self._cond = threading.Condition()
        self._state_lock = threading.Lock()
        self._inbox: deque[_Request] = deque()
        self._aborted: set[str] = set()
        self._requests: dict[str, _Request] = {}   # worker-owned: every request the scheduler holds
        self._stopping = False
        # Totals for /metrics, written by the worker only (reads from the loop are benign races).
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._ids = itertools.count()
        self._shared_generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self.liveness = liveness or EngineLiveness()
        self._on_fatal = on_fatal  # called (from the worker) if it dies: the process should end
        self.cpu_policy = None if cpu_policy is None else checked(cpu_policy)  # refused here, not in the thread
        self._thread = threading.Thread(target=self._run, name="replica-engine", daemon=True)

    # -- asyncio side ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + len(self.scheduler.waiting)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.stats.num_preemptions

    @property
    def prefix_cache_queries(self) -> int:
        return self.scheduler.stats.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.scheduler.stats.prefix_cache_hits

    @property
    def kv_cache_usage(self) -> float:
        return self.pool.usage

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def cached_block_hashes(self) -> set[int]:
        """The prefix cache's contents now (what a KV event subscriber should hold)."""
        with self._state_lock:
            return self.pool.cached_hashes()

    def local_prefix_blocks(self, block_hashes: list[int]) -> int:
        """How many of these leading blocks the prefix cache holds now (touched, so they are the
        last to be evicted before the request that needs them arrives)."""
        with self._state_lock:
            hit = self.pool.longest_cached_prefix(block_hashes)
            self.pool.touch(hit)
            return len(hit)

    def claim_pin(self, pin_id: str) -> KVPin | None:
        """Take a pin for a pull: it no longer expires; its blocks stay allocated (so unwritten)
        until `release_pinned`."""
        with self._state_lock:
            return self.pins.claim(pin_id)

    def peek_pin(self, pin_id: str) -> KVPin | None:
        with self._state_lock:
            return self.pins.peek(pin_id)

    def release_pinned(self, block_ids: list[int]) -> None:
        with self._cond:
            self._unpinned.append(block_ids)
            self._cond.notify()

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               cache_salt: str | None = None, *, kv_pin_id: str | None = None,
               staged_kv: StagedKV | None = None) -> RequestStream:
        """Queue a request; call from the event loop. Raises Overloaded when the queue is full and
        BadRequest past the context (the server caps max_tokens before: this guards direct callers).
        KV blocks are taken as the sequence grows, not reserved for max_tokens up front; a pool that
        runs short preempts the newest sequence (see Scheduler). `kv_pin_id`: pin the blocks when it
        finishes (the prefill side of P/D); `staged_kv`: prompt blocks pulled from a prefill replica."""
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise BadRequest(f"{len(prompt_token_ids)} prompt tokens + max_tokens {params.max_tokens} exceed "
                             f"this replica's max_model_len {self.max_model_len}.",
                             param="max_tokens", code="context_length_exceeded")
        loop = asyncio.get_running_loop()
        request_id = f"seq-{next(self._ids)}"
        stream = RequestStream(request_id, prompt_token_ids, loop)
        sequence = Sequence(request_id, list(prompt_token_ids), params.max_tokens, cache_salt)
        if staged_kv is not None:
            sequence.remote_kv = RemoteKV(staged_kv.first_block)
        request = _Request(sequence, params, stream, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
                           params.make_generator(), pin_id=kv_pin_id, staged=staged_kv)
        with self._cond:
            if self._stopping:
                raise Unavailable("The replica is shutting down.")
            if self.num_waiting >= self.max_waiting:
                raise Overloaded(f"Too many waiting requests ({self.max_waiting}); retry shortly.",
                                 retry_after_s=1)
            self._inbox.append(request)
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Drop a request at the worker's next step and free its blocks (idempotent)."""
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
    def health_problem(self) -> str | None:
        """None while the engine can make progress (see replica/liveness.py)."""
        return self.liveness.problem(self._thread.is_alive(), bool(self.num_running or self.num_waiting))

    def _run(self) -> None:
        if self.cpu_policy is not None:  # before the first torch op: its worker threads inherit it
            if not apply_to_current_thread(self.cpu_policy):
                log.warning("cpu_policy_not_applied", policy=self.cpu_policy,
                            reason="the OS refused or lacks it; the engine keeps the default policy")
        try:
            self._work()
        except BaseException as exc:  # the worker is gone: nothing it held can finish here
            log.critical("engine_died", error=f"{type(exc).__name__}: {exc}", exc_info=True)
            self.liveness.died(exc)
            self._fail_all(Unavailable(f"The replica's engine failed ({type(exc).__name__}); retry elsewhere."))
            if self._on_fatal is not None:
                self._on_fatal(exc)

    def _work(self) -> None:
        idle = False  # the last schedule ran nothing (waiting requests wait for blocks): no spinning
        with torch.inference_mode():
            while True:
                with self._state_lock:
                    next_expiry_s = self.pins.next_expiry_s()  # the worker wakes to free expired pins
                with self._cond:
                    while not (self._stopping or self._inbox or self._aborted or self._unpinned
                               or (self.scheduler.has_work() and not idle)):
                        wait_s = None if next_expiry_s is None else next_expiry_s - time.monotonic()
                        if wait_s is not None and wait_s <= 0:
                            break
                        self._cond.wait(wait_s)
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, deque()
                    aborted, self._aborted = self._aborted, set()
                    unpinned, self._unpinned = self._unpinned, []
                with self._state_lock:
                    for block_ids in unpinned:
                        self.pool.release(block_ids)
                    self._expire_pins()
                    for request in inbox:
                        self._admit(request)
                    for request_id in aborted:
                        request = self._requests.pop(request_id, None)
                        if request is not None:
                            self.scheduler.finish(request.sequence)
                            request.stream._push_threadsafe(TokenEvent(None, "", FINISH_ABORT))
                    chunks = self.scheduler.schedule()
                idle = not chunks
                if chunks:
                    self._step(chunks)
                self._publish_events()
                self.liveness.stepped(bool(chunks))
        self._fail_all(Unavailable("The replica shut down before the request finished."))

    def _admit(self, request: _Request) -> None:
        ids = request.sequence.prompt_token_ids
        if ids and (min(ids) < 0 or max(ids) >= self.config.vocab_size):
            request.stream._push_threadsafe(TokenEvent(None, "", error=ValueError(
                f"prompt token IDs must be in [0, {self.config.vocab_size})")))
            return
        self.scheduler.add(request.sequence)
        self._requests[request.request_id] = request
        self.prompt_tokens_total += len(ids)

    def _step(self, chunks) -> None:
        items = [StepItem(c.token_ids, c.start, c.sequence.block_ids, c.samples) for c in chunks]
        try:
            self._load_staged(chunks)
            logits = self.runner.execute(items)
            sampling = [c for c in chunks if c.samples]
            greedy = logits.argmax(-1).tolist()  # one batched argmax covers every greedy row
            sampled = {}
            for row, chunk in enumerate(sampling):
                request = self._requests[chunk.sequence.request_id]
                params = request.params
                sampled[id(chunk.sequence)] = greedy[row] if params.greedy else \
                    sample(logits[row], params, request.generator or self._shared_generator)
        except Exception as exc:  # the requests of this step fail; the engine keeps serving
            log.exception("step_failed", requests=[c.sequence.request_id for c in chunks])
            with self._state_lock:
                for chunk in chunks:
                    request = self._requests.pop(chunk.sequence.request_id)
                    self.scheduler.finish(chunk.sequence)
                    request.stream._push_threadsafe(TokenEvent(None, "", error=exc))
            return
        with self._state_lock:
            self.scheduler.update(chunks, sampled)
            for chunk in sampling:
                request = self._requests[chunk.sequence.request_id]
                self.generation_tokens_total += 1
                self._append_token(request, chunk.sequence.output_token_ids[-1])

    def _expire_pins(self) -> None:
        for pin in self.pins.expire(time.monotonic()):
            self.pool.release(pin.block_ids)
            log.warning("kv_pin_expired", remote_request_id=pin.pin_id, blocks=len(pin.block_ids),
                        lease_s=self.pins.lease_s, hint="no decode replica pulled these blocks in time")

    def _load_staged(self, chunks) -> None:
        """Write pulled prompt blocks into the blocks admission just gave their requests."""
        for chunk in chunks:
            remote = chunk.sequence.remote_kv
            if remote is None or (remote.target_block_ids is None and not remote.stale):
                continue
            request = self._requests[chunk.sequence.request_id]
            if remote.stale:
                self.kv_staged_stale_total += 1
                request.staged_stale = True
                log.info("kv_staged_stale", request_id=request.request_id, first_block=remote.first_block)
            else:
                unpack_blocks(self.runner.kv_caches, request.staged, remote.skip_blocks, remote.target_block_ids)
                self.kv_staged_loaded_total += 1
            chunk.sequence.remote_kv = None
            request.staged = None  # the bytes go now

    def _finish(self, request: _Request) -> KVPin | None:
        """Forget a finished request; free its blocks, or pin them for a pull."""
        del self._requests[request.request_id]
        sequence = request.sequence
        if request.pin_id is None:
            self.scheduler.finish(sequence)
            return None
        num_tokens = sequence.num_computed_tokens  # KV written so far (vLLM's remote_num_tokens)
        block_ids = self.scheduler.detach(sequence)
        return self.pins.add(request.pin_id, block_ids, num_tokens, len(sequence.prompt_token_ids),
                             prompt_digest(sequence.prompt_token_ids, sequence.cache_salt), time.monotonic())

    def _publish_events(self) -> None:
        with self._state_lock:
            events = self.pool.drain_events()
        if events and self.kv_events is not None:
            self.kv_events.publish(events)

    def _fail_all(self, error: Exception) -> None:
        with self._cond:
            pending = list(self._requests.values()) + list(self._inbox)
            self._requests.clear()
            self._inbox.clear()
        for request in pending:
            request.stream._push_threadsafe(TokenEvent(None, "", error=error))

    def _append_token(self, request: _Request, token_id: int) -> None:
        """Emit one token's event; a token that finishes the request also frees (or pins) its blocks."""
        params = request.params
        sequence = request.sequence
        request.detokenizer.add(token_id)
        text = request.detokenizer.text
        finish, stop_reason = None, None
        if token_id in params.stop_token_ids:
            finish, stop_reason = FINISH_STOP, token_id
        elif not params.ignore_eos and token_id in self._stop_token_ids:
            finish = FINISH_STOP
        if params.stop:
            hit = find_stop_string(text, params.stop, request.emitted_chars)
            if hit is not None:
                cut_at, stop_string = hit
                text = text[:cut_at]
                finish, stop_reason = FINISH_STOP, stop_string
        if finish is None and len(sequence.output_token_ids) >= params.max_tokens:
            finish = FINISH_LENGTH
        release_to = len(text) if finish else len(text) - held_back_chars(text, params.stop)
        delta = text[request.emitted_chars:max(request.emitted_chars, release_to)]
        request.emitted_chars += len(delta)
        pin = self._finish(request) if finish is not None else None
        request.stream._push_threadsafe(TokenEvent(token_id, delta, finish, stop_reason,
                                                   num_cached_tokens=sequence.num_cached_tokens or 0,
                                                   kv_pin=pin, kv_staged_stale=request.staged_stale))
