"""The `deepseek_v41` model family: DeepSeek-V4.1-Flash's real layout (a causal encoder-decoder) at any size.

`config` holds the shape (`V41Config`, presets, per-layer roles, parameter counts); `model` the plain-torch model
whose `state_dict()` carries the release's native tensor names; `state` one conversation's windows and global KV
(the cache the model reads and writes); `conversation` the reference serial path (prefill, bounded replay, step);
`engine` the serving engine and `batch` its decode step of many conversations in one pass; `adapters` the
placement rule and LoRA on the native names (one adapter per call, or per batch row); `quant` and `checkpoint`
the release's FP8/FP4 formats and sharded safetensors; `onnx_stages` / `onnx_export` its stages as ONNX graphs
and `ort_engine` the engine over them (ONNX Runtime), `engines` what `ced.engines.make_engine` calls for it. The
family is registered in `ced.families`. Facts and
sources: ../shared/reference/deepseek_v41.md.
"""

from .config import V41Config, V41ConfigError, parameter_counts

__all__ = ["V41Config", "V41ConfigError", "parameter_counts"]
