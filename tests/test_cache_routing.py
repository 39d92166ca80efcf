"""Cache-aware routing end to end: a real gateway in front of real tiny replicas.

Precise mode is proven with `learn_from_routing: false`: the gateway's table then learns only
from the replicas' KV events, so a matched prefix in a decision can only come from them."""
from __future__ import annotations

import contextlib
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from gateway.config import parse_config
from gateway.router import TIMED_EVERY, TIMED_FIRST, TIMED_GAP_S, Router
from observability.metrics import GatewayMetrics
from routing.params import CacheAwareParams
from tests.servers import free_port, run_gateway, run_replica
from tests.test_engine_serving import TINY_KV_BYTES_PER_BLOCK
from tests.test_gateway import Gateway, http, metric

PREFILL_WEIGHT = CacheAwareParams().prefill_weight  # what a score charges per second of uncached prefill

WAIT_S = 30.0


def poll(predicate, what: str, server, timeout_s: float = WAIT_S):
    """Another process's state has no event to await: poll, bounded, failing with its logs."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{server.logs()[-3000:]}"
        time.sleep(0.05)
    return value


@contextlib.contextmanager
def cluster(tmp_path, routing: str, replicas: int = 2, kv_events: bool = False, kv_blocks: int | None = None):
    """`kv_blocks`: each replica's KV cache in blocks, also told to the gateway (default: the
    replica's own, which the gateway learns from its /metrics)."""
    with contextlib.ExitStack() as stack:
        endpoints = [(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}") for _ in range(replicas)]
        kv_size = ["--kv-cache-gb", f"{kv_blocks * TINY_KV_BYTES_PER_BLOCK / (1 << 30):.9f}"] if kv_blocks else []
        started = [stack.enter_context(run_replica("tiny", extra_args=kv_size + (
            ["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay] if kv_events else [])))
            for pub, replay in endpoints]
        port = free_port()
        config = tmp_path / "gateway.yaml"
        entries = ""
        for i, (replica, (pub, replay)) in enumerate(zip(started, endpoints)):
            entries += f"  - name: r{i}\n    url: {replica.url}\n    model: tiny\n"
            if kv_blocks:
                entries += f"    capacity_blocks: {kv_blocks}\n"
            if kv_events:
                entries += f"    kv_events: {{endpoint: '{pub}', replay_endpoint: '{replay}'}}\n"
        config.write_text(f"gateway: {{host: 127.0.0.1, port: {port}, connect_timeout_s: 2}}\n"
                          f"logging: {{format: json}}\nrouting:\n{routing}replicas:\n{entries}")
        server = stack.enter_context(run_gateway(config, port))
        yield Gateway(server, started)


def complete(gateway: Gateway, prompt: list[int], request_id: str, **extra) -> dict:
    headers = extra.pop("headers", {})
    status, _, answer = http("POST", gateway.url + "/v1/completions",
                             {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra},
                             {"x-request-id": request_id, **headers})
    assert status == 200, answer
    return gateway.record(request_id)


def gateway_metric(gateway: Gateway, name: str, **labels) -> float:
    return metric(http("GET", gateway.url + "/metrics")[2], name, **labels)


def test_precise_mode_routes_a_shared_prefix_to_the_replica_whose_events_hold_it(tmp_path):
    routing = "  policy: cache_aware\n  cache_aware: {learn_from_routing: false}\n"
    with cluster(tmp_path, routing, kv_events=True) as gateway:
        for name in ("r0", "r1"):
            poll(lambda: gateway_metric(gateway, "kvgate_routing_mode", replica=name) == 1,
                 f"{name} precise", gateway.server)
        rng = random.Random(7)
        prefix = [rng.randrange(10, 250) for _ in range(96)]  # 6 full blocks
        first = complete(gateway, prefix + [rng.randrange(10, 250) for _ in range(20)], "first")
        holder = first["replica"]
        assert first["routing"]["mode"] == "precise" and first["routing"]["matched_blocks"] == {"r0": 0, "r1": 0}
        # The replica's BlockStored events reach the gateway's table (nothing else teaches it here).
        poll(lambda: gateway_metric(gateway, "kvgate_kv_event_batches_total", replica=holder) > 0,
             "events applied", gateway.server)
        for i in range(4):
            record = complete(gateway, prefix + [rng.randrange(10, 250) for _ in range(20)], f"again-{i}")
            assert record["replica"] == holder, record["routing"]
            assert record["routing"]["matched_blocks"][holder] >= 6
            assert record["routing"]["reason"].startswith("longest prefix")
            assert record["routing"]["predicted_cached_tokens"] >= 96
            assert record["cached_tokens"] >= 96  # the replica agrees: it reused the prefix
            assert set(record["routing"]["load_estimate"]) == {"r0", "r1"}
        assert gateway_metric(gateway, "kvgate_kv_events_fallbacks_total") == 0


def test_approximate_mode_learns_from_its_own_routing_and_logs_the_decision(tmp_path):
    with cluster(tmp_path, "  policy: cache_aware\n  scrape_interval_s: 0.2\n") as gateway:
        rng = random.Random(11)
        prefixes = [[rng.randrange(10, 250) for _ in range(64)] for _ in range(2)]
        holders = {}
        for round_ in range(3):
            for p, prefix in enumerate(prefixes):
                record = complete(gateway, prefix + [rng.randrange(10, 250) for _ in range(8)], f"a-{round_}-{p}")
                assert record["routing"]["mode"] == "approximate"
                holders.setdefault(p, record["replica"])
                assert record["replica"] == holders[p], record["routing"]
                if round_:
                    assert record["routing"]["matched_blocks"][holders[p]] == 4
                    assert record["cached_tokens"] >= 64
        text = http("GET", gateway.url + "/metrics")[2]
        assert metric(text, "kvgate_predicted_cached_tokens_total") == 4 * 64
        assert metric(text, "kvgate_reported_cached_tokens_total") >= 4 * 64
        assert metric(text, "kvgate_scrape_failures_total") == 0


def test_full_caches_take_new_content_evenly_so_a_prefix_lives_as_long_as_in_one_pooled_cache(tmp_path):
    """Two replicas of 48 KV blocks, every request a new prompt of 3-10 blocks, one at a time
    (both idle: a tie), streamed and not. Once both caches are full, each new prompt goes to the
    replica that took fewer new blocks of late: what a full cache takes in, it evicts, so fed
    evenly the pair keeps a prefix about as long as one 96-block LRU would. Placed by a hash of
    the prompt, the blocks each replica took would wander apart by tens of blocks."""
    with cluster(tmp_path, "  policy: cache_aware\n", kv_blocks=48) as gateway:
        rng = random.Random(5)
        serial = iter(range(1, 10_000))

        def new_prompt(blocks: int) -> list[int]:  # whole blocks plus 3 tokens: the answer completes no block
            return [rng.randrange(10, 250) for _ in range(16 * blocks + 3)]

        def send(prompt: list[int]) -> dict:
            number = next(serial)
            request_id = f"t-{number}"
            if number % 2:
                return complete(gateway, prompt, request_id)
            stream = gateway.client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                                       stream=True, extra_headers={"x-request-id": request_id})
            finishes = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]
            assert finishes[-1] == "length", finishes  # the stream ran to its end
            return gateway.record(request_id)

        taken = {"r0": 0, "r1": 0}
        records = []
        for _ in range(24):  # fills both caches (and then some)
            record = send(new_prompt(rng.randrange(3, 11)))
            taken[record["replica"]] += record["prompt_tokens"] // 16
            records.append(record)
        kept = new_prompt(6)
        holder = send(kept)["replica"]
        later = {"r0": 0, "r1": 0}
        for _ in range(10):  # 65 new blocks at most: < 96 - 6, so one pooled LRU would still hold `kept`
            record = send(new_prompt(rng.randrange(3, 8)))
            later[record["replica"]] += record["prompt_tokens"] // 16
            taken[record["replica"]] += record["prompt_tokens"] // 16
            records.append(record)
        reasons = [r["routing"]["reason"] for r in records]
        assert any("slowest cache turnover" in reason for reason in reasons), reasons
        assert abs(taken["r0"] - taken["r1"]) <= 10, (taken, reasons)
        assert later[holder] <= 48 - 6, (later, holder)
        again = send(kept[:96] + [7, 8, 9])
        assert again["replica"] == holder, again["routing"]
        assert again["cached_tokens"] == 96, again  # the replica still held all 6 blocks


def test_session_header_and_user_field_keep_a_session_on_one_replica(tmp_path):
    routing = "  policy: session_affinity\n  session_header: x-tenant-session\n  session_affinity: {fallback: round_robin}\n"
    with cluster(tmp_path, routing) as gateway:
        rng = random.Random(3)
        by_header = [complete(gateway, [rng.randrange(10, 250) for _ in range(8)], f"h-{i}",
                              headers={"x-tenant-session": "s-1"}) for i in range(4)]
        assert len({r["replica"] for r in by_header}) == 1
        assert [r["routing"]["reason"] for r in by_header[1:]] == ["session affinity"] * 3
        by_user = [complete(gateway, [rng.randrange(10, 250) for _ in range(8)], f"u-{i}", user="alice")
                   for i in range(4)]
        assert len({r["replica"] for r in by_user}) == 1
        # Without a session, round robin alternates: the sessions above were sticky, not lucky.
        plain = [complete(gateway, [5, 6, 7], f"p-{i}")["replica"] for i in range(2)]
        assert plain[0] != plain[1]


def test_the_bench_targets_sglang_router_only_when_it_ran():
    """bench.cache_routing's verdicts: a kvgate mode is held to sglang-router's figures when
    sglang-router ran, and to the oracle and balance always; no goal is dropped or softened."""
    from bench.cache_routing import RunResult, workload_targets

    def run(router, hit, ttfts_ms, served):
        return RunResult(router, hit, served, [t / 1000 for t in ttfts_ms], 0, 40.0, 1.0, 0.5)

    runs = {"precise": run("precise", 0.60, [20, 30, 200], [100, 100, 100, 130]),
            "sglang": run("sglang", 0.62, [25, 25, 150], [400, 10, 10, 10])}
    lines = workload_targets("chat", runs, oracle_hit=0.64)
    assert lines == [
        "target chat_precise_hit_rate_vs_sglang: 0.6 (goal >= 0.62) short",
        "target chat_precise_hit_vs_oracle: 0.938 (goal >= 0.9) met",
        "target chat_precise_ttft_p50_ms: 30 (goal <= 25) short",
        "target chat_precise_ttft_p99_ms: 200 (goal <= 150) short",
        "target chat_precise_max_over_mean: 1.21 (goal <= 1.3) met",
    ]
    without = workload_targets("chat", {"precise": runs["precise"]}, oracle_hit=0.64)
    assert without == [lines[1], lines[4]]


def test_the_bench_runs_rounds_in_abba_order_and_pools_their_requests():
    """--rounds N: routers run forward then backward (a drifting host slows each alike), and a
    router's rounds pool into one row: TTFT percentiles over every request, requests per replica
    summed, hit rate averaged; the targets then read the pooled rows."""
    from bench.cache_routing import RunResult, merge_rounds, round_order, workload_targets

    assert round_order(["precise", "approximate", "sglang"], 3) == [
        (0, "precise"), (0, "approximate"), (0, "sglang"),
        (1, "sglang"), (1, "approximate"), (1, "precise"),
        (2, "precise"), (2, "approximate"), (2, "sglang")]
    first = RunResult("precise", 0.60, [100, 100], [0.010, 0.030], 0, 40.0, 1.0, 0.5, ["slow host"], 0.008, 0.2)
    second = RunResult("precise", 0.70, [90, 130], [0.020, 0.040, 0.050], 1, 41.0, 1.2, 0.7, [], 0.010, 0.0)
    pooled = merge_rounds([first, second])
    assert pooled.hit_rate == pytest.approx(0.65) and pooled.served == [190, 230] and pooled.failures == 1
    assert sorted(pooled.ttfts_s) == [0.010, 0.020, 0.030, 0.040, 0.050] and pooled.ttft_ms(50) == pytest.approx(30)
    assert pooled.notes == ["round 1: slow host"] and pooled.steal_cores == pytest.approx(0.1)
    assert merge_rounds([first]) is first
    sglang = merge_rounds([RunResult("sglang", 0.5, [300, 20], [0.025], 0, 40.0, 1.0, 0.5)] * 2)
    assert workload_targets("chat", {"precise": pooled, "sglang": sglang}, oracle_hit=0.7)[2] == \
        "target chat_precise_ttft_p50_ms: 30 (goal <= 25) short"


def test_the_gateway_exports_each_replicas_prefill_rate_and_says_when_the_configured_one_is_far_off(tmp_path):
    """Streamed and not: a request's uncached tokens over its routing-to-first-token time, averaged
    per replica, next to the replica's own figures; the YAML's rate (100 tokens/s here) is far off
    what a tiny replica reaches, and with learning off the log says so once."""
    routing = "  policy: cache_aware\n  load: {prefill_tokens_per_s: 100, learn: false}\n"
    with cluster(tmp_path, routing, replicas=1) as gateway:
        rng = random.Random(5)
        for i in range(8):
            record = complete(gateway, [rng.randrange(10, 250) for _ in range(600)], f"p-{i}", stream=i % 2 == 1)
            assert record["cached_tokens"] == 0 and record["prompt_tokens"] == 600
        observed = gateway_metric(gateway, "kvgate_replica_prefill_tokens_per_second", replica="r0")
        replica_text = http("GET", gateway.replicas["r0"].url + "/metrics")[2]
        own_ttft_s = metric(replica_text, "vllm:time_to_first_token_seconds_sum")
        replica_rate = 8 * 600 / own_ttft_s  # the replica's own view (its TTFT from the request's arrival)
        # Ours includes the trip to the replica, so it is a bit lower than the replica's own.
        assert 0.2 * replica_rate < observed < 1.5 * replica_rate, (observed, replica_rate)
        lines = [json.loads(line) for line in gateway.server.logs().splitlines()
                 if line.startswith("{") and '"prefill_rate_differs"' in line]
        assert len(lines) == 1 and lines[0]["replica"] == "r0" and lines[0]["configured_tokens_per_s"] == 100
        assert lines[0]["observed_tokens_per_s"] > 1000
        assert '"prefill_rate_learned"' not in gateway.server.logs() and '"decode_step_learned"' not in gateway.server.logs()
        later = complete(gateway, [rng.randrange(10, 250) for _ in range(600)], "later")
        # still 600 uncached tokens at 100 tokens/s (weighted as cache_aware weighs uncached prefill)
        assert later["routing"]["scores"]["r0"] == 6.0 * PREFILL_WEIGHT


def test_the_gateway_learns_the_prefill_rate_and_decode_step_and_routes_in_seconds_of_them(tmp_path):
    """The YAML is far off a tiny replica: 100 prompt tokens/s (an uncached 600-token prompt priced
    at 6 s) and a 1 s decode step for a batch of one (0.9 + 0.1: a replica decoding one stream looks
    1 s of queueing away). After 8 samples of each (answers streamed and not, over both replicas; a
    stream whose tokens all came in one read times no step, so it may take a few more answers) the
    gateway uses what it measured for the model: it says so once for each, exports both, and the
    next decisions are in seconds of them (scores; a busy replica's queueing is the learned step)."""
    routing = ("  policy: cache_aware\n  load: {prefill_tokens_per_s: 100, decode_step_base_s: 0.9, "
               "decode_step_s_per_seq: 0.1}\n")
    with cluster(tmp_path, routing, replicas=2) as gateway:
        rng = random.Random(11)

        def prompt(n=600):
            return [rng.randrange(10, 250) for _ in range(n)]

        def learned(event: str) -> list[dict]:
            return [r for r in map(json.loads, filter(lambda line: line.startswith("{"),
                                                      gateway.server.logs().splitlines())) if r["event"] == event]

        first = complete(gateway, prompt(), "p-0", max_tokens=16, ignore_eos=True)
        assert first["routing"]["scores"] == {"r0": 6.0 * PREFILL_WEIGHT, "r1": 6.0 * PREFILL_WEIGHT}
        sent = 1
        while sent < 8 or not (learned("prefill_rate_learned") and learned("decode_step_learned")):
            assert sent < 32, gateway.server.logs()[-3000:]
            record = complete(gateway, prompt(), f"p-{sent}", stream=sent % 2 == 1, max_tokens=16, ignore_eos=True)
            assert record["completion_tokens"] == 16
            sent += 1
        rate_lines, step_lines = learned("prefill_rate_learned"), learned("decode_step_learned")
        assert len(rate_lines) == 1 and rate_lines[0]["model"] == "tiny" and rate_lines[0]["configured_tokens_per_s"] == 100
        assert rate_lines[0]["tokens_per_s"] > 1000
        assert len(step_lines) == 1 and step_lines[0]["model"] == "tiny" and step_lines[0]["configured_step_ms"] == 1000
        step_ms = step_lines[0]["step_ms"]
        itl_ms = [gateway.record(f"p-{i}")["itl_mean_ms"] for i in range(1, sent, 2)]  # the streamed ones
        itl_ms = [itl for itl in itl_ms if itl]
        assert 0.3 * min(itl_ms) < step_ms < 3 * max(itl_ms) and step_ms < 200, (step_ms, itl_ms)
        rate = gateway_metric(gateway, "kvgate_routing_prefill_tokens_per_second", model="tiny")
        # The gauge is the rate in use: the one logged, or a refresh since (each moves it by more than
        # LEARN_REFRESH, unlogged: 32,590 -> 37,592 tokens/s once on a busy host); the scores below
        # check that it is the rate decisions use.
        assert 0.5 * rate <= rate_lines[0]["tokens_per_s"] <= 2 * rate, (rate, rate_lines)
        step_s = gateway_metric(gateway, "kvgate_routing_decode_step_seconds", model="tiny")
        assert abs(step_s * 1000 - step_ms) <= 0.1 * step_ms + 0.01
        later = complete(gateway, prompt(), "later")
        scores = later["routing"]["scores"]
        assert scores["r0"] == scores["r1"]  # one rate per model: the replicas' scores stay comparable
        assert abs(scores["r0"] - PREFILL_WEIGHT * 600 / rate) <= 0.002 + 0.01 * scores["r0"], (scores, rate)
        # One long stream keeps a replica decoding while another request is routed.
        with ThreadPoolExecutor(1) as pool:
            busy = pool.submit(complete, gateway, prompt(40), "busy", max_tokens=1200, ignore_eos=True, stream=True)
            holder = poll(lambda: next((name for name in ("r0", "r1") if gateway_metric(
                gateway, "kvgate_requests_in_flight", replica=name) == 1), None), "the long stream running",
                gateway.server)
            # Probes until one is routed while the stream decodes (past its first token: on a busy
            # machine that took more than the 0.2 s once waited here), bounded.
            for attempt in range(40):
                time.sleep(0.1)
                probe = complete(gateway, prompt(40), f"probe-{attempt}")
                if probe["routing"]["load_estimate"][holder]["decoding"] or busy.done():
                    break
            busy.result(timeout=60)
        estimate = probe["routing"]["load_estimate"][holder]
        assert estimate["decoding"] == 1
        assert abs(estimate["queue_delay_ms"] - step_s * 1000) <= 0.05 * step_s * 1000 + 0.01, (estimate, step_s)
        assert '"prefill_rate_differs"' not in gateway.server.logs()


def test_non_streamed_requests_are_timed_first_then_one_in_n_at_most_one_per_gap():
    """What the load model learns from traffic that never streams costs a relayed stream each: a
    model's first requests, then one in TIMED_EVERY, but at saturation no more than one per
    TIMED_GAP_S (a burst of 1,000 is timed TIMED_FIRST + 1 times, not 90)."""
    config = parse_config("routing: {policy: cache_aware}\n"
                          "replicas:\n  - {name: r0, url: 'http://127.0.0.1:1', model: m}\n")
    router = Router(config, GatewayMetrics())
    now = [100.0]
    router.state.clock = lambda: now[0]
    burst = [router.times_non_stream("m") for _ in range(1000)]
    assert all(burst[:TIMED_FIRST]) and sum(burst[TIMED_FIRST:]) == 1
    steady = 0
    for _ in range(20 * TIMED_EVERY):  # 100 requests a second: one in TIMED_EVERY, as ever
        now[0] += 0.01
        steady += router.times_non_stream("m")
    assert steady == 20 and 0.01 * TIMED_EVERY > TIMED_GAP_S
    router.apply(parse_config("routing: {policy: round_robin}\n"
                               "replicas:\n  - {name: r0, url: 'http://127.0.0.1:1', model: m}\n"))
    assert not any(router.times_non_stream("m") for _ in range(100))  # nothing to learn for


def test_a_tries_routing_explanation_says_what_the_policy_saw_when_it_chose():
    """The record's `routing` is built when the record is written, after the answer: its loads,
    estimates and reason are still those of the moment of the choice, not of the write."""
    config = parse_config("routing: {policy: cache_aware}\nreplicas:\n"
                          "  - {name: r0, url: 'http://127.0.0.1:1', model: m}\n"
                          "  - {name: r1, url: 'http://127.0.0.1:2', model: m}\n")
    router = Router(config, GatewayMetrics())
    tracker = router.state.tracker
    tracker.on_routed("r1", 100)  # one of ours already waiting on r1
    ids = list(range(48))
    with router.attempt(["r0", "r1"], "m", ids, router.hashes(ids, None), None, None, 4) as attempt:
        assert attempt.replica == "r0"
        attempt.retried_after = ["r9"]
    for _ in range(3):  # after the choice: more load everywhere, and the try itself has ended
        tracker.on_routed("r0", 100)
        tracker.on_routed("r1", 100)
    routing = msgspec.to_builtins(attempt.log)  # as the record's JSON has it
    assert routing["chosen"] == "r0" and routing["load"] == {"r0": 0, "r1": 1}
    assert {name: e["waiting"] for name, e in routing["load_estimate"].items()} == {"r0": 0, "r1": 1}
    assert routing["load_estimate"]["r1"]["in_flight"] == 1 and routing["mode"] == "approximate"
    assert routing["retried_after"] == ["r9"] and "reason" in routing


def test_a_try_is_made_the_same_by_its_c_call_as_by_its_python_lines(monkeypatch):
    """gateway/router.py's try (RoutedAttempt) made in one C call (routing/_decision.c new_attempt)
    has every slot the Python lines set, equal, for both policies, precise and approximate replicas,
    a replica with ours queued and one without, a replica the tracker has not seen; the tracker
    counts it the same way (its loads, tickets, running prompts), and the try ends the same."""
    from gateway import router as router_module
    from routing import load

    if router_module._new_attempt is None:
        pytest.skip("routing/_decision.c not built")
    slots = [name for cls in router_module.RoutedAttempt.__mro__ for name in getattr(cls, "__slots__", ())]
    made_in_c = [0]
    new_attempt = router_module._new_attempt

    def counted(*args):
        attempt = new_attempt(*args)
        made_in_c[0] += attempt is not None
        return attempt
    monkeypatch.setattr(router_module, "_new_attempt", counted)

    def run(native: bool, native_load: bool) -> list:
        monkeypatch.setattr(router_module, "NATIVE", native)
        monkeypatch.setattr(load, "NATIVE", native_load)
        made = []
        for policy in ("cache_aware", "round_robin"):
            config = parse_config(f"routing: {{policy: {policy}}}\nreplicas:\n"
                                  "  - {name: r0, url: 'http://127.0.0.1:1', model: m}\n"
                                  "  - {name: r1, url: 'http://127.0.0.1:2', model: m}\n")
            router = Router(config, GatewayMetrics())
            router.state.clock = router.state.tracker.clock = lambda: 100.0  # the loads' backlog: no drift
            router.precise["r1"] = True
            tracker = router.state.tracker
            tracker.on_routed("r1", 100)  # one of ours already waiting on r1
            for n in range(6):
                ids = list(range(n * 7, n * 7 + 40 + n))
                candidates = ["r0", "r1"] if n != 5 else ["r2"]  # r2: not in the tracker yet
                attempt = router.attempt(candidates, "m", ids, router.hashes(ids, None), None, None, 4)
                assert type(attempt) is router_module.RoutedAttempt
                fields = {name: getattr(attempt, name) for name in slots}
                fields["routed_s"] = type(fields["routed_s"])
                fields.pop("state"), fields.pop("router"), fields.pop("decision")
                made.append((fields, {name: (l.waiting, l.routed, sorted(l.running_prompts)) for name, l
                                      in tracker.replicas.items()}, tracker.own_total))
                if n % 2:
                    attempt.first_token()
                attempt.cached_tokens = 16
                with attempt:
                    pass
                made.append(({name: l.waiting + l.decoding for name, l in tracker.replicas.items()},
                             attempt.done, attempt.started_decoding))
        return made

    python = run(False, False)
    assert made_in_c[0] == 0
    assert run(True, True) == python and run(True, False) == python
    assert made_in_c[0] == 2 * 2 * 6  # every try of both native runs made in C
    assert any(fields["_mode"] == "precise" for fields, *_ in python[::2])
    assert {fields["prefill_sample"] for fields, *_ in python[::2]} == {True, False}
