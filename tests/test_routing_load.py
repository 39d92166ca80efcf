"""Load tracker: own accounting, scraped metrics with a staleness bound, Prometheus parsing.
Every test runs on the C estimate (routing/_decision.c) and on the Python loop."""
import random

import msgspec
import pytest

from routing import load
from routing.load import LoadModel, LoadTracker, parse_load_metrics


@pytest.fixture(autouse=True, params=["C", "Python"])
def estimate_loop(request, monkeypatch):
    if request.param == "C" and load._native_loads_and_delays is None:
        pytest.skip("routing/_decision.c not built")
    monkeypatch.setattr(load, "NATIVE", request.param == "C")
    return request.param

VLLM = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.42
"""
SGLANG = """# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 2
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 7
"""


def test_parses_vllm_and_sglang_load_metrics():
    vllm = parse_load_metrics(VLLM)
    assert (vllm.waiting, vllm.running, vllm.kv_cache_usage) == (3, 5, 0.42)
    sglang = parse_load_metrics(SGLANG)
    assert (sglang.waiting, sglang.running) == (2, 7)


def test_own_accounting_follows_a_request_through_its_life():
    tracker = LoadTracker(LoadModel(prefill_tokens_per_s=1000, decode_step_base_s=0.01, decode_step_s_per_seq=0.001))
    tracker.on_routed("a", prompt_tokens=3000, cached_tokens=1000)
    assert tracker.in_flight("a", 0) == 1
    assert abs(tracker.queue_delay_s("a", 0) - 2.0) < 1e-9
    tracker.on_first_token("a", 3000, 1000)
    assert tracker.estimate("a", 0).decoding == 1
    assert abs(tracker.queue_delay_s("a", 0) - 0.011) < 1e-9
    tracker.on_finished("a", 3000, 1000)
    assert tracker.in_flight("a", 0) == 0 and tracker.queue_delay_s("a", 0) == 0


def test_admission_room_counts_our_waiting_and_decoding_requests():
    tracker = LoadTracker()
    tracker.on_routed("a", 100)
    tracker.on_routed("a", 100)
    tracker.on_first_token("a", 100, 0)
    tracker.on_routed("b", 100)
    assert tracker.with_room(["a", "b", "never-routed"], 2) == ["b", "never-routed"]  # a: 1 waiting + 1 decoding
    assert tracker.with_room(["b", "a"], 3) == ["b", "a"]  # in the order asked
    tracker.on_finished("a", 100, 0)
    assert tracker.with_room(["a"], 2) == ["a"]
    assert tracker.with_room(["a", "b"], 1) == []


def test_admission_room_stays_exact_through_any_order_of_steps():
    """with_room answers from the tracker's running total of our requests when it is under the
    limit: whatever order requests are routed, start decoding, finish, or lose their replica to a
    reload in, that total is the sum over replicas and the answer is the per-replica check's."""
    import random

    rng = random.Random(7)
    tracker = LoadTracker()
    names = ["a", "b", "c"]
    live: list[tuple[str, int, bool]] = []  # (replica, ticket, decoding)
    for _ in range(3000):
        step = rng.random()
        if step < 0.4 or not live:
            name = rng.choice(names)
            live.append((name, tracker.on_routed(name, 100), False))
        elif step < 0.65:
            i = rng.randrange(len(live))
            name, ticket, decoding = live[i]
            if not decoding:
                tracker.on_first_token(name, 100)
                live[i] = (name, ticket, True)
        elif step < 0.98:
            name, ticket, decoding = live.pop(rng.randrange(len(live)))
            if name in tracker.replicas:  # as routing.attempt does after a reload removed it
                tracker.on_finished(name, 100, started_decoding=decoding, ticket=ticket)
        else:
            gone = rng.choice(names)
            tracker.remove_replica(gone)
        assert tracker.own_total == sum(tracker.own_in_flight(n) for n in tracker.replicas)
        limit = rng.randint(1, 12)
        assert list(tracker.with_room(names, limit)) == [n for n in names if tracker.own_in_flight(n) < limit]


def test_the_prefill_ahead_drains_while_the_replica_works_on_it():
    """A long prompt routed a while ago is partly prefilled: a new request does not wait for all of it
    (routing a cache hit away from a replica whose queue was already half done is a miss)."""
    now = [0.0]
    tracker = LoadTracker(LoadModel(prefill_tokens_per_s=1000, decode_step_base_s=0, decode_step_s_per_seq=0),
                          clock=lambda: now[0])
    tracker.on_routed("a", prompt_tokens=2000)
    assert abs(tracker.queue_delay_s("a", 0.0) - 2.0) < 1e-9
    assert abs(tracker.queue_delay_s("a", 0.5) - 1.5) < 1e-9
    assert tracker.queue_delay_s("a", 3.0) == 0 and tracker.in_flight("a", 3.0) == 1  # still counted as load
    now[0] = 1.0
    tracker.on_routed("a", prompt_tokens=1000)  # 1000 left of the first + this one
    assert abs(tracker.queue_delay_s("a", 1.0) - 2.0) < 1e-9
    now[0] = 1.2
    tracker.on_first_token("a", 2000)  # the first one is done: only the second's 1000 can be ahead
    assert abs(tracker.queue_delay_s("a", 1.2) - 1.0) < 1e-9
    assert abs(tracker.queue_delay_s("a", 1.7) - 0.5) < 1e-9
    now[0] = 1.7
    tracker.on_finished("a", 1000, started_decoding=False)
    tracker.on_finished("a", 2000)
    assert tracker.queue_delay_s("a", 1.7) == 0 and tracker.in_flight("a", 1.7) == 0


def test_a_learned_prefill_rate_applies_to_its_replica_and_drains_the_backlog_at_that_rate():
    now = [0.0]
    tracker = LoadTracker(LoadModel(prefill_tokens_per_s=1000, decode_step_base_s=0, decode_step_s_per_seq=0),
                          clock=lambda: now[0])
    for replica in ("a", "b"):
        tracker.on_routed(replica, prompt_tokens=2000)
    now[0] = 0.5  # half a second at the configured rate: 1500 tokens left on each
    tracker.set_prefill_rate("a", 4000.0)
    assert tracker.prefill_rate("a") == 4000.0 and tracker.prefill_rate("b") == 1000.0
    assert abs(tracker.queue_delay_s("a", 0.5) - 1500 / 4000) < 1e-9
    assert abs(tracker.queue_delay_s("b", 0.5) - 1.5) < 1e-9
    assert abs(tracker.queue_delay_s("a", 0.6) - 1100 / 4000) < 1e-9  # drains at the new rate from now on
    tracker.set_prefill_rate("a", None)
    assert tracker.prefill_rate("a") == 1000.0


def test_a_learned_decode_step_scale_applies_to_its_replica():
    tracker = LoadTracker(LoadModel(prefill_tokens_per_s=1000, decode_step_base_s=0.01, decode_step_s_per_seq=0.002))
    for replica in ("a", "b"):
        tracker.on_routed(replica, prompt_tokens=100)
        tracker.on_first_token(replica, 100)  # decoding one
    tracker.set_decode_step_scale("a", 0.25)
    assert abs(tracker.queue_delay_s("a", 0) - 0.012 * 0.25) < 1e-12
    assert abs(tracker.queue_delay_s("b", 0) - 0.012) < 1e-12
    tracker.set_decode_step_scale("a", None)
    assert abs(tracker.queue_delay_s("a", 0) - 0.012) < 1e-12


def test_scraped_load_counts_until_stale():
    tracker = LoadTracker(LoadModel(stale_after_s=10))
    tracker.on_scrape("a", parse_load_metrics(VLLM), now=100)
    assert tracker.in_flight("a", 105) == 8
    assert tracker.queue_delay_s("a", 105) > 0
    assert tracker.in_flight("a", 111) == 0  # stale: ignored


def test_a_scrape_that_saw_our_own_requests_does_not_count_them_twice():
    tracker = LoadTracker(LoadModel(stale_after_s=10))
    for _ in range(3):
        tracker.on_routed("a", prompt_tokens=100)
    # The replica reports our 3 plus 2 of someone else's.
    tracker.on_scrape("a", parse_load_metrics(VLLM.replace("3.0", "1.0").replace("5.0", "4.0")), now=100)
    assert tracker.in_flight("a", 101) == 5
    for _ in range(3):
        tracker.on_finished("a", 100, started_decoding=False)
    assert tracker.in_flight("a", 101) == 2  # ours finished since; the scrape's copy of them is not load


def test_a_request_that_finished_while_a_scrape_was_on_its_way_is_not_load_from_elsewhere():
    """The replica wrote its page while our request ran; the answer came after it finished. Our
    request was counted by the replica, so it is ours, not a phantom load for stale_after_s."""
    tracker = LoadTracker(LoadModel(stale_after_s=10))
    tracker.on_routed("a", prompt_tokens=100)
    window = tracker.scrape_window("a")              # the scrape is sent
    tracker.on_finished("a", 100, started_decoding=False)
    tracker.on_routed("a", prompt_tokens=100)        # another of ours starts and ends meanwhile
    tracker.on_finished("a", 100, started_decoding=False)
    seen = parse_load_metrics(VLLM.replace("3.0", "0.0").replace("5.0", "2.0"))  # both running then
    tracker.on_scrape("a", seen, now=100, window=window)
    assert tracker.in_flight("a", 101) == 0
    assert tracker.queue_delay_s("a", 101) == 0
    # Someone else's request, in the same scrape, still counts.
    window = tracker.scrape_window("a")
    tracker.on_scrape("a", parse_load_metrics(VLLM.replace("3.0", "0.0").replace("5.0", "1.0")), now=102,
                      window=window)
    assert tracker.in_flight("a", 103) == 1


def test_the_line_scan_reads_what_prometheus_clients_parser_reads_from_a_real_exposition():
    """parse_load_metrics scans for its few sample lines; on a page written by prometheus_client
    (label sets, a label value with braces and spaces, a longer name that starts like ours,
    histograms, a timestamp) it sums what the library's own parser finds."""
    from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    waiting = Gauge("vllm:num_requests_waiting", "w", ["model_name", "engine"], registry=registry)
    waiting.labels("m", "0").set(3)
    waiting.labels('we{ird} "name"', "1").set(4)
    Gauge("vllm:num_requests_waiting_by_reason", "x", ["reason"], registry=registry).labels("capacity").set(50)
    Gauge("vllm:num_requests_running", "r", ["model_name"], registry=registry).labels("m").set(5)
    usage = Gauge("vllm:kv_cache_usage_perc", "u", ["engine"], registry=registry)
    usage.labels("0").set(0.25)
    usage.labels("1").set(0.75)
    Histogram("vllm:time_to_first_token_seconds", "t", ["model_name"], registry=registry).labels("m").observe(0.1)
    page = generate_latest(registry).decode() + "sglang:num_queue_reqs 2 1700000000000\n"

    expected = {"waiting": 0.0, "running": 0.0, "kv": 0.0}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name in ("vllm:num_requests_waiting", "sglang:num_queue_reqs"):
                expected["waiting"] += sample.value
            elif sample.name == "vllm:num_requests_running":
                expected["running"] += sample.value
            elif sample.name == "vllm:kv_cache_usage_perc":
                expected["kv"] = max(expected["kv"], sample.value)
    got = parse_load_metrics(page)
    assert (got.waiting, got.running, got.kv_cache_usage) == (expected["waiting"], expected["running"], expected["kv"])
    assert (got.waiting, got.running, got.kv_cache_usage) == (9, 5, 0.75)


def test_the_c_estimate_equals_the_python_loop_to_the_bit():
    """Requests routed, prefilled and finished, scrapes fresh and stale, learned rates and step
    scales, at random times: the C loop's loads, delays and log records are the Python loop's,
    value and type (an int load stays an int in the decision's log), for every candidate list asked."""
    if load._native_loads_and_delays is None:
        pytest.skip("routing/_decision.c not built")
    rng = random.Random(11)
    now = [0.0]
    tracker = LoadTracker(LoadModel(prefill_tokens_per_s=3000, decode_step_base_s=0.01, decode_step_s_per_seq=0.002,
                                    stale_after_s=2.0), clock=lambda: now[0])
    names = ["a", "b", "c", "d"]
    live: list[tuple[str, int, int, bool]] = []  # (replica, prompt tokens, ticket, decoding)
    compared = 0
    for _ in range(4000):
        now[0] += rng.choice((0.0, 0.001, 0.05, 0.3))
        step = rng.random()
        replica = rng.choice(names)
        if step < 0.3:
            prompt = rng.randint(1, 4000)
            live.append((replica, prompt, tracker.on_routed(replica, prompt, rng.choice((0, prompt // 2))), False))
        elif step < 0.5 and live:
            i = rng.randrange(len(live))
            name, prompt, ticket, decoding = live[i]
            if not decoding:
                tracker.on_first_token(name, prompt, 0)
                live[i] = (name, prompt, ticket, True)
        elif step < 0.7 and live:
            name, prompt, ticket, decoding = live.pop(rng.randrange(len(live)))
            tracker.on_finished(name, prompt, 0, started_decoding=decoding, ticket=ticket)
        elif step < 0.8:
            window = tracker.scrape_window(replica)
            page = VLLM.replace("3.0", f"{rng.randint(0, 6)}.0").replace("5.0", f"{rng.randint(0, 9)}.0")
            tracker.on_scrape(replica, parse_load_metrics(page), now=now[0], window=rng.choice((window, None)))
        elif step < 0.85:
            tracker.set_prefill_rate(replica, rng.choice((None, 500.0, 12000.0)))
        elif step < 0.9:
            tracker.set_decode_step_scale(replica, rng.choice((None, 0.5, 3.0)))
        asked = rng.sample(names, rng.randint(1, len(names)))
        at = now[0] + rng.choice((0.0, 0.2, 5.0))
        load.NATIVE = True
        native = tracker.loads_and_delays(asked, at, estimates=True)
        assert tracker.loads_and_delays(asked, at) == native[:2]
        load.NATIVE = False
        python = tracker.loads_and_delays(asked, at, estimates=True)
        assert [(type(x), x) for x in native[0]] == [(type(x), x) for x in python[0]]
        assert [(type(x), x) for x in native[1]] == [(type(x), x) for x in python[1]]
        assert [[(type(v), v) for v in msgspec.structs.astuple(e)] for e in native[2]] == \
            [[(type(v), v) for v in msgspec.structs.astuple(e)] for e in python[2]]
        # The record's JSON of them, as C writes it in the same pass (estimates=bytes) and as the
        # Python loop encodes it: the same object, the same values and types, read back.
        python_json = tracker.loads_and_delays(asked, at, estimates=bytes)[2]
        load.NATIVE = True
        native_json = tracker.loads_and_delays(asked, at, estimates=bytes)[2]
        expected = msgspec.json.decode(msgspec.json.encode(dict(zip(asked, python[2]))))
        typed = lambda estimates: {name: [(type(v), v) for v in e.values()] for name, e in estimates.items()}
        assert typed(msgspec.json.decode(native_json)) == typed(msgspec.json.decode(python_json)) == typed(expected)
        assert list(msgspec.json.decode(native_json)) == asked
        compared += 1
    assert compared == 4000


def test_the_c_accounting_leaves_every_field_as_the_python_lines_do():
    """Two trackers driven through the same random lives of requests (routed with and without a
    cached prefix and block hashes, prefilled or not, finished, some on a replica not tracked yet),
    with scrapes and learned rates between: after every step each replica's fields (value and
    type: a count stays an int, the backlog a float until the pending count caps it) and the
    total in flight are the same whether routing/_decision.c or the Python lines kept them."""
    if load._native_routed is None:
        pytest.skip("routing/_decision.c not built")
    from dataclasses import fields

    def snapshot(tracker: LoadTracker) -> list:
        return [tracker.own_total] + [(name, [(f.name, type(v), v) for f in fields(one) if f.name != "scraped"
                                              for v in [getattr(one, f.name)]])
                                      for name, one in sorted(tracker.replicas.items())]

    now = [0.0]
    trackers = {native: LoadTracker(LoadModel(prefill_tokens_per_s=2000), clock=lambda: now[0])
                for native in (True, False)}
    rng = random.Random(3)
    live: list[tuple[str, int, int, dict, bool]] = []  # (replica, prompt, cached, tickets, decoding)
    for step_index in range(3000):
        now[0] += rng.choice((0.0, 0.0005, 0.02, 0.4))
        step = rng.random()
        replica = rng.choice(["a", "b", "c", f"new-{step_index}"] if step_index % 50 == 0 else ["a", "b", "c"])
        for native, tracker in trackers.items():
            load.NATIVE = native
            if step < 0.35:
                if native:
                    prompt = rng.randint(0, 3000)
                    cached = rng.choice((0, prompt // 2, prompt + 16))
                    hashes = rng.choice(((), [rng.getrandbits(64) for _ in range(prompt // 16)]))
                    live.append((replica, prompt, cached, {}, False))
                name, prompt, cached, tickets, _ = live[-1]
                tickets[native] = tracker.on_routed(name, prompt, cached, hashes)
            elif step < 0.55 and live:
                if native:
                    pick = rng.randrange(len(live))
                name, prompt, cached, tickets, decoding = live[pick]
                if not decoding:
                    tracker.on_first_token(name, prompt, cached)
                if not native:
                    live[pick] = (name, prompt, cached, tickets, True)
            elif step < 0.75 and live:
                if native:
                    pick = rng.randrange(len(live))
                name, prompt, cached, tickets, decoding = live[pick]
                tracker.on_finished(name, prompt, cached, started_decoding=decoding, ticket=tickets[native])
                if not native:
                    live.pop(pick)
            elif step < 0.85:
                tracker.on_scrape(replica, parse_load_metrics(VLLM), now=now[0])
            elif step < 0.9:
                tracker.set_prefill_rate(replica, (None, 700.0, 0.0)[step_index % 3])
        assert snapshot(trackers[True]) == snapshot(trackers[False]), step_index
    assert trackers[True].own_total > 0 and len(trackers[True].replicas) > 3


def test_a_replica_not_tracked_yet_is_added_and_estimated_idle():
    tracker = LoadTracker(LoadModel(prefill_tokens_per_s=1000))
    tracker.on_routed("a", prompt_tokens=500)
    loads, delays = tracker.loads_and_delays(("a", "new"), 0.0)
    assert loads == [1, 0] and delays[1] == 0.0 and delays[0] > 0
    assert "new" in tracker.replicas
