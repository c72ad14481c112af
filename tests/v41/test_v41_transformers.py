"""Whole-model parity with transformers' own `deepseek_v41`: runs only where an installed transformers has it
(upstream main has `models/deepseek_v41/`, no PyPI release does yet: 5.25.0 is the newest, reference §1.6)."""

import importlib.util
import json

import pytest
import torch

import transformers
from ced.deepseek_v41.model import DeepseekV41ForCausalLM

HAS_V41 = importlib.util.find_spec("transformers.models.deepseek_v41") is not None
pytestmark = pytest.mark.skipif(not HAS_V41, reason=f"transformers {transformers.__version__} has no deepseek_v41 "
                                                    "(upstream main only; no PyPI release ships it yet)")


def test_logits_match_transformers_deepseek_v41(tmp_path, tiny_v41):
    """Our native-named weights saved as a checkpoint and loaded by transformers' port (which reads the release's
    names), then one pass on both sides. Loose tolerance: their top-k may order exact-zero ties differently."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    ours = DeepseekV41ForCausalLM.from_config(tiny_v41, seed=0)
    (tmp_path / "config.json").write_text(json.dumps(tiny_v41.to_hf()))
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, str(tmp_path / "model.safetensors"))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, tiny_v41.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = theirs(ids).logits
    torch.testing.assert_close(ours(ids), reference, rtol=0, atol=1e-3)
