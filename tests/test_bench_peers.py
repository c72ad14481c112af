"""The llama.cpp peer and the contention cells without llama.cpp: when the peer counts as installed, the cells and
target lines serving_throughput builds, the `lora` field, the CPU burner's lifetime, and rows tagged by contention
(a fake request, no server)."""

from __future__ import annotations

import time

import pytest

from benchmarks import peer_llamacpp, serving_throughput
from benchmarks._contention import cpu_burner
from benchmarks.load import Record


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_llamacpp_counts_as_installed_only_once_the_installer_finished(tmp_path):
    assert not peer_llamacpp.llamacpp_available(tmp_path)
    for name in ("bin/llama-server", "bin/llama-bench", "venv/bin/python", "src/convert_hf_to_gguf.py",
                 "src/convert_lora_to_gguf.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert not peer_llamacpp.llamacpp_available(tmp_path)  # no stamp: the installer stopped half way
    (tmp_path / "installed.txt").write_text("llama-cpp-python 0.3.36\n")
    assert peer_llamacpp.llamacpp_available(tmp_path)


def test_the_cells_gain_the_issue_targets_only_with_llamacpp():
    assert serving_throughput.plan_cells((4,), (1, 16), False) == [(4, 1), (4, 16)]
    assert serving_throughput.plan_cells((4,), (1, 16), True) == [(1, 1), (1, 16), (4, 1), (4, 16)]


def test_the_lora_field_names_one_adapter_at_scale_one_or_all_at_zero():
    assert peer_llamacpp.lora_field("chat") == [{"id": 0, "scale": 1.0}]
    assert peer_llamacpp.lora_field("design") == [{"id": 3, "scale": 1.0}]
    assert peer_llamacpp.lora_field("base") == peer_llamacpp.lora_field(None) == [
        {"id": i, "scale": 0.0} for i in range(4)]


def test_the_server_command_loads_every_adapter_at_scale_zero(tmp_path):
    command = peer_llamacpp.server_command(tmp_path, 8123)
    assert command[command.index("-t") + 1] == "2"
    assert [command[i + 1] for i, arg in enumerate(command) if arg == "--lora-scaled"] == \
        [",".join(f"{tmp_path / f'a{i}-f32.gguf'}:0" for i in range(4))]  # once: a repeated flag keeps the last


def row(engine, scenario, contention, tokens_per_s=None, ttft=None, adapters=1, concurrency=16):
    return {"engine": engine, "scenario": scenario, "contention": contention, "adapters": adapters,
            "concurrency": concurrency, "tokens_per_s": tokens_per_s, "p50_ttft_ms": ttft}


def test_target_lines_give_the_measured_ratio_and_say_when_it_is_missing():
    rows = [row("mol2", "steady", "none", 100.0, adapters=1, concurrency=1),
            row("llamacpp", "steady", "none", 500.0, adapters=1, concurrency=1),
            row("mol2", "steady", "none", 600.0, adapters=4),
            row("llamacpp", "steady", "none", 2000.0, adapters=1)]
    one, mixed = serving_throughput.llamacpp_target_lines(rows)
    assert one.endswith("0.2 (target >= 0.8: NOT met)")
    assert mixed.endswith("0.3 (target >= 1.0: NOT met)")
    assert serving_throughput.llamacpp_target_lines(rows[2:])[0].endswith("n/a (not measured) (target >= 0.8)")


def test_contention_lines_compare_the_burner_with_none():
    rows = [row("mol2", "cold_prompt", "none", ttft=500.0), row("mol2", "cold_prompt", "burner", ttft=24000.0),
            row("mol2", "steady", "none", 600.0, adapters=4), row("mol2", "steady", "burner", 300.0, adapters=4)]
    assert serving_throughput.contention_lines(rows, ["mol2"]) == [
        "mol2 cold prompt p50 TTFT, burner / none: 48 (target <= 3: NOT met)",
        "mol2 tokens/s at 16 streams on 4 adapter(s), burner / none: 0.5 (target >= 0.4: met)"]


def test_the_burner_runs_inside_its_block_and_is_gone_after_it():
    with cpu_burner(60.0) as pid:
        time.sleep(0.2)
        assert alive(pid)
    assert not alive(pid)
    with pytest.raises(RuntimeError), cpu_burner(60.0) as pid:
        raise RuntimeError("a cell failed")
    assert not alive(pid)


def test_the_burner_stops_itself_at_its_limit():
    with cpu_burner(0.3) as pid:
        deadline = time.monotonic() + 10.0
        while alive(pid) and time.monotonic() < deadline:  # a finished burner is a zombie until the block reaps it
            time.sleep(0.05)
        assert not alive(pid)


def test_every_cell_runs_under_each_condition_and_its_rows_say_which(monkeypatch):
    seen = []

    def send(text, adapter, max_tokens, record: Record) -> Record:
        record.start = time.perf_counter()
        record.add_tokens(max_tokens)
        record.end = time.perf_counter()
        return record

    monkeypatch.setattr(serving_throughput, "cpu_burner", lambda limit_s: _Recording(seen, limit_s))
    engines = serving_throughput.Engines({"a": send, "b": send})
    rows = serving_throughput.measure_conditions(engines, [(1, 1), (4, 2)], serving_throughput.CONDITIONS, 0.05,
                                                 None, 0, 0.0, 8, lambda condition, i: f"{condition} {i}")
    steady = [(r["engine"], r["adapters"], r["contention"]) for r in rows if r["scenario"] == "steady"]
    assert steady == [("a", 1, "none"), ("b", 1, "none"), ("a", 1, "burner"), ("b", 1, "burner"),
                      ("b", 4, "none"), ("a", 4, "none"), ("b", 4, "burner"), ("a", 4, "burner")]
    cold = [(r["engine"], r["contention"], r["requests"], r["errors"]) for r in rows if r["scenario"] == "cold_prompt"]
    assert cold == [("a", "none", 3, 0), ("b", "none", 3, 0), ("a", "burner", 3, 0), ("b", "burner", 3, 0)]
    assert len(seen) == 3  # one burner per condition "burner": two cells and the cold prompts


class _Recording:
    """Stands in for the burner's context manager and counts its uses (the real one is tested above)."""

    def __init__(self, seen: list, limit_s: float):
        self.seen, self.limit_s = seen, limit_s

    def __enter__(self):
        self.seen.append(self.limit_s)
        return 0

    def __exit__(self, *exc):
        return False
