"""A decode step in one native call (ced/kernels), over the paged pool in place.

A layer for one token per row is ~80 small torch operations (norm, projections, RoPE, the ring write and read, the
indexer's scores and top-k, the gather of the selected entries, the softmax, the FFN); on the demo each costs more
in dispatch than in arithmetic, and even one Python call per layer costs as much as its arithmetic. Here the whole
step of BatchedEngine.step (embedding, both stages, the replay rings, the final norm and the head) is one call of
`decode_step` over a StepModel: per layer its attention (norm, q/k/v with the rows' LoRA, RoPE, the ring write; on
source layers the compressor, whose completed block is pooled into a global entry; on index layers the indexer's
top-k; the window and the selected entries, o, the residual) and its FFN. The arithmetic is the model's
(ced/model.py) in another summation order: a row's logits agree with the torch step's to float tolerance and are
the same bits alone or in any batch.

The StepModel (pointers to the modules' packed weights and the pool's buffers) is built once and kept on the pool
(`StepPlan`): rebuilt when the pool grows (its buffers move) and for each set of adapters the rows use.
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor

from . import kernels
from .lora import MultiLoRALinear
from .model import rope_tables

ATTENTION, FFN = "attention", "ffn"
MAX_VARIANTS = 64  # adapter sets whose StepModels a plan keeps (a new set past it starts the cache over)


def layer_blocks(layers: range) -> tuple[tuple[int, str], ...]:
    """Both blocks of each layer, in order: ((index, "attention"), (index, "ffn"), ...)."""
    return tuple((index, part) for index in layers for part in (ATTENTION, FFN))


class NativeDecode:
    """One decode step over `cache` (a PagedCache of one position per row)."""

    def __init__(self, cache, positions: Tensor):
        pool, B = cache.pool, len(cache.rows)
        config = pool.config
        self.cache, self.lib, self.B, self.top_k = cache, kernels.library(), B, config.index_top_k
        cos, sin = rope_tables(positions.reshape(B, 1), config.rope_theta, config.head_dim, torch.float32)
        self._keep = [cache.slots.contiguous(), positions.reshape(B).contiguous(), cache.table.contiguous(),
                      cos.reshape(B, -1).contiguous(), sin.reshape(B, -1).contiguous()]
        slots, flat_positions, table, cos, sin = self._keep
        self.rows = kernels.DecodeRows(
            B, slots.data_ptr(), flat_positions.data_ptr(), min(pool.W, max(cache.ends)), pool.W, table.data_ptr(),
            table.shape[1], pool.page_entries, max(cache.ends) // cache.m, cache.m, cos.data_ptr(), sin.data_ptr(),
            None)

    def step(self, model, tokens: list[int]) -> Tensor | None:
        """Next-token logits (B, V) of BatchedEngine.step for `tokens` (one per row) through `model` (a
        CEDForCausalLM, its linears the engine's), the replay rings written as `_keep_stream` writes them; None
        where a linear has no native form (the caller runs the torch path)."""
        pool = self.cache.pool
        key = (id(model), pool.n_slots, pool.n_pages)  # growth moves the pool's buffers
        plan = pool.native_plans.get(key)
        if plan is None:
            plan = pool.native_plans[key] = StepPlan(model, pool)
        step_model = plan.step_model()
        if step_model is None:
            return None
        slots = plan.mapping.row_slots if plan.mapping is not None else None
        self.rows.lora_slots = None if slots is None else slots.data_ptr()
        ids = torch.tensor(tokens, dtype=torch.long)
        logits = torch.empty(self.B, model.ced.vocab_size)
        kernels.check(self.lib.decode_step(ctypes.byref(self.rows), ctypes.byref(step_model), ids.data_ptr(),
                                           logits.data_ptr()))
        return logits


class StepPlan:
    """A model's StepModel over one pool's buffers, one per set of adapters in use (a linear runs its LoRA only
    where a row's adapter has one for it); None where a linear has no native form."""

    def __init__(self, model, pool):
        self.model, self.pool = model, pool
        E, layers = model.ced.decoder_start, model.model.layers
        self.stages = ((*layer_blocks(range(E)), (E, ATTENTION)), ((E, FFN), *layer_blocks(range(E + 1, len(layers)))))
        blocks = [block for stage in self.stages for block in stage]
        linears = [linear for index, part in blocks for linear in _linears(layers[index], part)] + [model.lm_head]
        norms = [_norm(layers[index], part) for index, part in blocks] + [model.model.norm]
        self.native = (all(hasattr(linear, "native_spec") and _bias(linear) is None for linear in linears)
                       and all(kernels.available(t.dtype) for t in [model.model.embed_tokens.weight]
                               + [norm.weight for norm in norms]))
        self.mapping = next((linear.mapping for linear in linears if isinstance(linear, MultiLoRALinear)), None)
        self._variants: dict[tuple, tuple | None] = {}

    def step_model(self) -> kernels.StepModel | None:
        if not self.native:
            return None
        mapping = self.mapping
        if mapping is not None and mapping.row_slots is not None and mapping.host_slots is None:
            return None  # a mapping of slots only (the baseline engine's): no native form
        key = (mapping.active if mapping is not None else (), MultiLoRALinear.changes)
        if key not in self._variants:
            if len(self._variants) >= MAX_VARIANTS:
                self._variants.clear()
            self._variants[key] = self._build()
        variant = self._variants[key]
        return None if variant is None else variant[0]

    def _build(self) -> tuple | None:
        layers, pool, model = self.model.model.layers, self.pool, self.model
        stages = [[self._block(layers[index], part) for index, part in stage] for stage in self.stages]
        head = model.lm_head.native_spec()
        if head is None or any(None in stage for stage in stages):
            return None
        shared, decoder = ((kernels.StepBlock * len(stage))(*stage) for stage in stages)
        norm = model.model.norm
        step_model = kernels.StepModel(
            embed=model.model.embed_tokens.weight.data_ptr(), hidden=model.ced.hidden_size, shared=shared,
            n_shared=len(shared), decoder=decoder, n_decoder=len(decoder), top_k=model.ced.index_top_k,
            stream_ring=pool.stream.data_ptr(), sel_idx_ring=pool.sel_idx.data_ptr(),
            sel_valid_ring=pool.sel_valid.data_ptr(), final_norm=norm.weight.data_ptr(), final_eps=norm.eps,
            head=ctypes.pointer(head))
        return step_model, shared, decoder  # the arrays stay alive with the struct that points into them

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


def _bias(linear):
    """A linear's bias, which the kernels' products have none of (the CED model's linears have none)."""
    return getattr(getattr(linear, "base", linear), "bias", None)


def _norm(layer, part: str):
    return layer.mlp_norm if part == FFN else layer.attn_norm
