"""Built engine folders (ONNX graphs, TensorRT plans) and the manifest that ties them to one model.

A built engine holds the weights inside its graphs, while the serving engine keeps the PyTorch model beside it
(adapter slots, embeddings for the router, the oracle). Both must be the same model, so the manifest records a
fingerprint of the config and of the weights, the graphs and their IO names, and the adapted modules whose LoRA
slots the decoder graphs take as inputs. Anything that does not match is refused, naming what differs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .config import CEDConfig

MANIFEST_FILE = "engine.json"
FORMAT = "mol2-ced-engine/1"
STAGES = ("prefill", "replay", "decode_step")  # prefill = run_shared; replay / decode_step = run_decoder + LM head


class EngineFileError(ValueError):
    """A built engine folder that cannot serve this model: the message says which file or field is wrong."""


def config_fingerprint(config: CEDConfig) -> str:
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def weights_fingerprint(model: torch.nn.Module) -> str:
    """Hash of every parameter's name, shape and float32 bytes; the same for a model with LoRA-wrapped Linears."""
    digest = hashlib.sha256()
    params = {name.replace(".base.", "."): p for name, p in model.named_parameters()}
    for name in sorted(params):
        tensor = params[name].detach().to(torch.float32).contiguous()
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()[:16]


def write_manifest(out_dir: Path, manifest: dict) -> Path:
    path = Path(out_dir) / MANIFEST_FILE
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def read_manifest(engine_dir: str | Path, kind: str, stages: tuple[str, ...] = STAGES) -> dict:
    """The manifest of `engine_dir`, checked for format, kind and the presence of the graph of every stage in
    `stages` and of its file."""
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise EngineFileError(f"engine folder {engine_dir} does not exist (build it with `python -m engine_build "
                              f"{'onnx' if kind == 'onnx' else 'tensorrt'} ...`)")
    path = engine_dir / MANIFEST_FILE
    if not path.is_file():
        raise EngineFileError(f"{engine_dir}: no {MANIFEST_FILE} (not a built engine folder)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise EngineFileError(f"{path}: corrupt manifest: {error}") from None
    if manifest.get("format") != FORMAT:
        raise EngineFileError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("kind") != kind:
        raise EngineFileError(f"{path}: holds a {manifest.get('kind')!r} engine, expected {kind!r}")
    graphs = manifest.get("graphs", {})
    missing = [stage for stage in stages if stage not in graphs]
    if missing:
        raise EngineFileError(f"{path}: no graph for stage(s) {missing} (built by an older version? build it again)")
    for stage in stages:
        file = engine_dir / graphs[stage]["file"]
        if not file.is_file():
            raise EngineFileError(f"{engine_dir}: the {stage} graph {graphs[stage]['file']} is missing")
    return manifest


def check_matches(manifest: dict, config: CEDConfig, model: torch.nn.Module, lora_modules: list[str],
                  where: str | Path) -> None:
    """Refuse a manifest built for another config, other weights or another set of adapted modules."""
    built = manifest.get("config", {})
    if manifest.get("config_fingerprint") != config_fingerprint(config):
        ours = config.to_dict()
        differ = sorted(k for k in set(built) | set(ours) if _plain(built.get(k)) != _plain(ours.get(k)))
        detail = ", ".join(f"{k}: engine {built.get(k)!r} vs model {ours.get(k)!r}" for k in differ[:6])
        raise EngineFileError(f"{where}: built for another config ({detail or 'fingerprint differs'})")
    if manifest.get("weights_fingerprint") != weights_fingerprint(model):
        raise EngineFileError(f"{where}: built from other weights (weights fingerprint "
                              f"{manifest.get('weights_fingerprint')} vs the model's {weights_fingerprint(model)}); "
                              "rebuild the engine from this model folder")
    if manifest.get("lora_modules") != sorted(lora_modules):
        raise EngineFileError(f"{where}: the graphs take LoRA inputs for other modules than this engine adapts")


def _plain(value):
    return list(value) if isinstance(value, tuple) else value
