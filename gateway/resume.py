"""The request that continues an answer on another replica after k of its tokens were delivered:
the prompt's token IDs plus those k output IDs, as a /v1/completions prompt (vLLM and the built-in
replica both take token IDs), with the client's sampling fields kept (temperature, top_p, seed,
stop strings and token IDs, ...) and max_tokens reduced by k. Greedy decoding then yields
exactly the tokens the first replica would have produced next."""
from __future__ import annotations

import msgspec

from protocol.requests import AnyRequest, ChatCompletionRequest, requested_max_tokens

# What /v1/completions with a token-ID prompt does not take, or what the continuation replaces.
_DROPPED = frozenset({
    "messages", "prompt", "max_tokens", "max_completion_tokens", "echo", "suffix", "add_generation_prompt",
    "continue_final_message", "chat_template", "chat_template_kwargs", "documents", "tools", "tool_choice",
    "functions", "function_call", "parallel_tool_calls", "response_format", "stream", "stream_options", "n",
    "best_of", "add_special_tokens", "mm_processor_kwargs", "kv_transfer_params",
})
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's (and OpenAI's) for /v1/completions


def effective_max_tokens(parsed: AnyRequest, prompt_len: int, max_model_len: int | None,
                         replica_default: int | None) -> int | None:
    """How many tokens the first replica was going to generate at most: the request's own
    max_tokens, or the replica's default (a model's generation_config), or vLLM's (16 for
    completions, up to the context for chat). None: unknown (no context length known)."""
    requested, _ = requested_max_tokens(parsed)
    if requested is None:
        requested = replica_default
    if requested is None and not isinstance(parsed, ChatCompletionRequest):
        requested = COMPLETIONS_DEFAULT_MAX_TOKENS
    room = None if max_model_len is None else max_model_len - prompt_len
    if requested is None:
        return room
    return requested if room is None else min(requested, room)


def continuation_body(raw: dict, model: str, prompt_ids: list[int], output_ids: list[int],
                      max_tokens_left: int | None) -> bytes:
    body = {key: value for key, value in raw.items() if key not in _DROPPED}
    body.update(model=model, prompt=list(prompt_ids) + list(output_ids), stream=True,
                stream_options={"include_usage": True}, return_token_ids=True)
    if max_tokens_left is not None:
        body["max_tokens"] = max_tokens_left
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens:
        body["min_tokens"] = max(min_tokens - len(output_ids), 0)
    return msgspec.json.encode(body)
