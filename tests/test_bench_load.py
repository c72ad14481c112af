"""benchmarks/load.py's pure logic: summaries of synthetic records, Prometheus sums, the runner's bookkeeping with
a fake request (no server)."""

from __future__ import annotations

import time

import pytest

from benchmarks.load import (Record, max_gap_during, percentile, prometheus_sum, run_streams, summarize,
                             user_turn, waiting_during)


def record(start: float, times: list[float], **fields) -> Record:
    return Record(start=start, token_times=list(times), end=times[-1] if times else start, **fields)


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 101)), 95) == pytest.approx(95.05)


def test_summary_counts_tokens_inside_the_window():
    records = [record(0.0, [0.1, 0.2, 0.3, 0.4]), record(0.5, [0.9, 1.0, 1.1]),
               record(1.5, [2.5, 2.6])]  # the last one sent inside, its tokens after the window
    summary = summarize(records, window=(0.0, 2.0))
    assert summary["tokens"] == 7
    assert summary["tokens_per_s"] == pytest.approx(3.5)
    assert summary["requests"] == 3
    assert summary["p50_ttft_ms"] == pytest.approx(400.0)  # TTFTs 100, 400, 1000 ms
    assert summary["p95_ttft_ms"] == pytest.approx(940.0)
    assert summary["p50_itl_ms"] == pytest.approx(100.0)
    assert summary["errors"] == 0


def test_summary_default_window_and_errors():
    records = [record(1.0, [1.5, 2.0, 3.0]), Record(start=1.2, error="ServerError: boom")]
    summary = summarize(records)
    assert summary["tokens_per_s"] == pytest.approx(3 / 2.0)  # first send (1.0) to last token (3.0)
    assert summary["errors"] == 1
    assert summary["requests"] == 1
    assert summary["p50_itl_ms"] == pytest.approx(750.0)  # gaps 0.5 s and 1.0 s


def test_tokens_arriving_together_share_a_time():
    r = Record(start=0.0)
    r.add_tokens(1, 0.2)
    r.add_tokens(3, 0.5)
    r.add_tokens(0, 0.6)
    assert r.tokens == 4 and r.ttft == pytest.approx(0.2)
    assert r.gaps == pytest.approx([0.3, 0.0, 0.0])


def test_requests_waiting_during_a_prefill():
    long_start, long_first = 10.0, 20.0
    records = [record(5.0, [9.0, 9.5]),        # first token before the prefill began: not waiting
               record(9.0, [21.0]),            # waited across the start
               record(15.0, [16.0]),           # sent and answered inside
               record(19.0, [25.0]),           # waited across the end
               record(20.5, [21.0])]           # sent after the prefill's first token
    during = waiting_during(records, long_start, long_first)
    assert [r.start for r in during] == [9.0, 15.0, 19.0]
    stalled = [record(0.0, [1.0, 9.0, 22.0, 22.1])]
    assert max_gap_during(stalled, long_start, long_first) == pytest.approx(13.0)
    assert max_gap_during([record(0.0, [1.0, 2.0])], long_start, long_first) is None


def test_prometheus_sum_over_labels():
    text = "\n".join(["# HELP mol2_state_bytes_written bytes", "# TYPE mol2_state_bytes_written counter",
                      'mol2_state_bytes_written{adapter="chat",stage="decode"} 100',
                      'mol2_state_bytes_written{adapter="agent",stage="prefill"} 28.5',
                      'mol2_state_bytes_written_other{adapter="chat"} 7',
                      'mol2_requests{adapter="chat"} 3'])
    assert prometheus_sum(text, "mol2_state_bytes_written") == pytest.approx(128.5)
    assert prometheus_sum(text, "mol2_state_bytes_moved") is None
    assert prometheus_sum("mol2_state_bytes_moved_total 5\n", "mol2_state_bytes_moved") == 5.0


def test_runner_requests_each_and_a_failing_stream():
    def request(stream, turn, rec):
        rec.start = time.perf_counter()
        if stream == 1 and turn == 1:
            raise RuntimeError("refused")
        rec.add_tokens(2)
        rec.end = time.perf_counter()
        return rec

    run = run_streams(3, request, requests_each=3)
    ok = [r for r in run.records if r.error is None]
    assert len(ok) == 3 + 1 + 3  # stream 1 stopped at its failure
    assert [r.error for r in run.records if r.error] == ["RuntimeError: refused"]
    assert summarize(run.records, run.window)["tokens"] == 14


def test_runner_duration_stops_new_requests_at_its_end():
    def request(stream, turn, rec):
        rec.start = time.perf_counter()
        time.sleep(0.01)
        rec.add_tokens(1)
        rec.end = time.perf_counter()
        return rec

    started = time.perf_counter()
    run = run_streams(2, request, duration_s=0.05)
    assert time.perf_counter() - started < 1.0
    assert all(r.start <= run.window[1] for r in run.records)
    assert run.window[1] - run.window[0] == pytest.approx(0.05)


def test_runner_duration_with_an_extra():
    def request(stream, turn, rec):
        rec.start = time.perf_counter()
        time.sleep(0.01)
        rec.add_tokens(1)
        rec.end = time.perf_counter()
        return rec

    def extra(rec):
        rec.start = time.perf_counter()
        time.sleep(0.15)
        rec.add_tokens(1)
        rec.end = time.perf_counter()
        return rec

    run = run_streams(2, request, duration_s=0.05, extras=[(0.02, extra)], tail_s=0.02)
    assert len(run.extras) == 1 and run.extras[0].tokens == 1
    _, end = run.window
    assert end >= run.extras[0].end + 0.02 - 1e-6  # the window outlasts the extra
    assert any(r.start > run.extras[0].end for r in run.records)  # streams kept going past the nominal 0.05 s
    with pytest.raises(ValueError):
        run_streams(1, request)


def test_user_turn_markers():
    assert user_turn("hi") == "<|bos|><|user|>hi<|end|><|assistant|>"
    assert user_turn("hi", first=False) == "<|user|>hi<|end|><|assistant|>"
