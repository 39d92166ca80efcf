"""Cache-aware routing against the baselines, on real replicas, in one run.

4 built-in tiny replicas (`python -m replica --model tiny`) with a small KV budget each (so a
replica cannot hold every prefix and eviction matters), behind the gateway. Workload: G prefix
groups x R requests, each a P-token shared prefix + an S-token unique suffix, in a seeded random
order with Poisson arrivals. For each policy the replicas are restarted (caches start empty) and
the same schedule is replayed; printed per policy:

  - cluster prefix-cache hit rate: the replicas' own counters, sum of vllm:prefix_cache_hits
    deltas / sum of vllm:prefix_cache_queries deltas (tokens)
  - max/mean requests per replica (vllm:request_success deltas)
  - TTFT p50/p99 (client side, streams) and throughput
and once: the oracle hit rate, one LRU cache of the summed size replaying the same arrival order.

    .venv/bin/python -m bench.cache_routing            # 32 groups x 16, 1,024 + 64 tokens, 8 out, 10 req/s: ~4 min
    .venv/bin/python -m bench.cache_routing --quick    # 8 groups x 8: ~1.5 min (too few requests for stable figures)
    .venv/bin/python -m bench.cache_routing --policies cache_aware,cache_aware_approx   # precise vs approximate
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from routing.hashing import block_hashes
from tests.servers import free_port, run_gateway, run_replica

BLOCK = 16
TINY_KV_BYTES_PER_BLOCK = 2 * 2 * BLOCK * 2 * 16 * 4  # K+V x 2 layers x 16 tokens x 2 kv heads x dim 16 x fp32
REPLICAS = 4
POLICIES = ("round_robin", "least_load", "consistent_hash", "cache_aware")  # + "cache_aware_approx" (no KV events)


@dataclass
class Settings:
    groups: int = 32
    per_group: int = 16
    prefix_tokens: int = 1024
    suffix_tokens: int = 64
    max_tokens: int = 8
    rate_rps: float = 10.0
    # A replica holds 8 groups' prefixes (512 blocks) plus its requests in flight (68+ blocks each):
    # the 4 together hold all 32 prefixes, one alone a quarter of them.
    capacity_blocks: int = 1024
    seed: int = 0
    balance_slack: float = 0.0     # cache_aware's routing.cache_aware.balance_slack


def workload(s: Settings) -> list[tuple[float, int, list[int]]]:
    """(arrival offset s, group, prompt token IDs), seeded; groups interleaved at random."""
    rng = random.Random(s.seed)
    prefixes = [[rng.randrange(10, 250) for _ in range(s.prefix_tokens)] for _ in range(s.groups)]
    order = [g for g in range(s.groups) for _ in range(s.per_group)]
    rng.shuffle(order)
    t, out = 0.0, []
    for g in order:
        t += rng.expovariate(s.rate_rps)
        out.append((t, g, prefixes[g] + [rng.randrange(10, 250) for _ in range(s.suffix_tokens)]))
    return out


def oracle_hit_rate(requests, capacity_blocks: int) -> float:
    """One LRU cache of `capacity_blocks` (the replicas' sum), same arrival order, prefix hits."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit_tokens = query_tokens = 0
    for _t, _g, prompt in requests:
        hashes = block_hashes(prompt, BLOCK)
        hit = 0
        for h in hashes:
            if h not in cache:
                break
            hit += 1
        hit_tokens += hit * BLOCK
        query_tokens += len(prompt)
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hit_tokens / query_tokens


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def replay(url: str, requests, max_tokens: int) -> tuple[list[float], float, int]:
    """Send the schedule (open loop); returns TTFTs, wall seconds, failures."""
    ttfts: list[float] = []
    failures = 0
    timeout = aiohttp.ClientTimeout(total=300)

    async def one(session, offset: float, prompt: list[int], start: float) -> None:
        nonlocal failures
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        sent = time.perf_counter()
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    failures += 1
                    await resp.read()
                    return
                first = None
                async for line in resp.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter() - sent
                if first is not None:
                    ttfts.append(first)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            failures += 1

    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1024)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(one(session, t, prompt, start) for t, _g, prompt in requests))
        return ttfts, time.perf_counter() - start, failures


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def run_policy(policy: str, s: Settings, requests, workdir: Path, keep_logs: str | None = None) -> dict:
    kv_gb = s.capacity_blocks * TINY_KV_BYTES_PER_BLOCK / (1 << 30)
    with contextlib.ExitStack() as stack:
        endpoints = [(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}") for _ in range(REPLICAS)]
        replicas = [stack.enter_context(run_replica("tiny", extra_args=[
            "--kv-cache-gb", f"{kv_gb:.9f}", "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay_ep,
            "--log-level", "warning"])) for pub, replay_ep in endpoints]
        precise = policy == "cache_aware"
        name = "cache_aware" if policy.startswith("cache_aware") else policy
        port = free_port()
        entries = "".join(
            f"  - name: r{i}\n    url: {r.url}\n    model: tiny\n    capacity_blocks: {s.capacity_blocks}\n"
            + (f"    kv_events: {{endpoint: '{pub}', replay_endpoint: '{rep}'}}\n" if precise else "")
            for i, (r, (pub, rep)) in enumerate(zip(replicas, endpoints)))
        config = workdir / f"{policy}.yaml"
        config.write_text(f"gateway: {{host: 127.0.0.1, port: {port}}}\nlogging: {{format: json, level: {'info' if keep_logs else 'warning'}}}\n"
                          f"routing:\n  policy: {name}\n  scrape_interval_s: 0.5\n"
                          f"  cache_aware: {{balance_slack: {s.balance_slack}}}\nreplicas:\n{entries}")
        gateway = stack.enter_context(run_gateway(config, port))
        before = [(metric(r.url, "vllm:prefix_cache_hits_total"), metric(r.url, "vllm:prefix_cache_queries_total"),
                   metric(r.url, "vllm:request_success_total")) for r in replicas]
        ttfts, wall_s, failures = asyncio.run(replay(gateway.url, requests, s.max_tokens))
        after = [(metric(r.url, "vllm:prefix_cache_hits_total"), metric(r.url, "vllm:prefix_cache_queries_total"),
                  metric(r.url, "vllm:request_success_total")) for r in replicas]
        if keep_logs:
            Path(keep_logs).mkdir(parents=True, exist_ok=True)
            (Path(keep_logs) / f"{policy}.gateway.log").write_text(gateway.logs())
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    served = [a[2] - b[2] for a, b in zip(after, before)]
    mean = sum(served) / len(served)
    return {"policy": policy, "hit_rate": hits / queries if queries else 0.0, "served": served,
            "max_over_mean": max(served) / mean if mean else float("nan"),
            "ttft_p50_ms": pct(ttfts, 50) * 1000, "ttft_p99_ms": pct(ttfts, 99) * 1000,
            "rps": len(ttfts) / wall_s, "failures": failures}


def target(name: str, value: float, op: str, goal: float, unit: str = "") -> str:
    ok = value >= goal if op == ">=" else value <= goal if op == "<=" else value < goal
    return f"target {name}: {value:.3g}{unit} (goal {op} {goal:.3g}{unit}) {'met' if ok else 'short'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 groups x 8 requests")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--balance-slack", type=float, default=None, help="cache_aware balance_slack")
    parser.add_argument("--capacity-blocks", type=int, default=None, help="KV blocks per replica")
    parser.add_argument("--keep-logs", default=None, help="copy each gateway's log into this directory")
    args = parser.parse_args(argv)
    s = Settings(seed=args.seed)
    if args.quick:
        s.groups, s.per_group, s.capacity_blocks = 8, 8, 320
    if args.rate:
        s.rate_rps = args.rate
    if args.balance_slack is not None:
        s.balance_slack = args.balance_slack
    if args.capacity_blocks:
        s.capacity_blocks = args.capacity_blocks
    requests = workload(s)
    oracle = oracle_hit_rate(requests, REPLICAS * s.capacity_blocks)
    print(f"workload: {s.groups} groups x {s.per_group} requests, {s.prefix_tokens}-token prefix + "
          f"{s.suffix_tokens}-token suffix, {s.max_tokens} output tokens, Poisson {s.rate_rps:g} req/s "
          f"(seed {s.seed}); {REPLICAS} tiny replicas x {s.capacity_blocks} KV blocks", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvgate-cache-bench-") as tmp:
        for policy in args.policies.split(","):
            started = time.monotonic()
            results[policy] = run_policy(policy, s, requests, Path(tmp), args.keep_logs)
            r = results[policy]
            print(f"  {policy:<20} hit {r['hit_rate']:6.1%}  served {r['served']}  max/mean {r['max_over_mean']:.2f}  "
                  f"TTFT p50 {r['ttft_p50_ms']:7.1f} ms  p99 {r['ttft_p99_ms']:7.1f} ms  {r['rps']:5.1f} req/s  "
                  f"failures {r['failures']}  ({time.monotonic() - started:.0f} s)", flush=True)
    print(f"  {'oracle (one LRU)':<20} hit {oracle:6.1%}")
    print()
    print(f"{'policy':<20}{'hit rate':>10}{'max/mean':>10}{'TTFT p50':>11}{'TTFT p99':>11}{'req/s':>8}")
    for policy, r in results.items():
        print(f"{policy:<20}{r['hit_rate']:>10.1%}{r['max_over_mean']:>10.2f}{r['ttft_p50_ms']:>9.1f}ms"
              f"{r['ttft_p99_ms']:>9.1f}ms{r['rps']:>8.1f}")
    print(f"{'oracle':<20}{oracle:>10.1%}")
    print()
    for policy, r in results.items():
        print(f"figure {policy}_hit_rate: {r['hit_rate']:.3f}")
    print(f"figure oracle_hit_rate: {oracle:.3f}")
    ca, rr = results.get("cache_aware"), results.get("round_robin")
    if ca:
        print(target("cache_aware_hit_vs_oracle", ca["hit_rate"] / oracle, ">=", 0.9))
        print(target("cache_aware_max_over_mean", ca["max_over_mean"], "<=", 1.3))
    if ca and rr:
        print(target("cache_aware_hit_vs_round_robin", ca["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else
                     float("inf"), ">=", 2.0, "x"))
        print(target("cache_aware_ttft_p99_ms", ca["ttft_p99_ms"], "<", rr["ttft_p99_ms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
