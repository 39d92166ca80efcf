"""Open-loop and closed-loop HTTP load generator for OpenAI-shaped servers.

Open loop: arrivals follow a schedule fixed in advance (Poisson or evenly spaced), so a slow
server cannot slow the offered load down. Closed loop: N workers each send the next request as
soon as the previous one finished, for a fixed count (saturation, throughput, CPU per request).

Every request records its latency, time to first body byte (streams), status and error. A
benchmark runs the generator in its own process (`LoadgenProcess`) so the client's CPU never
shares an event loop, or a GIL, with the server it measures.

    .venv/bin/python -m bench.loadgen --url http://127.0.0.1:8000 --rate 200 --duration-s 10 [--stream]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp

# Hard bounds so a misconfigured phase can never run away.
MAX_REQUESTS_PER_PHASE = 200_000
MAX_PHASE_S = 600.0


@dataclass
class Phase:
    """One measured run: where to send, what to send, and how requests arrive."""
    name: str
    url: str                       # full URL, e.g. http://127.0.0.1:8000/v1/completions
    body: dict                     # JSON body sent with every request (or, with `bodies`, the first)
    mode: str = "open"             # "open" (scheduled arrivals) | "closed" (fixed concurrency)
    rate_rps: float = 100.0        # open loop: mean arrival rate
    duration_s: float = 5.0        # open loop: schedule length
    arrivals: str = "poisson"      # open loop: "poisson" | "fixed"
    seed: int = 0                  # open loop: same seed, same schedule
    concurrency: int = 32          # closed loop: workers
    count: int = 1000              # closed loop: total requests
    timeout_s: float = 30.0        # per request
    cpu_pids: list[int] = field(default_factory=list)  # processes whose CPU time to sample around the phase
    bodies: list[dict] = field(default_factory=list)   # if set: request i sends bodies[i % len(bodies)]
    urls: list[str] = field(default_factory=list)      # if set: request i goes to urls[i % len(urls)]
                                                       # (a client spreading its own requests over backends)


@dataclass
class RequestResult:
    scheduled_s: float             # intended send time, from phase start
    lateness_s: float              # how late the client actually sent it (client-side lag)
    latency_s: float               # send -> last byte
    ttfb_s: float | None           # send -> first body byte (streams only)
    status: int                    # HTTP status, 0 when no response arrived
    error: str | None = None


@dataclass
class PhaseResult:
    name: str
    results: list[RequestResult]
    wall_s: float
    cpu_s: dict[int, float]        # pid -> CPU seconds (user + system) spent during the phase

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.status == 200 and r.error is None]

    def achieved_rps(self) -> float:
        return len(self.ok) / self.wall_s if self.wall_s > 0 else 0.0


# -- schedules -------------------------------------------------------------------------------

def arrival_offsets_s(rate_rps: float, duration_s: float, arrivals: str = "poisson", seed: int = 0) -> list[float]:
    """Send times from phase start. Poisson: exponential gaps; fixed: evenly spaced."""
    if rate_rps <= 0 or duration_s <= 0:
        return []
    rng = random.Random(seed)
    offsets: list[float] = []
    t = 0.0
    while len(offsets) < MAX_REQUESTS_PER_PHASE:
        t += rng.expovariate(rate_rps) if arrivals == "poisson" else 1.0 / rate_rps
        if t >= duration_s:
            break
        offsets.append(t)
    return offsets


# -- CPU accounting --------------------------------------------------------------------------

def process_tree(pid: int) -> list[int]:
    """`pid` and the processes it started, recursively (a gateway's workers); [pid] once it is gone."""
    import psutil
    try:
        return [pid] + [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return [pid]


def process_cpu_s(pid: int) -> float:
    """utime + stime of one process (all its threads) from /proc/<pid>/stat, in seconds; 0.0 if gone."""
    return sum(process_cpu_split_s(pid))


def process_cpu_split_s(pid: int) -> tuple[float, float]:
    """(utime, stime) of one process (all its threads) from /proc/<pid>/stat, in seconds; zeros if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return 0.0, 0.0
    # The command name may contain spaces; fields after the closing paren are fixed.
    fields = raw[raw.rindex(b")") + 2:].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


# -- one request -----------------------------------------------------------------------------

async def _send(session: aiohttp.ClientSession, url: str, payload: bytes, stream: bool,
                timeout: aiohttp.ClientTimeout, scheduled_s: float, phase_start: float) -> RequestResult:
    sent = time.perf_counter()
    ttfb = None
    status = 0
    error = None
    try:
        async with session.post(url, data=payload, timeout=timeout,
                                headers={"Content-Type": "application/json"}) as resp:
            status = resp.status
            if stream:
                # First body byte, not headers: a gateway may send headers before it has any token.
                done_seen, tail = False, b""
                async for chunk in resp.content.iter_any():
                    if ttfb is None:
                        ttfb = time.perf_counter() - sent
                    window = tail + chunk  # a marker split across two reads is still found
                    if b'data: {"error"' in window:  # a 200 whose answer failed in-band
                        error = "in-band error event"
                    done_seen = done_seen or b"data: [DONE]" in window
                    tail = window[-16:]
                if status == 200 and not done_seen and error is None:
                    error = "stream ended without [DONE]"
            else:
                await resp.read()
            if status != 200:
                error = f"HTTP {status}"
    except Exception as exc:  # recorded, never raised: one failure must not stop a phase
        error = f"{type(exc).__name__}: {exc}"[:200]
    done = time.perf_counter()
    return RequestResult(scheduled_s=scheduled_s, lateness_s=max(0.0, sent - phase_start - scheduled_s),
                         latency_s=done - sent, ttfb_s=ttfb, status=status, error=error)


def _session() -> aiohttp.ClientSession:
    # Unlimited pool: an open loop must never queue behind the client's own connection cap.
    connector = aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=True)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False)


async def run_phase(phase: Phase) -> PhaseResult:
    payload = [json.dumps(body).encode() for body in (phase.bodies or [phase.body])]
    stream = bool((phase.bodies or [phase.body])[0].get("stream"))
    timeout = aiohttp.ClientTimeout(total=phase.timeout_s)
    phase_deadline_s = min(MAX_PHASE_S, phase.duration_s + phase.timeout_s + 5.0) if phase.mode == "open" \
        else MAX_PHASE_S
    cpu_before = {pid: process_cpu_s(pid) for pid in phase.cpu_pids}
    async with _session() as session:
        start = time.perf_counter()
        if phase.mode == "open":
            results = await _open_loop(session, phase, payload, stream, timeout, start, phase_deadline_s)
        elif phase.mode == "closed":
            results = await _closed_loop(session, phase, payload, stream, timeout, start, phase_deadline_s)
        else:
            raise ValueError(f"unknown phase mode {phase.mode!r}")
        wall = time.perf_counter() - start
    cpu = {pid: process_cpu_s(pid) - before for pid, before in cpu_before.items()}
    return PhaseResult(name=phase.name, results=results, wall_s=wall, cpu_s=cpu)


async def _open_loop(session, phase: Phase, payloads: list[bytes], stream: bool, timeout, start: float,
                     deadline_s: float) -> list[RequestResult]:
    tasks = []
    urls = phase.urls or [phase.url]
    for index, offset in enumerate(arrival_offsets_s(phase.rate_rps, phase.duration_s, phase.arrivals, phase.seed)):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(_send(session, urls[index % len(urls)], payloads[index % len(payloads)],
                                                 stream, timeout, offset, start)))
    remaining = max(0.1, start + deadline_s - time.perf_counter())
    done, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    return [t.result() for t in tasks if t in done]


async def _closed_loop(session, phase: Phase, payloads: list[bytes], stream: bool, timeout, start: float,
                       deadline_s: float) -> list[RequestResult]:
    count = min(phase.count, MAX_REQUESTS_PER_PHASE)
    results: list[RequestResult] = []
    next_index = 0

    urls = phase.urls or [phase.url]

    async def worker():
        nonlocal next_index
        while next_index < count and time.perf_counter() - start < deadline_s:
            payload, url = payloads[next_index % len(payloads)], urls[next_index % len(urls)]
            next_index += 1
            results.append(await _send(session, url, payload, stream, timeout, time.perf_counter() - start, start))

    workers = [asyncio.ensure_future(worker()) for _ in range(max(1, phase.concurrency))]
    try:
        await asyncio.wait_for(asyncio.gather(*workers), timeout=deadline_s)
    except asyncio.TimeoutError:
        pass
    return results


# -- running in its own process --------------------------------------------------------------

def _worker_main(conn) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    loop = asyncio.new_event_loop()
    try:
        while True:
            message = conn.recv()
            if message is None:
                return
            phase = Phase(**message)
            result = loop.run_until_complete(run_phase(phase))
            conn.send(asdict(result))
    except (EOFError, KeyboardInterrupt):
        return
    finally:
        loop.close()


class LoadgenProcess:
    """The generator in a child process: `run(phase)` blocks until the phase is done."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_worker_main, args=(child_conn,), daemon=True,
                                        name="kvgate-loadgen")

    def __enter__(self) -> "LoadgenProcess":
        self._process.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def run(self, phase: Phase) -> PhaseResult:
        self._conn.send(asdict(phase))
        limit_s = min(MAX_PHASE_S, (phase.duration_s if phase.mode == "open" else MAX_PHASE_S)
                      + phase.timeout_s + 30.0)
        if not self._conn.poll(limit_s):
            raise TimeoutError(f"load generator did not finish phase {phase.name!r} in {limit_s:.0f} s")
        try:
            raw = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(timeout=5)
            raise RuntimeError(f"load generator process died (exit code {self._process.exitcode})") from None
        results = [RequestResult(**r) for r in raw.pop("results")]
        raw["cpu_s"] = {int(k): v for k, v in raw["cpu_s"].items()}
        return PhaseResult(results=results, **raw)

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=5)


# -- summaries -------------------------------------------------------------------------------

def start_bench():
    """A bench's start: SIGTERM unwinds like Ctrl-C (through every `with`, which stops every
    process it started); returns (start time, progress), progress printing a line to stderr with
    the seconds elapsed."""
    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:5.1f} s] {message}", file=sys.stderr, flush=True)

    return started, progress


def percentiles_ms(values_s: list[float], points=(50, 90, 99)) -> dict[int, float]:
    import numpy as np
    if not values_s:
        return {p: float("nan") for p in points}
    array = np.asarray(values_s) * 1000.0
    return {p: float(np.percentile(array, p)) for p in points}


def summary(result: PhaseResult) -> dict:
    ok = result.ok
    ttfbs = [r.ttfb_s for r in ok if r.ttfb_s is not None]
    return {
        "phase": result.name,
        "sent": len(result.results),
        "ok": len(ok),
        "errors": len(result.results) - len(ok),
        "achieved_rps": round(result.achieved_rps(), 1),
        "latency_ms": percentiles_ms([r.latency_s for r in ok]),
        "ttfb_ms": percentiles_ms(ttfbs) if ttfbs else None,
        "lateness_p99_ms": percentiles_ms([r.lateness_s for r in result.results], (99,))[99],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default="stub")
    parser.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--mode", choices=("open", "closed"), default="open")
    parser.add_argument("--rate", type=float, default=100.0, help="open loop: requests per second")
    parser.add_argument("--duration-s", type=float, default=5.0, help="open loop: schedule length")
    parser.add_argument("--arrivals", choices=("poisson", "fixed"), default="poisson")
    parser.add_argument("--concurrency", type=int, default=32, help="closed loop: workers")
    parser.add_argument("--count", type=int, default=1000, help="closed loop: requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write one JSON line per request here")
    args = parser.parse_args(argv)

    body: dict = {"model": args.model, "max_tokens": args.max_tokens}
    if args.endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        body["prompt"] = args.prompt
    if args.stream:
        body["stream"] = True
    phase = Phase(name=f"{args.mode}:{args.endpoint}", url=args.url.rstrip("/") + args.endpoint, body=body,
                  mode=args.mode, rate_rps=args.rate, duration_s=args.duration_s, arrivals=args.arrivals,
                  seed=args.seed, concurrency=args.concurrency, count=args.count)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(run_phase(phase))
    print(json.dumps(summary(result), indent=2))
    if args.out:
        with open(args.out, "w") as f:
            for r in result.results:
                f.write(json.dumps(asdict(r)) + "\n")


if __name__ == "__main__":
    main()
