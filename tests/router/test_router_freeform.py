"""The hand-written `domain.freeform` split: 40-80 requests over the four demo adapters, none following a training
template (the template check itself catches template-made queries), written over the domain data's candidates."""

from __future__ import annotations

import json

import pytest

from mol2_router.builders import (_CODE_ASKS, _DESIGN_ASKS, _DOC_ASKS, adapter_candidates, training_templates,
                                  write_freeform)
from mol2_router.data import read_questions
from mol2_router.freeform import FREEFORM, freeform_questions, template_hits


def test_size_and_classes():
    counts = {label: len(texts) for label, texts in FREEFORM.items()}
    assert set(counts) == {"chat", "agent", "coding", "design"}
    assert 40 <= sum(counts.values()) <= 80 and min(counts.values()) >= 10
    texts = [t for texts in FREEFORM.values() for t in texts]
    assert len(set(texts)) == len(texts)


def test_no_request_follows_a_training_template():
    templates = training_templates()
    assert len(templates) >= len(_CODE_ASKS + _DOC_ASKS + _DESIGN_ASKS)
    offenders = {t: hits for texts in FREEFORM.values() for t in texts if (hits := template_hits(t, templates))}
    assert not offenders


@pytest.mark.parametrize("text", ["Fix the bug in this function:\ndef f(x):\n    return x +", "Get me a text editor.",
                                  "Which tar option does this: list the archive", "Write a Python function that sorts.",
                                  "Set up nginx, please.", "Change the colours here to a dark theme:\nbody {}"])
def test_template_check_catches_template_made_queries(text):
    assert template_hits(text, training_templates())


def test_written_over_the_domain_candidates(tmp_path):
    candidates = adapter_candidates()
    questions = freeform_questions(candidates)
    (tmp_path / "domain.train.jsonl").write_text(json.dumps(questions[0].to_json()) + "\n")
    assert write_freeform(tmp_path) == len(questions)
    back = read_questions(tmp_path / "domain.freeform.jsonl")
    assert [q.query for q in back] == [q.query for q in questions]
    assert all(q.candidates == candidates and q.source == f"freeform:{q.label}" for q in back)
