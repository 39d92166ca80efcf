"""What kvgate's request path costs on top of its own parts: the same gateway process, reached two
ways, side by side.

`bench/lean_router.py` does the work a round_robin request cannot skip with its own lean parts.
Here the gateway process itself (`python -m gateway.cli serve`: its config, replica pool, router
and policy, load tracker, upstream client, request log and metrics) gets a second listener. A
request that arrives there takes a lean path through those same parts: the head read in C, the
body decoded, the pool's candidates, the prompt's IDs from the replica's token cache, the block
hashes where the policy reads them, `router.attempt` (the policy's choice, the load tracker, the
routing explanation), the replica's answer through the pool's upstream client, the answer
written, the replica reported healthy, the record emitted through the request log and the
request's metrics observed. What it leaves out is what the hot path adds around them: the
hot connection's head checks and request struct, the front door (request id, API key, JSON
shape, session header), the proxy's plan, answer and tries (failover, resume, P/D, timeouts,
in-flight limits, context checks, error answers), the response's hooks.

So, per request at saturation (the same wrk closed loop as vs_routers.py, both ways alternating
in one run):
- kvgate's own path minus the lean path here: what the hot path's layers cost;
- the lean path here minus bench/lean_router.py (printed with `--routers ...,lean` in
  vs_routers.py): what kvgate's parts cost over the leanest ones.

    .venv/bin/python -m bench.layers              # ~2 min: both policies, 3 rounds x 8 s each way
    .venv/bin/python -m bench.layers --rounds 1 --saturation-s 4

The gateway process with its second listener alone (what the bench starts):

    .venv/bin/python -m bench.layers --serve CONFIG.yaml --lean-port 8101
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lean_router import _Client, answer_client
from gateway.limits import new_request_id
from gateway.prompts import prompt_ids_now
from gateway.proxy import _with_token_ids
from observability.request_log import RequestRecord
from protocol.requests import decode_completion

UPSTREAM_DEADLINE_S = 600.0  # the lean path's deadline for one upstream answer


class LeanOverParts:
    """The lean path through a running gateway's parts (app["proxy"]'s pool, router, request log,
    metrics); bench/lean_router.py's _Client calls serve()."""

    def __init__(self, app) -> None:
        self.proxy = app["proxy"]
        self.loop = asyncio.get_running_loop()

    async def serve(self, client, body: bytes, arrived_s: float) -> None:
        proxy = self.proxy
        pool, router = proxy.pool, proxy.router
        parsed = decode_completion(body)
        record = RequestRecord(new_request_id(), "/v1/completions", arrived_s)
        model = record.model = parsed.model
        candidates = pool.candidates(model)
        ids, _ = prompt_ids_now(parsed, candidates[0].tokenizer)
        record.prompt_token_ids, record.prompt_tokens = ids, len(ids)
        names = pool.main_pool(model, False)[1]
        hashes = router.hashes(ids, None) if router.reads_prefixes else ()
        deadline = self.loop.time() + UPSTREAM_DEADLINE_S
        try:
            with router.attempt(names, model, ids, hashes, None, None, parsed.max_tokens) as attempt:
                replica = pool.by_name[attempt.replica]
                record.replica, record.routed_s, record.routing = replica.name, attempt.routed_s, attempt
                upstream = await pool.client.post(replica.origin, "/v1/completions", _with_token_ids(body),
                                                  record.request_id, deadline)
                answer = upstream.body_now()
                if answer is None:
                    answer = await upstream.read(deadline)
                upstream.release()
                attempt.prefill_sample = False  # the whole answer came at once, as in the proxy
                attempt.first_token()
                answer_client(client, record, answer)
                pool.report(replica, ok=True)
                attempt.cached_tokens = record.cached_tokens
        finally:
            proxy.request_log.emit(record)  # its metrics too


def serve_with_lean_listener(config_path: str, lean_port: int) -> int:
    """`kvgate serve --config config_path`, with the lean path listening on lean_port too."""
    import gateway.server as server
    from gateway.cli import main as kvgate_main

    build_app = server.build_app

    def with_lean_listener(*args, **kwargs):
        app = build_app(*args, **kwargs)

        async def listen(app) -> None:
            lean = LeanOverParts(app)
            app["lean_listener"] = await asyncio.get_running_loop().create_server(
                lambda: _Client(lean), "127.0.0.1", lean_port)

        async def close(app) -> None:
            app["lean_listener"].close()

        app.on_startup.append(listen)
        app.on_cleanup.append(close)
        return app

    server.build_app = with_lean_listener
    return kvgate_main(["serve", "--config", config_path])


def measure(rounds: int, saturation_s: float, connections: int) -> list[str]:
    from rich.console import Console
    from rich.table import Table

    from bench import vs_routers as vs
    from bench.loadgen import start_bench
    from bench.stub_backend import StubProcess
    from tests.servers import free_port, run_process

    _, progress = start_bench()
    settings = argparse.Namespace(saturation_s=saturation_s, connections=connections)
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-layers-")))
        stubs = [stack.enter_context(StubProcess(output_tokens=vs.OUTPUT_TOKENS, stderr=subprocess.DEVNULL))
                 for _ in range(vs.STUBS)]
        urls = [stub.url for stub in stubs]
        pairs = []
        for policy in vs.POLICIES:
            port, lean_port = free_port(), free_port()
            config = vs.gateway_config(workdir, policy, urls, port)
            server = stack.enter_context(run_process(
                [sys.executable, "-m", "bench.layers", "--serve", str(config), "--lean-port", str(lean_port)],
                f"http://127.0.0.1:{port}/health", port=port, name=f"kvgate-{policy}"))
            pairs.append((vs.Router(f"kvgate {policy}", "kvgate", policy, server.url, server.proc.pid),
                          vs.Router(f"lean path over kvgate's parts, {policy}", "lean", policy,
                                    f"http://127.0.0.1:{lean_port}", server.proc.pid)))
        routers = [router for pair in pairs for router in pair]
        progress(f"{len(stubs)} stubs and {len(pairs)} gateways up")
        vs.saturate_in_turn(stack, routers, workdir, settings, rounds, progress)
    table = Table(title=f"CPU us a request at saturation ({connections} in flight, {rounds} x {saturation_s:g} s "
                        f"each way, {vs.STUBS} stubs, fixed prompt): one gateway process per policy, reached two ways")
    for column in ("policy", "kvgate's path", "lean path over its parts", "the path's layers", "failed"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    lines = []
    for ours, lean in pairs:
        full, parts = ours.cpu_us_per_request("fixed"), lean.cpu_us_per_request("fixed")
        failed = ours.failed["fixed"] + lean.failed["fixed"]
        table.add_row(ours.policy, f"{full:.1f}", f"{parts:.1f}", f"{full - parts:.1f}", str(failed))
        lines += [f"figure kvgate_{ours.policy}_cpu_us_per_request: {full:.1f}",
                  f"figure kvgate_{ours.policy}_lean_path_over_its_parts_cpu_us_per_request: {parts:.1f}",
                  f"figure kvgate_{ours.policy}_hot_path_layers_cpu_us_per_request: {full - parts:.1f}"]
    Console(width=150).print(table)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="What kvgate's request path costs over a lean path through its "
                                                 "own parts, in one gateway process.")
    parser.add_argument("--rounds", type=int, default=3, help="saturation rounds each way")
    parser.add_argument("--saturation-s", type=float, default=8.0, help="seconds per saturation phase")
    parser.add_argument("--connections", type=int, default=64, help="closed-loop connections (wrk -c)")
    parser.add_argument("--serve", metavar="CONFIG", help="run one gateway with the lean listener (what the bench starts)")
    parser.add_argument("--lean-port", type=int, help="with --serve: the lean path's port")
    args = parser.parse_args(argv)
    if args.serve:
        if not args.lean_port:
            parser.error("--serve needs --lean-port")
        return serve_with_lean_listener(args.serve, args.lean_port)
    started = time.monotonic()
    lines = measure(args.rounds, args.saturation_s, args.connections)
    print(f"total {time.monotonic() - started:.0f} s")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
