"""Multi-LoRA as fixed slots (as in Punica / S-LoRA / vLLM): stacked A/B buffers per wrapped Linear, a slot
per loaded adapter, and one mapping that says which slot each batch row uses. Scaling is folded into B at load.

Wrapping happens from outside the model (`wrap_linears`), so the model file knows nothing about adapters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernels


@dataclass
class LoRAMapping:
    """Which slot each row of the current batch uses; -1 (or None for the whole batch) means no adapter."""

    row_slots: Tensor | None = None  # (B,) long
    host_slots: list[int] | None = None  # the same on the host: lets a module skip its LoRA without a sync
    active: tuple[int, ...] = ()  # the slots some row uses, ascending: the only ones a step computes
    uniform: bool = False  # every row uses the one active slot: the mask is all ones and is skipped
    _mask: tuple | Tensor | None = None  # row_mask, or what builds it (a native decode step never reads it)

    def set_rows(self, slots: list[int], n_slots: int, max_rank: int, dtype: torch.dtype) -> None:
        self.active = tuple(sorted({slot for slot in slots if slot >= 0}))
        self.row_slots, self.host_slots = torch.tensor(slots, dtype=torch.long), slots
        self._mask = (max_rank, dtype)
        self.uniform = len(self.active) == 1 and all(slot >= 0 for slot in slots)

    @property
    def row_mask(self) -> Tensor | None:
        """(B, 1, len(active) * max_rank): 1 over the rank block of each row's slot."""
        if isinstance(self._mask, tuple):
            (max_rank, dtype), slots = self._mask, self.host_slots
            mask = torch.zeros(len(slots), len(self.active), max_rank, dtype=dtype)
            for row, slot in enumerate(slots):
                if slot >= 0:
                    mask[row, self.active.index(slot)] = 1
            self._mask = mask.view(len(slots), 1, len(self.active) * max_rank)
        return self._mask

    def clear(self) -> None:
        self.row_slots = self.host_slots = self._mask = None
        self.active, self.uniform = (), False


def transposed(weight: Tensor) -> Tensor:
    """A Linear's weight (out, in) as (in, out), contiguous: what `x @ weight_t` reads fastest. MKL runs that 1.6x
    faster than F.linear's read of the (out, in) weight at the shapes the engine decodes with (measured: (16, 256) x
    (256, 768) 60 -> 38 us, (1, 256) x (256, 768) 13 -> 8 us). The engine's weights are frozen: the copy is taken
    once, when the engine is built."""
    return weight.detach().t().contiguous()


def panels_of(weight_t: Tensor) -> Tensor | None:
    """The weight (in, out) in the native kernel's panels (ced/kernels; bfloat16 where its values are), where the
    kernel takes it: float32 in the CPU's memory (not a model built on the meta device to list its modules)."""
    if weight_t.device.type != "cpu" or not kernels.available(weight_t.dtype):
        return None
    return kernels.pack_weight(weight_t)


class PackedLinear(nn.Module):
    """An inference nn.Linear that multiplies by its transposed copy (`transposed`), and a few rows at a time by
    the native kernel's panels of it. Its parameters keep a plain Linear's names (and tensors, so tied weights stay
    tied): the model's state dict does not change."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.register_buffer("weight_t", transposed(base.weight), persistent=False)
        self.panels = panels_of(self.weight_t)
        self.spec = None if self.panels is None else kernels.LinearSpec.of(self.panels, *self.weight_t.shape)

    def native_spec(self) -> kernels.LinearSpec | None:
        """The weight as the native kernels read it (None where they cannot)."""
        return self.spec

    def native_args(self, rows: int) -> tuple[kernels.LinearSpec, None] | None:
        """What the native kernels need to run this linear on `rows` rows: (spec, no slots)."""
        return None if self.spec is None else (self.spec, None)

    def forward(self, x: Tensor) -> Tensor:
        if self.spec is not None and kernels.takes(x):
            y = kernels.matmul(x, self.spec)
            return y if self.bias is None else y + self.bias
        return packed_linear(x, self.weight_t, self.bias)


def packed_linear(x: Tensor, weight_t: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear(x, weight, bias) from the weight's transposed copy."""
    y = torch.matmul(x, weight_t)
    return y if bias is None else y + bias


class MultiLoRALinear(nn.Module):
    changes = 0  # adapters loaded or unloaded in any instance: what the native plans of a decode step depend on

    def __init__(self, base: nn.Linear, n_slots: int, max_rank: int, mapping: LoRAMapping):
        super().__init__()
        self.base, self.mapping = base, mapping
        dtype = base.weight.dtype
        self.register_buffer("weight_t", transposed(base.weight), persistent=False)  # base(x) as x @ weight_t
        self.register_buffer("lora_a", torch.zeros(n_slots, max_rank, base.in_features, dtype=dtype), persistent=False)
        self.register_buffer("lora_b", torch.zeros(n_slots, base.out_features, max_rank, dtype=dtype),
                             persistent=False)
        self.register_buffer("in_use", torch.zeros(n_slots, dtype=torch.bool), persistent=False)
        self.used = [False] * n_slots  # in_use on the host
        # the native kernel's copies (ced/kernels): the base's panels, each slot's A^T and B^T packed
        self.panels = panels_of(self.weight_t)
        if self.panels is not None:
            self.a_panels = torch.zeros(n_slots, base.in_features * max_rank, dtype=torch.float32)
            self.b_panels = torch.zeros(n_slots, max_rank * base.out_features, dtype=torch.float32)
            shape = (base.in_features, base.out_features)
            self.base_spec = kernels.LinearSpec.of(self.panels, *shape)
            self.lora_spec = kernels.LinearSpec.of(self.panels, *shape, (self.a_panels, self.b_panels, max_rank))
        self._packed: dict[tuple[int, ...], tuple[Tensor, Tensor]] = {}  # active slots -> their A and B, stacked

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def set_lora(self, slot: int, a: Tensor, b_scaled: Tensor) -> None:
        rank = a.shape[0]
        self.reset_lora(slot)
        self.lora_a[slot, :rank] = a.to(self.lora_a.dtype)
        self.lora_b[slot, :, :rank] = b_scaled.to(self.lora_b.dtype)
        self.in_use[slot] = True
        self.used[slot] = True
        self._slot_changed(slot)

    def reset_lora(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.in_use[slot] = False
        self.used[slot] = False
        self._slot_changed(slot)

    def _slot_changed(self, slot: int) -> None:
        self._packed.clear()
        MultiLoRALinear.changes += 1
        if self.panels is not None:
            self.a_panels[slot] = kernels.pack(self.lora_a[slot].t())
            self.b_panels[slot] = kernels.pack(self.lora_b[slot].t())

    def native_spec(self) -> kernels.LinearSpec | None:
        """The weight (and the slots' LoRA, where a row of the mapping uses one this linear has) as the native
        kernels read it, or None where they cannot (no panels; a mapping of slots only, as the baseline engine
        sets)."""
        slots, host = self.mapping.row_slots, self.mapping.host_slots
        if self.panels is None or (slots is not None and host is None):
            return None
        if slots is None or not any(self.used[slot] for slot in self.mapping.active):
            return self.base_spec
        return self.lora_spec

    def native_args(self, rows: int) -> tuple[kernels.LinearSpec, Tensor | None] | None:
        """What the native kernels need to run this linear on `rows` rows (batch rows x positions) under the
        mapping: (spec, each row's slot or None), or None where they cannot."""
        spec, slots, host = self.native_spec(), self.mapping.row_slots, self.mapping.host_slots
        if spec is None or spec is self.base_spec:
            return None if spec is None else (spec, None)
        if rows != len(host):  # (B, T, in): the row's slot for each of its positions
            slots = slots.repeat_interleave(rows // len(host))
        return self.lora_spec, slots

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, in)
        native = self.native_args(x.numel() // x.shape[-1]) if kernels.takes(x) else None
        if native is not None:
            y = kernels.matmul(x, *native)
            return y if self.base.bias is None else y + self.base.bias
        slots, host = self.mapping.row_slots, self.mapping.host_slots
        y = packed_linear(x, self.weight_t, self.base.bias)
        if slots is None:
            return y
        if host is not None:  # mixed batches: the A of every slot in use at once, each row masked to its own block
            active = self.mapping.active
            if not any(self.used[slot] for slot in active):
                return y
            a, b = self._stacked(active)
            down = F.linear(x, a)  # (B, T, U*r)
            if not self.mapping.uniform:  # each row keeps its own slot's block (x 1.0 elsewhere changes no bit)
                down = down * self.mapping.row_mask
            return y + F.linear(down, b)  # a row without an adapter adds exact zeros
        active = (slots >= 0) & self.in_use[slots.clamp(min=0)]
        if not bool(active.any()):
            return y
        rows = active.nonzero().squeeze(1)  # rows without an adapter are left untouched, bit for bit
        a, b = self.lora_a[slots[rows]], self.lora_b[slots[rows]]  # (R, r, in), (R, out, r)
        delta = torch.matmul(torch.matmul(x[rows], a.transpose(1, 2)), b.transpose(1, 2))  # (R, T, out)
        return y.index_add(0, rows, delta)

    def _stacked(self, active: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """A (U*r, in) and B (out, U*r) of the active slots, in their order; kept until a slot changes. Only the
        slots some row uses are computed: one adapter's batch costs one adapter's LoRA, not every slot's."""
        if active not in self._packed:
            if len(self._packed) >= 16:  # a few recent sets of slots (mixed batches could make 2**slots of them)
                del self._packed[next(iter(self._packed))]
            index = torch.tensor(active)
            a = self.lora_a[index].reshape(-1, self.in_features)
            b = self.lora_b[index].permute(1, 0, 2).reshape(self.out_features, -1).contiguous()
            self._packed[active] = (a, b)
        return self._packed[active]


def lora_forward_reference(x: Tensor, base: nn.Linear, a: Tensor | None, b_scaled: Tensor | None) -> Tensor:
    """Plain single-adapter LoRA, the reference the slotted path is tested against."""
    y = base(x)
    return y if a is None else y + (x @ a.T) @ b_scaled.T


def slot_mask(slots: Tensor, n_slots: int, rank: int, dtype: torch.dtype) -> Tensor:
    """(B, 1, n_slots * rank): 1 over the rank block of each row's slot (-1: none, all 0)."""
    blocks = torch.arange(n_slots)[:, None].expand(n_slots, rank).reshape(1, 1, n_slots * rank)
    return (blocks == slots[:, None, None]).to(dtype)


def lora_by_row(y: Tensor, x: Tensor, a: Tensor, b_side: Tensor, own: Tensor) -> Tensor:
    """y = base(x) (B, T, out) plus each row's own slot of stacked A (S, r, in) and B (`side_by_side`: (out, S * r)),
    `own` the rows' `slot_mask` (a row without an adapter gets exactly 0). Every slot's product is computed for every
    row and masked, which is cheap at these ranks: a gather of each row's A and B copied a megabyte a module in a
    batch of 16 rows. No branch on the data: what the exported graphs compute (ced/onnx_stages.py), with A, B and the
    slots as graph inputs."""
    low = torch.matmul(x, a.reshape(-1, a.shape[-1]).transpose(0, 1)) * own  # (B, T, S * r)
    return y + torch.matmul(low, b_side.transpose(0, 1))


def side_by_side(b_scaled: Tensor) -> Tensor:
    """The slots' B (S, out, r) as one (out, S * r) matrix, in the order of A's rows reshaped (S * r, in)."""
    return b_scaled.permute(1, 0, 2).reshape(b_scaled.shape[1], -1)


def pack_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Every plain nn.Linear left in the model (those no adapter may touch, the head included) as a PackedLinear;
    the ones inside a MultiLoRALinear stay as they are (it packs its own)."""
    inside = {f"{name}.{child}" for name, module in model.named_modules()
              if isinstance(module, MultiLoRALinear) for child, _ in module.named_children()}
    return replace_linears(model, lambda name: name not in inside, lambda name, base: PackedLinear(base))


def replace_linears(model: nn.Module, include: Callable[[str], bool],
                    make: Callable[[str, nn.Linear], nn.Module]) -> dict[str, nn.Module]:
    """Replace every nn.Linear whose qualified name passes `include` by make(name, linear); returns them by name."""
    wrapped = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and include(name):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            wrapped[name] = make(name, module)
            setattr(parent, child, wrapped[name])
    return wrapped


def wrap_linears(model: nn.Module, include: Callable[[str], bool], n_slots: int, max_rank: int,
                 mapping: LoRAMapping) -> dict[str, MultiLoRALinear]:
    """Replace every nn.Linear whose qualified name passes `include` by a MultiLoRALinear; returns them by name."""
    if any(isinstance(module, (MultiLoRALinear, PackedLinear)) for module in model.modules()):
        raise ValueError("this model already has LoRA slots (another engine was built on it): give each engine a "
                         "model of its own, e.g. CEDForCausalLM.from_pretrained(...) again")
    return replace_linears(model, include, lambda name, base: MultiLoRALinear(base, n_slots, max_rank, mapping))
