"""vLLM's adapter management (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) over the adapter-set file.

The file the engine watches stays the one source of truth: loading an adapter checks it as the engine will (PEFT's
format, the placement rule, module shapes, rank, free slots: `AdapterRegistry.check` on a weightless copy of the
model's modules; the set's own rules: `parse_adapter_set` on the new file), then replaces the file atomically.
The engine takes the new set on its next request (AdapterSetWatcher: the file's mtime), between scheduler steps;
the router's option cache is keyed by the set's (route prompt, adapters), so a new set gets its own options.

`lora_path` must lie inside the adapters root once symlinks and `..` are resolved: a server that loads whatever
path a client names reads any file the server's user can read. A path the OS cannot take (a NUL byte, a name or
path over its limits, a symlink loop, a folder it may not read) is the client's 400 naming lora_path, as is a
`lora_name` the adapter-set file cannot hold.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
import threading
from pathlib import Path

from ced.adapters import AdapterError

from ...core.adapter_set import _NAME as ADAPTER_NAME
from ...core.adapter_set import AdapterSet, AdapterSetError, AdapterSetWatcher, parse_adapter_set
from .schema import APIError

RESERVED = ("mol2", "auto", "base")  # model names of the API (and the engine's "no adapter")


class AdapterManager:
    def __init__(self, adapter_set: Path, adapters_root: Path, model_dir: Path, max_adapters: int, max_rank: int):
        self.path = Path(adapter_set)
        self.root = Path(adapters_root).resolve()
        self.watcher = AdapterSetWatcher(self.path)
        self.max_adapters = max_adapters
        self._checker = _weightless_registry(model_dir, max_adapters, max_rank)
        self.max_context = self._checker.config.max_context
        self.vocab_size = self._checker.config.vocab_size
        self._lock = threading.Lock()  # one rewrite at a time (the app may run handlers on several threads)

    def current(self) -> AdapterSet:
        self.watcher.poll()  # a stat: the file may also be edited by hand
        return self.watcher.current

    # -- load / unload --------------------------------------------------------------------------------------------

    def load(self, name: str, path: str, description: str | None = None) -> AdapterSet:
        if name in RESERVED or ":" in name:
            raise APIError(400, f"lora_name {name!r} is reserved (the API's model names: {', '.join(RESERVED)}, "
                                "and NAME:ADAPTER)", "lora_name", "invalid_value")
        if not ADAPTER_NAME.match(name):  # the adapter-set file's rule: refused here, not as a bad file later
            raise APIError(400, f"lora_name {_shown(name)} must be 1-64 letters, digits, '_', '.' or '-'",
                           "lora_name", "invalid_value")
        directory = self.confined(path)
        with self._lock:
            raw = self._raw()
            if any(entry.get("name") == name for entry in raw["adapters"]):
                raise APIError(400, f"the adapter {name!r} is already loaded; unload it first", "lora_name",
                               "adapter_exists")
            if len(raw["adapters"]) >= self.max_adapters:
                raise APIError(400, f"all {self.max_adapters} adapter slots of the engine are in use (max_adapters); "
                                    "unload one first", "lora_name", "no_free_slot")
            try:
                self._checker.check(directory)
            except (AdapterError, ValueError, OSError) as error:
                raise APIError(400, f"the adapter at {_shown(path)} cannot be served: {error}", "lora_path",
                               "invalid_adapter") from None
            raw["adapters"].append({"name": name, "path": self._relative(directory),
                                    "description": description or _description(directory, name)})
            return self._write(raw)

    def unload(self, name: str) -> AdapterSet:
        with self._lock:
            raw = self._raw()
            kept = [entry for entry in raw["adapters"] if entry.get("name") != name]
            if len(kept) == len(raw["adapters"]):
                known = ", ".join(entry.get("name", "?") for entry in raw["adapters"]) or "none"
                raise APIError(404, f"no adapter {name!r} is loaded (loaded: {known})", "lora_name",
                               "adapter_not_found")
            raw["adapters"] = kept
            return self._write(raw)

    def confined(self, path: str) -> Path:
        """`path` (absolute, or relative to the root) resolved; refused unless it is a directory inside the root."""
        candidate = Path(path) if Path(path).is_absolute() else self.root / path
        self._check_os_limits(path, candidate)
        try:
            resolved = candidate.resolve()  # symlinks and `..` are followed before the check, not after
            inside = resolved.is_relative_to(self.root)
            is_dir = inside and resolved.is_dir()
        except (OSError, RuntimeError) as error:  # RuntimeError: pathlib's "Symlink loop from ..."
            raise APIError(400, f"lora_path {_shown(path)} cannot be resolved: {_os_reason(error)}", "lora_path",
                           "invalid_path") from None
        if not inside:
            raise APIError(400, f"lora_path {_shown(path)} resolves to {resolved}, outside the adapters root "
                                f"{self.root} (mol2 serve --adapters-root)", "lora_path", "path_not_allowed")
        if not is_dir:
            raise APIError(400, f"lora_path {_shown(path)} is not a directory inside {self.root}", "lora_path",
                           "invalid_adapter")
        return resolved

    def _check_os_limits(self, path: str, candidate: Path) -> None:
        """What the OS refuses with an exception of its own (os.stat: ValueError for NUL, ENAMETOOLONG), refused
        first with the limit named."""
        if "\x00" in path:
            raise APIError(400, "lora_path must not contain a NUL byte", "lora_path", "invalid_path")
        name_max, path_max = os.pathconf(self.root, "PC_NAME_MAX"), os.pathconf(self.root, "PC_PATH_MAX")
        longest = max((len(os.fsencode(part)) for part in candidate.parts), default=0)
        if longest > name_max:
            raise APIError(400, f"lora_path {_shown(path)} has a name of {longest} bytes, over the filesystem's limit "
                                f"of {name_max} (NAME_MAX)", "lora_path", "invalid_path")
        if len(os.fsencode(str(candidate))) >= path_max:
            raise APIError(400, f"lora_path {_shown(path)} is {len(os.fsencode(str(candidate)))} bytes as a path, "
                                f"over the OS's limit of {path_max - 1} (PATH_MAX)", "lora_path", "invalid_path")

    # -- the file -------------------------------------------------------------------------------------------------

    def _raw(self) -> dict:
        """The file as JSON, kept whole (route_prompt and any other field survive the rewrite)."""
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise APIError(500, f"the adapter-set file {self.path} cannot be read: {error}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("adapters"), list):
            raise APIError(500, f"the adapter-set file {self.path} has no 'adapters' list")
        return raw

    def _relative(self, directory: Path) -> str:
        base = self.path.resolve().parent
        return os.path.relpath(directory, base) if directory.is_relative_to(base) else str(directory)

    def _write(self, raw: dict) -> AdapterSet:
        """Check the new set by parsing it, then swap it in with one rename, so the engine reads the old file or
        the new one, never half of one. The mtime must change for the watchers to see it: on a filesystem whose
        clock ticks coarser than two quick rewrites, it is moved on by hand."""
        before = os.stat(self.path).st_mtime_ns
        handle, temporary = tempfile.mkstemp(prefix=".adapter_set.", suffix=".json", dir=self.path.parent)
        try:
            with os.fdopen(handle, "w") as file:
                json.dump(raw, file, indent=2)
                file.write("\n")
            try:
                adapter_set = parse_adapter_set(temporary)  # relative paths resolve against the same folder
            except AdapterSetError as error:
                raise APIError(400, str(error).replace(temporary, str(self.path)), "lora_path",
                               "invalid_adapter_set") from None
            os.chmod(temporary, os.stat(self.path).st_mode & 0o777)
            if os.stat(temporary).st_mtime_ns <= before:
                os.utime(temporary, ns=(before + 1_000_000, before + 1_000_000))
            os.replace(temporary, self.path)
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise
        self.watcher.poll()
        return adapter_set


def _shown(text: str) -> str:
    """A client's string in a message: quoted, and cut when long (a 4,000-byte path is not worth repeating)."""
    return repr(text) if len(text) <= 80 else repr(text[:77]) + "..."


def _os_reason(error: Exception) -> str:
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror} ({errno.errorcode.get(error.errno, error.errno)})"
    if isinstance(error, RuntimeError):  # Python 3.11's pathlib reports a loop itself instead of raising ELOOP
        return f"{os.strerror(errno.ELOOP)} (ELOOP): {error}"
    return str(error)


def _description(directory: Path, name: str) -> str:
    """What the router reads about the adapter: its folder's description.txt (as the demo's adapters have)."""
    text = directory / "description.txt"
    return text.read_text().strip() if text.is_file() else name


def _weightless_registry(model_dir: Path, max_adapters: int, max_rank: int):
    """An AdapterRegistry over the model's LoRA-wrapped modules built on the meta device: the shapes and the
    placement rule of the real engine, no weights in memory (milliseconds even for a large model)."""
    import torch

    from ced.families import family_of, read_config

    family = family_of(model_dir)
    with torch.device("meta"):  # the slot buffers too
        if family.name == "deepseek_v41":
            from ced.deepseek_v41.adapters import V41AdapterRegistry, V41AdapterSet

            return V41AdapterRegistry(V41AdapterSet(family.model_cls()(read_config(model_dir))), max_adapters,
                                      max_rank)
        from ced.engine import CEDEngine
        from ced.model import CEDForCausalLM, CEDPretrainedConfig

        return CEDEngine(CEDForCausalLM(CEDPretrainedConfig.from_pretrained(model_dir)), max_adapters,
                         max_rank).adapters
