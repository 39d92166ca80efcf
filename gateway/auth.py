"""Who may use the gateway, and as whom: API keys, tenants, the admin token.

Keys. A key is 256 random bits (`kvg-` + 43 URL-safe characters, `kvgate keys add` prints it
once); the routing YAML keeps only its SHA-256. A slow password hash (scrypt, pbkdf2) makes
guessing a low-entropy secret expensive, but a random 256-bit key cannot be guessed, so a fast
hash gives away nothing and costs a microsecond per request instead of tens of milliseconds. A
presented key is hashed and compared with every stored hash with hmac.compare_digest (no early
exit, so timing says nothing about which key, if any, matched). Keys and hashes are never logged;
records name the key by its NAME.

Tenants. Every key belongs to a tenant (its own name unless `tenant:` groups keys). The gateway
sets the tenant's `cache_salt` on each request before routing: in the block hashes the router
matches and in the body the replica gets, so two tenants never share a cached prefix (a shared
one would tell a tenant, through its time to first token, what another one sent). A client's
own `cache_salt` and `kv_transfer_params` (which can name a remote KV host to a vLLM P/D replica;
SGLang's `bootstrap_host/port/room` likewise) are dropped unless its key is allowed them. With no
keys configured (a loopback host, or `auth: none`) requests pass as sent.

Per key: the models it may use, requests/min and tokens/min (gateway/ratelimit.py says when
tokens count), a prompt-token limit and a max_tokens cap."""
from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Callable

from aiohttp import web

from gateway.config import ApiKey, Config, LimitsSection, is_loopback
from gateway.ratelimit import KeyLimiter, duration
from protocol.errors import BadRequest, Forbidden, NotFound, RateLimited, Unauthorized
from protocol.requests import AnyRequest, ChatCompletionRequest, requested_max_tokens

KEY_PREFIX = "kvg-"
ADMIN_PREFIX = "kvgadm-"
GRANT = "kvgate.grant"  # request state: the caller's Grant
# Fields that tell a P/D replica where to move KV blocks from or to: vLLM's, and SGLang's bootstrap.
KV_TRANSFER_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="kvgate"'}


def new_secret(prefix: str = KEY_PREFIX) -> str:
    return prefix + secrets.token_urlsafe(32)


def secret_hash(secret: str) -> str:
    return _digest(secret).hex()


def _digest(secret: str) -> bytes:
    # surrogateescape: aiohttp hands header bytes that are not UTF-8 over as surrogates; such a
    # token matches nothing, but must not raise
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


def tenant_salt(tenant: str) -> str:
    return f"kvgate-tenant:{tenant}"


def bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class KeyPolicy:
    """One configured key, ready to match and to apply."""
    __slots__ = ("spec", "digest", "models", "cache_salt", "limiter")

    def __init__(self, spec: ApiKey, limiter: KeyLimiter) -> None:
        self.spec = spec
        self.digest = bytes.fromhex(spec.sha256)
        self.models = None if spec.models is None else frozenset(spec.models)
        self.cache_salt = tenant_salt(spec.tenant_name)
        self.limiter = limiter

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def tenant(self) -> str:
        return self.spec.tenant_name


class Grant:
    """What one request may do: its key (None: keys are off) and the limits in force. The proxy
    calls `admit` once it knows the model and the prompt's length, and `settle` when the request
    is over; the front door puts `headers()` on the response."""
    __slots__ = ("key", "limits", "record", "reserved_tokens")

    def __init__(self, key: KeyPolicy | None, limits: LimitsSection) -> None:
        self.key = key
        self.limits = limits
        self.record = None
        self.reserved_tokens: int | None = None

    def admit(self, parsed: AnyRequest, raw: dict | None, record) -> None:
        """Apply the key to a decoded request (model, tenant salt, client fields it may not send,
        max_tokens cap), then check the prompt's length and charge tokens/min. Edits `parsed` and
        `raw` (what the replica gets) in place; `raw` is None without a key (nothing to edit)."""
        key = self.key
        self.record = record
        if key is not None:
            record.key, record.tenant = key.name, key.tenant
            if key.models is not None and record.model not in key.models:
                raise NotFound(f"The model `{record.model}` does not exist or you do not have access to it.",
                               param="model", code="model_not_found")
            if not (key.spec.allow_cache_salt and parsed.cache_salt is not None):
                parsed.cache_salt = raw["cache_salt"] = key.cache_salt
            if not key.spec.allow_kv_transfer_params:
                for name in KV_TRANSFER_FIELDS:
                    raw.pop(name, None)
            if key.spec.max_tokens is not None:
                _cap_max_tokens(parsed, raw, key.spec.max_tokens)
        prompt_tokens = record.prompt_tokens or 0
        limit = self.limits.max_prompt_tokens if key is None else _smallest(self.limits.max_prompt_tokens,
                                                                           key.spec.max_prompt_tokens)
        if limit is not None and prompt_tokens > limit:
            param = "messages" if isinstance(parsed, ChatCompletionRequest) else "prompt"
            raise BadRequest(f"The prompt has {prompt_tokens} tokens; at most {limit} are allowed"
                             f"{' for this key' if key and key.spec.max_prompt_tokens == limit else ''}.",
                             param=param, code="prompt_too_long")
        if key is not None and key.limiter.tokens is not None:
            cost = prompt_tokens + (requested_max_tokens(parsed)[0] or 0)
            bucket = key.limiter.tokens
            wait_s = bucket.try_take(cost)
            if wait_s == float("inf"):
                raise BadRequest(f"This request needs {cost} tokens (prompt + max_tokens) but key "
                                 f"{key.name!r} may use {bucket.per_minute} tokens per minute; send a "
                                 "shorter prompt or a lower max_tokens.", param="max_tokens",
                                 code="request_too_large")
            if wait_s > 0:
                raise RateLimited(f"Rate limit reached for key {key.name!r} on tokens per min (TPM): limit "
                                  f"{bucket.per_minute}, requested {cost}. Please try again in "
                                  f"{duration(wait_s)}.", kind="tokens", retry_after_s=wait_s,
                                  headers=key.limiter.headers())
            self.reserved_tokens = cost

    def settle(self) -> None:
        """Correct the tokens/min charge to what the request really used (prompt + output produced)."""
        if self.reserved_tokens is None or self.key is None or self.key.limiter.tokens is None:
            return
        record = self.record
        output = record.completion_tokens if record.completion_tokens is not None else len(record.output_token_ids)
        self.key.limiter.tokens.adjust((record.prompt_tokens or 0) + output - self.reserved_tokens)
        self.reserved_tokens = None

    def headers(self) -> dict[str, str]:
        return self.key.limiter.headers() if self.key is not None else {}


def _smallest(*values: int | None) -> int | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _cap_max_tokens(parsed: AnyRequest, raw: dict, cap: int) -> None:
    fields = ("max_tokens", "max_completion_tokens") if isinstance(parsed, ChatCompletionRequest) else ("max_tokens",)
    asked = False
    for field in fields:
        value = getattr(parsed, field)
        if value is not None:
            asked = True
            if value > cap:
                setattr(parsed, field, cap)
                raw[field] = cap
    if not asked:
        parsed.max_tokens = raw["max_tokens"] = cap


class Gate:
    """The configured keys and admin token; `apply` follows a reload (rate-limit state is kept per
    key name, so a reload does not hand every key a fresh minute)."""

    def __init__(self, config: Config, admin_token: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # The admin token from the environment (read once at the CLI edge), hashed at once.
        self._env_admin = bytes.fromhex(secret_hash(admin_token)) if admin_token else None
        self.keys: list[KeyPolicy] = []
        self.apply(config)

    def apply(self, config: Config) -> None:
        section = config.auth_section
        old = {key.name: key.limiter for key in self.keys}
        keys = []
        for spec in section.keys:
            limiter = old.get(spec.name)
            if limiter is None:
                limiter = KeyLimiter(spec.rpm, spec.tpm, self.clock)
            else:
                limiter.resize(spec.rpm, spec.tpm)
            keys.append(KeyPolicy(spec, limiter))
        admin = [bytes.fromhex(section.admin_token_sha256)] if section.admin_token_sha256 else []
        if self._env_admin is not None:
            admin.append(self._env_admin)
        self.keys, self.admin_digests = keys, admin
        self.keys_required = config.keys_required
        self.limits = config.limits
        self.metrics_need_admin = section.metrics == "admin"
        # Admin endpoints are open only where the API is: a loopback host without keys or admin token.
        self.admin_open = not admin and not self.keys_required and is_loopback(config.gateway.host)

    def _match(self, token: str) -> KeyPolicy | None:
        digest = _digest(token)
        found = None
        for key in self.keys:  # every key is compared: no early exit
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found

    def authenticate(self, request: web.Request) -> Grant:
        """The caller's grant: 401 without a valid key (when keys are on), 429 past its requests/min."""
        if not self.keys_required:
            return Grant(None, self.limits)
        token = bearer(request)
        if token is None:
            raise Unauthorized("You didn't provide an API key. You need to provide your API key in an "
                               "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                               code="missing_api_key", headers=_CHALLENGE)
        key = self._match(token)
        if key is None:
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key", headers=_CHALLENGE)
        bucket = key.limiter.requests
        if bucket is not None:
            wait_s = bucket.try_take(1)
            if wait_s > 0:
                raise RateLimited(f"Rate limit reached for key {key.name!r} on requests per min (RPM): limit "
                                  f"{bucket.per_minute}. Please try again in {duration(wait_s)}.",
                                  kind="requests", retry_after_s=wait_s, headers=key.limiter.headers())
        return Grant(key, self.limits)

    def check_admin(self, request: web.Request) -> None:
        """401 without the admin token, 403 with an API key or when no admin token is configured."""
        if self.admin_open:
            return
        if not self.admin_digests:
            raise Forbidden("Admin endpoints are off: no admin token is configured (kvgate keys admin-token, "
                            "or KVGATE_ADMIN_TOKEN in kvgate's environment).", code="admin_disabled")
        token = bearer(request)
        if token is None:
            raise Unauthorized("This endpoint needs the admin token (Authorization: Bearer ADMIN_TOKEN).",
                               code="missing_admin_token", headers=_CHALLENGE)
        digest = _digest(token)
        matched = False
        for stored in self.admin_digests:
            matched |= hmac.compare_digest(digest, stored)
        if matched:
            return
        if self._match(token) is not None:
            raise Forbidden("An API key cannot use admin endpoints; use the admin token.", code="admin_only")
        raise Unauthorized("Incorrect admin token provided.", code="invalid_admin_token", headers=_CHALLENGE)


def grant_of(request: web.Request) -> Grant:
    """The grant the front door gave this request (a request built without it: keys off, default limits)."""
    grant = request.get(GRANT)
    return grant if grant is not None else Grant(None, LimitsSection())
