"""The gateway's side of routing: owns the RoutingState and the live policy, turns a request into
a routing.RouteRequest, and reports each routed attempt's progress back (load tracker hooks,
prefix-table corrections from the cached tokens a replica reports).

Everything here is synchronous and runs on the event loop between awaits, so a hot reload
(`apply`) never interleaves with a decision. A `Ticket` remembers the state it was routed
with: a request in flight across a reload reports to the tracker it was counted in."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import structlog

from gateway.config import Config, RoutingSection
from observability.metrics import GatewayMetrics
from routing import RouteRequest, RoutingState, make_policy
from routing.hashing import block_hashes
from routing.load import LoadModel, LoadTracker
from routing.prefix_table import as_block_keys

log = structlog.get_logger("kvgate.router")


@dataclass(eq=False)
class Ticket:
    """One routed attempt of one request."""
    replica: str
    model: str
    state: RoutingState
    prompt_tokens: int
    hashes: Sequence[int]
    predicted_cached_tokens: int
    uses_table: bool           # the policy consulted/learned the prefix table
    prefix_key: int | None = None  # what the policy counted as running there (tracker.on_routed)
    started_decoding: bool = False
    done: bool = False


def _load_model(section: RoutingSection) -> LoadModel:
    load = section.load
    return LoadModel(prefill_tokens_per_s=load.prefill_tokens_per_s,
                     decode_step_s_per_seq=load.decode_step_s_per_seq,
                     decode_step_base_s=load.decode_step_base_s, stale_after_s=load.stale_after_s)


class Router:
    def __init__(self, config: Config, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.state: RoutingState | None = None
        self.config: Config | None = None
        self.policy = None
        self.precise: dict[str, bool] = {}          # replica -> KV events currently trusted
        self.expect_events: dict[str, float] = {}   # replica -> since when a BlockStored is overdue
        self.learned_capacity: dict[str, int] = {}  # replica -> blocks, from its /metrics
        self.apply(config)

    # ---- configuration --------------------------------------------------------------------------

    def apply(self, config: Config) -> None:
        """Adopt a (validated) config: policy, weights, replicas added or removed. Raises on a
        policy that cannot be built, before anything changes."""
        routing = config.routing
        policy_state = self.state
        fresh = (policy_state is None or policy_state.block_size != routing.block_size
                 or policy_state.guess_ttl_s != routing.guess_ttl_s)
        if fresh:  # new block size or TTL: the tables' keys/stamps mean something else; start over
            policy_state = RoutingState(LoadTracker(_load_model(routing)), block_size=routing.block_size,
                                        guess_ttl_s=routing.guess_ttl_s)
        policy = make_policy(routing.policy, routing.policy_params(), policy_state)
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

    # ---- one request ----------------------------------------------------------------------------

    def session_key(self, headers, user: str | None) -> str | None:
        return headers.get(self.config.routing.session_header) or user or None

    def hashes(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> np.ndarray:
        """Computed once per request (retries reuse them): ~500 xxh3 calls for an 8k prompt, kept
        as the uint64 array the prefix table reads (no per-decision conversion)."""
        return as_block_keys(block_hashes(prompt_token_ids, self.state.block_size, cache_salt))

    def route(self, candidates: list[str], model: str, prompt_token_ids: Sequence[int],
              hashes: Sequence[int], session_key: str | None, cache_salt: str | None,
              max_new_tokens: int | None):
        state = self.state
        request = RouteRequest(model=model, prompt_token_ids=prompt_token_ids, max_new_tokens=max_new_tokens,
                               block_hashes=hashes, session_key=session_key, cache_salt=cache_salt)
        # The load each candidate looked like before this decision (the record explains the choice).
        estimates = ({name: _estimate_log(state, name) for name in candidates}
                     if self.policy.name != "round_robin" else None)
        policy = self.policy
        decision = policy.choose(candidates, request)
        if decision.policy == "round_robin":  # the one policy that does not count what it routes
            state.tracker.on_routed(decision.replica, len(prompt_token_ids), 0)
        commit = getattr(policy, "commit", None)
        if commit is not None:
            # Approximate mode's guess (a 500-block insert for an 8k prompt) is recorded off the
            # decision path: on the next loop turn, once the request is on its way upstream.
            try:
                asyncio.get_running_loop().call_soon(commit, decision)
            except RuntimeError:  # no loop (called from plain code): record it now
                commit(decision)
        predicted = getattr(decision, "predicted_cached_tokens", 0)
        uses_table = bool(getattr(decision, "matched_blocks", None))
        ticket = Ticket(decision.replica, model, state, len(prompt_token_ids), hashes, predicted, uses_table,
                        getattr(decision, "prefix_key", None))
        if predicted:
            self.metrics.predicted_cached_tokens.labels(replica=decision.replica).inc(predicted)
        entry = decision.as_log()
        entry["mode"] = "precise" if self.precise.get(decision.replica) else "approximate"
        if estimates is not None:
            entry["load_estimate"] = estimates
        return decision, ticket, entry

    def first_token(self, ticket: Ticket) -> None:
        if ticket.started_decoding or ticket.done:
            return
        ticket.started_decoding = True
        if self.precise.get(ticket.replica) and (ticket.prompt_tokens // ticket.state.block_size
                                                 > ticket.predicted_cached_tokens // ticket.state.block_size):
            # It just prefilled full blocks it did not hold: their BlockStored events must follow.
            self.expect_events.setdefault(ticket.replica, ticket.state.clock())
        if ticket.replica in ticket.state.model_of:
            ticket.state.tracker.on_first_token(ticket.replica, ticket.prompt_tokens, ticket.predicted_cached_tokens)

    def finished(self, ticket: Ticket, cached_tokens: int | None, prefilled: bool) -> None:
        """The attempt is over (answered, failed or cancelled). `cached_tokens`: what the replica
        reported, if it did; `prefilled`: the replica computed the prompt (its blocks are there now)."""
        if ticket.done:
            return
        ticket.done = True
        state = ticket.state
        if ticket.replica not in state.model_of:
            return  # removed by a reload while this ran: nothing of it is tracked any more
        state.tracker.on_finished(ticket.replica, ticket.prompt_tokens, ticket.predicted_cached_tokens,
                                  started_decoding=ticket.started_decoding, prefix_key=ticket.prefix_key)
        if cached_tokens is not None:
            self.metrics.reported_cached_tokens.labels(replica=ticket.replica).inc(cached_tokens)
        if not ticket.uses_table or self.precise.get(ticket.replica):
            return  # precise mode: KV events are the truth, they need no correcting
        table = state.table(ticket.model)
        predicted_blocks = ticket.predicted_cached_tokens // state.block_size
        if not prefilled:
            # Routing assumed the whole prompt would be cached there; it never got computed.
            table.correct(ticket.replica, ticket.hashes, predicted_blocks)
        elif cached_tokens is not None and cached_tokens // state.block_size < predicted_blocks:
            # The replica had evicted part of what we believed it held. Drop those claims, then
            # record the prompt again: the replica has just recomputed it, so it holds it now
            # (as the newest entries of its ring, which is what LRU on the replica did too).
            table.correct(ticket.replica, ticket.hashes[:predicted_blocks], cached_tokens // state.block_size)
            table.insert(ticket.replica, ticket.hashes, guessed=True, now=state.clock())


def _estimate_log(state: RoutingState, replica: str) -> dict:
    estimate = state.tracker.estimate(replica, state.clock())
    return {"waiting": estimate.waiting, "pending_prefill_tokens": estimate.pending_prefill_tokens,
            "decoding": estimate.decoding, "in_flight": estimate.in_flight,
            "queue_delay_ms": round(estimate.queue_delay_s * 1000, 3), "scraped_fresh": estimate.scraped_fresh}
