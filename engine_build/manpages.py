"""Man pages (troff / mdoc source) to plain text: a small renderer, good enough for corpus prose and for
pulling NAME, SYNOPSIS, EXAMPLES and option descriptions out of a page. Heuristic: tables and some layout are lost."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

_NAMED_CHARS = {
    "em": "—", "en": "–", "hy": "-", "mi": "-", "bu": "•", "aq": "'", "dq": '"', "lq": "“", "rq": "”",
    "oq": "‘", "cq": "’", "co": "©", "rg": "®", "tm": "™", "de": "°", "mu": "×", "di": "÷", "+-": "±",
    "<=": "≤", ">=": "≥", "!=": "≠", "->": "→", "<-": "←", "ua": "↑", "da": "↓", "sc": "§", "ps": "¶",
    "dg": "†", "ga": "`", "aa": "´", "ti": "~", "ha": "^", "ba": "|", "bv": "|", "br": "│", "ul": "_",
    "rs": "\\", "sl": "/", "pl": "+", "eq": "=", "fm": "′", "Fo": "«", "Fc": "»", "ss": "ß", "ae": "æ",
    "AE": "Æ", "o/": "ø", "O/": "Ø", "Po": "£", "Eu": "€", "eu": "€", "ct": "¢", "12": "½", "14": "¼",
    "34": "¾", "at": "@", "sh": "#", "Do": "$", "lB": "[", "rB": "]", "lC": "{", "rC": "}", "la": "⟨",
    "ra": "⟩", "pc": "·", "md": "·", "**": "*", "fi": "fi", "fl": "fl", "ff": "ff", "ci": "○", "sq": "□",
    "OK": "✓", "tno": "~", "bq": "„", "Bq": "„", "Sd": "ð", "TP": "þ", "<>": "↔", "if": "∞", "*p": "π",
}
_ACCENTS = {"'": "\u0301", "`": "\u0300", "^": "\u0302", ":": "\u0308", "~": "\u0303", ",": "\u0327",
            "o": "\u030a", "v": "\u030c"}
_STRINGS = {"lq": "“", "rq": "”", 'L"': "“", 'R"': "”", "C`": "'", "C'": "'", "Tm": "™", "R": "®",
            "Aq": "'", "aq": "'", "dq": '"', "Lq": "“", "Rq": "”", "PI": "π", "ga": "`", "S": ""}
_ONE_CHAR = {"-": "-", "e": "\\", "\\": "\\", "~": " ", "0": " ", " ": " ", "t": "\t", ".": ".",
             "'": "'", "`": "`", "_": "_", "[": "[", "]": "]", "/": "", ",": ""}
_ESCAPE = re.compile(r"""\\(?:
    (?P<comment>["#].*)
  | f(?:\[[^\]]*\]|\(..|.)
  | s[-+]?(?:\(\d\d|\[[^\]]*\]|'[^']*'|\d)
  | \((?P<char2>..)
  | \[(?P<charb>[^\]]*)\]
  | \*(?:\[(?P<strb>[^\]]*)\]|\((?P<str2>..)|(?P<str1>.))
  | [nmgkFMYV](?:\[[^\]]*\]|\(..|.)
  | N'(?P<num>\d+)'
  | [hvwlLxoDbZHSRXAB]'[^']*'
  | \$(?:\d|\*|@)
  | (?P<one>.)
)""", re.X)
_MDOC_DROP = frozenset(
    "Ar Cm Pa Em Sy Li Dv Ev Va Fn Fa Ft Fo Fc In Ic Er St Ad Cd An Ql Dq Sq Pq Qq Do Dc Sx Lk Mt Tn Aq"
    " Bq Brq Ux Bx Nx Fx Ox At Bsx No Pf Ta Ms Vt Ap Eq Sc So Qo Qc Po Pc Bo Bc".split())


def _named_char(name: str) -> str:
    if name.startswith("u") and len(name) >= 5 and all(c in "0123456789ABCDEFabcdef" for c in name[1:5]):
        try:
            return "".join(chr(int(part, 16)) for part in name[1:].split("_"))
        except ValueError:
            return ""
    if name in _NAMED_CHARS:
        return _NAMED_CHARS[name]
    if len(name) == 2 and name[0] in _ACCENTS and name[1].isalpha():
        return unicodedata.normalize("NFC", name[1] + _ACCENTS[name[0]])
    return ""


def _split_args(s: str) -> list[str]:
    """Split a request's arguments like troff: spaces separate, double quotes group, escapes kept whole."""
    args, cur, i, quoted, started = [], [], 0, False, False
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            cur.append(s[i:i + 2])
            started, i = True, i + 2
            continue
        if quoted:
            if c == '"':
                if s[i + 1:i + 2] == '"':
                    cur.append('"')
                    i += 2
                    continue
                quoted = False
            else:
                cur.append(c)
        elif c in " \t":
            if started:
                args.append("".join(cur))
                cur, started = [], False
        elif c == '"' and not started:
            quoted = started = True
        else:
            cur.append(c)
            started = True
        i += 1
    if started:
        args.append("".join(cur))
    return args


@dataclass
class ManBlock:
    heading: str  # the section (NAME, SYNOPSIS, ...)
    tag: str | None  # .TP/.IP tag, e.g. "-a, --all"
    text: str
    nofill: bool  # a literal block (.nf/.EX): line breaks are meaningful


@dataclass
class ManPage:
    name: str  # file stem, e.g. "ls"
    section: str
    title: str
    blocks: list[ManBlock]

    def heading_blocks(self, *names: str) -> list[ManBlock]:
        return [b for b in self.blocks if b.heading in names]

    def render(self) -> str:
        out, heading = [f"{self.title}({self.section})"], None
        for b in self.blocks:
            if b.heading != heading:
                out += ["", b.heading]
                heading = b.heading
            if b.tag and b.text:
                bullet = len(b.tag) <= 2 and not any(c.isalnum() for c in b.tag)
                out.append(f"{b.tag} {b.text}" if bullet else f"{b.tag}\n    " + b.text.replace("\n", "\n    "))
            else:
                out.append(b.tag or b.text)
            out.append("")
        return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


class _ManParser:
    """A small man(7)/mdoc(7) to plain-text converter: enough for prose, tags, synopses and examples."""

    def __init__(self, name: str, section: str):
        self.page = ManPage(name, section, name.upper(), [])
        self.strings = dict(_STRINGS)
        self.heading = ""
        self.lines: list[str] = []
        self.nofill = False
        self.tag: str | None = None
        self.want_tag = False
        self.want_heading = False
        self.skip_until: str | None = None  # ".." after .de/.ig, ".EN" after .EQ
        self.skip_depth = 0  # open \{ blocks of a skipped .el branch
        self.table: str | None = None  # "format" or "rows" inside .TS/.TE

    # inline escapes
    def _escape(self, m: re.Match) -> str:
        if m.group("comment") is not None:
            return ""
        for g in ("char2", "charb"):
            if m.group(g) is not None:
                return _named_char(m.group(g))
        for g in ("strb", "str2", "str1"):
            if m.group(g) is not None:
                return self.text(self.strings.get(m.group(g), ""))
        if m.group("num") is not None:
            n = int(m.group("num"))
            return chr(n) if 32 <= n < 0x110000 else ""
        one = m.group("one")
        if one is not None:
            return _ONE_CHAR.get(one, "" if one.isalnum() or one in "&|^)%:{}!?c" else one)
        return ""

    def text(self, s: str) -> str:
        return _ESCAPE.sub(self._escape, s) if "\\" in s else s

    # paragraph assembly
    def emit(self, s: str):
        if self.want_heading:
            self.flush()
            self.heading, self.want_heading = s.strip().upper(), False
        elif self.want_tag:
            s = re.sub(r"\s+", " ", s).strip()
            self.tag = f"{self.tag}, {s}" if self.tag else s
            self.want_tag = False
        elif self.nofill or self.table:
            self.lines.append(s.rstrip())
        elif s.strip():
            self.lines.append(s.strip())

    def flush(self):
        if self.lines and any(x.strip() for x in self.lines):
            if self.nofill or self.table:
                text = "\n".join(self.lines).strip("\n")
            else:
                text = re.sub(r"\s+", " ", " ".join(self.lines)).strip()
            self.page.blocks.append(ManBlock(self.heading, self.tag, text, self.nofill or bool(self.table)))
        elif self.tag:
            self.page.blocks.append(ManBlock(self.heading, self.tag, "", False))
        self.lines, self.tag = [], None

    # requests
    def request(self, line: str):
        body = line[1:].lstrip()
        m = re.match(r"(\S+)\s*(.*)", body)
        if not m:
            return
        req, rest = m.group(1), m.group(2)
        args = _split_args(rest)
        targs = [self.text(a) for a in args]
        if req in ("SH", "Sh"):
            self.flush()
            if targs:
                self.heading = " ".join(targs).strip().upper()
            else:
                self.want_heading = True
        elif req in ("SS", "Ss"):
            self.flush()
            if targs:
                self.emit(" ".join(targs))
                self.flush()
        elif req == "TH" or req == "Dt":
            if targs:
                self.page.title = targs[0]
            if len(targs) > 1:
                self.page.section = targs[1]
        elif req in ("PP", "LP", "P", "Pp", "sp", "br", "HP", "RS", "RE", "in", "ti", "Bl", "El", "ne"):
            self.flush()
        elif req in ("TP", "It"):
            self.flush()
            if req == "It" and args:
                self.tag = self._mdoc(args)
            else:
                self.want_tag = True
        elif req == "TQ":
            self.want_tag = True
        elif req == "IP":
            self.flush()
            self.tag = targs[0].strip() if targs and targs[0].strip() else None
        elif req in ("nf", "EX", "Bd", "D1", "Dl"):
            self.flush()
            self.nofill = True
            if req in ("D1", "Dl"):
                self.emit(self._mdoc(args))
                self.flush()
                self.nofill = False
        elif req in ("fi", "EE", "Ed"):
            self.flush()
            self.nofill = False
        elif req in ("B", "I", "SM", "SB", "Nd", "UE", "ME"):
            if targs:
                self.emit(("- " if req == "Nd" else "") + " ".join(targs))
        elif req in ("BR", "BI", "IB", "IR", "RB", "RI"):
            self.emit("".join(targs))
        elif req == "SY":
            self.flush()
            self.emit(" ".join(targs))
        elif req == "OP":
            self.emit("[" + " ".join(targs) + "]")
        elif req == "ds" and args:
            name, _, value = rest.partition(" ")
            self.strings[name.strip()] = value[1:] if value.startswith('"') else value
        elif req in ("de", "de1", "am", "ig"):
            self.skip_until = ".."
        elif req == "EQ":
            self.skip_until = ".EN"
        elif req == "TS":
            self.flush()
            self.table = "format"
        elif req == "TE":
            self.flush()
            self.table = None
        elif req in ("if", "ie"):
            cond_rest = re.match(r"(\S+)\s*(.*)", rest)
            if cond_rest:
                inner = cond_rest.group(2)
                inner = inner[2:].lstrip() if inner.startswith("\\{") else inner
                if inner.startswith("\\\n") or inner in ("\\", ""):
                    return
                self.line(inner)
        elif req == "el":
            if "\\{" in rest:
                self.skip_depth = rest.count("\\{") - rest.count("\\}")
        elif req == "Nm":
            if args and self.page.title == self.page.name.upper():
                self.page.title = args[0]
            self.emit(self._mdoc(args) if args else self.page.title)
        elif req == "Fl" or (len(req) in (2, 3) and req[0].isupper() and req[1:].islower() and req in _MDOC_DROP):
            self.emit(self._mdoc([req] + args))

    def _mdoc(self, args: list[str]) -> str:
        out, prefix, close = [], "", 0
        for a in args:
            if a == "Fl":
                prefix = "-"
            elif a in ("Op", "Oo"):
                out.append("[")
                close += a == "Op"
            elif a == "Oc":
                out.append("]")
            elif a in _MDOC_DROP or a == "Ns" or a == "Xr":
                continue
            else:
                out.append(prefix + self.text(a))
                prefix = ""
        if prefix:
            out.append(prefix)
        out += ["]"] * close
        return re.sub(r"\[ ", "[", re.sub(r" \]", "]", " ".join(out)))

    def line(self, line: str):
        if self.skip_until is not None:
            if line.strip().startswith(self.skip_until):
                self.skip_until = None
            return
        if self.skip_depth > 0:
            self.skip_depth += line.count("\\{") - line.count("\\}")
            return
        if line.startswith((".", "'")):
            if line[1:].lstrip().startswith(('\\"', "\\#")):
                return
            self.request(line)
            return
        if self.table == "format":
            if line.rstrip().endswith("."):
                self.table = "rows"
            return
        if self.table == "rows":
            line = line.replace("T{", "").replace("T}", "").replace("\t", "  ")
        if not line.strip():
            if not self.nofill:
                self.flush()
            else:
                self.lines.append("")
            return
        if line.startswith((" ", "\t")) and not self.nofill and not self.table:
            self.flush()
        self.emit(self.text(line))

    def finish(self) -> ManPage:
        self.flush()
        return self.page


def parse_man(src: str, name: str, section: str) -> ManPage | None:
    """Parse a man page's troff source; None for an alias page (`.so other.1`)."""
    for raw in src.split("\n", 50)[:50]:
        if raw.startswith(".so "):
            return None
    p = _ManParser(name, section)
    src = re.sub(r"(?<!\\)((?:\\\\)*)\\\n", r"\1", src.replace("\r\n", "\n"))  # escaped newlines join lines
    for line in src.split("\n"):
        p.line(line)
    page = p.finish()
    _merge_option_tags(page)
    return page


def _merge_option_tags(page: ManPage):
    """DocBook pages write an option as its own paragraph followed by an indented body: make it a tag."""
    merged: list[ManBlock] = []
    for b in page.blocks:
        prev = merged[-1] if merged else None
        if (prev is not None and prev.tag is None and not prev.nofill and b.tag is None and not b.nofill
                and prev.heading == b.heading and prev.text.startswith("-") and len(prev.text) < 60
                and "\n" not in prev.text and b.text and not b.text.startswith("-")):
            merged[-1] = ManBlock(b.heading, prev.text, b.text, False)
        else:
            merged.append(b)
    page.blocks = merged
