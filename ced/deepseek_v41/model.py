"""DeepSeek-V4.1's backbone as plain torch modules whose `state_dict()` keys are the release's native names
(`embed.weight`, `layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`, `layers.N.hc_attn_fn`, ...).

Every layer: mHC streams collapse (with the previous site's lagged pre-mix) into one input; MQA over one shared
K=V latent: a window of the last W latents plus, from the first KV source up, the top-k entries of the global KV
of its group's source; a learnable sink per head; then a MoE FFN. The forward is split like `ced/model.py`'s:

- `shared_stage`: layers 0..E-1 and layer E's attention. Adapter-free; writes the encoder windows, every global
  KV (layer E's is the only one the decoder reads) and layer E's top-k and candidate pool. Its layer E-1 output
  is H19, the streams (B, T, hc, C).
- `decoder_stage`: layer E's FFN and layers E+1..L-1 from layer E's post-attention streams, under whatever
  adapter is applied from outside (`ced.deepseek_v41.adapters`).

Both read and write conversation state only through `ced.deepseek_v41.state.V41Cache` (or its verbs over many
conversations at their own positions, `ced.deepseek_v41.batch.RowsCache`: a batched decode step).
`forward(input_ids)` runs both over the whole sequence in chunks: the oracle.

Rules this file pins where the reference leaves them open (choices made here, not read from a source):
- Ties in every top-k (indexer entries, candidate blocks) go to the most recent entry (`ced.model.top_k_recent`,
  exact zeros included: -0.0 equals 0.0). ReLU scores tie at exactly zero often; without a rule, a batch of
  queries and one query pick differently (the reference measured 6e-2 in transformers' V4).
- A candidate block's score is the largest score of its visible entries; the candidate source's own top-k is
  over all entries, later index sources (`uses_candidates`) score only entries inside its pool.
- A group (entry k, positions k*r .. k*r+r-1) is visible to a query once the query has reached its last position.
- The shared expert's SwiGLU is not clamped; routed experts clamp at `swiglu_limit` (the config's field says
  "routed experts").
- The release's FP8 window and FP4 compressed-KV fake quantisation (QAT) is not modelled: latents stay in the
  engine's dtype.

Engram is refused: a config with `engram_layer_ids` raises `V41ConfigError` naming the layers. Its hashing
(tokenizer-derived compressed vocabulary, prime-bucket n-gram hashes) is not specified in the sources this
project may read closely enough to compute the release's numbers, and a guess would run silently wrong.
DSpark (`mtp.*`) and the vision tower (`vision.*`, `aligner.*`, `image_*`) are load-and-skip: they never change
the backbone's next-token logits (DSpark only drafts, vision only embeds images), so a loader drops their
tensors with one logged line (`skipped_tensors`).
"""

from __future__ import annotations

import logging
import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..model import top_k_recent
from ..state import Selection
from .config import V41Config, V41ConfigError, V41LayerRole
from .state import LatentStore, LatentWindow, V41Cache

log = logging.getLogger(__name__)
NEG_INF = float("-inf")
SKIPPED_PREFIXES = ("mtp.", "vision.", "aligner.", "image_")  # DSpark and the vision tower: load-and-skip
F32_SUFFIXES = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                "attn_sink", "gate.bias", "gate.bias_vl")  # stored (and kept) in float32, as in the release


def skipped_tensors(names) -> list[str]:
    """The checkpoint tensors this engine drops (DSpark, vision); logs one line when there are any."""
    skipped = [name for name in names if name.startswith(SKIPPED_PREFIXES)]
    if skipped:
        log.info("deepseek_v41: skipping %d DSpark/vision tensors (%s...): the backbone does not use them",
                 len(skipped), ", ".join(sorted({n.split(".")[0] for n in skipped})))
    return skipped


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        return (self.weight.float() * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


# -- rotary: interleaved pairs on the trailing qk_rope_head_dim dims ---------------------------------------------

def rope_inv_freq(config: V41Config, kind: str) -> Tensor:
    """(R/2,) frequencies of the main rope (theta rope_theta) or the compress rope (compress_rope_theta with YaRN:
    wavelengths past the original context are slowed by `factor`, with a linear ramp between beta_fast and
    beta_slow rotations; no attention scaling)."""
    dim = config.qk_rope_head_dim
    base = config.rope_theta if kind == "main" else config.compress_rope_theta
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if kind == "main":
        return inv
    original, factor = config.rope_scaling_original_max_position_embeddings, config.rope_scaling_factor

    def dim_of(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times in the context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_of(config.rope_scaling_beta_fast)), 0)
    high = min(math.ceil(dim_of(config.rope_scaling_beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def rope_tables(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin (..., T, R/2) at absolute positions (..., T), in float32."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    return angles.cos(), angles.sin()


def rope_for(inv_freqs: dict[str, Tensor], positions: Tensor) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
    """{"main"|"compress": (inv_freq, cos, sin)} at positions (1, T) shared by the rows (cos/sin (T, R/2)), or
    (B, T) of each row's own (a batched decode step: cos/sin (B, T, R/2)): what a stage's layers share."""
    rows = positions[0] if positions.shape[0] == 1 else positions
    return {kind: (inv_freq, *rope_tables(rows, inv_freq)) for kind, inv_freq in inv_freqs.items()}


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Rotate the trailing R = 2 * cos.shape[-1] dims of x in interleaved pairs (2i, 2i+1); `cos`/`sin` broadcast
    against x[..., :R/2]. `inverse` rotates by -angle (the attention output's rope slice)."""
    R = 2 * cos.shape[-1]
    sin = -sin if inverse else sin
    rope = x[..., -R:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    # reshape to the known shape, not flatten: an exported graph may rotate zero entries, and ONNX cannot infer a -1
    # from a size-0 tensor
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).reshape(rope.shape)
    return torch.cat([x[..., :-R], rotated.to(x.dtype)], dim=-1)


# -- mHC: hc_mult residual streams -------------------------------------------------------------------------------

def hc_weights(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, config: V41Config) -> tuple[Tensor, Tensor, Tensor]:
    """From streams x (B, T, n, C): pre (B, T, n), post (B, T, n) and comb (B, T, n, n), doubly stochastic after
    Sinkhorn-Knopp. One projection for all three; in V4.1 `pre` is consumed by the *next* site (lagged). Without
    gradients, in float32 on the CPU, the native kernel computes them (ced/kernels: ~60 small torch operations a
    site, Sinkhorn's 20 rounds most of them, were most of a short prefill's time), position by position as a decode
    step does."""
    if kernels.enabled() and x.dtype == fn.dtype == torch.float32 and x.device.type == "cpu":
        return kernels.v41_hc_weights(x, fn, base, scale, config.hc_sinkhorn_iters, config.rms_norm_eps,
                                      config.hc_eps)
    n = config.hc_mult
    flat = x.flatten(2).float()  # (B, T, n*C)
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
    mixes = F.linear(flat, fn.float())  # (B, T, (2+n)*n)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + config.hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + config.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + config.hc_eps)
    for _ in range(config.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + config.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + config.hc_eps)
    return pre, post, comb


def hc_collapse(x: Tensor, pre: Tensor) -> Tensor:
    """(B, T, n, C) weighted by pre (B, T, n) -> (B, T, C)."""
    return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)


def hc_expand(x: Tensor, out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """The site's output (B, T, C) spread by post, plus the streams (B, T, n, C) mixed by comb^T."""
    return post.to(x.dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(x.dtype).transpose(-1, -2), x)


# -- attention ---------------------------------------------------------------------------------------------------

class Compressor(nn.Module):
    """KV sources only: each complete group of `ratio` inputs -> one latent (softmax-gated pool in fp32 at ratio
    >= 2, a plain projection at ratio 1), normed, rotated at the group's first position."""

    def __init__(self, config: V41Config, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(config.hidden_size, config.head_dim, bias=False)
        self.wgate = nn.Linear(config.hidden_size, config.head_dim, bias=False) if ratio > 1 else None
        self.norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, groups: Tensor) -> Tensor:
        """groups (B, N', r, C) -> latents (B, N', D), before RoPE."""
        kv = self.wkv(groups)  # (B, N', r, D)
        if self.wgate is None:
            return self.norm(kv[:, :, 0])
        weights = self.wgate(groups).float().softmax(dim=2)  # per-dim softmax over the group's positions
        return self.norm((kv.float() * weights).sum(dim=2)).to(groups.dtype)


class Indexer(nn.Module):
    """Queries (`wq_b` from the query's low-rank residual, `weights_proj`) on index sources; keys (`wk`, `k_norm`
    over a source's pre-RoPE latent) on KV sources. Score: sum_h w_h * ReLU(q_h . k)."""

    def __init__(self, config: V41Config, role: V41LayerRole):
        super().__init__()
        self.config, self.role = config, role
        nI, dI = config.index_n_heads, config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, nI * dI, bias=False) if role.is_index_source else None
        self.weights_proj = nn.Linear(config.hidden_size, nI, bias=False) if role.is_index_source else None
        self.wk = nn.Linear(config.head_dim, dI, bias=False) if role.is_kv_source else None
        self.k_norm = RMSNorm(dI, config.rms_norm_eps) if role.is_kv_source else None

    def keys(self, latent: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return apply_rope(self.k_norm(self.wk(latent)), cos, sin)  # (B, N', I)

    def scores(self, xn: Tensor, q_residual: Tensor, keys: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """(B, T, N) float32 scores of every entry for queries at xn (B, T, C); cos/sin (.., T, R/2)."""
        B, T, _ = xn.shape
        nI, dI = self.config.index_n_heads, self.config.index_head_dim
        q = apply_rope(self.wq_b(q_residual).view(B, T, nI, dI), cos.unsqueeze(-2), sin.unsqueeze(-2))
        per_head = torch.matmul(q.float(), keys.float().transpose(1, 2).unsqueeze(1)).relu() * dI ** -0.5  # (B,T,h,N)
        weights = self.weights_proj(xn).float() * nI ** -0.5  # (B, T, h)
        return torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2)  # (B, T, N)

    def select_in_pool(self, xn: Tensor, q_residual: Tensor, keys: Tensor, cos: Tensor, sin: Tensor,
                       positions: Tensor, ratio: int, pool: Selection, graph: bool = False) -> Selection:
        """Top-k entries for a later index source, scoring only the entries of the candidate blocks (B, T, P): its
        work is O(pool) per query, not O(context). The pool's entries are taken in entry order, so the tie rule
        (the most recent wins) is the one `select` applies over all entries."""
        config, (B, N, _) = self.config, keys.shape
        bs, T = config.candidate_block_size, xn.shape[1]
        n_blocks = (N + bs - 1) // bs  # not -(-N // bs): ONNX divides integers toward zero
        blocks = torch.where(pool.valid, pool.idx, n_blocks).sort(dim=-1).values  # (B, T, P), invalid ones last
        entries = (blocks[..., None] * bs + torch.arange(bs, device=keys.device)).flatten(-2)  # (B, T, P*bs)
        inside = entries < N
        picked = keys[torch.arange(B, device=keys.device)[:, None, None], entries.clamp(max=N - 1)]  # (B,T,M,I)
        nI, dI = config.index_n_heads, config.index_head_dim
        q = apply_rope(self.wq_b(q_residual).view(B, T, nI, dI), cos.unsqueeze(-2), sin.unsqueeze(-2))
        per_head = torch.einsum("bthd,btmd->bthm", q.float(), picked.float()).relu() * dI ** -0.5  # (B, T, h, M)
        weights = self.weights_proj(xn).float() * nI ** -0.5  # (B, T, h)
        scores = torch.einsum("bth,bthm->btm", weights, per_head)  # (B, T, M)
        visible = inside & ((entries + 1) * ratio - 1 <= positions[..., None])
        top = _top_k(scores.masked_fill(~visible, NEG_INF), config.index_topk, graph)
        idx = entries.gather(-1, top.idx).masked_fill(~top.valid, 0)
        return Selection(idx, top.valid)

    def select(self, scores: Tensor, positions: Tensor, ratio: int, pool: Selection | None,
               graph: bool = False) -> tuple[Selection, Selection | None]:
        """Top-k entries (and, at the candidate source, the candidate pool) from scores (B, T, N). `graph`: the
        form traced for export (N unknown, maybe 0: `_top_k`'s)."""
        config, (B, T, N) = self.config, scores.shape
        group_end = (torch.arange(N, device=scores.device) + 1) * ratio - 1
        scores = scores.masked_fill(group_end[None, None] > positions[..., None], NEG_INF)
        bs = config.candidate_block_size
        if self.role.uses_candidates and pool is not None:  # only entries inside the candidate blocks
            allowed = scores.new_zeros(B, T, N // bs + 2, dtype=torch.bool)
            allowed.scatter_(2, torch.where(pool.valid, pool.idx, N // bs + 1), True)
            block = torch.arange(N, device=scores.device) // bs
            scores = scores.masked_fill(~allowed[:, :, block], NEG_INF)
        new_pool = None
        if self.role.is_candidate_source and config.candidate_topk_blocks:
            n_blocks = (N + bs - 1) // bs  # not -(-N // bs): ONNX divides integers toward zero
            blocks = F.pad(scores, (0, n_blocks * bs - N), value=NEG_INF).view(B, T, n_blocks, bs).amax(-1)
            new_pool = _top_k(blocks, config.candidate_topk_blocks, graph)
        return _top_k(scores, config.index_topk, graph), new_pool


def _last(choice: Selection | None) -> Selection | None:
    return None if choice is None else Selection(choice.idx[:, -1:], choice.valid[:, -1:])


def _top_k(scores: Tensor, k: int, graph: bool = False) -> Selection:
    """The k best entries (ties to the most recent), padded with invalid slots where fewer exist. An invalid
    slot points at entry 0, whatever the call saw: a choice does not depend on how many entries existed.

    `graph`: the form traced into an exported graph, where the number of entries is unknown (maybe under k, maybe
    0) and `min` would be frozen at the traced one: k columns of -inf go in front of the oldest entry, so there are
    always k candidates, and `top_k_recent`'s graph form (ONNX TopK on the flipped scores) keeps the tie rule. A pad
    or a masked entry is -inf, so invalid, so entry 0: the same Selection as the eager form's."""
    if graph:
        idx, values = top_k_recent(F.pad(scores, (k, 0), value=NEG_INF), k, graph=True)
        valid = values > NEG_INF
        return Selection((idx - k).clamp(min=0).masked_fill(~valid, 0), valid)
    n = min(k, scores.shape[-1])
    idx, values = top_k_recent(scores.contiguous(), n)
    valid = values > NEG_INF
    idx = idx.masked_fill(~valid, 0)
    if n < k:
        idx, valid = F.pad(idx, (0, k - n)), F.pad(valid, (0, k - n))
    return Selection(idx, valid)


class GroupedLinear(nn.Linear):
    """Block-diagonal linear: weight (G*R, in) holds G blocks of R rows; group g of the input (..., G, in) meets
    only block g: (..., G, R)."""

    def __init__(self, in_features: int, out_features: int, groups: int):
        super().__init__(in_features, out_features, bias=False)
        self.groups = groups

    def forward(self, x: Tensor) -> Tensor:
        return torch.einsum("...gi,gri->...gr", x, self.weight.view(self.groups, -1, self.in_features))


class Attention(nn.Module):
    def __init__(self, config: V41Config, role: V41LayerRole):
        super().__init__()
        self.config, self.role = config, role
        C, H, D, Q = config.hidden_size, config.num_attention_heads, config.head_dim, config.q_lora_rank
        G, R = config.o_groups, config.o_lora_rank
        self.wq_a = nn.Linear(C, Q, bias=False)
        self.q_norm = RMSNorm(Q, config.rms_norm_eps)
        self.wq_b = nn.Linear(Q, H * D, bias=False)  # no per-head norm after it (V4 had one)
        self.wkv = nn.Linear(C, D, bias=False)
        self.kv_norm = RMSNorm(D, config.rms_norm_eps)
        self.wo_a = GroupedLinear(H * D // G, G * R, G)  # group g maps its H/G heads to R dims
        self.wo_b = nn.Linear(G * R, C, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.compressor = Compressor(config, role.ratio) if role.is_kv_source else None
        has_indexer = role.is_kv_source or role.is_index_source
        self.indexer = Indexer(config, role) if has_indexer else None

    def grouped_output(self, out: Tensor) -> Tensor:
        """(B, T, H*D) -> wo_a per group of heads -> (B, T, G*R) -> wo_b -> (B, T, C)."""
        grouped = self.wo_a(out.unflatten(-1, (self.config.o_groups, -1)))  # (B, T, G, R)
        return self.wo_b(grouped.flatten(2))

    def pool_groups(self, groups: Tensor, first: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
        """Complete groups (B, N', r, C) whose first is entry `first` (B,): latents and indexer keys (B, N', .),
        both rotated at each group's first position."""
        latent = self.compressor(groups)  # (B, N', D), before RoPE
        start = (torch.arange(groups.shape[1], device=groups.device) + first[:, None]) * self.role.ratio  # (B, N')
        cos, sin = rope_tables(start, inv_freq)
        return apply_rope(latent, cos, sin), self.indexer.keys(latent, cos, sin)

    def forward(self, xn: Tensor, positions: Tensor, rope: dict, cache: V41Cache, selection: Selection | None,
                pool: Selection | None, last_only: bool = False):
        """xn: (B, T, C) normed input at positions (1, T) (or (B, T): each row's own, a batched step); the cache
        holds what precedes them. Every position's latent goes to the window; with `last_only` only the last
        position queries: output (B, 1, C).
        `rope`: {"main"|"compress": (inv_freq, cos, sin)} at these positions. Returns (out, selection, pool)."""
        role, config = self.role, self.config
        inv_freq, cos, sin = rope[role.rope]
        q_residual = self.q_norm(self.wq_a(xn))  # (B, T, Q)
        kv = apply_rope(self.kv_norm(self.wkv(xn)), cos, sin)  # (B, T, D): K = V
        if self.compressor is not None:  # first: this chunk's complete groups are visible to its own queries
            cache.compress(role.index, xn, lambda groups, first: self.pool_groups(groups, first, inv_freq))
        keys, key_pos = cache.extend_window(role.index, kv, positions)  # (B, S, D), (1 or B, S)
        if last_only:
            xn, q_residual, positions = xn[:, -1:], q_residual[:, -1:], positions[:, -1:]
            cos, sin = cos[..., -1:, :], sin[..., -1:, :]
            selection, pool = _last(selection), _last(pool)
        B, T, _ = xn.shape
        H, D = config.num_attention_heads, config.head_dim
        q = apply_rope(self.wq_b(q_residual).view(B, T, H, D), cos.unsqueeze(-2), sin.unsqueeze(-2))  # (B, T, H, D)
        source, graph = role.kv_source, cache.graph
        has_entries = source is not None and cache.has_entries(source)  # a graph's cache: always (maybe none)
        if role.is_index_source and has_entries and role.uses_candidates and pool is not None:
            selection = self.indexer.select_in_pool(xn, q_residual, cache.index_keys(source), cos, sin, positions,
                                                    cache.ratio(source), pool, graph)  # inside the candidate blocks
        elif role.is_index_source and has_entries:  # a new choice over the source's entries
            scores = self.indexer.scores(xn, q_residual, cache.index_keys(source), cos, sin)
            selection, new_pool = self.indexer.select(scores, positions, cache.ratio(source), pool, graph)
            pool = new_pool if role.is_candidate_source else pool

        scale = D ** -0.5
        local = torch.einsum("bthd,bsd->bhts", q, keys) * scale  # (B, H, T, S)
        distance = positions[:, :, None] - key_pos[:, None, :]  # (1, T, S)
        local = local.masked_fill(((distance < 0) | (distance >= config.sliding_window))[:, None], NEG_INF)
        logits = [local]
        if has_entries and selection is not None:
            picked = cache.gather(source, selection.idx)  # (B, T, k, D)
            glob = torch.einsum("bthd,btkd->bhtk", q, picked) * scale
            logits.append(glob.masked_fill(~selection.valid[:, None], NEG_INF))
        sink = self.attn_sink.to(local.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
        # one softmax over [window | selected entries | sink], in fp32; the sink takes its share, then is dropped
        probs = torch.cat([*logits, sink], dim=-1).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs[..., : local.shape[-1]], keys.unsqueeze(1))  # (B, H, T, D)
        if len(logits) > 1:
            out = out + torch.einsum("bhtk,btkd->bhtd", probs[..., local.shape[-1]: -1], picked)
        out = apply_rope(out.transpose(1, 2), cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True)  # (B, T, H, D)
        return self.grouped_output(out.flatten(2)), selection, pool


# -- MoE FFN -----------------------------------------------------------------------------------------------------

class Expert(nn.Module):
    def __init__(self, dim: int, inner: int, limit: float | None):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inner, bias=False)  # gate
        self.w2 = nn.Linear(inner, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, inner, bias=False)  # up

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w1(x), self.w3(x)
        if self.limit:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    """Router: scores from `weight`; `bias` shifts only which experts are chosen; `bias_vl` is the image tokens'
    (unused here: text only)."""

    def __init__(self, config: V41Config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (N, C) -> expert ids (N, k) and their weights (N, k)."""
        config = self.config
        logits = F.linear(x.float(), self.weight.float())  # (N, E)
        if config.scoring_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif config.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        ids = torch.topk(scores + self.bias.float(), config.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if config.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * config.routed_scaling_factor


def _no_scope(token: Tensor) -> AbstractContextManager:
    return nullcontext()


class MoE(nn.Module):
    """Routed experts (each token to its top-k) plus the shared expert.

    `dense` selects the form traced into an exported graph (ced/deepseek_v41/onnx_stages.py sets it on its copy of
    the model): the eager loop visits the experts some token chose (`ids.unique().tolist()`, data the trace would
    freeze), the dense form runs every expert on every token and weighs each output by the routing weights, zero
    where the expert was not chosen. Same result within float rounding (the sum runs in expert order, not
    index_add's), at n_routed_experts / num_experts_per_tok times the routed FLOPs: 4x on the demo's 8 experts
    top-2, 64x at the release's 384 top-6 (a graph for that size needs a gather-by-expert form instead)."""

    dense = False

    def __init__(self, config: V41Config):
        super().__init__()
        # entered around each routed expert's call with the tokens (of the flattened batch) it computes: how a
        # per-row feature applied from outside (per-row LoRA, ced.deepseek_v41.adapters) learns whose rows they are
        self.token_scope: Callable[[Tensor], AbstractContextManager] = _no_scope
        C, F_ = config.hidden_size, config.moe_intermediate_size
        self.gate = Gate(config)
        self.experts = nn.ModuleList(Expert(C, F_, config.swiglu_limit) for _ in range(config.n_routed_experts))
        self.shared_experts = Expert(C, F_ * config.n_shared_experts, None) if config.n_shared_experts else None

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, C)
        ids, weights = self.gate(flat)  # (N, k)
        if self.dense:
            return self._dense(flat, ids, weights).view(shape)
        routed = torch.zeros_like(flat)
        for e in ids.unique().tolist():  # each chosen expert once, over its tokens
            token, slot = torch.where(ids == e)
            with self.token_scope(token):
                out = self.experts[e](flat[token])
            routed.index_add_(0, token, (out * weights[token, slot, None]).to(flat.dtype))
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(flat)
        return routed.view(shape)

    def _dense(self, flat: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """The graph form: every expert over every token, weighted by its routing weight (0 if not chosen)."""
        combine = torch.zeros(flat.shape[0], len(self.experts), dtype=weights.dtype, device=flat.device)
        combine = combine.scatter(1, ids, weights)  # (N, n_routed): a token's k weights at its experts
        routed = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            routed = routed + (expert(flat) * combine[:, e, None]).to(flat.dtype)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(flat)
        return routed


# -- layers and the model ----------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, config: V41Config, role: V41LayerRole):
        super().__init__()
        self.config, self.role = config, role
        C, n = config.hidden_size, config.hc_mult
        self.attn_norm = RMSNorm(C, config.rms_norm_eps)
        self.attn = Attention(config, role)
        self.ffn_norm = RMSNorm(C, config.rms_norm_eps)
        self.ffn = MoE(config)
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty(config.hc_dim, n * C)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(config.hc_dim)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))

    def _hc(self, site: str, x: Tensor):
        return hc_weights(x, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                          getattr(self, f"hc_{site}_scale"), self.config)

    def attention_site(self, x: Tensor, pre: Tensor, positions, rope, cache, selection, pool, last_only=False):
        """Streams x (B, T, n, C) collapsed with the previous site's pre (B, T, n); returns the new streams, this
        site's pre (for the FFN site), and the top-k and pool in force after this layer."""
        out, selection, pool = self.attn(self.attn_norm(hc_collapse(x, pre)), positions, rope, cache, selection,
                                         pool, last_only)
        if last_only:
            x = x[:, -1:]
        pre, post, comb = self._hc("attn", x)
        return hc_expand(x, out, post, comb), pre, selection, pool

    def ffn_site(self, x: Tensor, pre: Tensor) -> tuple[Tensor, Tensor]:
        out = self.ffn(self.ffn_norm(hc_collapse(x, pre)))
        pre, post, comb = self._hc("ffn", x)
        return hc_expand(x, out, post, comb), pre


@dataclass
class SharedOutput:
    h19: Tensor  # (B, T, n, C): streams out of the last encoder layer
    stream: Tensor  # (B, T, n, C): streams after the first decoder layer's attention
    pre: Tensor  # (B, T, n): that attention site's pre-mix, which the layer's FFN collapses with
    selection: Selection | None  # the first decoder layer's top-k for these positions
    pool: Selection | None  # its candidate blocks for these positions


class DeepseekV41ForCausalLM(nn.Module):
    """The backbone with native names. Constructible on `torch.device("meta")` (nothing is computed at init
    beyond filling parameters)."""

    def __init__(self, config: V41Config):
        super().__init__()
        if config.engram_layer_ids:
            raise V41ConfigError(f"Engram layers {list(config.engram_layer_ids)} are not supported by this engine "
                                 "(the n-gram hashing is not specified closely enough to reproduce); use a config "
                                 "without engram_layer_ids")
        self.config = config
        C = config.hidden_size
        self.embed = nn.Embedding(config.vocab_size, C)
        self.layers = nn.ModuleList(Block(config, role) for role in config.roles)
        self.norm = RMSNorm(C, config.rms_norm_eps)
        self.head = nn.Linear(C, config.vocab_size, bias=False)
        for name, p in self.named_parameters():  # what nn.Linear / nn.Embedding leave unset, or at zero
            if name.endswith(("hc_attn_fn", "hc_ffn_fn", "gate.weight")):
                nn.init.normal_(p, std=0.02)
            elif name.endswith(("attn_sink", "gate.bias")):
                nn.init.normal_(p, std=0.5 if name.endswith("attn_sink") else 0.02)
            if not name.endswith(F32_SUFFIXES):
                p.data = p.data.to(config.torch_dtype)
        self._inv_freq = {kind: rope_inv_freq(config, kind) for kind in ("main", "compress")}  # not in state_dict

    @classmethod
    def from_config(cls, config: V41Config, seed: int | None = None) -> "DeepseekV41ForCausalLM":
        if seed is not None:
            torch.manual_seed(seed)
        return cls(config).eval()

    def _rope(self, positions: Tensor) -> dict:
        return rope_for(self._inv_freq, positions)

    # -- the two stages ------------------------------------------------------------------------------------

    def shared_stage(self, input_ids: Tensor, positions: Tensor, cache: V41Cache) -> SharedOutput:
        """Layers 0..E-1 and layer E's attention over input_ids (B, T) at positions (1, T) (or (B, T), each row's
        own: a batched step, ced.deepseek_v41.batch), appending to cache."""
        E, n = self.config.decoder_start, self.config.hc_mult
        B, T = input_ids.shape
        x = self.embed(input_ids).unsqueeze(2).expand(B, T, n, -1).contiguous()  # (B, T, n, C)
        pre = F.one_hot(torch.zeros(B, T, dtype=torch.long, device=x.device), n).to(torch.float32)  # (B, T, n)
        rope, selection, pool, h19 = self._rope(positions), None, None, None
        for layer in self.layers[: E + 1]:
            x, pre, selection, pool = layer.attention_site(x, pre, positions, rope, cache, selection, pool)
            if layer.role.index == E:
                break
            x, pre = layer.ffn_site(x, pre)
            if layer.role.index == E - 1:
                h19 = x
        return SharedOutput(h19, x, pre, selection, pool)

    def decoder_stage(self, stream: Tensor, pre: Tensor, positions: Tensor, selection: Selection | None,
                      pool: Selection | None, cache: V41Cache, last_only: bool = False) -> Tensor:
        """Layer E's FFN and layers E+1..L-1 from the post-attention streams (B, T, n, C); returns the final
        hidden (B, T, C) (with `last_only`: the last layer queries the last position only, (B, 1, C))."""
        E = self.config.decoder_start
        x, pre = self.layers[E].ffn_site(stream, pre)
        rope = self._rope(positions)
        for layer in self.layers[E + 1:]:
            final = last_only and layer is self.layers[-1]
            x, pre, selection, pool = layer.attention_site(x, pre, positions, rope, cache, selection, pool, final)
            x, pre = layer.ffn_site(x, pre)
        return self.norm(hc_collapse(x, pre))  # the final collapse uses the last FFN site's pre

    def logits(self, hidden: Tensor) -> Tensor:
        return self.head(hidden).float()

    # -- one conversation's objects ------------------------------------------------------------------------

    def new_windows(self, layers) -> dict[int, LatentWindow]:
        return {i: LatentWindow(self.config.sliding_window) for i in layers}

    def new_stores(self) -> dict[int, LatentStore]:
        return {i: LatentStore(self.config.compress_ratios[i]) for i in self.config.kv_source_layer_ids}

    def run_shared(self, input_ids: Tensor, start: int, windows, stores) -> SharedOutput:
        return self.shared_stage(input_ids, _positions(start, input_ids.shape[1], input_ids.device),
                                 V41Cache(windows, stores, start))

    def run_decoder(self, out: SharedOutput, start: int, windows, stores, last_only: bool = False) -> Tensor:
        """`decoder_stage` over one conversation's adapter-bound windows and layer E's store (the only global KV
        the decoder reads)."""
        E = self.config.decoder_start
        positions = _positions(start, out.stream.shape[1], out.stream.device)
        return self.decoder_stage(out.stream, out.pre, positions, out.selection, out.pool,
                                  V41Cache(windows, {E: stores[E]}, start), last_only)

    def hidden(self, input_ids: Tensor, chunk_size: int = 256) -> Tensor:
        """Final hidden states (B, T, C) of the whole sequence on fresh state, `chunk_size` queries at a time.
        Differentiable (training runs it with autograd on); `forward` is this without gradients. Parameters that
        only choose (the indexer, which picks entries by top-k, and the gate's selection bias) get no gradient."""
        windows, stores = self.new_windows(range(self.config.num_hidden_layers)), self.new_stores()
        hidden = []
        for start in range(0, input_ids.shape[1], chunk_size):
            out = self.run_shared(input_ids[:, start: start + chunk_size], start, windows, stores)
            hidden.append(self.run_decoder(out, start, windows, stores))
        return torch.cat(hidden, dim=1)

    @torch.no_grad()
    def forward(self, input_ids: Tensor, chunk_size: int = 256) -> Tensor:
        """Logits (B, T, V) of the whole sequence, `chunk_size` queries at a time (the oracle)."""
        return self.logits(self.hidden(input_ids, chunk_size))


def _positions(start: int, length: int, device) -> Tensor:
    return torch.arange(start, start + length, device=device)[None]  # (1, T): shared by the rows
