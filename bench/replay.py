"""Replay a workload's requests at their arrival times, each with its own body, from a child process.

bench.loadgen sends one body at a schedule it draws itself; a workload (bench.workloads) fixes
every request's body and arrival in advance, so that each router gets the very same traffic. The
sending itself is loadgen's (`_send`: latency, time to first body byte, status, error), and, as
with `LoadgenProcess`, the client runs in its own process so it never shares an event loop or a
GIL with what it measures. Open loop: a slow router cannot slow the arrivals down. Bounded: every
request has a timeout and the replay a deadline past the last arrival.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import time

import aiohttp

from bench.loadgen import MAX_REQUESTS_PER_PHASE, RequestResult, _send, _session
from bench.workloads import Request

EXTRA_DEADLINE_S = 120.0  # after the last arrival


def replay(base_url: str, requests: list[Request], *, model: str, stream: bool = True,
           timeout_s: float = 60.0) -> tuple[list[RequestResult], float]:
    """Send `requests` (open loop, at their arrival_s) to base_url from a child process; returns
    one result per request, in the requests' order, and the wall seconds of the replay."""
    items = [(r.arrival_s, base_url.rstrip("/") + r.path, json.dumps(r.body(model, stream)).encode())
             for r in requests[:MAX_REQUESTS_PER_PHASE]]
    deadline_s = (items[-1][0] if items else 0.0) + timeout_s + EXTRA_DEADLINE_S
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # terminated on exit, whatever happens
        pending = pool.apply_async(_replay_in_child, (items, stream, timeout_s, deadline_s))
        return pending.get(timeout=deadline_s + 30)


def _replay_in_child(items, stream: bool, timeout_s: float, deadline_s: float):
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(_replay(items, stream, timeout_s, deadline_s))


async def _replay(items, stream: bool, timeout_s: float, deadline_s: float):
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with _session() as session:
        start = time.perf_counter()
        tasks = []
        for offset, url, payload in items:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(_send(session, url, payload, stream, timeout, offset, start)))
        remaining = max(0.1, start + deadline_s - time.perf_counter())
        done, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        wall_s = time.perf_counter() - start
    results = [t.result() if t in done else
               RequestResult(scheduled_s=offset, lateness_s=0.0, latency_s=deadline_s, ttfb_s=None, status=0,
                             error="replay deadline") for t, (offset, _u, _p) in zip(tasks, items)]
    return results, wall_s
