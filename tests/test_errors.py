"""Bad input gets a clear exception and leaves the engine exactly as it was: adapters and conversation state."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from ced import AdapterError, ContextTooLongError, PlacementError, StateError, UnknownAdapterError, write_peft_adapter


def snapshot(engine, state):
    stores = {i: (g.k.clone(), g.v.clone()) for i, g in state.shared.globals.items()}
    lora = {name: (m.lora_a.clone(), m.lora_b.clone()) for name, m in engine.adapters.modules.items()}
    return engine.adapters.records(), list(state.shared.tokens), state.nbytes(), state.bound.adapter, stores, lora


def assert_unchanged(before, after):
    assert before[:4] == after[:4]
    for key, (k, v) in before[4].items():
        assert torch.equal(k, after[4][key][0]) and torch.equal(v, after[4][key][1])
    for name, (a, b) in before[5].items():
        assert torch.equal(a, after[5][name][0]) and torch.equal(b, after[5][name][1])


@pytest.fixture()
def busy(engine):
    """An engine mid-conversation."""
    state = engine.new_conversation()
    result = engine.turn(state, list(range(30)), "A1")
    list(engine.generate(state, "A1", result.logits, max_tokens=4))
    return engine, state


def corrupt(adapter_dirs, tmp_path, name="A4"):
    path = tmp_path / "bad"
    shutil.copytree(adapter_dirs[name], path)
    return path


def test_placement_violation_names_the_module(busy, adapter_dirs):
    engine, state = busy
    before = snapshot(engine, state)
    with pytest.raises(PlacementError, match=r"model\.layers\.3\.attn\.(q|k|v)_proj.*first decoder layer"):
        engine.adapters.load("unsafe", adapter_dirs["unsafe"])
    assert_unchanged(before, snapshot(engine, state))
    assert "unsafe" not in engine.adapters


def test_encoder_module_is_refused(busy, tmp_path):
    engine, state = busy
    before = snapshot(engine, state)
    path = write_peft_adapter(tmp_path / "enc", {
        "model.layers.4.mlp.up_proj": (torch.randn(2, 64), torch.randn(128, 2)),
        "model.layers.1.attn.q_proj": (torch.randn(2, 64), torch.randn(64, 2))}, r=2, lora_alpha=4)
    with pytest.raises(PlacementError, match=r"model\.layers\.1\.attn\.q_proj.*encoder layer 1"):
        engine.adapters.load("enc", path)
    assert_unchanged(before, snapshot(engine, state))


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / "adapter_model.safetensors").unlink(), "missing adapter_model.safetensors"),
    (lambda p: (p / "adapter_config.json").unlink(), "missing adapter_config.json"),
    (lambda p: (p / "adapter_config.json").write_text("{not json"), "corrupt adapter_config.json"),
    (lambda p: (p / "adapter_model.safetensors").write_bytes(b"\x00" * 40), "corrupt adapter_model.safetensors"),
    (lambda p: (p / "adapter_config.json").write_text(json.dumps({"lora_alpha": 8})), r"required field\(s\) \['r'\]"),
    (lambda p: (p / "adapter_config.json").write_text(json.dumps({"r": 3, "lora_alpha": 8})), "has rank 4"),
    (lambda p: (p / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "use_dora": True})),
     "unsupported"),
])
def test_broken_adapter_files(busy, adapter_dirs, tmp_path, damage, message):
    engine, state = busy
    path = corrupt(adapter_dirs, tmp_path)
    damage(path)
    before = snapshot(engine, state)
    with pytest.raises(AdapterError, match=message):
        engine.adapters.load("A4", path)
    with pytest.raises(AdapterError, match=message):
        engine.adapters.replace("A1", path)  # a failed replace keeps the old version serving
    assert_unchanged(before, snapshot(engine, state))


@pytest.mark.parametrize("setting, named", [
    ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights='pissa_niter_4'"),   # rewrote the base's weights
    ({"init_lora_weights": "olora"}, "init_lora_weights='olora'"),
    ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),             # applies from the invocation on
    ({"layer_replication": [[0, 6], [4, 6]]}, "layer_replication"),               # another layer stack
    ({"use_bdlora": {"block": 2}}, "use_bdlora"),
    ({"trainable_token_indices": [3]}, "trainable_token_indices"),
    ({"bias": "all"}, "bias"),
    ({"peft_type": "LOHA"}, "peft_type"),
    ({"some_future_variant": {"k": 1}}, "some_future_variant"),                   # unknown and set: refused
])
def test_adapter_settings_that_change_the_computation_are_refused(busy, adapter_dirs, tmp_path, setting, named):
    engine, state = busy
    path = corrupt(adapter_dirs, tmp_path)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **setting}))
    before = snapshot(engine, state)
    with pytest.raises(AdapterError, match=re.escape(named)):
        engine.adapters.load("A4", path)
    assert_unchanged(before, snapshot(engine, state))


def test_a_config_peft_wrote_passes_the_settings_check():
    from ced.adapters import unsupported_settings

    demo_adapters = Path(__file__).resolve().parents[1] / "models" / "demo" / "adapters"
    configs = sorted(demo_adapters.glob("*/adapter_config.json"))   # every field PEFT 0.21 writes
    assert len(configs) >= 4
    for config in configs:
        assert unsupported_settings(json.loads(config.read_text())) == [], config
    assert unsupported_settings({"init_lora_weights": "gaussian", "lora_dropout": 0.1, "loftq_config": {},
                                 "use_qalora": False, "layers_to_transform": [4, 5]}) == []


def test_wrong_shape_and_rank(busy, tmp_path):
    engine, state = busy
    before = snapshot(engine, state)
    wrong = write_peft_adapter(tmp_path / "shape", {"model.layers.4.mlp.up_proj": (torch.randn(2, 32),
                                                                                    torch.randn(128, 2))}, 2, 4)
    with pytest.raises(AdapterError, match=r"expects A \(r, 64\)"):
        engine.adapters.load("shape", wrong)
    big = write_peft_adapter(tmp_path / "rank", {"model.layers.4.mlp.up_proj": (torch.randn(16, 64),
                                                                                 torch.randn(128, 16))}, 16, 4)
    with pytest.raises(AdapterError, match="exceeds the engine's max_rank 8"):
        engine.adapters.load("rank", big)
    missing = write_peft_adapter(tmp_path / "nomod", {"model.layers.4.mlp.nothing": (torch.randn(2, 64),
                                                                                     torch.randn(128, 2))}, 2, 4)
    with pytest.raises(AdapterError, match="does not exist in this model"):
        engine.adapters.load("nomod", missing)
    assert_unchanged(before, snapshot(engine, state))


def test_unknown_adapter_name(busy):
    engine, state = busy
    before = snapshot(engine, state)
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'coding'.*A1"):
        engine.turn(state, [1, 2, 3], "coding")
    with pytest.raises(UnknownAdapterError):
        engine.replay(state, "coding")
    with pytest.raises(UnknownAdapterError):
        engine.adapters.unload("coding")
    assert_unchanged(before, snapshot(engine, state))


def test_context_over_the_maximum(busy):
    engine, state = busy
    before = snapshot(engine, state)
    too_many = engine.config.max_context - state.length + 1
    with pytest.raises(ContextTooLongError, match=f"over the configured maximum of {engine.config.max_context}"):
        engine.turn(state, [5] * too_many, "A1")
    with pytest.raises(ValueError, match="out of range"):
        engine.prefill(state, [1, 2, engine.config.vocab_size])
    assert_unchanged(before, snapshot(engine, state))


def test_decoding_with_stale_windows_is_refused(busy):
    engine, state = busy
    with pytest.raises(StateError, match="call replay first"):
        engine.step(state, 3, "A2")  # windows belong to A1
    engine.prefill(state, [1, 2])
    with pytest.raises(StateError, match="call replay first"):
        engine.step(state, 3, "A1")  # windows do not cover the new tokens


def test_decoding_on_windows_of_a_replaced_adapter_is_refused(busy, adapter_dirs):
    engine, state = busy                                  # windows built under A1's weights
    engine.adapters.replace("A1", adapter_dirs["A2"])
    with pytest.raises(StateError, match="other weights"):
        engine.step(state, 3, "A1")
    engine.adapters.unload("A1")
    engine.adapters.load("A1", adapter_dirs["A1"])        # the weights the windows were built with, loaded again
    engine.step(state, 3, "A1")                           # valid windows: accepted without a replay
    engine.adapters.replace("A1", adapter_dirs["A3"])
    with pytest.raises(StateError, match="other weights"):
        engine.step(state, 3, "A1")
    logits, _ = engine.replay(state, "A1")
    engine.step(state, int(logits.argmax()), "A1")


def test_register_replace_unload(engine, adapter_dirs):
    record = engine.adapters.get("A1")
    assert record.version == 1 and record.rank == 4
    replaced = engine.adapters.replace("A1", adapter_dirs["A2"])
    assert (replaced.version, replaced.slot) == (2, record.slot)
    with pytest.raises(AdapterError, match="already loaded"):
        engine.adapters.load("A1", adapter_dirs["A2"])
    engine.adapters.unload("A1")
    assert "A1" not in engine.adapters
    assert all(not m.in_use[record.slot] for m in engine.adapters.modules.values())


@pytest.mark.parametrize("values", [{"temperature": float("nan")}, {"temperature": float("inf")},
                                    {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1}])
def test_bad_sampling_parameters_are_refused_naming_the_field(values):
    from ced.engine import SamplingParams

    (field, value), = values.items()
    with pytest.raises(ValueError, match=f"^{field} must be .*, got {value!r}$"):
        SamplingParams(**values)


def test_a_second_engine_on_the_same_model_is_refused(engine):
    from ced import CEDEngine

    with pytest.raises(ValueError, match="already has LoRA slots"):
        CEDEngine(engine.model)


def test_an_adapter_made_on_the_inner_model_is_told_so(engine, tmp_path):
    path = write_peft_adapter(tmp_path / "inner", {"layers.4.mlp.up_proj": (torch.randn(2, 64), torch.randn(128, 2))},
                              r=2, lora_alpha=4)
    with pytest.raises(PlacementError, match="lacks the 'model.' prefix"):
        engine.adapters.load("inner", path)


def test_a_tiny_temperature_samples_the_argmax():
    from ced.engine import SamplingParams, sample

    logits = torch.tensor([0.5, 2.0, 1.999, -3.0])
    assert sample(logits, SamplingParams(temperature=1e-38, seed=0), torch.Generator().manual_seed(0)) == 1


def test_an_engine_without_slots_is_the_plain_model_and_refuses_an_adapter(adapter_dirs, tiny_model):
    """The adapter-free prefill stage builds its engine with max_adapters=0: no Linear wrapped, the same prefill."""
    from ced import CEDEngine
    from ced.lora import MultiLoRALinear

    plain, slotted = CEDEngine(tiny_model(), max_adapters=0), CEDEngine(tiny_model(), max_adapters=2)
    assert not any(isinstance(m, MultiLoRALinear) for m in plain.model.modules())
    tokens = list(range(5, 40))
    a, b = plain.new_conversation(), slotted.new_conversation()
    assert torch.equal(plain.prefill(a, tokens), slotted.prefill(b, tokens))
    with pytest.raises(AdapterError, match="no adapter slots"):
        plain.adapters.load("A1", adapter_dirs["A1"])
    assert not plain.adapters.records()  # the refusal loaded nothing
