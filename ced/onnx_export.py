"""Export the CED stages of a model folder as ONNX graphs with dynamic lengths, plus the engine manifest.

    mol2 build onnx --model models/demo/model --out artifacts/engines/demo-onnx

Three graphs (see `onnx_stages.py` for what each computes):

| graph | what | dynamic |
|---|---|---|
| prefill.onnx | `run_shared`: encoder + first decoder layer's attention; outputs H19, the stream, layer E's top-k, the updated windows, the new global entries / index keys / partial blocks | tokens, window lengths, global entries, partial block |
| replay.onnx | `run_decoder` + LM head from empty adapter-bound windows | positions, global entries, adapter slots, rank |
| decode_step.onnx | the same with the adapter-bound windows as inputs (one decode step) | as replay, plus window lengths |

Batch is 1 (one conversation per call, as OrtCEDEngine runs it); `row_slots` (1,) picks the adapter slot. Beside
them, the serving engine's graphs over the paged pool, any number of rows per call (ced/pool_graphs.py).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch

from .engine_files import FORMAT, config_fingerprint, weights_fingerprint, write_manifest
from .model import CEDForCausalLM

from .onnx_stages import DecoderStage, PrefillStage, io_names, lora_modules
from .pool_graphs import export_pool_graphs

OPSET = 18
LAYOUT = 2  # the graphs' set and inputs as this code feeds them: a cached build of another layout is not reused
SAMPLE_T, _PAST, _ENTRIES, _PENDING = 5, 3, 2, 2  # sample lengths: all >= 2 so that export keeps them symbolic


def _samples(model: CEDForCausalLM, stage: str) -> tuple[list[torch.Tensor], list[dict]]:
    """Sample inputs of a stage and, per input, which dimensions are dynamic (by name)."""
    c = model.ced
    H, D, C, I, K = c.n_heads, c.head_dim, c.hidden_size, c.index_dim, c.index_top_k

    def own(name: str, kind: str, suffix: str, rand, g) -> tuple[torch.Tensor, dict]:
        if kind in ("window_k", "window_v"):
            return rand(1, H, _PAST, D), {2: f"past_{suffix}"}
        if kind in ("global_k", "global_v"):
            return rand(1, _ENTRIES, H, D), {1: f"entries_{suffix or c.decoder_start}"}
        if kind == "index_keys":
            return rand(1, _ENTRIES, I), {1: f"entries_{suffix or c.decoder_start}"}
        if kind == "pending":
            return rand(1, _PENDING, C), {1: f"pending_{suffix}"}
        if name == "stream":
            return rand(1, SAMPLE_T, C), {1: "tokens"}
        if name == "selection_idx":
            return torch.randint(0, _ENTRIES, (1, SAMPLE_T, K), generator=g), {1: "tokens"}
        if name == "selection_valid":
            return torch.rand(1, SAMPLE_T, K, generator=g) > 0.5, {1: "tokens"}
        raise AssertionError(f"no sample for input {name!r}")

    return samples(model, io_names(model, stage)[0], c.vocab_size, own, side_by_side=True)


def samples(model, names: list[str], vocab_size: int, own,
            side_by_side: bool = False) -> tuple[list[torch.Tensor], list[dict]]:
    """Either family's sample inputs named `names` and, per input, its dynamic axes: the token ids, the start, the
    rows' adapter slots and the LoRA inputs here, the family's own state from `own(name, kind, suffix, rand, g)`
    (kind and suffix: the name split at its first "."). One seeded generator for all, in the names' order."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    tensors, dims = [], []
    for name in names:
        kind, _, suffix = name.partition(".")
        if name == "input_ids":
            t, d = torch.randint(0, vocab_size, (1, SAMPLE_T), generator=g), {1: "tokens"}
        elif name == "start":
            t, d = torch.tensor(7), {}
        elif name == "row_slots":
            t, d = torch.tensor([1]), {}
        elif kind in ("lora_a", "lora_b"):
            t, d = lora_sample(model, kind, suffix, rand, side_by_side)
        else:
            t, d = own(name, kind, suffix, rand, g)
        tensors.append(t)
        dims.append(d)
    return tensors, dims


def lora_sample(model, kind: str, module: str, rand, side_by_side: bool = False) -> tuple[torch.Tensor, dict]:
    """A sample of a LoRA input of `module` (three slots of rank 4; kind lora_a or lora_b) and its dynamic axes."""
    linear = model.get_submodule(module)
    if kind == "lora_a":
        return rand(3, 4, linear.in_features) * 0.01, {0: "slots", 1: "rank"}
    if side_by_side:  # the ced family's graphs take B as ced/lora.py's side_by_side
        return rand(linear.out_features, 3 * 4) * 0.01, {1: "slot_ranks"}
    return rand(3, linear.out_features, 4) * 0.01, {0: "slots", 2: "rank"}


def export_stage(model: CEDForCausalLM, stage: str, path: Path, opset: int = OPSET,
                 exporter: str = "torchscript") -> None:
    """One stage to `path`. `torchscript` traces (about a second per graph); `dynamo` goes through torch.export
    (about half a minute per graph here); both give graphs with the same IO and the same results."""
    module = PrefillStage(model) if stage == "prefill" else DecoderStage(model, with_windows=stage == "decode_step")
    inputs, outputs = io_names(model, stage)
    tensors, dims = _samples(model, stage)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporters' deprecation and tracer warnings
        if exporter == "torchscript":
            axes = {name: d for name, d in zip(inputs, dims) if d}
            torch.onnx.export(module.eval(), tuple(tensors), str(path), input_names=inputs, output_names=outputs,
                              dynamic_axes=axes, opset_version=opset, dynamo=False)
        elif exporter == "dynamo":
            # Named Dims: the same name on two inputs means the same length (e.g. the stream and its selection).
            named = {}
            shapes = [{axis: named.setdefault(n, torch.export.Dim(n)) for axis, n in d.items()} for d in dims]
            torch.onnx.export(module.eval(), tuple(tensors), str(path), input_names=inputs, output_names=outputs,
                              dynamic_shapes=(tuple(shapes),), opset_version=opset, dynamo=True,
                              external_data=False, verbose=False)
        else:
            raise ValueError(f"exporter must be 'torchscript' or 'dynamo', got {exporter!r}")


def export_engine(model_dir: str | Path, out_dir: str | Path, opset: int = OPSET, exporter: str = "torchscript",
                  progress: bool = True) -> dict:
    """Export all three stages of the model in `model_dir` into `out_dir`; returns the manifest written there."""
    import onnx

    model = CEDForCausalLM.from_pretrained(str(model_dir)).float().eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    graphs = {}
    for stage in ("prefill", "replay", "decode_step"):
        start = time.perf_counter()
        path = out_dir / f"{stage}.onnx"
        export_stage(model, stage, path, opset, exporter)
        onnx.checker.check_model(str(path))
        inputs, outputs = io_names(model, stage)
        axes = {name: {str(axis): dim for axis, dim in d.items()} for name, d in zip(inputs, _samples(model, stage)[1])}
        graphs[stage] = {"file": path.name, "inputs": inputs, "outputs": outputs, "dynamic_axes": axes}
        if progress:
            print(f"  {stage:<12} {path.stat().st_size / 2**20:7.1f} MiB  {time.perf_counter() - start:5.1f} s")
    graphs.update(export_pool_graphs(model, out_dir, opset, progress))  # the serving engine's (OrtBatchedEngine)
    manifest = {
        "format": FORMAT, "kind": "onnx", "family": "ced", "layout": LAYOUT, "opset": opset, "exporter": exporter,
        "model_dir": str(model_dir),
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in model.ced.to_dict().items()},
        "config_fingerprint": config_fingerprint(model.ced), "weights_fingerprint": weights_fingerprint(model),
        "lora_modules": lora_modules(model), "batch": 1, "graphs": graphs,
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__},
    }
    write_manifest(out_dir, manifest)
    return manifest

