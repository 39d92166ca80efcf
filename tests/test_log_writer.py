"""The background log writer: every line handed over is written exactly once, in order, to stdout
and the log file (rotating at the same lines as line-by-line writes would), and nothing is left
behind at close; request records skip structlog but keep its line shape."""
from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import threading

from observability.log_writer import LogWriter
from observability.logs import LogFile
from tests.servers import REPO_ROOT


def test_no_line_is_lost_duplicated_or_reordered_and_close_flushes(tmp_path):
    stdout = open(tmp_path / "stdout", "wb")
    log_file = LogFile(tmp_path / "file.jsonl", max_bytes=0)
    writer = LogWriter(stdout, log_file, max_pending_bytes=4096)  # small: producers meet back-pressure

    def produce(name: str) -> None:
        for n in range(3000):
            writer.write(f'{{"who": "{name}", "n": {n}}}'.encode())

    threads = [threading.Thread(target=produce, args=(f"t{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    writer.write_line_to_file(b'{"who": "stdlib", "n": 0}')
    writer.close()
    stdout.close()
    for path, extra in ((tmp_path / "stdout", 0), (tmp_path / "file.jsonl", 1)):
        lines = [json.loads(line) for line in path.read_bytes().splitlines()]
        assert len(lines) == 4 * 3000 + extra
        for name in ("t0", "t1", "t2", "t3"):
            assert [line["n"] for line in lines if line["who"] == name] == list(range(3000))  # each in order
    assert writer.flush(0.1)  # closed: nothing pending


def test_batched_lines_rotate_between_the_same_lines_as_single_ones(tmp_path):
    one, batch = tmp_path / "one.jsonl", tmp_path / "batch.jsonl"
    lines = [b'{"n": %d}' % n for n in range(40)]
    single = LogFile(one, max_bytes=50, keep=3)
    for line in lines:
        single.write_line(line)
    single.close()
    batched = LogFile(batch, max_bytes=50, keep=3)
    batched.write_lines(lines[:13])
    batched.write_lines(lines[13:])
    batched.close()
    for suffix in ("", ".1", ".2", ".3"):
        assert (tmp_path / f"one.jsonl{suffix}").read_bytes() == (tmp_path / f"batch.jsonl{suffix}").read_bytes()


def test_a_writer_without_a_descriptor_gets_the_lines_too():
    sink = io.BytesIO()
    writer = LogWriter(sink)
    for n in range(100):
        writer.write(b"%d" % n)
    assert writer.flush(5.0)
    assert sink.getvalue().splitlines() == [b"%d" % n for n in range(100)]
    writer.close()


def test_request_records_keep_structlogs_line_shape_and_are_written_at_exit(tmp_path):
    code = f"""
import io, structlog
from observability.logs import LogFile, configure_logging
from observability.request_log import RequestLog, RequestRecord
configure_logging("info", "json", log_file=LogFile({str(tmp_path / "gw.jsonl")!r}))
structlog.contextvars.bind_contextvars(worker=3)
log = RequestLog("full")
for n in range(500):
    record = RequestRecord(f"r{{n}}", "/v1/completions")
    record.prompt_token_ids = [1, 2, n]
    record.tokens_arrived([7, 8], 1.0)
    assert log.emit(record) and not log.emit(record)
structlog.get_logger("t").info("after", n=500)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for raw in (result.stdout, (tmp_path / "gw.jsonl").read_bytes()):
        lines = [json.loads(line) for line in raw.splitlines()]
        assert [line.get("request_id") for line in lines[:500]] == [f"r{n}" for n in range(500)]
        assert lines[500]["event"] == "after" and len(lines) == 501
        first = lines[0]
        assert list(first)[:3] == ["event", "level", "timestamp"] and first["timestamp"].endswith("Z")
        assert first["worker"] == 3 and first["prompt_token_ids"] == [1, 2, 0] and first["output_token_ids"] == [7, 8]


def test_a_records_json_line_has_the_fields_structlog_would_write_whatever_is_set_and_bound(tmp_path):
    """The JSON sink writes a record from its line Struct (no dict); structlog's own chain, given
    the same record as keyword arguments, is the reference: the same keys and values, whichever
    optional fields are set, token-ID policy and context (none, the worker's number, more)."""
    code = """
import json, structlog
from observability.logs import configure_logging
from observability.request_log import RequestLog, RequestRecord
configure_logging("info", "json")
def record(n, rich):
    r = RequestRecord(f"r{n}", "/v1/chat/completions", 10.0)
    r.prompt_token_ids = [1, 2, n]
    r.tokens_arrived([7, 8], 10.5, 2)
    r.routed_s, r.finished_s, r.finish_reason, r.model, r.replica = 10.25, 11.0, "stop", "m", "a"
    if rich:
        r.key, r.tenant, r.pd, r.failed_after_headers, r.panic_routing = "k1", "t1", {"prefill": "p"}, True, True
        r.add_failover("b", 1, "stalled")
        r.fail(502, "gone")
    return r
n = 0
for context in ({}, {"worker": 3}, {"worker": 3, "session": "s"}):
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**context)
    for policy in ("full", "hashed", "off"):
        for rich in (False, True):
            RequestLog(policy).emit(record(n, rich))
            RequestLog(policy, structlog.get_logger("kvgate.request")).emit(record(n, rich))
            n += 1
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == 36
    for ours, reference in zip(lines[::2], lines[1::2]):
        assert list(ours)[:3] == ["event", "level", "timestamp"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{6})?Z", ours.pop("timestamp"))
        reference.pop("timestamp")
        assert ours == reference
    assert lines[0]["e2e_ms"] == 1000.0 and lines[0]["routed_ms"] == 250.0 and "key" not in lines[0]
    rich = lines[2]
    assert rich["failover"] == [{"replica": "b", "after_tokens": 1, "reason": "stalled"}]
    assert (rich["status"], rich["error"], rich["key"], rich["tenant"], rich["pd"]) == (502, "gone", "k1", "t1",
                                                                                      {"prefill": "p"})
    assert rich["failed_after_headers"] is rich["panic_routing"] is True
    assert lines[4]["prompt_token_ids"].endswith(":3") and "output_token_ids" not in lines[8]
    assert lines[12]["worker"] == 3 and lines[24]["session"] == "s"
