"""The request record's token-ID policy (DESIGN contract 4): full, hashed or off, one record each."""
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
