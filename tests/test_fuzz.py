"""Hostile input, a few thousand times: every malformed or abusive request gets a 4xx in OpenAI's
shape, the server stays up with bounded memory, and the next good request is served.

The same cases (seeded, so a failure reproduces) go to a real gateway and, directly, to the real
built-in replica behind it. The replica serves the tiny model with a chat template that raises
(`raise_exception` on a tool message or on "RAISE", an undefined function on a leading assistant
message), so template errors are exercised on both. Each case is invalid by construction: a body
that might otherwise be served ends with `"n": 0`, which both servers refuse.

Kinds: random bytes, truncated JSON, invalid UTF-8, every field with wrong types and out-of-range
values (huge integers and floats included), deep and wide nesting, 10 MB bodies, a gzip bomb,
unhonoured fields, bad kv_transfer_params, hostile x-request-id / session / auth headers, bad
paths and methods, and raw HTTP that aiohttp's parser refuses (too many or too long headers, bad
request lines, bad Content-Length, broken chunked encoding)."""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import gzip
import http.client
import json
import random
import shutil
import socket
import threading
from dataclasses import dataclass, field

import pytest

from replica.tiny import CHATML_TEMPLATE, tiny_checkpoint_dir
from tests.servers import free_port, run_gateway, run_replica
from tests.test_gateway import http as call

SEED = 20240601
MODEL = "fuzz"
WORKERS = 8
MIN_CASES = 2000
RSS_GROWTH_LIMIT_MB = 256      # resident memory after the run vs before (allocator arenas stay)
PEAK_GROWTH_LIMIT_MB = 768     # the peak during the run vs before (8 MiB bodies in flight, 8 at a time)

RAISING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "{% if 'RAISE' in message['content'] %}{{ raise_exception('this template refuses RAISE') }}{% endif %}"
    "{% if loop.first and message['role'] == 'assistant' %}{{ no_such_function() }}{% endif %}"
    "{% endfor %}" + CHATML_TEMPLATE)


@dataclass
class Case:
    kind: str
    body: bytes = b""
    method: str = "POST"
    path: str = "/v1/completions"
    headers: dict = field(default_factory=dict)
    raw: bytes | None = None  # a whole HTTP request written to a socket as is

    def describe(self) -> str:
        shown = self.raw if self.raw is not None else self.body
        return f"{self.kind} {self.method} {self.path} {self.headers} {shown[:160]!r}"


def _body(value: dict | list) -> bytes:
    return json.dumps(value).encode()


def _anchored(value: dict) -> bytes:
    """A body whose only sure fault may be junk a server ignores: `"n": 0` last makes it a 400 anywhere."""
    return _body({**value, "n": 0})


COMPLETION = {"model": MODEL, "prompt": "hello there", "max_tokens": 1}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

# Values that are wrong for each field: wrong types, out of range, or refused by a rule.
BAD_VALUES = {
    "model": [5, [], {}, True, "m" * 2000, "", "no-such-model"],
    "max_tokens": [0, -1, 10 ** 30, "5", 1.5, [], True, (1 << 20) + 1],
    "temperature": [-0.1, 2.5, "hot", [], True, {}],
    "top_p": [0, 1.5, -1, "x", []],
    "top_k": [-2, 10 ** 30, "x", 1.5],
    "seed": [10 ** 30, -(10 ** 30), "x", 1.5, 2 ** 63],
    "n": [0, 2, 129, "x", -1],
    "stop": [5, ["a"] * 17, ["x" * 300], [1], {}, "x" * 300, [None]],
    "stop_token_ids": [[-1], [10 ** 30], "x", [1.5], [[1]]],
    "stream": ["yes", 1, [], {}],
    "stream_options": ["x", {"include_usage": "x"}, [], 5],
    "user": [5, "u" * 300, [], {}],
    "cache_salt": [5, "c" * 300, []],
    "return_token_ids": ["x", 5, []],
    "skip_special_tokens": ["x", 2],
    "ignore_eos": ["x", {}],
    "logprobs": [True, 3], "top_logprobs": [5], "tools": [[{"type": "function", "function": {"name": "f"}}]],
    "logit_bias": [{"1": 5}], "response_format": [{"type": "json_object"}], "min_p": [0.5],
    "presence_penalty": [1.0], "best_of": [3], "guided_json": [{"type": "object"}], "prompt_logprobs": [1],
    "kv_transfer_params": ["x", {"remote_port": "x"}, {"do_remote_decode": "yes"}, {"remote_block_ids": "x"}, [], 5],
}
COMPLETION_BAD = {
    "prompt": [5, {}, True, [], [[]], [-1], [10 ** 30], [1.5], ["a", "b"], [1, "a"], "", None, [[1], [2]],
               [2 ** 31], [[-5]], [{}]],
    "echo": ["x", 1],
}
CHAT_BAD = {
    "messages": [[], "x", None, [{"role": "robot", "content": "x"}], [{"content": "x"}],
                 [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url"}]}],
                 [{"role": "user", "content": [{"type": "text"}]}], [{"role": "tool", "content": "x"}],
                 [{"role": "user", "content": "please RAISE"}], [{"role": "assistant", "content": "x"}],
                 [{"role": "user", "content": "x", "name": 5}], [{"role": "user", "content": {"a": 1}}],
                 [{"role": "user", "content": [{"type": "text", "text": 5}]}], [[1]]],
    "max_completion_tokens": [0, -1, "x", 10 ** 30],
    "add_generation_prompt": ["x", 3],
}


def _deep(depth: int, opener: str = "[") -> bytes:
    closer = "]" if opener == "[" else "}"
    inner = '{"a":' * depth + "1" + "}" * depth if opener == "{" else opener * depth + closer * depth
    return inner.encode()


def build_cases(rng: random.Random) -> list[Case]:
    cases: list[Case] = []
    bases = (("/v1/completions", COMPLETION, COMPLETION_BAD), ("/v1/chat/completions", CHAT, CHAT_BAD))
    # Every field with every bad value, on both endpoints.
    for path, base, own in bases:
        for name, values in {**BAD_VALUES, **own}.items():
            for value in values:
                cases.append(Case(f"field:{name}", _body({**base, name: value}), path=path))
                rest = {k: v for k, v in base.items() if k != name}
                cases.append(Case(f"field-first:{name}", _body({name: value, **rest}), path=path))
    # Huge numbers written out as text (thousands of digits; floats past the double range).
    for path, base, _ in bases:
        for name in ("max_tokens", "seed", "top_k", "temperature", "n"):
            for digits in (20, 400, 4400, 20000):
                text = _body({**base, name: 0}).replace(f'"{name}": 0'.encode(), f'"{name}": 1{"0" * digits}'.encode())
                cases.append(Case(f"digits:{name}", text, path=path))
            for literal in (b"1e400", b"-1e400", b"123456789012345678901234567890.5", b"-0.5e999"):
                text = _body({**base, name: 0}).replace(f'"{name}": 0'.encode(), f'"{name}": '.encode() + literal)
                cases.append(Case(f"float:{name}", text, path=path))
        cases.append(Case("digits:prompt-id", b'{"model": "fuzz", "prompt": [1' + b"0" * 5000 + b"]}"))
    # Deep nesting in an unknown field, in the prompt, in messages.
    for depth in (40, 65, 200, 900, 1100, 5000, 100_000):
        for opener in "[{":
            junk = _deep(depth, opener)
            cases.append(Case(f"deep:{depth}{opener}", b'{"model": "fuzz", "prompt": "x", "z": ' + junk + b', "n": 0}'))
            cases.append(Case(f"deep-prompt:{depth}{opener}", b'{"model": "fuzz", "prompt": ' + junk + b"}"))
            cases.append(Case(f"deep-messages:{depth}{opener}", b'{"model": "fuzz", "messages": ' + junk + b"}",
                              path="/v1/chat/completions"))
    # Wide: many small containers (cheap to send, costly to decode into Python objects).
    for count in (2_000, 150_000, 1_000_000):
        for item in (b"[]", b"{}"):
            junk = b"[" + b",".join([item] * count) + b"]"
            cases.append(Case(f"wide:{count}", b'{"model": "fuzz", "prompt": "x", "z": ' + junk + b', "n": 0}'))
    # 10 MB bodies and a gzip bomb.
    ten_mb = 10 * 1024 * 1024
    cases.append(Case("10MB:prompt", _anchored({"model": MODEL, "prompt": "x" * ten_mb})))
    cases.append(Case("10MB:ids", b'{"model": "fuzz", "prompt": [' + b"7," * (ten_mb // 2) + b'7], "n": 0}'))
    cases.append(Case("10MB:bytes", rng.randbytes(ten_mb)))
    cases.append(Case("10MB:nest", b"[" * ten_mb))
    cases.append(Case("10MB:stop", _anchored({"model": MODEL, "prompt": "x", "stop": ["s" * ten_mb]})))
    cases.append(Case("10MB:messages", _anchored({"model": MODEL, "messages": [{"role": "user", "content": "y"}] * 400_000}),
                      path="/v1/chat/completions"))
    bomb = gzip.compress(b"{" + b" " * (200 * 1024 * 1024), compresslevel=9)
    cases.append(Case("gzip-bomb", bomb, headers={"Content-Encoding": "gzip"}))
    # Hostile headers on otherwise valid bodies (anchored: the header alone may be accepted or fixed).
    for value in ("x" * 129, "a b c", "../../etc/passwd", "%00", "x" * 5000, "\u00e9t\u00e9", "{}", "-"):
        cases.append(Case("header:x-request-id", _anchored(COMPLETION), headers={"x-request-id": value}))
    for value in ("s" * 300, "s" * 6000, ""):
        cases.append(Case("header:x-session-id", _anchored(COMPLETION), headers={"x-session-id": value}))
    for value in ("Bearer", "Bearer " + "k" * 6000, "Basic Zm9vOmJhcg==", "bearer  ", "\u00ff" * 10):
        cases.append(Case("header:authorization", _anchored(COMPLETION), headers={"Authorization": value}))
    for value in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "a" * 3000):
        cases.append(Case("header:content-type", _anchored(COMPLETION), headers={"Content-Type": value}))
    # Paths and methods.
    for method, path in (("GET", "/v1/completions"), ("DELETE", "/v1/completions"), ("PUT", "/v1/chat/completions"),
                         ("POST", "/v1/models"), ("GET", "/v1/nope"), ("POST", "/admin/replicas/x/explode"),
                         ("GET", "/" + "a" * 5000), ("GET", "/v1/../../etc/passwd"), ("POST", "/v1/completions/"),
                         ("PATCH", "/health"), ("GET", "/%ff%fe"), ("OPTIONS", "/v1/completions")):
        cases.append(Case(f"path:{method}", b"{}", method=method, path=path))
    # Raw HTTP that the parser itself refuses.
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    body = _anchored(COMPLETION)
    raws = [
        ("many-headers", head + "".join(f"X-H{i}: v\r\n" for i in range(150)) + f"Content-Length: {len(body)}\r\n\r\n"),
        ("long-header", head + "X-Long: " + "v" * 20000 + f"\r\nContent-Length: {len(body)}\r\n\r\n"),
        ("long-url", "GET /" + "u" * 20000 + " HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("bad-line", "GARBAGE\r\n\r\n"), ("bad-version", "GET /health HTTP/9.9\r\nHost: x\r\n\r\n"),
        ("tls-hello", "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + "\x00" * 40),
        ("bad-length", head + "Content-Length: abc\r\n\r\n"), ("negative-length", head + "Content-Length: -5\r\n\r\n"),
        ("huge-length", head + "Content-Length: " + "9" * 40 + "\r\n\r\n"),
        ("two-lengths", head + f"Content-Length: {len(body)}\r\nContent-Length: 3\r\n\r\n"),
        ("bad-chunk", head + "Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n"),
        ("nul-header", head + "X-Nul: a\x00b\r\n" + f"Content-Length: {len(body)}\r\n\r\n"),
        ("space-in-name", head + "Bad Name: v\r\n" + f"Content-Length: {len(body)}\r\n\r\n"),
        ("bare-lf", "GET /health HTTP/1.1\nHost: x\n\n\x00\x00"),
        ("header-continuation", head + "X-A: a\r\n  folded\r\n" + f"Content-Length: {len(body)}\r\n\r\n"),
    ]
    for name, text in raws:
        payload = text.encode("latin-1")
        if payload.endswith(f"Content-Length: {len(body)}\r\n\r\n".encode()):
            payload += body
        cases.append(Case(f"raw:{name}", raw=payload))
    # Random: bytes, truncated JSON, invalid UTF-8, random combinations, until there are enough.
    while len(cases) < MIN_CASES + 200:
        pick = rng.random()
        path, base, own = bases[rng.randrange(2)]
        fields = {**BAD_VALUES, **own}
        if pick < 0.2:
            cases.append(Case("random-bytes", rng.randbytes(rng.randint(1, 3000)), path=path))
        elif pick < 0.4:
            full = _body({**base, "stop": ["x", "y"], "temperature": 0.5})
            cases.append(Case("truncated", full[:rng.randrange(1, len(full) - 1)], path=path))
        elif pick < 0.55:
            text = _body({**base, "user": "AAAA"})
            bad = rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc0\xaf", b"\x80"])
            cases.append(Case("invalid-utf8", text.replace(b"AAAA", b"AA" + bad + b"AA"), path=path))
        elif pick < 0.65:
            text = _body({**base, "user": "AAAA"}).replace(b'"AAAA"', rng.choice(
                [b'"\\ud800"', b'"\\udfff x"', b'"\\u12"', b'"\\x41"', b'"\x01\x02"', b'"a\\', b"\"a\nb\""]))
            cases.append(Case("bad-escape", text, path=path))
        else:  # one to three bad fields, with a random extra field of junk
            value = dict(base)
            for name in rng.sample(sorted(fields), rng.randint(1, 3)):
                value[name] = rng.choice(fields[name])
            value[rng.choice(["z", "extra", "\u2603", ""])] = rng.choice([None, 1, "x" * rng.randint(0, 500), [1] * 50])
            if all(v == base.get(k) for k, v in value.items() if k in base) and len(value) == len(base) + 1:
                continue
            cases.append(Case("random-fields", _body(value), path=path))
    return cases


# ---- sending ---------------------------------------------------------------------------------------

@dataclass
class Answer:
    status: int
    body: bytes
    raw: bool


def _send_raw(port: int, payload: bytes) -> Answer:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(payload)
        data = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                data += chunk
                if _complete(data):
                    break
    head, _, body = data.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    return Answer(status, body, True)


def _complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


class Sender:
    """One keep-alive connection per worker thread and server; a closed one is reopened."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.local = threading.local()

    def send(self, case: Case) -> Answer:
        if case.raw is not None:
            return _send_raw(self.port, case.raw)
        for attempt in range(2):
            conn = getattr(self.local, "conn", None)
            if conn is None:
                conn = self.local.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            try:
                headers = {"Content-Type": "application/json", **case.headers}
                conn.request(case.method, case.path, body=case.body, headers=headers)
                response = conn.getresponse()
                body = response.read()
                if response.will_close:
                    conn.close()
                    self.local.conn = None
                return Answer(response.status, body, False)
            except (http.client.HTTPException, OSError):
                conn.close()
                self.local.conn = None
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")


def _problem(answer: Answer, strict_raw: bool) -> str | None:
    if not 400 <= answer.status < 500:
        return f"status {answer.status}: {answer.body[:300]!r}"
    if answer.raw and not strict_raw:
        return None
    try:
        error = json.loads(answer.body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"status {answer.status} not in OpenAI's shape: {answer.body[:300]!r}"
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"status {answer.status}, error object {error!r:.300}"
    return None


def _memory_mb(pid: int) -> dict[str, float]:
    out = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                out[name] = int(value.split()[0]) / 1024
    return out


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("raising-template")
    source = tiny_checkpoint_dir()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copy(source / name, model_dir / name)
    (model_dir / "model.safetensors").symlink_to(source / "model.safetensors")
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": RAISING_TEMPLATE}))
    with contextlib.ExitStack() as stack:
        replica = stack.enter_context(run_replica(str(model_dir), extra_args=["--served-model-name", MODEL]))
        port = free_port()
        config = tmp_path_factory.mktemp("fuzz") / "gateway.yaml"
        config.write_text(f"gateway: {{host: 127.0.0.1, port: {port}}}\nlogging: {{format: json, level: warning}}\n"
                          f"routing: {{policy: round_robin}}\nreplicas:\n  - {{name: r0, url: '{replica.url}', model: {MODEL}}}\n")
        gateway = stack.enter_context(run_gateway(config, port))
        yield {"gateway": gateway, "replica": replica}


@pytest.mark.parametrize("target", ["gateway", "replica"])
def test_hostile_input_gets_a_4xx_in_openais_shape_and_the_server_holds(servers, target):
    server = servers[target]
    cases = build_cases(random.Random(SEED))
    assert len(cases) >= MIN_CASES
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    warm = call("POST", server.url + "/v1/chat/completions", good)  # warm: tokenizer, first batch
    assert warm[0] == 200, (warm, server.logs()[-3000:])
    before = _memory_mb(server.proc.pid)
    sender = Sender(server.port)
    # Both servers render even aiohttp's parser refusals in OpenAI's shape (protocol.http.OpenAIErrorsSite).
    strict_raw = True
    problems, answers = [], collections.Counter()
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        for case, outcome in zip(cases, pool.map(lambda c: _try(sender, c), cases)):
            problem = outcome if isinstance(outcome, str) else _problem(outcome, strict_raw)
            if not isinstance(outcome, str):
                answers[outcome.status] += 1
            if problem:
                problems.append((case.kind, f"{case.describe()}\n    -> {problem}"))
    assert server.proc.poll() is None, f"{target} died:\n{server.logs()[-3000:]}"
    after = _memory_mb(server.proc.pid)
    status, _, answer = call("POST", server.url + "/v1/chat/completions", good)
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1, answer
    first_of_kind = list({kind: text for kind, text in reversed(problems)}.values())
    assert not problems, (f"{len(problems)} of {len(cases)} cases answered badly; one per kind:\n"
                          + "\n".join(first_of_kind[:40]))
    assert after["VmRSS"] - before["VmRSS"] < RSS_GROWTH_LIMIT_MB, (before, after)
    assert after["VmHWM"] - before["VmRSS"] < PEAK_GROWTH_LIMIT_MB, (before, after)
    print(f"{target}: {len(cases)} cases, statuses {dict(answers)}, memory MB before {before}, after {after}")


def _try(sender: Sender, case: Case) -> Answer | str:
    try:
        return sender.send(case)
    except (http.client.HTTPException, OSError) as exc:
        return f"no answer: {type(exc).__name__}: {exc}"
