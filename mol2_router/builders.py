"""Builders of routing questions from offline real text (RESOURCES.md), in the format of `data.py`.

Generic data (every question has its own candidate set of 2..77 options, so fixed labels cannot be memorized):
- `debian-section`: a package's description -> its archive section (section texts as on packages.debian.org);
- `debtags:<facet>`: a package's description -> its one tag in a facet (tag texts from the debtags vocabulary);
- `fortune`: a fortune cookie -> its category;
- `man-section`: a man page's one-line summary -> its manual section (section texts from man(1)).
Domain data: queries for the four demo adapters (chat, agent, coding, design) from the corpus, with the
adapters' own descriptions; the corpus train split feeds domain train/dev, its valid split the held-out benchmark.
Beside them, requests about each domain made from offline text (`asks.py`, source `ask:<domain>`), with held-out
items and phrasings in the benchmark.
`domain.freeform` adds hand-written requests that follow no training template (`freeform.py`; test only).
The files are read by `engine_build.sources`, the readers the demo corpus and HeteroFold use too.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Iterator

from engine_build.sources import SourceMissing, deb822, man_files, read_debian, read_man, split_of, unit_hash

from .asks import PHRASINGS, ask_items, ask_queries, fortune_cookies
from .data import Candidate, Question, read_questions, write_questions
from .freeform import freeform_questions

MIN_CANDIDATES, MAX_CANDIDATES = 2, 77
GENERIC_SHARES = (("test", 0.1), ("dev", 0.1))  # of the generic questions, by the hash of their id; train the rest

DEBIAN_SECTIONS = {  # packages.debian.org section texts
    "admin": "Administration Utilities: utilities to administer system resources, manage user accounts, etc.",
    "cli-mono": "Mono/CLI: everything about Mono and the Common Language Infrastructure.",
    "comm": "Communication Programs: software to use your modem in the old fashioned style.",
    "database": "Databases: database servers and clients.",
    "debug": "Debug packages: debugging information for executables and shared libraries.",
    "devel": "Development: development utilities, compilers, development environments, libraries, etc.",
    "doc": "Documentation: FAQs, HOWTOs and other documents, and software needed to browse documentation.",
    "editors": "Editors: software to edit files. Programming environments.",
    "education": "Education: software for learning and teaching.",
    "electronics": "Electronics: electronics utilities.",
    "embedded": "Embedded software: software suitable for use in embedded applications.",
    "fonts": "Fonts: font packages.",
    "games": "Games: programs to spend a nice time with after all this setting up.",
    "gnome": "GNOME: the GNOME desktop environment, a set of integrated applications.",
    "gnu-r": "GNU R: everything about GNU R, a statistical computation and graphics system.",
    "gnustep": "GNUstep: the GNUstep environment.",
    "golang": "Go: Go programming language, libraries, and development tools.",
    "graphics": "Graphics: editors, viewers, converters... everything to become an artist.",
    "hamradio": "Ham Radio: software for ham radio.",
    "haskell": "Haskell: everything about Haskell.",
    "httpd": "Web Servers: web servers and their modules.",
    "interpreters": "Interpreters: all kind of interpreters for interpreted languages. Macro processors.",
    "introspection": "Introspection: machine readable introspection data for use by development tools.",
    "java": "Java: everything about Java.",
    "javascript": "JavaScript: JavaScript programming language, libraries, and development tools.",
    "kde": "KDE: the K Desktop Environment, a set of integrated applications.",
    "kernel": "Kernels: operating system kernels and related modules.",
    "libdevel": "Library development: libraries necessary for developers to write programs that use them.",
    "libs": "Libraries: libraries to make other programs work.",
    "lisp": "Lisp: everything about Lisp.",
    "localization": "Language packs: localization support for big software packages.",
    "mail": "Mail: programs to route, read, and compose e-mail messages.",
    "math": "Mathematics: math software.",
    "metapackages": "Meta packages: packages that mainly provide dependencies on other packages.",
    "misc": "Miscellaneous: miscellaneous utilities that didn't fit well anywhere else.",
    "net": "Network: daemons and clients to connect your system to the world.",
    "news": "Newsgroups: software to access Usenet, to set up news servers, etc.",
    "ocaml": "OCaml: everything about OCaml, an ML language implementation.",
    "oldlibs": "Old Libraries: old versions of libraries, kept for backward compatibility.",
    "otherosfs": "Other OS's and file systems: run programs of other operating systems, use their filesystems.",
    "perl": "Perl: everything about Perl, an interpreted scripting language.",
    "php": "PHP: everything about PHP.",
    "python": "Python: everything about Python, an interpreted, interactive object oriented language.",
    "ruby": "Ruby: everything about Ruby, an interpreted object oriented language.",
    "rust": "Rust: Rust programming language, library crates, and development tools.",
    "science": "Science: basic tools for scientific work.",
    "shells": "Shells: command shells. Friendly user interfaces for beginners.",
    "sound": "Sound: utilities to deal with sound: mixers, players, recorders, CD players, etc.",
    "tasks": "Tasks: packages used by tasksel to configure the system for a specific task.",
    "tex": "TeX: the famous typesetting software and related programs.",
    "text": "Text Processing: utilities to format and print text documents.",
    "utils": "Utilities: file and disk manipulation, backup and archive tools, system monitoring, etc.",
    "vcs": "Version Control Systems: version control systems and related utilities.",
    "video": "Video: video viewers, editors, recording, streaming.",
    "web": "Web Software: web servers, browsers, proxies, download tools etc.",
    "x11": "X Window System software: X servers, libraries, window managers, terminal emulators.",
    "xfce": "Xfce: a fast and lightweight desktop environment.",
    "zope": "Zope/Plone Framework: Zope application server and Plone content management system.",
}

MAN_SECTIONS = {  # man(1)
    "1": "Executable programs or shell commands",
    "2": "System calls (functions provided by the kernel)",
    "3": "Library calls (functions within program libraries)",
    "4": "Special files (usually found in /dev)",
    "5": "File formats and conventions, e.g. /etc/passwd",
    "6": "Games",
    "7": "Miscellaneous (including macro packages and conventions)",
    "8": "System administration commands (usually only for root)",
}

FACETS = ("use", "works-with", "implemented-in", "interface", "role", "scope", "field", "game", "uitoolkit",
          "network", "admin", "x11", "made-of", "works-with-format", "protocol", "hardware", "security")


# -- Debian package records ----------------------------------------------------------------------------

def debian_records(apt_lists: str | Path) -> list[dict]:
    """One record per package, from its first paragraph listed: name, section (its last part), short, long, tags.
    SourceMissing (a FileNotFoundError) when the folder holds no Packages file."""
    lists = read_debian(Path(apt_lists))
    first = {}
    for stanza in lists.packages:
        first.setdefault(stanza.package, stanza)
    return [{"name": name, "section": first[name].section.split("/")[-1], "short": first[name].short,
             "long": lists.long(first[name]), "tags": list(first[name].tags)} for name in sorted(first)]


def _package_query(rec: dict, max_chars: int = 400) -> str:
    text = rec["short"].rstrip(".") + "."
    if rec["long"]:
        text += " " + " ".join(rec["long"].split())
    return text[:max_chars].rsplit(" ", 1)[0] if len(text) > max_chars else text


def debtags_vocabulary(path: str | Path | None = None, workdir: str | Path = "artifacts/router/debtags") -> dict:
    """tag -> description from the debtags vocabulary; fetched with `apt-get download debtags` when missing."""
    candidates = [Path(path)] if path else [Path("/usr/share/debtags/vocabulary"),
                                            Path(workdir) / "usr/share/debtags/vocabulary"]
    found = next((p for p in candidates if p.exists()), None)
    if found is None and path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        work = Path(workdir).resolve()
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", "debtags"], cwd=work, capture_output=True)
        debs = sorted(work.glob("debtags_*.deb"))
        if debs:
            subprocess.run(["dpkg", "-x", str(debs[-1]), str(work)], check=True, capture_output=True)
            found = work / "usr/share/debtags/vocabulary"
    if found is None or not found.exists():
        return {}
    vocabulary = {}
    for rec in deb822(found.read_text(encoding="utf-8", errors="replace")):
        if "Tag" in rec and "Description" in rec:
            short, _, rest = rec["Description"].partition("\n")
            first = " ".join(rest.split()).split(". ")[0].rstrip(".")
            text = f"{short.strip()}. {first}." if first and first != "." else short.strip()
            vocabulary[rec["Tag"]] = text if len(text) <= 160 else text[:160].rsplit(" ", 1)[0]
    return vocabulary


# -- question sampling ---------------------------------------------------------------------------------

def _question(qid: str, query: str, label: str, labels: dict[str, str], source: str) -> Question:
    """A question whose candidate set is the label plus k-1 distractors, k drawn from the question's own hash."""
    rng = random.Random(int(unit_hash(qid, "candidates") * 2 ** 32))
    k = rng.randint(MIN_CANDIDATES, min(MAX_CANDIDATES, len(labels)))
    others = sorted(n for n in labels if n != label)
    names = [label] + rng.sample(others, k - 1)
    rng.shuffle(names)
    return Question(query, tuple(Candidate(n, labels[n]) for n in names), label, source, qid)


def _stratified(items: dict[str, list], total: int, salt: str) -> list:
    """Up to `total` items, round-robin over labels (each label's items in hash order)."""
    pools = {k: sorted(v, key=lambda item: unit_hash(str(item[0]), salt)) for k, v in items.items() if v}
    out, depth = [], 0
    while len(out) < total and any(depth < len(v) for v in pools.values()):
        for k in sorted(pools):
            if depth < len(pools[k]) and len(out) < total:
                out.append(pools[k][depth])
        depth += 1
    return out


def debian_section_questions(records: list[dict], total: int) -> list[Question]:
    by_section = defaultdict(list)
    for rec in records:
        if rec["section"] in DEBIAN_SECTIONS and rec["short"]:
            by_section[rec["section"]].append((rec["name"], rec))
    return [_question(f"debian-section:{name}", _package_query(rec), rec["section"], DEBIAN_SECTIONS, "debian-section")
            for name, rec in _stratified(by_section, total, "debian-section")]


def debtags_questions(records: list[dict], vocabulary: dict[str, str], total: int) -> list[Question]:
    """One question per (package, facet) where the package has exactly one tag of that facet."""
    by_facet_tag: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        facets = defaultdict(list)
        for tag in rec["tags"]:
            facets[tag.split("::")[0]].append(tag)
        for facet, tags in facets.items():
            if facet in FACETS and len(tags) == 1 and rec["short"]:
                by_facet_tag[facet][tags[0]].append((rec["name"], rec))
    questions = []
    usable = {f: t for f, t in by_facet_tag.items() if len(t) >= MIN_CANDIDATES}
    per_facet = max(1, total // max(1, len(usable)))
    for facet in sorted(usable):
        labels = {tag: vocabulary.get(tag, tag.split("::")[1].replace("-", " ").replace(":", " "))
                  for tag in usable[facet]}
        for name, rec in _stratified(usable[facet], per_facet, f"debtags:{facet}"):
            tag = next(t for t in rec["tags"] if t.startswith(facet + "::"))
            questions.append(_question(f"debtags:{facet}:{name}", _package_query(rec), tag, labels, f"debtags:{facet}"))
    return questions[:total]


def fortune_questions(root: str | Path, total: int) -> list[Question]:
    root = Path(root)
    if not root.is_dir():
        return []
    by_category = defaultdict(list)
    for category, cookie, i in fortune_cookies(root):
        by_category[category].append((f"{category}:{i}", cookie))
    labels = {c: f"fortune cookies filed under '{c.replace('-', ' ')}'" for c in by_category}
    return [_question(f"fortune:{key}", cookie, key.split(":")[0], labels, "fortune")
            for key, cookie in _stratified(by_category, total, "fortune")]


_NAME_LINE = re.compile(r"^\s*(?P<names>[^\s].*?)\s+\\?[-\u2013]\s+(?P<what>.+)$")


def _man_summary(path: Path) -> str | None:
    """The page's one-line summary (its NAME line's, or mdoc's .Nd), of 8 characters or more."""
    text = read_man(path)
    if text is None:
        return None
    lines = text.splitlines()[:200]
    for i, line in enumerate(lines):
        if re.match(r'^\.S[Hh]\s+"?(NAME|Name)"?\s*$', line):
            for nxt in lines[i + 1: i + 6]:
                if nxt.startswith(".Nd "):
                    return nxt[4:].strip()
                match = _NAME_LINE.match(nxt.replace("\\-", "-").replace("\\(em", "-"))
                if match and not nxt.startswith("."):
                    what = re.sub(r"\\f[BIRP]|\\[&e]", "", match["what"]).strip()
                    return what if len(what) >= 8 else None
    return None


def man_questions(root: str | Path, total: int) -> list[Question]:
    try:
        files = man_files(Path(root), MAN_SECTIONS)  # aliases too: each link's name is a question of its own
    except SourceMissing:
        return []
    paths_of = defaultdict(list)
    for file in files:
        paths_of[file.folder[3:]].append(file.path)
    per_section = 4 * total // len(MAN_SECTIONS)
    by_section = {section: [(p.name, p) for p in sorted(paths, key=lambda p: unit_hash(p.name, "man"))[:per_section]]
                  for section, paths in paths_of.items()}
    out = []
    for name, path in _stratified(by_section, 3 * total, "man-section"):
        summary = _man_summary(path)
        if summary:
            section = path.parent.name[3:]
            out.append(_question(f"man:{name}", summary[0].upper() + summary[1:], section, MAN_SECTIONS, "man-section"))
    return out[:total]


# -- domain data for the demo adapters --------------------------------------------------------------------

_CODE_ASKS = ("{code}", "Explain what this code does:\n{code}", "Fix the bug in this function:\n{code}",
              "Add type hints and a docstring:\n{code}", "Write a unit test for this:\n{code}")
_DOC_ASKS = ("Write a Python function that {what}", "How do I write Python code that {what}?",
             "Implement in Python: {what}")
_DESIGN_ASKS = ("{code}", "Make this look better:\n{code}", "Why does this render wrong?\n{code}",
                "Convert this to a cleaner layout:\n{code}", "Change the colours here to a dark theme:\n{code}")


def _code_chunks(text: str, rng: random.Random, max_lines: int = 12) -> Iterator[str]:
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"\s*(def|class|async def) \w", line)]
    for i in starts:
        chunk = "\n".join(lines[i: i + rng.randint(3, max_lines)]).strip()
        if 40 <= len(chunk) <= 800:
            yield chunk


def _docstring_asks(text: str) -> Iterator[str]:
    for match in re.finditer(r'def \w+\([^)]*\)[^:]*:\s*\n\s*"""(?P<doc>[^\n"]{15,160})', text):
        doc = match["doc"].strip().rstrip(".")
        if doc[:1].isupper() and doc.split()[0].endswith("s"):  # "Returns ...", "Creates ..." -> "returns ..."
            yield doc[0].lower() + doc[1:] + "."


def _design_chunks(text: str, rng: random.Random, max_lines: int = 12) -> Iterator[str]:
    lines = [line for line in text.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if re.search(r"[{<]", line)]
    rng.shuffle(starts)
    for i in starts[:40]:
        chunk = "\n".join(lines[i: i + rng.randint(3, max_lines)]).strip()
        if 40 <= len(chunk) <= 800:
            yield chunk


def domain_queries(corpus: str | Path, split: str, per_class: int, seed: int = 0) -> dict[str, list[tuple[str, str]]]:
    """(id, query) per demo domain from the corpus split, at most `per_class` each, deduplicated."""
    rng = random.Random(f"{seed}:{split}")
    found: dict[str, dict[str, str]] = {d: {} for d in ("chat", "agent", "coding", "design")}
    for domain in found:
        path = Path(corpus) / f"{domain}.{split}.jsonl"
        with path.open(encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                if "turns" in rec:
                    for j, (role, text) in enumerate(rec["turns"]):
                        if role == "user" and 8 <= len(text) <= 600:
                            found[domain].setdefault(text, f"{rec['id']}:{j}")
                    if domain == "chat":  # a user who shares a quote or a joke is making small talk
                        reply = " ".join(rec["turns"][-1][1].split())
                        if 20 <= len(reply) <= 300:
                            found[domain].setdefault(reply, f"{rec['id']}:text")
                elif domain == "coding":
                    for k, chunk in enumerate(_code_chunks(rec["text"], rng)):
                        found[domain].setdefault(rng.choice(_CODE_ASKS).format(code=chunk), f"{rec['id']}:{k}")
                    for k, what in enumerate(_docstring_asks(rec["text"])):
                        found[domain].setdefault(rng.choice(_DOC_ASKS).format(what=what), f"{rec['id']}:doc{k}")
                elif domain == "design":
                    for k, chunk in enumerate(_design_chunks(rec["text"], rng)):
                        found[domain].setdefault(rng.choice(_DESIGN_ASKS).format(code=chunk), f"{rec['id']}:{k}")
    out = {}
    for domain, queries in found.items():
        items = sorted(queries.items(), key=lambda kv: unit_hash(kv[1] + kv[0], f"domain:{seed}"))
        out[domain] = [(qid, text) for text, qid in items[:per_class]]
    return out


def adapter_candidates(adapters_dir: str | Path | None = None) -> tuple[Candidate, ...]:
    """The four demo adapters with their descriptions (description.txt beside each adapter, else ced.demo)."""
    from ced.demo import ADAPTERS

    out = []
    for name, default in ADAPTERS.items():
        path = Path(adapters_dir) / name / "description.txt" if adapters_dir else None
        text = path.read_text().strip() if path is not None and path.exists() else default
        out.append(Candidate(name, " ".join(text.split())[:400]))
    return tuple(out)


def domain_questions(corpus: str | Path, candidates: tuple[Candidate, ...], train_per_class: int,
                     bench_per_class: int, dev_fraction: float = 0.1, seed: int = 0, asks: dict | None = None,
                     asks_per_class: int = 0) -> dict[str, list[Question]]:
    """domain.train / domain.dev from the corpus train split; domain.bench from its valid split, minus any query
    text that also occurs in train (held out). With `asks` (`asks.ask_items`), each domain also gets up to
    `asks_per_class` requests about it in train/dev and a third as many in the benchmark (source `ask:<domain>`),
    from held-out items and phrasings."""
    train = domain_queries(corpus, "train", int(train_per_class * (1 + dev_fraction)) + 1, seed)
    bench = domain_queries(corpus, "valid", 4 * bench_per_class, seed)
    seen = {text for items in train.values() for _, text in items}
    use_asks = bool(asks) and asks_per_class > 0
    ask_train = ask_queries(asks, "train", int(asks_per_class * (1 + dev_fraction)) + 1, seed) if use_asks else {}
    ask_bench = ask_queries(asks, "bench", asks_per_class // 3, seed) if use_asks else {}
    out = {"domain.train": [], "domain.dev": [], "domain.bench": []}
    for domain in (c.name for c in candidates):
        for qid, text in train.get(domain, []) + ask_train.get(domain, []):
            source = f"ask:{domain}" if qid.startswith("ask:") else f"domain:{domain}"
            q = Question(text, candidates, domain, source, f"{domain}:{qid}")
            out["domain.dev" if unit_hash(qid, "domain-dev") < dev_fraction else "domain.train"].append(q)
        held = [(qid, text) for qid, text in bench.get(domain, []) if text not in seen][:bench_per_class]
        out["domain.bench"] += [Question(text, candidates, domain, f"domain:{domain}", f"{domain}:{qid}")
                                for qid, text in held]
        out["domain.bench"] += [Question(text, candidates, domain, f"ask:{domain}", f"{domain}:{qid}")
                                for qid, text in ask_bench.get(domain, [])]
    return out


def training_templates() -> list[str]:
    """The format strings the domain queries are made from: these builders', the phrasings of the requests about
    each domain (the benchmark-only ones too) and the demo corpus's prompts. `freeform.template_hits` checks the
    hand-written requests against them."""
    from engine_build import corpus  # the corpus's prompts; imported here, for the one caller that needs them

    templates = [*_CODE_ASKS, *_DOC_ASKS, *_DESIGN_ASKS]
    templates += [p for phrasings in PHRASINGS.values() for p in phrasings]
    return templates + [*corpus._APT_PROMPTS, *corpus._SYNOPSIS_PROMPTS, *corpus._OPTION_PROMPTS]


def write_freeform(out: str | Path, adapters_dir: str | Path | None = None) -> int:
    """Write domain.freeform.jsonl under `out`, over the same candidates as the folder's domain.train.jsonl
    (else the demo adapters'); returns the count."""
    train = Path(out) / "domain.train.jsonl"
    candidates = read_questions(train)[0].candidates if train.exists() else adapter_candidates(adapters_dir)
    return write_questions(Path(out) / "domain.freeform.jsonl", freeform_questions(candidates))


# -- everything -----------------------------------------------------------------------------------------------

def build_all(out: str | Path, corpus: str | Path = "artifacts/corpus", apt_lists: str | Path = "artifacts/apt/lists",
              fortune_root: str | Path = "/usr/share/games/fortunes", man_root: str | Path = "/usr/share/man",
              adapters_dir: str | Path | None = None, generic_total: int = 6000, train_per_class: int = 300,
              bench_per_class: int = 100, asks_per_class: int = 300, seed: int = 0, log=print) -> dict[str, int]:
    """Write generic.{train,dev,test}.jsonl and domain.{train,dev,bench}.jsonl under `out`; returns counts."""
    out = Path(out)
    share = {"debian-section": 0.3, "debtags": 0.35, "fortune": 0.2, "man-section": 0.15}
    generic: list[Question] = []
    try:
        records = debian_records(apt_lists)
    except FileNotFoundError as error:
        log(f"skipping Debian sources: {error}")
        records = []
    if records:
        generic += debian_section_questions(records, int(generic_total * share["debian-section"]))
        vocabulary = debtags_vocabulary()
        if not vocabulary:
            log("debtags vocabulary not found: tag names stand in for descriptions")
        generic += debtags_questions(records, vocabulary, int(generic_total * share["debtags"]))
    generic += fortune_questions(fortune_root, int(generic_total * share["fortune"]))
    generic += man_questions(man_root, int(generic_total * share["man-section"]))
    counts = {}
    for split in ("train", "dev", "test"):
        rows = [q for q in generic if split_of(q.id, GENERIC_SHARES, salt="split") == split]
        counts[f"generic.{split}"] = write_questions(out / f"generic.{split}.jsonl", rows)
    asks = ask_items(man_root, fortune_root=fortune_root, debian=records) if asks_per_class else None
    domain = domain_questions(corpus, adapter_candidates(adapters_dir), train_per_class, bench_per_class, seed=seed,
                              asks=asks, asks_per_class=asks_per_class)
    for name, rows in domain.items():
        counts[name] = write_questions(out / f"{name}.jsonl", rows)
    counts["domain.freeform"] = write_freeform(out, adapters_dir)
    (out / "manifest.json").write_text(json.dumps({"counts": counts, "sources": sorted({q.source for q in generic})},
                                                  indent=2) + "\n")
    return counts
