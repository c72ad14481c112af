"""The body of POST /v1/responses (OpenAI's Responses API), validated as strictly as the chat body (schema.py).

`input` is a string (one user message) or a list of message items: `{"role", "content"}` with `content` a string or
a list of text parts (`input_text`; `output_text` too, as the SDK hands an earlier answer's output items back).
Anything that is not text (images, files, audio, tool calls and their outputs, reasoning items, item references)
is refused with a 400 naming the item. So are the request fields this server cannot honour, unless set to their
no-op value (OPENAI_ONLY); fields nobody defined are ignored, as elsewhere.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .schema import DEFAULT_MAX_TOKENS, FLOAT32_SMALLEST, MAX_TOKENS_LIMIT, APIError, _Strict, refuse_unsupported

MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's own limits
TEXT_PARTS = ("input_text", "output_text")
ROLES = ("user", "system", "developer", "assistant")

# (field, the values that mean "not used"): set to anything else, the request is refused with a 400 naming it
_UNSUPPORTED = {
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "max_tool_calls": (None,),
    "background": (None, False), "conversation": (None,), "include": (None, []), "prompt": (None,),
    "reasoning": (None, {}), "top_logprobs": (None, 0), "prompt_cache_retention": (None,),
    "context_management": (None, []), "moderation": (None,), "image": (None,), "access_programs": (None,),
    "background_options": (None,),
    "text": (None, {}, {"format": {"type": "text"}}),  # structured output: not built for this API yet
    "truncation": (None, "disabled"),  # a prompt over the limit is refused, never cut
    "service_tier": (None, "auto", "default"),
    "stream_options": (None, {}, {"include_obfuscation": False}),  # no obfuscation padding is sent
}


class ResponseTextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str


class ResponseInputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ResponseTextPart]

    def engine_message(self) -> dict:
        """As the engine's `messages` input takes it: OpenAI's developer is a system message."""
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ResponseRequest(_Strict):
    model: str
    input: str | list[ResponseInputMessage]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None  # no tools: nothing to run in parallel either way
    # accepted, with nothing to do here: the prefix cache needs no key, and who asks is not recorded
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_unsupported(data, _UNSUPPORTED)
            if isinstance(data.get("input"), list):
                _check_items(data["input"])
        return data

    @field_validator("input")
    @classmethod
    def _a_turn(cls, value):
        if isinstance(value, str):
            if not value:
                raise ValueError("the input is empty")
            return value
        if not value:
            raise ValueError("give at least one message")
        if value[0].role == "assistant":
            raise ValueError("the first message must be a user, system or developer message (this model's turns "
                             "begin with one)")
        if value[-1].role == "assistant":
            raise ValueError("the last message must not be the assistant's: there is nothing to reply to")
        return value

    @field_validator("temperature", "top_p")
    @classmethod
    def _fits_float32(cls, value: float) -> float:
        if 0 < value < FLOAT32_SMALLEST:
            raise ValueError(f"must be at least {FLOAT32_SMALLEST:.7g}, the smallest positive float32 (the engine's "
                             "type): it would arrive as 0")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, metadata):
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys, got {len(metadata)}")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(f"keys are at most {MAX_METADATA_KEY} characters and values at most "
                                 f"{MAX_METADATA_VALUE} (key {key[:MAX_METADATA_KEY]!r})")
        return metadata

    def input_messages(self) -> list[dict]:
        """The input as engine messages (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [item.engine_message() for item in self.input]

    @property
    def token_limit(self) -> int:
        return self.max_output_tokens or DEFAULT_MAX_TOKENS


def _check_items(items: list) -> None:
    """Input items that are not text messages, named by their place (`input[2]`, `input[0].content[1]`), with what
    they are: pydantic's own message for a union member it cannot match says less."""
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue  # pydantic names it
        kind = item.get("type", "message")
        if kind != "message":
            raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported by this server (text "
                                "messages only)", f"input[{i}]", "unsupported_parameter")
        content = item.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") not in TEXT_PARTS:
                raise APIError(400, f"input[{i}].content[{j}]: content of type {part.get('type')!r} is not supported "
                                    "by this server (input_text and output_text only)",
                               f"input[{i}].content[{j}]", "unsupported_parameter")
