"""kvgate's hot path against the Rust routers users would pick instead, measured side by side in
one run: the same 4 instant stub backends (bench/stub_backend.py, 16 output tokens), the same load.

Routers: kvgate (`python -m gateway.cli serve`, one process, request records with their token IDs
logged in JSON to a file) with round_robin and cache_aware; sglang-router 0.3.2 and vllm-router
0.1.17 (bench/routers.py installs them in the bench's own virtualenv, never as kvgate
dependencies) with round_robin and cache_aware. A router that cannot be installed or started here
is named with the reason, and no row or target is printed for it. A reference row, "python floor":
bench/floor_proxy.py, a uvloop byte pipe (each client connection piped to the next stub in turn, no
HTTP parsing): what the event loop and the socket calls of a relayed request cost here, which any
router written in Python pays before its own work. Another, "python lean router":
bench/lean_router.py, the work a kvgate round_robin request cannot skip (head, body, cached
tokenization, token IDs, kept-alive upstream, answer, one record with both ID lists) in lean
Python, non-streamed only: kvgate's CPU over it is what its layers and features cost.

1. CPU per request at saturation: wrk -t1 -c64 (or, without wrk, bench/loadgen.py's closed loop
   in its own process) for `--saturation-s` per round, routers in a rotating order each round;
   the router process's CPU time (utime + stime from /proc, children included) over the phase /
   requests answered 200. Two prompts: the same short completions prompt every request (as the
   issue's table), and a different prompt every request (no tokenizer cache hit, new prefix
   blocks for the cache-aware routers every time).
2. Added latency at 200 req/s, open loop (Poisson), non-streamed requests: router percentile -
   the same schedule sent straight to the stubs by the client, taking them in turn, in
   alternating windows (every router and each baseline once per round, rotating order). The
   client spreads its requests over the 4 stubs as a pool gets them without a router: sent all
   to one stub, the baseline would leave out what spreading costs every router (a stub that
   slept through the last 3 requests answers its next one later; bench/lone_stages.py --stubs
   1 against 4: ~0.47 ms of round_robin's TTFB). The one-stub baseline is run and printed too.
3. Streaming time to first byte added, the same way with stream=true (and over one stub, a
   column of its own).

    .venv/bin/python -m bench.vs_routers            # ~6 min
    .venv/bin/python -m bench.vs_routers --quick    # ~2 min: the machinery, rougher figures

Ends with `target ...` lines: kvgate's CPU per request at most sglang-router's (cache_aware and
round_robin, same policy), its added p50 at 200 req/s at most sglang-router's, and its streaming
TTFB added p50 at most 0.5 ms.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.gateway_overhead import PROMPT, check_answers
from bench.loadgen import (LoadgenProcess, Phase, PhaseResult, percentiles_ms, process_cpu_split_s, process_tree,
                           start_bench)
from bench.routers import (RouterUnavailable, run_sglang_router, run_vllm_router, sglang_router_python,
                           vllm_router_python)
from bench.stub_backend import StubProcess
from replica.cpu_policy import POLICIES as CPU_POLICIES
from tests.servers import ServerStartError, free_port, run_gateway, run_process

STUBS = 4
OUTPUT_TOKENS = 16
TTFB_GOAL_MS = 0.5
POLICIES = ("round_robin", "cache_aware")


@dataclass
class Settings:
    saturation_s: float
    rounds: int
    unique_rounds: int
    rate_rps: float
    window_s: float
    windows: int
    connections: int


def settings_from(args) -> Settings:
    if args.quick:
        return Settings(saturation_s=4.0, rounds=1, unique_rounds=1, rate_rps=args.rate, window_s=2.0, windows=1,
                        connections=args.connections)
    return Settings(saturation_s=args.saturation_s, rounds=args.rounds, unique_rounds=1, rate_rps=args.rate,
                    window_s=args.window_s, windows=args.windows, connections=args.connections)


@dataclass
class Router:
    """One router under test: its name, how to reach it, the processes whose CPU is its cost."""
    name: str            # e.g. "kvgate cache_aware"
    family: str          # kvgate | sglang-router | vllm-router
    policy: str
    url: str
    pid: int
    cpu_s: dict[str, float] = field(default_factory=lambda: {"fixed": 0.0, "unique": 0.0})
    sys_s: dict[str, float] = field(default_factory=lambda: {"fixed": 0.0, "unique": 0.0})  # the kernel's part of cpu_s
    served: dict[str, int] = field(default_factory=lambda: {"fixed": 0, "unique": 0})
    failed: dict[str, int] = field(default_factory=lambda: {"fixed": 0, "unique": 0})
    wall_s: dict[str, float] = field(default_factory=lambda: {"fixed": 0.0, "unique": 0.0})
    latency: list[PhaseResult] = field(default_factory=list)
    ttfb: list[PhaseResult] = field(default_factory=list)
    streams: bool = True  # False: it serves no streams (the lean router): no TTFB phases, "nan" in their columns

    @property
    def urls(self) -> list[str]:
        return [self.url]

    def pids(self) -> list[int]:
        return process_tree(self.pid)

    def cpu_us_per_request(self, workload: str) -> float:
        served = self.served[workload]
        return self.cpu_s[workload] / served * 1e6 if served else float("nan")

    def sys_us_per_request(self, workload: str) -> float:
        served = self.served[workload]
        return self.sys_s[workload] / served * 1e6 if served else float("nan")


@dataclass
class Direct:
    """A baseline without a router: the open-loop client sends to `urls` itself, in turn."""
    name: str
    urls: list[str]
    latency: list[PhaseResult] = field(default_factory=list)
    ttfb: list[PhaseResult] = field(default_factory=list)

    def percentiles_ms(self) -> tuple[dict, dict]:
        """(latency, TTFB) p50 and p99 in ms over its windows."""
        return (percentiles_ms(pooled_ms(self.latency, "latency")[0], (50, 99)),
                percentiles_ms(pooled_ms(self.ttfb, "ttfb")[0], (50, 99)))


# ---- load ------------------------------------------------------------------------------------

def body(stream: bool) -> dict:
    b = {"model": "stub", "prompt": PROMPT, "max_tokens": OUTPUT_TOKENS, "temperature": 0.0}
    if stream:
        b["stream"] = True
    return b


WRK_FIXED = """
wrk.method = "POST"
wrk.body = %(body)s
wrk.headers["Content-Type"] = "application/json"
"""
# A different prompt each request: the number leads, so every 16-token block of it is new.
WRK_UNIQUE = """
local counter = 0
init = function(args) counter = tonumber(args[1]) end
request = function()
  counter = counter + 1
  local body = string.format('{"model": "stub", "prompt": "Request %%d: %(prompt)s", "max_tokens": %(tokens)d, "temperature": 0.0}', counter)
  return wrk.format("POST", "/v1/completions", {["Content-Type"] = "application/json"}, body)
end
"""


def write_wrk_scripts(directory: Path) -> dict[str, Path]:
    fixed = directory / "fixed.lua"
    fixed.write_text(WRK_FIXED % {"body": json.dumps(json.dumps(body(False)))}, encoding="utf-8")
    unique = directory / "unique.lua"
    unique.write_text(WRK_UNIQUE % {"prompt": PROMPT, "tokens": OUTPUT_TOKENS}, encoding="utf-8")
    return {"fixed": fixed, "unique": unique}


_WRK_REQUESTS = re.compile(r"(\d+) requests in")
_WRK_NON_2XX = re.compile(r"Non-2xx or 3xx responses: (\d+)")
_WRK_ERRORS = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")


def wrk_counts(out: str) -> tuple[int, int]:
    """(requests answered 2xx/3xx, requests failed: other statuses and socket errors) from wrk's output."""
    total = int(_WRK_REQUESTS.search(out).group(1)) if _WRK_REQUESTS.search(out) else 0
    bad = int(_WRK_NON_2XX.search(out).group(1)) if _WRK_NON_2XX.search(out) else 0
    errors = sum(map(int, _WRK_ERRORS.search(out).groups())) if _WRK_ERRORS.search(out) else 0
    return total - bad, bad + errors


def saturate(router: Router, workload: str, settings: Settings, scripts: dict[str, Path], loadgen: LoadgenProcess,
             offset: int) -> None:
    """One closed-loop phase at `connections` in flight; adds the router's CPU and answers."""
    pids = router.pids()
    before = {pid: process_cpu_split_s(pid) for pid in pids}
    started = time.monotonic()
    if shutil.which("wrk"):
        argv = ["wrk", "-t1", f"-c{settings.connections}", f"-d{settings.saturation_s:g}s", "--timeout", "10s",
                "-s", str(scripts[workload]), router.url + "/v1/completions"]
        if workload == "unique":
            argv += ["--", str(offset)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=settings.saturation_s + 60)
        served, failed = wrk_counts(done.stdout)
    else:
        count = int(settings.saturation_s * 2000)
        bodies = ([body(False)] if workload == "fixed" else
                  [{**body(False), "prompt": f"Request {offset + i}: {PROMPT}"} for i in range(count)])
        result = loadgen.run(Phase(name=router.name, url=router.url + "/v1/completions", body=bodies[0],
                                   bodies=bodies, mode="closed", concurrency=settings.connections, count=count,
                                   timeout_s=10.0))
        served, failed = len(result.ok), len(result.results) - len(result.ok)
    router.wall_s[workload] += time.monotonic() - started
    for pid, (user, system) in before.items():
        user_after, system_after = process_cpu_split_s(pid)
        router.cpu_s[workload] += user_after - user + system_after - system
        router.sys_s[workload] += system_after - system
    router.served[workload] += served
    router.failed[workload] += failed


def saturate_in_turn(stack: contextlib.ExitStack, routers: list[Router], directory: Path, settings,
                     rounds: int, progress) -> None:
    """Side by side in one run (bench/layers.py, bench/ab_cpu.py): every router's answer checked
    and its path warmed up, then `rounds` closed-loop phases each on the fixed prompt, the order
    rotating each round; each router's CPU and answers add up in it."""
    for router in routers:
        check_answers(router.url + "/v1/completions", body(False))
    scripts = write_wrk_scripts(directory)
    loadgen = stack.enter_context(LoadgenProcess())
    for router in routers:
        loadgen.run(Phase(name="warmup", url=router.url + "/v1/completions", body=body(False), mode="closed",
                          concurrency=16, count=400, timeout_s=10.0))
    for index in range(rounds):
        order = routers[index % len(routers):] + routers[:index % len(routers)]
        for router in order:
            saturate(router, "fixed", settings, scripts, loadgen, 0)
        progress(f"round {index + 1}/{rounds}: " + ", ".join(
            f"{router.name} {router.cpu_us_per_request('fixed'):.1f}" for router in routers))


STUB_RECOVERY_S = 30.0  # how long a stub may take to answer again after a router's phase


class StubsDown(RuntimeError):
    """A phase left the stubs not answering: every later figure would be NaN."""


def check_stubs(stub_urls: list[str], after: str, say=None, recovery_s: float = STUB_RECOVERY_S) -> None:
    """Every stub answers /v1/models again within `recovery_s` (each try 5 s), else StubsDown
    naming the phase before; a stub that needed more than one try is reported through `say`."""
    for url in stub_urls:
        started = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5) as answer:
                    answer.read()
                break
            except OSError as exc:
                if time.monotonic() - started >= recovery_s:
                    raise StubsDown(f"stub {url} stopped answering after {after} ({exc}, for {recovery_s:g} s); the "
                                    "figures from here on would be failures, so the run stops. Leave that router "
                                    "out with --routers.") from None
                time.sleep(0.5)
        waited = time.monotonic() - started
        if waited > 5 and say is not None:
            say(f"stub {url} answered again {waited:.0f} s after {after}")


def open_loop(urls: list[str], stream: bool, settings: Settings, seed: int, loadgen: LoadgenProcess) -> PhaseResult:
    """The open-loop schedule to `urls` (a router's, or the stubs' with the client taking them in turn)."""
    return loadgen.run(Phase(name=urls[0], url=urls[0] + "/v1/completions", body=body(stream), mode="open",
                             rate_rps=settings.rate_rps, duration_s=settings.window_s, arrivals="poisson",
                             seed=seed, timeout_s=10.0, urls=[url + "/v1/completions" for url in urls]))


# ---- routers ---------------------------------------------------------------------------------

def gateway_config(directory: Path, policy: str, stub_urls: list[str], port: int) -> Path:
    path = directory / f"kvgate-{policy}.yaml"
    path.write_text(
        f"gateway: {{host: 127.0.0.1, port: {port}}}\n"
        "logging: {level: info, format: json, token_ids: full}\n"
        f"routing: {{policy: {policy}}}\n"
        "replicas:\n" + "".join(f"  - {{name: stub-{i}, url: '{url}', model: stub}}\n"
                                for i, url in enumerate(stub_urls)), encoding="utf-8")
    return path


def start_routers(stack: contextlib.ExitStack, directory: Path, stub_urls: list[str], wanted: set[str],
                  say) -> tuple[list[Router], list[str]]:
    routers: list[Router] = []
    missing: list[str] = []
    if "kvgate" in wanted:
        for policy in POLICIES:
            port = free_port()
            server = stack.enter_context(run_gateway(gateway_config(directory, policy, stub_urls, port), port))
            routers.append(Router(f"kvgate {policy}", "kvgate", policy, server.url, server.proc.pid))
    for family, module, label, policy, streams, health, extra in (
            # the references: what a Python router cannot go below on this machine, and what the
            # work kvgate must do on a request costs in lean Python
            ("floor", "bench.floor_proxy", "python floor (byte pipe)", "per connection", True, "/v1/models", []),
            ("lean", "bench.lean_router", "python lean router", "round_robin", False, "/health",
             ["--log-file", str(directory / "lean-router.jsonl")])):
        if family not in wanted:
            continue
        port = free_port()
        argv = [sys.executable, "-m", module, "--port", str(port), *extra]
        for url in stub_urls:
            argv += ["--backend", url]
        server = stack.enter_context(run_process(argv, f"http://127.0.0.1:{port}{health}", port=port,
                                                 name=module.split(".")[1]))
        routers.append(Router(label, family, policy, server.url, server.proc.pid, streams=streams))
    for family, installer, runner in (("sglang-router", sglang_router_python, run_sglang_router),
                                      ("vllm-router", vllm_router_python, run_vllm_router)):
        if family.split("-")[0] not in wanted:
            continue
        try:
            python = installer(say)
            for policy in POLICIES:
                server = stack.enter_context(runner(python, stub_urls, policy=policy))
                routers.append(Router(f"{family} {policy}", family, policy, server.url, server.proc.pid))
        except (RouterUnavailable, ServerStartError, OSError, subprocess.SubprocessError) as exc:
            routers = [r for r in routers if r.family != family]
            missing.append(f"{family}: {str(exc).strip().splitlines()[0][:300]}")
    return routers, missing


# ---- report ----------------------------------------------------------------------------------

def fmt(value: float, digits: int = 2) -> str:
    return "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def pooled_ms(results: list[PhaseResult], what: str) -> tuple[list[float], int, int]:
    values, sent, ok = [], 0, 0
    for result in results:
        sent += len(result.results)
        good = result.ok
        ok += len(good)
        values += [(r.ttfb_s if what == "ttfb" else r.latency_s) for r in good
                   if (r.ttfb_s if what == "ttfb" else r.latency_s) is not None]
    return values, sent, ok


def interpreter_build() -> str:
    """This interpreter, its version, and whether its libpython is a shared library (what a Python
    router's CPU depends on: sysconfig describes the distribution's shared build, not the binary)."""
    shared = ""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            shared = next((line.split()[-1] for line in maps if "/libpython" in line), "")
    except OSError:
        pass
    linked = f"libpython shared ({shared})" if shared else "libpython linked in"
    return f"{os.path.realpath(sys.executable)} (Python {sys.version.split()[0]}, {linked})"


def report(routers: list[Router], direct: dict[str, Direct], settings: Settings, missing: list[str]) -> list[str]:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 150))
    # "Added" is over the stubs taken in turn (the same spread of backends, no router); the TTFB
    # added over one stub is printed too (the first table measured against one backend).
    d_lat, d_ttfb = direct["turns"].percentiles_ms()
    one_ttfb = direct["one"].percentiles_ms()[1]
    table = Table(title=f"{STUBS} instant stubs ({OUTPUT_TOKENS} tokens), one run; saturation: "
                        f"{settings.connections} in flight, {settings.rounds} x {settings.saturation_s:g} s per router "
                        f"(fixed prompt); open loop {settings.rate_rps:g} req/s, {settings.windows} x "
                        f"{settings.window_s:g} s windows per router")
    for column in ("router", "CPU us/req (fixed prompt)", "of it system", "req/s", "CPU us/req (unique prompts)",
                   "added p50 / p99 ms @rate", "latency p50 / p99 ms", "TTFB p50 / p99 ms",
                   "TTFB added p50 / p99 ms", "TTFB added p50 ms over one stub", "failed"):
        table.add_column(column, justify="left" if column == "router" else "right")
    figures: dict[str, dict] = {}
    for router in routers:
        lat_values, lat_sent, lat_ok = pooled_ms(router.latency, "latency")
        ttfb_values, ttfb_sent, ttfb_ok = pooled_ms(router.ttfb, "ttfb")
        lat = percentiles_ms(lat_values, (50, 99))
        ttfb = percentiles_ms(ttfb_values, (50, 99))
        rps = router.served["fixed"] / router.wall_s["fixed"] if router.wall_s["fixed"] else float("nan")
        failed = (router.failed["fixed"] + router.failed["unique"] + (lat_sent - lat_ok) + (ttfb_sent - ttfb_ok))
        figures[router.name] = {"cpu": router.cpu_us_per_request("fixed"), "sys": router.sys_us_per_request("fixed"),
                                "cpu_unique": router.cpu_us_per_request("unique"),
                                "added_p50": lat[50] - d_lat[50], "added_p99": lat[99] - d_lat[99],
                                "ttfb_added_p50": ttfb[50] - d_ttfb[50], "ttfb_added_p99": ttfb[99] - d_ttfb[99],
                                "ttfb_added_one_p50": ttfb[50] - one_ttfb[50]}
        f = figures[router.name]
        table.add_row(router.name, fmt(f["cpu"], 0), fmt(f["sys"], 0), fmt(rps, 0), fmt(f["cpu_unique"], 0),
                      f"{fmt(f['added_p50'])} / {fmt(f['added_p99'])}", f"{fmt(lat[50])} / {fmt(lat[99])}",
                      f"{fmt(ttfb[50])} / {fmt(ttfb[99])}", f"{fmt(f['ttfb_added_p50'])} / {fmt(f['ttfb_added_p99'])}",
                      fmt(f["ttfb_added_one_p50"]), str(failed))
    for baseline in direct.values():
        lat, first = baseline.percentiles_ms()
        table.add_row(baseline.name, "-", "-", "-", "-", "-", f"{fmt(lat[50])} / {fmt(lat[99])}",
                      f"{fmt(first[50])} / {fmt(first[99])}", "-", "-", "")
    console.print(table)
    console.print("CPU us/req: the router process's CPU time (user + system, children included) over the "
                  "saturation phases / requests answered 200; 'of it system' is the kernel's part (the "
                  "sockets' syscalls, which every router pays alike). The stubs, the load generator and every other "
                  f"router share the machine's {os.cpu_count()} cores; compare within this run only.")
    console.print(f"kvgate, the byte pipe and the lean router ran on {interpreter_build()}: the build moves a Python router's CPU "
                  "(bench/README.md: pyenv's 3.11.7, libpython shared and built without PGO, cost 17-20% more a "
                  "request than Debian's 3.11.2).")
    for line in missing:
        console.print(f"[yellow]not measured: {line}[/yellow]")

    lines: list[str] = []
    for policy in POLICIES:
        ours = figures.get(f"kvgate {policy}")
        theirs = figures.get(f"sglang-router {policy}")
        if ours is None:
            continue
        if theirs is not None:
            goal = theirs["cpu"]
            lines.append(_target(f"kvgate_{policy}_cpu_us_per_request", ours["cpu"], "<=", goal, 0))
            lines.append(_target(f"kvgate_{policy}_added_p50_ms", ours["added_p50"], "<=", theirs["added_p50"], 2))
        lines.append(_target(f"kvgate_{policy}_ttfb_added_p50_ms", ours["ttfb_added_p50"], "<=", TTFB_GOAL_MS, 2))
    lean = figures.get("python lean router")
    for policy in POLICIES:
        if lean is not None and f"kvgate {policy}" in figures:  # what kvgate's layers and features cost over the essentials
            lines.append(f"figure kvgate_{policy}_cpu_us_per_request_over_lean_router: "
                         f"{fmt(figures[f'kvgate {policy}']['cpu'] - lean['cpu'], 0)}")
    for name, f in figures.items():
        key = name.replace(" ", "_").replace("-", "_")
        lines.append(f"figure {key}_ttfb_added_p50_ms_over_one_stub: {fmt(f['ttfb_added_one_p50'])}")
        lines.append(f"figure {key}_cpu_us_per_request_unique_prompts: {fmt(f['cpu_unique'], 0)}")
        lines.append(f"figure {key}_system_cpu_us_per_request: {fmt(f['sys'], 0)}")
        if not name.startswith("kvgate"):
            lines.append(f"figure {key}_cpu_us_per_request: {fmt(f['cpu'], 0)}")
            lines.append(f"figure {key}_ttfb_added_p50_ms: {fmt(f['ttfb_added_p50'])}")
    return lines


def _target(name: str, value: float, op: str, goal: float, digits: int) -> str:
    met = not math.isnan(value) and not math.isnan(goal) and (value <= goal if op == "<=" else value >= goal)
    return f"target {name}: {fmt(value, digits)} (goal {op} {fmt(goal, digits)}) {'met' if met else 'short'}"


# ---- main ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvgate's hot path against sglang-router and vllm-router.")
    parser.add_argument("--quick", action="store_true", help="one short round of everything (~2 min)")
    parser.add_argument("--routers", default="kvgate,sglang,vllm,floor,lean",
                        help="comma-separated: kvgate,sglang,vllm,floor,lean (floor: bench/floor_proxy.py, a uvloop "
                             "byte pipe, what any Python router costs at least; lean: bench/lean_router.py, the "
                             "work a kvgate round_robin request must do in lean Python, non-streamed only)")
    parser.add_argument("--saturation-s", type=float, default=8.0, help="seconds per saturation phase")
    parser.add_argument("--rounds", type=int, default=3, help="saturation rounds per router (fixed prompt)")
    parser.add_argument("--connections", type=int, default=64, help="closed-loop connections (wrk -c)")
    parser.add_argument("--rate", type=float, default=200.0, help="open-loop requests per second")
    parser.add_argument("--window-s", type=float, default=3.0, help="open-loop window per router")
    parser.add_argument("--windows", type=int, default=3, help="open-loop windows per router and measurement")
    parser.add_argument("--stub-cpu-policy", choices=CPU_POLICIES, default="normal",
                        help="the stubs' --cpu-policy: 'batch' keeps a woken stub from preempting the router "
                             "on the cores they share (a remote backend never does)")
    parser.add_argument("--keep-logs", metavar="DIR", help="copy the kvgate configs here")
    args = parser.parse_args(argv)
    settings = settings_from(args)
    wanted = {name.strip() for name in args.routers.split(",") if name.strip()}

    started, progress = start_bench()

    if not shutil.which("wrk"):
        progress("wrk not found: saturation uses bench/loadgen.py's closed loop instead (apt-get install wrk)")
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-vs-routers-")))
        stubs = [stack.enter_context(StubProcess(output_tokens=OUTPUT_TOKENS, stderr=subprocess.DEVNULL,
                                                     cpu_policy=args.stub_cpu_policy))
                 for _ in range(STUBS)]
        stub_urls = [stub.url for stub in stubs]

        def stubs_said() -> None:  # what the stubs logged (a traceback per request that failed there)
            for stub in stubs:
                if lines := [line for line in stub.output_tail() if line.strip()]:
                    errors = [line for line in lines if "Error" in line or "Exception" in line]
                    progress(f"stub {stub.url} logged {len(lines)}+ lines; the last error: {(errors or lines)[-1][:300]}")
        stack.callback(stubs_said)
        progress(f"{STUBS} stubs up: {', '.join(stub_urls)}")
        routers, missing = start_routers(stack, workdir, stub_urls, wanted, progress)
        for line in missing:
            progress(f"not measured: {line}")
        progress("routers up: " + ", ".join(f"{r.name} ({r.url})" for r in routers))
        for router in routers:
            check_answers(router.url + "/v1/completions", body(False))
        scripts = write_wrk_scripts(workdir)
        loadgen = stack.enter_context(LoadgenProcess())
        for router in routers:  # warm every path: pools, caches, JIT-less but cold code
            loadgen.run(Phase(name="warmup", url=router.url + "/v1/completions", body=body(False), mode="closed",
                              concurrency=16, count=400, timeout_s=10.0))
            if router.streams:
                loadgen.run(Phase(name="warmup", url=router.url + "/v1/completions", body=body(True), mode="closed",
                                  concurrency=8, count=100, timeout_s=10.0))
        progress("warmed up")

        offset = int(time.time()) % 1_000_000 * 1000
        for round_index in range(settings.rounds):
            order = routers[round_index % len(routers):] + routers[:round_index % len(routers)]
            for router in order:
                saturate(router, "fixed", settings, scripts, loadgen, offset)
                check_stubs(stub_urls, f"{router.name}'s saturation phase", progress)
                progress(f"saturation round {round_index + 1}/{settings.rounds}: {router.name} "
                         f"{router.cpu_us_per_request('fixed'):.0f} us/req so far")
        for round_index in range(settings.unique_rounds):
            for router in routers:
                offset += 10_000_000
                saturate(router, "unique", settings, scripts, loadgen, offset)
                check_stubs(stub_urls, f"{router.name}'s unique-prompt phase", progress)
                progress(f"unique prompts: {router.name} {router.cpu_us_per_request('unique'):.0f} us/req")

        # Two baselines without a router: every request to one stub (a lone hot backend), and the
        # client taking the 4 stubs in turn (the spread a pool of backends gets without a router,
        # and what round_robin gives each stub: a stub that has slept through 3 requests answers
        # later than one that answered the last).
        direct: dict[str, Direct] = {"one": Direct("direct to one stub", stub_urls[:1]),
                                     "turns": Direct(f"direct to the {len(stub_urls)} stubs in turn", stub_urls)}
        for stream in (False, True):
            targets = list(direct.values()) + [router for router in routers if router.streams or not stream]
            for window in range(settings.windows):
                shift = window % len(targets)
                for target in targets[shift:] + targets[:shift]:
                    result = open_loop(target.urls, stream, settings, seed=100 + window, loadgen=loadgen)
                    (target.ttfb if stream else target.latency).append(result)
                progress(f"open loop {'stream' if stream else 'non-stream'} window {window + 1}/{settings.windows}")
        if args.keep_logs:
            destination = Path(args.keep_logs)
            destination.mkdir(parents=True, exist_ok=True)
            for path in workdir.glob("*.yaml"):
                shutil.copy(path, destination / path.name)
        lines = report(routers, direct, settings, missing)
    print(f"total {time.monotonic() - started:.0f} s")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except StubsDown as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # every `with` has already stopped its process
        print("interrupted: stubs, routers and load generator stopped", file=sys.stderr)
        sys.exit(130)
