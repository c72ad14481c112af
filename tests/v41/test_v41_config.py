"""The V4.1 config: the flash preset equals the released config and its parameter counts match the checkpoint's
per part within 1 %; the role table; validation errors; the config.json round trip."""

import json

import pytest
import torch

from ced.deepseek_v41.config import V41Config, V41ConfigError, layer_parameters, parameter_counts
from ced.deepseek_v41.model import Block, DeepseekV41ForCausalLM

FLASH = "deepseek-v4.1-flash"


def test_flash_counts_match_the_release_per_part():
    counts = parameter_counts(V41Config.from_name(FLASH))
    released = {"backbone": 551.9e9, "engram": 196.6e9, "dspark": 14.2e9}  # kiojuvr checkpoint atlas, reference §1.1
    for part, expected in released.items():
        assert abs(counts[part] - expected) / expected < 0.01, (part, counts[part])
    assert abs(counts["vision"] - 0.49e9) / 0.49e9 < 0.05  # shape partly assumed (vision_intermediate_size)


def test_flash_preset_is_the_released_text_config():
    c = V41Config.from_name(FLASH)
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (40, 5120, 64, 1)
    assert (c.head_dim, c.qk_rope_head_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank) == (512, 64, 1280, 8, 1024)
    assert c.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    assert c.kv_source_layer_ids == (2, 8, 14, 20) and c.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert (c.candidate_source_layer_id, c.candidate_topk_blocks, c.candidate_block_size) == (20, 2048, 8)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.sliding_window) == (32, 128, 512, 128)
    assert (c.rope_theta, c.compress_rope_theta, c.rope_scaling_factor) == (10000, 160000, 16)
    assert (c.rope_scaling_original_max_position_embeddings, c.rope_scaling_beta_fast, c.rope_scaling_beta_slow) \
        == (65536, 32, 1)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.moe_intermediate_size) == (384, 6, 1, 2304)
    assert (c.scoring_func, c.topk_method, c.routed_scaling_factor, c.norm_topk_prob, c.swiglu_limit) == \
        ("sqrtsoftplus", "noaux_tc", 1.5, True, 10.0)
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps) == (4, 20, 1e-6, 1e-20)
    assert c.engram_layer_ids == (1, 14) and c.engram_num_embeddings == (384006168, 384016682)
    assert (c.num_nextn_predict_layers, c.vocab_size, c.max_position_embeddings) == (3, 129280, 1048576)
    assert c.decoder_start == 20


def test_flash_roles():
    roles = V41Config.from_name(FLASH).roles
    modes = {i: roles[i].mode for i in range(40)}
    assert [modes[i] for i in (0, 1)] == ["swa", "swa"]
    assert all(modes[i] == "encoder-full" for i in (2, 8, 14))
    assert all(modes[i] == "encoder-reuse" for i in (3, 7, 9, 13, 15, 19))
    assert modes[20] == "decoder-full" and roles[20].is_candidate_source and roles[20].ratio == 1
    assert all(modes[i] == "decoder-reindex" and roles[i].uses_candidates for i in (24, 28, 32, 36))
    assert all(modes[i] == "decoder-reuse" for i in (21, 23, 25, 39))
    assert [roles[i].kv_source for i in (3, 9, 19, 20, 39)] == [2, 8, 14, 20, 20]
    assert [roles[i].selection_layer for i in (19, 21, 27, 39)] == [14, 20, 24, 36]
    assert [roles[i].rope for i in (1, 2, 39)] == ["main", "compress", "compress"]


def test_tiny_has_every_role(tiny_v41):
    assert [r.mode for r in tiny_v41.roles] == ["swa", "encoder-full", "encoder-reuse", "encoder-reuse",
                                                "decoder-full", "decoder-reuse", "decoder-reindex", "decoder-reuse"]
    assert [r.ratio for r in tiny_v41.roles] == [0, 2, 2, 2, 1, 1, 1, 1]


@pytest.mark.parametrize("name", [FLASH, "v41-tiny"])
def test_config_json_round_trip(name):
    config = V41Config.from_name(name)
    hf = json.loads(json.dumps(config.to_hf()))
    assert hf["model_type"] == "deepseek_v41" and "text_config" in hf
    assert V41Config.from_hf(hf) == config
    hf["text_config"]["bos_token_id"] = 0  # keys the engine does not use are dropped
    hf["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    assert V41Config.from_hf(hf) == config


@pytest.mark.parametrize("change, words", [
    (dict(compress_ratios=(0, 2, 2, 1, 1, 1, 1, 1)), "layer 3 reads KV source 1"),
    (dict(candidate_source_layer_id=1), "must be the first decoder layer 4"),
    (dict(engram_layer_ids=(5,), engram_num_embeddings=(10,)), "engram layers [5] lie in the decoder"),
    (dict(compress_ratios=(0, 2, 2, 2, 1, 1, 1)), "compress_ratios has 7 entries"),
    (dict(index_source_layer_ids=(4, 6)), "KV sources [1] must also be index sources"),
    (dict(num_key_value_heads=2), "num_key_value_heads must be 1"),
])
def test_invalid_shapes_are_refused_with_the_reason(tiny_v41, change, words):
    with pytest.raises(V41ConfigError, match=None) as error:
        tiny_v41.replace(**change)
    assert words in str(error.value)


def test_from_hf_refuses_another_model_type(tiny_v41):
    with pytest.raises(V41ConfigError, match="deepseek_v4"):
        V41Config.from_hf({**tiny_v41.to_hf(), "model_type": "deepseek_v4"})


def test_backbone_count_is_what_the_model_allocates(tiny_v41):
    model = DeepseekV41ForCausalLM(tiny_v41)
    assert sum(t.numel() for t in model.state_dict().values()) == parameter_counts(tiny_v41)["backbone"]


def test_flash_layer_counts_on_meta():
    """Each kind of flash layer built on the meta device allocates what layer_parameters counts."""
    config = V41Config.from_name(FLASH)
    for i in (0, 2, 3, 20, 21, 24):
        with torch.device("meta"):
            block = Block(config, config.roles[i])
        assert sum(p.numel() for p in block.parameters()) == layer_parameters(config, config.roles[i]), i


def test_engram_is_refused_by_name():
    with pytest.raises(V41ConfigError, match=r"Engram layers \[1, 14\]"):
        with torch.device("meta"):
            DeepseekV41ForCausalLM(V41Config.from_name(FLASH))
