"""Request bodies of the OpenAI endpoints, validated strictly (a string where a number belongs is a 400 naming the
field, not a silent conversion), and errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

A body is parsed within bounds before any of it is used: JSON nested deeper than max_json_depth is refused before
the parser sees it (a parser recurses), and every string of it must be Unicode text UTF-8 can carry (a lone
surrogate, from invalid bytes or an unpaired \\u escape, is a 400 naming its field, not a failure where it is
encoded).
Numbers must fit what the engine's inputs hold (INT32, FP32): no value is wrapped or rounded to 0 on the way.

Fields OpenAI defines that this server cannot honour (logit_bias, echo, ...) are refused when set to anything
but their no-op value, so a client never gets an answer computed without what it asked for. Fields nobody defined
are ignored, as OpenAI's own server and vLLM do for forward compatibility. OpenAI's `presence_penalty`,
`frequency_penalty`, `response_format`, `tools` / `tool_choice` and `logprobs` are honoured (guided.py, tools.py,
token_logprobs.py), and these vLLM extensions: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`stop_token_ids`, `ignore_eos` and guided decoding (`guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`, `structured_outputs`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..guard import Refusal, check_depth

MAX_TOKENS_LIMIT = 4096  # the engine's own bound on one request's new tokens
DEFAULT_MAX_TOKENS = 256
MAX_STOPS = 16
INT32_MAX = 2**31 - 1  # top_k travels as the engine's INT32 input
MAX_TOP_LOGPROBS = 20  # the engine's bound (ced/engine.py); OpenAI's too
FLOAT32_SMALLEST = 1.401298464324817e-45  # the smallest positive float32: below it, FP32 inputs arrive as 0


class APIError(Exception):
    """A request refused or failed; `status` is the HTTP code, the rest becomes OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _field_name(location: tuple) -> str:
    """pydantic's error location as a dotted field name: ("messages", 0, "content") -> "messages[0].content"."""
    name = ""
    for part in location:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name


def validation_error(error: ValidationError) -> APIError:
    """The first problem of a body, named by its field."""
    first = error.errors(include_url=False)[0]
    location = tuple(part for part in first["loc"] if not str(part).startswith("function-"))
    # union members add their type to the location ("stop.str", "stop.list[str]"): drop those tails
    location = tuple(part for part in location if not (isinstance(part, str) and ("[" in part or part in
                                                                                  ("str", "int", "float", "bool"))))
    param = _field_name(location) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = "this field is required"
    got = first.get("input")
    detail = f" (got {json.dumps(got)[:80]})" if first["type"] != "missing" and _jsonable(got) else ""
    return APIError(400, f"{param}: {message}{detail}" if param else message, param, "invalid_value")


def _jsonable(value: Any) -> bool:
    """Worth echoing in the message: a scalar, or a short list of scalars."""
    scalars = (str, int, float, bool, type(None))
    return isinstance(value, scalars) or (isinstance(value, list) and len(value) <= 8
                                          and all(isinstance(v, scalars) for v in value))


def parse_body(model: type[BaseModel], raw: bytes, max_json_depth: int) -> BaseModel:
    """Bytes of a request -> the validated model. Malformed JSON, JSON nested deeper than `max_json_depth`, text
    that is no valid Unicode and bad fields all become a 400."""
    try:
        check_depth(raw, max_json_depth)  # before json.loads, which recurses (1,000 levels: RecursionError)
    except Refusal as refusal:
        raise APIError(refusal.status, refusal.message, None, "json_too_deep") from None
    try:
        # invalid UTF-8 bytes become lone surrogates, as JSON's unpaired \ud800 escapes do: _check_text then
        # names the field that holds either
        data = json.loads(raw.decode("utf-8", "surrogateescape"), parse_constant=_no_constant)
    except (json.JSONDecodeError, ValueError, RecursionError) as error:
        raise APIError(400, f"the request body is not valid JSON: {error}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}", None,
                       "invalid_json")
    _check_text(data)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise validation_error(error) from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_text(data: dict) -> None:
    """Every string of the body, keys too, must be text UTF-8 can carry; the first that is not is named by its
    field ("messages[0].content"). Iterative: the depth is bounded already, but no recursion is simpler to trust."""
    stack = [((), data)]
    while stack:
        location, value = stack.pop()
        if isinstance(value, str):
            _check_string(location, value)
        elif isinstance(value, dict):
            for key in value:
                _check_string(location, key, is_key=True)
            stack.extend(reversed([(location + (key,), item) for key, item in value.items()]))  # in document order
        elif isinstance(value, list):
            stack.extend(reversed([(location + (index,), item) for index, item in enumerate(value)]))


def _check_string(location: tuple, text: str, is_key: bool = False) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        name = _field_name(location) or "the request body"
        what = f"a key of {name}" if is_key else name
        point = ord(text[error.start])
        if 0xDC80 <= point <= 0xDCFF:  # how surrogateescape decoded an invalid byte
            why = (f"is not valid UTF-8: byte 0x{point - 0xDC00:02X} at character {error.start} (or an unpaired "
                   f"\\u{point:04x} escape)")
        else:
            why = f"is not valid Unicode text: an unpaired surrogate \\u{point:04x} at character {error.start}"
        raise APIError(400, f"{what} {why}", _field_name(location) or None, "invalid_text") from None


class _Strict(BaseModel):
    # strict: no "5" -> 5; JSON numbers still fill float fields. Unknown fields are ignored (see the module doc).
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Strict):
    """A call in an assistant message of the history (as this server returned it)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant's message that calls tools
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (tools.py renders them as the template does)
    tool_call_id: str | None = None  # a tool's result: the call it answers

    @model_validator(mode="after")
    def _has_content(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant's message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to an assistant's message, not to a {self.role}'s")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def engine_message(self) -> dict:
        """As the engine's `messages` input takes it (OpenAI's "developer" is a system message)."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"name": call.function.name, "arguments": call.function.arguments}
                                     for call in self.tool_calls]
        return message


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments; None: any object
    strict: bool | None = None  # the arguments follow `parameters` either way when the grammar forces a call


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")  # OpenAI's key (`schema` would shadow pydantic's own attribute)
    strict: bool | None = None  # the answer follows the schema either way: the grammar enforces it


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: one of its constraints. Its other keys are refused, not ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# (field, the values that mean "not used"): set to anything else, the request is refused
def refuse_unsupported(data: Any, unsupported: dict[str, tuple]) -> None:
    """A 400 naming the first field of `unsupported` that `data` sets to anything but one of its accepted no-op
    values (a field this server does not implement is refused, never silently ignored)."""
    for name, unused in unsupported.items():
        if name in data and not any(data[name] is u or data[name] == u for u in unused):
            raise APIError(400, f"{name}: not supported by this server", name, "unsupported_parameter")


_UNSUPPORTED = {
    "functions": (None, []), "function_call": (None, "none"),  # OpenAI's deprecated form of tools
    "logit_bias": (None, {}), "best_of": (None, 1),
    "echo": (None, False), "suffix": (None, ""),
}


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # OpenAI's default: sampled, not greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=INT32_MAX)  # vLLM's extension; 0 = off
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)  # OpenAI's: per token already in the output
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)  # OpenAI's: per occurrence in the output
    # vLLM's extensions, honoured by the engine (ced/engine.py SamplingParams)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)
    stop_token_ids: list[int] | None = Field(default=None, max_length=1024)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)  # choices: at most the server's max_n (choices.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: benchmarks generate max_tokens whatever the model says
    user: str | None = None
    # structured output (guided.py turns them into the engine's grammar; at most one of them)
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None  # vLLM's extras
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_unsupported(data, _UNSUPPORTED)
        return data

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, ids):
        if ids is not None and any(not 0 <= token <= INT32_MAX for token in ids):
            raise ValueError(f"token ids are 0 to {INT32_MAX}")
        return ids

    @field_validator("temperature", "top_p", "repetition_penalty", "min_p", "presence_penalty", "frequency_penalty")
    @classmethod
    def _fits_float32(cls, value: float, info) -> float:
        """The engine takes FP32: a positive value under float32's smallest would reach it as 0 (top_p 5e-324 did,
        and was refused as top_p=0.0, a value never sent)."""
        if 0 < value < FLOAT32_SMALLEST:
            zero = "0 (greedy) or " if info.field_name == "temperature" else ""
            raise ValueError(f"must be {zero}at least {FLOAT32_SMALLEST:.7g}, the smallest positive float32 (the "
                             "engine's type): it would arrive as 0")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("a stop string must not be empty")
        return stops

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)  # OpenAI's newer name
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = None  # False: at most one call is returned
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("messages")
    @classmethod
    def _ends_with_user(cls, messages: list[Message]) -> list[Message]:
        if messages[-1].role not in ("user", "tool"):
            raise ValueError(f"the last message must be the user's (or a tool's result), got role "
                             f"{messages[-1].role!r}")
        return messages

    @model_validator(mode="after")
    def _logprobs_asked(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        return self

    def engine_messages(self) -> list[dict]:
        """The history as the engine's `messages` input takes it (OpenAI's "developer" is a system message)."""
        return [m.engine_message() for m in self.messages]

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # the alternatives per token

    @property
    def engine_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request, got a list of {len(prompt)}")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @property
    def token_limit(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS


class LoadAdapterRequest(_Strict):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    description: str | None = None  # ours: what the router reads; else the folder's description.txt


class UnloadAdapterRequest(_Strict):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; ignored


class TokenizeRequest(_Strict):
    """vLLM's POST /tokenize: a `prompt` (as /v1/completions takes it) or `messages` (as /v1/chat/completions
    renders them), tokenized as the engine tokenizes them."""

    model: str | None = None  # checked when given: an unknown model is a 404, as elsewhere
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True  # prompt: <|bos|> first, as /v1/completions does (a trained tokenizer's)
    add_generation_prompt: Literal[True] = True  # messages end in the assistant's marker, as a chat request's do

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give prompt or messages, one of them", "prompt" if self.prompt is None else
                           "messages", "invalid_value")
        if self.messages == []:
            raise APIError(400, "messages: give at least one message", "messages", "invalid_value")
        return self

    def engine_messages(self) -> list[dict]:
        return [m.engine_message() for m in self.messages]


class DetokenizeRequest(_Strict):
    """vLLM's POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)
