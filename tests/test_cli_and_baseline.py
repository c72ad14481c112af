"""The `mol2 chat` demo runs and reports bounded replay; the every-layer baseline computes what the oracle does."""

import pytest
import torch

from ced import CEDEngine
from ced.baseline import BaselineConversation, EveryLayerBaseline
from mol2_cli import main


def test_chat_demo_prints_replay_and_bytes(tmp_path, capsys):
    main(["chat", "--max-tokens", "2", "--threads", "1", "--demo", str(tmp_path / "demo")])
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"demo: {tmp_path / 'demo'} (untrained: seeded random weights; named explicitly)"
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert [row[1] for row in rows] == ["chat", "agent", "coding", "design", "coding", "chat", "base"]  # as served
    replayed = [int(row[4]) for row in rows]
    assert all(0 < r <= 128 for r in replayed) and replayed[-1] == 128
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "notes.txt").write_text("not a demo")
    with pytest.raises(SystemExit) as exit_info:          # a wrong folder is refused, not filled with a demo
        main(["chat", "--demo", str(tmp_path / "elsewhere")])
    assert str(exit_info.value.code).startswith(f"mol2 chat: error: {tmp_path / 'elsewhere'} holds no demo")
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["notes.txt"]


def test_baseline_switch_is_a_full_recompute(adapter_dirs, tiny_model):
    engine, baseline = CEDEngine(tiny_model()), EveryLayerBaseline(tiny_model())
    for name in ("A1", "L0"):
        engine.adapters.load(name, adapter_dirs[name])
        baseline.adapters.load(name, adapter_dirs[name])
    tokens = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    conversation = BaselineConversation(tokens)
    sizes = []
    for name in ("A1", "L0"):
        logits = baseline.switch(conversation, name)
        torch.testing.assert_close(logits, engine.oracle(tokens, name)[-1], rtol=0, atol=1e-5)
        sizes.append(conversation.nbytes())
    assert sizes[1] - 8 * len(tokens) == 2 * (sizes[0] - 8 * len(tokens))  # one full state per adapter visited


def test_cli_reports_bad_input_without_a_traceback(tmp_path):
    bad = tmp_path / "mine.jsonl"
    bad.write_text('{"query": "hi", "candidates": [], "label": "chat"}\n')
    good = tmp_path / "good.jsonl"
    good.write_text('{"query": "hi", "candidates": [{"name": "chat", "description": "talk"}], "label": "chat"}\n')
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(good.read_bytes().replace(b'"hi"', b'"h\xe9"'))
    cases = [(["router", "eval", "--data-file", str(bad)], f"mol2 router eval: error: {bad}:1: empty candidate list"),
             (["router", "eval", "--data", str(bad)], "mol2 router eval: error: --data takes the routing-data folder"),
             (["router", "eval", "--head", str(tmp_path)], f"mol2 router eval: error: no router head in {tmp_path}"),
             (["router", "eval", "--data-file", str(latin1), "--head", str(tmp_path)],
              f"mol2 router eval: error: {latin1}:1: not UTF-8 (byte 0xe9 at column 13)"),
             (["router", "eval", "--data-file", str(good), "--head", str(tmp_path)],
              f"mol2 router eval: error: no router head in {tmp_path}"),
             (["repo", "build", "--adapter-set", str(tmp_path / "none.json")], "mol2 repo: error: adapter-set file")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert str(exit_info.value.code).startswith(message)


def test_router_training_needs_an_epoch(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["router", "train", "--epochs", "0"])
    assert exit_info.value.code == 2 and "'0' is not a whole number of at least 1" in capsys.readouterr().err
