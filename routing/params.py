"""Each policy's parameters and their defaults, declared once: the routing YAML decodes into these
structs (gateway/config.py), and the policies are built from them (routing/registry.py).

Unknown keys are errors (`forbid_unknown_fields`): a typo never falls back to a default."""
from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

NonNegative = Annotated[float, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
Factor = Annotated[float, Meta(ge=1)]


class RoundRobinParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class LeastLoadParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    seed: int | None = None          # power-of-two sampling; None: a fresh seed per start


class ConsistentHashParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    virtual_nodes: PositiveInt = 100
    epsilon: NonNegative = 0.25      # a replica over (1 + epsilon) x mean load is skipped
    key_blocks: PositiveInt = 4      # the ring key: the hash of the prompt's first key_blocks blocks


class CacheAwareParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """score = prefill_weight x uncached-prefill seconds + queue_weight x queueing seconds."""
    # 2: a replica's uncached prefill delays this request's first token and, as long again, the
    # requests queued behind it there; a cached prefix spares both. At 1 (this request's TTFT
    # alone) conversations left their history for a few ms less queueing and recomputed it
    # elsewhere, a second copy in the pool: on the Mooncake conversation trace (4 x 3,072-block
    # replicas) 32 of 600 requests lost 6,032 cached tokens that way, hit rate 0.85 of the pooled
    # oracle; at 2, 0.95 (bench.cache_routing --workloads c --trace FILE --capacity-blocks 3072).
    prefill_weight: NonNegative = 2.0
    queue_weight: NonNegative = 1.0
    balance_factor: Factor = 1.25    # a replica over factor x mean in-flight (+ slack) gets no new request
    balance_slack: NonNegative = 0.0  # ... when it already runs this prefix (a hot prefix spreads out)
    follow_slack: NonNegative = 2.0  # extra room for a replica that only holds the prefix in its cache
    follow_abs_slack: NonNegative = 2.0  # ... which may always be this many requests above the least loaded
    #                                     (at a mean load of 0.5, a factor of it says little)
    min_match_blocks: Annotated[int, Meta(ge=0)] = 1   # shorter matches count as no match
    # A cached prefix that many requests share (where they branch off: a system prompt) steers the
    # choice only when it covers at least this fraction of the prompt: a new conversation behind a
    # shared system prompt does not follow the replica that cached it first; its own history does.
    follow_min_fraction: Annotated[float, Meta(ge=0, le=1)] = 0.5
    learn_from_routing: bool = True  # approximate mode: a routed prompt is assumed cached there
    # New content (a tie) goes to the replica that took the fewest new blocks (per block of its
    # cache) of late, counted with this half-life: once caches are full, where it lives longest.
    turnover_half_life_s: Annotated[float, Meta(gt=0)] = 20.0


class SessionAffinityParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    fallback: str = "cache_aware"    # policy for a request without a session, or a session that moves
    max_sessions: PositiveInt = 100_000
    ttl_s: Annotated[float, Meta(gt=0)] = 3600.0
    balance_factor: Factor = 1.25
    balance_slack: NonNegative = 0.0
