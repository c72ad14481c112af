"""benchmarks/router_accuracy on either family's demo: the head each demo ships is scored from cached H19 features of
that demo's own model, every row names the family, and the feature path routes as the serving path does (the same
head deciding after the family's engine prefilled the turn)."""

from __future__ import annotations

import pytest

from benchmarks.router_accuracy import accuracy_rows, demo_head_predictions, harness
from ced.demo import resolve_demo
from ced.families import family_of
from mol2_router import Candidate, Question
from mol2_router.data import write_questions

OPTIONS = (Candidate("chat", "small talk, jokes and everyday conversation"),
           Candidate("agent", "multi-step tasks that run shell commands and tools"),
           Candidate("coding", "writing, explaining and fixing Python code"),
           Candidate("design", "user-interface design: HTML, CSS and SVG"))
ASKS = [("Tell me a joke about cats.", "chat"), ("How was your weekend?", "chat"),
        ("List the files in /tmp, then delete the logs.", "agent"), ("Run the tests and fix what fails.", "agent"),
        ("Write a Python function that reverses a list.", "coding"), ("Why does my loop raise IndexError?", "coding"),
        ("Make a CSS button with rounded corners.", "design"), ("Draw an SVG logo of a sun.", "design")]


@pytest.mark.parametrize("folder", ["models/demo", "models/demo-v41"])
def test_the_demos_head_routes_the_same_from_features_and_through_its_engine(folder, tmp_path, monkeypatch):
    import mol2_router.pipeline

    monkeypatch.setattr(mol2_router.pipeline, "WORK", tmp_path / "router")  # the feature cache, not artifacts/
    demo = resolve_demo(folder)
    family = family_of(demo.model_dir).name
    assert family == ("ced" if folder == "models/demo" else "deepseek_v41")
    questions = [Question(q, OPTIONS, label, f"ask:{label}", f"q{i}") for i, (q, label) in enumerate(ASKS)]
    write_questions(tmp_path / "domain.bench.jsonl", questions)

    predictions = demo_head_predictions(demo, family, tmp_path, splits=["domain.bench"])
    assert list(predictions) == [("B", 0)]  # the demo's head: mode B, seed 0 (its router/config.json)
    pairs = predictions["B", 0]["domain.bench"]
    assert [q.id for q, _ in pairs] == [q.id for q in questions] and {p for _, p in pairs} <= {c.name for c in OPTIONS}
    rows = accuracy_rows("mol2", predictions, "demo", family)
    assert [(r["family"], r["checkpoint"], r["split"], r["n"]) for r in rows] == [(family, "demo", "domain.bench", 8)]

    served, _, checkpoints = harness(demo, questions, mol_tokens=2, checkpoint="last", progress=False, family=family)
    assert checkpoints["mol2"] == "demo" and set(served) == {"mol", "mol2"}
    assert [p for _, p in served["mol2"]] == [p for _, p in pairs]
