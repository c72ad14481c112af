"""What one server accepts: the prompt of one request, and how many conversations and bytes its store keeps.

Each refusal names the limit, its value and the setting that changes it, so a client (or whoever runs the server)
knows what to do. The limits travel as the engine model's config.pbtxt parameters (`max_prompt_tokens`,
`max_conversations`, `max_store_bytes`, `idle_timeout_s`); left `auto` they come from MOL2_<NAME> (what
`mol2 serve --max-prompt-tokens ...` sets), else from DEFAULTS. 0 turns a count or size limit off.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULTS = {"max_prompt_tokens": 16384, "max_conversations": 10000, "max_store_bytes": 8 << 30,
            "idle_timeout_s": 3600.0}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


class LimitError(ValueError):
    """A request over one of the server's limits (a ValueError: the client's 400, with this message)."""


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int = DEFAULTS["max_prompt_tokens"]  # templated tokens of one turn's prompt
    max_conversations: int = DEFAULTS["max_conversations"]  # stored plus starting conversations (0: no limit)
    max_store_bytes: int = DEFAULTS["max_store_bytes"]  # bytes of every journal in the store (0: no limit)

    def __post_init__(self):
        for name in ("max_prompt_tokens", "max_conversations", "max_store_bytes"):
            if getattr(self, name) < 0 or (name == "max_prompt_tokens" and getattr(self, name) == 0):
                raise ValueError(f"{name} must be {'positive' if name == 'max_prompt_tokens' else '>= 0'}, "
                                 f"got {getattr(self, name)}")

    def check_prompt(self, tokens: int) -> None:
        if tokens > self.max_prompt_tokens:
            raise LimitError(f"the prompt is {tokens} tokens, over this server's limit of {self.max_prompt_tokens} "
                             "tokens per request (max_prompt_tokens): send a shorter turn")

    def check_text(self, name: str, size: int, bytes_per_token: int) -> None:
        """Before tokenizing: `size` bytes of text make at least size / bytes_per_token tokens (the tokenizer's
        longest token, ChatTokenizer.max_token_bytes), so a text over max_prompt_tokens times that cannot fit and is
        refused unread (a 64 MiB prompt took 190 s and 12 GB of the engine's memory to tokenize, only to be refused)."""
        limit = self.max_prompt_tokens * bytes_per_token
        if size > limit:
            raise LimitError(f"{name} is {size:,} bytes, more than this server's limit of {self.max_prompt_tokens} "
                             f"tokens per request (max_prompt_tokens) can hold ({limit:,} bytes at most): send a "
                             "shorter turn")

    def check_room(self, conversations: int, store_bytes: int) -> None:
        """Whether the store may take one more conversation, holding `conversations` and `store_bytes` now."""
        if self.max_conversations and conversations >= self.max_conversations:
            raise LimitError(f"this server already holds {conversations} conversations, its limit "
                             f"(max_conversations={self.max_conversations}); a new one can start once others end "
                             "(end_conversation) or expire")
        if self.max_store_bytes and store_bytes >= self.max_store_bytes:
            raise LimitError(f"this server's conversation store holds {store_bytes:,} bytes, at its limit "
                             f"(max_store_bytes={self.max_store_bytes:,}); a new conversation can start once others "
                             "end (end_conversation) or expire")


def check_context(length: int, adding: int, limit: int) -> None:
    """A conversation of `length` tokens may take `adding` more only below the model's context (max_context): the
    last position is kept for the first generated token."""
    if length + adding >= limit:
        raise LimitError(f"the conversation would reach {length + adding} tokens, over the context limit of {limit}")


def parse_size(text: str | int) -> int:
    """Bytes from "8589934592", "8G", "512MiB", "1.5g" (powers of 1024)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    if match is None:
        raise ValueError(f"{text!r} is not a size in bytes (e.g. 8589934592, 512M, 8G)")
    return int(float(match[1]) * 1024 ** " kmgt".index(match[2].lower() or " "))


def resolve(name: str, value: str) -> str:
    """A setting's value with `auto` taken as its default."""
    return str(DEFAULTS[name]) if value == "auto" else value


def from_settings(values: dict[str, str]) -> Limits:
    """Limits from setting strings (config parameters or MOL2_* variables; `auto` = the default)."""
    return Limits(int(resolve("max_prompt_tokens", values.get("max_prompt_tokens", "auto"))),
                  int(resolve("max_conversations", values.get("max_conversations", "auto"))),
                  parse_size(resolve("max_store_bytes", values.get("max_store_bytes", "auto"))))
