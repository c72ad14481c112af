"""The prefix cache shared across adapters, through the scheduler without a server: a history served under one
adapter and sent whole under another reuses its prefix and gives the tokens of a run without the cache; forks of
one history share its pages; a chat resent with its reply reuses the previous request's prompt; eviction keeps
the cache under its byte budget; a stateful conversation and a stateless request find each other's states; the same
prompt under the same adapter again skips the replay (its windows and logits are stored); an answer goes out before
its last token is appended, and a request sent on it still finds the end state."""

from __future__ import annotations

import pytest

from ced.batched import BatchedEngine
from ced.tokenization import ChatTokenizer
from python_backend.core.scheduler import Scheduler, Turn
from python_backend.core.routing import RouteDecision
from python_backend.core.store import ConversationStore

from test_scheduler import make_engine  # the scheduler tests' engine
from turn_sink import ListSink

HISTORY = "The quick brown fox jumps over the lazy dog, and then it naps under the old oak tree. " * 8  # ~700 tokens


def scheduler_for(served_dir, tmp_path, cache_bytes=1 << 30):
    engine = make_engine(served_dir)
    return Scheduler(BatchedEngine(engine), ConversationStore(tmp_path, engine.config),
                     ChatTokenizer(served_dir / "model"), lambda decision: decision.adapter, lambda: [],
                     prefill_chunk=128, token_budget=256, prefix_cache_bytes=cache_bytes)


def stateless(scheduler, messages, adapter, max_tokens=8):
    """One stateless request, run to its end: (tokens, the finished turn)."""
    sink = ListSink()
    prompt, route_start = scheduler.tokenizer.render(messages)
    decision = RouteDecision(adapter, 0)
    turn = Turn("", [], lambda pooled: decision, sink, max_tokens=max_tokens, explicit=True, prompt=prompt,
                route_start=route_start)
    scheduler.submit(turn)
    scheduler.drain()
    assert sink.done and sink.error is None, sink.error
    return sink.tokens, turn


def chat(*texts):
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(texts)]


@pytest.fixture()
def scheduler(served_dir, tmp_path):
    return scheduler_for(served_dir, tmp_path)


def test_a_history_served_under_one_adapter_serves_another_from_the_cache(scheduler, served_dir, tmp_path):
    messages = chat(HISTORY + "What does the fox do?")
    _, cold = stateless(scheduler, messages, "chat")
    assert cold.cached == 0 and cold.prompt_tokens == len(scheduler.tokenizer.render(messages)[0])
    tokens, warm = stateless(scheduler, messages, "coding")
    assert warm.cached == warm.prompt_tokens and warm.replayed > 0  # all from the cache, then W replayed
    reference, _ = stateless(scheduler_for(served_dir, tmp_path / "none", cache_bytes=0), messages, "coding")
    assert tokens == reference


def test_the_same_prompt_and_adapter_again_needs_no_replay(scheduler):
    messages = chat(HISTORY + "Where does it nap?")
    first, cold = stateless(scheduler, messages, "chat")
    again, warm = stateless(scheduler, messages, "chat")
    assert cold.replayed > 0 and warm.replayed == 0 and warm.cached == warm.prompt_tokens
    assert again == first  # the stored windows and logits are what the replay gave
    _, other = stateless(scheduler, messages, "coding")
    assert other.replayed > 0  # another adapter's windows are rebuilt


def test_forks_of_one_history_share_its_pages(scheduler):
    stateless(scheduler, chat(HISTORY + "Go on."), "chat", max_tokens=2)
    pool, before = scheduler.engine.pool, scheduler.residency.nbytes()
    held_before = [entry.row for entry in scheduler.residency.prefixes.entries.values()]
    _, one = stateless(scheduler, chat(HISTORY + "Go on.", "It slept.", "And then?"), "chat", max_tokens=2)
    _, two = stateless(scheduler, chat(HISTORY + "Go on.", "It ran.", "Where to?"), "coding", max_tokens=2)
    assert one.cached > 600 and two.cached == one.cached  # both started from the first request's prompt
    history_pages = one.cached // scheduler.engine.config.block_size // pool.page_entries
    entries = [entry.row for entry in scheduler.residency.prefixes.entries.values()]
    added = [row for row in entries if row not in held_before]
    for page in entries[0].pages[:history_pages]:
        assert all(page in row.pages for row in entries)  # one copy of the history, held by every entry
    old_pages = {page for row in held_before for page in row.pages}
    new_pages = {page for row in added for page in row.pages} - old_pages
    assert len(new_pages) <= 2 * len(added)  # only pages of the forks' own new tokens (each less than a page)
    assert scheduler.residency.nbytes() - before == len(added) * pool.slot_nbytes() + len(new_pages) * pool.page_nbytes()


def test_a_chat_resent_with_its_reply_reuses_the_previous_prompt(scheduler):
    first = chat("Tell me about foxes." * 4)
    reply, turn = stateless(scheduler, first, "chat")
    text = scheduler.tokenizer.decode(reply)
    _, second = stateless(scheduler, first + [{"role": "assistant", "content": text},
                                              {"role": "user", "content": "Thanks."}], "coding")
    assert second.cached >= turn.prompt_tokens


def test_eviction_keeps_the_cache_under_its_budget(served_dir, tmp_path):
    probe = scheduler_for(served_dir, tmp_path / "probe")
    stateless(probe, chat("a short question"), "chat", max_tokens=2)
    one_entry = max(probe.engine.pool.nbytes(entry.row) for entry in probe.residency.prefixes.entries.values())
    scheduler = scheduler_for(served_dir, tmp_path, cache_bytes=3 * one_entry)
    for n in range(5):
        stateless(scheduler, chat(f"question number {n} " * 3), "chat", max_tokens=2)
        assert scheduler.residency.nbytes() <= 3 * one_entry
    assert scheduler.residency.prefixes.stats.evicted >= 4 and 0 < len(scheduler.residency.prefixes) <= 3
    _, again = stateless(scheduler, chat("question number 0 " * 3), "chat", max_tokens=2)
    assert again.cached == 0  # the oldest were evicted


def test_a_stateful_conversation_and_a_stateless_request_find_each_others_states(scheduler):
    text = HISTORY + "Who naps?"
    _, warm = stateless(scheduler, chat(text), "chat")
    sink, decision = ListSink(), RouteDecision("coding", 0)
    stateful = Turn("c1", scheduler.tokenizer.encode(text), lambda pooled: decision, sink, max_tokens=4,
                    explicit=True, new=True)
    scheduler.submit(stateful)
    scheduler.drain()
    assert sink.done and stateful.cached == warm.prompt_tokens  # the new conversation started from the cache
    assert scheduler.store.length_of("c1") == stateful.row.length  # and its journal holds the whole history
    history = chat(text, scheduler.tokenizer.decode(sink.tokens), "More?")
    _, resent = stateless(scheduler, history, "chat")
    assert resent.cached >= stateful.row.length - 1  # the conversation's end state (its last token re-rendered)


def test_a_fork_outside_inference_mode_writes_buffers_grown_inside_it(scheduler):
    engine = scheduler.engine
    rows = [engine.open() for _ in range(engine.pool.n_slots)]
    engine.prefill(rows[0], [1, 2, 3])  # inference mode
    grown = engine.open()  # the pool doubles its slots here, outside inference mode
    engine.prefill(grown, list(range(1, 300)))  # pages grow inside inference mode
    copy = engine.fork(grown)  # outside: must still write the pool's buffers
    assert copy.tokens == grown.tokens and copy.pages[0] == grown.pages[0]


def test_an_answer_goes_out_before_its_last_token_is_appended_and_a_resend_on_it_finds_the_end_state(scheduler):
    """A stateless turn is answered when its last token is sampled, its row still to append it; a request sent on
    that answer (the prompt, the reply, more) is admitted after the appending step, so it starts from the end state
    that step cached: the prompt and the whole reply."""
    decision = RouteDecision("chat", 0)
    prompt, route_start = scheduler.tokenizer.render(chat("Tell me a story about a fox."))

    def request(tokens, sink, max_tokens):
        return Turn("", [], lambda pooled: decision, sink, max_tokens=max_tokens, explicit=True, prompt=tokens,
                    route_start=route_start)

    class SendsOnTheAnswer(ListSink):
        def finished(self, turn):
            super().finished(turn)
            self.row_still_decoding = turn in scheduler.decoding
            self.next = request(prompt + self.tokens + scheduler.tokenizer.encode(" And then?"), ListSink(), 2)
            scheduler.submit(self.next)

    answered = SendsOnTheAnswer()
    scheduler.submit(request(prompt, answered, 6))
    scheduler.drain()
    assert answered.done and answered.row_still_decoding and len(answered.tokens) == 6
    assert answered.next.sink.done and answered.next.cached == len(prompt) + 6
