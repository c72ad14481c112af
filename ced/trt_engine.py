"""The CED engine with its model calls run by TensorRT plans (built by `python -m engine_build tensorrt`).

Same as the ONNX Runtime engine (same graphs, same IO names, same state handling): only how a stage runs
differs. Inputs are copied to the GPU, outputs back to the CPU, because the conversation state stays in CPU
tensors that the Triton state codec writes; keeping state on the GPU is the next step once this runs on one.

UNTESTED so far: no GPU was lent when it was written. tests/test_tensorrt_gpu.py and scripts/gpu_check.sh
check it on a GPU machine.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .engine_files import STAGES, EngineFileError
from .ort_engine import OrtCEDEngine


def require_tensorrt() -> None:
    """Raise a clear error when this machine cannot run TensorRT engines."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise RuntimeError("the tensorrt engine needs the `tensorrt` package (pip install tensorrt) and a CUDA "
                           "GPU; neither is required elsewhere: use --engine torch or onnxruntime") from None
    if not torch.cuda.is_available():
        raise RuntimeError("the tensorrt engine needs a CUDA GPU, and torch sees none (this torch build: "
                           f"{torch.__version__}); use --engine torch or onnxruntime")


class TensorRTCEDEngine(OrtCEDEngine):
    kind = "tensorrt"
    stages = STAGES  # built from the ONNX folder's batch-1 graphs only

    def _open(self, stage: str, threads: int):
        import tensorrt as trt

        require_tensorrt()
        spec = self.manifest["graphs"][stage]
        logger = trt.Logger(trt.Logger.WARNING)
        engine = trt.Runtime(logger).deserialize_cuda_engine((self.engine_dir / spec["file"]).read_bytes())
        if engine is None:
            raise EngineFileError(f"{self.engine_dir / spec['file']}: TensorRT cannot load it (built by another "
                                  "TensorRT version or for another GPU?)")
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        if sorted(inputs) != sorted(spec["inputs"]):
            raise EngineFileError(f"{self.engine_dir / spec['file']}: IO names differ from {stage!r} in the manifest")
        return engine, engine.create_execution_context()

    def _run(self, stage: str, feeds: dict[str, np.ndarray]) -> dict[str, Tensor]:
        import tensorrt as trt

        engine, context = self.sessions[stage]
        spec = self.manifest["graphs"][stage]
        keep = []  # device tensors must outlive the launch
        for name in spec["inputs"]:
            tensor = torch.from_numpy(np.ascontiguousarray(feeds[name])).cuda()
            if tensor.numel() == 0:  # TensorRT wants a valid address even for an empty tensor
                tensor = torch.empty(1, dtype=tensor.dtype, device="cuda")
                context.set_input_shape(name, feeds[name].shape)
            else:
                context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, tensor.data_ptr())
            keep.append(tensor)
        outputs = {}
        for name in spec["outputs"]:
            shape = tuple(context.get_tensor_shape(name))
            dtype = torch.from_numpy(np.empty(0, dtype=trt.nptype(engine.get_tensor_dtype(name)))).dtype
            outputs[name] = torch.empty(shape, dtype=dtype, device="cuda")
            if outputs[name].numel() == 0:  # e.g. no block completed in this chunk: a valid, unused address
                keep.append(torch.empty(1, dtype=dtype, device="cuda"))
            context.set_tensor_address(name, (outputs[name] if outputs[name].numel() else keep[-1]).data_ptr())
        stream = torch.cuda.current_stream()
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"TensorRT failed to run the {stage} engine")
        stream.synchronize()
        return {name: tensor.float().cpu() if tensor.is_floating_point() else tensor.cpu()
                for name, tensor in outputs.items()}
