"""Publish a built demo into the repository (models/demo): the weights stored in bf16 so that model, tokenizer,
adapters and router head fit the 30 MB the project commits; they load back as float32 (the config's dtype).

    python -m engine_build publish --src artifacts/demo --dst models/demo
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SERVED = ("chat", "agent", "coding", "design")  # the domain adapters; the others are for benchmarks
KEPT = SERVED + ("random_l0", "every_layer")


def publish(src: Path, dst: Path) -> dict:
    src, dst = Path(src), Path(dst)
    (dst / "model").mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(src / "model" / name, dst / "model" / name)
    weights = load_file(str(src / "model" / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()},
              str(dst / "model" / "model.safetensors"), metadata={"format": "pt"})
    for name in KEPT:
        if (src / "adapters" / name).is_dir():
            target = dst / "adapters" / name
            target.mkdir(parents=True, exist_ok=True)
            for file in ("adapter_config.json", "adapter_model.safetensors", "description.txt"):
                shutil.copy2(src / "adapters" / name / file, target / file)
    for extra in ("router", "pretrain"):
        if (src / extra).is_dir():
            shutil.copytree(src / extra, dst / extra, dirs_exist_ok=True)
    if (src / "manifest.json").is_file():
        shutil.copy2(src / "manifest.json", dst / "manifest.json")
    if (src / "README.md").is_file():  # its Files section describes the float32 build: point to published.json
        (dst / "README.md").write_text(without_files_section((src / "README.md").read_text()))
    files = sorted(p for p in dst.rglob("*") if p.is_file() and p.name != "published.json")
    summary = {"source": str(src), "weights_dtype": "bfloat16 (loaded as float32)",
               "total_bytes": sum(p.stat().st_size for p in files),
               "files": {str(p.relative_to(dst)): hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in files}}
    (dst / "published.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def without_files_section(readme: str) -> str:
    """The build's README with its "## Files" section (sizes and hashes of the float32 build) replaced by a pointer
    to published.json, which lists what was published."""
    head, marker, rest = readme.partition("\n## Files")
    if not marker:
        return readme
    _, heading, tail = rest.partition("\n## ")
    note = ("\n## Files\n\nPublished with the weights in bf16 (loaded back as float32): every file with its sha256, "
            "and the total size, is in `published.json`.\n")
    return head + note + (("\n## " + tail) if heading else "")
