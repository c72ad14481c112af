"""Pins down the shared readers of offline text (`engine_build.sources`): what each returns from small files in the
real formats, and that the one `split_of` gives the corpus's and the routing data's splits as they always were."""
from __future__ import annotations

import gzip
import hashlib
import lzma

import pytest

from engine_build.sources import (SourceMissing, fortune_files, man_files, read_debian, read_fortunes, read_man,
                                  read_man_page, read_python_sources, split_of, unit_hash)

IDS = [f"doc:{i}" for i in range(3000)]


def _sha_unit(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2 ** 64


def test_unit_hash_is_sha256_of_salt_and_key():
    assert unit_hash("man:man1/ls.1", "split:0") == _sha_unit("split:0:man:man1/ls.1")
    assert unit_hash("x") == _sha_unit(":x")
    assert all(0.0 <= unit_hash(i, "s") < 1.0 for i in IDS)


def test_split_of_gives_the_corpus_and_routing_splits():
    corpus = ["valid" if _sha_unit(f"split:3:{i}") < 0.02 else "train" for i in IDS]
    assert [split_of(i, (("valid", 0.02),), salt="split:3") for i in IDS] == corpus
    routing = ["test" if (u := _sha_unit(f"split:{i}")) < 0.1 else "dev" if u < 0.2 else "train" for i in IDS]
    assert [split_of(i, (("test", 0.1), ("dev", 0.1)), salt="split") for i in IDS] == routing
    assert {split_of(i, (), salt="s", rest="all") for i in IDS} == {"all"}


def test_a_wider_share_only_takes_keys_from_the_splits_after_it():
    narrow = [split_of(i, (("calib", 0.1), ("heldout", 0.1)), salt="s") for i in IDS]
    wide = [split_of(i, (("calib", 0.2), ("heldout", 0.1)), salt="s") for i in IDS]
    assert all(w == "calib" for n, w in zip(narrow, wide) if n == "calib")
    assert 200 <= narrow.count("heldout") <= 400  # about a tenth


PACKAGES = """Package: hello
Version: 2.10-3
Section: devel
Description: example package based on GNU hello
Description-md5: 11111111111111111111111111111111
Tag: role::program, devel::lang:c,
 use::printing

Package: inline
Version: 1.0
Section: contrib/text
Description: a package that carries its long description
 First line.
 .
 Second paragraph.
"""
TRANSLATIONS = """Package: hello
Description-md5: 11111111111111111111111111111111
Description-en: example package based on GNU hello
 The GNU hello program produces a familiar, friendly greeting.
"""


def test_debian_lists_join_packages_and_translations(tmp_path):
    (tmp_path / "d_main_binary-amd64_Packages.gz").write_bytes(gzip.compress(PACKAGES.encode(), mtime=0))
    (tmp_path / "d_main_i18n_Translation-en.xz").write_bytes(lzma.compress(TRANSLATIONS.encode()))
    (tmp_path / "e_main_binary-amd64_Packages.gz").write_bytes(b"not gzip")
    (tmp_path / "d_InRelease").write_text("ignored")
    lists = read_debian(tmp_path)
    assert lists.files == ["d_main_binary-amd64_Packages.gz", "e_main_binary-amd64_Packages.gz",
                           "d_main_i18n_Translation-en.xz"]
    assert lists.unreadable == ["e_main_binary-amd64_Packages.gz"]
    hello, inline = lists.packages  # the translation is no package of its own
    assert (hello.package, hello.version, hello.section, hello.short) == ("hello", "2.10-3", "devel",
                                                                           "example package based on GNU hello")
    assert hello.tags == ("role::program", "devel::lang:c", "use::printing") and hello.long == ""
    assert lists.long(hello) == "The GNU hello program produces a familiar, friendly greeting."
    assert inline.section == "contrib/text" and len(inline.md5) == 32  # no Description-md5: the description's md5
    assert lists.long(inline) == inline.long == "First line.\n\nSecond paragraph."


def test_debian_lists_without_packages_are_missing(tmp_path):
    (tmp_path / "d_main_i18n_Translation-en").write_text(TRANSLATIONS)
    with pytest.raises(SourceMissing, match="no \\*_Packages files"):
        read_debian(tmp_path)
    with pytest.raises(FileNotFoundError):  # what the routing data's builders catch
        read_debian(tmp_path / "absent")


def test_fortunes_are_split_at_percent_lines(tmp_path):
    (tmp_path / "art").write_text("%\nFirst.\n%  \nSecond,\nin two lines.\n%\n%\nThird.\n")
    (tmp_path / "art.dat").write_bytes(b"\0\1")
    (tmp_path / "art.u8").symlink_to("art")
    (tmp_path / "law").write_bytes("Caf\xe9 law.\n".encode("latin-1"))  # not UTF-8: read as Latin-1
    assert [p.name for p in fortune_files(tmp_path)] == ["art", "law"]
    art = read_fortunes(tmp_path / "art")
    assert [f.index for f in art] == list(range(5)) and {f.file for f in art} == {"art"}
    assert [f.text.strip() for f in art] == ["", "First.", "Second,\nin two lines.", "", "Third."]
    assert read_fortunes(tmp_path / "law")[0].text == "Café law.\n"
    with pytest.raises(SourceMissing, match="no fortune folder"):
        fortune_files(tmp_path / "absent")


LS = '.TH LS 1\n.SH NAME\nls \\- list directory contents\n.SH DESCRIPTION\nList information about the FILEs.\n'


def test_man_files_and_pages(tmp_path):
    (tmp_path / "man1").mkdir()
    (tmp_path / "man1" / "ls.1.gz").write_bytes(gzip.compress(LS.encode(), mtime=0))
    (tmp_path / "man1" / "dir.1.gz").write_bytes(gzip.compress(b".so man1/ls.1\n", mtime=0))
    (tmp_path / "man1" / "list.1.gz").symlink_to("ls.1.gz")
    (tmp_path / "man1" / "broken.1.gz").write_bytes(b"not gzip")
    (tmp_path / "man8").mkdir()
    (tmp_path / "man8" / "openssl-req.8ssl").write_text(LS)
    files = man_files(tmp_path, "18")
    assert [(f.folder, f.stem, f.name, f.section, f.alias) for f in files] == [
        ("man1", "broken.1", "broken", "1", False), ("man1", "dir.1", "dir", "1", False),
        ("man1", "list.1", "list", "1", True), ("man1", "ls.1", "ls", "1", False),
        ("man8", "openssl-req.8ssl", "openssl-req", "8ssl", False)]
    broken, alias_page, link, ls, _ = files
    assert read_man(ls.path) == LS and read_man(link.path) == LS and read_man(broken.path) is None
    assert read_man_page(alias_page) is None and read_man_page(broken) is None  # `.so` pages hold no text
    assert "ls - list directory contents" in read_man_page(ls).render()
    with pytest.raises(SourceMissing, match="no man page folder"):
        man_files(tmp_path / "absent", "1")


def test_python_sources_skip_and_count(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "a.py").write_text('"""A."""\n')
    (tmp_path / "blank.py").write_text("\n\n")
    (tmp_path / "latin.py").write_bytes("# caf\xe9\n".encode("latin-1"))
    (tmp_path / "pkg" / "__init__.py").write_text("X = 1\n")
    (tmp_path / "pkg" / "sub" / "deep.py").write_text("Y = 2\n")
    (tmp_path / "site-packages" / "third.py").write_text("Z = 3\n")
    found = read_python_sources(tmp_path)
    assert [f.rel for f in found.files] == ["a.py", "pkg/__init__.py", "pkg/sub/deep.py"]
    assert (found.scanned, found.skipped) == (5, 2)  # blank.py, latin.py
    shallow = read_python_sources(tmp_path, skip_dirs=frozenset(), max_depth=2)
    assert [f.rel for f in shallow.files] == ["a.py", "pkg/__init__.py", "site-packages/third.py"]
    assert [f.rel for f in read_python_sources(tmp_path, max_bytes=8).files] == ["pkg/__init__.py", "pkg/sub/deep.py"]
