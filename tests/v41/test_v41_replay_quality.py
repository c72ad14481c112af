"""benchmarks.replay_quality runs its protocol on the deepseek_v41 engine: rows carry the family, a context inside the
window replays everything (path = oracle = control), beyond it a target's logits stay bitwise equal across sources,
and the hidden-state part is skipped because this engine cannot capture the decoder layers."""

from __future__ import annotations

import torch

from benchmarks.replay_quality import captures_hidden, run_pairs
from ced.deepseek_v41.engine import V41Engine
from ced.deepseek_v41.model import DeepseekV41ForCausalLM

ADAPTERS = [None, "all", "experts"]


def make_engine(tmp_path, tiny_v41, random_adapter) -> V41Engine:
    """v41-tiny (W=8) with "all" (every allowed module, routed experts included) and "experts" (routed only)."""
    engine = V41Engine(DeepseekV41ForCausalLM.from_config(tiny_v41, seed=0), max_adapters=3, max_rank=8)
    for seed, (name, include) in enumerate([("all", lambda n: True), ("experts", lambda n: ".experts." in n)]):
        engine.adapters.load(name, random_adapter(tmp_path / name, engine.adapter_set.modules, include, seed=seed + 1))
    return engine


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_within_the_window_replay_equals_the_oracle(tmp_path, tiny_v41, random_adapter):
    engine = make_engine(tmp_path, tiny_v41, random_adapter)
    context = tokens(5, engine.config.window)
    rows, _ = run_pairs(engine, ADAPTERS, context[:3], context[3:5], context[5:], family="deepseek_v41")
    assert {r["family"] for r in rows} == {"deepseek_v41"} and len(rows) == len(ADAPTERS) ** 2
    for row in rows:
        assert row["bitwise_equal_across_sources"]
        assert row["logit_mae"] < 1e-5 and row["control_logit_mae"] < 1e-5
        assert abs(row["ppl_ratio"] - 1) < 1e-5 and row["top1_agreement"] == 1.0


def test_beyond_the_window_sources_do_not_matter(tmp_path, tiny_v41, random_adapter):
    engine = make_engine(tmp_path, tiny_v41, random_adapter)
    context = tokens(6, 24)  # 3 windows of W=8: the replay truncates
    rows, _ = run_pairs(engine, ADAPTERS, context[:14], context[14:17], context[17:], family="deepseek_v41")
    assert all(row["bitwise_equal_across_sources"] for row in rows)
    assert max(row["logit_mae"] for row in rows) > 1e-4  # the path differs from the oracle: the measure is not blind


def test_only_the_ced_engine_captures_hidden_states(tmp_path, tiny_v41, random_adapter, engine):
    assert captures_hidden(engine)  # tests/conftest.py's tiny CEDEngine
    assert not captures_hidden(make_engine(tmp_path, tiny_v41, random_adapter))
