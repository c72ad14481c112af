"""The CED engine with its two model calls run by ONNX Runtime on graphs built by `python -m engine_build onnx`.

Everything else is `CEDEngine`: the conversation state (the same torch tensors, so the Triton state codec and the
conversation store see no difference), the verbs, the adapter registry. LoRA slots stay in the registry's
buffers and are fed to the decoder graphs on every call (`LoRAInputs`), so loading, replacing or unloading an adapter
takes effect on the next call, with no re-export. The PyTorch model stays loaded beside the graphs: its buffers hold the
slots, the router reads its embeddings, and the evaluation-only `oracle` / `forward_batch` run it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .engine import CEDEngine
from .engine_files import STAGES, EngineFileError, check_matches, read_manifest
from .lora import MultiLoRALinear, side_by_side
from .pool_graphs import POOL_STAGES
from .model import CEDForCausalLM, SharedOutput
from .state import ConversationState, Selection


def _np(tensor: Tensor | None, empty_shape: tuple[int, ...]) -> np.ndarray:
    """A state tensor as the graphs take it; state not written yet is a zero-length tensor."""
    if tensor is None:
        return np.zeros(empty_shape, dtype=np.float32)
    return tensor.detach().contiguous().numpy()


def open_session(engine_dir: Path, spec: dict, stage: str, threads: int):
    """An ONNX Runtime session on one graph of a built folder (its manifest entry `spec`), its IO names checked
    against the manifest's. Shared by every family's ORT engine."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.log_severity_level = 3  # warnings about unused initializers are noise here
    try:
        session = ort.InferenceSession(str(engine_dir / spec["file"]), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime raises its own exception types for a corrupt file
        raise EngineFileError(f"{engine_dir / spec['file']}: ONNX Runtime cannot load it: {error}") from None
    inputs, outputs = [i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()]
    if inputs != spec["inputs"] or outputs != spec["outputs"]:
        raise EngineFileError(f"{engine_dir / spec['file']}: IO names differ from {stage!r} in the manifest (a graph "
                              "from another build?)")
    return session


class LoRAInputs:
    """The registry's LoRA slots as the ced family's graphs take them: each module's A as stored, its B side by side
    (ced/lora.py), made again only after an adapter was loaded or unloaded, so a swap takes effect on the next call
    with no re-export."""

    def __init__(self, modules: list[tuple[str, MultiLoRALinear]]):
        self.modules, self.made_at, self.feeds = modules, None, {}

    def __call__(self) -> dict[str, Tensor]:
        if self.made_at != MultiLoRALinear.changes:
            self.made_at = MultiLoRALinear.changes
            self.feeds = {}
            for name, module in self.modules:
                self.feeds[f"lora_a.{name}"] = module.lora_a
                self.feeds[f"lora_b.{name}"] = side_by_side(module.lora_b).contiguous()
        return self.feeds


class OrtCEDEngine(CEDEngine):
    kind = "onnx"  # the manifest kind this engine runs
    stages = STAGES + POOL_STAGES  # the graphs its folder must hold: its own and the serving engine's

    def __init__(self, model: CEDForCausalLM, engine_dir: str | Path, max_adapters: int = 8, max_rank: int = 16,
                 prefill_chunk: int = 256, threads: int | None = None):
        # The graphs run float32 (exported from the float32 model), so the state and the slots must be float32 too,
        # whatever dtype the checkpoint was saved in.
        super().__init__(model.float(), max_adapters, max_rank, prefill_chunk=prefill_chunk)
        self.engine_dir = Path(engine_dir)
        self.manifest = read_manifest(self.engine_dir, self.kind, self.stages)
        if self.manifest.get("family", "ced") != "ced":  # builds before the field existed are the ced family's
            raise EngineFileError(f"{self.engine_dir}: built for the {self.manifest['family']!r} family, not ced")
        check_matches(self.manifest, self.config, self.model, list(self.adapters.modules), self.engine_dir)
        self.lora_inputs = LoRAInputs([(name, self.adapters.modules[name]) for name in self.manifest["lora_modules"]])
        self.sessions = {stage: self._open(stage, threads or torch.get_num_threads()) for stage in STAGES}

    def _open(self, stage: str, threads: int):
        return open_session(self.engine_dir, self.manifest["graphs"][stage], stage, threads)

    def _run(self, stage: str, feeds: dict[str, np.ndarray]) -> dict[str, Tensor]:
        spec = self.manifest["graphs"][stage]
        values = self.sessions[stage].run(None, feeds)
        return {name: torch.from_numpy(value) for name, value in zip(spec["outputs"], values)}

    # -- the two model calls --------------------------------------------------------------------------------

    def _shared_stage(self, state: ConversationState, tokens: list[int]) -> SharedOutput:
        c, shared = self.config, state.shared
        H, D = c.n_heads, c.head_dim
        feeds = {"input_ids": np.asarray([tokens], dtype=np.int64), "start": np.asarray(shared.length, dtype=np.int64)}
        for i, window in shared.windows.items():
            feeds[f"window_k.{i}"] = _np(window.k, (1, H, 0, D))
            feeds[f"window_v.{i}"] = _np(window.v, (1, H, 0, D))
        for s, store in shared.globals.items():
            feeds[f"global_k.{s}"] = _np(store.k, (1, 0, H, D))
            feeds[f"global_v.{s}"] = _np(store.v, (1, 0, H, D))
            feeds[f"index_keys.{s}"] = _np(store.index_keys, (1, 0, c.index_dim))
            feeds[f"pending.{s}"] = _np(store.pending, (1, 0, c.hidden_size))
        out = self._run("prefill", feeds)
        for i, window in shared.windows.items():
            window.k, window.v = out[f"window_k_out.{i}"], out[f"window_v_out.{i}"]
        for s, store in shared.globals.items():
            store.add_entries(out[f"new_global_k.{s}"], out[f"new_global_v.{s}"], out[f"new_index_keys.{s}"])
            store.pending = out[f"pending_out.{s}"]
        return SharedOutput(out["h19"], out["stream"], Selection(out["selection_idx"], out["selection_valid"]))

    def _decoder_logits(self, state: ConversationState, stream: Tensor, start: int, selection: Selection,
                        windows: dict, capture: dict[int, list[Tensor]] | None = None) -> Tensor:
        if capture is not None:
            raise NotImplementedError("capturing decoder layer outputs needs the torch engine (evaluation only)")
        c = self.config
        store = state.shared.globals[c.decoder_start]
        # Replay starts from empty adapter-bound windows; a decode step continues them.
        stage = "decode_step" if any(len(w) for w in windows.values()) else "replay"
        slots = self.mapping.row_slots if self.mapping.row_slots is not None else torch.tensor([-1])
        feeds = {"stream": _np(stream, ()), "start": np.asarray(start, dtype=np.int64),
                 "selection_idx": _np(selection.idx, ()), "selection_valid": _np(selection.valid, ()),
                 "global_k": _np(store.k, (1, 0, c.n_heads, c.head_dim)),
                 "global_v": _np(store.v, (1, 0, c.n_heads, c.head_dim)),
                 "index_keys": _np(store.index_keys, (1, 0, c.index_dim)), "row_slots": _np(slots, ())}
        if stage == "decode_step":
            for i, window in windows.items():
                feeds[f"window_k.{i}"], feeds[f"window_v.{i}"] = _np(window.k, ()), _np(window.v, ())
        feeds.update({name: _np(value, ()) for name, value in self.lora_inputs().items()})
        out = self._run(stage, feeds)
        for i, window in windows.items():
            window.k, window.v = out[f"window_k_out.{i}"], out[f"window_v_out.{i}"]
        return out["logits"][0]
