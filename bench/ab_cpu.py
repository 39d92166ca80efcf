"""What a change does to the gateway's CPU per request at saturation, side by side in one run:
this tree's gateway against a git revision's (`--against REV`, a worktree with its C extensions,
as bench/request_cost.py makes it), over the same 4 instant stubs, each saturated in turn by
vs_routers' closed loop (wrk -t1 -c64, fixed prompt), rounds rotating the order.

Why not request_cost's counts alone: they count work, not its cost. One task per client
connection instead of one per request ran ~3% fewer instructions (callgrind) and cost 5% more
CPU a request here (bench/README, "Thirty-second session"). A change to the hot path counts
where both agree.

    .venv/bin/python -m bench.ab_cpu --against HEAD~1                  # ~3 min: rr and ca, 4 rounds
    .venv/bin/python -m bench.ab_cpu --against HEAD --rounds 2         # the same tree twice: the noise

Prints each gateway's CPU us a request (user + system of its process tree / requests answered)
per round and in all, and the ratio this tree / the revision. On these shared machines two
gateways of one tree differ by ~1% over 4 rounds.
"""
from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import vs_routers as vs
from bench.loadgen import start_bench
from bench.request_cost import REPO_ROOT, gateway_argv, worktree
from bench.stub_backend import StubProcess
from tests.servers import free_port, run_gateway


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="This tree's gateway against a revision's: CPU a request.")
    parser.add_argument("--against", metavar="REV", required=True, help="the git revision to compare with")
    parser.add_argument("--policies", default=",".join(vs.POLICIES), help="comma-separated routing policies")
    parser.add_argument("--rounds", type=int, default=4, help="saturation phases per gateway")
    parser.add_argument("--saturation-s", type=float, default=8.0, help="seconds per phase")
    parser.add_argument("--connections", type=int, default=64, help="closed-loop connections (wrk -c)")
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in policies:
        if name not in vs.POLICIES:
            parser.error(f"--policies: {name!r} is not one of {', '.join(vs.POLICIES)}")
    if args.rounds < 1 or args.saturation_s <= 0 or args.connections < 1:
        parser.error("--rounds, --saturation-s and --connections must be positive")
    started, progress = start_bench()
    settings = argparse.Namespace(saturation_s=args.saturation_s, connections=args.connections)
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-ab-cpu-")))
        progress(f"checking out {args.against}")
        trees = {"this tree": REPO_ROOT, args.against: worktree(args.against, workdir, stack)}
        stubs = [stack.enter_context(StubProcess(output_tokens=vs.OUTPUT_TOKENS, stderr=subprocess.DEVNULL))
                 for _ in range(vs.STUBS)]
        pairs: list[tuple[vs.Router, vs.Router]] = []
        for policy in policies:
            pair = []
            for index, (label, tree) in enumerate(trees.items()):
                directory = workdir / f"{policy}-{index}"
                directory.mkdir()
                port = free_port()
                config = vs.gateway_config(directory, policy, [stub.url for stub in stubs], port)
                server = stack.enter_context(run_gateway(config, port, argv=gateway_argv(tree, config)))
                pair.append(vs.Router(f"{policy} {label}", "kvgate", policy, server.url, server.proc.pid))
            pairs.append(tuple(pair))
        routers = [router for pair in pairs for router in pair]
        progress("gateways up: " + ", ".join(router.name for router in routers))
        vs.saturate_in_turn(stack, routers, workdir, settings, args.rounds, progress)
    print(f"total {time.monotonic() - started:.0f} s; CPU us a request at saturation ({args.connections} in flight, "
          f"{args.rounds} x {args.saturation_s:g} s each, {vs.STUBS} stubs, fixed prompt):")
    for ours, theirs in pairs:
        mine, base = ours.cpu_us_per_request("fixed"), theirs.cpu_us_per_request("fixed")
        failed = ours.failed["fixed"] + theirs.failed["fixed"]
        print(f"  {ours.policy:12s} this tree {mine:6.1f}  {args.against} {base:6.1f}  ratio {mine / base:.3f}"
              f"  ({failed} failed)")
        print(f"figure kvgate_{ours.policy}_cpu_us_per_request_ratio_against_revision: {mine / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
