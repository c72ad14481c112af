"""Pins down the demo build's training on the tiny preset: pretraining resumes exactly; PEFT adapters learn and load."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from ced import CEDConfig, CEDEngine, CEDForCausalLM, PlacementError
from engine_build.adapters import AdapterTrainConfig, train_adapters
from engine_build.corpus import DOMAINS
from engine_build.pretrain import PretrainConfig, pretrain
from engine_build.tokenizer import save_tokenizer, train_tokenizer

WORDS = {
    "general": ["the", "package", "provides", "a", "library", "for", "tools", "manual", "page", "system", "file"],
    "coding": ["def", "return", "self", "import", "class", "None", "if", "else", "for", "in", "x", "y"],
    "design": ["color:", "#fff;", "margin:", "0;", "div", "span", "button", "border:", "1px", "solid;"],
    "agent": ["ls", "-l", "grep", "-r", "find", ".", "-name", "tar", "czf", "rm", "cp"],
    "chat": ["hello", "friend", "what", "a", "nice", "day", "joke", "laugh", "tell", "me"],
}


def _doc(domain: str, i: int, rng: random.Random) -> dict:
    words = WORDS[domain]
    text = " ".join(words[(i + k * k) % len(words)] if rng.random() < 0.8 else rng.choice(words)
                    for k in range(rng.randint(20, 60)))
    record = {"id": f"{domain}:{i:05d}", "domain": domain, "source": "fixture", "text": text}
    if domain in ("chat", "agent"):
        record["turns"] = [["user", " ".join(words[:3])], ["assistant", text]]
        record["text"] = f"User: {' '.join(words[:3])}\nAssistant: {text}"
    return record


@pytest.fixture(scope="module")
def fixture_corpus(tmp_path_factory):
    """Five small domains with distinct word sets, and a 320-token BPE (the tiny preset's vocabulary)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for domain in DOMAINS:
        for split, n in (("train", 120), ("valid", 12)):
            with open(root / f"{domain}.{split}.jsonl", "w") as f:
                for i in range(n):
                    f.write(json.dumps(_doc(domain, i + (10_000 if split == "valid" else 0), rng)) + "\n")
    tokenizer = train_tokenizer(root, root / "tokenizer", vocab_size=320, check_vocab=False, progress=False)
    return root, root / "tokenizer", tokenizer


def _tiny_pretrain_config() -> PretrainConfig:
    return PretrainConfig(preset="tiny", tokens=6 * 4 * 64, seq_len=64, batch_size=4, warmup_steps=2, eval_every=3,
                          ckpt_every=2, valid_rows=5, bf16=False, chunk_size=32)


def test_pretraining_resumes_to_the_same_state(fixture_corpus, tmp_path):
    corpus, tokenizer_dir, _ = fixture_corpus
    cfg = _tiny_pretrain_config()
    straight = pretrain(cfg, corpus, tokenizer_dir, tmp_path / "straight", progress=False)
    first = pretrain(cfg, corpus, tokenizer_dir, tmp_path / "resumed", progress=False, stop_after=3)
    assert first == {"finished": False, "step": 3}
    assert not (tmp_path / "resumed" / "model").exists()
    resumed = pretrain(cfg, corpus, tokenizer_dir, tmp_path / "resumed", progress=False)

    assert straight["steps"] == resumed["steps"] == 6
    assert resumed["history"]["train_loss"] == straight["history"]["train_loss"]
    assert resumed["history"]["valid"] == straight["history"]["valid"]
    a = load_file(str(tmp_path / "straight" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert straight["final_valid_loss"] < straight["history"]["valid"][0]["loss"]  # it learned something
    assert (tmp_path / "straight" / "pretrain" / "loss_curve.png").stat().st_size > 0
    assert not (tmp_path / "straight" / "pretrain" / "work").exists()  # checkpoint and rows removed at the end
    reloaded = CEDForCausalLM.from_pretrained(tmp_path / "straight" / "model")
    assert reloaded.ced == CEDConfig.from_name("tiny")


def test_the_model_vocabulary_follows_the_tokenizer(fixture_corpus, tmp_path):
    corpus, _, _ = fixture_corpus
    larger = train_tokenizer(corpus, tmp_path / "tokenizer", vocab_size=400, check_vocab=False, progress=False)
    assert larger.get_vocab_size() > CEDConfig.from_name("tiny").vocab_size
    pretrain(_tiny_pretrain_config(), corpus, tmp_path / "tokenizer", tmp_path / "out", progress=False)
    model = CEDForCausalLM.from_pretrained(tmp_path / "out" / "model")
    assert model.ced.vocab_size == larger.get_vocab_size()


def test_peft_adapters_lower_the_loss_and_pass_the_placement_check(fixture_corpus, tmp_path):
    corpus, _, tokenizer = fixture_corpus
    model_dir = tmp_path / "model"
    CEDForCausalLM.from_ced(CEDConfig.from_name("tiny"), seed=0).save_pretrained(model_dir)
    save_tokenizer(tokenizer, model_dir)
    cfg = AdapterTrainConfig(rank=4, alpha=8, lr=1e-2, steps=12, warmup_steps=2, batch_size=4, seq_len=64,
                             valid_rows=6, bf16=False, chunk_size=32, random_rank=2)
    rows = {r["name"]: r for r in train_adapters(corpus, model_dir, tmp_path / "adapters", cfg, progress=False)}

    assert set(rows) == {"chat", "agent", "coding", "design", "every_layer", "random_l0"}
    for name in ("chat", "agent", "coding", "design"):
        assert rows[name]["adapter_valid_loss"] < rows[name]["base_valid_loss"], rows[name]
        assert rows[name]["engine"] == "loads"
        assert rows[name]["engine_logit_gap"] < 1e-4  # the engine's slots compute what PEFT computes
    assert rows["every_layer"]["adapter_valid_loss"] < rows["every_layer"]["base_valid_loss"]
    assert rows["every_layer"]["engine"].startswith("refused")

    engine = CEDEngine(CEDForCausalLM.from_pretrained(model_dir), max_adapters=8, max_rank=16)
    for name in ("chat", "agent", "coding", "design", "random_l0"):
        engine.adapters.load(name, tmp_path / "adapters" / name)
    with pytest.raises(PlacementError, match="encoder layer"):
        engine.adapters.load("every_layer", tmp_path / "adapters" / "every_layer")
    assert (tmp_path / "adapters" / "coding" / "description.txt").read_text().strip()
    table = json.loads((tmp_path / "adapters" / "adapters.json").read_text())
    assert [r["name"] for r in table["adapters"]] == list(rows)


def test_adapter_build_takes_ranks_above_16_and_checks_validation_first(fixture_corpus, tmp_path):
    import shutil

    corpus, _, tokenizer = fixture_corpus
    model_dir = tmp_path / "model"
    CEDForCausalLM.from_ced(CEDConfig.from_name("tiny"), seed=0).save_pretrained(model_dir)
    save_tokenizer(tokenizer, model_dir)
    cfg = AdapterTrainConfig(rank=32, alpha=64, steps=3, warmup_steps=1, batch_size=2, seq_len=64, valid_rows=2,
                             bf16=False, chunk_size=32, random_rank=2)
    rows = {r["name"]: r for r in train_adapters(corpus, model_dir, tmp_path / "adapters", cfg, progress=False)}
    assert all(rows[name]["engine"] == "loads" for name in ("chat", "agent", "coding", "design"))

    small = tmp_path / "small"
    shutil.copytree(corpus, small)
    (small / "coding.valid.jsonl").write_text("")
    with pytest.raises(ValueError, match="coding.valid packs into no 64-token row"):
        train_adapters(small, model_dir, tmp_path / "refused", cfg, progress=False)
    assert not (tmp_path / "refused" / "chat").exists()   # refused before any adapter was trained


def test_publish_drops_the_float32_builds_file_table():
    from engine_build.publish import without_files_section

    readme = "# Demo\n\n## Adapters\n\nrows\n\n## Files (42.5 MB)\n\n| model.safetensors | 36,329,536 |\n\n## After\n\nkept\n"
    published = without_files_section(readme)
    assert "36,329,536" not in published and "published.json" in published
    assert published.startswith("# Demo\n\n## Adapters\n\nrows\n") and published.endswith("## After\n\nkept\n")
    assert without_files_section("# no table\n") == "# no table\n"
