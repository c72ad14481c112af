"""The ONNX export of the tiny preset: every graph passes the ONNX checker, the manifest says what the graphs are,
and engine folders that cannot serve the model (missing, corrupt, another config, other weights) are refused."""

import json
import shutil

import onnx
import pytest

from ced import CEDConfig, CEDForCausalLM
from ced.engine_files import MANIFEST_FILE, STAGES, EngineFileError, config_fingerprint, weights_fingerprint
from ced.engines import make_engine
from ced.ort_engine import OrtCEDEngine
from ced.onnx_export import OPSET, export_engine


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(model folder, engine folder) of the seeded tiny model."""
    root = tmp_path_factory.mktemp("onnx_export")
    CEDForCausalLM.from_ced(CEDConfig.from_name("tiny"), seed=0).save_pretrained(str(root / "model"))
    export_engine(root / "model", root / "engine", progress=False)
    return root / "model", root / "engine"


def copy_engine(built, tmp_path):
    shutil.copytree(built[1], tmp_path / "engine")
    return tmp_path / "engine"


def test_every_stage_passes_the_onnx_checker(built):
    for stage in STAGES:
        model = onnx.load(str(built[1] / f"{stage}.onnx"))
        onnx.checker.check_model(model, full_check=True)  # full_check: shape inference too
        assert model.opset_import[0].version == OPSET


def test_manifest_names_the_graphs_and_the_model(built, tiny_config):
    manifest = json.loads((built[1] / MANIFEST_FILE).read_text())
    model = CEDForCausalLM.from_pretrained(str(built[0]))
    assert manifest["config_fingerprint"] == config_fingerprint(tiny_config)
    assert manifest["weights_fingerprint"] == weights_fingerprint(model)
    for stage in STAGES:
        graph = onnx.load(str(built[1] / manifest["graphs"][stage]["file"])).graph
        assert [i.name for i in graph.input] == manifest["graphs"][stage]["inputs"]
        assert [o.name for o in graph.output] == manifest["graphs"][stage]["outputs"]
    prefill = manifest["graphs"]["prefill"]
    assert "h19" in prefill["outputs"] and not any(name.startswith("lora_") for name in prefill["inputs"])
    for stage in ("replay", "decode_step"):  # one graph serves any adapter set: slots and rank are dynamic
        inputs = manifest["graphs"][stage]["inputs"]
        assert "row_slots" in inputs
        assert {f"lora_a.{m}" for m in manifest["lora_modules"]} <= set(inputs)
        axes = manifest["graphs"][stage]["dynamic_axes"][f"lora_a.{manifest['lora_modules'][0]}"]
        assert set(axes.values()) == {"slots", "rank"}


def test_the_factory_builds_every_kind_it_can(built):
    torch_engine = make_engine("torch", built[0], max_adapters=2, max_rank=4)
    ort_engine = make_engine("onnxruntime", built[0], max_adapters=2, max_rank=4, engine_dir=built[1])
    assert isinstance(ort_engine, OrtCEDEngine) and ort_engine.config == torch_engine.config
    with pytest.raises(ValueError, match="unknown engine kind 'tflite'"):
        make_engine("tflite", built[0])


def test_tensorrt_without_a_gpu_is_a_clear_error(built):
    import torch

    try:
        import tensorrt  # noqa: F401
        has_trt = True
    except ImportError:
        has_trt = False
    if has_trt and torch.cuda.is_available():
        pytest.skip("TensorRT and a GPU are here: tests/test_tensorrt_gpu.py covers this engine")
    with pytest.raises(RuntimeError, match="tensorrt engine needs"):
        make_engine("tensorrt", built[0], engine_dir=built[1])


def ort(built, engine_dir):
    return OrtCEDEngine(CEDForCausalLM.from_pretrained(str(built[0])), engine_dir, max_adapters=2, max_rank=4)


def test_a_missing_folder_graph_or_manifest_is_refused(built, tmp_path):
    with pytest.raises(EngineFileError, match="does not exist"):
        ort(built, tmp_path / "nowhere")
    engine = copy_engine(built, tmp_path)
    (engine / "replay.onnx").unlink()
    with pytest.raises(EngineFileError, match="the replay graph replay.onnx is missing"):
        ort(built, engine)
    (engine / MANIFEST_FILE).unlink()
    with pytest.raises(EngineFileError, match="no engine.json"):
        ort(built, engine)


def test_a_corrupt_manifest_or_graph_is_refused(built, tmp_path):
    engine = copy_engine(built, tmp_path)
    (engine / "prefill.onnx").write_bytes(b"not a graph")
    with pytest.raises(EngineFileError, match="prefill.onnx: ONNX Runtime cannot load it"):
        ort(built, engine)
    (engine / MANIFEST_FILE).write_text("{")
    with pytest.raises(EngineFileError, match="corrupt manifest"):
        ort(built, engine)


def test_graphs_swapped_between_stages_are_refused(built, tmp_path):
    engine = copy_engine(built, tmp_path)
    shutil.copy(engine / "decode_step.onnx", engine / "replay.onnx")
    with pytest.raises(EngineFileError, match="IO names differ from 'replay'"):
        ort(built, engine)


def test_an_engine_built_for_another_config_is_refused(built, tmp_path, tiny_config):
    other = tmp_path / "other"
    CEDForCausalLM.from_ced(tiny_config.replace(window=8), seed=0).save_pretrained(str(other))
    with pytest.raises(EngineFileError, match="built for another config .*window: engine 16 vs model 8"):
        OrtCEDEngine(CEDForCausalLM.from_pretrained(str(other)), built[1])


def test_an_engine_built_from_other_weights_is_refused(built, tiny_model):
    with pytest.raises(EngineFileError, match="built from other weights"):
        OrtCEDEngine(tiny_model(seed=1), built[1])


def test_a_manifest_of_another_kind_is_refused(built, tmp_path):
    engine = copy_engine(built, tmp_path)
    manifest = json.loads((engine / MANIFEST_FILE).read_text())
    (engine / MANIFEST_FILE).write_text(json.dumps({**manifest, "kind": "tensorrt"}))
    with pytest.raises(EngineFileError, match="holds a 'tensorrt' engine, expected 'onnx'"):
        ort(built, engine)


def test_without_a_folder_the_factory_exports_once_and_reuses_it(built, tmp_path, monkeypatch):
    import ced.engines

    monkeypatch.setattr(ced.engines, "ROOT", tmp_path)
    first = make_engine("onnxruntime", built[0], max_adapters=2, max_rank=4)
    assert first.engine_dir.is_relative_to(tmp_path / "artifacts/engines")
    stamp = (first.engine_dir / MANIFEST_FILE).stat().st_mtime_ns
    second = make_engine("onnxruntime", built[0], max_adapters=2, max_rank=4)
    assert second.engine_dir == first.engine_dir and (first.engine_dir / MANIFEST_FILE).stat().st_mtime_ns == stamp
