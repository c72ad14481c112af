"""The serving engine's stages as ONNX graphs over the paged pool (ced/paged.py): what `OrtBatchedEngine`
(ced/ort_batched.py) runs, as `BatchedEngine` runs the model over a `PagedCache`.

| graph | what | rows x positions |
|---|---|---|
| pool_prefill.onnx | `shared_stage` of a chunk of each row (ragged chunks padded) | B x T |
| pool_replay.onnx | `decoder_stage` + LM head from empty adapter-bound windows, over kept streams | B x n |
| pool_step.onnx | both stages + LM head for one token of each row, each under its own adapter | B x 1 |

A graph reads the pool where it lies and writes nothing: its inputs are the rows' window rings (B, H, W, D) — in
place for a settled decode batch, whose rings are one slice of each buffer — the whole page buffers of the global
entries with the rows' page table, and each row's partial block; its outputs are what the call adds (each layer's
new keys and values, the blocks it pooled, the stream kept for replay), which the engine writes into the pool. So
what a call moves grows with its rows, positions and W, never with the history, as in the torch engine.

The arithmetic is the model's (`shared_stage`, `decoder_stage`) over a `PoolGraphCache`, whose bookkeeping is in
tensor operations only (no branch on a length, which is unknown until the graph runs): a ring's places carry the
positions they hold, so attention masks them as it masks any key; every chunk pools the blocks from its first open
one on, and a block not complete yet is masked by its block end like a padded entry.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from . import kernels
from .config import CEDConfig
from .model import CEDForCausalLM
from .onnx_stages import graph_lora_model, lora_modules
from .paged import FAR
from .state import PoolBlocks, Selection

POOL_STAGES = ("pool_prefill", "pool_replay", "pool_step")


class PoolGraphCache:
    """The AttentionCache of rows over pool tensors given as graph inputs (see the module's docstring).

    positions (B, T); table (B, P) the rows' pages; pages: source -> (k, v (pages, Pe, H, D), index keys
    (pages, Pe, I)); rings: layer -> (k, v) (B, H, W, D), absent for a layer whose past is empty for this call;
    pending: source -> (B, m, C), each row's open block (its first `start % m` places hold inputs). `done`
    (R,): in a decode step, the rows whose open block this position completes, the only ones that pool (the others'
    new entry is zeros, masked by its block end); None: a chunk, every row pools."""

    graph = True

    def __init__(self, positions: Tensor, table: Tensor, pages: dict[int, tuple[Tensor, Tensor, Tensor]],
                 rings: dict[int, tuple[Tensor, Tensor]], pending: dict[int, Tensor], block_size: int,
                 done: Tensor | None = None):
        self.positions, self.table, self.pages, self.rings, self.pending = positions, table, pages, rings, pending
        self.m, self.done = block_size, done
        self.start = positions[:, :1]  # (B, 1)
        self.new_windows: dict[int, tuple[Tensor, Tensor]] = {}  # layer -> this call's keys, values (B, H, T, D)
        self.entries: dict[int, tuple[Tensor, Tensor, Tensor]] = {}  # source -> pooled k, v, index keys (B, n, ...)
        self.added: dict[int, tuple[Tensor, ...]] = {}  # source -> the call's outputs: what the engine writes
        if rings:
            W = next(iter(rings.values()))[0].shape[2]
            last = self.start - 1  # place p holds the latest position before the call that is p modulo W
            held = last - (last - torch.arange(W)[None]).remainder(W)
            self.ring_positions = held.masked_fill(held < 0, FAR)  # (B, W)

    def extend_window(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.new_windows[layer] = (k, v)
        if layer not in self.rings:
            return k, v, positions
        ring_k, ring_v = self.rings[layer]
        # In two parts: the model joins their scores, not the ring (ced/model.py). A place the call's positions will
        # take holds one W or more back, out of their window: masked.
        return (ring_k, k), (ring_v, v), (self.ring_positions, positions)

    def compress(self, layer: int, xn: Tensor, pool: PoolBlocks) -> None:
        """Pool the blocks from each row's open one on: its held inputs (at most m - 1), then this call's T; so
        ceil(T / m) + 1 blocks cover any row. Those past a row's end are incomplete, masked by their block ends.
        A decode step pools the `done` rows' blocks only, a row's m - 1 held inputs and this one."""
        (B, T, C), m = xn.shape, self.m
        first, held = self.start // m, self.start % m  # (B, 1)
        if self.done is not None:
            done = self.done
            blocks = torch.cat([self.pending[layer][done, : m - 1], xn[done]], dim=1)[:, None]  # (R, 1, m, C)
            pooled = pool(blocks, first[done, 0])
            self.entries[layer] = tuple(torch.zeros(B, *t.shape[1:]).index_copy(0, done, t) for t in pooled)
            self.added[layer] = (*pooled, xn)  # the engine writes xn into each row's open block
            return
        offsets = torch.arange(((T + m - 1) // m + 1) * m)[None]  # from the open block's first place
        source = torch.where(offsets < held, offsets, offsets - held + m).clamp(max=m + T - 1)
        inputs = torch.cat([self.pending[layer], xn], dim=1)  # (B, m + T, C)
        blocks = inputs.gather(1, source[..., None].expand(B, -1, C)).view(B, -1, m, C)
        self.entries[layer] = pool(blocks, first[:, 0])
        self.added[layer] = (*self.entries[layer], blocks)

    def has_entries(self, source: int) -> bool:
        return True  # maybe none: the block-end mask and the selection's validity hide them

    def _paged(self, buffer: Tensor) -> Tensor:
        return buffer[self.table].flatten(1, 2)  # (B, P * Pe, ...): each row's entries, padded past its own

    def index_keys(self, source: int) -> Tensor:
        keys = self._paged(self.pages[source][2])
        if source not in self.entries:
            return keys
        new = self.entries[source][2]  # (B, n, I) at entries first.. of each row
        B, N, n = keys.shape[0], keys.shape[1], new.shape[1]
        keys = torch.cat([keys, torch.zeros_like(new)], dim=1)
        relative = torch.arange(N + n)[None] - self.start // self.m  # (B, N + n)
        picked = new.gather(1, relative.clamp(0, n - 1)[..., None].expand(B, -1, new.shape[2]))
        return torch.where(((relative >= 0) & (relative < n))[..., None], picked, keys)

    def gather(self, source: int, idx: Tensor) -> tuple[Tensor, Tensor]:
        """Gathered in the order attention reads them, (B, H, T, k, D), and returned as (B, T, k, H, D) views: the
        model's permute back cancels, where a gather in entry order left a transpose of every selection."""
        k_pages, v_pages, _ = self.pages[source]
        Pe, H, D = k_pages.shape[1:]
        new = source in self.entries
        first = (self.start // self.m)[..., None]  # (B, 1, 1)
        looked = torch.where(idx < first, idx, torch.zeros_like(idx)) if new else idx  # a new entry: not paged
        pages = self.table.gather(1, (looked // Pe).flatten(1)).view_as(looked)
        places = (pages * Pe + looked % Pe)[:, None] * H + torch.arange(H)[None, :, None, None]  # (B, H, T, k)
        k, v = k_pages.reshape(-1, D)[places], v_pages.reshape(-1, D)[places]  # (B, H, T, k, D)
        if new:
            new_k, new_v, _ = self.entries[source]  # (B, n, H, D)
            relative = (idx - first).clamp(0, new_k.shape[1] - 1)[:, None]  # (B, 1, T, k)
            rows, heads = torch.arange(idx.shape[0])[:, None, None, None], torch.arange(H)[None, :, None, None]
            old = (idx < first)[:, None, ..., None]  # (B, 1, T, k, 1)
            k = torch.where(old, k, new_k.transpose(1, 2)[rows, heads, relative])
            v = torch.where(old, v, new_v.transpose(1, 2)[rows, heads, relative])
        return k.permute(0, 2, 3, 1, 4), v.permute(0, 2, 3, 1, 4)

    def native_decode(self, positions: Tensor) -> None:
        return None


# -- the graphs' inputs and outputs -------------------------------------------------------------------------------


def _window_layers(c: CEDConfig, stage: str) -> list[int]:
    """The layers whose rings a stage reads (a replay rebuilds the adapter-bound windows from empty)."""
    return list(range(c.decoder_start + 1)) if stage == "pool_prefill" else [] if stage == "pool_replay" \
        else list(range(c.n_layers))


def _sources(c: CEDConfig, stage: str) -> tuple[list[int], list[int]]:
    """(the sources whose pages a stage reads, those it compresses into)."""
    shared = list(c.source_layers)
    return (shared, shared) if stage != "pool_replay" else ([c.decoder_start], [])


def pool_io_names(model: CEDForCausalLM, stage: str) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of a pool graph, in the order its wrapper takes and returns them."""
    c = model.ced
    layers, (read, compressed) = _window_layers(c, stage), _sources(c, stage)
    inputs = ["stream", "selection_idx", "selection_valid"] if stage == "pool_replay" else ["input_ids"]
    inputs += ["positions", "table"]
    inputs += [f"pages_{part}.{s}" for s in read for part in "kvi"]
    inputs += [f"ring_{kv}.{i}" for i in layers for kv in "kv"]
    inputs += [f"pending.{s}" for s in compressed]
    if stage == "pool_step":
        inputs += ["done"]
    if stage != "pool_prefill":
        inputs += ["row_slots"] + [f"lora_{ab}.{name}" for name in lora_modules(model) for ab in "ab"]
    written = list(range(c.decoder_start + 1)) if stage == "pool_prefill" else list(c.adapter_bound_layers) \
        if stage == "pool_replay" else list(range(c.n_layers))
    outputs = {"pool_prefill": ["h19", "stream", "selection_idx", "selection_valid"], "pool_replay": ["logits"],
               "pool_step": ["logits", "stream", "selection_idx", "selection_valid"]}[stage]
    outputs += [f"new_{kv}.{i}" for i in written for kv in "kv"]
    last = "inputs" if stage == "pool_step" else "blocks"  # a step's inputs (B, 1, C); a chunk's blocks (B, n, m, C)
    outputs += [f"{part}.{s}" for s in compressed for part in ("entry_k", "entry_v", "entry_i", last)]
    return inputs, outputs


class PoolStage(nn.Module):
    """One pool graph around the model's own stages. The model is copied: its adaptable Linears take the LoRA
    inputs (onnx_stages.graph_lora_model), the caller's model stays as it was."""

    def __init__(self, model: CEDForCausalLM, stage: str):
        super().__init__()
        self.stage, (self.names, _) = stage, pool_io_names(model, stage)
        self.model, self.lora = graph_lora_model(model)

    def forward(self, *inputs: Tensor):
        model, c, stage = self.model, self.model.ced, self.stage
        get = dict(zip(self.names, inputs))
        read, compressed = _sources(c, stage)
        positions = get["positions"]
        cache = PoolGraphCache(positions, get["table"],
                               {s: (get[f"pages_k.{s}"], get[f"pages_v.{s}"], get[f"pages_i.{s}"]) for s in read},
                               {i: (get[f"ring_k.{i}"], get[f"ring_v.{i}"]) for i in _window_layers(c, stage)},
                               {s: get[f"pending.{s}"] for s in compressed}, c.block_size, get.get("done"))
        if stage == "pool_prefill":
            out = model.shared_stage(get["input_ids"], positions, cache)
            outputs = [out.h19, out.stream, out.selection.idx, out.selection.valid]
        else:
            self.lora.weights = {name: (get[f"lora_a.{name}"], get[f"lora_b.{name}"]) for name in self.lora.names}
            self.lora.slots = get["row_slots"]
            try:
                if stage == "pool_replay":
                    selection = Selection(get["selection_idx"], get["selection_valid"])
                    hidden = model.decoder_stage(get["stream"], positions, selection, cache, last_only=True)
                    outputs = [model.lm_head(hidden[:, -1])]
                else:
                    out = model.shared_stage(get["input_ids"], positions, cache)
                    hidden = model.decoder_stage(out.stream, positions, out.selection, cache)
                    outputs = [model.lm_head(hidden[:, -1]), out.stream, out.selection.idx, out.selection.valid]
            finally:
                self.lora.clear()
        outputs += [t for i in sorted(cache.new_windows) for t in cache.new_windows[i]]
        outputs += [t for s in compressed for t in cache.added[s]]
        return tuple(outputs)


# -- export -------------------------------------------------------------------------------------------------------

_ROWS, _T, _PAGES, _PAGE_ENTRIES, _SLOTS = 2, 5, 3, 4, 3  # sample sizes: all >= 2 so that export keeps them symbolic


def _samples(model: CEDForCausalLM, stage: str) -> tuple[list[Tensor], list[dict]]:
    """Sample inputs of a pool graph and, per input, its dynamic axes by name."""
    from .onnx_export import lora_sample

    c = model.ced
    H, D, C, I, K, W, m = c.n_heads, c.head_dim, c.hidden_size, c.index_dim, c.index_top_k, c.window, c.block_size
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    T = 1 if stage == "pool_step" else _T
    rows_t = {0: "rows", 1: "positions"} if T > 1 else {0: "rows"}
    tensors, dims = [], []
    for name in pool_io_names(model, stage)[0]:
        kind, _, suffix = name.partition(".")
        if name == "input_ids":
            t, d = torch.randint(0, c.vocab_size, (_ROWS, T), generator=g), rows_t
        elif name == "positions":
            starts = [[m * _PAGE_ENTRIES + 3], [m + 1]]  # entries within the sample table's two pages
            t, d = torch.tensor(starts) + torch.arange(T)[None], rows_t
        elif name == "table":
            t, d = torch.tensor([[0, 2], [1, 0]]), {0: "rows", 1: "table_pages"}
        elif kind in ("pages_k", "pages_v"):
            t, d = rand(_PAGES, _PAGE_ENTRIES, H, D), {0: "pages", 1: "page_entries"}
        elif kind == "pages_i":
            t, d = rand(_PAGES, _PAGE_ENTRIES, I), {0: "pages", 1: "page_entries"}
        elif kind in ("ring_k", "ring_v"):
            t, d = rand(_ROWS, H, W, D), {0: "rows"}
        elif kind == "pending":
            t, d = rand(_ROWS, m, C), {0: "rows"}
        elif name == "stream":
            t, d = rand(_ROWS, T, C), rows_t
        elif name == "selection_idx":
            t, d = torch.randint(0, 8, (_ROWS, T, K), generator=g), rows_t
        elif name == "selection_valid":
            t, d = torch.rand(_ROWS, T, K, generator=g) > 0.5, rows_t
        elif name == "done":
            t, d = torch.tensor([0, 1]), {0: "done"}
        elif name == "row_slots":
            t, d = torch.tensor([1, -1]), {0: "rows"}
        elif kind in ("lora_a", "lora_b"):
            t, d = lora_sample(model, kind, suffix, rand, side_by_side=True)
        else:
            raise AssertionError(f"no sample for input {name!r}")
        tensors.append(t)
        dims.append(d)
    return tensors, dims


def export_pool_graphs(model: CEDForCausalLM, out_dir: Path, opset: int, progress: bool = True) -> dict:
    """The three pool graphs of `model` (float32) into `out_dir`: their manifest entries by stage."""
    import onnx

    graphs = {}
    for stage in POOL_STAGES:
        began = time.perf_counter()
        path = out_dir / f"{stage}.onnx"
        inputs, outputs = pool_io_names(model, stage)
        tensors, dims = _samples(model, stage)
        with warnings.catch_warnings(), torch.no_grad(), kernels.turned_off():  # the model's graph arithmetic
            warnings.simplefilter("ignore")  # the exporter's deprecation and tracer warnings
            torch.onnx.export(PoolStage(model, stage).eval(), tuple(tensors), str(path), input_names=inputs,
                              output_names=outputs, dynamic_axes={n: d for n, d in zip(inputs, dims) if d},
                              opset_version=opset, dynamo=False)
        onnx.checker.check_model(str(path))
        graphs[stage] = {"file": path.name, "inputs": inputs, "outputs": outputs}
        if progress:
            print(f"  {stage:<12} {path.stat().st_size / 2**20:7.1f} MiB  {time.perf_counter() - began:5.1f} s")
    return graphs
