"""OpenAI response and stream-chunk shapes in vLLM's dialect, for every server that writes them
(the built-in replica; the gateway when it writes a resumed answer itself)."""
from __future__ import annotations


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens or 0}}


def chunk_base(response_id: str, created: int, model: str, chat: bool) -> dict:
    """The fields every chunk of one stream repeats."""
    return {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model}


def text_chunk(base: dict, chat: bool, text: str, finish_reason: str | None = None,
               stop_reason: int | str | None = None, token_ids: list[int] | None = None) -> dict:
    """One chunk carrying `text` (and, if asked, the token IDs that produced it)."""
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {**base, "choices": [choice]}


def usage_chunk(base: dict, usage: dict) -> dict:
    return {**base, "choices": [], "usage": usage}


def full_response(base: dict, chat: bool, text: str, finish_reason: str | None, stop_reason,
                  usage: dict, token_ids: list[int] | None = None,
                  prompt_token_ids: list[int] | None = None) -> dict:
    """A whole (non-streamed) answer; token IDs only when the client asked (return_token_ids)."""
    if chat:
        message = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                   "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": stop_reason, "token_ids": token_ids}
        return {**base, "object": "chat.completion", "choices": [choice], "service_tier": None,
                "system_fingerprint": None, "usage": usage, "prompt_logprobs": None,
                "prompt_token_ids": prompt_token_ids, "kv_transfer_params": None}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
              "stop_reason": stop_reason, "prompt_logprobs": None, "prompt_token_ids": prompt_token_ids,
              "token_ids": token_ids}
    return {**base, "object": "text_completion", "choices": [choice], "usage": usage,
            "system_fingerprint": None, "kv_transfer_params": None}
