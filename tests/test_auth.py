"""API keys, tenants, rate limits and the admin token: pure pieces first (buckets on a fake clock,
a key applied to a decoded request, YAML text edits), then a real gateway with keys in front of two
real tiny replicas (`tiny` and `other`), whose YAML is edited while it runs."""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import subprocess
import sys
import time

import pytest

from gateway.auth import Gate, Grant, tenant_salt
from gateway.config import ConfigError, parse_config
from gateway.keys_file import add_key, remove_key, set_admin_hash
from gateway.ratelimit import KeyLimiter, TokenBucket, duration
from observability.request_log import RequestRecord
from protocol.errors import BadRequest, NotFound, RateLimited
from protocol.requests import decode_chat, decode_completion
from tests.servers import REPO_ROOT, free_port, run_gateway, run_replica
from tests.test_cache_routing import poll
from tests.test_gateway import Gateway, http
from tests.test_hot_reload import log_events

REPLICAS = "replicas:\n  - {name: r0, url: 'http://127.0.0.1:9', model: tiny}\n"


def sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- pure pieces ---------------------------------------------------------------------------------

def test_bucket_bursts_its_minute_then_refills_at_its_rate_and_says_when():
    clock = Clock()
    bucket = TokenBucket(60, clock)
    assert all(bucket.try_take(1) == 0 for _ in range(60))
    assert bucket.try_take(1) == pytest.approx(1.0) and bucket.remaining() == 0
    assert bucket.reset_s() == pytest.approx(60.0)
    clock.now += 1.5
    assert bucket.try_take(1) == 0 and bucket.remaining() == 0
    assert bucket.try_take(61) == float("inf")  # more than a whole minute: never
    bucket.adjust(30)  # a correction after the fact may go below zero: later requests wait longer
    assert bucket.level < 0 and bucket.try_take(1) > 30
    assert [duration(s) for s in (0.02, 1, 1.5, 360, 61.25)] == ["20ms", "1s", "1.5s", "6m0s", "1m1.3s"]


def test_limiter_headers_are_openais():
    clock = Clock()
    limiter = KeyLimiter(rpm=10, tpm=1000, clock=clock)
    limiter.requests.try_take(1)
    limiter.tokens.try_take(250)
    assert limiter.headers() == {
        "x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "6s", "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "750", "x-ratelimit-reset-tokens": "15s"}
    limiter.resize(rpm=None, tpm=500)  # a reload: spent tokens stay spent, within the new size
    assert "x-ratelimit-limit-requests" not in limiter.headers()
    assert limiter.headers()["x-ratelimit-remaining-tokens"] == "500"


def _config(keys: str, **extra) -> object:
    extra_text = "".join(f"{name}: {value}\n" for name, value in extra.items())
    return parse_config(f"auth:\n  keys:\n{keys}{extra_text}{REPLICAS}")


def _record(model: str, prompt_tokens: int) -> RequestRecord:
    record = RequestRecord("r", "/v1/chat/completions")
    record.model, record.prompt_tokens = model, prompt_tokens
    return record


def test_a_key_sets_its_tenants_salt_drops_what_it_may_not_send_and_caps_max_tokens():
    config = _config(f"    - {{name: a, sha256: '{sha('a')}', tenant: team, max_tokens: 8}}\n"
                     f"    - {{name: t, sha256: '{sha('t')}', allow_cache_salt: true, allow_kv_transfer_params: true}}\n")
    gate = Gate(config)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100,
            "cache_salt": tenant_salt("other"), "kv_transfer_params": {"remote_host": "10.0.0.1"},
            "bootstrap_host": "10.0.0.2", "bootstrap_room": 7}
    for name, salt, kv, cap in (("a", tenant_salt("team"), None, 8), ("t", tenant_salt("other"), body["kv_transfer_params"], 100)):
        key = next(k for k in gate.keys if k.name == name)
        raw = json.loads(json.dumps(body))
        parsed = decode_chat(json.dumps(raw).encode())
        record = _record("tiny", 5)
        Grant(key, config.limits).admit(parsed, raw, record)
        assert parsed.cache_salt == raw["cache_salt"] == salt
        assert raw.get("kv_transfer_params") == kv
        assert raw.get("bootstrap_host") == (None if kv is None else "10.0.0.2")
        assert parsed.max_completion_tokens == raw["max_completion_tokens"] == cap
        assert (record.key, record.tenant) == (name, "team" if name == "a" else "t")
    key = gate.keys[0]
    raw = {"model": "tiny", "prompt": "x"}
    parsed = decode_completion(b'{"model": "tiny", "prompt": "x"}')
    Grant(key, config.limits).admit(parsed, raw, _record("tiny", 1))
    assert parsed.max_tokens == raw["max_tokens"] == 8 and raw["cache_salt"] == tenant_salt("team")


def test_a_key_is_refused_other_models_long_prompts_and_tokens_past_its_minute():
    config = _config(f"    - {{name: a, sha256: '{sha('a')}', models: [tiny], max_prompt_tokens: 10, tpm: 100}}\n",
                     limits="{max_prompt_tokens: 50}")
    key = Gate(config).keys[0]
    parsed = decode_completion(b'{"model": "tiny", "prompt": "x", "max_tokens": 30}')
    with pytest.raises(NotFound) as caught:
        Grant(key, config.limits).admit(parsed, {}, _record("other", 1))
    assert caught.value.code == "model_not_found" and "do not have access" in caught.value.message
    with pytest.raises(BadRequest) as caught:
        Grant(key, config.limits).admit(parsed, {}, _record("tiny", 11))
    assert caught.value.code == "prompt_too_long" and "at most 10" in caught.value.message
    with pytest.raises(BadRequest) as caught:  # the global limit holds for requests without a key too
        Grant(None, config.limits).admit(parsed, {}, _record("tiny", 51))
    assert "at most 50" in caught.value.message
    grants = [Grant(key, config.limits) for _ in range(3)]
    for grant in grants[:2]:
        grant.admit(parsed, {}, _record("tiny", 10))  # 40 tokens each: 80 of 100
    with pytest.raises(RateLimited) as caught:
        grants[2].admit(parsed, {}, _record("tiny", 10))
    assert caught.value.status == 429 and caught.value.type == "tokens" and caught.value.retry_after_s > 0
    assert caught.value.headers["x-ratelimit-remaining-tokens"] == "20"
    grants[0].record.completion_tokens = 5  # it produced 5 of its 30: 25 come back
    grants[0].settle()
    grants[0].settle()  # once only
    grants[2].admit(parsed, {}, _record("tiny", 10))
    big = decode_completion(b'{"model": "tiny", "prompt": "x", "max_tokens": 200}')
    with pytest.raises(BadRequest) as caught:
        Grant(key, config.limits).admit(big, {}, _record("tiny", 1))
    assert caught.value.code == "request_too_large"


def test_config_refuses_an_open_gateway_on_a_public_host_unless_told():
    public = "gateway: {host: 0.0.0.0}\n"
    with pytest.raises(ConfigError, match=r":1: gateway.host: '0.0.0.0' is not a loopback address .* `auth: none`"):
        parse_config(public + REPLICAS)
    assert parse_config(public + "auth: none\n" + REPLICAS).keys_required is False
    with_key = parse_config(public + f"auth:\n  keys:\n    - {{name: a, sha256: '{sha('a')}'}}\n" + REPLICAS)
    assert with_key.keys_required is True
    with pytest.raises(ConfigError, match=r"auth.keys\[1\].name: duplicate key name 'a'"):
        _config(f"    - {{name: a, sha256: '{sha('a')}'}}\n    - {{name: a, sha256: '{sha('b')}'}}\n")
    with pytest.raises(ConfigError, match=r"auth.keys\[0\].models: no replica serves model 'gpt'"):
        _config(f"    - {{name: a, sha256: '{sha('a')}', models: [gpt]}}\n")


def test_check_config_refuses_a_public_host_without_keys_and_names_the_line(tmp_path):
    config = tmp_path / "public.yaml"
    config.write_text("# public\ngateway:\n  host: 0.0.0.0\n" + REPLICAS)
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "check-config", str(config)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"{config}:3: gateway.host: '0.0.0.0' is not a loopback address" in done.stderr
    config.write_text("# public\ngateway:\n  host: 0.0.0.0\nauth: none\n" + REPLICAS)
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "check-config", str(config)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_keys_edits_keep_every_comment_and_round_trip():
    text = ("# my gateway\ngateway: {host: 127.0.0.1}   # loopback\n"
            "auth:\n  keys: []    # keys go here\n  metrics: public\n" + REPLICAS)
    one = add_key(text, {"name": "a", "sha256": sha("a"), "rpm": 5})
    two = add_key(one, {"name": "007", "sha256": sha("b"), "models": ["tiny"]})
    config = parse_config(two)
    assert [(k.name, k.rpm, k.models) for k in config.auth.keys] == [("a", 5, None), ("007", None, ["tiny"])]
    assert all(comment in two for comment in ("# my gateway", "# loopback", "# keys go here"))
    back = remove_key(remove_key(two, "a"), "007")
    assert parse_config(back).auth.keys == [] and "# keys go here" in back
    admin = set_admin_hash(set_admin_hash(back, sha("x")), sha("y"))
    assert parse_config(admin).auth.admin_token_sha256 == sha("y")
    appended = add_key(REPLICAS, {"name": "a", "sha256": sha("a")})  # no auth section yet
    assert parse_config(appended).keys_required
    for flow_auth in ("auth: {keys: []}\n", "auth: {keys: }\n", "auth: {keys: [], metrics: public}\n"):
        added = add_key(flow_auth + REPLICAS, {"name": "a", "sha256": sha("a")})
        assert [k.name for k in parse_config(added).auth.keys] == ["a"], added


# ---- a real gateway with keys ---------------------------------------------------------------------

ADMIN = "kvgadm-test-admin-token"
KEYS = {"alice": "kvg-alice-secret", "alice-2": "kvg-alice-2-secret", "bob": "kvg-bob-secret",
        "limited": "kvg-limited-secret", "narrow": "kvg-narrow-secret", "metered": "kvg-metered-secret"}


def _write(path, port: int, replicas, extra_keys: str = "") -> None:
    path.write_text(
        f"# a gateway with keys\ngateway: {{host: 127.0.0.1, port: {port}, connect_timeout_s: 2}}\n"
        "logging: {format: json, token_ids: full}\nrouting: {policy: round_robin}\n"
        f"auth:\n  admin_token_sha256: '{sha(ADMIN)}'\n  keys:\n"
        f"    - {{name: alice, sha256: '{sha(KEYS['alice'])}', tenant: acme}}\n"
        f"    - {{name: alice-2, sha256: '{sha(KEYS['alice-2'])}', tenant: acme}}\n"
        f"    - {{name: bob, sha256: '{sha(KEYS['bob'])}'}}\n"
        f"    - {{name: limited, sha256: '{sha(KEYS['limited'])}', rpm: 20}}\n"
        f"    - {{name: metered, sha256: '{sha(KEYS['metered'])}', rpm: 1000, tpm: 1000000}}\n"
        f"    - {{name: narrow, sha256: '{sha(KEYS['narrow'])}', models: [other], max_tokens: 3}}\n"
        f"{extra_keys}replicas:\n"
        f"  - {{name: r0, url: '{replicas[0].url}', model: tiny}}\n"
        f"  - {{name: r1, url: '{replicas[1].url}', model: other}}\n")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    with contextlib.ExitStack() as stack:
        replicas = [stack.enter_context(run_replica("tiny")),
                    stack.enter_context(run_replica("tiny", extra_args=["--served-model-name", "other"]))]
        port = free_port()
        config = tmp_path_factory.mktemp("auth") / "gateway.yaml"
        _write(config, port, replicas)
        server = stack.enter_context(run_gateway(config, port))
        gateway = Gateway(server, replicas)
        gateway.config = config
        yield gateway


def bearer(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


def completion(gateway, key: str | None, body: dict, **headers):
    auth = bearer(KEYS[key]) if key in KEYS else bearer(key) if key else {}
    return http("POST", gateway.url + "/v1/completions", body, {**auth, **headers})


def test_no_key_or_a_wrong_key_is_a_401_in_openais_shape_and_no_key_is_ever_logged(keyed):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}  # 2 tokens, whatever is sampled
    for key, code in ((None, "missing_api_key"), ("kvg-wrong", "invalid_api_key"), (ADMIN, "invalid_api_key")):
        status, headers, answer = completion(keyed, key, body)
        assert status == 401 and set(answer["error"]) == {"message", "type", "param", "code"}
        assert answer["error"]["code"] == code and answer["error"]["type"] == "invalid_request_error"
        assert headers["WWW-Authenticate"].startswith("Bearer") and "kvg-wrong" not in json.dumps(answer)
        assert http("GET", keyed.url + "/v1/models", headers=bearer(key) if key else {})[0] == 401
    status, _, answer = completion(keyed, "alice", body, **{"x-request-id": "alice-1"})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2
    record = keyed.record("alice-1")
    assert (record["key"], record["tenant"]) == ("alice", "acme")
    logs = keyed.server.logs()
    assert not any(secret in logs or sha(secret) in logs for secret in [*KEYS.values(), ADMIN])
    assert any(r["status"] == 401 and r.get("key") is None for r in keyed.records())  # refusals are recorded too


def test_admin_endpoints_need_the_admin_token_and_public_health_says_only_ok(keyed):
    for path in ("/admin/replicas", "/admin/health"):
        assert http("GET", keyed.url + path)[0] == 401
        assert http("GET", keyed.url + path, headers=bearer("kvgadm-wrong"))[0] == 401
        status, _, answer = http("GET", keyed.url + path, headers=bearer(KEYS["alice"]))
        assert status == 403 and answer["error"]["code"] == "admin_only"
        assert http("GET", keyed.url + path, headers=bearer(ADMIN))[0] == 200
    assert http("POST", keyed.url + "/admin/replicas/r0/drain", headers=bearer(KEYS["bob"]))[0] == 403
    status, _, health = http("GET", keyed.url + "/health")
    assert status == 200 and health == {"status": "ok", "all_ready": True}
    status, _, detail = http("GET", keyed.url + "/admin/health", headers=bearer(ADMIN))
    assert set(detail["replicas"]) == {"r0", "r1"}
    assert http("GET", keyed.url + "/metrics")[0] == 200  # `metrics: public` (the default)


def test_rate_limit_is_a_429_with_openais_headers_and_recovers(keyed):
    url = keyed.url + "/v1/models"
    seen = []
    for _ in range(40):  # 20 a minute: the burst runs out within these
        status, headers, answer = http("GET", url, headers=bearer(KEYS["limited"]))
        seen.append(status)
        if status == 429:
            break
        assert headers["x-ratelimit-limit-requests"] == "20"
    assert seen[-1] == 429 and seen.count(200) >= 19, seen
    assert answer["error"]["code"] == "rate_limit_exceeded" and answer["error"]["type"] == "requests"
    assert int(headers["Retry-After"]) >= 1 and headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    assert http("GET", url, headers=bearer(KEYS["bob"]))[0] == 200  # another key is not held back
    deadline = time.monotonic() + 30  # 20 a minute: one more within ~3 s
    while (status := http("GET", url, headers=bearer(KEYS["limited"]))[0]) == 429:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert status == 200


@pytest.mark.parametrize("stream", [False, True])
def test_completions_carry_the_keys_rate_limit_headers_and_the_request_id(keyed, stream):
    """The completions endpoints (the gateway's own hot path) answer with what every response
    gets from the front door: the key's x-ratelimit-* headers, counting down, and the request id."""
    import http.client
    from urllib.parse import urlsplit

    netloc = urlsplit(keyed.url).netloc
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, "ignore_eos": True, "stream": stream})
    remaining, answered_s = [], []
    for n in range(2):
        conn = http.client.HTTPConnection(netloc, timeout=30)
        try:
            conn.request("POST", "/v1/completions", body, {**bearer(KEYS["metered"]), "Content-Type": "application/json",
                                                            "x-request-id": f"metered-{stream}-{n}"})
            response = conn.getresponse()
            text = response.read().decode()
            headers = {k.lower(): v for k, v in response.getheaders()}
        finally:
            conn.close()
        assert response.status == 200, text
        assert ("data: [DONE]" in text) == stream
        assert headers["x-request-id"] == f"metered-{stream}-{n}"
        assert headers["x-ratelimit-limit-requests"] == "1000" and headers["x-ratelimit-limit-tokens"] == "1000000"
        assert headers["x-ratelimit-reset-requests"].endswith("s")
        remaining.append(int(headers["x-ratelimit-remaining-requests"]))
        answered_s.append(time.monotonic())
    # Each request takes one; the bucket refills 1000/60 a second meanwhile (a slow machine can
    # put more than 60 ms between the two answers, one unit back).
    refilled = math.ceil((answered_s[1] - answered_s[0]) * 1000 / 60)
    assert remaining[0] < 1000 and remaining[1] <= remaining[0] - 1 + refilled, (remaining, refilled)
    status, headers, _ = completion(keyed, None, {"model": "tiny", "prompt": "hi"}, **{"x-request-id": "no-key"})
    assert status == 401 and headers["x-request-id"] == "no-key"  # a refusal carries it too
    assert not any(name.lower().startswith("x-ratelimit") for name in headers)


def test_two_tenants_with_the_same_prompt_never_hit_each_others_cache(keyed):
    prompt = list(range(10, 90))  # 5 blocks of 16
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}

    def cached(key: str, request_id: str, **extra) -> int:
        status, _, answer = completion(keyed, key, {**body, **extra}, **{"x-request-id": request_id})
        assert status == 200, answer
        record = keyed.record(request_id)
        assert record["key"] == key
        return record["cached_tokens"]

    assert cached("alice", "acme-first") == 0
    assert cached("alice-2", "acme-second") > 0       # the same tenant shares its prefix
    # Another tenant never does, even when it names the first one's salt (dropped: its key may not) ...
    assert cached("bob", "bob-salted", cache_salt=tenant_salt("acme")) == 0
    assert cached("bob", "bob-second") > 0            # ... and within its own tenant it does
    assert keyed.record("bob-salted")["tenant"] == "bob"


def test_a_key_sees_and_uses_only_its_models_and_its_max_tokens(keyed):
    status, _, models = http("GET", keyed.url + "/v1/models", headers=bearer(KEYS["narrow"]))
    assert status == 200 and [m["id"] for m in models["data"]] == ["other"]
    status, _, answer = completion(keyed, "narrow", {"model": "tiny", "prompt": "hi"})
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    status, _, answer = completion(keyed, "narrow", {"model": "other", "prompt": "hi", "max_tokens": 50,
                                                     "ignore_eos": True})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3


def test_keys_added_revoked_and_a_non_utf8_edit_while_serving(keyed):
    """A YAML edit with a byte that is not UTF-8 is rejected and the watcher lives on: the next good
    edit (`kvgate keys add` on the live file) applies, and a revoked key stops working."""
    config = keyed.config
    good = config.read_bytes()
    reloads = len(log_events(keyed, "config_reloaded"))
    config.write_bytes(good.replace(b"# a gateway with keys", b"# caf\xe9 (latin-1)"))
    poll(lambda: log_events(keyed, "config_rejected"), "config_rejected", keyed.server)
    rejected = log_events(keyed, "config_rejected")[-1]
    assert "not UTF-8" in rejected["error"] and f"{config}:1:" in rejected["error"]
    config.write_bytes(good + b"# fixed\n")
    poll(lambda: len(log_events(keyed, "config_reloaded")) > reloads, "the good edit applied", keyed.server)
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "add", "carol", "--config", str(config),
                           "--rpm", "100"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr
    carol = done.stdout.strip()
    assert carol.startswith("kvg-") and carol not in config.read_text() and sha(carol) in config.read_text()
    assert "# fixed" in config.read_text()  # the edit kept the file's own text
    poll(lambda: http("GET", keyed.url + "/v1/models", headers=bearer(carol))[0] == 200, "carol's key", keyed.server)
    listed = subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "list", "--config", str(config)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert "carol" in listed.stdout and "rpm=100" in listed.stdout and sha(carol) not in listed.stdout
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "revoke", "carol", "--config", str(config)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    poll(lambda: http("GET", keyed.url + "/v1/models", headers=bearer(carol))[0] == 401, "carol revoked", keyed.server)
    assert [key.name for key in parse_config(config.read_text()).auth.keys][-1] == "narrow"
