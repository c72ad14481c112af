"""Export a deepseek_v41 model's stages as ONNX graphs with dynamic lengths, plus the engine manifest.

    python -m engine_build onnx --model models/demo-v41/model --out artifacts/engines/demo-v41-onnx

The same three graphs as the ced family's (ced/onnx_export.py), one conversation per call:

| graph | what | dynamic |
|---|---|---|
| prefill.onnx | `run_shared`: layers 0..E-1 and layer E's attention; H19 pooled over the mHC streams, layer E's stream, pre, top-k and pool, the windows (last W), each source's new entries and partial group | tokens, window lengths, entries, partial groups |
| replay.onnx | `run_decoder` + head from empty adapter-bound windows (the last position's logits) | positions, layer E's entries, adapter slots, rank |
| decode_step.onnx | the same with the adapter-bound windows as inputs | as replay, plus window lengths |
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch

from ..engine_files import FORMAT, config_fingerprint, weights_fingerprint, write_manifest
from ..onnx_export import OPSET, SAMPLE_T, samples
from .model import DeepseekV41ForCausalLM
from .onnx_stages import DecoderStage, PrefillStage, has_pool, io_names, lora_modules

STAGES = ("prefill", "replay", "decode_step")
_PAST, _ENTRIES, _PENDING = 3, 3, 2  # sample lengths (and SAMPLE_T tokens): all >= 2, so export keeps them symbolic


def _samples(model: DeepseekV41ForCausalLM, stage: str) -> tuple[list[torch.Tensor], list[dict]]:
    """Sample inputs of a stage and, per input, which dimensions are dynamic (by name). The values only need to
    be in range (entry and block numbers below the sample's entries): tracing records the operations."""
    c, lora = model.config, lora_modules(model)
    n, C, D, I = c.hc_mult, c.hidden_size, c.head_dim, c.index_head_dim

    def own(name: str, kind: str, suffix: str, rand, g) -> tuple[torch.Tensor, dict]:
        if kind == "window":
            return rand(1, _PAST, D), {1: f"past_{suffix}"}
        if kind == "latent":
            return rand(1, _ENTRIES, D), {1: f"entries_{suffix or c.decoder_start}"}
        if kind == "index_keys":
            return rand(1, _ENTRIES, I), {1: f"entries_{suffix or c.decoder_start}"}
        if kind == "pending":
            return rand(1, _PENDING, C), {1: f"pending_{suffix}"}
        if name == "stream":
            return rand(1, SAMPLE_T, n, C), {1: "tokens"}
        if name == "pre":
            return torch.rand(1, SAMPLE_T, n, generator=g), {1: "tokens"}
        if name in ("selection_idx", "pool_idx"):
            k = c.index_topk if name == "selection_idx" else c.candidate_topk_blocks
            below = _ENTRIES if name == "selection_idx" else 1
            return torch.randint(0, below, (1, SAMPLE_T, k), generator=g), {1: "tokens"}
        if name in ("selection_valid", "pool_valid"):
            k = c.index_topk if name == "selection_valid" else c.candidate_topk_blocks
            return torch.rand(1, SAMPLE_T, k, generator=g) > 0.5, {1: "tokens"}
        raise AssertionError(f"no sample for input {name!r}")

    return samples(model, io_names(c, lora, stage)[0], c.vocab_size, own)


def export_stage(model: DeepseekV41ForCausalLM, stage: str, path: Path, opset: int = OPSET) -> None:
    """One stage to `path`, traced (torch.onnx's torchscript exporter: a few seconds per graph)."""
    module = PrefillStage(model) if stage == "prefill" else DecoderStage(model, with_windows=stage == "decode_step")
    inputs, outputs = io_names(model.config, lora_modules(model), stage)
    tensors, dims = _samples(model, stage)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracer warnings
        torch.onnx.export(module.eval(), tuple(tensors), str(path), input_names=inputs, output_names=outputs,
                          dynamic_axes={name: d for name, d in zip(inputs, dims) if d}, opset_version=opset,
                          dynamo=False)


def export_model(model: DeepseekV41ForCausalLM, out_dir: str | Path, model_dir: str | Path | None = None,
                 opset: int = OPSET, progress: bool = True) -> dict:
    """Export the three stages of `model` (float32) into `out_dir`; returns the manifest written there."""
    import onnx

    model = model.float().eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    graphs, lora = {}, lora_modules(model)
    for stage in STAGES:
        start = time.perf_counter()
        path = out_dir / f"{stage}.onnx"
        export_stage(model, stage, path, opset)
        onnx.checker.check_model(str(path))
        inputs, outputs = io_names(model.config, lora, stage)
        axes = {name: {str(axis): dim for axis, dim in d.items()} for name, d in zip(inputs, _samples(model, stage)[1])}
        graphs[stage] = {"file": path.name, "inputs": inputs, "outputs": outputs, "dynamic_axes": axes}
        if progress:
            print(f"  {stage:<12} {path.stat().st_size / 2**20:7.1f} MiB  {time.perf_counter() - start:5.1f} s")
    manifest = {
        "format": FORMAT, "kind": "onnx", "family": "deepseek_v41", "opset": opset, "exporter": "torchscript",
        "model_dir": None if model_dir is None else str(model_dir),
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in model.config.to_dict().items()},
        "config_fingerprint": config_fingerprint(model.config), "weights_fingerprint": weights_fingerprint(model),
        "lora_modules": lora, "has_pool": has_pool(model.config), "batch": 1, "graphs": graphs,
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__},
    }
    write_manifest(out_dir, manifest)
    return manifest


def export_engine(model_dir: str | Path, out_dir: str | Path, opset: int = OPSET, exporter: str = "torchscript",
                  progress: bool = True) -> dict:
    """Export the model in `model_dir` (its safetensors checkpoint) into `out_dir`."""
    from .checkpoint import load_checkpoint

    if exporter != "torchscript":  # the dynamo path is not checked against this family's graph forms
        raise ValueError(f"the deepseek_v41 export runs the torchscript exporter only, not {exporter!r}")

    return export_model(load_checkpoint(model_dir)[1], out_dir, model_dir, opset, progress)
