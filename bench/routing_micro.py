"""Routing decision time and prefix-table memory: an 8,000-token prompt, 16 replicas, 1M cached blocks.

Run: .venv/bin/python -m bench.routing_micro [--iterations N]
Decision = cache_aware.choose (table match + load + score + balance guard + decision record),
timed with perf_counter_ns around choose() alone (the request object is built before), on a clock
past the guess TTL (the TTL check runs), tokenization excluded. Rows:
  hashes given, list           the prompt's block hashes as the list of ints the gateway computes
                               once per request (gateway.router.Router.hashes): the target
  hashes given, uint64 array   the same hashes as a uint64 array (read in place; a list's ints are
                               converted in C, ~1 us for 500)
  hashing included             block_hashes(token IDs) + choose, timed together
  block hashing alone          block_hashes: the per-request cost before routing
  approximate: commit          cache_aware.commit(decision): the prompt's 500 blocks inserted as
                               guesses on the chosen replica; the gateway runs it after dispatching
                               the request (next event-loop turn), off the decision path
  expired guesses in table     the same decision after 3 other replicas guessed 200..500 of the
                               prompt's blocks, past their TTL: the match reads guess bits and stamps
                               and drops them
  expired, numpy lookup         the row above through the numpy lookup (the C one not used): what an
                               install without a C compiler gets
A noise-floor row times a plain Python loop of the decision's median duration the same way: the
machine's own p99 (scheduler, neighbours). The target line is the worst p99 of the in-target rows
(list and uint64 array, both prompts, with and without guesses); the median line says what the code costs
when nothing preempts it. Timings are wall clock on whatever else the machine runs: compare rows
side by side. Measurement hygiene (printed): the process is pinned to one CPU and its priority
raised when permitted (nice -10, root only), every row is warmed up first; the GC stays on and
no sample is dropped.
"""
from __future__ import annotations

import argparse
import os
import random
import time
import tracemalloc

import numpy as np

from routing import RouteRequest, RoutingState, make_policy
from routing.hashing import block_hashes
from routing.prefix_table import _native as native
from routing.prefix_table import as_block_keys

REPLICAS = [f"r{i}" for i in range(16)]


def percentile(values, q):
    values = sorted(values)
    return values[min(int(len(values) * q), len(values) - 1)]


WARMUP = 200


def _idle_ticks(cpus) -> dict[int, int]:
    """Idle jiffies per CPU from /proc/stat (empty where it is unreadable)."""
    try:
        with open("/proc/stat") as stat:
            fields = [line.split() for line in stat if line.startswith("cpu") and line[3].isdigit()]
    except OSError:
        return {}
    return {int(f[0][3:]): int(f[4]) for f in fields if int(f[0][3:]) in cpus}


def hygiene() -> str:
    """Pin to one CPU (no migrations mid-sample) and raise priority if permitted; say what applied."""
    applied = []
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        idle = _idle_ticks(cpus)
        time.sleep(0.3)
        after = _idle_ticks(cpus)
        cpu = max(cpus, key=lambda c: after.get(c, 0) - idle.get(c, 0))  # the one neighbours use least now
        os.sched_setaffinity(0, {cpu})
        applied.append(f"pinned to CPU {cpu} (the idlest of {len(cpus)})")
    try:
        os.nice(-10)
        applied.append("nice -10")
    except OSError:
        applied.append("nice not permitted (skipped)")
    return ", ".join(applied + [f"{WARMUP} warm-up calls per row", "GC on", "no samples dropped"])


def timed(fn, n: int, warmup: int = WARMUP) -> list[int]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        started = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=1000)
    args = parser.parse_args()
    applied = hygiene()
    rng = np.random.default_rng(0)
    random.seed(0)
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
    precise = make_policy("cache_aware", {"learn_from_routing": False}, state)
    tokens = [random.randrange(50_000) for _ in range(8000)]
    hashes = block_hashes(tokens)
    for name, blocks in (("r3", 64), ("r7", 300), ("r11", 500)):  # shared prefixes of various lengths
        table.insert(name, hashes[:blocks], guessed=False, now=0)
    clock_now[0] = 2 * state.guess_ttl_s  # decisions run later: the guess-TTL check is live
    other_tokens = [t + 1 for t in tokens]
    prompts = {"no match": (other_tokens, block_hashes(other_tokens)), "64..500-block matches": (tokens, hashes)}

    def decide(request):
        return precise.choose(REPLICAS, request)  # a pure decision: loads stay as they were

    def timed_decisions(request, count: int) -> list[int]:
        for _ in range(WARMUP):
            decide(request)
        times = []
        for _ in range(count):
            started = time.perf_counter_ns()
            precise.choose(REPLICAS, request)
            times.append(time.perf_counter_ns() - started)
        return times

    n = args.iterations
    n_hashing = max(n // 4, 200)
    rows = []  # (prompt, mode, in target, p50 us, p99 us, p99.9 us)

    def row(label, mode, in_target, times):
        rows.append((label, mode, in_target, percentile(times, 0.5) / 1e3, percentile(times, 0.99) / 1e3,
                     percentile(times, 0.999) / 1e3))
    for label, (prompt_tokens, prompt_hashes) in prompts.items():
        as_array = as_block_keys(prompt_hashes)
        for mode, in_target, request in (
                ("hashes given, list", True,
                 RouteRequest(model="m", prompt_token_ids=prompt_tokens, block_hashes=prompt_hashes)),
                ("hashes given, uint64 array", True,
                 RouteRequest(model="m", prompt_token_ids=prompt_tokens, block_hashes=as_array))):
            row(label, mode, in_target, timed_decisions(request, n))
        times = timed(lambda: decide(RouteRequest(model="m", prompt_token_ids=prompt_tokens,
                                                  block_hashes=block_hashes(prompt_tokens))), n_hashing)
        row(label, "hashing included", False, times)
    row("(any)", "block hashing alone", False, timed(lambda: block_hashes(tokens), n_hashing))
    # The machine's own tail: a fixed Python loop as long as the slowest in-target decision's p50,
    # timed the same way. If its p99 is milliseconds too, the decision's p99 is the scheduler's
    # (neighbours preempting us for a time slice every few ms), not the code's.
    decision_p50_ns = max(r[3] for r in rows if r[2]) * 1e3
    probe = timed(lambda: sum(range(1000)), 200)
    steps = max(int(1000 * decision_p50_ns / percentile(probe, 0.5)), 100)
    row("(machine noise floor)", f"sum(range({steps})) loop", False, timed(lambda: sum(range(steps)), n))
    floor_row = rows[-1]
    # Last: it writes guesses into the table (the chosen replica gets the prompt's blocks).
    approximate = make_policy("cache_aware", {"learn_from_routing": True}, state)
    request = RouteRequest(model="m", prompt_token_ids=tokens, block_hashes=hashes)  # as the gateway gives them
    times = timed(lambda: approximate.commit(decide(request)), n_hashing)  # decide's share shown above
    row("64..500-block matches", "approximate: decide + commit", False, times)
    # Guesses on the prompt's blocks from other replicas, then the clock moved past their TTL: the
    # match must read guess bits and stamps and drop them (r3, r7, r11 still hold theirs confirmed).
    for name, blocks in (("r5", 200), ("r9", 400), ("r13", 500)):
        table.insert(name, hashes[:blocks], guessed=True, now=clock_now[0])
    clock_now[0] += 2 * state.guess_ttl_s
    assert table.match(hashes, clock_now[0], ["r5", "r9", "r13", "r11"]) == {"r5": 0, "r9": 0, "r13": 0, "r11": 500}
    row("64..500-block matches", "expired guesses in table", True, timed_decisions(request, n))
    if native is not None:  # the same decision through the numpy lookup, for comparison
        table.native = False
        row("64..500-block matches", "expired, numpy lookup", False, timed_decisions(request, n))
        table.native = True

    print(f"prefix table: {cached:,} cached blocks on {len(REPLICAS)} replicas; arrays {table.memory_bytes():,} B, "
          f"tracemalloc {traced:,} B")
    print(f"measurement: {applied}")
    print("prefix lookup: " + ("C (routing/_prefix_match.c)" if native is not None
                               else "numpy (routing/_prefix_match.c not built: no C compiler at install)"))
    print(f"{'prompt (8k tokens, 500 blk)':<28}{'mode':<30}{'includes hashing':<18}{'in target':<11}"
          f"{'p50 us':>9}{'p99 us':>9}{'p99.9 us':>10}")
    for label, mode, in_target, p50, p99, p999 in rows:
        includes = "yes" if "hashing" in mode else "-" if label.startswith("(machine") else "no"
        print(f"{label:<28}{mode:<30}{includes:<18}{'yes' if in_target else 'no':<11}{p50:>9.1f}{p99:>9.1f}"
              f"{p999:>10.1f}")
    p99 = max(r[4] for r in rows if r[2])
    p50 = max(r[3] for r in rows if r[2])
    floor_p99 = floor_row[4]
    per_block = traced / cached
    print(f"figure routing_decision_p50_us: {p50:.1f}")
    print(f"figure noise_floor_p99_us: {floor_p99:.1f} (a loop as long as the decision's median)")
    print(f"target routing_decision_p99_us: {p99:.1f} (goal <= 50) {'met' if p99 <= 50 else 'short'}")
    print(f"target bytes_per_cached_block: {per_block:.1f} (goal <= 64) {'met' if per_block <= 64 else 'short'}")


if __name__ == "__main__":
    main()
