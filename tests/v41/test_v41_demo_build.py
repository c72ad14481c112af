"""Pins down `mol2 build demo --family deepseek_v41 --quick`: it trains, publishes a release-format checkpoint that
checkpoint.py loads back, writes adapters that PEFT itself loads onto the native names, and skips finished stages."""

from __future__ import annotations

import json
import random

import pytest
import torch
from peft import PeftModel

from ced.adapters import read_peft_adapter
from ced.deepseek_v41 import checkpoint as ckpt
from ced.deepseek_v41.adapters import V41AdapterSet, placement_violation
from ced.demo import ADAPTERS
from engine_build.corpus import DOMAINS
from engine_build.v41_demo import QUICK, build_v41_demo

WORDS = {
    "general": "the package provides a library for tools manual page system file",
    "coding": "def return self import class None if else for in x y",
    "design": "color: #fff; margin: 0; div span button border: 1px solid;",
    "agent": "ls -l grep -r find . -name tar czf rm cp",
    "chat": "hello friend what a nice day joke laugh tell me",
}


def _corpus(root):
    """Five small domains with distinct words, enough rows for the quick size."""
    rng = random.Random(0)
    root.mkdir()
    for domain in DOMAINS:
        words = WORDS[domain].split()
        for split, n in (("train", 80), ("valid", 12)):
            with open(root / f"{domain}.{split}.jsonl", "w") as f:
                for i in range(n):
                    text = " ".join(rng.choice(words) for _ in range(rng.randint(30, 60)))
                    f.write(json.dumps({"id": f"{domain}:{split}:{i}", "domain": domain, "text": text}) + "\n")
    (root / "manifest.json").write_text("{}\n")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41_demo")
    _corpus(root / "corpus")
    out = build_v41_demo(root, quick=True, progress=False, threads=torch.get_num_threads())
    return root, out


def test_the_published_model_loads_back_in_the_release_format(built):
    _, out = built
    quant = json.loads((out / "quantization.json").read_text())
    assert [row["storage"] for row in quant["rows"]] == ["float32", "bf16", "fp8", "release"]
    assert quant["published"] == "release" and quant["shards"] >= 2
    hf = json.loads((out / "model" / "config.json").read_text())
    assert hf["model_type"] == "deepseek_v41" and hf["quantization_config"]["expert_dtype"] == "fp4"
    index = json.loads((out / "model" / ckpt.INDEX_FILE).read_text())["weight_map"]
    assert index["layers.5.ffn.experts.0.w1.weight"] != index["embed.weight"]  # sharded
    config, model = ckpt.load_checkpoint(out / "model")
    assert config.hidden_size == 64 and config.hc_mult == 4  # the v41-tiny shape
    summary = json.loads((out / "pretrain" / "summary.json").read_text())
    assert summary["steps"] == QUICK.pretrain.steps
    assert summary["final_valid_loss"] < summary["history"]["valid"][0]["loss"]  # it learned something
    ids = torch.randint(0, config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(ids)).all()


def test_adapters_load_through_peft_and_equal_the_engine(built):
    _, out = built
    config, base = ckpt.load_checkpoint(out / "model")
    rows = {row["name"]: row for row in json.loads((out / "adapters" / "adapters.json").read_text())["adapters"]}
    assert set(rows) == set(ADAPTERS) | {"random_l0"}
    ids = torch.randint(0, config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    for name in ADAPTERS:
        path = out / "adapters" / name
        modules = read_peft_adapter(path).weights
        assert modules and all(placement_violation(m, config) is None for m in modules)
        assert rows[name]["engine_logit_gap"] == 0.0
        peft = PeftModel.from_pretrained(ckpt.load_checkpoint(out / "model")[1], str(path)).eval()
        engine = V41AdapterSet(ckpt.load_checkpoint(out / "model")[1])
        engine.load(name, path)
        engine.use(name)
        with torch.no_grad():
            theirs = peft.get_base_model()(ids)
        assert torch.equal(engine.model(ids), theirs)
        assert not torch.equal(theirs, base(ids))  # the adapter changes the logits
    randomized = read_peft_adapter(out / "adapters" / "random_l0").weights
    assert any(".ffn.experts." in m for m in randomized)  # random_l0 adapts routed experts


def test_a_second_build_skips_every_finished_stage(built, capsys):
    root, out = built
    before = {p: p.stat().st_mtime_ns for p in (out / "model").iterdir()}
    build_v41_demo(root, quick=True, progress=False, threads=torch.get_num_threads())
    assert capsys.readouterr().out.count("already built") == 3
    assert {p: p.stat().st_mtime_ns for p in (out / "model").iterdir()} == before


def test_router_h19_is_pooled_over_the_streams_and_blind_to_right_padding(tiny_v41):
    from ced.deepseek_v41.model import DeepseekV41ForCausalLM
    from mol2_router.features import h19_batch

    model = DeepseekV41ForCausalLM.from_config(tiny_v41, seed=0)
    ids = torch.randint(6, tiny_v41.vocab_size, (1, 19), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([ids, torch.full((1, 7), 2)], dim=1)  # PAD after the row's real tokens
    alone, batched = h19_batch(model, ids), h19_batch(model, padded)
    assert alone.shape == (1, 19, tiny_v41.hidden_size)
    # equal up to float32 rounding (the batch's matmuls have another shape; measured 1e-6), where a padding token
    # that leaked into an earlier position would move it by O(1)
    torch.testing.assert_close(batched[:, :19], alone, rtol=0, atol=1e-5)
    with torch.no_grad():
        streams = model.run_shared(ids, 0, model.new_windows(range(tiny_v41.decoder_start + 1)),
                                   model.new_stores()).h19  # (1, T, hc, C)
    assert torch.equal(alone, streams.mean(dim=2))
