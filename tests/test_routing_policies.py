"""Every policy on plain data: choices, balance under a hot prefix, removed replicas, affinity."""
import heapq
import random

import msgspec
import pytest

from routing import POLICIES, Attempt, RouteRequest, RoutingState, make_policy
from routing.hashing import block_hashes


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _state(replicas, clock=None):
    state = RoutingState(clock=clock or Clock())
    for name in replicas:
        state.add_replica(name, "m", 10_000)
    return state


def _request(tokens, session=None):
    return RouteRequest(model="m", prompt_token_ids=tokens, block_hashes=block_hashes(tokens), session_key=session)


def _route(policy, state, candidates, request) -> Attempt:
    """What the gateway does with a decision: count it (routing.attempt) and let the policy learn."""
    decision = policy.choose(candidates, request)
    policy.commit(decision)
    return Attempt(state, decision, "m", len(request.prompt_token_ids), request.block_hashes)


REPLICAS = ["r0", "r1", "r2", "r3"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_explains_its_decision_with_plain_data(name):
    policy = make_policy(name, {}, _state(REPLICAS))
    decision = policy.choose(REPLICAS, _request(list(range(100)), session="u1"))
    assert decision.replica in REPLICAS
    log = decision.as_log()
    assert log["policy"] in (name, "round_robin") and isinstance(log["reason"], str)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_routing_field_written_in_c_reads_as_the_dict_it_replaces(name):
    """The record's routing field comes from routing/_decision.c's writer (routing_json); it must
    read back as routing_log's dict plus the gateway's fields would encode, for every policy, with
    names that need escaping, loaded replicas and a retry."""
    pytest.importorskip("routing._decision")
    from routing.load import EstimateLog
    from routing.policy import routing_json
    names = ["r0", 'q"uote', "back\\slash", "\u00e9t\u00e9\n"]
    state = _state(names)
    policy = make_policy(name, {}, state)
    for i, replica in enumerate(names[:3]):
        for _ in range(i):
            state.tracker.on_routed(replica, 300 + 17 * i, 16 * i, _request(list(range(300 + 17 * i))).block_hashes)
    for prompt in (list(range(100)), list(range(5)), list(range(40)) + [7] * 33):
        decision = policy.choose(names, _request(prompt, session="u1"))
        policy.commit(decision)
        estimates = dict(zip(names, [EstimateLog(i, 100 * i, 2 * i, i + 1, 0.001 * i + 1e-7, i % 2 == 0)
                                     for i in range(len(names))]))
        written = msgspec.json.encode(estimates)  # as cache_aware's decision keeps its own: written already
        for extra in ((None, None), (estimates, None), (estimates, ["r0", 'q"uote']), (written, ["r0"])):
            expected = decision.as_log() | {"mode": "precise"}
            if extra[0] is not None:
                expected["load_estimate"] = estimates
            if extra[1] is not None:
                expected["retried_after"] = extra[1]
            written = routing_json(decision, "precise", *extra)
            assert msgspec.json.decode(written) == msgspec.json.decode(msgspec.json.encode(expected))


def test_a_routing_field_written_once_and_reused_is_each_decisions_own():
    """round_robin's routing field (no numbers in it) is written once per distinct decision and
    then reused: every record still reads as its own decision's dict, whichever of policy, reason,
    replica, candidates, predicted cached tokens and mode differs from the one before."""
    pytest.importorskip("routing._decision")
    from routing.policy import RoutingDecision, routing_json
    lists = [("r0", "r1", "r2"), ("r0", "r1"), ("r1", "r0", "r2")]
    for _ in range(2):  # the second pass reads what the first wrote
        for candidates in lists:
            for turn, replica in enumerate(candidates):
                for policy, reason, predicted in (("round_robin", f"turn {turn + 1} of {len(candidates)}", 0),
                                                  ("random", "uniform", 0), ("round_robin", "turn 1 of 3", 16)):
                    decision = RoutingDecision(replica, policy, reason, candidates, predicted_cached_tokens=predicted)
                    for mode in ("approximate", "precise"):
                        expected = decision.as_log() | {"mode": mode}
                        assert msgspec.json.decode(routing_json(decision, mode, None, None)) == expected
                        retried = routing_json(decision, mode, None, ["r9"])  # a retry: not the shared line
                        assert msgspec.json.decode(retried) == expected | {"retried_after": ["r9"]}


def test_cache_aware_reasons_written_in_c_read_as_the_property_words_them():
    """explain_cache_aware words the reason in C: every branch of CacheAwareDecision.reason (its
    reference), with names and tie reasons that need escaping."""
    pytest.importorskip("routing._decision")
    from routing.policies import CacheAwareDecision
    from routing.policy import routing_json
    names = ("r0", 'q"uote', "back\\slash", "\u00e9t\u00e9\n")
    cases = [  # (chosen, matched, allowed, why, shared prefix, balance factor)
        (1, [0, 0, 0, 0], None, "", False, 1.25),
        (2, [3, 5, 5, 0], None, "least load", False, 1.25),
        (0, [2, 7, 1, 0], [0, 2, 3], "", False, 1.5),
        (0, [2, 7, 1, 0], [0, 2, 3], "", False, 2),
        (3, [2, 7, 1, 0], None, 'prefix "hash"\n', False, 1.25),
        (0, [0, 4, 4, 1], [0, 1, 2, 3], "", True, 1.25),
        (2, [0, 4, 1, 1], [0, 1, 2, 3], "rotation", False, 1.25),
    ]
    for chosen, matched, allowed, why, shared, factor in cases:
        decision = CacheAwareDecision(names[chosen], names, 16 * matched[chosen], matched, [1, 2.5, 0, 3],
                                      [0.25, 1e-7, 3.0, 0.1 + 0.2], allowed, why, factor, None, (), shared)
        expected = decision.as_log() | {"mode": "approximate", "retried_after": ["r0"]}
        written = routing_json(decision, "approximate", None, ["r0"])
        assert msgspec.json.decode(written) == msgspec.json.decode(msgspec.json.encode(expected))
        assert msgspec.json.decode(written)["reason"] == decision.reason


def test_the_routing_field_written_in_c_keeps_every_number_as_it_reads():
    """Floats on the microsecond grid are written from their count of millionths, others as repr;
    ints of any size exactly: each reads back as the same value (and a non-finite float as null)."""
    pytest.importorskip("routing._decision")
    from routing.policy import RoutingDecision, routing_json
    rng = random.Random(9)
    values = [0.0, -0.0, 1.0, -2.5, 0.000001, 1e-7, 123456.789012, -999999999.999999, 1e9, 1e16, 2.0 ** 70,
              3 ** 50, -(3 ** 50), 7, -7, 0, 0.1 + 0.2, 1 / 3, 5e-324, 1.7976931348623157e308]
    values += [round(rng.uniform(-1e4, 1e4) * 1e6) / 1e6 for _ in range(300)]
    values += [rng.uniform(-1e4, 1e4) for _ in range(300)] + [rng.randrange(-2 ** 64, 2 ** 64) for _ in range(50)]
    names = [f"r{i}" for i in range(len(values))]
    decision = RoutingDecision(names[0], "least_load", "why", tuple(names), load=dict(zip(names, values)),
                               scores={"r0": 0.1234565, "r1": -2.0000004, "r2": float("inf")})
    read = msgspec.json.decode(routing_json(decision, "approximate", None, None))
    assert [read["load"][name] for name in names] == values
    assert read["scores"] == {"r0": round(0.1234565, 6), "r1": -2.0, "r2": None}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_removed_replica_gets_no_new_request(name):
    state = _state(REPLICAS)
    policy = make_policy(name, {}, state)
    prompt = _request(list(range(320)), session="u1")
    for _ in range(20):
        policy.choose(REPLICAS, prompt)
    state.remove_replica("r1")
    chosen = {policy.choose([r for r in REPLICAS if r != "r1"], prompt).replica for _ in range(50)}
    assert "r1" not in chosen


def test_unknown_policy_and_unknown_keys_are_errors():
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="balance_factr"):
        make_policy("cache_aware", {"balance_factr": 2})


def test_cache_aware_follows_the_longest_prefix_when_load_is_even():
    clock = Clock()
    state = _state(REPLICAS, clock)
    policy = make_policy("cache_aware", {}, state)
    shared = list(range(1024))
    first = _route(policy, state, REPLICAS, _request(shared + [1] * 64))  # approximate: guessed there
    first.first_token()
    first.finish(None, precise=False)
    second = policy.choose(REPLICAS, _request(shared + [2] * 64))
    assert second.replica == first.replica
    assert second.matched_blocks[first.replica] == 64
    assert second.predicted_cached_tokens == 1024


def _simulate(policy_name, arrivals=2000, groups=1, replicas=REPLICAS, seed=0, service_s=1.0, rate=6.0):
    """Poisson arrivals, fixed service time; returns (requests per replica, decisions that sent a
    request to a replica already over 1.25x the mean in-flight load while a replica was idle)."""
    clock = Clock()
    state = _state(replicas, clock)
    policy = make_policy(policy_name, {}, state)
    rng = random.Random(seed)
    prompts = [list(range(g * 10_000, g * 10_000 + 1024)) for g in range(groups)]
    counts = {r: 0 for r in replicas}
    done: list[tuple[float, int, Attempt]] = []
    worst = 0
    for n in range(arrivals):
        clock.now += rng.expovariate(rate)
        while done and done[0][0] <= clock.now:
            heapq.heappop(done)[2].finish(1024, precise=True)
        before = {r: state.tracker.in_flight(r, clock.now) for r in replicas}
        attempt = _route(policy, state, replicas, _request(prompts[rng.randrange(groups)] + [rng.randrange(9)] * 32))
        decision = attempt.decision
        counts[decision.replica] += 1
        heapq.heappush(done, (clock.now + service_s, n, attempt))
        mean_after = (sum(before.values()) + 1) / len(replicas)
        if before[decision.replica] > min(before.values()) == 0 and before[decision.replica] + 1 > 1.25 * mean_after:
            worst += 1
    return counts, worst


def test_hot_prefix_never_piles_onto_one_replica():
    counts, piled_while_idle = _simulate("cache_aware", groups=1)
    mean = sum(counts.values()) / len(counts)
    assert max(counts.values()) <= 1.25 * mean, counts
    assert piled_while_idle == 0


@pytest.mark.parametrize("capacity_blocks", [1000, 100_000])
def test_new_prefixes_on_idle_replicas_spread_out_instead_of_piling_onto_the_first(capacity_blocks):
    """Each request starts a prefix nobody holds and every replica is idle when it arrives: the
    choice is a tie. Config order would send all of them to r0; a clearly emptier cache (then a
    hash of the prompt's first block) spreads them: where a prefix is a large part of a cache,
    evenly (each replica's share of prefixes fits its cache), else about evenly."""
    state = RoutingState(clock=Clock())
    for name in REPLICAS:
        state.add_replica(name, "m", capacity_blocks)
    policy = make_policy("cache_aware", {}, state)
    counts = {r: 0 for r in REPLICAS}
    for group in range(32):
        attempt = _route(policy, state, REPLICAS, _request(list(range(group * 2000, group * 2000 + 1024)) + [7] * 64))
        attempt.first_token()
        attempt.finish(None, precise=False)  # done before the next arrives: all idle
        decision = attempt.decision
        assert decision.matched_blocks == {r: 0 for r in REPLICAS}
        counts[decision.replica] += 1
    if capacity_blocks == 1000:  # 68 blocks a prefix: 6.8% of a cache, past the fill tolerance
        assert counts == {r: 8 for r in REPLICAS}, counts
    else:
        assert 4 <= min(counts.values()) and max(counts.values()) <= 12, counts


def test_new_prefix_ties_break_by_prefix_hash_not_config_order():
    """Same empty caches, same load: which replica a new prefix lands on depends on the prefix,
    and reordering the candidates does not change it."""
    chosen = set()
    for group in range(16):
        tokens = list(range(group * 2000, group * 2000 + 64))
        picks = {make_policy("cache_aware", {}, _state(order)).choose(order, _request(tokens)).replica
                 for order in (REPLICAS, REPLICAS[::-1])}
        assert len(picks) == 1
        chosen |= picks
    assert len(chosen) >= 3


def test_a_prompt_every_tied_replica_holds_whole_goes_by_its_hash_and_new_content_to_the_emptiest():
    """Cache room decides where new content goes; a prompt that every tied replica already holds
    whole brings none, so its hash decides (stable under candidate order), not which cache is emptier."""
    state = _state(REPLICAS)
    table = state.table("m")
    for i, name in enumerate(REPLICAS[:3]):  # r3's cache clearly the emptiest
        start = 50_000 + i * 10_000
        table.insert(name, block_hashes(list(range(start, start + 16 * 600))), guessed=False, now=0.0)
    held = list(range(1000, 1000 + 64))  # 4 whole blocks, on every replica
    for name in REPLICAS:
        table.insert(name, block_hashes(held), guessed=False, now=0.0)
    policy = make_policy("cache_aware", {}, state)
    picks = set()
    for order in (REPLICAS, REPLICAS[::-1], REPLICAS[1:] + REPLICAS[:1]):
        decision = policy.choose(order, _request(held))
        assert decision.matched_blocks == {r: 4 for r in REPLICAS}
        assert decision.reason.endswith("tie broken by prefix hash"), decision.reason
        picks.add(decision.replica)
    assert len(picks) == 1
    for n in range(200, 216):
        for name in REPLICAS:
            table.insert(name, block_hashes(list(range(n * 100, n * 100 + 64))), guessed=False, now=0.0)
    hashes_chosen = {policy.choose(REPLICAS, _request(list(range(n * 100, n * 100 + 64)))).replica
                     for n in range(200, 216)}  # other prompts held whole everywhere: spread by their hashes
    assert len(hashes_chosen) >= 3, hashes_chosen
    new = policy.choose(REPLICAS, _request(list(range(90_000, 90_064))))
    assert new.replica == "r3" and new.reason.endswith("tie broken by emptiest cache"), new.reason


def test_a_prefix_follows_its_cache_past_a_small_imbalance_unless_it_is_running_there():
    state = _state(REPLICAS)
    policy = make_policy("cache_aware", {}, state)
    prefix = list(range(1024))
    first = _route(policy, state, REPLICAS, _request(prefix + [1] * 64))
    first.first_token()
    first.finish(None, precise=False)
    holder = first.replica
    # The holder runs another prompt's (cached) request while the others idle: one over the mean
    # bound, but following the cache is a hit and spreading is a miss plus a duplicate prefix.
    other = _request(list(range(5000, 6088)))
    state.tracker.on_routed(holder, 1088, 1024, other.block_hashes)
    follow = _route(policy, state, REPLICAS, _request(prefix + [2] * 64))
    assert follow.replica == holder and follow.predicted_cached_tokens == 1024, follow.decision.as_log()
    # Now the holder runs this very prefix: it arrives faster than one replica serves it (hot),
    # and the strict bound sends the next one to an idle replica.
    again = policy.choose(REPLICAS, _request(prefix + [3] * 64))
    assert again.replica != holder and again.reason.startswith("balance guard"), again.as_log()


def test_a_prompt_nothing_cached_for_goes_to_the_shortest_queue_not_the_fewest_requests():
    """The balance guard bounds following a cache. With no match anywhere, a replica running one
    long prefill is not a better place than one running two short ones (a trace's p99 request
    waited 115 ms behind a 1,633-token prefill, past a replica with 37 ms of queue)."""
    state = _state(REPLICAS)
    policy = make_policy("cache_aware", {}, state)
    rng = random.Random(4)

    def unseen(n):
        return [rng.randrange(10, 30000) for _ in range(n)]
    for replica in ("r0", "r1", "r2"):
        for _ in range(2):
            state.tracker.on_routed(replica, 200, 0, _request(unseen(200)).block_hashes)
    state.tracker.on_routed("r3", 1633, 0, _request(unseen(1633)).block_hashes)
    decision = policy.choose(REPLICAS, _request(unseen(172)))
    assert decision.replica != "r3", decision.as_log()
    delays = dict(zip(REPLICAS, state.tracker.loads_and_delays(REPLICAS, state.clock())[1]))
    assert delays[decision.replica] == min(delays.values()) < delays["r3"]


def test_a_prefix_every_replica_holds_goes_to_the_shortest_queue_even_where_it_is_running():
    """Held as deeply everywhere, the cache favours no replica: the balance guard, which bounds
    following a cache, does not keep the request from the one replica with the shortest queue
    because that replica runs the same prefix (the guard would send it behind a long prefill)."""
    state = _state(REPLICAS)
    policy = make_policy("cache_aware", {}, state)
    rng = random.Random(5)
    prefix = list(range(1024))
    table = state.table("m")
    for name in REPLICAS:
        table.insert(name, block_hashes(prefix), guessed=False, now=0.0)
    for _ in range(2):  # two short requests of this prefix: cached, little left to prefill
        state.tracker.on_routed("r0", 1040, 1024, _request(prefix + [rng.randrange(10, 30000)] * 16).block_hashes)
    for replica in ("r1", "r2", "r3"):  # one long uncached prefill each
        state.tracker.on_routed(replica, 1633, 0, _request([rng.randrange(10, 30000) for _ in range(1633)]).block_hashes)
    decision = policy.choose(REPLICAS, _request(prefix + [7] * 40))
    assert decision.replica == "r0", decision.as_log()
    assert decision.predicted_cached_tokens == 1024
    delays = dict(zip(REPLICAS, state.tracker.loads_and_delays(REPLICAS, state.clock())[1]))
    assert delays["r0"] == min(delays.values()) < delays["r1"]


def test_least_load_and_bounded_consistent_hash_stay_balanced():
    for name in ("least_load", "consistent_hash"):
        counts, _ = _simulate(name, groups=3)
        mean = sum(counts.values()) / len(counts)
        assert max(counts.values()) <= 1.3 * mean, (name, counts)


def test_consistent_hash_keeps_a_prefix_on_one_replica_when_lightly_loaded():
    state = _state(REPLICAS)
    policy = make_policy("consistent_hash", {"key_blocks": 4}, state)
    chosen = set()
    for i in range(10):
        attempt = _route(policy, state, REPLICAS, _request(list(range(64)) + [i] * 40))
        attempt.finish(None, precise=False)
        chosen.add(attempt.replica)
    assert len(chosen) == 1


def test_session_affinity_sticks_and_moves_when_its_replica_leaves():
    state = _state(REPLICAS)
    policy = make_policy("session_affinity", {"fallback": "least_load", "max_sessions": 2}, state)
    first = _route(policy, state, REPLICAS, _request([1] * 20, session="alice"))
    first.finish(None, precise=False)
    again = _route(policy, state, REPLICAS, _request([2] * 20, session="alice"))
    assert again.replica == first.replica and again.decision.reason == "session affinity"
    again.finish(None, precise=False)
    others = [r for r in REPLICAS if r != first.replica]
    moved = policy.choose(others, _request([3] * 20, session="alice"))
    assert moved.replica in others and moved.reason.startswith("moved session")
    for user in ("bob", "carol", "dave"):
        policy.choose(REPLICAS, _request([4] * 20, session=user))
    assert len(policy.sticky) == 2  # bounded


def test_round_robin_keeps_its_old_call_shape():
    policy = make_policy("round_robin")
    from routing import RouteRequest
    assert [policy.choose(["a", "b"], RouteRequest(model="m")).replica for _ in range(3)] == ["a", "b", "a"]


def _chat_traffic(policy_name: str, conversations: int = 64, seed: int = 3):
    """Multi-turn chat behind one system prompt (16 blocks, ~30% of a first turn), Poisson arrivals
    of new conversations, think time between turns, approximate mode (the policy learns from its own
    routing). Returns (requests per replica, turns that went where their conversation's previous
    turn went, later turns)."""
    clock = Clock()
    state = _state(REPLICAS, clock)
    policy = make_policy(policy_name, {}, state)
    rng = random.Random(seed)
    system = list(range(100_000, 100_256))
    events: list[tuple[float, int, int]] = []  # (time, conversation, turn)
    t = 0.0
    turns_of = {}
    for conv in range(conversations):
        t += rng.expovariate(2.0)
        turns_of[conv] = rng.choice([2, 3, 4, 6, 10])
        heapq.heappush(events, (t, conv, 0))
    history = {conv: system + [conv * 1000 + i for i in range(rng.randrange(200, 700))] for conv in turns_of}
    running: list[tuple[float, int, Attempt]] = []
    counts = {r: 0 for r in REPLICAS}
    last_replica: dict[int, str] = {}
    followed = later = 0
    while events:
        clock.now, conv, turn = heapq.heappop(events)
        while running and running[0][0] <= clock.now:
            heapq.heappop(running)[2].finish(None, precise=False)
        attempt = _route(policy, state, REPLICAS, _request(history[conv]))
        attempt.first_token()
        counts[attempt.replica] += 1
        if turn:
            later += 1
            followed += attempt.replica == last_replica[conv]
        last_replica[conv] = attempt.replica
        service_s = 0.2 + len(history[conv]) / 4000
        heapq.heappush(running, (clock.now + service_s, id(attempt), attempt))
        if turn + 1 < turns_of[conv]:  # the answer and the next user message extend the conversation
            history[conv] = history[conv] + [conv * 1000 + 700 + 97 * turn + i for i in range(rng.randrange(60, 300))]
            heapq.heappush(events, (clock.now + service_s + rng.uniform(1.0, 6.0), conv, turn + 1))
    return counts, followed, later


def test_a_shared_system_prompt_neither_piles_conversations_nor_scatters_their_turns():
    counts, followed, later = _chat_traffic("cache_aware")
    mean = sum(counts.values()) / len(counts)
    assert max(counts.values()) <= 1.3 * mean, counts
    assert followed >= 0.9 * later, (followed, later)
    rr_counts, rr_followed, _ = _chat_traffic("round_robin")
    assert rr_followed < 0.5 * later  # the baseline scatters turns: the test can tell the difference


def test_an_agents_own_history_steers_however_small_but_a_shared_prefix_does_not():
    """A match that ends in the request's own history (an agent's earlier steps) steers even when
    the new tool output makes it under follow_min_fraction of the prompt; a match that ends where
    other requests branched off too (a shared system prompt) does not, below that fraction."""
    state = _state(REPLICAS)
    policy = make_policy("cache_aware", {}, state)
    system = list(range(9000, 9000 + 16 * 16))
    for n in range(3):  # conversations behind one system prompt, all on r0: its end is a branch point
        attempt = _route(policy, state, ["r0"], _request(system + [n * 100 + i for i in range(400)]))
        attempt.first_token()
        attempt.finish(None, precise=False)
    newcomer = policy.choose(REPLICAS, _request(system + [5000 + i for i in range(600)]))
    assert newcomer.replica != "r0", newcomer.as_log()  # the system prompt alone does not pull it to r0
    agent = system + [7000 + i for i in range(5 * 16)]
    state.table("m").insert("r3", block_hashes(agent), guessed=False, now=0)  # its earlier step ran on r3
    step = agent + [8000 + i for i in range(25 * 16)]  # a long tool output: 21 of 46 blocks cached
    decision = policy.choose(REPLICAS, _request(step))
    assert decision.replica == "r3" and decision.matched_blocks["r3"] == 21, decision.as_log()


def test_cache_aware_decides_the_same_with_its_c_loops_as_with_the_python_ones(monkeypatch):
    """Hot and new prefixes under Poisson load, scrapes of traffic from elsewhere, a learned
    prefill rate, prompts shorter than a block, a clock that jumps past turnover's rebase: every
    decision (replica, scores, loads, matched blocks, the logged estimate) is the same whether
    routing/_decision.c's loops or the Python ones made it, and with C built no tie's cache step
    runs in Python."""
    from routing import load, policies

    if load._native_loads_and_delays is None or policies._native_decide is None:
        pytest.skip("routing/_decision.c not built")
    python_cache_steps = [0]
    by_cache = policies.CacheAware._by_cache
    in_one_call = {"choose": 0, "commit": 0}  # decisions and commits the one C call made whole

    def counted(self, *args):
        python_cache_steps[0] += 1
        return by_cache(self, *args)
    monkeypatch.setattr(policies.CacheAware, "_by_cache", counted)

    def counting(name, native_call):
        def call(*args):
            out = native_call(*args)
            in_one_call[name] += out is not None
            return out
        return call
    if policies._native_choose is not None:
        monkeypatch.setattr(policies, "_native_choose", counting("choose", policies._native_choose))
        monkeypatch.setattr(policies, "_native_commit", counting("commit", policies._native_commit))

    def run(native: bool) -> list:
        monkeypatch.setattr(load, "NATIVE", native)
        monkeypatch.setattr(policies, "NATIVE", native)
        python_cache_steps[0] = 0
        clock = Clock()
        state = _state(REPLICAS, clock)
        policy = make_policy("cache_aware", {}, state)
        rng = random.Random(5)
        prompts = [list(range(g * 10_000, g * 10_000 + 300 + 200 * g)) for g in range(4)]
        running: list[tuple[float, int, Attempt]] = []
        seen = []
        for n in range(1500):
            clock.now += rng.expovariate(8.0)
            while running and running[0][0] <= clock.now:
                heapq.heappop(running)[2].finish(None, precise=False)
            if n % 97 == 0:
                scraped = load.ScrapedLoad(waiting=rng.randint(0, 3), running=rng.randint(0, 5))
                state.tracker.on_scrape(rng.choice(REPLICAS), scraped, clock.now)
            if n == 700:
                for name in REPLICAS:
                    state.tracker.set_prefill_rate(name, 5000.0)
            if n == 1100:  # past 64 turnover half lives: its sums start again from now
                clock.now += 65 * policy.turnover_half_life_s
            if n % 50 == 49:  # shorter than a block, on an idle pool: turns
                clock.now += 2.0
                while running:
                    heapq.heappop(running)[2].finish(None, precise=False)
                if n == 1299:  # a replica's cache dropped and re-added: its count of blocks written restarts
                    state.table("m").remove_replica("r2")
                    state.table("m").add_replica("r2", 10_000)
                tokens = [rng.randrange(50_000, 60_000) for _ in range(rng.randrange(1, state.block_size))]
            else:
                tokens = prompts[rng.randrange(4)] + [rng.randrange(50_000, 60_000) for _ in range(rng.randrange(1, 90))]
            attempt = _route(policy, state, REPLICAS, _request(tokens))
            if rng.random() < 0.7:
                attempt.first_token()
            heapq.heappush(running, (clock.now + rng.uniform(0.1, 1.5), n, attempt))
            decision = attempt.decision
            seen.append((decision.replica, decision._scores, decision._loads, decision._matched,
                         decision.reason, msgspec.json.decode(decision.load_estimates)))
        return (seen, python_cache_steps[0], dict(policy._new_blocks), policy._turnover_origin, policy._turn,
                list(policy._branch_points.items()), state.table("m").match_lengths(block_hashes(prompts[0]), clock.now,
                                                                                    REPLICAS))

    (native, native_steps, *native_state), (python, python_steps, *python_state) = run(True), run(False)
    assert native == python
    assert native_state == python_state  # turnover's sums and origin, the turns, branch points, guesses
    if policies._native_choose is not None:  # the whole choice and commit in one call, but for a few
        assert in_one_call["choose"] > 1400 and in_one_call["commit"] > 1400, in_one_call
    assert native_steps == 0 and python_steps > 100, (native_steps, python_steps)
    assert len({replica for replica, *_ in native}) == len(REPLICAS)  # the traffic spread: every path ran
    reasons = " | ".join({reason for _, _, _, _, reason, _ in native})
    for step in ("balance guard", "least load", "prefix hash", "emptiest cache", "slowest cache turnover",
                 "rotation"):  # the guard and every tie step
        assert step in reasons, reasons
