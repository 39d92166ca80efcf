"""What a change does to the latency users see, side by side in one run: this tree's gateway
against a git revision's (`--against REV`, a worktree as bench/request_cost.py makes it), on
vs_routers' 4 instant stubs and its open-loop client (Poisson arrivals at `--rate`, 16 output
tokens), streamed and not, windows rotating over the targets, against the same schedules sent
straight to a stub.

    .venv/bin/python -m bench.ab_latency --against HEAD~1                 # ~5 min: rr and ca, 10 windows
    .venv/bin/python -m bench.ab_latency --against HEAD~1 --windows 4 --policies round_robin

Prints, per gateway, the streamed time to first body byte and the non-streamed latency the
gateway adds: its p50 and p90 minus the direct p50, its p99 minus the direct p99. At 200 req/s
most requests are alone in flight: what this measures is the lone request's path (cold caches,
the scheduler's placement of gateway, stub and client on the machine's cores), which a
saturation figure (vs_routers' CPU per request) does not show. On a shared machine two runs of
one revision differ by ~0.1 ms at p50: a change counts where it shows in both policies.
"""
from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.loadgen import LoadgenProcess, Phase, percentiles_ms, start_bench
from bench.request_cost import REPO_ROOT, gateway_argv, worktree
from bench.stub_backend import StubProcess
from bench.vs_routers import OUTPUT_TOKENS, POLICIES, STUBS, Settings, body, gateway_config, open_loop, pooled_ms
from tests.servers import free_port, run_gateway


def start_gateway(stack: contextlib.ExitStack, tree: Path, directory: Path, policy: str, stub_urls: list[str]) -> str:
    """The gateway of source tree `tree` serving `policy` over the stubs; its URL."""
    directory.mkdir()
    port = free_port()
    config = gateway_config(directory, policy, stub_urls, port)
    return stack.enter_context(run_gateway(config, port, argv=gateway_argv(tree, config))).url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="This tree's gateway against a revision's: latency added.")
    parser.add_argument("--against", metavar="REV", required=True, help="the git revision to compare with")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated routing policies")
    parser.add_argument("--windows", type=int, default=10, help="open-loop windows per target and measurement")
    parser.add_argument("--window-s", type=float, default=3.0)
    parser.add_argument("--rate", type=float, default=200.0, help="open-loop requests per second")
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in policies:
        if name not in POLICIES:
            parser.error(f"--policies: {name!r} is not one of {', '.join(POLICIES)}")
    if args.windows < 1 or args.window_s <= 0 or args.rate <= 0:
        parser.error("--windows, --window-s and --rate must be positive")
    started, progress = start_bench()
    settings = Settings(saturation_s=0.0, rounds=0, unique_rounds=0, rate_rps=args.rate, window_s=args.window_s,
                        windows=args.windows, connections=0)
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-ab-latency-")))
        progress(f"checking out {args.against}")
        trees = {"this tree": REPO_ROOT, args.against: worktree(args.against, workdir, stack)}
        stubs = [stack.enter_context(StubProcess(output_tokens=OUTPUT_TOKENS, stderr=subprocess.DEVNULL))
                 for _ in range(STUBS)]
        stub_urls = [stub.url for stub in stubs]
        targets = [("direct", stub_urls[0])]
        for policy in policies:
            for index, (label, tree) in enumerate(trees.items()):
                targets.append((f"{policy} {label}", start_gateway(stack, tree, workdir / f"{policy}-{index}",
                                                                    policy, stub_urls)))
        progress("gateways up: " + ", ".join(name for name, _ in targets[1:]))
        loadgen = stack.enter_context(LoadgenProcess())
        for _, url in targets:  # warm every path
            for stream in (True, False):
                loadgen.run(Phase(name="warmup", url=url + "/v1/completions", body=body(stream), mode="closed",
                                  concurrency=8, count=300, timeout_s=10.0))
        results: dict[tuple[str, bool], list] = {(name, stream): [] for name, _ in targets for stream in (False, True)}
        for stream in (True, False):
            for window in range(args.windows):
                shift = window % len(targets)
                for name, url in targets[shift:] + targets[:shift]:
                    results[(name, stream)].append(open_loop([url], stream, settings, seed=100 + window,
                                                                loadgen=loadgen))
                progress(f"{'stream' if stream else 'non-stream'} window {window + 1}/{args.windows}")
    print(f"total {time.monotonic() - started:.0f} s, {args.rate:.0f} req/s open loop, {args.windows} windows of "
          f"{args.window_s:g} s per target")
    for stream in (True, False):
        what = "ttfb" if stream else "latency"
        direct = percentiles_ms(pooled_ms(results[("direct", stream)], what)[0], (50, 99))
        print(f"{'streamed TTFB' if stream else 'non-streamed latency'}: direct p50 {direct[50]:.3f} ms, "
              f"p99 {direct[99]:.3f} ms; added:")
        for name, _ in targets[1:]:
            values, sent, ok = pooled_ms(results[(name, stream)], what)
            p = percentiles_ms(values, (50, 90, 99))
            print(f"  {name:40s} p50 {p[50] - direct[50]:6.3f}  p90 {p[90] - direct[50]:6.3f}  "
                  f"p99 {p[99] - direct[99]:6.3f} ms  ({ok}/{sent} ok)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: stubs, gateways and load generator stopped", file=sys.stderr)
        sys.exit(130)
