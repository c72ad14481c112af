"""docs/architecture.md §1's invariants on v41-tiny with adapters on native names (routed experts included): the
global KV of layers <= E bitwise the same under any adapter, a target's logits bitwise the same whichever adapter wrote the
history, and bounded replay of the last W positions against a full recompute under the target.

Replay tolerance: when the whole context fits the window (length <= W) replay computes exactly what a full
recompute does (atol 1e-5, fp32). Past W it is an approximation by design (the decoder windows are rebuilt from
the last W positions only): at 35 tokens (W=8, random tiny weights, logits of magnitude ~2) its logits must stay
within 0.1 of the full recompute's and ten times closer to it than the base model's are (measured: 0.038 vs
0.52; at 12 and 80 tokens 0.036 and 0.070, against 0.48 and 0.43), while the no-switch control (the target
throughout, token by token) matches the recompute to 1e-5.
"""

import pytest
import torch

from ced.deepseek_v41.conversation import StateMismatch, V41Conversation, full_recompute

SOURCES = [None, "all", "experts", "attn"]
TARGETS = [None, "all", "experts"]


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def written_by(adapters, history: list[int], source) -> V41Conversation:
    """The source's turn: the first token prefilled and replayed, every later one stepped, under `source`."""
    adapters.use(source)
    conversation = V41Conversation(adapters.model)
    conversation.prefill(history[:1])
    conversation.replay(source)
    for token in history[1:]:
        conversation.step(token, source)
    return conversation


@pytest.fixture(autouse=True)
def base_model_after(v41_adapters):
    """Each test leaves the shared model on the base, failed or not."""
    yield
    v41_adapters.use(None)


@pytest.fixture(scope="module")
def histories(v41_adapters):
    history = tokens(0, 24)
    return {source: written_by(v41_adapters, history, source) for source in SOURCES}


def test_global_kv_of_layers_up_to_e_is_bitwise_the_same_under_any_adapter(histories, tiny_v41):
    reference = histories[None].shared
    for source in SOURCES[1:]:
        shared = histories[source].shared
        for i, store in shared.stores.items():
            assert torch.equal(store.latent, reference.stores[i].latent), (source, i)
            assert torch.equal(store.index_keys, reference.stores[i].index_keys), (source, i)
        for i in range(tiny_v41.decoder_start + 1):
            assert torch.equal(shared.windows[i].kv, reference.windows[i].kv), (source, i)
        assert torch.equal(shared.stream, reference.stream) and torch.equal(shared.pre, reference.pre)
        assert torch.equal(shared.selection.idx, reference.selection.idx)
        assert torch.equal(shared.pool.idx, reference.pool.idx)
    bound = {s: torch.cat([w.kv.flatten() for w in histories[s].bound.windows.values()]) for s in SOURCES}
    for a in SOURCES:  # while the adapter-bound windows really differ
        for b in SOURCES:
            assert a == b or not torch.equal(bound[a], bound[b]), (a, b)


def test_target_logits_are_bitwise_the_same_whichever_adapter_wrote_the_history(histories, v41_adapters):
    new_turn, continuation = tokens(1, 5), tokens(2, 3)
    first = {}
    for target in TARGETS:
        runs = {}
        for source in SOURCES:
            conversation = histories[source].fork()
            v41_adapters.use(target)
            conversation.prefill(new_turn)
            logits = [conversation.replay(target)]
            logits += [conversation.step(token, target) for token in continuation]
            runs[source] = logits
        for source in SOURCES[1:]:
            for position, (ours, reference) in enumerate(zip(runs[source], runs[None])):
                assert torch.equal(ours, reference), (target, source, position)
        first[target] = runs[None][0]
    for a in TARGETS:
        for b in TARGETS:
            assert a == b or (first[a] - first[b]).abs().max() > 1e-3, (a, b)
    v41_adapters.use(None)


def test_a_step_under_another_adapter_than_the_windows_is_refused(histories):
    conversation = histories["all"].fork()
    with pytest.raises(StateMismatch, match="replay first"):
        conversation.step(3, "experts")


@pytest.mark.parametrize("length", [6, 35])
def test_bounded_replay_against_a_full_recompute_under_the_target(v41_adapters, tiny_v41, length):
    W, target = tiny_v41.sliding_window, "all"
    context = tokens(3, length)
    written = written_by(v41_adapters, context[:-1], "experts")  # another adapter wrote the history
    v41_adapters.use(target)
    written.prefill(context[-1:])
    replayed = written.replay(target)
    oracle = full_recompute(v41_adapters.model, context)
    if length <= W:
        torch.testing.assert_close(replayed, oracle, rtol=0, atol=1e-5)
    else:
        error = (replayed - oracle).abs().max()
        v41_adapters.use(None)
        base = full_recompute(v41_adapters.model, context)
        assert error < 0.1, error
        assert error < (oracle - base).abs().max() / 10
    v41_adapters.use(None)


def test_no_switch_control_matches_the_full_recompute(v41_adapters):
    context = tokens(4, 30)
    v41_adapters.use("all")
    conversation = V41Conversation(v41_adapters.model)
    conversation.prefill(context[:1])
    logits = conversation.replay("all")
    for token in context[1:]:
        logits = conversation.step(token, "all")
    torch.testing.assert_close(logits, full_recompute(v41_adapters.model, context), rtol=0, atol=1e-5)
    v41_adapters.use(None)


def test_why_the_first_decoder_attention_is_refused(tiny_v41):
    """Negative control: LoRA forced onto layer E's wq_a (the rule refuses it) changes the shared state the
    decoder reads after E's attention: its candidate pool, top-k and post-attention streams."""
    from ced.deepseek_v41.adapters import LoRALinear
    from ced.deepseek_v41.model import DeepseekV41ForCausalLM

    model = DeepseekV41ForCausalLM.from_config(tiny_v41, seed=0)
    attn = model.layers[tiny_v41.decoder_start].attn
    attn.wq_a = forced = LoRALinear(attn.wq_a)
    g = torch.Generator().manual_seed(0)
    forced.adapters["forced"] = (torch.randn(4, forced.in_features, generator=g),
                                 torch.randn(forced.out_features, 4, generator=g))
    ids = torch.tensor([tokens(5, 30)])
    outs = {}
    for name in (None, "forced"):
        forced.active = name
        outs[name] = model.run_shared(ids, 0, model.new_windows(range(tiny_v41.decoder_start + 1)),
                                      model.new_stores())
    assert not torch.equal(outs[None].stream, outs["forced"].stream)
    assert not torch.equal(outs[None].pool.idx, outs["forced"].pool.idx)
