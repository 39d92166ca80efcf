"""Routing YAML as typed structs: decoded once, validated once, errors naming the key and its line.

msgspec checks keys and types and reports a path (`$.replicas[0].prot`); PyYAML's node tree maps
that path back to a line, so a user reads `configs/x.yaml:7: replicas[0].prot: unknown key`."""
from __future__ import annotations

import ipaddress
import re
import typing
from pathlib import Path
from typing import Annotated, Literal, Union
from urllib.parse import urlsplit

import msgspec
import yaml
from msgspec import Meta

from gateway.engines import engine_problems
from routing import POLICIES
from routing.params import (CacheAwareParams, ConsistentHashParams, LeastLoadParams, NonNegative, PositiveInt,
                            RoundRobinParams, SessionAffinityParams)

Port = Annotated[int, Meta(ge=1, le=65535)]
PositiveSeconds = Annotated[float, Meta(gt=0)]


class RouteTimeouts(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Per-model overrides of the gateway's timeouts (`gateway.routes: {MODEL: {...}}`)."""
    request_timeout_s: PositiveSeconds | None = None
    ttft_timeout_s: PositiveSeconds | None = None
    inter_token_timeout_s: PositiveSeconds | None = None


class GatewaySection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Port = 8000
    request_timeout_s: PositiveSeconds = 600.0     # whole request, every try and resume included
    connect_timeout_s: PositiveSeconds = 5.0       # opening a connection to a replica
    ttft_timeout_s: PositiveSeconds = 120.0        # request sent -> first token; past it the try is dead
    inter_token_timeout_s: PositiveSeconds = 30.0  # a stream silent this long is stalled: resumed elsewhere
    routes: dict[str, RouteTimeouts] = {}          # per model: timeouts that differ
    max_attempts: Annotated[int, Meta(ge=1, le=16)] = 3  # tries per request (first + retries/resumes)
    retry_budget: Annotated[float, Meta(ge=0, le=1)] = 0.2  # retries at most this fraction of recent requests
    retry_budget_min: Annotated[int, Meta(ge=0)] = 5       # ... but always this many per window
    max_in_flight_per_replica: PositiveInt = 256   # more wait in the gateway's queue
    queue_size: Annotated[int, Meta(ge=0)] = 1024  # requests waiting for a replica; more get 429
    queue_timeout_s: PositiveSeconds = 30.0        # longest wait in that queue before a 429
    drain_grace_s: Annotated[float, Meta(ge=0)] = 30.0  # SIGTERM: in-flight requests get this long
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 8 * 1024 * 1024
    # A non-streamed request whose replica fails mid-answer: false (default) tries it again from
    # scratch elsewhere, the replica's JSON answer passed through; true collects it from a streamed
    # replica, so it resumes from the tokens already made (an SSE relay per request: ~70% more
    # gateway CPU per non-streamed request on bench/vs_routers.py's stubs). Streams always resume.
    resume_non_stream: bool = False
    # Gateway processes on the port (SO_REUSEPORT), each with its own event loop; 1: one process
    # (gateway/workers.py says what they share and how).
    workers: Annotated[int, Meta(ge=1, le=64)] = 1

    def timeouts(self, model: str | None) -> tuple[float, float, float]:
        """(request, ttft, inter_token) timeouts in seconds for a model."""
        route = self.routes.get(model or "")
        if route is None:
            return self.request_timeout_s, self.ttft_timeout_s, self.inter_token_timeout_s
        return (route.request_timeout_s or self.request_timeout_s, route.ttft_timeout_s or self.ttft_timeout_s,
                route.inter_token_timeout_s or self.inter_token_timeout_s)


class HealthSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Active probes and passive ejection (gateway/health.py says how they combine)."""
    probe_interval_s: PositiveSeconds = 2.0
    probe_timeout_s: PositiveSeconds = 2.0
    healthy_threshold: PositiveInt = 2           # probes in a row that bring an ejected replica back
    unhealthy_threshold: PositiveInt = 2         # probe failures in a row that eject it
    eject_consecutive_failures: PositiveInt = 3  # request failures in a row that eject it
    eject_error_rate: Annotated[float, Meta(gt=0, le=1)] = 0.5
    error_window_s: PositiveSeconds = 10.0
    error_min_requests: PositiveInt = 10
    eject_base_s: PositiveSeconds = 2.0          # first ejection; doubles while the replica flaps
    eject_max_s: PositiveSeconds = 60.0
    restart_backoff_s: PositiveSeconds = 1.0     # `kvgate up`: first restart of a dead replica, doubling
    max_restarts_per_minute: Annotated[int, Meta(ge=0)] = 5
    # With every replica of a model out of rotation, send its requests to those not known to be
    # gone (ejected for timeouts or errors, not for a refused connection) instead of a 503: all
    # ejected at once usually means all loaded, and a 503 for everyone turns that into an outage.
    panic_routing: bool = True
    # Panic also while fewer than this fraction of a model's replicas are in rotation (Envoy's
    # healthy_panic_threshold, as a fraction): the requests then go to the ones in rotation and to
    # those out of it not known to be gone, so the few left are not buried under everyone's load
    # (ejected for timeouts, they would be next). 0: only when none is in rotation.
    panic_threshold: Annotated[float, Meta(ge=0, lt=1)] = 0.0


class LoggingSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"
    token_ids: Literal["full", "hashed", "off"] = "full"
    file: Annotated[str, Meta(min_length=1)] | None = None  # JSON lines here too; None: terminal only
    file_max_mb: Annotated[float, Meta(ge=0)] = 100.0       # rotate beyond this; 0: never
    file_keep: Annotated[int, Meta(ge=0, le=1000)] = 5      # rotated files kept: FILE.1 (newest) .. FILE.N

    def file_path(self) -> Path | None:
        """`file` as an absolute path; a relative one is taken from the directory kvgate starts in
        (where a user then runs `kvgate tail FILE`), not from the config file's directory."""
        return None if self.file is None else Path(self.file).expanduser().absolute()




Sha256Hex = Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]


class ApiKey(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One client's key (`kvgate keys add NAME` writes these): what it may ask for, and how much.
    The key itself is never stored, only its SHA-256 (gateway/auth.py says why that is enough)."""
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@-]+$")]
    sha256: Sha256Hex
    tenant: Annotated[str, Meta(min_length=1, max_length=64)] | None = None  # default: the key's name
    models: list[str] | None = None                # None: every model
    rpm: PositiveInt | None = None                 # requests per minute
    tpm: PositiveInt | None = None                 # tokens per minute (prompt + output)
    max_prompt_tokens: PositiveInt | None = None
    max_tokens: PositiveInt | None = None          # output cap: asked for more (or nothing) -> this
    allow_cache_salt: bool = False                 # its own `cache_salt` is kept (else the tenant's)
    allow_kv_transfer_params: bool = False         # its kv_transfer_params / bootstrap_* are forwarded (else dropped)

    @property
    def tenant_name(self) -> str:
        return self.tenant or self.name


class AuthSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """API keys and the admin token. No keys: every client is served (allowed on a loopback host
    only, unless `auth: none` says so explicitly)."""
    keys: list[ApiKey] = []
    admin_token_sha256: Sha256Hex | None = None   # /admin/*, /admin/health (and /metrics if `metrics: admin`)
    metrics: Literal["public", "admin"] = "public"


class LimitsSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What one request or one client may cost the gateway before any replica is involved."""
    max_headers: Annotated[int, Meta(ge=8, le=1024)] = 100        # header lines in a request
    max_header_bytes: Annotated[int, Meta(ge=1024, le=1 << 20)] = 8190  # request line / one header line
    max_json_depth: Annotated[int, Meta(ge=4, le=512)] = 64       # nesting of the JSON body
    max_json_containers: Annotated[int, Meta(ge=16)] = 100_000    # objects + arrays in one body
    max_prompt_tokens: PositiveInt | None = None                  # every request (a key may set fewer)
    header_timeout_s: PositiveSeconds = 10.0     # a request head's first byte -> its last
    body_timeout_s: PositiveSeconds = 60.0       # reading the whole body
    keepalive_timeout_s: PositiveSeconds = 75.0  # an idle keep-alive connection is closed after this
    max_connections_per_client: PositiveInt = 1024  # open connections from one IP address


class LoadModelSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How the load tracker turns tokens into seconds (routing.load.LoadModel)."""
    prefill_tokens_per_s: PositiveSeconds = 8000.0
    decode_step_s_per_seq: NonNegative = 0.002
    decode_step_base_s: NonNegative = 0.010
    # Measure each model's prefill rate and decode step from its requests (gateway/router.py) and
    # use those once each has 8 samples: the three values above are then only where it starts.
    learn: bool = True
    stale_after_s: PositiveSeconds = 10.0


class PDSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Prefill/decode pools (replicas with `role: prefill | decode`)."""
    # No prefill leg when the chosen decode replica already caches this much of the prompt ...
    skip_prefill_fraction: Annotated[float, Meta(ge=0, le=1)] = 0.8
    # ... or when what it lacks is shorter than this (a short prompt costs the decode replica less
    # than its wait behind long prompts in the prefill pool; llm-d's selective disaggregation).
    min_prefill_tokens: Annotated[int, Meta(ge=0)] = 256


class RoutingSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    policy: str = "round_robin"
    block_size: PositiveInt = 16                 # tokens per prefix block (the replicas' block size)
    session_header: str = "x-session-id"         # affinity key header; the body's `user` field also counts
    guess_ttl_s: PositiveSeconds = 300.0         # a routed-but-unconfirmed prefix is forgotten after this
    default_capacity_blocks: PositiveInt = 8192  # a replica's KV capacity when YAML and /metrics don't say
    scrape_interval_s: PositiveSeconds = 2.0     # each replica's /metrics
    scrape_timeout_s: PositiveSeconds = 1.0
    kv_events_silence_s: PositiveSeconds = 10.0  # a serving replica without events this long -> approximate
    load: LoadModelSection = msgspec.field(default_factory=LoadModelSection)
    cache_aware: CacheAwareParams = msgspec.field(default_factory=CacheAwareParams)
    consistent_hash: ConsistentHashParams = msgspec.field(default_factory=ConsistentHashParams)
    least_load: LeastLoadParams = msgspec.field(default_factory=LeastLoadParams)
    session_affinity: SessionAffinityParams = msgspec.field(default_factory=SessionAffinityParams)
    pd: PDSection = msgspec.field(default_factory=PDSection)

    def policy_params(self, name: str | None = None) -> msgspec.Struct:
        """Policy `name`'s section (default: the configured policy's), the struct make_policy takes."""
        return getattr(self, name or self.policy, None) or RoundRobinParams()


Engine = Literal["kvgate", "vllm", "sglang"]
Role = Literal["mixed", "prefill", "decode"]


class LaunchSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How `kvgate up` starts the server for this entry: a built-in replica, or a vLLM / SGLang
    server (`engine`, which is also the replica's `engine`)."""
    model: str
    engine: Engine | None = None      # default: the replica's `engine` (kvgate)
    threads: Annotated[int, Meta(ge=1, le=1024)] = 1
    extra_args: list[str] = []
    executable: str | None = None     # the program instead of `vllm` / `python3` (sglang) / this Python (kvgate)
    env: dict[str, str] = {}          # extra environment for the process (e.g. CUDA_VISIBLE_DEVICES)


class KVEventsSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where a replica publishes its KV events (vLLM's ZMQ shape): precise mode for it."""
    endpoint: str                       # PUB socket, e.g. tcp://127.0.0.1:5557
    replay_endpoint: str | None = None  # ROUTER socket answering replay requests (gap resync)


class ReplicaSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    url: str
    model: str
    role: Role = "mixed"              # prefill / decode: a disaggregated pool (P/D), mixed: both
    engine: Engine = "kvgate"         # the server's protocol for P/D: kvgate and vllm (kv_transfer_params), sglang (bootstrap)
    bootstrap_port: Port | None = None  # sglang prefill: its --disaggregation-bootstrap-port (default 8998)
    tokenizer: str | None = None
    launch: LaunchSpec | None = None
    capacity_blocks: PositiveInt | None = None  # KV capacity in blocks (else learned, else the default)
    kv_events: KVEventsSpec | None = None

    @property
    def engine_name(self) -> str:
        return (self.launch.engine if self.launch is not None and self.launch.engine else None) or self.engine

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or (443 if self.url.startswith("https") else 80)


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    gateway: GatewaySection = msgspec.field(default_factory=GatewaySection)
    health: HealthSection = msgspec.field(default_factory=HealthSection)
    logging: LoggingSection = msgspec.field(default_factory=LoggingSection)
    routing: RoutingSection = msgspec.field(default_factory=RoutingSection)
    # `auth: none` (written out) serves without keys on any host; a section lists keys.
    auth: Union[Literal["none"], AuthSection] = msgspec.field(default_factory=AuthSection)
    limits: LimitsSection = msgspec.field(default_factory=LimitsSection)
    replicas: list[ReplicaSpec]

    def models(self) -> list[str]:
        return list(dict.fromkeys(replica.model for replica in self.replicas))

    @property
    def auth_section(self) -> AuthSection:
        return AuthSection() if self.auth == "none" else self.auth

    @property
    def keys_required(self) -> bool:
        """Whether /v1/* needs an API key: whenever keys are listed (and `auth: none` is not written)."""
        return self.auth != "none" and bool(self.auth.keys)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ConfigError(Exception):
    """A config file that cannot be used; the message is ready for a user: `file:line: key: why`."""


def load_config(path: str | Path) -> Config:
    """Read and validate a routing YAML file. FileNotFoundError if it does not exist."""
    path = Path(path)
    return parse_config(path.read_text(encoding="utf-8"), str(path))


def parse_config(text: str, source: str = "<config>") -> Config:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}:{line}: invalid YAML: {problem}") from None
    if root is None:
        raise ConfigError(f"{source}:1: empty config: expected a mapping with a `replicas` list")
    try:
        config = _decode(text, root)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc, root, source) from None
    problems = list(_value_problems(config))
    if problems:
        path, why = problems[0]
        raise ConfigError(f"{source}:{_line_of(root, path)}: {_dotted(path)}: {why}")
    return config


# YAML 1.1 (what PyYAML reads) takes unquoted on/off/yes/no for booleans, so `token_ids: off` is
# False; where a boolean is no valid value, the word as written is what the user meant.
_BOOL_WORDS = {"on", "off", "yes", "no"}
_MAX_BOOL_WORDS = 100  # words taken back per file (each is a decode): a bound, not a limit users meet


def _decode(text: str, root: yaml.Node) -> Config:
    data = None
    for _ in range(_MAX_BOOL_WORDS):
        try:
            return msgspec.yaml.decode(text.encode(), type=Config) if data is None else msgspec.convert(data, Config)
        except msgspec.ValidationError as exc:
            message = str(exc)
            at = _AT.search(message)
            path = _parse_path(at.group(1)) if at else []
            node, _line, found = _node_at(root, path)
            if not (path and found and "got `bool`" in message and isinstance(node, yaml.ScalarNode)
                    and node.tag == "tag:yaml.org,2002:bool" and node.value.lower() in _BOOL_WORDS):
                raise
            data = yaml.safe_load(text) if data is None else data
            parent = data
            for part in path[:-1]:
                parent = parent[part]
            parent[path[-1]] = node.value
    return msgspec.convert(data, Config)


# ---- value checks msgspec cannot express --------------------------------------------------------

def _value_problems(config: Config):
    if config.routing.policy not in POLICIES:
        yield (["routing", "policy"],
               f"unknown policy {config.routing.policy!r} (expected one of: {', '.join(POLICIES)})")
    fallback = config.routing.session_affinity.fallback
    if fallback not in POLICIES or fallback == "session_affinity":
        yield (["routing", "session_affinity", "fallback"],
               f"unknown fallback policy {fallback!r} (expected one of: "
               f"{', '.join(p for p in POLICIES if p != 'session_affinity')})")
    for model in config.gateway.routes:
        if model not in config.models():
            yield (["gateway", "routes", model],
                   f"no replica serves model {model!r} (models: {', '.join(config.models())})")
    if not config.routing.session_header.strip():
        yield ["routing", "session_header"], "must not be empty"
    if not config.replicas:
        yield ["replicas"], "must list at least one replica"
    yield from _auth_problems(config)
    seen_names: dict[str, int] = {}
    seen_urls: dict[str, int] = {}
    for index, replica in enumerate(config.replicas):
        if not replica.name.strip():
            yield ["replicas", index, "name"], "must not be empty"
        if replica.name in seen_names:
            yield (["replicas", index, "name"],
                   f"duplicate replica name {replica.name!r} (also replicas[{seen_names[replica.name]}])")
        seen_names.setdefault(replica.name, index)
        why = _url_problem(replica.url)
        if why:
            yield ["replicas", index, "url"], why
        elif replica.url.rstrip("/") in seen_urls:
            yield (["replicas", index, "url"],
                   f"duplicate url {replica.url!r} (also replicas[{seen_urls[replica.url.rstrip('/')]}])")
        seen_urls.setdefault(replica.url.rstrip("/"), index)
        if not replica.model.strip():
            yield ["replicas", index, "model"], "must not be empty"
        if replica.launch is not None and not replica.launch.model.strip():
            yield ["replicas", index, "launch", "model"], "must not be empty"
        if replica.launch is not None and not why and urlsplit(replica.url).port is None:
            yield ["replicas", index, "url"], "a replica with `launch` needs an explicit port in its url"
        if replica.launch is not None and replica.launch.engine and replica.engine != "kvgate" \
                and replica.launch.engine != replica.engine:
            yield (["replicas", index, "launch", "engine"],
                   f"{replica.launch.engine!r} differs from the replica's engine {replica.engine!r}")
        if replica.bootstrap_port is not None and replica.engine_name != "sglang":
            yield ["replicas", index, "bootstrap_port"], "only SGLang prefill servers have a bootstrap port"
        if replica.kv_events is not None:
            for key in ("endpoint", "replay_endpoint"):
                value = getattr(replica.kv_events, key)
                if value is not None and (bad := _zmq_endpoint_problem(value)):
                    yield ["replicas", index, "kv_events", key], bad
    yield from engine_problems(config)  # what vLLM / SGLang / kvgate servers need (tokenizer, ports, flags)


def _auth_problems(config: Config):
    if config.auth != "none" and not config.auth.keys and not is_loopback(config.gateway.host):
        yield (["gateway", "host"],
               f"{config.gateway.host!r} is not a loopback address and no API keys are configured: add one "
               "(kvgate keys add NAME) or write `auth: none` to serve every client without a key")
    if config.auth == "none":
        return
    names: dict[str, int] = {}
    hashes: dict[str, int] = {}
    for index, key in enumerate(config.auth.keys):
        if key.name in names:
            yield ["auth", "keys", index, "name"], f"duplicate key name {key.name!r} (also keys[{names[key.name]}])"
        if key.sha256 in hashes:
            yield ["auth", "keys", index, "sha256"], f"the same key as keys[{hashes[key.sha256]}]"
        names.setdefault(key.name, index)
        hashes.setdefault(key.sha256, index)
        for model in key.models or ():
            if model not in config.models():
                yield (["auth", "keys", index, "models"],
                       f"no replica serves model {model!r} (models: {', '.join(config.models())})")


def _zmq_endpoint_problem(endpoint: str) -> str | None:
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        return f"bad endpoint {endpoint!r}: expected tcp://host:port (or ipc://path)"
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            return f"bad endpoint {endpoint!r}: expected tcp://host:port with a port 1-65535"
    return None


def _url_problem(url: str) -> str | None:
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError when out of range or not a number
    except ValueError as exc:
        return f"bad url {url!r}: {exc}"
    if parts.scheme not in ("http", "https"):
        return f"bad url {url!r}: scheme must be http or https"
    if not parts.hostname:
        return f"bad url {url!r}: no host"
    if port == 0:
        return f"bad url {url!r}: port out of range 1-65535"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return f"bad url {url!r}: give the server's root (http://host:port), not a path"
    return None


# ---- msgspec errors -> file:line: key: why ------------------------------------------------------

_AT = re.compile(r"\s*- at `\$(.*)`$")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")
_MISSING = re.compile(r"Object missing required field `([^`]*)`")
_PART = re.compile(r"\.([A-Za-z_][\w-]*)|\[(\d+)\]|\.`([^`]*)`")


def _validation_error(exc: msgspec.ValidationError, root: yaml.Node, source: str) -> ConfigError:
    text = str(exc)
    at = _AT.search(text)
    path = _parse_path(at.group(1)) if at else []
    message = text[:at.start()] if at else text
    if unknown := _UNKNOWN.match(message):
        key = unknown.group(1)
        struct = _struct_at(path)
        expected = ", ".join(struct.__struct_fields__) if struct else "?"
        path = path + [key]
        why = f"unknown key (expected one of: {expected})"
    elif missing := _MISSING.match(message):
        return ConfigError(f"{source}:{_line_of(root, path)}: {_dotted(path + [missing.group(1)])}: "
                           "missing required key")
    else:
        why = (message[0].lower() + message[1:] if message else "invalid value").replace("`", "")
        choices = _choices(_type_at(path))
        if why.startswith("invalid enum value") and choices:
            why += f" (expected one of: {', '.join(map(str, choices))})"
    return ConfigError(f"{source}:{_line_of(root, path)}: {_dotted(path)}: {why}")


def _choices(tp) -> list[str]:
    """The values a Literal (or a union of a Literal and a section) accepts, for an error message."""
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) is Literal:
        return [str(value) for value in typing.get_args(tp)]
    out = []
    for member in typing.get_args(tp):
        if typing.get_origin(member) is Literal:
            out += [str(value) for value in typing.get_args(member)]
        elif isinstance(member, type) and issubclass(member, msgspec.Struct):
            out.append("a mapping")
    return out


def _parse_path(text: str) -> list:
    return [name or backticked if (name or backticked) else int(index)
            for name, index, backticked in _PART.findall(text)]


def _dotted(path: list) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _struct_at(path: list):
    current = _unwrap(_type_at(path))
    return current if isinstance(current, type) and issubclass(current, msgspec.Struct) else None


def _type_at(path: list):
    """The type found at `path` inside Config (list indices step into the element type)."""
    current = Config
    for part in path:
        current = _unwrap(current)
        if isinstance(part, int):
            args = typing.get_args(current)
            current = args[0] if args else None
        elif isinstance(current, type) and issubclass(current, msgspec.Struct):
            current = typing.get_type_hints(current).get(part)
        else:
            return None
    return current


def _unwrap(tp):
    """Optional[X] -> X (the non-None member), Annotated[X, ...] -> X, and a union of a Literal
    and a section (`auth: none | {...}`) -> the section, whose keys an error path steps into."""
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (Union, getattr(__import__("types"), "UnionType", Union)):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        structs = [a for a in members if isinstance(a, type) and issubclass(a, msgspec.Struct)]
        tp = members[0] if len(members) == 1 else structs[0] if len(structs) == 1 else tp
    return tp


def _line_of(root: yaml.Node, path: list) -> int:
    """1-based line of the deepest node along `path` that exists (the key's line for mappings)."""
    return _node_at(root, path)[1]


def _node_at(root: yaml.Node, path: list) -> tuple[yaml.Node, int, bool]:
    """The deepest node along `path` that exists, its 1-based line (the key's for mappings), and
    whether it is the whole path's."""
    node, line = root, root.start_mark.line + 1
    for part in path:
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            for key_node, value_node in node.value:
                if getattr(key_node, "value", None) == part:
                    line, node = key_node.start_mark.line + 1, value_node
                    break
            else:
                return node, line, False
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return node, line, False
    return node, line, True
