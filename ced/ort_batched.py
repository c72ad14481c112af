"""The serving engine on ONNX Runtime: `BatchedEngine` (the paged pool, its verbs, state in and out) whose model
calls run the pool graphs of `python -m engine_build onnx` (ced/pool_graphs.py).

A decode step is one graph call for the whole batch, each row under its own adapter; a batch of prefill chunks and
a group of replays one call each, as in the torch engine. A graph reads the pool in place and returns what the call
adds; it is written here, as `PagedCache` writes it for torch, so the pool, the conversation store and the
transfer formats see no difference between the two runtimes.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .batched import BatchedEngine
from .model import SharedOutput
from .ort_engine import OrtCEDEngine, open_session
from .paged import Resident
from .pool_graphs import POOL_STAGES
from .state import Selection


class OrtBatchedEngine(BatchedEngine):
    """Over an `OrtCEDEngine` (its model, adapter registry and built folder); `threads`: ONNX Runtime's per call."""

    def __init__(self, engine: OrtCEDEngine, page_entries: int = 64, capacity_bytes: int = 0,
                 threads: int | None = None):
        super().__init__(engine, page_entries, capacity_bytes=capacity_bytes)
        graphs = engine.manifest["graphs"]  # OrtCEDEngine refused a folder without them
        threads = threads or torch.get_num_threads()
        self.sessions = {stage: open_session(engine.engine_dir, graphs[stage], stage, threads) for stage in POOL_STAGES}
        self.outputs = {stage: graphs[stage]["outputs"] for stage in POOL_STAGES}
        # each stage's inputs read from the pool, (name, kind, layer or source), parsed once (the files' own names)
        self.pool_inputs = {stage: [(name, kind, int(suffix)) for name in graphs[stage]["inputs"]
                                    for kind, _, suffix in [name.partition(".")]
                                    if kind in ("pages_k", "pages_v", "pages_i", "ring_k", "ring_v", "pending")]
                            for stage in POOL_STAGES}

    # -- the model's calls -----------------------------------------------------------------------------------

    def _run_shared(self, rows: list[Resident], starts: list[int], ids: Tensor,
                    lengths: list[int] | None) -> SharedOutput:
        T = ids.shape[1]
        feeds = {"input_ids": ids, **self._pool_feeds("pool_prefill", rows, starts, T)}
        out = self._run("pool_prefill", feeds)
        self._write(rows, starts, lengths or [T] * len(rows), out, feeds["table"])
        return SharedOutput(out["h19"], out["stream"], Selection(out["selection_idx"], out["selection_valid"]))

    def _run_replay(self, rows: list[Resident], starts: list[int], stream: Tensor, selection: Selection,
                    adapters: list[str | None]) -> Tensor:
        n = stream.shape[1]
        feeds = {"stream": stream, "selection_idx": selection.idx, "selection_valid": selection.valid,
                 **self._pool_feeds("pool_replay", rows, starts, n), **self._lora_feeds(adapters)}
        out = self._run("pool_replay", feeds)
        self._write(rows, starts, [n] * len(rows), out, feeds["table"])
        return out["logits"]

    def _run_step(self, rows: list[Resident], starts: list[int], tokens: list[int],
                  adapters: list[str | None]) -> Tensor:
        m = self.config.block_size
        # The rows whose block this token completes pool it; row 0 stands in when none does (an ONNX Reshape cannot
        # infer a dimension of an empty tensor): its entry is masked by its block end, and not written.
        done = [b for b, start in enumerate(starts) if start % m == m - 1] or [0]
        feeds = {"input_ids": torch.tensor(tokens)[:, None], **self._pool_feeds("pool_step", rows, starts, 1),
                 "done": torch.tensor(done), **self._lora_feeds(adapters)}
        out = self._run("pool_step", feeds)
        self._write(rows, starts, [1] * len(rows), out, feeds["table"])
        self._keep_stream(rows, starts, SharedOutput(None, out["stream"],
                                                     Selection(out["selection_idx"], out["selection_valid"])))
        return out["logits"]

    # -- feeds and results ------------------------------------------------------------------------------------

    def _run(self, stage: str, feeds: dict[str, Tensor]) -> dict[str, Tensor]:
        values = self.sessions[stage].run(None, {name: _numpy(value) for name, value in feeds.items()})
        return {name: torch.from_numpy(value) for name, value in zip(self.outputs[stage], values)}

    def _pool_feeds(self, stage: str, rows: list[Resident], starts: list[int], T: int) -> dict[str, Tensor]:
        """The pool as a graph reads it: the rows' rings (a slice in place where the rows are settled in slot order,
        else copied out), the whole page buffers and the rows' page table, each row's open block."""
        pool, slots = self.pool, [row.slot for row in rows]
        span = slice(slots[0], slots[0] + len(rows)) if slots == list(range(slots[0], slots[0] + len(rows))) else None
        index = torch.tensor(slots)
        pick = (lambda buffer: buffer[span]) if span is not None else (lambda buffer: buffer.index_select(0, index))
        feeds = {"positions": torch.tensor(starts)[:, None] + torch.arange(T)[None], "table": pool.page_table(rows)}
        buffers = {"pages_k": pool.gk, "pages_v": pool.gv, "pages_i": pool.gi}
        for name, kind, at in self.pool_inputs[stage]:
            if kind in buffers:
                feeds[name] = buffers[kind][at]
            else:  # a row's ring or open block
                feeds[name] = pick({"ring_k": pool.wk, "ring_v": pool.wv, "pending": pool.pending}[kind][at])
        return feeds

    def _lora_feeds(self, adapters: list[str | None]) -> dict[str, Tensor]:
        """Each row's adapter slot and the registry's slot buffers as they are now (a swap needs no re-export)."""
        return {"row_slots": torch.tensor([self.adapters.slot_of(adapter) for adapter in adapters]),
                **self.engine.lora_inputs()}

    def _write(self, rows: list[Resident], starts: list[int], lengths: list[int], out: dict[str, Tensor],
               table: Tensor) -> None:
        """What a call added, into the pool: each layer's keys and values (the last W of each row's real
        positions), the blocks it completed as global entries, each row's open block. `table`: the rows' pages,
        as the call read them."""
        pool, m = self.pool, self.config.block_size
        slots = torch.tensor([row.slot for row in rows])
        T = out_length(out)
        ragged = None if min(lengths) == max(lengths) == T else lengths
        places = torch.tensor(starts) % pool.W if T == 1 else None  # a step: one place a row
        for name, values in out.items():
            kind, _, layer = name.partition(".")
            if kind in ("new_k", "new_v"):
                ring = (pool.wk if kind == "new_k" else pool.wv)[int(layer)]
                if places is not None:
                    ring[slots, :, places] = values[:, :, 0]
                else:
                    pool.write_window(ring, slots, starts, values, ragged)
        first_source = self.config.source_layers[0]
        if f"entry_k.{first_source}" not in out:
            return  # a replay: the decoder pools nothing
        ends = [start + n for start, n in zip(starts, lengths)]
        complete = [end // m - start // m for start, end in zip(starts, ends)]  # blocks each row completed
        step = f"inputs.{first_source}" in out  # a step's entries are of its completed rows only, in order
        completed = [b for b, count in enumerate(complete) if count]
        out_rows = {b: j if step else b for j, b in enumerate(completed)}
        done = [(b, i, out_rows[b]) for b in completed for i in range(complete[b])]  # (row, entry, its output row)
        if done:  # where each completed block's entry goes: the same for every source
            b, i, place = (torch.tensor(column) for column in zip(*done))
            numbers = torch.tensor([starts[row] // m for row, _, _ in done]) + i
            pages, offsets = (t[:, 0] for t in pool.entry_places(table[b], numbers[:, None]))
        held = torch.tensor(starts) % m
        for source in self.config.source_layers:
            if done:
                for buffer, part in ((pool.gk, "entry_k"), (pool.gv, "entry_v"), (pool.gi, "entry_i")):
                    buffer[source][pages, offsets] = out[f"{part}.{source}"][place, i]
            if step:  # each row's input goes to its open block (a completed one's is not read again)
                pool.pending[source][slots, held] = out[f"inputs.{source}"][:, 0]
                continue
            open_rows = [b for b, end in enumerate(ends) if end % m]
            if open_rows:
                b = torch.tensor(open_rows)
                pool.pending[source][slots[b]] = out[f"blocks.{source}"][b, torch.tensor(complete)[b]]


def out_length(out: dict[str, Tensor]) -> int:
    """The positions per row of a call's window outputs (B, H, T, D)."""
    return next(values.shape[2] for name, values in out.items() if name.startswith("new_k."))


def _numpy(value: Tensor) -> np.ndarray:
    return value.detach().numpy() if value.is_contiguous() else value.detach().contiguous().numpy()
