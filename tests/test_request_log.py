"""The request record's token-ID policy (DESIGN contract 4): full, hashed or off, one record each."""
import asyncio
import io
import json

import structlog

from observability.request_log import RequestLog, RequestRecord, hashed_ids


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


def test_records_of_a_loop_turn_are_written_together_in_order_and_a_broken_one_costs_only_its_own_line():
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
        before = len(out.getvalue().splitlines())  # nothing yet: the turn is not over
        await asyncio.sleep(0)
        await asyncio.sleep(0)
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
