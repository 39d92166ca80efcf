"""`python -m replica` / `kvgate replica`: load a model, start the engine thread and the HTTP server,
print one ready line, stop cleanly on SIGINT/SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import structlog

from replica.cpu_policy import POLICIES, apply_to_current_thread
from replica.memory import bound_heap_retention, page_out_file_mappings, return_freed_heap

ROLES = ("mixed", "prefill", "decode")
SHUTDOWN_GRACE_S = 5.0
EXIT_ENGINE_DIED = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate replica", description="Run one built-in kvgate replica.")
    parser.add_argument("--model", required=True, help="HF checkpoint dir, FILE.gguf, 'smollm2' or 'tiny'")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: from the model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--cpu-policy", choices=POLICIES, default="batch",
                        help="Linux scheduling policy of the engine's compute threads: 'batch' (SCHED_BATCH: "
                             "same CPU share, but a wake-up does not preempt a co-located gateway's event "
                             "loop) or 'normal'")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-waiting", type=int, default=256,
                        help="queued requests beyond which new ones get 429")
    parser.add_argument("--max-running", type=int, default=64,
                        help="most sequences in the running batch (vLLM's --max-num-seqs)")
    parser.add_argument("--kv-cache-gb", type=float, default=0.25, help="memory for the paged KV cache")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest sequence (prompt + output) served; default: the model's context, "
                             "capped to what the KV cache holds for one sequence")
    parser.add_argument("--generation-config", default="auto",
                        help="default sampling for fields a request leaves out, as vLLM: 'auto' (the "
                             "model's generation_config.json, or its model card's advice), 'vllm' "
                             "(neutral: temperature 1, top_p 1), or a directory with a generation_config.json")
    parser.add_argument("--override-generation-config", default=None, metavar="JSON",
                        help="""sampling defaults on top of --generation-config, e.g. '{"temperature": 0.7}'""")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="tokens per engine step (decodes + prefill chunks)")
    parser.add_argument("--kv-events-endpoint", default=None,
                        help="publish KV events (vLLM's shape) on this ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557")
    parser.add_argument("--kv-events-replay-endpoint", default=None,
                        help="ZMQ ROUTER endpoint answering replay requests for missed event batches")
    parser.add_argument("--role", choices=ROLES, default="mixed",
                        help="disaggregated prefill/decode (vLLM's kv_transfer_params protocol): 'prefill' "
                             "answers do_remote_decode requests and serves their KV blocks, 'decode' pulls "
                             "them for do_remote_prefill requests, 'mixed' does both; all serve plain requests")
    parser.add_argument("--kv-lease-duration-s", type=float, default=30.0,
                        help="prefill side: how long a finished request's KV blocks stay pinned for a pull "
                             "(vLLM's kv_lease_duration)")
    parser.add_argument("--kv-pull-timeout-s", type=float, default=10.0,
                        help="decode side: bound on one KV pull (connect, request, all bytes)")
    parser.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"), default="fail",
                        help="decode side: a failed pull fails the request (vLLM's default) or computes the "
                             "prompt here; a request may choose with kv_transfer_params.kv_load_failure_policy")
    parser.add_argument("--kv-transfer-host", default=None,
                        help="prefill side: the remote_host decode replicas pull from (default: --host, or "
                             "127.0.0.1 when --host is a wildcard address)")
    parser.add_argument("--health-stall-s", type=float, default=30.0,
                        help="/health answers 503 when the engine has work but no step finished this long")
    parser.add_argument("--debug-fault", default=None, help=argparse.SUPPRESS)  # tests: crash/stall-after-steps=N
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--log-format", default="auto", choices=("auto", "json", "console"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.kv_lease_duration_s <= 0 or args.kv_pull_timeout_s <= 0:
        print("kvgate replica: --kv-lease-duration-s and --kv-pull-timeout-s must be > 0", file=sys.stderr)
        return 2
    if min(args.threads, args.max_waiting, args.max_running, args.block_size, args.max_num_batched_tokens) < 1:
        print("kvgate replica: --threads, --max-waiting, --max-running, --block-size and "
              "--max-num-batched-tokens must be >= 1", file=sys.stderr)
        return 2
    if args.kv_cache_gb <= 0:
        print("kvgate replica: --kv-cache-gb must be > 0", file=sys.stderr)
        return 2
    if args.max_model_len is not None and args.max_model_len < 1:
        print("kvgate replica: --max-model-len must be >= 1", file=sys.stderr)
        return 2
    override = None
    if args.override_generation_config:
        import json
        try:
            override = json.loads(args.override_generation_config)
        except json.JSONDecodeError as exc:
            print(f"kvgate replica: --override-generation-config is not JSON: {exc}", file=sys.stderr)
            return 2
        if not isinstance(override, dict):
            print("kvgate replica: --override-generation-config must be a JSON object", file=sys.stderr)
            return 2

    from observability.logs import configure_logging
    configure_logging(args.log_level, args.log_format)
    log = structlog.get_logger("kvgate.replica")

    bound_heap_retention()
    import torch  # only now: argument errors above answer without paying for torch's import

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (e.g. called twice in one process)
        pass

    from replica.loader import load_model

    try:
        loaded = load_model(args.model, dtype=getattr(torch, args.dtype), name=args.served_model_name)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvgate replica: cannot load model {args.model!r}: {exc}", file=sys.stderr)
        return 2
    return_freed_heap()
    log.info("model_loaded", model=loaded.name, source=loaded.source, max_model_len=loaded.max_model_len,
             dtype=args.dtype, threads=args.threads)
    if args.max_model_len is not None and args.max_model_len > loaded.max_model_len:
        return _refuse(log, f"--max-model-len {args.max_model_len} is greater than the model's context "
                            f"({loaded.max_model_len} tokens, max_position_embeddings)")
    from replica.generation_config import GenerationConfigError, resolve_sampling_defaults
    try:
        defaults, ignored = resolve_sampling_defaults(args.generation_config, loaded.recommended_sampling,
                                                      override, loaded.recommended_by)
    except GenerationConfigError as exc:
        return _refuse(log, str(exc))
    if defaults.source != "vllm":
        # vLLM says the same: a user surprised by a non-1.0 temperature learns where it came from.
        log.info("default_sampling", source=defaults.source, **defaults.as_dict(),
                 hint="--generation-config vllm for neutral defaults")
    if ignored:
        log.warning("default_sampling_ignored", fields=ignored,
                    reason="the built-in engine does not implement these yet")
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        runner = asyncio.run
    return runner(_serve(args, loaded, defaults, log))


def _refuse(log, message: str) -> int:
    log.error("replica_start_refused", error=message)
    print(f"kvgate replica: {message}", file=sys.stderr)
    return 2


async def _serve(args, loaded, defaults, log) -> int:
    from aiohttp import web

    from protocol.http import OpenAIErrorsSite
    from replica.engine import Engine
    from replica.server import ReplicaServer

    from replica.liveness import EngineLiveness
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    engine_died: list[BaseException] = []

    def on_fatal(error: BaseException) -> None:  # on the worker thread: the loop ends the process
        engine_died.append(error)
        loop.call_soon_threadsafe(stop.set)

    try:
        liveness = EngineLiveness(args.health_stall_s, args.debug_fault)
    except ValueError as exc:
        return _refuse(log, str(exc))
    # The HTTP (this) thread: batch without a lower priority (replica/cpu_policy.py), before the
    # helper threads start (the KV event publisher's, which wakes every engine step, and ZMQ's):
    # they inherit it. After the model loaded: torch's workers start from the engine thread.
    if args.cpu_policy == "batch" and not apply_to_current_thread("batch", lower_priority=False):
        log.warning("cpu_policy_not_applied", policy="batch", thread="http")
    kv_events = None
    if args.kv_events_endpoint:
        from replica.kv_events import KVEventPublisher
        kv_events = KVEventPublisher(args.kv_events_endpoint, args.kv_events_replay_endpoint)
    try:
        engine = Engine(loaded.model, loaded.config, loaded.tokenizer,
                        max_model_len=args.max_model_len or loaded.max_model_len,
                        max_model_len_requested=args.max_model_len is not None,
                        max_waiting=args.max_waiting, max_running=args.max_running,
                        kv_cache_gb=args.kv_cache_gb, block_size=args.block_size,
                        max_num_batched_tokens=args.max_num_batched_tokens, kv_events=kv_events,
                        kv_lease_s=args.kv_lease_duration_s, liveness=liveness, on_fatal=on_fatal,
                        cpu_policy=args.cpu_policy)
    except ValueError as exc:
        if kv_events is not None:
            kv_events.close()
        return _refuse(log, str(exc))
    log.info("kv_cache_ready", num_blocks=engine.pool.num_blocks, block_size=args.block_size,
             kv_cache_bytes=engine.runner.kv_cache_bytes, max_model_len=engine.max_model_len)
    if engine.max_model_len < engine.model_max_len:
        log.warning("max_model_len_capped", model_max_len=engine.model_max_len, max_model_len=engine.max_model_len,
                    kv_cache_tokens=engine.pool.num_blocks * args.block_size,
                    hint="one sequence must fit the KV cache: raise --kv-cache-gb for a longer context")
    engine.start()
    server = ReplicaServer(engine, loaded.tokenizer, model_name=loaded.name, source=loaded.source,
                           vocab_size=loaded.config.vocab_size, sampling_defaults=defaults, role=args.role,
                           kv_pull_timeout_s=args.kv_pull_timeout_s,
                           kv_load_failure_policy=args.kv_load_failure_policy)
    # handler_cancellation: a client that hangs up on a non-streamed request cancels the handler,
    # whose `finally` aborts the sequence. On shutdown, in-flight requests get a few seconds to end
    # (a gateway in front resumes the rest elsewhere).
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = OpenAIErrorsSite(runner, args.host, args.port)  # parser refusals in OpenAI's shape too
        await site.start()
        host, port = runner.addresses[0][:2]
        url = f"http://{host}:{port}"
        server.kv.advertised = (args.kv_transfer_host or _reachable(args.host), port)
        log.info("replica_ready", model=loaded.name, url=url, role=args.role,
                 kv_engine_id=server.kv.engine_id if args.role != "mixed" else None)
        print(f"replica ready model={loaded.name} url={url}", flush=True)
        # Start-up is over: library pages touched only while importing and loading go back to the
        # page cache (serving faults back the few it uses).
        log.info("startup_pages_released", mapped_bytes_advised=page_out_file_mappings())
        await stop.wait()
        if engine_died:
            # Its requests have their error; /health says why meanwhile. Exit so a supervisor
            # (kvgate up, systemd, k8s) restarts a process whose engine is gone.
            log.error("replica_exiting", reason="engine thread died", error=str(engine_died[0]))
        else:
            log.info("replica_stopping")
    finally:
        await runner.cleanup()
        engine.shutdown(timeout_s=1.0 if engine.health_problem() else 10.0)  # a hung worker never joins
        if kv_events is not None:
            kv_events.close()
        # See gateway/server.py: join executor threads before uvloop closes the loop.
        await asyncio.get_running_loop().shutdown_default_executor()
    return EXIT_ENGINE_DIED if engine_died else 0


def _reachable(host: str) -> str:
    """The address others reach this replica at: a wildcard listen address is not one."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
