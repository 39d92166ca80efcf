"""`kvgate` command line: up | serve | replica | check-config | tail | keys.

Each subcommand imports what it needs when it runs: `kvgate replica` is the only one that loads
torch (through `replica.cli`), so the gateway process stays torch-free, and `kvgate tail` loads
neither aiohttp nor the gateway."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local.yaml"
EXIT_BAD_CONFIG = 1
EXIT_MISSING_FILE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="KV-cache-aware gateway for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the built-in replicas of a config, then the gateway")
    up.add_argument("--config", default=None, help=f"routing YAML (default: {DEFAULT_CONFIG})")
    up.add_argument("--startup-timeout-s", type=float, default=None,
                    help="how long each replica may take to load before kvgate gives up (default: "
                         "600 s for kvgate's own, 3600 s for vLLM and SGLang, which may download weights first)")
    up.add_argument("--replica-logs", default=None, metavar="DIR",
                    help="write each replica's output to DIR/<name>.log and keep it (default: a temporary "
                         "directory, removed when kvgate stops cleanly and kept when a replica failed)")
    serve = sub.add_parser("serve", help="run the gateway alone in front of the replicas in a config")
    serve.add_argument("--config", required=True, help="routing YAML")
    sub.add_parser("replica", help="run one built-in replica (see `kvgate replica --help`)", add_help=False)
    sub.add_parser("tail", help="follow the JSON request log, one readable line per request "
                                "(see `kvgate tail --help`)", add_help=False)
    check = sub.add_parser("check-config", help="validate a routing YAML file")
    check.add_argument("file")
    check.add_argument("--commands", action="store_true",
                       help="also print the command `kvgate up` runs for each `launch` entry")
    keys = sub.add_parser("keys", help="API keys and the admin token in a routing YAML (see `kvgate keys -h`)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    add = keys_sub.add_parser("add", help="make a new API key: prints it once, writes only its SHA-256")
    add.add_argument("name", help="the key's name (in logs and records; letters, digits, _ . @ -)")
    add.add_argument("--tenant", help="tenant whose prefix cache it shares (default: the key's own name)")
    add.add_argument("--models", nargs="+", metavar="MODEL", help="models it may use (default: every model)")
    add.add_argument("--rpm", type=int, help="requests per minute")
    add.add_argument("--tpm", type=int, help="tokens per minute (prompt + output)")
    add.add_argument("--max-prompt-tokens", type=int, help="longest prompt it may send")
    add.add_argument("--max-tokens", type=int, help="cap on the output it may ask for")
    add.add_argument("--allow-cache-salt", action="store_true", help="keep the cache_salt it sends (trusted)")
    add.add_argument("--allow-kv-transfer-params", action="store_true",
                     help="forward the kv_transfer_params it sends (trusted)")
    revoke = keys_sub.add_parser("revoke", help="remove a key (a running gateway drops it within a second)")
    revoke.add_argument("name")
    keys_sub.add_parser("list", help="the keys' names, tenants and limits (never the keys)")
    keys_sub.add_parser("admin-token", help="make a new admin token: prints it once, writes its SHA-256")
    for command in keys_sub.choices.values():
        command.add_argument("--config", default=str(DEFAULT_CONFIG), help="routing YAML (default: %(default)s)")
    return parser


def _load(path: str | Path):
    """The config, or an exit code after printing why not (same message for every subcommand)."""
    from gateway.config import ConfigError, load_config
    try:
        config = load_config(path)
    except FileNotFoundError:
        print(f"error: {path}: no such file", file=sys.stderr)
        return EXIT_MISSING_FILE
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    log_file = config.logging.file_path()
    if log_file is not None:
        from observability.logs import log_file_problem
        if problem := log_file_problem(log_file):
            print(f"error: {path}:{_key_line(path, ['logging', 'file'])}: logging.file: {problem}", file=sys.stderr)
            return EXIT_BAD_CONFIG
    return config


def _key_line(path: str | Path, key: list) -> int:
    """The line of `key` in a config file that has already parsed (for checks made outside it)."""
    import yaml
    from gateway.config import _line_of
    return _line_of(yaml.compose(Path(path).read_text(encoding="utf-8"), Loader=yaml.SafeLoader), key)


def _start_logging(config):
    """structlog as the config says, plus the JSON log file if it names one: (True, the LogFile
    or None); (False, None) after saying why that file cannot be opened."""
    from observability.logs import LogFile, configure_logging
    log_file = None
    path = config.logging.file_path()
    if path is not None:
        try:
            log_file = LogFile(path, max_bytes=int(config.logging.file_max_mb * 1024 * 1024),
                               keep=config.logging.file_keep)
        except OSError as exc:
            print(f"error: logging.file: cannot open {path}: {exc.strerror or exc}", file=sys.stderr)
            return False, None
        print(f"kvgate: JSON log in {path} (follow it with: kvgate tail {path})", file=sys.stderr, flush=True)
    configure_logging(config.logging.level, config.logging.format, log_file=log_file)
    return True, log_file


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "replica":
        from replica.cli import main as replica_main  # torch loads here, and only here
        return replica_main(argv[1:])
    if argv and argv[0] == "tail":
        from observability.tail import main as tail_main
        return tail_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        config = _load(args.file)
        if isinstance(config, int):
            return config
        print(f"ok: {args.file} ({len(config.replicas)} replica{'s' if len(config.replicas) != 1 else ''}, "
              f"policy {config.routing.policy})")
        if args.commands:
            from gateway.engines import engine_command
            for spec in config.replicas:
                if spec.launch is not None:
                    print(f"{spec.name}: {engine_command(spec, config.routing.block_size).shell()}")
        return 0
    if args.command == "keys":
        from gateway.keys_cli import main as keys_main
        return keys_main(args)
    if args.command == "serve":
        return _serve(args.config)
    if args.command == "up":
        return _up(args.config or DEFAULT_CONFIG, args.startup_timeout_s, args.replica_logs)
    return 2


def _serve(path: str) -> int:
    config = _load(path)
    if isinstance(config, int):
        return config
    from gateway.server import print_ready, run
    started, log_file = _start_logging(config)
    if not started:
        return EXIT_BAD_CONFIG
    if config.gateway.workers > 1:
        from gateway.workers import run_workers  # this process supervises; the workers serve
        return run_workers(config, path, admin_token=_admin_token(), log_file=log_file,
                           on_ready=print_ready(config))
    return run(config, on_ready=print_ready(config), config_path=path, admin_token=_admin_token())


def _admin_token() -> str | None:
    """The admin token from the environment, read here at the edge and passed down."""
    return os.environ.get("KVGATE_ADMIN_TOKEN") or None


def _up(path: str | Path, startup_timeout_s: float | None, replica_logs: str | None = None) -> int:
    config = _load(path)
    if isinstance(config, int):
        return config
    from gateway.launcher import LaunchError, Launcher
    from gateway.server import print_ready, run
    started, log_file = _start_logging(config)
    if not started:
        return EXIT_BAD_CONFIG
    try:
        launcher = Launcher(config, Path(replica_logs) if replica_logs else None)
    except OSError as exc:
        print(f"error: --replica-logs {replica_logs}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG

    def interrupt(_signum, _frame):  # SIGTERM while replicas load: same orderly stop as Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        launcher.start()
        if launcher.replicas:
            _wait_with_progress(launcher, startup_timeout_s)
        if config.gateway.workers > 1:  # this process keeps the replicas; the workers serve
            from gateway.workers import run_workers
            return run_workers(config, str(path), launcher, _admin_token(), log_file, print_ready(config))
        return run(config, on_ready=print_ready(config), config_path=str(path), launcher=launcher,
                   admin_token=_admin_token())
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        launcher.stop()


def _wait_with_progress(launcher, timeout_s: float | None) -> None:
    names = ", ".join(r.spec.name for r in launcher.replicas)
    kept = "" if not launcher.temporary_logs else "; removed at a clean exit, --replica-logs DIR keeps them"
    print(f"kvgate: starting {len(launcher.replicas)} replica(s): {names} (logs in {launcher.log_dir}{kept})",
          file=sys.stderr, flush=True)
    for replica in launcher.replicas:
        if replica.spec.engine_name != "kvgate":  # say what runs: the user may need to run it by hand
            print(f"kvgate: {replica.spec.name}: {replica.command.shell()}", file=sys.stderr, flush=True)
    by_name = {r.spec.name: r for r in launcher.replicas}

    def latest(waiting: list[str]) -> str:
        """A loading engine's own progress line (vLLM and SGLang load for minutes)."""
        lines = [f"{name}: {line[:120]}" for name in waiting if (line := by_name[name].last_line())]
        return "; ".join(lines)

    if sys.stderr.isatty():
        from rich.console import Console
        from rich.markup import escape
        with Console(stderr=True).status("loading replicas...") as status:
            launcher.wait_healthy(timeout_s, lambda waiting, elapsed_s: status.update(escape(
                f"loading {', '.join(waiting)} ({elapsed_s:.0f} s) {latest(waiting)}")))
    else:
        last_report = [0.0]

        def report(waiting: list[str], elapsed_s: float) -> None:
            if elapsed_s - last_report[0] >= 5.0:
                last_report[0] = elapsed_s
                print(f"kvgate: waiting for {', '.join(waiting)} ({elapsed_s:.0f} s) {latest(waiting)}".rstrip(),
                      file=sys.stderr, flush=True)

        launcher.wait_healthy(timeout_s, report)
    print("kvgate: replicas healthy", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
