"""Decisions another process made, adopted here as if this process had made them: how the workers
of one gateway (`gateway.workers` > 1) keep one policy state.

A worker routes a request and commits the decision (routing.policy.Policy.commit); `shareable`
says what of it the other workers need, and each of them passes that to `adopt`, which makes the
same commit on its own policy. Only what a policy learns from its own routing travels:

  cache_aware       the prompt's blocks, guessed on the chosen replica (approximate mode; in precise
                    mode the KV events confirm them), and where its match ended (branch points: a
                    shared system prompt is told apart from a conversation's own history)
  session_affinity  the session's replica (and its fallback's share, when the fallback chose)

The other policies learn nothing from routing: round_robin and least_load balance each worker's
own share (the load each worker sees is shared separately), a hash ring needs no memory.
Pure: no I/O, no clock of its own."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from routing.policies import CacheAware, CacheAwareDecision, SessionAffinity
from routing.policy import RoutingState

_NO_HASHES = np.zeros(0, dtype=np.uint64)


@dataclass(frozen=True)
class SharedDecision:
    replica: str
    hashes: np.ndarray        # the prompt's block keys (uint64); empty when no prefix is learned
    deepest_matched: int      # blocks of the prompt that the best candidate held
    session_key: str | None   # session_affinity: the session that now sticks to `replica`


def shareable(policy, decision, session_key: str | None = None) -> SharedDecision | None:
    """What the other workers must learn from `decision` (made and committed here), or None."""
    if isinstance(policy, SessionAffinity):
        if not session_key:  # the fallback decided alone: share what it learned
            return shareable(policy.fallback, decision)
        inner = shareable(policy.fallback, decision.inner) if decision.inner is not None else None
        return SharedDecision(decision.replica, inner.hashes if inner else _NO_HASHES,
                              inner.deepest_matched if inner else 0, session_key)
    if isinstance(policy, CacheAware) and isinstance(decision, CacheAwareDecision):
        matched = decision.matched_blocks
        return SharedDecision(decision.replica, np.asarray(decision.hashes, dtype=np.uint64),
                              max(matched.values(), default=0), None)
    return None


def adopt(policy, state: RoutingState, model: str, shared: SharedDecision) -> None:
    """Make `shared`'s commit on this process's `policy`, as its own routing would have."""
    if state.model_of.get(shared.replica) != model:
        return  # a replica this process does not route to (a reload in flight): nothing to learn
    if isinstance(policy, SessionAffinity):
        if shared.session_key:
            sticky = policy.sticky
            sticky[shared.session_key] = (shared.replica, state.clock())
            sticky.move_to_end(shared.session_key)
            while len(sticky) > policy.max_sessions:
                sticky.popitem(last=False)
        policy = policy.fallback
    if isinstance(policy, CacheAware) and len(shared.hashes):
        # The decision as commit() reads it: chosen replica, deepest match, table, hashes.
        policy.commit(CacheAwareDecision(shared.replica, (), 0, [shared.deepest_matched], [], [], (), "", 0.0,
                                         state.table(model), shared.hashes))


def block_keys(data: bytes) -> np.ndarray:
    """Hashes sent as raw uint64 bytes (native byte order: the workers run on one machine)."""
    return np.frombuffer(data, dtype=np.uint64) if data else _NO_HASHES


def key_bytes(hashes: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(hashes, dtype=np.uint64).tobytes()
