"""The routing policies by their config name: one explicit table, each entry the policy's
parameter struct (routing/params.py, what its YAML section decodes into) and how it is built."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import msgspec

from routing.params import (CacheAwareParams, ConsistentHashParams, LeastLoadParams, RoundRobinParams,
                            SessionAffinityParams)
from routing.policies import CacheAware, ConsistentHash, LeastLoad, SessionAffinity
from routing.policy import Policy, RoutingState
from routing.round_robin import RoundRobin


@dataclass(frozen=True)
class PolicySpec:
    params: type[msgspec.Struct]
    build: Callable[..., Policy]   # build(params, state, fallback) -> Policy


def _session_affinity(params: SessionAffinityParams, state: RoutingState, fallback: Policy) -> Policy:
    return SessionAffinity(state, fallback, params.max_sessions, params.ttl_s, params.balance_factor,
                           params.balance_slack)


POLICIES: dict[str, PolicySpec] = {
    "round_robin": PolicySpec(RoundRobinParams, lambda p, state, _: RoundRobin()),
    "least_load": PolicySpec(LeastLoadParams, lambda p, state, _: LeastLoad(state, p.seed)),
    "consistent_hash": PolicySpec(ConsistentHashParams, lambda p, state, _: ConsistentHash(
        state, p.virtual_nodes, p.epsilon, p.key_blocks)),
    "cache_aware": PolicySpec(CacheAwareParams, lambda p, state, _: CacheAware(
        state, p.prefill_weight, p.queue_weight, p.balance_factor, p.balance_slack, p.follow_slack,
        p.min_match_blocks, p.learn_from_routing, p.follow_min_fraction, p.follow_abs_slack,
        p.turnover_half_life_s)),
    "session_affinity": PolicySpec(SessionAffinityParams, _session_affinity),
}


def policy_params(name: str, params: msgspec.Struct | dict | None = None) -> msgspec.Struct:
    """`params` as policy `name`'s struct (a dict is validated: unknown keys and bad values raise
    ValueError naming them)."""
    spec = _spec(name)
    if isinstance(params, spec.params):
        return params
    try:
        return msgspec.convert(params or {}, spec.params)
    except msgspec.ValidationError as exc:
        raise ValueError(f"routing policy {name!r}: {exc}") from None


def make_policy(name: str, params: msgspec.Struct | dict | None = None, state: RoutingState | None = None,
                fallback_params: msgspec.Struct | dict | None = None) -> Policy:
    """A policy by its config name. `params`: its struct or YAML keys; `state`: shared tables and
    load (a fresh one if omitted: fine for round_robin, tests and benches); `fallback_params`:
    for session_affinity, its fallback policy's parameters."""
    state = state or RoutingState()
    values = policy_params(name, params)
    fallback = None
    if isinstance(values, SessionAffinityParams):
        if values.fallback not in POLICIES or values.fallback == "session_affinity":
            raise ValueError(f"unknown fallback policy {values.fallback!r} for session_affinity")
        fallback = make_policy(values.fallback, fallback_params, state)
    return _spec(name).build(values, state, fallback)


def _spec(name: str) -> PolicySpec:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r} (expected one of: {', '.join(POLICIES)})") from None
