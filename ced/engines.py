"""One way to get an engine of any kind: `make_engine("torch" | "onnxruntime" | "tensorrt", model_dir, ...)`.

Every kind has `CEDEngine`'s interface and keeps conversation state in the same tensors, so the Triton stages,
the state codec and the conversation store work unchanged whichever engine runs the model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # imported where an engine is built: the settings read ENGINE_KINDS without loading torch
    from .engine import CEDEngine
    from .model import CEDForCausalLM

ENGINE_KINDS = ("torch", "onnxruntime", "tensorrt")
ROOT = Path(__file__).resolve().parents[1]


def default_engine_dir(model, kind: str) -> Path:
    """Where a built engine of `model` (of any family) is cached when no folder is given: named by its
    fingerprints, so another model (or retrained weights) never picks up a stale build."""
    from .engine_files import config_fingerprint, weights_fingerprint

    config = model.ced if hasattr(model, "ced") else model.config  # the ced family's own config, or V41Config
    return ROOT / "artifacts/engines" / f"{config_fingerprint(config)}-{weights_fingerprint(model)}" / kind


def build_once(engine_dir: Path, export: Callable[[Path], object]) -> Path:
    """`engine_dir`, built by export(folder) now if it holds no manifest. Safe when several processes (Triton's
    prefill and decode models) start at once: each exports into its own folder, the first rename wins."""
    from .engine_files import MANIFEST_FILE

    if not (engine_dir / MANIFEST_FILE).is_file():
        scratch = engine_dir.with_name(f"{engine_dir.name}.tmp{os.getpid()}")
        export(scratch)
        try:
            scratch.rename(engine_dir)
        except OSError:  # another process finished first: use its build
            shutil.rmtree(scratch, ignore_errors=True)
    return engine_dir


def ensure_onnx_engine(model_dir: str | Path, model=None) -> Path:
    """The cached ONNX build of the model in `model_dir` (of any family; `model`: it, already loaded), exported
    now if missing."""
    from .families import family_of

    return family_of(model_dir).ensure_onnx_engine(model_dir, model)


def ensure_ced_onnx_engine(model_dir: str | Path, model: CEDForCausalLM | None = None) -> Path:
    """ensure_onnx_engine for the ced family."""
    from .model import CEDForCausalLM
    from .onnx_export import LAYOUT, export_engine

    model = model or CEDForCausalLM.from_pretrained(str(model_dir))
    return build_once(default_engine_dir(model, f"onnx-{LAYOUT}"),
                      lambda scratch: export_engine(model_dir, scratch, progress=False))


def make_engine(kind: str, model_dir: str | Path, max_adapters: int = 8, max_rank: int = 16,
                engine_dir: str | Path | None = None, threads: int | None = None) -> CEDEngine:
    """An engine over the model in `model_dir`, made by its family (ced.families' `engines`): the ced family's
    CEDEngine / OrtCEDEngine / TensorRTCEDEngine, or the deepseek_v41 family's V41Engine / OrtV41Engine, all with
    the same interface.

    onnxruntime: runs the graphs in `engine_dir` (built by `python -m engine_build onnx`); without `engine_dir`
    they are exported once (seconds) into `default_engine_dir` and reused. tensorrt (ced family only): needs
    `engine_dir` built by `python -m engine_build tensorrt`, the `tensorrt` package and a CUDA GPU. A folder built
    for another config or other weights is refused with an error that names what differs.
    """
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine kind {kind!r}; choose one of {ENGINE_KINDS}")
    from .families import family_of

    return family_of(model_dir).make_engine(kind, model_dir, max_adapters, max_rank, engine_dir, threads)


def make_ced_engine(kind: str, model_dir: str | Path, max_adapters: int, max_rank: int,
                    engine_dir: str | Path | None, threads: int | None) -> CEDEngine:
    """make_engine for the ced family."""
    from .engine import CEDEngine
    from .model import CEDForCausalLM

    model = CEDForCausalLM.from_pretrained(str(model_dir))
    if kind == "torch":
        return CEDEngine(model, max_adapters, max_rank)
    if kind == "onnxruntime":
        from .ort_engine import OrtCEDEngine

        engine_dir = ensure_ced_onnx_engine(model_dir, model) if engine_dir is None else engine_dir
        return OrtCEDEngine(model, engine_dir, max_adapters, max_rank, threads=threads)
    from .trt_engine import TensorRTCEDEngine, require_tensorrt

    require_tensorrt()  # before anything else: the error a CPU machine gets says what is missing
    if engine_dir is None:
        raise ValueError("the tensorrt engine needs engine_dir: build it on the GPU machine with "
                         "`python -m engine_build tensorrt --onnx DIR --out DIR --precision fp16`")
    return TensorRTCEDEngine(model, engine_dir, max_adapters, max_rank)
