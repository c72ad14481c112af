"""Build TensorRT engines (plans) from the ONNX graphs of `mol2 build onnx`. GPU machine only.

    mol2 build tensorrt --onnx artifacts/engines/demo-onnx --out artifacts/engines/demo-trt --precision fp16

Every graph is parsed by TensorRT's own ONNX parser: the stages use standard ops only (MatMul, Softmax, TopK,
Gather, Where, Concat, Slice, ...), so no plugin is needed (plugins/README.md says why). Each dynamic axis the
manifest names gets one optimization profile range, from the model config and the limits given here. The output
folder gets `<stage>.plan` and an engine.json with kind "tensorrt" and the ONNX manifest's fingerprints.

UNTESTED in this repository so far: no GPU was lent when it was written (scripts/gpu_check.sh runs it).
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import CEDConfig
from .engine_files import STAGES, read_manifest, write_manifest

PRECISIONS = ("fp16", "bf16", "fp32")


def axis_ranges(config: CEDConfig, max_tokens: int, max_adapters: int, max_rank: int) -> dict[str, tuple]:
    """(min, opt, max) of each dynamic axis name the export uses (see onnx_export._samples)."""
    W, m = config.window, config.block_size
    max_entries = config.max_context // m
    ranges = {"tokens": (1, min(W, max_tokens), max(max_tokens, W)), "slots": (1, max_adapters, max_adapters),
              "rank": (1, max_rank, max_rank)}
    for layer in range(config.n_layers):
        ranges[f"past_{layer}"] = (0, W, W)  # zero at a conversation's first chunk
        ranges[f"entries_{layer}"] = (0, min(512, max_entries), max_entries)
        ranges[f"pending_{layer}"] = (0, m - 1, m - 1)
    return ranges


def _profile_shapes(shape: list, axes: dict[str, str], ranges: dict[str, tuple]) -> tuple[list, list, list]:
    lo, opt, hi = list(shape), list(shape), list(shape)
    for axis, name in axes.items():
        lo[int(axis)], opt[int(axis)], hi[int(axis)] = ranges[name]
    return lo, opt, hi


def _autocast(path: Path, precision: str, out_dir: Path) -> Path:
    """TensorRT 11 builds strongly typed networks only (its FP16/BF16 builder flags are gone): the graph itself
    must carry the low precision. ModelOpt's AutoCast rewrites it, keeping float32 inputs and outputs."""
    try:
        from modelopt.onnx.autocast import convert_to_mixed_precision
    except ImportError:
        raise RuntimeError("TensorRT 11 has no fp16/bf16 builder flags: install nvidia-modelopt[onnx] (AutoCast), "
                           "or build with --precision fp32, or use TensorRT 10") from None
    import onnx

    converted = convert_to_mixed_precision(onnx_path=str(path), low_precision_type=precision, keep_io_types=True)
    target = out_dir / f"{path.stem}.{precision}.onnx"
    onnx.save(converted, str(target))
    return target


def build_engines(onnx_dir: str | Path, out_dir: str | Path, precision: str = "fp16", max_tokens: int = 256,
                  max_adapters: int = 8, max_rank: int = 16, workspace_gib: float = 8.0) -> dict:
    import onnx

    from .trt_engine import require_tensorrt

    require_tensorrt()  # the builder needs the package and a GPU: say so before reading anything
    import tensorrt as trt

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    manifest = read_manifest(onnx_dir, "onnx")
    config = CEDConfig.from_dict(manifest["config"])
    ranges = axis_ranges(config, max_tokens, max_adapters, max_rank)
    out_dir.mkdir(parents=True, exist_ok=True)
    logger = trt.Logger(trt.Logger.WARNING)
    graphs = {}
    for stage in STAGES:
        spec = manifest["graphs"][stage]
        builder = trt.Builder(logger)
        network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
        parser = trt.OnnxParser(network, logger)
        source = onnx_dir / spec["file"]
        if precision != "fp32" and not hasattr(trt.BuilderFlag, "FP16"):
            source = _autocast(source, precision, out_dir)  # TensorRT 11: precision lives in the graph
        if not parser.parse_from_file(str(source)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RuntimeError(f"TensorRT cannot parse {spec['file']}: {errors}")
        build_config = builder.create_builder_config()
        build_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 2**30))
        if precision != "fp32" and hasattr(trt.BuilderFlag, "FP16"):  # TensorRT 10: weak typing, a flag
            build_config.set_flag(trt.BuilderFlag.FP16 if precision == "fp16" else trt.BuilderFlag.BF16)
        profile = builder.create_optimization_profile()
        graph = onnx.load(str(onnx_dir / spec["file"]), load_external_data=False).graph
        shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
        for name, axes in spec["dynamic_axes"].items():
            if axes:
                profile.set_shape(name, *_profile_shapes(shapes[name], axes, ranges))
        build_config.add_optimization_profile(profile)
        plan = builder.build_serialized_network(network, build_config)
        if plan is None:
            raise RuntimeError(f"TensorRT failed to build the {stage} engine (see the log above)")
        (out_dir / f"{stage}.plan").write_bytes(bytes(plan))
        graphs[stage] = {**spec, "file": f"{stage}.plan"}
    built = {**manifest, "kind": "tensorrt", "precision": precision, "graphs": graphs,
             "limits": {"max_tokens": max_tokens, "max_adapters": max_adapters, "max_rank": max_rank},
             "versions": {**manifest.get("versions", {}), "tensorrt": trt.__version__}}
    write_manifest(out_dir, built)
    print(json.dumps({"out": str(out_dir), "precision": precision, "stages": list(graphs)}))
    return built
