"""The offline text that the demo data is made from, read in one place, and the one stable hash that splits it.

| reader                            | what it reads                                           | record         |
|-----------------------------------|---------------------------------------------------------|----------------|
| `read_debian`                     | apt list files: `*_Packages*`, `*_i18n_Translation-en*` | `DebianStanza` |
| `man_files`, `read_man`           | man pages (gzipped or plain troff) under man1..man8     | `ManFile`, str |
| `read_man_page`                   | one man page, parsed by `manpages.parse_man`            | `ManPage`      |
| `fortune_files`, `read_fortunes`  | fortune files, one entry per `%`-delimited cookie       | `Fortune`      |
| `read_python_sources`             | the `.py` files of a tree such as the standard library  | `PythonFile`   |

A record holds what the files say (raw fields, every entry kept): the demo corpus (`corpus.py`), the routing data
(`mol2_router`) and HeteroFold's corpus each choose, clean and format from there. A source that is absent on this
machine raises `SourceMissing`.

`unit_hash(key, salt)` is the one hash behind every split and sample of that data, and `split_of` the one split:
the corpus's train/valid, the routing data's train/dev/test and HeteroFold's train/calib/heldout are the same
function with their own shares and salt.
"""
from __future__ import annotations

import bz2
import gzip
import hashlib
import lzma
import os
import re
import subprocess
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from .manpages import ManPage, parse_man

APT_HELPER = "/usr/lib/apt/apt-helper"  # decompresses apt's list files (.lz4 among them)
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
FORTUNE_SIDE_SUFFIXES = (".dat", ".u8", ".pdat")  # strfile's index, the UTF-8 alias link, the index's copy

Bar = Callable[[list[Path]], Iterable[Path]]  # wraps a list of files in a progress bar; `_no_bar` by default


class SourceMissing(FileNotFoundError):
    """The source's root is absent or holds nothing usable on this machine."""


def _no_bar(files: list[Path]) -> Iterable[Path]:
    return files


# --------------------------------------------------------------------------------------------- hashing


def unit_hash(key: str, salt: str = "") -> float:
    """A stable number in [0, 1) for `key`: the first 8 bytes of sha256("<salt>:<key>"), over 2**64."""
    return int.from_bytes(hashlib.sha256(f"{salt}:{key}".encode("utf-8")).digest()[:8], "big") / 2 ** 64


def split_of(key: str, shares: Sequence[tuple[str, float]], salt: str, rest: str = "train") -> str:
    """The split of `key`: the first (name, share) whose running total of shares its hash is under, else `rest`.
    Depends on nothing but its arguments; growing a share only moves keys into that split from the ones after it."""
    u, bound = unit_hash(key, salt), 0.0
    for name, share in shares:
        bound += share
        if u < bound:
            return name
    return rest


# ------------------------------------------------------------------------------------------ plain files


def decode(data: bytes, strict: bool = False) -> str | None:
    """UTF-8, else Latin-1 (every byte is a character); with `strict`, None instead of Latin-1."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None if strict else data.decode("latin-1")


def walk_sorted(root: Path, skip_dirs: frozenset[str] = frozenset(), max_depth: int | None = None) -> Iterator[Path]:
    """Regular files under root in sorted order (a folder's files before its subfolders'), symlinks (files and
    folders) skipped; with `max_depth`, only files at most that many path parts below root."""
    for dirpath, dirnames, filenames in os.walk(root):
        depth = len(Path(dirpath).relative_to(root).parts)
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not os.path.islink(os.path.join(dirpath, d))
                             and (max_depth is None or depth + 1 < max_depth))
        for name in sorted(filenames):
            p = Path(dirpath, name)
            if not p.is_symlink() and p.is_file():
                yield p


# ------------------------------------------------------------------------------- Debian package records


def read_list_file(path: Path) -> str:
    """An apt list file as text, whatever its compression; OSError when it cannot be read or decompressed."""
    try:
        if path.suffix == ".gz":
            data = gzip.decompress(path.read_bytes())
        elif path.suffix == ".xz":
            data = lzma.decompress(path.read_bytes())
        elif path.suffix == ".bz2":
            data = bz2.decompress(path.read_bytes())
        elif path.suffix in (".lz4", ".zst"):
            if not os.access(APT_HELPER, os.X_OK):
                raise OSError(f"{path.name}: needs {APT_HELPER} to decompress")
            data = subprocess.run([APT_HELPER, "cat-file", str(path)], check=True, capture_output=True).stdout
        else:
            data = path.read_bytes()
    except (subprocess.CalledProcessError, EOFError, lzma.LZMAError) as error:
        raise OSError(f"{path.name}: {error}") from error
    return decode(data)


def deb822(text: str) -> Iterator[dict[str, str]]:
    """The paragraphs of a Debian control-style file as field -> value (continuation lines kept, "\\n"-joined)."""
    for para in re.split(r"\n[ \t]*\n", text):
        rec: dict[str, str] = {}
        key = None
        for line in para.split("\n"):
            if line[:1] in (" ", "\t") and key:
                rec[key] += "\n" + line
            elif ":" in line:
                key, _, value = line.partition(":")
                rec[key] = value.strip()
        if rec:
            yield rec


def long_description(lines: str) -> str:
    """Debian's long-description markup undone: one leading space, ' .' for a blank line."""
    out = []
    for line in lines.split("\n"):
        line = line[1:] if line.startswith(" ") else line
        out.append("" if line.strip() == "." else line)
    return "\n".join(out).strip()


@dataclass(frozen=True)
class DebianStanza:
    """One package paragraph of an apt list file: a Packages entry, or a Translation-en one (a description only)."""
    package: str
    version: str  # "" in Translation-en files
    section: str  # as written ("contrib/games"); "" when the paragraph has none
    description: str  # the Description(-en) field: the short description, then the long one's raw lines
    md5: str  # Description-md5, else the md5 of the description: what joins a package to its translation
    translation: bool  # a Description-en paragraph, which adds a long description and no package
    tags: tuple[str, ...] = ()  # debtags, "role::program"

    @property
    def short(self) -> str:
        return self.description.partition("\n")[0].strip()

    @property
    def has_long(self) -> bool:
        return bool(self.description.partition("\n")[2].strip())

    @property
    def long(self) -> str:
        return long_description(self.description.partition("\n")[2]) if self.has_long else ""


def _stanza(rec: dict[str, str]) -> DebianStanza | None:
    description = rec.get("Description-en") or rec.get("Description")
    if not description or "Package" not in rec:
        return None
    md5 = rec.get("Description-md5") or hashlib.md5((description + "\n").encode()).hexdigest()
    tags = tuple(t.strip() for t in rec.get("Tag", "").replace("\n", " ").split(",") if t.strip())
    return DebianStanza(rec["Package"], rec.get("Version", ""), rec.get("Section", ""), description, md5,
                        "Description-en" in rec, tags)


@dataclass
class DebianLists:
    """What one folder of apt list files says."""
    files: list[str]  # names read: the Packages files, then the Translation-en files, each sorted
    unreadable: list[str] = field(default_factory=list)  # names that could not be decompressed
    packages: list[DebianStanza] = field(default_factory=list)  # every Packages paragraph, in file order
    long_by_md5: dict[str, str] = field(default_factory=dict)  # from every file; the first one wins

    def long(self, stanza: DebianStanza) -> str:
        """The package's long description, from its own paragraph or its translation."""
        return self.long_by_md5.get(stanza.md5, "")


def apt_list_files(lists: Path | None) -> list[Path]:
    """The Packages files, then the Translation-en files, of an apt list folder, each sorted."""
    if lists is None or not Path(lists).is_dir():
        raise SourceMissing(f"no apt list folder at {lists}")
    names = sorted(Path(lists).iterdir())
    packages = [p for p in names if re.search(r"_Packages(\.\w+)?$", p.name)]
    if not packages:
        raise SourceMissing(f"no *_Packages files in {lists} (run apt-get update)")
    return packages + [p for p in names if re.search(r"_i18n_Translation-en(\.\w+)?$", p.name)]


def read_debian(lists: Path | None, bar: Bar = _no_bar) -> DebianLists:
    """Every package paragraph of the apt lists in `lists`, and their long descriptions (unreadable files skipped)."""
    files = apt_list_files(lists)
    out = DebianLists([p.name for p in files])
    for path in bar(files):
        try:
            text = read_list_file(path)
        except OSError:
            out.unreadable.append(path.name)
            continue
        for stanza in filter(None, map(_stanza, deb822(text))):
            if stanza.has_long:
                out.long_by_md5.setdefault(stanza.md5, stanza.long)
            if not stanza.translation:
                out.packages.append(stanza)
    return out


# -------------------------------------------------------------------------------------------- man pages


@dataclass(frozen=True)
class ManFile:
    """One file of a man page folder, `man1/ls.1.gz`."""
    path: Path
    alias: bool  # a symbolic link to another page

    @property
    def folder(self) -> str:
        return self.path.parent.name  # "man1"

    @property
    def stem(self) -> str:
        return self.path.name[:-3] if self.path.name.endswith(".gz") else self.path.name  # "ls.1"

    @property
    def name(self) -> str:
        return self.stem.rpartition(".")[0] or self.stem  # "ls"

    @property
    def section(self) -> str:
        return self.stem.rpartition(".")[2] or self.folder[3:]  # "1", "3ssl"


def man_files(root: Path | None, sections: Iterable[str]) -> list[ManFile]:
    """The files (symbolic links to files too) of `root`/man<section> for each section, each folder sorted."""
    if root is None or not Path(root).is_dir():
        raise SourceMissing(f"no man page folder at {root}")
    out = []
    for section in sections:
        folder = Path(root) / f"man{section}"
        if folder.is_dir():
            out += [ManFile(p, p.is_symlink()) for p in sorted(folder.iterdir()) if p.is_file()]
    return out


def read_man(path: Path) -> str | None:
    """A man page's troff source, gunzipped when it ends in .gz; None when it cannot be read."""
    try:
        data = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    return decode(data)


def read_man_page(file: ManFile) -> ManPage | None:
    """The parsed page; None when it cannot be read or holds no text (an alias page: `.so man1/ls.1`)."""
    source = read_man(file.path)
    page = parse_man(source, file.name, file.section) if source is not None else None
    return page if page is not None and page.blocks else None


# --------------------------------------------------------------------------------------------- fortunes


@dataclass(frozen=True)
class Fortune:
    """One entry of a fortune file, as written (surrounding newlines included)."""
    file: str  # the file's name, its category: "art", "linux"
    index: int  # its place in the file, counting every entry, empty ones too
    text: str


def fortune_files(root: Path | None) -> list[Path]:
    """The fortune files of a fortune folder (top level only), sorted; index files and alias links left out."""
    if root is None or not Path(root).is_dir():
        raise SourceMissing(f"no fortune folder at {root} (apt-get install -y fortunes fortunes-min)")
    return [p for p in sorted(Path(root).iterdir())
            if p.is_file() and not p.is_symlink() and p.suffix not in FORTUNE_SIDE_SUFFIXES]


def read_fortunes(path: Path) -> list[Fortune]:
    """Every entry of one fortune file: the text between lines that hold only '%' (strfile's delimiter)."""
    entries = re.split(r"^%[ \t]*$", decode(path.read_bytes()), flags=re.M)
    return [Fortune(path.name, i, text) for i, text in enumerate(entries)]


# ------------------------------------------------------------------------------------- Python sources


def default_stdlib() -> Path:
    """The running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class PythonFile:
    rel: str  # path below the root, "/"-separated: "json/decoder.py"
    text: str


@dataclass
class PythonSources:
    files: list[PythonFile]  # in `walk_sorted` order
    scanned: int  # .py files found
    skipped: int  # too large, not UTF-8, or blank


def read_python_sources(root: Path | None, skip_dirs: frozenset[str] = STDLIB_SKIP_DIRS, max_depth: int | None = None,
                        max_bytes: int | None = None, bar: Bar = _no_bar) -> PythonSources:
    """The readable .py files under `root` (the standard library: site-packages is skipped unless `skip_dirs`
    says otherwise), larger ones than `max_bytes` left unread."""
    if root is None or not Path(root).is_dir():
        raise SourceMissing(f"no Python standard library at {root}")
    root = Path(root)
    paths = [p for p in walk_sorted(root, skip_dirs, max_depth) if p.suffix == ".py"]
    if not paths:
        raise SourceMissing(f"no .py files under {root}")
    files = []
    for p in bar(paths):
        text = None if max_bytes is not None and p.stat().st_size > max_bytes else decode(p.read_bytes(), strict=True)
        if text is not None and text.strip():
            files.append(PythonFile(p.relative_to(root).as_posix(), text))
    return PythonSources(files, len(paths), len(paths) - len(files))
