"""The routing policies beyond round robin, each a class with `choose(candidates, request)`.

least_load       power of two choices on the load estimate
consistent_hash  hash ring with virtual nodes, bounded load (a replica over (1+epsilon) x mean is skipped)
cache_aware      min over candidates of prefill cost of the uncached tokens + queueing delay,
                 among those a balance guard allows
session_affinity sticky session -> replica map (bounded, TTL) in front of another policy

Policies decide and nothing else (routing.policy.Policy): routing.attempt counts what they route
in the load tracker. cache_aware's approximate mode records the prompt's blocks as guessed on the
chosen replica in `commit(decision)`, which the gateway calls right after the decision for a short
prompt and once the request is on its way for a long one (gateway/router.py COMMIT_NOW_BLOCKS);
the other policies' commit does nothing. Parameters: routing/params.py;
the table of names: routing/registry.py.
"""
from __future__ import annotations

import bisect
import random
from collections import OrderedDict
from typing import Any, Sequence

import msgspec
import xxhash

from routing.policy import Policy, RouteRequest, RoutingDecision, RoutingState, require_candidates, routing_log
from routing.prefix_table import native_guess as _native_guess, native_match as _native_match

import routing.load as _load
try:  # routing/_decision.c: cache_aware's choice from the matches and loads, in C
    from routing._decision import (choose_cache_aware as _native_choose, commit_cache_aware as _native_commit,
                                   decide as _native_decide, explain_cache_aware as _explain_cache_aware)
except ImportError:  # built without a C compiler: the Python lines in choose(), and the record's dict
    _native_choose = _native_commit = _native_decide = _explain_cache_aware = None
NATIVE = True  # False: the Python lines even where the C call was built (tests compare the two)
# What choose() asks the load tracker to write of each candidate's estimate for the request record:
# their JSON object (bytes), in the pass that reads the loads.
RECORD_ESTIMATES: type | None = bytes


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


class LeastLoad:
    name = "least_load"
    reads_prefixes = False  # the prompt's block hashes are not asked for
    learns = False
    timed = True  # ties on in-flight requests go to the shorter queue, in seconds

    def __init__(self, state: RoutingState, seed: int | None = None) -> None:
        self.state = state
        self.random = random.Random(seed)

    def choose(self, candidates: Sequence[str], request: RouteRequest) -> RoutingDecision:
        require_candidates(candidates)
        now = self.state.clock()
        sample = list(candidates) if len(candidates) <= 2 else self.random.sample(list(candidates), 2)
        loads = _loads(self.state, sample, now)
        tracker = self.state.tracker
        chosen = min(sample, key=lambda name: (loads[name], tracker.queue_delay_s(name, now)))
        return RoutingDecision(chosen, self.name, f"least loaded of {len(sample)} sampled", tuple(candidates),
                               load=loads, scores={name: loads[name] for name in sample})

    def commit(self, decision: RoutingDecision) -> None:
        """Learns nothing from its own routing."""


class ConsistentHash:
    name = "consistent_hash"
    reads_prefixes = True
    learns = False
    timed = False

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

    def routing_key(self, request: RouteRequest) -> tuple[int, str]:
        session = getattr(request, "session_key", None)
        if session:
            return xxhash.xxh3_64_intdigest(session.encode()), "session key"
        hashes = self.state.hashes(request)
        if len(hashes):
            return int(hashes[min(self.key_blocks, len(hashes)) - 1]), f"first {min(self.key_blocks, len(hashes))} blocks"
        return xxhash.xxh3_64_intdigest(repr(list(request.prompt_token_ids)).encode()), "short prompt"

    def choose(self, candidates: Sequence[str], request: RouteRequest) -> RoutingDecision:
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
        reason = f"ring owner of {key_kind}" + (f", skipped over-loaded {', '.join(skipped)}" if skipped else "")
        return RoutingDecision(chosen, self.name, reason, tuple(candidates), load=loads)

    def commit(self, decision: RoutingDecision) -> None:
        """Learns nothing from its own routing."""


# A cache is "clearly emptier" when it holds fewer blocks than the others by more than this share
# of the prompt routed: a replica a hair emptier (its KV events a moment behind) must not take
# every new prefix, and a whole conversation's worth of difference must count.
FILL_TOLERANCE_PROMPTS = 0.5
# ... and only while that cache has room to spare: once every cache is this full they all evict
# for each new prompt, their fills move by what each replica evicted a moment ago (noise that
# followed would feed one replica more and more: 246 of 600 trace requests), and the hash decides.
FILL_SPREAD_BELOW = 0.75
# Earlier requests whose deepest match ended after a block that make it a shared prefix (a system
# prompt): a request's own history (a conversation's or an agent's earlier turn) ends its match at
# a deeper block each turn, never where another request's match ended.
BRANCH_SHARED = 1
# Among caches of about the same fill, new content goes where it will live longest: the replica
# whose cache turns over slowest, i.e. that recently took the fewest new blocks for its capacity
# (once full, what each replica evicts is what it was sent). A pool of per-replica LRUs fed evenly
# behaves like one LRU of their summed size; fed by a hash, one of them evicts a prefix that is
# about to be reused while another still keeps older content (bench.cache_routing's trace: hit
# rate 0.83-0.85 of the pooled oracle by hash, 0.92-1.06 by turnover with tail-first rings and
# replicas that reuse empty blocks first).
BRANCH_POINTS_KEPT = 1 << 16  # branch points remembered (LRU): ~100 bytes each
_MIX32 = 0x9E37_79B1  # odd multiplier (2**32 / golden ratio): rendezvous ranks from (replica hash ^ prefix key)
_MASK32 = (1 << 32) - 1
_REBASE_HALVINGS = 64  # turnover's weights start again from 1 past 2 ** this (far from a float's range)
if _native_decide is not None:  # the C tie steps read these, not copies of them
    from routing._decision import set_tie_constants as _set_tie_constants
    _set_tie_constants(FILL_TOLERANCE_PROMPTS, FILL_SPREAD_BELOW, float(_REBASE_HALVINGS))


class CacheAwareDecision(msgspec.Struct, gc=False):
    """A cache_aware decision: the chosen replica plus what explains it, kept as lists aligned
    with the candidates; the dicts and the reason text of the log record are built on demand
    (after the response), not on the decision path. A Struct: its __init__ runs in C (one is
    made per request; untracked by the GC: it holds no reference back to itself)."""
    replica: str
    candidates: tuple
    predicted_cached_tokens: int
    _matched: list
    _loads: list
    _scores: list
    _allowed: Sequence[int] | None  # None: the balance guard allowed every candidate
    _why: str
    _balance_factor: float
    table: Any  # for commit(): where the guess goes
    hashes: Any
    _shared_prefix: bool = False  # the deepest match was a shared prefix too small to steer
    # The record's load estimate from choose()'s pass of the tracker: each candidate's EstimateLog
    # as the JSON object by name (bytes), written in that pass.
    load_estimates: Any = None
    policy = "cache_aware"

    @property
    def matched_blocks(self) -> dict[str, int]:
        return dict(zip(self.candidates, self._matched))

    @property
    def load(self) -> dict[str, float]:
        return dict(zip(self.candidates, self._loads))

    @property
    def scores(self) -> dict[str, float]:
        return dict(zip(self.candidates, self._scores))

    @property
    def reason(self) -> str:
        matched = self._matched
        chosen = self.candidates.index(self.replica)
        best = matched.index(max(matched))  # the first of the deepest
        if matched[best] == matched[chosen]:
            text = (f"longest prefix ({matched[chosen]} blocks) at lowest cost" if matched[chosen]
                    else "no cached prefix; lowest queueing delay")
        elif self._shared_prefix:
            text = (f"new content: the {matched[best]} cached blocks are a prefix other requests share "
                    f"(a system prompt), too small a part of this prompt to follow")
        elif self._allowed is not None and best not in self._allowed:
            text = (f"balance guard: {self.candidates[best]} holds {matched[best]} blocks but is over "
                    f"{self._balance_factor}x mean load")
        else:
            text = (f"queueing at {self.candidates[best]} outweighs its {matched[best] - matched[chosen]} "
                    f"extra cached blocks")
        return text + (f"; tie broken by {self._why}" if self._why else "")

    # explain_json(decision, mode, estimates, retried_after) -> msgspec.Raw: routing.policy.routing_json
    # of a decision of this class, one C call (no Python frame) that reads its fields and words
    # `reason` as the property above does (its reference). None where the C module was not built.
    explain_json = _explain_cache_aware

    def as_log(self) -> dict:
        """decision_log's record, from the aligned lists (no dict of scores made to be rounded)."""
        candidates = self.candidates
        return routing_log(self.policy, self.reason, self.replica, candidates, dict(zip(candidates, self._matched)),
                           dict(zip(candidates, self._loads)), candidates, self._scores, self.predicted_cached_tokens)


if _native_choose is not None and _native_match is not None:  # what the C choose and commit call and make
    from routing._decision import set_choose_parts as _set_choose_parts
    _set_choose_parts(_native_match, _native_guess, CacheAwareDecision, BRANCH_SHARED, BRANCH_POINTS_KEPT)


class CacheAware:
    """score(r) = prefill_weight * uncached_tokens(r) / prefill rate (LoadTracker.prefill_rate)
                + queue_weight * queue_delay_s(r), in seconds; lowest wins among the replicas
    the balance guard allows. prefill_weight (default 2, routing/params.py) counts an uncached
    prefill twice: the request's own wait and the wait it adds for the requests behind it there.

    Balance guard (the bound on a hot prefix): a replica may take one more request while its
    in-flight load + 1 <= balance_factor x mean (counting this request) + balance_slack. A
    replica whose cache holds the prompt's first m >= min_match_blocks blocks gets `follow_slack`
    more requests, unless it is already running a request that shares half of those m blocks: following
    a cache piles up only when the same prefix arrives faster than one replica serves it (that
    prefix is hot and gets the strict bound); a cold prefix sent away from its cache is a miss
    there and a duplicate of its prefix evicting someone else's. Such a replica may also always be
    `follow_abs_slack` requests above the least loaded (at a mean load of 0.5 a factor says
    little; the score's queueing term still weighs those requests). "The same prefix" is judged at
    the depth the prompt would follow, not by its first block: behind a system prompt that every
    request shares, a conversation's next turn follows its own history, and new conversations
    that share only the system prompt spread. The least loaded are always allowed, and with no
    match that steers on any candidate, or the same match on every candidate, the guard does not apply
    (the scores are load alone).

    A match that ends where other routed prompts branched off too (a shared prefix: the system
    prompt every conversation starts with) steers only when it covers `follow_min_fraction` of
    the prompt; below that the request is new content (a new conversation), scored as if nothing
    were cached, so it goes where load and cache room say (SGLang's cache_threshold does the same
    for every match; their "smallest tree" is our emptiest cache), and the shared prefix spreads
    to every replica once instead of pulling every conversation to the first replica that cached
    it. A match that ends in a request's own history (a conversation's or an agent's earlier
    turns) always steers, however small a part of the prompt it is.

    Ties (nothing deeper cached on one replica than another, equal queueing) go to the least
    loaded, then to a replica whose cache is clearly emptiest (fewest blocks in the table for its
    capacity, by more than FILL_TOLERANCE_PROMPTS of this prompt, while it is under
    FILL_SPREAD_BELOW full), then to the one whose cache turns over slowest (fewest blocks new to
    it of late for its capacity, decayed with `turnover_half_life_s`: what a full cache takes in
    it evicts, so feeding them evenly keeps every prefix about as long as one pooled LRU would),
    then by rendezvous hash of the prompt's first block that no replica holds (its own content: a
    new conversation's first message, not the shared system prompt; a prompt shorter than a block,
    which caches nothing, in turns), never by config order: new prefixes spread over the
    replicas, and each replica's share of them fits its cache (SGLang's "smallest tree" for a low
    match). A prefix's later requests then follow their cache. A prompt that every tied replica
    holds whole brings no new content to place: the cache steps are skipped, and the hash of its
    last block decides.

    `commit(decision)` records the prompt's blocks as guessed on the chosen replica (approximate
    mode, learn_from_routing), apart from choose(): the gateway calls it right after the decision
    for a short prompt, once the request is on its way for a long one."""
    name = "cache_aware"
    timed = True
    reads_prefixes = True
    learns = True  # branch points; approximate mode's guessed prefixes

    def __init__(self, state: RoutingState, prefill_weight: float = 2.0, queue_weight: float = 1.0,
                 balance_factor: float = 1.25, balance_slack: float = 0.0, follow_slack: float = 2.0,
                 min_match_blocks: int = 1, learn_from_routing: bool = True,
                 follow_min_fraction: float = 0.5, follow_abs_slack: float = 2.0,
                 turnover_half_life_s: float = 20.0) -> None:
        self.state = state
        self.prefill_weight = prefill_weight
        self.queue_weight = queue_weight
        self.balance_factor = balance_factor
        self.balance_slack = balance_slack
        self.follow_slack = max(follow_slack, balance_slack)
        self.min_match_blocks = min_match_blocks
        self.follow_min_fraction = follow_min_fraction
        self.follow_abs_slack = follow_abs_slack
        # Where routed prompts' deepest matches ended (block hash -> how many): a block many
        # different requests branch off after is a shared prefix (a system prompt), not a history.
        self._branch_points: OrderedDict[int, int] = OrderedDict()
        self.learn_from_routing = learn_from_routing  # approximate mode: a routed prompt is assumed cached there
        self._name_hash: dict[str, int] = {}
        # replica -> [the table's blocks-written count when last asked, its new blocks, each weighted
        # 2 ** ((when it was seen - _turnover_origin) / half life)]: how fast its cache turns over
        self.turnover_half_life_s = turnover_half_life_s
        self._new_blocks: dict[str, list] = {}
        self._turnover_origin: float | None = None
        self._turn = 0  # turns for prompts shorter than a block (no block of their own)

    def choose(self, candidates: Sequence[str], request: RouteRequest) -> CacheAwareDecision:
        if _native_choose is not None and NATIVE and _load.NATIVE:
            # The lines below in one C call (routing/_decision.c choose_cache_aware); None where
            # they serve (the model's first request, hashes to make, a table or load not read there).
            decision = _native_choose(self, candidates, request, RECORD_ESTIMATES)
            if decision is not None:
                return decision
        if not candidates:
            require_candidates(candidates)
        state = self.state
        tracker = state.tracker
        now = state.clock()
        hashes = request.block_hashes  # as the gateway computed them; else state.hashes makes them
        if not len(hashes):
            hashes = state.hashes(request)
        table = state.tables.get(request.model) or state.table(request.model)
        n_blocks = len(hashes)
        if n_blocks:
            matched = _native_match(table, hashes, now, candidates) if _native_match is not None else None
            if matched is None:
                matched = table.match_lengths(hashes, now, candidates)
        else:
            matched = [0] * len(candidates)
        loads, delays, *estimates = tracker.loads_and_delays(candidates, now, estimates=RECORD_ESTIMATES)
        estimates = estimates[0] if estimates else None
        prompt_tokens = len(request.prompt_token_ids)
        block = state.block_size  # matched blocks are whole prompt blocks: never more than the prompt
        min_match = self.min_match_blocks or 1
        deepest = max(matched)
        shared_prefix = False
        if deepest and deepest * block < self.follow_min_fraction * prompt_tokens \
                and self._branch_points.get(int(hashes[deepest - 1]), 0) >= BRANCH_SHARED:
            # All that is cached is a prefix other requests branch off too (a shared system prompt
            # in front of a new conversation), and a small part of this prompt: it does not steer;
            # load and cache room decide (see the class doc).
            min_match = n_blocks + 1
            shared_prefix = True
        if _native_decide is not None and NATIVE:
            # What follows, in one C call (routing/_decision.c decide: the same steps on the same
            # doubles, a tie's cache steps included); a tie it leaves (a name not hashed
            # yet, a table or state it declines to read) is broken below.
            chosen, why, scores, allowed, tied, skip_cache = _native_decide(
                matched, loads, delays, prompt_tokens, block, min_match, self.prefill_weight, self.queue_weight,
                tracker, self.balance_factor, self.balance_slack, self.follow_slack, self.follow_abs_slack,
                candidates, hashes, self._name_hash, table, self, now)
            if tied is not None:
                chosen, why = self._after_load_step(candidates, tied, table, hashes, deepest, n_blocks, skip_cache,
                                                    now)
        else:
            # The candidates serve one model, which the gateway gives one prefill rate: scores stay
            # comparable (and ties exact) across them.
            per_token_s = self.prefill_weight / tracker.prefill_rate(candidates[0])
            chosen, why, scores, allowed = self._decide(candidates, hashes, matched, loads, delays, table,
                                                        prompt_tokens, min_match, per_token_s, deepest, now)
        cached_tokens = matched[chosen] * block
        if cached_tokens > prompt_tokens:
            cached_tokens = prompt_tokens
        return CacheAwareDecision(candidates[chosen], tuple(candidates), cached_tokens, matched, loads, scores,
                                  allowed, why, self.balance_factor, table, hashes, shared_prefix, estimates)

    def _decide(self, candidates, hashes, matched, loads, delays, table, prompt_tokens: int, min_match: int,
                per_token_s: float, deepest: int, now: float) -> tuple[int, str, list[float], list[int] | None]:
        """choose() once the matches and loads are known, in Python (the reference for the C
        call): (chosen index, why a tie went there, the scores, the indices the balance guard
        allows or None for all)."""
        tracker = self.state.tracker
        block = self.state.block_size
        n_blocks = len(hashes)
        queue_weight = self.queue_weight
        # Balance guard, as "load <= cap" (cap = factor x mean after this request + slack - 1).
        mean_after = (sum(loads) + 1) / len(loads)
        least = min(loads)
        strict_cap = self.balance_factor * mean_after + self.balance_slack - 1
        follow_cap = self.balance_factor * mean_after + self.follow_slack - 1
        if follow_cap < least + self.follow_abs_slack:
            follow_cap = least + self.follow_abs_slack
        scores = [per_token_s * (prompt_tokens - blocks * block if blocks >= min_match else prompt_tokens)
                  + queue_weight * delay for blocks, delay in zip(matched, delays)]
        bound = least if least > strict_cap else strict_cap  # the least loaded are always allowed
        # The guard bounds following a cache. With nothing cached to follow anywhere, the scores
        # are prefill and queueing alone and already weigh the load: bounding the request count
        # too sent a trace's 172-token prompt to the one replica under the count bound, 115 ms of
        # queue behind a 1,633-token prefill, past one with 37 ms (TTFT 250 ms, a p99 request).
        # So too when every candidate holds as much of the prompt (a prefix cached everywhere):
        # the cache term is the same for all and the scores are queueing alone.
        if max(loads) <= bound or deepest < min_match or min(matched) == deepest:
            allowed = None
            best_score = min(scores)
            tied = [i for i, score in enumerate(scores) if score == best_score]
        else:
            # "Already running this prefix": a request in flight there shares at least half of
            # what this prompt would follow (a group's shared document, not only the system
            # prompt in front of a conversation's own history).
            allowed = [i for i, load in enumerate(loads)
                       if load <= bound or (matched[i] >= min_match and load <= follow_cap and not
                                            tracker.running_prefix(candidates[i], hashes, (matched[i] + 1) // 2))]
            best_score = min([scores[i] for i in allowed])
            tied = [i for i in allowed if scores[i] == best_score]
        if len(tied) == 1:
            return tied[0], "", scores, allowed
        # Tied replicas that all hold the whole prompt take in nothing new from it: where
        # their caches have room or turn over slowest does not matter, its hash decides.
        holding = bool(n_blocks) and min([matched[i] for i in tied]) == n_blocks
        chosen, why = self._break_tie(candidates, tied, loads, table, hashes, deepest, n_blocks, holding, now)
        return chosen, why, scores, allowed

    def _break_tie(self, candidates, tied: list[int], loads, table, hashes, deepest: int, n_blocks: int,
                   holding: bool, now: float) -> tuple[int, str]:
        """Among equally scored candidates: least loaded, then emptiest cache, then slowest cache
        turnover, then a rendezvous hash of the prompt's own first block (a new prefix lands on a
        stable, spread-out replica). `holding`: every tied candidate holds the whole prompt (no
        cache takes in anything new): the cache steps are skipped."""
        values = [loads[i] for i in tied]
        low = min(values)
        if max(values) != low:
            tied = [i for i, load in zip(tied, values) if load == low]
            if len(tied) == 1:
                return tied[0], "least load"
        return self._after_load_step(candidates, tied, table, hashes, deepest, n_blocks, holding, now)

    def _after_load_step(self, candidates, tied: list[int], table, hashes, deepest: int, n_blocks: int,
                         skip_cache: bool, now: float) -> tuple[int, str]:
        """_break_tie past its load step (where the C call leaves a tie): the cache steps unless
        `skip_cache` (every tied replica holds the whole prompt, or the C call took them), then
        turns for a prompt shorter than a block, else the rendezvous hash of the prompt's first
        block no replica holds (its last where all hold it)."""
        names = candidates if len(tied) == len(candidates) else [candidates[i] for i in tied]
        if not skip_cache:
            tied, names, why = self._by_cache(candidates, tied, names, table, n_blocks, now)
            if why:
                return tied[0], why
        if not n_blocks:  # a prompt shorter than a block caches nothing: take turns
            self._turn += 1
            return tied[self._turn % len(tied)], "rotation"
        # 32-bit multiplicative ranks (small ints: a fraction of the cost of 64-bit products);
        # the high bits of the product, which decide the minimum, depend on every bit of h ^ key.
        key = int(hashes[min(deepest, n_blocks - 1)]) & _MASK32
        get, learn = self._name_hash.get, self._hash_name
        ranks = [(((get(name) or learn(name)) ^ key) * _MIX32) & _MASK32 for name in names]
        return tied[ranks.index(min(ranks))], "prefix hash"

    def _by_cache(self, candidates, tied: list[int], names, table, n_blocks: int,
                  now: float) -> tuple[list[int], list, str]:
        """_break_tie's cache steps: (tied, their names, the reason when one is left, else "")."""
        values = table.fills(names)
        low = min(values)
        # A clearly emptier cache: by more than part of this prompt (small differences are noise).
        tolerance = max(FILL_TOLERANCE_PROMPTS * n_blocks, 1) / min(table.capacities(names))
        if low < FILL_SPREAD_BELOW and max(values) > low + tolerance:
            tied = [i for i, fill in zip(tied, values) if fill <= low + tolerance]
            if len(tied) == 1:
                return tied, names, "emptiest cache"
            names = [candidates[i] for i in tied]
        # Then where the fewest new blocks went of late: while caches fill, the emptiest to the
        # block; once they are full, what each takes in it evicts. No tolerance: the chosen
        # replica's count rises with this prompt's guess at commit, so the next new prompt
        # already sees it (precise mode's events only confirm it). A prompt shorter than a block
        # adds nothing to any cache (and would not move the count: they would all pile up).
        if n_blocks:
            values = self.turnover(names, table, now)
            low = min(values)
            if max(values) > low:
                tied = [i for i, share in zip(tied, values) if share == low]
                if len(tied) == 1:
                    return tied, names, "slowest cache turnover"
                names = [candidates[i] for i in tied]
        return tied, names, ""

    def turnover(self, names: Sequence[str], table, now: float) -> list[float]:
        """Blocks new to each replica's cache of late (the table's count of blocks written for it,
        decayed with turnover_half_life_s), per block of its capacity, all times one common factor
        (only their order and ties are used): a block seen at t weighs 2 ** (t / half life) rather
        than every sum being decayed to now, which is the same ratio between replicas. Brought up
        to date for every replica of the table when asked (a tie among new content: most new
        requests); what was written since the last ask counts as written now (`now`: the
        decision's clock). routing/_decision.c's cache steps do the same to the same state."""
        origin = self._turnover_origin
        if origin is None:
            origin = self._turnover_origin = now
        halvings = (now - origin) / self.turnover_half_life_s
        seen = self._new_blocks
        if halvings > _REBASE_HALVINGS:  # every ~20 min at the default half life: the sums start again from now
            scale = 2.0 ** -halvings if halvings < 1000 else 0.0
            for entry in seen.values():
                entry[1] *= scale
            self._turnover_origin, halvings = now, 0.0
        weight = 2.0 ** halvings
        replicas = table.replicas()
        for name, written in zip(replicas, table.written(replicas)):
            entry = seen.get(name)
            if entry is None:
                seen[name] = [written, written * weight]  # what it holds already counts as new now
            elif written != entry[0]:
                entry[1] += (written - entry[0] if written > entry[0] else written) * weight  # re-added: counts anew
                entry[0] = written
        return [seen[name][1] / capacity for name, capacity in zip(names, table.capacities(names))]

    def _hash_name(self, name: str) -> int:
        h = self._name_hash[name] = xxhash.xxh32_intdigest(name.encode()) or 1
        return h

    def commit(self, decision: CacheAwareDecision) -> None:
        """What the policy learns from its own routing, apart from choose(): where this prompt's
        match ended (branch points), and in approximate mode that the chosen replica will hold the
        prompt's blocks (a guess, corrected by the cached tokens it reports)."""
        if _native_commit is not None and NATIVE and _native_commit(self, decision):
            return  # the lines below in one C call (routing/_decision.c commit_cache_aware)
        matched, hashes = decision._matched, decision.hashes
        deepest = max(matched) if matched else 0
        if deepest:
            points = self._branch_points
            key = int(hashes[deepest - 1])
            points[key] = points.pop(key, 0) + 1  # (re)inserted: the most recent, last
            if len(points) > BRANCH_POINTS_KEPT:
                points.popitem(last=False)
        if self.learn_from_routing and len(hashes):
            table, replica, now = decision.table, decision.replica, self.state.clock()
            try:
                if _native_guess is None or _native_guess(table, replica, hashes, now) is None:
                    table.insert(replica, hashes, guessed=True, now=now)
            except KeyError:  # the replica left the table since (removed from the pool)
                pass


class SessionAffinity:
    """A session (the `user` field or an affinity header) sticks to the replica it first got,
    while that replica is a candidate and within the balance bound; otherwise `fallback` picks
    and the session moves. The map is bounded (LRU) and entries expire after `ttl_s`."""
    name = "session_affinity"

    def __init__(self, state: RoutingState, fallback: Policy, max_sessions: int = 100_000, ttl_s: float = 3600.0,
                 balance_factor: float = 1.25, balance_slack: float = 0.0) -> None:
        self.state = state
        self.fallback = fallback
        self.timed = fallback.timed
        self.reads_prefixes = fallback.reads_prefixes
        self.learns = fallback.learns
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.balance_factor = balance_factor
        self.balance_slack = balance_slack
        self.sticky: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def choose(self, candidates: Sequence[str], request: RouteRequest) -> RoutingDecision:
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
                               getattr(decision, "predicted_cached_tokens", 0), decision)

    def commit(self, decision: RoutingDecision) -> None:
        """The fallback's commit, for a decision the fallback made: wrapped in a session's decision,
        or its own, returned as is for a request without a session key."""
        if getattr(decision, "policy", None) != self.name:
            self.fallback.commit(decision)
        elif decision.inner is not None:
            self.fallback.commit(decision.inner)

