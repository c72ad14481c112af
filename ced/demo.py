"""The demo the command line serves: the `demo` preset with four domain adapters, and a scripted conversation.

The trained demo (model, BPE tokenizer, adapters, router head) is committed under models/demo/, built by
`python -m engine_build demo`. Without it, the demo falls back to seeded random weights and random PEFT adapters,
built once under artifacts/demo-untrained/ and tokenized as UTF-8 bytes: costs and bytes are real, text is noise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .config import CEDConfig
from .model import CEDForCausalLM
from .synthetic import ATTENTION, FFN, decoder_modules_regex, make_random_adapter

PROJECT = Path(__file__).resolve().parent.parent
TRAINED_ROOT = PROJECT / "models/demo"
DEFAULT_ROOT = PROJECT / "artifacts/demo-untrained"

ADAPTERS = {
    "chat": "small talk, jokes and everyday conversation",
    "agent": "multi-step tasks that run shell commands and tools",
    "coding": "writing, explaining and fixing Python code",
    "design": "user-interface design: HTML, CSS and SVG",
}

SCRIPT: list[tuple[str, str | None]] = [  # (user turn, adapter)
    ("Hi! Tell me something funny about computers.", "chat"),
    ("Find every file in my home directory changed in the last day and archive them.", "agent"),
    ("Write a Python function that returns the n-th Fibonacci number.", "coding"),
    ("Make the login button a rounded blue gradient with white text.", "design"),
    ("Now add a unit test for the Fibonacci function.", "coding"),
    ("Thanks, that was helpful. One more joke?", "chat"),
    ("And what does the base model say without any adapter?", None),
]


@dataclass
class DemoArtifacts:
    model_dir: Path
    adapters: dict[str, Path]
    trained: bool


def untrained_demo(root: Path = DEFAULT_ROOT, preset: str = "demo") -> DemoArtifacts:
    """Build (first run only) and return the untrained demo model and its four adapters."""
    root = Path(root)
    adapters = {name: root / "adapters" / name for name in ADAPTERS}
    done = root / "READY"
    if not done.exists():
        config = CEDConfig.from_name(preset)
        model = CEDForCausalLM.from_ced(config, seed=0)
        targets = decoder_modules_regex(config, ATTENTION + FFN)
        steps = tqdm(total=1 + len(adapters), desc="building the untrained demo (first run only)")
        model.save_pretrained(root / "model")
        steps.update()
        for seed, (name, path) in enumerate(adapters.items(), start=1):
            make_random_adapter(model, path, targets, rank=16, alpha=32, seed=seed, scale=0.02)
            (path / "description.txt").write_text(ADAPTERS[name] + "\n")
            steps.update()
        steps.close()
        done.write_text(json.dumps({"preset": preset, "trained": False}))
    return DemoArtifacts(root / "model", adapters, trained=False)


def trained_demo(root: Path = TRAINED_ROOT) -> DemoArtifacts | None:
    root = Path(root)
    if not (root / "model" / "config.json").is_file():
        return None
    adapters = {name: root / "adapters" / name for name in ADAPTERS if (root / "adapters" / name).is_dir()}
    return DemoArtifacts(root / "model", adapters, trained=True)


def demo_artifacts(root: Path | None = None) -> DemoArtifacts:
    """The trained demo when it is there (or the folder given), else the untrained one (built on first use). A
    folder given that holds something else is refused rather than filled with an untrained demo."""
    if root is None:
        return trained_demo() or untrained_demo()
    root = Path(root)
    found = trained_demo(root)
    if found is not None:
        return found
    if root.is_dir() and any(root.iterdir()) and not (root / "READY").exists():
        raise FileNotFoundError(f"{root} holds no demo (model/config.json and adapters/): name a folder built by "
                                "`python -m engine_build demo` (its ROOT/demo), or a new folder for an untrained demo")
    return untrained_demo(root)
