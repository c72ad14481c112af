"""In-flight batching: one loop steps every active turn of a server together.

A turn moves through prefill (its new tokens through the adapter-free stage, in chunks of the engine's
`prefill_chunk`), route (an explicit adapter wins; otherwise the MoL2 head on the turn's pooled H19), replay (W
positions under the adapter: every turn, so a switch costs what a continue costs) and decode. Each iteration of
the loop runs one batched decode step for every decoding row (each under its own adapter), admits the turns that
arrived, then runs prefill chunks under a token budget (shortest remaining first, so a long prompt never holds
back a short one; chunks of similar lengths share one padded call), then one batched replay for the turns whose
prefill just ended, whose first tokens go out in the same iteration. Rows join and leave at token boundaries. A
turn that stores nothing is answered when its last token is sampled (`_answer_early`).

Conversations stay resident in the engine's pool between turns, beside the prefix cache's rows, both owned by
`Residency` (python_backend/core/residency.py) under one byte budget; the journal (ConversationStore) is the copy that
survives. A resident copy is trusted only while the journal is what this loop wrote (ConversationStore.reusable:
the same file, size and times, its last record checked again); a journal another process wrote since is read back,
and one damaged since is rewritten from the resident copy. A turn that fails or is cancelled stores nothing: its
resident copy is dropped, the journal still holds the turn before.

A handed turn (a disaggregated decode server's) arrives with the state another server prefilled and routed: it
enters at replay, decodes in the same batch as every other row, and its final state goes back to its sender, which
owns the store (or, with `returns_state` off, is stored here).

A stateless turn (a whole chat or prompt, the OpenAI API's way) names no conversation: it starts from the longest
prefix of its tokens in the prefix cache (ced/prefix_cache.py), whichever adapter wrote it, and leaves its states
there (at the end of its prompt and at its end), never in the journal. A new conversation starts from the cache
too, and each stateful turn's end state goes there, so the two paths find each other's states.

Everything here runs on the loop's thread; `submit` is the only entry from others.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch import Tensor

from ced import kernels
from ced.batched import BatchedEngine
from ced.engine import SamplingParams, TokenLogprobs, sample, sample_with_logprobs
from ced.paged import Resident
from ced.prefix_cache import CachedPrefix
from ced.state import ConversationState
from ced.tokenization import ChatTokenizer

from .inputs import RequestError
from .limits import check_context
from .routing import RouteDecision
from .residency import Residency
from .store import ConversationStore
from .structured import Grammars, RowGrammar

log = logging.getLogger(__name__)


class TurnSink(Protocol):
    """Where a turn's results go (the Triton model's response sender, or a test's list)."""

    def token(self, token: int, turn: "Turn") -> None: ...

    def finished(self, turn: "Turn") -> None: ...

    def failed(self, error: Exception, turn: "Turn") -> None: ...

    def cancelled(self) -> bool: ...


@dataclass
class Turn:
    conversation_id: str
    text_ids: list[int]
    route: Callable[[Tensor | None], RouteDecision]  # pooled H19 (None when explicit) -> the decision
    sink: TurnSink
    max_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False
    end_conversation: bool = False
    explicit: bool = False  # the client named the adapter: no H19 pooling needed
    new: bool = False  # a conversation this turn starts
    prompt: list[int] | None = None  # a stateless turn: its whole rendered chat or prompt (no conversation)
    route_start: int = 0  # the position where the turn the router pools begins
    handed: ConversationState | None = None  # prefilled and routed elsewhere (a decode server): enters at replay
    leaves_prefilled: bool = False  # a prefill server's turn: leaves after prefill with `final_state` and `pooled`
    returns_state: bool = False  # the state goes back to its sender (`final_state`), who holds the lock; nothing stored
    # progress, kept by the scheduler
    locked: bool = False  # holds the conversation's turn lock (taken when opened, released when it ends)
    row: Resident | None = None
    tokens: list[int] = field(default_factory=list)  # the templated turn to prefill
    prefilled: int = 0
    h19: list[Tensor] = field(default_factory=list)
    start_length: int = 0
    decision: RouteDecision | None = None
    adapter: str | None = None  # the engine's name (None = base)
    digest: str = ""
    replayed: int = 0
    generated: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled and sent, to be appended by the next step
    last: bool = False  # next_token is the turn's last
    generator: torch.Generator | None = None
    answered: bool = False  # its last response is out; the row stays until its last token is appended
    submitted: float = field(default_factory=time.perf_counter)
    bytes_written: int = 0
    bytes_moved: int = 0
    cached: int = 0  # tokens of the prompt taken from the prefix cache
    hit: CachedPrefix | None = None  # the cache entry they came from
    pooled: Tensor | None = None  # what the router was given
    finish_reason: str = ""  # "stop" (a stop token) or "length"
    final_state: ConversationState | None = None  # a handed turn's end state, when it returns it
    grammar: RowGrammar | None = None  # structured output: this row's matcher (from sampling.grammar, at its 1st token)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per generated token, when sampling.logprobs asks

    @property
    def stateless(self) -> bool:
        return self.prompt is not None

    @property
    def prompt_tokens(self) -> int:
        """The turn's prompt: what was prefilled now and what came from the cache."""
        return self.cached + len(self.tokens)


@dataclass
class SchedulerStats:
    iterations: int = 0
    decode_rows: int = 0  # summed over steps: / steps = mean batch
    decode_steps: int = 0
    prefill_tokens: int = 0
    prefill_calls: int = 0
    prefill_rows: int = 0  # summed over calls: / calls = mean rows a prefill call served
    replays: int = 0


class Scheduler:
    def __init__(self, engine: BatchedEngine, store: ConversationStore, tokenizer: ChatTokenizer,
                 engine_adapter: Callable[[RouteDecision], str | None], refresh: Callable[[], list[str]],
                 token_budget: int = 512, max_resident: int = 64, prefill_chunk: int = 256,
                 prefix_cache_bytes: int = 1 << 30, publish: Callable[[], None] = lambda: None):
        """`publish`: sends what the sinks were given so far (python_backend/core/engine_core.py's Outbox), called after
        each decode step and at the end of each iteration."""
        self.engine, self.store, self.tokenizer = engine, store, tokenizer
        self.publish = publish
        self._grammars: Grammars | None = None  # built at the first turn with a grammar (xgrammar loads in seconds)
        self.engine_adapter, self.refresh = engine_adapter, refresh
        self.token_budget, self.prefill_chunk = token_budget, prefill_chunk
        self.stats = SchedulerStats()
        self.incoming: queue.Queue[Turn] = queue.Queue()
        self.prefilling: list[Turn] = []
        self.decoding: list[Turn] = []
        self.answering: list[Turn] = []  # sampled their last token this iteration, answered at its end
        # the pool's rows between turns (idle conversations, cached prefixes) under one budget with the running ones
        self.residency = Residency(engine, prefix_cache_bytes, max_resident, live=lambda: [
            turn.row for turn in self.prefilling + self.decoding if turn.row is not None])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mol2-scheduler", daemon=True)
        self._last_expiry = time.monotonic()

    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.incoming.put(None)
        self._thread.join(timeout=30)

    def submit(self, turn: Turn) -> None:
        self.incoming.put(turn)

    @property
    def active(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    # -- the loop -------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.iterate(block=True)
            except Exception:  # a bug of ours: every active turn gets the error, the loop goes on
                log.exception("scheduler iteration failed")
                for turn in self.prefilling + self.decoding:
                    self._fail(turn, RuntimeError("the serving loop failed on this turn's batch (see the log)"))
                self.prefilling, self.decoding = [], []
            self.publish()

    def iterate(self, block: bool = False) -> None:
        """One iteration (tests call it directly): decode step, admit, prefill chunks, replay, early answers."""
        if not self.active:
            self._admit(block)
        if self._stop.is_set():
            return
        self._maybe_refresh()
        self._maybe_expire()
        self._drop_cancelled()
        self.stats.iterations += 1
        budget = self.token_budget
        if self.decoding:
            budget -= len(self.decoding)
            self._decode_step()
            self.publish()  # the step's tokens go out before this iteration's prefill chunks run
        self._admit(False)  # after the step: what it finished is in the prefix cache for these turns to find
        ready = self._prefill(budget)
        if ready:
            self._replay(ready)
        self._answer_early()

    def drain(self) -> None:
        """Run until nothing is left (tests)."""
        while self.active or not self.incoming.empty():
            self.iterate()

    # -- admission --------------------------------------------------------------------------------------------------

    def _admit(self, block: bool) -> None:
        """Open the turns queued now (waiting for one first when `block`). Turns that arrive while these open wait
        for the next iteration: a burst that trickles in (a request every few ms, each parsed in turn by Triton)
        starts decoding as it comes, instead of the first arrivals waiting until the last is in."""
        waiting = self.incoming.qsize()
        if block and not waiting:
            waiting = 1
        taken = []
        for _ in range(waiting):
            try:
                turn = self.incoming.get(timeout=0.5) if block else self.incoming.get_nowait()
            except queue.Empty:
                break
            if turn is None:
                break
            block = False
            taken.append(turn)
        if not taken:
            return
        # Each was parsed against the adapter set of its arrival, which may be newer than the set the engine last
        # took: take it now, before any of them is routed (else a just-loaded adapter is "not loaded").
        self._maybe_refresh()
        for turn in taken:
            try:
                self._open(turn)
                self.prefilling.append(turn)
            except Exception as error:  # noqa: BLE001 - the turn is refused, the loop goes on
                self._fail(turn, error)

    def _open(self, turn: Turn) -> None:
        if not (turn.stateless or turn.returns_state):  # the lock is ours (a returned state's is its sender's)
            self.store.begin_turn(turn.conversation_id)  # a second turn on it is refused until this one ends
            turn.locked = True
        if turn.sampling.seed is not None:
            turn.generator = torch.Generator().manual_seed(turn.sampling.seed)
        if turn.handed is not None:  # nothing to prefill: straight to route (the decision came with it) and replay
            turn.row = self.engine.open(turn.handed)
            turn.start_length, turn.tokens = turn.row.length, []
            return
        bos = 1 if self.tokenizer.trained else 0  # the router pools the user's turn less <|bos|>, as it was trained
        if turn.stateless or turn.new:  # the whole sequence is known: start from its longest cached prefix
            whole = turn.prompt if turn.stateless else self.tokenizer.user_turn(turn.text_ids, first=True)
            self.store.limits.check_prompt(len(whole))  # max_prompt_tokens (python_backend/core/limits.py)
            row = self._cached_row(turn, whole)
            turn.tokens = whole[row.length:]
            if turn.new:
                turn.route_start = bos
        else:
            row = self._resident_row(turn)
            turn.tokens = self.tokenizer.user_turn(turn.text_ids, first=row.length == 0)
            turn.route_start = row.length + (bos if row.length == 0 else 0)
        turn.row, turn.start_length = row, row.length
        if not (turn.stateless or turn.new):
            self.store.limits.check_prompt(len(turn.tokens))
        check_context(row.length, len(turn.tokens), self.engine.config.max_context)

    def _resident_row(self, turn: Turn) -> Resident:
        """The conversation in the pool, read back from the journal when the pool's copy is missing or stale."""
        cid = turn.conversation_id
        held = self.residency.take(cid)
        if held is not None:
            row, written = held
            try:
                if self.store.reusable(cid, written, lambda: self.engine.delta(row, 0)):
                    return row
            except BaseException:  # could not repair the journal (a full disk): the copy is kept for the next try
                self.residency.keep(cid, row, written)
                raise
            self.engine.close(row)
        state = self.store.load(cid)  # raises UnknownConversation / StoreError with the client's message
        row = self.engine.open(state)
        turn.bytes_moved += self.engine.nbytes(row)  # a miss reads the whole state once
        return row

    def _cached_row(self, turn: Turn, tokens: list[int]) -> Resident:
        """A fork of the longest cached prefix of `tokens`, or an empty row. A routed turn needs H19 of its own
        turn: a prefix covering all of it serves only if the router's pooled H19 was stored with it."""
        hit = self.residency.lookup(tokens)
        if hit is not None and hit.row.length == len(tokens) and not turn.explicit and hit.pooled is None:
            hit = self.residency.lookup(tokens, longest=len(tokens) - 1)
        if hit is None:
            return self.engine.open()
        turn.cached, turn.hit = hit.row.length, hit
        return self.engine.fork(hit.row, keep_bound=hit.row.length == len(tokens))

    # -- the three kinds of work ---------------------------------------------------------------------------------

    def _prefill(self, budget: int) -> list[Turn]:
        """Prefill chunks under the token budget, in rounds: each unfinished turn, shortest remaining first, adds
        its next chunk while the budget lasts (the first always goes), and the round's chunks run batched."""
        ready = [turn for turn in self.prefilling if turn.prefilled == len(turn.tokens)]  # all of it was cached
        for turn in ready:
            self.prefilling.remove(turn)
        spent = 0
        while not spent or spent < budget:
            round_ = []
            for turn in sorted(self.prefilling, key=lambda t: len(t.tokens) - t.prefilled):
                chunk = turn.tokens[turn.prefilled: turn.prefilled + self.prefill_chunk]
                if turn.prefilled >= len(turn.tokens) or spent and spent + len(chunk) > budget:
                    continue
                round_.append((turn, chunk))
                spent += len(chunk)
            if not round_:
                break
            for group in _similar_lengths(round_):
                self._prefill_group(group)
            for turn, _ in round_:
                if turn in self.prefilling and turn.prefilled == len(turn.tokens):
                    ready.append(turn)
                    self.prefilling.remove(turn)
        self.stats.prefill_tokens += spent
        routed = []
        for turn in ready:
            try:
                if turn.leaves_prefilled:
                    self._leave_prefilled(turn)
                    continue
                self._route(turn)
                routed.append(turn)
            except Exception as error:  # noqa: BLE001
                self._fail(turn, error)
        return routed

    def _prefill_group(self, group: list[tuple[Turn, list[int]]]) -> None:
        """One batched call for chunks of similar lengths; a turn whose chunk is refused fails alone."""
        runnable = []
        for turn, chunk in group:
            try:
                self.engine.check(turn.row, chunk)  # e.g. an id outside the vocabulary
                runnable.append((turn, chunk))
            except Exception as error:  # noqa: BLE001
                self._fail(turn, error)
        if not runnable:
            return
        try:
            h19 = self.engine.prefill_rows([turn.row for turn, _ in runnable], [chunk for _, chunk in runnable])
        except Exception as error:  # noqa: BLE001 - these rows may be part-written: their turns fail
            for turn, _ in runnable:
                self._fail(turn, error)
            return
        self.stats.prefill_calls += 1
        self.stats.prefill_rows += len(runnable)
        for (turn, chunk), rows in zip(runnable, h19):
            turn.h19.append(rows)
            turn.prefilled += len(chunk)

    def _leave_prefilled(self, turn: Turn) -> None:
        """A prefill server's turn ends here: the router and the decoder run elsewhere, on what it hands on."""
        turn.pooled, turn.h19 = self._pooled(turn), []
        turn.final_state = self.engine.export(turn.row)
        self.engine.close(turn.row)
        turn.row = None
        self._release(turn)
        turn.sink.finished(turn)

    def _route(self, turn: Turn) -> None:
        pooled = None
        if not turn.explicit:
            pooled = turn.pooled = self._pooled(turn)
        turn.h19 = []
        turn.decision = turn.route(pooled)
        turn.adapter = self.engine_adapter(turn.decision)
        turn.digest = self.engine.adapters.digest(turn.adapter)

    def _pooled(self, turn: Turn) -> Tensor:
        """The router's input: H19 of the turn's own tokens (from route_start), averaged."""
        skip = turn.route_start - turn.start_length  # H19 rows of this call before the turn
        if skip >= 0:
            return torch.cat(turn.h19)[skip:].mean(0)
        if not turn.h19:  # all of it came from the cache, with the pooled H19 stored beside it
            return turn.hit.pooled
        return torch.cat(turn.h19).mean(0)  # its start came from the cache: the router sees the rest

    def _replay(self, turns: list[Turn]) -> None:
        for turn in [t for t in turns if self._replayed_already(t)]:  # the cache holds this very replay's result
            turns.remove(turn)
            self.decoding.append(turn)
            self._next(turn, turn.hit.logits)
        if not turns:
            return
        try:
            logits, counts = self.engine.replay([t.row for t in turns], [t.adapter for t in turns])
        except Exception as error:  # noqa: BLE001 - e.g. an adapter unloaded since routing: these turns fail
            for turn in turns:
                self._fail(turn, error)
            return
        self.stats.replays += len(turns)
        for turn, row_logits, count in zip(turns, logits, counts):
            turn.replayed = count
            self.decoding.append(turn)
            self._next(turn, row_logits)  # every first token is on its way before the cache's copies are made
        for turn, row_logits in zip(turns, logits):
            # The prompt's end, the adapter's windows and next-token logits: what a resend will match. The row is
            # as the replay left it (the sampled token is appended by the next step), unless the turn has just
            # finished at the context limit (its end state went to the cache then).
            resend = turn.stateless or turn.new
            if turn.tokens and resend and self.residency.caches_prefixes and turn in self.decoding:
                self.residency.keep_prefix(self.engine.fork(turn.row, keep_bound=True), turn.pooled,
                                           row_logits.clone(), turn.digest)

    def _replayed_already(self, turn: Turn) -> bool:
        """A stateless prompt found whole in the cache with its adapter's windows current and the logits they gave:
        the replay would rebuild exactly those windows, so it is skipped (an adapter reloaded since has another
        digest). A conversation's turn always replays W, as the seed does (and says so in `replayed_tokens`)."""
        hit, row = turn.hit, turn.row
        return (turn.stateless and not turn.tokens and hit is not None and hit.logits is not None and hit.digest == turn.digest
                and row.bound_adapter == turn.adapter and row.bound_length == row.length)

    def _decode_step(self) -> None:
        self.decoding.sort(key=lambda turn: turn.row.slot)  # the step's own order (settled slots): no reordering
        rows = list(self.decoding)
        logits = self.engine.step([t.row for t in rows], [t.next_token for t in rows], [t.adapter for t in rows])
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(rows)
        most_likely = kernels.argmax_rows(logits)  # one call for every greedy row
        for i, (turn, best) in enumerate(zip(rows, most_likely)):
            if turn.last:
                self._finish(turn)
            else:  # a plain greedy turn's token is its argmax: no view of its row (a torch call each) is made
                self._next(turn, None if turn.sampling.plain_greedy else logits[i], best)

    def _next(self, turn: Turn, logits: Tensor | None, most_likely: int | None = None) -> None:
        """Sample the turn's next token and send it; it is appended by the next step (as CEDEngine.generate).
        `most_likely`: the logits' argmax where the caller has it, the token of a plain greedy turn (whose
        `logits` may then be None)."""
        if len(turn.generated) >= turn.max_tokens or turn.row.length >= self.engine.config.max_context:
            turn.finish_reason = "length"
            self._finish(turn)
            return
        stops, sampling = turn.sampling.stop_token_ids, turn.sampling
        try:
            if sampling.grammar is not None:
                turn.grammar = turn.grammar or self.grammars.matcher(sampling.grammar)
                left = min(turn.max_tokens - len(turn.generated), self.engine.config.max_context - turn.row.length)
                if sampling.greedy:  # the most likely token it allows, no masked copy
                    most_likely = turn.grammar.greedy(logits, left)
                else:  # a copy of the logits, what the grammar forbids at -inf
                    logits = turn.grammar.mask(logits, left)
            history = ()
            if sampling.shapes_logits:  # penalties or min_tokens: they read the conversation's tokens
                eos = () if turn.ignore_eos else self.tokenizer.stop_ids
                history = (turn.row.tokens, turn.generated, set(eos) | set(stops))
            if most_likely is not None and sampling.greedy:
                token = most_likely
            elif sampling.logprobs is None:
                token = sample(logits, sampling, turn.generator, *history)
            else:
                token, logprobs = sample_with_logprobs(logits, sampling, sampling.logprobs, turn.generator, *history)
                turn.logprobs.append(logprobs)
            if turn.grammar is not None:
                turn.grammar.accept(token)
        except Exception as error:  # noqa: BLE001 - this row's grammar failed: the turn fails, the batch goes on
            self._fail(turn, error)
            return
        turn.generated.append(token)
        turn.next_token = token
        stop = token in stops or token in self.tokenizer.stop_ids and not turn.ignore_eos
        stop = stop or turn.grammar is not None and turn.grammar.done  # complete: nothing but a stop token could follow
        turn.last = stop or len(turn.generated) >= turn.max_tokens
        if turn.last:
            turn.finish_reason = "stop" if stop else "length"
            if (turn.stateless or turn.end_conversation) and turn.handed is None:
                self.answering.append(turn)
        turn.sink.token(token, turn)

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.engine.config.vocab_size)
        return self._grammars

    # -- the end of a turn ---------------------------------------------------------------------------------------------

    def _answer_early(self) -> None:
        """A turn that stores nothing (stateless, or ending its conversation) is answered as soon as its last token
        is sampled, a step and its end sooner: the step that appends the token only serves the prefix cache. The
        answers go out at the end of the iteration, after its admissions: a client's next request, sent on the
        answer, is admitted after the next step, and so finds the end state that step puts in the cache."""
        for turn in self.answering:
            if turn not in self.decoding:  # failed or cancelled since
                continue
            try:
                if turn.end_conversation and not turn.stateless:
                    self.store.delete(turn.conversation_id)
            except Exception as error:  # noqa: BLE001 - not deleted: the client must not think it was
                self._fail(turn, error)
                continue
            self._release(turn)
            turn.answered = True
            turn.sink.finished(turn)
        self.answering = []

    def _finish(self, turn: Turn) -> None:
        self.decoding.remove(turn)
        cid = turn.conversation_id
        if turn.handed is not None:
            self._finish_handed(turn)
            return
        if turn.answered:
            self._keep_end_state(turn.row)
            return
        if turn.stateless:
            self._keep_end_state(turn.row)
            turn.sink.finished(turn)
            return
        try:
            if turn.end_conversation:
                self.store.delete(cid)
                self._keep_end_state(turn.row)
            else:
                before = self.store.bytes_written
                row, since = turn.row, 0 if turn.new else turn.start_length  # a new one's cached prefix too
                self.store.append(cid, self.engine.delta(row, since), lambda: self.engine.delta(row, 0))
                turn.bytes_written = self.store.bytes_written - before
                if self.residency.caches_prefixes:
                    self.residency.keep_prefix(self.engine.fork(row))
                self.residency.keep(cid, turn.row, self.store.identity(cid))
        except Exception as error:  # noqa: BLE001 - not stored: the client must not think it was
            self.residency.take(cid)  # the row, if kept already, is closed here
            self.engine.close(turn.row)
            self._release(turn)
            turn.sink.failed(error, turn)
            return
        self._release(turn)
        turn.sink.finished(turn)

    def _finish_handed(self, turn: Turn) -> None:
        """A decode server's turn: its end state goes back to the sender (or is stored here); the row is freed."""
        try:
            if turn.returns_state:  # the sender keeps it; the last turn of a conversation wants nothing back
                turn.final_state = None if turn.end_conversation else self.engine.export(turn.row)
            else:
                self.store.commit(turn.conversation_id, self.engine.export(turn.row), turn.end_conversation)
        except Exception as error:  # noqa: BLE001 - not returned or stored: the client must not think it was
            self._fail(turn, error)
            return
        self.engine.close(turn.row)
        turn.row = None
        self._release(turn)
        turn.sink.finished(turn)

    def _fail(self, turn: Turn, error: Exception) -> None:
        for active in (self.prefilling, self.decoding):
            if turn in active:
                active.remove(turn)
        if turn.row is not None:  # the resident copy holds part of the failed turn: the journal's is the good one
            self.residency.take(turn.conversation_id)
            self.engine.close(turn.row)
            turn.row = None
        if turn.answered:  # released and answered: only its row (and the prefix cache's copy of it) is lost
            return
        self._release(turn)
        turn.sink.failed(error, turn)

    def _release(self, turn: Turn) -> None:
        if turn.locked:
            turn.locked = False
            self.store.end_turn(turn.conversation_id)

    def _keep_end_state(self, row: Resident) -> None:
        """An ended conversation's state: into the prefix cache (a client may send its history whole), or freed."""
        self.residency.keep_prefix(row)

    def _drop_cancelled(self) -> None:
        for turn in [t for t in self.prefilling + self.decoding if not t.answered and t.sink.cancelled()]:
            self._fail(turn, CancelledTurn("cancelled by the client"))

    def _maybe_expire(self, every_s: float = 60.0) -> None:
        """Idle conversations past the store's timeout end, in the journal and in the pool."""
        now = time.monotonic()
        if now - self._last_expiry < every_s:
            return
        self._last_expiry = now
        for cid in self.store.expire():
            self.residency.drop(cid)
            log.info("conversation %s expired", cid)

    def _maybe_refresh(self) -> None:
        """Take a changed adapter-set file between steps; a decoding row whose adapter changed under it stops."""
        changes = self.refresh()
        if not changes:
            return
        log.info("adapter set changed: %s", "; ".join(changes))
        for turn in list(self.decoding):
            try:
                current = self.engine.adapters.digest(turn.adapter)
            except ValueError:
                current = None
            if current != turn.digest:
                self._fail(turn, RequestError(f"adapter {turn.adapter!r} was changed during this turn; "
                                              "send the turn again"))


class CancelledTurn(Exception):
    pass


def _similar_lengths(chunks: list[tuple[Turn, list[int]]]) -> list[list[tuple[Turn, list[int]]]]:
    """Chunks in groups that one padded call serves without much waste: each at most twice its group's shortest
    (a 256-token chunk of a long prompt does not make twenty short prompts compute 256 positions each)."""
    groups: list[list[tuple[Turn, list[int]]]] = []
    for turn, chunk in sorted(chunks, key=lambda item: len(item[1])):
        if groups and len(chunk) <= 2 * len(groups[-1][0][1]):
            groups[-1].append((turn, chunk))
        else:
            groups.append([(turn, chunk)])
    return groups
