"""The TensorRT engine on a GPU: plans built from the tiny ONNX graphs agree with the PyTorch engine, keep source
independence bitwise, and the demo gives the same greedy reply. Skips where TensorRT or CUDA is absent."""

import copy
from pathlib import Path

import pytest
import torch

from ced import CEDConfig, CEDEngine, CEDForCausalLM


def _gpu_ready() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


pytestmark = pytest.mark.skipif(not _gpu_ready(), reason="no GPU lent to this task; TensorRT build untested")

# Max |TensorRT - torch| on logits: fp32 plans only reorder reductions; fp16 plans round every activation.
ATOL = {"fp32": 1e-3, "fp16": 5e-2}
DEMO = Path(__file__).resolve().parents[1] / "models/demo"


def tokens(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def build(root: Path, model_dir: Path, precision: str) -> Path:
    from ced.onnx_export import export_engine
    from ced.tensorrt_build import build_engines

    if not (root / "onnx/engine.json").is_file():
        export_engine(model_dir, root / "onnx", progress=False)
    build_engines(root / "onnx", root / precision, precision, max_adapters=4, max_rank=8)
    return root / precision


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("trt")
    CEDForCausalLM.from_ced(CEDConfig.from_name("tiny"), seed=0).save_pretrained(str(root / "model"))
    return root


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_logits_match_torch(tiny_dir, adapter_dirs, precision):
    from ced.trt_engine import TensorRTCEDEngine

    engine_dir = build(tiny_dir, tiny_dir / "model", precision)
    engines = (CEDEngine(CEDForCausalLM.from_pretrained(str(tiny_dir / "model")), 4, 8),
               TensorRTCEDEngine(CEDForCausalLM.from_pretrained(str(tiny_dir / "model")), engine_dir, 4, 8))
    for engine in engines:
        engine.adapters.load("A1", adapter_dirs["A1"])
    for adapter in (None, "A1"):
        states = [engine.new_conversation() for engine in engines]
        logits = [engine.turn(state, tokens(0, 50), adapter).logits for engine, state in zip(engines, states)]
        assert (logits[1] - logits[0]).abs().max() <= ATOL[precision]
        for token in tokens(1, 5):
            logits = [engine.step(state, token, adapter) for engine, state in zip(engines, states)]
            assert (logits[1] - logits[0]).abs().max() <= ATOL[precision]


def test_source_independence_is_bitwise(tiny_dir, adapter_dirs):
    from ced.trt_engine import TensorRTCEDEngine

    engine = TensorRTCEDEngine(CEDForCausalLM.from_pretrained(str(tiny_dir / "model")),
                               build(tiny_dir, tiny_dir / "model", "fp16"), 4, 8)
    for name in ("A1", "A2"):
        engine.adapters.load(name, adapter_dirs[name])
    runs = {}
    for source in (None, "A1", "A2"):
        state = engine.new_conversation()
        result = engine.turn(state, tokens(2, 30), source)
        list(engine.generate(state, source, result.logits, max_tokens=5))
        runs[source] = engine.turn(copy.deepcopy(state), tokens(3, 6), "A1").logits
    assert torch.equal(runs["A1"], runs[None]) and torch.equal(runs["A2"], runs[None])


@pytest.mark.skipif(not (DEMO / "model/model.safetensors").is_file(), reason="the trained demo is not in models/demo")
def test_demo_greedy_reply_matches(tmp_path):
    from ced.tokenization import ChatTokenizer
    from ced.trt_engine import TensorRTCEDEngine

    engines = (CEDEngine(CEDForCausalLM.from_pretrained(str(DEMO / "model"))),
               TensorRTCEDEngine(CEDForCausalLM.from_pretrained(str(DEMO / "model")),
                                 build(tmp_path, DEMO / "model", "fp32")))
    tokenizer = ChatTokenizer(DEMO / "model")
    user = tokenizer.user_turn(tokenizer.encode("Reverse a list in Python."), first=True)
    replies = []
    for engine in engines:
        engine.adapters.load("coding", DEMO / "adapters/coding")
        state = engine.new_conversation()
        result = engine.turn(state, user, "coding")
        replies.append(list(engine.generate(state, "coding", result.logits, 12, stop_tokens=tokenizer.stop_ids)))
    assert replies[0] == replies[1]
