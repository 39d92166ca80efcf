"""Prompt token IDs before routing, with the replica's own tokenizer and chat template.

Mirrors what a vLLM-style server does, so the IDs the gateway routes on are the IDs the replica
computes: completions get special tokens (BOS), chat prompts are rendered by the template (which
writes its own BOS) and encoded without adding more. Both through the bundle's token cache
(tokenization/token_cache.py): a repeated prompt is not tokenized again, and a chat's next turn
only tokenizes its new messages."""
from __future__ import annotations

import asyncio

from protocol.errors import BadRequest
from protocol.requests import AnyRequest, ChatCompletionRequest, message_dicts, single_prompt
from tokenization import TokenizerBundle
from tokenization.token_cache import token_cache

# Above this many characters, tokenization moves to a thread: a 100k-character prompt takes
# tens of ms in the Rust tokenizer, long enough to stall every stream the loop is relaying.
OFF_LOOP_CHARS = 8192


def _prompt_chars(request: AnyRequest) -> int:
    if isinstance(request, ChatCompletionRequest):
        total = 0
        for message in request.messages:
            content = message.content
            if isinstance(content, str):
                total += len(content)
            elif content:
                total += sum(len(part.text or "") for part in content)
        return total
    prompt = single_prompt(request)
    return len(prompt) if isinstance(prompt, str) else 0


def tokenize_request(request: AnyRequest, bundle: TokenizerBundle) -> list[int]:
    if isinstance(request, ChatCompletionRequest):
        try:
            text = bundle.apply_chat_template(message_dicts(request),
                                              add_generation_prompt=request.add_generation_prompt)
        except ValueError as exc:
            raise BadRequest(str(exc), param="messages") from None
        return token_cache(bundle).encode(text, add_special_tokens=False)
    prompt = single_prompt(request)
    if isinstance(prompt, list):
        return list(prompt)
    return token_cache(bundle).encode(prompt, add_special_tokens=True)


async def prompt_token_ids(request: AnyRequest, bundle: TokenizerBundle) -> list[int]:
    if _prompt_chars(request) < OFF_LOOP_CHARS:
        return tokenize_request(request, bundle)
    return await asyncio.get_running_loop().run_in_executor(None, tokenize_request, request, bundle)
