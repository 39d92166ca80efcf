"""Wire shapes of disaggregated prefill/decode (contract 5), in vLLM 0.33.0's NixlConnector dialect.

One P/D request is two legs, as vLLM's toy proxy drives them:
  1. prefill leg, to a prefill replica: the client's body with `max_tokens=1`, `stream=false` and
     `kv_transfer_params={"do_remote_decode": true, "do_remote_prefill": false, remote_*: null}`.
     The prefill replica computes the prompt, samples one token, keeps the prompt's KV blocks
     pinned and answers with `kv_transfer_params` for the decode leg: `do_remote_prefill=true`,
     `do_remote_decode=false`, `remote_engine_id`, `remote_block_ids` (`[[ids]]`: one list per KV
     cache group, as 0.33.0), `remote_request_id`, `remote_host`, `remote_port`,
     `remote_num_tokens`, `tp_size`/`dcp_size`/`pp_size`, `transfer_mode: "pull"`.
  2. decode leg, to a decode replica: the client's body (its own max_tokens, stream, ...) with
     those `kv_transfer_params`. The decode replica pulls the prompt blocks its prefix cache lacks
     from `remote_host:remote_port`, recomputes the prompt's last token to sample (vLLM does the
     same: the prefill replica's token is not passed on) and generates.
The prefill replica frees the pinned blocks once pulled, or when their lease
(`--kv-lease-duration-s`, vLLM's `kv_lease_duration`, 30 s) runs out.

Transport: vLLM reads blocks with NIXL (RDMA) after a ZMQ handshake on remote_port; kvgate
replicas pull over HTTP instead: `POST /kvgate/kv/pull` on `remote_host:remote_port` (the
prefill replica's own HTTP address) with a `KVPullRequest`, answered with the blocks' raw bytes.
So kvgate replicas pair with kvgate replicas; a vLLM prefill's params (another engine id) get a
clear 4xx from a kvgate decode replica, never a hang.

Error codes below are what a gateway can branch on (`error.code` of the OpenAI-shaped body).
"""
from __future__ import annotations

from typing import Literal, Union

import msgspec

from protocol.errors import BadRequest

# -- error codes ---------------------------------------------------------------------------------
INVALID_PARAMS = "invalid_kv_transfer_params"     # 400: the decode leg's params are unusable as sent
ROLE_MISMATCH = "kv_transfer_role_mismatch"       # 400: e.g. do_remote_prefill sent to a prefill replica
UNKNOWN_ENGINE = "kv_unknown_remote_engine"       # 404: remote_engine_id is not the replica at remote_host:port
UNKNOWN_REQUEST = "kv_unknown_remote_request"     # 404: no pinned blocks under remote_request_id (expired,
#                                                        already pulled, or never pinned): redo the prefill leg
INVALID_BLOCKS = "kv_invalid_remote_block_ids"    # 400: block ids that the pinned request does not hold
PROMPT_MISMATCH = "kv_prompt_mismatch"            # 409: the decode leg's prompt is not the prefill leg's
LAYOUT_MISMATCH = "kv_layout_mismatch"            # 409: the two replicas' KV layouts differ (model, dtype, block size)
REJECTED = "kv_transfer_rejected"                 # 400: the remote answered the pull with a 4xx of its own
TRANSFER_FAILED = "kv_transfer_failed"            # 502: remote unreachable, timed out, or cut the transfer short

FailurePolicy = Literal["fail", "recompute"]


class KVTransferParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The request's and the prefill answer's `kv_transfer_params`, vLLM 0.33.0's field names.
    Unknown fields are ignored (vLLM adds some every release)."""
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    # 0.33.0 sends one list per KV cache group ([[1, 2, 3]]); older releases a flat list.
    remote_block_ids: list[Union[int, list[int]]] | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_num_tokens: int | None = None
    tp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1
    remote_blocks_expiry_time: float | None = None
    remote_registration_generation: int = 0
    transfer_mode: str | None = None
    # kvgate extension: what the decode replica does when the pull fails (vLLM has this as the
    # server-wide kv_load_failure_policy; "fail" is vLLM's default, "recompute" computes the prompt).
    kv_load_failure_policy: FailurePolicy | None = None


class _Envelope(msgspec.Struct):
    kv_transfer_params: KVTransferParams | None = None


_envelope_decoder = msgspec.json.Decoder(_Envelope)


def decode_kv_transfer_params(body: bytes) -> KVTransferParams | None:
    """The request body's `kv_transfer_params` (None when absent or null). A wrongly typed field
    raises msgspec.ValidationError naming it (`$.kv_transfer_params.remote_port`): a 400."""
    return _envelope_decoder.decode(body).kv_transfer_params


class RemoteSource(msgspec.Struct, frozen=True):
    """Where a decode leg pulls from: a validated `do_remote_prefill` params set."""
    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: list[int]
    num_tokens: int | None


def remote_source(params: KVTransferParams) -> RemoteSource:
    """Validate a decode leg's params; BadRequest naming what is missing or unusable."""
    missing = [name for name in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                                 "remote_block_ids") if getattr(params, name) is None]
    if missing:
        raise _invalid(f"do_remote_prefill needs {', '.join(missing)} (send the prefill answer's "
                       f"kv_transfer_params unchanged).")
    if not (0 < params.remote_port < 65536):
        raise _invalid(f"remote_port {params.remote_port} is not a TCP port.")
    if not params.remote_host or any(c in params.remote_host for c in "/@?# "):
        raise _invalid(f"remote_host {params.remote_host!r} is not a host name or address.")
    if (params.tp_size, params.dcp_size, params.pp_size) != (1, 1, 1):
        raise _invalid(f"tp_size/dcp_size/pp_size {params.tp_size}/{params.dcp_size}/{params.pp_size}: "
                       f"kvgate replicas pull from one unsharded prefill engine (1/1/1).")
    if params.transfer_mode not in (None, "pull"):
        raise _invalid(f"transfer_mode {params.transfer_mode!r}: kvgate replicas only pull.")
    block_ids = flat_block_ids(params.remote_block_ids)
    if params.remote_num_tokens is not None and params.remote_num_tokens < 0:
        raise _invalid("remote_num_tokens must be >= 0.")
    return RemoteSource(params.remote_engine_id, params.remote_request_id, params.remote_host,
                        params.remote_port, block_ids, params.remote_num_tokens)


def flat_block_ids(value: list) -> list[int]:
    """vLLM 0.33.0's per-group lists ([[ids]]) or an older flat list, as one list (one group)."""
    if all(isinstance(item, int) for item in value):
        ids = value
    elif len(value) == 1 and isinstance(value[0], list):
        ids = value[0]
    else:
        raise _invalid("remote_block_ids must be one list of block ids (one KV cache group), e.g. [[0, 1, 2]].")
    if any(i < 0 for i in ids):
        raise _invalid("remote_block_ids must be >= 0.")
    return list(ids)


def _invalid(message: str) -> BadRequest:
    return BadRequest(f"Invalid kv_transfer_params: {message}", param="kv_transfer_params", code=INVALID_PARAMS)


# -- the pull endpoint (decode replica -> prefill replica) -----------------------------------------
PULL_PATH = "/kvgate/kv/pull"


class KVLayout(msgspec.Struct, frozen=True):
    """What one block's bytes mean; both replicas must agree on all of it."""
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str            # torch dtype name, e.g. "float32"

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * _ELEMENT_BYTES[self.dtype]


_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class KVPullRequest(msgspec.Struct, kw_only=True):
    """Body of POST /kvgate/kv/pull. The answer (200) is `len(block_ids) * bytes_per_block` raw
    bytes laid out [layer][k, v][block, in the order asked][token in block][kv head][head dim];
    the pinned request is released once the answer is written. An empty `block_ids` only releases
    (the decode replica already holds every block)."""
    engine_id: str
    request_id: str
    block_ids: list[int]
    layout: KVLayout
    prompt_digest: int           # the decode leg's prompt (+ cache_salt) hashed: both legs' prompts match
    num_prompt_tokens: int


class KVTransferStats(msgspec.Struct, kw_only=True):
    """`kv_transfer_stats` in a decode leg's answer (non-streamed body; streamed: the chunk with the
    finish_reason), for the gateway's request log; /metrics has the totals."""
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    blocks_pulled: int = 0
    blocks_local: int = 0          # prompt blocks the decode replica's prefix cache already held
    remote: str = ""               # host:port pulled from
    recomputed: bool = False       # the pull failed and the prompt was computed here instead
    error: str | None = None       # why the pull failed (recomputed answers only)
