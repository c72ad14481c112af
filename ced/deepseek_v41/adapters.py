"""LoRA adapters for the `deepseek_v41` family on the release's native module names, and their placement rule.

Adapters are read in PEFT's on-disk format by `ced.adapters.read_peft_adapter` (keys
`base_model.model.<module>.lora_A.weight` ...), with `<module>` a native name such as `layers.21.attn.wq_a`,
`layers.20.ffn.shared_experts.w1` or `layers.30.ffn.experts.7.w2` (a leading `model.` is accepted and dropped).

The rule (docs/architecture.md §1, the paper's placement): nothing in layers 0..E-1; nothing in layer E's
attention (its compressor, indexer and `wq_a`, which feeds the candidate queries, all write adapter-free state);
layer E's `ffn` allowed; any adaptable module of layers E+1..L-1; `mtp.*` (DSpark) refused. Adaptable modules are
`attn.{wq_a,wq_b,wkv,wo_a,wo_b}`, `ffn.shared_experts.{w1,w2,w3}` and `ffn.experts.N.{w1,w2,w3}`.

LoRA is applied from outside the model (`attach_lora` wraps those Linears, keeping their parameter names, so the
model's `state_dict()` does not change); `V41AdapterSet.use(name)` picks the adapter every wrapped module adds
for the next calls (one adapter per call), `V41AdapterSet.use_rows(names)` one adapter per batch row for a
decode step (`RowAdapters`: ced.lora's `LoRAMapping` of active slots and a row mask, over this set's adapters).
`V41AdapterRegistry` gives the set the registry API the server drives (`ced.adapters.AdapterRegistry`'s).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..adapters import (AdapterError, AdapterRecord, AdapterRegistry, PeftAdapter, PlacementError,
                        UnknownAdapterError, read_peft_adapter)
from ..lora import LoRAMapping
from .config import V41Config
from .model import DeepseekV41ForCausalLM, GroupedLinear, MoE

_LAYER = re.compile(r"^layers\.(?P<layer>\d+)\.(?P<rest>.+)$")
_ADAPTABLE = re.compile(r"^(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)"
                        r"|ffn\.shared_experts\.(w1|w2|w3)|ffn\.experts\.\d+\.(w1|w2|w3))$")


def native_name(module: str) -> str:
    """The native name of a PEFT module path (`model.layers.3...` -> `layers.3...`)."""
    return module.removeprefix("model.")


def placement_violation(module: str, config: V41Config) -> str | None:
    """Why `module` (a native name) may not carry an adapter, or None if it may."""
    module = native_name(module)
    E = config.decoder_start
    if module.startswith("mtp."):
        return (f"module {module!r} is a DSpark draft layer: rule 'mtp.* is never adapted' (the drafter proposes "
                "for every adapter; vLLM skips 'mtp.' likewise)")
    match = _LAYER.match(module)
    if match is None:
        return (f"module {module!r} is not inside a backbone layer: rule 'embed, head, norm and vision are shared "
                "by every adapter'")
    layer, rest = int(match["layer"]), match["rest"]
    if layer >= config.num_hidden_layers:
        return f"module {module!r}: layer {layer} does not exist (num_hidden_layers={config.num_hidden_layers})"
    if layer < E:
        return (f"module {module!r} is in encoder layer {layer}: rule 'nothing in layers 0..{E - 1}' (the encoder "
                "writes the history every adapter shares)")
    if layer == E and rest.startswith("attn."):
        return (f"module {module!r} is in the first decoder layer's attention (layer {E}): rule 'nothing in layer "
                f"{E}'s attention' (its compressor, indexer and wq_a write the global KV, indexer keys and candidate "
                "pool the decoder shares); only that layer's ffn may carry an adapter")
    if not _ADAPTABLE.match(rest):
        return (f"module {module!r} is not adaptable: rule 'LoRA applies to attn.{{wq_a,wq_b,wkv,wo_a,wo_b}}, "
                "ffn.shared_experts.{w1,w2,w3} and ffn.experts.N.{w1,w2,w3}'")
    return None


@dataclass
class RowAdapters:
    """One adapter per batch row, for calls of one token per row (a decode step): ced.lora's `LoRAMapping` (the
    active slots, the row mask) over the set's adapters numbered in `names`' order. Every wrapped module of a set
    reads the same object."""

    mapping: LoRAMapping = field(default_factory=LoRAMapping)
    names: tuple[str, ...] = ()  # mapping slot -> adapter name
    rank: int = 0  # each slot's block in the stacked A and B: the widest rank loaded
    expert_rows: Tensor | None = None  # inside a routed expert's call: the batch row of each token it computes

    @property
    def in_use(self) -> bool:
        return self.mapping.host_slots is not None

    @contextmanager
    def tokens(self, token: Tensor) -> Iterator[None]:
        """MoE.token_scope: a routed expert computes only the tokens routed to it (one token per row: token = row)."""
        self.expert_rows = token
        try:
            yield
        finally:
            self.expert_rows = None


class LoRALinear(nn.Module):
    """A Linear (or GroupedLinear) plus the low-rank delta of the active adapter (`active`), or of each row's own
    (`rows`, when in use). Keeps the base's `weight` under its own name; the adapters live outside the state dict."""

    def __init__(self, base: nn.Linear, rows: RowAdapters | None = None):
        super().__init__()
        self.base = [base]  # in a list: not a submodule, so the parameter names stay `<module>.weight`
        self.weight = base.weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.groups = base.groups if isinstance(base, GroupedLinear) else None
        self.adapters: dict[str, tuple[Tensor, Tensor]] = {}  # name -> A (r, in), B scaled (out, r)
        self.active: str | None = None
        self.rows = RowAdapters() if rows is None else rows
        self._stacked: dict[tuple[str, ...], tuple[Tensor, Tensor]] = {}  # names -> their A and B, stacked

    changes = 0  # adapters installed or removed in any instance: what a native step's packed LoRA depends on

    def changed(self) -> None:
        """An adapter was installed or removed: the stacked copies (and the native step's) are stale."""
        self._stacked.clear()
        LoRALinear.changes += 1

    def forward(self, x: Tensor) -> Tensor:
        y = self.base[0](x)
        if self.rows.in_use:
            return self._by_row(x, y)
        if self.active not in self.adapters:
            return y
        a, b = self.adapters[self.active]
        return y + self._up(F.linear(x, a.to(x.dtype)), b.to(x.dtype))  # down: (..., r), or (..., G, r) grouped

    def _up(self, down: Tensor, b: Tensor) -> Tensor:
        if self.groups is None:
            return F.linear(down, b)
        # block g of the delta B A is B's rows of group g times A: each group meets its own rows of B
        return torch.einsum("...gr,gor->...go", down, b.view(self.groups, -1, b.shape[1]))

    def _by_row(self, x: Tensor, y: Tensor) -> Tensor:
        """Every active adapter's A at once, each row masked to its own block (ced.lora.MultiLoRALinear's way): a
        row without an adapter, or whose adapter leaves this module alone, adds exact zeros."""
        rows = self.rows
        names = tuple(rows.names[slot] for slot in rows.mapping.active)
        if not any(name in self.adapters for name in names):
            return y
        a, b = self._stacked_for(names, rows.rank, x.dtype)  # (U*r, in), (out, U*r)
        down = F.linear(x, a)  # (..., U*r), or (..., G, U*r) grouped
        if not rows.mapping.uniform:
            mask = rows.mapping.row_mask[:, 0]  # (B, U*r)
            if rows.expert_rows is not None:  # x holds only the tokens routed to this expert
                mask = mask[rows.expert_rows]
            down = down * mask.view(mask.shape[0], *[1] * (down.dim() - 2), -1).to(down)
        return y + self._up(down, b)

    def _stacked_for(self, names: tuple[str, ...], rank: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """A (U*rank, in) and B (out, U*rank) of `names` in order, each padded with zeros to `rank` (zeros too for
        an adapter that leaves this module alone); kept until an adapter changes."""
        if names not in self._stacked:
            if len(self._stacked) >= 16:  # a few recent sets (mixed batches could make 2**adapters of them)
                del self._stacked[next(iter(self._stacked))]
            a = self.weight.new_zeros(len(names), rank, self.in_features, dtype=dtype)
            b = self.weight.new_zeros(self.out_features, len(names), rank, dtype=dtype)
            for i, name in enumerate(names):
                if name in self.adapters:
                    a_i, b_i = self.adapters[name]
                    a[i, : a_i.shape[0]], b[:, i, : a_i.shape[0]] = a_i, b_i
            self._stacked[names] = (a.flatten(0, 1), b.flatten(1))
        return self._stacked[names]


def attach_lora(model: DeepseekV41ForCausalLM, rows: RowAdapters | None = None) -> dict[str, LoRALinear]:
    """Wrap every module the placement rule allows; returns them by native name. With `rows`, every wrapped
    module reads it, and each MoE with wrapped routed experts tells it which tokens an expert computes."""
    wrapped = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and placement_violation(name, model.config) is None:
            parent_name, _, child = name.rpartition(".")
            wrapped[name] = LoRALinear(module, rows)
            setattr(model.get_submodule(parent_name), child, wrapped[name])
    if rows is not None:
        for name, module in model.named_modules():
            if isinstance(module, MoE) and any(key.startswith(f"{name}.experts.") for key in wrapped):
                module.token_scope = rows.tokens
    return wrapped


class V41AdapterSet:
    """name -> adapter, installed into every wrapped module; `use(name)` selects the adapter of the next calls."""

    def __init__(self, model: DeepseekV41ForCausalLM):
        self.model, self.config = model, model.config
        self.rows = RowAdapters()
        self.modules = attach_lora(model, self.rows)
        self.names: dict[str, PeftAdapter] = {}

    def check(self, path: str | Path) -> PeftAdapter:
        """Read and validate an adapter (format, placement, shapes) without installing it."""
        adapter = read_peft_adapter(path)
        for module, (a, b) in adapter.weights.items():
            reason = placement_violation(module, self.config)
            if reason is not None:
                raise PlacementError(f"{adapter.path}: refused: {reason}")
            target = self.modules.get(native_name(module))
            if target is None:
                raise AdapterError(f"{adapter.path}: module {module!r} does not exist in this model")
            out = target.out_features // (target.groups or 1)
            if a.shape[1] != target.in_features or b.shape[0] != target.out_features:
                raise AdapterError(f"{adapter.path}: module {module!r} expects A (r, {target.in_features}) and "
                                   f"B ({target.out_features}, r), got {tuple(a.shape)} and {tuple(b.shape)}"
                                   + (f" (a grouped projection: {target.groups} groups of {out} rows)"
                                      if target.groups else ""))
        return adapter

    def load(self, name: str, path: str | Path) -> PeftAdapter:
        if name in self.names:
            raise AdapterError(f"adapter {name!r} is already loaded (from {self.names[name].path})")
        adapter = self.check(path)
        self.install(name, adapter)
        return adapter

    def install(self, name: str, adapter: PeftAdapter) -> None:
        """Put a checked adapter under `name`, in place of whatever `name` held (a replace)."""
        for module in self.modules.values():
            module.adapters.pop(name, None)
            module.changed()
        for module, (a, b) in adapter.weights.items():
            self.modules[native_name(module)].adapters[name] = (a, b)
        self.names[name] = adapter

    def unload(self, name: str) -> None:
        if name not in self.names:
            raise UnknownAdapterError(f"unknown adapter {name!r} (loaded: {', '.join(sorted(self.names)) or 'none'})")
        for module in self.modules.values():
            module.adapters.pop(name, None)
            module.changed()
            if module.active == name:  # no name left dangling: the base model until the next use()
                module.active = None
        del self.names[name]

    def use(self, name: str | None) -> None:
        """Every wrapped module adds `name`'s delta from now on (None: the base model)."""
        if name is not None and name not in self.names:
            raise UnknownAdapterError(f"unknown adapter {name!r} (loaded: {', '.join(sorted(self.names)) or 'none'})")
        for module in self.modules.values():
            # a plain attribute, set past nn.Module.__setattr__'s checks: every prefill and replay sets it in each
            # of the wrapped modules (123 on the V4.1 demo), twice
            module.__dict__["active"] = name

    @contextmanager
    def use_rows(self, names: list[str | None]) -> Iterator[None]:
        """Row b of the next calls (one token per row) adds adapter names[b]'s delta (None: the base model), for
        the duration of the block; an unknown name fails before any work."""
        for name in names:
            if name is not None and name not in self.names:
                raise UnknownAdapterError(f"unknown adapter {name!r} (loaded: "
                                          f"{', '.join(sorted(self.names)) or 'none'})")
        order = tuple(self.names)
        self.rows.names = order
        self.rows.rank = max((adapter.rank for adapter in self.names.values()), default=1)
        self.rows.mapping.set_rows([-1 if name is None else order.index(name) for name in names], len(order),
                                   self.rows.rank, self.model.embed.weight.dtype)
        try:
            yield
        finally:
            self.rows.mapping.clear()


class V41AdapterRegistry(AdapterRegistry):
    """`ced.adapters.AdapterRegistry`'s API (what the server drives: load, replace, unload, check, records, digest,
    slot_of) over a V41AdapterSet. Each wrapped module holds its adapters by name, so a slot here is a number only:
    `n_slots` bounds how many are loaded at once and `max_rank` their rank, as the ced engine's buffers do; the
    messages are AdapterRegistry's own."""

    def __init__(self, adapter_set: V41AdapterSet, n_slots: int, max_rank: int):
        super().__init__(adapter_set.modules, adapter_set.config, n_slots, max_rank, placement="decoder")
        self.adapter_set = adapter_set

    def unload(self, name: str) -> None:
        self.get(name)
        self.adapter_set.unload(name)
        del self._records[name]

    def _validated(self, path: str | Path) -> PeftAdapter:
        adapter = self.adapter_set.check(path)  # format, placement on the native names, module shapes
        if adapter.rank > self.max_rank:
            raise AdapterError(f"{adapter.path}: rank {adapter.rank} exceeds the engine's max_rank {self.max_rank}")
        return adapter

    def _install(self, name: str, adapter: PeftAdapter, slot: int, version: int) -> AdapterRecord:
        self.adapter_set.install(name, adapter)
        record = AdapterRecord(name, str(adapter.path), version, slot, adapter.rank,
                               tuple(sorted(native_name(m) for m in adapter.weights)), adapter.digest)
        self._records[name] = record
        return record
