"""A model's chat tokenizer: the trained BPE (`tokenizer.json` beside the weights) with its chat markers, or UTF-8
bytes for the untrained demo. A user turn is wrapped the way the model was trained on dialogues."""

from __future__ import annotations

from pathlib import Path

ROLES = ("system", "user", "assistant")


class ByteTokenizer:
    """UTF-8 bytes as token ids: the stand-in when a model has no trained tokenizer."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class ChatTokenizer:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir) / "tokenizer.json"
        if path.is_file():
            from tokenizers import Tokenizer

            self._bpe, self._bytes = Tokenizer.from_file(str(path)), None
            self._max_token_bytes: int | None = None  # computed on first use
            ids = {name: self._bpe.token_to_id(name) for name in ("<|bos|>", "<|user|>", "<|assistant|>", "<|end|>",
                                                                  "<|eos|>")}
            self.bos, self.user, self.assistant = ids["<|bos|>"], ids["<|user|>"], ids["<|assistant|>"]
            self.stop_ids = tuple(i for i in (ids["<|end|>"], ids["<|eos|>"]) if i is not None)
        else:
            self._bpe, self._bytes = None, ByteTokenizer()
            self.bos = self.user = self.assistant = None
            self.stop_ids = ()

    @property
    def trained(self) -> bool:
        return self._bpe is not None

    @property
    def max_token_bytes(self) -> int:
        """No token covers more UTF-8 bytes of text than this, so a text of N bytes is at least N / this tokens:
        what lets a server refuse an oversized prompt without tokenizing it. For a byte-level BPE each character of
        a vocabulary entry stands for one byte and encodes to one byte or more, so the entries' UTF-8 lengths bound
        it from above (an overestimate only makes the bound looser, never refuses a prompt that fits)."""
        if self._bpe is None:
            return 1
        if self._max_token_bytes is None:
            self._max_token_bytes = max(len(token.encode("utf-8")) for token in self._bpe.get_vocab(True))
        return self._max_token_bytes

    def encode(self, text: str) -> list[int]:
        return self._bpe.encode(text).ids if self._bpe else self._bytes.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._bpe.decode(ids, skip_special_tokens=True) if self._bpe else self._bytes.decode(ids)

    def user_turn(self, text_ids: list[int], first: bool) -> list[int]:
        """`<|bos|>` on the first turn, then `<|user|>text<|end|><|assistant|>`: the reply starts right after."""
        if not self.trained:
            return list(text_ids)
        return ([self.bos] if first else []) + [self.user] + list(text_ids) + [self.stop_ids[0], self.assistant]

    def render(self, messages: list[dict]) -> tuple[list[int], int]:
        """A whole chat as the stateful path would have built it turn by turn: each user turn as `user_turn`, each
        assistant message as the reply it stands for (its text, then `<|end|>`). The model has no system role: a
        system message is rendered as a user turn. Returns the tokens and where the last user turn starts (what
        the router pools, as it pools a stateful turn). The messages must be checked (`check_messages`) first."""
        tokens, route_start = [], 0
        for message in messages:
            text_ids = self.encode(message["content"])
            if message["role"] == "assistant":
                tokens += text_ids + ([self.stop_ids[0]] if self.trained else [])
                continue
            first = not tokens
            route_start = len(tokens) + (1 if first and self.trained else 0)  # the router skips <|bos|>
            tokens += self.user_turn(text_ids, first)
        return tokens, route_start

    def completion_prompt(self, text: str) -> list[int]:
        """A raw prompt (completions): its text, after `<|bos|>` as every sequence the model saw began."""
        return ([self.bos] if self.trained else []) + self.encode(text)


def check_messages(messages) -> list[dict]:
    """A chat's messages as the client sent them (parsed JSON): a list of {role, content}, the last from the user."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with role and content")
        if message.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
        try:
            message["content"].encode("utf-8")
        except UnicodeEncodeError as error:  # JSON's "\ud800" parses to a lone surrogate, which is no text
            raise ValueError(f"messages[{i}].content holds a lone surrogate (U+{ord(error.object[error.start]):04X} "
                             f"at character {error.start}): not valid Unicode text") from None
    if messages[-1]["role"] == "assistant":
        raise ValueError("the last message must be the user's (or system's): there is nothing to reply to")
    return messages
