"""Routing questions: one JSONL format for generic, domain and user data.

One question per line:

    {"query": "...", "candidates": [{"name": "chat", "description": "..."}, ...], "label": "chat",
     "source": "debian-section", "id": "optional"}

`label` names one of the candidates. A file is validated as a whole before anything uses it; a bad line is
refused with `RouteDataError` naming the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from engine_build.sources import unit_hash  # noqa: F401  the data's one hash, importable from here too (benchmarks)

MAX_DESCRIPTION_CHARS = 400  # one option's description; the head sees at most max_option_tokens tokens of it
MAX_CANDIDATES = 128
MAX_QUERY_CHARS = 100_000


class RouteDataError(ValueError):
    """A routing question that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Candidate:
    name: str
    description: str

    def option_text(self) -> str:
        """What the option side reads after the route prompt."""
        return f"{self.name}: {self.description}"


@dataclass(frozen=True)
class Question:
    query: str
    candidates: tuple[Candidate, ...]
    label: str
    source: str
    id: str = ""
    where: str = ""  # file:line, for error messages

    @property
    def label_index(self) -> int:
        return [c.name for c in self.candidates].index(self.label)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.candidates)

    def to_json(self) -> dict:
        record = {"query": self.query, "candidates": [{"name": c.name, "description": c.description}
                                                      for c in self.candidates],
                  "label": self.label, "source": self.source}
        if self.id:
            record["id"] = self.id
        return record


NOT_TEXT = "{field} holds an unpaired surrogate (a lone \\ud800-\\udfff escape), which is not text"


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def parse_question(record: object, where: str, max_description_chars: int = MAX_DESCRIPTION_CHARS) -> Question:
    def refuse(message: str):
        raise RouteDataError(f"{where}: {message}")

    if not isinstance(record, dict):
        refuse(f"expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("query", "candidates", "label") if k not in record]
    if missing:
        refuse(f"missing field(s) {missing}")
    query, candidates, label = record["query"], record["candidates"], record["label"]
    if not isinstance(query, str) or not query.strip():
        refuse("query must be a non-empty string")
    if not _is_text(query):
        refuse(NOT_TEXT.format(field="query"))
    if len(query) > MAX_QUERY_CHARS:
        refuse(f"query of {len(query)} characters is over the limit of {MAX_QUERY_CHARS}")
    if not isinstance(candidates, list) or not candidates:
        refuse("empty candidate list: a question needs at least one candidate (two to be a choice)")
    if len(candidates) > MAX_CANDIDATES:
        refuse(f"{len(candidates)} candidates, over the limit of {MAX_CANDIDATES}")
    parsed = []
    for i, c in enumerate(candidates):
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"].strip():
            refuse(f"candidate {i} needs a non-empty string 'name'")
        description = c.get("description", "")
        if not isinstance(description, str):
            refuse(f"candidate {c['name']!r}: description must be a string")
        if not (_is_text(c["name"]) and _is_text(description)):
            refuse(NOT_TEXT.format(field=f"candidate {i}"))
        if len(description) > max_description_chars:
            refuse(f"candidate {c['name']!r}: description of {len(description)} characters is over the limit of "
                   f"{max_description_chars}")
        parsed.append(Candidate(c["name"], description.strip()))
    names = [c.name for c in parsed]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        refuse(f"duplicate candidate names {duplicates}")
    if label not in names:
        refuse(f"unknown label {label!r}: not among the candidates {names[:10]}{' ...' if len(names) > 10 else ''}")
    return Question(query, tuple(parsed), label, str(record.get("source", "user")), str(record.get("id", "")), where)


def read_questions(path: str | Path, max_description_chars: int = MAX_DESCRIPTION_CHARS) -> list[Question]:
    path = Path(path)
    questions = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise RouteDataError(f"{where}: not UTF-8 (byte {raw[error.start]:#04x} at column {error.start + 1})"
                                     ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise RouteDataError(f"{where}: not valid JSON ({error.msg})") from None
            questions.append(parse_question(record, where, max_description_chars))
    if not questions:
        raise RouteDataError(f"{path}: no questions")
    return questions


def write_questions(path: str | Path, questions: Iterable[Question]) -> int:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for q in questions:
            f.write(json.dumps(q.to_json(), ensure_ascii=False) + "\n")
            n += 1
    return n

