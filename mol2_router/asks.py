"""Requests *about* each domain, made from offline real text: `domain:<name>` questions of the `ask:*` sources.

The corpus gives the domains as their material (code, markup, shell sessions, fortune cookies), so a router trained
on it alone learns that coding looks like code; a user types "my script raises KeyError: ..." instead. Each source
here pairs one real item with one phrasing of a request:

- coding: stdlib docstrings ("Return the ...") as things to implement (as "... to return the ..." or "a function
  that returns ..."), the stdlib's own `raise X("...")` messages as errors to explain, libc calls from man(3) as
  how-tos, Python's builtins, the stdlib's modules (by their docstring's first line) and the language reference's
  topics (`pydoc_data`) as questions about the language;
- agent: commands from man(1)/man(8) whose one-line summary is an action, as jobs to carry out;
- design: X11 colour names (rgb.txt), icon names of the installed icon themes, font packages (Debian section fonts),
  CSS properties (the list Pygments' CSS lexer knows) as styling requests;
- chat: fortune cookies shared in conversation.

Items split train / bench by their own hash, and so do the phrasings: a kind's last two phrasings are used only
for the benchmark (`domain.bench`), so it also measures requests phrased in a way training never showed.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Iterator

from engine_build.sources import (PythonFile, SourceMissing, default_stdlib, fortune_files, man_files,
                                  read_fortunes, read_man, read_python_sources, unit_hash)

BENCH_ONLY_PHRASINGS = 2

PHRASINGS: dict[str, tuple[str, ...]] = {
    "coding:doc": ("I need a Python helper to {what}", "Implement this in Python, please: {what}",
                   "Could you code up something that will {what}?", "Show me the Python for this: {what}",
                   "Write a Python function that {does}.", "I need a function which {does}.",
                   "Code a small Python utility that {does}.", "Make a Python function that {does}.",
                   "Give me a function to {what}", "Can you write code that {does}?"),
    "coding:error": ("Why do I get {error}?", "My program stops with {error}. What did I do wrong?",
                     "Python says {error} - how do I fix my code?", "Debug this for me: {error}",
                     "Explain this error from my script: {error}", "I keep hitting {error} when I run my tests."),
    "coding:libc": ("In C, how do I use {call}() to {what}?", "Show an example C program calling {call}() ({what}).",
                    "What arguments does the C function {call}() take? It should {what}.",
                    "Explain the return value of {call}() in C ({what}).",
                    "Is {call}() safe to use in my C code? I want to {what}.",
                    "Write C that uses {call}() to {what}."),
    "coding:builtin": ("When should I use {name}() in Python?", "Explain Python's built-in {name} with an example.",
                       "Why does {name}() not behave the way I expect in my script?",
                       "Show me a few ways to use {name}() in Python.", "How does Python's {name} work under the hood?",
                       "Is there a better alternative to {name}() in my Python code?"),
    "coding:module": ("How do I use the Python {module} module? It is about {about}.",
                      "Write a short example with Python's {module} module ({about}).",
                      "What are the main functions of the {module} module in Python?",
                      "Is {module} the right Python module for {about}?",
                      "Help me understand the {module} module ({about}) in Python.",
                      "Which part of Python's {module} module should I use for {about}?"),
    "coding:topic": ("Explain {topic} in Python with a small example.", "I'm confused about {topic} in Python.",
                     "What are the rules for {topic} in Python?", "Teach me {topic} in Python, step by step.",
                     "What's a common mistake with {topic} in Python?", "In Python code, how do {topic} work?"),
    "agent:command": ("On this machine, {what} with {cmd} for me.", "Please use {cmd} to {what} and report back.",
                      "Run {cmd} here so that we {what}.", "Go ahead and {what} - {cmd} should do it.",
                      "Log in to the server and {what} using {cmd}.", "Automate this with {cmd}: {what}."),
    "design:colour": ("Make the page background {colour}.", "Does {colour} work as an accent colour for buttons?",
                      "Pick a palette around {colour} for my app.", "Restyle the header in {colour}.",
                      "What text colour reads well on {colour}?", "Use {colour} for the links and adjust the rest."),
    "design:icon": ("Draw an icon for '{icon}' in SVG.", "Design a flat symbolic icon meaning {icon}.",
                    "Sketch a 16px glyph for the {icon} action.",
                    "Our toolbar needs a {icon} icon; what should it look like?",
                    "Redraw the {icon} icon so it matches a rounded style.", "Make a monochrome {icon} pictogram."),
    "design:font": ("Would this font suit my website's headings: {font}?", "Pair {font} with a body font for me.",
                    "Set the UI typeface to {font}.", "Is {font} readable enough for long paragraphs?",
                    "Build a type scale for a landing page using {font}.", "Mock up a poster title set in {font}."),
    "design:css": ("Use the CSS property {prop} to tidy up my page.", "Style the navigation bar with {prop}.",
                   "Should I change the {prop} of my cards to make them look better?",
                   "Give the buttons a {prop} rule so they look nicer.", "Which value of {prop} suits a responsive layout?",
                   "Explain the CSS property {prop} with an example for my landing page."),
    "chat:share": ("Ha, I read this today: {quote}", "My grandfather always said: {quote}",
                   "Someone posted this and I can't stop laughing: {quote}", "What do you make of this? {quote}",
                   "Random thought for you: {quote}", "A friend texted me this: {quote}"),
}

_ACTION_VERBS = {"add", "build", "change", "check", "compare", "compress", "configure", "convert", "copy", "count",
                 "create", "decompress", "delete", "determine", "display", "download", "dump", "edit", "extract",
                 "find", "format", "generate", "join", "kill", "list", "locate", "manage", "merge", "modify", "monitor",
                 "mount", "move", "print", "query", "read", "remove", "rename", "report", "reset", "restore", "run",
                 "search", "send", "set", "show", "sort", "split", "start", "stop", "summarize", "synchronize",
                 "test", "translate", "update", "verify", "view", "wait", "write"}
_CODE_VERBS = _ACTION_VERBS | {"return", "make", "get", "parse", "encode", "decode", "open", "close", "load", "save",
                               "compute", "calculate", "strip", "apply", "wrap", "yield"}
_NAME_LINE = re.compile(r"^(?P<names>[\w.+:,\\ -]+?)\s+\\?-\s+(?P<what>.+)$")


def _imperative(phrase: str) -> str | None:
    """'Returns the size.' -> 'return the size'; None unless the phrase starts with a verb in the third person or
    the imperative that we know."""
    words = phrase.strip().rstrip(".").split()
    if len(words) < 3:
        return None
    first = words[0].lower()
    if first.endswith(("ches", "shes", "sses", "xes")):  # "searches" -> "search"
        base = first[:-2]
    else:  # "returns" -> "return", "list" stays
        base = first[:-1] if first.endswith("s") else first
    if base not in _CODE_VERBS:
        return None
    return " ".join([base, *words[1:]])


def _third_person(imperative: str) -> str:
    """'return the size' -> 'returns the size' (for the verbs `_imperative` knows)."""
    verb, _, rest = imperative.partition(" ")
    if verb.endswith(("ch", "sh", "ss", "x")):
        verb += "es"
    elif verb.endswith("y") and verb[-2:-1] not in "aeiou":
        verb = verb[:-1] + "ies"
    else:
        verb += "s"
    return f"{verb} {rest}"


def _builtin_names() -> list[str]:
    """Python's builtin functions and types, without exceptions and the interactive helpers."""
    import builtins

    skip = {"copyright", "credits", "exit", "help", "license", "quit"}
    return [name for name, obj in vars(builtins).items()
            if not name.startswith("_") and name not in skip and callable(obj)
            and not (isinstance(obj, type) and issubclass(obj, BaseException))]


def _stdlib_sources(stdlib: Path) -> list[PythonFile]:
    """The .py files of the standard library's top folder, then of its subfolders' (site-packages' too, as the
    routing data has always read them)."""
    found = read_python_sources(stdlib, skip_dirs=frozenset({"__pycache__"}), max_depth=2).files
    return sorted(found, key=lambda f: f.rel.count("/"))  # stable: each level keeps its sorted order


def _module_summaries(files: list[PythonFile]) -> Iterator[tuple[str, str]]:
    """(module, what its docstring's first line says it is about), for public stdlib modules and packages."""
    for file in files:
        parts = file.rel.split("/")
        if not (len(parts) == 1 or parts[1:] == ["__init__.py"]):
            continue
        name = parts[0].removesuffix(".py")
        if name.startswith("_") or "test" in name:
            continue
        match = re.match(r'\s*(?:#[^\n]*\n\s*)*[rR]?"""\s*(?P<doc>[^\n]{8,100})', file.text)
        if not match:
            continue
        about = re.sub(rf"^(module\s+)?{re.escape(name)}(\.py)?\s*(--|-|:)\s*", "", match["doc"], flags=re.IGNORECASE)
        about = re.sub(r'\.\s.*$|\.$', "", about.strip().removesuffix('"""')).strip()
        if len(about.split()) >= 2:
            yield name, about[0].lower() + about[1:] if not about[:2].isupper() else about


def _language_topics() -> list[str]:
    """The language reference's help topics ('context-managers' -> 'context managers')."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [t.replace("-", " ") for t in topics if not t.startswith(("bltin", "atom", "id-", "typesseq-"))]


def _css_property_names() -> list[str]:
    try:  # Pygments ships the list of CSS properties its CSS lexer highlights
        from pygments.lexers._css_builtins import _css_properties
    except ImportError:
        return []
    return sorted(p for p in _css_properties if not p.startswith("-"))


def _man_summaries(section: str, man_root: Path) -> Iterator[tuple[str, str]]:
    """(first name, summary) from the NAME line of each page of one section (aliases too)."""
    try:
        files = man_files(man_root, (section,))
    except SourceMissing:
        return
    for file in files:
        if not re.search(rf"\.{section}(\.gz)?$", file.path.name):
            continue
        text = read_man(file.path)
        if text is None:
            continue
        lines = text.splitlines()[:120]
        for i, line in enumerate(lines):
            if re.match(r'^\.S[Hh]\s+"?NAME"?\s*$', line, re.IGNORECASE):
                match = next((m for m in (_NAME_LINE.match(n.replace("\\-", "-")) for n in lines[i + 1:i + 4]) if m),
                             None)
                if match:
                    name = match["names"].split(",")[0].strip().replace("\\", "")
                    yield name, re.sub(r"\\f[BIRP]|\\[&e]", "", match["what"]).strip()
                break


def _stdlib_items(files: list[PythonFile]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(key, imperative) from function docstrings and (key, 'Exc: message') from literal raise messages."""
    docs, errors = {}, {}
    for file in files:
        parts = file.rel.split("/")
        if "test" in parts or parts[-1].startswith("test"):
            continue
        stem = parts[-1].removesuffix(".py")
        for m in re.finditer(r'def (\w+)\([^)]*\)[^:]*:\s*\n\s*"""(?P<doc>[^\n"]{15,140})', file.text):
            what = _imperative(m["doc"].split(". ")[0])
            if what:
                docs.setdefault(what, f"{stem}.{m[1]}")
        for m in re.finditer(r'raise (\w+Error)\("(?P<msg>[^"{}%\\]{12,90})"\)', file.text):
            errors.setdefault(f"{m[1]}: {m['msg']}", f"{stem}:{m.start()}")
    return [(k, v) for v, k in docs.items()], [(k, v) for v, k in errors.items()]


def fortune_cookies(root: Path) -> Iterator[tuple[str, str, int]]:
    """(category, cookie on one line, its index in the file) for the fortunes of 20 to 400 characters."""
    for path in fortune_files(root):
        for fortune in read_fortunes(path):
            cookie = " ".join(fortune.text.replace("%", " ").split())  # "100%" -> "100": as the data always was
            if 20 <= len(cookie) <= 400:
                yield fortune.file, cookie, fortune.index


def _font_packages(records: list[dict]) -> list[tuple[str, str]]:
    skip = re.compile(r"transitional|convert|editor|tool|utilit|librar|metapackage|dummy", re.IGNORECASE)
    return [(r["name"], r["short"].rstrip(".")) for r in records
            if r["section"] == "fonts" and re.search(r"\bfonts?\b", r["short"], re.IGNORECASE)
            and not skip.search(r["short"])]


def _unique(pairs: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """The first occurrence of each item key (a man page reached by several names, ...)."""
    first: dict[str, dict] = {}
    for key, fields in pairs:
        first.setdefault(key, fields)
    return list(first.items())


def ask_items(man_root: str | Path = "/usr/share/man", icon_root: str | Path = "/usr/share/icons",
              rgb: str | Path = "/usr/share/X11/rgb.txt", fortune_root: str | Path = "/usr/share/games/fortunes",
              debian: list[dict] | None = None) -> dict[str, list[tuple[str, dict]]]:
    """kind -> [(item key, fields for the phrasing)], every source that is installed."""
    man_root, icon_root = Path(man_root), Path(icon_root)
    stdlib = _stdlib_sources(default_stdlib())
    docs, errors = _stdlib_items(stdlib)
    items: dict[str, list[tuple[str, dict]]] = {kind: [] for kind in PHRASINGS}
    items["coding:doc"] = [(key, {"what": what, "does": _third_person(what)}) for key, what in docs]
    items["coding:builtin"] = [(f"builtin:{n}", {"name": n}) for n in _builtin_names()]
    items["coding:module"] = [(f"module:{m}", {"module": m, "about": about})
                              for m, about in _module_summaries(stdlib)]
    items["coding:topic"] = [(f"topic:{t}", {"topic": t}) for t in _language_topics()]
    items["coding:error"] = [(key, {"error": error}) for key, error in errors]
    for call, what in _man_summaries("3", man_root):
        if (verb := _imperative(what)) and re.fullmatch(r"[a-z_][a-z0-9_]*", call):
            items["coding:libc"].append((f"libc:{call}", {"call": call, "what": verb}))
    for section in ("1", "8"):
        for cmd, what in _man_summaries(section, man_root):
            if (verb := _imperative(what)) and " " not in cmd:
                items["agent:command"].append((f"man{section}:{cmd}", {"cmd": cmd, "what": verb}))
    if Path(rgb).exists():
        names = {" ".join(re.findall(r"[A-Z]?[a-z]+|\d+", line.split("\t")[-1])).lower()
                 for line in Path(rgb).read_text().splitlines()[1:] if "\t" in line}
        items["design:colour"] = [(f"rgb:{n}", {"colour": n}) for n in sorted(names) if n and not n[-1].isdigit()]
    icons = {re.sub(r"(-symbolic|-rtl|-ltr)+$", "", p.name.split(".")[0]) for p in icon_root.glob("*/*/*/*.*")} \
        if icon_root.is_dir() else set()
    items["design:icon"] = [(f"icon:{n}", {"icon": n.replace("-", " ")}) for n in sorted(icons) if len(n) > 3]
    items["design:font"] = [(f"font:{n}", {"font": s}) for n, s in _font_packages(debian or [])]
    items["design:css"] = [(f"css:{p}", {"prop": p}) for p in _css_property_names()]
    if Path(fortune_root).is_dir():
        items["chat:share"] = [(f"fortune:{cat}:{i}", {"quote": text})
                               for cat, text, i in fortune_cookies(Path(fortune_root)) if len(text) <= 200]
    return {kind: _unique(pairs) for kind, pairs in items.items()}


def ask_queries(items: dict[str, list[tuple[str, dict]]], split: str, per_class: int, seed: int = 0,
                bench_fraction: float = 0.25) -> dict[str, list[tuple[str, str]]]:
    """(id, query) per domain: items on `split`'s side of the hash ("train" or "bench"), spread evenly over the
    domain's kinds, each phrased with one of the phrasings that split may use."""
    out: dict[str, list[tuple[str, str]]] = {}
    kinds_of: dict[str, list[str]] = {}
    for kind in PHRASINGS:
        if items.get(kind):
            kinds_of.setdefault(kind.split(":")[0], []).append(kind)
    for domain, kinds in kinds_of.items():
        pools = []
        for kind in kinds:
            side = [(key, fields) for key, fields in items[kind]
                    if (unit_hash(key, "ask-split") < bench_fraction) == (split == "bench")]
            pools.append(sorted(side, key=lambda kf: unit_hash(kf[0], f"ask:{seed}")))
        cut = -BENCH_ONLY_PHRASINGS
        phrasings = {k: PHRASINGS[k][cut:] if split == "bench" else PHRASINGS[k][:cut] for k in kinds}
        chosen, depth = [], 0
        while len(chosen) < per_class and any(depth < len(p) for p in pools):
            for kind, pool in zip(kinds, pools):
                if depth < len(pool) and len(chosen) < per_class:
                    key, fields = pool[depth]
                    rng = random.Random(f"{seed}:{key}")
                    chosen.append((f"ask:{key}", rng.choice(phrasings[kind]).format(**fields)))
            depth += 1
        out[domain] = chosen
    return out

