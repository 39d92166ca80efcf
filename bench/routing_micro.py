"""Routing decision time and prefix-table memory: an 8,000-token prompt, 16 replicas, 1M cached blocks.

Run: .venv/bin/python bench/routing_micro.py [--iterations N]
Decision = cache_aware.choose (table match + load + score + the approximate-mode insert),
tokenization excluded; reported with the prompt's block hashes precomputed and with hashing.
"""
from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc

import numpy as np

from routing import RouteRequest, RoutingState, make_policy
from routing.hashing import block_hashes

REPLICAS = [f"r{i}" for i in range(16)]


def percentile(values, q):
    values = sorted(values)
    return values[min(int(len(values) * q), len(values) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=1000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    clock_now = [0.0]
    tracemalloc.start()
    state = RoutingState(clock=lambda: clock_now[0])
    for name in REPLICAS:
        state.add_replica(name, "m", 1_000_000 // 16)
    table = state.table("m")
    for i in range(2000):  # 1M cached blocks
        table.insert(REPLICAS[i % 16], rng.integers(1, 2**63, 500, dtype=np.uint64), guessed=False, now=0)
    traced, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    cached = sum(table.size(r) for r in REPLICAS)
    policy = make_policy("cache_aware", {"learn_from_routing": False}, state)
    tokens = [random.randrange(50_000) for _ in range(8000)]
    hashes = block_hashes(tokens)
    for name, blocks in (("r3", 64), ("r7", 300), ("r11", 500)):  # shared prefixes of various lengths
        table.insert(name, hashes[:blocks], guessed=False, now=0)
    prompts = {"no match": block_hashes([t + 1 for t in tokens]), "64..500-block matches": hashes}
    rows = []
    gc.disable()
    for label, prompt_hashes in prompts.items():
        keys = np.asarray(prompt_hashes, dtype=np.uint64)
        for with_hashing in (False, True):
            times = []
            n = args.iterations if not with_hashing else max(args.iterations // 4, 200)
            for _ in range(n):
                started = time.perf_counter_ns()
                h = block_hashes(tokens) if with_hashing else keys
                policy.choose(REPLICAS, RouteRequest(model="m", prompt_token_ids=tokens, block_hashes=h))
                times.append(time.perf_counter_ns() - started)
            rows.append((label, "with hashing" if with_hashing else "hashes given",
                         percentile(times, 0.5) / 1e3, percentile(times, 0.99) / 1e3))
    gc.enable()
    print(f"prefix table: {cached:,} cached blocks on {len(REPLICAS)} replicas; arrays {table.memory_bytes():,} B, "
          f"tracemalloc {traced:,} B")
    print(f"{'prompt (8,000 tokens, 500 blocks)':<36}{'':<16}{'p50 us':>10}{'p99 us':>10}")
    for label, mode, p50, p99 in rows:
        print(f"{label:<36}{mode:<16}{p50:>10.1f}{p99:>10.1f}")
    p99 = max(row[3] for row in rows if row[1] == "hashes given")
    per_block = traced / cached
    print(f"target routing_decision_p99_us: {p99:.1f} (goal <= 50, hashes given, worst prompt) "
          f"{'met' if p99 <= 50 else 'short'}")
    print(f"target bytes_per_cached_block: {per_block:.1f} (goal <= 64) {'met' if per_block <= 64 else 'short'}")




if __name__ == "__main__":
    main()
