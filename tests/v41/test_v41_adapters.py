"""Adapters on V4.1's native names: the placement rule refuses what it must, naming the module and the rule; PEFT
adapters load onto attention, the grouped wo_a, shared and routed experts and add exactly B·A·scaling."""

import pytest
import torch

from ced.adapters import PlacementError, read_peft_adapter
from ced.deepseek_v41.adapters import V41AdapterSet, placement_violation
from ced.deepseek_v41.model import DeepseekV41ForCausalLM

ALLOWED = ["layers.4.ffn.experts.3.w1", "layers.4.ffn.shared_experts.w2", "layers.5.attn.wq_a", "layers.5.attn.wo_a",
           "layers.7.attn.wkv", "layers.6.ffn.experts.0.w2", "model.layers.7.attn.wo_b"]
REFUSED = {
    "layers.4.attn.wq_a": "first decoder layer's attention",
    "layers.4.attn.compressor.wkv": "first decoder layer's attention",
    "layers.4.attn.indexer.wq_b": "first decoder layer's attention",
    "layers.2.ffn.experts.0.w1": "nothing in layers 0..3",
    "layers.0.attn.wo_b": "nothing in layers 0..3",
    "mtp.0.attn.wq_a": "mtp.* is never adapted",
    "embed": "not inside a backbone layer",
    "layers.6.attn.indexer.wq_b": "is not adaptable",
    "layers.5.ffn.gate": "is not adaptable",
}


@pytest.mark.parametrize("module", ALLOWED)
def test_allowed_modules(module, tiny_v41):
    assert placement_violation(module, tiny_v41) is None


@pytest.mark.parametrize("module, rule", REFUSED.items())
def test_refusals_name_the_module_and_the_rule(module, rule, tiny_v41):
    reason = placement_violation(module, tiny_v41)
    assert reason is not None and repr(module) in reason and rule in reason


def test_an_adapter_in_the_first_decoder_layers_attention_is_refused_at_load(tmp_path, tiny_v41, random_adapter):
    adapters = V41AdapterSet(DeepseekV41ForCausalLM.from_config(tiny_v41, seed=0))
    model = DeepseekV41ForCausalLM.from_config(tiny_v41, seed=0)  # an unwrapped twin to make the bad adapter
    linears = {n: m for n, m in model.named_modules() if n in ("layers.4.attn.wq_a", "layers.5.attn.wq_b")}
    path = random_adapter(tmp_path / "bad", linears, lambda n: True)
    with pytest.raises(PlacementError, match=r"'layers\.4\.attn\.wq_a' is in the first decoder layer's attention"):
        adapters.load("bad", path)
    assert not adapters.names


def test_wrapping_keeps_the_native_state_dict(tiny_v41):
    model = DeepseekV41ForCausalLM.from_config(tiny_v41, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    V41AdapterSet(model)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_lora_adds_the_scaled_delta_on_plain_grouped_and_expert_modules(v41_adapters, tiny_v41):
    adapter = read_peft_adapter(v41_adapters.names["all"].path)
    for name in ("layers.5.attn.wq_b", "layers.4.ffn.experts.6.w2", "layers.7.ffn.shared_experts.w1",
                 "layers.6.attn.wo_a"):
        module, (a, b) = v41_adapters.modules[name], adapter.weights[name]
        merged = module.weight.detach() + b @ a  # PEFT's merge: W + scaling * B A (scaling folded into b)
        v41_adapters.use("all")
        if module.groups:  # the grouped output projection: block g of the merged weight meets group g
            x = torch.randn(3, module.groups, module.in_features)
            expected = torch.einsum("ngi,gri->ngr", x, merged.view(module.groups, -1, module.in_features))
        else:
            x = torch.randn(3, module.in_features)
            expected = x @ merged.T
        torch.testing.assert_close(module(x), expected, rtol=0, atol=1e-5)
        v41_adapters.use(None)
        assert not torch.allclose(module(x), expected, atol=1e-3)


def test_routed_expert_adapter_changes_the_output(v41_adapters):
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    v41_adapters.use(None)
    base = v41_adapters.model(ids)
    v41_adapters.use("experts")
    adapted = v41_adapters.model(ids)
    v41_adapters.use(None)
    assert (adapted - base).abs().max() > 1e-3
