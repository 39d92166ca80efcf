"""What `kvgate up` runs for a replica entry: one function per engine turns the entry into the
command line and environment that engine's own CLI expects, and `engine_problems` refuses a
config whose servers could not start or could not be routed to.

Flag names and JSON shapes are the engines' own, read from the releases users run:
  vLLM 0.33.0     vllm/engine/arg_utils.py (flags from the config dataclasses), vllm/config/cache.py,
                  vllm/config/kv_events.py, vllm/config/kv_transfer.py, vllm/entrypoints/common/cli_args.py
                  (--host, --port), vllm/entrypoints/cli/serve.py (`vllm serve [model_tag]`)
  SGLang 0.5.23   sglang/srt/arg_groups/fields/*.py (flags from the ServerArgs fields), sglang/launch_server.py,
                  sglang/srt/disaggregation/kv_events.py (KVEventsConfig)
The gateway needs three things of every server: the same KV block size as routing.block_size
(the prompt's block hashes must line up with the server's cache), its KV events published where
the YAML's `kv_events` says the gateway subscribes, and the served model name clients ask for."""
from __future__ import annotations

import ipaddress
import json
import shlex
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator
from urllib.parse import urlsplit

if TYPE_CHECKING:  # gateway.config imports this module for its checks
    from gateway.config import Config, KVEventsSpec, ReplicaSpec

# How long a server may take to answer /health after it starts. vLLM and SGLang load weights
# (downloading them the first time), capture CUDA graphs and compile: minutes on a big model.
STARTUP_TIMEOUT_S = {"kvgate": 600.0, "vllm": 3600.0, "sglang": 3600.0}

# vLLM 0.33.0, distributed/kv_transfer/kv_connector/v1/nixl/connector.py: kv_both is deprecated
# with NixlConnector ("set kv_role='kv_producer' for prefill instances and 'kv_consumer' for decode").
# A mixed replica gets no kv-transfer config at all: the gateway never sends it a P/D leg, and a
# connector would register its whole KV cache with NIXL and bind a side channel for nothing.
VLLM_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
VLLM_KV_CONNECTOR = "NixlConnector"
# vllm/envs.py: every NIXL instance (both roles) binds its handshake listener on this port.
NIXL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
NIXL_DEFAULT_PORT = 5600
# sglang/srt/arg_groups/fields/disagg.py: disaggregation_bootstrap_port, "Default is 8998".
SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998

# Flags whose value the gateway relies on, set by kvgate from the entry; extra_args may not
# override them (a different port, name or block size would break routing silently).
_OWNED_FLAGS = {
    "kvgate": {"--model": "launch.model", "--host": "url", "--port": "url",
               "--served-model-name": "model", "--block-size": "routing.block_size", "--role": "role"},
    "vllm": {"--host": "url", "--port": "url", "--served-model-name": "model",
             "--block-size": "routing.block_size", "--model": "launch.model"},
    "sglang": {"--model-path": "launch.model", "--model": "launch.model", "--host": "url", "--port": "url",
               "--served-model-name": "model", "--page-size": "routing.block_size",
               "--disaggregation-mode": "role", "--disaggregation-bootstrap-port": "bootstrap_port"},
}


@dataclass(frozen=True)
class EngineCommand:
    """A server process: its argv and the variables added to kvgate's own environment."""
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """One line a user can paste into a shell."""
        prefix = " ".join(f"{key}={shlex.quote(value)}" for key, value in self.env.items())
        return (prefix + " " if prefix else "") + shlex.join(self.argv)


def engine_command(spec: ReplicaSpec, block_size: int) -> EngineCommand:
    """The command `kvgate up` runs for an entry with a `launch` block."""
    build = {"kvgate": kvgate_command, "vllm": vllm_command, "sglang": sglang_command}[spec.engine_name]
    return build(spec, block_size)


def startup_timeout_s(spec: ReplicaSpec) -> float:
    return STARTUP_TIMEOUT_S[spec.engine_name]


def kvgate_command(spec: ReplicaSpec, block_size: int) -> EngineCommand:
    """`python -m replica ...`: the built-in engine (replica/cli.py)."""
    launch = spec.launch
    argv = [*_program(launch.executable, [sys.executable]), "-m", "replica", "--model", launch.model,
            "--host", _host(spec), "--port", str(spec.port), "--threads", str(launch.threads),
            "--served-model-name", spec.model, "--block-size", str(block_size)]
    if spec.role != "mixed":
        argv += ["--role", spec.role]
    if spec.kv_events is not None:  # the replica binds exactly where the gateway connects
        argv += ["--kv-events-endpoint", spec.kv_events.endpoint]
        if spec.kv_events.replay_endpoint:
            argv += ["--kv-events-replay-endpoint", spec.kv_events.replay_endpoint]
    return EngineCommand(argv + list(launch.extra_args), dict(launch.env))


def vllm_command(spec: ReplicaSpec, block_size: int) -> EngineCommand:
    """`vllm serve MODEL ...` (vLLM 0.33.0). The model is the positional `model_tag` and comes
    first: `vllm serve` refuses --served-model-name without it (utils/argparse_utils.py)."""
    launch = spec.launch
    argv = [*_program(launch.executable, ["vllm"]), "serve", launch.model,
            "--host", _host(spec), "--port", str(spec.port), "--served-model-name", spec.model,
            # CacheConfig.enable_prefix_caching (BooleanOptionalAction) and block_size
            "--enable-prefix-caching", "--block-size", str(block_size)]
    if spec.kv_events is not None:
        argv += ["--kv-events-config", _json(vllm_kv_events_config(spec.kv_events))]
    if spec.role in VLLM_KV_ROLE:
        argv += ["--kv-transfer-config", _json({"kv_connector": VLLM_KV_CONNECTOR,
                                                "kv_role": VLLM_KV_ROLE[spec.role]})]
    # extra_args last: vLLM keeps the last value of a repeated flag (a whole --kv-transfer-config
    # there replaces kvgate's, e.g. another connector).
    return EngineCommand(argv + list(launch.extra_args), dict(launch.env))


def vllm_kv_events_config(kv_events: KVEventsSpec) -> dict:
    """vllm/config/kv_events.py KVEventsConfig. vLLM's publisher binds its PUB endpoint only when
    it is a wildcard (`tcp://*:PORT`, else it connects: distributed/kv_events.py _is_bind_endpoint),
    so it listens on every interface at the YAML's port; its replay ROUTER always binds, so that one
    keeps the YAML's address when it is an IP address."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": bind_endpoint(kv_events.endpoint, wildcard_only=True)}
    if kv_events.replay_endpoint:
        config["replay_endpoint"] = bind_endpoint(kv_events.replay_endpoint)
    return config


def sglang_command(spec: ReplicaSpec, block_size: int) -> EngineCommand:
    """`python3 -m sglang.launch_server ...` (SGLang 0.5.23; `sglang serve` is its newer name for
    the same parser). Prefix caching (RadixAttention) is on unless --disable-radix-cache."""
    launch = spec.launch
    argv = [*_program(launch.executable, ["python3"]), "-m", "sglang.launch_server",
            "--model-path", launch.model, "--host", _host(spec), "--port", str(spec.port),
            "--served-model-name", spec.model, "--page-size", str(block_size),
            "--enable-metrics"]  # the gateway scrapes sglang:num_queue_reqs and friends from /metrics
    if spec.kv_events is not None:
        argv += ["--kv-events-config", _json(sglang_kv_events_config(spec.kv_events))]
    if spec.role != "mixed":
        argv += ["--disaggregation-mode", spec.role]
    if spec.role == "prefill":  # the gateway hands this port to the decode side as bootstrap_port
        argv += ["--disaggregation-bootstrap-port", str(sglang_bootstrap_port(spec))]
    return EngineCommand(argv + list(launch.extra_args), dict(launch.env))


def sglang_kv_events_config(kv_events: KVEventsSpec) -> dict:
    """sglang/srt/disaggregation/kv_events.py KVEventsConfig: `bind: true` binds the PUB socket
    on the given address (else only wildcard endpoints bind); the replay ROUTER always binds."""
    config = {"publisher": "zmq", "endpoint": bind_endpoint(kv_events.endpoint), "bind": True}
    if kv_events.replay_endpoint:
        config["replay_endpoint"] = bind_endpoint(kv_events.replay_endpoint)
    return config


def sglang_bootstrap_port(spec: ReplicaSpec) -> int:
    return spec.bootstrap_port or SGLANG_DEFAULT_BOOTSTRAP_PORT


def bind_endpoint(endpoint: str, wildcard_only: bool = False) -> str:
    """The address a server binds so that the gateway can connect to `endpoint` (the YAML's):
    the same port, on that IPv4 address or on every interface (ZMQ binds addresses and interface
    names, not host names). ipc:// and inproc:// bind as they are."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not wildcard_only and _is_ipv4(host):
        return endpoint
    return f"tcp://*:{port}"


def _is_ipv4(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 4
    except ValueError:
        return False


def _program(executable: str | None, default: list[str]) -> list[str]:
    """`launch.executable` split as a shell would ("/opt/vllm/bin/python -m vllm.entrypoints.cli.main"
    works), or the engine's usual program."""
    return shlex.split(executable) if executable else default


def _host(spec: ReplicaSpec) -> str:
    return urlsplit(spec.url).hostname or "127.0.0.1"


def _json(value: dict) -> str:
    return json.dumps(value, separators=(",", ":"))


# ---- checks (gateway.config runs them with its own; each yields (key path, why)) ----------------

def engine_problems(config: Config) -> Iterator[tuple[list, str]]:
    for index, replica in enumerate(config.replicas):
        engine = replica.engine_name
        if engine in ("vllm", "sglang") and not replica.tokenizer:
            yield (["replicas", index, "tokenizer"],
                   f"{_ENGINE_NAMES[engine]} servers do not serve kvgate's tokenizer (GET /kvgate/tokenizer): "
                   "give the model's local HF directory (or .gguf file) here, the tokenizer the server uses")
        if engine == "sglang" and replica.bootstrap_port is not None and replica.role != "prefill":
            yield (["replicas", index, "bootstrap_port"],
                   f"only an SGLang prefill server listens on a bootstrap port (this one is {replica.role})")
        if replica.launch is None:
            continue
        if engine != "kvgate" and replica.launch.threads != 1:
            yield (["replicas", index, "launch", "threads"],
                   f"threads is for kvgate's own CPU replicas; give {_ENGINE_NAMES[engine]} its own flags "
                   "in extra_args")
        if replica.launch.executable is not None and not shlex.split(replica.launch.executable):
            yield ["replicas", index, "launch", "executable"], "must not be empty"
        for position, arg in enumerate(replica.launch.extra_args):
            flag = arg.split("=", 1)[0]
            if engine == "vllm":  # vLLM reads --served_model_name as --served-model-name
                flag = "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag
            owner = _OWNED_FLAGS[engine].get(flag)
            if owner is not None:
                yield (["replicas", index, "launch", "extra_args", position],
                       f"{flag} is set by kvgate from `{owner}`; change that instead")
        if replica.kv_events is not None:
            for key in ("endpoint", "replay_endpoint"):
                value = getattr(replica.kv_events, key)
                if value is not None and value.startswith("inproc://"):
                    yield (["replicas", index, "kv_events", key],
                           "inproc:// lives inside one process; the gateway cannot reach a launched server's: "
                           "use tcp://127.0.0.1:PORT or ipc://PATH")
    yield from _port_clashes(config)


_ENGINE_NAMES = {"kvgate": "kvgate", "vllm": "vLLM", "sglang": "SGLang"}


def _port_clashes(config: Config) -> Iterator[tuple[list, str]]:
    """Every process `kvgate up` starts runs on this machine: no two may bind the same port."""
    claimed: dict[int, str] = {config.gateway.port: "the gateway's port (gateway.port)"}
    for index, replica in enumerate(config.replicas):
        if replica.launch is None:
            continue
        for path, port, what, hint in _bound_ports(index, replica):
            if port is None:
                yield path, hint
            elif port in claimed:
                yield path, (f"port {port} ({what}) is also {claimed[port]}: each server `kvgate up` starts "
                             f"needs its own ports{'; ' + hint if hint else ''}")
            else:
                claimed[port] = f"replicas[{index}] ({replica.name})'s {what}"


def _bound_ports(index: int, replica: ReplicaSpec) -> Iterator[tuple[list, int | None, str, str]]:
    """(key path, port, what, hint) for each TCP port the server binds; port None: the hint is a problem."""
    at = ["replicas", index]
    try:
        yield at + ["url"], urlsplit(replica.url).port or replica.port, "HTTP", ""
    except ValueError:
        pass  # a bad url: gateway.config says so
    if replica.kv_events is not None:
        for key, what in (("endpoint", "KV events"), ("replay_endpoint", "KV events replay")):
            port = _tcp_port(getattr(replica.kv_events, key))
            if port is not None:
                yield at + ["kv_events", key], port, what, ""
    engine = replica.engine_name
    if engine == "sglang" and replica.role == "prefill":
        if replica.bootstrap_port:
            yield at + ["bootstrap_port"], replica.bootstrap_port, "SGLang bootstrap", ""
        else:
            yield (at + ["bootstrap_port"], SGLANG_DEFAULT_BOOTSTRAP_PORT, "SGLang bootstrap",
                   f"{SGLANG_DEFAULT_BOOTSTRAP_PORT} is SGLang's default: set bootstrap_port")
    if engine == "vllm" and replica.role in VLLM_KV_ROLE:
        path = at + ["launch", "env", NIXL_PORT_ENV]
        value = replica.launch.env.get(NIXL_PORT_ENV)
        if value is None:
            yield (path, NIXL_DEFAULT_PORT, "NIXL side channel",
                   f"{NIXL_DEFAULT_PORT} is vLLM's default: set launch.env.{NIXL_PORT_ENV}")
        elif value.isdigit() and 1 <= int(value) <= 65535:
            yield path, int(value), "NIXL side channel", ""
        else:
            yield path, None, "", f"expected a port number 1-65535, got {value!r}"


def _tcp_port(endpoint: str | None) -> int | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    port = endpoint.rpartition(":")[2]
    return int(port) if port.isdigit() else None
