"""Routing data: bad questions refused naming the file and line; builders give 2..77 candidates with the label among
them; batched right-padded H19 extraction equals engine.prefill; the feature cache resumes from its shards."""

from __future__ import annotations

import json

import pytest
import torch

from ced import CEDEngine
from mol2_router.builders import _question, debian_records, debian_section_questions, fortune_questions
from mol2_router.data import RouteDataError, read_questions
from mol2_router.features import RouteTokenizer, cached_features, h19_batch, mol2_layout, option_tokens, pad_batch

GOOD = {"query": "list my files", "candidates": [{"name": "agent", "description": "shell"},
                                                 {"name": "chat", "description": "small talk"}],
        "label": "agent", "source": "test"}


def write(tmp_path, records):
    path = tmp_path / "q.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.mark.parametrize("bad,message", [
    ({**GOOD, "label": "coding"}, "unknown label 'coding'"),
    ({**GOOD, "candidates": []}, "empty candidate list"),
    ({**GOOD, "candidates": [{"name": "agent", "description": "x" * 401}, {"name": "chat"}]},
     "description of 401 characters is over the limit"),
    ({**GOOD, "candidates": [{"name": "agent"}, {"name": "agent"}]}, "duplicate candidate names"),
    ({"candidates": GOOD["candidates"], "label": "agent"}, "missing field"),
    ("{not json", "not valid JSON"),
    (json.dumps({**GOOD, "query": "a \ud800 b"}), "query holds an unpaired surrogate"),      # stays a \\ud800 escape
    (json.dumps({**GOOD, "candidates": [{"name": "agent", "description": "\udc00"}, {"name": "chat"}]}),
     "candidate 0 holds an unpaired surrogate"),
])
def test_bad_questions_are_refused_naming_the_line(tmp_path, bad, message):
    path = write(tmp_path, [GOOD, GOOD, bad])
    with pytest.raises(RouteDataError, match=message) as error:
        read_questions(path)
    assert f"{path}:3" in str(error.value)


def test_good_file_and_over_long_option_in_tokens(tmp_path):
    questions = read_questions(write(tmp_path, [GOOD, {**GOOD, "label": "chat"}]))
    assert [q.label_index for q in questions] == [0, 1]
    assert questions[1].where.endswith(":2")
    with pytest.raises(RouteDataError, match=r"q.jsonl:2: option .* over max_option_tokens=8"):
        option_tokens(RouteTokenizer("bytes"), questions[1].candidates[1].option_text(), 8, questions[1].where)


def test_candidate_sets_have_2_to_77_options_with_the_label():
    labels = {f"l{i}": f"label {i}" for i in range(120)}
    sizes = set()
    for i in range(300):
        q = _question(f"q{i}", "text", "l7", labels, "test")
        assert 2 <= len(q.candidates) <= 77 and "l7" in q.names and len(set(q.names)) == len(q.names)
        sizes.add(len(q.candidates))
    assert min(sizes) < 10 and max(sizes) > 60  # each question draws its own size


def test_builders_on_small_real_format_fixtures(tmp_path):
    fortunes = tmp_path / "fortunes"
    fortunes.mkdir()
    for cat in ("art", "food", "law"):
        (fortunes / cat).write_text("\n%\n".join(f"A saying about {cat} number {i} that is long enough."
                                                   for i in range(5)) + "\n")
        (fortunes / f"{cat}.dat").write_bytes(b"\0")
    qs = fortune_questions(fortunes, 9)
    assert len(qs) == 9 and {q.label for q in qs} == {"art", "food", "law"}
    lists = tmp_path / "lists"
    lists.mkdir()
    (lists / "x_Packages").write_text(
        "Package: foo\nSection: python\nDescription: a python thing\n more text\nTag: role::program, use::editing\n\n"
        "Package: bar\nSection: games\nDescription: a game\n fun\n")
    records = debian_records(lists)
    assert [r["name"] for r in records] == ["bar", "foo"] and records[1]["tags"] == ["role::program", "use::editing"]
    qs = debian_section_questions(records, 10)
    assert {q.label for q in qs} == {"python", "games"} and all(q.query.startswith("a ") for q in qs)


def test_right_padded_batch_extraction_equals_engine_prefill(tiny_model):
    model = tiny_model()
    engine = CEDEngine(model)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(6, 300, (n,), generator=g).tolist() for n in (5, 16, 23, 41)]  # over block and chunk edges
    ids, lengths = pad_batch(rows)
    batched = h19_batch(model, ids, chunk=16)  # several chunks, like the engine's prefill_chunk
    for row, n in zip(rows, lengths.tolist()):
        state = engine.new_conversation()
        torch.testing.assert_close(batched[rows.index(row), :n], engine.prefill(state, row), rtol=1e-5, atol=1e-5)


def test_feature_cache_is_sharded_and_resumes(tiny_model, tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "model")
    questions = read_questions(write(tmp_path, [{**GOOD, "query": f"request number {i}"} for i in range(7)]))
    logs = []
    first = cached_features(model, tmp_path / "model", RouteTokenizer("bytes"), questions, tmp_path / "cache",
                            shard_size=3, progress=False, log=logs.append)
    shards = sorted((tmp_path / "cache").glob("*/shard_*.safetensors"))
    assert len(shards) == 3 and first.query.shape == (7, 64)
    shards[1].unlink()  # an interrupted run: one shard missing
    logs.clear()
    again = cached_features(model, tmp_path / "model", RouteTokenizer("bytes"), questions, tmp_path / "cache",
                            shard_size=3, progress=False, log=logs.append)
    assert "1 of 3 shards to do" in logs[0]
    torch.testing.assert_close(again.query, first.query)
    tok = RouteTokenizer("bytes")
    lay = mol2_layout(tok, questions[4])
    engine = CEDEngine(model)
    h19 = engine.prefill(engine.new_conversation(), lay.ids)
    torch.testing.assert_close(first.query[4], h19[lay.query[0]: lay.query[1]].mean(0), rtol=1e-5, atol=1e-5)
