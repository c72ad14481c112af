"""Publish a built demo into the repository (models/demo): the weights stored in bf16 so that model, tokenizer,
adapters and router head fit the 30 MB the project commits; they load back as float32 (the config's dtype).
A deepseek_v41 demo's model/ is already in the release's format and storage dtypes: it is copied as it is.

    python -m engine_build publish --src artifacts/demo --dst models/demo
    python -m engine_build publish --src artifacts/demo-v41 --dst models/demo-v41
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
    sharded = (src / "model" / "model.safetensors.index.json").is_file()
    if sharded:  # deepseek_v41: already in the release's format and dtypes
        shutil.copytree(src / "model", dst / "model", dirs_exist_ok=True)
    else:
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
    for name in ("manifest.json", "adapter_set.json", "quantization.json"):  # the last two: deepseek_v41's build
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    if (src / "README.md").is_file():  # a CED build's Files section describes its float32 build: point to
        readme = (src / "README.md").read_text()  # published.json (a deepseek_v41 build's files are published as is)
        (dst / "README.md").write_text(readme if sharded else without_files_section(readme))
    files = sorted(p for p in dst.rglob("*") if p.is_file() and p.name != "published.json")
    dtype = ("the release's (FP8 E4M3, FP4 experts, BF16, F32; quantization.json)" if sharded
             else "bfloat16 (loaded as float32)")
    summary = {"source": str(src), "weights_dtype": dtype,
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
