"""Load tracker: own accounting, scraped metrics with a staleness bound, Prometheus parsing."""
from routing.load import LoadModel, LoadTracker, parse_load_metrics

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
