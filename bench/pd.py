"""Disaggregated prefill/decode against mixed replicas, same machine, same workload, one run.

Two clusters behind `kvgate serve` (cache_aware), started one after the other on the same
machine: 2 mixed built-in replicas, then 1 prefill + 1 decode replica (SmolLM2 by default, one
thread each). The same schedule is replayed on both: `--decoders` streams with short prompts
and long answers keep decoding, while long prompts (`--long-tokens`) arrive every
`--long-every-s` with short answers. On a mixed replica every long prefill stalls the streams
decoding there (a prefill chunk takes a step); with P/D the decode replica never prefills.

Printed per cluster: inter-token latency p50/p99 of the decoding streams (client side, gaps
between streamed events), TTFT p50/p99 of every request, and for P/D the KV moved and its rate
(bytes / seconds the decode replica spent pulling) next to this machine's memory copy bandwidth.

    .venv/bin/python -m bench.pd                      # SmolLM2, ~4 min
    .venv/bin/python -m bench.pd --model tiny --duration-s 20      # quick check of the machinery

Targets: `pd_itl_p99_vs_mixed` <= 0.5 and `pd_ttft_p99_vs_mixed` <= 1.2.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.chaos import free_port, get_json, target
from bench.loadgen import percentiles_ms

REPO_ROOT = Path(__file__).resolve().parent.parent


def memcpy_gb_s(megabytes: int = 256, rounds: int = 5) -> float:
    import numpy as np
    source = np.ones(megabytes << 20, dtype=np.uint8)
    dest = np.empty_like(source)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        np.copyto(dest, source)
        best = min(best, time.perf_counter() - started)
    return source.nbytes / best / 1e9


class Cluster:
    """Replica processes + `kvgate serve` in front, on free ports; stopped on exit."""

    def __init__(self, model: str, roles: list[str], workdir: Path, name: str) -> None:
        self.procs: list[subprocess.Popen] = []
        self.replicas: dict[str, str] = {}
        self.outputs = []
        entries = ""
        for i, role in enumerate(roles):
            port = free_port()
            rname = f"{role[0]}{i}"
            out = open(workdir / f"{name}-{rname}.log", "wb")
            self.outputs.append(out)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "replica", "--model", model, "--port", str(port), "--threads", "1",
                 "--role", role, "--served-model-name", "bench", "--log-format", "json",
                 "--max-num-batched-tokens", "512"],
                cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            self.replicas[rname] = f"http://127.0.0.1:{port}"
            entries += f"  - {{name: {rname}, url: 'http://127.0.0.1:{port}', model: bench, role: {role}}}\n"
        self.port = free_port()
        config = workdir / f"{name}.yaml"
        config.write_text(f"gateway: {{host: 127.0.0.1, port: {self.port}}}\nlogging: {{format: json}}\n"
                          f"routing: {{policy: cache_aware}}\nreplicas:\n{entries}")
        out = open(workdir / f"{name}-gateway.log", "wb")
        self.outputs.append(out)
        self.procs.append(subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
                                           cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL))
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError("a process of the cluster exited while starting")
            try:
                if get_json(self.url + "/health").get("all_ready"):
                    return
            except OSError:
                pass
            time.sleep(0.5)  # other processes loading a model: poll, bounded
        raise RuntimeError("cluster not ready in time")

    def metric(self, replica: str, name: str) -> float:
        with urllib.request.urlopen(self.replicas[replica] + "/metrics", timeout=5) as response:
            text = response.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for out in self.outputs:
            out.close()


# ---- the client (its own process: it never shares a core's loop with what it measures) ----------

async def _stream(session, url: str, kind: str, body: dict, started: float) -> dict:
    import aiohttp
    sent = time.perf_counter()
    stamps: list[float] = []
    error = None
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=600)) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}"
            async for line in resp.content:
                if line.startswith(b"data: {") and b'"choices":[{' in line:
                    stamps.append(time.perf_counter())
    except Exception as exc:  # recorded: one failure must not stop the run
        error = f"{type(exc).__name__}: {exc}"[:200]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"kind": kind, "at": sent - started, "ttft": stamps[0] - sent if stamps else None,
            "gaps": gaps, "error": error}


async def _run_schedule(url: str, schedule: list[tuple[float, dict]]) -> list[dict]:
    import aiohttp
    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        tasks = []
        for offset, kind, body in schedule:
            delay = started + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(_stream(session, url, kind, body, started)))
        return list(await asyncio.gather(*tasks))


def _client(url: str, schedule, queue) -> None:
    queue.put(asyncio.run(_run_schedule(url, schedule)))


def run_client(url: str, schedule) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_client, args=(url, schedule, queue))
    process.start()
    results = queue.get(timeout=1800)
    process.join(30)
    return results


def make_schedule(args, rng: random.Random) -> list[tuple[float, str, dict]]:
    common = {"model": "bench", "temperature": 0, "ignore_eos": True, "stream": True}
    schedule = []
    for i in range(args.decoders):  # steady decoders, staggered, renewed as they finish
        t = i * 0.5
        while t < args.duration_s:
            schedule.append((t, "decode", {**common, "max_tokens": args.decode_tokens,
                                           "prompt": [rng.randrange(3, 500) for _ in range(64)]}))
            t += args.decode_tokens * 0.08 + rng.uniform(0.5, 1.5)
    t = 2.0
    while t < args.duration_s:
        schedule.append((t, "long", {**common, "max_tokens": 8,
                                     "prompt": [rng.randrange(3, 500) for _ in range(args.long_tokens)]}))
        t += args.long_every_s
    return sorted(schedule, key=lambda item: item[0])


def summarize(results: list[dict]) -> dict:
    gaps = [g for r in results if r["kind"] == "decode" and not r["error"] for g in r["gaps"]]
    ttft = [r["ttft"] for r in results if r["ttft"] is not None and not r["error"]]
    return {"itl": percentiles_ms(gaps, (50, 99)), "ttft": percentiles_ms(ttft, (50, 99)),
            "errors": sum(1 for r in results if r["error"]), "requests": len(results)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--decoders", type=int, default=3, help="streams decoding at any time")
    parser.add_argument("--decode-tokens", type=int, default=120)
    parser.add_argument("--long-tokens", type=int, default=800)
    parser.add_argument("--long-every-s", type=float, default=8.0)
    parser.add_argument("--keep", default=None, help="keep configs and logs in this directory")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table
    console = Console(stderr=True)
    workdir = Path(args.keep or tempfile.mkdtemp(prefix="kvgate-pd-"))
    workdir.mkdir(parents=True, exist_ok=True)
    schedule = make_schedule(args, random.Random(5))
    rows, kv = {}, {}
    for name, roles in (("mixed", ["mixed", "mixed"]), ("pd", ["prefill", "decode"])):
        cluster = Cluster(args.model, roles, workdir, name)
        try:
            with console.status(f"{name}: starting {len(roles)} {args.model} replicas ..."):
                cluster.wait_ready()
            with console.status(f"{name}: {len(schedule)} requests over {args.duration_s:g} s ..."):
                rows[name] = summarize(run_client(cluster.url + "/v1/completions", schedule))
            if name == "pd":
                decode = next(r for r in cluster.replicas if r.startswith("d"))
                kv = {"bytes": cluster.metric(decode, 'kvgate:kv_transfer_bytes_total'),
                      "seconds": cluster.metric(decode, "kvgate:kv_transfer_seconds_sum")}
        finally:
            cluster.stop()

    table = Table(title=f"{args.model}: {args.decoders} decoding streams, a {args.long_tokens}-token prompt "
                        f"every {args.long_every_s:g} s, {args.duration_s:g} s")
    for column in ("cluster", "requests", "errors", "ITL p50 ms", "ITL p99 ms", "TTFT p50 ms", "TTFT p99 ms"):
        table.add_column(column)
    for name, label in (("mixed", "2 mixed"), ("pd", "1 prefill + 1 decode")):
        row = rows[name]
        table.add_row(label, str(row["requests"]), str(row["errors"]), f"{row['itl'][50]:.1f}",
                      f"{row['itl'][99]:.1f}", f"{row['ttft'][50]:.1f}", f"{row['ttft'][99]:.1f}")
    Console().print(table)
    copy = memcpy_gb_s()
    rate = kv["bytes"] / kv["seconds"] / 1e9 if kv.get("seconds") else 0.0
    print(f"KV moved (P/D): {kv.get('bytes', 0) / 1e6:.1f} MB in {kv.get('seconds', 0):.3f} s of pulls -> "
          f"{rate:.2f} GB/s; this machine's memory copy: {copy:.2f} GB/s ({rate / copy:.2f}x)")
    print(f"figure kv_transfer_gb_s: {rate:.3g}")
    print(target("pd_itl_p99_vs_mixed", rows["pd"]["itl"][99] / rows["mixed"]["itl"][99], "<=", 0.5))
    print(target("pd_ttft_p99_vs_mixed", rows["pd"]["ttft"][99] / rows["mixed"]["ttft"][99], "<=", 1.2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
