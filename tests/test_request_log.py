"""The request record's token-ID policy (DESIGN contract 4): full, hashed or off, one record each."""
import asyncio
import io
import json
import random
import time

import msgspec
import pytest
import structlog

from observability.request_log import FLUSH_DELAY_S, RequestLog, RequestRecord, hashed_ids


def emitted(policy: str) -> dict:
    out = io.StringIO()
    logger = structlog.wrap_logger(structlog.PrintLogger(out),
                                   processors=[structlog.processors.add_log_level,
                                               structlog.processors.JSONRenderer()])
    record = RequestRecord("req-1", "/v1/completions")
    record.prompt_token_ids = [1, 2, 3]
    record.tokens_arrived([7, 8], 1.0)
    log = RequestLog(policy, logger)
    assert log.emit(record) is True
    assert log.emit(record) is False  # exactly one record per request
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_full_logs_the_ids():
    line = emitted("full")
    assert line["event"] == "request" and line["request_id"] == "req-1"
    assert line["prompt_token_ids"] == [1, 2, 3] and line["output_token_ids"] == [7, 8]


def test_hashed_logs_a_stable_fingerprint_not_the_ids():
    line = emitted("hashed")
    assert line["prompt_token_ids"] == hashed_ids([1, 2, 3]) != hashed_ids([1, 2, 4])
    assert line["output_token_ids"].endswith(":2")
    assert "[" not in json.dumps(line["prompt_token_ids"])


def test_off_logs_no_ids():
    line = emitted("off")
    assert "prompt_token_ids" not in line and "output_token_ids" not in line
    assert line["status"] == 200


def test_tokens_of_one_read_time_as_the_events_that_brought_them_one_by_one():
    together, apart = RequestRecord("a", "/v1/completions", 0.0), RequestRecord("b", "/v1/completions", 0.0)
    reads = [([5], 1.0, 1), ([6, 7, 8], 1.5, 3), ([9, 10], 2.5, 2)]  # (ids, when, events that carried them)
    for ids, now, events in reads:
        together.tokens_arrived(ids, now, events)
        for n in range(events):  # the same read, event by event (one ID each, the last gets the rest)
            apart.tokens_arrived(ids[n:n + 1] if n < events - 1 else ids[n:], now)
    assert together.output_token_ids == apart.output_token_ids == [5, 6, 7, 8, 9, 10]
    assert together.itl_s == apart.itl_s == [0.5, 0.0, 0.0, 1.0, 0.0]
    assert together.ttft_s == apart.ttft_s == 1.0


class _BrokenRouting:
    """A record's routing whose explanation fails (a bug elsewhere): its line cannot be made."""
    @property
    def log(self):
        raise RuntimeError("explanation failed")


def test_records_emitted_together_are_written_together_in_order_and_a_broken_one_costs_only_its_own_line():
    out = io.StringIO()
    logger = structlog.wrap_logger(structlog.PrintLogger(out), processors=[structlog.processors.JSONRenderer()])
    log = RequestLog("full", logger)

    async def turn() -> tuple[int, int]:
        log.bind(asyncio.get_running_loop())
        for n in range(5):
            record = RequestRecord(f"req-{n}", "/v1/completions")
            record.prompt_token_ids = [n]
            if n == 2:
                record.routing = _BrokenRouting()
            assert log.emit(record) is True
            assert log.emit(record) is False  # still one line a request
        await asyncio.sleep(0)
        before = len(out.getvalue().splitlines())  # nothing yet: they wait FLUSH_DELAY_S
        deadline = time.monotonic() + 2.0
        while not out.getvalue() and time.monotonic() < deadline:
            await asyncio.sleep(FLUSH_DELAY_S)
        return before, len(out.getvalue().splitlines())

    before, after = asyncio.run(turn())
    assert before == 0 and after == 4
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["request_id"] for line in lines] == ["req-0", "req-1", "req-3", "req-4"]
    assert [line["prompt_token_ids"] for line in lines] == [[0], [1], [3], [4]]


def test_records_still_pending_are_written_by_flush():
    out = io.StringIO()
    logger = structlog.wrap_logger(structlog.PrintLogger(out), processors=[structlog.processors.JSONRenderer()])
    log = RequestLog("off", logger)
    loop = asyncio.new_event_loop()
    try:
        log.bind(loop)
        log.emit(RequestRecord("late", "/v1/completions"))  # the loop never turns again (a stop)
        assert out.getvalue() == ""
        log.flush()
        assert json.loads(out.getvalue())["request_id"] == "late"
    finally:
        loop.close()


class _Try:
    """A gateway try's stand-in for the record's routing field: its log, and its log as JSON."""
    log = {"policy": "cache_aware", "chosen": "r1"}

    def log_json(self):
        return msgspec.Raw(b'{"policy":"cache_aware"}')


def test_a_records_line_is_the_same_from_its_c_call_as_from_the_python_lines(monkeypatch):
    """Every optional field set and not, times on and off the microsecond grid, halves that round to
    even, token intervals, a routing dict or a try's log (as JSON or not), each token-ID policy:
    observability/_record_line.c's line is field for field the Python lines' line."""
    from observability import request_log

    if request_log._native_line is None:
        pytest.skip("observability/_record_line.c not built")
    rng = random.Random(3)
    records = []
    for n in range(400):
        started = rng.choice([0.0, 1000.0, rng.uniform(0, 1e5)])
        record = RequestRecord(f"req-{n}", rng.choice(["/v1/completions", "/v1/chat/completions"]), started)
        record.model, record.replica = rng.choice([(None, None), ("m", "r1")])
        record.prompt_token_ids = rng.choice([None, [], [rng.randrange(50_000) for _ in range(rng.randrange(40))]])
        record.prompt_tokens = None if record.prompt_token_ids is None else len(record.prompt_token_ids)
        record.routed_s = rng.choice([None, started + rng.uniform(0, 0.01), started + 0.0000005])
        if rng.random() < 0.7:
            for _ in range(rng.randrange(1, 6)):
                record.tokens_arrived([rng.randrange(50_000)], started + rng.uniform(0.001, 2.0), rng.randrange(1, 3))
        record.finished_s = rng.choice([None, started + rng.uniform(0, 3), started + 0.0025005])
        record.routing = rng.choice([None, {"policy": "round_robin"}, _Try()])
        record.cached_tokens = rng.choice([None, 0, 32])
        record.finish_reason = rng.choice([None, "stop", "length"])
        if rng.random() < 0.3:
            record.key, record.tenant = "team-a", rng.choice([None, "tenant-a"])
        if rng.random() < 0.3:
            record.fail(rng.choice([429, 502]), "replica failed")
        if rng.random() < 0.2:
            record.add_failover("r2", rng.randrange(5), "connection reset")
        record.failover = rng.choice([record.failover, []]) if record.failover is None else record.failover
        record.failed_after_headers = rng.random() < 0.2
        record.pd = rng.choice([None, {"prefill": "p0", "decode": "d0"}])
        record.panic_routing = rng.random() < 0.1
        records.append(record)
    unfinished = [record for record in records if record.finished_s is None]
    assert unfinished  # e2e measured to now: compared by the fields around it
    for policy in ("full", "off", "hashed"):
        for routing_json in (False, True):
            monkeypatch.setattr(request_log, "NATIVE", True)
            native = [msgspec.structs.asdict(record.as_line(policy, routing_json)) for record in records]
            monkeypatch.setattr(request_log, "NATIVE", False)
            python = [msgspec.structs.asdict(record.as_line(policy, routing_json)) for record in records]
            for record, c_line, py_line in zip(records, native, python):
                if record.finished_s is None:
                    assert 0 <= py_line.pop("e2e_ms") - c_line.pop("e2e_ms") < 1000
                assert c_line == py_line, (policy, routing_json, c_line, py_line)
    # Through the request log, batched, as the gateway writes it: the same lines.
    for native in (True, False):
        monkeypatch.setattr(request_log, "NATIVE", native)
        out = io.StringIO()
        logger = structlog.wrap_logger(structlog.PrintLogger(out), processors=[structlog.processors.JSONRenderer()])
        log = RequestLog("full", logger)
        for record in records[:50]:
            record._emitted = False
            record.finished_s = record.finished_s or record.started_s + 1.0
            log.emit(record)
        assert len(out.getvalue().splitlines()) == 50
        if native:
            written = out.getvalue()
        else:
            assert out.getvalue() == written
