"""Queue-depth estimate per replica (DESIGN contract 3), in requests, tokens and seconds.

The gateway's own in-flight accounting is exact for traffic it routed and instant; scraped
/metrics see traffic from elsewhere but lag by a scrape interval. We keep both: a fresh
scrape (younger than `stale_after_s`) adds what the replica reported beyond our own requests
at scrape time (traffic we did not route), a stale one is ignored. Counting only the excess
keeps a scrape that saw our own, since finished, requests from inflating the estimate.
"""
from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass, field
from typing import Sequence

import msgspec

try:  # routing/_decision.c: the per-candidate loop and the per-request accounting in C
    from routing._decision import finished as _native_finished
    from routing._decision import first_token as _native_first_token
    from routing._decision import loads_and_delays as _native_loads_and_delays
    from routing._decision import routed as _native_routed
except ImportError:  # built without a C compiler: the Python lines below
    _native_loads_and_delays = _native_routed = _native_first_token = _native_finished = None
NATIVE = True  # False: the Python lines even where the C ones were built (tests compare the two)

# metric sample name -> field of ScrapedLoad (vLLM and SGLang spellings)
_SCRAPED = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",  # older vLLM name
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_running_reqs": "running",
    "sglang:token_usage": "kv_cache_usage",
}


@dataclass(slots=True)  # slots: its fields are read at fixed offsets, here and in routing/_decision.c
class ScrapedLoad:
    waiting: float = 0.0
    running: float = 0.0
    kv_cache_usage: float | None = None  # 0..1
    at_s: float = float("-inf")
    ours_waiting: int = 0    # our own accounting when the scrape was taken
    ours_in_flight: int = 0
    extra: tuple[float, float] = (0.0, 0.0)  # external(), as LoadTracker.on_scrape recorded it

    def external(self) -> tuple[float, float]:
        """(waiting, running) the replica had beyond the requests we routed to it."""
        total = max(self.waiting + self.running - self.ours_in_flight, 0.0)
        waiting = min(max(self.waiting - self.ours_waiting, 0.0), total)
        return waiting, total - waiting


# One sample line of a metric above: its name exactly (a longer name does not match), any labels,
# the value. Labels end at the line's last "}" (a quoted label value may hold braces).
_SAMPLE = re.compile(r"^(" + "|".join(map(re.escape, _SCRAPED)) + r")(?:\{[^\n]*\})?[ \t]+(\S+)", re.MULTILINE)


def parse_load_metrics(text: str) -> ScrapedLoad:
    """Waiting/running requests and KV usage from Prometheus text (summed over label sets).

    A scan for the few sample lines these come from, not a parse of the whole page: a replica's
    /metrics is mostly histograms, and prometheus_client's parser took ~5 ms of the loop per
    scrape of a kvgate replica (py-spy, bench.cache_routing's trace: 8% of the gateway's samples)."""
    load = ScrapedLoad()
    for name, value in _SAMPLE.findall(text):
        try:
            number = float(value)
        except ValueError:
            continue
        field_name = _SCRAPED[name]
        if field_name == "kv_cache_usage":
            load.kv_cache_usage = max(load.kv_cache_usage or 0.0, number)
        else:
            setattr(load, field_name, getattr(load, field_name) + number)
    return load


@dataclass(frozen=True, slots=True)
class LoadModel:
    """How tokens turn into seconds; per-deployment numbers, set in the routing YAML."""
    prefill_tokens_per_s: float = 8000.0
    decode_step_s_per_seq: float = 0.002    # added to every step by each running sequence
    decode_step_base_s: float = 0.010       # one decode step with a tiny batch
    stale_after_s: float = 10.0


@dataclass(slots=True)  # slots: every decision reads ~10 fields of each candidate (routing/_decision.c)
class ReplicaLoad:
    waiting: int = 0                 # routed, no first token yet
    pending_prefill_tokens: int = 0  # uncached prompt tokens of those
    # The same work as a fluid queue the replica drains at its prefill rate since backlog_at:
    # a request routed 100 ms ago is 100 ms into its prefill (or the one before it is), so what is
    # left ahead of a new request is the smaller of the two (see queue_delay_s).
    backlog_tokens: float = 0.0
    backlog_at: float = 0.0
    decoding: int = 0                # streaming sequences
    routed: int = 0                  # requests ever routed here (a scrape's window counts them)
    decoding_context_tokens: int = 0
    # tokens/s this replica prefills as learned from its requests (the gateway's Router sets one
    # rate for every replica of a model); None: the model's configured prefill_tokens_per_s
    prefill_tokens_per_s: float | None = None
    # the model's decode step terms (decode_step_base_s, decode_step_s_per_seq) times this, as
    # learned from its streams' token intervals (Router); None: as configured
    decode_step_scale: float | None = None
    scraped: ScrapedLoad = field(default_factory=ScrapedLoad)
    # ticket -> block hashes of our requests in flight here: what the balance guard asks when a
    # prompt would follow this replica's cache ("is that cached prefix already running here?")
    running_prompts: dict[int, Sequence[int]] = field(default_factory=dict)


class EstimateLog(msgspec.Struct, gc=False):
    """One candidate's load estimate in the request record (`routing.load_estimate`), as the
    policy saw it: made with the decision (loads_and_delays(..., estimates=True), in C where
    routing/_decision.c was built), encoded as the JSON object of these fields."""
    waiting: int
    pending_prefill_tokens: int
    decoding: int
    in_flight: int
    queue_delay_ms: float  # to the microsecond, as observability.request_log.ms gives it
    scraped_fresh: bool


@dataclass(frozen=True)
class LoadEstimate:
    """Plain data for the decision record."""
    waiting: int
    pending_prefill_tokens: int
    decoding: int
    in_flight: int
    queue_delay_s: float
    scraped_fresh: bool


class LoadTracker:
    # Slots: routing/_decision.c reads and writes them at their offsets, once or twice a request.
    __slots__ = ("model", "clock", "replicas", "_tickets", "own_total")

    def __init__(self, model: LoadModel | None = None, clock=time.monotonic) -> None:
        self.model = model or LoadModel()
        self.clock = clock  # when requests are routed and prefilled (the drain of the backlog)
        self.replicas: dict[str, ReplicaLoad] = {}
        self._tickets = itertools.count(1)
        # Our requests in flight everywhere: the sum of waiting + decoding over `replicas`, kept
        # by every step that moves one of them (with_room's shortcut: under a limit in total,
        # every replica is under it).
        self.own_total = 0

    def _get(self, replica: str) -> ReplicaLoad:
        load = self.replicas.get(replica)
        if load is None:
            load = self.replicas[replica] = ReplicaLoad()
        return load

    def remove_replica(self, replica: str) -> None:
        load = self.replicas.pop(replica, None)
        if load is not None:
            self.own_total -= load.waiting + load.decoding

    def prefill_rate(self, replica: str) -> float:
        """Tokens/s `replica` is taken to prefill: the learned rate if one was set, else the model's."""
        load = self.replicas.get(replica)
        return (load is not None and load.prefill_tokens_per_s) or self.model.prefill_tokens_per_s

    def set_decode_step_scale(self, replica: str, scale: float | None) -> None:
        """Scale `replica`'s decode step terms by `scale` (None: as configured)."""
        self._get(replica).decode_step_scale = scale

    def set_prefill_rate(self, replica: str, tokens_per_s: float | None) -> None:
        """Use `tokens_per_s` for `replica`'s queue (None: back to the model's rate). The backlog
        drained so far is folded in at the old rate first."""
        load = self._get(replica)
        self._drain(load)
        load.prefill_tokens_per_s = tokens_per_s

    # ---- the gateway's own accounting -------------------------------------------------
    def on_routed(self, replica: str, prompt_tokens: int, cached_tokens: int = 0,
                  block_hashes: Sequence[int] = ()) -> int:
        """Count a request routed to `replica`; returns the ticket on_finished takes back.
        `block_hashes`: the prompt's, remembered while it runs (see running_prefix). In one C call
        where routing/_decision.c was built (the lines below are the reference)."""
        if _native_routed is not None and NATIVE:
            ticket = _native_routed(self, replica, prompt_tokens, cached_tokens, block_hashes)
            if ticket is not None:
                return ticket  # else not tracked yet: made below
        load = self.replicas.get(replica) or self._get(replica)
        load.waiting += 1
        load.routed += 1
        self.own_total += 1
        uncached = prompt_tokens - cached_tokens if prompt_tokens > cached_tokens else 0
        load.pending_prefill_tokens += uncached
        self._drain(load)
        load.backlog_tokens += uncached
        ticket = next(self._tickets)
        if len(block_hashes):
            load.running_prompts[ticket] = block_hashes
        return ticket

    def on_first_token(self, replica: str, prompt_tokens: int, cached_tokens: int = 0) -> None:
        """Same arguments as on_routed (the gateway passes what it predicted then)."""
        if _native_first_token is not None and NATIVE \
                and _native_first_token(self, replica, prompt_tokens, cached_tokens) is not None:
            return
        load = self.replicas.get(replica) or self._get(replica)
        if load.waiting:
            load.waiting -= 1  # and decoding += 1 below: own_total stays
        else:
            self.own_total += 1  # decoding without having been counted as waiting
        if prompt_tokens > cached_tokens:
            pending = load.pending_prefill_tokens - (prompt_tokens - cached_tokens)
            load.pending_prefill_tokens = pending if pending > 0 else 0
        self._drain(load)
        if load.backlog_tokens > load.pending_prefill_tokens:
            load.backlog_tokens = load.pending_prefill_tokens
        load.decoding += 1
        load.decoding_context_tokens += prompt_tokens

    def on_finished(self, replica: str, prompt_tokens: int, cached_tokens: int = 0,
                    started_decoding: bool = True, ticket: int | None = None) -> None:
        """Request over (done, failed or cancelled); started_decoding: on_first_token was called;
        ticket: what on_routed returned."""
        if _native_finished is not None and NATIVE \
                and _native_finished(self, replica, prompt_tokens, cached_tokens, started_decoding, ticket) is not None:
            return
        load = self.replicas.get(replica) or self._get(replica)
        if not started_decoding:
            self.on_first_token(replica, prompt_tokens, cached_tokens)
        if load.decoding:
            load.decoding -= 1
            self.own_total -= 1
        context = load.decoding_context_tokens - prompt_tokens
        load.decoding_context_tokens = context if context > 0 else 0
        if ticket is not None:
            load.running_prompts.pop(ticket, None)

    def _drain(self, load: ReplicaLoad) -> None:
        """Fold the prefill done since backlog_at into the backlog (at the replica's rate): what
        it was then, less what the replica prefilled since, never below 0."""
        now = self.clock()
        at = load.backlog_at
        if now > at:
            left = load.backlog_tokens - (now - at) * (load.prefill_tokens_per_s or self.model.prefill_tokens_per_s)
            load.backlog_tokens = left if left > 0.0 else 0.0
            load.backlog_at = now

    def own_in_flight(self, replica: str) -> int:
        """Our own requests on `replica` (routed, not yet finished): the gateway's admission count."""
        load = self.replicas.get(replica)
        return 0 if load is None else load.waiting + load.decoding

    def with_room(self, replicas: Sequence[str], limit: int) -> list[str]:
        """The replicas among `replicas` with fewer than `limit` of our requests (own_in_flight),
        in their order: admission's check, one call for a request's candidates. Under `limit` in
        all, `replicas` itself (a tuple: nothing to copy)."""
        if self.own_total < limit:
            return replicas
        loads = self.replicas
        out = []
        for name in replicas:
            load = loads.get(name)
            if load is None or load.waiting + load.decoding < limit:
                out.append(name)
        return out

    def running_prefix(self, replica: str, block_hashes: Sequence[int], depth: int) -> bool:
        """Is one of our requests in flight on `replica` sharing this prompt's first `depth`
        blocks? (Chained hashes: equal hash at depth-1 means equal prefix.) A loop over that
        replica's running requests, asked only of a replica the balance guard is about to pass over."""
        load = self.replicas.get(replica)
        if load is None or depth < 1 or not load.running_prompts:
            return False
        key = block_hashes[depth - 1]
        for running in load.running_prompts.values():  # a loop, not any(generator): 0.3 against 1.1 us
            if len(running) >= depth and running[depth - 1] == key:
                return True
        return False

    def scrape_window(self, replica: str) -> tuple[int, int, int]:
        """Taken when a scrape is sent, handed to on_scrape with its answer: (waiting, in flight,
        routed so far) of our own requests there."""
        load = self._get(replica)
        return load.waiting, load.waiting + load.decoding, load.routed

    def own_during(self, replica: str, window: tuple[int, int, int] | None) -> tuple[int, int]:
        """(waiting, in flight) of ours that the replica may have counted in a scrape sent at
        `window` and answered now: those there when it was sent plus those routed since. Our
        counts as of the answer alone miss a request that finished meanwhile but was running
        when the replica wrote its page: that request then reads as traffic from elsewhere, a
        phantom load kept for stale_after_s (a test saw a lone client's prefix sent away from its
        cache by one)."""
        load = self._get(replica)
        if window is None:
            return load.waiting, load.waiting + load.decoding
        waiting, in_flight, routed = window
        since = max(load.routed - routed, 0)
        return waiting + since, in_flight + since

    def on_scrape(self, replica: str, scraped: ScrapedLoad, now: float,
                  window: tuple[int, int, int] | None = None) -> None:
        """A scrape's answer; `window`: scrape_window() as the scrape was sent."""
        load = self._get(replica)
        scraped.at_s = now
        scraped.ours_waiting, scraped.ours_in_flight = self.own_during(replica, window)
        scraped.extra = scraped.external()  # once per scrape, not once per candidate of every decision
        load.scraped = scraped

    # ---- the estimate -----------------------------------------------------------------
    def in_flight(self, replica: str, now: float) -> float:
        """Requests queued or running: ours, plus others' the last fresh scrape saw."""
        return self.loads_and_delays((replica,), now)[0][0]

    def queue_delay_s(self, replica: str, now: float) -> float:
        """Seconds a new request waits before its own prefill starts: the uncached prefill
        ahead of it plus one decode step per pending token-step of the running batch. The prefill
        ahead is what the requests without a first token still need, less what the replica has
        done since they were routed (at its prefill rate): a 2,000-token prompt routed
        200 ms ago is not 250 ms of work ahead any more."""
        return self.loads_and_delays((replica,), now)[1][0]

    def loads_and_delays(self, replicas, now: float, estimates: bool | type = False) -> tuple:
        """(in_flight, queue_delay_s) of each replica, in one pass: a policy's per-decision loop
        over its candidates (plain attribute reads and arithmetic, ~0.5 us a replica); with
        `estimates`, a third item: each one's EstimateLog for the request record, in a list, or
        with estimates=bytes their JSON object by replica name, the record's `load_estimate` as
        it will be written (routing/_decision.c writes it in the same pass: no objects made)."""
        if _native_loads_and_delays is not None and NATIVE:
            out = _native_loads_and_delays(self, replicas, now, (bytes if estimates is bytes else EstimateLog)
                                           if estimates else None)
            if out is not None:  # else a replica not tracked yet: the loop below adds it
                return out
        m = self.model
        stale_after_s, configured_rate = m.stale_after_s, m.prefill_tokens_per_s
        step_base_s, step_per_seq_s = m.decode_step_base_s, m.decode_step_s_per_seq
        get = self.replicas.get
        loads: list[float] = []
        delays: list[float] = []
        records: list[EstimateLog] = []
        fresh_after_s = now - stale_after_s
        for replica in replicas:
            load = get(replica) or self._get(replica)
            tokens_per_s = load.prefill_tokens_per_s or configured_rate
            pending_tokens = load.pending_prefill_tokens
            if pending_tokens:  # what _drain would leave of the backlog, inline (no call a candidate)
                elapsed = now - load.backlog_at
                left = load.backlog_tokens - elapsed * tokens_per_s if elapsed > 0 else load.backlog_tokens
                if left < pending_tokens:
                    pending_tokens = left if left > 0.0 else 0.0
            waiting, running = load.waiting, load.decoding
            in_flight = waiting + running
            scraped = load.scraped
            extra_waiting, extra_running = scraped.extra
            if (extra_waiting or extra_running) and now - scraped.at_s <= stale_after_s:
                # Traffic we did not route: assume its waiting requests are as long as ours on average.
                in_flight += extra_waiting + extra_running
                if extra_waiting:
                    pending_tokens += extra_waiting * (pending_tokens / waiting if waiting else 512)
                running += int(extra_running)
            loads.append(in_flight)
            # Prefill work ahead, interleaved with the running batch's decode steps.
            scale = load.decode_step_scale
            delay = (pending_tokens / tokens_per_s
                     + ((step_base_s + step_per_seq_s * running) * (1.0 if scale is None else scale)
                        if running else 0.0))
            delays.append(delay)
            if estimates:
                records.append(EstimateLog(waiting, load.pending_prefill_tokens, load.decoding, int(in_flight),
                                           round(delay * 1e6) / 1000, scraped.at_s >= fresh_after_s))
        if estimates is bytes:
            return loads, delays, msgspec.json.encode(dict(zip(replicas, records)))
        return (loads, delays, records) if estimates else (loads, delays)

    def estimate(self, replica: str, now: float) -> LoadEstimate:
        load = self._get(replica)
        return LoadEstimate(load.waiting, load.pending_prefill_tokens, load.decoding,
                            int(self.in_flight(replica, now)), self.queue_delay_s(replica, now),
                            now - load.scraped.at_s <= self.model.stale_after_s)
