"""Prompt token IDs before routing, with the replica's own tokenizer and chat template.

Mirrors what a vLLM-style server does, so the IDs the gateway routes on are the IDs the replica
computes: completions get special tokens (BOS), chat prompts are rendered by the template (which
writes its own BOS) and encoded without adding more. Both through the bundle's token cache
(tokenization/token_cache.py): a repeated prompt is not tokenized again, and a chat's next turn
only tokenizes its new messages."""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from protocol.errors import BadRequest
from protocol.requests import AnyRequest, ChatCompletionRequest, message_dicts, single_prompt
from tokenization import TokenizerBundle
from tokenization.token_cache import token_cache

# When more than this many characters of a prompt are new to the token cache (a long document, ~4k
# tokens), they are tokenized on a worker thread, in the tokenizer's GIL-free batch call: the loop
# keeps relaying streams meanwhile (a Python encode on a thread would stall it 5 ms at a time, the
# interpreter's switch interval), and such prompts tokenize on every core at once. Shorter new text
# costs less on the loop (the token cache's word encoder: ~0.3 ms for 8k characters of known ASCII
# words, against 2.2 ms in the tokenizer and a thread hop).
OFF_LOOP_CHARS = 16384
YIELD_CHARS = 1024
# One thread per core: prompts that arrive together finish one after another on each core, the
# first ones early, rather than all late together.
_POOL = ThreadPoolExecutor(max(1, os.cpu_count() or 1), thread_name_prefix="kvgate-tokenize")


def prompt_text(request: AnyRequest, bundle: TokenizerBundle) -> tuple[str | list[int], bool]:
    """What a replica tokenizes for the request (the rendered chat, or the completions prompt;
    token IDs as they came) and whether BOS is added to it."""
    if isinstance(request, ChatCompletionRequest):
        try:
            text = bundle.apply_chat_template(message_dicts(request),
                                              add_generation_prompt=request.add_generation_prompt)
        except ValueError as exc:
            raise BadRequest(str(exc), param="messages") from None
        return text, False  # the template wrote its own BOS
    return single_prompt(request), True


def tokenize_request(request: AnyRequest, bundle: TokenizerBundle) -> list[int]:
    prompt, add_special_tokens = prompt_text(request, bundle)
    if isinstance(prompt, list):
        return list(prompt)
    return token_cache(bundle).encode(prompt, add_special_tokens=add_special_tokens)


def prompt_ids_now(request: AnyRequest, bundle: TokenizerBundle) -> tuple[list[int] | None, tuple | None]:
    """(the prompt's IDs, None) where they cost no wait: IDs as sent, or text with under
    YIELD_CHARS new to the token cache (the usual request: no coroutine to run); else (None,
    what prompt_token_ids takes to finish it)."""
    prompt, add_special_tokens = prompt_text(request, bundle)
    if isinstance(prompt, list):
        return list(prompt), None
    cache = token_cache(bundle)
    ids = cache.cached(prompt, add_special_tokens)  # a prompt asked again whole
    if ids is not None:
        return ids, None
    lookup = cache.lookup(prompt)
    if lookup.missing_chars < YIELD_CHARS:
        return cache.finish(lookup, add_special_tokens), None
    return None, (cache, lookup, add_special_tokens)


async def prompt_token_ids(request: AnyRequest, bundle: TokenizerBundle, pending: tuple | None = None) -> list[int]:
    """The prompt's IDs; `pending`: what prompt_ids_now left to do, if it was asked first."""
    if pending is None:
        ids, pending = prompt_ids_now(request, bundle)
        if ids is not None:
            return ids
    cache, lookup, add_special_tokens = pending
    # Requests that arrive together (a trace's burst, a batch client) are tokenized on the loop one
    # after another: a long new prompt first lets the shorter ones that came with it go ahead, one
    # loop turn per YIELD_CHARS new characters (at most 3), shortest first, as a scheduler would.
    # Alone, it costs a few loop turns (~10 us each).
    for _ in range(min(3, lookup.missing_chars // YIELD_CHARS)):
        await asyncio.sleep(0)
    if lookup.missing_chars < OFF_LOOP_CHARS:
        return cache.finish(lookup, add_special_tokens)
    return await asyncio.get_running_loop().run_in_executor(_POOL, cache.finish, lookup, add_special_tokens, True)
