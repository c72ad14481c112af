"""Component parity with transformers 5.25's `deepseek_v4` (fp32, weights copied across): every check of
`benchmarks.v41_parity` (rope tables, grouped output projection, sink attention over a shared latent, one mHC
layer, MoE routing + clamped SwiGLU, softmax-gated compressor, ReLU indexer with the tie rule pinned both sides)."""

import pytest

from benchmarks.v41_parity import CHECKS
from ced.deepseek_v41.config import V41Config

pytest.importorskip("transformers.models.deepseek_v4", reason="this transformers has no deepseek_v4 module")


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_component_matches_transformers_deepseek_v4(check):
    rows = check(V41Config.from_name("v41-tiny"), 24, 0)
    failed = [row for row in rows if not row["passed"]]
    assert not failed, failed
