"""A decode step's attention blocks in native calls (ced/kernels), over the paged pool in place.

A layer's attention for one token per row is ~60 small torch operations (norm, three projections, RoPE, the ring
write and read, the indexer's scores and top-k, the gather of the selected entries, the softmax, o); on the demo
each costs more in dispatch than in arithmetic. Here it is a few calls: `attention_pre` (norm, q/k/v with the
rows' LoRA, RoPE, the ring write), on source layers `compress_rows` (the token joins its row's pending block; a
block it completes is pooled into a global entry), on index layers `index_select`, and `attention_post` (the
window and the selected entries, o, the residual). The arithmetic is the model's (ced/model.py), in another
summation order: a row's logits agree with the serial engine's to float tolerance and are the same bits alone or
in any batch.
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor

from . import kernels
from .state import Selection


class NativeDecode:
    """One decode step over `cache` (a PagedCache of one position per row): what every layer shares, built once."""

    def __init__(self, cache, positions: Tensor, tables: tuple[Tensor, Tensor]):
        pool, B = cache.pool, len(cache.rows)
        self.cache, self.lib, self.B = cache, kernels.library(), B
        self._keep = [cache.slots.contiguous(), positions.reshape(B).contiguous(), cache.ring_key_positions(),
                      cache.table.contiguous(), *(t.reshape(B, -1).contiguous() for t in tables)]
        slots, flat_positions, key_pos, table, cos, sin = self._keep
        self.rows = kernels.DecodeRows(
            B, slots.data_ptr(), flat_positions.data_ptr(), key_pos.data_ptr(), key_pos.shape[1], pool.W,
            table.data_ptr(), table.shape[1], pool.page_entries, max(cache.ends) // cache.m, cache.m,
            cos.data_ptr(), sin.data_ptr(), None)

    def attention_block(self, layer, x: Tensor, selection: Selection | None) -> tuple[Tensor, Selection | None] | None:
        """x + attention(norm(x)) of `layer` (ced.model.CEDLayer) for x (B, 1, C), and the selection the next layers
        read; None where a linear is not the engine's (no native form), so the caller runs the torch path."""
        attn, cache, B, lib = layer.attn, self.cache, self.B, self.lib
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        if attn.indexer is not None:
            linears += [attn.indexer.query, attn.indexer.weight]
        if attn.compressor is not None:
            linears += [attn.compressor.gate, attn.compressor.index_key]
        native = [getattr(linear, "native_args", lambda rows: None)(B) for linear in linears]
        if None in native:
            return None
        specs = [spec for spec, _ in native]
        lora_slots = next((slots for _, slots in native if slots is not None), None)  # one mapping: the same slots
        self._lora_slots = lora_slots  # alive while the kernels read it
        self.rows.lora_slots = None if lora_slots is None else lora_slots.data_ptr()
        config, index, rows = attn.config, attn.role.index, ctypes.byref(self.rows)
        H, D, C = config.n_heads, config.head_dim, x.shape[-1]
        x = x.contiguous()
        xn, q = x.new_empty(B, C), x.new_empty(B, H * D)
        kernels.check(lib.attention_pre(rows, x.data_ptr(), layer.attn_norm.weight.data_ptr(), layer.attn_norm.eps,
                                        specs[0], specs[1], specs[2], H, D, cache.pool.wk[index].data_ptr(),
                                        cache.pool.wv[index].data_ptr(), xn.data_ptr(), q.data_ptr()))
        if attn.compressor is not None:  # first: a block this token completes is readable by its own query
            pool = cache.pool
            kernels.check(lib.compress_rows(rows, xn.data_ptr(), pool.pending[index].data_ptr(), specs[1], specs[2],
                                            specs[-2], specs[-1], H, D, pool.gk[index].data_ptr(),
                                            pool.gv[index].data_ptr(), pool.gi[index].data_ptr()))
        source = attn.role.global_source
        has_entries = source is not None and cache.has_entries(source)
        if attn.indexer is not None:  # a new choice over this layer's source; none before the first block ends
            selection = self._select(attn.indexer, specs[4:6], xn, source) if has_entries else None
        gk = gv = idx = valid = None
        if has_entries and selection is not None:
            gk, gv = cache.pool.gk[source], cache.pool.gv[source]
            idx, valid = selection.idx.reshape(B, -1).contiguous(), selection.valid.reshape(B, -1).contiguous()
        top_k = config.index_top_k
        y = x.new_empty(B, 1, C)
        kernels.check(lib.attention_post(
            rows, x.data_ptr(), q.data_ptr(), cache.pool.wk[index].data_ptr(), cache.pool.wv[index].data_ptr(), H, D,
            1.0 / math.sqrt(D), *(None if t is None else t.data_ptr() for t in (gk, gv, idx, valid)), top_k, specs[3],
            y.data_ptr()))
        return y, selection

    def _select(self, indexer, specs, xn: Tensor, source: int) -> Selection:
        B, top_k = self.B, indexer.top_k
        idx, valid = torch.empty(B, 1, top_k, dtype=torch.long), torch.empty(B, 1, top_k, dtype=torch.bool)
        kernels.check(self.lib.index_select(ctypes.byref(self.rows), xn.data_ptr(), specs[0], specs[1],
                                            self.cache.pool.gi[source].data_ptr(), indexer.heads, indexer.dim, top_k,
                                            idx.data_ptr(), valid.data_ptr()))
        return Selection(idx, valid)
