"""A decode step's stages in native calls (ced/kernels), over the paged pool in place.

A layer for one token per row is ~80 small torch operations (norm, projections, RoPE, the ring write and read, the
indexer's scores and top-k, the gather of the selected entries, the softmax, the FFN); on the demo each costs more
in dispatch than in arithmetic, and even one Python call per layer costs as much as its arithmetic. Here a stage
(the encoder and the first decoder layer's attention; the rest of the decoder) is one call of `run_blocks` over an
array of StepBlocks: per layer its attention (norm, q/k/v with the rows' LoRA, RoPE, the ring write; on source
layers the compressor, whose completed block is pooled into a global entry; on index layers the indexer's top-k;
the window and the selected entries, o, the residual) and its FFN. The arithmetic is the model's (ced/model.py) in
another summation order: a row's logits agree with the torch step's to float tolerance and are the same bits alone
or in any batch.

The array (pointers to the modules' packed weights and the pool's buffers) is built once per stage and kept on the
pool (`StepPlan`): rebuilt when the pool grows (its buffers move) and for each set of adapters the rows use.
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor

from . import kernels
from .lora import MultiLoRALinear
from .model import rope_tables
from .state import Selection

ATTENTION, FFN = "attention", "ffn"
MAX_VARIANTS = 64  # adapter sets whose arrays a plan keeps (a new set past it starts the cache over)


def layer_blocks(layers: range) -> tuple[tuple[int, str], ...]:
    """Both blocks of each layer, in order: ((index, "attention"), (index, "ffn"), ...)."""
    return tuple((index, part) for index in layers for part in (ATTENTION, FFN))


class NativeDecode:
    """One decode step over `cache` (a PagedCache of one position per row): what every stage shares, built once."""

    def __init__(self, cache, positions: Tensor):
        pool, B = cache.pool, len(cache.rows)
        config = pool.config
        self.cache, self.lib, self.B, self.top_k = cache, kernels.library(), B, config.index_top_k
        cos, sin = rope_tables(positions.reshape(B, 1), config.rope_theta, config.head_dim, torch.float32)
        self._keep = [cache.slots.contiguous(), positions.reshape(B).contiguous(), cache.ring_key_positions(),
                      cache.table.contiguous(), cos.reshape(B, -1).contiguous(), sin.reshape(B, -1).contiguous()]
        slots, flat_positions, key_pos, table, cos, sin = self._keep
        self.rows = kernels.DecodeRows(
            B, slots.data_ptr(), flat_positions.data_ptr(), key_pos.data_ptr(), key_pos.shape[1], pool.W,
            table.data_ptr(), table.shape[1], pool.page_entries, max(cache.ends) // cache.m, cache.m,
            cos.data_ptr(), sin.data_ptr(), None)

    def shared_stage(self, layers, E: int, x: Tensor) -> tuple[Tensor, Tensor, Selection | None] | None:
        """CEDForCausalLM.shared_stage on the embedded tokens x (B, 1, C): (H19, the stream after layer E's
        attention, its selection), or None (no native form)."""
        ran = self._run(layers, (*layer_blocks(range(E)), (E, ATTENTION)), x, None,
                        snapshot_after=2 * E - 1 if E else None)
        return None if ran is None else (ran[2], ran[0], ran[1])

    def decoder_stage(self, layers, E: int, stream: Tensor, selection: Selection | None) -> Tensor | None:
        """CEDForCausalLM.decoder_stage's hidden state before the final norm, or None (no native form)."""
        ran = self._run(layers, ((E, FFN), *layer_blocks(range(E + 1, len(layers)))), stream, selection)
        return None if ran is None else ran[0]

    def _run(self, layers, blocks: tuple[tuple[int, str], ...], x: Tensor, selection: Selection | None,
             snapshot_after: int | None = None) -> tuple[Tensor, Selection | None, Tensor | None] | None:
        """`blocks` of `layers` (the model's CEDLayers) on x (B, 1, C) in one call: x after them, the selection
        the next layers read, and x after block `snapshot_after` (or None); None where a linear is not the
        engine's (no native form), so the caller runs the torch path."""
        pool = self.cache.pool
        key = (id(layers), blocks, pool.n_slots, pool.n_pages)  # growth moves the pool's buffers
        plan = pool.native_plans.get(key)
        if plan is None:
            plan = pool.native_plans[key] = StepPlan(layers, blocks, pool)
        array = plan.array()
        if array is None:
            return None
        B, C, top_k = self.B, x.shape[-1], self.top_k
        slots = plan.mapping.row_slots if plan.mapping is not None else None
        self.rows.lora_slots = None if slots is None else slots.data_ptr()
        out = x.reshape(B, C).clone()
        if selection is not None:
            idx, valid = selection.idx.reshape(B, top_k).clone(), selection.valid.reshape(B, top_k).clone()
        else:
            idx, valid = torch.zeros(B, top_k, dtype=torch.long), torch.zeros(B, top_k, dtype=torch.bool)
        selected = ctypes.c_int(selection is not None)
        snapshot = x.new_empty(B, 1, C) if snapshot_after is not None else None
        kernels.check(self.lib.run_blocks(
            ctypes.byref(self.rows), array, len(array), out.data_ptr(), C, idx.data_ptr(), valid.data_ptr(),
            ctypes.byref(selected), None if snapshot is None else snapshot.data_ptr(),
            -1 if snapshot_after is None else snapshot_after))
        chosen = Selection(idx.view(B, 1, top_k), valid.view(B, 1, top_k)) if selected.value else None
        return out.view(B, 1, C), chosen, snapshot


class StepPlan:
    """The StepBlock array of `blocks` over the pool's buffers, one per set of adapters in use (a linear runs its
    LoRA only where a row's adapter has one for it); None where a linear has no native form."""

    def __init__(self, layers, blocks: tuple[tuple[int, str], ...], pool):
        self.layers, self.blocks, self.pool = layers, blocks, pool
        linears = [linear for index, part in blocks for linear in _linears(layers[index], part)]
        self.native = all(hasattr(linear, "native_spec") for linear in linears) and all(
            kernels.available(norm.weight.dtype) for index, part in blocks for norm in [_norm(layers[index], part)])
        self.mapping = next((linear.mapping for linear in linears if isinstance(linear, MultiLoRALinear)), None)
        self._arrays: dict[tuple, ctypes.Array | None] = {}

    def array(self) -> ctypes.Array | None:
        if not self.native:
            return None
        mapping = self.mapping
        if mapping is not None and mapping.row_slots is not None and mapping.host_slots is None:
            return None  # a mapping of slots only (the baseline engine's): no native form
        key = (mapping.active if mapping is not None else (), MultiLoRALinear.changes)
        if key not in self._arrays:
            if len(self._arrays) >= MAX_VARIANTS:
                self._arrays.clear()
            self._arrays[key] = self._build()
        return self._arrays[key]

    def _build(self) -> ctypes.Array | None:
        blocks = [self._block(self.layers[index], part) for index, part in self.blocks]
        return None if None in blocks else (kernels.StepBlock * len(blocks))(*blocks)

    def _block(self, layer, part: str) -> kernels.StepBlock | None:
        specs = [linear.native_spec() for linear in _linears(layer, part)]
        if None in specs:
            return None
        pointers = [ctypes.pointer(spec) for spec in specs]
        norm = _norm(layer, part)
        if part == FFN:
            return kernels.StepBlock(norm=norm.weight.data_ptr(), eps=norm.eps, ffn_gate=pointers[0],
                                     ffn_up=pointers[1], ffn_down=pointers[2])
        pool, attn = self.pool, layer.attn
        config, index, source = attn.config, attn.role.index, attn.role.global_source
        block = kernels.StepBlock(
            norm=norm.weight.data_ptr(), eps=norm.eps, q=pointers[0], k=pointers[1], v=pointers[2], o=pointers[3],
            heads=config.n_heads, head_dim=config.head_dim, scale=1.0 / math.sqrt(config.head_dim),
            ring_k=pool.wk[index].data_ptr(), ring_v=pool.wv[index].data_ptr(), top_k=config.index_top_k)
        pointers = pointers[4:]
        if attn.compressor is not None:
            block.gate, block.index_key = pointers[:2]
            block.pending, block.own_gk = pool.pending[index].data_ptr(), pool.gk[index].data_ptr()
            block.own_gv, block.own_gi = pool.gv[index].data_ptr(), pool.gi[index].data_ptr()
            pointers = pointers[2:]
        if attn.indexer is not None:
            block.index_query, block.index_weight = pointers[:2]
            block.index_heads, block.index_dim = attn.indexer.heads, attn.indexer.dim
        if source is not None:
            block.src_gk, block.src_gv = pool.gk[source].data_ptr(), pool.gv[source].data_ptr()
            block.src_gi = pool.gi[source].data_ptr()
        return block


def _linears(layer, part: str) -> list:
    """The linears of a layer's block, in the order StepPlan._block reads them."""
    if part == FFN:
        return [layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
    attn = layer.attn
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
    if attn.compressor is not None:
        linears += [attn.compressor.gate, attn.compressor.index_key]
    if attn.indexer is not None:
        linears += [attn.indexer.query, attn.indexer.weight]
    return linears


def _norm(layer, part: str):
    return layer.mlp_norm if part == FFN else layer.attn_norm
