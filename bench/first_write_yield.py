"""A/B of the hot path's one yield after a lone request's first body write
(gateway/hot_path.py `HotExchange._first_out`, switched by `LET_CLIENT_RUN`): kvgate with and
without it, side by side in one run, on vs_routers' 4 instant stubs and its open-loop client
(Poisson at 200 req/s, 16 output tokens), streamed and not, windows rotating over the targets,
against the same schedules sent straight to a stub.

    .venv/bin/python -m bench.first_write_yield                 # ~5 min: rr and ca, 10 windows each
    .venv/bin/python -m bench.first_write_yield --windows 4 --policies round_robin

Prints, per gateway, the streamed TTFB and the non-streamed latency the gateway adds (its p50 and
p90 minus the direct p50, its p99 minus the direct p99). The yield only helps a client that
shares a core with the gateway (here, the load generator), and only when the gateway is idle
enough that a request is alone in flight.
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
from bench.stub_backend import StubProcess
from bench.vs_routers import STUBS, OUTPUT_TOKENS, POLICIES, Settings, body, gateway_config, open_loop, pooled_ms
from tests.servers import free_port, run_gateway


def start_gateway(stack: contextlib.ExitStack, directory: Path, policy: str, stub_urls: list[str], yields: bool) -> str:
    directory.mkdir()
    port = free_port()
    config = gateway_config(directory, policy, stub_urls, port)
    code = (f"import sys, gateway.hot_path as hot; hot.LET_CLIENT_RUN = {yields}; from gateway.cli import main; "
            f"sys.exit(main(['serve', '--config', {str(config)!r}]))")
    return stack.enter_context(run_gateway(config, port, argv=[sys.executable, "-c", code])).url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvgate with and without the yield after a lone first write.")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated routing policies")
    parser.add_argument("--windows", type=int, default=10, help="open-loop windows per target and measurement")
    parser.add_argument("--window-s", type=float, default=3.0)
    parser.add_argument("--rate", type=float, default=200.0, help="open-loop requests per second")
    args = parser.parse_args(argv)
    started, progress = start_bench()
    settings = Settings(saturation_s=0.0, rounds=0, unique_rounds=0, rate_rps=args.rate, window_s=args.window_s,
                        windows=args.windows, connections=0)
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-yield-ab-")))
        stubs = [stack.enter_context(StubProcess(output_tokens=OUTPUT_TOKENS, stderr=subprocess.DEVNULL))
                 for _ in range(STUBS)]
        stub_urls = [stub.url for stub in stubs]
        targets = [("direct", stub_urls[0])]
        for policy in (p.strip() for p in args.policies.split(",") if p.strip()):
            for yields in (False, True):
                name = f"kvgate {policy} {'yield' if yields else 'no yield'}"
                targets.append((name, start_gateway(stack, workdir / name.replace(" ", "-"), policy, stub_urls, yields)))
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
                    results[(name, stream)].append(open_loop(url, stream, settings, seed=100 + window, loadgen=loadgen))
                progress(f"{'stream' if stream else 'non-stream'} window {window + 1}/{args.windows}")
    print(f"total {time.monotonic() - started:.0f} s, {args.rate:.0f} req/s open loop, {args.windows} windows of "
          f"{args.window_s:.0f} s per target")
    for stream in (True, False):
        what = "ttfb" if stream else "latency"
        direct = percentiles_ms(pooled_ms(results[("direct", stream)], what)[0], (50, 99))
        print(f"{'streamed TTFB' if stream else 'non-streamed latency'}: direct p50 {direct[50]:.3f} ms, "
              f"p99 {direct[99]:.3f} ms; added:")
        for name, _ in targets[1:]:
            values, sent, ok = pooled_ms(results[(name, stream)], what)
            p = percentiles_ms(values, (50, 90, 99))
            print(f"  {name:32s} p50 {p[50] - direct[50]:6.3f}  p90 {p[90] - direct[50]:6.3f}  "
                  f"p99 {p[99] - direct[99]:6.3f} ms  ({ok}/{sent} ok)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: stubs, gateways and load generator stopped", file=sys.stderr)
        sys.exit(130)
