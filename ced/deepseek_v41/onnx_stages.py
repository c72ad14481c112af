"""The deepseek_v41 stages as export wrappers: the graphs' inputs and outputs around the model's own forward.

As for the ced family (ced/onnx_stages.py): each stage runs `shared_stage` or `decoder_stage` of
ced/deepseek_v41/model.py over a `V41ExportCache`, whose state tensors come in as graph inputs and leave as graph
outputs (windows, global entries and their indexer keys, partial groups, layer E's stream / pre / top-k / pool
tails: any of them of length zero). Where the eager model branches on data, the graph forms are selected by
flags: `cache.graph` (top-k over an unknown number of entries, `model._top_k`) and `MoE.dense` (every expert
computed, weighted by the routing mask). The arithmetic is the model's, written once.

Multi-LoRA is a graph input, as in the ced family: per adapted Linear (the placement rule's, routed experts
included) a stacked A (S, r, in) and B (S, out, r) (scaling folded into B, as V41AdapterSet holds them) and
`row_slots` (1,) picking the slot (-1: no adapter, the base's output bit for bit), so one graph serves any adapters.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from ..lora import replace_linears
from ..state import Selection
from .adapters import placement_violation
from .config import V41Config
from .model import DeepseekV41ForCausalLM, MoE


class V41ExportError(ValueError):
    """A V4.1 shape the exported graphs cannot serve; the message names the rule."""


def check_exportable(config: V41Config) -> None:
    """The graphs keep layer E's top-k (and pool) for every position, as the eager state does only when layer E
    always has entries for its own queries: a ratio-1 index source (true of the release's and the demo's shapes)."""
    E = config.decoder_start
    if config.compress_ratios[E] != 1 or E not in config.index_source_layer_ids:
        raise V41ExportError(f"the ONNX export needs the first decoder layer ({E}) to be an index source of "
                             f"compress ratio 1 (it is ratio {config.compress_ratios[E]}, index source: "
                             f"{E in config.index_source_layer_ids}): its top-k must exist at every position")
    if config.candidate_topk_blocks and config.candidate_source_layer_id not in (E, *config.adapter_bound_layers):
        raise V41ExportError(f"the ONNX export needs the candidate source ({config.candidate_source_layer_id}) at "
                             f"or above the first decoder layer ({E})")


def has_pool(config: V41Config) -> bool:
    """Whether layer E publishes a candidate pool (then it is state, and a graph input / output)."""
    return bool(config.candidate_topk_blocks) and config.candidate_source_layer_id == config.decoder_start


def lora_modules(model: DeepseekV41ForCausalLM) -> list[str]:
    """The Linears that may carry an adapter (V41AdapterSet's), in a fixed order: the decoder graphs' LoRA inputs."""
    return sorted(name for name, module in model.named_modules()
                  if isinstance(module, nn.Linear) and placement_violation(name, model.config) is None)


def io_names(config: V41Config, lora: list[str], stage: str) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of a stage, in the order its forward takes and returns them."""
    E, sources = config.decoder_start, config.kv_source_layer_ids
    choices = ["selection_idx", "selection_valid"] + (["pool_idx", "pool_valid"] if has_pool(config) else [])
    if stage == "prefill":
        inputs = ["input_ids", "start"] + [f"window.{i}" for i in range(E + 1)]
        inputs += [f"{part}.{s}" for s in sources for part in ("latent", "index_keys", "pending")]
        outputs = ["h19", "stream", "pre", *choices] + [f"window_out.{i}" for i in range(E + 1)]
        outputs += [f"{part}.{s}" for s in sources for part in ("new_latent", "new_index_keys", "pending_out")]
        return inputs, outputs
    inputs = ["stream", "pre", "start", *choices, "latent", "index_keys", "row_slots"]
    if stage == "decode_step":
        inputs += [f"window.{i}" for i in config.adapter_bound_layers]
    inputs += [f"lora_{ab}.{name}" for name in lora for ab in "ab"]
    return inputs, ["logits"] + [f"window_out.{i}" for i in config.adapter_bound_layers]


class V41ExportCache:
    """`V41Cache`'s verbs over explicit tensors, for a traced stage. Every length is a graph dimension that may be
    zero when it runs, so nothing branches on one: windows are joined and cut to the last W, groups are split by
    integer division (maybe none), and an all-zero entry after the store's own is what a choice points at before
    any entry exists (such slots are invalid: they get no weight)."""

    graph = True

    def __init__(self, config: V41Config, windows: dict[int, Tensor], stores: dict[int, tuple[Tensor, Tensor]],
                 pending: dict[int, Tensor]):
        self.windows = dict(windows)  # layer -> (B, n, D); after the call: the last W positions
        self.stores = dict(stores)  # source -> latents (B, N, D), index keys (B, N, I); compress appends
        self.pending = dict(pending)  # source -> (B, p, C); after the call: the group not yet complete
        self.added: dict[int, tuple[Tensor, Tensor]] = {}  # source -> the entries this call added
        self.ratios, self.window = config.compress_ratios, config.sliding_window

    def extend_window(self, layer: int, kv: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        past = self.windows[layer]
        keys = torch.cat([past, kv], dim=1)  # (B, S, D)
        self.windows[layer] = keys[:, -self.window:]
        key_pos = torch.arange(keys.shape[1], device=kv.device)[None] + (positions[:, :1] - past.shape[1])
        return keys, key_pos  # (1, S): the past positions, then this call's

    def compress(self, layer: int, xn: Tensor, pool) -> None:
        (B, _, C), r = xn.shape, self.ratios[layer]
        rows = torch.cat([self.pending[layer], xn], dim=1)  # (B, p + T, C)
        n_groups = rows.shape[1] // r
        first = torch.zeros(B, dtype=torch.long, device=xn.device) + self.stores[layer][0].shape[1]
        self.added[layer] = pool(rows[:, : n_groups * r].reshape(B, n_groups, r, C), first)
        self.stores[layer] = tuple(torch.cat(pair, dim=1) for pair in zip(self.stores[layer], self.added[layer]))
        self.pending[layer] = rows[:, n_groups * r:]

    def ratio(self, source: int) -> int:
        return self.ratios[source]

    def has_entries(self, source: int) -> bool:
        return True  # maybe none when the graph runs: the choices' validity masks them

    def index_keys(self, source: int) -> Tensor:
        return self.stores[source][1]

    def gather(self, source: int, idx: Tensor) -> Tensor:
        latent = self.stores[source][0]
        B, N, D = latent.shape
        rows = torch.cat([latent, latent.new_zeros(B, 1, D)], dim=1).reshape(-1, D)  # (B * (N + 1), D)
        return rows[idx + (torch.arange(B, device=idx.device) * (N + 1))[:, None, None]]  # (B, T, k, D)


class GraphLoRA:
    """The LoRA inputs of the call being traced: each adapted Linear's stacked (A, B) by name, and the row's slot
    (as an index into the stack and whether there is one: computed once per graph, not once per module)."""

    def __init__(self):
        self.weights: dict[str, tuple[Tensor, Tensor]] = {}
        self.index: Tensor | None = None
        self.active: Tensor | None = None

    def set(self, weights: dict[str, tuple[Tensor, Tensor]], slots: Tensor | None) -> None:
        self.weights = weights
        self.index, self.active = (None, None) if slots is None else (slots[0].clamp(min=0), slots[0] >= 0)


class GraphLoRALinear(nn.Module):
    """An adaptable Linear (or GroupedLinear) of the exported model: its base, plus the slot's A and B. One
    conversation per call, so one slot; any leading dims (the MoE's experts see tokens flattened, (N, C))."""

    def __init__(self, base: nn.Linear, name: str, lora: GraphLoRA):
        super().__init__()
        self.base, self.name, self.lora = base, name, lora
        self.groups = getattr(base, "groups", None)

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        if self.lora.index is None:
            return y
        a, b = self.lora.weights[self.name]
        a, b = a[self.lora.index], b[self.lora.index]  # (r, in), (out, r)
        down = torch.matmul(x, a.transpose(0, 1))  # (..., r), or (..., G, r) grouped
        if self.groups is None:
            delta = torch.matmul(down, b.transpose(0, 1))
        else:  # group g's rows of B meet group g's down projection (V41's LoRALinear._up)
            delta = torch.einsum("...gr,gor->...go", down, b.view(self.groups, -1, b.shape[1]))
        return torch.where(self.lora.active, y + delta, y)


def graph_model(model: DeepseekV41ForCausalLM, lora: GraphLoRA | None = None) -> DeepseekV41ForCausalLM:
    """A copy of the model in its graph forms (dense MoE; with `lora`, the adaptable Linears read its inputs)."""
    model = copy.deepcopy(model).float().eval()
    for module in model.modules():
        if isinstance(module, MoE):
            module.dense = True
    if lora is not None:
        replace_linears(model, set(lora_modules(model)).__contains__,
                        lambda name, base: GraphLoRALinear(base, name, lora))
    return model


def _positions(start: Tensor, length) -> Tensor:
    return (torch.arange(length) + start)[None]  # (1, T)


class PrefillStage(nn.Module):
    """`shared_stage`: layers 0..E-1 and layer E's attention. No adapter inputs: nothing here may depend on one."""

    def __init__(self, model: DeepseekV41ForCausalLM):
        super().__init__()
        check_exportable(model.config)
        self.model, self.config = graph_model(model), model.config
        self.names = io_names(model.config, [], "prefill")[0]

    def forward(self, *inputs: Tensor):
        c, E = self.config, self.config.decoder_start
        get = dict(zip(self.names, inputs))
        sources = c.kv_source_layer_ids
        cache = V41ExportCache(c, {i: get[f"window.{i}"] for i in range(E + 1)},
                               {s: (get[f"latent.{s}"], get[f"index_keys.{s}"]) for s in sources},
                               {s: get[f"pending.{s}"] for s in sources})
        ids = get["input_ids"]
        out = self.model.shared_stage(ids, _positions(get["start"], ids.shape[1]), cache)
        outputs = [out.h19.mean(dim=2), out.stream, out.pre, out.selection.idx, out.selection.valid]
        if has_pool(c):
            outputs += [out.pool.idx, out.pool.valid]
        outputs += [cache.windows[i] for i in range(E + 1)]
        outputs += [t for s in sources for t in (*cache.added[s], cache.pending[s])]
        return tuple(outputs)


class DecoderStage(nn.Module):
    """`decoder_stage` + head from layer E's post-attention streams, under the slot's adapter. `with_windows`
    (decode_step) continues the adapter-bound windows; without (replay) they start empty."""

    def __init__(self, model: DeepseekV41ForCausalLM, with_windows: bool):
        super().__init__()
        check_exportable(model.config)
        self.lora, self.lora_names, self.with_windows = GraphLoRA(), lora_modules(model), with_windows
        self.model, self.config = graph_model(model, self.lora), model.config
        self.names = io_names(model.config, self.lora_names, "decode_step" if with_windows else "replay")[0]

    def forward(self, *inputs: Tensor):
        c, E = self.config, self.config.decoder_start
        get = dict(zip(self.names, inputs))
        stream = get["stream"]
        empty = stream.new_zeros(stream.shape[0], 0, c.head_dim)
        windows = {i: get[f"window.{i}"] if self.with_windows else empty for i in c.adapter_bound_layers}
        cache = V41ExportCache(c, windows, {E: (get["latent"], get["index_keys"])}, {})
        pool = Selection(get["pool_idx"], get["pool_valid"]) if has_pool(c) else None
        self.lora.set({name: (get[f"lora_a.{name}"], get[f"lora_b.{name}"]) for name in self.lora_names},
                      get["row_slots"])
        try:
            hidden = self.model.decoder_stage(stream, get["pre"], _positions(get["start"], stream.shape[1]),
                                              Selection(get["selection_idx"], get["selection_valid"]), pool, cache,
                                              last_only=True)
        finally:
            self.lora.set({}, None)
        logits = self.model.logits(hidden)[:, -1]  # (1, V)
        return (logits,) + tuple(cache.windows[i] for i in c.adapter_bound_layers)
