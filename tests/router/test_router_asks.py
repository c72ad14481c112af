"""Requests about each domain (`mol2_router/asks.py`): verb phrases recognized, man-page summaries read, and the
train / benchmark sides disjoint in both items and phrasings."""

from __future__ import annotations

import gzip

import pytest

from mol2_router.asks import (BENCH_ONLY_PHRASINGS, PHRASINGS, _imperative, _man_summaries, _module_summaries,
                              _stdlib_sources, _third_person, ask_queries)


@pytest.mark.parametrize("phrase,expected", [
    ("Returns the size of the file.", "return the size of the file"),
    ("Searches for files in a directory hierarchy", "search for files in a directory hierarchy"),
    ("list directory contents", "list directory contents"),
    ("GNU project C and C++ compiler", None),
    ("Returns.", None),
])
def test_imperative(phrase, expected):
    assert _imperative(phrase) == expected


@pytest.mark.parametrize("imperative,expected", [
    ("return the size", "returns the size"), ("search for files", "searches for files"),
    ("copy the tree", "copies the tree"), ("display a list", "displays a list"), ("fix the box", "fixes the box"),
])
def test_third_person(imperative, expected):
    assert _third_person(imperative) == expected


def test_module_summaries_strip_the_module_name_and_the_period(tmp_path):
    (tmp_path / "csv.py").write_text('"""csv.py - read/write/investigate CSV files\n"""\n')
    (tmp_path / "bisect.py").write_text('# comment\n"""Bisection algorithms."""\n')
    (tmp_path / "_private.py").write_text('"""Hidden helpers for the rest."""\n')
    (tmp_path / "quiet.py").write_text("x = 1\n")
    assert sorted(_module_summaries(_stdlib_sources(tmp_path))) == [("bisect", "bisection algorithms"),
                                                                     ("csv", "read/write/investigate CSV files")]


def test_man_summaries_from_roff(tmp_path):
    folder = tmp_path / "man1"
    folder.mkdir()
    page = '.TH LS 1\n.SH NAME\nls \\- list directory contents\n.SH SYNOPSIS\n.B ls\n'
    (folder / "ls.1.gz").write_bytes(gzip.compress(page.encode()))
    (folder / "notes.txt").write_text(page)  # not a section-1 page
    assert list(_man_summaries("1", tmp_path)) == [("ls", "list directory contents")]


def test_train_and_bench_sides_share_neither_items_nor_phrasings():
    items = {"coding:error": [(f"e{i}", {"error": f"ValueError: bad value number {i}"}) for i in range(400)],
             "design:colour": [(f"c{i}", {"colour": f"colour {i}"}) for i in range(400)]}
    train = ask_queries(items, "train", per_class=100)
    bench = ask_queries(items, "bench", per_class=40)
    assert {len(v) for v in train.values()} == {100} and {len(v) for v in bench.values()} == {40}
    for domain in ("coding", "design"):
        assert not {qid for qid, _ in train[domain]} & {qid for qid, _ in bench[domain]}
    kind_of = {"coding": "coding:error", "design": "design:colour"}

    def opening(template):
        return template.split("{")[0] or template.split("}")[-1]

    for domain, kind in kind_of.items():
        train_only = PHRASINGS[kind][:-BENCH_ONLY_PHRASINGS]
        bench_only = PHRASINGS[kind][-BENCH_ONLY_PHRASINGS:]
        assert all(any(opening(t) in q for t in train_only) and not any(opening(t) in q for t in bench_only)
                   for _, q in train[domain])
        assert all(any(opening(t) in q for t in bench_only) for _, q in bench[domain])
    assert train == ask_queries(items, "train", per_class=100)  # deterministic


def test_accuracy_benchmark_cuts_the_bench_by_source():
    from benchmarks.router_accuracy import bench_parts
    from mol2_router.data import Candidate, Question

    options = (Candidate("chat", "talk"), Candidate("coding", "code"))
    corpus = [(Question(f"q{i}", options, "chat", "domain:chat"), "chat") for i in range(3)]
    asks = [(Question("a", options, "coding", "ask:coding"), "chat")]
    parts = bench_parts({"domain.bench": corpus + asks})
    assert parts == {"domain.bench[corpus]": corpus, "domain.bench[asks]": asks}
    assert bench_parts({"domain.bench": corpus}) == {}
