"""The serving engine of the `deepseek_v41` family, with `ced.engine.CEDEngine`'s interface and semantics, so the
server's scheduler drives it through `ced.row_engine.RowEngine` (one conversation per call) as it drives the ced
family's exported graphs.

A turn is `prefill` (the new tokens through the adapter-free shared stage: layers 0..E-1 and layer E's attention;
never the history again), `replay` (layer E's FFN and layers E+1..L-1 over the last W positions under the turn's
adapter: a switch costs what a continue costs), then one `step` per token; `step_rows` steps many conversations,
each under its own adapter, in one pass of the model (ced.deepseek_v41.batch). Each call selects its adapter for that
call only, so consecutive calls on different conversations may name different adapters. The arithmetic is the
reference serial path's (`V41Conversation`), on the state the server stores (`V41ConversationState`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor

from .. import kernels
from ..cpu_share import FreeCpus
from ..engine import CEDEngine, EngineStats, StateError, check_tokens
from ..state import Selection
from .adapters import V41AdapterRegistry, V41AdapterSet
from .batch import step_rows
from .model import DeepseekV41ForCausalLM, SharedOutput
from .native import V41Plan
from .state import V41AdapterState, V41ConversationState, empty_state


class FreshRows:
    """Tensors of `width` floats, each handed out once, made BLOCK at a time: after a decode step's kernel call a
    torch.empty of its logits costs ~12 us on the caches the call left (a one-row V4.1 step ~2.5 %); a block's rows
    are views that keep it alive, so a caller may keep one as long as it likes (at most a block's bytes held)."""

    BLOCK = 16

    def __init__(self, width: int):
        self.width, self._rows = width, []

    def take(self) -> Tensor:
        if not self._rows:
            self._rows = list(torch.empty(self.BLOCK, self.width).unbind(0))
        return self._rows.pop()


class V41Engine:
    def __init__(self, model: DeepseekV41ForCausalLM, max_adapters: int = 8, max_rank: int = 16,
                 prefill_chunk: int = 256):
        self.model = model.eval()
        self.config = model.config
        self.prefill_chunk = prefill_chunk
        self.adapter_set = V41AdapterSet(model)  # wraps every module the placement rule allows
        self.adapters = V41AdapterRegistry(self.adapter_set, max_adapters, max_rank)
        self.native = V41Plan(model, self.adapter_set)  # decode steps in one native call where it can take them
        self.free_cpus = FreeCpus()  # the kernels' second thread runs where others leave a CPU free
        self._logits = FreshRows(self.config.vocab_size)  # a one-row step's logits
        self.stats = EngineStats()

    # -- conversations --------------------------------------------------------------------------------------

    def new_conversation(self) -> V41ConversationState:
        return empty_state(self.config)

    @contextmanager
    def _using(self, adapter: str | None) -> Iterator[None]:
        """`adapter` in every wrapped module for this call only (an unknown name fails before any work)."""
        self.adapters.slot_of(adapter)
        self.adapter_set.use(adapter)
        try:
            yield
        finally:
            self.adapter_set.use(None)

    def _shared_stage(self, state: V41ConversationState, tokens: list[int]) -> SharedOutput:
        """The adapter-free stage over `tokens` at the end of the context; appends to the shared state."""
        shared = state.shared
        ids = torch.tensor([tokens], device=self.model.embed.weight.device)  # (1, T)
        out = self.model.run_shared(ids, shared.length, shared.windows, shared.stores)
        shared.keep(out.stream, out.pre, out.selection, out.pool)
        shared.tokens.extend(tokens)
        return out

    # -- the verbs ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, state: V41ConversationState, tokens: list[int]) -> Tensor:
        """Encode new tokens through the adapter-free stage only; returns H19 (n, C), the last encoder layer's
        streams pooled over the mHC axis (mean of the hc_mult streams): what the router reads."""
        tokens = check_tokens(self.config, state.length, tokens)
        h19 = []
        with self._using(None), kernels.step_threads(self.free_cpus, len(self.free_cpus.cpus)):
            for start in range(0, len(tokens), self.prefill_chunk):
                chunk = tokens[start: start + self.prefill_chunk]
                native = self.native.prefill(state, chunk)
                h19.append(native if native is not None else self._shared_stage(state, chunk).h19[0].mean(dim=1))
        self.stats.prefilled_positions += len(tokens)
        return torch.cat(h19)

    @torch.inference_mode()
    def replay(self, state: V41ConversationState, adapter: str | None) -> tuple[Tensor, int]:
        """Drop the adapter-bound windows and rebuild them over the last W positions under `adapter`. Returns the
        next-token logits (V,) and the number of positions replayed (min(W, context))."""
        if state.length == 0:
            raise StateError("nothing to replay: the conversation is empty")
        self.adapters.slot_of(adapter)  # an unknown adapter fails here, before the state is touched
        shared, n = state.shared, min(self.config.sliding_window, state.length)
        with kernels.step_threads(self.free_cpus, len(self.free_cpus.cpus)):
            native = self.native.replay(state, adapter, n)
        if native is not None:
            logits, windows = native
        else:
            last = lambda c: None if c is None else Selection(c.idx[:, -n:], c.valid[:, -n:])  # noqa: E731
            out = SharedOutput(None, shared.stream[:, -n:], shared.pre[:, -n:], last(shared.selection),
                               last(shared.pool))
            windows = self.model.new_windows(self.config.adapter_bound_layers)
            with self._using(adapter):
                hidden = self.model.run_decoder(out, state.length - n, windows, shared.stores, last_only=True)
                logits = self.model.logits(hidden)[0, -1]
        state.bound = V41AdapterState(adapter, windows, state.length, self.adapters.digest(adapter))
        self.stats.replayed_positions += n
        return logits, n

    def _check_step(self, state: V41ConversationState, token: int, adapter: str | None) -> list[int]:
        """What a step of `token` under `adapter` needs: a token in range, the adapter-bound windows current."""
        tokens = check_tokens(self.config, state.length, [token])
        bound = state.bound
        if bound.length != state.length or bound.adapter != adapter:
            raise StateError(f"the adapter-bound windows are for {bound.adapter!r} at length {bound.length}, not "
                             f"{adapter!r} at {state.length}: call replay first")
        if bound.digest != self.adapters.digest(adapter):
            raise StateError(f"adapter {adapter!r} now holds other weights than those its windows were built with "
                             "(replaced since, or never built): call replay first")
        return tokens

    # step and step_rows enter inference mode only for torch's path: the native call writes the state's buffers in
    # place outside autograd, and entering and leaving it costs a decode step ~25 us on the caches a step leaves.

    def step(self, state: V41ConversationState, token: int, adapter: str | None) -> Tensor:
        """Append one token (both stages) under the adapter whose windows are current; returns logits (V,)."""
        tokens = self._check_step(state, token, adapter)
        # One row on one thread: its largest product (the head) is the only one worth sharing, and waking the
        # kernels' second thread for it costs more than it saves (this machine, 2,048-token context, one row a
        # step, 64 steps in turn 8 times: 0.714 ms a step on two threads, 0.643 on one). step_rows shares as before.
        logits = self.native.step([state], tokens, [adapter], self._logits.take())
        if logits is None:
            logits = self._torch_step(state, tokens, adapter)
        state.bound.length = state.length
        self.stats.decoded_tokens += 1
        return logits

    @torch.inference_mode()
    def _torch_step(self, state: V41ConversationState, tokens: list[int], adapter: str | None) -> Tensor:
        with self._using(adapter):
            out = self._shared_stage(state, tokens)
            hidden = self.model.run_decoder(out, state.length - 1, state.bound.windows, state.shared.stores)
            return self.model.logits(hidden)[0, -1]

    def step_rows(self, states: list[V41ConversationState], tokens: list[int],
                  adapters: list[str | None]) -> Tensor:
        """`step` of every row in one pass of the model, each under its own adapter: logits (B, V). Every row is
        checked before any is touched; each row's logits equal its own `step`'s within float tolerance."""
        if len({id(state) for state in states}) != len(states):
            raise StateError("a conversation appears twice in one step")
        for adapter in adapters:
            self.adapters.slot_of(adapter)  # an unknown adapter is named as such, before any row is touched
        for state, token, adapter in zip(states, tokens, adapters, strict=True):
            self._check_step(state, token, adapter)
        with kernels.step_threads(self.free_cpus, len(self.free_cpus.cpus)):
            logits = self.native.step(states, tokens, adapters)  # (B, V)
        if logits is None:
            with torch.inference_mode(), self.adapter_set.use_rows(adapters):
                logits = self.model.logits(step_rows(self.model, states, tokens))[:, -1]
        for state in states:
            state.bound.length = state.length
        self.stats.decoded_tokens += len(states)
        return logits

    # CEDEngine's own: they need only prefill, replay, step, adapters, config.max_context and state.shared.tokens
    turn = CEDEngine.turn
    generate = CEDEngine.generate

    @torch.inference_mode()
    def oracle(self, tokens: list[int], adapter: str | None) -> Tensor:
        """Recompute the whole context under `adapter` in one pass: logits (T, V). Evaluation only."""
        ids = torch.tensor([tokens], device=self.model.embed.weight.device)
        with self._using(adapter):
            return self.model(ids, chunk_size=self.prefill_chunk)[0]
