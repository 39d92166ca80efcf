"""What one piece of the request path costs in the real gateway at saturation: the same tree's
gateway with the piece taken out (patched away in its process before it starts), side by side
with the whole one, over the same 4 instant stubs, each saturated in turn by vs_routers' closed
loop (wrk -t1 -c64, fixed prompt), rounds rotating the order.

Why: a piece timed alone in a loop (its code and data in the CPU's caches) costs a fraction of
what it costs between other requests. The request record's line, its encoding and handover to
the log writer took ~2 us in a loop and ~14 us a request in the gateway; the token cache's
lookup ~1.5 and ~9 (bench/README, "Thirty-third session"). Counts (bench/request_cost.py) miss
it the same way. Taking a piece out of the real path measures what it costs there.

    .venv/bin/python -m bench.ablate                                  # ~5 min: round_robin, every piece
    .venv/bin/python -m bench.ablate --policy cache_aware --pieces explain,estimates
    .venv/bin/python -m bench.ablate --rounds 2 --saturation-s 4       # rougher

A piece taken out is replaced by what leaves the rest of the path as it was (the same answer to
the client, the same routing), except `learning` (cache_aware: nothing learned, so nothing
matches and every choice is a tie) and `tokenize` (the prompt's IDs kept by its text: the fixed
prompt is tokenized once). Prints each gateway's CPU us a request and, per piece, whole minus
without; on these shared machines a figure moves by +-2-3 us from one run to the next.
"""
from __future__ import annotations

import argparse
import contextlib
import subprocess
import tempfile
import time
from pathlib import Path

from bench import vs_routers as vs
from bench.loadgen import start_bench
from bench.request_cost import REPO_ROOT, gateway_argv
from bench.stub_backend import StubProcess
from tests.servers import free_port, run_gateway

# Each piece: (what it is, the Python run in the gateway's process before it starts, which takes it out).
PIECES: dict[str, tuple[str, str]] = {
    "record": ("the request record: its line, encoding and handover to the log writer", """
import observability.request_log as m
m.RequestLog.emit = lambda self, record: True
"""),
    "record_encode": ("the record's encoding and handover (its line still made)", """
import observability.logs as m
m.JsonSink.lines = lambda self, event, lines: None
"""),
    "log_write": ("the log writer thread's write() of the lines", """
import observability.log_writer as m
m.LogWriter._write_batch = lambda self, lines: None
"""),
    "tokenize": ("the prompt's IDs from the token cache (kept by the prompt's text instead)", """
import gateway.proxy as m
_ids_now, _kept = m.prompt_ids_now, {}
def _by_text(parsed, bundle):
    key = parsed.prompt if isinstance(parsed.prompt, str) else None
    ids = _kept.get(key)
    if ids is None:
        ids = _kept[key] = _ids_now(parsed, bundle)[0]
    return list(ids), None
m.prompt_ids_now = _by_text
"""),
    "answer_decode": ("the replica's answer decoded for its IDs (the first one's kept)", """
import gateway.proxy as m
_decode, _first = m.decode_answer, []
def _once(body):
    if not _first:
        _first.append(_decode(body))
    return _first[0]
m.decode_answer = _once
"""),
    "health": ("passive health's count of each answered request", """
import gateway.upstream as m
_report = m.ReplicaPool.report
m.ReplicaPool.report = lambda self, replica, ok, reason=None, fatal=False: (
    None if ok else _report(self, replica, ok, reason, fatal))
"""),
    "metrics": ("the request's metrics: its counts, latencies and cached tokens folded in", """
import observability.metrics as m
m.GatewayMetrics.observe_records = lambda self, records: None
m.GatewayMetrics.add = lambda self, metric, replica, amount=1, also=None, also_amount=0: None
"""),
    "retry_budget": ("the retry budget's count of each request", """
import gateway.retry_budget as m
m.RetryBudget.on_request = lambda self, now_s: None
"""),
    "explain": ("the record's routing explanation (an empty object instead; cache_aware)", """
import msgspec, routing.policies as m
m.CacheAwareDecision.explain_json = lambda decision, mode, estimates, retried_after: msgspec.Raw(b"{}")
"""),
    "estimates": ("each candidate's load estimate for the record (cache_aware)", """
import gateway.router as r, routing.load as m, routing.policies as p
p.RECORD_ESTIMATES = None  # cache_aware's choice asks for none
_loads = m.LoadTracker.loads_and_delays
def _without(self, replicas, now, estimates=False):
    out = _loads(self, replicas, now, False)
    return (out[0], out[1], None) if estimates else out
m.LoadTracker.loads_and_delays = _without
r._estimates = lambda state, candidates, decision: None
"""),
    "learning": ("what cache_aware learns from its own routing (its guesses, branch points)", """
import routing.policies as m
m.CacheAware.learns = False
"""),
}
DEFAULT_PIECES = {"round_robin": ("record", "tokenize", "answer_decode", "health", "retry_budget"),
                  "cache_aware": ("record", "tokenize", "explain", "estimates", "learning")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="What pieces of the request path cost in the real gateway.")
    parser.add_argument("--policy", default="round_robin", choices=vs.POLICIES)
    parser.add_argument("--pieces", help=f"comma-separated, of: {', '.join(PIECES)} (a set per policy)")
    parser.add_argument("--rounds", type=int, default=3, help="saturation phases per gateway")
    parser.add_argument("--saturation-s", type=float, default=6.0, help="seconds per phase")
    args = parser.parse_args(argv)
    pieces = [p.strip() for p in args.pieces.split(",") if p.strip()] if args.pieces else \
        list(DEFAULT_PIECES[args.policy])
    for name in pieces:
        if name not in PIECES:
            parser.error(f"--pieces: {name!r} is not one of {', '.join(PIECES)}")
    if args.rounds < 1 or args.saturation_s <= 0:
        parser.error("--rounds and --saturation-s must be positive")
    started, progress = start_bench()
    settings = argparse.Namespace(saturation_s=args.saturation_s, connections=64)
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-ablate-")))
        stubs = [stack.enter_context(StubProcess(output_tokens=vs.OUTPUT_TOKENS, stderr=subprocess.DEVNULL))
                 for _ in range(vs.STUBS)]
        routers: list[vs.Router] = []
        for label in ["whole", *pieces]:
            directory = workdir / label
            directory.mkdir()
            port = free_port()
            config = vs.gateway_config(directory, args.policy, [stub.url for stub in stubs], port)
            prelude = PIECES[label][1] if label in PIECES else ""
            server = stack.enter_context(run_gateway(config, port, argv=gateway_argv(REPO_ROOT, config, prelude)))
            routers.append(vs.Router(label, "kvgate", args.policy, server.url, server.proc.pid))
        progress("gateways up: " + ", ".join(router.name for router in routers))
        vs.saturate_in_turn(stack, routers, workdir, settings, args.rounds, progress)
    whole = routers[0].cpu_us_per_request("fixed")
    print(f"total {time.monotonic() - started:.0f} s; {args.policy}, CPU us a request at saturation "
          f"(64 in flight, {args.rounds} x {args.saturation_s:g} s each, {vs.STUBS} stubs, fixed prompt):")
    print(f"  whole path {whole:6.1f}")
    for router in routers[1:]:
        without = router.cpu_us_per_request("fixed")
        print(f"  without {router.name:14s} {without:6.1f}  the piece {whole - without:5.1f}  "
              f"({PIECES[router.name][0]})")
        print(f"figure kvgate_{args.policy}_{router.name}_cpu_us_per_request: {whole - without:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
