"""vLLM's response and SSE chunk shapes for the built-in replica (completions and chat), including
`return_token_ids`, usage, and the P/D fields: `kv_transfer_params` on a prefill leg's answer (its
final chunk when streamed, as vLLM 0.33) and `kv_transfer_stats` on a decode leg's."""
from __future__ import annotations

import time

import msgspec
from aiohttp import web

from protocol.kv_transfer import KVTransferStats
from protocol.requests import AnyRequest
from protocol.responses import full_response, text_chunk, usage_chunk, usage_of
from replica.engine import TokenEvent


class ResponseShaper:
    """vLLM's response and chunk shapes for one request."""

    def __init__(self, server, body: AnyRequest, request: web.Request,
                 prompt_ids: list[int], chat: bool, kv_stats: KVTransferStats | None = None):
        self.chat = chat
        self.kv = server.kv
        self.kv_stats = kv_stats
        self.prompt_ids = prompt_ids
        self.cached_tokens = 0  # from the engine's events: prompt tokens reused from the prefix cache
        self.return_token_ids = bool(body.return_token_ids)
        options = body.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = self.include_usage and bool(options.continuous_usage_stats)
        prefix = "chatcmpl-" if chat else "cmpl-"
        self.base = {"id": prefix + request["request_id"],
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": server.model_name}

    def opening_chunks(self) -> list[dict]:
        if not self.chat:
            return []
        chunk = {**self.base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]}
        if self.return_token_ids:
            chunk["prompt_token_ids"] = self.prompt_ids
        return [chunk]

    def token_chunk(self, ev: TokenEvent, text: str, completion_tokens: int) -> dict:
        self.cached_tokens = ev.num_cached_tokens
        chunk = text_chunk(self.base, self.chat, text, ev.finish_reason, ev.stop_reason,
                           [ev.token_id] if self.return_token_ids else None)
        if not self.chat and self.return_token_ids and completion_tokens == 1:
            chunk["choices"][0]["prompt_token_ids"] = self.prompt_ids  # vLLM: on a completion's first chunk
        if ev.finish_reason is not None:  # vLLM 0.33: the final chunk carries kv_transfer_params
            self._add_kv_fields(chunk, ev)
        if self.continuous_usage:
            chunk["usage"] = usage_of(len(self.prompt_ids), completion_tokens, self.cached_tokens)
        return chunk

    def usage_chunk(self, completion_tokens: int) -> dict:
        return usage_chunk(self.base, usage_of(len(self.prompt_ids), completion_tokens, self.cached_tokens))

    def full_response(self, text: str, output_ids: list[int], last: TokenEvent | None) -> dict:
        finish_reason = last.finish_reason if last else None
        stop_reason = last.stop_reason if last else None
        token_ids = output_ids if self.return_token_ids else None
        prompt_ids = self.prompt_ids if self.return_token_ids else None
        usage = usage_of(len(self.prompt_ids), len(output_ids), last.num_cached_tokens if last else 0)
        return self._add_kv_fields(full_response(self.base, self.chat, text, finish_reason, stop_reason, usage,
                                                 token_ids, prompt_ids), last)

    def _add_kv_fields(self, response: dict, last: TokenEvent | None) -> dict:
        """A prefill leg's answer gets the decode leg's kv_transfer_params; a decode leg's answer
        `kv_transfer_stats` (bytes moved, seconds) for the gateway's log."""
        if last is not None and last.kv_pin is not None:
            response["kv_transfer_params"] = self.kv.decode_params(last.kv_pin)
        if self.kv_stats is not None:
            stats = self.kv_stats
            if last is not None and last.kv_staged_stale:
                stats = msgspec.structs.replace(stats, recomputed=True, error="pulled KV unused (stale)")
            response["kv_transfer_stats"] = msgspec.to_builtins(stats)
        return response
