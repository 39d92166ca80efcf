"""The gateway in front of two real tiny replicas, all as real processes on loopback.

Every request is checked end to end: what the client got, what the gateway logged (token IDs equal
to the replica's), which replica served it, and what /metrics says."""
from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
import uuid

import openai
import pytest

from tests.servers import free_port, run_gateway, run_replica, stop_process

LOG_WAIT_S = 10.0


class Gateway:
    def __init__(self, server, replicas):
        self.server = server
        self.url = server.url
        self.replicas = {f"r{i}": replica for i, replica in enumerate(replicas)}
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=30)

    def records(self) -> list[dict]:
        out = []
        for line in self.server.logs().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    item = json.loads(line)
                    if item.get("event") == "request":
                        out.append(item)
        return out

    def record(self, request_id: str) -> dict:
        """The request's log record. Another process writes it, maybe just after the last byte a
        client reads, so poll the log file, bounded."""
        deadline = time.monotonic() + LOG_WAIT_S
        while True:
            found = [r for r in self.records() if r["request_id"] == request_id]
            if found:
                assert len(found) == 1, f"{len(found)} records for {request_id}"
                return found[0]
            assert time.monotonic() < deadline, f"no request record for {request_id}:\n{self.server.logs()[-3000:]}"
            time.sleep(0.05)


def http(method: str, url: str, body: bytes | dict | None = None, headers: dict | None = None):
    """(status, headers, parsed JSON or text) without raising on 4xx/5xx."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, resp_headers, raw = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        status, resp_headers, raw = err.code, dict(err.headers), err.read()
    try:
        return status, resp_headers, json.loads(raw)
    except json.JSONDecodeError:
        return status, resp_headers, raw.decode()


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            head, value = line.rsplit(" ", 1)
            if head == name or head.startswith(name + "{"):
                total += float(value)
    return total


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with contextlib.ExitStack() as stack:
        replicas = [stack.enter_context(run_replica("tiny")) for _ in range(2)]
        port = free_port()
        config = tmp_path_factory.mktemp("gw") / "gateway.yaml"
        config.write_text(
            f"gateway: {{host: 127.0.0.1, port: {port}, request_timeout_s: 60, connect_timeout_s: 2}}\n"
            "logging: {level: info, format: json, token_ids: full}\n"
            "routing: {policy: round_robin}\nreplicas:\n"
            + "".join(f"  - {{name: r{i}, url: '{r.url}', model: tiny}}\n" for i, r in enumerate(replicas)))
        server = stack.enter_context(run_gateway(config, port))
        yield Gateway(server, replicas)


def rid() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def direct(gateway: Gateway, replica: str, endpoint: str, body: dict) -> dict:
    status, _, answer = http("POST", gateway.replicas[replica].url + endpoint, {**body, "return_token_ids": True})
    assert status == 200, answer
    return answer


def test_completion_records_the_replicas_token_ids(gateway):
    request_id = rid()
    params = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
    raw = gateway.client.completions.with_raw_response.create(
        **params, extra_body={"return_token_ids": True}, extra_headers={"x-request-id": request_id})
    assert raw.headers["x-request-id"] == request_id
    answer = raw.parse()
    choice = answer.choices[0].model_extra
    record = gateway.record(request_id)
    assert record["status"] == 200 and record["stream"] is False and record["replica"] in gateway.replicas
    assert record["output_token_ids"] == choice["token_ids"] and len(choice["token_ids"]) == 8
    assert record["prompt_token_ids"] == choice["prompt_token_ids"]
    assert record["completion_tokens"] == answer.usage.completion_tokens == 8
    assert record["routing"]["policy"] == "round_robin" and record["e2e_ms"] > 0
    same = direct(gateway, record["replica"], "/v1/completions", params)
    assert same["choices"][0]["token_ids"] == choice["token_ids"]
    assert same["choices"][0]["prompt_token_ids"] == record["prompt_token_ids"]


def test_chat_without_return_token_ids_still_logs_them(gateway):
    request_id = rid()
    params = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6,
              "temperature": 0}
    answer = gateway.client.chat.completions.create(**params, extra_headers={"x-request-id": request_id})
    assert answer.choices[0].message.content is not None
    assert "token_ids" not in (answer.choices[0].model_extra or {})  # not asked for, not sent
    record = gateway.record(request_id)
    same = direct(gateway, record["replica"], "/v1/chat/completions", params)
    assert record["output_token_ids"] == same["choices"][0]["token_ids"]
    assert record["prompt_token_ids"] == same["prompt_token_ids"]
    assert record["completion_tokens"] == len(record["output_token_ids"]) == 6
    assert 0 < record["routed_ms"] < record["e2e_ms"]  # the gateway's own time before the replica had it


@pytest.mark.parametrize("stream", [False, True])
def test_a_long_new_prompt_is_counted_with_the_replicas_tokenizer(gateway, stream):
    """More new text than the gateway tokenizes on its loop (gateway.prompts.OFF_LOOP_CHARS): it is
    tokenized on a worker thread, and the context check before routing counts exactly the tokens
    the model's tokenizer makes of it (BOS included), streamed or not."""
    from gateway.prompts import OFF_LOOP_CHARS
    from replica.tiny import tiny_checkpoint_dir
    from tokenization import TokenizerBundle

    words = [f"{uuid.uuid4().hex[:6]}word" for _ in range(60)]
    prompt = " ".join(words[i % 60] + ("," if i % 7 == 0 else "") for i in range(OFF_LOOP_CHARS // 5))
    assert len(prompt) > OFF_LOOP_CHARS
    tiny = TokenizerBundle.from_hf_dir(tiny_checkpoint_dir())
    expected = len(tiny.tokenizer.encode(prompt, add_special_tokens=False).ids) + tiny.add_bos
    status, _, answer = http("POST", gateway.url + "/v1/completions",
                             {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": stream},
                             {"x-request-id": rid()})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert f"your prompt contains {expected} input tokens" in answer["error"]["message"], answer
    assert gateway.client.completions.create(model="tiny", prompt="Still serving", max_tokens=2).choices


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_relays_every_token_and_records_them(gateway, endpoint):
    request_id = rid()
    if endpoint == "completions":
        params = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}
        stream = gateway.client.completions.create(**params, stream=True, extra_body={"return_token_ids": True},
                                                   extra_headers={"x-request-id": request_id})
        path = "/v1/completions"
    else:
        params = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}],
                  "max_tokens": 10, "temperature": 0}
        stream = gateway.client.chat.completions.create(**params, stream=True,
                                                        extra_body={"return_token_ids": True},
                                                        extra_headers={"x-request-id": request_id})
        path = "/v1/chat/completions"
    streamed_ids, prompt_ids, usage_chunks = [], None, 0
    for chunk in stream:
        extra = chunk.model_extra or {}
        prompt_ids = prompt_ids or extra.get("prompt_token_ids")
        usage_chunks += chunk.usage is not None
        for choice in chunk.choices:
            prompt_ids = prompt_ids or (choice.model_extra or {}).get("prompt_token_ids")
            streamed_ids += (choice.model_extra or {}).get("token_ids") or []
    assert usage_chunks == 0  # the gateway asked for usage; the client did not, so it never sees it
    record = gateway.record(request_id)
    assert record["stream"] is True and record["status"] == 200 and "error" not in record
    assert record["output_token_ids"] == streamed_ids and len(streamed_ids) == 10
    assert record["prompt_token_ids"] == prompt_ids
    assert record["completion_tokens"] == 10 and record["ttft_ms"] > 0 and record["itl_max_ms"] >= 0
    assert 0 < record["routed_ms"] < record["ttft_ms"]  # the gateway's own time before the replica had it
    same = direct(gateway, record["replica"], path, params)
    assert same["choices"][0]["token_ids"] == streamed_ids


def test_stream_usage_is_relayed_when_the_client_asks(gateway):
    stream = gateway.client.completions.create(model="tiny", prompt="Hello", max_tokens=3, stream=True,
                                               stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usages = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usages) == 1 and usages[0].completion_tokens == 3


def test_round_robin_alternates_replicas(gateway):
    before = {name: metric(http("GET", r.url + "/metrics")[2], "vllm:request_success_total")
              for name, r in gateway.replicas.items()}
    ids = [rid() for _ in range(4)]
    for request_id in ids:
        gateway.client.completions.create(model="tiny", prompt="a b c", max_tokens=2,
                                          extra_headers={"x-request-id": request_id})
    served = [gateway.record(request_id)["replica"] for request_id in ids]
    assert served[0] != served[1] and served[0::2] == [served[0]] * 2 and served[1::2] == [served[1]] * 2
    after = {name: metric(http("GET", r.url + "/metrics")[2], "vllm:request_success_total")
             for name, r in gateway.replicas.items()}
    assert {name: after[name] - before[name] for name in after} == {"r0": 2, "r1": 2}


def test_metrics_count_requests_and_tokens(gateway):
    before = http("GET", gateway.url + "/metrics")[2]
    request_id = rid()
    gateway.client.completions.create(model="tiny", prompt="count me", max_tokens=4,
                                      extra_body={"ignore_eos": True},  # 4 tokens, whatever is sampled
                                      extra_headers={"x-request-id": request_id})
    replica = gateway.record(request_id)["replica"]
    after = http("GET", gateway.url + "/metrics")[2]
    assert (metric(after, "kvgate_requests_total", replica=replica, status="200")
            - metric(before, "kvgate_requests_total", replica=replica, status="200")) == 1
    assert metric(after, "kvgate_generation_tokens_total") - metric(before, "kvgate_generation_tokens_total") == 4
    assert metric(after, "kvgate_prompt_tokens_total") > metric(before, "kvgate_prompt_tokens_total")
    assert metric(after, "kvgate_e2e_request_latency_seconds_count") > metric(
        before, "kvgate_e2e_request_latency_seconds_count")
    assert "kvgate_requests_in_flight" in after and "kvgate_time_to_first_token_seconds_bucket" in after


def test_models_and_health(gateway):
    status, _, models = http("GET", gateway.url + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 2048
    status, _, health = http("GET", gateway.url + "/health")
    assert status == 200 and health == {"status": "ok", "all_ready": True}  # public: nothing more
    status, _, health = http("GET", gateway.url + "/admin/health")
    assert status == 200 and set(health["replicas"]) == {"r0", "r1"}


BAD_INPUTS = [
    ("/v1/completions", b'{"model": "tiny", "prompt": ', 400, "invalid_json"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 400, "invalid_type"),
    ("/v1/completions", {"model": "tiny", "max_tokens": 4}, 400, "missing_field"),
    ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4}, 400, "missing_field"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "invalid_type"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 10**12}, 400, "invalid_type"),
    ("/v1/completions", {"model": "tiny", "prompt": [5] * 3000, "max_tokens": 4}, 400, "context_length_exceeded"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4096}, 400, "context_length_exceeded"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model_not_found"),
]


@pytest.mark.parametrize("path,body,status,code", BAD_INPUTS)
def test_bad_input_is_refused_in_openai_shape_and_the_next_request_works(gateway, path, body, status, code):
    request_id = rid()
    got, headers, answer = http("POST", gateway.url + path, body, {"x-request-id": request_id})
    assert got == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]
    assert answer["error"]["code"] == code
    assert headers.get("x-request-id") == request_id
    record = gateway.record(request_id)
    assert record["status"] == status and record["error"] and record["replica"] is None
    ok = gateway.client.completions.create(model="tiny", prompt="still fine", max_tokens=2,
                                           extra_body={"ignore_eos": True})  # the tiny model may sample its EOS
    assert ok.choices[0].finish_reason == "length"


def test_client_disconnect_mid_stream_stops_the_replica(gateway):
    request_id = rid()
    generated_before = {name: metric(http("GET", r.url + "/metrics")[2], "vllm:generation_tokens_total")
                        for name, r in gateway.replicas.items()}
    body = json.dumps({"model": "tiny", "prompt": "go on forever", "max_tokens": 1500, "ignore_eos": True,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", gateway.server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                     + f"x-request-id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while received.count(b"data: ") < 3:  # a few tokens streamed: the request is running
            chunk = sock.recv(65536)
            assert chunk, "gateway closed the stream early"
            received += chunk
        assert received.startswith(b"HTTP/1.1 200")
        # A scrape while it streams counts it in flight (the per-try amounts are folded in at collection).
        assert metric(http("GET", gateway.url + "/metrics")[2], "kvgate_requests_in_flight") == 1
    record = gateway.record(request_id)
    assert record["error"] == "client_disconnected" and record["status"] == 499
    assert metric(http("GET", gateway.url + "/metrics")[2], "kvgate_requests_in_flight") == 0
    replica = gateway.replicas[record["replica"]]
    deadline = time.monotonic() + 15
    while metric(http("GET", replica.url + "/metrics")[2], "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "replica still generating for a gone client"
        time.sleep(0.05)
    # Stopped early: the replica did not generate the 1500 tokens nobody would read.
    generated = (metric(http("GET", replica.url + "/metrics")[2], "vllm:generation_tokens_total")
                 - generated_before[record["replica"]])
    assert 3 <= len(record["output_token_ids"]) and generated < 1500


def test_request_id_is_made_when_absent_and_passed_to_the_replica(gateway):
    raw = gateway.client.completions.with_raw_response.create(model="tiny", prompt="id?", max_tokens=1)
    request_id = raw.headers["x-request-id"]
    assert len(request_id) >= 16
    assert request_id in raw.parse().id  # the replica named its completion after the id it received
    assert gateway.record(request_id)["status"] == 200


def test_unreachable_replica_is_retried_on_another_and_marked_down(tmp_path):
    with contextlib.ExitStack() as stack:
        survivor = stack.enter_context(run_replica("tiny"))
        doomed = stack.enter_context(run_replica("tiny"))
        port = free_port()
        config = tmp_path / "gateway.yaml"
        config.write_text(
            f"gateway: {{host: 127.0.0.1, port: {port}, connect_timeout_s: 2}}\nlogging: {{format: json}}\n"
            f"replicas:\n  - {{name: doomed, url: '{doomed.url}', model: tiny}}\n"
            f"  - {{name: survivor, url: '{survivor.url}', model: tiny}}\n")
        server = stack.enter_context(run_gateway(config, port))
        gateway = Gateway(server, [doomed, survivor])
        stop_process(doomed.proc)  # dies while the gateway still believes it healthy
        ids = [rid() for _ in range(3)]
        for request_id in ids:
            answer = gateway.client.completions.create(model="tiny", prompt="still there?", max_tokens=2,
                                                       extra_body={"ignore_eos": True},
                                                       extra_headers={"x-request-id": request_id})
            assert answer.usage.completion_tokens == 2
        records = [gateway.record(request_id) for request_id in ids]
        assert [r["replica"] for r in records] == ["survivor"] * 3
        assert records[0]["routing"]["retried_after"] == ["doomed"]  # round robin's first pick was dead
        assert all("retried_after" not in r["routing"] for r in records[1:])  # then it was out of the pool
