"""The MoL2 pointer head, its option cache, and the Contextual-MoL q/k head.

Option side (query-independent, computed once per adapter set): token embeddings of "route prompt + description"
-> projection + positions -> residual MLP blocks -> self-attention within each option -> norm. The cache keeps the
option tokens' cross-attention K/V and each option's pointer key, and the same folded with the query side's
cross-attention query/output and pointer projections (a decision over the whole set is then three matmuls around
the norms and the MLP). Query side (per decision): norm + projection of H19 pooled over the user turn, one
cross-attention over the candidates' tokens, then q.k against the pointer keys.

`PointerHead.forward` is the plain reference (every projection computed inline); `encode_options` + `score` is the
cached path serving uses. The tests compare the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ced.model import RMSNorm

from .config import RouterConfig

NEG_INF = float("-inf")



def _spread(rows: Tensor) -> Tensor:
    """Per-column std of (n, C) rows for standardizing; a single row (std undefined) counts as spread 0, and the
    clamp keeps the scale finite."""
    rows = rows.float()
    return (rows.std(0) if len(rows) > 1 else torch.zeros(rows.shape[1:])).clamp(min=1e-6)


class MLPBlock(nn.Module):
    """x + down(gelu(up(norm(x))))."""

    def __init__(self, config: RouterConfig):
        super().__init__()
        d, f = config.d_model, config.mlp_ratio * config.d_model
        self.norm = RMSNorm(d, config.norm_eps)
        self.up, self.down = nn.Linear(d, f), nn.Linear(f, d)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.dropout(self.down(F.gelu(self.up(self.norm(x)))))


class AttentionBlock(nn.Module):
    """x + o(attend(q(norm(x)), k(norm(ctx)), v(norm(ctx)))); self-attention when ctx is x.

    `project_kv` + `attend` split the same computation so a context's K/V can be computed once and cached."""

    def __init__(self, config: RouterConfig):
        super().__init__()
        d = config.d_model
        self.heads, self.head_dim = config.n_heads, config.head_dim
        self.norm = RMSNorm(d, config.norm_eps)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.dropout = nn.Dropout(config.dropout)

    def _split(self, x: Tensor) -> Tensor:  # (..., S, d) -> (..., H, S, hd)
        return x.unflatten(-1, (self.heads, self.head_dim)).transpose(-3, -2)

    def project_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """context (..., S, d) -> K, V (..., H, S, hd)."""
        c = self.norm(context)
        return self._split(self.k(c)), self._split(self.v(c))

    def attend(self, x: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """x (..., T, d) reads K/V (..., H, S, hd); mask (..., S) True where a key is real."""
        q = self._split(self.q(self.norm(x)))  # (..., H, T, hd)
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, NEG_INF)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + bias[..., None, None, :]  # (..., H, T, S)
        out = scores.softmax(-1) @ v  # (..., H, T, hd)
        return x + self.dropout(self.o(out.transpose(-3, -2).flatten(-2)))

    def forward(self, x: Tensor, context: Tensor, mask: Tensor) -> Tensor:
        k, v = self.project_kv(context)
        return self.attend(x, k, v, mask)

    @torch.no_grad()
    def fold(self, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """A fixed context's K/V (1, H, S, hd) with the q and o projections folded in (exact algebra): the score
        weights (d, H*S), the score bias (1, H*S) (q's bias, -inf on padded keys) and the value-output rows
        (H*S, d), so that attending to that context is `attend_folded`, two matmuls."""
        H, hd = self.heads, self.head_dim
        k, v = k[0], v[0]
        scale = 1 / math.sqrt(hd)
        weights = torch.einsum("hsk,hkd->hsd", k, self.q.weight.view(H, hd, -1)) * scale
        bias = torch.einsum("hsk,hk->hs", k, self.q.bias.view(H, hd)) * scale
        bias = bias.masked_fill(~mask.reshape(1, -1), NEG_INF)
        values = torch.einsum("hsk,dhk->hsd", v, self.o.weight.view(-1, H, hd))
        return weights.flatten(0, 1).T.contiguous(), bias.reshape(1, -1), values.flatten(0, 1).contiguous()

    def attend_folded(self, x: Tensor, weights: Tensor, bias: Tensor, values: Tensor) -> Tensor:
        """`attend` (eval) for x (B, d) over a context folded by `fold`."""
        scores = torch.addmm(bias, self.norm(x), weights)  # (B, H*S)
        probs = scores.view(x.shape[0], self.heads, -1).softmax(-1).view(x.shape[0], -1)
        return x + torch.addmm(self.o.bias, probs, values)


@dataclass
class OptionCache:
    """The option side of one candidate set, computed once: everything a decision reads."""

    mask: Tensor  # (N, T) True on real tokens
    cross_k: Tensor  # (1, H, N*T, hd): the cross-attention keys of every option token, options side by side
    cross_v: Tensor  # (1, H, N*T, hd)
    keys: Tensor  # (N, d): pointer keys
    names: tuple[str, ...] = ()
    # the same, folded with the query-side projections for a decision over the whole set (`PointerHead.score`):
    folded_cross: tuple[Tensor, Tensor, Tensor] | None = None  # `AttentionBlock.fold`
    folded_pointer: tuple[Tensor, Tensor] | None = None  # (d, N) weights and (N,) bias: keys with pointer_q

    def __len__(self) -> int:
        return self.keys.shape[0]


class PointerHead(nn.Module):
    def __init__(self, config: RouterConfig):
        super().__init__()
        self.config = config
        C, d = config.hidden_size, config.d_model
        # query side: light. Pooled H19 share a large common component across inputs: the shift/scale buffers
        # (per-feature mean and 1/std over the training queries, set by `set_query_stats`) standardize it first.
        self.register_buffer("query_shift", torch.zeros(C))
        self.register_buffer("query_scale", torch.ones(C))
        self.query_norm = RMSNorm(C, config.norm_eps)
        self.query_proj = nn.Linear(C, d)
        # option side: deep
        self.option_proj = nn.Linear(C, d)
        self.option_pos = nn.Parameter(torch.zeros(config.max_option_tokens, d))
        self.option_mlps = nn.ModuleList(MLPBlock(config) for _ in range(config.option_mlp_layers))
        self.option_attn = nn.ModuleList(AttentionBlock(config) for _ in range(config.option_attn_layers))
        self.option_attn_mlps = nn.ModuleList(MLPBlock(config) for _ in range(config.option_attn_layers))
        self.option_norm = RMSNorm(d, config.norm_eps)
        # one cross-attention layer, then the pointer
        self.cross = AttentionBlock(config)
        self.cross_mlp = MLPBlock(config)
        self.pointer_norm = RMSNorm(d, config.norm_eps)
        self.pointer_q, self.pointer_k = nn.Linear(d, d), nn.Linear(d, d)
        nn.init.normal_(self.option_pos, std=0.02)

    # -- the two sides ---------------------------------------------------------------------------------------

    def option_tokens(self, embeds: Tensor, mask: Tensor) -> Tensor:
        """embeds (N, T, C) token embeddings of route prompt + description, mask (N, T) -> states (N, T, d)."""
        T = embeds.shape[1]
        if T > self.config.max_option_tokens:
            raise ValueError(f"options of {T} tokens exceed max_option_tokens={self.config.max_option_tokens}")
        x = self.option_proj(embeds) + self.option_pos[:T]  # (N, T, d)
        for mlp in self.option_mlps:
            x = mlp(x)
        for attn, mlp in zip(self.option_attn, self.option_attn_mlps):
            x = mlp(attn(x, x, mask))  # within each option only
        return self.option_norm(x)

    def option_keys(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """Mean over each option's real tokens, then the pointer's key projection: (N, d)."""
        m = mask.unsqueeze(-1).to(tokens.dtype)
        return self.pointer_k((tokens * m).sum(1) / m.sum(1).clamp(min=1))

    @torch.no_grad()
    def set_query_stats(self, pooled_h19: Tensor) -> None:
        """Standardize queries with the mean and std of training queries (n, C)."""
        self.query_shift.copy_(pooled_h19.float().mean(0))
        self.query_scale.copy_(1.0 / _spread(pooled_h19))

    def query(self, pooled_h19: Tensor) -> Tensor:
        """pooled H19 (B, C) -> (B, d)."""
        return self.query_proj(self.query_norm((pooled_h19 - self.query_shift) * self.query_scale))

    def pointer(self, q: Tensor, keys: Tensor, candidate_mask: Tensor) -> Tensor:
        """q (B, d) refined query, keys (B or 1, N, d) -> logits (B, N), -inf on padded candidates."""
        q = self.pointer_q(self.pointer_norm(q))
        logits = torch.matmul(keys, q.unsqueeze(-1)).squeeze(-1) / math.sqrt(self.config.d_model)  # (B, N)
        return logits.masked_fill(~candidate_mask, NEG_INF)

    # -- reference path: everything inline -------------------------------------------------------------------

    def forward(self, pooled_h19: Tensor, embeds: Tensor, mask: Tensor, candidates: Tensor | None = None,
                candidate_mask: Tensor | None = None) -> Tensor:
        """Logits (B, N) for queries (B, C) over options embeds (U, T, C) / mask (U, T).

        `candidates` (B, N) indexes each query's own candidate set into the U options (default: all U, every
        query), `candidate_mask` (B, N) marks real candidates (padding False)."""
        B, U = pooled_h19.shape[0], embeds.shape[0]
        candidates, candidate_mask = _candidates(B, U, candidates, candidate_mask)
        tokens = self.option_tokens(embeds, mask)  # (U, T, d)
        keys = self.option_keys(tokens, mask)[candidates]  # (B, N, d)
        context = tokens.flatten(0, 1).unsqueeze(0)  # (1, U*T, d): every option token, read through a mask
        context_mask = _context_mask(candidates, candidate_mask, mask)  # (B, U*T)
        q = self.query(pooled_h19).unsqueeze(1)  # (B, 1, d)
        k, v = self.cross.project_kv(context)  # inline: (1, H, U*T, hd)
        q = self.cross_mlp(self.cross.attend(q, k, v, context_mask))[:, 0]  # (B, d)
        return self.pointer(q, keys, candidate_mask)

    # -- cached path: the option side once, then a decision per query ---------------------------------------

    def encode_options(self, embeds: Tensor, mask: Tensor, names: tuple[str, ...] = ()) -> OptionCache:
        tokens = self.option_tokens(embeds, mask)
        k, v = self.cross.project_kv(tokens.flatten(0, 1).unsqueeze(0))  # (1, H, N*T, hd)
        keys = self.option_keys(tokens, mask)
        with torch.no_grad():
            scale = 1 / math.sqrt(self.config.d_model)
            pointer = ((keys @ self.pointer_q.weight).T.contiguous() * scale, keys @ self.pointer_q.bias * scale)
        return OptionCache(mask.clone(), k, v, keys, tuple(names), self.cross.fold(k, v, mask), pointer)

    def score(self, pooled_h19: Tensor, cache: OptionCache, candidates: Tensor | None = None,
              candidate_mask: Tensor | None = None) -> Tensor:
        """Logits (B, N) from the cache: the query projection, the cross-attention and the pointer only."""
        B, (U, T) = pooled_h19.shape[0], cache.mask.shape
        if candidates is None and cache.folded_cross is not None and not self.training:  # serving: 3 matmuls
            q = self.cross_mlp(self.cross.attend_folded(self.query(pooled_h19), *cache.folded_cross))
            return torch.addmm(cache.folded_pointer[1], self.pointer_norm(q), cache.folded_pointer[0])
        q = self.query(pooled_h19).unsqueeze(1)  # (B, 1, d)
        k, v = cache.cross_k, cache.cross_v  # (1, H, U*T, hd)
        if candidates is None:  # every query against the whole cached set: no gather, no membership mask
            keys, candidate_mask = cache.keys.unsqueeze(0), torch.ones(1, U, dtype=torch.bool)
            context_mask = cache.mask.reshape(1, U * T)
        else:
            candidates, candidate_mask = _candidates(B, U, candidates, candidate_mask)
            keys, context_mask = cache.keys[candidates], _context_mask(candidates, candidate_mask, cache.mask)
        q = self.cross_mlp(self.cross.attend(q, k, v, context_mask))[:, 0]  # (B, d)
        return self.pointer(q, keys, candidate_mask)


def _candidates(B: int, U: int, candidates: Tensor | None, candidate_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    if candidates is None:
        candidates = torch.arange(U).expand(B, U)
    if candidate_mask is None:
        candidate_mask = torch.ones(candidates.shape, dtype=torch.bool)
    return candidates, candidate_mask


def _context_mask(candidates: Tensor, candidate_mask: Tensor, token_mask: Tensor) -> Tensor:
    """(B, U*T): which option tokens each query's cross-attention reads (its own real candidates' real tokens)."""
    B, U = candidates.shape[0], token_mask.shape[0]
    member = torch.zeros(B, U + 1, dtype=torch.bool)  # column U collects the padded candidates
    member[torch.arange(B)[:, None], candidates.masked_fill(~candidate_mask, U)] = True
    member = member[:, :U]
    return (member[:, :, None] & token_mask[None]).flatten(1, 2)


class QKHead(nn.Module):
    """Contextual MoL's head: score = q(H19 of the query) . k(H19 of each option encoded after the query)."""

    def __init__(self, hidden_size: int, d_model: int = 128, norm_eps: float = 1e-5):
        super().__init__()
        self.hidden_size, self.d_model = hidden_size, d_model
        self.q_norm, self.k_norm = RMSNorm(hidden_size, norm_eps), RMSNorm(hidden_size, norm_eps)
        for name in ("q_shift", "k_shift"):
            self.register_buffer(name, torch.zeros(hidden_size))
        for name in ("q_scale", "k_scale"):
            self.register_buffer(name, torch.ones(hidden_size))
        self.q = nn.Sequential(nn.Linear(hidden_size, d_model), nn.GELU(), nn.Linear(d_model, d_model))
        self.k = nn.Sequential(nn.Linear(hidden_size, d_model), nn.GELU(), nn.Linear(d_model, d_model))

    def forward(self, query: Tensor, options: Tensor, candidate_mask: Tensor) -> Tensor:
        """query (B, C), options (B, N, C) pooled H19 -> logits (B, N), -inf on padded candidates."""
        q = self.q(self.q_norm((query - self.q_shift) * self.q_scale))  # (B, d)
        k = self.k(self.k_norm((options - self.k_shift) * self.k_scale))  # (B, N, d)
        logits = torch.einsum("bd,bnd->bn", q, k) / math.sqrt(self.d_model)
        return logits.masked_fill(~candidate_mask, NEG_INF)


    @torch.no_grad()
    def set_query_stats(self, query: Tensor, options: Tensor | None = None) -> None:
        """Standardize queries (n, C) and options (m, C) with the training data's mean and std."""
        self.q_shift.copy_(query.float().mean(0))
        self.q_scale.copy_(1.0 / _spread(query))
        if options is not None:
            self.k_shift.copy_(options.float().mean(0))
            self.k_scale.copy_(1.0 / _spread(options))


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
