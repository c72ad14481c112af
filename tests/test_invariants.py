"""docs/architecture.md §1's invariants on the tiny preset: source independence (bitwise), what breaks it, bounded
replay, shared bytes that do not grow with adapters visited, and mixed-adapter batches."""

import copy

import torch

from ced import CEDEngine

SOURCES = [None, "A1", "A2", "A3", "L0"]
TARGETS = [None, "A1", "A2", "L0"]


def history(seed: int = 0, length: int = 60) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def process_token_by_token(engine: CEDEngine, tokens: list[int], adapter):
    """The source's turn: the first token prefilled, then every later token decoded (forced) under `adapter`."""
    state = engine.new_conversation()
    engine.prefill(state, tokens[:1])
    engine.replay(state, adapter)
    for token in tokens[1:]:
        engine.step(state, token, adapter)
    return state


def switch_and_continue(engine, state, new_turn, continuation, target) -> list[torch.Tensor]:
    """New turn, switch to the target, force-decode the continuation; the logits at every position."""
    logits = [engine.turn(state, new_turn, target).logits]
    for token in continuation:
        logits.append(engine.step(state, token, target))
    return logits


def test_source_independence_is_bitwise(engine):
    tokens, new_turn, continuation = history(0), history(1, 8), history(2, 6)
    states = {source: process_token_by_token(engine, tokens, source) for source in SOURCES}

    windows = {s: torch.cat([w.k.flatten() for w in states[s].bound.windows.values()]) for s in SOURCES}
    for a in SOURCES:  # the sources really differ before the switch
        for b in SOURCES:
            assert a == b or not torch.equal(windows[a], windows[b]), (a, b)

    first_logits = {}
    for target in TARGETS:
        runs = {}
        for source in SOURCES:
            runs[source] = switch_and_continue(engine, copy.deepcopy(states[source]), new_turn, continuation, target)
        for source in SOURCES[1:]:
            for position, (ours, reference) in enumerate(zip(runs[source], runs[SOURCES[0]])):
                assert torch.equal(ours, reference), f"target {target}, source {source}, position {position}"
        first_logits[target] = runs[None][0]
    for a in TARGETS:  # and every target changes the output
        for b in TARGETS:
            assert a == b or not torch.equal(first_logits[a], first_logits[b]), (a, b)


def test_an_adapter_on_the_first_decoder_attention_breaks_independence(adapter_dirs, tiny_model):
    engine = CEDEngine(tiny_model(), max_adapters=4, max_rank=8, placement="decoder+first-attention")
    engine.adapters.load("unsafe", adapter_dirs["unsafe"])
    engine.adapters.load("A1", adapter_dirs["A1"])
    tokens, new_turn = history(0), history(1, 8)
    for target in (None, "A1"):
        clean = engine.turn(process_token_by_token(engine, tokens, None), new_turn, target).logits
        dirty = engine.turn(process_token_by_token(engine, tokens, "unsafe"), new_turn, target).logits
        assert not torch.equal(clean, dirty)
        assert (clean - dirty).abs().max() > 1e-4


def test_replay_processes_exactly_w_positions(engine, tiny_config):
    W = tiny_config.window
    counted = []
    layer = engine.model.model.layers[tiny_config.decoder_start]
    ffn_block = layer.ffn_block  # counted at the block: a few rows run it as one native call, not module by module

    def counting(x):
        counted.append(x.shape[1])
        return ffn_block(x)

    layer.ffn_block = counting
    try:
        for length in (2 * W, 2 * W + 4 * W + 7):
            state = engine.new_conversation()
            engine.prefill(state, history(3, length))
            counted.clear()
            before = engine.stats.replayed_positions
            logits, replayed = engine.replay(state, "A1")
            assert replayed == W and counted == [W]
            assert engine.stats.replayed_positions - before == W
    finally:
        del layer.ffn_block


def test_short_context_replays_all_of_it(engine):
    state = engine.new_conversation()
    engine.prefill(state, history(4, 5))
    assert engine.replay(state, "A2")[1] == 5


def test_shared_bytes_do_not_grow_with_adapters_visited(adapter_dirs, tiny_config, tiny_model):
    engine = CEDEngine(tiny_model(), max_adapters=8, max_rank=8)
    names = ["A1", "A2", "A3", "A4", "A5", "A6", "A7", "L0"]
    for name in names:
        engine.adapters.load(name, adapter_dirs[name])
    visits = {1: ["A1"] * 10, 8: names + ["A1", "L0"]}
    W, C = tiny_config.window, tiny_config
    bound_limit = W * len(C.adapter_bound_layers) * 2 * C.n_heads * C.head_dim * 4
    sizes = {}
    for count, sequence in visits.items():
        state = engine.new_conversation()
        for turn, adapter in enumerate(sequence):
            result = engine.turn(state, history(10 + turn, 12), adapter)
            list(engine.generate(state, adapter, result.logits, max_tokens=3))
            assert state.nbytes()["adapter_bound"] <= bound_limit
        assert len({a for a in sequence}) == count
        sizes[count] = state.nbytes()
    assert sizes[1]["shared"] == sizes[8]["shared"]
    assert sizes[1]["adapter_bound"] == sizes[8]["adapter_bound"] == bound_limit


def test_mixed_batch_equals_single_requests(engine):
    rows = torch.randint(0, 256, (5, 40), generator=torch.Generator().manual_seed(7))
    adapters = [None, "A1", "L0", "A2", None]
    batched = engine.forward_batch(rows, adapters)
    for i, adapter in enumerate(adapters):
        single = engine.forward_batch(rows[i: i + 1], [adapter])[0]
        torch.testing.assert_close(batched[i], single, rtol=0, atol=1e-5)
    base_rows = engine.forward_batch(rows[[0, 4]], [None, None])
    assert torch.equal(batched[[0, 4]], base_rows)  # rows with no adapter are untouched
