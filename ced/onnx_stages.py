"""The CED stages as export wrappers: the graphs' inputs and outputs around the model's own forward.

Each stage runs `shared_stage` or `decoder_stage` of `ced/model.py` over an `ExportCache` (ced/state.py): the
conversation state comes in as graph inputs (windows, global KV, index keys, partial blocks, any of them of length
zero) and the updated state goes out as graph outputs. The arithmetic is the model's, written once; where it has
data-dependent branches the cache's `graph` flag selects their graph form (a selection that always has top_k
slots, masks where the eager path skips work).

Multi-LoRA is a graph input: per adapted Linear the slots' stacked A (S, r, in) and their B side by side
(out, S * r; scaling folded into B, `ced/lora.py`'s `side_by_side`) and one slot per batch row (-1 = no adapter),
so one graph serves any adapter set.
The wrapped model is the plain `CEDForCausalLM`; weights become graph initializers.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from .adapters import placement_violation
from .lora import lora_by_row, replace_linears, slot_mask
from .model import CEDForCausalLM
from .state import ExportCache, Selection


def lora_modules(model: CEDForCausalLM) -> list[str]:
    """The Linears that may carry an adapter (the engine's slots), in a fixed order: the decoder graphs' LoRA inputs."""
    return sorted(name for name, module in model.named_modules()
                  if isinstance(module, nn.Linear) and placement_violation(name, model.ced) is None)


def io_names(model: CEDForCausalLM, stage: str) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of a stage, in the order the stage's forward takes and returns them."""
    c = model.ced
    E = c.decoder_start
    if stage == "prefill":
        inputs = ["input_ids", "start"]
        inputs += [f"window_{kv}.{i}" for i in range(E + 1) for kv in "kv"]
        inputs += [f"{part}.{s}" for s in c.source_layers for part in ("global_k", "global_v", "index_keys", "pending")]
        outputs = ["h19", "stream", "selection_idx", "selection_valid"]
        outputs += [f"window_{kv}_out.{i}" for i in range(E + 1) for kv in "kv"]
        outputs += [f"{part}.{s}" for s in c.source_layers
                    for part in ("new_global_k", "new_global_v", "new_index_keys", "pending_out")]
        return inputs, outputs
    inputs = ["stream", "start", "selection_idx", "selection_valid", "global_k", "global_v", "index_keys", "row_slots"]
    if stage == "decode_step":
        inputs += [f"window_{kv}.{i}" for i in c.adapter_bound_layers for kv in "kv"]
    inputs += [f"lora_{ab}.{name}" for name in lora_modules(model) for ab in "ab"]
    outputs = ["logits"] + [f"window_{kv}_out.{i}" for i in c.adapter_bound_layers for kv in "kv"]
    return inputs, outputs


class GraphLoRA:
    """The LoRA inputs of the call being traced: each adapted Linear's stacked (A, B) by name, and the rows' slots."""

    def __init__(self, names: list[str]):
        self.names = names  # the adapted Linears, in the graphs' input order
        self.weights: dict[str, tuple[Tensor, Tensor]] = {}
        self.slots: Tensor | None = None
        self.own: Tensor | None = None  # the rows' slot_mask, made once per traced call

    def mask(self, a: Tensor) -> Tensor:
        if self.own is None:
            self.own = slot_mask(self.slots, a.shape[0], a.shape[1], a.dtype)
        return self.own

    def clear(self) -> None:
        self.weights, self.slots, self.own = {}, None, None


class GraphLoRALinear(nn.Module):
    """An adaptable Linear of the exported model: its base weight, plus `lora_by_row` over the graph's inputs."""

    def __init__(self, base: nn.Linear, name: str, lora: GraphLoRA):
        super().__init__()
        self.base, self.name, self.lora = base, name, lora

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        if self.lora.slots is None:
            return y
        a, b = self.lora.weights[self.name]
        return lora_by_row(y, x, a, b, self.lora.mask(a))


def graph_lora_model(model: CEDForCausalLM) -> tuple[CEDForCausalLM, GraphLoRA]:
    """A copy of `model` whose adaptable Linears take their LoRA from the returned GraphLoRA (the graph's inputs
    while a call is traced); the caller's model stays as it was."""
    lora = GraphLoRA(lora_modules(model))
    copied = copy.deepcopy(model)
    replace_linears(copied, set(lora.names).__contains__, lambda name, base: GraphLoRALinear(base, name, lora))
    return copied, lora


def _positions(start: Tensor, length) -> Tensor:
    return (torch.arange(length) + start)[None]  # (1, T)


class PrefillStage(nn.Module):
    """`shared_stage`: layers 0..E-1 and layer E's attention. No adapter inputs: nothing here may depend on one."""

    def __init__(self, model: CEDForCausalLM):
        super().__init__()
        self.model, self.names = model, io_names(model, "prefill")[0]

    def forward(self, *inputs: Tensor):
        c, E = self.model.ced, self.model.ced.decoder_start
        get = dict(zip(self.names, inputs))
        cache = ExportCache({i: (get[f"window_k.{i}"], get[f"window_v.{i}"]) for i in range(E + 1)},
                            {s: (get[f"global_k.{s}"], get[f"global_v.{s}"], get[f"index_keys.{s}"])
                             for s in c.source_layers},
                            {s: get[f"pending.{s}"] for s in c.source_layers}, c.block_size, c.window)
        input_ids = get["input_ids"]
        out = self.model.shared_stage(input_ids, _positions(get["start"], input_ids.shape[1]), cache)
        outputs = [out.h19, out.stream, out.selection.idx, out.selection.valid]
        outputs += [t for i in range(E + 1) for t in cache.windows[i]]
        outputs += [t for s in c.source_layers for t in (*cache.added[s], cache.pending[s])]
        return tuple(outputs)


class DecoderStage(nn.Module):
    """`decoder_stage` + the LM head at the last position, under each row's LoRA slot (graph inputs).

    `with_windows=False` is the replay graph (the adapter-bound windows start empty); True is one decode step.
    The model is copied: its adaptable Linears become `GraphLoRALinear`s, the caller's model stays as it was."""

    def __init__(self, model: CEDForCausalLM, with_windows: bool):
        super().__init__()
        self.with_windows = with_windows
        self.names = io_names(model, "decode_step" if with_windows else "replay")[0]
        self.model, self.lora = graph_lora_model(model)

    def forward(self, *inputs: Tensor):
        c, E = self.model.ced, self.model.ced.decoder_start
        get = dict(zip(self.names, inputs))
        stream = get["stream"]
        B, T, _ = stream.shape
        empty = stream.new_zeros(B, c.n_heads, 0, c.head_dim)
        windows = {i: (get[f"window_k.{i}"], get[f"window_v.{i}"]) if self.with_windows else (empty, empty)
                   for i in c.adapter_bound_layers}
        cache = ExportCache(windows, {E: (get["global_k"], get["global_v"], get["index_keys"])}, {}, c.block_size,
                            c.window)
        self.lora.weights = {name: (get[f"lora_a.{name}"], get[f"lora_b.{name}"]) for name in self.lora.names}
        self.lora.slots = get["row_slots"]
        try:
            hidden = self.model.decoder_stage(stream, _positions(get["start"], T),
                                              Selection(get["selection_idx"], get["selection_valid"]), cache,
                                              last_only=True)
        finally:
            self.lora.clear()
        logits = self.model.lm_head(hidden[:, -1])  # (B, V)
        return (logits,) + tuple(t for i in c.adapter_bound_layers for t in cache.windows[i])
