"""The pointer head: logit shapes, parameter counts per preset (paper ~15.25M), and the option cache vs the reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mol2_router import PRESETS, PointerHead, RouterConfig
from mol2_router.head import count_parameters


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_parameter_count_matches_the_shape(preset):
    config = RouterConfig.from_name(preset)
    with torch.device("meta"):  # the paper head is only counted, never allocated
        head = PointerHead(config)
    assert count_parameters(head) == config.num_parameters()


def test_paper_preset_is_about_15_25m_at_the_40_layer_hidden_size():
    from ced import CEDConfig

    config = RouterConfig.from_name("paper")
    assert config.hidden_size == CEDConfig.from_name("ced-40").hidden_size
    assert abs(config.num_parameters() - 15.25e6) / 15.25e6 < 0.01


def test_demo_preset_reads_the_demo_hidden_size():
    from ced import CEDConfig

    assert RouterConfig.from_name("demo").hidden_size == CEDConfig.from_name("demo").hidden_size


def _options(U=6, T=9, C=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(U, T, C, generator=g)
    lengths = torch.randint(2, T + 1, (U,), generator=g)
    return embeds, torch.arange(T)[None, :] < lengths[:, None]


def test_shapes_and_padding():
    head = PointerHead(RouterConfig.from_name("tiny")).eval()
    embeds, mask = _options()
    query = torch.randn(3, 64)
    assert head(query, embeds, mask).shape == (3, 6)
    candidates = torch.tensor([[0, 1, 2], [3, 4, 0], [5, 0, 0]])
    cmask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]]).bool()
    logits = head(query, embeds, mask, candidates, cmask)
    assert logits.shape == (3, 3)
    assert torch.isinf(logits[~cmask]).all() and torch.isfinite(logits[cmask]).all()


@pytest.mark.parametrize("U,T,B", [(2, 3, 1), (6, 9, 4), (17, 20, 8)])
def test_option_cache_equals_uncached_computation(U, T, B):
    torch.manual_seed(U)
    head = PointerHead(RouterConfig.from_name("tiny")).eval()
    embeds, mask = _options(U, T)
    query = torch.randn(B, 64)
    with torch.no_grad():
        cache = head.encode_options(embeds, mask)
        reference = head(query, embeds, mask)
        torch.testing.assert_close(head.score(query, cache), reference, rtol=1e-5, atol=1e-5)  # folded
        unfolded = dataclasses.replace(cache, folded_cross=None, folded_pointer=None)
        torch.testing.assert_close(head.score(query, unfolded), reference, rtol=1e-5, atol=1e-5)
        candidates = torch.randint(0, U, (B, 3))
        cmask = torch.rand(B, 3) < 0.7
        cmask[:, 0] = True
        cached = head.score(query, cache, candidates, cmask)
        reference = head(query, embeds, mask, candidates, cmask)
        torch.testing.assert_close(cached[cmask], reference[cmask], rtol=1e-5, atol=1e-5)


def test_a_question_sees_only_its_own_candidates():
    """Scores over a candidate subset equal the scores with only those options encoded."""
    torch.manual_seed(0)
    head = PointerHead(RouterConfig.from_name("tiny")).eval()
    embeds, mask = _options(8, 7)
    query = torch.randn(1, 64)
    pick = torch.tensor([[5, 2, 7]])
    with torch.no_grad():
        subset = head(query, embeds, mask, pick)
        alone = head(query, embeds[pick[0]], mask[pick[0]])
    torch.testing.assert_close(subset, alone, rtol=1e-5, atol=1e-5)


def test_over_long_options_are_refused():
    head = PointerHead(RouterConfig.from_name("tiny", max_option_tokens=8))
    embeds, mask = _options(2, 9)
    with pytest.raises(ValueError, match="max_option_tokens=8"):
        head(torch.randn(1, 64), embeds, mask)


def test_query_statistics_of_a_single_training_question_are_finite():
    head = PointerHead(RouterConfig.from_name("tiny"))
    head.set_query_stats(torch.randn(1, 64))
    assert torch.isfinite(head.query_scale).all() and torch.isfinite(head.query(torch.randn(2, 64))).all()


def test_mol_reads_names_that_end_in_punctuation():
    from mol2_router.baselines import name_pattern

    assert name_pattern("c++").search("I pick C++ because it is code")
    assert name_pattern(".net").search("use .net here")
    assert not name_pattern("chat").search("chatter")          # still whole names only
