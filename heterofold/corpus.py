"""Offline real text: Debian package descriptions, man pages, fortunes, Python stdlib docstrings.

The files are read by `engine_build.sources` (the readers the demo corpus and the routing data use too); this
module keeps what HeteroFold wants of them. Every document is assigned to one split (train / calib / heldout) by
the shared `split_of` over a hash of its text, so the zoo's training text, the calibration prompts and the
evaluation text never overlap, whatever order the sources are read in.
"""
from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import unicodedata
from pathlib import Path

from engine_build.sources import (SourceMissing, default_stdlib, fortune_files, man_files, read_debian, read_fortunes,
                                  read_man_page, read_python_sources, split_of)

SPLITS = ("train", "calib", "heldout")
SHARES = (("calib", 0.1), ("heldout", 0.1))  # of the documents, by the hash of their text; train takes the rest
APT_LISTS = Path("/var/lib/apt/lists")
MAN_ROOT = Path("/usr/share/man")
FORTUNE_ROOT = Path("/usr/share/games/fortunes")


def _clean(text: str) -> str:
    text = unicodedata.normalize("NFC", text)
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def debian_descriptions(limit: int = 6000, apt_lists: Path = APT_LISTS) -> list[str]:
    """Packages whose long description has two lines or more (none when apt has no lists)."""
    try:
        lists = read_debian(apt_lists)
    except SourceMissing:
        return []
    docs, seen = [], set()
    for stanza in lists.packages:
        long = lists.long(stanza)
        if stanza.package in seen or "\n" not in long:
            continue
        seen.add(stanza.package)
        body = " ".join(line.strip() for line in long.split("\n"))
        docs.append(f"Package {stanza.package} ({stanza.section or 'misc'}): {stanza.short}.\n{body}")
        if len(docs) >= limit:
            break
    return docs


def man_pages(limit: int = 1500, seed: int = 0, root: Path = MAN_ROOT) -> list[str]:
    """Up to `limit` pages drawn at random (alias links left out), rendered to text, of more than 300 characters."""
    try:
        files = [f for f in man_files(root, "12345678") if not f.alias]
    except SourceMissing:
        return []
    random.Random(seed).shuffle(files)
    docs = []
    for file in files[:limit]:
        page = read_man_page(file)
        text = page.render() if page is not None else ""
        if len(text) > 300:
            docs.append(text[:6000])
    return docs


def fortunes(root: Path = FORTUNE_ROOT) -> list[str]:
    try:
        files = fortune_files(root)
    except SourceMissing:
        return []
    entries = (fortune.text.strip() for path in files for fortune in read_fortunes(path))
    return [entry for entry in entries if len(entry) > 40]


def stdlib_docstrings(limit: int = 1500) -> list[str]:
    """Docstrings of over 120 characters from the standard library's first 400 top-level modules."""
    try:
        files = read_python_sources(default_stdlib(), max_depth=1).files[:400]
    except SourceMissing:
        return []
    docs = []
    for file in files:
        try:
            tree = ast.parse(file.text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 120:
                    docs.append(doc)
        if len(docs) >= limit:
            break
    return docs[:limit]


def build(cache: Path | None = None) -> dict[str, list[str]]:
    """All sources, cleaned, deduplicated, split; cached as JSON when `cache` is given."""
    if cache is not None and cache.exists():
        return json.loads(cache.read_text())
    seen, out = set(), {s: [] for s in SPLITS}
    for doc in debian_descriptions() + man_pages() + fortunes() + stdlib_docstrings():
        doc = _clean(doc)
        if len(doc) < 80 or doc in seen:
            continue
        seen.add(doc)
        out[split_of(doc, SHARES, salt="heterofold")].append(doc)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(out))
    return out


def sentences(docs: list[str], min_words: int = 6, max_words: int = 16) -> list[str]:
    """Short sentences (questions to reconstruct, multiple-choice stems)."""
    out = []
    for d in docs:
        for s in re.split(r"(?<=[.!?])\s+", d.replace("\n", " ")):
            n = len(s.split())
            if min_words <= n <= max_words and s[:1].isalpha():
                out.append(s)
    return out


def fingerprint(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]
