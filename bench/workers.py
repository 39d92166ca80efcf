"""Throughput at saturation of one gateway process against `gateway.workers: 2`, side by side.

Two stub replicas (`bench/stub_backend.py`, answer at once) and two gateways in front of them,
both up for the whole run: one process, and two workers on one port. A closed loop (the load
generator in its own process) saturates one gateway, then the other, in ABBA order over
several rounds, non-streamed and streamed, so machine noise lands on both sides; the speedup is
the median over rounds of each round's ratio (its two B phases over its two A phases), which a
slow drift of the machine's other load does not bias. Request logging
is on (a JSON file with full token IDs), as users run it. Reports requests/s per side, their
ratio, and the CPU each gateway's processes used (parent and workers together).

On a 2-core machine the load generator and the stubs compete with the workers for the same two
cores: the ratio is what a second worker buys on this box, not what it buys on a machine with
cores to spare.

    .venv/bin/python -m bench.workers [--quick] [--rounds 6] [--requests 1000] [--concurrency 64]

Ends with `figure <name>: <value>` lines (the issue sets no goal for this)."""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.gateway_overhead import GatewayProcess, check_answers, free_port
from bench.loadgen import LoadgenProcess, Phase, PhaseResult, start_bench
from bench.stub_backend import StubProcess

PROMPT = "The quick brown fox jumps over the lazy dog. A gateway routes each request to the replica. " * 4


def write_config(directory: Path, name: str, port: int, workers: int, stubs: list[str]) -> Path:
    path = directory / f"{name}.yaml"
    replicas = "".join(f"  - {{name: stub-{i}, url: '{url}', model: stub}}\n" for i, url in enumerate(stubs))
    path.write_text(f"gateway: {{host: 127.0.0.1, port: {port}, workers: {workers}}}\n"
                    f"logging: {{level: info, format: json, token_ids: full, file: '{directory / name}.jsonl'}}\n"
                    "routing: {policy: cache_aware}\n"
                    f"replicas:\n{replicas}", encoding="utf-8")
    return path


def wait_all_workers(gateway: GatewayProcess, timeout_s: float = 60.0) -> None:
    """The ready line comes once every worker has every replica (another process: poll its log)."""
    deadline = time.monotonic() + timeout_s
    while "kvgate ready:" not in gateway.log_tail(200):
        if time.monotonic() > deadline:
            raise RuntimeError(f"gateway not ready after {timeout_s:.0f} s:\n{gateway.log_tail()}")
        time.sleep(0.1)


def body(stream: bool, output_tokens: int) -> dict:
    return {"model": "stub", "prompt": PROMPT, "max_tokens": output_tokens, "stream": stream}


def saturate(loadgen: LoadgenProcess, url: str, name: str, stream: bool, args, pids: list[int]) -> PhaseResult:
    return loadgen.run(Phase(name=name, url=url + "/v1/completions", body=body(stream, args.output_tokens),
                             mode="closed", concurrency=args.concurrency, count=args.requests, timeout_s=30.0,
                             cpu_pids=pids))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Saturation throughput: 1 gateway process vs 2 workers.")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 600 requests")
    parser.add_argument("--rounds", type=int, default=6, help="ABBA rounds per mode (each side runs twice a round)")
    parser.add_argument("--requests", type=int, default=1000, help="requests per saturation phase")
    parser.add_argument("--concurrency", type=int, default=64, help="closed-loop requests in flight")
    parser.add_argument("--output-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.requests = 2, 600

    started, progress = start_bench()

    sides = {"1 process": 1, "2 workers": 2}
    results: dict[tuple[str, bool], list[PhaseResult]] = {(side, s): [] for side in sides for s in (False, True)}
    ratios: dict[bool, list[float]] = {False: [], True: []}  # per ABBA round: 2 workers' req/s / 1 process's
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-bench-workers-")))
        stub_log = stack.enter_context(open(workdir / "stubs.log", "wb"))
        stubs = [stack.enter_context(StubProcess(output_tokens=args.output_tokens, stderr=stub_log)) for _ in range(2)]
        gateways = {}
        for side, workers in sides.items():
            port = free_port()
            name = f"gw{workers}"
            gateway = stack.enter_context(GatewayProcess(write_config(workdir, name, port, workers,
                                                                      [s.url for s in stubs]),
                                                         port, workdir / f"{name}.log"))
            wait_all_workers(gateway)
            check_answers(gateway.url + "/v1/completions", body(False, args.output_tokens))
            gateways[side] = gateway
            progress(f"{side}: {gateway.url}, pids {gateway.pids()}")
        loadgen = stack.enter_context(LoadgenProcess())
        for stream in (False, True):  # warm both: connection pools, code paths, tokenizer caches
            for side, gateway in gateways.items():
                saturate(loadgen, gateway.url, "warmup", stream, argparse.Namespace(
                    output_tokens=args.output_tokens, concurrency=16, requests=300), [])
        progress("warmed up")
        for stream in (False, True):
            for round_ in range(args.rounds):
                order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
                rps: dict[str, float] = {side: 0.0 for side in sides}
                for side in order + order[::-1]:  # A B B A
                    gateway = gateways[side]
                    result = saturate(loadgen, gateway.url, side, stream, args, gateway.pids())
                    results[(side, stream)].append(result)
                    rps[side] += result.achieved_rps() / 2
                    progress(f"{'stream' if stream else 'plain '} round {round_} {side}: "
                             f"{result.achieved_rps():.0f} req/s, {len(result.results) - len(result.ok)} errors")
                one, two = (rps[side] for side in sides)
                ratios[stream].append(two / one if one else float("nan"))
    lines = report(results, ratios, sides, args)
    print(f"total {time.monotonic() - started:.0f} s")
    for line in lines:
        print(line)
    return 0


def report(results, ratios, sides, args) -> list[str]:
    lines = [f"closed loop, {args.concurrency} in flight, {args.requests} requests a phase, "
             f"{args.output_tokens} output tokens, 2 stub replicas, cache_aware, JSON log file with token IDs",
             f"{'mode':8} {'side':10} {'req/s median':>13} {'min':>7} {'max':>7} {'cores busy':>11} "
             f"{'CPU ms/req':>11} {'errors':>7}"]
    figures = []
    for stream in (False, True):
        mode = "stream" if stream else "plain"
        medians = {}
        for side in sides:
            phases = results[(side, stream)]
            rps = [p.achieved_rps() for p in phases]
            cpu_s = [sum(p.cpu_s.values()) for p in phases]
            busy = statistics.median(c / p.wall_s for c, p in zip(cpu_s, phases))
            per_request_ms = statistics.median(1000 * c / max(len(p.ok), 1) for c, p in zip(cpu_s, phases))
            errors = sum(len(p.results) - len(p.ok) for p in phases)
            medians[side] = statistics.median(rps)
            lines.append(f"{mode:8} {side:10} {medians[side]:13.0f} {min(rps):7.0f} {max(rps):7.0f} "
                         f"{busy:11.2f} {per_request_ms:11.2f} {errors:7d}")
            tag = "1p" if sides[side] == 1 else f"{sides[side]}w"
            figures.append(f"figure workers_rps_{mode}_{tag}: {medians[side]:.0f} req/s")
        paired = ratios[stream]
        lines.append(f"{mode:8} 2 workers / 1 process per round: {' '.join(f'{r:.2f}' for r in paired)}")
        figures.append(f"figure workers_speedup_{mode}: {statistics.median(paired):.2f}x "
                       f"(median of {len(paired)} ABBA rounds' ratios, 2 workers / 1 process)")
    return lines + figures


if __name__ == "__main__":
    sys.exit(main())
