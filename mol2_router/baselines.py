"""The two routers MoL2 replaces, behind the same interface (`decide(RouteQuery, options)` -> Decision).

- MoL: an adapter (the seed's randomly initialized L0, here `random_l0`) reads a route prompt placed after the
  user turn and decodes a label and a short reason; the label is the first candidate name in the text. The route
  prompt's KV and the decoded tokens land in a temporary copy of the state, which is then dropped (rollback).
- Contextual MoL: the route prompt and every option are encoded after the query in a temporary encoder pass
  (prefill on a copy: a temporary global-KV branch); a q/k head scores each option's pooled H19 against the
  query's. The copy is dropped.
Either way the conversation's own state is bitwise what it was (tests compare every tensor and the tokens).
"""

from __future__ import annotations

import copy
import re
import time
from typing import Sequence

import torch

from .data import Candidate
from .features import ASSISTANT, END, EOS, USER, RouteTokenizer, option_tokens
from .head import QKHead
from .interface import Decision, RouteQuery, Router

MOL_PROMPT = ("Pick the adapter that should answer the request above. Options:\n{options}\n"
              "Answer with the option name, then a short reason.")


def name_pattern(name: str) -> re.Pattern:
    """A candidate's name as a whole word of decoded text; lookarounds, not \\b, so that names that begin or end in
    punctuation ("c++", ".net") match too."""
    return re.compile(rf"(?<!\w){re.escape(name)}(?!\w)", re.IGNORECASE)


class MoLRouter(Router):
    name = "mol"

    def __init__(self, engine, tokenizer: RouteTokenizer, candidates: Sequence[Candidate] = (),
                 adapter: str | None = "random_l0", max_tokens: int = 64):
        from ced.engine import SamplingParams

        self.engine, self.tokenizer, self.adapter, self.max_tokens = engine, tokenizer, adapter, max_tokens
        self.sampling = SamplingParams(temperature=0.0)
        if candidates:
            self.set_options(candidates)

    def set_options(self, candidates: Sequence[Candidate]) -> None:
        """The route prompt listing the options, and the patterns that find their names in the decoded text."""
        self.candidates = tuple(candidates)
        options = "\n".join(f"- {c.name}: {c.description}" for c in self.candidates)
        self.prompt = [USER] + self.tokenizer.encode(MOL_PROMPT.format(options=options)) + [END, ASSISTANT]
        self._names = [name_pattern(c.name) for c in self.candidates]

    def parse(self, text: str) -> int:
        """Index of the candidate named first in the decoded text, -1 when none is."""
        hits = [(m.start(), i) for i, pattern in enumerate(self._names) if (m := pattern.search(text))]
        return min(hits)[1] if hits else -1

    def route(self, query: RouteQuery) -> Decision:
        state = query.need("state", self.name)
        started = time.perf_counter()
        branch = copy.deepcopy(state)  # the route prompt and the label go here, never into `state`
        turn = self.engine.turn(branch, self.prompt, self.adapter)
        out = list(self.engine.generate(branch, self.adapter, turn.logits, self.max_tokens, self.sampling,
                                        stop_tokens=(END, EOS)))
        del branch  # rollback
        text = self.tokenizer.decode(out)
        index = self.parse(text)
        name = self.candidates[index].name if index >= 0 else None
        return Decision(name, True, index, reason=text, ms=(time.perf_counter() - started) * 1e3)


class ContextualRouter(Router):
    name = "contextual"

    def __init__(self, engine, head: QKHead, tokenizer: RouteTokenizer, candidates: Sequence[Candidate] = (),
                 max_option_tokens: int = 96):
        self.engine, self.head = engine, head.eval()
        self.tokenizer, self.max_option_tokens = tokenizer, max_option_tokens
        if candidates:
            self.set_options(candidates)

    def set_options(self, candidates: Sequence[Candidate]) -> None:
        """The options' tokens (route prompt + "name: description" + newline each) and their spans."""
        self.candidates = tuple(candidates)
        self.ids, self.spans = [], []
        for c in self.candidates:
            opt = option_tokens(self.tokenizer, c.option_text(), self.max_option_tokens, f"option {c.name!r}") + \
                self.tokenizer.encode("\n")
            self.spans.append((len(self.ids), len(self.ids) + len(opt)))
            self.ids += opt

    @torch.inference_mode()
    def route(self, query: RouteQuery) -> Decision:
        state, h19 = query.need("state", self.name), query.need("h19", self.name)
        started = time.perf_counter()
        branch = copy.deepcopy(state)  # the temporary global-KV branch
        options_h19 = self.engine.prefill(branch, self.ids)  # (sum T, C): the options, read in the query's context
        del branch  # cleanup
        options = torch.stack([options_h19[s:e].float().mean(0) for s, e in self.spans])  # (N, C)
        logits = self.head(h19.float().mean(0, keepdim=True), options[None],
                           torch.ones(1, len(self.candidates), dtype=torch.bool))[0]
        index = int(logits.argmax())
        return Decision(self.candidates[index].name, True, index, logits, ms=(time.perf_counter() - started) * 1e3)
