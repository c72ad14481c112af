"""Per-family adapters over transformers' real model classes: capture K/V where HeteroFold maps them, install
mapped K/V so the receiver applies its own key norm and RoPE.

Capture points (all three families share the module names `self_attn.{q,k,v}_proj`):
- K: the output of `k_proj`, i.e. before the key norm (Qwen3's QK-norm) and before RoPE;
- V: the output of `v_proj`;
- Q: the output of `q_proj` (receiver side only, as the calibration target's query).

Installing a cache runs the receiver's own `k_norm` (when the family has one) and its own rotary embedding on the
mapped K, then writes K/V into a `transformers.DynamicCache`. Adding a family is one `FamilySpec` entry below
(see heterofold/README.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers
from transformers import DynamicCache


@dataclass(frozen=True)
class FamilySpec:
    name: str                     # registry key
    config_cls: str               # transformers config class name
    model_cls: str                # transformers causal-LM class name
    tokenizer: str                # "cl100k" | "qwen" | "bpe"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    key_norm: str | None = None   # attribute of self_attn holding the key norm (applied before RoPE)
    query_norm: str | None = None
    extra: dict = field(default_factory=dict)   # family-specific config fields

    def config(self, vocab_size: int, max_positions: int = 32768):
        cls = getattr(transformers, self.config_cls)
        return cls(vocab_size=vocab_size, hidden_size=self.hidden, num_hidden_layers=self.layers,
                   num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                   intermediate_size=self.intermediate, max_position_embeddings=max_positions,
                   tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=None, eos_token_id=None,
                   pad_token_id=0, **self.extra)

    def build(self, vocab_size: int, seed: int = 0, max_positions: int = 32768, attn: str = "sdpa"):
        torch.manual_seed(seed)
        cfg = self.config(vocab_size, max_positions)
        cfg._attn_implementation = attn
        return getattr(transformers, self.model_cls)(cfg).eval()


# Different depth, KV heads and head dim per family, as in the seed's Llama / Qwen3 / Ministral triple.
FAMILIES = {
    "llama": FamilySpec("llama", "LlamaConfig", "LlamaForCausalLM", "bpe",
                        layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=384),
    "qwen3": FamilySpec("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "qwen",
                        layers=6, hidden=128, heads=4, kv_heads=1, head_dim=48, intermediate=352,
                        key_norm="k_norm", query_norm="q_norm"),
    "mistral": FamilySpec("mistral", "MistralConfig", "MistralForCausalLM", "cl100k",
                          layers=5, hidden=144, heads=6, kv_heads=3, head_dim=24, intermediate=384,
                          extra={"sliding_window": None}),
}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class Capture:
    """Per-layer pre-norm, pre-RoPE K, V (and Q when asked), each (T, heads*D), for one sequence."""
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    q: list[torch.Tensor] | None = None
    logits: torch.Tensor | None = None


class Adapter:
    """Capture and install for one model; everything family-specific comes from its `FamilySpec`."""

    def __init__(self, model, spec: FamilySpec):
        self.model, self.spec = model, spec
        cfg = model.config
        self.layers = cfg.num_hidden_layers
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.d_kv = self.kv_heads * self.head_dim
        self.d_model = cfg.hidden_size

    def attn(self, layer: int):
        return self.model.model.layers[layer].self_attn

    @torch.no_grad()
    def capture(self, ids: list[int] | torch.Tensor, want_q: bool = False, want_logits: bool = False) -> Capture:
        ids = torch.as_tensor(ids).view(1, -1)
        ks, vs, qs, hooks = [None] * self.layers, [None] * self.layers, [None] * self.layers, []
        for i in range(self.layers):
            a = self.attn(i)
            hooks.append(a.k_proj.register_forward_hook(lambda m, inp, out, i=i: ks.__setitem__(i, out[0])))
            hooks.append(a.v_proj.register_forward_hook(lambda m, inp, out, i=i: vs.__setitem__(i, out[0])))
            if want_q:
                hooks.append(a.q_proj.register_forward_hook(lambda m, inp, out, i=i: qs.__setitem__(i, out[0])))
        try:
            if want_logits:
                logits = self.model(input_ids=ids, use_cache=False).logits[0]
            else:                              # the LM head is not needed for K/V
                self.model.model(input_ids=ids, use_cache=False)
                logits = None
        finally:
            for h in hooks:
                h.remove()
        return Capture(ks, vs, qs if want_q else None, logits)

    def heads_view(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        """(T, n_heads*D) -> (n_heads, T, D)."""
        return x.view(x.shape[0], n_heads, self.head_dim).transpose(0, 1)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (H, T, D) rotated with the receiver's own rotary embedding at `positions` (T,)."""
        cos, sin = self.model.model.rotary_emb(x, positions.view(1, -1))   # (1, T, D)
        return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)

    def key_post(self, layer: int, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Mapped pre-norm K (T, Hkv*D) -> the cache's K (Hkv, T, D): own key norm, then own RoPE."""
        k = self.heads_view(k, self.kv_heads)
        if self.spec.key_norm:
            k = getattr(self.attn(layer), self.spec.key_norm)(k)
        return self.rope(k, positions)

    def query_post(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = self.heads_view(q, self.heads)
        if self.spec.query_norm:
            q = getattr(self.attn(layer), self.spec.query_norm)(q)
        return self.rope(q, positions)

    def scaling(self, layer: int) -> float:
        return float(self.attn(layer).scaling)

    def kv_group(self) -> torch.Tensor:
        """g(h): the KV head each query head reads (GQA)."""
        return torch.arange(self.heads) // (self.heads // self.kv_heads)

    @torch.no_grad()
    def build_cache(self, ks: list[torch.Tensor], vs: list[torch.Tensor], start: int = 0) -> DynamicCache:
        """Install mapped pre-norm K and V ((T, Hkv*D) per layer) as a DynamicCache at positions start.."""
        dtype = next(self.model.parameters()).dtype
        cache = DynamicCache(config=self.model.config)
        pos = torch.arange(start, start + ks[0].shape[0])
        for i, (k, v) in enumerate(zip(ks, vs)):
            k_post = self.key_post(i, k.to(dtype), pos)                      # (Hkv, T, D)
            cache.update(k_post[None], self.heads_view(v.to(dtype), self.kv_heads)[None], i)
        return cache

    @torch.no_grad()
    def decode_from(self, cache: DynamicCache, ids: list[int], attentions: bool = False):
        """Run `ids` on top of a cache (teacher-forced); returns the model output."""
        past = cache.get_seq_length()
        ids_t = torch.as_tensor(ids).view(1, -1)
        pos = torch.arange(past, past + ids_t.shape[1]).view(1, -1)
        return self.model(input_ids=ids_t, cache=cache, position_ids=pos, use_cache=True,
                          output_attentions=attentions)

    @torch.no_grad()
    def greedy(self, cache: DynamicCache, first: int, max_new: int, banned: int = 0) -> list[int]:
        """Greedy continuation; `banned` (the unknown-token row) is never emitted."""
        out, tok = [], first
        for _ in range(max_new):
            logits = self.decode_from(cache, [tok]).logits[0, -1]
            logits[banned] = float("-inf")
            tok = int(logits.argmax())
            out.append(tok)
        return out


def attention(q: torch.Tensor, k: torch.Tensor, group: torch.Tensor, scaling: float, offset: int = 0):
    """Causal attention probabilities P (H, Tq, Tk) of post-RoPE q (H, Tq, D) against k (Hkv, Tk, D).

    Query row r sits at absolute position offset + r; key c at position c.
    """
    scores = torch.einsum("htd,hsd->hts", q, k[group]) * scaling
    tq, tk = q.shape[1], k.shape[1]
    mask = torch.arange(tk)[None, :] > (torch.arange(tq)[:, None] + offset)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
