"""A tiny end-to-end run (fixture data -> H19 extraction -> head training, mode B) learns a separable toy task, for
both the MoL2 pointer head and the Contextual-MoL q/k head; the recipe modes visit the right data."""

from __future__ import annotations

import random

import pytest
import torch

from mol2_router import Candidate, Question, RouterConfig, RouteTokenizer
from mol2_router.train import OptionTable, RouteSet, TrainConfig, accuracy, new_scorer, stages, train_head
from mol2_router.features import cached_features

TOPICS = {"fruit": "apples pears plums", "tools": "hammer saw drill", "music": "guitar drum piano",
          "sea": "whale shark coral"}
WORDS = {"fruit": ["apple", "pear", "plum", "mango"], "tools": ["hammer", "saw", "drill", "wrench"],
         "music": ["guitar", "drum", "piano", "violin"], "sea": ["whale", "shark", "coral", "tide"]}


def toy_questions(n: int, seed: int, source: str) -> list[Question]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        label = rng.choice(sorted(TOPICS))
        others = rng.sample([t for t in TOPICS if t != label], rng.randint(1, 3))
        names = [label] + others
        rng.shuffle(names)
        query = " ".join(rng.choice(WORDS[label]) for _ in range(rng.randint(3, 6)))
        out.append(Question(query, tuple(Candidate(t, TOPICS[t]) for t in names), label, source, f"{source}{i}"))
    return out


@pytest.fixture(scope="module")
def toy_sets(tmp_path_factory):
    from tests.conftest import tiny_model

    root = tmp_path_factory.mktemp("toy")
    model = tiny_model()
    model.save_pretrained(root / "model")
    tok = RouteTokenizer("bytes")
    sets = {}
    for kind in ("mol2", "contextual"):
        for name, n, seed in (("generic.train", 160, 1), ("domain.train", 40, 2), ("test", 80, 3)):
            qs = toy_questions(n, seed, name)
            feats = cached_features(model, root / "model", tok, qs, root / "cache", kind, 64, progress=False, log=None)
            sets[kind, name] = RouteSet(name, qs, feats)
    return model, tok, sets


@pytest.mark.parametrize("kind", ["mol2", "contextual"])
def test_tiny_end_to_end_train_learns_a_separable_task(toy_sets, kind):
    model, tok, sets = toy_sets
    config = RouterConfig.from_name("tiny")
    table = OptionTable(tok, config.max_option_tokens) if kind == "mol2" else None
    scorer = new_scorer(kind, config, model.get_input_embeddings().weight, seed=0)
    test = sets[kind, "test"]
    before = accuracy(scorer, test, table)
    result = train_head(scorer, sets[kind, "generic.train"], sets[kind, "domain.train"], [test],
                        TrainConfig(mode="B", epochs=25, batch_size=32, lr=3e-3, warmup_steps=5), table,
                        progress=False)
    after = accuracy(scorer, test, table)
    assert after >= 0.9, (before, after, result.history[-1])
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert 1 <= result.best_epoch <= 25


def test_modes_visit_the_right_data(toy_sets):
    _, _, sets = toy_sets
    g, d = sets["mol2", "generic.train"], sets["mol2", "domain.train"]
    a, b, c = (stages(m, g, d) for m in ("A", "B", "C"))
    assert [len(s) for s in a] == [len(g)]
    assert [len(s) for s in b] == [len(g) + len(d)]
    assert [len(s) for s in c] == [len(g), len(d)] and all(rs is d for rs, _ in c[1])


def test_mode_c_first_stage_is_mode_a_bitwise(toy_sets):
    """One C run also yields the A run: its first stage's last and dev-best heads equal a separate A run's."""
    model, tok, sets = toy_sets
    config = RouterConfig.from_name("tiny", dropout=0.1)  # dropout on: the random stream must line up too
    table = OptionTable(tok, config.max_option_tokens)
    dev = [sets["mol2", "test"]]
    results = {}
    for mode in ("A", "C"):
        scorer = new_scorer("mol2", config, model.get_input_embeddings().weight, seed=3)
        results[mode] = train_head(scorer, sets["mol2", "generic.train"], sets["mol2", "domain.train"], dev,
                                   TrainConfig(mode=mode, epochs=3, batch_size=32, seed=3, warmup_steps=2), table,
                                   progress=False)
    a, first = results["A"], results["C"].stages[0]
    assert len(results["C"].stages) == 2 and len(a.stages) == 1
    assert first.best_epoch == a.best_epoch and first.history == a.history
    for mine, theirs in ((first.last, a.last), (first.best, a.best)):
        for key, value in theirs.state_dict().items():
            assert torch.equal(mine.state_dict()[key], value), key
    assert results["C"].history[:3] == a.history and len(results["C"].history) == 6


def test_batches_close_before_too_many_distinct_options():
    from mol2_router.train import source_batches

    def own_options(i):  # every question brings three options nobody else has
        return Question(f"q{i}", tuple(Candidate(f"item{i}-{j}", "x") for j in range(3)), f"item{i}-0", "match")

    rs = RouteSet("generic.train", [own_options(i) for i in range(50)], features=None)
    batches = source_batches([(rs, i) for i in range(50)], batch_size=16, rng=None, max_options=12)
    assert [len(b) for b in batches] == [4] * 12 + [2]
    assert sorted(i for b in batches for _, i in b) == list(range(50))
    shared = RouteSet("generic.train", toy_questions(50, 0, "toy"), features=None)  # four options in all
    assert [len(b) for b in source_batches([(shared, i) for i in range(50)], 16, None, max_options=12)] == [16, 16, 16, 2]


def test_mode_gaps_pair_modes_over_the_same_questions():
    from benchmarks.router_accuracy import mode_gaps
    from mol2_router.data import Candidate, Question

    options = (Candidate("a", "first"), Candidate("b", "second"))
    qs = [Question(f"q{i}", options, "a", "test", f"q{i}") for i in range(40)]

    def run(right: int):  # the first `right` questions routed right
        return {"domain.bench": [(q, "a" if i < right else "b") for i, q in enumerate(qs)]}

    predictions = {("B", 0): run(30), ("B", 1): run(34), ("C", 0): run(24), ("C", 1): run(24), ("A", 0): run(32)}
    gaps = {r["group"]: r for r in mode_gaps("mol2", predictions)}
    assert set(gaps) == {"B - A, domain.bench", "B - C, domain.bench"}  # only the splits the runs have
    c = gaps["B - C, domain.bench"]
    assert c["n"] == 40 and c["accuracy"] == pytest.approx((32 - 24) / 40) and 0 < c["low"] < c["accuracy"] < c["high"]
    a = gaps["B - A, domain.bench"]  # B's seeds average 32 right, as A's one seed: no gap, zero inside the interval
    assert a["accuracy"] == 0.0 and a["low"] < 0 < a["high"]
