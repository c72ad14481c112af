"""V41Engine (ced/deepseek_v41/engine.py) serves the deepseek_v41 family with CEDEngine's interface: its logits are the
reference serial path's bit for bit, a target's turn is the same whichever adapter wrote the history, the family's
state operations (empty_state, copy_state, delta_of, apply_delta) rebuild a state bit for bit with deltas that do not
grow with the history, stale windows are refused, and the server's parts drive it: RowEngine, the conversation store's
journal and the scheduler's loop."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ced import kernels
from ced.adapters import AdapterError, PlacementError, UnknownAdapterError
from ced.deepseek_v41.conversation import V41Conversation
from ced.deepseek_v41.engine import FreshRows, V41Engine
from ced.deepseek_v41.model import DeepseekV41ForCausalLM
from ced.deepseek_v41.state import apply_delta, copy_state, delta_of, empty_state
from ced.engine import ContextTooLongError, StateError
from ced.row_engine import RowEngine
from ced.state import DeltaError

from turn_sink import ListSink

SOURCES = [None, "all", "experts"]


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def engine(tmp_path, tiny_v41, random_adapter) -> V41Engine:
    """v41-tiny (W=8) with two adapters on native names: "all" (every allowed module, routed experts included)
    and "experts" (routed experts only). A new one per test (milliseconds): tests load and replace adapters."""
    engine = V41Engine(DeepseekV41ForCausalLM.from_config(tiny_v41, seed=0), max_adapters=3, max_rank=8)
    for seed, (name, include) in enumerate([("all", lambda n: True), ("experts", lambda n: ".experts." in n)]):
        path = random_adapter(tmp_path / name, engine.adapter_set.modules, include, seed=seed + 1)
        engine.adapters.load(name, path)
    return engine


def shared_tensors(state) -> dict:
    """Every tensor of the adapter-free state by a name of this test's own (None where a part is empty)."""
    shared = state.shared
    parts = {f"window.{i}": w.kv for i, w in shared.windows.items()}
    for i, store in shared.stores.items():
        parts |= {f"{i}.latent": store.latent, f"{i}.index_keys": store.index_keys, f"{i}.pending": store.pending}
    parts |= {"stream": shared.stream, "pre": shared.pre}
    for name in ("selection", "pool"):
        choice = getattr(shared, name)
        parts |= {f"{name}.idx": choice and choice.idx, f"{name}.valid": choice and choice.valid}
    return parts


def assert_same_shared(a, b) -> None:
    assert a.shared.tokens == b.shared.tokens
    ours, theirs = shared_tensors(a), shared_tensors(b)
    for name, tensor in ours.items():
        other = theirs[name]
        assert (tensor is None) == (other is None), name
        assert tensor is None or (tensor.dtype == other.dtype and torch.equal(tensor, other)), name


def write_history(engine, history: list[int], adapter):
    """A conversation whose first token is prefilled and replayed, every later one stepped, under `adapter`."""
    state = engine.new_conversation()
    engine.prefill(state, history[:1])
    engine.replay(state, adapter)
    for token in history[1:]:
        engine.step(state, token, adapter)
    return state


def test_prefill_replay_and_step_give_the_reference_paths_logits_bitwise(engine, tiny_v41):
    """With the native kernels off the engine's steps are the reference path's torch arithmetic, bit for bit (the
    native step agrees with it within float tolerance: tests/v41/test_batched_step.py)."""
    assert engine.config.max_context == tiny_v41.max_position_embeddings and engine.config.window == 8
    first, second, steps = tokens(0, 13), tokens(1, 5), tokens(2, 3)
    state, reference = engine.new_conversation(), V41Conversation(engine.model)
    try:
        with kernels.turned_off():
            for prompt, adapter in ((first, "all"), (second, "experts")):  # the second turn switches adapter
                h19 = engine.prefill(state, prompt)
                length = state.length
                logits, replayed = engine.replay(state, adapter)
                ours = [logits] + [engine.step(state, token, adapter) for token in steps]
                engine.adapter_set.use(adapter)  # the reference path takes its adapter from outside
                expected_h19 = reference.prefill(prompt).h19[0].mean(dim=1)  # pooled over the mHC streams
                theirs = [reference.replay(adapter)] + [reference.step(token, adapter) for token in steps]
                assert h19.shape == (len(prompt), tiny_v41.hidden_size) and torch.equal(h19, expected_h19)
                assert replayed == min(tiny_v41.sliding_window, length)
                assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    finally:
        engine.adapter_set.use(None)
    assert_same_shared(state, reference)
    assert all(torch.equal(reference.bound.windows[i].kv, w.kv) for i, w in state.bound.windows.items())


def test_a_long_prompt_is_prefilled_in_chunks_as_the_reference_path_takes_them(engine):
    """Torch's arithmetic (the kernels off) bit for bit; the native chunks: tests/v41/test_native_chunks.py."""
    engine.prefill_chunk, prompt = 5, tokens(14, 17)
    state, reference = engine.new_conversation(), V41Conversation(engine.model)
    with kernels.turned_off():
        h19 = engine.prefill(state, prompt)
        expected = torch.cat([reference.prefill(prompt[i: i + 5]).h19[0].mean(dim=1) for i in range(0, 17, 5)])
    assert torch.equal(h19, expected) and engine.stats.prefilled_positions == 17
    assert_same_shared(state, reference)


def test_each_call_uses_its_adapter_for_that_call_only(engine):
    state = engine.new_conversation()
    engine.prefill(state, tokens(3, 6))
    engine.replay(state, "all")
    assert all(module.active is None for module in engine.adapter_set.modules.values())
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'nope'"):
        engine.replay(state, "nope")
    assert state.bound.adapter == "all" and state.bound.length == state.length  # untouched by the refusal


def test_a_turn_is_bitwise_the_same_whichever_adapter_wrote_the_history(engine):
    history, new_turn, continuation = tokens(4, 12), tokens(5, 5), tokens(6, 2)
    written = {source: write_history(engine, history, source) for source in SOURCES}
    bound = {s: torch.cat([w.kv.flatten() for w in written[s].bound.windows.values()]) for s in SOURCES}
    assert all(a == b or not torch.equal(bound[a], bound[b]) for a in SOURCES for b in SOURCES)  # they differ
    firsts = {}
    for target in ("all", "experts"):
        runs = {}
        for source in SOURCES:
            state = copy_state(written[source])
            engine.prefill(state, new_turn)
            runs[source] = [engine.replay(state, target)[0]] + [engine.step(state, t, target) for t in continuation]
        for source in SOURCES[1:]:
            assert all(torch.equal(a, b) for a, b in zip(runs[source], runs[None], strict=True)), (target, source)
        firsts[target] = runs[None][0]
    assert (firsts["all"] - firsts["experts"]).abs().max() > 1e-3  # the targets themselves differ


def test_copy_state_shares_tensors_and_is_independent(engine):
    original = write_history(engine, tokens(7, 11), "all")
    before = {name: t.clone() for name, t in shared_tensors(original).items() if t is not None}
    bound_before = {i: w.kv.clone() for i, w in original.bound.windows.items()}
    copy = copy_state(original)
    held = list(original.tensors())
    assert len(held) == 20  # 8 windows (5 shared, 3 bound), 2 stores x 3, stream, pre, 2 choices x 2
    assert all(a is b for a, b in zip(copy.tensors(), held, strict=True))  # shared until one of them grows
    engine.step(copy, 9, "all")
    engine.prefill(copy, tokens(8, 7))
    engine.replay(copy, "experts")
    engine.step(copy, 3, "experts")
    after = shared_tensors(original)
    assert original.length == 11 and all(torch.equal(after[name], t) for name, t in before.items())
    assert all(torch.equal(original.bound.windows[i].kv, kv) for i, kv in bound_before.items())
    twin = copy_state(original)  # the original goes on as if the copy had never run
    assert torch.equal(engine.step(original, 9, "all"), engine.step(twin, 9, "all"))


def test_a_replaced_adapter_makes_step_refuse_until_replay(engine, tmp_path, random_adapter):
    modules = engine.adapter_set.modules
    engine.adapters.load("swap", random_adapter(tmp_path / "v1", modules, lambda n: ".attn." in n, seed=10))
    try:
        state = engine.new_conversation()
        engine.prefill(state, tokens(9, 6))
        before, _ = engine.replay(state, "swap")
        record = engine.adapters.replace("swap", random_adapter(tmp_path / "v2", modules, lambda n: True, seed=11))
        assert record.version == 2 and state.bound.digest != record.digest
        with pytest.raises(StateError, match="replaced since"):
            engine.step(state, 5, "swap")
        with pytest.raises(StateError, match="call replay first"):  # windows of another adapter
            engine.step(state, 5, "all")
        assert state.length == 6  # refused before anything was appended
        after, _ = engine.replay(state, "swap")
        assert (after - before).abs().max() > 1e-3  # the new weights answer
        engine.step(state, 5, "swap")
    finally:
        engine.adapters.unload("swap")
    with pytest.raises(UnknownAdapterError):
        engine.step(state, 6, "swap")


def test_the_registry_has_adapter_registrys_api(engine, tmp_path, random_adapter, tiny_v41):
    assert "all" in engine.adapters and len(engine.adapters) == 2 and engine.adapters.n_slots == 3
    assert [r.name for r in engine.adapters.records()] == ["all", "experts"]
    assert engine.adapters.slot_of(None) == -1 and engine.adapters.digest(None) == "base"
    record = engine.adapters.get("experts")
    assert record.digest == engine.adapters.digest("experts") and record.modules[0].startswith("layers.")
    E = tiny_v41.decoder_start
    bare = DeepseekV41ForCausalLM.from_config(tiny_v41, seed=0)  # unwrapped, to write adapters the rule refuses
    linears = {n: m for n, m in bare.named_modules() if n in (f"layers.{E}.attn.wq_a", f"layers.{E + 1}.attn.wq_b")}
    with pytest.raises(PlacementError, match=rf"'layers\.{E}\.attn\.wq_a' is in the first decoder layer's attention"):
        engine.adapters.check(random_adapter(tmp_path / "bad", linears, lambda n: True))
    modules = engine.adapter_set.modules
    with pytest.raises(AdapterError, match="rank 12 exceeds the engine's max_rank 8"):
        engine.adapters.load("wide", random_adapter(tmp_path / "wide", modules, lambda n: ".attn." in n, rank=12))
    assert "wide" not in engine.adapters and "wide" not in engine.adapter_set.names
    engine.adapters.load("third", random_adapter(tmp_path / "third", modules, lambda n: ".attn." in n))
    try:
        with pytest.raises(AdapterError, match="all 3 adapter slots are in use"):
            engine.adapters.load("fourth", random_adapter(tmp_path / "fourth", modules, lambda n: ".attn." in n))
        assert sorted(r.slot for r in engine.adapters.records()) == [0, 1, 2]
    finally:
        engine.adapters.unload("third")
    assert all("third" not in module.adapters for module in modules.values())


def test_bad_tokens_are_refused_before_the_state_is_touched(engine, tiny_v41):
    state = engine.new_conversation()
    engine.prefill(state, [1, 2, 3])
    with pytest.raises(ValueError, match=r"token ids \[256\] out of range 0..255"):
        engine.prefill(state, [4, 256])
    with pytest.raises(ContextTooLongError, match="over the configured maximum of 4096"):
        engine.prefill(state, [5] * tiny_v41.max_position_embeddings)
    assert state.length == 3
    with pytest.raises(StateError, match="the conversation is empty"):
        engine.replay(engine.new_conversation(), None)


def test_a_steps_logits_stay_its_own_through_the_steps_after_it(engine):
    """A one-row step's logits are a row of a block made for several steps (FreshRows): none is handed out twice."""
    state = engine.new_conversation()
    engine.prefill(state, [1, 2, 3])
    engine.replay(state, None)
    kept = []
    for token in range(FreshRows.BLOCK + 3):  # past a block's end
        logits = engine.step(state, token % 7, None)
        kept.append((logits, logits.clone()))
    assert all(torch.equal(logits, copy) for logits, copy in kept)
    assert len({logits.data_ptr() for logits, _ in kept}) == len(kept)


def test_row_engine_drives_the_v41_engine_as_the_engine_itself(engine):
    rows_engine = RowEngine(engine)
    histories = {"all": tokens(10, 13), None: tokens(11, 4), "experts": tokens(12, 9)}
    rows = [rows_engine.open() for _ in histories]
    h19 = rows_engine.prefill_rows(rows, list(histories.values()))
    logits, counts = rows_engine.replay(rows, list(histories))
    assert counts == [min(8, len(h)) for h in histories.values()]
    step = rows_engine.step(rows, [7, 8, 9], list(histories))
    assert [row.length for row in rows] == [14, 5, 10] and [row.bound_length for row in rows] == [14, 5, 10]
    for i, (adapter, history) in enumerate(histories.items()):
        state = engine.new_conversation()
        assert torch.equal(engine.prefill(state, history), h19[i])
        assert torch.equal(engine.replay(state, adapter)[0], logits[i])
        # the step is one pass over the three rows (V41Engine.step_rows): a row's logits within float tolerance
        # of its own step's (a batched matmul may sum in another order), as tests/v41/test_batched_step.py pins
        alone = engine.step(state, [7, 8, 9][i], adapter)
        assert (alone - step[i]).abs().max() <= 1e-5 * alone.abs().max()
        assert rows[i].bound_adapter == adapter and rows[i].tokens == state.shared.tokens


def test_a_row_engine_fork_is_a_conversation_of_its_own(engine):
    rows_engine = RowEngine(engine)
    row = rows_engine.open()
    rows_engine.prefill_rows([row], [tokens(13, 11)])
    rows_engine.replay([row], ["all"])
    fork = rows_engine.fork(row, keep_bound=True)
    # shared until one of them grows: counted once, as the prefix cache needs; every tensor's storage counted
    assert rows_engine.unshared_nbytes([row]) >= sum(row.state.nbytes().values()) > 8 * row.length
    assert rows_engine.unshared_nbytes([row, fork]) == rows_engine.unshared_nbytes([row]) + 8 * fork.length
    twin = rows_engine.open(rows_engine.export(row))
    before = shared_tensors(fork.state)
    rows_engine.step([row], [5], ["all"])  # the original goes on...
    rows_engine.prefill_rows([row], [[6, 7, 8]])
    after = shared_tensors(fork.state)
    assert fork.length == 11 and all(after[name] is t for name, t in before.items())  # ...and the fork is as it was
    assert fork.bound_adapter == "all" and fork.bound_length == fork.length  # its windows kept: no replay needed
    assert torch.equal(rows_engine.step([fork], [5], ["all"]), rows_engine.step([twin], [5], ["all"]))
    assert rows_engine.delta(fork, 0).tokens == rows_engine.delta(twin, 0).tokens == fork.tokens
    assert rows_engine.fork(row).bound_length == -1  # without keep_bound, the next turn replays


# -- deltas ---------------------------------------------------------------------------------------------------------

def turns_with_deltas(engine, adapters=("all", "experts", None, "all")):
    """A conversation of four turns (odd lengths: a partial group pends at the ratio-2 sources) and the delta each
    turn added."""
    state, deltas = engine.new_conversation(), []
    for i, adapter in enumerate(adapters):
        since = state.length
        engine.prefill(state, tokens(20 + i, 5 + 2 * i))
        engine.replay(state, adapter)
        for token in tokens(30 + i, 2):
            engine.step(state, token, adapter)
        deltas.append(delta_of(state, since))
    return state, deltas


def test_a_snapshot_and_a_chain_of_deltas_rebuild_the_state_bitwise(engine, tiny_v41):
    state, deltas = turns_with_deltas(engine)
    snapshot, chain = empty_state(tiny_v41), empty_state(tiny_v41)
    apply_delta(snapshot, delta_of(state, 0))
    for delta in deltas:
        apply_delta(chain, delta)
    for rebuilt in (snapshot, chain):
        assert_same_shared(rebuilt, state)
        assert rebuilt.bound.adapter == "all" and rebuilt.bound.length == 0
        assert all(len(w) == 0 for w in rebuilt.bound.windows.values())  # the next turn replays them
    live = {t.untyped_storage().data_ptr() for t in shared_tensors(state).values() if t is not None}
    assert not any(t.untyped_storage().data_ptr() in live for t in deltas[-1].appended.values())  # dense copies
    names = set(deltas[-1].appended) | set(deltas[-1].replaced)
    assert not any(str(layer) in name.split(".") for layer in tiny_v41.adapter_bound_layers for name in names)
    # the rebuilt states answer the next turn as the live one does
    prompt = tokens(40, 3)
    answers = []
    for candidate in (state, snapshot, chain):
        engine.prefill(candidate, prompt)
        answers.append([engine.replay(candidate, "experts")[0], engine.step(candidate, 4, "experts")])
    assert all(torch.equal(a, b) for other in answers[1:] for a, b in zip(answers[0], other, strict=True))


def test_a_deltas_bytes_do_not_grow_with_the_history(engine):
    def turn_delta_bytes(history_length: int) -> tuple[int, int]:
        state = engine.new_conversation()
        engine.prefill(state, tokens(50, history_length))
        since = state.length
        engine.prefill(state, tokens(51, 6))
        engine.replay(state, "all")
        engine.step(state, 1, "all")
        delta = delta_of(state, since)
        assert len(delta.tokens) == 7
        return delta.added_nbytes() + delta.replaced_nbytes(), delta_of(state, 0).added_nbytes()

    sizes = {length: turn_delta_bytes(length) for length in (16, 64, 200)}
    assert sizes[16][0] == sizes[64][0] == sizes[200][0], sizes  # O(new tokens + W)
    assert sizes[16][1] < sizes[64][1] < sizes[200][1], sizes  # while the history itself grows


def test_a_delta_that_does_not_fit_is_refused_and_leaves_the_state_as_it_was(engine, tiny_v41):
    state, deltas = turns_with_deltas(engine, adapters=("all", "experts"))
    target = empty_state(tiny_v41)
    apply_delta(target, deltas[0])
    kept = {name: t for name, t in shared_tensors(target).items()}
    E, appended, replaced = tiny_v41.decoder_start, deltas[1].appended, deltas[1].replaced
    entries = f"entries.{E}.latent"
    cases = {
        "starts at token 0, the state holds": deltas[0],  # applied twice
        r"parts \['window.99'\]": dataclasses.replace(deltas[1], replaced={**replaced, "window.99": torch.zeros(1)}),
        f"global entries of layer {E}": dataclasses.replace(deltas[1], appended={**appended,
                                                                                 entries: appended[entries][:, 1:]}),
        f"the delta's entries of layer {E} are": dataclasses.replace(
            deltas[1], appended={**appended, entries: appended[entries][..., :-1]}),  # one dim short
    }
    for message, delta in cases.items():
        with pytest.raises(DeltaError, match=message):
            apply_delta(target, delta)
        after = shared_tensors(target)
        assert target.length == len(deltas[0].tokens)
        assert all(after[name] is t for name, t in kept.items()), message
    with pytest.raises(DeltaError, match="since token 99"):
        delta_of(target, 99)
    apply_delta(target, deltas[1])  # the right one still fits
    assert_same_shared(target, state)


def test_the_conversation_store_keeps_a_v41_conversation_through_its_journal(engine, tiny_v41, tmp_path):
    """The server's journal (python_backend/core/store.py) over this family's state verbs: a snapshot, then a turn's
    delta appended, read back as the live state, which then answers as the live one does."""
    from python_backend.core.store import ConversationStore

    store = ConversationStore(tmp_path, tiny_v41)
    state, deltas = turns_with_deltas(engine, adapters=("all", "experts", None))
    store.save("c1", empty_state(tiny_v41))
    for delta in deltas:
        store.append("c1", delta)
    loaded = store.load("c1")
    assert_same_shared(loaded, state)
    prompt = tokens(60, 4)
    answers = []
    for candidate in (state, loaded):
        engine.prefill(candidate, prompt)
        answers.append([engine.replay(candidate, "all")[0], engine.step(candidate, 2, "all")])
    assert all(torch.equal(a, b) for a, b in zip(*answers, strict=True))
    store.save("c1", loaded)  # the turn's delta on top of what the journal holds
    assert_same_shared(store.load("c1"), loaded)


def test_the_scheduler_serves_a_v41_conversation_as_the_serial_engine(tmp_path, tiny_v41, random_adapter):
    """The server's loop (python_backend/core/scheduler.py) over RowEngine(V41Engine) and the real journal: three
    turns that switch adapters give the tokens of the serial engine's turn + generate, and the store keeps them."""
    from ced.tokenization import ChatTokenizer
    from python_backend.core.store import ConversationStore

    config = tiny_v41.replace(vocab_size=320)  # the byte tokenizer's ids and its specials (no tokenizer.json)
    tokenizer = ChatTokenizer(tmp_path / "no_tokenizer")

    def make_engine() -> V41Engine:
        engine = V41Engine(DeepseekV41ForCausalLM.from_config(config, seed=0))
        engine.adapters.load("all", random_adapter(tmp_path / "all", engine.adapter_set.modules, lambda n: True))
        return engine

    script = [("hello there", "all"), ("and again", None), ("a third turn", "all")]
    store = ConversationStore(tmp_path / "store", config)
    served = serve_script(make_engine(), store, tokenizer, script)
    serial = make_engine()
    state, expected = serial.new_conversation(), []
    for text, adapter in script:
        logits = serial.turn(state, tokenizer.user_turn(tokenizer.encode(text), state.length == 0), adapter).logits
        expected.append(list(serial.generate(state, adapter, logits, 6, stop_tokens=tokenizer.stop_ids)))
    assert served == expected and all(len(tokens) == 6 for tokens in served)
    assert_same_shared(store.load("c1"), state)


def serve_script(engine, store, tokenizer, script, max_tokens: int = 6) -> list[list[int]]:
    """One conversation's turns (text, adapter) through the server's loop over RowEngine(engine): each turn's
    tokens, every turn checked to have ended without error."""
    from python_backend.core.routing import RouteDecision
    from python_backend.core.scheduler import Scheduler, Turn

    scheduler = Scheduler(RowEngine(engine), store, tokenizer, lambda decision: decision.adapter, lambda: [],
                          prefill_chunk=64, token_budget=80)
    served = []
    for i, (text, adapter) in enumerate(script):
        sink, decision = ListSink(), RouteDecision(adapter, 0)
        scheduler.submit(Turn("c1", tokenizer.encode(text), lambda pooled, d=decision: d, sink,
                              max_tokens=max_tokens, explicit=True, new=i == 0))
        scheduler.drain()
        assert sink.done and sink.error is None, sink.error
        served.append(sink.tokens)
    return served
