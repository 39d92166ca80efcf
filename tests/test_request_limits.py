"""What a request may ask of a built-in replica, end to end through the gateway: the context the
replica serves (capped to its KV cache, or refused at start), max_tokens left out running to that
context, vLLM's 400 for a prompt past it, and a 400 naming every field the engine does not honour.
Real processes on loopback: a tiny replica with an 8-block KV cache behind `kvgate serve`."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import subprocess
import sys

import openai
import pytest

from tests.servers import REPO_ROOT, free_port, run_gateway, run_replica
from tests.test_gateway import Gateway, http

TINY_KV_BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 tokens, 2 kv heads, dim 16, fp32
SMALL_CACHE_BLOCKS = 8
SMALL_CONTEXT = SMALL_CACHE_BLOCKS * 16             # the tiny model's own context is 2048
GREEDY = {"temperature": 0, "ignore_eos": True}


def kv_gb(blocks: int) -> str:
    return f"{(blocks + 0.5) * TINY_KV_BYTES_PER_BLOCK / (1 << 30):.12f}"  # half a block over: no rounding loss


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with contextlib.ExitStack() as stack:
        replica = stack.enter_context(run_replica("tiny", extra_args=["--kv-cache-gb", kv_gb(SMALL_CACHE_BLOCKS)]))
        port = free_port()
        config = tmp_path_factory.mktemp("limits") / "gateway.yaml"
        config.write_text(
            f"gateway: {{host: 127.0.0.1, port: {port}, request_timeout_s: 120}}\n"
            "logging: {level: info, format: json}\nrouting: {policy: round_robin}\n"
            f"replicas:\n  - {{name: r0, url: '{replica.url}', model: tiny}}\n")
        yield Gateway(stack.enter_context(run_gateway(config, port)), [replica])


def test_replica_caps_its_context_to_the_kv_cache_and_says_so(gateway):
    replica = gateway.replicas["r0"]
    for url in (replica.url, gateway.url):
        status, _, models = http("GET", url + "/v1/models")
        assert status == 200 and models["data"][0]["max_model_len"] == SMALL_CONTEXT
    capped = [json.loads(line) for line in replica.logs().splitlines() if '"max_model_len_capped"' in line]
    assert capped and (capped[0]["model_max_len"], capped[0]["max_model_len"]) == (2048, SMALL_CONTEXT)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_without_max_tokens_runs_to_the_context(gateway, stream):
    messages = [{"role": "user", "content": "Tell me a story about a robot."}]
    if stream:
        chunks = list(gateway.client.chat.completions.create(
            model="tiny", messages=messages, stream=True, stream_options={"include_usage": True},
            extra_body=GREEDY))
        usage = chunks[-1].usage
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        answer = gateway.client.chat.completions.create(model="tiny", messages=messages, extra_body=GREEDY)
        usage, finish = answer.usage, [answer.choices[0].finish_reason]
    assert finish == ["length"]
    assert usage.prompt_tokens + usage.completion_tokens == SMALL_CONTEXT and usage.completion_tokens > 64


def test_concurrent_requests_that_each_fill_the_cache_all_finish(gateway):
    """Blocks are taken as tokens are generated, not reserved for max_tokens: three requests whose
    full length is the whole pool are all admitted and finish (the pool preempts and recomputes)."""
    def run(index: int):
        return gateway.client.completions.create(model="tiny", prompt=f"Story number {index}:",
                                                 max_tokens=SMALL_CONTEXT, extra_body=GREEDY)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(run, range(3)))
    for answer in answers:
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage.prompt_tokens + answer.usage.completion_tokens == SMALL_CONTEXT
    status, _, alone = http("POST", gateway.replicas["r0"].url + "/v1/completions",
                            {"prompt": "Story number 0:", "max_tokens": SMALL_CONTEXT, **GREEDY})
    assert status == 200 and alone["choices"][0]["text"] == answers[0].choices[0].text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where", ["gateway", "replica"])
def test_prompt_longer_than_the_context_gets_vllms_400(gateway, where, stream):
    url = gateway.url if where == "gateway" else gateway.replicas["r0"].url
    body = {"model": "tiny", "prompt": [7] * (SMALL_CONTEXT + 5), "max_tokens": 4, "stream": stream}
    status, _, answer = http("POST", url + "/v1/completions", body)
    assert status == 400, answer
    assert answer["error"]["message"] == (
        f"This model's maximum context length is {SMALL_CONTEXT} tokens. However, your prompt contains "
        f"{SMALL_CONTEXT + 5} input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt.")
    assert answer["error"]["param"] == "input_tokens" and answer["error"]["type"] == "invalid_request_error"
    status, _, answer = http("POST", url + "/v1/completions", {**body, "prompt": [7] * SMALL_CONTEXT})
    assert status == 400 and "(at least 1)" in answer["error"]["message"]


def test_max_tokens_past_the_room_left_is_capped_and_past_the_context_refused(gateway):
    prompt = [5] * 100
    answer = gateway.client.completions.create(model="tiny", prompt=prompt, max_tokens=100, extra_body=GREEDY)
    assert answer.usage.completion_tokens == SMALL_CONTEXT - 100 and answer.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.client.completions.create(model="tiny", prompt=prompt, max_tokens=SMALL_CONTEXT + 1)
    assert caught.value.body["param"] == "max_tokens"
    assert caught.value.body["message"].startswith(f"max_tokens={SMALL_CONTEXT + 1} cannot be greater than "
                                                   f"max_model_len={SMALL_CONTEXT}")


# Each field the engine does not honour, with a value that asks for it. OpenAI's clients send these.
UNHONOURED = [
    ("logprobs", True), ("top_logprobs", 3), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "required"), ("response_format", {"type": "json_object"}), ("presence_penalty", 0.5),
    ("frequency_penalty", 1.0), ("repetition_penalty", 1.2), ("logit_bias", {"42": 5}), ("best_of", 2),
    ("min_p", 0.1), ("min_tokens", 4), ("guided_json", {"type": "object"}), ("prompt_logprobs", 1),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field,value", UNHONOURED, ids=[name for name, _ in UNHONOURED])
def test_a_field_the_replica_does_not_honour_is_a_400_naming_it(gateway, field, value, stream):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "stream": stream, field: value}
    status, _, answer = http("POST", gateway.url + "/v1/chat/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == field and f"`{field}`" in answer["error"]["message"]
    assert answer["error"]["code"] == "unsupported_parameter"
    status, _, direct = http("POST", gateway.replicas["r0"].url + "/v1/chat/completions", body)
    assert (status, direct) == (400, answer)  # the gateway passes the replica's 400 through unchanged


def test_completions_logprobs_zero_asks_for_logprobs(gateway):
    status, _, answer = http("POST", gateway.url + "/v1/completions",
                             {"model": "tiny", "prompt": "hi", "max_tokens": 2, "logprobs": 0})
    assert status == 400 and answer["error"]["param"] == "logprobs"


def test_not_used_values_of_those_fields_are_served(gateway):
    """Clients that always send the neutral values (LangChain sends penalties of 0, agents `tools: []`)."""
    neutral = {"logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none",
               "response_format": {"type": "text"}, "presence_penalty": 0, "frequency_penalty": 0.0,
               "repetition_penalty": 1.0, "logit_bias": {}, "best_of": 1, "min_p": 0, "min_tokens": 0,
               "parallel_tool_calls": True, "user": "someone", "store": False}
    for stream in (False, True):
        answer = gateway.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=stream,
            extra_body={**neutral, "ignore_eos": True},
            **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            # Three sampled tokens of the tiny model can decode to no text (a byte of a character),
            # so the stream is judged by what it says it generated and how it ended.
            chunks = list(answer)
            assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] \
                == ["length"]
            assert chunks[-1].usage.completion_tokens == 3
        else:
            assert answer.usage.completion_tokens == 3


def _replica_exit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replica", "--model", "tiny", "--port", "0", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_a_max_model_len_the_cache_cannot_hold_is_refused_with_both_numbers():
    done = _replica_exit("--kv-cache-gb", kv_gb(SMALL_CACHE_BLOCKS), "--max-model-len", "1024")
    assert done.returncode == 2
    assert ("--max-model-len 1024 needs 64 KV cache blocks for one sequence, but the KV cache holds 8 blocks "
            f"({SMALL_CONTEXT} tokens)") in done.stderr
    done = _replica_exit("--max-model-len", "4096")
    assert done.returncode == 2 and "greater than the model's context (2048 tokens" in done.stderr


def test_an_explicit_max_model_len_is_served():
    with run_replica("tiny", extra_args=["--max-model-len", "64"]) as replica:
        status, _, models = http("GET", replica.url + "/v1/models")
        assert models["data"][0]["max_model_len"] == 64
        status, _, answer = http("POST", replica.url + "/v1/completions", {"prompt": [3] * 60, **GREEDY})
        assert status == 200 and answer["usage"]["completion_tokens"] == 4  # 16 asked, 4 fit
        assert not any('"max_model_len_capped"' in line for line in replica.logs().splitlines())
