"""The causal encoder-decoder model as a `transformers` custom model.

Every layer: one softmax over its local window (the last W positions) and the top-k selected entries of the
global KV of the nearest source layer at or below it, then a SwiGLU FFN. The forward is split in two stages so
the engine can run them separately:

- `shared_stage`: layers 0..E-1 and the first decoder layer's attention. Adapter-free; writes encoder windows,
  the global KV and the post-attention stream of layer E. Its layer E-1 output is H19.
- `decoder_stage`: layer E's FFN and layers E+1..L-1 from that stream, under whatever adapter is mapped.

Both read and write conversation state only through a cache (`ced.state.AttentionCache`): the reference objects
of one conversation (`run_shared` / `run_decoder`), the serving engine's paged pool of many (`ced.paged`), or the
explicit state tensors of an exported graph (`ced.state.ExportCache`, traced by ced/onnx_stages.py).

`forward(input_ids)` runs both over the whole sequence in chunks: it is the training path and the oracle.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from . import kernels
from .config import CEDConfig, LayerRole
from .state import AttentionCache, GlobalKV, ListCache, LocalWindow, Selection

NEG_INF = float("-inf")


class CEDPretrainedConfig(PretrainedConfig):
    """`transformers` wrapper of CEDConfig: same fields, validated through the frozen dataclass."""

    model_type = "ced"

    def __init__(self, **kwargs):
        ced_fields = {k: kwargs.pop(k) for k in list(kwargs) if k in CEDConfig.__dataclass_fields__ and k != "roles"}
        if isinstance(ced_fields.get("dtype"), torch.dtype):
            ced_fields["dtype"] = str(ced_fields["dtype"]).removeprefix("torch.")
        ced = CEDConfig.from_dict(ced_fields)  # validates
        for name, value in ced.to_dict().items():
            if name != "dtype":  # PretrainedConfig owns `dtype`: passed through below
                setattr(self, name, list(value) if isinstance(value, tuple) else value)
        kwargs.setdefault("tie_word_embeddings", ced.tie_word_embeddings)
        super().__init__(dtype=ced.dtype, **kwargs)

    @property
    def ced(self) -> CEDConfig:
        names = [f for f, spec in CEDConfig.__dataclass_fields__.items() if spec.init]
        values = {name: getattr(self, name) for name in names}
        if isinstance(values["dtype"], torch.dtype):
            values["dtype"] = str(values["dtype"]).removeprefix("torch.")
        return CEDConfig.from_dict(values)

    @classmethod
    def from_ced(cls, ced: CEDConfig) -> "CEDPretrainedConfig":
        return cls(**ced.to_dict())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if kernels.takes(x) and kernels.available(self.weight.dtype):  # a decode step's few rows: one native call
            return kernels.rms_norm(x, self.weight, self.eps)
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(positions: Tensor, theta: float, dim: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotation at absolute positions (B, T) or (T,), for head size `dim`: (B, 1, T, D/2) or
    (T, D/2), shared by the heads (and by q and k of a layer)."""
    angles = positions.to(torch.float32)[..., None] * _inverse_frequencies(theta, dim, positions.device)
    if angles.dim() == 3:
        angles = angles[:, None]  # (B, 1, T, D/2): one rotation per row, shared by the heads
    return angles.cos().to(dtype), angles.sin().to(dtype)


@functools.lru_cache(maxsize=16)
def _inverse_frequencies(theta: float, dim: int, device: torch.device) -> Tensor:
    half = dim // 2
    with torch.inference_mode(False):  # a plain tensor, whichever mode asks first: training reads it too
        return theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)


def apply_rope(x: Tensor, positions: Tensor, theta: float, tables: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Rotate x (B, H, T, D) by absolute positions (B, T) or (T,): pairs (i, i + D/2), as in Llama. `tables`:
    rope_tables of these positions, when the caller has them."""
    cos, sin = tables if tables is not None else rope_tables(positions, theta, x.shape[-1], x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class BlockCompressor(nn.Module):
    """Source layers only: pools each completed block of m inputs into one global K/V entry and one indexer key."""

    def __init__(self, config: CEDConfig):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.n_heads, bias=False)  # per-head pooling logits
        self.index_key = nn.Linear(config.hidden_size, config.index_dim, bias=False)


def top_k_recent(scores: Tensor, k: int, graph: bool = False) -> tuple[Tensor, Tensor]:
    """The k largest scores along the last dim, ties to the most recent (highest) index, ordered by score then
    recency: entry numbers and their scores (..., k). The choice must not depend on how many queries share the
    call (one-pass vs token by token), and ReLU scores tie at zero often, so `topk`'s unspecified tie order will
    not do alone; a full stable sort would, but costs O(N log N) per query where this is O(N): each score's order
    as an integer above its index makes every key distinct, and the k largest keys, largest first, are exactly the
    entries wanted in the order wanted (one integer topk; a float topk, a tie check and two sorts took 1.6x as long).

    `graph`: the form traced into an exported graph, which cannot branch on the data: ONNX TopK orders ties by
    the lower index, so on the flipped scores it picks and orders exactly as the eager form does (for graphs
    only: torch's own topk promises no tie order)."""
    if graph:
        values, flipped = scores.flip(-1).topk(k, dim=-1)
        return scores.shape[-1] - 1 - flipped, values
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0: the comparison has them equal
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # a negative float's magnitude bits flipped: the floats' order
    # ordered * 2**32 + index, in place (the low 32 bits are free: the same as a shift and an or, 2x faster)
    keys = ordered.to(torch.int64).mul_(1 << 32).add_(torch.arange(scores.shape[-1], device=scores.device))
    idx = keys.topk(k, dim=-1).values & 0xFFFFFFFF  # sorted: by score, then the most recent first
    return idx, scores.gather(-1, idx)


class Indexer(nn.Module):
    """Index layers only: a ReLU-scored lightning indexer that picks the top-k global entries per query."""

    def __init__(self, config: CEDConfig):
        super().__init__()
        self.heads, self.dim, self.top_k = config.index_heads, config.index_dim, config.index_top_k
        self.query = nn.Linear(config.hidden_size, config.index_heads * config.index_dim, bias=False)
        self.weight = nn.Linear(config.hidden_size, config.index_heads, bias=False)

    def select(self, xn: Tensor, index_keys: Tensor, positions: Tensor, block_size: int,
               graph: bool = False) -> Selection:
        """xn (B, T, C) at positions (B, T); index_keys (B, N, I), rows padded past their own entries (a padded
        entry's block ends after every query of its row, so the block-end mask hides it). `graph`: traced for
        export, N unknown (maybe under top_k, maybe 0), so no branch on it (see AttentionCache.graph)."""
        B, T, _ = xn.shape
        q = self.query(xn).view(B, T, self.heads, self.dim)  # (B, T, h, I)
        N = index_keys.shape[1]
        scores = torch.matmul(q.reshape(B, T * self.heads, self.dim), index_keys.transpose(1, 2)).relu_()
        # the heads' weighted sum as one matmul per query: (1, h) x (h, N), no (B, T, h, N) product in memory
        scores = torch.matmul(self.weight(xn).view(B * T, 1, self.heads), scores.view(B * T, self.heads, N))
        scores = scores.view(B, T, N)
        block_end = (torch.arange(N, device=xn.device) + 1) * block_size - 1
        scores = scores.masked_fill_(block_end[None, None, :] > positions[:, :, None], NEG_INF)
        if graph:  # top_k columns of -inf before the oldest entry: always enough candidates; a pad picked -> 0
            idx, values = top_k_recent(F.pad(scores, (self.top_k, 0), value=NEG_INF), self.top_k, graph=True)
            return Selection((idx - self.top_k).clamp(min=0), values > NEG_INF)
        k = min(self.top_k, N)
        idx, values = top_k_recent(scores, k)
        valid = values > NEG_INF
        if k < self.top_k:  # fewer completed blocks than top_k: pad with invalid slots
            pad = self.top_k - k
            idx, valid = F.pad(idx, (0, pad)), F.pad(valid, (0, pad))
        return Selection(idx, valid)


class CEDAttention(nn.Module):
    def __init__(self, config: CEDConfig, role: LayerRole):
        super().__init__()
        self.config, self.role = config, role
        C, H, D = config.hidden_size, config.n_heads, config.head_dim
        self.q_proj = nn.Linear(C, H * D, bias=False)
        self.k_proj = nn.Linear(C, H * D, bias=False)
        self.v_proj = nn.Linear(C, H * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)
        self.compressor = BlockCompressor(config) if role.is_source else None
        self.indexer = Indexer(config) if role.is_index else None

    def _heads(self, x: Tensor) -> Tensor:  # (B, T, H*D) -> (B, T, H, D)
        return x.view(*x.shape[:2], self.config.n_heads, self.config.head_dim)

    def pool_blocks(self, blocks: Tensor, first_entry: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Global entries of completed blocks (R, N', m, C) whose first is entry `first_entry` (R,) of its row:
        K (RoPE'd at each block's last position), V (R, N', H, D) and indexer keys (R, N', I)."""
        R, n_blocks, m, _ = blocks.shape
        H, D = self.config.n_heads, self.config.head_dim  # no -1: a graph may run this on zero blocks
        k = self._heads(self.k_proj(blocks).flatten(1, 2)).view(R, n_blocks, m, H, D)
        v = self._heads(self.v_proj(blocks).flatten(1, 2)).view(R, n_blocks, m, H, D)
        weights = self.compressor.gate(blocks).softmax(dim=2).unsqueeze(-1)  # (R, N', m, H, 1)
        k_entry, v_entry = (weights * k).sum(2), (weights * v).sum(2)  # (R, N', H, D)
        block_end = (torch.arange(n_blocks, device=blocks.device) + first_entry[:, None] + 1) * m - 1  # (R, N')
        k_entry = apply_rope(k_entry.transpose(1, 2), block_end, self.config.rope_theta).transpose(1, 2)
        return k_entry, v_entry, self.compressor.index_key(blocks.mean(2))

    def forward(self, xn: Tensor, positions: Tensor, cache: AttentionCache, selection: Selection | None,
                last_only: bool = False,
                tables: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Selection | None]:
        """xn: (B, T, C) normalized input at positions (B, T); the cache holds what precedes them. Every position's
        keys and values go to the cache; with `last_only` only the last position queries: output (B, 1, C).
        `tables`: rope_tables of the positions (a stage computes them once for all its layers)."""
        layer, source, theta = self.role.index, self.role.global_source, self.config.rope_theta
        if tables is None:
            tables = rope_tables(positions, theta, self.config.head_dim, xn.dtype)  # once for q and k
        k = apply_rope(self._heads(self.k_proj(xn)).transpose(1, 2), positions, theta, tables)
        v = self._heads(self.v_proj(xn)).transpose(1, 2)
        if self.compressor is not None:  # first: this chunk's completed blocks are readable by its own queries
            cache.compress(layer, xn, self.pool_blocks)
        keys, values, key_pos = cache.extend_window(layer, k, v, positions)  # (B, H, S, D) x2, (B or 1, S)
        if last_only:
            xn, positions, tables = xn[:, -1:], positions[:, -1:], tuple(t[..., -1:, :] for t in tables)
            if selection is not None:
                selection = Selection(selection.idx[:, -1:], selection.valid[:, -1:])
        B, T, _ = xn.shape
        q = apply_rope(self._heads(self.q_proj(xn)).transpose(1, 2), positions, theta, tables)  # (B, H, T, D)
        has_entries = source is not None and cache.has_entries(source)
        if self.indexer is not None:  # a new choice over this layer's source; none before the first block ends
            selection = self.indexer.select(xn, cache.index_keys(source), positions, self.config.block_size,
                                            cache.graph) if has_entries else None

        scale = 1.0 / math.sqrt(self.config.head_dim)
        if T == 1 and kernels.takes(q) and kernels.available(q.dtype):  # one query per row: one native call
            selected = None
            if has_entries and selection is not None:
                k_sel, v_sel = cache.gather(source, selection.idx)  # (B, 1, k, H, D)
                selected = (k_sel.permute(0, 3, 1, 2, 4), v_sel.permute(0, 3, 1, 2, 4), selection.valid)
            out = kernels.attend_one(q, keys, values, key_pos, positions, self.config.window, scale, selected)
            return self.o_proj(out), selection
        # The window may come in parts (keys, values and positions each a tuple): the pool graphs' cache hands the
        # ring as it lies and this call's keys apart, where joining them would copy the ring every step.
        parts = list(zip(*(part if isinstance(part, tuple) else (part,) for part in (keys, values, key_pos))))
        scores = []
        for part_keys, _, part_pos in parts:
            local = torch.matmul(q, part_keys.transpose(-1, -2)) * scale  # (B, H, T, S)
            distance = positions[:, :, None] - part_pos[:, None, :]  # (B, T, S)
            scores.append(local.masked_fill(((distance < 0) | (distance >= self.config.window))[:, None], NEG_INF))
        selected = has_entries and selection is not None
        if selected:
            k_sel, v_sel = cache.gather(source, selection.idx)  # (B, T, k, H, D)
            # (B, H, T, k, D): one small matmul per (row, head, query); a view, not a copy, where the cache
            # gathers in this order (PagedCache)
            k_sel, v_sel = k_sel.permute(0, 3, 1, 2, 4), v_sel.permute(0, 3, 1, 2, 4)
            glob = torch.matmul(q.unsqueeze(-2), k_sel.transpose(-1, -2)).squeeze(-2) * scale  # (B, H, T, k)
            scores.append(glob.masked_fill(~selection.valid[:, None], NEG_INF))
        probs = (torch.cat(scores, dim=-1) if len(scores) > 1 else scores[0]).softmax(dim=-1)
        out, at = None, 0
        for (_, part_values, _), local in zip(parts, scores):
            term = torch.matmul(probs[..., at: at + local.shape[-1]], part_values)  # (B, H, T, D)
            out, at = term if out is None else out + term, at + local.shape[-1]
        if selected:
            out = out + torch.matmul(probs[..., at:].unsqueeze(-2), v_sel).squeeze(-2)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), selection


def _positions(start: int, length: int, device) -> Tensor:
    return torch.arange(start, start + length, device=device)[None]  # (1, T): shared by the rows


class SwiGLU(nn.Module):
    def __init__(self, config: CEDConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class CEDLayer(nn.Module):
    def __init__(self, config: CEDConfig, role: LayerRole):
        super().__init__()
        self.role = role
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = CEDAttention(config, role)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = SwiGLU(config)

    def attention_block(self, x, positions, cache, selection, last_only: bool = False, tables=None):
        out, selection = self.attn(self.attn_norm(x), positions, cache, selection, last_only, tables)
        return (x[:, -1:] if last_only else x) + out, selection

    def ffn_block(self, x: Tensor) -> Tensor:
        fused = self._native_ffn_block(x) if kernels.takes(x) else None
        return fused if fused is not None else x + self.mlp(self.mlp_norm(x))

    def _native_ffn_block(self, x: Tensor) -> Tensor | None:
        """The block in one native call, where its linears are the engine's (ced.lora: packed, with the rows'
        LoRA) and the kernels take them; else None."""
        rows, linears = x.numel() // x.shape[-1], (self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj)
        native = [getattr(linear, "native_args", lambda rows: None)(rows) for linear in linears]
        if None in native or not kernels.available(self.mlp_norm.weight.dtype):
            return None
        slots = next((slots for _, slots in native if slots is not None), None)  # one mapping: the same slots
        return kernels.swiglu_block(x, self.mlp_norm.weight, self.mlp_norm.eps, *(spec for spec, _ in native), slots)


@dataclass
class SharedOutput:
    h19: Tensor  # (B, T, C): output of the last encoder layer
    stream: Tensor  # (B, T, C): residual stream after the first decoder layer's attention
    selection: Selection | None  # the first decoder layer's top-k choice for these positions


class CEDPreTrainedModel(PreTrainedModel):
    config_class = CEDPretrainedConfig
    base_model_prefix = "model"
    _no_split_modules = ["CEDLayer"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


class CEDModel(CEDPreTrainedModel):
    def __init__(self, config: CEDPretrainedConfig):
        super().__init__(config)
        ced = config.ced
        self.embed_tokens = nn.Embedding(ced.vocab_size, ced.hidden_size)
        self.layers = nn.ModuleList(CEDLayer(ced, role) for role in ced.roles)
        self.norm = RMSNorm(ced.hidden_size, ced.norm_eps)
        self.post_init()


class CEDForCausalLM(CEDPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: CEDPretrainedConfig):
        super().__init__(config)
        self.ced = config.ced
        self.model = CEDModel(config)
        self.lm_head = nn.Linear(self.ced.hidden_size, self.ced.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def from_ced(cls, ced: CEDConfig, seed: int | None = None) -> "CEDForCausalLM":
        if seed is not None:
            torch.manual_seed(seed)
        return cls(CEDPretrainedConfig.from_ced(ced)).to(ced.torch_dtype)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    # -- the two stages ------------------------------------------------------------------------------------
    # Each runs over any cache (ced.state.AttentionCache): the per-conversation objects below, or the serving
    # engine's paged pool (ced.paged), so the arithmetic is written once.

    def shared_stage(self, input_ids: Tensor, positions: Tensor, cache: AttentionCache) -> SharedOutput:
        """Layers 0..E-1 and layer E's attention over input_ids (B, T) at positions (B, T), appending to cache."""
        E = self.ced.decoder_start
        x, selection, h19 = self.model.embed_tokens(input_ids), None, None
        tables = self._rope(positions, x.dtype)
        for layer in self.model.layers[: E + 1]:
            x, selection = layer.attention_block(x, positions, cache, selection, tables=tables)
            if layer.role.index == E:
                break
            x = layer.ffn_block(x)
            if layer.role.index == E - 1:
                h19 = x
        return SharedOutput(h19, x, selection)

    def decoder_stage(self, stream: Tensor, positions: Tensor, selection: Selection | None, cache: AttentionCache,
                      capture: dict[int, list[Tensor]] | None = None, last_only: bool = False) -> Tensor:
        """Layer E's FFN and layers E+1..L-1 from the post-attention stream (B, T, C); returns final hidden.

        `capture`, if given, collects each decoder layer's output (B, T, C) under its layer index. `last_only`: the
        last layer runs its queries and FFN for the last position only (a replay wants the windows of every
        position but the next-token logits of the last): returns (B, 1, C).
        """
        E = self.ced.decoder_start
        x = self.model.layers[E].ffn_block(stream)
        if capture is not None:
            capture.setdefault(E, []).append(x)
        tables = self._rope(positions, x.dtype)
        for layer in self.model.layers[E + 1:]:
            final = last_only and layer is self.model.layers[-1]
            x, selection = layer.attention_block(x, positions, cache, selection, final, tables)
            x = layer.ffn_block(x)
            if capture is not None:
                capture.setdefault(layer.role.index, []).append(x)
        return self.model.norm(x)

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_tables(positions, self.ced.rope_theta, self.ced.head_dim, dtype)

    def run_shared(self, input_ids: Tensor, start: int, windows: dict[int, LocalWindow],
                   stores: dict[int, GlobalKV]) -> SharedOutput:
        """`shared_stage` on one conversation's objects (or rows of equal length), at positions start.."""
        cache = ListCache(windows, stores, start, self.ced.block_size)
        return self.shared_stage(input_ids, _positions(start, input_ids.shape[1], input_ids.device), cache)

    def run_decoder(self, stream: Tensor, start: int, selection: Selection | None,
                    windows: dict[int, LocalWindow], first_decoder_store: GlobalKV,
                    capture: dict[int, list[Tensor]] | None = None, last_only: bool = False) -> Tensor:
        """`decoder_stage` on one conversation's adapter-bound windows and the first decoder layer's global KV."""
        cache = ListCache(windows, {self.ced.decoder_start: first_decoder_store}, start, self.ced.block_size)
        return self.decoder_stage(stream, _positions(start, stream.shape[1], stream.device), selection, cache, capture,
                                  last_only)

    def new_windows(self, layers) -> dict[int, LocalWindow]:
        return {i: LocalWindow(self.ced.window) for i in layers}

    def new_stores(self) -> dict[int, GlobalKV]:
        return {i: GlobalKV() for i in self.ced.source_layers}

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, chunk_size: int = 256,
                capture: dict[int, list[Tensor]] | None = None, **unused) -> CausalLMOutput:
        """The whole sequence in chunks of `chunk_size` queries (training and the oracle). Labels are shifted.

        `capture` collects decoder layer outputs per chunk (see run_decoder)."""
        windows, stores = self.new_windows(range(self.ced.n_layers)), self.new_stores()
        hidden = []
        for start in range(0, input_ids.shape[1], chunk_size):
            chunk = input_ids[:, start: start + chunk_size]
            shared = self.run_shared(chunk, start, windows, stores)
            hidden.append(self.run_decoder(shared.stream, start, shared.selection, windows,
                                           stores[self.ced.decoder_start], capture))
        logits = self.lm_head(torch.cat(hidden, dim=1))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
