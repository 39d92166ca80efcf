"""`kvgate up` starts vLLM and SGLang servers: the command each engine gets for each role (pure),
what `kvgate check-config` refuses, and the whole path against a stand-in (tests/fake_engine.py)
that reads its command line as the real CLI does, serves the stub's OpenAI API and publishes KV
events: requests answered through the gateway, a killed server restarted by the supervisor.

Flag names and JSON shapes below are the engines' own (the files are named at each assertion):
vLLM 0.33.0 and SGLang 0.5.23."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from gateway.cli import main as kvgate_main
from gateway.config import ConfigError, parse_config
from gateway.engines import bind_endpoint, engine_command
from tests import fake_engine
from tests.servers import REPO_ROOT, free_port, run_process
from tests.test_cache_routing import poll
from tests.test_gateway import http, metric

FAKE = f"{shlex.quote(sys.executable)} {shlex.quote(str(REPO_ROOT / 'tests' / 'fake_engine.py'))}"


def config_of(replicas: str, block_size: int = 16, gateway_port: int = 8000) -> str:
    return (f"gateway: {{host: 127.0.0.1, port: {gateway_port}}}\nrouting: {{block_size: {block_size}}}\n"
            f"replicas:\n{replicas}")


def command_of(replica: str, block_size: int = 32):
    config = parse_config(config_of(replica, block_size), "x.yaml")
    return engine_command(config.replicas[0], block_size)


def vllm_entry(role: str = "mixed", extra: str = "", launch_extra: str = "") -> str:
    return (f"  - name: v\n    url: http://127.0.0.1:8201\n    model: llama-8b\n    engine: vllm\n    role: {role}\n"
            f"    tokenizer: /models/llama\n{extra}"
            f"    launch: {{model: meta-llama/Llama-3.1-8B-Instruct{launch_extra}}}\n")


def sglang_entry(role: str = "mixed", extra: str = "", launch_extra: str = "") -> str:
    return (f"  - name: s\n    url: http://127.0.0.1:8301\n    model: qwen\n    engine: sglang\n    role: {role}\n"
            f"    tokenizer: /models/qwen\n{extra}"
            f"    launch: {{model: /models/qwen{launch_extra}}}\n")


KV_EVENTS = "    kv_events: {endpoint: 'tcp://127.0.0.1:5557', replay_endpoint: 'tcp://127.0.0.1:5558'}\n"


# ---- the commands (pure) -------------------------------------------------------------------------

def test_vllm_mixed_serves_with_prefix_caching_the_gateways_block_size_and_kv_events():
    command = command_of(vllm_entry(extra=KV_EVENTS, launch_extra=", extra_args: ['--max-model-len', '8192']"))
    # vllm/entrypoints/cli/serve.py: `vllm serve [model_tag]`; entrypoints/common/cli_args.py FrontendArgs
    # --host/--port; engine/arg_utils.py: --served-model-name (ModelConfig), --enable-prefix-caching and
    # --block-size (CacheConfig), --kv-events-config (config/kv_events.py KVEventsConfig, JSON).
    assert command.argv == [
        "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--host", "127.0.0.1", "--port", "8201",
        "--served-model-name", "llama-8b", "--enable-prefix-caching", "--block-size", "32",
        "--kv-events-config", '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",'
                              '"replay_endpoint":"tcp://127.0.0.1:5558"}',
        "--max-model-len", "8192"]  # extra_args last
    assert command.env == {}  # a mixed replica takes no part in KV transfers: no NIXL, no side channel
    engine, args = fake_engine.parse_command(command.argv[1:])  # the flags as vLLM's parser reads them
    assert engine == "vllm" and args.enable_prefix_caching is True and args.block_size == 32
    assert fake_engine.vllm_binds(args.kv_events_config["endpoint"])  # vLLM binds only wildcard endpoints


@pytest.mark.parametrize("role, kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_vllm_prefill_and_decode_get_nixl_as_producer_and_consumer(role, kv_role):
    command = command_of(vllm_entry(role, launch_extra=", env: {VLLM_NIXL_SIDE_CHANNEL_PORT: '5611', "
                                                       "CUDA_VISIBLE_DEVICES: '1'}"))
    # config/kv_transfer.py KVTransferConfig; nixl/connector.py: kv_both is deprecated with NixlConnector,
    # "set kv_role='kv_producer' for prefill instances and kv_role='kv_consumer' for decode instances".
    flag = command.argv.index("--kv-transfer-config")
    assert json.loads(command.argv[flag + 1]) == {"kv_connector": "NixlConnector", "kv_role": kv_role}
    assert command.env == {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5611", "CUDA_VISIBLE_DEVICES": "1"}
    assert "--kv-events-config" not in command.argv  # none in the YAML: none asked of the server
    _, args = fake_engine.parse_command(command.argv[1:])
    assert args.kv_transfer_config["kv_role"] == kv_role


@pytest.mark.parametrize("role", ["mixed", "prefill", "decode"])
def test_sglang_gets_its_disaggregation_mode_page_size_metrics_and_kv_events(role):
    bootstrap = "    bootstrap_port: 9001\n" if role == "prefill" else ""
    command = command_of(sglang_entry(role, extra=KV_EVENTS + bootstrap))
    # sglang/launch_server.py; srt/arg_groups/fields/: model.py --model-path, serving.py --host --port
    # --served-model-name, schedule.py --page-size, observability.py --enable-metrics --kv-events-config,
    # disagg.py --disaggregation-mode (null|prefill|decode) --disaggregation-bootstrap-port (default 8998).
    expected = ["python3", "-m", "sglang.launch_server", "--model-path", "/models/qwen", "--host", "127.0.0.1",
                "--port", "8301", "--served-model-name", "qwen", "--page-size", "32", "--enable-metrics",
                "--kv-events-config", '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557","bind":true,'
                                      '"replay_endpoint":"tcp://127.0.0.1:5558"}']
    expected += {"mixed": [], "decode": ["--disaggregation-mode", "decode"],
                 "prefill": ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9001"]}[role]
    assert command.argv == expected
    engine, args = fake_engine.parse_command(command.argv[1:])
    assert engine == "sglang" and args.page_size == 32 and args.disaggregation_mode == {"mixed": "null"}.get(role, role)
    # disaggregation/kv_events.py: `bind: true` binds the address given (only loopback here)
    assert fake_engine.sglang_binds(args.kv_events["endpoint"], args.kv_events["bind"])


def test_an_sglang_prefill_without_bootstrap_port_gets_the_default_the_gateway_assumes():
    command = command_of(sglang_entry("prefill"))
    assert command.argv[-2:] == ["--disaggregation-bootstrap-port", "8998"]


def test_kvgate_replicas_get_their_role_and_the_block_size():
    entry = ("  - name: k\n    url: http://127.0.0.1:8401\n    model: tiny\n    role: prefill\n"
             "    launch: {model: tiny, threads: 2, extra_args: ['--kv-cache-gb', '0.5']}\n")
    assert command_of(entry).argv == [
        sys.executable, "-m", "replica", "--model", "tiny", "--host", "127.0.0.1", "--port", "8401",
        "--threads", "2", "--served-model-name", "tiny", "--block-size", "32", "--role", "prefill",
        "--kv-cache-gb", "0.5"]


def test_executable_replaces_the_program_and_keeps_the_engines_entry_point():
    # split as a shell would: quotes keep a path with a space whole
    program = "\"'/opt/vllm env/bin/python' -m vllm.entrypoints.cli.main\""
    vllm = command_of(vllm_entry(launch_extra=f", executable: {program}"))
    assert vllm.argv[:5] == ["/opt/vllm env/bin/python", "-m", "vllm.entrypoints.cli.main", "serve",
                             "meta-llama/Llama-3.1-8B-Instruct"]
    sglang = command_of(sglang_entry(launch_extra=", executable: /opt/sgl/bin/python"))
    assert sglang.argv[:3] == ["/opt/sgl/bin/python", "-m", "sglang.launch_server"]
    assert sglang.shell().startswith("/opt/sgl/bin/python -m sglang.launch_server --model-path /models/qwen")


def test_kv_event_endpoints_bind_where_the_gateway_connects():
    assert bind_endpoint("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"
    assert bind_endpoint("tcp://127.0.0.1:5557", wildcard_only=True) == "tcp://*:5557"
    assert bind_endpoint("tcp://gpu-node-3:5557") == "tcp://*:5557"  # ZMQ binds addresses, not names
    assert bind_endpoint("ipc:///tmp/kv.ipc", wildcard_only=True) == "ipc:///tmp/kv.ipc"


# ---- kvgate check-config ---------------------------------------------------------------------------

def problem(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "x.yaml")
    return str(info.value)


def test_a_vllm_or_sglang_replica_needs_a_tokenizer():
    text = config_of(vllm_entry().replace("    tokenizer: /models/llama\n", ""))
    assert problem(text).startswith("x.yaml:4: replicas[0].tokenizer: vLLM servers do not serve kvgate's "
                                    "tokenizer (GET /kvgate/tokenizer): give the model's local HF directory")
    served_elsewhere = "  - {name: s, url: 'http://10.0.0.5:30000', model: qwen, engine: sglang}\n"  # not launched
    assert "replicas[0].tokenizer: SGLang servers do not serve" in problem(config_of(served_elsewhere))


def test_two_servers_on_one_port_are_refused_with_the_key_to_change():
    pd_pair = (vllm_entry("prefill") + vllm_entry("decode").replace("name: v", "name: w")
               .replace("8201", "8202"))
    assert problem(config_of(pd_pair)) == (
        "x.yaml:17: replicas[1].launch.env.VLLM_NIXL_SIDE_CHANNEL_PORT: port 5600 (NIXL side channel) is also "
        "replicas[0] (v)'s NIXL side channel: each server `kvgate up` starts needs its own ports; 5600 is vLLM's "
        "default: set launch.env.VLLM_NIXL_SIDE_CHANNEL_PORT")
    fixed = pd_pair.replace("Instruct}", "Instruct, env: {VLLM_NIXL_SIDE_CHANNEL_PORT: '5610'}}", 1)
    parse_config(config_of(fixed), "x.yaml")
    prefills = sglang_entry("prefill") + sglang_entry("prefill").replace("name: s", "name: t").replace("8301", "8302")
    assert problem(config_of(prefills)).endswith(
        "replicas[1].bootstrap_port: port 8998 (SGLang bootstrap) is also replicas[0] (s)'s SGLang bootstrap: each "
        "server `kvgate up` starts needs its own ports; 8998 is SGLang's default: set bootstrap_port")
    clash = sglang_entry(extra="    kv_events: {endpoint: 'tcp://127.0.0.1:8000'}\n")
    assert problem(config_of(clash)).endswith(
        "replicas[0].kv_events.endpoint: port 8000 (KV events) is also the gateway's port (gateway.port): "
        "each server `kvgate up` starts needs its own ports")


def test_flags_kvgate_sets_cannot_be_overridden_in_extra_args():
    text = config_of(vllm_entry(launch_extra=", extra_args: ['--served_model_name', 'other']"))
    assert "replicas[0].launch.extra_args[0]: --served-model-name is set by kvgate from `model`" in problem(text)
    text = config_of(sglang_entry(launch_extra=", extra_args: ['--page-size=64']"))
    assert "--page-size is set by kvgate from `routing.block_size`; change that instead" in problem(text)
    text = config_of(sglang_entry("decode", extra="    bootstrap_port: 9000\n"))
    assert "replicas[0].bootstrap_port: only an SGLang prefill server listens on a bootstrap port" in problem(text)
    assert "threads is for kvgate's own" in problem(config_of(vllm_entry(launch_extra=", threads: 8")))


def test_check_config_prints_the_commands_kvgate_up_runs(tmp_path, capsys):
    path = tmp_path / "pd.yaml"
    path.write_text(config_of(sglang_entry("decode")))
    assert kvgate_main(["check-config", str(path), "--commands"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == ("s: python3 -m sglang.launch_server --model-path /models/qwen --host 127.0.0.1 --port 8301 "
                      "--served-model-name qwen --page-size 16 --enable-metrics --disaggregation-mode decode")


@pytest.mark.parametrize("name, roles", [("vllm-pd.yaml", ('"kv_role":"kv_producer"', '"kv_role":"kv_consumer"')),
                                         ("sglang-pd.yaml", ("--disaggregation-mode prefill",
                                                             "--disaggregation-mode decode"))])
def test_the_shipped_pd_examples_are_valid(capsys, name, roles):
    assert kvgate_main(["check-config", str(REPO_ROOT / "configs" / name), "--commands"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and roles[0] in lines[1] and roles[1] in lines[2]
    for line in lines[1:]:  # each command as the engine's own parser reads it
        argv = shlex.split(line.split(": ", 1)[1])
        fake_engine.parse_command(argv[next(i for i, a in enumerate(argv) if "=" not in a) + 1:])


# ---- `kvgate up` against the stand-in --------------------------------------------------------------

FAST_HEALTH = ("health: {probe_interval_s: 0.3, probe_timeout_s: 1, healthy_threshold: 1, unhealthy_threshold: 1,\n"
               "         eject_base_s: 0.5, restart_backoff_s: 0.2}\n")


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def admin(url: str) -> dict:
    return {entry["name"]: entry for entry in http("GET", url + "/admin/replicas")[2]["replicas"]}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def tiny_dir():
    from replica.tiny import tiny_checkpoint_dir
    return str(tiny_checkpoint_dir())


def test_kvgate_up_serves_through_vllm_and_sglang_stand_ins_and_restarts_a_killed_one(tmp_path, tiny_dir):
    port, block_size = free_port(), 8
    record = {name: tmp_path / f"{name}.jsonl" for name in ("v0", "s0", "vp", "vd")}

    def entry(name, engine, role, model, extra="", env=""):
        return (f"  - name: {name}\n    url: http://127.0.0.1:{free_port()}\n    model: {model}\n"
                f"    engine: {engine}\n    role: {role}\n    tokenizer: {tiny_dir}\n{extra}"
                f"    launch:\n      model: {tiny_dir}\n      executable: {json.dumps(FAKE)}\n"
                f"      env: {{FAKE_ENGINE_RECORD: '{record[name]}'{env}}}\n")

    replicas = (
        # vLLM's PUB binds only wildcard tcp endpoints; ipc:// keeps this test on loopback
        entry("v0", "vllm", "mixed", "vllm-model", extra=f"    kv_events: {{endpoint: 'ipc://{tmp_path}/v0.ipc', "
              f"replay_endpoint: 'tcp://127.0.0.1:{free_port()}'}}\n")
        + entry("s0", "sglang", "mixed", "sglang-model",
                extra=f"    kv_events: {{endpoint: 'tcp://127.0.0.1:{free_port()}'}}\n")
        # a P/D pair: its commands and ports (its requests are the P/D router's, tested elsewhere)
        + entry("vp", "vllm", "prefill", "pd-model", env=f", VLLM_NIXL_SIDE_CHANNEL_PORT: '{free_port()}'")
        + entry("vd", "vllm", "decode", "pd-model", env=f", VLLM_NIXL_SIDE_CHANNEL_PORT: '{free_port()}'"))
    config_path = tmp_path / "up.yaml"
    config_path.write_text(f"gateway: {{host: 127.0.0.1, port: {port}}}\n" + FAST_HEALTH
                           + f"logging: {{format: json}}\nrouting: {{policy: round_robin, block_size: {block_size}}}\n"
                           + f"replicas:\n{replicas}")
    config = parse_config(config_path.read_text())
    # a replica is killed here, so its logs are kept: in tmp_path, not a temporary directory of their own
    argv = [sys.executable, "-m", "gateway.cli", "up", "--config", str(config_path), "--replica-logs",
            str(tmp_path / "replica-logs")]
    children = []
    with run_process(argv, f"http://127.0.0.1:{port}/health", port=port, name="kvgate-up",
                     startup_timeout_s=120) as server:
        url = server.url
        poll(lambda: all(e["state"] == "healthy" and e["ready"] for e in admin(url).values()),
             "every stand-in healthy and its tokenizer loaded from the YAML", server, timeout_s=60)
        # Each server got exactly the command engines.py builds, with the YAML's environment.
        for spec in config.replicas:
            [started] = records(record[spec.name])
            children.append(started["child_pid"])
            assert started["argv"] == engine_command(spec, block_size).argv[2:]  # after `python fake_engine.py`
            assert started["env"]["FAKE_ENGINE_RECORD"] == str(record[spec.name])
        assert records(record["vp"])[0]["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == \
            config.replicas[2].launch.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]

        prompt = "The capital of France is a city on the river Seine, and it"
        for model, name in (("vllm-model", "v0"), ("sglang-model", "s0")):
            body = {"model": model, "prompt": prompt, "max_tokens": 4}
            status, _, reply = http("POST", url + "/v1/completions", body)
            assert status == 200 and reply["model"] == model and reply["usage"]["completion_tokens"] == 4, reply
            # The server published where kv_events says and the gateway, connecting there, applied it.
            poll(lambda: metric(http("GET", url + "/metrics")[2], "kvgate_kv_event_batches_total", replica=name) >= 1,
                 f"a KV event batch from {name}", server, timeout_s=20)

        # SIGKILL a server: the supervisor clears what it left (its engine-core child) and restarts it.
        first = records(record["v0"])[0]
        os.kill(first["pid"], signal.SIGKILL)
        poll(lambda: len(records(record["v0"])) == 2, "the stand-in restarted", server, timeout_s=30)
        poll(lambda: gone(first["child_pid"]), "the dead server's child killed", server, timeout_s=10)
        second = records(record["v0"])[1]
        children.append(second["child_pid"])
        assert second["argv"] == first["argv"]
        poll(lambda: admin(url)["v0"]["state"] == "healthy", "the restarted stand-in back in rotation", server,
             timeout_s=30)
        status, _, reply = http("POST", url + "/v1/completions", {"model": "vllm-model", "prompt": prompt,
                                                                   "max_tokens": 2})
        assert status == 200 and reply["usage"]["completion_tokens"] == 2, reply
        assert metric(http("GET", url + "/metrics")[2], "kvgate_replica_restarts_total", replica="v0") >= 1
        server_pids = [records(record[name])[-1]["pid"] for name in record]
    # `kvgate up` stopped (SIGTERM): every server and what it started is gone.
    for pid in server_pids + children:
        poll(lambda: gone(pid), f"process {pid} stopped", server, timeout_s=15)


def test_kvgate_up_says_why_a_server_refused_its_command(tmp_path, tiny_dir):
    port = free_port()
    config_path = tmp_path / "bad.yaml"
    config_path.write_text(
        f"gateway: {{host: 127.0.0.1, port: {port}}}\nlogging: {{format: json}}\nreplicas:\n"
        f"  - name: v\n    url: http://127.0.0.1:{free_port()}\n    model: m\n    engine: vllm\n"
        f"    tokenizer: {tiny_dir}\n"
        f"    launch: {{model: {tiny_dir}, executable: {json.dumps(FAKE)}, extra_args: ['--no-such-flag']}}\n")
    result = run_up(config_path)
    assert result.returncode == 1
    assert "replica v exited with code 2 while loading" in result.stderr
    assert "vllm serve: error: unrecognized arguments: --no-such-flag" in result.stderr
    assert "kvgate: v: " in result.stderr and "serve " in result.stderr  # the command it ran, for a rerun by hand
    # A failure keeps the temporary logs, and says where.
    kept = re.search(r"replica logs kept in (\S+) \(v exited while loading\)", result.stderr)
    assert kept and "--no-such-flag" in (Path(kept.group(1)) / "v.log").read_text()
    shutil.rmtree(kept.group(1))
    # --replica-logs DIR: there, and kept.
    chosen = tmp_path / "logs" / "here"
    result = run_up(config_path, "--replica-logs", str(chosen))
    assert result.returncode == 1 and f"logs in {chosen})" in result.stderr
    assert "--no-such-flag" in (chosen / "v.log").read_text()


def run_up(config_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", "up", "--config", str(config_path), *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
