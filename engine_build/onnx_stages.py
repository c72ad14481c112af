"""The CED stages written for export: the same arithmetic as `ced/model.py`, but as pure functions of tensors.

`ced/model.py` keeps conversation state in small Python objects and skips work with `if`s on their sizes (no
global entries yet, an empty window, fewer blocks than top-k). A graph cannot do that, so here every piece of
state is an input or an output tensor whose length may be zero, and the `if`s become masks:

- windows: keys = [window, this chunk]; positions before 0 never occur, so no padding is needed;
- global KV: one all-zero entry is appended before gathering, and invalid picks point at it (then masked);
- top-k: K columns of -inf are put before the scores, so there are always >= K candidates; ONNX TopK breaks ties
  by the lower index, which on the flipped scores is the most recent block, as the stable sort in the model does.

Multi-LoRA is a graph input: per adapted Linear a stacked A (S, r, in) and B (S, out, r) (scaling folded into B,
as `ced/lora.py` stores them) and one slot per batch row (-1 = no adapter), so one graph serves any adapter set.
The wrapped model is the plain `CEDForCausalLM`; weights become graph initializers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ced.adapters import placement_violation
from ced.config import LayerRole
from ced.model import CEDForCausalLM, apply_rope

NEG_INF = float("-inf")


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


class _Stage(nn.Module):
    """What both stages share: LoRA-aware Linears and one layer's attention, as functions of state tensors."""

    def __init__(self, model: CEDForCausalLM):
        super().__init__()
        self.model, self.c = model, model.ced

    def linear(self, name: str, x: Tensor, lora: dict[str, tuple[Tensor, Tensor]], slots: Tensor | None) -> Tensor:
        y = F.linear(x, self.model.get_submodule(name).weight)
        if name not in lora:
            return y
        a, b = lora[name]  # (S, r, in), (S, out, r)
        a, b = a[slots.clamp(min=0)], b[slots.clamp(min=0)]  # (B, r, in), (B, out, r)
        delta = torch.matmul(torch.matmul(x, a.transpose(1, 2)), b.transpose(1, 2))  # (B, T, out)
        return torch.where((slots >= 0)[:, None, None], y + delta, y)  # rows without an adapter stay bit-exact

    def select(self, prefix: str, xn: Tensor, index_keys: Tensor, positions: Tensor, lora, slots):
        """Top-k global entries per query: (idx, valid), each (B, T, K); idx as `Indexer.select` gives it."""
        B, T, _ = xn.shape
        c, K = self.c, self.c.index_top_k
        q = self.linear(prefix + "indexer.query", xn, lora, slots).reshape(B, T, c.index_heads, c.index_dim)
        scores = torch.einsum("bthi,bni->bthn", q, index_keys).relu()  # (B, T, h, N)
        scores = (scores * self.linear(prefix + "indexer.weight", xn, lora, slots).unsqueeze(-1)).sum(2)  # (B, T, N)
        n = index_keys.shape[1]
        block_end = (torch.arange(n) + 1) * c.block_size - 1
        scores = scores.masked_fill(block_end[None, None, :] > positions[None, :, None], NEG_INF)
        padded = torch.cat([torch.full((B, T, K), NEG_INF), scores], dim=-1)  # >= K candidates, pads the oldest
        values, order = padded.flip(-1).topk(K, dim=-1)  # ties -> lower flipped index = the most recent block
        idx = (n - 1 - order).clamp(min=0)  # a pad column maps to 0, as F.pad does in the model
        return idx, values > NEG_INF

    def compress(self, prefix: str, xn: Tensor, pending: Tensor, n_entries: int):
        """The global entries of the blocks completed by this chunk, and the new partial block."""
        c = self.c
        B, m, H, D = xn.shape[0], c.block_size, c.n_heads, c.head_dim  # explicit D: -1 fails on zero blocks
        rows = torch.cat([pending, xn], dim=1)  # (B, p + T, C)
        n_blocks = rows.shape[1] // m
        blocks = rows[:, : n_blocks * m].reshape(B, n_blocks, m, c.hidden_size)  # (B, N', m, C)
        k = F.linear(blocks, self.model.get_submodule(prefix + "k_proj").weight).reshape(B, n_blocks, m, H, D)
        v = F.linear(blocks, self.model.get_submodule(prefix + "v_proj").weight).reshape(B, n_blocks, m, H, D)
        weights = F.linear(blocks, self.model.get_submodule(prefix + "compressor.gate").weight)
        weights = weights.softmax(dim=2).unsqueeze(-1)  # (B, N', m, H, 1)
        k_entry, v_entry = (weights * k).sum(2), (weights * v).sum(2)  # (B, N', H, D)
        block_end = (torch.arange(n_blocks) + n_entries + 1) * m - 1
        k_entry = apply_rope(k_entry.transpose(1, 2), block_end, c.rope_theta).transpose(1, 2)
        index_keys = F.linear(blocks.mean(2), self.model.get_submodule(prefix + "compressor.index_key").weight)
        return k_entry, v_entry, index_keys, rows[:, n_blocks * m:]

    def attention(self, role: LayerRole, xn: Tensor, positions: Tensor, window: tuple[Tensor, Tensor],
                  store: tuple[Tensor, Tensor, Tensor] | None, selection, lora, slots):
        """One layer's attention (`CEDAttention.forward` after compression); returns (out, window', selection)."""
        c, prefix = self.c, f"model.layers.{role.index}.attn."
        B, T, _ = xn.shape
        H, D = c.n_heads, c.head_dim
        q = apply_rope(self.linear(prefix + "q_proj", xn, lora, slots).reshape(B, T, H, D).transpose(1, 2),
                       positions, c.rope_theta)  # (B, H, T, D)
        k = apply_rope(self.linear(prefix + "k_proj", xn, lora, slots).reshape(B, T, H, D).transpose(1, 2),
                       positions, c.rope_theta)
        v = self.linear(prefix + "v_proj", xn, lora, slots).reshape(B, T, H, D).transpose(1, 2)
        if role.is_index:
            selection = self.select(prefix, xn, store[2], positions, lora, slots)
        keys, values = torch.cat([window[0], k], dim=2), torch.cat([window[1], v], dim=2)  # (B, H, S, D)
        past = window[0].shape[2]
        key_pos = torch.arange(past + T) + (positions[0] - past)  # (S,)
        scale = 1.0 / math.sqrt(D)
        local = torch.matmul(q, keys.transpose(-1, -2)) * scale  # (B, H, T, S)
        distance = positions[:, None] - key_pos[None, :]
        local = local.masked_fill((distance < 0) | (distance >= c.window), NEG_INF)
        if store is None:  # below the first source: local attention only
            out = torch.matmul(local.softmax(dim=-1), values)
        else:
            idx, valid = selection
            g_k, g_v = store[0], store[1]
            n = g_k.shape[1]
            zero = torch.zeros(B, 1, H, D)
            flat_k = torch.cat([g_k, zero], dim=1).reshape(B * (n + 1), H, D)  # entry n of each row: all zero
            flat_v = torch.cat([g_v, zero], dim=1).reshape(B * (n + 1), H, D)
            pick = torch.where(valid, idx, n) + (torch.arange(B) * (n + 1))[:, None, None]  # (B, T, K)
            k_sel, v_sel = flat_k[pick], flat_v[pick]  # (B, T, K, H, D)
            glob = torch.einsum("bhtd,btkhd->bhtk", q, k_sel) * scale
            glob = glob.masked_fill(~valid[:, None], NEG_INF)
            probs = torch.cat([local, glob], dim=-1).softmax(dim=-1)
            S = keys.shape[2]
            out = torch.matmul(probs[..., :S], values)
            out = out + torch.einsum("bhtk,btkhd->bhtd", probs[..., S:], v_sel)
        out = self.linear(prefix + "o_proj", out.transpose(1, 2).reshape(B, T, H * D), lora, slots)
        W = c.window
        return out, (keys[:, :, -W:], values[:, :, -W:]), selection

    def ffn(self, index: int, x: Tensor, lora, slots) -> Tensor:
        layer, prefix = self.model.model.layers[index], f"model.layers.{index}.mlp."
        xn = layer.mlp_norm(x)
        gate = self.linear(prefix + "gate_proj", xn, lora, slots)
        up = self.linear(prefix + "up_proj", xn, lora, slots)
        return x + self.linear(prefix + "down_proj", F.silu(gate) * up, lora, slots)


class PrefillStage(_Stage):
    """`run_shared`: layers 0..E-1 and layer E's attention. No adapter inputs: nothing here may depend on one."""

    def forward(self, *inputs: Tensor):
        c, E = self.c, self.c.decoder_start
        names, _ = io_names(self.model, "prefill")
        get = dict(zip(names, inputs))
        input_ids, start = get["input_ids"], get["start"]
        positions = torch.arange(input_ids.shape[1]) + start  # (T,)
        stores = {s: [get[f"global_k.{s}"], get[f"global_v.{s}"], get[f"index_keys.{s}"]] for s in c.source_layers}
        new_entries, windows = {}, {}
        x, h19, selection = self.model.model.embed_tokens(input_ids), None, None
        for role in c.roles[: E + 1]:
            layer = self.model.model.layers[role.index]
            xn = layer.attn_norm(x)
            if role.is_source:  # compress first: this chunk's completed blocks are readable by its own queries
                s = role.index
                k_new, v_new, i_new, pending = self.compress(f"model.layers.{s}.attn.", xn, get[f"pending.{s}"],
                                                             stores[s][0].shape[1])
                new_entries[s] = (k_new, v_new, i_new, pending)
                stores[s] = [torch.cat([old, new], dim=1) for old, new in zip(stores[s], (k_new, v_new, i_new))]
            store = stores[role.global_source] if role.global_source is not None else None
            window = (get[f"window_k.{role.index}"], get[f"window_v.{role.index}"])
            out, windows[role.index], selection = self.attention(role, xn, positions, window, store, selection, {},
                                                                 None)
            x = x + out
            if role.index == E:
                break
            x = self.ffn(role.index, x, {}, None)
            if role.index == E - 1:
                h19 = x
        outputs = [h19, x, selection[0], selection[1]]
        outputs += [t for i in range(E + 1) for t in windows[i]]
        outputs += [t for s in c.source_layers for t in new_entries[s]]
        return tuple(outputs)


class DecoderStage(_Stage):
    """`run_decoder` + final norm + LM head at the last position, under the mapped adapter slots.

    `with_windows=False` is the replay graph (the adapter-bound windows start empty); True is one decode step."""

    def __init__(self, model: CEDForCausalLM, with_windows: bool):
        super().__init__(model)
        self.with_windows = with_windows
        self.stage = "decode_step" if with_windows else "replay"

    def forward(self, *inputs: Tensor):
        c, E = self.c, self.c.decoder_start
        names, _ = io_names(self.model, self.stage)
        get = dict(zip(names, inputs))
        stream, slots = get["stream"], get["row_slots"]
        B, T, _ = stream.shape
        positions = torch.arange(T) + get["start"]
        lora = {name: (get[f"lora_a.{name}"], get[f"lora_b.{name}"]) for name in lora_modules(self.model)}
        store = (get["global_k"], get["global_v"], get["index_keys"])
        selection = (get["selection_idx"], get["selection_valid"])
        empty = torch.zeros(B, c.n_heads, 0, c.head_dim)
        x, windows = self.ffn(E, stream, lora, slots), {}
        for role in c.roles[E + 1:]:
            layer = self.model.model.layers[role.index]
            window = (get[f"window_k.{role.index}"], get[f"window_v.{role.index}"]) if self.with_windows \
                else (empty, empty)
            out, windows[role.index], selection = self.attention(role, layer.attn_norm(x), positions, window, store,
                                                                 selection, lora, slots)
            x = self.ffn(role.index, x + out, lora, slots)
        logits = F.linear(self.model.model.norm(x[:, -1]), self.model.lm_head.weight)  # (B, V)
        return (logits,) + tuple(t for i in c.adapter_bound_layers for t in windows[i])
