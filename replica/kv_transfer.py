"""Both sides of P/D for the built-in replica (protocol/kv_transfer.py has the wire shapes).

Prefill side (`--role prefill` or `mixed`): a `do_remote_decode` request is submitted with a pin
id; its answer carries `kv_transfer_params` for the decode leg (`decode_params`); `handle_pull`
serves POST /kvgate/kv/pull, copying the pinned blocks and releasing them.

Decode side (`--role decode` or `mixed`): a `do_remote_prefill` request first pulls, in the HTTP
handler before it reaches the engine, the prompt blocks the local prefix cache lacks (`pull`),
then is submitted with them staged. Every wait on the network is bounded by
`--kv-pull-timeout-s`; a failed pull answers at once with a typed error (`KVPullFailed`: the
remote's own 4xx passed on, else 502), or, when the request or `--kv-load-failure-policy` says
`recompute`, computes the prompt locally.

Thread boundary: pinned blocks are never written (see kv_pins.py), so packing them may run off the
event loop (an executor thread, for large pulls) while the worker runs a forward. Pulled bytes wait
in host memory until the worker writes them at admission (engine.py). The pull happens before the
request queues on this replica, so no block of this replica is held while the network is awaited.
"""
from __future__ import annotations

import asyncio
import secrets
import time

import msgspec
import numpy as np
import structlog
from aiohttp import web

from protocol.errors import APIError, BadRequest, NotFound, Overloaded
from protocol.kv_transfer import (INVALID_BLOCKS, INVALID_PARAMS, LAYOUT_MISMATCH, PROMPT_MISMATCH, PULL_PATH,
                                  REJECTED, ROLE_MISMATCH, TRANSFER_FAILED, UNKNOWN_ENGINE, UNKNOWN_REQUEST,
                                  FailurePolicy, KVPullRequest, KVTransferParams, KVTransferStats, RemoteSource,
                                  remote_source)
from replica.bulk_http import BadAnswer, CutShort, ErrorAnswer, post_for_bytes
from replica.kv_codec import StagedKV, layout_of, new_buffer, pack_blocks
from replica.kv_pins import KVPin, prompt_digest
from routing.hashing import block_hashes

log = structlog.get_logger("kvgate.replica.kv_transfer")

DEFAULT_PULL_TIMEOUT_S = 10.0
OFF_LOOP_BYTES = 1 << 20  # packing more than this runs in an executor thread (~0.3 ms a MB, page faults included)
_KNOWN_CODES = {INVALID_BLOCKS, LAYOUT_MISMATCH, PROMPT_MISMATCH, UNKNOWN_ENGINE, UNKNOWN_REQUEST}


class KVPullFailed(APIError):
    """The remote side of a pull failed or refused it (recomputing locally is an option)."""
    status = 502
    type = "upstream_error"


class KVTransfer:
    def __init__(self, engine, metrics, *, role: str, engine_id: str | None = None,
                 pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S, failure_policy: FailurePolicy = "fail"):
        self.engine = engine
        self.metrics = metrics
        self.role = role
        self.engine_id = engine_id or f"kvgate-{secrets.token_hex(8)}"
        self.pull_timeout_s = pull_timeout_s
        self.failure_policy = failure_policy
        self.layout = layout_of(engine.runner.kv_caches)
        self.advertised: tuple[str, int] | None = None  # remote_host/remote_port: set once listening

    # -- one generation request ------------------------------------------------------------------
    async def prepare(self, request: web.Request, params: KVTransferParams, prompt_ids: list[int],
                      cache_salt: str | None) -> tuple[str | None, StagedKV | None, KVTransferStats | None]:
        """What `kv_transfer_params` ask of this request: (pin id, staged KV, transfer stats)."""
        if params.do_remote_decode and params.do_remote_prefill:
            raise BadRequest("Invalid kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive.",
                             param="kv_transfer_params", code=INVALID_PARAMS)
        if params.do_remote_decode:
            if self.role == "decode":
                raise _role_mismatch("do_remote_decode (a prefill leg)", "decode")
            # Unguessable: a pull needs it, so a forged one cannot drain another request's blocks.
            return f"{request['request_id']}-{secrets.token_hex(8)}", None, None
        if not params.do_remote_prefill:
            return None, None, None  # nothing asked (vLLM ignores such params too)
        if self.role == "prefill":
            raise _role_mismatch("do_remote_prefill (a decode leg)", "prefill")
        source = remote_source(params)
        if self.engine.num_waiting >= self.engine.max_waiting:  # before moving bytes we could not use
            raise Overloaded(f"Too many waiting requests ({self.engine.max_waiting}); retry shortly.",
                             retry_after_s=1)
        policy = params.kv_load_failure_policy or self.failure_policy
        try:
            staged, stats = await self.pull(source, prompt_ids, cache_salt)
        except KVPullFailed as exc:
            self.metrics.kv_pull_result("recomputed" if policy == "recompute" else "failed")
            log.warning("kv_pull_failed", request_id=request["request_id"], remote=f"{source.host}:{source.port}",
                        status=exc.status, code=exc.code, error=exc.message, policy=policy)
            if policy != "recompute":
                raise
            return None, None, KVTransferStats(remote=f"{source.host}:{source.port}", recomputed=True,
                                               error=exc.message)
        self.metrics.kv_pull_result("ok")
        return None, staged, stats

    def decode_params(self, pin: KVPin) -> dict:
        """The prefill answer's kv_transfer_params, field for field as vLLM 0.33.0's NixlConnector."""
        host, port = self.advertised or ("127.0.0.1", 0)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [pin.block_ids],
                "remote_engine_id": self.engine_id, "remote_request_id": pin.pin_id, "remote_host": host,
                "remote_port": port, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
                "remote_num_tokens": pin.num_tokens, "remote_blocks_expiry_time": None,
                "remote_registration_generation": 0, "transfer_mode": "pull"}

    # -- decode side -----------------------------------------------------------------------------
    async def pull(self, source: RemoteSource, prompt_ids: list[int],
                   cache_salt: str | None) -> tuple[StagedKV, KVTransferStats]:
        """Pull the prompt blocks the local prefix cache lacks. The block holding the last prompt
        token is always pulled (it is never a local hit: that token is recomputed to sample)."""
        block_size = self.engine.block_size
        prompt_blocks = -(-len(prompt_ids) // block_size)
        if len(source.block_ids) < prompt_blocks:
            raise BadRequest(f"Invalid kv_transfer_params: remote_block_ids has {len(source.block_ids)} blocks; "
                             f"this prompt of {len(prompt_ids)} tokens fills {prompt_blocks} of {block_size} "
                             f"tokens (the prefill leg had another prompt or block size).",
                             param="kv_transfer_params", code=INVALID_PARAMS)
        if source.num_tokens is not None and source.num_tokens < len(prompt_ids):
            raise BadRequest(f"Invalid kv_transfer_params: remote_num_tokens {source.num_tokens} is less than "
                             f"this prompt's {len(prompt_ids)} tokens.", param="kv_transfer_params",
                             code=INVALID_PARAMS)
        reusable = (len(prompt_ids) - 1) // block_size
        local = self.engine.local_prefix_blocks(block_hashes(prompt_ids[:reusable * block_size], block_size,
                                                             cache_salt))
        wanted = source.block_ids[local:prompt_blocks]
        pull = KVPullRequest(engine_id=source.engine_id, request_id=source.request_id, block_ids=wanted,
                             layout=self.layout, prompt_digest=prompt_digest(prompt_ids, cache_salt),
                             num_prompt_tokens=len(prompt_ids))
        start_s = time.monotonic()
        data = await self._fetch(source, pull, len(wanted) * self.layout.bytes_per_block)
        seconds = time.monotonic() - start_s
        self.metrics.kv_transfer("received", len(data), len(wanted), seconds)
        stats = KVTransferStats(kv_transfer_bytes=len(data), kv_transfer_seconds=round(seconds, 6),
                                blocks_pulled=len(wanted), blocks_local=local, remote=f"{source.host}:{source.port}")
        return StagedKV(local, len(wanted), data), stats

    async def _fetch(self, source: RemoteSource, pull: KVPullRequest, expected: int) -> np.ndarray:
        where = f"{source.host}:{source.port}"
        buffer = new_buffer(expected)
        progress = [0]
        try:
            async with asyncio.timeout(self.pull_timeout_s):
                await post_for_bytes(source.host, source.port, PULL_PATH, msgspec.json.encode(pull), buffer, progress)
        except TimeoutError as exc:  # before OSError, which it subclasses
            raise KVPullFailed(f"KV pull from {where} timed out after {self.pull_timeout_s:g}s "
                               f"(--kv-pull-timeout-s) with {progress[0]} of {expected} bytes.",
                               code=TRANSFER_FAILED) from exc
        except ErrorAnswer as exc:
            raise _refusal(exc, where) from exc
        except CutShort as exc:
            raise KVPullFailed(f"KV pull from {where} was cut short at {exc.received} of {expected} bytes "
                               f"(the prefill replica died mid-transfer?).", code=TRANSFER_FAILED) from exc
        except BadAnswer as exc:
            raise KVPullFailed(f"KV pull from {where} got a malformed answer: {exc}.", code=TRANSFER_FAILED) from exc
        except OSError as exc:
            raise KVPullFailed(f"KV pull from {where} failed: {type(exc).__name__}: {exc} (is the prefill "
                               f"replica down?).", code=TRANSFER_FAILED) from exc
        return buffer

    # -- prefill side ----------------------------------------------------------------------------
    async def handle_pull(self, request: web.Request) -> web.Response:
        """POST /kvgate/kv/pull: the pinned blocks asked for, then the pin is released. A refused
        pull leaves the pin for a correct one (or its lease)."""
        pull = msgspec.json.decode(await request.read(), type=KVPullRequest)
        if pull.engine_id != self.engine_id:
            raise NotFound(f"remote_engine_id {pull.engine_id!r} is not this replica ({self.engine_id}): "
                           f"remote_host/remote_port point at another replica, or it restarted.",
                           code=UNKNOWN_ENGINE)
        if pull.layout != self.layout:
            raise APIError(f"KV layouts differ: the puller has {msgspec.json.encode(pull.layout).decode()}, "
                           f"this replica {msgspec.json.encode(self.layout).decode()} (same model, dtype and "
                           f"--block-size on both sides).", status=409, code=LAYOUT_MISMATCH)
        pin = self.engine.peek_pin(pull.request_id)
        if pin is None:
            raise NotFound(f"No KV blocks pinned for remote_request_id {pull.request_id!r}: already pulled, "
                           f"expired (lease {self.engine.pins.lease_s:g}s), or never pinned here.",
                           code=UNKNOWN_REQUEST)
        if pull.prompt_digest != pin.prompt_digest or pull.num_prompt_tokens != pin.num_prompt_tokens:
            raise APIError(f"The decode leg's prompt ({pull.num_prompt_tokens} tokens) is not the prompt "
                           f"prefilled for {pull.request_id!r} ({pin.num_prompt_tokens} tokens): send both "
                           f"legs the same prompt and cache_salt.", status=409, code=PROMPT_MISMATCH)
        held = set(pin.block_ids)
        stray = [b for b in pull.block_ids if b not in held]
        if stray or len(set(pull.block_ids)) != len(pull.block_ids):
            raise BadRequest(f"remote_block_ids {stray[:8] or pull.block_ids[:8]} are not (distinct) blocks of "
                             f"{pull.request_id!r}.", param="block_ids", code=INVALID_BLOCKS)
        pin = self.engine.claim_pin(pull.request_id)
        if pin is None:  # expired or pulled by someone else since the peek
            raise NotFound(f"The KV blocks of {pull.request_id!r} were released meanwhile.", code=UNKNOWN_REQUEST)
        try:
            if len(pull.block_ids) * self.layout.bytes_per_block > OFF_LOOP_BYTES:
                data = await asyncio.get_running_loop().run_in_executor(
                    None, pack_blocks, self.engine.runner.kv_caches, pull.block_ids)
            else:
                data = pack_blocks(self.engine.runner.kv_caches, pull.block_ids)
        finally:
            self.engine.release_pinned(pin.block_ids)  # copied (or failed): the blocks go back either way
        self.metrics.kv_transfer("sent", len(data), len(pull.block_ids))
        return web.Response(body=data, content_type="application/octet-stream")


def _refusal(answer: ErrorAnswer, where: str) -> KVPullFailed:
    """The remote's 4xx in our shape passes on (status and code); anything else is a 502 / 400."""
    try:
        payload = msgspec.json.decode(answer.body)
        error = payload.get("error") if isinstance(payload, dict) else None
    except msgspec.DecodeError:
        error = None
    message = error.get("message") if isinstance(error, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    status = answer.status
    if 400 <= status < 500 and code in _KNOWN_CODES:
        return KVPullFailed(f"KV pull from {where} refused: {message}", status=status, code=code,
                            type="invalid_request_error", param="kv_transfer_params")
    if 400 <= status < 500:
        return KVPullFailed(f"KV pull from {where} answered HTTP {status} ({message or answer.reason}): "
                            f"remote_host/remote_port do not name a kvgate prefill replica.", status=400,
                            code=REJECTED, type="invalid_request_error", param="kv_transfer_params")
    return KVPullFailed(f"KV pull from {where} failed with HTTP {status}: {message or answer.reason}",
                        code=TRANSFER_FAILED)


def _role_mismatch(asked: str, role: str) -> BadRequest:
    return BadRequest(f"kv_transfer_params ask for {asked}, but this replica runs --role {role}.",
                      param="kv_transfer_params", code=ROLE_MISMATCH)
