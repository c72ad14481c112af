"""Pins the released checkpoint format: storage dtype by name, shards + index, lazy load, refusal by tensor name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ced.deepseek_v41 import checkpoint as K

F8, E8, I8, BF16, F32 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.bfloat16, torch.float32

# A hand-made model: one tensor for each storage rule, at sizes that leave partial 32-blocks.
SHAPES = {
    "embed.weight": (40, 64),
    "layers.0.attn_norm.weight": (64,),
    "layers.0.attn.wq_a.weight": (48, 64),
    "layers.0.attn.attn_sink": (4,),
    "layers.0.attn.compressor.wkv.weight": (32, 64),
    "layers.0.hc_attn_fn": (24, 256),
    "layers.0.ffn.gate.weight": (8, 64),
    "layers.0.ffn.gate.bias": (8,),
    "layers.0.ffn.experts.0.w1.weight": (32, 64),
    "layers.0.ffn.experts.0.w2.weight": (64, 32),
    "layers.0.ffn.shared_experts.w2.weight": (64, 32),
    "norm.weight": (64,),
    "head.weight": (40, 64),
}


def hand_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


@pytest.fixture
def written(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = hand_state_dict()
    K.write_checkpoint(tmp_path / "ckpt", {"hidden_size": 64}, state, max_shard_bytes=6000)
    return tmp_path / "ckpt", state


def test_storage_rule_on_release_names_and_shapes():
    """Shapes from the reference's header checks (§1.2): the stored shapes and dtypes the release has."""
    specs = K.stored_specs({
        "layers.3.attn.wq_a.weight": (1280, 5120),
        "layers.3.ffn.experts.17.w1.weight": (2304, 5120),
        "layers.3.ffn.experts.17.w2.weight": (5120, 2304),
        "layers.1.engram.embed.weight": (1000, 256),
        "layers.3.hc_ffn_fn": (24, 20480),
        "layers.3.attn.attn_sink": (64,),
        "layers.20.attn.compressor.wkv.weight": (512, 5120),
        "layers.24.attn.indexer.weights_proj.weight": (32, 5120),
        "layers.24.attn.indexer.wq_b.weight": (4096, 1280),
        "layers.3.ffn.gate.bias_vl": (384,),
        "head.weight": (129280, 5120),
        "mtp.0.ffn.experts.5.w3.weight": (2304, 5120),
        "mtp.0.main_proj.weight": (5120, 15360),
    })
    got = {name: (list(spec.shape), spec.dtype) for name, (spec, _) in specs.items()}
    assert got == {
        "layers.3.attn.wq_a.weight": ([1280, 5120], F8), "layers.3.attn.wq_a.scale": ([40, 160], E8),
        "layers.3.ffn.experts.17.w1.weight": ([2304, 2560], I8), "layers.3.ffn.experts.17.w1.scale": ([2304, 160], E8),
        "layers.3.ffn.experts.17.w2.weight": ([5120, 1152], I8), "layers.3.ffn.experts.17.w2.scale": ([5120, 72], E8),
        "layers.1.engram.embed.weight": ([1000, 256], F8), "layers.1.engram.embed.scale": ([1000, 8], E8),
        "layers.3.hc_ffn_fn": ([24, 20480], F32), "layers.3.attn.attn_sink": ([64], F32),
        "layers.20.attn.compressor.wkv.weight": ([512, 5120], BF16),
        "layers.24.attn.indexer.weights_proj.weight": ([32, 5120], BF16),
        "layers.24.attn.indexer.wq_b.weight": ([4096, 1280], F8), "layers.24.attn.indexer.wq_b.scale": ([128, 40], E8),
        "layers.3.ffn.gate.bias_vl": ([384], F32), "head.weight": ([129280, 5120], BF16),
        "mtp.0.ffn.experts.5.w3.weight": ([2304, 2560], I8), "mtp.0.ffn.experts.5.w3.scale": ([2304, 160], E8),
        "mtp.0.main_proj.weight": ([5120, 15360], BF16),
    }


def test_write_shards_index_and_read_back(written):
    directory, state = written
    index = json.loads((directory / K.INDEX_FILE).read_text())
    shards = sorted(p.name for p in directory.glob("model-*.safetensors"))
    assert len(shards) >= 3 and shards == [K.shard_name(i, len(shards)) for i in range(1, len(shards) + 1)]
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == shards
    stored = {}
    for shard in shards:
        stored.update(load_file(directory / shard))
    assert set(stored) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    assert {stored[n].dtype for n in ("layers.0.attn.wq_a.weight", "layers.0.ffn.experts.0.w1.weight",
                                      "layers.0.attn.wq_a.scale", "head.weight", "layers.0.hc_attn_fn")} \
        == {F8, I8, E8, BF16, F32}
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "deepseek_v41" and config["architectures"] == ["DeepseekV41ForCausalLM"]
    assert config["text_config"] == {"hidden_size": 64} and config["quantization_config"] == K.QUANTIZATION_CONFIG
    loaded = dict(K.iter_weights(directory, SHAPES))
    expected = K.fake_quantize(state)
    assert set(loaded) == set(SHAPES)
    assert all(torch.equal(loaded[n], expected[n]) for n in SHAPES)
    assert torch.equal(loaded["layers.0.hc_attn_fn"], state["layers.0.hc_attn_fn"])  # F32 is exact
    assert not torch.equal(loaded["layers.0.attn.wq_a.weight"], state["layers.0.attn.wq_a.weight"])  # FP8 is not


def _rewrite(directory: Path, name: str, change) -> None:
    """Apply `change(tensors)` to the shard holding `name`, keeping the index in step."""
    index_path = directory / K.INDEX_FILE
    index = json.loads(index_path.read_text())
    shard = index["weight_map"][name]
    tensors = load_file(directory / shard)
    change(tensors)
    save_file(tensors, str(directory / shard))
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != shard} | dict.fromkeys(tensors, shard)
    index_path.write_text(json.dumps(index))


MALFORMED = {
    "missing": ("layers.0.attn.attn_sink", lambda t: t.pop("layers.0.attn.attn_sink"), "missing"),
    "unexpected": ("layers.0.attn.attn_sink", lambda t: t.update({"layers.0.attn.wq_c.weight": torch.zeros(2)}),
                   "unexpected"),
    "wrong shape": ("layers.0.attn.compressor.wkv.weight",
                    lambda t: t.update({"layers.0.attn.compressor.wkv.weight": torch.zeros(31, 64, dtype=BF16)}),
                    r"shape \[31, 64\], the model expects \[32, 64\]"),
    "wrong dtype": ("layers.0.hc_attn_fn",
                    lambda t: t.update({"layers.0.hc_attn_fn": torch.zeros(24, 256, dtype=BF16)}),
                    "stored as BF16, the release stores it as F32"),
    "bad scale": ("layers.0.ffn.experts.0.w1.scale",
                  lambda t: t.update({"layers.0.ffn.experts.0.w1.scale": torch.ones(32, 1).to(E8)}),
                  r"scale shape \[32, 1\] does not fit its weight layers.0.ffn.experts.0.w1.weight \[32, 64\]"),
    "missing scale": ("layers.0.attn.wq_a.scale", lambda t: t.pop("layers.0.attn.wq_a.scale"),
                      "the scale of layers.0.attn.wq_a.weight"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoint_is_refused_by_name(written, case):
    directory, _ = written
    anchor, change, message = MALFORMED[case]
    _rewrite(directory, anchor, change)
    named = {"unexpected": "layers.0.attn.wq_c.weight"}.get(case, anchor)
    with pytest.raises(K.CheckpointError, match=message) as caught:
        K.check_checkpoint(directory, SHAPES)
    assert caught.value.tensor == named and str(caught.value).startswith(named)


def test_absent_shard_and_stale_index_are_refused(written):
    directory, _ = written
    index = json.loads((directory / K.INDEX_FILE).read_text())
    shard = index["weight_map"]["head.weight"]
    moved = directory / "elsewhere"
    (directory / shard).rename(moved)
    with pytest.raises(K.CheckpointError, match=f"shard {shard}, which is absent"):
        K.check_checkpoint(directory, SHAPES)
    moved.rename(directory / shard)
    first = index["weight_map"]["embed.weight"]
    assert first != shard  # written in order: the first tensor and the last lie in different shards
    index["weight_map"]["head.weight"] = first
    (directory / K.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(K.CheckpointError, match=f"^head.weight: the index puts it in shard {first}, which does not"):
        K.check_checkpoint(directory, SHAPES)
    (directory / first).write_bytes(b"garbage")
    with pytest.raises(K.CheckpointError, match=f"^{first}: not a readable safetensors file"):
        K.check_checkpoint(directory, SHAPES)


# --- the deepseek_v41 model: a synthetic tiny checkpoint ------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    """(config, {native name: float32 weight}) of the v41-tiny preset; skipped until the model file exists."""
    pytest.importorskip("ced.deepseek_v41.model", reason="ced/deepseek_v41/model.py is not there yet")
    from ced.deepseek_v41.config import V41Config

    config = V41Config.from_name("v41-tiny")
    return config, K.synthetic_state_dict(config, seed=3)


@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory) -> Path:
    config, state = tiny
    directory = tmp_path_factory.mktemp("v41") / "tiny"
    K.write_checkpoint(directory, config, state, max_shard_bytes=96 * 1024)
    return directory


def test_every_tiny_tensor_has_a_release_rule(tiny):
    """No name of the backbone falls through to the BF16 default: each one is placed by a rule of the reference."""
    config, state = tiny
    fallthrough = [n for n in state if not any(p.search(n) for p, _ in K._RULES)]
    assert fallthrough == []
    kinds = {K.storage_for(n).kind for n in state}
    assert kinds == {"fp8", "fp4", "bf16", "f32"}


def test_synthetic_tiny_loads_with_the_same_weights_and_logits(tiny, tiny_dir):
    from ced.deepseek_v41.model import DeepseekV41ForCausalLM

    config, state = tiny
    shards = sorted(tiny_dir.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    loaded_config, model = K.load_checkpoint(tiny_dir)
    assert loaded_config == config
    expected = K.fake_quantize(state)
    got = model.state_dict()
    assert set(got) == set(expected)
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    reference = DeepseekV41ForCausalLM(config)
    reference.load_state_dict(expected)
    input_ids = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(input_ids), reference.eval()(input_ids)
    a, b = (getattr(x, "logits", x) for x in (a, b))
    assert a.shape == (1, 12, config.vocab_size) and torch.isfinite(a).all()
    assert torch.equal(a, b)


def test_tiny_loads_into_bfloat16_keeping_the_float32_tensors(tiny, tiny_dir):
    config, state = tiny
    loaded_config, model = K.load_checkpoint(tiny_dir, dtype=torch.bfloat16)
    assert loaded_config.dtype == "bfloat16"
    expected = K.fake_quantize(state)
    got = model.state_dict()
    assert got["layers.0.hc_attn_fn"].dtype == torch.float32 and got["layers.0.attn.wq_a.weight"].dtype == BF16
    assert all(torch.equal(got[n], expected[n].to(got[n].dtype)) for n in expected)
    logits = model(torch.arange(10)[None] % config.vocab_size)
    assert logits.shape == (1, 10, config.vocab_size) and torch.isfinite(logits).all()


def test_tiny_malformed_is_refused_by_load(tiny, tiny_dir, tmp_path):
    import shutil

    directory = tmp_path / "broken"
    shutil.copytree(tiny_dir, directory)
    _rewrite(directory, "layers.4.attn.indexer.wk.weight", lambda t: t.pop("layers.4.attn.indexer.wk.weight"))
    with pytest.raises(K.CheckpointError, match="^layers.4.attn.indexer.wk.weight: missing"):
        K.load_checkpoint(directory)


# --- mol2 build synthetic-v41 / mol2 inspect ------------------------------------------------------------------------

def test_cli_build_and_inspect(tiny, tmp_path, capsys):
    from ced.deepseek_v41.config import parameter_counts
    from mol2_cli import main

    out = tmp_path / "synthetic"
    assert main(["build", "synthetic-v41", "--out", str(out), "--seed", "1", "--shard-mb", "0.1"]) == 0
    assert len(list(out.glob("model-*.safetensors"))) >= 3
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["family"] == "deepseek_v41"
    assert report["parameters"] == parameter_counts(tiny[0])
    assert report["forward"]["finite"] and report["forward"]["logits_shape"] == [1, 8, tiny[0].vocab_size]

    _rewrite(out, "layers.2.ffn.experts.3.w2.weight", lambda t: t.update(
        {"layers.2.ffn.experts.3.w2.weight": t["layers.2.ffn.experts.3.w2.weight"][:, :-1].clone()}))
    assert main(["inspect", str(out)]) == 1
    assert "layers.2.ffn.experts.3.w2.weight: shape" in capsys.readouterr().err


def test_cli_inspect_demo_and_presets(tmp_path, capsys):
    from mol2_cli import main

    demo = Path(__file__).resolve().parents[2] / "models" / "demo" / "model"
    if (demo / "config.json").exists():  # the committed ced demo
        assert main(["inspect", str(demo), "--json", "--tokens", "4"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["family"] == "ced" and report["forward"]["finite"]
        damaged = tmp_path / "damaged"
        damaged.mkdir()
        (damaged / "config.json").write_text((demo / "config.json").read_text())
        tensors = load_file(demo / "model.safetensors")
        del tensors["model.layers.2.attn.q_proj.weight"]
        save_file(tensors, str(damaged / "model.safetensors"))
        assert main(["inspect", str(damaged)]) == 1
        assert "model.layers.2.attn.q_proj.weight: missing" in capsys.readouterr().err
    assert main(["inspect", "--preset", "deepseek-v4.1-flash", "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)["parameters"]
    assert abs(counts["backbone"] / 551.9e9 - 1) < 0.01
