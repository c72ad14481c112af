"""V4.1 component parity: `ced.deepseek_v41` against transformers' `deepseek_v4` modules, weights copied across, fp32.

transformers 5.25 has no `deepseek_v41` (reference §1.6), but V4 shares most components. Each check builds the
component on both sides at the `v41-tiny` shape, copies our native-named weights into V4's modules and compares:

- rope tables: the main rope and the compress rope with YaRN (V4's `DeepseekV4RotaryEmbedding`)
- grouped output projection: `wo_a` (o_groups blocks) + `wo_b` vs `o_a_proj` + `o_b_proj`
- sink attention over a shared latent: a whole sliding-window attention layer (low-rank query, kv_norm,
  interleaved partial RoPE, sink, inverse RoPE on the output, grouped output) vs `DeepseekV4Attention`, with V4's
  per-head query norm replaced by the identity (V4.1 has none)
- one mHC layer: both hyper-connection sites with the attention and the FFN stubbed by one fixed function, the
  lag removed (each site collapses with its own `pre`, as V4 does)
- MoE: routing (sqrtsoftplus, selection-only bias, normalised top-k x routed_scaling_factor) and the routed +
  shared experts vs `DeepseekV4SparseMoeBlock`; the clamped SwiGLU separately, with inputs large enough to clamp
- softmax-gated compressor at ratio 2 vs `DeepseekV4HCACompressor` (rate 2, position bias zero: V4.1 has none)
- ReLU indexer: scores, and top-k indices with the tie rule pinned on both sides: V4's scorer is patched to see
  our keys (V4.1's keys are `k_norm(wk(latent))`, V4's come from an overlapping compressor) and to return an
  order key that breaks ties to the most recent entry, exactly `ced.model.top_k_recent`'s rule

    python -m benchmarks.v41_parity [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager

import torch
from torch import nn

from ced.deepseek_v41.config import V41Config
from ced.deepseek_v41.model import (Attention, MoE, RMSNorm, hc_collapse, hc_expand, hc_weights, rope_for,
                                    rope_inv_freq, rope_tables)
from ced.deepseek_v41.state import LatentWindow, V41Cache

from ._report import add_plot_option, markdown_table, plot_path, save_figure, write_json

COLUMNS = ["component", "max_abs_diff", "tolerance", "passed"]
TOL = 1e-5  # fp32, values of order 1


def v4_config(config: V41Config):
    """transformers' V4 config at the same shape (layers sliding-window only; compress rates 2)."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    cfg = DeepseekV4Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        moe_intermediate_size=config.moe_intermediate_size,
        num_hidden_layers=2, num_attention_heads=config.num_attention_heads, num_key_value_heads=1,
        head_dim=config.head_dim, q_lora_rank=config.q_lora_rank, qk_rope_head_dim=config.qk_rope_head_dim,
        num_experts_per_tok=config.num_experts_per_tok, n_routed_experts=config.n_routed_experts,
        n_shared_experts=config.n_shared_experts, o_groups=config.o_groups, o_lora_rank=config.o_lora_rank,
        index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim, index_topk=config.index_topk,
        sliding_window=config.sliding_window, hc_mult=config.hc_mult, hc_sinkhorn_iters=config.hc_sinkhorn_iters,
        hc_eps=config.hc_eps, compress_ratios=[0, 0], compress_rates={"compressed_sparse_attention": 2,
                                                                       "heavily_compressed_attention": 2},
        num_hash_layers=0, max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, compress_rope_theta=config.compress_rope_theta,
        routed_scaling_factor=config.routed_scaling_factor, swiglu_limit=config.swiglu_limit,
        scoring_func=config.scoring_func, norm_topk_prob=config.norm_topk_prob,
        rope_parameters={"rope_type": "yarn", "factor": config.rope_scaling_factor,
                         "original_max_position_embeddings": config.rope_scaling_original_max_position_embeddings,
                         "beta_fast": config.rope_scaling_beta_fast, "beta_slow": config.rope_scaling_beta_slow})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def _v4():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4

    return modeling_deepseek_v4


def _copy(dst: nn.Parameter | torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dst.copy_(src.detach().to(dst.dtype))


def _row(component: str, diff: float, tolerance: float = TOL, note: str = "") -> dict:
    return dict(component=component, max_abs_diff=float(diff), tolerance=tolerance, passed=bool(diff <= tolerance),
                note=note)


def _maxdiff(*pairs) -> float:
    return max(float((a.detach().float() - b.detach().float()).abs().max()) for a, b in pairs)


def _role(config: V41Config, mode: str):
    return next(r for r in config.roles if r.mode == mode)


# -- the checks ------------------------------------------------------------------------------------------------

def check_rope(config: V41Config, T: int, seed: int) -> list[dict]:
    rotary = _v4().DeepseekV4RotaryEmbedding(v4_config(config))
    positions = torch.arange(T)[None] + 1000 * seed
    rows = []
    for kind in ("main", "compress"):
        cos, sin = rope_tables(positions, rope_inv_freq(config, kind))
        cos4, sin4 = rotary(torch.zeros(1), positions, layer_type=kind)
        rows.append(_row("compress rope tables (YaRN)" if kind == "compress" else "main rope tables",
                         _maxdiff((cos, cos4), (sin, sin4))))
    return rows


def check_grouped_output(config: V41Config, T: int, seed: int) -> list[dict]:
    torch.manual_seed(seed)
    ours = Attention(config, _role(config, "swa"))
    theirs = _v4().DeepseekV4Attention(v4_config(config), 0)
    _copy(theirs.o_a_proj.weight, ours.wo_a.weight)
    _copy(theirs.o_b_proj.weight, ours.wo_b.weight)
    x = torch.randn(2, T, config.num_attention_heads * config.head_dim)
    grouped = theirs.o_a_proj(x.reshape(2, T, config.o_groups, -1)).flatten(2)
    return [_row("grouped output projection",
                 _maxdiff((ours.grouped_output(x), theirs.o_b_proj(grouped))))]


def _sliding_mask(T: int, window: int) -> torch.Tensor:
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    visible = (j <= i) & (i - j < window)
    return torch.zeros(T, T).masked_fill(~visible, float("-inf"))[None, None]  # (1, 1, T, T)


def check_sink_attention(config: V41Config, T: int, seed: int) -> list[dict]:
    torch.manual_seed(seed)
    role = _role(config, "swa")
    ours = Attention(config, role)
    nn.init.normal_(ours.attn_sink, std=1.0)
    for norm in (ours.q_norm, ours.kv_norm):
        nn.init.normal_(norm.weight, mean=1.0, std=0.1)
    cfg = v4_config(config)
    theirs = _v4().DeepseekV4Attention(cfg, 0)
    theirs.q_b_norm = nn.Identity()  # V4.1 has no per-head norm after wq_b
    for dst, src in ((theirs.q_a_proj, ours.wq_a), (theirs.q_a_norm, ours.q_norm), (theirs.q_b_proj, ours.wq_b),
                     (theirs.kv_proj, ours.wkv), (theirs.kv_norm, ours.kv_norm), (theirs.o_a_proj, ours.wo_a),
                     (theirs.o_b_proj, ours.wo_b)):
        _copy(dst.weight, src.weight)
    _copy(theirs.sinks, ours.attn_sink)
    x = torch.randn(1, T, config.hidden_size)
    positions = torch.arange(T)[None]
    cache = V41Cache({role.index: LatentWindow(config.sliding_window)}, {}, 0)
    inv = {kind: rope_inv_freq(config, kind) for kind in ("main", "compress")}
    out, _, _ = ours(x, positions, rope_for(inv, positions), cache, None, None)
    rotary = _v4().DeepseekV4RotaryEmbedding(cfg)
    embeddings = {kind: rotary(x, positions, layer_type=kind) for kind in ("main", "compress")}
    ref, _ = theirs(x, embeddings, positions, _sliding_mask(T, config.sliding_window))
    return [_row("sink attention over a shared latent",
                 _maxdiff((out, ref)))]


def check_mhc(config: V41Config, T: int, seed: int) -> list[dict]:
    """One V4 decoder layer with attention and MoE stubbed vs our two hyper-connection sites, lag removed."""
    torch.manual_seed(seed)
    cfg = v4_config(config)
    layer = _v4().DeepseekV4DecoderLayer(cfg, 0)
    C, n = config.hidden_size, config.hc_mult
    params = {}
    for site, hc in (("attn", layer.attn_hc), ("ffn", layer.ffn_hc)):
        params[site] = (torch.randn(config.hc_dim, n * C) * 0.05, torch.randn(config.hc_dim) * 0.5,
                        torch.rand(3) + 0.5)
        for dst, src in zip((hc.fn, hc.base, hc.scale), params[site]):
            _copy(dst, src)
    norms = {site: RMSNorm(C, config.rms_norm_eps) for site in ("attn", "ffn")}
    for site, theirs in (("attn", layer.input_layernorm), ("ffn", layer.post_attention_layernorm)):
        nn.init.normal_(norms[site].weight, mean=1.0, std=0.1)
        _copy(theirs.weight, norms[site].weight)
    stub = torch.randn(C, C) / C ** 0.5
    block = lambda h: torch.tanh(h @ stub)  # noqa: E731  the same stand-in for attention and FFN, both sides

    class Stub(nn.Module):
        def __init__(self, returns_pair: bool):
            super().__init__()
            self.returns_pair = returns_pair

        def forward(self, h, *args, **kwargs):
            return (block(h), None) if self.returns_pair else block(h)

    layer.self_attn, layer.mlp = Stub(True), Stub(False)
    x = torch.randn(2, T, n, C)
    ref = layer(x)
    ours = x
    for site in ("attn", "ffn"):
        pre, post, comb = hc_weights(ours, *params[site], config)
        ours = hc_expand(ours, block(norms[site](hc_collapse(ours, pre))), post, comb)
    return [_row("one mHC layer (lag removed)", _maxdiff((ours, ref)))]


def _v4_moe(config: V41Config, ours: MoE):
    block = _v4().DeepseekV4SparseMoeBlock(v4_config(config), 1)
    _copy(block.gate.weight, ours.gate.weight)
    _copy(block.gate.e_score_correction_bias, ours.gate.bias)
    for e, expert in enumerate(ours.experts):
        _copy(block.experts.gate_up_proj[e], torch.cat([expert.w1.weight, expert.w3.weight]))
        _copy(block.experts.down_proj[e], expert.w2.weight)
    shared = ours.shared_experts
    for dst, src in ((block.shared_experts.gate_proj, shared.w1), (block.shared_experts.up_proj, shared.w3),
                     (block.shared_experts.down_proj, shared.w2)):
        _copy(dst.weight, src.weight)
    return block


def check_moe(config: V41Config, T: int, seed: int) -> list[dict]:
    torch.manual_seed(seed)
    ours = MoE(config)
    nn.init.normal_(ours.gate.weight, std=0.3)
    nn.init.normal_(ours.gate.bias, std=0.3)
    theirs = _v4_moe(config, ours)
    x = torch.randn(2, T, config.hidden_size)
    ids, weights = ours.gate(x.reshape(-1, config.hidden_size))
    _, weights4, ids4 = theirs.gate(x)
    order, order4 = ids.sort(-1), ids4.sort(-1)
    routing = max(_maxdiff((order.values, order4.values)),  # the same experts (any difference is >= 1)
                  _maxdiff((weights.gather(1, order.indices), weights4.gather(1, order4.indices))))
    # the shared expert is not clamped here (see model.py); inputs of this size never reach the limit, so the
    # whole block is comparable
    block = _maxdiff((ours(x), theirs(x)))
    # clamped SwiGLU: inputs large enough that gate and up pass the limit; every token through expert 0, weight 1
    big = torch.randn(2 * T, config.hidden_size) * 200
    expert = ours.experts[0]
    clamped = float(((expert.w1(big) > config.swiglu_limit) | (expert.w3(big).abs() > config.swiglu_limit))
                    .float().mean())
    ref = theirs.experts(big, torch.zeros(2 * T, 1, dtype=torch.long), torch.ones(2 * T, 1))
    return [_row("MoE routing", routing, note="same experts and weights"),
            _row("MoE block (routed + shared)", block),
            _row("clamped SwiGLU", _maxdiff((expert(big), ref)), 1e-5 * 200,
                 note=f"inputs x200: {clamped:.0%} of pre-activations past the limit; tolerance scaled by 200")]


def check_compressor(config: V41Config, T: int, seed: int) -> list[dict]:
    torch.manual_seed(seed)
    role = _role(config, "encoder-full")
    assert role.ratio == 2
    ours = Attention(config, role)
    nn.init.normal_(ours.compressor.norm.weight, mean=1.0, std=0.1)
    theirs = _v4().DeepseekV4HCACompressor(v4_config(config))
    _copy(theirs.kv_proj.weight, ours.compressor.wkv.weight)
    _copy(theirs.gate_proj.weight, ours.compressor.wgate.weight)
    _copy(theirs.kv_norm.weight, ours.compressor.norm.weight)
    with torch.no_grad():
        theirs.position_bias.zero_()  # V4.1 has no `ape`
    x = torch.randn(2, T, config.hidden_size)
    n = T // 2
    latent, _ = ours.pool_groups(x[:, : 2 * n].reshape(2, n, 2, -1), torch.zeros(2, dtype=torch.long),
                                 rope_inv_freq(config, "compress"))
    ref, _ = theirs(x, None, torch.arange(T)[None].expand(2, -1), None, 0)
    return [_row("softmax-gated compressor (ratio 2)",
                 _maxdiff((latent, ref[:, 0])))]


@contextmanager
def _pinned_scorer(scorer, keys: torch.Tensor, record: dict, pin: bool = True):
    """V4's scorer, fed our keys, returning an order key (score, then the most recent entry) in float64: V4's
    indexer then picks exactly what top_k_recent picks. Records V4's raw scores. `pin=False`: the raw scores, so
    V4 breaks ties its own way (torch.topk's order)."""
    original = scorer.forward

    def forward(q, compressed_kv, hidden_states):
        scores = original(q, keys, hidden_states)  # (B, S, N)
        record["scores"] = scores
        if not pin:
            return scores
        bits = (scores + 0.0).contiguous().view(torch.int32)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return (ordered.to(torch.int64) * (1 << 32) + torch.arange(scores.shape[-1])).double()

    scorer.forward = forward
    try:
        yield
    finally:
        scorer.forward = original


def check_indexer(config: V41Config, T: int, seed: int) -> list[dict]:
    torch.manual_seed(seed)
    role = _role(config, "encoder-full")
    ours = Attention(config, role)
    nn.init.normal_(ours.indexer.k_norm.weight, mean=1.0, std=0.1)
    cfg = v4_config(config)
    theirs = _v4().DeepseekV4Indexer(cfg)
    _copy(theirs.q_b_proj.weight, ours.indexer.wq_b.weight)
    _copy(theirs.scorer.weights_proj.weight, ours.indexer.weights_proj.weight)
    x = torch.randn(1, T, config.hidden_size)
    positions = torch.arange(T)[None]
    inv = rope_inv_freq(config, "compress")
    n = T // 2
    _, keys = ours.pool_groups(x[:, : 2 * n].reshape(1, n, 2, -1), torch.zeros(1, dtype=torch.long), inv)
    q_residual = ours.q_norm(ours.wq_a(x))
    cos, sin = rope_tables(positions[0], inv)
    scores = ours.indexer.scores(x, q_residual, keys, cos, sin)
    selection, _ = ours.indexer.select(scores, positions, 2, None)
    record = {}
    with _pinned_scorer(theirs.scorer, keys, record):
        picked = theirs(x, q_residual, positions, None, 0)  # (1, T, k), -1 where invalid
    with _pinned_scorer(theirs.scorer, keys, {}, pin=False):
        unpinned = theirs(x, q_residual, positions, None, 0)
    ours_idx = torch.where(selection.valid, selection.idx, -1)[..., : picked.shape[-1]]
    zeros = int((scores == 0).sum())
    loose = int((ours_idx != unpinned).sum())
    return [_row("ReLU indexer scores", _maxdiff((scores, record["scores"]))),
            _row("ReLU indexer top-k (tie rule pinned)", float((ours_idx != picked).sum()), 0.0,
                 note=f"max_abs_diff counts differing indices; {zeros} of {scores.numel()} scores are exactly 0; "
                      f"with V4's own tie order (not pinned) {loose} indices differ")]


CHECKS = [check_rope, check_grouped_output, check_sink_attention, check_mhc, check_moe, check_compressor,
          check_indexer]


def run(quick: bool = False) -> list[dict]:
    """Every check over a few seeds and lengths; each component's worst difference."""
    config = V41Config.from_name("v41-tiny")
    cases = [(24, 0)] if quick else [(24, 0), (40, 1), (64, 2)]
    worst: dict[str, dict] = {}
    with torch.no_grad():
        for check in CHECKS:
            for T, seed in cases:
                for row in check(config, T, seed):
                    key = row["component"]
                    if key not in worst or row["max_abs_diff"] > worst[key]["max_abs_diff"]:
                        worst[key] = row
                    worst[key]["passed"] = worst[key]["passed"] and row["passed"]
    return list(worst.values())


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1))
    labels = [row["component"] for row in rows]
    floor = 1e-12  # a difference of exactly zero, drawn at the floor
    ax.barh(labels, [max(row["max_abs_diff"], floor) for row in rows], color="tab:blue", label="max |diff|")
    ax.scatter([max(row["tolerance"], floor) for row in rows], labels, color="tab:red", marker="|", s=200,
               label="tolerance")
    ax.set_xscale("log")
    ax.set_xlabel("max absolute difference vs transformers deepseek_v4 (fp32)")
    ax.invert_yaxis()
    ax.legend(loc="lower right")
    save_figure(figure, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, one length")
    parser.add_argument("--json", default=None)
    add_plot_option(parser, "artifacts/benchmarks/v41_parity.png")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = run(args.quick)
    print(markdown_table(rows, COLUMNS))
    for row in rows:
        if row["note"]:
            print(f"- {row['component']}: {row['note']}")
    write_json(rows, args.json)
    if plot_path(args):
        plot(rows, plot_path(args))
    return 0 if all(row["passed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
