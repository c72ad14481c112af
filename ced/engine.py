"""The CED engine: many LoRA adapters over one shared conversation history.

A turn is `prefill` (the new user tokens through the adapter-free stage: encoder, global KV, H19) then `replay`
(the last W positions through the decoder under the chosen adapter), then `generate`. A switch is a replay.
The engine never copies the history per adapter and never recomputes anything adapter-free.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Collection, Iterable, Iterator, Sequence

import torch
from torch import Tensor

from .adapters import AdapterRegistry, placement_violation
from .lora import LoRAMapping, pack_linears, wrap_linears
from .model import CEDForCausalLM, SharedOutput
from .state import AdapterState, ConversationState, Selection, SharedState


class ContextTooLongError(ValueError):
    pass


class StateError(RuntimeError):
    """An engine call that does not fit the conversation's state (e.g. decoding with stale windows)."""


MAX_TOP_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's bound)


@dataclass
class SamplingParams:
    """How the next token is chosen. The penalties and filters mean what vLLM's (and OpenAI's) fields of the same
    names mean, so a client gets what it asked for whichever server it sends to."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest (0: off)
    repetition_penalty: float = 1.0  # a token already in the context (prompt or output): logit / p if > 0, else x p
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    min_tokens: int = 0  # no stop token before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # stop after any of these, as after the tokenizer's own stop tokens
    # structured output: a grammar the answer must follow, as python_backend/core/structured.py's GrammarSpec JSON
    # (the server masks each step's logits with it; this engine's own `generate` refuses it)
    grammar: str | None = None
    logprobs: int | None = None  # each token's log-probability and this many likeliest alternatives; None: off

    def __post_init__(self):
        # each refusal names its field and the value as the engine got it (NaN fails every comparison)
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no top-k filter), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be > 0 and <= 1, got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be between 0 and 1, got {self.min_p!r}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be between -2 and 2, got {getattr(self, name)!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if any(token < 0 for token in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (>= 0), got {list(self.stop_token_ids)!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS} (the alternatives per token), "
                             f"got {self.logprobs!r}")

    @property
    def shapes_logits(self) -> bool:
        """Whether anything but temperature, top-k and top-p applies (the rows that need their history)."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.min_tokens > 0)

    @property
    def greedy(self) -> bool:
        """The most likely token (of those a grammar allows, where one applies): no temperature, shaping or
        logprobs."""
        return self.temperature == 0 and not self.shapes_logits and self.logprobs is None

    @property
    def plain_greedy(self) -> bool:
        """The most likely token, nothing else: no temperature, shaping, grammar or logprobs."""
        return self.greedy and self.grammar is None


@dataclass
class EngineStats:
    prefilled_positions: int = 0  # through the adapter-free stage
    replayed_positions: int = 0  # through the decoder by bounded replay
    decoded_tokens: int = 0


@dataclass
class TurnResult:
    logits: Tensor  # (V,) next-token logits under the adapter
    h19: Tensor  # (n, C) H19 of the new tokens: what the router reads
    replayed: int  # positions replayed


class CEDEngine:
    def __init__(self, model: CEDForCausalLM, max_adapters: int = 8, max_rank: int = 16,
                 placement: str = "decoder", prefill_chunk: int = 256):
        """`placement="decoder+first-attention"` is the unsafe switch that only the invariant tests use."""
        self.model = model.eval()
        self.config = model.ced
        self.prefill_chunk = prefill_chunk
        self.mapping = LoRAMapping()
        # max_adapters=0: no slots at all, the plain model (an adapter-free stage never runs an adapter)
        modules = wrap_linears(model, lambda name: max_adapters > 0 and
                               placement_violation(name, self.config, placement) is None,
                               max_adapters, max_rank, self.mapping)
        self.adapters = AdapterRegistry(modules, self.config, max_adapters, max_rank, placement)
        pack_linears(model)  # the rest too: the engine's model is frozen, its weights kept in matmul's best layout
        self.stats = EngineStats()

    # -- conversations --------------------------------------------------------------------------------------

    def new_conversation(self) -> ConversationState:
        E = self.config.decoder_start
        shared = SharedState(self.model.new_windows(range(E + 1)), self.model.new_stores())
        return ConversationState(shared, AdapterState(None, self.model.new_windows(self.config.adapter_bound_layers)))

    @contextmanager
    def _rows(self, adapters: Iterable[str | None]):
        slots = [self.adapters.slot_of(name) for name in adapters]  # raises on unknown names before any work
        self.mapping.set_rows(slots, self.adapters.n_slots, self.adapters.max_rank,
                              next(self.model.parameters()).dtype)
        try:
            yield
        finally:
            self.mapping.clear()

    def _check_tokens(self, state: ConversationState, tokens: list[int]) -> list[int]:
        return check_tokens(self.config, state.length, tokens)

    # -- the two model calls: another engine (ONNX Runtime, TensorRT) overrides only these -----------------------

    def _shared_stage(self, state: ConversationState, tokens: list[int]) -> SharedOutput:
        """The adapter-free stage over `tokens` at the end of the context; appends to the shared windows/globals."""
        shared = state.shared
        return self.model.run_shared(torch.tensor([tokens]), shared.length, shared.windows, shared.globals)

    def _decoder_logits(self, state: ConversationState, stream: Tensor, start: int, selection: Selection,
                        windows: dict, capture: dict[int, list[Tensor]] | None = None) -> Tensor:
        """The decoder (under the rows' mapped adapter) from `stream` at `start`, appending to `windows`; returns
        the next-token logits (V,) of the last position (the last layer runs for it alone unless capturing)."""
        hidden = self.model.run_decoder(stream, start, selection, windows,
                                        state.shared.globals[self.config.decoder_start], capture, capture is None)
        return self.model.lm_head(hidden[:, -1])[0]

    def _run_shared(self, state: ConversationState, tokens: list[int]) -> SharedOutput:
        shared = state.shared
        out = self._shared_stage(state, tokens)
        W, k = self.config.window, self.config.index_top_k
        selection = out.selection or Selection(torch.zeros(1, len(tokens), k, dtype=torch.long),
                                               torch.zeros(1, len(tokens), k, dtype=torch.bool))
        out.selection = selection
        shared.stream = out.stream[:, -W:].clone() if shared.stream is None else \
            torch.cat([shared.stream, out.stream], dim=1)[:, -W:].clone()
        shared.selection = selection.keep_last(shared.selection, W)
        shared.tokens.extend(tokens)
        return out

    # -- the verbs ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, state: ConversationState, tokens: list[int]) -> Tensor:
        """Encode new tokens through the adapter-free stage only (never the history again); returns H19 (n, C)."""
        tokens = self._check_tokens(state, tokens)
        h19 = []
        with self._rows([None]):
            for start in range(0, len(tokens), self.prefill_chunk):
                h19.append(self._run_shared(state, tokens[start: start + self.prefill_chunk]).h19[0])
        self.stats.prefilled_positions += len(tokens)
        return torch.cat(h19)

    @torch.inference_mode()
    def replay(self, state: ConversationState, adapter: str | None,
               capture: dict[int, list[Tensor]] | None = None) -> tuple[Tensor, int]:
        """Drop the adapter-bound windows and rebuild them over the last W positions under `adapter`.

        Returns the next-token logits (V,) and the number of positions replayed (min(W, context)). `capture`
        collects the replayed decoder layers' outputs (evaluation).
        """
        if state.length == 0:
            raise StateError("nothing to replay: the conversation is empty")
        self.adapters.slot_of(adapter)  # an unknown adapter fails here, before the state is touched
        shared, n = state.shared, min(self.config.window, state.length)
        windows = self.model.new_windows(self.config.adapter_bound_layers)
        selection = Selection(shared.selection.idx[:, -n:], shared.selection.valid[:, -n:])
        with self._rows([adapter]):
            logits = self._decoder_logits(state, shared.stream[:, -n:], state.length - n, selection, windows, capture)
        state.bound = AdapterState(adapter, windows, state.length, self.adapters.digest(adapter))
        self.stats.replayed_positions += n
        return logits, n

    @torch.inference_mode()
    def step(self, state: ConversationState, token: int, adapter: str | None) -> Tensor:
        """Append one token (both stages) under the adapter whose windows are current; returns logits (V,)."""
        tokens = self._check_tokens(state, [token])
        if state.bound.length != state.length or state.bound.adapter != adapter:
            raise StateError(f"the adapter-bound windows are for {state.bound.adapter!r} at length "
                             f"{state.bound.length}, not {adapter!r} at {state.length}: call replay first")
        if state.bound.digest != self.adapters.digest(adapter):
            raise StateError(f"adapter {adapter!r} now holds other weights than those its windows were built "
                             "with (replaced since): call replay first")
        with self._rows([adapter]):
            out = self._run_shared(state, tokens)
            logits = self._decoder_logits(state, out.stream, state.length - 1, out.selection, state.bound.windows)
        state.bound.length = state.length
        self.stats.decoded_tokens += 1
        return logits

    def turn(self, state: ConversationState, tokens: list[int], adapter: str | None) -> TurnResult:
        """A new user turn: prefill it, then bounded replay under `adapter` (a switch costs nothing more)."""
        self.adapters.slot_of(adapter)
        h19 = self.prefill(state, tokens)
        logits, replayed = self.replay(state, adapter)
        return TurnResult(logits, h19, replayed)

    def generate(self, state: ConversationState, adapter: str | None, logits: Tensor, max_tokens: int,
                 sampling: SamplingParams | None = None, stop_tokens: Iterable[int] = ()) -> Iterator[int]:
        """Sample from `logits`, append, repeat; each yielded token is already part of the state."""
        sampling = sampling or SamplingParams()
        if sampling.grammar is not None or sampling.logprobs is not None:
            raise ValueError("structured output and logprobs are served by the torch engine's scheduler only "
                             "(mol2 serve --engine torch)")
        stop, generated = set(stop_tokens) | set(sampling.stop_token_ids), []
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        for _ in range(max_tokens):
            if state.length >= self.config.max_context:
                return
            token = sample(logits, sampling, generator, state.shared.tokens, generated, stop)
            generated.append(token)
            logits = self.step(state, token, adapter)
            yield token
            if token in stop:
                return

    # -- evaluation and batches -----------------------------------------------------------------------------

    @torch.inference_mode()
    def oracle(self, tokens: list[int], adapter: str | None,
               capture: dict[int, list[Tensor]] | None = None) -> Tensor:
        """Recompute the whole context under `adapter` in one pass: logits (T, V). Evaluation only."""
        with self._rows([adapter]):
            return self.model(torch.tensor([tokens]), chunk_size=self.prefill_chunk, capture=capture).logits[0]

    @torch.inference_mode()
    def forward_batch(self, input_ids: Tensor, adapters: list[str | None]) -> Tensor:
        """One forward pass over rows (B, T), each under its own adapter (None = base): logits (B, T, V)."""
        if len(adapters) != input_ids.shape[0]:
            raise ValueError(f"{input_ids.shape[0]} rows but {len(adapters)} adapters")
        with self._rows(adapters):
            return self.model(input_ids, chunk_size=self.prefill_chunk).logits


def check_tokens(config, length: int, tokens: list[int]) -> list[int]:
    """Tokens that may join a context of `length`: ids in the vocabulary, within the context limit."""
    tokens = list(map(int, tokens))  # builtins, not comprehensions: a decode step checks its token on cold caches
    if not tokens:
        raise ValueError("no tokens given")
    if min(tokens) < 0 or max(tokens) >= config.vocab_size:
        bad = [t for t in tokens if not 0 <= t < config.vocab_size]
        raise ValueError(f"token ids {bad[:5]} out of range 0..{config.vocab_size - 1}")
    if length + len(tokens) > config.max_context:
        raise ContextTooLongError(f"context would reach {length + len(tokens)} tokens, over the configured "
                                  f"maximum of {config.max_context}")
    return tokens


def shaped_logits(logits: Tensor, sampling: SamplingParams, context: Sequence[int], generated: Sequence[int],
                  stop_ids: Collection[int]) -> Tensor:
    """The logits after the penalties (`context`: every token of the conversation so far, `generated`: this turn's
    output) and, before `min_tokens`, with `stop_ids` impossible. A copy; the input is untouched."""
    logits = logits.float().clone()
    if sampling.repetition_penalty != 1 and len(context):
        seen = torch.tensor(sorted(set(context)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / sampling.repetition_penalty,
                                   values * sampling.repetition_penalty)
    if (sampling.presence_penalty or sampling.frequency_penalty) and len(generated):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.numel())[:logits.numel()]
        logits -= sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0)
    stop_ids = sorted(token for token in stop_ids if token < logits.numel())  # an id past the vocabulary never comes
    if len(generated) < sampling.min_tokens and stop_ids:
        logits[torch.tensor(stop_ids, dtype=torch.long)] = -math.inf
    return logits


@dataclass
class TokenLogprobs:
    """A sampled token's log-probability and the likeliest alternatives, under the distribution it was drawn from."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), likeliest first


def sample(logits: Tensor, sampling: SamplingParams, generator: torch.Generator | None = None,
           context: Sequence[int] = (), generated: Sequence[int] = (), stop_ids: Collection[int] = ()) -> int:
    """The next token: greedy at temperature 0, else drawn after top-k, top-p and min-p. With penalties or
    `min_tokens` the logits are shaped first (shaped_logits), which needs the conversation's tokens."""
    if sampling.shapes_logits:
        logits = shaped_logits(logits, sampling, context, generated, stop_ids)
    if sampling.temperature == 0:
        return int(logits.argmax())
    return draw(_filtered(logits, sampling), generator)


def draw(probs: Tensor, generator: torch.Generator | None = None) -> int:
    """An index drawn with probability probs[i] / probs.sum(), by the inverse of the cumulative sum (one uniform
    number from `generator`): torch.multinomial takes ~230 us for one draw over the demo's 8K tokens on this CPU,
    this ~25, and a sampled row pays it every token."""
    cdf = probs.cumsum(0)
    u = torch.rand(1, generator=generator, dtype=cdf.dtype) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True))
    if index >= len(probs):  # u rounded up to the total: the last token that has any probability
        index = int(probs.nonzero()[-1])
    return index


def sample_with_logprobs(logits: Tensor, sampling: SamplingParams, top: int,
                         generator: torch.Generator | None = None, context: Sequence[int] = (),
                         generated: Sequence[int] = (), stop_ids: Collection[int] = ()) -> tuple[int, TokenLogprobs]:
    """`sample`'s token (the same draw from the same generator) and its TokenLogprobs with `top` alternatives, read
    from the distribution it was drawn from: after the penalties, the temperature and the filters (a filtered token's
    log-probability is -inf). Greedy (temperature 0) draws nothing: its distribution is the shaped logits' softmax."""
    if sampling.shapes_logits:
        logits = shaped_logits(logits, sampling, context, generated, stop_ids)
    if sampling.temperature == 0:
        logprobs = logits.float().log_softmax(-1)
        token = int(logits.argmax())
    else:
        probs = _filtered(logits, sampling)
        token = draw(probs, generator)
        logprobs = probs.log()
    values, ids = logprobs.topk(min(top, logprobs.numel()))
    return token, TokenLogprobs(token, float(logprobs[token]), list(zip(ids.tolist(), values.tolist())))


def _filtered(logits: Tensor, sampling: SamplingParams) -> Tensor:
    """The probabilities a token is drawn from at `sampling.temperature` (> 0), after min-p, top-k and top-p."""
    logits = logits.float()
    probs = ((logits - logits.max()) / sampling.temperature).softmax(-1)  # shifted: a tiny temperature stays finite
    if sampling.min_p:
        probs = torch.where(probs >= sampling.min_p * probs.max(), probs, torch.zeros_like(probs))
    if sampling.top_k:
        kth = probs.topk(min(sampling.top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > sampling.top_p * sorted_probs.sum()
        probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0))
    return probs / probs.sum()
