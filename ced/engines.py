"""One way to get an engine of any kind: `make_engine("torch" | "onnxruntime" | "tensorrt", model_dir, ...)`.

Every kind has `CEDEngine`'s interface and keeps conversation state in the same tensors, so the Triton stages,
the state codec and the conversation store work unchanged whichever engine runs the model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where an engine is built: the settings read ENGINE_KINDS without loading torch
    from .engine import CEDEngine
    from .model import CEDForCausalLM

ENGINE_KINDS = ("torch", "onnxruntime", "tensorrt")
ROOT = Path(__file__).resolve().parents[1]


def default_engine_dir(model: CEDForCausalLM, kind: str) -> Path:
    """Where a built engine of `model` is cached when no folder is given: named by its fingerprints, so another
    model (or retrained weights) never picks up a stale build."""
    from .engine_files import config_fingerprint, weights_fingerprint

    return ROOT / "artifacts/engines" / f"{config_fingerprint(model.ced)}-{weights_fingerprint(model)}" / kind


def ensure_onnx_engine(model_dir: str | Path, model: CEDForCausalLM | None = None) -> Path:
    """The cached ONNX build of the model in `model_dir`, exported now if missing. Safe when several processes
    (Triton's prefill and decode models) start at once: each exports into its own folder, the first rename wins."""
    from .engine_files import MANIFEST_FILE
    from .model import CEDForCausalLM

    model = model or CEDForCausalLM.from_pretrained(str(model_dir))
    engine_dir = default_engine_dir(model, "onnx")
    if not (engine_dir / MANIFEST_FILE).is_file():
        from .onnx_export import export_engine

        scratch = engine_dir.with_name(f"{engine_dir.name}.tmp{os.getpid()}")
        export_engine(model_dir, scratch, progress=False)
        try:
            scratch.rename(engine_dir)
        except OSError:  # another process finished first: use its build
            shutil.rmtree(scratch, ignore_errors=True)
    return engine_dir


def make_engine(kind: str, model_dir: str | Path, max_adapters: int = 8, max_rank: int = 16,
                engine_dir: str | Path | None = None, threads: int | None = None) -> CEDEngine:
    """An engine over the model in `model_dir`, of its family (ced.families): the ced family's CEDEngine, or the
    deepseek_v41 family's V41Engine (torch only), both with the same interface.

    onnxruntime: runs the graphs in `engine_dir` (built by `python -m engine_build onnx`); without `engine_dir`
    they are exported once (a few seconds) into `default_engine_dir` and reused. tensorrt: needs `engine_dir`
    built by `python -m engine_build tensorrt`, the `tensorrt` package and a CUDA GPU. A folder built for another
    config or other weights is refused with an error that names what differs.
    """
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine kind {kind!r}; choose one of {ENGINE_KINDS}")
    from .families import family_of

    if family_of(model_dir).name == "deepseek_v41":
        if kind != "torch":
            raise ValueError(f"the {kind} engine does not run the deepseek_v41 family yet (its export covers the "
                             "ced family's stages only): serve it with the torch engine")
        from .deepseek_v41.checkpoint import load_checkpoint
        from .deepseek_v41.engine import V41Engine

        return V41Engine(load_checkpoint(model_dir)[1], max_adapters, max_rank)
    from .engine import CEDEngine
    from .model import CEDForCausalLM

    model = CEDForCausalLM.from_pretrained(str(model_dir))
    if kind == "torch":
        return CEDEngine(model, max_adapters, max_rank)
    if kind == "onnxruntime":
        from .ort_engine import OrtCEDEngine

        engine_dir = ensure_onnx_engine(model_dir, model) if engine_dir is None else engine_dir
        return OrtCEDEngine(model, engine_dir, max_adapters, max_rank, threads=threads)
    from .trt_engine import TensorRTCEDEngine, require_tensorrt

    require_tensorrt()  # before anything else: the error a CPU machine gets says what is missing
    if engine_dir is None:
        raise ValueError("the tensorrt engine needs engine_dir: build it on the GPU machine with "
                         "`python -m engine_build tensorrt --onnx DIR --out DIR --precision fp16`")
    return TensorRTCEDEngine(model, engine_dir, max_adapters, max_rank)
