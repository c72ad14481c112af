"""The deepseek_v41 engine with its model calls run by ONNX Runtime on the graphs of ced/deepseek_v41/onnx_export.py.

`V41Engine`'s interface and semantics (prefill -> H19 pooled over the mHC streams, replay of the last W positions
under the turn's adapter, one step per token) over the same `V41ConversationState`, so RowEngine, the store, the
journal and the transfers see no difference. What stays torch: the adapter registry (V41AdapterSet holds each
adapter's A and scaled B per module; they are fed to the decoder graphs on every call, so loading, replacing or
unloading takes effect on the next call, with no re-export), `turn` / `generate`, and the evaluation-only `oracle`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..engine import EngineStats, StateError, check_tokens
from ..engine_files import STAGES, EngineFileError, check_matches, read_manifest
from ..ort_engine import open_session
from ..state import Selection
from .adapters import LoRALinear, V41AdapterRegistry, V41AdapterSet
from .engine import V41Engine
from .model import DeepseekV41ForCausalLM
from .onnx_stages import has_pool
from .state import V41AdapterState, V41ConversationState


def _np(tensor: Tensor | None, empty_shape: tuple[int, ...]) -> np.ndarray:
    """A state tensor as the graphs take it; a part not written yet is a zero-length tensor."""
    if tensor is None:
        return np.zeros(empty_shape, dtype=np.float32)
    return tensor.detach().contiguous().numpy()


class OrtV41Engine(V41Engine):
    kind = "onnx"  # the manifest kind this engine runs

    def __init__(self, model: DeepseekV41ForCausalLM, engine_dir: str | Path, max_adapters: int = 8,
                 max_rank: int = 16, prefill_chunk: int = 256, threads: int | None = None):
        # Not V41Engine.__init__: no native plan (the graphs run every call). The graphs run float32 (exported
        # from the float32 model), so the state and the adapters must be float32 too.
        self.model = model.float().eval()
        self.config = model.config
        self.prefill_chunk = prefill_chunk
        self.adapter_set = V41AdapterSet(self.model)
        self.adapters = V41AdapterRegistry(self.adapter_set, max_adapters, max_rank)
        self.stats = EngineStats()
        self.engine_dir = Path(engine_dir)
        self.manifest = read_manifest(self.engine_dir, self.kind)
        if self.manifest.get("family") != "deepseek_v41":
            raise EngineFileError(f"{self.engine_dir}: built for the {self.manifest.get('family', 'ced')!r} family, "
                                  "not deepseek_v41")
        check_matches(self.manifest, self.config, self.model, list(self.adapter_set.modules), self.engine_dir)
        self._pool = has_pool(self.config)
        self._lora_feeds: dict[str | None, dict[str, np.ndarray]] = {}  # adapter -> its LoRA inputs
        self._lora_changes = -1  # LoRALinear.changes when they were made
        self.sessions = {stage: open_session(self.engine_dir, self.manifest["graphs"][stage], stage,
                                             threads or torch.get_num_threads()) for stage in STAGES}

    def _run(self, stage: str, feeds: dict[str, np.ndarray]) -> dict[str, Tensor]:
        values = self.sessions[stage].run(None, feeds)
        return {name: torch.from_numpy(value) for name, value in zip(self.manifest["graphs"][stage]["outputs"], values)}

    # -- the graph calls ------------------------------------------------------------------------------------

    def _shared_stage(self, state: V41ConversationState, tokens: list[int]) -> dict[str, Tensor]:
        """The prefill graph over `tokens` at the end of the context; appends to the shared state and returns
        what the decoder graphs take for these positions (and H19 pooled) by name."""
        c, shared = self.config, state.shared
        feeds = {"input_ids": np.asarray([tokens], dtype=np.int64), "start": np.asarray(shared.length, dtype=np.int64)}
        for i, window in shared.windows.items():
            feeds[f"window.{i}"] = _np(window.kv, (1, 0, c.head_dim))
        for s, store in shared.stores.items():
            feeds[f"latent.{s}"] = _np(store.latent, (1, 0, c.head_dim))
            feeds[f"index_keys.{s}"] = _np(store.index_keys, (1, 0, c.index_head_dim))
            feeds[f"pending.{s}"] = _np(store.pending, (1, 0, c.hidden_size))
        out = self._run("prefill", feeds)
        for i, window in shared.windows.items():
            window.kv = out[f"window_out.{i}"]
        for s, store in shared.stores.items():
            store.add_entries(out[f"new_latent.{s}"], out[f"new_index_keys.{s}"])
            store.pending = out[f"pending_out.{s}"]
        selection = Selection(out["selection_idx"], out["selection_valid"])
        pool = Selection(out["pool_idx"], out["pool_valid"]) if self._pool else None
        shared.keep(out["stream"], out["pre"], selection, pool)
        shared.tokens.extend(tokens)
        return out

    def _lora(self, adapter: str | None) -> dict[str, np.ndarray]:
        """The LoRA inputs for a call under `adapter`: one slot holding its A and scaled B per module (zeros where
        it leaves a module alone; slot -1 and rank-1 zeros for the base model). Kept until an adapter changes."""
        if self._lora_changes != LoRALinear.changes:  # an adapter was loaded, replaced or unloaded since
            self._lora_feeds, self._lora_changes = {}, LoRALinear.changes
        if adapter in self._lora_feeds:
            return self._lora_feeds[adapter]
        rank = 1 if adapter is None else self.adapters.get(adapter).rank
        feeds = {"row_slots": np.asarray([-1 if adapter is None else 0], dtype=np.int64)}
        for name in self.manifest["lora_modules"]:
            module = self.adapter_set.modules[name]
            a = np.zeros((1, rank, module.in_features), dtype=np.float32)
            b = np.zeros((1, module.out_features, rank), dtype=np.float32)
            if adapter in module.adapters:
                a_i, b_i = module.adapters[adapter]
                a[0, : a_i.shape[0]], b[0, :, : a_i.shape[0]] = a_i.float().numpy(), b_i.float().numpy()
            feeds[f"lora_a.{name}"], feeds[f"lora_b.{name}"] = a, b
        self._lora_feeds[adapter] = feeds
        return feeds

    def _decoder(self, stage: str, stream: Tensor, pre: Tensor, start: int, selection: Selection,
                 pool: Selection | None, state: V41ConversationState, windows: dict, adapter: str | None) -> Tensor:
        """A decoder graph (replay: from empty windows; decode_step: continuing `windows`), which it updates;
        returns the last position's logits (V,)."""
        c = self.config
        store = state.shared.stores[c.decoder_start]
        feeds = {"stream": _np(stream, ()), "pre": _np(pre, ()), "start": np.asarray(start, dtype=np.int64),
                 "selection_idx": _np(selection.idx, ()), "selection_valid": _np(selection.valid, ()),
                 "latent": _np(store.latent, (1, 0, c.head_dim)),
                 "index_keys": _np(store.index_keys, (1, 0, c.index_head_dim)), **self._lora(adapter)}
        if self._pool:
            feeds["pool_idx"], feeds["pool_valid"] = _np(pool.idx, ()), _np(pool.valid, ())
        if stage == "decode_step":
            for i, window in windows.items():
                feeds[f"window.{i}"] = _np(window.kv, (1, 0, c.head_dim))
        out = self._run(stage, feeds)
        for i, window in windows.items():
            window.kv = out[f"window_out.{i}"]
        return out["logits"][0]

    # -- the verbs (V41Engine's semantics) ------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, state: V41ConversationState, tokens: list[int]) -> Tensor:
        tokens = check_tokens(self.config, state.length, tokens)
        h19 = [self._shared_stage(state, tokens[start: start + self.prefill_chunk])["h19"][0]
               for start in range(0, len(tokens), self.prefill_chunk)]
        self.stats.prefilled_positions += len(tokens)
        return torch.cat(h19)

    @torch.inference_mode()
    def replay(self, state: V41ConversationState, adapter: str | None) -> tuple[Tensor, int]:
        if state.length == 0:
            raise StateError("nothing to replay: the conversation is empty")
        self.adapters.slot_of(adapter)  # an unknown adapter fails here, before the state is touched
        shared, n = state.shared, min(self.config.sliding_window, state.length)
        last = lambda c: None if c is None else Selection(c.idx[:, -n:], c.valid[:, -n:])  # noqa: E731
        windows = self.model.new_windows(self.config.adapter_bound_layers)
        logits = self._decoder("replay", shared.stream[:, -n:], shared.pre[:, -n:], state.length - n,
                               last(shared.selection), last(shared.pool), state, windows, adapter)
        state.bound = V41AdapterState(adapter, windows, state.length, self.adapters.digest(adapter))
        self.stats.replayed_positions += n
        return logits, n

    @torch.inference_mode()
    def step(self, state: V41ConversationState, token: int, adapter: str | None) -> Tensor:
        tokens = self._check_step(state, token, adapter)
        out = self._shared_stage(state, tokens)
        pool = Selection(out["pool_idx"], out["pool_valid"]) if self._pool else None
        logits = self._decoder("decode_step", out["stream"], out["pre"], state.length - 1,
                               Selection(out["selection_idx"], out["selection_valid"]), pool, state,
                               state.bound.windows, adapter)
        state.bound.length = state.length
        self.stats.decoded_tokens += 1
        return logits

    @torch.inference_mode()
    def step_rows(self, states: list[V41ConversationState], tokens: list[int],
                  adapters: list[str | None]) -> Tensor:
        """`step` of each row in turn (the graphs take one conversation per call); every row is checked first."""
        if len({id(state) for state in states}) != len(states):
            raise StateError("a conversation appears twice in one step")
        for state, token, adapter in zip(states, tokens, adapters, strict=True):
            self._check_step(state, token, adapter)
        return torch.stack([self.step(state, token, adapter) for state, token, adapter in zip(states, tokens, adapters)])


__all__ = ["OrtV41Engine"]
