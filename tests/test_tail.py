"""`kvgate tail` and the JSON log file: a real gateway writes its request records to `logging.file`,
and `kvgate tail` (a subprocess, as a user runs it) shows them, filters them, follows the file
across truncation and rotation, reads stdin, and sums them up correctly."""
from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from observability.logs import LogFile
from observability.tail import (LineCounts, Record, RecordFilter, StatusFilter, WindowStats, clock,
                                format_record, parse_record, percentile)
from tests.servers import REPO_ROOT, free_port, run_gateway, run_replica
from tests.test_gateway import http

WAIT_S = 15.0  # another process writes or reads: every wait on it is bounded by this


def kvgate_tail(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", "tail", *args], cwd=REPO_ROOT, input=stdin,
                          capture_output=True, timeout=60)


def shown_ids(stdout: bytes) -> list[str]:
    """Request ids of the lines `--wide` printed, in order."""
    return re.findall(r" id=(\S+)\]$", stdout.decode(), flags=re.MULTILINE)


def file_records(path: Path) -> list[dict]:
    lines = path.read_bytes().splitlines()
    return [item for item in map(json.loads, lines) if item.get("event") == "request"]


# ---- a log recorded from a real gateway --------------------------------------------------------

@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Two tiny replicas behind `kvgate serve` with `logging.file` set; five answered requests
    (one streamed), a 404 for an unknown model and a 400 for a broken body. The servers stop
    before the tests run: what stays is the log file, and the gateway's stdout for comparison."""
    directory = tmp_path_factory.mktemp("tail")
    log_path = directory / "requests.jsonl"
    with contextlib.ExitStack() as stack:
        replicas = [stack.enter_context(run_replica("tiny")) for _ in range(2)]
        port = free_port()
        config = directory / "gateway.yaml"
        config.write_text(
            f"gateway: {{host: 127.0.0.1, port: {port}}}\n"
            f"logging: {{format: json, token_ids: full, file: '{log_path}', file_max_mb: 50, file_keep: 2}}\n"
            "routing: {policy: round_robin}\nreplicas:\n"
            + "".join(f"  - {{name: r{i}, url: '{r.url}', model: tiny}}\n" for i, r in enumerate(replicas)))
        gateway = stack.enter_context(run_gateway(config, port))
        ids = {kind: f"tail-{kind}-{uuid.uuid4().hex[:8]}" for kind in
               ("a", "b", "c", "d", "stream", "not_found", "bad_body")}
        for kind in ("a", "b", "c", "d"):
            status, _, answer = http("POST", gateway.url + "/v1/completions",
                                     {"model": "tiny", "prompt": f"request {kind} " * 20, "max_tokens": 4,
                                      "ignore_eos": True}, {"x-request-id": ids[kind]})
            assert status == 200, answer
        status, _, _ = http("POST", gateway.url + "/v1/chat/completions",
                            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                             "stream": True, "ignore_eos": True}, {"x-request-id": ids["stream"]})
        assert status == 200
        assert http("POST", gateway.url + "/v1/completions", {"model": "gpt-9", "prompt": "x"},
                    {"x-request-id": ids["not_found"]})[0] == 404
        assert http("POST", gateway.url + "/v1/completions", b'{"model": "tiny", "prompt": ',
                    {"x-request-id": ids["bad_body"]})[0] == 400
        deadline = time.monotonic() + WAIT_S
        while len(file_records(log_path)) < len(ids):  # the gateway writes after the response: poll, bounded
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        stdout = gateway.logs()
    records = {record["request_id"]: record for record in file_records(log_path)}
    yield {"path": log_path, "ids": ids, "records": records, "stdout": stdout}


def test_serve_writes_every_log_event_as_json_to_the_file_and_the_terminal(recorded):
    lines = [json.loads(line) for line in recorded["path"].read_bytes().splitlines()]  # every line JSON
    assert {"gateway_listening", "gateway_ready", "request"} <= {line["event"] for line in lines}
    records = recorded["records"]
    assert sorted(records) == sorted(recorded["ids"].values())  # one record per request, no more
    answered = records[recorded["ids"]["a"]]
    assert answered["status"] == 200 and answered["completion_tokens"] == 4 and len(answered["prompt_token_ids"]) > 20
    assert records[recorded["ids"]["not_found"]]["status"] == 404
    on_terminal = [json.loads(line) for line in recorded["stdout"].splitlines()
                   if line.startswith("{") and '"event":"request"' in line]
    assert {record["request_id"]: record for record in on_terminal} == records


def test_tail_shows_one_line_per_request_and_a_final_summary(recorded):
    result = kvgate_tail(str(recorded["path"]), "--no-follow", "--wide")
    assert result.returncode == 0 and result.stderr == b""
    ids, records = recorded["ids"], recorded["records"]
    assert sorted(shown_ids(result.stdout)) == sorted(ids.values())
    lines = result.stdout.decode().splitlines()
    for line in lines[:-1]:
        record = records[shown_ids(line.encode())[0]]
        assert f"  {record['replica'] or '-'}" in line and f"  {record['status']}  " in line
        assert re.search(rf"in +{record['prompt_tokens'] or '-'} cached +", line)
        if record["status"] == 200:
            assert record["routing"]["reason"] in line
            assert f"out {record['completion_tokens']:>4}" in line and "error" not in line
        else:
            assert f"error: {record['error']}" in line
    summary = lines[-1]
    assert summary.startswith("-- total") and "7 requests" in summary and "2 failed" in summary
    for replica in ("r0", "r1"):
        served = sum(record["replica"] == replica for record in records.values())
        assert served >= 2 and f"{replica}: {served} req" in summary
    assert "skipped " in summary and "other event" in summary  # gateway_listening, gateway_ready, ...


@pytest.mark.parametrize("args,keep", [
    (["--replica", "r0"], lambda r: r["replica"] == "r0"),
    (["--replica", "r0,r1"], lambda r: r["replica"] is not None),
    (["--status", "4xx"], lambda r: 400 <= r["status"] < 500),
    (["--status", "404"], lambda r: r["status"] == 404),
    (["--status", "!200"], lambda r: r["status"] != 200),
    (["--status", "errors"], lambda r: r["status"] >= 400),
    (["--status", "ok", "--replica", "r1"], lambda r: r["status"] == 200 and r["replica"] == "r1"),
    (["--model", "gpt-9"], lambda r: r["model"] == "gpt-9"),
    (["--slow-ms", "0"], lambda r: True),
    (["--slow-ms", "1e9"], lambda r: False),
])
def test_tail_filters(recorded, args, keep):
    result = kvgate_tail(str(recorded["path"]), "--no-follow", "--wide", *args)
    assert result.returncode == 0, result.stderr
    expected = [rid for rid, record in recorded["records"].items() if keep(record)]
    assert sorted(shown_ids(result.stdout)) == sorted(expected)


def test_tail_slow_ms_is_end_to_end_latency(recorded):
    latencies = sorted(record["e2e_ms"] for record in recorded["records"].values())
    threshold = latencies[len(latencies) // 2]
    result = kvgate_tail(str(recorded["path"]), "--no-follow", "--wide", "--slow-ms", str(threshold))
    assert sorted(shown_ids(result.stdout)) == sorted(
        rid for rid, record in recorded["records"].items() if record["e2e_ms"] >= threshold)


def test_tail_reads_stdin_to_its_end(recorded):
    raw = recorded["path"].read_bytes()
    result = kvgate_tail("-", "--wide", "--status", "errors", stdin=b"console noise\n" + raw)
    assert result.returncode == 0, result.stderr
    assert sorted(shown_ids(result.stdout)) == sorted([recorded["ids"]["not_found"], recorded["ids"]["bad_body"]])
    assert "1 non-JSON line" in result.stdout.decode().splitlines()[-1]


def test_bad_status_term_is_refused_with_the_syntax():
    result = kvgate_tail("x.jsonl", "--status", "4x")
    assert result.returncode == 2 and b"bad status term '4x'" in result.stderr


def test_missing_file_without_follow_is_an_error(tmp_path):
    result = kvgate_tail(str(tmp_path / "nope.jsonl"), "--no-follow")
    assert result.returncode == 2 and b"no such file" in result.stderr


# ---- crafted logs ------------------------------------------------------------------------------

def request_line(request_id: str, replica: str | None = "r0", status: int = 200, prompt: int | None = 100,
                 cached: int | None = 50, ttft_ms: float | None = 10.0, e2e_ms: float = 100.0,
                 timestamp: str = "2025-03-04T05:06:07.891234Z", error: str | None = None) -> bytes:
    record = {"event": "request", "level": "info", "timestamp": timestamp, "request_id": request_id,
              "model": "m", "replica": replica, "endpoint": "/v1/completions", "stream": False, "status": status,
              "prompt_tokens": prompt, "completion_tokens": 8, "cached_tokens": cached, "ttft_ms": ttft_ms,
              "e2e_ms": e2e_ms, "finish_reason": "length",
              "routing": {"policy": "cache_aware", "reason": "longest prefix (3 blocks) at lowest cost"}
              if replica else None, "prompt_token_ids": list(range(prompt or 0)), "output_token_ids": [1] * 8}
    if error is not None:
        record["error"] = error
    return json.dumps(record).encode()


def crafted_records() -> list[bytes]:
    """r0: TTFT 10..100 ms (10 requests), 400 of 1000 prompt tokens cached; r1: one request, no
    cached-token report; one 503 before routing. Timestamps span 2 s."""
    lines = [request_line(f"a{i}", "r0", ttft_ms=10.0 * (i + 1), prompt=100, cached=40,
                          timestamp=f"2025-03-04T05:06:0{i // 5}.{i % 5}00000Z") for i in range(10)]
    lines.append(request_line("b0", "r1", cached=None, ttft_ms=5.0, timestamp="2025-03-04T05:06:01.500000Z"))
    lines.append(request_line("c0", None, status=503, prompt=None, cached=None, ttft_ms=None, e2e_ms=2.0,
                              timestamp="2025-03-04T05:06:02.000000Z", error="No replica serving `m` is ready."))
    return lines


def test_window_stats_add_up_a_small_log():
    stats = WindowStats()
    for line in crafted_records():
        stats.add(parse_record(line))
    assert (stats.requests, stats.failed, stats.cached_tokens, stats.prompt_tokens) == (12, 1, 400, 1000)
    assert stats.log_span_s() == 2.0
    assert percentile(stats.replicas["r0"].ttft_ms, 50) == 50.0 and percentile(stats.replicas["r0"].ttft_ms, 99) == 100.0
    assert stats.summary("total", 2.0) == (
        "-- total: 12 requests, 6.00/s, 1 failed, hit rate 40.0% (400/1000 prompt tokens cached)"
        " | r0: 10 req, hit 40.0%, TTFT p50 50.0 ms p99 100.0 ms | r1: 1 req, hit -, TTFT p50 5.0 ms p99 5.0 ms")


def test_percentile_is_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.0 and percentile([4.0, 1.0, 3.0, 2.0], 75) == 3.0
    assert percentile(list(map(float, range(1, 201))), 99) == 198.0


def test_final_summary_line_of_the_cli(tmp_path):
    log = tmp_path / "crafted.jsonl"
    log.write_bytes(b"\n".join([b'{"event": "gateway_ready", "level": "info"}', *crafted_records(), b""]))
    result = kvgate_tail(str(log), "--no-follow")
    lines = result.stdout.decode().splitlines()
    assert len(lines) == 13 and lines[-1] == (
        "-- total over 2.0 s of log: 12 requests, 6.00/s, 1 failed, hit rate 40.0% (400/1000 prompt tokens "
        "cached) | r0: 10 req, hit 40.0%, TTFT p50 50.0 ms p99 100.0 ms | r1: 1 req, hit -, TTFT p50 5.0 ms "
        "p99 5.0 ms | skipped 1 other event, 0 non-JSON lines")
    assert lines[0].startswith("05:06:00.000  r0        200  in   100 cached    40 out    8  ttft    10.0 ms  "
                               "e2e   100.0 ms  longest prefix (3 blocks) at lowest cost")
    assert lines[11].startswith("05:06:02.000  -         503") and lines[11].endswith(
        "error: No replica serving `m` is ready.")


def test_parse_record_skips_what_is_not_a_request_record():
    counts = LineCounts()
    assert parse_record(b"2025-01-01 10:00:00 [info] gateway_ready", counts) is None
    assert parse_record(b'{"event": "gateway_ready", "level": "info"}', counts) is None
    assert parse_record(b'{"event": "scrape", "status": "ok"}', counts) is None  # other shape, other event
    assert parse_record(b'{"event": "request", "status": 2', counts) is None     # torn line
    assert parse_record(b"", counts) is None
    record = parse_record(request_line("x"), counts)
    assert record.request_id == "x" and record.status == 200 and record.cached_tokens == 50
    assert (counts.requests, counts.other_events, counts.not_json) == (1, 2, 2)


def test_status_filter_terms():
    def shows(spec: str, status: int, error: str | None = None) -> bool:
        return StatusFilter(spec)(Record(event="request", status=status, error=error))
    assert shows("200", 200) and not shows("200", 201)
    assert shows("4xx", 404) and shows("4xx", 499) and not shows("4xx", 500)
    assert shows("5xx,429", 429) and shows("5xx,429", 503) and not shows("5xx,429", 404)
    assert shows("errors", 499) and shows("errors", 200, "upstream_disconnected") and not shows("errors", 200)
    assert shows("ok", 200) and not shows("ok", 404)
    assert shows("!200", 404) and not shows("!200", 200) and shows("4xx,!404", 400) and not shows("4xx,!404", 404)
    for bad in ("4x", "", "fail", "!"):
        with pytest.raises(ValueError):
            StatusFilter(bad)


def test_record_filter_combines_its_parts():
    record = parse_record(request_line("x", "r1", e2e_ms=300.0))
    assert RecordFilter()(record)
    assert RecordFilter(replicas=frozenset({"r1"}), slow_ms=300.0)(record)
    assert not RecordFilter(replicas=frozenset({"r0"}))(record)
    assert not RecordFilter(models=frozenset({"other"}))(record)
    assert not RecordFilter(slow_ms=300.5)(record)


def test_format_shows_time_replica_status_tokens_latency_reason():
    text = "".join(part for part, _ in format_record(parse_record(request_line("x", ttft_ms=12345.0, e2e_ms=54321.0))))
    assert text == ("05:06:07.891  r0        200  in   100 cached    50 out    8  ttft   12.35 s   "
                    "e2e   54.32 s   longest prefix (3 blocks) at lowest cost")
    assert clock("2025-03-04T05:06:07Z") == "05:06:07.000" and clock(None) == "??:??:??.???"


# ---- following a file, stdin, pipes ------------------------------------------------------------

class Follower:
    """`kvgate tail FILE --wide` as a live process; its output lines arrive on queues."""

    def __init__(self, *args: str) -> None:
        # Ctrl-C as at a terminal: SIGINT at its default even when the suite runs as a background
        # job, whose children inherit it ignored (and Python then keeps it ignored).
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "tail", "--wide", *args], cwd=REPO_ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.stdout: queue.Queue[str] = queue.Queue()
        self.stderr: queue.Queue[str] = queue.Queue()
        for pipe, lines in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr)):
            threading.Thread(target=lambda p=pipe, q=lines: [q.put(line.decode()) for line in p], daemon=True).start()

    def next_line(self, lines: queue.Queue, prefix: str = "") -> str:
        deadline = time.monotonic() + WAIT_S
        while True:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))  # queue.Empty: the test fails
            if line.startswith(prefix):
                return line

    def next_request_id(self) -> str:
        while True:
            ids = shown_ids(self.next_line(self.stdout).encode())
            if ids:
                return ids[0]


def test_follow_shows_appended_lines_across_truncation_and_rotation(tmp_path):
    log = tmp_path / "live.jsonl"
    log.write_bytes(request_line("old") + b"\n")
    follower = Follower(str(log), "--summary-every-s", "0.3")
    try:
        assert "from the end" in follower.next_line(follower.stderr, "kvgate tail: following")
        with open(log, "ab") as out:
            out.write(request_line("new-1") + b"\n" + request_line("new-2")[:40])  # the second one half written
            out.flush()
            assert follower.next_request_id() == "new-1"  # "old" predates the start: not shown
            out.write(request_line("new-2")[40:] + b"\n")
        assert follower.next_request_id() == "new-2"
        assert "r0: " in follower.next_line(follower.stdout, "-- last ")  # the periodic summary
        log.write_bytes(request_line("after-truncation") + b"\n")  # truncated and rewritten
        assert follower.next_request_id() == "after-truncation"
        writer = LogFile(log, max_bytes=len(request_line("r-0")) * 3, keep=2)  # the gateway's own rotation
        for index in range(8):  # one at a time: like tail -F, a follower sees only the newest file
            writer.write_line(request_line(f"r-{index}"))
            assert follower.next_request_id() == f"r-{index}"
        writer.close()
        assert Path(f"{log}.1").exists() and Path(f"{log}.2").exists() and not Path(f"{log}.3").exists()
        follower.proc.send_signal(signal.SIGINT)
        assert follower.proc.wait(timeout=WAIT_S) == 130
        assert "Traceback" not in "".join(follower.stderr.queue)
    finally:
        if follower.proc.poll() is None:
            follower.proc.kill()
            follower.proc.wait()


def test_follow_waits_for_a_file_that_does_not_exist_yet(tmp_path):
    log = tmp_path / "later.jsonl"
    follower = Follower(str(log), "--summary-every-s", "0")
    try:
        follower.next_line(follower.stderr, "kvgate tail: waiting for")
        log.write_bytes(request_line("first") + b"\n")  # all of a new file is new
        assert follower.next_request_id() == "first"
        follower.proc.send_signal(signal.SIGTERM)
        assert follower.proc.wait(timeout=WAIT_S) == 130
    finally:
        if follower.proc.poll() is None:
            follower.proc.kill()
            follower.proc.wait()


def test_from_start_shows_what_the_file_holds_then_follows(tmp_path):
    log = tmp_path / "live.jsonl"
    log.write_bytes(request_line("old") + b"\n")
    follower = Follower(str(log), "--from-start", "--summary-every-s", "0")
    try:
        assert follower.next_request_id() == "old"
        with open(log, "ab") as out:
            out.write(request_line("new") + b"\n")
        assert follower.next_request_id() == "new"
    finally:
        follower.proc.kill()
        follower.proc.wait()


def test_a_closed_pipe_ends_tail_quietly(tmp_path):
    log = tmp_path / "big.jsonl"
    log.write_bytes(b"\n".join(request_line(f"x{i}", prompt=1) for i in range(20000)) + b"\n")
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "tail", str(log), "--no-follow"], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"05:06:07.891  r0")
    proc.stdout.close()  # what `| head -1` does
    assert proc.wait(timeout=60) == 0
    assert proc.stderr.read() == b""


def test_tail_imports_neither_aiohttp_nor_torch():
    code = ("import sys, gateway.cli, observability.tail; "
            "assert 'aiohttp' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# ---- the log file writer -----------------------------------------------------------------------

def test_log_file_appends_across_restarts_and_keeps_n_rotated_files(tmp_path):
    path = tmp_path / "gw.jsonl"
    first = LogFile(path, max_bytes=0)
    first.write_line(b'{"n": 0}')
    first.close()
    second = LogFile(path, max_bytes=20, keep=2)  # a restart appends to what is there
    for n in range(1, 8):
        second.write_line(b'{"n": %d}' % n)  # 9 bytes a line: two fit in 20
    second.close()
    assert path.read_bytes() == b'{"n": 6}\n{"n": 7}\n'
    assert Path(f"{path}.1").read_bytes() == b'{"n": 4}\n{"n": 5}\n'
    assert Path(f"{path}.2").read_bytes() == b'{"n": 2}\n{"n": 3}\n'
    assert not Path(f"{path}.3").exists()  # 0 and 1 (the first file, appended to) went as the oldest


def test_console_terminal_still_gets_json_lines_in_the_file(tmp_path):
    path = tmp_path / "gw.jsonl"
    code = f"""
import io, logging, structlog
from observability.logs import LogFile, configure_logging
terminal = io.StringIO()
configure_logging("info", "console", stream=terminal, log_file=LogFile({str(path)!r}))
structlog.get_logger("t").info("request", request_id="r1", status=200, prompt_token_ids=[1, 2])
structlog.get_logger("t").debug("hidden")
try:
    1 / 0
except ZeroDivisionError:
    structlog.get_logger("t").exception("boom")
logging.getLogger("aiohttp.server").error("from the stdlib")
assert "request" in terminal.getvalue() and not terminal.getvalue().lstrip().startswith("{{")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["event"] for line in lines] == ["request", "boom", "from the stdlib"]
    assert list(lines[0])[:3] == ["event", "level", "timestamp"] and lines[0]["prompt_token_ids"] == [1, 2]
    assert "ZeroDivisionError" in lines[1]["exception"] and lines[2]["logger"] == "aiohttp.server"


def test_serve_refuses_a_log_file_it_cannot_open(tmp_path):
    config = tmp_path / "gw.yaml"
    config.write_text(f"logging: {{file: '{tmp_path}'}}\nreplicas:\n  - {{name: a, url: 'http://127.0.0.1:9', model: m}}\n")
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and f"{config}:1: logging.file: {tmp_path} is a directory" in result.stderr
