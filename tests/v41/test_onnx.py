"""The deepseek_v41 family on ONNX Runtime (ced/deepseek_v41/onnx_export.py, ort_engine.py) against V41Engine with
the native kernels off (torch's own arithmetic): H19, replay and step logits within RTOL of the largest |logit|,
the same top-k, the same layer-E choices (selection, pool) and state tensors close, under no adapter and under
adapters on every module (routed experts included) or on the routed experts only; adapters loaded after the
export; a chunked prefill; make_engine's cached build and its refusal of another model's graphs; RowEngine and the
scheduler's loop.

One export (the tiny shape, vocab 320 for the scheduler's byte tokenizer) per session: about ten seconds.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from ced import kernels
from ced.deepseek_v41.checkpoint import load_checkpoint, write_synthetic
from ced.deepseek_v41.engine import V41Engine
from ced.deepseek_v41.onnx_export import export_engine
from ced.deepseek_v41.ort_engine import OrtV41Engine
from ced.engine import StateError
from ced.engine_files import EngineFileError
from ced.engines import make_engine
from ced.row_engine import RowEngine

from test_batched_step import assert_close_states as close_states_within
from test_engine import serve_script

# Of the largest |logit| (or of the largest |value| of a state tensor). Both run float32; the graphs sum in
# another order (the dense MoE adds every expert's output, ORT's matmuls and reductions): measured ~1e-6.
RTOL = 1e-4
assert_close_states = partial(close_states_within, rtol=RTOL)  # this file's tolerance
ADAPTERS = {"all": lambda n: True, "experts": lambda n: ".experts." in n}


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="session")
def built(tmp_path_factory, tiny_v41):
    """(model folder, ONNX engine folder) of the tiny shape with seeded weights, exported once."""
    root = tmp_path_factory.mktemp("v41_onnx")
    write_synthetic(root / "model", tiny_v41.replace(vocab_size=320), seed=0)
    export_engine(root / "model", root / "onnx", progress=False)
    return root / "model", root / "onnx"


def load_adapters(engine, tmp_path, random_adapter) -> None:
    for seed, (name, include) in enumerate(ADAPTERS.items()):
        engine.adapters.load(name, random_adapter(tmp_path / name, engine.adapter_set.modules, include,
                                                  rank=4 + 2 * seed, seed=seed + 1))


@pytest.fixture
def pair(built, tmp_path, random_adapter):
    """(V41Engine, OrtV41Engine) over the same weights, both with the same adapters, loaded after the export."""
    model_dir, onnx_dir = built
    engines = (V41Engine(load_checkpoint(model_dir)[1], max_adapters=4, max_rank=8),
               make_engine("onnxruntime", model_dir, max_adapters=4, max_rank=8, engine_dir=onnx_dir, threads=1))
    assert isinstance(engines[1], OrtV41Engine)
    for engine in engines:
        load_adapters(engine, tmp_path, random_adapter)
    with kernels.turned_off():
        yield engines


def close_logits(ours, reference):
    assert ours.shape == reference.shape
    scale = reference.abs().max().item()
    assert (ours - reference).abs().max().item() <= RTOL * scale
    k = 8
    assert torch.equal(ours.topk(k).indices, reference.topk(k).indices)


def test_prefill_in_chunks_writes_the_same_shared_state(pair):
    """Chunks of 1, 4, 13 and 30 tokens (groups completing mid-chunk, the first call with no global entry yet,
    windows full and cut to W): H19 and every shared tensor as the torch engine writes them."""
    reference, ours = pair
    states = [engine.new_conversation() for engine in pair]
    for seed, n in enumerate((1, 4, 13, 30)):
        chunk = tokens(seed, n)
        h19 = ours.prefill(states[1], chunk)
        expected = reference.prefill(states[0], chunk)
        assert h19.shape == expected.shape == (n, reference.config.hidden_size)
        torch.testing.assert_close(h19, expected, rtol=RTOL, atol=RTOL * expected.abs().max().item())
    assert_close_states(states[1], states[0], bound=False)


@pytest.mark.parametrize("adapter", [None, "all", "experts"])
def test_replay_and_steps_match_the_torch_engine(pair, adapter):
    """A replay of the last W positions, then twelve steps (the layer-E entries pass an odd count, so the last
    candidate block is partial): logits, top-k and the whole state, adapter-bound windows included."""
    states = [engine.new_conversation() for engine in pair]
    (reference, ours), prompt = pair, tokens(5, 21)
    for engine, state in zip(pair, states):
        engine.prefill(state, prompt)
    (ours_logits, ours_n), (expected, n) = ours.replay(states[1], adapter), reference.replay(states[0], adapter)
    assert ours_n == n == reference.config.sliding_window
    close_logits(ours_logits, expected)
    assert_close_states(states[1], states[0])
    for token in tokens(6, 12):
        close_logits(ours.step(states[1], token, adapter), reference.step(states[0], token, adapter))
    assert_close_states(states[1], states[0])
    assert ours.stats.decoded_tokens == reference.stats.decoded_tokens == 12


def test_a_replaced_adapter_takes_effect_on_the_next_call(pair, tmp_path, random_adapter):
    """The graphs take the adapters as inputs: a replace needs no re-export, and windows built under the old
    weights are refused until the next replay (V41Engine's rule)."""
    reference, ours = pair
    states = [engine.new_conversation() for engine in pair]
    for engine, state in zip(pair, states):
        engine.prefill(state, tokens(7, 10))
        engine.replay(state, "experts")
    other = random_adapter(tmp_path / "other", reference.adapter_set.modules, ADAPTERS["experts"], seed=9)
    for engine in pair:
        engine.adapters.replace("experts", other)
    with pytest.raises(StateError, match="call replay first"):
        ours.step(states[1], 3, "experts")
    close_logits(ours.replay(states[1], "experts")[0], reference.replay(states[0], "experts")[0])
    close_logits(ours.step(states[1], 3, "experts"), reference.step(states[0], 3, "experts"))


def test_graphs_of_other_weights_are_refused(built, tmp_path, tiny_v41):
    """A model folder whose weights differ from the ones the graphs were exported from: named, not run."""
    _, onnx_dir = built
    write_synthetic(tmp_path / "other", tiny_v41.replace(vocab_size=320), seed=1)
    with pytest.raises(EngineFileError, match="other weights"):
        make_engine("onnxruntime", tmp_path / "other", engine_dir=onnx_dir)
    with pytest.raises(ValueError, match="tensorrt engine does not run the deepseek_v41 family"):
        make_engine("tensorrt", tmp_path / "other")


def test_without_a_folder_make_engine_finds_the_cached_build(built, tmp_path, monkeypatch):
    """make_engine / ensure_onnx_engine of a deepseek_v41 folder go through the family registry to this family's
    cache, artifacts/engines/<config>-<weights>/onnx: a build already there is loaded, not exported again."""
    import shutil

    import ced.engines

    model_dir, onnx_dir = built
    monkeypatch.setattr(ced.engines, "ROOT", tmp_path)
    cached = ced.engines.default_engine_dir(load_checkpoint(model_dir)[1], "onnx")
    assert cached.is_relative_to(tmp_path / "artifacts/engines")
    shutil.copytree(onnx_dir, cached)
    stamp = (cached / "engine.json").stat().st_mtime_ns
    assert ced.engines.ensure_onnx_engine(model_dir) == cached
    engine = make_engine("onnxruntime", model_dir, threads=1)
    assert isinstance(engine, OrtV41Engine) and engine.engine_dir == cached
    assert (cached / "engine.json").stat().st_mtime_ns == stamp


def test_row_engine_steps_rows_of_different_adapters(pair):
    """RowEngine over the ORT engine: two rows under different adapters step in one call (each row its own
    graph call), as the torch engine's batched step computes them."""
    rows_by_engine = []
    for engine in pair:
        rows = RowEngine(engine)
        opened = [rows.open() for _ in range(2)]
        rows.prefill_rows(opened, [tokens(8, 9), tokens(9, 14)])
        rows.replay(opened, ["all", None])
        rows_by_engine.append((rows, opened))
    (reference, ref_rows), (ours, our_rows) = rows_by_engine
    for token in (4, 99, 250):
        expected = reference.step(ref_rows, [token, token], ["all", None])
        got = ours.step(our_rows, [token, token], ["all", None])
        for row in range(2):
            close_logits(got[row], expected[row])
    for mine, theirs in zip(our_rows, ref_rows):
        assert_close_states(mine.state, theirs.state)


def test_the_scheduler_serves_the_same_tokens_on_onnxruntime(built, tmp_path, random_adapter):
    """The server's loop (python_backend/core/scheduler.py) over RowEngine(OrtV41Engine) and the real journal:
    three turns that switch adapters give the torch engine's greedy tokens, and the store keeps the state."""
    from ced.tokenization import ChatTokenizer
    from python_backend.core.store import ConversationStore

    model_dir, onnx_dir = built
    tokenizer = ChatTokenizer(tmp_path / "no_tokenizer")  # the byte tokenizer: ids below 320

    script = [("hello there", "all"), ("and again", None), ("a third turn", "experts")]
    with kernels.turned_off():
        ours = make_engine("onnxruntime", model_dir, engine_dir=onnx_dir, threads=1)
        load_adapters(ours, tmp_path, random_adapter)
        store = ConversationStore(tmp_path / "store", ours.config)
        served = serve_script(ours, store, tokenizer, script)
        reference = V41Engine(load_checkpoint(model_dir)[1])
        load_adapters(reference, tmp_path, random_adapter)
        state, expected = reference.new_conversation(), []
        for text, adapter in script:
            logits = reference.turn(state, tokenizer.user_turn(tokenizer.encode(text), state.length == 0),
                                    adapter).logits
            expected.append(list(reference.generate(state, adapter, logits, 6, stop_tokens=tokenizer.stop_ids)))
    assert served == expected and all(len(tokens) == 6 for tokens in served)
    loaded = store.load("c1")
    assert loaded.shared.tokens == state.shared.tokens
    assert_close_states(loaded, state, bound=False)
