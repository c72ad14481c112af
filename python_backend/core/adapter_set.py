"""The adapter-set file: which adapters a server offers (name, path, description) and the route prompt.

    {"adapters": [{"name": "coding", "path": "adapters/coding", "description": "Python code"}, ...],
     "route_prompt": "Pick the adapter for the user's request."}       # optional

Relative paths are relative to the file. Without `route_prompt` the router uses the prompt its head was trained with
(recorded in the head's config.json); another prompt changes the option side the head reads, which it has not seen
in training (on the demo, "Choose the adapter ..." instead of the trained "Route to:" took mode B's domain.bench
accuracy from 93.9% to 91.8%). The file is re-read when its mtime changes (a parse per request would cost
milliseconds), and `sync` brings an engine's registry to it: new adapters loaded, changed ones replaced
(a new version), removed ones unloaded. A bad file keeps the last good set serving and says what is wrong.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ced.adapters import AdapterRegistry

from .fnv import adapter_hash

log = logging.getLogger(__name__)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class AdapterSetError(ValueError):
    pass


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    path: str  # absolute
    description: str

    @property
    def hash(self) -> int:
        return adapter_hash(self.path)


@dataclass(frozen=True)
class AdapterSet:
    route_prompt: str
    adapters: tuple[AdapterEntry, ...]

    def by_name(self, name: str) -> AdapterEntry | None:
        return next((a for a in self.adapters if a.name == name), None)

    def by_hash(self, value: int) -> AdapterEntry | None:
        return next((a for a in self.adapters if a.hash == value), None)


def parse_adapter_set(path: str | Path) -> AdapterSet:
    path = Path(path).resolve()
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterSetError(f"adapter-set file {path} does not exist") from None
    except json.JSONDecodeError as error:
        raise AdapterSetError(f"adapter-set file {path} is not valid JSON: {error}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("adapters"), list):
        raise AdapterSetError(f"{path}: expected an object with an 'adapters' list")
    entries, seen = [], set()
    for number, item in enumerate(raw["adapters"], start=1):
        missing = [key for key in ("name", "path", "description") if not isinstance(item, dict) or key not in item]
        if missing:
            raise AdapterSetError(f"{path}: adapter #{number} lacks {missing}")
        name = item["name"]
        if not isinstance(name, str) or not _NAME.match(name):
            raise AdapterSetError(f"{path}: adapter #{number} has a bad name {name!r} (letters, digits, _ . -)")
        if name in seen:
            raise AdapterSetError(f"{path}: adapter name {name!r} appears twice")
        seen.add(name)
        entry = AdapterEntry(name, str((path.parent / item["path"]).resolve()), str(item["description"]))
        twin = next((e for e in entries if e.hash == entry.hash), None)
        if twin is not None:  # the route decision travels as this hash: two entries must never share it
            same = "the same directory as" if twin.path == entry.path else "a 31-bit path id with"
            raise AdapterSetError(f"{path}: adapter {name!r} has {same} {twin.name!r} ({entry.path}); give each "
                                  "adapter of a set a directory of its own")
        entries.append(entry)
    return AdapterSet(str(raw.get("route_prompt") or ""), tuple(entries))  # "": the head's trained prompt


class AdapterSetWatcher:
    """The current adapter set of one file, re-read when the file's mtime changes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._mtime: int | None = None
        self.current: AdapterSet = parse_adapter_set(self.path)  # the first read must succeed
        self._mtime = os.stat(self.path).st_mtime_ns
        self.error: str | None = None

    def poll(self) -> bool:
        """Re-read if the file changed; True when a new set was taken. A bad file keeps the old set."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            self.error = f"adapter-set file {self.path} disappeared; keeping the last good set"
            return False
        if mtime == self._mtime:
            return False
        self._mtime = mtime
        try:
            self.current, self.error = parse_adapter_set(self.path), None
            return True
        except AdapterSetError as error:
            self.error = f"{error}; keeping the last good set"
            log.error(self.error)
            return False


def sync_registry(registry: AdapterRegistry, adapter_set: AdapterSet, fingerprints: dict[str, str],
                  failures: dict[str, str] | None = None) -> list[str]:
    """Make `registry` hold exactly `adapter_set`. `fingerprints` (name -> path + file mtimes) tracks what is
    loaded so a changed adapter directory is replaced. Returns what changed; a bad adapter is reported and
    skipped (the rest of the set still loads), and why is kept in `failures` (name -> error) while it stays so."""
    failures = {} if failures is None else failures
    changes = []
    wanted = {entry.name: entry for entry in adapter_set.adapters}
    for name in [r.name for r in registry.records() if r.name not in wanted]:
        registry.unload(name)
        fingerprints.pop(name, None)
        changes.append(f"unloaded {name}")
    for name in [name for name in failures if name not in wanted]:
        del failures[name]
    for name, entry in wanted.items():
        fingerprint = _fingerprint(entry.path)
        if fingerprints.get(name) == fingerprint:
            continue
        try:
            if name in registry:
                record = registry.replace(name, entry.path)
                changes.append(f"replaced {name} (version {record.version})")
            else:
                registry.load(name, entry.path)
                changes.append(f"loaded {name}")
            fingerprints[name] = fingerprint
            failures.pop(name, None)
        except ValueError as error:
            log.error("adapter %s not loaded: %s", name, error)
            changes.append(f"failed {name}: {error}")
            failures[name] = str(error)
    return changes


def _fingerprint(path: str) -> str:
    files = sorted(Path(path).glob("adapter_*")) if Path(path).is_dir() else []
    return path + "|" + "|".join(f"{f.name}:{f.stat().st_mtime_ns}:{f.stat().st_size}" for f in files)
