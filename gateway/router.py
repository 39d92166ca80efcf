"""The gateway's side of routing: owns the RoutingState and the live policy, and turns each try
of a request into one RoutedAttempt, which the proxy enters once per try:

    with router.attempt(candidates, model, prompt_ids, hashes, ...) as attempt:
        ... send to attempt.replica; attempt.first_token() when the first token arrives ...

The attempt owns the try's whole life: counted in the load tracker (routing.attempt), the
in-flight gauge, the policy's commit (approximate mode's guess), the KV events a precise replica
now owes, and on leaving the corrections from the cached tokens the replica reported.

Everything here is synchronous and runs on the event loop between awaits, so a hot reload
(`apply`) never interleaves with a decision. An attempt keeps the state it was routed with: a
request in flight across a reload reports to the tracker it was counted in."""
from __future__ import annotations

import asyncio
import time
from typing import Sequence

import msgspec
import structlog

from gateway.config import Config, RoutingSection
from observability.metrics import GatewayMetrics
from routing import Attempt, Decision, RouteRequest, RoutingState, make_policy
from routing.policy import routing_json
from routing.hashing import block_hashes
from routing.load import EstimateLog, LoadModel, LoadTracker
import routing.load as _load

try:  # routing/_decision.c: RoutedAttempt(...) in one call
    from routing._decision import new_attempt as _new_attempt, set_attempt_parts as _set_attempt_parts
except ImportError:  # built without a C compiler: RoutedAttempt.__init__
    _new_attempt = None
NATIVE = True  # False: RoutedAttempt.__init__ even where the C call was built (tests compare the two)

log = structlog.get_logger("kvgate.router")

# Observed prefill rate (Router.observe_prefill): requests with at least this many uncached
# tokens count (shorter ones are mostly fixed costs). Observed decode step (observe_decode):
# streams of at least DECODE_MIN_TOKENS tokens count. Each sample moves a moving average this
# much; after this many, the load model uses a model's averages (routing.load.learn), adopting a
# new value when it moved by more than LEARN_REFRESH of the one in use; with learning off, a
# replica's prefill rate this many times off the configured one is logged, once.
PREFILL_RATE_MIN_TOKENS = 256
DECODE_MIN_TOKENS = 5
LEARN_ALPHA = 0.2
LEARN_SAMPLES = 8
LEARN_REFRESH = 0.1
PREFILL_RATE_HINT = 2.0
# A learning policy's commit (approximate mode's guess, cache_aware's branch points) for a prompt of
# at most this many blocks is made as the decision is (~0.7 us, the usual prompt); a longer one's
# on the next loop turn.
COMMIT_NOW_BLOCKS = 64
# A non-streamed answer times nothing (it arrives whole), so the first TIMED_FIRST non-streamed
# requests of a model, and one in TIMED_EVERY after, are relayed from a streamed replica anyway
# (times_non_stream): the load model learns from traffic that never streams too. A relayed answer
# costs the gateway about twice a passed-through one, so past TIMED_EVERY / TIMED_GAP_S requests a
# second (320) the timed ones are TIMED_GAP_S apart: 20 samples a second still track the replicas.
TIMED_FIRST = 32
TIMED_EVERY = 16
TIMED_GAP_S = 0.05


def _load_model(section: RoutingSection) -> LoadModel:
    load = section.load
    return LoadModel(prefill_tokens_per_s=load.prefill_tokens_per_s,
                     decode_step_s_per_seq=load.decode_step_s_per_seq,
                     decode_step_base_s=load.decode_step_base_s, stale_after_s=load.stale_after_s)


def _routing_state(routing: RoutingSection) -> RoutingState:
    return RoutingState(LoadTracker(_load_model(routing)), block_size=routing.block_size,
                        guess_ttl_s=routing.guess_ttl_s)


def _policy(routing: RoutingSection, state: RoutingState):
    """The configured policy over `state` (raises on one that cannot be built)."""
    params = routing.policy_params()
    return make_policy(routing.policy, params, state, routing.policy_params(getattr(params, "fallback", None)))


class Router:
    def __init__(self, config: Config, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop (Proxy.start): no getpid() a request
        self.state: RoutingState | None = None
        self.config: Config | None = None
        self.policy = None
        self.reads_prefixes = False
        self.precise: dict[str, bool] = {}          # replica -> KV events currently trusted
        self.expect_events: dict[str, float] = {}   # replica -> since when a BlockStored is overdue
        self.learned_capacity: dict[str, int] = {}  # replica -> blocks, from its /metrics
        self.prefill_rates: dict[str, tuple[float, int]] = {}  # replica -> (observed tokens/s, samples)
        self.model_prefill_rates: dict[str, tuple[float, int]] = {}  # model -> (observed tokens/s, samples)
        self.adopted_prefill_rates: dict[str, float] = {}  # model -> the rate its replicas' queues use
        # model -> (observed token interval / the configured decode step for the batch, samples)
        self.model_decode_scales: dict[str, tuple[float, int]] = {}
        self.adopted_decode_scales: dict[str, float] = {}  # model -> the scale its replicas' decode steps use
        self.non_stream_requests: dict[str, int] = {}  # model -> non-streamed requests so far
        self.last_timed_s: dict[str, float] = {}       # model -> clock of its last timed one (after the first)
        self.apply(config)
        self._warm_up()

    def _warm_up(self) -> None:
        """One decision of the configured policy on a scratch state, with its log and commit, and
        the prefix table's array paths (insert, match, removal, clear), before the first request:
        their first calls cost ~15 ms (numpy's lazy imports: np.unique alone takes 12 ms once),
        which the first requests after a start would otherwise wait for. Nothing real changes."""
        routing = self.config.routing
        scratch = _routing_state(routing)
        for name in ("warm-a", "warm-b"):
            scratch.add_replica(name, "warm", 256)
        policy = _policy(routing, scratch)
        tokens = list(range(1, 40 * routing.block_size + 1))
        hashes = self.hashes(tokens, None)
        decision = policy.choose(["warm-a", "warm-b"], RouteRequest(model="warm", prompt_token_ids=tokens,
                                                                   block_hashes=hashes))
        decision.as_log()
        policy.commit(decision)
        table = scratch.table("warm")
        table.insert("warm-b", hashes, guessed=False, now=scratch.clock())
        table.match(hashes, scratch.clock())
        table.remove("warm-b", hashes)
        table.clear("warm-a")

    # ---- configuration --------------------------------------------------------------------------

    def apply(self, config: Config) -> None:
        """Adopt a (validated) config: policy, weights, replicas added or removed. Raises on a
        policy that cannot be built, before anything changes."""
        routing = config.routing
        policy_state = self.state
        fresh = (policy_state is None or policy_state.block_size != routing.block_size
                 or policy_state.guess_ttl_s != routing.guess_ttl_s)
        if fresh:  # new block size or TTL: the tables' keys/stamps mean something else; start over
            policy_state = _routing_state(routing)
        policy = _policy(routing, policy_state)
        if not fresh:
            policy_state.tracker.model = _load_model(routing)
        wanted = {spec.name: spec for spec in config.replicas}
        for name in [name for name in policy_state.model_of if name not in wanted]:
            policy_state.remove_replica(name)
            self.precise.pop(name, None)
        for spec in config.replicas:
            if policy_state.model_of.get(spec.name) not in (None, spec.model):
                policy_state.remove_replica(spec.name)  # now serves another model: another table
            if spec.name not in policy_state.model_of:
                policy_state.add_replica(spec.name, spec.model, self._capacity(spec, routing))
        self.state, self.policy, self.config = policy_state, policy, config
        self.reads_prefixes = policy.reads_prefixes  # whether it routes on the prompt's block hashes
        if not routing.load.learn:
            self.adopted_prefill_rates.clear()
            self.adopted_decode_scales.clear()
        self._push_learned(spec.name for spec in config.replicas)  # a new or rebuilt state, a replica added

    def _capacity(self, spec, routing: RoutingSection) -> int:
        return spec.capacity_blocks or self.learned_capacity.get(spec.name) or routing.default_capacity_blocks

    def learn_capacity(self, replica: str, blocks: int) -> None:
        """A replica's /metrics said how many KV blocks it has; size its table to match (once)."""
        if blocks <= 0 or self.learned_capacity.get(replica) == blocks:
            return
        self.learned_capacity[replica] = blocks
        spec = next((s for s in self.config.replicas if s.name == replica), None)
        if spec is None or spec.capacity_blocks:
            return
        table = self.state.table(spec.model)
        if table.has_replica(replica) and table.capacity(replica) != blocks:
            # Keeps what the table learned for it (and its load): traffic may already be flowing.
            table.resize(replica, blocks, self.state.clock())
            log.info("replica_capacity_learned", replica=replica, capacity_blocks=blocks)

    def observe_prefill(self, replica: str, uncached_tokens: int, seconds: float) -> None:
        """One request's prefill as seen from here (routing to first token, nothing of ours queued
        ahead of it): a moving average per replica, exported as a gauge, and one per model.

        The load model's queue estimates and the cache's worth are in seconds of a prefill rate.
        With routing.load.learn (the default) the model's average becomes that rate for all its
        replicas once it has LEARN_SAMPLES samples (one rate per model: the candidates of a
        decision share it, so their scores stay comparable), logged the first time. Without it, a
        log line says once when a replica's average settles more than PREFILL_RATE_HINT times off
        the configured rate."""
        if seconds <= 0 or uncached_tokens <= 0:
            return
        sample = uncached_tokens / seconds
        rate, samples = _averaged(self.prefill_rates, replica, sample)
        self.metrics.replica_counter(self.metrics.prefill_rate, replica).set(round(rate, 1))
        load = self.config.routing.load
        configured = load.prefill_tokens_per_s
        if not load.learn:
            if samples == LEARN_SAMPLES and not 1 / PREFILL_RATE_HINT <= rate / configured <= PREFILL_RATE_HINT:
                log.info("prefill_rate_differs", replica=replica, observed_tokens_per_s=round(rate),
                         configured_tokens_per_s=configured,
                         hint="set routing.load.prefill_tokens_per_s to what your replicas reach (or "
                              "learn: true): queue estimates are in seconds of that rate")
            return
        model, first = self._learned(self.model_prefill_rates, self.adopted_prefill_rates, replica, sample)
        if model is None:
            return
        rate = self.adopted_prefill_rates[model]
        self.metrics.routing_prefill_rate.labels(model=model).set(round(rate, 1))
        self._push_learned(name for name, of in self.state.model_of.items() if of == model)
        if first:
            log.info("prefill_rate_learned", model=model, tokens_per_s=round(rate),
                     samples=self.model_prefill_rates[model][1], configured_tokens_per_s=configured)

    def observe_decode(self, replica: str, batch: int, tokens: int, seconds: float) -> None:
        """One stream's decode as seen from here: `tokens` after its first in `seconds`, with
        `batch` sequences of ours decoding there when it started. Its mean token interval over the
        step the load model assumes for that batch (decode_step_base_s + decode_step_s_per_seq x
        batch) is one sample of the model's scale; with routing.load.learn, once the average has
        LEARN_SAMPLES samples it scales that model's decode steps in the queue estimates
        (logged the first time, exported as kvgate_routing_decode_step_seconds{model}: one step of
        a batch of one)."""
        load = self.config.routing.load
        predicted = load.decode_step_base_s + load.decode_step_s_per_seq * max(batch, 1)
        if not load.learn or seconds <= 0 or tokens < 1 or predicted <= 0:
            return  # (a stream whose tokens all came in one read times nothing)
        model, first = self._learned(self.model_decode_scales, self.adopted_decode_scales, replica,
                                     seconds / tokens / predicted)
        if model is None:
            return
        configured_step_s = load.decode_step_base_s + load.decode_step_s_per_seq  # a batch of one
        step_s = configured_step_s * self.adopted_decode_scales[model]
        self.metrics.routing_decode_step.labels(model=model).set(round(step_s, 6))
        self._push_learned(name for name, of in self.state.model_of.items() if of == model)
        if first:
            log.info("decode_step_learned", model=model, step_ms=round(step_s * 1000, 3),
                     configured_step_ms=round(configured_step_s * 1000, 3), samples=self.model_decode_scales[model][1])

    def _learned(self, averages: dict, adopted: dict, replica: str, sample: float) -> tuple[str | None, bool]:
        """Fold one sample into its model's average. (model, whether it is the first value) when
        the average is now to be adopted (enough samples, and new or moved by more than
        LEARN_REFRESH of the one in use), else (None, False)."""
        model = self.state.model_of.get(replica)
        if model is None:
            return None, False
        value, samples = _averaged(averages, model, sample)
        current = adopted.get(model)
        if samples < LEARN_SAMPLES or (current is not None and abs(value / current - 1) <= LEARN_REFRESH):
            return None, False
        adopted[model] = value
        return model, current is None

    def _push_learned(self, replicas) -> None:
        """Hand the load tracker what is learned for each replica's model (None where nothing is)."""
        state = self.state
        for name in replicas:
            model = state.model_of.get(name)
            state.tracker.set_prefill_rate(name, self.adopted_prefill_rates.get(model))
            state.tracker.set_decode_step_scale(name, self.adopted_decode_scales.get(model))

    def times_non_stream(self, model: str) -> bool:
        """Whether this non-streamed request of `model` is to be relayed from a streamed replica
        so that its first token and token intervals are timed (TIMED_FIRST, TIMED_EVERY, at most
        one per TIMED_GAP_S), for a policy that reads the load model's seconds."""
        if not self.policy.timed:
            return False
        count = self.non_stream_requests.get(model, 0)
        self.non_stream_requests[model] = count + 1
        if count < TIMED_FIRST:
            return True
        if count % TIMED_EVERY:
            return False
        now = self.state.clock()
        if now - self.last_timed_s.get(model, float("-inf")) < TIMED_GAP_S:
            return False
        self.last_timed_s[model] = now
        return True

    # ---- one request ----------------------------------------------------------------------------

    def session_key(self, headers, user: str | None) -> str | None:
        return headers.get(self.config.routing.session_header) or user or None

    def hashes(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> list[int]:
        """Computed once per request (retries reuse them): ~500 xxh3 calls for an 8k prompt, kept
        as the list of ints they come as: the prefix table's C calls read a list in place (a uint64
        array made from it cost ~1 us a request more)."""
        return block_hashes(prompt_token_ids, self.state.block_size, cache_salt)

    def attempt(self, candidates: list[str], model: str, prompt_token_ids: Sequence[int],
                hashes: Sequence[int], session_key: str | None, cache_salt: str | None,
                max_new_tokens: int | None) -> "RoutedAttempt":
        """Choose a replica among `candidates` and start one try there (see the module docstring)."""
        state = self.state
        request = RouteRequest(model=model, prompt_token_ids=prompt_token_ids, max_new_tokens=max_new_tokens,
                               block_hashes=hashes, session_key=session_key, cache_salt=cache_salt)
        policy = self.policy
        decision = policy.choose(candidates, request)
        # The load each candidate looked like when it was chosen (the record explains the choice).
        estimates = _estimates(state, candidates, decision) if policy.name != "round_robin" else None
        if policy.learns:
            if len(hashes) <= COMMIT_NOW_BLOCKS:
                policy.commit(decision)  # the usual prompt: no loop callback a request
            else:
                try:
                    # A long prompt's guess (a 500-block insert for an 8k prompt) is recorded off the
                    # decision path: on the next loop turn, once the request is on its way upstream.
                    (self.loop or asyncio.get_running_loop()).call_soon(policy.commit, decision)
                except RuntimeError:  # no loop (called from plain code): record it now
                    policy.commit(decision)
        if _new_attempt is not None and NATIVE:  # RoutedAttempt.__init__'s lines in one C call
            attempt = _new_attempt(RoutedAttempt, self, state, decision, model, len(prompt_token_ids), hashes,
                                   estimates, _load.NATIVE)
            if attempt is not None:
                return attempt
        return RoutedAttempt(self, state, decision, model, len(prompt_token_ids), hashes, estimates)


class RoutedAttempt(Attempt):
    """One try of one request on the replica its policy chose: routing/attempt.py's bookkeeping
    (one object, not one wrapping the other: a try is on every request's path), plus what the
    gateway adds to it (metrics, KV-event expectations, the learned prefill and decode rates, the
    record's explanation). Leaving the `with` block ends it, however the try ended:
    `cached_tokens` (set from the replica's usage, if it said) is what corrects approximate mode's
    table. Router.attempt makes it in one C call (routing/_decision.c new_attempt: these slots set
    in place, the tracker's count made there) where it was built; __init__ is the reference."""
    __slots__ = ("router", "cached_tokens", "first_token_s", "routed_s", "prefill_sample", "batch",
                 "decode_sample", "retried_after", "_mode", "_estimates", "_log")

    def __init__(self, router: Router, state: RoutingState, decision: Decision, model: str, prompt_tokens: int,
                 hashes: Sequence[int], estimates: dict | bytes | None) -> None:
        Attempt.__init__(self, state, decision, model, prompt_tokens, hashes)
        self.router = router
        replica = self.replica
        self.cached_tokens: int | None = None
        self.first_token_s: float | None = None   # perf_counter when this try's first token came
        self.routed_s = time.perf_counter()
        load = state.tracker.replicas.get(replica)
        # Its first token can time the replica's prefill (Router.observe_prefill): nothing of ours
        # is queued ahead of it (the caller clears it when the first token is the whole answer).
        self.prefill_sample = load is not None and load.waiting <= 1
        self.batch = 1  # ours decoding there once this one started (its own included)
        # (tokens after the first, seconds they took), set by the caller for a try that streamed
        # its whole answer: times the replica's decode step (Router.observe_decode)
        self.decode_sample: tuple[int, float] | None = None
        # The record's explanation is built when first read (the record is written after the
        # answer), not before the request goes upstream: what it says is fixed now.
        self._mode = "precise" if router.precise.get(replica) else "approximate"
        self._estimates = estimates
        self._log: dict | None = None
        self.retried_after: list[str] | None = None  # the replicas this request failed on before

    @property
    def log(self) -> dict:
        """The `routing` field of the request record: the decision's explanation, the replica's
        routing mode, each candidate's load estimate, the replicas tried before."""
        out = self._log
        if out is None:
            out = self._log = self.decision.as_log()
            out["mode"] = self._mode
            estimates = self._estimates
            if type(estimates) is bytes:  # the decision's own, written as JSON when it was made
                estimates = msgspec.json.decode(estimates)
            if estimates is not None:
                out["load_estimate"] = estimates
        if self.retried_after:
            out["retried_after"] = self.retried_after
        return out

    def log_json(self):
        """`log` as the record's JSON (routing.policy.routing_json), built once, at the record's
        encoding; the dict where the C writer was not built."""
        raw = routing_json(self.decision, self._mode, self._estimates, self.retried_after or None)
        return self.log if raw is None else raw

    def first_token(self) -> None:
        """The replica prefilled the prompt: its first token (or, not streamed, its answer) came."""
        if not Attempt.first_token(self):
            return
        self.first_token_s = time.perf_counter()
        state = self.state
        load = state.tracker.replicas.get(self.replica)
        self.batch = load.decoding if load is not None else 1
        if self.router.precise.get(self.replica) and (self.prompt_tokens // state.block_size
                                                      > self.predicted_cached_tokens // state.block_size):
            # It just prefilled full blocks it did not hold: their BlockStored events must follow.
            self.router.expect_events.setdefault(self.replica, state.clock())

    def __enter__(self) -> "RoutedAttempt":
        return self

    def __exit__(self, *_exc) -> None:
        router, replica = self.router, self.replica
        if self.done:
            return
        predicted = self.predicted_cached_tokens
        if self.cached_tokens is not None:
            # The try's predicted and reported cached tokens, counted together as it ends.
            metrics = router.metrics
            metrics.add(metrics.reported_cached_tokens, replica, self.cached_tokens,
                        metrics.predicted_cached_tokens if predicted else None, predicted)
            uncached = self.prompt_tokens - self.cached_tokens
            if self.prefill_sample and self.first_token_s is not None and uncached >= PREFILL_RATE_MIN_TOKENS:
                router.observe_prefill(replica, uncached, self.first_token_s - self.routed_s)
        elif predicted:
            metrics = router.metrics
            metrics.add(metrics.predicted_cached_tokens, replica, predicted)
        if self.decode_sample is not None and self.decode_sample[0] >= DECODE_MIN_TOKENS - 1:
            router.observe_decode(replica, self.batch, *self.decode_sample)
        self.finish(self.cached_tokens, precise=bool(router.precise.get(replica)))


if _new_attempt is not None:  # the class and clock the C call makes a try with
    _set_attempt_parts(RoutedAttempt, time.perf_counter)


def _estimates(state: RoutingState, candidates: list[str], decision: Decision) -> dict[str, EstimateLog] | bytes:
    """Each candidate's load estimate as the policy decided on it (choose() changes no load; the
    try is counted right after this): what the policy's pass of the tracker wrote (cache_aware's:
    the JSON object, bytes), else one pass of the tracker now (EstimateLog by name)."""
    estimates = getattr(decision, "load_estimates", None)
    if estimates is not None:
        return estimates
    return dict(zip(candidates, state.tracker.loads_and_delays(candidates, state.clock(), estimates=True)[2]))


def _averaged(averages: dict[str, tuple[float, int]], key: str, sample: float) -> tuple[float, int]:
    """Move `key`'s moving average (LEARN_ALPHA) by one sample; the first starts it at itself."""
    rate, samples = averages.get(key, (sample, 0))
    rate += (sample - rate) * LEARN_ALPHA
    averages[key] = (rate, samples + 1)
    return rate, samples + 1
