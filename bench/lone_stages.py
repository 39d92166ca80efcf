"""Where a lone request's time goes: stage stamps inside the gateway, lined up with the client's.

One client sends `--requests` requests one at a time on a keep-alive connection, `--gap-ms` apart
(at 200 req/s most requests are alone in flight; this is that case, without the queueing), first
straight to a stub, then through a kvgate gateway over `--stubs` stubs (vs_routers' instant ones,
16 tokens). The gateway runs with stamps wrapped around its hot path (perf_counter_ns, which is
CLOCK_MONOTONIC in every process, so the client's and the gateway's stamps share one clock):

    read        the client's request bytes reach the gateway (HotProtocol.data_received)
    serve       the request parsed, the front door's steps begin (HotPath.start)
    up_write    the request to the replica is written (the write() call starts)
    up_written  ... and returns: a replica on the same core that preempts the gateway mid-write
                holds this for its whole turn
    up_read     the replica's first bytes reach the gateway (nN: that read held N events)
    out         the client's first body bytes are written (HotExchange._first_out)

and prints, per pair of consecutive stages, the median over the requests, then how many events
the replica's first read held. The first byte the client counts is the first body byte.

    .venv/bin/python -m bench.lone_stages                      # ~20 s
    .venv/bin/python -m bench.lone_stages --pin                # gateway and client on CPU 0, stubs on CPU 1
    .venv/bin/python -m bench.lone_stages --no-stream --gap-ms 0.2
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from bench.request_cost import REPO_ROOT, gateway_argv
from bench.stub_backend import StubProcess
from bench.vs_routers import OUTPUT_TOKENS, POLICIES, body, gateway_config
from tests.servers import free_port, run_gateway

# Run in the gateway's process before it serves: wraps the hot path's steps with stamps, dumps
# them as JSON to the file STAGES_OUT names on SIGUSR1, and exits.
_STAMPS = r'''
import json, os, signal, time
import gateway.hot_path as hot, gateway.http_client as client
stamp, stamps = time.perf_counter_ns, []
def _wrap(cls, name, before, after=None):
    inner = getattr(cls, name)
    def wrapped(self, *args):
        stamps.append((before, stamp()))
        result = inner(self, *args)
        if after:
            stamps.append((after, stamp()))
        return result
    setattr(cls, name, wrapped)
_wrap(hot.HotProtocol, "data_received", "read")
_wrap(client._Connection, "send", "up_write", "up_written")
_wrap(hot.HotExchange, "_first_out", "out")
_received = client._Connection.data_received
def _upstream_read(self, data):
    now = stamp()
    stamps.append(("up_read", now))
    stamps.append(("n%d" % data.count(b"data:"), now))
    return _received(self, data)
client._Connection.data_received = _upstream_read
_wrap(hot.HotPath, "start", "serve")
def _dump(*_):
    with open(STAGES_OUT, "w") as out:
        json.dump(stamps, out)
    os._exit(0)
signal.signal(signal.SIGUSR1, _dump)
'''


def send_one_at_a_time(port: int, requests: int, gap_s: float, stream: bool) -> list[tuple[int, int]]:
    """(sent, first body byte) in perf_counter_ns for each request (non-streamed: the last byte)."""
    payload = msgspec.json.encode(body(stream))
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    times = []
    with socket.create_connection(("127.0.0.1", port), timeout=10.0) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(requests):
            sent = time.perf_counter_ns()
            sock.sendall(request)
            data = sock.recv(65536)
            while b"\r\n\r\n" not in data:
                data += _recv(sock)
            head, _, rest = data.partition(b"\r\n\r\n")
            if stream:
                while not rest:
                    rest += _recv(sock)
                first = time.perf_counter_ns()
                while not rest.endswith(b"0\r\n\r\n"):
                    rest += _recv(sock)
            else:
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                while len(rest) < length:
                    rest += _recv(sock)
                first = time.perf_counter_ns()
            times.append((sent, first))
            time.sleep(gap_s)
    return times


def _recv(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    if not data:
        raise ConnectionError("the server closed the connection mid-answer")
    return data


def pin(pid: int, cpu: int) -> None:
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), {cpu})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stage stamps of lone requests through the gateway.")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=5.0, help="pause between requests")
    parser.add_argument("--policy", choices=POLICIES, default="round_robin")
    parser.add_argument("--stubs", type=int, default=4, help="stubs behind the gateway (1-4)")
    parser.add_argument("--no-stream", action="store_true", help="non-streamed requests (the client counts the last byte)")
    parser.add_argument("--pin", action="store_true",
                        help="the gateway and the client on CPU 0, the stubs on CPU 1 (needs 2 CPUs)")
    args = parser.parse_args(argv)
    if not 1 <= args.stubs <= 4 or args.requests < 1 or args.gap_ms < 0:
        parser.error("--stubs 1-4, --requests at least 1, --gap-ms not negative")
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        parser.error("--pin needs 2 CPUs")
    stream = not args.no_stream
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-lone-stages-")))
        stubs = [stack.enter_context(StubProcess(output_tokens=OUTPUT_TOKENS, stderr=subprocess.DEVNULL))
                 for _ in range(4)]
        port = free_port()
        config = gateway_config(workdir, args.policy, [stub.url for stub in stubs[:args.stubs]], port)
        dump = workdir / "stages.json"
        argv = gateway_argv(REPO_ROOT, config, f"STAGES_OUT = {str(dump)!r}\n" + _STAMPS)
        gateway = stack.enter_context(run_gateway(config, port, argv=argv))
        if args.pin:
            for stub in stubs:
                pin(stub.process.pid, 1)
            pin(gateway.proc.pid, 0)
            os.sched_setaffinity(0, {0})
        stub_port = int(stubs[0].url.rsplit(":", 1)[1])
        for target in (port, stub_port):  # warm both paths
            send_one_at_a_time(target, 200, 0.001, stream)
        direct = send_one_at_a_time(stub_port, args.requests, args.gap_ms / 1000, stream)
        through = send_one_at_a_time(port, args.requests, args.gap_ms / 1000, stream)
        os.kill(gateway.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10.0
        while gateway.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        stamps = json.loads(dump.read_text())
    what = "TTFB" if stream else "latency"
    direct_us = statistics.median((first - sent) / 1e3 for sent, first in direct)
    through_us = statistics.median((first - sent) / 1e3 for sent, first in through)
    print(f"{args.requests} lone {'streamed' if stream else 'non-streamed'} requests, {args.gap_ms:g} ms apart, "
          f"{args.policy} over {args.stubs} stub(s){', pinned' if args.pin else ''}")
    print(f"{what} p50: direct {direct_us:.0f} us, through kvgate {through_us:.0f} us, added {through_us - direct_us:.0f} us")
    segments: dict[str, list[float]] = collections.defaultdict(list)
    first_reads: collections.Counter = collections.Counter()
    index = 0
    for sent, first in through:  # the stamps between this request's send and its first byte
        while index < len(stamps) and stamps[index][1] < sent:
            index += 1
        seen: dict[str, int] = {}
        for stage, at in stamps[index:]:
            if at > first:
                break
            seen.setdefault(stage, at)
        reads = [stage for stage in seen if re.fullmatch(r"n\d+", stage)]
        if reads:
            first_reads[reads[0]] += 1
        chain = [("client sends", sent)] + sorted(((s, t) for s, t in seen.items() if s not in reads),
                                                  key=lambda item: item[1]) + [("client's first byte", first)]
        for (a, at_a), (b, at_b) in zip(chain, chain[1:]):
            segments[f"{a} -> {b}"].append((at_b - at_a) / 1e3)
    print(f"{'stage':40s} {'requests':>8s} {'p50 us':>8s}")
    for name, values in sorted(segments.items(), key=lambda item: -len(item[1])):
        if len(values) >= len(through) // 10:
            print(f"{name:40s} {len(values):8d} {statistics.median(values):8.1f}")
    print("events in the replica's first read: " + ", ".join(
        f"{stage[1:]}: {count}" for stage, count in sorted(first_reads.items(), key=lambda item: -item[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
