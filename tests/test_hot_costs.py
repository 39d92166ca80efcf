"""Shortcuts the hot path takes must not change what they stand in for: the prefix table's scalar
touch of a repeated prompt leaves the table exactly as the array path would, and metrics folded in
batches read the same as metrics updated one request at a time."""
from __future__ import annotations

import random

import numpy as np
import pytest
from prometheus_client import Gauge

from observability.metrics import FLUSH_EVERY, GatewayMetrics
from observability.request_log import RequestRecord
from routing import prefix_table
from routing.hashing import block_hashes
from routing.prefix_table import PrefixTable
from tests.test_gateway import metric


def _tables(expected_blocks: int, count: int) -> list[PrefixTable]:
    tables = []
    for _ in range(count):
        table = PrefixTable(expected_blocks=expected_blocks, guess_ttl_s=300.0)
        for name in ("a", "b", "c"):
            table.add_replica(name, 64)
        tables.append(table)
    return tables


def _state(table: PrefixTable) -> tuple:
    """Every array of the table, as bytes (compared in one memcmp each)."""
    rings = {name: (ring.hashes.tobytes(), ring.seen.tobytes(), ring.pos.tobytes()) for name, ring in table._rings.items()}
    return (table._lines.tobytes(), table._gs.tobytes(), rings, table._counts.tobytes(), table._guessing)


PATHS = ["scalar"] + (["C"] if prefix_table._native is not None else [])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("expected_blocks", [4096, 64])  # 64: buckets overflow (second choice, eviction)
def test_the_small_and_c_inserts_leave_the_table_as_the_array_path_does(monkeypatch, expected_blocks, path):
    """Inserts and removals run in C where routing/_prefix_match.c is built, else in scalar Python
    up to 16 blocks (every short prompt's guess, a replica's KV event batch of one engine step):
    slot for slot what the numpy path writes, ring evictions (CLOCK second chances, the hand,
    passes), full buckets and the sizes and turnover counts included."""
    fast, slow = _tables(expected_blocks, 2)
    fast.native = path == "C"
    slow.native = False
    rng = random.Random(3)
    prompts = [np.array(block_hashes([rng.randrange(500) for _ in range(rng.randrange(16, 200 if i % 2 else 480))]),
                        dtype=np.uint64)
               for i in range(40)]

    def both(op, *args, **kwargs):
        getattr(fast, op)(*args, **kwargs)
        monkeypatch.setattr(prefix_table, "_SMALL_INSERT", 0)
        getattr(slow, op)(*args, **kwargs)
        monkeypatch.setattr(prefix_table, "_SMALL_INSERT", 16)

    for step in range(600):
        replica, prompt = rng.choice("abc"), rng.choice(prompts)
        guessed, now = rng.random() < 0.7, step * 0.37
        if rng.random() < 0.2:  # a replica's evictions (BlockRemoved): a few blocks take the scalar path too
            start = rng.randrange(len(prompt))
            both("remove", replica, prompt[start:start + rng.choice((2, 8, 40))])
        elif rng.random() < 0.2:  # a KV event batch arrives as a list of ints
            both("insert", replica, prompt[:rng.choice((3, 12, 30))].tolist(), guessed=False, now=now)
        else:
            both("insert", replica, prompt, guessed=guessed, now=now)
        assert _state(fast) == _state(slow), step
    assert sum(fast.written(["a", "b", "c"])) > 3 * 64 * 4  # every ring turned over several times


@pytest.mark.parametrize("requests", [3, FLUSH_EVERY + 5])
def test_metrics_folded_in_batches_read_as_if_updated_one_by_one(requests):
    batched = GatewayMetrics()
    for n in range(requests):
        batched.observe_record(RequestRecord(
            "r", "/v1/completions", started_s=1.0, replica=f"r{n % 2}", status=200 if n % 5 else 502,
            first_token_s=1.0 + 0.01 * n, itl_s=[0.001 * n, 0.2], finished_s=1.5, prompt_tokens=10,
            completion_tokens=3))
    text = batched.render().decode()
    assert metric(text, "kvgate_requests_total") == requests
    assert metric(text, "kvgate_requests_total", replica="r1", status="502") == len(
        [n for n in range(requests) if n % 2 and not n % 5])
    assert metric(text, "kvgate_inter_token_latency_seconds_count") == 2 * requests
    assert metric(text, "kvgate_inter_token_latency_seconds_bucket", le="0.1") == len(
        [n for n in range(requests) if 0.001 * n <= 0.1])
    assert metric(text, "kvgate_time_to_first_token_seconds_sum") == pytest.approx(sum(0.01 * n for n in range(requests)))
    assert metric(text, "kvgate_prompt_tokens_total") == 10 * requests
    assert metric(text, "kvgate_e2e_request_latency_seconds_sum") == pytest.approx(0.5 * requests)


@pytest.mark.parametrize("tries", [3, FLUSH_EVERY + 5])
def test_per_replica_amounts_folded_in_batches_read_as_if_updated_one_by_one(tries):
    """A per-replica gauge (+1 then -1 a try) and cached-token counters, added in batches: a scrape
    in the middle sees the tries still open, one at the end sees none, and the counters' totals."""
    metrics = GatewayMetrics()
    open_tries = Gauge("kvgate_test_open_tries", "Tries open, by replica.", ["replica"], registry=metrics.registry)
    for n in range(tries):
        metrics.add(open_tries, f"r{n % 2}")
        metrics.add(metrics.predicted_cached_tokens, f"r{n % 2}", 16)
    text = metrics.render().decode()
    assert metric(text, "kvgate_test_open_tries", replica="r0") == (tries + 1) // 2
    assert metric(text, "kvgate_test_open_tries", replica="r1") == tries // 2
    for n in range(tries):
        metrics.add(open_tries, f"r{n % 2}", -1)
        metrics.add(metrics.reported_cached_tokens, f"r{n % 2}", 0 if n % 3 else 16)
    text = metrics.render().decode()
    assert metric(text, "kvgate_test_open_tries", replica="r0") == 0  # back at 0, the series still shown
    assert metric(text, "kvgate_test_open_tries", replica="r1") == 0
    assert metric(text, "kvgate_predicted_cached_tokens_total", replica="r0") == 16 * ((tries + 1) // 2)
    assert metric(text, "kvgate_reported_cached_tokens_total") == 16 * len(range(0, tries, 3))
