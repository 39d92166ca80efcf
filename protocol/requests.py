"""OpenAI request bodies as msgspec structs: decoded and type-checked once at the edge.

Unknown fields are ignored here (the gateway passes the raw body on, so they still reach the
replica). Value checks that msgspec cannot express live in `check_*` below, one place for both
the gateway and the replica."""
from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

from protocol.errors import BadRequest

# Bounds that catch garbage early; the real limit is the model's context, checked by whoever
# knows it (gateway after tokenizing, replica always).
MAX_TOKENS_LIMIT = 1 << 20
PositiveTokens = Annotated[int, Meta(ge=1, le=MAX_TOKENS_LIMIT)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TokenId = Annotated[int, Meta(ge=0)]


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Fields both endpoints share."""
    model: str | None = None
    max_tokens: PositiveTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    n: Annotated[int, Meta(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    user: str | None = None
    cache_salt: str | None = None
    skip_special_tokens: bool = True


class CompletionRequest(SamplingFields, kw_only=True, omit_defaults=True):
    # str | list[int] | [str] | [[int]]: msgspec allows one array type per union, so the list's
    # elements are a union and check_common enforces that they agree.
    prompt: str | list[Union[TokenId, str, list[TokenId]]]
    echo: bool = False


class TextPart(msgspec.Struct, omit_defaults=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True, omit_defaults=True):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveTokens | None = None
    add_generation_prompt: bool = True


AnyRequest = Union[CompletionRequest, ChatCompletionRequest]

_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)


def decode_completion(body: bytes) -> CompletionRequest:
    request = _completion_decoder.decode(body)
    check_common(request)
    return request


def decode_chat(body: bytes) -> ChatCompletionRequest:
    request = _chat_decoder.decode(body)
    check_common(request)
    if not request.messages:
        raise BadRequest("`messages` must contain at least one message.", param="messages")
    for index, message in enumerate(request.messages):
        if isinstance(message.content, list):
            for part in message.content:
                if part.type != "text" or part.text is None:
                    raise BadRequest(f"Only text content parts are supported (message {index} has "
                                     f"a part of type {part.type!r}).", param=f"messages[{index}].content")
    return request


def check_common(request: SamplingFields) -> None:
    if request.n != 1:
        raise BadRequest("Only n=1 is supported.", param="n")
    if isinstance(request, CompletionRequest):
        prompt = request.prompt
        if isinstance(prompt, list) and prompt:
            kinds = {type(item) for item in prompt}
            if len(kinds) != 1:
                raise BadRequest("`prompt` must be a string, a list of token IDs, or a one-element "
                                 "list of either.", param="prompt")
            if not isinstance(prompt[0], int) and len(prompt) != 1:
                raise BadRequest("Batched prompts are not supported: send one prompt per request.",
                                 param="prompt")
        if prompt == "" or prompt == [] or prompt == [[]]:
            raise BadRequest("`prompt` must not be empty.", param="prompt")
    stops = request.stop
    if isinstance(stops, list) and len(stops) > 16:
        raise BadRequest("At most 16 stop sequences are allowed.", param="stop")


def single_prompt(request: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request (a one-element batch is unwrapped)."""
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return prompt[0]
    return prompt


def max_new_tokens(request: AnyRequest, default: int) -> int:
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens if request.max_tokens is not None else default


def message_dicts(request: ChatCompletionRequest) -> list[dict]:
    """Messages as plain dicts for a chat template; text parts joined into one string."""
    out = []
    for message in request.messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        item = {"role": message.role, "content": content or ""}
        if message.name:
            item["name"] = message.name
        out.append(item)
    return out


def stop_strings(request: SamplingFields) -> list[str]:
    if request.stop is None:
        return []
    return [request.stop] if isinstance(request.stop, str) else [s for s in request.stop if s]
