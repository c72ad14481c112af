"""The ONNX Runtime engine against the PyTorch engine: state and logits within tolerance for prefill, replay and
step (with and without adapters), source independence still bitwise, the same greedy tokens over a conversation
that switches adapters, adapters swapped at run time without re-export, and the trained demo."""

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from ced import CEDConfig, CEDEngine, CEDForCausalLM
from ced.ort_engine import OrtCEDEngine
from ced.onnx_export import export_engine

# Max |ORT - torch| allowed. Both run float32; the graphs reorder a few reductions (measured: ~3e-7 on tiny,
# ~4e-5 on the demo, whose logits reach ~20).
ATOL = {"tiny": 1e-5, "demo": 2e-4}
DEMO = Path(__file__).resolve().parents[1] / "models/demo"


def tokens(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def engines(tmp_path_factory, adapter_dirs):
    """(torch engine, ORT engine) over the same seeded tiny model, the same four adapters loaded in each."""
    root = tmp_path_factory.mktemp("onnx_engine")
    CEDForCausalLM.from_ced(CEDConfig.from_name("tiny"), seed=0).save_pretrained(str(root / "model"))
    export_engine(root / "model", root / "engine", progress=False)
    pair = (CEDEngine(CEDForCausalLM.from_pretrained(str(root / "model")), max_adapters=4, max_rank=8),
            OrtCEDEngine(CEDForCausalLM.from_pretrained(str(root / "model")), root / "engine", max_adapters=4,
                         max_rank=8, threads=1))
    for engine in pair:
        engine.prefill_chunk = 13  # several chunks per prefill: the windows and partial blocks carry over
        for name in ("A1", "A2", "L0"):
            engine.adapters.load(name, adapter_dirs[name])
    return pair


def close(ours, reference, atol=ATOL["tiny"]):
    assert ours.shape == reference.shape
    difference = (ours.float() - reference.float()).abs().max().item() if ours.numel() else 0.0
    assert difference <= atol, difference


def test_prefill_writes_the_same_shared_state(engines):
    torch_engine, ort_engine = engines
    states = [engine.new_conversation() for engine in engines]
    for chunk in (tokens(0, 3), tokens(1, 40), tokens(2, 1), tokens(3, 27)):
        close(ort_engine.prefill(states[1], chunk), torch_engine.prefill(states[0], chunk))
    ours, reference = states[1].shared, states[0].shared
    for i in reference.windows:
        close(ours.windows[i].k, reference.windows[i].k)
        close(ours.windows[i].v, reference.windows[i].v)
    for s in reference.globals:
        for part in ("k", "v", "index_keys", "pending"):
            close(getattr(ours.globals[s], part), getattr(reference.globals[s], part))
    close(ours.stream, reference.stream)
    assert torch.equal(ours.selection.idx, reference.selection.idx)  # the top-k choice itself is exact
    assert torch.equal(ours.selection.valid, reference.selection.valid)


@pytest.mark.parametrize("adapter", [None, "A1", "L0"])
def test_replay_and_steps_match(engines, adapter):
    states = [engine.new_conversation() for engine in engines]
    for engine, state in zip(engines, states):
        engine.prefill(state, tokens(4, 50))
    (reference, n), (ours, m) = (engine.replay(state, adapter) for engine, state in zip(engines, states))
    assert n == m == 16
    close(ours, reference)
    for token in tokens(5, 6):
        close(engines[1].step(states[1], token, adapter), engines[0].step(states[0], token, adapter))
    for i in states[0].bound.windows:
        close(states[1].bound.windows[i].k, states[0].bound.windows[i].k)


def test_the_graph_form_of_the_top_k_choice_is_the_eager_one(tmp_path, monkeypatch):
    """Indexer.select traced with graph=True (always top_k slots, ties through ONNX TopK) against the eager form
    (its O(N) tie-break, its padding), on scores that tie at the cut, with fewer entries than top_k, and none."""
    import numpy as np
    import onnxruntime

    import ced.model

    config = CEDConfig.from_name("tiny")
    indexer = CEDForCausalLM.from_ced(config, seed=0).model.layers[1].attn.indexer.eval()

    class Select(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.indexer = indexer

        def forward(self, xn, index_keys, positions):
            selection = self.indexer.select(xn, index_keys, positions, config.block_size, graph=True)
            return selection.idx, selection.valid

    g = torch.Generator().manual_seed(0)
    sample = (torch.randn(1, 5, config.hidden_size, generator=g), torch.randn(1, 6, config.index_dim, generator=g),
              torch.arange(20, 25)[None])
    with torch.no_grad():
        torch.onnx.export(Select(), sample, str(tmp_path / "select.onnx"), input_names=["xn", "keys", "positions"],
                          output_names=["idx", "valid"], dynamo=False, opset_version=18,
                          dynamic_axes={"xn": {1: "T"}, "keys": {1: "N"}, "positions": {1: "T"}})
    session = onnxruntime.InferenceSession(str(tmp_path / "select.onnx"), providers=["CPUExecutionProvider"])
    tied = []  # rows whose k-th score ties with an entry left out: where topk's own tie order would not do
    choose = ced.model.top_k_recent

    def recording(scores, k, graph=False):
        idx, values = choose(scores, k, graph)
        tied.append(int(((scores >= values[..., -1:]).sum(-1) > k).sum()))
        return idx, values

    monkeypatch.setattr(ced.model, "top_k_recent", recording)
    for n_entries in (0, 3, 30):
        xn = torch.randn(1, 40, config.hidden_size, generator=g)
        keys = torch.randn(1, n_entries, config.index_dim, generator=g)
        keys[:, ::3] = 0  # a zero key scores exactly 0: ties at the cut for queries with few positive scores
        positions = torch.arange(90, 130)[None]
        with torch.no_grad():
            eager = indexer.select(xn, keys, positions, config.block_size)
        idx, valid = session.run(None, {"xn": xn.numpy(), "keys": keys.numpy(), "positions": positions.numpy()})
        assert np.array_equal(idx, eager.idx.numpy()) and np.array_equal(valid, eager.valid.numpy()), n_entries
    assert sum(tied)  # the tied case was really there


def test_source_independence_is_still_bitwise(engines):
    """As tests/test_invariants.py, under ONNX Runtime: the history's adapter never reaches the target's logits."""
    ort_engine = engines[1]
    history, new_turn, continuation = tokens(6, 40), tokens(7, 8), tokens(8, 4)
    states = {}
    for source in (None, "A1", "A2", "L0"):
        state = ort_engine.new_conversation()
        ort_engine.prefill(state, history[:1])
        ort_engine.replay(state, source)
        for token in history[1:]:
            ort_engine.step(state, token, source)
        states[source] = state
    windows = {s: torch.cat([w.k.flatten() for w in state.bound.windows.values()]) for s, state in states.items()}
    assert not torch.equal(windows[None], windows["A1"])  # the sources really differ before the switch
    for target in (None, "A1", "L0"):
        runs = {}
        for source, state in states.items():
            state = copy.deepcopy(state)
            logits = [ort_engine.turn(state, new_turn, target).logits]
            logits += [ort_engine.step(state, token, target) for token in continuation]
            runs[source] = logits
        for source in ("A1", "A2", "L0"):
            for position, (ours, reference) in enumerate(zip(runs[source], runs[None])):
                assert torch.equal(ours, reference), f"target {target}, source {source}, position {position}"


def test_greedy_tokens_match_over_a_conversation_with_switches(engines):
    states = [engine.new_conversation() for engine in engines]
    for turn, adapter in enumerate(["A1", "L0", None, "A2", "A1"]):
        replies = []
        for engine, state in zip(engines, states):
            result = engine.turn(state, tokens(10 + turn, 9), adapter)
            replies.append(list(engine.generate(state, adapter, result.logits, max_tokens=8)))
        assert replies[0] == replies[1], f"turn {turn} under {adapter}"
    assert states[0].shared.tokens == states[1].shared.tokens


def test_adapters_swap_at_run_time_without_re_export(engines, adapter_dirs):
    torch_engine, ort_engine = engines
    sessions = dict(ort_engine.sessions)
    states = [engine.new_conversation() for engine in engines]
    for engine, state in zip(engines, states):
        engine.prefill(state, tokens(20, 30))

    def both(adapter):
        reference, ours = (engine.replay(copy.deepcopy(state), adapter)[0] for engine, state in zip(engines, states))
        close(ours, reference)
        return ours

    before = both("A1")
    for engine in engines:
        engine.adapters.replace("A1", adapter_dirs["A3"])  # new weights under the same name and slot
        engine.adapters.unload("L0")
        engine.adapters.load("A5", adapter_dirs["A5"])  # into the freed slot
    after = both("A1")
    assert not torch.equal(before, after)
    both("A5")
    assert ort_engine.sessions == sessions  # the same graphs served every set
    for engine in engines:  # back to the module's adapter set
        engine.adapters.replace("A1", adapter_dirs["A1"])
        engine.adapters.unload("A5")
        engine.adapters.load("L0", adapter_dirs["L0"])


@pytest.mark.skipif(not (DEMO / "model/model.safetensors").is_file(), reason="the trained demo is not in models/demo")
def test_the_demo_gives_the_same_greedy_reply(tmp_path):
    from ced.tokenization import ChatTokenizer

    export_engine(DEMO / "model", tmp_path / "engine", progress=False)
    engines = (CEDEngine(CEDForCausalLM.from_pretrained(str(DEMO / "model"))),
               OrtCEDEngine(CEDForCausalLM.from_pretrained(str(DEMO / "model")), tmp_path / "engine", threads=1))
    tokenizer = ChatTokenizer(DEMO / "model")
    states = [engine.new_conversation() for engine in engines]
    for turn, (text, adapter) in enumerate([("Reverse a list in Python.", "coding"), ("And now a joke.", "chat")]):
        user = tokenizer.user_turn(tokenizer.encode(text), first=turn == 0)
        replies = []
        for engine, state in zip(engines, states):
            if adapter not in engine.adapters:
                engine.adapters.load(adapter, DEMO / "adapters" / adapter)
            result = engine.turn(state, user, adapter)
            replies.append((result.logits, list(engine.generate(state, adapter, result.logits, 12,
                                                                stop_tokens=tokenizer.stop_ids))))
        close(replies[1][0], replies[0][0], ATOL["demo"])
        assert replies[1][1] == replies[0][1]


def test_a_bfloat16_checkpoint_runs_in_float32(tmp_path):
    """The graphs are float32: a checkpoint saved in bfloat16 is run (state and slots) in float32, as torch runs it
    after .float(), instead of failing at the first graph call."""
    config = dataclasses.replace(CEDConfig.from_name("tiny"), dtype="bfloat16")
    CEDForCausalLM.from_ced(config, seed=0).to(torch.bfloat16).save_pretrained(str(tmp_path / "model"))
    export_engine(tmp_path / "model", tmp_path / "engine", progress=False)
    ort_engine = OrtCEDEngine(CEDForCausalLM.from_pretrained(str(tmp_path / "model")), tmp_path / "engine", threads=1)
    torch_engine = CEDEngine(CEDForCausalLM.from_pretrained(str(tmp_path / "model")).float())
    results = [engine.turn(engine.new_conversation(), tokens(5, 20), None) for engine in (ort_engine, torch_engine)]
    close(results[0].logits, results[1].logits)
