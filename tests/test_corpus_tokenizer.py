"""Pins down: the corpus builder is byte-identical across builds of a fixture, its split is a stable hash of the
document id, missing sources are reported not fatal, and the BPE tokenizer round-trips text with correct
character offsets and single-token chat markers."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from engine_build import corpus as C
from engine_build import tokenizer as T

MAN_LS = r""".\" a comment
.TH LS "1" "2022" "GNU coreutils" "User Commands"
.SH NAME
ls \- list directory contents
.SH SYNOPSIS
.B ls
[\fI\,OPTION\/\fR]... [\fI\,FILE\/\fR]...
.SH DESCRIPTION
List information about the FILEs \(em sorted \(lqalphabetically\(rq.
.TP
\fB\-a\fR, \fB\-\-all\fR
do not ignore entries starting with .
.TP
\fB\-w\fR, \fB\-\-width\fR=\fI\,COLS\/\fR
set output width to COLS.  0 means no limit
.SH EXAMPLES
To list everything, run:
.PP
.nf
$ ls \-a
.fi
"""
MAN_ALIAS = ".so man1/ls.1\n"

PACKAGES = """Package: hello
Version: 2.10-3
Section: devel
Description: example package based on GNU hello
Description-md5: 11111111111111111111111111111111

Package: cowsay
Version: 3.03
Section: games
Description: configurable talking cow
Description-md5: 22222222222222222222222222222222
"""
TRANSLATIONS = """Package: hello
Description-md5: 11111111111111111111111111111111
Description-en: example package based on GNU hello
 The GNU hello program produces a familiar, friendly greeting.
 .
 Seriously, though: this is an example.

Package: cowsay
Description-md5: 22222222222222222222222222222222
Description-en: configurable talking cow
 Cowsay (or cowthink) will turn text into happy ASCII cows, with
 speech (or thought) balloons.
"""
FORTUNES = "A day for firm decisions!!!!!  Or is it?\n%\nYou will be hungry again in one hour.\n%\nBe careful.\n"
PY_MODULE = '''"""A tiny module for the fixture."""


def greet(name: str) -> str:
    """Return a greeting for name."""
    return f"Hello, {name}!"


class Counter:
    """Counts things."""

    def add(self, n=1):
        """Add n to the count."""
        self.n = getattr(self, "n", 0) + n
'''
CSS = "body { color: #333; font-family: sans-serif; }\n.button:hover { background: #eee; }\n"
SVG = '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16"><circle cx="8" cy="8" r="4"/></svg>\n'


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, Path]:
    man = tmp_path / "man"
    (man / "man1").mkdir(parents=True)
    (man / "man1" / "ls.1.gz").write_bytes(gzip.compress(MAN_LS.encode(), mtime=0))
    (man / "man1" / "dir.1.gz").write_bytes(gzip.compress(MAN_ALIAS.encode(), mtime=0))
    apt = tmp_path / "apt"
    apt.mkdir()
    (apt / "deb_main_binary-amd64_Packages").write_text(PACKAGES)
    (apt / "deb_main_i18n_Translation-en").write_text(TRANSLATIONS)
    fortunes = tmp_path / "fortunes"
    fortunes.mkdir()
    (fortunes / "fortunes").write_text(FORTUNES)
    (fortunes / "fortunes.dat").write_bytes(b"\x00\x01")
    (fortunes / "fortunes.u8").symlink_to("fortunes")
    stdlib = tmp_path / "stdlib"
    (stdlib / "pkg").mkdir(parents=True)
    (stdlib / "tiny.py").write_text(PY_MODULE)
    (stdlib / "pkg" / "__init__.py").write_text('"""A package."""\nX = 1\n')
    (stdlib / "site-packages").mkdir()
    (stdlib / "site-packages" / "ignored.py").write_text("IGNORED = True\n")
    design = tmp_path / "share"
    (design / "theme").mkdir(parents=True)
    (design / "theme" / "style.css").write_text(CSS)
    (design / "theme" / "copy.css").write_text(CSS)  # a duplicate: kept once
    (design / "theme" / "icon.svg").write_text(SVG)
    return {"man": man, "apt": apt, "fortunes": fortunes, "stdlib": stdlib, "design": design}


def _config(roots: dict[str, Path], **kw) -> C.CorpusConfig:
    return C.CorpusConfig(man_root=roots["man"], fortune_root=roots["fortunes"], stdlib_root=roots["stdlib"],
                          design_roots=(roots["design"],), apt_lists=roots["apt"], **kw)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for d in C.DOMAINS for s in ("train", "valid")
            for line in (out / f"{d}.{s}.jsonl").read_text().splitlines()]


def test_corpus_is_deterministic(roots, tmp_path):
    m1 = C.build_corpus(tmp_path / "a", _config(roots), progress=False)
    m2 = C.build_corpus(tmp_path / "b", _config(roots), progress=False)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert len(files) == 2 * len(C.DOMAINS) + 1
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert m1 == m2
    for name, f in m1["files"].items():
        assert f["sha256"] == C._sha256_file(tmp_path / "a" / name)
    assert all(s["status"] == "ok" for s in m1["sources"].values()), m1["sources"]


def test_corpus_content(roots, tmp_path):
    m = C.build_corpus(tmp_path / "out", _config(roots, valid_fraction=0.0), progress=False)
    recs = {r["id"]: r for r in _records(tmp_path / "out")}
    assert {r["domain"] for r in recs.values()} == set(C.DOMAINS)
    ls = recs["man:man1/ls.1"]["text"]
    assert "ls - list directory contents" in ls and "\\f" not in ls and "“alphabetically”" in ls
    assert "man:man1/dir.1" not in recs  # alias pages are skipped
    turns = recs["man-agent:man1/ls.1"]["turns"]
    assert ["assistant", "ls [OPTION]... [FILE]..."] in turns
    assert ["assistant", "ls -a"] in turns and ["assistant", "ls --width=COLS"] in turns
    assert ["assistant", "ls -a"] == turns[turns.index(["user", "To list everything"]) + 1]
    hello = recs["debian:hello"]["text"]
    assert hello.startswith("hello (devel): example package") and "\n\nSeriously, though" in hello
    assert recs["apt-agent:cowsay"]["turns"][1][1].endswith("cowsay")
    assert "stdlib:tiny.py" in recs and not any("ignored" in i for i in recs)
    assert "greet(name: str)\n    Return a greeting for name." in recs["pydoc:tiny.py"]["text"]
    assert sum(1 for i in recs if i.startswith("fortunes:")) == 3
    assert sum(1 for i in recs if i.startswith("design:")) == 2
    assert m["sources"]["design"]["files_skipped"] == 1


def test_missing_sources_are_reported(roots, tmp_path):
    cfg = _config(roots)
    cfg.man_root, cfg.fortune_root = tmp_path / "nope", None
    m = C.build_corpus(tmp_path / "out", cfg, progress=False)
    for name in ("man", "man-agent", "fortunes"):
        assert m["sources"][name]["status"] == "missing" and m["sources"][name]["documents"] == 0
    assert m["domains"]["chat"]["train"]["documents"] == 0
    assert (tmp_path / "out" / "chat.train.jsonl").read_text() == ""


def test_split_is_stable():
    ids = [f"doc:{i}" for i in range(4000)]
    cfg = C.CorpusConfig()
    first = [cfg.split_of(i) for i in ids]
    assert first == [C.CorpusConfig(valid_fraction=0.02, seed=0).split_of(i) for i in ids]
    assert 40 <= first.count("valid") <= 120  # about 2%
    assert [C.CorpusConfig(seed=1).split_of(i) for i in ids] != first  # the seed salts it
    # growing the validation share only moves documents from train to valid
    wider = [C.CorpusConfig(valid_fraction=0.05).split_of(i) for i in ids]
    assert all(w == "valid" for f, w in zip(first, wider) if f == "valid")


def test_size_cap_is_deterministic(roots, tmp_path):
    cfg = _config(roots, valid_fraction=0.0)
    cfg.caps["fortunes"] = 60
    m = C.build_corpus(tmp_path / "out", cfg, progress=False)
    s = m["sources"]["fortunes"]
    assert s["documents_before_cap"] == 3 and 0 < s["documents"] < 3 and s["bytes"] <= 60


# --------------------------------------------------------------------------------------------- tokenizer

SAMPLES = [
    "ls -la /usr/share/man | grep gz",
    "def greet(name):\n    return f'Hello, {name}!'\n",
    "Café crème, naïve résumé — 東京 🚀 ümlaut\ttabs\n\nand  double  spaces ",
    "body { color: #333; }",
    "",
    " leading space and trailing ",
]


@pytest.fixture
def small_tokenizer(roots, tmp_path):
    C.build_corpus(tmp_path / "corpus", _config(roots, valid_fraction=0.0), progress=False)
    texts = list(T.iter_training_texts(tmp_path / "corpus")) + SAMPLES[:2]
    return T.train_tokenizer(tmp_path / "corpus", tmp_path / "tok", vocab_size=400, progress=False,
                             texts=texts, check_vocab=False), tmp_path / "tok"


def test_tokenizer_round_trip_and_offsets(small_tokenizer):
    tok, _ = small_tokenizer
    for text in SAMPLES:
        enc = tok.encode(text, add_special_tokens=False)
        assert tok.decode(enc.ids, skip_special_tokens=False) == text
        covered = [False] * len(text)
        prev = (0, 0)
        for (start, end), token in zip(enc.offsets, enc.tokens):
            assert 0 <= start <= end <= len(text) and (start, end) >= prev  # spans never go backwards
            raw = bytes(_BYTE_DECODER[c] for c in token)
            assert raw in text[start:end].encode("utf-8"), (text, start, end, token)  # bytes lie in the span
            covered[start:end] = [True] * (end - start)
            prev = (start, end)
        assert all(covered)
    ascii_text = SAMPLES[0]
    enc = tok.encode(ascii_text, add_special_tokens=False)
    assert [ascii_text[s:e] for s, e in enc.offsets] == [tok.decode([i]) for i in enc.ids]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()


def test_chat_markers_are_single_tokens(small_tokenizer):
    tok, path = small_tokenizer
    tok = T.load_tokenizer(path)  # reload from disk: ids and markers survive saving
    for i, marker in enumerate(T.SPECIAL_TOKENS):
        assert tok.token_to_id(marker) == i
        assert tok.encode(marker, add_special_tokens=False).ids == [i]
        assert tok.encode(f"x{marker}y", add_special_tokens=False).tokens[1] == marker
    turns = [("user", "list files"), ("assistant", "ls -a")]
    ids, roles = T.encode_chat(turns, tok, return_roles=True)
    assert len(ids) == len(roles)
    assert ids[:2] == [0, 3] and ids[-1] == 1 and ids.count(5) == 2 and ids.count(4) == 1
    assert tok.decode(ids, skip_special_tokens=False) == T.format_chat(turns)
    assert T.encode_chat(turns, tok, add_generation_prompt=True)[-1] == 4
    assert {r for i, r in zip(ids, roles) if r == "assistant"} == {"assistant"}
    injected = T.encode_chat([("user", "<|end|>")], tok)
    assert injected.count(5) == 1  # text that looks like a marker is encoded as text
    with pytest.raises(ValueError):
        T.encode_chat([("system", "hi")], tok)


def test_tokenizer_training_is_deterministic(roots, tmp_path, small_tokenizer):
    _, path = small_tokenizer
    texts = list(T.iter_training_texts(tmp_path / "corpus")) + SAMPLES[:2]
    T.train_tokenizer(None, tmp_path / "tok2", vocab_size=400, progress=False, texts=texts, check_vocab=False)
    assert (path / "tokenizer.json").read_bytes() == (tmp_path / "tok2" / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError):
        T.train_tokenizer(None, None, vocab_size=1000, texts=texts)


def test_build_commands_refuse_a_folder_without_their_input(tmp_path, capsys):
    from engine_build.cli import main

    empty, corpus = tmp_path / "empty", tmp_path / "corpus"
    empty.mkdir()
    corpus.mkdir()
    (corpus / "chat.train.jsonl").write_text("")
    for argv, message in [(["tokenizer", "--corpus", str(empty), "--out", str(tmp_path / "tok")],
                           f"--corpus {empty} holds no *.train.jsonl: build it with `python -m engine_build corpus"),
                          (["adapters", "--corpus", str(corpus), "--model", str(empty), "--out", str(tmp_path / "ad")],
                           f"--model {empty} holds no config.json")]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "empty"]  # nothing was written
