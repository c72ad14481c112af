"""The docs hold together: every relative link in README.md, docs/ and benchmarks/README.md points at a file (and a
heading) that exists, the README stays a front door (≤ 160 lines, the Quick start's two commands), and every design
citation in the source names a section of docs/architecture.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCE_DIRS = ["ced", "engine_build", "mol2_router", "python_backend", "heterofold", "benchmarks", "mol2_cli",
               "model_repository", "model_repository_heterofold", "tests", "scripts"]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (`§`, `:`, `'`, backticks) dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_the_pages_exist():
    for name in ("architecture", "serving", "operations", "disaggregated", "openai_api"):
        assert (ROOT / "docs" / f"{name}.md").is_file(), name
    assert (ROOT / "benchmarks" / "README.md").is_file()


def test_every_relative_link_points_at_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 160
    assert "bash scripts/setup.sh && .venv/bin/mol2 serve" in text
    assert "bash scripts/test.sh" in text


def test_design_citations_name_a_section_of_docs_architecture():
    sections = set(re.findall(r"^## §(\d+) ", (ROOT / "docs" / "architecture.md").read_text(), re.M))
    stale, unknown = [], []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            where = str(path.relative_to(ROOT))
            stale += [f"{where}: DESIGN §{n}" for n in re.findall(r"\bDESIGN §(\d+)", text)]
            unknown += [f"{where}: §{n}" for n in re.findall(r"docs/architecture\.md §(\d+)", text) if n not in sections]
    assert stale == [], "the design lives in docs/architecture.md: cite 'docs/architecture.md §N'"
    assert unknown == []
