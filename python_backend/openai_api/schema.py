"""Request bodies of the OpenAI endpoints, validated strictly (a string where a number belongs is a 400 naming the
field, not a silent conversion), and errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Fields OpenAI defines that this server cannot honour (tools, logprobs, penalties, n > 1, ...) are refused when set
to anything but their no-op value, so a client never gets an answer computed without what it asked for. Fields
nobody defined are ignored, as OpenAI's own server and vLLM do for forward compatibility. Two vLLM extensions are
taken: `top_k` and `ignore_eos`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_TOKENS_LIMIT = 4096  # the engine's own bound on one request's new tokens
DEFAULT_MAX_TOKENS = 256
MAX_STOPS = 16


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


def parse_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    """Bytes of a request -> the validated model; malformed JSON and bad fields both become a 400."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise APIError(400, f"the request body is not valid JSON: {error}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}", None,
                       "invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise validation_error(error) from None


class _Strict(BaseModel):
    # strict: no "5" -> 5; JSON numbers still fill float fields. Unknown fields are ignored (see the module doc).
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


# (field, the values that mean "not used"): set to anything else, the request is refused
_UNSUPPORTED = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "best_of": (None, 1),
    "echo": (None, False), "suffix": (None, ""), "response_format": (None, {"type": "text"}),
}


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # OpenAI's default: sampled, not greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # vLLM's extension; 0 = off
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: benchmarks generate max_tokens whatever the model says
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, unused in _UNSUPPORTED.items():
                if name in data and not any(data[name] is u or data[name] == u for u in unused):
                    raise APIError(400, f"{name}: not supported by this server", name, "unsupported_parameter")
        return data

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

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

    @field_validator("messages")
    @classmethod
    def _ends_with_user(cls, messages: list[Message]) -> list[Message]:
        if messages[-1].role != "user":
            raise ValueError(f"the last message must be the user's, got role {messages[-1].role!r}")
        return messages

    def engine_messages(self) -> list[dict]:
        """The history as the engine's `messages` input takes it (OpenAI's "developer" is a system message)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    @property
    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS


class CompletionRequest(_Sampling):
    prompt: str | list[str]

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
