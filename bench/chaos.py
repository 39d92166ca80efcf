"""Failover under load: what clients see before and while replicas fail, and how fast a stream
that lost its replica continues elsewhere.

`kvgate up` with 3 built-in replicas (tiny by default), an open-loop Poisson load of streamed
completions (greedy, distinct prompts of 60-600 tokens, 64 tokens out) from a separate process.
The load runs two windows back to back, same rate:
  before   nothing fails
  fault    at +1 s one replica is SIGKILLed (`kvgate up` restarts it), at +fault_s/3 another is
           SIGSTOPped for 3 s (its streams stall: resumed elsewhere after inter_token_timeout_s)
Per window: requests, failures seen by clients (HTTP errors, in-band error events, streams
without [DONE]), goodput (completed requests/s), TTFT p50/p99 (first body byte, client side).
From the gateway's request records: resume latency (a failed try to the next try's first token)
p50/p99, and the tokens each resumed stream had before its seam. Then, on the idle cluster, a
cold request of each resumed continuation's length (prompt + k tokens, nothing cached) gives the
cold TTFT the resume is compared with.

    .venv/bin/python -m bench.chaos                    # ~1.5 min
    .venv/bin/python -m bench.chaos --rate 12 --before-s 20 --fault-s 20 --model tiny

Ends with `target resume_p99_vs_cold_ttft_p99: X (goal <= 2) met|short` and
`target fault_window_client_failures: N (goal <= 0) met|short`.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.loadgen import LoadgenProcess, Phase, arrival_offsets_s, percentiles_ms
from tests.servers import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


def get_json(url: str, timeout_s: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def target(name: str, value: float, op: str, goal: float) -> str:
    met = value <= goal if op == "<=" else value >= goal
    return f"target {name}: {value:.3g} (goal {op} {goal:g}) {'met' if met else 'short'}"


class Cluster:
    """`kvgate up` on free ports; its request log goes to a file the bench reads afterwards."""

    def __init__(self, model: str, replicas: int, workdir: Path) -> None:
        self.port = free_port()
        self.log_file = workdir / "requests.jsonl"
        config = workdir / "chaos.yaml"
        config.write_text(
            f"gateway: {{host: 127.0.0.1, port: {self.port}, ttft_timeout_s: 10, inter_token_timeout_s: 1}}\n"
            "health: {probe_interval_s: 0.5, probe_timeout_s: 0.5, restart_backoff_s: 0.5}\n"
            f"logging: {{format: json, file: '{self.log_file}'}}\nrouting: {{policy: cache_aware}}\nreplicas:\n"
            + "".join(f"  - {{name: r{i}, url: 'http://127.0.0.1:{free_port()}', model: {model}, "
                      f"launch: {{model: {model}}}}}\n" for i in range(replicas)))
        self.output = open(workdir / "kvgate-up.out", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "up", "--config", str(config)],
                                     cwd=REPO_ROOT, stdout=self.output, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvgate up exited with {self.proc.returncode}")
            try:
                replicas = get_json(self.url + "/admin/replicas")["replicas"]
                if all(r["state"] == "healthy" and r["ready"] for r in replicas):
                    return
            except OSError:
                pass
            time.sleep(0.25)  # another process: poll, bounded
        raise RuntimeError("replicas not healthy in time")

    def pids(self) -> dict[str, int]:
        return {r["name"]: r["process"]["pid"] for r in get_json(self.url + "/admin/replicas")["replicas"]}

    def records(self) -> list[dict]:
        out = []
        for line in self.log_file.read_text().splitlines():
            if '"event":"request"' in line:
                out.append(json.loads(line))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.output.close()


def bodies(count: int, seed: int, max_tokens: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"model": "tiny", "prompt": [rng.randrange(3, 500) for _ in range(rng.randrange(60, 600))],
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            for _ in range(count)]


def window_row(name: str, results, wall_s: float) -> tuple[list, int]:
    ok = [r for r in results if r.status == 200 and r.error is None]
    failed = len(results) - len(ok)
    ttft = percentiles_ms([r.ttfb_s for r in ok if r.ttfb_s is not None], (50, 99))
    return [name, len(results), failed, f"{len(ok) / wall_s:.2f}", f"{ttft.get(50, 0):.1f}",
            f"{ttft.get(99, 0):.1f}"], failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--rate", type=float, default=10.0, help="requests/s, Poisson")
    parser.add_argument("--before-s", type=float, default=15.0)
    parser.add_argument("--fault-s", type=float, default=15.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--keep", default=None, help="keep the config, logs and request records in this directory")
    args = parser.parse_args(argv)
    if args.replicas < 3:
        parser.error("--replicas must be at least 3 (one killed, one frozen, one serving)")
    from rich.console import Console
    from rich.table import Table
    console = Console(stderr=True)
    workdir = Path(args.keep or tempfile.mkdtemp(prefix="kvgate-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(args.model, args.replicas, workdir)
    try:
        with console.status("starting kvgate up ..."):
            cluster.wait_ready()
        pids = cluster.pids()
        total_s = args.before_s + args.fault_s
        phase = Phase(name="chaos", url=cluster.url + "/v1/completions", body={}, rate_rps=args.rate,
                      duration_s=total_s, seed=1, timeout_s=120.0,
                      bodies=bodies(max(1, int(args.rate * total_s * 1.2)), 7, args.max_tokens))
        faults: list[str] = []

        def inject(start: float) -> None:
            def at(offset_s: float) -> None:
                time.sleep(max(0.0, start + offset_s - time.monotonic()))
            at(args.before_s + 1.0)
            os.kill(pids["r0"], signal.SIGKILL)
            faults.append(f"+{time.monotonic() - start - args.before_s:.1f} s SIGKILL r0")
            at(args.before_s + args.fault_s / 3)
            os.kill(pids["r1"], signal.SIGSTOP)
            faults.append(f"+{time.monotonic() - start - args.before_s:.1f} s SIGSTOP r1 (3 s)")
            time.sleep(3.0)
            os.kill(pids["r1"], signal.SIGCONT)

        with LoadgenProcess() as loadgen, console.status(f"load: {args.rate:g} req/s for {total_s:g} s ..."):
            injector = threading.Thread(target=inject, args=(time.monotonic(),))
            injector.start()
            result = loadgen.run(phase)
            injector.join()
        before = [r for r in result.results if r.scheduled_s < args.before_s]
        during = [r for r in result.results if r.scheduled_s >= args.before_s]
        # Which body each result sent (request i sends bodies[i % n], in schedule order).
        index_of = {offset: i for i, offset in enumerate(arrival_offsets_s(phase.rate_rps, phase.duration_s,
                                                                           phase.arrivals, phase.seed))}
        prompt_len = {id(r): len(phase.bodies[index_of[r.scheduled_s] % len(phase.bodies)]["prompt"])
                      for r in result.results}
        cluster.wait_ready()  # the killed replica is back
        records = [r for r in cluster.records() if r.get("endpoint") == "/v1/completions"]
        resumed = [r for r in records if any("resume_ms" in f for f in r.get("failover") or [])]
        resume_ms = [f["resume_ms"] for r in resumed for f in r["failover"] if "resume_ms" in f]
        # Cold TTFT for each resumed continuation's prompt length, on the idle cluster.
        cold_s = []
        rng = random.Random(11)
        with console.status("cold requests of the resumed lengths ..."):
            for record in resumed:
                seam = max(f["after_tokens"] for f in record["failover"])
                length = record["prompt_tokens"] + seam
                body = {"model": "tiny", "prompt": [rng.randrange(3, 500) for _ in range(length)], "max_tokens": 1,
                        "temperature": 0, "stream": True}
                started = time.perf_counter()
                request = urllib.request.Request(cluster.url + "/v1/completions", json.dumps(body).encode(),
                                                 {"content-type": "application/json"})
                with urllib.request.urlopen(request, timeout=60) as response:
                    response.read(1)
                    cold_s.append(time.perf_counter() - started)
                    response.read()
    finally:
        cluster.stop()

    table = Table(title=f"kvgate up, {args.replicas} {args.model} replicas, {args.rate:g} req/s streamed")
    for column in ("window", "requests", "client failures", "goodput req/s", "TTFT p50 ms", "TTFT p99 ms"):
        table.add_column(column)
    row, _ = window_row(f"before ({args.before_s:g} s)", before, args.before_s)
    table.add_row(*map(str, row))
    row, fault_failures = window_row(f"fault ({args.fault_s:g} s)", during, args.fault_s)
    table.add_row(*map(str, row))
    Console().print(table)
    print("faults: " + "; ".join(faults))
    resume = percentiles_ms([ms / 1000 for ms in resume_ms], (50, 99))
    cold = percentiles_ms(cold_s, (50, 99))
    lengths = sorted(r["prompt_tokens"] + max(f["after_tokens"] for f in r["failover"]) for r in resumed)
    # The load's own requests are cold too (distinct prompts): those of the resumed lengths, in the
    # fault window, are cold requests of the same length under the same conditions.
    same = [r.ttfb_s for r in during if r.ttfb_s is not None and r.error is None and lengths
            and lengths[0] <= prompt_len[id(r)] <= lengths[-1]]
    cold_window = percentiles_ms(same, (50, 99))
    seams = sorted(max(f["after_tokens"] for f in r["failover"]) for r in resumed)
    print(f"resumed streams: {len(resumed)} (tokens before the seam {seams[:1] + seams[-1:] if seams else '-'}, "
          f"continuation prompts {lengths[:1] + lengths[-1:] if lengths else '-'} tokens)")
    print(f"resume latency p50 {resume.get(50, 0):.1f} / p99 {resume.get(99, 0):.1f} ms; cold requests of those "
          f"lengths: in the fault window ({len(same)}) TTFT p50 {cold_window.get(50, 0):.1f} / p99 "
          f"{cold_window.get(99, 0):.1f} ms, on the idle cluster p50 {cold.get(50, 0):.1f} / p99 {cold.get(99, 0):.1f} ms")
    print(f"records: {workdir / 'requests.jsonl'}" if args.keep else "")
    if resume_ms and same:
        print(f"figure resume_p99_vs_idle_cold_ttft_p99: {resume[99] / cold[99]:.3g}")
        print(target("resume_p99_vs_cold_ttft_p99", resume[99] / cold_window[99], "<=", 2.0))
    else:
        print("target resume_p99_vs_cold_ttft_p99: no resumed stream in this run (goal <= 2) short")
    print(target("fault_window_client_failures", fault_failures, "<=", 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
