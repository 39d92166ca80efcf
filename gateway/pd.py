"""Disaggregated prefill/decode (DESIGN contract 5): the legs of one try on a P/D pool.

The try's replica is a decode replica, chosen by the routing policy among the decode pool (load,
and its own prefix cache). Then:

  skip       it already holds `pd.skip_prefill_fraction` of the prompt, or lacks fewer than
             `pd.min_prefill_tokens`: it prefills the rest itself, no prefill leg (as llm-d and
             vllm-router do)
  kvgate /   a prefill leg first, to a prefill replica the policy chooses among the prefill pool
  vllm       (prefix affinity): the client's body with max_tokens=1, stream=false and
             kv_transfer_params={do_remote_decode: true}; its answer's kv_transfer_params go
             with the decode leg, which pulls the KV blocks it lacks and generates
  sglang     SGLang's bootstrap protocol: the same body, with bootstrap_host/port/room, to the
             prefill and the decode server at once; the prefill answer is read and dropped

A prefill leg that fails is tried on another prefill replica, then given up: the decode replica
prefills itself (`fallback`). A decode leg whose pull fails (the prefill replica died, its pin
expired) is tried again with a fresh prefill leg elsewhere; one that dies mid-stream resumes on
another replica from its tokens (gateway/proxy.py), which recomputes. Nothing waits past the
request's deadline."""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
import msgspec
import structlog

from gateway.router import Router
from gateway.upstream import ReplicaPool, ReplicaState, refused, timeout_at

log = structlog.get_logger("kvgate.pd")
_encode_json = msgspec.json.Encoder().encode
_decode_json = msgspec.json.Decoder().decode

PREFILL_TRIES = 2          # prefill replicas tried per decode try before the decode replica prefills
SGLANG_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
_PREFILL_LEG = {"stream": False, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None,
                                       "remote_host": None, "remote_port": None}}


@dataclass
class PDState:
    """What one request's P/D legs learned across its tries (also its record's `pd` field)."""
    prefill_failed: list[str] = field(default_factory=list)  # prefill replicas that failed this request
    local_prefill: bool = False   # give up on prefill legs: the decode replica computes the prompt
    record: dict = field(default_factory=dict)


@dataclass
class DecodeLeg:
    payload: bytes
    prefill_task: asyncio.Task | None = None  # sglang: the prefill server's request, read and dropped

    async def close(self, answered: bool) -> None:
        """After the decode try: a prefill leg still running is left to finish (bounded by the
        request's deadline) when the answer came, and cancelled when it did not."""
        task = self.prefill_task
        if task is not None and not task.done() and not answered:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def is_pd_error(code) -> bool:
    """A decode leg's 4xx/5xx that is the KV transfer's, not the client's (gateway: try again)."""
    return isinstance(code, str) and (code.startswith("kv_") or code == "invalid_kv_transfer_params")


class PrefillDecode:
    def __init__(self, pool: ReplicaPool, router: Router, metrics) -> None:
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self._decode_models: tuple[object, frozenset[str]] = (None, frozenset())  # (config, its P/D models)

    def decode_pool(self, model: str) -> bool:
        """Is `model` served by a P/D pool (decode replicas configured)? Asked of every request:
        the answer is worked out once per config (a reload brings a new one)."""
        config = self.pool.config
        if self._decode_models[0] is not config:
            self._decode_models = (config, frozenset(spec.model for spec in config.replicas
                                                     if spec.role == "decode"))
        return model in self._decode_models[1]

    async def decode_leg(self, plan, record, decode: ReplicaState, matched_tokens: int,
                         state: PDState) -> DecodeLeg:
        """The body the decode replica gets, after the prefill leg when one is needed."""
        prompt_tokens = len(plan.prompt_ids)
        entry = state.record
        entry.update(decode=decode.name)
        pd = self.pool.config.routing.pd
        if state.local_prefill:
            entry.update(prefill=None, fallback="decode replica prefills")
            return DecodeLeg(plan.payload)
        if matched_tokens >= pd.skip_prefill_fraction * prompt_tokens \
                or prompt_tokens - matched_tokens < pd.min_prefill_tokens:
            entry.update(prefill=None, skipped_prefill=True, decode_cached_tokens=matched_tokens)
            self.metrics.pd_requests.labels(path="skipped_prefill").inc()
            return DecodeLeg(plan.payload)
        if decode.spec.engine_name == "sglang":
            return self._sglang(plan, decode, state, record.endpoint)
        params = await self._prefill_leg(plan, record, state)
        if params is None:
            entry.update(fallback="decode replica prefills")
            self.metrics.pd_requests.labels(path="fallback").inc()
            return DecodeLeg(plan.payload)
        self.metrics.pd_requests.labels(path="prefill_decode").inc()
        return DecodeLeg(_encode_json({**plan.raw, "kv_transfer_params": params}))

    async def _prefill_leg(self, plan, record, state: PDState) -> dict | None:
        """kv_transfer_params from a prefill replica, or None when no prefill replica could answer."""
        loop = asyncio.get_running_loop()
        body = {key: value for key, value in plan.raw.items()
                if key not in ("stream_options", "max_completion_tokens")}
        body.update(_PREFILL_LEG)
        payload = _encode_json(body)
        entry = state.record
        for _ in range(PREFILL_TRIES):
            names = [r.name for r in self.pool.candidates(plan.model)
                     if r.spec.role == "prefill" and r.name not in state.prefill_failed]
            if not names:
                break
            started = time.perf_counter()
            with self.router.attempt(names, plan.model, plan.prompt_ids, plan.hashes(), plan.session_key,
                                     plan.parsed.cache_salt, 1) as attempt:
                prefill = self.pool.by_name[attempt.replica]
                entry.update(prefill=prefill.name, prefill_routing=attempt.log.get("reason"))
                reason = None
                try:
                    async with timeout_at(min(plan.deadline, loop.time() + plan.ttft_timeout_s)):
                        async with self.pool.session.post(prefill.base_url + record.endpoint, data=payload,
                                                          headers={"content-type": "application/json",
                                                                   "x-request-id": record.request_id}) as resp:
                            reply = await resp.read()
                            status = resp.status
                except TimeoutError:
                    reason, fatal = "prefill leg timed out", False
                except aiohttp.ClientError as exc:
                    reason, fatal = f"prefill leg: {type(exc).__name__}: {exc}", refused(exc)
                if reason is None:
                    answer = _safe_json(reply)
                    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
                    if status == 200 and isinstance(params, dict) and params.get("do_remote_prefill"):
                        attempt.first_token()
                        usage = answer.get("usage") or {}
                        attempt.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                        entry.update(prefill_ms=round((time.perf_counter() - started) * 1000, 3),
                                     prefill_cached_tokens=attempt.cached_tokens)
                        self.pool.report(prefill, ok=True)
                        return params
                    if 400 <= status < 500 and status not in (408, 429):
                        # The client's request is wrong for any replica: the decode leg will say so too.
                        log.warning("prefill_leg_refused", replica=prefill.name, status=status,
                                    request_id=record.request_id)
                        state.prefill_failed.append(prefill.name)
                        return None
                    reason, fatal = f"prefill leg: HTTP {status}", False
                state.prefill_failed.append(prefill.name)
                entry.setdefault("prefill_failures", []).append({"replica": prefill.name, "reason": reason})
                self.pool.report(prefill, ok=False, reason=reason, fatal=fatal)
                log.warning("prefill_leg_failed", replica=prefill.name, reason=reason, request_id=record.request_id)
        return None

    def _sglang(self, plan, decode: ReplicaState, state: PDState, endpoint: str) -> DecodeLeg:
        names = [r for r in self.pool.candidates(plan.model)
                 if r.spec.role == "prefill" and r.name not in state.prefill_failed]
        if not names:
            state.record.update(fallback="no prefill replica")
            return DecodeLeg(plan.payload)
        prefill = random.choice(names) if len(names) > 1 else names[0]
        fields = {"bootstrap_host": urlsplit(prefill.base_url).hostname,
                  "bootstrap_port": prefill.spec.bootstrap_port or SGLANG_BOOTSTRAP_PORT,
                  "bootstrap_room": random.getrandbits(63)}
        payload = _encode_json({**plan.raw, **fields})
        state.record.update(prefill=prefill.name, bootstrap_room=fields["bootstrap_room"])
        self.metrics.pd_requests.labels(path="prefill_decode").inc()

        async def prefill_leg() -> None:  # read to its end and dropped, as SGLang's router does
            try:
                async with timeout_at(plan.deadline):
                    async with self.pool.session.post(prefill.base_url + endpoint, data=payload,
                                                      headers={"content-type": "application/json"}) as resp:
                        await resp.read()
                        if resp.status != 200:
                            log.warning("prefill_leg_failed", replica=prefill.name, status=resp.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("prefill_leg_failed", replica=prefill.name, reason=f"{type(exc).__name__}: {exc}")
        return DecodeLeg(payload, asyncio.get_running_loop().create_task(prefill_leg()))


def _safe_json(body: bytes):
    try:
        return _decode_json(body)
    except msgspec.DecodeError:
        return None
