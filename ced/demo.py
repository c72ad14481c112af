"""The demo the command line serves: the `demo` preset with four domain adapters, and a scripted conversation.

Until trained weights exist (the demo-model issue), the demo builds seeded random weights and random PEFT
adapters once, caches them under artifacts/, and tokenizes text as UTF-8 bytes. The engine's costs and state
accounting are the real ones; the generated text is noise until the weights are trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .config import CEDConfig
from .model import CEDForCausalLM
from .synthetic import ATTENTION, FFN, decoder_modules_regex, make_random_adapter

DEFAULT_ROOT = Path("artifacts/demo-untrained")

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


class ByteTokenizer:
    """UTF-8 bytes as token ids: the stand-in until the demo BPE tokenizer is trained."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


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
