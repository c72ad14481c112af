"""make_engine for the deepseek_v41 family (ced.families' `engines`): the torch engine, or the ONNX Runtime one
over graphs exported once into ced.engines.default_engine_dir (or the given `engine_dir`)."""

from __future__ import annotations

from pathlib import Path


def make_v41_engine(kind: str, model_dir: str | Path, max_adapters: int, max_rank: int,
                    engine_dir: str | Path | None, threads: int | None):
    from .checkpoint import load_checkpoint

    if kind == "tensorrt":
        raise ValueError("the tensorrt engine does not run the deepseek_v41 family yet (its plans are built from "
                         "the ced family's graphs): serve it with --engine torch or --engine onnxruntime")
    model = load_checkpoint(model_dir)[1]
    if kind == "torch":
        from .engine import V41Engine

        return V41Engine(model, max_adapters, max_rank)
    from .ort_engine import OrtV41Engine

    if engine_dir is None:
        engine_dir = ensure_onnx_engine(model_dir, model)
    return OrtV41Engine(model, engine_dir, max_adapters, max_rank, threads=threads)


def ensure_onnx_engine(model_dir: str | Path, model=None) -> Path:
    """The cached ONNX build of the deepseek_v41 model in `model_dir` (`model`: it, already loaded), exported now
    if missing."""
    from ..engines import build_once, default_engine_dir
    from .checkpoint import load_checkpoint
    from .onnx_export import export_model

    model = model or load_checkpoint(model_dir)[1]

    return build_once(default_engine_dir(model, "onnx"),
                      lambda scratch: export_model(model, scratch, model_dir, progress=False))
