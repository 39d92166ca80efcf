"""The serving engine end to end, against real `python -m replica --model tiny` processes:
continuous batching gives each request the tokens it gets alone, prefix caching reuses blocks
and says so in usage, a pool too small for the load preempts and still finishes everything,
and the KV event stream rebuilds exactly the replica's cache contents."""
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx  # ships with the openai SDK (test extra)
import pytest
import torch
import zmq

from protocol.kv_events import BlockRemoved, BlockStored, decode_batch
from tests.kv_index import replay_into_index
from tests.test_kv_events import collect, replay
from replica.loader import load_model
from replica.model_runner import ModelRunner, greedy_generate
from routing.hashing import ROOT_HASH, block_hashes
from tests.servers import free_port, run_replica

TIMEOUT = httpx.Timeout(60.0)
GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True}
TINY_KV_BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 tokens, 2 kv heads, dim 16, fp32


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


def alone(tiny, prompt: list[int], max_tokens: int) -> list[int]:
    """The model's own greedy loop for one sequence (paged path, nothing else in the batch)."""
    runner = ModelRunner(tiny.model, tiny.config, num_blocks=-(-(len(prompt) + max_tokens) // 16))
    return greedy_generate(runner, prompt, max_tokens)


def complete(url: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    response = httpx.post(url + "/v1/completions", timeout=TIMEOUT,
                          json={"prompt": prompt, "max_tokens": max_tokens, **GREEDY, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def tokens_of(body: dict) -> list[int]:
    return body["choices"][0]["token_ids"]


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def random_prompts(count: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(*lengths))] for _ in range(count)]


def test_16_concurrent_mixed_requests_match_each_alone(tiny):
    prompts = random_prompts(16, seed=1, lengths=(3, 150))
    max_tokens = [4 + (7 * i) % 21 for i in range(16)]
    # A small step budget so long prompts are prefilled in chunks beside running decodes.
    with run_replica("tiny", extra_args=["--max-num-batched-tokens", "48"]) as replica:
        with ThreadPoolExecutor(16) as pool:
            bodies = list(pool.map(lambda i: complete(replica.url, prompts[i], max_tokens[i]), range(16)))
        assert metric(replica.url, "vllm:num_requests_running") == 0
    for i, body in enumerate(bodies):
        assert tokens_of(body) == alone(tiny, prompts[i], max_tokens[i]), f"request {i}"
        assert body["usage"]["completion_tokens"] == max_tokens[i]


def test_shared_prefix_hits_the_cache_with_identical_tokens(tiny):
    prefix = random_prompts(1, seed=2, lengths=(45, 46))[0]            # 45 tokens: 2 full blocks
    first, second = prefix + [11, 12, 13], prefix + [21, 22, 23, 24, 25]
    with run_replica("tiny") as replica:
        url = replica.url
        cold = complete(url, first, 12)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        shared = complete(url, second, 12)
        assert shared["usage"]["prompt_tokens_details"]["cached_tokens"] == 32   # the shared full blocks
        warm = complete(url, first, 12)
        # 48 tokens: 3 full blocks, but the third holds the last token and is computed again
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        salted = complete(url, first, 12, cache_salt="another-tenant")
        assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert metric(url, "vllm:prefix_cache_hits_total") == 64
        assert metric(url, "vllm:prefix_cache_queries_total") == 48 + 50 + 48 + 48
    assert tokens_of(cold) == tokens_of(warm) == tokens_of(salted) == alone(tiny, first, 12)
    assert tokens_of(shared) == alone(tiny, second, 12)


def test_small_pool_preempts_finishes_everything_and_events_rebuild_the_cache(tiny):
    pub_endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    num_blocks = 12                               # 192 token slots for 8 requests of ~60 tokens
    kv_gb = num_blocks * TINY_KV_BYTES_PER_BLOCK / (1 << 30)
    prompts = random_prompts(8, seed=3, lengths=(18, 30))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    sub.connect(pub_endpoint)
    received: dict = {}
    try:
        with run_replica("tiny", extra_args=["--kv-cache-gb", f"{kv_gb:.12f}", "--kv-events-endpoint", pub_endpoint,
                                             "--kv-events-replay-endpoint", replay_endpoint]) as replica:
            url = replica.url
            too_big = httpx.post(url + "/v1/completions", timeout=TIMEOUT,
                                 json={"prompt": [5] * 100, "max_tokens": 200})
            assert too_big.status_code == 400, too_big.text
            with ThreadPoolExecutor(8) as pool:
                bodies = list(pool.map(lambda p: complete(url, p, 36), prompts))
            assert metric(url, "vllm:num_preemptions_total") > 0
            assert metric(url, "vllm:kv_cache_usage_perc") == 0
            cache = httpx.get(url + "/kvgate/cache", timeout=TIMEOUT).json()
            expected = set(cache["block_hashes"])
            # Batches still in flight after the last step arrive within a moment; bounded wait.
            deadline = time.monotonic() + 10
            index: set[int] = set()
            while time.monotonic() < deadline:
                collect(sub, received, time.monotonic() + 0.2, decode=decode_batch)
                last = max(received, default=-1)
                received.update(replay(ctx, replay_endpoint, 0, decode=decode_batch) if not received or
                                sorted(received) != list(range(last + 1)) else {})
                index = replay_into_index(received)
                if index == expected:
                    break
    finally:
        sub.close()
    for i, body in enumerate(bodies):
        assert tokens_of(body) == alone(tiny, prompts[i], 36), f"request {i}"
    assert sorted(received) == list(range(len(received)))
    assert index == expected and expected
    events = [e for seq in sorted(received) for e in received[seq].events]
    assert any(isinstance(e, BlockRemoved) for e in events)  # the run evicted blocks
    # Events carry token IDs, so a subscriber rebuilds every hash with routing/hashing alone.
    for event in events:
        if isinstance(event, BlockStored):
            parent = ROOT_HASH if event.parent_block_hash is None else event.parent_block_hash
            assert block_hashes(event.token_ids, event.block_size, parent_hash=parent) == event.block_hashes


def _thread_policies(pid: int) -> dict[int, tuple[int, int]]:
    """Each thread's (scheduling policy, nice value)."""
    import os
    return {int(tid): (os.sched_getscheduler(int(tid)), os.getpriority(os.PRIO_PROCESS, int(tid)))
            for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_BATCH"), reason="Linux scheduling policies")
def test_the_engine_computes_as_batch_work_and_its_http_thread_yields_on_wake_up():
    """By default the engine thread and the intra-op thread torch starts for it run SCHED_BATCH at
    nice BATCH_NICE (no wake-up preemption of a co-located gateway, which gets the CPU first), the
    process's main (HTTP) thread SCHED_BATCH at the nice value it had (no preemption either, a fair
    share); `--cpu-policy normal` keeps every thread normal. Both serve the same tokens."""
    import os

    from replica.cpu_policy import BATCH_NICE
    base_nice = os.getpriority(os.PRIO_PROCESS, 0)
    prompt = random_prompts(1, seed=5, lengths=(40, 41))[0]
    answers = []
    for extra, batch_threads, http_policy in (([], 2, os.SCHED_BATCH), (["--cpu-policy", "normal"], 0, os.SCHED_OTHER)):
        with run_replica("tiny", threads=2, extra_args=extra) as replica:
            answers.append(tokens_of(complete(replica.url, prompt, 6)))  # its first torch op starts the pool
            policies = _thread_policies(replica.proc.pid)
        assert policies.pop(replica.proc.pid) == (http_policy, base_nice)
        # The compute threads at BATCH_NICE; threads the HTTP thread starts later (executors) inherit
        # its batch policy at its nice value.
        compute = [tid for tid, (policy, nice) in policies.items()
                   if policy == os.SCHED_BATCH and nice == max(base_nice, BATCH_NICE) != base_nice]
        assert len(compute) == batch_threads or base_nice >= BATCH_NICE, policies  # (run under nice: no telling)
        if http_policy == os.SCHED_OTHER:
            assert all(policy == os.SCHED_OTHER and nice == base_nice for policy, nice in policies.values()), policies
    assert answers[0] == answers[1]


def test_cpu_policy_applies_to_the_calling_thread_only():
    import os
    import threading

    from replica.cpu_policy import BATCH_NICE, apply_to_current_thread
    seen = {}

    def worker():
        seen["applied"] = apply_to_current_thread("batch")
        seen["policy"] = os.sched_getscheduler(threading.get_native_id())
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)
    if hasattr(os, "SCHED_BATCH"):
        assert seen == {"applied": True, "policy": os.SCHED_BATCH,
                        "nice": max(BATCH_NICE, os.getpriority(os.PRIO_PROCESS, 0))}
        assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
    with pytest.raises(ValueError, match="batch, normal"):
        apply_to_current_thread("realtime")
