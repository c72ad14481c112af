"""The V4.1 model: native state_dict names and dtypes, one pass == chunked == token by token (top-k and candidate
pool included, ties pinned), the stage split, meta construction, DSpark/vision load-and-skip."""

import logging

import pytest
import torch

from ced.deepseek_v41.model import DeepseekV41ForCausalLM, skipped_tensors
from ced.deepseek_v41.state import V41Cache

TOKENS = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def model(tiny_v41):
    return DeepseekV41ForCausalLM.from_config(tiny_v41, seed=0)


def test_state_dict_has_the_native_names(model, tiny_v41):
    keys = set(model.state_dict())
    assert {"embed.weight", "norm.weight", "head.weight"} <= keys
    for i, role in enumerate(tiny_v41.roles):
        p = f"layers.{i}."
        for name in ("attn.wq_a.weight", "attn.q_norm.weight", "attn.wq_b.weight", "attn.wkv.weight",
                     "attn.kv_norm.weight", "attn.wo_a.weight", "attn.wo_b.weight", "attn.attn_sink",
                     "attn_norm.weight",
                     "ffn_norm.weight", "ffn.gate.weight", "ffn.gate.bias", "ffn.gate.bias_vl",
                     "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight",
                     "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale"):
            assert p + name in keys
        for e in range(tiny_v41.n_routed_experts):
            assert all(f"{p}ffn.experts.{e}.{w}.weight" in keys for w in ("w1", "w2", "w3"))
        assert (p + "attn.compressor.wkv.weight" in keys) == role.is_kv_source
        assert (p + "attn.compressor.wgate.weight" in keys) == (role.is_kv_source and role.ratio == 2)
        assert (p + "attn.indexer.wk.weight" in keys) == (p + "attn.indexer.k_norm.weight" in keys) == role.is_kv_source
        assert (p + "attn.indexer.wq_b.weight" in keys) == role.is_index_source
        assert (p + "attn.indexer.weights_proj.weight" in keys) == role.is_index_source
    C, n = tiny_v41.hidden_size, tiny_v41.hc_mult
    sd = model.state_dict()
    assert sd["layers.0.hc_attn_fn"].shape == (tiny_v41.hc_dim, n * C) and sd["layers.0.hc_attn_scale"].shape == (3,)
    heads_per_group = tiny_v41.num_attention_heads // tiny_v41.o_groups
    assert sd["layers.0.attn.wo_a.weight"].shape == (tiny_v41.o_groups * tiny_v41.o_lora_rank,
                                                    heads_per_group * tiny_v41.head_dim)


def test_bfloat16_keeps_the_release_float32_tensors(tiny_v41):
    config = tiny_v41.replace(dtype="bfloat16")
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(config)
    for name, tensor in model.state_dict().items():
        f32 = name.endswith(("hc_attn_fn", "hc_ffn_fn", "_base", "_scale", "attn_sink", "gate.bias", "bias_vl"))
        assert tensor.dtype == (torch.float32 if f32 else torch.bfloat16), name
    model = DeepseekV41ForCausalLM.from_config(config, seed=0)
    assert torch.isfinite(model(TOKENS[:, :12])).all()


def test_one_pass_equals_chunked_equals_token_by_token(model):
    one = model(TOKENS, chunk_size=TOKENS.shape[1])
    for chunk in (7, 1):
        torch.testing.assert_close(model(TOKENS, chunk_size=chunk), one, rtol=0, atol=1e-5)


def _shared_choices(model, chunk: int):
    windows, stores = model.new_windows(range(model.config.decoder_start + 1)), model.new_stores()
    outs = [model.run_shared(TOKENS[:, s: s + chunk], s, windows, stores) for s in range(0, TOKENS.shape[1], chunk)]

    def cat(attr):
        return (torch.cat([getattr(o, attr).idx for o in outs], 1),
                torch.cat([getattr(o, attr).valid for o in outs], 1))

    return cat("selection"), cat("pool"), stores


def test_top_k_and_pool_do_not_depend_on_chunking(model):
    """ReLU scores tie at exactly zero; the most-recent rule makes one pass and token by token pick the same."""
    (sel, pool, stores), (sel1, pool1, stores1) = _shared_choices(model, 40), _shared_choices(model, 1)
    assert torch.equal(sel[0], sel1[0]) and torch.equal(sel[1], sel1[1])
    assert torch.equal(pool[0], pool1[0]) and torch.equal(pool[1], pool1[1])
    E = model.config.decoder_start
    assert stores[E].n_entries == 40 and stores[1].n_entries == 20  # ratio 1 at E, ratio 2 at the encoder source
    torch.testing.assert_close(stores[E].latent, stores1[E].latent, rtol=0, atol=1e-5)


def test_exact_zero_ties_occur_in_the_index_scores(model):
    """The tie rule is exercised: the candidate source's scores hold exact zeros among visible entries."""
    E = model.config.decoder_start
    windows, stores = model.new_windows(range(E + 1)), model.new_stores()
    seen = {}
    layer = model.layers[E].attn.indexer
    original = layer.scores
    layer.scores = lambda *args: seen.setdefault("scores", original(*args))
    try:
        model.run_shared(TOKENS, 0, windows, stores)
    finally:
        del layer.scores
    assert int((seen["scores"] == 0).sum()) > 0


def test_stage_split_shapes(model, tiny_v41):
    E = tiny_v41.decoder_start
    windows, stores = model.new_windows(range(tiny_v41.num_hidden_layers)), model.new_stores()
    out = model.run_shared(TOKENS[:, :10], 0, windows, stores)
    assert out.h19.shape == (1, 10, tiny_v41.hc_mult, tiny_v41.hidden_size) == out.stream.shape
    assert out.pre.shape == (1, 10, tiny_v41.hc_mult)
    assert out.selection.idx.shape == (1, 10, tiny_v41.index_topk)
    assert out.pool.idx.shape == (1, 10, tiny_v41.candidate_topk_blocks)
    assert all(len(windows[i]) == 0 for i in tiny_v41.adapter_bound_layers)  # the shared stage never touches them
    hidden = model.run_decoder(out, 0, windows, stores)
    assert hidden.shape == (1, 10, tiny_v41.hidden_size)
    assert isinstance(V41Cache(windows, stores, 0).gather(E, out.selection.idx), torch.Tensor)


def test_dspark_and_vision_tensors_are_skipped_with_one_logged_line(caplog):
    names = ["layers.0.attn.wq_a.weight", "mtp.0.main_proj.weight", "vision.blocks.0.w", "aligner.w1.weight"]
    with caplog.at_level(logging.INFO, logger="ced.deepseek_v41.model"):
        assert skipped_tensors(names) == names[1:]
    assert len(caplog.records) == 1 and "DSpark/vision" in caplog.text


def test_a_reindex_layer_scores_inside_the_pool_and_picks_what_masking_every_entry_picks(model, tiny_v41):
    """select_in_pool (O(pool) a query) chooses the entries that scoring every entry and masking the rest to the
    candidate blocks chooses (O(context)), ties included."""
    from ced.deepseek_v41.model import Selection

    layer = next(layer for layer in model.layers if layer.attn.role.uses_candidates)
    indexer, config, g = layer.attn.indexer, tiny_v41, torch.Generator().manual_seed(3)
    B, T, N, ratio = 1, 6, 57, 1
    xn = torch.randn(B, T, config.hidden_size, generator=g)
    q_residual = torch.randn(B, T, config.q_lora_rank, generator=g)
    keys = torch.randn(B, N, config.index_head_dim, generator=g)
    keys[:, ::3] = 0  # exact-zero scores: the tie rule decides
    positions = torch.arange(N - T, N)[None]
    cos = torch.randn(T, config.qk_rope_head_dim // 2, generator=g)
    sin = torch.randn(T, config.qk_rope_head_dim // 2, generator=g)
    n_blocks = -(-N // config.candidate_block_size)
    P = config.candidate_topk_blocks
    idx = torch.stack([torch.randperm(n_blocks, generator=g)[:P] for _ in range(T)])[None]
    valid = torch.ones_like(idx, dtype=torch.bool)
    valid[..., -1] = False  # an invalid pool slot is ignored
    pool = Selection(idx, valid)
    with torch.no_grad():
        masked, _ = indexer.select(indexer.scores(xn, q_residual, keys, cos, sin), positions, ratio, pool)
        inside = indexer.select_in_pool(xn, q_residual, keys, cos, sin, positions, ratio, pool)
    assert torch.equal(inside.valid, masked.valid) and torch.equal(inside.idx, masked.idx)
