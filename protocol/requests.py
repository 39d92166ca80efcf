"""OpenAI request bodies as msgspec structs: decoded and type-checked once at the edge.

Unknown fields are ignored here (the gateway passes the raw body on, so they still reach the
replica). Value checks that msgspec cannot express live in `check_*` below, one place for both
the gateway and the replica."""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from protocol.errors import BadRequest

# Bounds that catch garbage early; the real limit is the model's context, checked by whoever
# knows it (gateway after tokenizing, replica always).
MAX_TOKENS_LIMIT = 1 << 20
PositiveTokens = Annotated[int, Meta(ge=1, le=MAX_TOKENS_LIMIT)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
# Token IDs are hashed as uint32 and index int32 tensors: a bigger number is garbage, and a 400 here
# rather than an OverflowError deep in the gateway or the engine.
MAX_TOKEN_ID = (1 << 31) - 1
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
Seed = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]  # an int64 (the engine masks it to 64 bits)
TopK = Annotated[int, Meta(ge=-1, le=MAX_TOKEN_ID)]
# Strings that are keys or are checked on every token: bounded so no client can grow a map without
# limit (the session table keys on `user`) or make the engine thread's stop check slow (its cost per
# token grows with the square of a stop string's length).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_USER_CHARS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_MODEL_CHARS = 1024
ShortModel = Annotated[str, Meta(max_length=MAX_MODEL_CHARS)]
User = Annotated[str, Meta(max_length=MAX_USER_CHARS)]
CacheSalt = Annotated[str, Meta(max_length=MAX_CACHE_SALT_CHARS)]


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Fields both endpoints share."""
    model: ShortModel | None = None
    max_tokens: PositiveTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    n: Annotated[int, Meta(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    user: User | None = None
    cache_salt: CacheSalt | None = None
    skip_special_tokens: bool | None = None   # None: the replica's default (True unless configured)


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


def _decode(decoder: msgspec.json.Decoder, body: bytes):
    try:
        return decoder.decode(body)
    except RecursionError:  # msgspec stops at the interpreter's recursion limit: a 400, not a 500
        raise BadRequest("The JSON body is nested too deeply.", code="json_too_deep") from None


def decode_completion(body: bytes) -> CompletionRequest:
    request = _decode(_completion_decoder, body)
    check_common(request)
    return request


def decode_chat(body: bytes) -> ChatCompletionRequest:
    request = _decode(_chat_decoder, body)
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
        if not prompt or prompt == [[]]:  # "", [] or [[]]
            raise BadRequest("`prompt` must not be empty.", param="prompt")
    stops = request.stop
    if stops is None:
        return
    if isinstance(stops, list) and len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"At most {MAX_STOP_STRINGS} stop sequences are allowed.", param="stop")
    for stop in [stops] if isinstance(stops, str) else stops or ():
        if len(stop) > MAX_STOP_CHARS:
            raise BadRequest(f"A stop sequence may be at most {MAX_STOP_CHARS} characters long "
                             f"(one has {len(stop)}).", param="stop", code="stop_too_long")


# Fields of OpenAI's and vLLM's request bodies that the built-in replica does not honour yet, with the
# values that mean "not used". A client that always sends `frequency_penalty: 0` or `tools: []` keeps
# working; any other value is a 400 naming the field, never a 200 that silently ignored it. (The
# gateway does not apply this table: a vLLM replica behind it honours these, and the gateway passes
# the built-in replica's 400 through unchanged.)
_ZERO = (None, 0)
UNHONOURED_FIELDS: dict[str, tuple] = {
    "logprobs": (None, False), "top_logprobs": _ZERO, "prompt_logprobs": (None,),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "presence_penalty": _ZERO, "frequency_penalty": _ZERO, "repetition_penalty": (None, 1),
    "logit_bias": (None, {}), "min_p": _ZERO, "min_tokens": _ZERO,
    "best_of": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1),
    "suffix": (None, ""), "include_stop_str_in_output": (None, False),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "allowed_token_ids": (None,), "bad_words": (None, []),
    "truncate_prompt_tokens": (None,), "prompt_embeds": (None,),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "documents": (None, []),
    "continue_final_message": (None, False), "reasoning_effort": (None,), "web_search_options": (None,),
}
UNHONOURED_NAMES = frozenset(UNHONOURED_FIELDS)
_unhonoured_decoder = msgspec.json.Decoder(
    msgspec.defstruct("UnhonouredFields", [(name, Any, None) for name in UNHONOURED_FIELDS]))
# Any of those names written as a key: most bodies name none of them, and are done after one search
# (a key spelled with \u escapes is not found here, so a body with any escape gets the full check).
_UNHONOURED_KEY = re.compile(rb'"(?:' + b"|".join(re.escape(name.encode()) for name in UNHONOURED_FIELDS) + rb')"')


def _same(value: Any, not_used: Any) -> bool:
    """JSON equality without Python's bool/int mixing (`logprobs: 0` is not `false`); 0 and 0.0 agree."""
    if isinstance(value, bool) or isinstance(not_used, bool) or not isinstance(value, (int, float)):
        return type(value) is type(not_used) and value == not_used
    return isinstance(not_used, (int, float)) and value == not_used


def check_honoured(body: bytes) -> None:
    """400 naming the first field of `UNHONOURED_FIELDS` set to anything but a not-used value
    (call once the body decoded as a request, so it is a JSON object)."""
    if body.find(b"\\u") < 0 and _UNHONOURED_KEY.search(body) is None:
        return
    fields = _decode(_unhonoured_decoder, body)
    for name, not_used in UNHONOURED_FIELDS.items():
        value = getattr(fields, name)
        if not any(_same(value, v) for v in not_used):
            allowed = " or ".join(msgspec.json.encode(v).decode() for v in not_used)
            raise BadRequest(f"`{name}` is not supported by this replica (kvgate's built-in engine) yet; "
                             f"leave it out or send {allowed}.", param=name, code="unsupported_parameter")


def single_prompt(request: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request (a one-element batch is unwrapped)."""
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return prompt[0]
    return prompt


def requested_max_tokens(request: AnyRequest) -> tuple[int | None, str]:
    """The output length the client asked for, and the field it used (None: left out)."""
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens, "max_completion_tokens"
    return request.max_tokens, "max_tokens"


def fit_max_tokens(request: AnyRequest, prompt_len: int, max_model_len: int, default: int | None) -> int:
    """The output length a request gets, by vLLM 0.33's rules (one place for gateway and replica):
    a requested length above max_model_len and a prompt that leaves no room for one token are 400s;
    otherwise the requested length (or `default`, None meaning "up to the context") is capped to
    the room the prompt leaves, so a request that leaves max_tokens out runs to the context."""
    requested, param = requested_max_tokens(request)
    if requested is not None and requested > max_model_len:
        raise BadRequest(f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
                         f"Please request fewer output tokens.", param=param, code="context_length_exceeded")
    if prompt_len > max_model_len:
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, your "
                         f"prompt contains {prompt_len} input tokens, which exceeds this limit even without "
                         f"any output tokens. Please reduce the length of the input prompt.",
                         param="input_tokens", code="context_length_exceeded")
    if prompt_len == max_model_len:
        raise BadRequest(f"The decoder prompt (length {prompt_len}) plus the number of requested output "
                         f"tokens (at least 1) is longer than the maximum model length of {max_model_len}. "
                         f"Make sure that `max_model_len` is no smaller than the number of text tokens "
                         f"(prompt + requested output tokens).", param="input_tokens",
                         code="context_length_exceeded")
    wanted = requested if requested is not None else default
    room = max_model_len - prompt_len
    return room if wanted is None else min(wanted, room)


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
