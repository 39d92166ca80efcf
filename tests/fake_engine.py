"""A stand-in for `vllm serve` and `python -m sglang.launch_server`, run by `kvgate up` through
`launch.executable` in tests: it reads its command line the way that engine's CLI does and serves
bench/stub_backend.py's OpenAI app on the port it was given.

    fake_engine.py serve MODEL_DIR --host H --port P ...               (as the `vllm` program)
    fake_engine.py -m sglang.launch_server --model-path MODEL_DIR ...  (as `python3`)

What it checks, as the real engine would refuse the same mistakes:
  - only the flags below, with the real ones' names, types and choices (an unknown flag exits 2,
    as argparse does in vLLM and SGLang);
  - JSON configs: every key known, with the right type (vLLM's config classes forbid extra keys;
    SGLang's KVEventsConfig ignores them, which we refuse too: a typo there is a silent failure);
  - KV events: the PUB socket binds or connects by the engine's own rule, and the gateway must be
    able to connect to it (a connecting publisher here exits, since no event would ever arrive);
  - P/D: vLLM's NIXL side channel and SGLang's bootstrap server bind their ports, so two servers
    given the same port fail like the real ones.
It publishes a BlockStored batch (vLLM's shape) for the full blocks of each prompt it serves.

Each start appends one JSON line to $FAKE_ENGINE_RECORD: the argv, the engine's environment
variables, its pid and the pid of a child it starts (like vLLM's engine core), which it stops on
SIGTERM and leaves behind on SIGKILL. It never serves /kvgate/tokenizer (real engines don't).

P/D, as far as the router sees it: each generation request's JSON body is appended to
$FAKE_ENGINE_REQUESTS; a vLLM kv_producer answers a `do_remote_decode` request with the
`kv_transfer_params` NixlConnector returns (vllm/distributed/kv_transfer/kv_connector/v1/nixl/
connector.py request_finished: do_remote_prefill, remote_engine_id, remote_block_ids, remote_host,
remote_port, remote_request_id, tp_size); a kv_consumer or an SGLang server just records what it got
(kv_transfer_params, bootstrap_host/port/room) so the test can check the pairing."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# ---- vLLM 0.33.0 -------------------------------------------------------------------------------
# vllm/config/kv_events.py KVEventsConfig and vllm/config/kv_transfer.py KVTransferConfig (pydantic
# dataclasses with extra="forbid", vllm/config/utils.py): field -> accepted JSON types.
VLLM_KV_EVENTS_FIELDS = {"enable_kv_cache_events": (bool,), "publisher": (str,), "endpoint": (str,),
                         "replay_endpoint": (str, type(None)), "buffer_steps": (int,), "hwm": (int,),
                         "max_queue_size": (int,), "topic": (str,)}
VLLM_KV_TRANSFER_FIELDS = {"kv_connector": (str, type(None)), "engine_id": (str, type(None)),
                           "kv_buffer_device": (str,), "kv_role": (str, type(None)), "kv_port": (int,),
                           "kv_connector_extra_config": (dict,), "kv_connector_module_path": (str, type(None)),
                           "enable_permute_local_kv": (bool,), "kv_load_failure_policy": (str,)}
VLLM_KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")

# ---- SGLang 0.5.23 -----------------------------------------------------------------------------
# sglang/srt/disaggregation/kv_events.py KVEventsConfig (pydantic BaseModel).
SGLANG_KV_EVENTS_FIELDS = {"publisher": (str,), "endpoint": (str,), "bind": (bool, type(None)),
                           "replay_endpoint": (str, type(None)), "buffer_steps": (int,), "hwm": (int,),
                           "max_queue_size": (int,), "topic": (str,), "format": (str,)}
# sglang/srt/arg_groups/choices.py DISAGG_TRANSFER_BACKEND_CHOICES
SGLANG_TRANSFER_BACKENDS = ["mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp"]


def vllm_parser() -> argparse.ArgumentParser:
    """`vllm serve`'s flags that kvgate and these tests use, as vllm/engine/arg_utils.py and
    vllm/entrypoints/common/cli_args.py declare them."""
    parser = argparse.ArgumentParser(prog="vllm serve", allow_abbrev=False)
    parser.add_argument("model_tag", nargs="?")                            # entrypoints/openai cli_args make_arg_parser
    parser.add_argument("--host", type=str, default=None)                  # FrontendArgs.host
    parser.add_argument("--port", type=int, default=8000)                  # FrontendArgs.port
    parser.add_argument("--served-model-name", nargs="+", default=None)    # ModelConfig.served_model_name
    parser.add_argument("--tokenizer", default=None)                       # ModelConfig.tokenizer
    parser.add_argument("--max-model-len", type=int, default=None)         # ModelConfig.max_model_len
    parser.add_argument("--block-size", type=int, default=None)            # CacheConfig.block_size
    parser.add_argument("--gpu-memory-utilization", "--device-memory-utilization", dest="gpu_memory_utilization",
                        type=float, default=0.92)                          # CacheConfig.gpu_memory_utilization
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=None)                                      # CacheConfig.enable_prefix_caching
    parser.add_argument("--kv-events-config", type=_json_fields("--kv-events-config", VLLM_KV_EVENTS_FIELDS),
                        default=None)                                      # VllmConfig.kv_events_config
    parser.add_argument("--kv-transfer-config", type=_json_fields("--kv-transfer-config", VLLM_KV_TRANSFER_FIELDS),
                        default=None)                                      # VllmConfig.kv_transfer_config
    return parser


def sglang_parser() -> argparse.ArgumentParser:
    """`python -m sglang.launch_server`'s flags that kvgate and these tests use, as
    sglang/srt/arg_groups/fields/{model,serving,schedule,observability,disagg,memory}.py declare them."""
    parser = argparse.ArgumentParser(prog="sglang serve", allow_abbrev=False)
    parser.add_argument("--model-path", "--model", dest="model_path", type=str, required=True)  # fields/model.py
    parser.add_argument("--tokenizer-path", type=str, default=None)        # fields/serving.py
    parser.add_argument("--host", type=str, default="127.0.0.1")           # fields/serving.py
    parser.add_argument("--port", type=int, default=30000)                 # fields/serving.py
    parser.add_argument("--served-model-name", type=str, default=None)     # fields/serving.py
    parser.add_argument("--page-size", type=int, default=None)             # fields/schedule.py
    parser.add_argument("--mem-fraction-static", type=float, default=None)  # fields/schedule.py
    parser.add_argument("--enable-metrics", action="store_true")           # fields/observability.py
    parser.add_argument("--kv-events-config", type=str, default=None)      # fields/observability.py (JSON string)
    parser.add_argument("--disable-radix-cache", action="store_true")      # fields/memory.py
    parser.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null")
    parser.add_argument("--disaggregation-transfer-backend", choices=SGLANG_TRANSFER_BACKENDS, default="mooncake")
    parser.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)  # fields/disagg.py
    parser.add_argument("--disaggregation-ib-device", type=str, default=None)
    return parser


def _json_fields(flag: str, fields: dict[str, tuple]):
    def parse(text: str) -> dict:
        return check_fields(flag, json.loads(text), fields)
    parse.__name__ = flag  # argparse names the type in its error message
    return parse


def check_fields(flag: str, value: Any, fields: dict[str, tuple]) -> dict:
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{flag}: expected a JSON object")
    for key, item in value.items():
        if key not in fields:
            raise argparse.ArgumentTypeError(f"{flag}: unknown field {key!r}")
        if not isinstance(item, fields[key]) or (isinstance(item, bool) and bool not in fields[key]):
            raise argparse.ArgumentTypeError(f"{flag}: {key} has the wrong type ({type(item).__name__})")
    return value


def parse_command(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """(engine, parsed flags) for a command line after the program name; SystemExit(2) when the
    engine would refuse it."""
    if argv[:1] == ["serve"]:
        return "vllm", parse_vllm(argv[1:])
    if argv[:2] == ["-m", "sglang.launch_server"]:
        return "sglang", parse_sglang(argv[2:])
    sys.exit(f"fake_engine: expected `serve ...` (vllm) or `-m sglang.launch_server ...`, got {argv[:2]}")


def parse_vllm(argv: list[str]) -> argparse.Namespace:
    argv = [_dashes(arg) for arg in argv]
    if argv and argv[0].startswith("-") and any(a.startswith("--served-model-name") for a in argv):
        sys.exit("ValueError: `model` should be provided as the first positional argument when using `vllm serve`.")
    args = vllm_parser().parse_args(argv)
    transfer = args.kv_transfer_config
    if transfer is not None and transfer.get("kv_connector") is not None:
        if transfer.get("kv_role") not in VLLM_KV_ROLES:  # KVTransferConfig.__post_init__
            sys.exit(f"ValueError: Please specify kv_role when kv_connector is set, supported roles are "
                     f"{VLLM_KV_ROLES}")
    return args


def _dashes(arg: str) -> str:
    """vLLM's FlexibleArgumentParser reads --foo_bar as --foo-bar (vllm/utils/argparse_utils.py)."""
    if not arg.startswith("--"):
        return arg
    key, sep, value = arg[2:].partition("=")
    return "--" + key.replace("_", "-") + sep + value


def parse_sglang(argv: list[str]) -> argparse.Namespace:
    args = sglang_parser().parse_args(argv)
    if args.kv_events_config is not None:
        args.kv_events = check_fields("--kv-events-config", json.loads(args.kv_events_config), SGLANG_KV_EVENTS_FIELDS)
    else:
        args.kv_events = None
    return args


# ---- serving -----------------------------------------------------------------------------------

def vllm_binds(endpoint: str) -> bool:
    """vllm/distributed/kv_events.py ZmqEventPublisher._is_bind_endpoint."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def sglang_binds(endpoint: str, bind: bool | None) -> bool:
    """sglang/srt/disaggregation/kv_events.py ZmqEventPublisher._socket_setup."""
    if bind is not None:
        return bind
    return ("*" in endpoint or "::" in endpoint or "0.0.0.0" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


def kv_events_of(engine: str, args) -> tuple[str, str | None, str] | None:
    """(PUB endpoint, replay endpoint, topic) when the engine would publish KV events."""
    if engine == "vllm":
        config = args.kv_events_config
        if not config:
            return None
        publisher = config.get("publisher") or ("zmq" if config.get("enable_kv_cache_events") else "null")
        if publisher != "zmq" or not config.get("enable_kv_cache_events"):
            return None
        endpoint = config.get("endpoint", "tcp://*:5557")
        if not vllm_binds(endpoint):
            sys.exit(f"fake_engine: vLLM would CONNECT its KV event publisher to {endpoint}; nothing binds there, "
                     "so the gateway would never get an event")
        return endpoint, config.get("replay_endpoint"), config.get("topic", "")
    config = args.kv_events
    if not config or config.get("publisher", "null") != "zmq":
        return None
    endpoint = config.get("endpoint", "tcp://*:5557")
    if not sglang_binds(endpoint, config.get("bind")):
        sys.exit(f"fake_engine: SGLang would CONNECT its KV event publisher to {endpoint}")
    return endpoint, config.get("replay_endpoint"), config.get("topic", "")


def bind_port(host: str, port: int) -> socket.socket:
    """Hold a TCP port the way the engine's side server does (a clash fails like theirs)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1" if host in ("localhost", "") else host, port))
    sock.listen(8)
    return sock


def main() -> None:
    engine, args = parse_command(sys.argv[1:])
    if engine == "vllm":
        model_dir, served = args.model_tag, (args.served_model_name or [args.model_tag])[0]
        block_size, host = args.block_size or 16, args.host or "0.0.0.0"
    else:
        model_dir, served = args.model_path, args.served_model_name or args.model_path
        block_size, host = args.page_size or 1, args.host

    held = []
    if engine == "vllm" and args.kv_transfer_config and args.kv_transfer_config.get("kv_connector"):
        # vllm/envs.py + nixl/base_scheduler.py: the handshake listener of every NIXL instance.
        held.append(bind_port(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
                              int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))))
    if engine == "sglang" and args.disaggregation_mode == "prefill":
        held.append(bind_port(host, args.disaggregation_bootstrap_port))

    # Like vLLM's engine core process: stopped with us on SIGTERM, left behind by a SIGKILL.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    record = os.environ.get("FAKE_ENGINE_RECORD")
    if record:
        env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "SGLANG_", "CUDA_", "FAKE_"))}
        with open(record, "a") as out:
            out.write(json.dumps({"engine": engine, "argv": sys.argv[1:], "env": env, "pid": os.getpid(),
                                  "child_pid": child.pid}) + "\n")
    try:
        serve(engine, args, model_dir, served, block_size, host)
    finally:
        child.kill()
        child.wait()
        for sock in held:
            sock.close()


def serve(engine: str, args, model_dir: str, served: str, block_size: int, host: str) -> None:
    import asyncio

    from aiohttp import web

    from bench.stub_backend import StubModel, build_app
    from bench.stub_backend import serve as serve_app
    from tokenization.bundle import TokenizerBundle

    publisher = None
    events = kv_events_of(engine, args)
    if events is not None:
        from replica.kv_events import KVEventPublisher
        endpoint, replay_endpoint, topic = events
        publisher = KVEventPublisher(endpoint, replay_endpoint, topic=topic)

    class PublishingModel(StubModel):
        def prompt_ids(self, request):
            ids = super().prompt_ids(request)
            if publisher is not None and len(ids) >= block_size:
                publisher.publish([stored_event(ids, block_size)])
            return ids

    model = PublishingModel(served, TokenizerBundle.from_hf_dir(model_dir), output_tokens=8, max_model_len=4096)
    app = build_app(model)

    @web.middleware
    async def engine_routes(request, handler):
        if request.path == "/kvgate/tokenizer":
            raise web.HTTPNotFound()  # vLLM and SGLang have no such route
        if request.path == "/metrics" and engine == "sglang" and not args.enable_metrics:
            raise web.HTTPNotFound()  # SGLang serves /metrics only with --enable-metrics
        return await handler(request)

    app.middlewares.append(engine_routes)
    app.middlewares.append(_pd_middleware(engine, args, host))
    try:
        asyncio.run(serve_app(app, host, args.port))
    finally:
        if publisher is not None:
            publisher.close()


def _pd_middleware(engine: str, args, host: str):
    """Records generation requests; a vLLM kv_producer answers a prefill leg with its params."""
    from aiohttp import web
    producer = engine == "vllm" and (args.kv_transfer_config or {}).get("kv_role") == "kv_producer"
    side_port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
    requests_file = os.environ.get("FAKE_ENGINE_REQUESTS")
    counter = iter(range(1, 1 << 30))

    @web.middleware
    async def pd(request, handler):
        if request.method != "POST" or not request.path.startswith("/v1/"):
            return await handler(request)
        body = json.loads(await request.read())
        if requests_file:
            with open(requests_file, "a") as out:
                out.write(json.dumps({"path": request.path, "body": body}) + "\n")
        response = await handler(request)
        params = body.get("kv_transfer_params") or {}
        if producer and params.get("do_remote_decode") and isinstance(response, web.Response):
            answer = json.loads(response.body)
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": f"fake-{os.getpid()}",
                "remote_block_ids": [[1, 2, 3]], "remote_host": host, "remote_port": side_port,
                "remote_request_id": f"fake-req-{next(counter)}", "tp_size": 1}
            return web.json_response(answer)
        return response
    return pd


def stored_event(token_ids: list[int], block_size: int):
    """One BlockStored for the prompt's full blocks (hashes here are any chain: the gateway
    rebuilds its own from the token IDs)."""
    from replica.block_pool import StoredEvent
    full = len(token_ids) // block_size * block_size
    hashes, parent = [], None
    for start in range(0, full, block_size):
        digest = hashlib.blake2b(repr((parent, token_ids[start:start + block_size])).encode(), digest_size=8)
        parent = int.from_bytes(digest.digest(), "big") >> 1
        hashes.append(parent)
    return StoredEvent(hashes, None, token_ids[:full], block_size)


if __name__ == "__main__":
    main()
