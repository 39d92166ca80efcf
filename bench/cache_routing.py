"""Cache-aware routing against sglang-router and round robin, on real replicas, in one run.

4 built-in tiny replicas (`python -m replica --model tiny`), each with a small KV cache
(`--capacity-blocks`, so a replica holds a fraction of the traffic's working set and eviction
matters) and each held to a fixed CPU share (`--replica-cpu`, default 0.8 x cores / replicas, via
bench.cpu_caps where cgroups allow: co-located replicas then do not slow each other down, as
replicas on separate devices do not; uncapped, four replicas on two cores reward a router that
loads few of them), serve every workload of bench.workloads (a chat, b agent, c trace, d groups) once per
router; the replicas are restarted for each run (caches start empty) and every router gets the
same requests at the same arrival times, streamed:

    kvgate cache_aware precise      the gateway with policy cache_aware, replicas' KV events in its YAML
    kvgate cache_aware approximate  the same without KV events (it learns from its own routing)
    kvgate round_robin              the baseline
    sglang-router cache_aware       sglang-router 0.3.2 with its defaults (bench-only venv, see bench.routers)

Per workload and router: the cluster prefix-cache hit rate from the replicas' own counters (sum of
vllm:prefix_cache_hits deltas / sum of vllm:prefix_cache_queries deltas), TTFT p50/p99 (client
side: first body byte of the stream), max/mean requests per replica (vllm:request_success deltas);
once per workload, the oracle: one LRU cache of the replicas' summed capacity replaying the same
arrival order at block granularity. Targets, per workload and kvgate mode: hit rate at least
sglang-router's and at least 0.9 of the oracle, TTFT p50 and p99 at most sglang-router's,
max/mean at most 1.3.

    .venv/bin/python -m bench.cache_routing                  # every workload and router, 40 s each: ~14 min
    .venv/bin/python -m bench.cache_routing --quick          # 5 s each: ~4 min, machinery only
    .venv/bin/python -m bench.cache_routing --workloads c --trace ../shared/traces/other.jsonl
    .venv/bin/python -m bench.cache_routing --routers precise,sglang --keep-logs /tmp/cr
    .venv/bin/python -m bench.cache_routing --rounds 2    # each router twice, ABBA order, pooled: fairer on a drifting host
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.cpu_caps import SHARES, CpuCaps
from bench.loadgen import RequestResult, process_cpu_s, process_tree
from bench.replay import replay
from bench.routers import RouterUnavailable, run_sglang_router, sglang_router_python
from bench.workloads import WORKLOADS, Selection, Workload, prompt_token_ids, simulate_lru, tiny_bundle
from replica.cpu_policy import POLICIES
from tests.servers import ServerStartError, free_port, run_gateway, run_replica

BLOCK = 16
TINY_KV_BYTES_PER_BLOCK = 2 * 2 * BLOCK * 2 * 16 * 4  # K+V x 2 layers x 16 tokens x 2 kv heads x dim 16 x fp32
MODEL = "tiny"
ROUTERS = {
    "precise": "kvgate cache_aware precise",
    "approximate": "kvgate cache_aware approximate",
    "round_robin": "kvgate round_robin",
    "sglang": "sglang-router cache_aware",
}
KVGATE_MODES = ("precise", "approximate")
PRECISE_WAIT_S = 20.0
PORT_ATTEMPTS = 3


@dataclass
class Settings:
    replicas: int = 4
    # 768 blocks = 12k tokens = 6 full contexts of the tiny model: one replica holds a fraction of
    # a workload's working set, the four together all of it (bench.workloads --stats).
    capacity_blocks: int = 768
    stream: bool = True
    keep_logs: str | None = None
    # Cores each replica may use (bench.cpu_caps): replicas on separate devices do not slow each
    # other down; 0 = uncapped (the replicas share the machine's cores).
    replica_cpu: float = 0.0
    replica_cpu_policy: str | None = None  # the replicas' --cpu-policy (None: their default)
    gateway_workers: int = 1               # kvgate's gateway.workers
    cap_whole_process: bool = False        # cap every replica thread, not only its compute threads
    replica_cpu_shares: int = SHARES       # the capped compute's cgroup weight against the host's other work
    rounds: int = 1                        # runs of every router per workload, in ABBA order (see merge_rounds)
    cpu_note: str = ""


@dataclass
class RunResult:
    router: str
    hit_rate: float
    served: list[int]
    ttfts_s: list[float]
    failures: int
    wall_s: float
    machine_cores: float          # CPU busy on the whole machine during the traffic, in cores
    server_cores: float           # of which the replicas and the router in front
    notes: list[str] = field(default_factory=list)
    replica_ttft_mean_s: float = float("nan")  # the replicas' own TTFT (from arrival there), mean
    steal_cores: float = 0.0      # CPU the hypervisor gave to other guests meanwhile (/proc/stat steal), in cores

    @property
    def added_ms(self) -> float:
        """Client TTFT mean - the replicas' own: what the router in front added per request."""
        return (sum(self.ttfts_s) / len(self.ttfts_s) - self.replica_ttft_mean_s) * 1000 if self.ttfts_s else float("nan")

    @property
    def max_over_mean(self) -> float:
        mean = sum(self.served) / len(self.served) if self.served else 0.0
        return max(self.served) / mean if mean else float("nan")

    def ttft_ms(self, p: float) -> float:
        return pct(self.ttfts_s, p) * 1000


def merge_rounds(runs: list[RunResult]) -> RunResult:
    """One router's runs of one workload (--rounds) as one: the requests of all rounds pooled (TTFT
    percentiles over all of them, requests per replica summed), hit rate and the per-run averages
    (cores, steal, the replicas' own TTFT) averaged over the rounds, each round's notes kept."""
    if len(runs) == 1:
        return runs[0]
    n = len(runs)
    return RunResult(runs[0].router, sum(r.hit_rate for r in runs) / n,
                     [sum(column) for column in zip(*(r.served for r in runs))],
                     [t for r in runs for t in r.ttfts_s], sum(r.failures for r in runs), sum(r.wall_s for r in runs),
                     sum(r.machine_cores for r in runs) / n, sum(r.server_cores for r in runs) / n,
                     [f"round {i + 1}: {note}" for i, r in enumerate(runs) for note in r.notes],
                     sum(r.replica_ttft_mean_s for r in runs) / n, sum(r.steal_cores for r in runs) / n)


def round_order(routers: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, router) in the order to run them: forward, then backward, and so on (A B C C B A ...),
    so that a host whose speed drifts during the bench slows every router about as much."""
    return [(i, router) for i in range(rounds) for router in (routers if i % 2 == 0 else routers[::-1])]


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def metric(url: str, name: str, **labels) -> float:
    """Sum of the samples of `name` (with these labels) in url's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if (head == name or head.startswith(name + "{")) and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def replica_counters(urls: list[str]) -> list[tuple[float, ...]]:
    """Per replica: prefix-cache hits, queries, requests served, and its own TTFT sum and count
    (from the request's arrival at the replica: what the router in front adds is not in it)."""
    return [(metric(u, "vllm:prefix_cache_hits_total"), metric(u, "vllm:prefix_cache_queries_total"),
             metric(u, "vllm:request_success_total"), metric(u, "vllm:time_to_first_token_seconds_sum"),
             metric(u, "vllm:time_to_first_token_seconds_count")) for u in urls]


def enter_server(stack: contextlib.ExitStack, start):
    """stack.enter_context(start()), again with fresh ports when one was taken in between: free_port
    only says a port was free a moment ago, and other processes on a shared machine bind ports too."""
    for attempt in range(PORT_ATTEMPTS):
        try:
            return stack.enter_context(start())
        except ServerStartError as exc:
            if attempt + 1 == PORT_ATTEMPTS or "in use" not in str(exc).lower():
                raise


def start_replicas(stack: contextlib.ExitStack, s: Settings) -> tuple[list, list[tuple[str, str]]]:
    """s.replicas tiny replicas publishing KV events (for every router alike), started in parallel,
    each capped at s.replica_cpu cores where the machine allows (bench.cpu_caps)."""
    caps = stack.enter_context(CpuCaps(s.replica_cpu, shares=s.replica_cpu_shares))  # entered first: its cgroups go once the replicas stopped
    kv_gb = s.capacity_blocks * TINY_KV_BYTES_PER_BLOCK / (1 << 30)

    def start(_index):
        endpoints: list[str] = []

        def fresh():
            endpoints[:] = [f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"]
            return run_replica(MODEL, extra_args=[
                "--kv-cache-gb", f"{kv_gb:.9f}", "--kv-events-endpoint", endpoints[0],
                "--kv-events-replay-endpoint", endpoints[1], "--log-level", "warning"]
                + (["--cpu-policy", s.replica_cpu_policy] if s.replica_cpu_policy else []))
        return enter_server(stack, fresh), tuple(endpoints)

    # Each start waits for its replica's health; the waits overlap (ExitStack's append is atomic).
    with concurrent.futures.ThreadPoolExecutor(s.replicas) as pool:
        started = list(pool.map(start, range(s.replicas)))
    replicas = [replica for replica, _ in started]
    # Unwinding stops them one by one; a SIGTERM to all first makes those waits overlap too.
    stack.callback(lambda: [r.proc.poll() is None and r.proc.send_signal(signal.SIGTERM) for r in replicas])
    for replica in replicas:
        caps.cap(replica.proc.pid, whole_process=s.cap_whole_process)
        warm_up(replica.url)
    s.cpu_note = (f"each replica capped at {s.replica_cpu:.2f} of a core ({caps.scope}; bench.cpu_caps)"
                  if not caps.unavailable
                  else f"replicas share the machine's cores ({caps.unavailable}): they slow each other down, "
                       f"which favours routers that load few replicas")
    return replicas, [endpoints for _, endpoints in started]


def warm_up(url: str) -> None:
    """A fresh replica's first prefill and decode steps are slow (lazy allocations): two short
    requests, of text no workload uses, before the counters are read."""
    for words in (8, 160):
        body = {"model": MODEL, "prompt": " W" * words, "max_tokens": 4, "temperature": 0.0}
        request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()


def kvgate_config(router: str, replicas, endpoints, port: int, log_level: str, workers: int = 1) -> str:
    """The YAML a user writes: a policy and the replicas (with their KV events in precise mode);
    `gateway.workers` when more than one."""
    policy = "round_robin" if router == "round_robin" else "cache_aware"
    entries = "".join(
        f"  - name: r{i}\n    url: {r.url}\n    model: {MODEL}\n"
        + (f"    kv_events: {{endpoint: '{pub}', replay_endpoint: '{rep}'}}\n" if router == "precise" else "")
        for i, (r, (pub, rep)) in enumerate(zip(replicas, endpoints)))
    more = f", workers: {workers}" if workers > 1 else ""
    return (f"gateway: {{host: 127.0.0.1, port: {port}{more}}}\nlogging: {{format: json, level: {log_level}}}\n"
            f"routing:\n  policy: {policy}\nreplicas:\n{entries}")


def wait_precise(gateway_url: str, count: int, workers: int = 1) -> bool:
    """Every replica in precise mode (its KV event stream subscribed) in every worker (the gauge
    has one sample per worker); polled, bounded."""
    deadline = time.monotonic() + PRECISE_WAIT_S
    while time.monotonic() < deadline:
        if all(metric(gateway_url, "kvgate_routing_mode", replica=f"r{i}") == workers for i in range(count)):
            return True
        time.sleep(0.2)
    return False


def run_router(router: str, workload: Workload, s: Settings, workdir: Path, sglang_python: Path | None,
               round_index: int = 0) -> RunResult:
    notes = []
    verbose = s.keep_logs is not None
    with contextlib.ExitStack() as stack:
        replicas, endpoints = start_replicas(stack, s)
        urls = [r.url for r in replicas]
        if router == "sglang":
            front = enter_server(stack, lambda: run_sglang_router(sglang_python, urls,
                                                                   log_level="info" if verbose else "warn"))
        else:
            config = workdir / f"{workload.name.replace(':', '_')}.{router}.yaml"

            def gateway():
                port = free_port()
                config.write_text(kvgate_config(router, replicas, endpoints, port, "info" if verbose else "warning",
                                                s.gateway_workers))
                return run_gateway(config, port)
            front = enter_server(stack, gateway)
            if router == "precise" and not wait_precise(front.url, len(replicas), s.gateway_workers):
                notes.append("precise mode not confirmed before traffic (kvgate_routing_mode != 1)")
        pids = [r.proc.pid for r in replicas] + process_tree(front.proc.pid)  # the gateway's workers too
        before, machine_before, servers_before = replica_counters(urls), machine_cpu_s(), sum(map(process_cpu_s, pids))
        results, wall_s = replay(front.url, workload.requests, model=MODEL, stream=s.stream)
        machine_after = machine_cpu_s()
        machine_cores = (machine_after[0] - machine_before[0]) / wall_s
        steal_cores = (machine_after[1] - machine_before[1]) / wall_s
        server_cores = (sum(map(process_cpu_s, pids)) - servers_before) / wall_s
        if steal_cores > STEAL_WARN_CORES:
            notes.append(f"the hypervisor took {steal_cores:.2f} cores for other guests during this run (steal): "
                         "its TTFTs are slower than the routing made them; compare with a rerun")
        after = replica_counters(urls)
        if router == "precise" and (fallbacks := metric(front.url, "kvgate_kv_events_fallbacks_total")):
            notes.append(f"{fallbacks:.0f} KV event fallbacks to approximate")
        if s.keep_logs:
            out = Path(s.keep_logs)
            out.mkdir(parents=True, exist_ok=True)
            stem = f"{workload.name.replace(':', '_')}.{router}" + (f".round{round_index + 1}" if s.rounds > 1 else "")
            (out / f"{stem}.log").write_text(front.logs())
            # What the client saw of each request, for tails of routers that log no records (sglang-router).
            (out / f"{stem}.requests.jsonl").write_text("".join(
                json.dumps({"index": i, "session": request.session, "units": len(request.units),
                            "arrival_s": round(result.scheduled_s, 4), "ttft_s": (ok_ttfts([result]) or [None])[0],
                            "latency_s": round(result.latency_s, 4), "status": result.status}) + "\n"
                for i, (request, result) in enumerate(zip(workload.requests, results))))
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    served = [round(a[2] - b[2]) for a, b in zip(after, before)]
    replica_ttft_s = sum(a[3] - b[3] for a, b in zip(after, before))
    replica_ttft_n = sum(a[4] - b[4] for a, b in zip(after, before))
    failed = [r for r in results if r.status != 200 or r.error]
    if failed:
        notes.append(f"first failure: {failed[0].error or failed[0].status}")
    return RunResult(router, hits / queries if queries else 0.0, served, ok_ttfts(results), len(failed), wall_s,
                     machine_cores, server_cores, notes,
                     replica_ttft_s / replica_ttft_n if replica_ttft_n else float("nan"), steal_cores)


# Steal above this (cores, over a run) gets a note on the run's row: on a virtual machine whose host
# is oversubscribed, a run's replicas got less CPU than their cap, whichever router ran.
STEAL_WARN_CORES = 0.1


def machine_cpu_s() -> tuple[float, float]:
    """CPU seconds the whole machine has spent busy (all cores, /proc/stat; steal included: on a
    shared machine, busy minus the bench's own processes is what the neighbours took during a run),
    and of those, steal: time the hypervisor ran other guests on our virtual cores."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields[:8]) - idle) / tick, (fields[7] if len(fields) > 7 else 0) / tick


def ok_ttfts(results: list[RequestResult]) -> list[float]:
    """Time to first token of the requests that succeeded: the stream's first body byte, or the
    whole answer's latency when not streaming."""
    return [r.ttfb_s if r.ttfb_s is not None else r.latency_s for r in results if r.status == 200 and not r.error]


def target(name: str, value: float, op: str, goal: float, unit: str = "") -> str:
    ok = value >= goal if op == ">=" else value <= goal if op == "<=" else value < goal
    return f"target {name}: {value:.3g}{unit} (goal {op} {goal:.3g}{unit}) {'met' if ok else 'short'}"


def workload_targets(key: str, runs: dict[str, RunResult], oracle_hit: float) -> list[str]:
    """The acceptance, per kvgate mode that ran: against sglang-router (when it ran) and the oracle."""
    lines = []
    sglang = runs.get("sglang")
    for mode in KVGATE_MODES:
        r = runs.get(mode)
        if r is None:
            continue
        prefix = f"{key}_{mode}"
        if sglang:
            lines.append(target(f"{prefix}_hit_rate_vs_sglang", r.hit_rate, ">=", sglang.hit_rate))
        lines.append(target(f"{prefix}_hit_vs_oracle", r.hit_rate / oracle_hit if oracle_hit else float("nan"), ">=", 0.9))
        if sglang:
            lines.append(target(f"{prefix}_ttft_p50_ms", r.ttft_ms(50), "<=", sglang.ttft_ms(50)))
            lines.append(target(f"{prefix}_ttft_p99_ms", r.ttft_ms(99), "<=", sglang.ttft_ms(99)))
        lines.append(target(f"{prefix}_max_over_mean", r.max_over_mean, "<=", 1.3))
    return lines


def table(workload: Workload, runs: dict[str, RunResult], oracle_hit: float, s: Settings) -> str:
    rows = [f"{workload.name}: {workload.description}; {len(workload.requests)} requests over "
            f"{workload.duration_s:.0f} s; {s.replicas} tiny replicas x {s.capacity_blocks} KV blocks",
            f"  {'router':<32}{'hit rate':>9}{'/oracle':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'max/mean':>10}"
            f"{'failed':>8}{'cores':>11}{'steal':>7}{'added':>9}  served per replica"]
    for router, r in runs.items():
        rows.append(f"  {ROUTERS[router]:<32}{r.hit_rate:>9.1%}{r.hit_rate / oracle_hit if oracle_hit else float('nan'):>9.2f}"
                    f"{r.ttft_ms(50):>8.1f}ms{r.ttft_ms(99):>8.1f}ms{r.max_over_mean:>10.2f}{r.failures:>8}"
                    f"{r.machine_cores:>6.1f}/{r.server_cores:.1f}{r.steal_cores:>7.2f}{r.added_ms:>7.2f}ms  {r.served}"
                    + "".join(f"\n      note: {n}" for n in r.notes))
    rows.append(f"  {f'oracle (one LRU, {s.replicas * s.capacity_blocks} blocks)':<32}{oracle_hit:>9.1%}{1:>9.2f}")
    rows.append(f"  {s.cpu_note}")
    if s.rounds > 1:
        rows.append(f"  each row pools {s.rounds} rounds run in ABBA order: TTFT over all their requests, requests "
                    f"per replica summed, hit rate, cores, steal and added averaged")
    rows.append(f"  cores: CPU busy during the traffic, whole machine / replicas + router "
                f"({os.cpu_count()} cores; the rest is the client and the neighbours); steal: cores the "
                f"hypervisor gave other guests meanwhile (a noisy host); added: client TTFT "
                f"mean - the replicas' own TTFT mean (what the router in front adds)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="a,b,c,d", help="a=chat, b=agent, c=trace, d=groups (default: all)")
    parser.add_argument("--routers", default=",".join(ROUTERS), help=f"of {','.join(ROUTERS)} (default: all)")
    parser.add_argument("--trace", default=None, help="Mooncake JSONL for workload c, or 'chat' for the chat "
                                                       "workload as a trace (default: ../shared/traces/mooncake_synthetic_trace.jsonl)")
    parser.add_argument("--trace-requests", type=int, default=None, help="first N records of the trace (default 600)")
    parser.add_argument("--trace-duration-s", type=float, default=None,
                        help="scale the trace's arrivals to span this many seconds (default 40; 0: as recorded)")
    parser.add_argument("--quick", action="store_true", help="small workloads (~4 min): the machinery, not figures")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capacity-blocks", type=int, default=None, help="KV blocks per replica (default 768)")
    parser.add_argument("--replica-cpu", type=float, default=None,
                        help="cores each replica may use, as if on a device of its own (default: 0.8 x the "
                             "machine's cores / replicas; 0: uncapped, replicas share the cores)")
    parser.add_argument("--cap-whole-process", action="store_true",
                        help="cap every thread of a replica, its HTTP thread too (default: its compute threads, "
                             "as a device would be; bench/cpu_caps.py says why)")
    parser.add_argument("--replica-cpu-shares", type=int, default=SHARES,
                        help="the capped compute's cgroup cpu.shares against the host's other work (default "
                             "128: an emulated device yields the CPU to the router; 1024: equal weight)")
    parser.add_argument("--gateway-workers", type=int, default=1,
                        help="kvgate's gateway.workers (processes on one port; default 1)")
    parser.add_argument("--replica-cpu-policy", choices=POLICIES, default=None,
                        help="the replicas' --cpu-policy (default: theirs, batch): 'normal' lets a replica's "
                             "compute thread preempt the router on the cores they share")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every router this many times per workload, in ABBA order, and pool the rounds' "
                             "requests (default 1): a host whose speed drifts then slows every router alike")
    parser.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT is then the whole answer)")
    parser.add_argument("--keep-logs", default=None, help="write each run's gateway / sglang-router log into this directory "
                                                          "(kvgate logs at info: one record per request with its routing), "
                                                          "and what the client saw of each request (NAME.requests.jsonl)")
    args = parser.parse_args(argv)
    routers = args.routers.split(",")
    keys = args.workloads.split(",")
    for bad in [r for r in routers if r not in ROUTERS] + [k for k in keys if k not in WORKLOADS]:
        parser.error(f"unknown router or workload {bad!r}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    s = Settings(stream=not args.no_stream, keep_logs=args.keep_logs, rounds=args.rounds)
    if args.capacity_blocks:
        s.capacity_blocks = args.capacity_blocks
    s.replica_cpu_policy = args.replica_cpu_policy
    s.gateway_workers = args.gateway_workers
    s.cap_whole_process = args.cap_whole_process
    s.replica_cpu_shares = args.replica_cpu_shares
    s.replica_cpu = (round(0.8 * (os.cpu_count() or 1) / s.replicas, 2) if args.replica_cpu is None
                     else args.replica_cpu)
    selection = Selection.from_args(args)

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    console = Console(highlight=False)
    sglang_python = None
    if "sglang" in routers:
        try:
            sglang_python = sglang_router_python(say=console.print)
        except RouterUnavailable as exc:
            console.print(f"sglang-router unavailable: {exc}\nsglang-router is left out: no sglang-router rows, "
                          f"no targets against it")
            routers.remove("sglang")

    bundle = tiny_bundle()
    workloads = {key: selection.build(key) for key in keys}
    oracles = {key: simulate_lru([prompt_token_ids(r, bundle) for r in w.requests],
                                 s.replicas * s.capacity_blocks).hit_rate for key, w in workloads.items()}
    results: dict[str, dict[str, RunResult]] = {}
    with tempfile.TemporaryDirectory(prefix="kvgate-cache-bench-") as tmp, \
            Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} runs"),
                     TimeElapsedColumn(), console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("cache_routing", total=len(workloads) * len(routers) * s.rounds)
        for key, workload in workloads.items():
            rounds: dict[str, list[RunResult]] = {router: [] for router in routers}
            for round_index, router in round_order(routers, s.rounds):
                progress.update(task, description=f"{workload.name} · {ROUTERS[router]} "
                                                  f"({len(workload.requests)} requests, {workload.duration_s:.0f} s)"
                                                  + (f" · round {round_index + 1}/{s.rounds}" if s.rounds > 1 else ""))
                started = time.monotonic()
                r = run_router(router, workload, s, Path(tmp), sglang_python, round_index)
                rounds[router].append(r)
                progress.advance(task)
                progress.console.print(
                    f"  {WORKLOADS[key]:<7} {ROUTERS[router]:<31} hit {r.hit_rate:6.1%}  "
                    f"TTFT p50 {r.ttft_ms(50):6.1f} p99 {r.ttft_ms(99):7.1f} ms  max/mean {r.max_over_mean:.2f}  "
                    f"failed {r.failures}  cores {r.machine_cores:.1f}/{r.server_cores:.1f} steal {r.steal_cores:.2f}  "
                    f"({r.wall_s:.0f} s of {time.monotonic() - started:.0f} s)"
                    + (f"  round {round_index + 1}" if s.rounds > 1 else ""), soft_wrap=True)
            results[key] = {router: merge_rounds(rounds[router]) for router in routers}
    print()
    for key, workload in workloads.items():
        print(table(workload, results[key], oracles[key], s))
        print()
    for key, workload in workloads.items():
        name = WORKLOADS[key]
        for router, r in results[key].items():
            print(f"figure {name}_{router}_hit_rate: {r.hit_rate:.3f}")
            print(f"figure {name}_{router}_replica_ttft_mean_ms: {r.replica_ttft_mean_s * 1000:.1f}")
        print(f"figure {name}_oracle_hit_rate: {oracles[key]:.3f}")
    for key in workloads:
        for line in workload_targets(WORKLOADS[key], results[key], oracles[key]):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
