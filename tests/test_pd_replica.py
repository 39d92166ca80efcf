"""Disaggregated prefill/decode between built-in replicas (vLLM's kv_transfer_params protocol):
one prefill + one decode tiny replica, driven the way vLLM's toy proxy drives its two legs."""
from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time

import httpx2 as httpx
import pytest

from protocol.kv_transfer import (INVALID_BLOCKS, INVALID_PARAMS, PROMPT_MISMATCH, REJECTED, ROLE_MISMATCH,
                                  TRANSFER_FAILED, UNKNOWN_ENGINE, UNKNOWN_REQUEST)
from replica.kv_pins import prompt_digest
from routing.hashing import block_hashes
from tests.servers import run_replica

TIMEOUT = httpx.Timeout(30.0)
GREEDY = {"temperature": 0, "ignore_eos": True}
BLOCK = 16
POLL_S = 0.05  # another process's state has no event to await: poll, bounded
# What the toy proxy sends to the prefill leg (remote_* null until the prefill replica fills them).
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture(scope="module")
def prefill():
    with run_replica("tiny", extra_args=["--role", "prefill"]) as server:
        yield server


@pytest.fixture(scope="module")
def decode():
    with run_replica("tiny", extra_args=["--role", "decode", "--kv-pull-timeout-s", "3"]) as server:
        yield server


@pytest.fixture(scope="module")
def mixed():
    with run_replica("tiny") as server:
        yield server


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=TIMEOUT) as client:
        yield client


# -- the proxy's two legs ------------------------------------------------------------------------
def prefill_leg(http, prefill_url: str, path: str, body: dict) -> dict:
    """vLLM's toy proxy: max_tokens=1, stream=false, no stream_options, kv_transfer_params asked."""
    leg = {k: v for k, v in body.items() if k != "stream_options"}
    leg.update(max_tokens=1, stream=False, kv_transfer_params=PREFILL_PARAMS)
    response = http.post(prefill_url + path, json=leg)
    assert response.status_code == 200, response.text
    params = response.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    return params


def decode_leg(http, decode_url: str, path: str, body: dict, params: dict) -> httpx.Response:
    return http.post(decode_url + path, json={**body, "kv_transfer_params": params})


def output_of(http, url: str, path: str, body: dict) -> tuple[list[int], str, dict]:
    """(token IDs, text, final message) of a request, streamed or not."""
    body = {**body, "return_token_ids": True}
    if not body.get("stream"):
        response = http.post(url + path, json=body)
        assert response.status_code == 200, response.text
        payload = response.json()
        choice = payload["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return choice["token_ids"], text, payload
    chunks = []
    with http.stream("POST", url + path, json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    token_chunks = [c for c in chunks if c["choices"] and "token_ids" in c["choices"][0]]  # not chat's role chunk
    ids = [t for c in token_chunks for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                   for c in token_chunks)
    final = next(c for c in token_chunks if c["choices"][0]["finish_reason"] is not None)
    return ids, text, final


def through_pd(http, prefill, decode, path: str, body: dict) -> tuple[list[int], str, dict]:
    params = prefill_leg(http, prefill.url, path, body)
    return output_of(http, decode.url, path, {**body, "kv_transfer_params": params})


def metric(http, url: str, name: str, **labels) -> float:
    total = 0.0
    for line in http.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for_metric(http, url: str, name: str, want: float, timeout_s: float = 20.0, at_most: bool = False,
                    **labels) -> None:
    """Until the metric reads `want` (or, `at_most`, no more than it), bounded."""
    deadline = time.monotonic() + timeout_s
    while (metric(http, url, name, **labels) > want) if at_most else (metric(http, url, name, **labels) != want):
        assert time.monotonic() < deadline, f"{name} never reached {want}: {metric(http, url, name, **labels)}"
        time.sleep(POLL_S)


def bytes_per_block(http, url: str) -> int:
    info = http.get(url + "/server_info").json()
    return info["kv_cache_bytes"] // (info["max_total_num_tokens"] // info["block_size"])


def token_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


# -- outputs ----------------------------------------------------------------------------------------
def _cases() -> list[tuple[str, dict]]:
    cases = []
    lengths = [1, 5, 15, 16, 17, 31, 32, 33, 47, 64, 90, 130]
    for i, length in enumerate(lengths):  # token prompts of every shape: partial and full last blocks
        cases.append(("/v1/completions", {"prompt": token_prompt(1000 + i, length), "max_tokens": 12}))
    shared = token_prompt(77, 48)  # prompts sharing blocks with each other (prefix hits on both sides)
    for i in range(4):
        cases.append(("/v1/completions", {"prompt": shared + token_prompt(2000 + i, 7 + 9 * i), "max_tokens": 10}))
    for text in ("Hello, world! How are you today?", "The scheduler batches sequences together; prefill fills "
                 "the cache and decode adds one token a step. Attention looks back at every previous token."):
        cases.append(("/v1/completions", {"prompt": text, "max_tokens": 16}))
    for text in ("What is the capital of France?", "Tell me a story about a robot who learns to paint."):
        cases.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 12}))
    return cases


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_greedy_outputs_through_prefill_and_decode_equal_a_mixed_replica(http, prefill, decode, mixed, stream):
    for path, body in _cases():
        body = {**body, **GREEDY, "stream": stream}
        expected_ids, expected_text, _ = output_of(http, mixed.url, path, body)
        ids, text, final = through_pd(http, prefill, decode, path, body)
        assert (ids, text) == (expected_ids, expected_text), (path, body)
        stats = final["kv_transfer_stats"]
        assert stats["recomputed"] is False and stats["blocks_pulled"] >= 1
        assert stats["kv_transfer_bytes"] == stats["blocks_pulled"] * bytes_per_block(http, decode.url)


def test_prefill_answer_carries_vllm_kv_transfer_params(http, prefill):
    prompt = token_prompt(3, 40)  # 2 full blocks + 8 tokens: 3 blocks
    response = http.post(prefill.url + "/v1/completions",
                         json={"prompt": prompt, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS,
                               **GREEDY})
    body = response.json()
    params = body["kv_transfer_params"]
    info = http.get(prefill.url + "/server_info").json()
    assert len(body["choices"][0]["text"]) >= 0 and body["usage"]["completion_tokens"] == 1
    assert params["remote_engine_id"] == info["kv_engine_id"]
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == prefill.port
    assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == 3  # one KV cache group
    assert params["remote_num_tokens"] == 40 and params["remote_request_id"]
    assert (params["tp_size"], params["transfer_mode"]) == (1, "pull")
    assert info["disaggregation_mode"] == "prefill"
    # a streamed prefill leg carries them on its final chunk, as vLLM 0.33 does
    _, _, final = output_of(http, prefill.url, "/v1/completions",
                            {"prompt": prompt, "max_tokens": 1, "stream": True, "kv_transfer_params": PREFILL_PARAMS})
    streamed_blocks = final["kv_transfer_params"]["remote_block_ids"][0]
    assert streamed_blocks[:2] == params["remote_block_ids"][0][:2]  # the full blocks: prefix-cache hits
    assert streamed_blocks[2] != params["remote_block_ids"][0][2]    # the partial one is its own (still pinned)


def test_server_info_reports_disaggregation_mode(http, decode, mixed):
    assert http.get(decode.url + "/server_info").json()["disaggregation_mode"] == "decode"
    assert http.get(mixed.url + "/server_info").json()["disaggregation_mode"] == "null"


# -- only the missing blocks move ---------------------------------------------------------------------
def test_second_request_sharing_a_prefix_pulls_only_the_missing_blocks(http, prefill, decode):
    per_block = bytes_per_block(http, decode.url)
    first = token_prompt(11, 5 * BLOCK + 5)               # 5 full blocks + 5 tokens
    second = first[:5 * BLOCK] + token_prompt(12, 20)     # shares 5 blocks; 6 full + 4: 7 blocks
    body = {"max_tokens": 4, **GREEDY}
    _, _, one = through_pd(http, prefill, decode, "/v1/completions", {**body, "prompt": first})
    assert (one["kv_transfer_stats"]["blocks_local"], one["kv_transfer_stats"]["blocks_pulled"]) == (0, 6)
    received_before = metric(http, decode.url, "kvgate:kv_transfer_bytes_total", direction="received")
    sent_before = metric(http, prefill.url, "kvgate:kv_transfer_bytes_total", direction="sent")
    _, _, two = through_pd(http, prefill, decode, "/v1/completions", {**body, "prompt": second})
    stats = two["kv_transfer_stats"]
    assert (stats["blocks_local"], stats["blocks_pulled"]) == (5, 2)
    assert stats["kv_transfer_bytes"] == 2 * per_block
    received = metric(http, decode.url, "kvgate:kv_transfer_bytes_total", direction="received") - received_before
    sent = metric(http, prefill.url, "kvgate:kv_transfer_bytes_total", direction="sent") - sent_before
    assert received == sent == 2 * per_block
    # vLLM's usage: prompt tokens served without computing them here (local + pulled)
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] == len(second)


def test_pulled_blocks_enter_the_decode_prefix_cache(http, prefill, decode):
    prompt = token_prompt(21, 3 * BLOCK + 3)
    through_pd(http, prefill, decode, "/v1/completions", {"prompt": prompt, "max_tokens": 2, **GREEDY})
    cached = set(http.get(decode.url + "/kvgate/cache").json()["block_hashes"])
    assert set(block_hashes(prompt, BLOCK)) <= cached  # committed, so published as KV events too


# -- pinned blocks are freed ----------------------------------------------------------------------------
def test_pinned_blocks_are_freed_after_the_pull(http, prefill, decode):
    prompt = token_prompt(31, 70)
    pinned_before = metric(http, prefill.url, "kvgate:kv_pinned_blocks")  # other tests' unpulled pins
    in_use_before = metric(http, prefill.url, "vllm:kv_cache_usage_perc")
    pulled_before = metric(http, prefill.url, "kvgate:kv_pins_pulled_total")
    params = prefill_leg(http, prefill.url, "/v1/completions", {"prompt": prompt, **GREEDY})
    assert metric(http, prefill.url, "kvgate:kv_pinned_blocks") == pinned_before + 5
    assert metric(http, prefill.url, "vllm:kv_cache_usage_perc") > in_use_before
    response = decode_leg(http, decode.url, "/v1/completions", {"prompt": prompt, "max_tokens": 3, **GREEDY}, params)
    assert response.status_code == 200, response.text
    assert metric(http, prefill.url, "kvgate:kv_pinned_blocks") == pinned_before
    assert metric(http, prefill.url, "kvgate:kv_pins_pulled_total") == pulled_before + 1
    # Back in the pool, not just unlisted. At most: a block an earlier test's request still held
    # when in_use_before was read can be freed meanwhile (seen once in CI: one block below).
    wait_for_metric(http, prefill.url, "vllm:kv_cache_usage_perc", in_use_before, at_most=True)


def test_a_pull_of_no_blocks_only_releases_the_pin(http, prefill):
    """What a decode replica holding every block would send (vLLM's notify-only read)."""
    prompt = token_prompt(35, 20)
    params = prefill_leg(http, prefill.url, "/v1/completions", {"prompt": prompt, **GREEDY})
    info = http.get(prefill.url + "/server_info").json()
    layout = {"num_layers": 2, "block_size": BLOCK, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}  # tiny
    assert info["kv_cache_bytes"] // (info["max_total_num_tokens"] // BLOCK) == 2 * 2 * BLOCK * 2 * 16 * 4
    pull = {"engine_id": params["remote_engine_id"], "request_id": params["remote_request_id"], "block_ids": [],
            "layout": layout, "prompt_digest": prompt_digest(prompt, None), "num_prompt_tokens": len(prompt)}
    pinned = metric(http, prefill.url, "kvgate:kv_pinned_blocks")
    response = http.post(prefill.url + "/kvgate/kv/pull", json=pull)
    assert response.status_code == 200 and response.content == b""
    assert metric(http, prefill.url, "kvgate:kv_pinned_blocks") == pinned - 2
    again = http.post(prefill.url + "/kvgate/kv/pull", json=pull)
    assert again.status_code == 404 and again.json()["error"]["code"] == UNKNOWN_REQUEST


def test_pinned_blocks_are_freed_when_the_lease_runs_out(http, decode, mixed):
    # 8 blocks of 16 tokens (tiny: 8 KB a block): one pin can starve the pool until its lease ends
    small = ["--kv-cache-gb", "0.00006104", "--kv-lease-duration-s", "1"]
    with run_replica("tiny", extra_args=["--role", "prefill", *small]) as short_lease:
        assert http.get(short_lease.url + "/server_info").json()["max_total_num_tokens"] == 8 * BLOCK
        body = {"prompt": token_prompt(41, 90), "max_tokens": 6, **GREEDY}
        params = prefill_leg(http, short_lease.url, "/v1/completions", body)  # pins 6 of the 8 blocks
        # needs 4 blocks: waits (the worker sleeps until the lease ends, no spinning), then runs
        waiting = {"prompt": token_prompt(42, 50), "max_tokens": 10, **GREEDY}
        assert output_of(http, short_lease.url, "/v1/completions", waiting)[0] == \
            output_of(http, mixed.url, "/v1/completions", waiting)[0]
        assert metric(http, short_lease.url, "kvgate:kv_pins_expired_total") == 1
        assert metric(http, short_lease.url, "kvgate:kv_pinned_blocks") == 0
        wait_for_metric(http, short_lease.url, "vllm:kv_cache_usage_perc", 0.0)
        assert "kv_pin_expired" in short_lease.logs()
        late = decode_leg(http, decode.url, "/v1/completions", body, params)
        assert late.status_code == 404 and late.json()["error"]["code"] == UNKNOWN_REQUEST
        # a request that asked for it recomputes instead
        ids, _, final = output_of(http, decode.url, "/v1/completions",
                                  {**body, "kv_transfer_params": {**params, "kv_load_failure_policy": "recompute"}})
        assert final["kv_transfer_stats"]["recomputed"] is True
        assert ids == output_of(http, mixed.url, "/v1/completions", body)[0]


# -- failures are fast and explicit ----------------------------------------------------------------------
def test_prefill_killed_before_the_pull_fails_fast_or_recomputes(http, decode, mixed):
    body = {"prompt": token_prompt(51, 50), "max_tokens": 8, **GREEDY}
    with run_replica("tiny", extra_args=["--role", "prefill"]) as doomed:
        params = prefill_leg(http, doomed.url, "/v1/completions", body)
        doomed.proc.kill()
        doomed.proc.wait(10)
    failed = decode_leg(http, decode.url, "/v1/completions", body, params)
    assert failed.status_code == 502
    error = failed.json()["error"]
    assert error["code"] == TRANSFER_FAILED and f"127.0.0.1:{params['remote_port']}" in error["message"]
    for stream in (False, True):
        ids, _, final = output_of(http, decode.url, "/v1/completions",
                                  {**body, "stream": stream,
                                   "kv_transfer_params": {**params, "kv_load_failure_policy": "recompute"}})
        assert final["kv_transfer_stats"]["recomputed"] is True and final["kv_transfer_stats"]["error"]
        assert ids == output_of(http, mixed.url, "/v1/completions", body)[0]
    assert metric(http, decode.url, "kvgate:kv_pulls_total", result="failed") >= 1
    assert metric(http, decode.url, "kvgate:kv_pulls_total", result="recomputed") >= 2


class FakePrefill:
    """A raw TCP server standing in for a prefill replica that misbehaves: `truncate` answers the
    pull's headers and half its bytes, then closes; `stall` never answers; `foreign` is some other
    HTTP server (404 page)."""

    def __init__(self, mode: str, bytes_per_block: int):
        self.mode = mode
        self.bytes_per_block = bytes_per_block
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                with conn:
                    if self.stop.is_set():  # close()'s wake-up connection
                        return
                    head, body = self._read_request(conn)
                    if self.mode == "stall":
                        self.stop.wait(30)  # until the test ends (the puller gives up first)
                    elif self.mode == "foreign":
                        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Type: text/html\r\n"
                                     b"Content-Length: 9\r\nConnection: close\r\n\r\nnot here!")
                    else:
                        size = len(json.loads(body)["block_ids"]) * self.bytes_per_block
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                                     b"Content-Length: %d\r\n\r\n" % size + b"\0" * (size // 2))

    @staticmethod
    def _read_request(conn: socket.socket) -> tuple[bytes, bytes]:
        data = b""
        while b"\r\n\r\n" not in data:
            more = conn.recv(65536)
            if not more:
                raise OSError("the client went away")
            data += more
        head, body = data.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(body) < length:
            more = conn.recv(65536)
            if not more:
                raise OSError("the client went away")
            body += more
        return head, body

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):  # wake a thread blocked in accept()
            socket.create_connection(("127.0.0.1", self.port), timeout=5).close()
        self.thread.join(10)
        self.listener.close()


@pytest.mark.parametrize("mode,status,code,words", [
    ("truncate", 502, TRANSFER_FAILED, "cut short"),
    ("stall", 502, TRANSFER_FAILED, "timed out after 3s"),
    ("foreign", 400, REJECTED, "do not name a kvgate prefill replica"),
])
def test_a_misbehaving_prefill_gets_a_clear_error_never_a_hang(http, prefill, decode, mode, status, code, words):
    body = {"prompt": token_prompt(61, 40), "max_tokens": 4, **GREEDY}
    params = prefill_leg(http, prefill.url, "/v1/completions", body)
    fake = FakePrefill(mode, bytes_per_block(http, decode.url))
    try:
        response = decode_leg(http, decode.url, "/v1/completions", body, {**params, "remote_port": fake.port})
    finally:
        fake.close()
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and words in error["message"]
    # the real pin is untouched: the decode leg against the real prefill replica still works
    assert decode_leg(http, decode.url, "/v1/completions", body, params).status_code == 200


def test_forged_kv_transfer_params_get_a_clear_4xx(http, prefill, decode, mixed):
    prompt = token_prompt(71, 40)
    body = {"prompt": prompt, "max_tokens": 4, **GREEDY}
    params = prefill_leg(http, prefill.url, "/v1/completions", body)
    forged = [
        ({**params, "remote_engine_id": "kvgate-0000"}, 404, UNKNOWN_ENGINE),
        ({**params, "remote_request_id": "guessed"}, 404, UNKNOWN_REQUEST),
        ({**params, "remote_block_ids": [[900, 901, 902]]}, 400, INVALID_BLOCKS),
        ({**params, "remote_block_ids": [[0]]}, 400, INVALID_PARAMS),            # fewer blocks than the prompt
        ({**params, "remote_port": mixed.port}, 404, UNKNOWN_ENGINE),            # another replica
        ({**params, "remote_port": decode.port}, 404, UNKNOWN_ENGINE),           # the decode replica itself
        ({k: v for k, v in params.items() if k != "remote_host"}, 400, INVALID_PARAMS),
        ({**params, "remote_host": "bad host/x"}, 400, INVALID_PARAMS),
        ({**params, "remote_port": 0}, 400, INVALID_PARAMS),
        ({**params, "tp_size": 2}, 400, INVALID_PARAMS),
        ({**params, "remote_block_ids": [[1], [2]]}, 400, INVALID_PARAMS),
        ({**params, "do_remote_decode": True}, 400, INVALID_PARAMS),
        ({**params, "remote_port": "8000x"}, 400, "invalid_type"),
    ]
    for forged_params, status, code in forged:
        response = decode_leg(http, decode.url, "/v1/completions", body, forged_params)
        assert response.status_code == status, (forged_params, response.text)
        assert response.json()["error"]["code"] == code, response.text
    other_prompt = decode_leg(http, decode.url, "/v1/completions", {**body, "prompt": prompt[:-1] + [7]}, params)
    assert other_prompt.status_code == 409 and other_prompt.json()["error"]["code"] == PROMPT_MISMATCH
    # none of that consumed the pin: the genuine decode leg still gets its blocks
    genuine = decode_leg(http, decode.url, "/v1/completions", body, params)
    assert genuine.status_code == 200 and genuine.json()["kv_transfer_stats"]["blocks_pulled"] == 3
    assert http.get(decode.url + "/health").status_code == 200 and http.get(prefill.url + "/health").status_code == 200


def test_each_role_refuses_the_other_sides_leg(http, prefill, decode):
    body = {"prompt": "hello", "max_tokens": 2}
    to_decode = http.post(decode.url + "/v1/completions", json={**body, "kv_transfer_params": PREFILL_PARAMS})
    assert to_decode.status_code == 400 and to_decode.json()["error"]["code"] == ROLE_MISMATCH
    params = {**PREFILL_PARAMS, "do_remote_decode": False, "do_remote_prefill": True}
    to_prefill = http.post(prefill.url + "/v1/completions", json={**body, "kv_transfer_params": params})
    assert to_prefill.status_code == 400 and to_prefill.json()["error"]["code"] == ROLE_MISMATCH
    for url in (prefill.url, decode.url):  # plain requests are served by every role, as vLLM does
        assert http.post(url + "/v1/completions", json=body).status_code == 200


def test_a_mixed_replica_serves_both_legs(http, mixed):
    body = {"prompt": token_prompt(81, 37), "max_tokens": 6, **GREEDY}
    expected = output_of(http, mixed.url, "/v1/completions", body)[0]
    params = prefill_leg(http, mixed.url, "/v1/completions", body)
    ids, _, final = output_of(http, mixed.url, "/v1/completions", {**body, "kv_transfer_params": params})
    assert ids == expected
    # its own cache already held the full blocks: only the last (partial) block moved
    assert (final["kv_transfer_stats"]["blocks_local"], final["kv_transfer_stats"]["blocks_pulled"]) == (2, 1)


# -- the pieces, without processes -----------------------------------------------------------------------
def _scheduler_with_cached(prompt: list[int], block_size: int = 4, num_blocks: int = 16):
    """A scheduler whose prefix cache holds `prompt`'s full blocks (one finished request)."""
    from replica.block_pool import BlockPool
    from replica.scheduler import Scheduler, Sequence
    pool = BlockPool(num_blocks, block_size)
    scheduler = Scheduler(pool, max_num_batched_tokens=64)
    warm = Sequence("warm", prompt, max_tokens=1)
    scheduler.add(warm)
    chunks = scheduler.schedule()
    scheduler.update(chunks, {id(warm): 7})
    scheduler.finish(warm)
    return pool, scheduler


def test_remote_admission_computes_all_but_the_last_token_and_skips_blocks_held_locally():
    from replica.scheduler import RemoteKV, Sequence
    prompt = list(range(1, 19))                       # 18 tokens, 4-token blocks: 4 full + 2
    pool, scheduler = _scheduler_with_cached(prompt[:8])  # 2 blocks cached here
    sequence = Sequence("d", prompt, max_tokens=3)
    sequence.remote_kv = RemoteKV(first_block=1)      # the pull saw 1 block locally; now 2 are
    scheduler.add(sequence)
    (chunk,) = scheduler.schedule()
    remote = sequence.remote_kv
    assert (chunk.start, chunk.num_tokens, chunk.samples) == (17, 1, True)  # only the last token runs
    assert remote.skip_blocks == 1 and len(remote.target_block_ids) == 3 and not remote.stale
    assert sequence.block_ids[2:] == remote.target_block_ids and len(sequence.block_ids) == 5
    assert len(sequence.block_hashes) == 4 and len(pool.cached_hashes()) == 4  # pulled full blocks committed
    assert sequence.num_cached_tokens == 18                                     # vLLM: local + transferred
    assert scheduler.stats.prefix_cache_hits == 8                                # local hits only


def test_remote_admission_is_stale_when_blocks_the_pull_relied_on_were_evicted():
    from replica.scheduler import RemoteKV, Sequence
    prompt = list(range(1, 19))
    pool, scheduler = _scheduler_with_cached(prompt[:8], num_blocks=8)
    hog = Sequence("hog", list(range(100, 128)), max_tokens=1)  # 7 of 8 blocks: evicts a cached one
    scheduler.add(hog)
    scheduler.update(scheduler.schedule(), {})
    scheduler.finish(hog)
    assert block_hashes(prompt[:8], 4)[1] not in pool.cached_hashes()
    sequence = Sequence("d", prompt, max_tokens=3)
    sequence.remote_kv = RemoteKV(first_block=2)
    scheduler.add(sequence)
    (chunk,) = scheduler.schedule()
    assert sequence.remote_kv.stale and sequence.remote_kv.target_block_ids is None
    assert (chunk.start, chunk.num_tokens) == (4, 14)  # computed here, after the block still cached


def test_pin_table_claims_once_and_expires_by_lease():
    from replica.kv_pins import PinTable
    pins = PinTable(lease_s=30)
    pins.add("a", [1, 2], 20, 20, 123, now_s=100.0)
    pins.add("b", [3], 5, 5, 456, now_s=110.0)
    assert (len(pins), pins.num_blocks, pins.next_expiry_s()) == (2, 3, 130.0)
    assert pins.claim("a").block_ids == [1, 2] and pins.claim("a") is None
    assert pins.expire(now_s=139.9) == [] and [p.pin_id for p in pins.expire(now_s=140.0)] == ["b"]
    assert (len(pins), pins.num_blocks, pins.claimed_total, pins.expired_total) == (0, 0, 1, 1)


def test_packed_blocks_unpack_to_the_same_tensors():
    import numpy as np
    import torch

    from replica.kv_codec import StagedKV, pack_blocks, unpack_blocks
    shape = (8, 4, 2, 3)  # blocks, block size, kv heads, head dim
    source = [(torch.randn(shape), torch.randn(shape)) for _ in range(2)]
    target = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(2)]
    data = np.frombuffer(pack_blocks(source, [5, 1, 6]), dtype=np.uint8).copy()
    assert len(data) == 3 * 2 * 2 * 4 * 2 * 3 * 4
    unpack_blocks(target, StagedKV(first_block=0, num_blocks=3, data=data), skip_blocks=1, block_ids=[2, 7])
    for (k, v), (k2, v2) in zip(source, target):
        assert torch.equal(k2[2], k[1]) and torch.equal(k2[7], k[6]) and torch.equal(v2[7], v[6])
        assert not k2[5].any()  # the skipped block was not written
    assert len(pack_blocks(source, [])) == 0  # a release-only pull
