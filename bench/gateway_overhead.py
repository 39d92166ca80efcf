"""What the gateway itself costs: added latency, added time to first byte, CPU per request.

One run, one stub backend (`bench/stub_backend.py`, answers at once), one gateway in front of it
with its real JSON request logging on (to a file). The load generator runs in its own process.

1. Added latency at a fixed open-loop rate (non-stream completions): the same Poisson schedule is
   sent straight to the stub and through the gateway in alternating short windows (ABBA order), so
   machine noise lands on both sides; added = gateway percentile - direct percentile.
2. Added time to first byte, the same way, with stream=true.
3. Gateway CPU per request at saturation: closed loop, fixed count, CPU time of the gateway process
   (and any children) from /proc/<pid>/stat divided by the requests served.

    .venv/bin/python -m bench.gateway_overhead [--quick]

Ends with `figure <name>: <value>` lines (this step has no goals yet).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.loadgen import LoadgenProcess, Phase, PhaseResult, percentiles_ms, start_bench
from bench.stub_backend import StubProcess, die_with_parent
from tests.servers import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The quick brown fox jumps over the lazy dog. A gateway routes each request to the replica."
LADDER = (25, 50, 75, 90, 99, 99.9, 100)


@dataclass
class Settings:
    rate_rps: float
    windows: int
    window_s: float
    saturation_requests: int
    concurrency: int
    output_tokens: int
    warmup_requests: int


def settings_from(args) -> Settings:
    if args.quick:
        return Settings(rate_rps=args.rate, windows=4, window_s=1.0, saturation_requests=600,
                        concurrency=args.concurrency, output_tokens=args.output_tokens, warmup_requests=100)
    return Settings(rate_rps=args.rate, windows=args.windows, window_s=args.window_s,
                    saturation_requests=args.saturation_requests, concurrency=args.concurrency,
                    output_tokens=args.output_tokens, warmup_requests=300)


# -- the gateway process -----------------------------------------------------------------------

def write_config(directory: Path, port: int, stub_url: str) -> Path:
    path = directory / "gateway.yaml"
    path.write_text(
        "gateway: {host: 127.0.0.1, port: %d}\n"
        "logging: {level: info, format: json, token_ids: full}\n"
        "routing: {policy: round_robin}\n"
        "replicas:\n"
        "  - name: stub-0\n"
        "    url: %s\n"
        "    model: stub\n" % (port, stub_url), encoding="utf-8")
    return path


class GatewayProcess:
    """`python -m gateway.cli serve --config FILE`, stdout+stderr to a log file, stopped on exit."""

    def __init__(self, config: Path, port: int, log_path: Path, ready_timeout_s: float = 60.0):
        self.argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def pids(self) -> list[int]:
        """The gateway and its descendants, should it run workers."""
        import psutil
        try:
            return [self.pid] + [child.pid for child in psutil.Process(self.pid).children(recursive=True)]
        except psutil.Error:
            return [self.pid]

    def __enter__(self) -> "GatewayProcess":
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.argv, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        # Another process's readiness has no event to await: poll /health, bounded by the deadline.
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited with code {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"gateway not healthy after {self.ready_timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        if getattr(self, "_log", None) is not None:
            self._log.close()


def check_answers(url: str, body: dict) -> None:
    """One request must succeed before anything is timed; otherwise say what came back."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"{url} answered HTTP {err.code}: {err.read()[:500]!r}") from None


# -- measuring ---------------------------------------------------------------------------------

def body(settings: Settings, stream: bool) -> dict:
    b = {"model": "stub", "prompt": PROMPT, "max_tokens": settings.output_tokens, "temperature": 0.0}
    if stream:
        b["stream"] = True
    return b


def interleaved(loadgen: LoadgenProcess, settings: Settings, targets: dict[str, str], stream: bool,
                progress, cpu_pids: list[int]) -> dict[str, list[PhaseResult]]:
    """Alternating windows, same schedule (seed) for both sides of a pair, ABBA order."""
    runs: dict[str, list[PhaseResult]] = {name: [] for name in targets}
    names = list(targets)
    for window in range(settings.windows):
        order = names if window % 2 == 0 else names[::-1]
        for name in order:
            phase = Phase(name=name, url=targets[name] + "/v1/completions", body=body(settings, stream),
                          mode="open", rate_rps=settings.rate_rps, duration_s=settings.window_s,
                          arrivals="poisson", seed=1000 + window, timeout_s=10.0, cpu_pids=cpu_pids)
            runs[name].append(loadgen.run(phase))
            progress(f"{'stream' if stream else 'non-stream'} window {window + 1}/{settings.windows} {name}")
    return runs


def pooled(results: list[PhaseResult], what: str) -> tuple[list[float], int, int]:
    values, sent, errors = [], 0, 0
    for result in results:
        sent += len(result.results)
        ok = result.ok
        errors += len(result.results) - len(ok)
        values += [r.ttfb_s if what == "ttfb" else r.latency_s for r in ok
                   if (r.ttfb_s if what == "ttfb" else r.latency_s) is not None]
    return values, sent, errors


def saturation(loadgen: LoadgenProcess, settings: Settings, url: str, name: str, pids: list[int]) -> PhaseResult:
    phase = Phase(name=name, url=url + "/v1/completions", body=body(settings, stream=False), mode="closed",
                  concurrency=settings.concurrency, count=settings.saturation_requests, timeout_s=10.0,
                  cpu_pids=pids)
    return loadgen.run(phase)


# -- reporting ---------------------------------------------------------------------------------

def fmt(value: float, digits: int = 2) -> str:
    return "nan" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def report(settings: Settings, latency: dict, ttfb: dict, sat_gw: PhaseResult, sat_direct: PhaseResult,
           gateway_pids: list[int], stub_pid: int, client_pid: int, log_bytes: int, logged_requests: int) -> list[str]:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    figures: list[tuple[str, str]] = []

    for title, runs, what, key in (("latency, non-stream", latency, "latency", "added"),
                                   ("time to first byte, stream", ttfb, "ttfb", "added_ttfb")):
        direct, sent_d, err_d = pooled(runs["direct"], what)
        through, sent_g, err_g = pooled(runs["gateway"], what)
        ladder_d, ladder_g = percentiles_ms(direct, LADDER), percentiles_ms(through, LADDER)
        table = Table(title=f"{title} at {settings.rate_rps:g} req/s open loop (Poisson), "
                            f"{settings.windows} x {settings.window_s:g} s windows per side, ms")
        table.add_column("side")
        table.add_column("ok / sent", justify="right")
        for p in LADDER:
            table.add_column("max" if p == 100 else f"p{p:g}", justify="right")
        table.add_row("direct", f"{len(direct)}/{sent_d}", *(fmt(ladder_d[p]) for p in LADDER))
        table.add_row("gateway", f"{len(through)}/{sent_g}", *(fmt(ladder_g[p]) for p in LADDER))
        table.add_row("added", "", *(fmt(ladder_g[p] - ladder_d[p]) for p in LADDER), style="bold")
        console.print(table)
        per_window = Table(title=f"{title}: per window, ms (the windows should agree; a stall shows here)")
        for column in ("window", "direct p50 / p99", "gateway p50 / p99", "added p50", "added p99"):
            per_window.add_column(column, justify="left" if column == "window" else "right")
        added_p99_by_window = []
        for i, (d, g) in enumerate(zip(runs["direct"], runs["gateway"])):
            pd = percentiles_ms(pooled([d], what)[0], (50, 99))
            pg = percentiles_ms(pooled([g], what)[0], (50, 99))
            added_p99_by_window.append(pg[99] - pd[99])
            per_window.add_row(str(i + 1), f"{fmt(pd[50])} / {fmt(pd[99])}", f"{fmt(pg[50])} / {fmt(pg[99])}",
                               fmt(pg[50] - pd[50]), fmt(pg[99] - pd[99]))
        console.print(per_window)
        if err_d or err_g:
            console.print(f"[red]errors: direct {err_d}, gateway {err_g}[/red]")
        cpu_s = sum(sum(r.cpu_s.get(pid, 0.0) for pid in gateway_pids) for r in runs["gateway"])
        wall_s = sum(r.wall_s for r in runs["gateway"])
        cpu_us = cpu_s / len(through) * 1e6 if through else float("nan")
        console.print(f"gateway CPU at {settings.rate_rps:g} req/s: {cpu_us:.0f} us/request, "
                      f"{cpu_s / wall_s if wall_s else float('nan'):.2f} cores busy")
        name = "gateway_added" if what == "latency" else "gateway_added_ttfb"
        figures.append((f"{name}_p50_ms", fmt(ladder_g[50] - ladder_d[50])))
        figures.append((f"{name}_p99_ms", fmt(ladder_g[99] - ladder_d[99])))
        # Robust to one window hit by a stall elsewhere on the machine; the pooled figure is not.
        figures.append((f"{name}_p99_ms_window_median", fmt(statistics.median(added_p99_by_window))))
        figures.append((f"gateway_cpu_us_per_{'request' if what == 'latency' else 'stream'}_at_rate",
                        fmt(cpu_us, 0)))
        if err_g:
            figures.append((f"{name}_errors", str(err_g)))

    gateway_cpu_s = sum(sat_gw.cpu_s.get(pid, 0.0) for pid in gateway_pids)
    served = len(sat_gw.ok)
    cpu_us = gateway_cpu_s / served * 1e6 if served else float("nan")
    table = Table(title=f"saturation: closed loop, {settings.concurrency} in flight, "
                        f"{settings.saturation_requests} non-stream requests")
    for column in ("target", "ok / sent", "req/s", "p50 ms", "p99 ms", "gateway CPU s", "gateway cores busy",
                   "gateway CPU us/req", "stub CPU us/req", "client cores busy"):
        table.add_column(column, justify="left" if column == "target" else "right")
    for label, result in (("direct", sat_direct), ("gateway", sat_gw)):
        lat = percentiles_ms([r.latency_s for r in result.ok], (50, 99))
        ok = len(result.ok)
        gw_s = sum(result.cpu_s.get(pid, 0.0) for pid in gateway_pids)
        stub_us = result.cpu_s.get(stub_pid, 0.0) / ok * 1e6 if ok else float("nan")
        wall = result.wall_s or float("nan")
        table.add_row(label, f"{ok}/{len(result.results)}", f"{result.achieved_rps():.0f}", fmt(lat[50]),
                      fmt(lat[99]), fmt(gw_s, 2), fmt(gw_s / wall), fmt(gw_s / ok * 1e6, 0) if ok else "nan",
                      fmt(stub_us, 0), fmt(result.cpu_s.get(client_pid, 0.0) / wall))
    console.print(table)
    console.print("Cores busy near 1.0 for the gateway means it is the bottleneck; the machine has "
                  f"{os.cpu_count()} cores shared by the client, stub, gateway and anything else running.")
    if logged_requests:
        console.print(f"gateway log: {log_bytes} bytes for {logged_requests} requests "
                      f"({log_bytes / logged_requests:.0f} bytes/request, JSON, token_ids: full)")
    figures.append(("gateway_cpu_us_per_request", fmt(cpu_us, 0)))
    figures.append(("gateway_saturation_rps", f"{sat_gw.achieved_rps():.0f}"))
    figures.append(("direct_saturation_rps", f"{sat_direct.achieved_rps():.0f}"))
    return [f"figure {name}: {value}" for name, value in figures]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Gateway-added latency, TTFB and CPU per request, against a stub.")
    parser.add_argument("--quick", action="store_true", help="short run (4 x 1 s windows, 600 saturation requests)")
    parser.add_argument("--rate", type=float, default=200.0, help="open-loop requests per second")
    parser.add_argument("--windows", type=int, default=6, help="windows per side per measurement")
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument("--saturation-requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64, help="closed-loop requests in flight")
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--keep-logs", metavar="DIR", help="copy the gateway and stub logs here")
    args = parser.parse_args(argv)
    settings = settings_from(args)

    started, progress = start_bench()

    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-bench-")))
        stub_log = stack.enter_context(open(workdir / "stub.log", "wb"))
        if args.keep_logs:
            stack.callback(_copy_logs, workdir, Path(args.keep_logs))
        stub = stack.enter_context(StubProcess(output_tokens=settings.output_tokens, stderr=stub_log))
        progress(f"stub up at {stub.url} (pid {stub.pid})")
        port = free_port()
        gateway = stack.enter_context(GatewayProcess(write_config(workdir, port, stub.url), port,
                                                     workdir / "gateway.log"))
        progress(f"gateway up at {gateway.url} (pid {gateway.pid})")
        check_answers(gateway.url + "/v1/completions", body(settings, stream=False))
        loadgen = stack.enter_context(LoadgenProcess())
        targets = {"direct": stub.url, "gateway": gateway.url}

        for stream in (False, True):  # warm both paths: connection pools, caches, code paths
            for url in targets.values():
                loadgen.run(Phase(name="warmup", url=url + "/v1/completions", body=body(settings, stream),
                                  mode="closed", concurrency=8, count=settings.warmup_requests, timeout_s=10.0))
        progress("warmed up")
        log_bytes_before = gateway.log_path.stat().st_size

        gateway_pids = gateway.pids()
        latency = interleaved(loadgen, settings, targets, stream=False, progress=progress, cpu_pids=gateway_pids)
        ttfb = interleaved(loadgen, settings, targets, stream=True, progress=progress, cpu_pids=gateway_pids)
        logged = sum(len(r.results) for r in latency["gateway"] + ttfb["gateway"])
        log_bytes = gateway.log_path.stat().st_size - log_bytes_before

        cpu_pids = gateway_pids + [stub.pid, loadgen.pid]
        sat_direct = saturation(loadgen, settings, stub.url, "direct", cpu_pids)
        progress(f"saturation direct: {sat_direct.achieved_rps():.0f} req/s")
        sat_gw = saturation(loadgen, settings, gateway.url, "gateway", cpu_pids)
        progress(f"saturation through gateway: {sat_gw.achieved_rps():.0f} req/s")
        lines = report(settings, latency, ttfb, sat_gw, sat_direct, gateway_pids, stub.pid, loadgen.pid,
                       log_bytes, logged)
    print(f"total {time.monotonic() - started:.0f} s")
    for line in lines:
        print(line)
    return 0


def _copy_logs(workdir: Path, destination: Path) -> None:
    import shutil
    destination.mkdir(parents=True, exist_ok=True)
    for name in ("gateway.log", "stub.log", "gateway.yaml"):
        if (workdir / name).exists():
            shutil.copy(workdir / name, destination / name)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # every `with` has already stopped its process
        print("interrupted: stub, gateway and load generator stopped", file=sys.stderr)
        sys.exit(130)
