"""A model's chat tokenizer: the trained BPE (`tokenizer.json` beside the weights) with its chat markers, or UTF-8
bytes for the untrained demo. A user turn is wrapped the way the model was trained on dialogues.

The chat template's tool format (the demo's; docs/openai_api.md shows it): the tools a chat offers are a system
text (`tools_prompt`) ahead of the history; the assistant calls one by answering
`<tool_call>{"name": NAME, "arguments": {...}}</tool_call>` (one block per call), and a tool's result comes back as a
`tool` message, rendered as a user-side turn `<tool_response>RESULT</tool_response>` (the model has no tool role, as it
has no system role)."""

from __future__ import annotations

import json
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool")
TOOL_CALL = ("<tool_call>", "</tool_call>")  # around each call's JSON in an assistant's answer
TOOL_RESPONSE = ("<tool_response>", "</tool_response>")  # around a tool's result


def tools_prompt(tools: list[dict]) -> str:
    """The system text that offers `tools` ({name, description, parameters} each) in the template's tool format."""
    lines = [json.dumps({"name": tool["name"], "description": tool.get("description", ""),
                         "parameters": tool.get("parameters", {})}) for tool in tools]
    return ("You may call these functions. To call one, answer "
            f'{TOOL_CALL[0]}{{"name": NAME, "arguments": {{...}}}}{TOOL_CALL[1]}.\n' + "\n".join(lines))


def tool_call_text(name: str, arguments: str) -> str:
    """One call as the assistant writes it. `arguments` is the JSON text a client got back (and returns); re-written
    with json's default separators, as the grammar makes the model write them, so a resent history matches."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:  # kept as the client sent it: the model sees what it is told it said
        return f'{TOOL_CALL[0]}{{"name": {json.dumps(name)}, "arguments": {arguments}}}{TOOL_CALL[1]}'
    return f"{TOOL_CALL[0]}{json.dumps({'name': name, 'arguments': parsed})}{TOOL_CALL[1]}"


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

    def vocabulary_bytes(self, vocab_size: int) -> list[bytes]:
        """The UTF-8 bytes each token id of a model with `vocab_size` logits writes: b"" for the chat markers and
        for ids the tokenizer does not have (they print nothing). What a grammar reads the vocabulary as."""
        if self._bpe is None:
            return [bytes([i]) if i < 256 else b"" for i in range(vocab_size)]
        to_byte = {char: byte for byte, char in enumerate(_byte_level_alphabet())}
        special = set(self._bpe.get_added_tokens_decoder())
        pieces = []
        for i in range(vocab_size):
            token = None if i in special else self._bpe.id_to_token(i)
            pieces.append(b"" if token is None else bytes(to_byte[char] for char in token))
        return pieces

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
            content = message["content"]
            if message["role"] == "assistant":
                content += "".join(tool_call_text(call["name"], call["arguments"])
                                   for call in message.get("tool_calls", ()))
                tokens += self.encode(content) + ([self.stop_ids[0]] if self.trained else [])
                continue
            if message["role"] == "tool":
                content = f"{TOOL_RESPONSE[0]}{content}{TOOL_RESPONSE[1]}"
            text_ids = self.encode(content)
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
        calls = message.get("tool_calls", [])
        if calls and message["role"] != "assistant":
            raise ValueError(f"messages[{i}].tool_calls: only an assistant's message calls tools")
        if not isinstance(calls, list) or not all(
                isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), str)
                for call in calls):
            raise ValueError(f"messages[{i}].tool_calls must be a list of {{name, arguments}} objects (strings)")
        try:
            message["content"].encode("utf-8")
        except UnicodeEncodeError as error:  # JSON's "\ud800" parses to a lone surrogate, which is no text
            raise ValueError(f"messages[{i}].content holds a lone surrogate (U+{ord(error.object[error.start]):04X} "
                             f"at character {error.start}): not valid Unicode text") from None
    if messages[-1]["role"] == "assistant":
        raise ValueError("the last message must be the user's (or system's or a tool's): there is nothing to reply to")
    return messages


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte 0..255 in a byte-level BPE's tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]
