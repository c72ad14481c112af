"""The replay-quality metrics give the known answers: identical paths score MAE 0 and ratio 1; a context that
fits in the window replays everything, so the deployed path equals the oracle and the control."""

import math

import torch

from benchmarks.replay_quality import compare, hidden_state_mae, run_pairs


def test_identical_logits_score_perfectly():
    logits = torch.randn(20, 50)
    targets = torch.randint(0, 50, (20,))
    assert compare(logits, logits.clone(), targets) == dict(logit_mae=0.0, top1_agreement=1.0, ppl_ratio=1.0)


def test_a_better_path_has_a_ratio_below_one():
    targets = torch.arange(5)
    oracle = torch.zeros(5, 5)
    sharper = oracle.clone()
    sharper[torch.arange(5), targets] = 1.0
    result = compare(sharper, oracle, targets)
    assert result["ppl_ratio"] < 1 and math.isclose(result["logit_mae"], 0.2, rel_tol=1e-6)


def test_within_the_window_replay_equals_the_oracle(engine):
    W = engine.config.window
    tokens = torch.randint(0, 256, (W,), generator=torch.Generator().manual_seed(5)).tolist()
    history, turn, continuation = tokens[:6], tokens[6:9], tokens[9:W]  # the whole context always fits in W
    rows, _ = run_pairs(engine, [None, "A1", "L0"], history, turn, continuation)
    for row in rows:
        assert row["bitwise_equal_across_sources"]
        assert row["logit_mae"] < 1e-5 and row["control_logit_mae"] < 1e-5
        assert abs(row["ppl_ratio"] - 1) < 1e-5 and row["top1_agreement"] == 1.0
    assert hidden_state_mae(engine, tokens, "A1", W).max() < 1e-5


def test_beyond_the_window_replay_truncates(engine):
    tokens = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(6)).tolist()
    errors = hidden_state_mae(engine, tokens, "A1", 80)  # (decoder layers, W)
    assert errors[0].max() == 0  # the first decoder layer's FFN reads only shared state
    assert errors[1:].max() > 1e-4  # later layers lost the target's windows before the replay
