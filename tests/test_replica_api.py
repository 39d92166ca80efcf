"""The built-in replica's OpenAI/vLLM HTTP API, against a real `python -m replica --model tiny`."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx2 as httpx  # ships with the openai SDK (test extra)
import openai
import pytest
import torch

from protocol.errors import Overloaded
from replica.engine import Engine
from replica.loader import load_model
from replica.model_runner import ModelRunner, greedy_generate
from replica.sampler import SamplingParams
from tests.servers import run_replica

TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture(scope="module")
def replica():
    with run_replica("tiny") as server:
        yield server


@pytest.fixture(scope="module")
def client(replica):
    with httpx.Client(base_url=replica.url, timeout=TIMEOUT) as http:
        yield http


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


def complete(client, **body) -> dict:
    response = client.post("/v1/completions", json={"max_tokens": 8, **body})
    assert response.status_code == 200, response.text
    return response.json()


def chat(client, **body) -> dict:
    response = client.post("/v1/chat/completions", json={"max_tokens": 8, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream_chunks(client, path: str, body: dict) -> list[dict]:
    """All chunks of a streamed response, checking the framing: every event is `data:` JSON and
    `data: [DONE]` comes last."""
    payloads = []
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                assert line.startswith("data: "), line
                payloads.append(line[len("data: "):])
    assert payloads and payloads[-1] == "[DONE]"
    assert "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def metric(client, name: str) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


GREEDY = {"temperature": 0, "ignore_eos": True}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]


# -- completions and chat ---------------------------------------------------------------------
def test_completion_with_text_prompt_has_vllm_shape(client):
    body = complete(client, model="tiny", prompt="The quick brown fox", max_tokens=6, **GREEDY)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert isinstance(body["created"], int) and body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    assert choice["prompt_token_ids"] is None and choice["token_ids"] is None  # not asked for
    usage = body["usage"]
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 6
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_completion_with_token_id_prompt(client):
    prompt = [5, 17, 200, 33, 140]
    body = complete(client, prompt=prompt, return_token_ids=True, max_tokens=5, **GREEDY)
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    assert len(choice["token_ids"]) == 5 and body["usage"]["prompt_tokens"] == 5
    # a one-element batch of token IDs is the same prompt
    again = complete(client, prompt=[prompt], return_token_ids=True, max_tokens=5, **GREEDY)
    assert again["choices"][0]["token_ids"] == choice["token_ids"]


def test_chat_with_string_and_text_parts_gives_the_same_prompt(client):
    as_parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"][:4]},
                                                {"type": "text", "text": m["content"][4:]}]}
                for m in MESSAGES]
    plain = chat(client, messages=MESSAGES, return_token_ids=True, **GREEDY)
    parts = chat(client, messages=as_parts, return_token_ids=True, **GREEDY)
    assert plain["id"].startswith("chatcmpl-") and plain["object"] == "chat.completion"
    message = plain["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert plain["prompt_token_ids"] == parts["prompt_token_ids"]
    assert plain["choices"][0]["token_ids"] == parts["choices"][0]["token_ids"]
    tokenized = client.post("/tokenize", json={"messages": MESSAGES}).json()
    assert tokenized["tokens"] == plain["prompt_token_ids"]


def test_streamed_completion_matches_non_streamed_for_greedy(client):
    request = {"prompt": "Once upon a time", "max_tokens": 12, "return_token_ids": True, **GREEDY}
    full = complete(client, **request)["choices"][0]
    chunks = stream_chunks(client, "/v1/completions",
                           {**request, "stream_options": {"include_usage": True}})
    *token_chunks, usage_chunk = chunks
    assert all(c["id"] == chunks[0]["id"] and c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == full["text"]
    assert token_chunks[0]["choices"][0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in token_chunks[1:])
    assert [t for c in token_chunks for t in c["choices"][0]["token_ids"]] == full["token_ids"]
    assert [c["choices"][0]["finish_reason"] for c in token_chunks][-1] == "length"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 12
    assert usage_chunk["usage"]["prompt_tokens"] == len(full["prompt_token_ids"])


def test_streamed_chat_matches_non_streamed_for_greedy(client):
    request = {"messages": MESSAGES, "max_tokens": 10, "return_token_ids": True, **GREEDY}
    full = chat(client, **request)
    chunks = stream_chunks(client, "/v1/chat/completions", request)
    first, *rest = chunks
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert first["prompt_token_ids"] == full["prompt_token_ids"]
    assert "".join(c["choices"][0]["delta"]["content"] for c in rest) == full["choices"][0]["message"]["content"]
    assert [t for c in rest for t in c["choices"][0]["token_ids"]] == full["choices"][0]["token_ids"]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)  # include_usage not asked


def test_greedy_tokens_over_http_equal_the_models_own_greedy_loop(client, tiny):
    prompt = tiny.tokenizer.encode("Hello, world! How are you today?")
    steps = 16
    expected = greedy_generate(ModelRunner(tiny.model, tiny.config, num_blocks=8), prompt, steps)
    body = complete(client, prompt=prompt, max_tokens=steps, return_token_ids=True, **GREEDY)
    assert body["choices"][0]["token_ids"] == expected


def test_same_seed_same_tokens_different_seed_differs(client):
    request = {"prompt": "Tell me a story", "max_tokens": 16, "temperature": 1.0, "ignore_eos": True,
               "return_token_ids": True}

    def tokens(seed: int) -> list[int]:
        return complete(client, seed=seed, **request)["choices"][0]["token_ids"]

    first = tokens(1234)
    assert tokens(1234) == first
    assert tokens(99) != first


# -- stopping ---------------------------------------------------------------------------------
def _stop_candidate(text: str) -> str:
    for start in range(3, len(text) - 2):
        candidate = text[start:start + 2]
        if "\ufffd" not in candidate and candidate.strip():
            return candidate
    pytest.skip(f"greedy text has no usable stop string: {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(client, stream):
    request = {"prompt": "The scheduler batches sequences", "max_tokens": 24, **GREEDY}
    reference = complete(client, **request)["choices"][0]["text"]
    stop = _stop_candidate(reference)
    expected = reference[:reference.find(stop)]
    if stream:
        chunks = stream_chunks(client, "/v1/completions", {**request, "stop": [stop, "\u2603never"]})
        text = "".join(c["choices"][0]["text"] for c in chunks)
        last = chunks[-1]["choices"][0]
    else:
        last = complete(client, stop=stop, **request)["choices"][0]
        text = last["text"]
    assert text == expected
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop


def test_stop_token_ids_end_generation(client):
    request = {"prompt": "Numbers: 0 1 2 3", "max_tokens": 16, "return_token_ids": True, **GREEDY}
    reference = complete(client, **request)["choices"][0]["token_ids"]
    index = next(i for i in range(2, len(reference)) if reference[i] not in reference[:i])
    choice = complete(client, stop_token_ids=[reference[index]], **request)["choices"][0]
    assert choice["token_ids"] == reference[:index + 1]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == reference[index]


# -- tokenizer endpoints, models, metrics, headers --------------------------------------------
def test_tokenize_detokenize_round_trip(client, replica):
    text = "Paris is the capital of France."
    tokenized = client.post("/tokenize", json={"model": "tiny", "prompt": text,
                                               "return_token_strs": True}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == len(tokenized["token_strs"]) > 0
    assert tokenized["max_model_len"] == 2048
    assert client.post("/detokenize", json={"tokens": tokenized["tokens"]}).json() == {"prompt": text}


def test_models_lists_the_served_model(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == "tiny" and card["object"] == "model" and card["max_model_len"] == 2048


def test_tokenizer_payload_is_served(client, tiny):
    from tokenization.bundle import TokenizerBundle

    gzipped = client.get("/kvgate/tokenizer")  # httpx asks for gzip and inflates it
    assert gzipped.headers["content-encoding"] == "gzip"
    plain = client.get("/kvgate/tokenizer", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and plain.content == gzipped.content
    bundle = TokenizerBundle.from_payload(plain.content)
    assert bundle.encode("Hello, world!") == tiny.tokenizer.encode("Hello, world!")


def test_metrics_counters_move(client):
    before = {name: metric(client, name) for name in
              ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
               "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
               "vllm:inter_token_latency_seconds_count")}
    complete(client, prompt=[1, 2, 3, 4], max_tokens=5, **GREEDY)
    after = {name: metric(client, name) for name in before}
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 4
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 1
    assert after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"] == 1
    assert after["vllm:e2e_request_latency_seconds_count"] - before["vllm:e2e_request_latency_seconds_count"] == 1
    assert after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"] == 4
    text = client.get("/metrics").text
    assert 'vllm:num_requests_running{model_name="tiny"} 0.0' in text
    assert 'vllm:num_requests_waiting{model_name="tiny"} 0.0' in text


def test_request_id_is_echoed_or_minted(client):
    given = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                        headers={"x-request-id": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123" and given.json()["id"] == "cmpl-abc-123"
    minted = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert minted.headers["x-request-id"] and minted.json()["id"] == "cmpl-" + minted.headers["x-request-id"]


def test_official_openai_client_works(replica):
    sdk = openai.OpenAI(base_url=replica.url + "/v1", api_key="unused", timeout=30, max_retries=0)
    try:
        assert [m.id for m in sdk.models.list()] == ["tiny"]
        answer = sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 6
        streamed = sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
        chunks = list(streamed)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == answer.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == 6
        legacy = sdk.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert legacy.choices[0].finish_reason == "length"
        with pytest.raises(openai.NotFoundError):
            sdk.completions.create(model="nope", prompt="Hello", max_tokens=4)
    finally:
        sdk.close()


# -- bad input --------------------------------------------------------------------------------
BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [7] * 2048, "max_tokens": 4}, 400, "input_tokens"),
    ("/v1/completions", {"prompt": [1, 2, 512], "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": 7}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-5"}, 404, "model"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 9000}]}, 400, "input_tokens"),
    ("/detokenize", {"tokens": [100000]}, 400, "tokens"),
    ("/tokenize", {}, 400, "prompt"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{p}" for i, (p, *_rest) in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_openai_error_and_server_keeps_serving(client, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if status == 404:
        assert error["code"] == "model_not_found"
    assert complete(client, prompt="still alive", max_tokens=2)["choices"][0]["text"] is not None


def test_unknown_route_is_an_openai_404(client):
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


# -- disconnects and overload -----------------------------------------------------------------
def test_client_disconnect_mid_stream_aborts_the_sequence(client, replica):
    prompt = [3, 4, 5, 6]
    max_tokens = 2048 - len(prompt)
    generated_before = metric(client, "vllm:generation_tokens_total")
    with httpx.Client(base_url=replica.url, timeout=TIMEOUT) as other:
        with other.stream("POST", "/v1/completions",
                          json={"prompt": prompt, "max_tokens": max_tokens, "stream": True, **GREEDY}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            assert metric(client, "vllm:num_requests_running") == 1
        # leaving both blocks closes the connection mid-stream
    deadline = time.monotonic() + 10
    while metric(client, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "sequence still running after client disconnect"
        time.sleep(0.02)
    assert metric(client, "vllm:kv_cache_usage_perc") == 0.0  # its blocks went back to the pool
    generated = metric(client, "vllm:generation_tokens_total") - generated_before
    # The engine stopped long before max_tokens: the work was aborted, not just unobserved.
    assert generated < max_tokens / 2, generated
    assert complete(client, prompt="next one", max_tokens=3, **GREEDY)["usage"]["completion_tokens"] == 3


def test_full_waiting_queue_rejects_with_overloaded(tiny):
    async def scenario():
        # Not started: nothing leaves the queue, so the bound is exact.
        engine = Engine(tiny.model, tiny.config, tiny.tokenizer, max_model_len=tiny.max_model_len,
                        max_waiting=2)
        engine.submit([1, 2], SamplingParams(max_tokens=1))
        engine.submit([1, 2], SamplingParams(max_tokens=1))
        assert engine.num_waiting == 2
        with pytest.raises(Overloaded) as caught:
            engine.submit([1, 2], SamplingParams(max_tokens=1))
        assert caught.value.status == 429 and caught.value.retry_after_s >= 1

    asyncio.run(scenario())


def test_engine_interleaves_concurrent_requests_and_fails_only_the_bad_one(tiny):
    async def scenario():
        engine = Engine(tiny.model, tiny.config, tiny.tokenizer, max_model_len=tiny.max_model_len)
        engine.start()
        try:
            greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
            streams = [engine.submit([1, 2, 3 + i], greedy) for i in range(3)]
            bad = engine.submit([1, 2, 10_000], greedy)  # out of vocab: the embedding lookup fails

            arrivals = []  # (stream index) in the order tokens arrive

            async def collect(stream, index=-1):
                tokens = []
                async for ev in stream:
                    tokens.append(ev.token_id)
                    arrivals.append(index)
                return tokens

            results = await asyncio.wait_for(asyncio.gather(*(collect(s, i) for i, s in enumerate(streams)),
                                                            collect(bad), return_exceptions=True), 30)
            assert [len(r) for r in results[:3]] == [20, 20, 20]
            # Round robin: every request got its first token before any request finished.
            first_finish = min(len(arrivals) - arrivals[::-1].index(i) - 1 for i in range(3))
            assert all(arrivals.index(i) < first_finish for i in range(3)), arrivals
            assert isinstance(results[3], Exception)
            after = await asyncio.wait_for(collect(engine.submit([5, 6], greedy)), 30)
            assert len(after) == 20
        finally:
            engine.shutdown()

    asyncio.run(scenario())


# -- process lifecycle ------------------------------------------------------------------------
def test_sigterm_stops_the_replica_cleanly():
    with run_replica("tiny") as server:
        assert "replica ready model=tiny url=" + server.url in server.logs()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(20) == 0, server.logs()


def test_echo_prefixes_the_prompt_text(client):
    plain = complete(client, prompt="Hello there", max_tokens=4, **GREEDY)["choices"][0]["text"]
    echoed = complete(client, prompt="Hello there", max_tokens=4, echo=True, **GREEDY)["choices"][0]["text"]
    assert echoed == "Hello there" + plain


def test_errors_and_streams_carry_the_request_id(client):
    error = client.post("/v1/completions", json={"prompt": "hi", "model": "nope"}, headers={"x-request-id": "e-1"})
    assert error.status_code == 404 and error.headers["x-request-id"] == "e-1"
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True},
                       headers={"x-request-id": "s-1"}) as response:
        assert response.headers["x-request-id"] == "s-1"
        assert json.loads(next(response.iter_lines())[len("data: "):])["id"] == "cmpl-s-1"


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info", "/model_info", "/get_model_info"])
def test_router_registration_probes_answer(client, path):
    response = client.get(path)
    assert response.status_code == 200
    body = response.json()
    assert body["is_generation"] is True and body["model_path"] and body["tokenizer_path"]
    assert body["served_model_name"] == "tiny"
    if "server_info" in path:  # what an operator sizes a host from
        assert body["vocab_size"] == 512 and body["weight_bytes"] > 0 and body["kv_cache_bytes"] > 0


def test_metrics_carry_vllm_cache_and_scheduler_names(client):
    complete(client, prompt="metrics please", max_tokens=2, **GREEDY)
    text = client.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket"):
        assert f"\n{name}{{" in text, name
    assert metric(client, "vllm:prefix_cache_queries_total") > 0


def test_metrics_advertise_kv_capacity_like_vllm(client):
    """Routers size their prefix tables from vllm:cache_config_info{num_gpu_blocks=...}."""
    import re

    import torch

    from replica.loader import load_model
    from replica.model_runner import num_blocks_for_budget

    config = load_model("tiny").config
    expected = num_blocks_for_budget(config, 16, torch.float32, 0.25)  # the replica's defaults
    text = client.get("/metrics").text
    match = re.search(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"[^}]*\} 1\.0$', text, re.MULTILINE)
    assert match, text[:2000]
    assert int(match.group(1)) == expected
    assert 'block_size="16"' in match.group(0)
