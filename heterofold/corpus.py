"""Offline real text: Debian package descriptions, man pages, fortunes, Python stdlib docstrings.

Every document is assigned to one split (train / calib / heldout) by a hash of its text, so the zoo's training
text, the calibration prompts and the evaluation text never overlap, whatever order the sources are read in.
"""
from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

SPLITS = ("train", "calib", "heldout")


def _clean(text: str) -> str:
    text = unicodedata.normalize("NFC", text)
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def debian_descriptions(limit: int = 6000) -> list[str]:
    """Package records from `apt-cache dumpavail` (empty when apt has no lists)."""
    try:
        out = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    docs = []
    for record in out.split("\n\n"):
        fields, desc, in_desc = {}, [], False
        for line in record.splitlines():
            if in_desc and line.startswith(" "):
                desc.append("" if line.strip() == "." else line.strip())
                continue
            in_desc = False
            key, _, value = line.partition(":")
            if key == "Description":
                in_desc, desc = True, [value.strip()]
            elif key in ("Package", "Section"):
                fields[key] = value.strip()
        if "Package" in fields and len(desc) > 2:
            body = desc[0] + ".\n" + " ".join(desc[1:])
            docs.append(f"Package {fields['Package']} ({fields.get('Section', 'misc')}): {body}")
        if len(docs) >= limit:
            break
    return docs


_TROFF_ESC = re.compile(r"\\f[BIRP]|\\f\(..|\\s[+-]?\d|\\\(..|\\[&|^e]|\\\*\(..|\\\*.")


def _strip_troff(src: str) -> str:
    lines = []
    for line in src.splitlines():
        if line.startswith(('.\\"', "'\\\"")):
            continue
        if line.startswith("."):
            parts = line.split(None, 1)
            if len(parts) < 2 or parts[0] not in (".SH", ".SS", ".B", ".I", ".BR", ".IR", ".BI", ".RB", ".IP", ".TP"):
                continue
            line = parts[1].replace('"', "")
        line = _TROFF_ESC.sub("", line).replace("\\-", "-").replace("\\ ", " ").replace("\\", "")
        lines.append(line)
    return " ".join(lines)


def man_pages(limit: int = 1500, seed: int = 0) -> list[str]:
    paths = sorted(Path("/usr/share/man").glob("man[1-8]/*.gz"))
    random.Random(seed).shuffle(paths)
    docs = []
    for p in paths[:limit]:
        try:
            text = _strip_troff(gzip.open(p, "rt", errors="replace").read())
        except (OSError, EOFError):
            continue
        if len(text) > 300:
            docs.append(text[:6000])
    return docs


def fortunes() -> list[str]:
    docs = []
    for p in sorted(Path("/usr/share/games/fortunes").glob("*")):
        if p.suffix or not p.is_file():
            continue
        for chunk in p.read_text(errors="replace").split("\n%\n"):
            if len(chunk.strip()) > 40:
                docs.append(chunk.strip())
    return docs


def stdlib_docstrings(limit: int = 1500) -> list[str]:
    root = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    docs = []
    for p in sorted(root.glob("*.py"))[:400]:
        try:
            tree = ast.parse(p.read_text(errors="replace"))
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


def split_of(doc: str) -> str:
    h = int(hashlib.sha1(doc.encode()).hexdigest()[:8], 16) % 20
    return "train" if h < 16 else ("calib" if h < 18 else "heldout")


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
        out[split_of(doc)].append(doc)
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
