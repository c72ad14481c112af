"""Tool calling on the OpenAI port, in the demo chat template's tool format (ced/tokenization.py): the offered tools
become the system text ahead of the history, the model calls one by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and those blocks are parsed back into `tool_calls`, whole
or as streamed deltas.

`tool_choice`: "auto" (the default with tools) lets the model answer text or calls; "none" offers no tools and parses
nothing, so no call comes back; "required" and a named function force one call through the grammar (a JSON schema
over the tools' names and parameters between the tags), so even the 9M demo writes a well-formed call.
"""

from __future__ import annotations

import json
import uuid

from ced.tokenization import TOOL_CALL, tools_prompt

from ...core.structured import GrammarSpec
from .schema import APIError, ChatCompletionRequest


class ToolUse:
    """What a chat request's tools mean for its prompt, its grammar and its answer."""

    def __init__(self, body: ChatCompletionRequest):
        tools = body.tools or []
        choice = body.tool_choice or ("auto" if tools else "none")
        if choice != "none" and not tools:
            raise APIError(400, "tool_choice: no tools were given to choose from", "tool_choice", "invalid_value")
        self.functions = {tool.function.name: tool.function for tool in tools}
        if len(self.functions) != len(tools):
            raise APIError(400, "tools: two tools have the same name", "tools", "invalid_value")
        self.choice = choice if isinstance(choice, str) else choice.function.name
        if not isinstance(choice, str) and self.choice not in self.functions:
            raise APIError(400, f"tool_choice: no tool is named {self.choice!r} (offered: "
                                f"{', '.join(self.functions)})", "tool_choice.function.name", "invalid_value")
        self.active = self.choice != "none"  # tools offered, calls parsed
        self.single = body.parallel_tool_calls is False or self.forced

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "none")

    def messages(self, messages: list[dict]) -> list[dict]:
        """The engine's messages with the tools' system text first (joined to a leading system message)."""
        if not self.active:
            return messages
        offered = tools_prompt([{"name": f.name, "description": f.description or "",
                                 "parameters": f.parameters or {"type": "object"}} for f in self.functions.values()])
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": f"{offered}\n\n{messages[0]['content']}"}, *messages[1:]]
        return [{"role": "system", "content": offered}, *messages]

    def grammar(self) -> GrammarSpec | None:
        """The grammar of a forced call: one block whose JSON names a tool (the named one) with its arguments."""
        if not self.forced:
            return None
        names = list(self.functions) if self.choice == "required" else [self.choice]
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": name},
                                 "arguments": self.functions[name].parameters or {"type": "object"}}}
                 for name in names]
        return GrammarSpec("tool_call", json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls}))

    def split(self, text: str) -> tuple[str | None, list[dict]]:
        """The answer's text without its calls (None if nothing is left) and the calls, OpenAI's shape."""
        if not self.active:
            return text, []
        parser = CallParser(self)
        pieces = parser.feed(text) + parser.flush()
        content = "".join(piece for piece in pieces if isinstance(piece, str))
        calls = [piece for piece in pieces if isinstance(piece, dict)]
        return (content if content.strip() or not calls else None), calls


class CallParser:
    """The answer's text in order, as it streams: plain text, and each complete block that calls an offered tool as
    a call. Text that may still turn out to open a block is held back until the next piece settles it."""

    def __init__(self, use: ToolUse):
        self.use = use
        self.buffer, self.calls = "", 0
        self.inside = False

    def feed(self, piece: str) -> list[str | dict]:
        self.buffer += piece
        out: list[str | dict] = []
        while True:
            if self.inside:
                end = self.buffer.find(TOOL_CALL[1])
                if end < 0:
                    return out
                block, self.buffer = self.buffer[:end], self.buffer[end + len(TOOL_CALL[1]):]
                self.inside = False
                call = self._call(block)
                out.append(call if call is not None else f"{TOOL_CALL[0]}{block}{TOOL_CALL[1]}")
                continue
            start = self.buffer.find(TOOL_CALL[0])
            if start >= 0:
                if start:
                    out.append(self.buffer[:start])
                self.buffer, self.inside = self.buffer[start + len(TOOL_CALL[0]):], True
                continue
            hold = next((k for k in range(min(len(TOOL_CALL[0]) - 1, len(self.buffer)), 0, -1)
                         if TOOL_CALL[0].startswith(self.buffer[-k:])), 0)
            cut = len(self.buffer) - hold
            if cut:
                out.append(self.buffer[:cut])
            self.buffer = self.buffer[cut:]
            return out

    def flush(self) -> list[str]:
        """What is left at the end: an unclosed block (an answer cut by max_tokens) stays text."""
        rest = (TOOL_CALL[0] if self.inside else "") + self.buffer
        self.buffer, self.inside = "", False
        return [rest] if rest else []

    def _call(self, block: str) -> dict | None:
        """A block -> OpenAI's tool call, or None (not JSON, an unknown tool, or one call too many)."""
        try:
            data = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not (isinstance(data, dict) and data.get("name") in self.use.functions and "arguments" in data):
            return None
        if self.use.single and self.calls:
            return None
        arguments = data["arguments"]
        self.calls += 1
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": data["name"],
                             "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


class ToolDeltas:
    """Streamed `delta`s of a chat answer with tools: content deltas, and each call as one `tool_calls` delta with
    its index, id, name and whole arguments, once its block is complete."""

    def __init__(self, use: ToolUse):
        self.parser = CallParser(use) if use.active else None
        self.index = 0

    @property
    def called(self) -> bool:
        return self.index > 0

    def feed(self, piece: str) -> list[dict]:
        return self._deltas(self.parser.feed(piece) if self.parser else [piece])

    def flush(self) -> list[dict]:
        return self._deltas(self.parser.flush() if self.parser else [])

    def _deltas(self, pieces: list[str | dict]) -> list[dict]:
        deltas = []
        for piece in pieces:
            if isinstance(piece, str):
                deltas.append({"content": piece})
            else:
                deltas.append({"tool_calls": [{"index": self.index, **piece}]})
                self.index += 1
        return deltas
