"""benchmarks/switch_cost's deepseek_v41 rows, fast: the bounded replay runs W positions through the decoder
whatever the context (the baseline all of them, and its logits are a full recompute's), and the state-bytes
formula reproduces a real conversation's cache on v41-tiny and the tech report's 890 B/token on the release's
FP4 layout (288 B latent + 68 B index key at layer 20, 3 x (288 + 68) / 2 for the ratio-2 sources: exactly 890).
`--demo models/demo-v41` measures the trained demo's own weights and adapters, its bytes beside the CED demo's.
"""

import json

import pytest
import torch

from benchmarks.switch_cost import (TECH_REPORT_BYTES_PER_TOKEN, V41Bench, measure, v41_bench_config,
                                    v41_measured_state, v41_state_bytes)
from ced.deepseek_v41.config import V41Config
from ced.deepseek_v41.conversation import full_recompute
from ced.deepseek_v41.model import DeepseekV41ForCausalLM

CONTEXTS = [160, 320]  # both past W=128, one and two prefill chunks


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return V41Bench(CONTEXTS, n_adapters=2, rank=4, workdir=tmp_path_factory.mktemp("switch_cost"))


def test_replay_runs_w_positions_at_every_context_and_the_baseline_all(bench):
    W = bench.config.sliding_window
    assert W == v41_bench_config().sliding_window == 128
    rows = measure(bench, CONTEXTS, visits=[1, 2], repeats=1)
    assert [(r["context_tokens"], r["adapters_visited"]) for r in rows] == [(c, v) for c in CONTEXTS for v in (1, 2)]
    for row in rows:
        assert row["family"] == "deepseek_v41"
        assert row["replay_positions"] == W, row  # flat work: W positions, not the context
        assert row["replay_ms"] > 0 and row["baseline_ms"] > 0
        assert 0 < row["replay_indexer_ms"] < row["replay_ms"]  # the decoder's reindex layer scored, inside the replay
        assert row["served_replay_ms"] > 0  # the server's engine timed beside them
    by = {(r["context_tokens"], r["adapters_visited"]): r for r in rows}
    for c in CONTEXTS:  # ours holds one state whatever was visited; the baseline one full state per adapter
        assert by[c, 1]["state_bytes"] == by[c, 2]["state_bytes"]
        one_state = by[c, 1]["baseline_state_bytes"] - 8 * c  # less the token ids
        assert by[c, 2]["baseline_state_bytes"] - by[c, 1]["baseline_state_bytes"] == one_state > 0
    history = bench.history(CONTEXTS[1])
    bench.decoded = 0
    bench.theirs(history, "adapter1")
    assert bench.decoded == CONTEXTS[1]  # the baseline recomputes the whole context


def test_the_served_switch_is_the_reference_switch(bench):
    """`served_replay_ms` times the server's engine (V41Engine, on its own copy of the weights and adapters) doing
    the very switch `replay_ms` times on the reference path: W positions, the same next-token logits."""
    history = bench.history(CONTEXTS[1])
    bench.adapters.use("adapter1")
    reference = history[0].replay("adapter1")
    bench.adapters.use(None)
    served, replayed = bench.engine.replay(history[2], "adapter1")
    assert replayed == bench.config.sliding_window
    torch.testing.assert_close(served, reference, rtol=0, atol=1e-5 * float(reference.abs().max()))


def test_the_baseline_is_a_full_recompute_under_the_target(bench):
    from benchmarks.switch_cost import V41FullStates, history_tokens

    tokens = history_tokens(bench.config.vocab_size, 300)
    ours = bench.recompute(V41FullStates(tokens), "adapter0")
    oracle = full_recompute(bench.model, tokens)  # adapter0 still in use: one pass over the whole context
    bench.adapters.use(None)
    base = full_recompute(bench.model, tokens)
    torch.testing.assert_close(ours, oracle, rtol=0, atol=1e-4)
    assert (oracle - base).abs().max() > 1e-3  # the adapter is really applied


@pytest.mark.parametrize("preset", ["v41-tiny", "v41-bench"])
def test_the_state_formula_reproduces_a_real_conversations_cache(preset):
    config = V41Config.from_name("v41-tiny") if preset == "v41-tiny" else v41_bench_config()
    model = DeepseekV41ForCausalLM.from_config(config, seed=0)
    measured = v41_measured_state(model, lengths=(256, 512))  # every ratio divides both: no pending inputs
    assert measured == v41_state_bytes(config, "engine")
    D, I = config.head_dim, config.index_head_dim
    assert measured[0] == (D + I) * 4 * (1 + 1 / 2)  # fp32; layer 4 at ratio 1, layer 1 at ratio 2


def test_the_flash_preset_at_fp4_gives_the_tech_reports_890_bytes_per_token():
    flash = V41Config.from_name("deepseek-v4.1-flash")
    per_token, fixed = v41_state_bytes(flash, "release-fp4")
    assert TECH_REPORT_BYTES_PER_TOKEN == 890
    assert per_token == 890  # 288 + 68 + 3 * (288 + 68) / 2, exactly
    assert fixed > 40 * 128 * 528  # FP8 window rings of 528 B per layer and position, plus the replay inputs
    bf16, _ = v41_state_bytes(flash, "engine")
    assert bf16 == (512 + 128) * 2 * (1 + 3 / 2) == 3200


def test_the_v41_demo_runs_with_its_own_weights_adapters_and_bytes(tmp_path):
    """`--demo models/demo-v41`: the demo's checkpoint and its trained adapters (random_l0 too), the same W-position
    replay, and its measured bytes per token the engine formula's at its config (fp32, D=64, I=32: 576)."""
    from benchmarks.switch_cost import main
    from ced.demo import resolve_demo

    demo = resolve_demo("models/demo-v41")
    bench = V41Bench([160], n_adapters=8, rank=16, workdir=tmp_path, demo=demo)
    assert bench.shape == "demo-v41" and bench.names == ["chat", "agent", "coding", "design", "random_l0"]
    assert bench.model.embed.weight.shape == (8192, 128)  # the demo's weights, not v41-bench's
    rows = measure(bench, [160], visits=[1, 2], repeats=1)
    assert {r["family"] for r in rows} == {"deepseek_v41"}
    assert all(r["replay_positions"] == bench.config.sliding_window == 128 for r in rows)
    per_token, _ = v41_measured_state(bench.model, lengths=(256, 512))
    assert per_token == v41_state_bytes(bench.config, "engine")[0] == (64 + 32) * 4 * (1 / 2 + 1) == 576
    rows = main(["--demo", "models/demo-v41", "--contexts", "160", "--repeats", "1", "--quick", "--plot", "",
                 "--json", str(tmp_path / "rows.json")])
    assert {r["family"] for r in rows} == {"deepseek_v41"}
    assert sorted({r["adapters_visited"] for r in rows}) == [1, 2, 4]  # the demo's 5 adapters: no 8
    state = [r for r in json.loads((tmp_path / "rows.json").read_text()) if r["table"] == "state_bytes"]
    per_token = {(r["family"], r["shape"], r["how"]): r["state_bytes_per_token"] for r in state}
    assert per_token == {  # the demo's bytes beside the CED demo's, and both beside the tech report's 890
        ("deepseek_v41", "demo-v41", "measured (1K/4K conversation)"): 576,
        ("ced", "demo", "measured (1K/4K conversation)"): 816,
        ("deepseek_v41", "demo-v41", "computed (release-fp4 layout)"): 79.5,  # 1.5 x (32 + 4 + 16 + 1) B
        ("deepseek_v41", "deepseek-v4.1-flash", "computed (engine layout)"): 3200,
        ("deepseek_v41", "deepseek-v4.1-flash", "computed (release-fp4 layout)"): 890}
    assert [r["tech_report_bytes_per_token"] for r in state] == ["", "", "", "", 890]  # beside the flash row only
