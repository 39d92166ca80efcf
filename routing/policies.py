"""The routing policies beyond round robin, each a class with `choose(candidates, request)`.

least_load       power of two choices on the load estimate
consistent_hash  hash ring with virtual nodes, bounded load (a replica over (1+epsilon) x mean is skipped)
cache_aware      min over candidates of prefill cost of the uncached tokens + queueing delay,
                 among those a balance guard allows
session_affinity sticky session -> replica map (bounded, TTL) in front of another policy

Policies that route (all but round_robin) record the routing in the shared state: the load
tracker's on_routed, and (cache_aware, approximate mode) the prompt's blocks as guessed on the
chosen replica. The gateway then reports on_first_token / on_finished to `state.tracker`.
"""
from __future__ import annotations

import bisect
import random
from collections import OrderedDict
from typing import Sequence

import xxhash

from routing.policy import RoutingDecision, RoutingState, register, require_candidates
from routing.round_robin import RequestInfo, RoundRobin


def _take(params: dict, policy: str, **defaults):
    values = {key: type(default)(params.pop(key, default)) if default is not None else params.pop(key, None)
              for key, default in defaults.items()}
    if params:
        raise ValueError(f"unknown key(s) for routing policy {policy!r}: {', '.join(sorted(params))}")
    return values


def _loads(state: RoutingState, candidates: Sequence[str], now: float) -> dict[str, float]:
    return {name: state.tracker.in_flight(name, now) for name in candidates}


def _within_bound(loads: dict[str, float], factor: float, slack: float) -> list[str]:
    """Candidates that may take one more request without exceeding factor x the mean load
    (counting that request); the least loaded are always allowed."""
    n = len(loads)
    cap = factor * (sum(loads.values()) + 1) / n + slack
    allowed = [name for name, load in loads.items() if load + 1 <= cap]
    if not allowed:
        low = min(loads.values())
        allowed = [name for name, load in loads.items() if load == low]
    return allowed


@register("round_robin")
def _round_robin(params: dict, state: RoutingState):
    _take(params, "round_robin")
    return RoundRobin()


class LeastLoad:
    name = "least_load"

    def __init__(self, state: RoutingState, seed: int | None = None) -> None:
        self.state = state
        self.random = random.Random(seed)

    def choose(self, candidates: Sequence[str], request: RequestInfo) -> RoutingDecision:
        require_candidates(candidates)
        now = self.state.clock()
        sample = list(candidates) if len(candidates) <= 2 else self.random.sample(list(candidates), 2)
        loads = _loads(self.state, sample, now)
        tracker = self.state.tracker
        chosen = min(sample, key=lambda name: (loads[name], tracker.queue_delay_s(name, now)))
        tracker.on_routed(chosen, len(request.prompt_token_ids), 0)
        return RoutingDecision(chosen, self.name, f"least loaded of {len(sample)} sampled", tuple(candidates),
                               load=loads, scores={name: loads[name] for name in sample})


@register("least_load")
def _least_load(params: dict, state: RoutingState):
    values = _take(params, "least_load", seed=None)
    return LeastLoad(state, values["seed"])


class ConsistentHash:
    name = "consistent_hash"

    def __init__(self, state: RoutingState, virtual_nodes: int = 100, epsilon: float = 0.25,
                 key_blocks: int = 4) -> None:
        self.state = state
        self.virtual_nodes = virtual_nodes
        self.epsilon = epsilon
        self.key_blocks = key_blocks
        self._ring_for: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, candidates: Sequence[str]) -> tuple[list[int], list[str]]:
        key = tuple(candidates)
        if key != self._ring_for:  # rebuilt only when the candidate set changes
            points = sorted((xxhash.xxh3_64_intdigest(f"{name}#{i}".encode()), name)
                            for name in candidates for i in range(self.virtual_nodes))
            self._points = [p for p, _ in points]
            self._owners = [name for _, name in points]
            self._ring_for = key
        return self._points, self._owners

    def routing_key(self, request: RequestInfo) -> tuple[int, str]:
        session = getattr(request, "session_key", None)
        if session:
            return xxhash.xxh3_64_intdigest(session.encode()), "session key"
        hashes = self.state.hashes(request)
        if len(hashes):
            return int(hashes[min(self.key_blocks, len(hashes)) - 1]), f"first {min(self.key_blocks, len(hashes))} blocks"
        return xxhash.xxh3_64_intdigest(repr(list(request.prompt_token_ids)).encode()), "short prompt"

    def choose(self, candidates: Sequence[str], request: RequestInfo) -> RoutingDecision:
        require_candidates(candidates)
        now = self.state.clock()
        points, owners = self._ring(candidates)
        key, key_kind = self.routing_key(request)
        loads = _loads(self.state, candidates, now)
        allowed = set(_within_bound(loads, 1 + self.epsilon, 0.0))
        start = bisect.bisect_left(points, key)
        skipped: list[str] = []
        chosen = None
        for step in range(len(points)):  # walks past at most every virtual node once
            owner = owners[(start + step) % len(points)]
            if owner in allowed:
                chosen = owner
                break
            if owner not in skipped:
                skipped.append(owner)
        assert chosen is not None  # `allowed` is never empty
        self.state.tracker.on_routed(chosen, len(request.prompt_token_ids), 0)
        reason = f"ring owner of {key_kind}" + (f", skipped over-loaded {', '.join(skipped)}" if skipped else "")
        return RoutingDecision(chosen, self.name, reason, tuple(candidates), load=loads)


@register("consistent_hash")
def _consistent_hash(params: dict, state: RoutingState):
    values = _take(params, "consistent_hash", virtual_nodes=100, epsilon=0.25, key_blocks=4)
    return ConsistentHash(state, **values)


class CacheAware:
    """score(r) = prefill_weight * uncached_tokens(r) / prefill_tokens_per_s
                + queue_weight * queue_delay_s(r), in seconds; lowest wins among the replicas
    the balance guard allows (load + 1 <= balance_factor x mean + balance_slack)."""
    name = "cache_aware"

    def __init__(self, state: RoutingState, prefill_weight: float = 1.0, queue_weight: float = 1.0,
                 balance_factor: float = 1.25, balance_slack: float = 0.0, min_match_blocks: int = 1,
                 learn_from_routing: bool = True) -> None:
        self.state = state
        self.prefill_weight = prefill_weight
        self.queue_weight = queue_weight
        self.balance_factor = balance_factor
        self.balance_slack = balance_slack
        self.min_match_blocks = min_match_blocks
        self.learn_from_routing = learn_from_routing  # approximate mode: a routed prompt is assumed cached there

    def choose(self, candidates: Sequence[str], request: RequestInfo) -> RoutingDecision:
        require_candidates(candidates)
        state, tracker = self.state, self.state.tracker
        now = state.clock()
        hashes = state.hashes(request)
        table = state.table(request.model)
        matched = table.match(hashes, now, candidates) if len(hashes) else {name: 0 for name in candidates}
        prompt_tokens = len(request.prompt_token_ids)
        block = state.block_size
        tokens_per_s = tracker.model.prefill_tokens_per_s
        loads = _loads(state, candidates, now)
        allowed = _within_bound(loads, self.balance_factor, self.balance_slack)
        scores = {}
        for name in candidates:
            blocks = matched[name] if matched[name] >= self.min_match_blocks else 0
            uncached = max(prompt_tokens - blocks * block, 0)
            scores[name] = (self.prefill_weight * uncached / tokens_per_s
                            + self.queue_weight * tracker.queue_delay_s(name, now))
        # Ties (e.g. nothing cached anywhere, all idle) go to the least loaded, then config order.
        chosen = min(allowed, key=lambda name: (scores[name], loads[name]))
        best = max(candidates, key=lambda name: matched[name])
        if chosen == best or matched[best] == matched[chosen]:
            reason = (f"longest prefix ({matched[chosen]} blocks) at lowest cost" if matched[chosen]
                      else "no cached prefix; lowest queueing delay")
        elif best not in allowed:
            reason = f"balance guard: {best} holds {matched[best]} blocks but is over {self.balance_factor}x mean load"
        else:
            reason = f"queueing at {best} outweighs its {matched[best] - matched[chosen]} extra cached blocks"
        cached_tokens = min(matched[chosen] * block, prompt_tokens)
        tracker.on_routed(chosen, prompt_tokens, cached_tokens)
        if self.learn_from_routing and len(hashes):
            table.insert(chosen, hashes, guessed=True, now=now)
        return RoutingDecision(chosen, self.name, reason, tuple(candidates), matched_blocks=matched,
                               load=loads, scores=scores, predicted_cached_tokens=cached_tokens)


@register("cache_aware")
def _cache_aware(params: dict, state: RoutingState):
    values = _take(params, "cache_aware", prefill_weight=1.0, queue_weight=1.0, balance_factor=1.25,
                   balance_slack=0.0, min_match_blocks=1, learn_from_routing=True)
    return CacheAware(state, **values)


class SessionAffinity:
    """A session (the `user` field or an affinity header) sticks to the replica it first got,
    while that replica is a candidate and within the balance bound; otherwise `fallback` picks
    and the session moves. The map is bounded (LRU) and entries expire after `ttl_s`."""
    name = "session_affinity"

    def __init__(self, state: RoutingState, fallback, max_sessions: int = 100_000, ttl_s: float = 3600.0,
                 balance_factor: float = 1.25, balance_slack: float = 0.0) -> None:
        self.state = state
        self.fallback = fallback
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.balance_factor = balance_factor
        self.balance_slack = balance_slack
        self.sticky: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def choose(self, candidates: Sequence[str], request: RequestInfo) -> RoutingDecision:
        require_candidates(candidates)
        key = getattr(request, "session_key", None)
        if not key:
            return self.fallback.choose(candidates, request)
        now = self.state.clock()
        entry = self.sticky.get(key)
        if entry is not None and now - entry[1] <= self.ttl_s and entry[0] in candidates:
            loads = _loads(self.state, candidates, now)
            if entry[0] in _within_bound(loads, self.balance_factor, self.balance_slack):
                self.sticky[key] = (entry[0], now)
                self.sticky.move_to_end(key)
                self.state.tracker.on_routed(entry[0], len(request.prompt_token_ids), 0)
                return RoutingDecision(entry[0], self.name, "session affinity", tuple(candidates), load=loads)
        decision = self.fallback.choose(candidates, request)
        self.sticky[key] = (decision.replica, now)
        self.sticky.move_to_end(key)
        while len(self.sticky) > self.max_sessions:
            self.sticky.popitem(last=False)
        moved = "moved" if entry is not None else "new"
        return RoutingDecision(decision.replica, self.name, f"{moved} session; {decision.policy}: {decision.reason}",
                               tuple(candidates), getattr(decision, "matched_blocks", {}),
                               getattr(decision, "load", {}), getattr(decision, "scores", {}),
                               getattr(decision, "predicted_cached_tokens", 0))


@register("session_affinity")
def _session_affinity(params: dict, state: RoutingState):
    from routing.policy import make_policy
    fallback_name = params.pop("fallback", "cache_aware")
    fallback_params = params.pop("fallback_params", {})
    values = _take(params, "session_affinity", max_sessions=100_000, ttl_s=3600.0, balance_factor=1.25,
                   balance_slack=0.0)
    return SessionAffinity(state, make_policy(fallback_name, fallback_params, state), **values)
