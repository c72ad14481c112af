"""The heterofold_eval benchmark's paired comparison: each method's gap to HeteroFold over the same items, with a
bootstrap interval that separates a steady gap from item noise."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks._report import paired_difference
from benchmarks.heterofold_eval import gap_table, with_gaps


def test_paired_difference_separates_a_steady_gap_from_noise():
    rng = np.random.default_rng(1)
    base = rng.gamma(2.0, 0.1, 48)                       # items differ a lot from one another ...
    mean, low, high = paired_difference(list(base + 0.01), list(base))
    assert mean == pytest.approx(0.01) and low == pytest.approx(0.01) and high == pytest.approx(0.01)
    noisy = base + rng.normal(0, 0.05, 48)               # ... a zero-mean difference keeps zero inside the interval
    mean, low, high = paired_difference(list(noisy), list(base))
    assert low < 0 < high and low < mean < high
    shifted = base + 0.03 + rng.normal(0, 0.01, 48)      # a small gap, steady across items, stays clear of zero
    assert paired_difference(list(shifted), list(base))[1] > 0.02
    with pytest.raises(ValueError, match="no paired items"):
        paired_difference([], [])


def test_gaps_are_to_heterofold_within_a_direction():
    def row(direction, method, nt, att):
        return {"direction": direction, "method": method, "next_token_kl": float(np.mean(nt)),
                "attention_kl": float(np.mean(att)), "per_item": {"next_token_kl": nt, "attention_kl": att}}

    rows = with_gaps([row("a->b", "heterofold", [0.1, 0.2], [0.5, 0.5]),
                      row("a->b", "kv_ridge_ta", [0.2, 0.3], [0.4, 0.4]),
                      row("c->d", "kv_ridge_ta", [0.0, 0.0], [0.0, 0.0])])
    assert all("per_item" not in r for r in rows)
    assert "gap_next_token_kl" not in rows[0] and "gap_next_token_kl" not in rows[2]  # itself; no HeteroFold in c->d
    assert rows[1]["gap_next_token_kl"] == pytest.approx(0.1) and rows[1]["gap_attention_kl"] == pytest.approx(-0.1)
    assert "| a->b | kv_ridge_ta | +0.1000 [+0.1000, +0.1000] | -0.1000 [-0.1000, -0.1000] |" in gap_table(rows)
