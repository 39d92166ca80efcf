"""What every policy shares: the request it sees, the Policy protocol, the decision record, and
the state that outlives a policy (prefix tables, load tracker: a hot-reloaded policy keeps them).

A policy only decides: `choose` reads the state and returns a decision, it changes nothing.
What a routed request does to the state (counted in the load tracker from routing to its end,
its prompt guessed into the prefix table) is routing.attempt's job, in one place for every policy."""
from __future__ import annotations

import time
from typing import Any, Callable, Protocol, Sequence

import msgspec

from routing.hashing import DEFAULT_BLOCK_SIZE, block_hashes
from routing.load import LoadTracker
from routing.prefix_table import PrefixTable

try:  # routing/_decision.c: the record's routing field written as JSON in one call
    from routing._decision import explain as _explain
except ImportError:  # built without a C compiler: the record keeps routing_log's dict
    _explain = None
NATIVE = True  # False: the dict even where the C writer was built (tests compare the two)


class RouteRequest(msgspec.Struct, frozen=True):
    """What a policy may look at. `block_hashes`: the prompt's chained block hashes
    (routing.hashing.block_hashes), computed once by the gateway and reused; if empty they are
    computed here from prompt_token_ids. `session_key`: the `user` field or the affinity
    header, if any. A Struct, not a dataclass: one is made per request, and its __init__ runs
    in C (a frozen dataclass's ran ~100 opcodes)."""
    model: str
    prompt_token_ids: Sequence[int] = ()
    max_new_tokens: int | None = None
    block_hashes: Sequence[int] = ()
    session_key: str | None = None
    cache_salt: str | None = None


class Decision(Protocol):
    """What the gateway reads of any policy's decision (RoutingDecision's fields)."""
    replica: str
    policy: str
    reason: str
    candidates: tuple[str, ...]
    matched_blocks: dict[str, int]
    load: dict[str, float]
    scores: dict[str, float]
    predicted_cached_tokens: int

    def as_log(self) -> dict: ...


class Policy(Protocol):
    """A routing policy: a pure decision over the candidates and the shared state."""
    name: str
    # Its decisions read the load model's seconds (prefill rate, decode step), which the gateway
    # learns by timing answers: a non-streamed request is then sometimes relayed from a stream.
    timed: bool
    # It reads the prompt's block hashes (request.block_hashes, or state.hashes): the gateway skips
    # computing them for a policy that says False.
    reads_prefixes: bool
    # Its commit learns something (False: the router does not call it).
    learns: bool

    def choose(self, candidates: Sequence[str], request: RouteRequest) -> Decision:
        """The replica for `request` among `candidates` (non-empty), and why. Changes nothing."""

    def commit(self, decision: Decision) -> None:
        """Called once the request is on its way to `decision.replica` (off the decision path):
        what the policy learns from its own routing (approximate mode's guessed prefix)."""


class RoutingDecision(msgspec.Struct, frozen=True):
    """Plain data the gateway logs with the request (and `.replica` it routes to); a Struct, as
    RouteRequest."""
    replica: str
    policy: str
    reason: str
    candidates: tuple[str, ...] = ()
    matched_blocks: dict[str, int] = {}      # msgspec copies a mutable default for each instance
    load: dict[str, float] = {}              # in-flight requests per candidate
    scores: dict[str, float] = {}            # lower is better; seconds for cache_aware
    predicted_cached_tokens: int = 0
    inner: Any = None              # the wrapped policy's own decision (session_affinity's fallback)
    # Class attributes, not fields: what the record's writer asks every decision for (routing_json,
    # gateway/router.py _estimates). Found, not missed: a missed getattr formats an AttributeError
    # message (~2,000 instructions) on every request.
    load_estimates = None
    explain_json = None

    def as_log(self) -> dict:
        return decision_log(self)


def decision_log(decision) -> dict:
    """The `routing` field of a request record, for any decision with RoutingDecision's fields."""
    scores = decision.scores
    return routing_log(decision.policy, decision.reason, decision.replica, decision.candidates,
                       decision.matched_blocks, decision.load, scores.keys(), scores.values(),
                       decision.predicted_cached_tokens)


def routing_log(policy: str, reason: str, chosen: str, candidates, matched_blocks: dict, load: dict,
                scored, scores, predicted_cached_tokens: int) -> dict:
    """The `routing` field's shape; `scores` (of the replicas `scored`) to 6 decimals, as
    round(v, 6) gives them at half its cost."""
    return {"policy": policy, "reason": reason, "chosen": chosen, "candidates": list(candidates),
            "matched_blocks": matched_blocks, "load": load,
            "scores": dict(zip(scored, [round(v * 1e6) / 1e6 for v in scores])),
            "predicted_cached_tokens": predicted_cached_tokens}


def routing_json(decision, mode: str, estimates, retried_after: list | None) -> msgspec.Raw | None:
    """The `routing` field of a request record as JSON, ready to go into the record's encoding:
    routing_log's object plus `mode`, `load_estimate` (EstimateLog by name: a dict, or their JSON
    object already written, bytes) and `retried_after` when given, written by
    routing/_decision.c in one call instead of four dicts built and then encoded. A decision whose
    class has an `explain_json` function (cache_aware's) writes its own with it. None where the C
    module was not built (the record keeps the dict)."""
    if _explain is None or not NATIVE:
        return None
    own = getattr(type(decision), "explain_json", None)
    if own is not None:
        return own(decision, mode, estimates, retried_after)
    m, l, s = decision.matched_blocks, decision.load, decision.scores
    key = None
    if not (m or l or s or estimates or retried_after):  # no numbers (round_robin's): a few lines, repeated
        key = (decision.policy, decision.reason, decision.replica, decision.candidates,
               decision.predicted_cached_tokens, mode)
        written = _WRITTEN.get(key)
        if written is not None:
            return written
    written = msgspec.Raw(_explain(decision.policy, decision.reason, decision.replica, decision.candidates,
                                   m.keys(), m.values(), l.keys(), l.values(), s.keys(), s.values(),
                                   decision.predicted_cached_tokens, mode, estimates, retried_after))
    if key is not None:
        if len(_WRITTEN) >= WRITTEN_KEPT:
            _WRITTEN.clear()
        _WRITTEN[key] = written
    return written


# The routing fields of decisions without matches, loads, scores or estimates, by what they say
# (round_robin's "turn k of n" over one candidate list: n of them): written once, not on every
# record (~1.2 us a request). Raw is immutable: every record shares it.
WRITTEN_KEPT = 4096
_WRITTEN: dict[tuple, msgspec.Raw] = {}


class RoutingState:
    """Prefix tables (one per model) and the load tracker, shared by policies across reloads.

    The gateway registers replicas (`add_replica`) with their KV capacity in blocks, reports
    request progress to `tracker`, and feeds KV events or cached-token reports to `table(model)`."""

    def __init__(self, tracker: LoadTracker | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 guess_ttl_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.tracker = tracker or LoadTracker(clock=clock)
        self.block_size = block_size
        self.guess_ttl_s = guess_ttl_s
        self.clock = clock
        self.tables: dict[str, PrefixTable] = {}
        self.model_of: dict[str, str] = {}

    def table(self, model: str) -> PrefixTable:
        table = self.tables.get(model)
        if table is None:
            table = self.tables[model] = PrefixTable(guess_ttl_s=self.guess_ttl_s)
        return table

    def add_replica(self, replica: str, model: str, capacity_blocks: int) -> None:
        self.model_of[replica] = model
        self.table(model).add_replica(replica, capacity_blocks)

    def remove_replica(self, replica: str) -> None:
        model = self.model_of.pop(replica, None)
        if model is not None:
            self.tables[model].remove_replica(replica)
        self.tracker.remove_replica(replica)

    def hashes(self, request: RouteRequest) -> Sequence[int]:
        hashes = getattr(request, "block_hashes", ())
        if len(hashes) == 0 and request.prompt_token_ids:
            hashes = block_hashes(request.prompt_token_ids, self.block_size, getattr(request, "cache_salt", None))
        return hashes


def require_candidates(candidates: Sequence[str]) -> None:
    if not candidates:
        raise ValueError("no candidates to choose from")
