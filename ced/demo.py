"""The demo every command and the server use: the `demo` preset with four domain adapters, and a scripted conversation.

Which demo, in one order that `mol2 chat`, `mol2 serve` (and its Triton models), `mol2 router ...` and the
benchmarks share (`find_demo` / `resolve_demo`):

1. the folder named explicitly (`--demo`), a demo folder or its model/ folder;
2. ROOT/demo when it holds a model (ROOT: artifacts/ unless given): the fresh build of `mol2 build demo`, which
   `mol2 router ...` trains its head on and `mol2 build publish` then copies into models/demo;
3. the committed demo, models/demo;
4. the untrained demo: seeded random weights and random PEFT adapters, built once under ROOT/demo-untrained/ and
   tokenized as UTF-8 bytes (costs and bytes are real, text is noise).

The fresh build comes before the committed one so that a router is trained on, and a server serves, the model just
built; with one order for all, the two cannot differ. A demo is trained when its model has its BPE tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
WORK_ROOT = PROJECT / "artifacts"  # ROOT by default: `mol2 build demo --root artifacts` writes ROOT/demo
COMMITTED = PROJECT / "models/demo"  # the trained demo in the repository (`mol2 build publish`)

ADAPTERS = {
    "chat": "small talk, jokes and everyday conversation",
    "agent": "multi-step tasks that run shell commands and tools",
    "coding": "writing, explaining and fixing Python code",
    "design": "user-interface design: HTML, CSS and SVG",
}

BASE_NAME = "base"  # how the base model (no adapter, None in the engine) is named to people, as the server names it

SCRIPT: list[tuple[str, str | None]] = [  # (user turn, adapter; None: the base model)
    ("Hi! Tell me something funny about computers.", "chat"),
    ("Find every file in my home directory changed in the last day and archive them.", "agent"),
    ("Write a Python function that returns the n-th Fibonacci number.", "coding"),
    ("Make the login button a rounded blue gradient with white text.", "design"),
    ("Now add a unit test for the Fibonacci function.", "coding"),
    ("Thanks, that was helpful. One more joke?", "chat"),
    ("And what does the base model say without any adapter?", None),
]

ORIGINS = {  # why the resolver chose a demo, as each command reports it
    "given": "named explicitly",
    "built": "the fresh build, before models/demo",
    "committed": "the committed demo",
    "untrained": "no built or committed demo",
}


@dataclass(frozen=True)
class Demo:
    """One demo folder: model/ (with tokenizer.json when trained), adapters/<name>/, and router/ (the MoL2 head) and
    adapter_set.json once exported or served."""

    root: Path
    origin: str  # a key of ORIGINS

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def adapters_dir(self) -> Path:
        return self.root / "adapters"

    @property
    def router_dir(self) -> Path:
        return self.root / "router"

    @property
    def trained(self) -> bool:
        return (self.model_dir / "tokenizer.json").is_file()  # pretraining writes it; the untrained demo has none

    @property
    def tokenizer(self) -> Path | str:
        """The model's BPE tokenizer.json, or "bytes" for the untrained demo (the engine tokenizes it as bytes too)."""
        return self.model_dir / "tokenizer.json" if self.trained else "bytes"

    @property
    def adapters(self) -> dict[str, Path]:
        """The domain adapters this demo has, in ADAPTERS' order."""
        return {name: self.adapters_dir / name for name in ADAPTERS if (self.adapters_dir / name).is_dir()}

    @property
    def tag(self) -> str:
        return "demo" if self.trained else "demo-untrained"

    def describe(self) -> str:
        """The one line each command prints, e.g. "demo: models/demo (trained; the committed demo)"."""
        weights = "trained" if self.trained else "untrained: seeded random weights"
        return f"demo: {_shown(self.root)} ({weights}; {ORIGINS[self.origin]})"


def _shown(path: Path) -> str:
    """The path relative to the working directory when under it (as people type it), else absolute."""
    path = Path(path).absolute()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def holds_model(root: Path) -> bool:
    model = Path(root) / "model"
    weights = ("model.safetensors", "model.safetensors.index.json")  # one file (ced) or shards (deepseek_v41)
    return (model / "config.json").is_file() and any((model / name).is_file() for name in weights)


def find_demo(demo: str | Path | None = None, root: str | Path | None = None) -> Demo:
    """Which demo, by the order in this module's docstring, without building anything (the server's model processes
    resolve at once and must not each build one); the untrained one may not be built yet: see `resolve_demo`."""
    if demo is not None:
        return _given(Path(demo))
    root = WORK_ROOT if root is None else Path(root)
    if holds_model(root / "demo"):
        return Demo(root / "demo", "built")
    if holds_model(COMMITTED):
        return Demo(COMMITTED, "committed")
    return Demo(root / "demo-untrained", "untrained")


def resolve_demo(demo: str | Path | None = None, root: str | Path | None = None) -> Demo:
    """`find_demo`, with the untrained demo built when it is the one chosen (first use only)."""
    found = find_demo(demo, root)
    if found.origin == "untrained" or not holds_model(found.root):  # never over a model of someone's own
        untrained_demo(found.root)
    return found


def _given(folder: Path) -> Demo:
    """A folder named explicitly: a demo, its model/ folder, or a new (or empty) folder to build an untrained demo in.
    A folder that holds something else is refused rather than filled with an untrained demo."""
    if folder.name == "model" and holds_model(folder.parent):
        folder = folder.parent
    if holds_model(folder) or not folder.is_dir() or not any(folder.iterdir()) or (folder / "READY").exists():
        return Demo(folder, "given")
    raise FileNotFoundError(f"{folder} holds no demo (model/config.json, model/model.safetensors, adapters/): name a "
                            "folder built by `mol2 build demo` (its ROOT/demo), or a new folder for an untrained demo")


def untrained_demo(root: str | Path | None = None, preset: str = "demo") -> Demo:
    """Build (first run only) and return the untrained demo model and its four adapters."""
    root = WORK_ROOT / "demo-untrained" if root is None else Path(root)
    demo = Demo(root, "untrained")
    done = root / "READY"
    if not done.exists():
        from tqdm import tqdm

        from .config import CEDConfig
        from .model import CEDForCausalLM  # only a build needs torch: finding a demo must not load it
        from .synthetic import ATTENTION, FFN, decoder_modules_regex, make_random_adapter

        config = CEDConfig.from_name(preset)
        model = CEDForCausalLM.from_ced(config, seed=0)
        targets = decoder_modules_regex(config, ATTENTION + FFN)
        steps = tqdm(total=1 + len(ADAPTERS), desc="building the untrained demo (first run only)")
        model.save_pretrained(demo.model_dir)
        steps.update()
        for seed, name in enumerate(ADAPTERS, start=1):
            path = demo.adapters_dir / name
            make_random_adapter(model, path, targets, rank=16, alpha=32, seed=seed, scale=0.02)
            (path / "description.txt").write_text(ADAPTERS[name] + "\n")
            steps.update()
        steps.close()
        done.write_text(json.dumps({"preset": preset, "trained": False}))
    return demo
