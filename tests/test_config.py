"""Routing YAML: every mistake is refused with the key and its line; the shipped default is valid."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config, parse_config
from routing import make_policy
from routing.params import CacheAwareParams, LeastLoadParams

REPO_ROOT = Path(__file__).resolve().parent.parent

GOOD = """\
gateway:
  host: 127.0.0.1
  port: 8000
logging: {level: info, format: json, token_ids: full}
routing:
  policy: round_robin
replicas:
  - name: a
    url: http://127.0.0.1:8101
    model: m
  - name: b
    url: http://127.0.0.1:8102
    model: m
    launch: {model: tiny, threads: 1}
"""


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "x.yaml")
    return str(info.value)


def test_good_config_decodes_with_defaults():
    config = parse_config(GOOD, "x.yaml")
    assert [r.name for r in config.replicas] == ["a", "b"]
    assert config.gateway.request_timeout_s == 600 and config.gateway.connect_timeout_s == 5
    assert config.replicas[1].launch.model == "tiny" and config.replicas[1].port == 8102


def test_unknown_key_names_key_line_and_expected_keys():
    text = GOOD.replace("    model: m\n  - name: b", "    model: m\n    prot: 3\n  - name: b")
    assert error_of(text) == ("x.yaml:11: replicas[0].prot: unknown key "
                              "(expected one of: name, url, model, role, engine, bootstrap_port, tokenizer, launch, capacity_blocks, "
                              "kv_events)")


def test_unknown_top_level_section():
    assert error_of(GOOD + "extra: 1\n").startswith("x.yaml:15: extra: unknown key (expected one of: gateway,")


def test_wrong_type_names_key_and_line():
    assert error_of(GOOD.replace("port: 8000", "port: eighty")) == "x.yaml:3: gateway.port: expected int, got str"
    assert error_of(GOOD.replace("threads: 1", "threads: [1]")).startswith(
        "x.yaml:14: replicas[1].launch.threads: expected int, got array")


@pytest.mark.parametrize("old,new,expected", [
    ("port: 8000", "port: 70000", "x.yaml:3: gateway.port: expected int <= 65535"),
    ("policy: round_robin", "policy: magic", "x.yaml:6: routing.policy: unknown policy 'magic'"),
    ("url: http://127.0.0.1:8102", "url: 127.0.0.1:8102", "x.yaml:12: replicas[1].url: bad url"),
    ("url: http://127.0.0.1:8102", "url: http://127.0.0.1:99999", "x.yaml:12: replicas[1].url: bad url"),
    ("name: b", "name: a", "x.yaml:11: replicas[1].name: duplicate replica name 'a'"),
    ("token_ids: full", "token_ids: some", "x.yaml:4: logging.token_ids: invalid enum value 'some' "
                                           "(expected one of: full, hashed, off)"),
])
def test_bad_value_names_key_and_line(old, new, expected):
    assert error_of(GOOD.replace(old, new)).startswith(expected)


def test_yaml_boolean_words_are_taken_as_written_where_a_boolean_is_no_valid_value():
    # YAML 1.1 reads unquoted off/no/on/yes as booleans: `token_ids: off` was refused as a bool.
    config = parse_config(GOOD.replace("token_ids: full", "token_ids: off").replace("name: b", "name: no"))
    assert config.logging.token_ids == "off"
    assert [r.name for r in config.replicas] == ["a", "no"]
    config = parse_config(GOOD.replace("port: 8000", "port: 8000\n  resume_non_stream: on"))
    assert config.gateway.resume_non_stream is True  # where a boolean is valid, it stays one
    assert error_of(GOOD.replace("token_ids: full", "token_ids: false")).startswith(
        "x.yaml:4: logging.token_ids: expected str, got bool")  # true/false are booleans in any YAML


ROUTING = """\
routing:
  policy: cache_aware
  block_size: 16
  session_header: x-session-id
  cache_aware:
    prefill_weight: 2.0
    balance_factor: 1.25
  session_affinity: {fallback: least_load}
replicas:
  - name: a
    url: http://127.0.0.1:8101
    model: m
    capacity_blocks: 512
    kv_events: {endpoint: "tcp://127.0.0.1:5557", replay_endpoint: "tcp://127.0.0.1:5558"}
"""


def test_routing_policy_params_and_kv_events_decode():
    config = parse_config(ROUTING, "x.yaml")
    # The YAML decodes straight into routing's own parameter structs (declared once, defaults there).
    assert config.routing.policy_params() == CacheAwareParams()
    affinity = config.routing.policy_params("session_affinity")
    assert affinity.fallback == "least_load" and config.routing.policy_params(affinity.fallback) == LeastLoadParams()
    policy = make_policy("session_affinity", affinity, fallback_params=config.routing.policy_params("least_load"))
    assert policy.fallback.name == "least_load"
    assert config.replicas[0].capacity_blocks == 512
    assert config.replicas[0].kv_events.replay_endpoint == "tcp://127.0.0.1:5558"


@pytest.mark.parametrize("old,new,expected", [
    ("prefill_weight: 2.0", "prefill_wieght: 2.0", "x.yaml:6: routing.cache_aware.prefill_wieght: unknown key "
                                                   "(expected one of: prefill_weight, queue_weight,"),
    ("balance_factor: 1.25", "balance_factor: 0.5", "x.yaml:7: routing.cache_aware.balance_factor: expected float >= 1"),
    ("block_size: 16", "block_size: 0", "x.yaml:3: routing.block_size: expected int >= 1"),
    ("fallback: least_load", "fallback: magic", "x.yaml:8: routing.session_affinity.fallback: unknown fallback policy"),
    ("capacity_blocks: 512", "capacity_blocks: -1", "x.yaml:13: replicas[0].capacity_blocks: expected int >= 1"),
    ("tcp://127.0.0.1:5557", "tcp://127.0.0.1", "x.yaml:14: replicas[0].kv_events.endpoint: bad endpoint"),
    ("replay_endpoint", "replay", "x.yaml:14: replicas[0].kv_events.replay: unknown key"),
])
def test_bad_routing_value_names_key_and_line(old, new, expected):
    assert error_of(ROUTING.replace(old, new)).startswith(expected)


def test_empty_replicas_and_missing_replicas_are_refused():
    assert error_of("replicas: []\n") == "x.yaml:1: replicas: must list at least one replica"
    assert error_of("gateway: {port: 8000}\n") == "x.yaml:1: replicas: missing required key"
    assert error_of("") .startswith("x.yaml:1: empty config")


def test_yaml_syntax_error_names_line():
    assert error_of("gateway:\n  port: [8000\nreplicas: []\n").startswith("x.yaml:3: invalid YAML")


def test_shipped_local_yaml_is_valid():
    config = load_config(REPO_ROOT / "configs" / "local.yaml")
    assert [r.port for r in config.replicas] == [8101, 8102]
    assert {r.model for r in config.replicas} == {"smollm2"}
    assert all(r.launch is not None and r.launch.model == "smollm2" and r.launch.threads == 1
               for r in config.replicas)
    assert (config.gateway.host, config.gateway.port) == ("127.0.0.1", 8000)


def kvgate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)


def test_check_config_exit_codes(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("policy: round_robin", "policy: magic"))
    ok = kvgate("check-config", str(good))
    assert ok.returncode == 0 and ok.stdout.strip() == f"ok: {good} (2 replicas, policy round_robin)"
    refused = kvgate("check-config", str(bad))
    assert refused.returncode == 1 and f"{bad}:6: routing.policy: unknown policy 'magic'" in refused.stderr
    missing = kvgate("check-config", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_serve_and_up_refuse_a_bad_config_with_the_same_message(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("name: b", "name: a"))
    expected = f"{bad}:11: replicas[1].name: duplicate replica name 'a'"
    for command in ("serve", "up"):
        result = kvgate(command, "--config", str(bad))
        assert result.returncode == 1 and expected in result.stderr, result.stderr


def test_gateway_and_routing_import_no_torch_or_aiohttp_in_routing():
    code = ("import sys, gateway.cli, gateway.server, gateway.launcher; assert 'torch' not in sys.modules; "
            "import routing; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    code = "import sys, routing, routing.round_robin; assert 'aiohttp' not in sys.modules and 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_logging_file_keys_default_off_and_resolve_against_the_working_directory(monkeypatch, tmp_path):
    config = parse_config(GOOD, "x.yaml")
    assert (config.logging.file, config.logging.file_max_mb, config.logging.file_keep) == (None, 100.0, 5)
    assert config.logging.file_path() is None
    monkeypatch.chdir(tmp_path)
    config = parse_config(GOOD.replace("token_ids: full}", "token_ids: full, file: logs/gw.jsonl, file_keep: 0}"))
    assert config.logging.file_path() == tmp_path / "logs" / "gw.jsonl" and config.logging.file_keep == 0
    shipped = load_config(REPO_ROOT / "configs" / "local.yaml")
    assert shipped.logging.file == "kvgate-requests.jsonl"


@pytest.mark.parametrize("new,expected", [
    ("file: ''", "x.yaml:4: logging.file: expected str of length >= 1"),
    ("file_max_mb: -1", "x.yaml:4: logging.file_max_mb: expected float >= 0"),
    ("file_keep: many", "x.yaml:4: logging.file_keep: expected int, got str"),
])
def test_bad_logging_file_value_names_key_and_line(new, expected):
    assert error_of(GOOD.replace("token_ids: full}", f"token_ids: full, {new}}}")).startswith(expected)


def test_check_config_refuses_a_log_file_in_a_missing_directory(tmp_path):
    config = tmp_path / "gw.yaml"
    config.write_text(GOOD.replace("logging: {level: info, format: json, token_ids: full}",
                                   f"logging:\n  level: info\n  file: {tmp_path}/nope/gw.jsonl"))
    result = kvgate("check-config", str(config))
    assert result.returncode == 1, result.stdout
    assert f"{config}:6: logging.file: directory {tmp_path}/nope does not exist" in result.stderr
