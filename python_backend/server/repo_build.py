"""`mol2 repo build --adapter-set FILE`: one ensemble `mol2_<set>` per adapter set, side by side in one repository.

The adapter-free stages (tokenize, prefill) are shared by every set: that is the point of the design. Each set
gets its own engine (its own adapter registry and router head; conversations meet in the shared journal), router
(its own cached option side), decode and route-only model,
generated from the templates in model_repository/ with the set's file as their `adapter_set` parameter.

By default the sets go into artifacts/model_repository/, a copy of the committed repository made on first use
(`mol2 serve --model-repository artifacts/model_repository` serves it), so the committed one stays as it is.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from ..core.adapter_set import parse_adapter_set
from ..core.settings import ROOT

TEMPLATES = ROOT / "model_repository"
GENERATED = ROOT / "artifacts" / "model_repository"  # where `mol2 repo build` writes unless told otherwise
_SET_NAME = re.compile(r"^[a-z0-9_]{1,40}$")


def set_name_of(path: Path) -> str:
    name = re.sub(r"[^a-z0-9_]", "_", path.stem.lower())
    if not _SET_NAME.match(name):
        raise ValueError(f"cannot derive a model name from {path.name!r}: use --name")
    return name


def _with_parameter(config: str, key: str, value: str) -> str:
    pattern = re.compile(rf'parameters \{{ key: "{key}" value: \{{ string_value: "[^"]*" \}} \}}')
    line = f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
    return pattern.sub(line, config) if pattern.search(config) else config.rstrip() + "\n" + line + "\n"


def build(adapter_set: Path, repository: Path = GENERATED, name: str | None = None,
          router_dir: Path | None = None) -> list[str]:
    """Write engine_<set>, router_<set>, decode_<set>, route_<set> and mol2_<set> into `repository` (router and
    decode serve the set when the server is split in two); returns the names written.

    The set's router head: `router_dir`, else a `router/` folder beside the set's file, else the served model's
    own head (the router model's "auto"), so a set kept anywhere still routes."""
    adapter_set = adapter_set.resolve()
    parse_adapter_set(adapter_set)  # refuse a bad file before writing anything
    if router_dir is None and (adapter_set.parent / "router" / "config.json").is_file():
        router_dir = adapter_set.parent / "router"
    if router_dir is not None and not (Path(router_dir) / "config.json").is_file():
        raise FileNotFoundError(f"--router-dir {router_dir} holds no router head (config.json)")
    name = name or set_name_of(adapter_set)
    if not (repository / "mol2" / "config.pbtxt").is_file():  # a new repository: the base models beside the set's
        shutil.copytree(TEMPLATES, repository, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    written = []
    for stage in ("engine", "router", "decode", "route"):
        target = repository / f"{stage}_{name}"
        (target / "1").mkdir(parents=True, exist_ok=True)
        shutil.copy2(TEMPLATES / stage / "1" / "model.py", target / "1" / "model.py")
        config = (TEMPLATES / stage / "config.pbtxt").read_text()
        config = config.replace(f'name: "{stage}"', f'name: "{stage}_{name}"', 1)
        if stage != "route":  # route runs no adapters: it calls the set's router
            config = _with_parameter(config, "adapter_set", str(adapter_set))
        if stage in ("engine", "router") and router_dir is not None:
            config = _with_parameter(config, "router_dir", str(Path(router_dir).resolve()))
        if stage == "route":
            config = _with_parameter(config, "router_model", f"router_{name}")
        (target / "config.pbtxt").write_text(config)
        written.append(target.name)
    ensemble = (TEMPLATES / "mol2" / "config.pbtxt").read_text()
    ensemble = ensemble.replace('name: "mol2"', f'name: "mol2_{name}"', 1)
    ensemble = ensemble.replace('model_name: "engine"', f'model_name: "engine_{name}"')
    target = repository / f"mol2_{name}"
    (target / "1").mkdir(parents=True, exist_ok=True)
    (target / "config.pbtxt").write_text(ensemble)
    written.append(target.name)
    return written
