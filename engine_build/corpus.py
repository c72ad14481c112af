"""Deterministic text corpus from offline real text, grouped by domain.

Sources (each can be pointed elsewhere through `CorpusConfig`, and each one that is missing on a machine is
reported in the manifest and skipped):

| source             | domain  | what                                                                      |
|--------------------|---------|---------------------------------------------------------------------------|
| `debian`           | general | package descriptions: apt list files `*_Packages*` (name, section, short  |
|                    |         | description) joined with `*_i18n_Translation-en*` (long description)      |
| `man`              | general | man pages (gzipped troff, sections 1-8) rendered to plain text            |
| `pydoc`            | general | docstrings of the Python standard library, one document per module      |
| `man-agent`        | agent   | instruction -> shell command pairs from man pages: NAME line -> SYNOPSIS, |
|                    |         | EXAMPLES prose -> command, option description -> `cmd -x`                |
| `apt-agent`        | agent   | "install <what the package is>" -> `apt-get install <package>`           |
| `stdlib`           | coding  | Python standard library sources (the running interpreter's)              |
| `fortunes`         | chat    | fortune cookies as one user/assistant exchange each                       |
| `design`           | design  | CSS, SVG, HTML, GtkBuilder (.ui) and Glade files found on the machine    |

Output (`build_corpus(out, config)`): `<domain>.train.jsonl` and `<domain>.valid.jsonl` for every domain in
`DOMAINS` (empty files where a domain got nothing), one JSON object per line with keys `id`, `domain`,
`source`, `text` and, for conversational documents, `turns` (a list of `[role, text]`, roles `user` and
`assistant`; `text` then renders them as "User: ...\\nAssistant: ..." lines). `manifest.json` holds the
builder version, the settings, per-source counts (files, documents, bytes before and after the cap), per
domain/split counts and the sha256 of every output file.

The files are read by `sources.py` (the readers that the routing data and HeteroFold share); this module picks,
cleans and formats their records into documents.

Determinism: files are visited in sorted order, symlinks are skipped, every choice (split, size cap, prompt
template) is a hash of the document id and `seed`, and records are written sorted by id with sorted keys. The
manifest holds no time stamps and no output path, so two builds from the same inputs are byte-identical.
A document goes to validation when the hash of its id falls under `valid_fraction` (`CorpusConfig.split_of`).
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterable, Iterator

from tqdm import tqdm

from .manpages import ManPage
from .sources import (DebianLists, SourceMissing, decode, fortune_files, man_files, read_debian, read_fortunes,
                      read_man_page, read_python_sources, split_of, unit_hash, walk_sorted)
from .sources import default_stdlib as _default_stdlib  # the name engine_build/cli.py knows it by

BUILDER_VERSION = "1.0"
DOMAINS = ("chat", "agent", "coding", "design", "general")
MB = 1 << 20

DEFAULT_CAPS = {  # bytes of document text kept per source, chosen by hash order when a source has more
    "debian": 30 * MB,
    "man": 35 * MB,
    "pydoc": 6 * MB,
    "man-agent": 10 * MB,
    "apt-agent": 3 * MB,
    "stdlib": 30 * MB,
    "fortunes": 8 * MB,
    "design": 12 * MB,
}
DESIGN_SUFFIXES = (".css", ".svg", ".html", ".htm", ".ui", ".glade")

@dataclass
class CorpusConfig:
    man_root: Path | None = Path("/usr/share/man")  # holds man1..man8; translated subfolders are not read
    fortune_root: Path | None = Path("/usr/share/games/fortunes")  # top level only (not off/)
    stdlib_root: Path | None = field(default_factory=_default_stdlib)  # site-packages is never read
    design_roots: tuple[Path, ...] = (Path("/usr/share"),)  # searched recursively for DESIGN_SUFFIXES
    apt_lists: Path | None = Path("/var/lib/apt/lists")  # *_Packages* and *_i18n_Translation-en* files
    valid_fraction: float = 0.02  # share of documents (by id hash) in the validation split
    seed: int = 0  # salts every hash-based choice
    caps: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_CAPS))  # per source, bytes of text
    max_doc_bytes: int = 256 * 1024  # longer documents are cut at a line boundary
    max_file_bytes: int = 1 * MB  # larger source files are skipped unread
    man_family_cap: int = 250  # most pages per family (name up to the first - _ .), e.g. 16k gcloud_* pages
    man_sections: tuple[str, ...] = ("1", "2", "3", "4", "5", "6", "7", "8")
    agent_sections: tuple[str, ...] = ("1", "6", "8")  # pages whose synopsis is a shell command
    agent_pairs_per_page: int = 40

    def __post_init__(self):
        for name in ("man_root", "fortune_root", "stdlib_root", "apt_lists"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, Path(os.path.abspath(value)))
        self.design_roots = tuple(Path(os.path.abspath(p)) for p in self.design_roots)
        assert 0.0 <= self.valid_fraction < 1.0, self.valid_fraction

    def split_of(self, doc_id: str) -> str:
        """'valid' for about `valid_fraction` of ids, 'train' otherwise; depends on nothing but the id and seed."""
        return split_of(doc_id, (("valid", self.valid_fraction),), salt=f"split:{self.seed}")

    def to_json(self) -> dict:
        d = asdict(self)
        return {k: (str(v) if isinstance(v, Path) else [str(p) for p in v] if k == "design_roots" else v)
                for k, v in d.items()}


@dataclass
class Doc:
    id: str  # "<source>:<stable name>", unique over the corpus
    domain: str
    source: str
    text: str
    turns: list[tuple[str, str]] | None = None  # conversational documents only

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))

    def record(self) -> dict:
        r = {"id": self.id, "domain": self.domain, "source": self.source, "text": self.text}
        if self.turns is not None:
            r["turns"] = [[role, text] for role, text in self.turns]
        return r


@dataclass
class SourceStats:
    domain: str
    status: str = "ok"  # ok | missing | empty
    reason: str = ""
    inputs: list[str] = field(default_factory=list)  # roots or files read
    files_scanned: int = 0
    files_skipped: int = 0  # unreadable, undecodable, too large, aliases, duplicates
    documents_before_cap: int = 0
    bytes_before_cap: int = 0
    documents: int = 0
    bytes: int = 0


# --------------------------------------------------------------------------------------------- hashing


def _pick(options: tuple[str, ...], key: str) -> str:
    return options[int(unit_hash(key, "pick") * len(options))]


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ text


def _clean(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")


def _truncate(text: str, max_bytes: int) -> str:
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    cut = data[:max_bytes].decode("utf-8", errors="ignore")
    nl = cut.rfind("\n")
    return cut[:nl] if nl > 0 else cut


def _chat_text(turns: list[tuple[str, str]]) -> str:
    return "\n".join(f"{role.capitalize()}: {text}" for role, text in turns)


# -------------------------------------------------------------------------------- build context


def _fill(stats: SourceStats, inputs: list[str], counts: dict):
    stats.inputs = list(inputs)
    stats.files_scanned, stats.files_skipped = counts["files_scanned"], counts["files_skipped"]


def _lowest_versions(lists: DebianLists) -> list[dict]:
    """One record per package, from its lowest version listed (the first of equals): name, section, short, long."""
    chosen = {}
    for stanza in lists.packages:
        old = chosen.get(stanza.package)
        if old is None or (stanza.version, stanza.md5) < (old.version, old.md5):
            chosen[stanza.package] = stanza
    return [{"name": name, "section": chosen[name].section, "short": chosen[name].short,
             "long": lists.long(chosen[name])} for name in sorted(chosen)]


class _Context:
    """Holds the config and caches scans that several sources share (apt lists, man pages, stdlib files)."""

    def __init__(self, config: CorpusConfig, progress: bool):
        self.config = config
        self.progress = progress
        self._debian: tuple[DebianLists, list[dict]] | SourceMissing | None = None

    def debian_records(self, stats: SourceStats) -> list[dict]:
        """Package records from the apt lists, read once for the two sources that use them."""
        if self._debian is None:
            try:
                lists = read_debian(self.config.apt_lists, bar=lambda files: self.bar(files, "apt lists"))
                self._debian = lists, _lowest_versions(lists)
            except SourceMissing as e:
                self._debian = e
        if isinstance(self._debian, SourceMissing):
            raise self._debian
        lists, records = self._debian
        _fill(stats, lists.files, {"files_scanned": len(lists.files), "files_skipped": len(lists.unreadable)})
        return records

    def bar(self, items, desc: str, total: int | None = None):
        return tqdm(items, desc=desc, total=total, unit="file", disable=not self.progress, leave=False,
                    dynamic_ncols=True)

    @cached_property
    def man_pages(self) -> tuple[list[tuple[str, ManPage]], dict]:
        """[(relative path, page)] after the per-family cap, plus scan counts. Alias links are left out."""
        root = self.config.man_root
        files = [f for f in man_files(root, self.config.man_sections) if not f.alias]
        if not files:
            raise SourceMissing(f"no man pages under {root}/man[{''.join(self.config.man_sections)}]")
        families: dict[str, list] = {}
        for f in files:
            families.setdefault(re.split(r"[-_.]", f.path.name, maxsplit=1)[0], []).append(f)
        chosen = []
        for members in families.values():
            members = sorted(members, key=lambda f: unit_hash(f.path.name, f"family:{self.config.seed}"))
            chosen += members[: self.config.man_family_cap]
        chosen.sort(key=lambda f: f.path)
        counts = {"files_scanned": len(files), "files_skipped": len(files) - len(chosen)}
        pages = []
        for f in self.bar(chosen, "man pages"):
            page = read_man_page(f)
            if page is None:
                counts["files_skipped"] += 1
                continue
            pages.append((f"{f.folder}/{f.stem}", page))
        return pages, counts

    @cached_property
    def stdlib_files(self) -> tuple[list[tuple[str, str]], dict]:
        """[(path relative to the stdlib, source text)] for every readable .py file, plus scan counts."""
        found = read_python_sources(self.config.stdlib_root, max_bytes=self.config.max_file_bytes,
                                    bar=lambda paths: self.bar(paths, "stdlib"))
        return ([(f.rel, f.text) for f in found.files],
                {"files_scanned": found.scanned, "files_skipped": found.skipped})


# ------------------------------------------------------------------------------------------ sources


def source_debian(ctx: _Context, stats: SourceStats) -> Iterator[Doc]:
    seen_long: set[str] = set()
    for rec in ctx.debian_records(stats):
        head = f"{rec['name']} ({rec['section']}): {rec['short']}" if rec["section"] else f"{rec['name']}: {rec['short']}"
        body = rec["long"]
        text = head if not body or body in seen_long else f"{head}\n\n{body}"
        seen_long.add(body)
        yield Doc(f"debian:{rec['name']}", "general", "debian", text)


_APT_PROMPTS = ("Install {what}.", "How do I install {what}?", "I need {what} on this Debian machine.",
                "Set up {what}, please.", "Get me {what}.")
_APT_ANSWERS = ("apt-get install {pkg}", "sudo apt-get install {pkg}", "apt-get install -y {pkg}",
                "sudo apt install {pkg}")
_APT_SKIP_SECTIONS = {"libs", "libdevel", "oldlibs", "debug", "localization", "introspection"}


def source_apt_agent(ctx: _Context, stats: SourceStats) -> Iterator[Doc]:
    for rec in ctx.debian_records(stats):
        if rec["section"].split("/")[-1] in _APT_SKIP_SECTIONS or not rec["short"]:
            continue
        what = _lc_first(rec["short"])
        turns = [("user", _pick(_APT_PROMPTS, "apt-q:" + rec["name"]).format(what=what.rstrip("."))),
                 ("assistant", _pick(_APT_ANSWERS, "apt-a:" + rec["name"]).format(pkg=rec["name"]))]
        yield Doc(f"apt-agent:{rec['name']}", "agent", "apt-agent", _chat_text(turns), turns)


def source_man(ctx: _Context, stats: SourceStats) -> Iterator[Doc]:
    pages, counts = ctx.man_pages
    _fill(stats, [str(ctx.config.man_root)], counts)
    for rel, page in pages:
        yield Doc(f"man:{rel}", "general", "man", page.render())


_SYNOPSIS_PROMPTS = ("{Desc}.", "Which command should I use to {desc}?", "Show me the command to {desc}.",
                     "Command for this: {desc}.", "I want to {desc}. What do I run?")
_OPTION_PROMPTS = ("With {cmd}: {what}", "Which {cmd} option does this: {what}", "{cmd} flag for: {what}",
                   "How do I make {cmd} {what_lc}?")


def _lc_first(s: str) -> str:
    """Lower-case the first letter unless the first word is an acronym ("APT", "GNU")."""
    return s[:1].lower() + s[1:] if s[1:2].islower() or len(s) == 1 else s


def _first_sentence(text: str, limit: int = 200) -> str:
    s = re.split(r"(?<=[.!?])\s+(?=[A-Z(])|\n", text.strip(), maxsplit=1)[0].strip()
    return s if len(s) <= limit else ""


def man_agent_turns(page: ManPage, max_pairs: int, key: str) -> list[tuple[str, str]]:
    """Instruction -> command pairs from one man page (synopsis, examples, options), at most max_pairs."""
    names = page.heading_blocks("NAME")
    name_line = names[0].text.split("\n")[0] if names else ""
    cmd_part, sep, desc = name_line.partition(" - ")
    cmd = (cmd_part.split(",")[0].strip() if sep else "") or page.name
    pairs: list[tuple[str, str]] = []
    syn = page.heading_blocks("SYNOPSIS")
    desc = desc.strip().rstrip(".")
    syn = [b for b in syn if (b.tag or b.text).startswith(cmd.split()[0])]
    if syn and desc and syn[0].text:
        command = re.sub(r"\s+", " ", (syn[0].tag + " " if syn[0].tag else "") + syn[0].text).strip()
        if len(command) > 300:
            command = command[:300].rsplit(" ", 1)[0] + " ..."
        tmpl = _pick(_SYNOPSIS_PROMPTS, "syn:" + key)
        pairs.append((tmpl.format(Desc=desc[:1].upper() + desc[1:], desc=_lc_first(desc)), command))
    blocks = page.blocks
    for i, b in enumerate(blocks[:-1]):  # EXAMPLES: prose ending in ':' followed by a literal block
        nxt = blocks[i + 1]
        if "EXAMPLE" in b.heading and not b.nofill and b.text.endswith(":") and nxt.nofill:
            lines = [re.sub(r"^\s*[$#%] ", "", x).strip() for x in nxt.text.split("\n") if x.strip()][:6]
            ask = re.sub(r"[,:]?\s*(run|type|use|do|enter)?:$", "", b.text).strip()
            if lines and 10 <= len(ask) <= 400:
                pairs.append((ask, "\n".join(lines)))
    for b in blocks:
        if not b.tag or not b.text or b.nofill:
            continue
        what = _first_sentence(b.text)
        if len(what) < 8:
            continue
        if b.tag.startswith("-"):
            forms = [f.strip() for f in b.tag.split(", ") if f.strip().startswith("-")]
            command = f"{cmd} " + next((f for f in forms if re.search(r"[=\s\[]", f)), forms[0])
        elif ("COMMAND" in b.heading or "GROUP" in b.heading) and re.fullmatch(r"[\w.-]+", b.tag):
            command = f"{cmd} {b.tag}"
        else:
            continue
        tmpl = _pick(_OPTION_PROMPTS, f"opt:{key}:{b.tag}")
        pairs.append((tmpl.format(cmd=cmd, what=what, what_lc=_lc_first(what).rstrip(".")), command))
    turns = []
    for q, a in pairs[:max_pairs]:
        turns += [("user", q), ("assistant", a)]
    return turns


def source_man_agent(ctx: _Context, stats: SourceStats) -> Iterator[Doc]:
    pages, counts = ctx.man_pages
    _fill(stats, [str(ctx.config.man_root)], counts)
    for rel, page in pages:
        if rel.split("/")[0][3:] not in ctx.config.agent_sections:
            continue
        turns = man_agent_turns(page, ctx.config.agent_pairs_per_page, rel)
        if turns:
            yield Doc(f"man-agent:{rel}", "agent", "man-agent", _chat_text(turns), turns)


def source_stdlib(ctx: _Context, stats: SourceStats) -> Iterator[Doc]:
    files, counts = ctx.stdlib_files
    _fill(stats, [str(ctx.config.stdlib_root)], counts)
    for rel, text in files:
        yield Doc(f"stdlib:{rel}", "coding", "stdlib", f"# {rel}\n{text}")


def _module_docs(rel: str, source: str) -> str | None:
    """pydoc-like text: the module docstring, then each public class and function with its signature."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    modname = rel[:-3].replace("/", ".").removesuffix(".__init__")
    parts = [f"Module {modname}"]
    if (doc := ast.get_docstring(tree)):
        parts.append(doc)

    def visit(nodes, prefix: str, depth: int):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name.startswith("_") and node.name != "__init__":
                    continue
                doc = ast.get_docstring(node)
                if isinstance(node, ast.ClassDef):
                    bases = ", ".join(ast.unparse(b) for b in node.bases)
                    sig = f"class {prefix}{node.name}" + (f"({bases})" if bases else "")
                else:
                    sig = f"{prefix}{node.name}({ast.unparse(node.args)})"
                if doc:
                    parts.append(sig + "\n    " + inspect.cleandoc(doc).replace("\n", "\n    "))
                if isinstance(node, ast.ClassDef) and depth == 0:
                    visit(node.body, f"{prefix}{node.name}.", 1)

    visit(tree.body, "", 0)
    return "\n\n".join(parts) if len(parts) > 1 else None


def source_pydoc(ctx: _Context, stats: SourceStats) -> Iterator[Doc]:
    files, counts = ctx.stdlib_files
    _fill(stats, [str(ctx.config.stdlib_root)], counts)
    for rel, text in files:
        if re.search(r"(^|/)(tests?|idle_test)/", rel):
            continue
        doc = _module_docs(rel, text)
        if doc:
            yield Doc(f"pydoc:{rel}", "general", "pydoc", doc)


_FORTUNE_PROMPTS = ("Tell me something.", "Got a fortune for me?", "Say something witty.", "Share a quote.",
                    "Cheer me up.", "What's on your mind?", "Give me a thought for the day.",
                    "Tell me something about {topic}.", "Do you know anything funny about {topic}?",
                    "Any wisdom on {topic}?")


def source_fortunes(ctx: _Context, stats: SourceStats) -> Iterator[Doc]:
    files = fortune_files(ctx.config.fortune_root)
    stats.inputs = [str(ctx.config.fortune_root)]
    for path in ctx.bar(files, "fortunes"):
        stats.files_scanned += 1
        topic = path.name.replace("-", " and ").replace("_", " ")
        for fortune in read_fortunes(path):
            entry = _clean(fortune.text)
            if not entry.strip():
                continue
            doc_id = f"fortunes:{fortune.file}:{fortune.index:05d}"
            turns = [("user", _pick(_FORTUNE_PROMPTS, doc_id).format(topic=topic)), ("assistant", entry)]
            yield Doc(doc_id, "chat", "fortunes", _chat_text(turns), turns)


def source_design(ctx: _Context, stats: SourceStats) -> Iterator[Doc]:
    roots = [r for r in ctx.config.design_roots if r.is_dir()]
    if not roots:
        raise SourceMissing(f"none of the design roots exist: {[str(r) for r in ctx.config.design_roots]}")
    stats.inputs = [str(r) for r in roots]
    seen: set[str] = set()
    for root in roots:
        paths = [p for p in walk_sorted(root, frozenset({"site-packages", "__pycache__"}))
                 if p.suffix.lower() in DESIGN_SUFFIXES]
        for p in ctx.bar(paths, f"design {root}"):
            stats.files_scanned += 1
            if p.stat().st_size > ctx.config.max_file_bytes:
                stats.files_skipped += 1
                continue
            data = p.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            text = decode(data, strict=True)
            if text is None or digest in seen or not text.strip():
                stats.files_skipped += 1
                continue
            seen.add(digest)
            yield Doc(f"design:{root.name}/{p.relative_to(root).as_posix()}", "design", "design", text)


@dataclass(frozen=True)
class Source:
    name: str
    domain: str
    fn: Callable[[_Context, SourceStats], Iterable[Doc]]


SOURCES = (
    Source("debian", "general", source_debian),
    Source("man", "general", source_man),
    Source("pydoc", "general", source_pydoc),
    Source("man-agent", "agent", source_man_agent),
    Source("apt-agent", "agent", source_apt_agent),
    Source("stdlib", "coding", source_stdlib),
    Source("fortunes", "chat", source_fortunes),
    Source("design", "design", source_design),
)




# ------------------------------------------------------------------------------------------- build


def _apply_cap(docs: list[Doc], cap: int | None, seed: int) -> list[Doc]:
    """Keep documents in hash order until the byte cap; the result is sorted by id."""
    if cap is None or sum(d.nbytes for d in docs) <= cap:
        return sorted(docs, key=lambda d: d.id)
    kept, total = [], 0
    for d in sorted(docs, key=lambda d: unit_hash(d.id, f"cap:{seed}")):
        if total + d.nbytes <= cap:
            kept.append(d)
            total += d.nbytes
    return sorted(kept, key=lambda d: d.id)


def build_corpus(out: str | Path, config: CorpusConfig | None = None, progress: bool = True,
                 sources: Iterable[Source] = SOURCES) -> dict:
    """Build every source, write the per-domain split files and manifest.json under `out`; return the manifest."""
    config = config or CorpusConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = _Context(config, progress)
    per_domain: dict[str, list[Doc]] = {d: [] for d in DOMAINS}
    source_stats: dict[str, SourceStats] = {}
    seen_ids: set[str] = set()
    for src in tqdm(list(sources), desc="sources", unit="source", disable=not progress, dynamic_ncols=True):
        stats = source_stats[src.name] = SourceStats(src.domain)
        try:
            docs = []
            for d in src.fn(ctx, stats):
                text = _truncate(_clean(d.text), config.max_doc_bytes)
                if text.strip():
                    d.text = text
                    docs.append(d)
        except SourceMissing as e:
            stats.status, stats.reason = "missing", str(e)
            continue
        stats.documents_before_cap = len(docs)
        stats.bytes_before_cap = sum(d.nbytes for d in docs)
        docs = _apply_cap(docs, config.caps.get(src.name), config.seed)
        stats.documents, stats.bytes = len(docs), sum(d.nbytes for d in docs)
        if not docs:
            stats.status, stats.reason = "empty", stats.reason or "the source yielded no documents"
        for d in docs:
            if d.id in seen_ids:
                raise ValueError(f"duplicate document id {d.id}")
            seen_ids.add(d.id)
        per_domain[src.domain] += docs

    files, domains = {}, {}
    for domain in DOMAINS:
        docs = sorted(per_domain[domain], key=lambda d: d.id)
        domains[domain] = {}
        for split in ("train", "valid"):
            chosen = [d for d in docs if config.split_of(d.id) == split]
            name = f"{domain}.{split}.jsonl"
            with open(out / name, "w", encoding="utf-8", newline="\n") as f:
                for d in chosen:
                    f.write(json.dumps(d.record(), ensure_ascii=False, sort_keys=True, separators=(",", ":")))
                    f.write("\n")
            domains[domain][split] = {"documents": len(chosen), "bytes": sum(d.nbytes for d in chosen)}
            files[name] = {"sha256": _sha256_file(out / name), "bytes": (out / name).stat().st_size,
                           "documents": len(chosen)}
    manifest = {
        "builder_version": BUILDER_VERSION,
        "python": ".".join(map(str, sys.version_info[:3])),
        "config": config.to_json(),
        "sources": {name: asdict(s) for name, s in source_stats.items()},
        "domains": domains,
        "totals": {"documents": sum(s.documents for s in source_stats.values()),
                   "bytes": sum(s.bytes for s in source_stats.values())},
        "files": files,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def read_split(corpus_dir: str | Path, domain: str, split: str) -> Iterator[dict]:
    """The records of one domain's split, in file order."""
    with open(Path(corpus_dir) / f"{domain}.{split}.jsonl", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


# ------------------------------------------------------------------------------ system preparation


def prepare_system(apt_dir: Path, log=print) -> Path | None:
    """Make the Debian sources available (root only): install fortunes when missing, and fetch apt lists
    with English long descriptions into `apt_dir` (the system's own lists are left alone; Debian's Docker
    images set `Acquire::Languages "none"`, so their lists lack the Translation-en files).
    Returns the list folder to read, or None when it could not be prepared (the caller then uses the system's)."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        log("prepare: not root or no apt-get; using what is installed")
        return None
    apt_dir = Path(apt_dir).resolve()  # apt reads a relative Dir::State::Lists as relative to /var/lib/apt
    lists = apt_dir / "lists"
    (lists / "partial").mkdir(parents=True, exist_ok=True)
    (apt_dir / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    have_tr = any("_i18n_Translation-en" in p.name for p in lists.iterdir())
    if not have_tr:
        log(f"prepare: apt-get update (with Translation-en) into {lists}")
        r = subprocess.run(["apt-get", "update", "-o", f"Dir::State::Lists={lists}",
                            "-o", f"Dir::Cache={apt_dir / 'cache'}", "-o", "Acquire::Languages=en"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            log(f"prepare: apt-get update failed ({r.returncode}): {r.stderr.strip()[-500:]}")
            return None
    if not Path("/usr/share/games/fortunes/fortunes").exists():
        log("prepare: apt-get install -y fortunes fortunes-min")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update"], capture_output=True, env=env)
        r = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "fortunes", "fortunes-min"],
                           capture_output=True, text=True, env=env)
        if r.returncode != 0:
            log(f"prepare: installing fortunes failed: {r.stderr.strip()[-500:]}")
    return lists
