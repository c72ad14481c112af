"""Per-family adapters over transformers' real model classes: capture K/V where HeteroFold maps them, install
mapped K/V so the receiver applies its own key norm and RoPE.

Capture points (the base `Adapter`: Llama, Qwen3, Mistral and the like, whose attention has `{q,k,v}_proj`):
- K: the output of `k_proj`, i.e. before the key norm (Qwen3's QK-norm) and before RoPE;
- V: the output of `v_proj`;
- Q: the output of `q_proj` (receiver side only, as the calibration target's query).
A family whose attention differs (one fused projection, another attribute name) overrides `attn_name` and
`projection_hooks` in a subclass, as `GPTNeoXAdapter` does.

Installing a cache runs the receiver's own key norm (when the family has one) and its own rotary embedding on the
mapped K (only the leading dims the embedding covers, for partial rotary), then writes K/V into a
`transformers.DynamicCache`. Families are registered in registry.py (see heterofold/README.md, "Adding a model
family").
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
    tokenizer: str                # a name in tokenizer.TOKENIZERS: "bpe" | "cl100k" | "qwen"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    key_norm: str | None = None   # attribute of the attention module holding the key norm (applied before RoPE)
    query_norm: str | None = None
    extra: dict = field(default_factory=dict)   # family-specific config fields (e.g. GPT-NeoX's rotary_pct)

    def config(self, vocab_size: int, max_positions: int = 32768):
        cls = getattr(transformers, self.config_cls)
        return cls(vocab_size=vocab_size, hidden_size=self.hidden, num_hidden_layers=self.layers,
                   num_attention_heads=self.heads, **self._head_fields(cls),
                   intermediate_size=self.intermediate, max_position_embeddings=max_positions,
                   tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=None, eos_token_id=None,
                   pad_token_id=0, **self.extra)

    def _head_fields(self, cls) -> dict:
        """KV heads and head dim, for the config fields the class has. A family without GQA (GPT-NeoX) has no
        `num_key_value_heads`, one with no free head dim (GPT-NeoX, Phi) no `head_dim`: passing them anyway would
        set attributes the attention ignores but the rotary embedding reads."""
        fields = {"num_key_value_heads": self.kv_heads, "head_dim": self.head_dim}
        declared = getattr(cls, "__dataclass_fields__", fields)
        return {k: v for k, v in fields.items() if k in declared}

    def build(self, vocab_size: int, seed: int = 0, max_positions: int = 32768, attn: str = "sdpa"):
        torch.manual_seed(seed)
        cfg = self.config(vocab_size, max_positions)
        cfg._attn_implementation = attn
        self._check_heads(cfg)
        return getattr(transformers, self.model_cls)(cfg).eval()

    def _check_heads(self, cfg) -> None:
        """Refuse sizes the config does not build (a field it lacks is derived, so a spec can ask the impossible)."""
        built = head_shape(cfg)
        if built != (self.heads, self.kv_heads, self.head_dim):
            raise ValueError(f"family {self.name!r}: {self.config_cls} builds (heads, kv_heads, head_dim) = {built}, "
                             f"the spec asks {(self.heads, self.kv_heads, self.head_dim)} (a config without "
                             f"num_key_value_heads uses kv_heads = heads; without head_dim, hidden // heads)")


def head_shape(cfg) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a transformers config, with the defaults of a family lacking a field."""
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // heads


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
    """Capture and install for one model; everything family-specific comes from its `FamilySpec`, or from a
    subclass where the attention module is laid out differently (`attn_name`, `projection_hooks`)."""

    attn_name = "self_attn"       # attribute of each decoder layer holding its attention module

    def __init__(self, model, spec: FamilySpec):
        self.model, self.spec = model, spec
        cfg = model.config
        self.layers = cfg.num_hidden_layers
        self.heads, self.kv_heads, self.head_dim = head_shape(cfg)
        self.d_kv = self.kv_heads * self.head_dim
        self.d_model = cfg.hidden_size

    @property
    def backbone(self):
        """The decoder stack under the LM head: transformers' `base_model` (`model.model`, `model.gpt_neox`, ...)."""
        return self.model.base_model

    def attn(self, layer: int):
        return getattr(self.backbone.layers[layer], self.attn_name)

    def projection_hooks(self, layer: int, keep) -> list:
        """Forward hooks on one layer that call `keep(role, x)` with its "q", "k", "v" projections, x (T, heads*D)
        before any norm or RoPE. Returns the hook handles."""
        a = self.attn(layer)
        return [getattr(a, f"{role}_proj").register_forward_hook(lambda m, inp, out, role=role: keep(role, out[0]))
                for role in "qkv"]

    @torch.no_grad()
    def capture(self, ids: list[int] | torch.Tensor, want_q: bool = False, want_logits: bool = False) -> Capture:
        ids = torch.as_tensor(ids).view(1, -1)
        got = {role: [None] * self.layers for role in "qkv"}
        hooks = []
        for i in range(self.layers):
            hooks += self.projection_hooks(i, lambda role, x, i=i: got[role].__setitem__(i, x))
        try:
            if want_logits:
                logits = self.model(input_ids=ids, use_cache=False).logits[0]
            else:                              # the LM head is not needed for K/V
                self.backbone(input_ids=ids, use_cache=False)
                logits = None
        finally:
            for h in hooks:
                h.remove()
        return Capture(got["k"], got["v"], got["q"] if want_q else None, logits)

    def heads_view(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        """(T, n_heads*D) -> (n_heads, T, D)."""
        return x.view(x.shape[0], n_heads, self.head_dim).transpose(0, 1)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (H, T, D) rotated with the model's own rotary embedding at `positions` (T,)."""
        cos, sin = self.backbone.rotary_emb(x, positions.view(1, -1))     # (1, T, R), R <= D
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if cos.shape[-1] == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        # partial rotary (GPT-NeoX, Phi): the first R dims rotate, the rest carry no position
        r = cos.shape[-1]
        rotated = x[..., :r] * cos + rotate_half(x[..., :r]) * sin
        return torch.cat((rotated, x[..., r:]), dim=-1)

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


class GPTNeoXAdapter(Adapter):
    """GPT-NeoX (Pythia): the attention is `layers[i].attention`, with one fused `query_key_value` projection whose
    output holds, per head, that head's [q | k | v] (hidden = heads * D, no GQA). Its partial rotary (`rotary_pct`)
    needs nothing here: `Adapter.rope` rotates the dims the model's rotary embedding covers."""

    attn_name = "attention"

    def projection_hooks(self, layer: int, keep) -> list:
        def split(module, inputs, out):                                   # out (1, T, H * 3 * D)
            q, k, v = out[0].view(out.shape[1], self.heads, 3, self.head_dim).unbind(2)    # (T, H, D) each
            for role, x in zip("qkv", (q, k, v)):
                keep(role, x.reshape(x.shape[0], -1))                                     # (T, H*D)

        return [self.attn(layer).query_key_value.register_forward_hook(split)]


def attention(q: torch.Tensor, k: torch.Tensor, group: torch.Tensor, scaling: float, offset: int = 0):
    """Causal attention probabilities P (H, Tq, Tk) of post-RoPE q (H, Tq, D) against k (Hkv, Tk, D).

    Query row r sits at absolute position offset + r; key c at position c.
    """
    scores = torch.einsum("htd,hsd->hts", q, k[group]) * scaling
    tq, tk = q.shape[1], k.shape[1]
    mask = torch.arange(tk)[None, :] > (torch.arange(tq)[:, None] + offset)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
