"""What relaying a token stream costs each router, per token, side by side in one run.

bench/vs_routers.py's stubs write a whole answer at once, so a streamed answer reaches the router
in one or two reads: it measures a request's fixed cost. A real engine writes one token per decode
step, and a router then pays a read, a relay and a write for every token: for a streamed answer of
a few hundred tokens that is most of what the request costs it. Here the 4 stubs pace their events
(`--token-interval-ms`, a decode step; bench/stub_backend.py), so each token is its own read, and
`--connections` clients stream closed-loop through each router in turn (wrk, the same body
for every router: the bench prompt, `--tokens` tokens, stream=true).

Routers: kvgate round_robin and cache_aware (one process each, token IDs logged, as in
vs_routers) and sglang-router round_robin and cache_aware (bench/routers.py's own virtualenv;
`--routers kvgate,sglang,vllm` adds vllm-router; a router that cannot be installed or started is
named, with no row). Routers are started and counted as bench/vs_routers.py does (its processes,
children included). Per router: its process's CPU
time over the phases, split into user and system, per token and per request, with the requests
answered; `--rounds` rounds in a rotating order. Needs wrk.

    .venv/bin/python -m bench.stream_relay                  # ~2 min
    .venv/bin/python -m bench.stream_relay --tokens 256 --token-interval-ms 10 --connections 64

Ends with `figure <router>_<policy>_cpu_us_per_token: <value>` lines.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gateway_overhead import PROMPT
from bench.loadgen import process_cpu_split_s
from bench.stub_backend import StubProcess
from bench.vs_routers import STUBS, WRK_FIXED, Router, start_routers, wrk_counts


def phase(router: Router, script: Path, connections: int, seconds: float) -> tuple[int, float, float, int]:
    """One closed-loop wrk phase: (requests answered, user s, system s, failed) of the router's processes."""
    pids = router.pids()
    before = [process_cpu_split_s(pid) for pid in pids]
    done = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "30s", "-s", str(script),
                           router.url + "/v1/completions"], capture_output=True, text=True, timeout=seconds + 90)
    after = [process_cpu_split_s(pid) for pid in pids]
    served, failed = wrk_counts(done.stdout)
    return (served, sum(a[0] - b[0] for a, b in zip(after, before)), sum(a[1] - b[1] for a, b in zip(after, before)),
            failed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Routers' CPU per relayed token, with paced stub backends.")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per streamed answer (default 64)")
    parser.add_argument("--token-interval-ms", type=float, default=4.0, help="stub's time between tokens (default 4)")
    parser.add_argument("--connections", type=int, default=32, help="streams in flight (default 32)")
    parser.add_argument("--seconds", type=float, default=8.0, help="per phase (default 8)")
    parser.add_argument("--rounds", type=int, default=2, help="phases per router (default 2)")
    parser.add_argument("--routers", default="kvgate,sglang", help="of kvgate,sglang,vllm (default kvgate,sglang)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.connections < 1 or args.rounds < 1 or args.seconds <= 0:
        parser.error("--tokens, --connections, --rounds and --seconds must be positive")
    if not 0 < args.token_interval_ms <= 1000:
        parser.error("--token-interval-ms: above 0 (each token its own read) and at most 1000")
    wanted = set(args.routers.split(","))
    if not wanted <= {"kvgate", "sglang", "vllm"}:
        parser.error("--routers: of kvgate, sglang, vllm")
    if shutil.which("wrk") is None:
        print("stream_relay: needs wrk on PATH (apt-get install wrk)", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.table import Table
    console = Console()
    started = time.monotonic()

    def say(text: str) -> None:
        console.print(f"[{time.monotonic() - started:5.1f} s] {text}")

    rows: dict[str, list[tuple[int, float, float, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvgate-stream-relay-") as scratch, contextlib.ExitStack() as stack:
        directory = Path(scratch)
        stubs = [stack.enter_context(StubProcess(output_tokens=args.tokens, token_interval_ms=args.token_interval_ms,
                                                 stderr=subprocess.DEVNULL)) for _ in range(STUBS)]
        urls = [stub.url for stub in stubs]
        say(f"{STUBS} stubs up, {args.tokens} tokens {args.token_interval_ms:g} ms apart")
        routers, missing = start_routers(stack, directory, urls, wanted, say)
        script = directory / "stream.lua"
        body = {"model": "stub", "prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0.0, "stream": True}
        script.write_text(WRK_FIXED % {"body": json.dumps(json.dumps(body))}, encoding="utf-8")
        for router in routers:  # warm every path
            phase(router, script, args.connections, 2)
        for round_index in range(args.rounds):
            shift = round_index % max(len(routers), 1)
            for router in routers[shift:] + routers[:shift]:
                result = phase(router, script, args.connections, args.seconds)
                rows.setdefault(router.name, []).append(result)
                answered, user, system, failed = result
                say(f"round {round_index + 1}/{args.rounds}: {router.name}: {answered} streams, "
                    f"{(user + system) / max(answered * args.tokens, 1) * 1e6:.1f} us/token"
                    + (f", {failed} failed" if failed else ""))
    table = Table(title=f"CPU per relayed token: {args.tokens}-token streams, "
                        f"a token every {args.token_interval_ms:g} ms, "
                        f"{args.connections} in flight, {args.rounds} x {args.seconds:g} s per router")
    table.add_column("router", no_wrap=True, min_width=25)
    for column in ("streams", "failed", "CPU us/token", "user / system us/token", "CPU us/request"):
        table.add_column(column, justify="right")
    lines = []
    for name, results in rows.items():
        answered = sum(r[0] for r in results)
        user, system = sum(r[1] for r in results), sum(r[2] for r in results)
        tokens = max(answered * args.tokens, 1)
        table.add_row(name, str(answered), str(sum(r[3] for r in results)), f"{(user + system) / tokens * 1e6:.1f}",
                      f"{user / tokens * 1e6:.1f} / {system / tokens * 1e6:.1f}",
                      f"{(user + system) / max(answered, 1) * 1e6:.0f}")
        lines.append(f"figure {name.replace(' ', '_').replace('-', '_')}_cpu_us_per_token: "
                     f"{(user + system) / tokens * 1e6:.1f}")
    console.print(table)
    console.print(f"The stubs, wrk and every router share the machine's {os.cpu_count()} cores; "
                  "compare within this run.")
    for line in missing:
        console.print(f"[yellow]not measured: {line}[/yellow]")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
