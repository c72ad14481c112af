"""Structured output: the grammar a turn's answer must follow, applied as a token mask on that row's logits where the
scheduler samples it (xgrammar, on the CPU; rows without a grammar never reach this module).

A request's grammar travels as a GrammarSpec's JSON (the `engine` model's `structured_output` input, the OpenAI
port's translation of `response_format`, vLLM's `guided_*` / `structured_outputs` and `tools`). It is checked where
it arrives (`GrammarSpec.check`: a malformed schema, regex or grammar is the client's error, named), and compiled
against the served tokenizer once per distinct spec (`Grammars`, an LRU keyed by the spec's text: 16 rows under one
schema compile once). Each row then has its own matcher (`RowGrammar`): the mask for its next token, the token it
took, and whether the grammar is done, which ends the turn with finish_reason "stop" even where the tokenizer has no
stop token to say so (the untrained demo's bytes).

JSON-family grammars also forbid tokens that write a control character other than a line break: xgrammar's rule for
a string with `maxLength` lets them through, and raw control characters inside a string are not JSON. And a JSON row
closes its structure as its token budget runs out: with CLOSING_RESERVE tokens or fewer left, text the grammar
forces (a required key, `: `) is written in the fewest tokens (the longest allowed token that begins it), and
otherwise the tokens the grammar allows are narrowed, tier by tier where it allows any of a tier, to those that close what is open (inside a string:
a `"`, perhaps with `}`, `]` or `:` after it; outside: `]` or `}`), else to separators (`,`, `:`, a space), else to
a `"` (a key the schema requires, an empty string), so a small model that would write an unbounded string ends with
valid JSON instead of one cut by max_tokens.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ced import kernels
from ced.tokenization import TOOL_CALL, ChatTokenizer

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_call")
JSON_KINDS = frozenset({"json_schema", "json_object", "tool_call"})
CONTROL_BYTES = bytes(b for b in range(0x20) if b not in (0x0A, 0x0D))  # all but \n and \r
# what a JSON row near its budget's end prefers, tier by tier: inside a string, outside one (closing_tiers)
STRING_TIERS = (lambda piece: piece[:1] == b'"' and all(b in b"]}: " for b in piece[1:]),
                lambda piece: piece[:1] == b'"' and all(b in b"]},: " for b in piece[1:]))
OUTSIDE_TIERS = (lambda piece: bool(piece) and all(b in b"]}" for b in piece),
                 lambda piece: bool(piece) and all(b in b",: " for b in piece),
                 lambda piece: b'"' in piece and all(b in b' "' for b in piece))
CLOSING_RESERVE = 32  # tokens: a JSON row's budget left when it starts closing (keys a schema requires need some)


@dataclass(frozen=True)
class GrammarSpec:
    """What an answer must follow. `value`: json_schema / tool_call: a JSON schema (JSON text; tool_call: the call's
    JSON, between the chat template's <tool_call> tags); regex: a regular expression; choice: a JSON list of
    strings (the answer is one of them); grammar: EBNF (xgrammar's GBNF dialect); json_object: unused (any object)."""

    kind: str
    value: str = ""

    @classmethod
    def from_json(cls, text: str) -> "GrammarSpec":
        """The engine input's JSON {"type": KIND, "value": ...}; ValueError naming what is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"structured_output is not valid JSON: {error}") from None
        if not isinstance(data, dict) or data.get("type") not in KINDS:
            raise ValueError(f"structured_output must be {{\"type\": one of {', '.join(KINDS)}, \"value\": ...}}")
        value = data.get("value", "")
        if not isinstance(value, str):
            raise ValueError("structured_output.value must be a string (a schema, a choice list as JSON text)")
        return cls(data["type"], value).check()

    def to_json(self) -> str:
        return json.dumps({"type": self.kind, "value": self.value})

    def check(self) -> "GrammarSpec":
        """Itself, once its grammar builds; else ValueError with the grammar library's reason."""
        self.grammar()
        return self

    def grammar(self):
        """The tokenizer-free grammar (xgrammar.Grammar)."""
        import xgrammar as xgr  # here: a process that never sees a grammar does not pay its import (seconds)

        try:
            if self.kind == "json_schema":
                return xgr.Grammar.from_json_schema(_schema_text(self.value), any_whitespace=False)
            if self.kind == "json_object":
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
            if self.kind == "tool_call":
                call = xgr.Grammar.from_json_schema(_schema_text(self.value), any_whitespace=False)
                return xgr.Grammar.concat(_literal(xgr, TOOL_CALL[0]), call, _literal(xgr, TOOL_CALL[1]))
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.value)
            if self.kind == "choice":
                choices = json.loads(self.value)
                if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                    raise ValueError("a choice is a non-empty list of non-empty strings")
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices))
            if self.kind == "grammar":
                return xgr.Grammar.from_ebnf(self.value)
        except ValueError:
            raise
        except Exception as error:  # noqa: BLE001 - xgrammar raises RuntimeError with its C++ location first
            raise ValueError(f"{self.kind}: {_reason(error)}") from None
        raise ValueError(f"unknown structured output type {self.kind!r} (one of {', '.join(KINDS)})")


def _schema_text(value: str) -> str:
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as error:
        raise ValueError(f"the schema is not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"the schema must be a JSON object, got {type(schema).__name__}")
    return value


def _literal(xgr, text: str):
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def _reason(error: Exception) -> str:
    """xgrammar's message without its "[time] /project/cpp/file.cc:123: " prefix."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    return first.split(": ", 1)[1] if first.startswith("[") and ": " in first else first


class Grammars:
    """The compiled grammars of one served tokenizer, cached by their spec's text (LRU, `capacity` of them)."""

    def __init__(self, tokenizer: ChatTokenizer, vocab_size: int, capacity: int = 64, threads: int = 2):
        import xgrammar as xgr

        self.vocab_size, self.capacity = vocab_size, capacity
        pieces = tokenizer.vocabulary_bytes(vocab_size)
        self.stop_ids = list(tokenizer.stop_ids)
        # RAW: each id's bytes as the tokenizer writes them; b"" (the chat markers) is a special token, never allowed
        # except the stop tokens
        info = xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=self.stop_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.stop_bits = _bits([i in tokenizer.stop_ids for i in range(vocab_size)])
        self.json_bits = _bits([not any(b in CONTROL_BYTES for b in piece) for piece in pieces])
        self.pieces = pieces
        self.ids = {}  # each token's bytes -> its id (the first, should two write the same)
        for token, piece in enumerate(pieces):
            self.ids.setdefault(piece, token) if piece else None
        self.closing_tiers = {inside: [_bits([tier(piece) for piece in pieces]) for tier in tiers]
                              for inside, tiers in ((True, STRING_TIERS), (False, OUTSIDE_TIERS))}
        self.compiled: OrderedDict[str, tuple[object, bool]] = OrderedDict()  # spec -> (grammar, JSON family)
        self.compiles = 0  # how many specs were compiled (the rest came from the cache)

    def matcher(self, spec_json: str) -> "RowGrammar":
        """A fresh matcher for one row under this spec (compiled once per distinct spec text). Called on the
        scheduler's thread only."""
        entry = self.compiled.pop(spec_json, None)
        if entry is None:
            spec = GrammarSpec.from_json(spec_json)
            entry = self.compiler.compile_grammar(spec.grammar()), spec.kind in JSON_KINDS
            self.compiles += 1
        self.compiled[spec_json] = entry  # the most recently used last
        while len(self.compiled) > self.capacity:
            self.compiled.popitem(last=False)
        return RowGrammar(*entry, self)


class RowGrammar:
    """One row's matcher: the next token's mask, the tokens taken, whether the grammar is done."""

    def __init__(self, compiled, json_family: bool, grammars: Grammars):
        import xgrammar as xgr

        self._xgr, self.grammars = xgr, grammars
        self.matcher = xgr.GrammarMatcher(compiled)
        self.extra = grammars.json_bits if json_family else None
        self.bitmask = xgr.allocate_token_bitmask(1, grammars.vocab_size)
        self.done = False  # the grammar is complete and allows nothing but a stop token
        self.in_string = self.escaped = False  # where a JSON row's text is: what closing it takes
        self._fill()

    def _track_strings(self, piece: bytes) -> None:
        for byte in piece:
            if self.escaped:
                self.escaped = False
            elif self.in_string and byte == 0x5C:  # a backslash
                self.escaped = True
            elif byte == 0x22:  # a quote
                self.in_string = not self.in_string

    def _fill(self) -> None:
        self.matcher.fill_next_token_bitmask(self.bitmask)
        if self.extra is not None:
            self.bitmask &= self.extra

    def allowed(self, tokens_left: int | None = None) -> Tensor:
        """The tokens the grammar allows next (a bitmask (1, ceil(V / 32))); a JSON row with `tokens_left` <=
        CLOSING_RESERVE loses those that do not close or separate, where it may."""
        if self.extra is not None and tokens_left is not None and tokens_left <= CLOSING_RESERVE:
            return self._closing(self.bitmask)
        return self.bitmask

    def mask(self, logits: Tensor, tokens_left: int | None = None, allowed: Tensor | None = None) -> Tensor:
        """A copy of `logits` (V,) with every token the grammar forbids next (not in `allowed`) at -inf."""
        masked = logits.float().clone()
        self._xgr.apply_token_bitmask_inplace(masked, self.allowed(tokens_left) if allowed is None else allowed)
        return masked

    def greedy(self, logits: Tensor, tokens_left: int | None = None) -> int:
        """The most likely token the grammar allows: the argmax of `mask`'s copy, without making it (one native
        pass, ~2 us; the copy, xgrammar's mask and torch's argmax took ~45 us a row a step)."""
        allowed = self.allowed(tokens_left)
        token = kernels.argmax_allowed(logits, allowed[0])
        return int(self.mask(logits, allowed=allowed).argmax()) if token is None else token

    def _closing(self, bitmask: Tensor) -> Tensor:
        """The allowed tokens narrowed to those that end the JSON soonest (the module's doc)."""
        forced = self.matcher.find_jump_forward_string().encode("utf-8")
        for length in range(len(forced), 0, -1):
            token = self.grammars.ids.get(forced[:length])
            if token is not None and bitmask[0, token // 32] >> (token % 32) & 1:
                only = torch.zeros_like(bitmask)
                only[0, token // 32] = bitmask[0, token // 32] & (1 << (token % 32))
                return only
        for preferred in self.grammars.closing_tiers[self.in_string]:
            narrowed = bitmask & preferred
            if bool(narrowed.any()):
                return narrowed
        return bitmask

    def accept(self, token: int) -> None:
        """Take the row's sampled token; then `done` says whether the grammar allows anything but a stop token."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed")
        if self.extra is not None:
            self._track_strings(self.grammars.pieces[token])
        if self.matcher.is_terminated():
            self.done = True
            return
        self._fill()
        # checked only once complete (a µs): the mask test costs ~20 µs of small tensor ops
        self.done = self.matcher.is_completed() and not bool((self.bitmask & ~self.grammars.stop_bits).any())


def _bits(allowed: list[bool]) -> Tensor:
    """A token bitmask (1, ceil(V / 32)) int32, as xgrammar lays it out: bit j of word w is token 32 w + j."""
    flags = np.zeros(-(-len(allowed) // 32) * 32, dtype=bool)
    flags[:len(allowed)] = allowed
    return torch.from_numpy(np.packbits(flags, bitorder="little").view(np.int32).copy()).unsqueeze(0)
