"""K is captured before the key norm and RoPE and installed so the receiver applies its own, exactly once, for
every registered family (a family added to heterofold/registry.py is tested here without further edits)."""
import pytest
import torch

from heterofold.families import attention
from heterofold.registry import family_names


@pytest.mark.parametrize("family", family_names())
def test_installed_native_kv_reproduces_native_decoding(tiny_models, family):
    """Capture -> install at positions 0..T-2 -> decode token T-1 must equal a full forward.
    Would fail if RoPE (or Qwen3's k_norm) were applied twice or not at all, to all dims where only some rotate
    (GPT-NeoX's partial rotary), or if a fused projection were split in the wrong order."""
    R = tiny_models[family]
    ids = list(range(3, 30))
    cap = R.capture(ids, want_logits=True)
    cache = R.build_cache([k[:-1] for k in cap.k], [v[:-1] for v in cap.v])
    native = R.model(input_ids=torch.tensor([ids[:-1]]), use_cache=True).past_key_values
    for l in range(R.layers):
        assert torch.allclose(cache.layers[l].keys, native.layers[l].keys, atol=1e-5)
        assert torch.allclose(cache.layers[l].values, native.layers[l].values, atol=1e-6)
    out = R.decode_from(cache, [ids[-1]])
    assert torch.allclose(out.logits[0, -1], cap.logits[-1], atol=1e-4)


@pytest.mark.parametrize("family", family_names())
def test_prerotated_keys_would_be_rotated_twice(tiny_models, family):
    R = tiny_models[family]
    ids = list(range(3, 30))
    cap = R.capture(ids, want_logits=True)
    pos = torch.arange(len(ids) - 1)
    rotated = [R.key_post(l, k[:-1], pos).transpose(0, 1).reshape(len(ids) - 1, -1) for l, k in enumerate(cap.k)]
    cache = R.build_cache(rotated, [v[:-1] for v in cap.v])
    native = R.model(input_ids=torch.tensor([ids[:-1]]), use_cache=True).past_key_values
    assert not torch.allclose(cache.layers[0].keys[..., 1:, :], native.layers[0].keys[..., 1:, :], atol=1e-2)


@pytest.mark.parametrize("family", family_names())
def test_reference_attention_matches_the_model(tiny_models, family):
    """The calibration target (own q/k norm, RoPE, GQA groups) matches the model's eager attention weights."""
    R = tiny_models[family]
    ids = list(range(3, 20))
    cap = R.capture(ids, want_q=True)
    out = R.model(input_ids=torch.tensor([ids]), output_attentions=True)
    pos = torch.arange(len(ids))
    for l in range(R.layers):
        p = attention(R.query_post(l, cap.q[l], pos), R.key_post(l, cap.k[l], pos), R.kv_group(), R.scaling(l))
        assert torch.allclose(p, out.attentions[l][0], atol=1e-5)
