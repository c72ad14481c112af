"""Serving throughput: our tritonserver (the demo, 4 LoRA adapters) beside vLLM's CPU build (a Llama of the demo's
size and shape, 4 LoRA adapters r=16; benchmarks/peer_vllm.py), both running on this machine in the same run.
With `--pair` (a flag, not an engine choice), one more engine, `mol2_pair`: a disaggregated pair (`mol2 serve
--role decode` and `--role prefill --decode-url`, docs/disaggregated.md; fresh ports, a store each, one shared secret
file) sent the very requests the single server gets (Triton generate_stream, to the prefill server's public HTTP
port, which is behind `mol2 serve`'s guard; the single server's is tritonserver's own port, as before; the HTTP
guard cost 1.00-1.01x, benchmarks/README.md#guard_cost), interleaved with the others, plus a mol2_pair / mol2 ratio
table. With `--pair`, ours also get min_tokens = max_tokens (PAIR_NOTE). With `--onnxruntime`, one more:
`mol2_onnxruntime`, a second server on the exported ONNX graphs (`--engine onnxruntime`), whose turns run in the same
scheduler, a decode step one graph call for the batch (ced/ort_batched.py), with a mol2_onnxruntime / mol2 ratio
table. `--demo DIR`
serves another demo, as `mol2 serve --demo` (e.g. models/demo-v41, the deepseek_v41 family); every row carries its
`family`; vLLM and llama.cpp run only beside the ced family (their CPU builds do not run the V4.1 layout).

Cells: concurrency 1, 2, 4, 8, 16, 32 streams, on 1 adapter (every turn `chat` / a0) and on 4 adapters (stream i's
turn j on adapter (i + j) mod 4: round robin, every batch mixed). Each stream sends turns one after another: a short
prompt, max_tokens 64, `ignore_eos` (every stream runs to max_tokens where the server takes it). Each turn is a new
conversation (ours: no conversation_id, end_conversation true; vLLM: stateless completions), the prompt wrapped the
same way for both (our chat markers, one special token each), so both see the same token ids. Engines are
interleaved cell by cell (each engine's cell in turn, the order reversed every other cell), so drift of the
machine's load hits all of them; the load average is written beside each row.

`long_prompt`: at concurrency 8 on 4 adapters, one extra request with a ~25K-token prompt (this repository's
READMEs, repeated; counted with the demo tokenizer) arrives a third into the cell; the row's TTFTs are those of the
short requests that waited for their first token while the long prompt was being prefilled (sent before its first
token, first token after it was sent). tokens_per_s is over the whole cell; p50_itl_ms over the cell's short
requests; `max_itl_during_ms` the longest stall of a running stream during the prefill.

`llamacpp` (benchmarks/peer_llamacpp.py; `bash scripts/install_llamacpp.sh`, skipped with one line without it):
llama-server -t 2 on the vLLM peer's Llama and adapters converted to GGUF, its /completion with the turn wrapped in
our chat markers (the same token ids, checked against the demo tokenizer at start) and the adapter in the request's
`lora` field, the same client loop and token counts as the other engines. With it the cells always include issue
#36's: 1 stream on 1 adapter, 16 streams on 1 adapter and on 4 (TARGET_CELLS), and its targets are printed.

`cold_prompt`: one fresh ~4,096-token prompt alone (max_tokens 1), 3 of them in turn on each engine, each with a
first line no cache has seen; p50_ttft_ms is their median TTFT (`--cold-tokens 0` leaves the cell out).
`--contention` runs every cell twice, `contention` "none" and then "burner": beside a fixed CPU burner (one
busy-looping process of the benchmark's own, benchmarks/_contention.py, started before the cell and killed after it),
for every engine; issue #36's contention targets (a cold prompt's TTFT, 16-stream tokens/s, burner / none) printed.

`structured`: 16 streams on 4 adapters (ours only), the even streams' turns under a JSON schema (STRUCTURED_SCHEMA,
the engine's `structured_output` input: a grammar's token mask on those rows, python_backend/core/structured.py), the
odd ones free, right after the other cells, between two `structured_steady` cells of the same streams all free;
its tokens/s against the mean of those two is issue #35's target (>= 0.9), and `free_p50_itl_ms` (its free streams'
p50 ITL) against theirs says what the grammar rows cost the others. A schema's turn ends when its JSON is
complete, often before max_tokens: `mean_tokens` says how long its turns ran, `structured_tokens` the schema
streams' alone.

`--quick` (a smoke check): concurrency 1 and 16 on 4 adapters, cells of 8 s, a 4,096-token long prompt;
`--concurrency` and `--adapters` (comma lists) choose the cells, `--long-tokens 0` leaves the long prompt out.

    python -m benchmarks.serving_throughput [--quick] [--demo DIR] [--pair] [--onnxruntime] [--no-vllm] [--no-llamacpp] [--contention]
                                            [--concurrency 1,4,16] [--adapters 1,4] [--cold-tokens N]
                                            [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from . import load, peer_llamacpp
from ._contention import cpu_burner
from ._report import add_plot_option, markdown_table, plot_path, save_figure, write_json
from .peer_vllm import ADAPTERS, PEER_ROOT, SKIP_MESSAGE, build_peer, running_vllm, vllm_available, vllm_name

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = (1, 2, 4, 8, 16, 32)
QUICK_CONCURRENCY = (1, 16)
ADAPTER_COUNTS = (1, 4)
QUICK_ADAPTER_COUNTS = (4,)
MAX_TOKENS = 64
LONG_PROMPT_TOKENS = 25_000
QUICK_LONG_PROMPT_TOKENS = 4_096
LONG_CONCURRENCY, LONG_ADAPTERS = 8, 4
COLD_PROMPT_TOKENS, COLD_PROMPTS = 4_096, 3
TARGET_CELLS = ((1, 1), (1, 16), (4, 16))  # (adapters, concurrency): issue #36's, run whenever llama.cpp is
CONDITIONS = ("none", "burner")  # the `contention` of a row: alone, or beside one busy process (--contention)
PROMPTS = [
    "Tell me a joke about compilers.", "How was your weekend? Mine was quiet.", "Say something cheerful about rain.",
    "Archive every log file older than a week.", "Install the package that edits PDF files.",
    "Restart the web server and show its status.",
    "Write a Python function that merges two sorted lists.", "Fix the off-by-one error in this loop.",
    "Write a shell script that counts lines in every file.",
    "Make the header sticky with a soft shadow.", "Pick a calm colour palette for a reading app.",
    "Center the login form and round its corners.",
]
COLUMNS = ["family", "engine", "scenario", "contention", "concurrency", "adapters", "tokens_per_s", "p50_ttft_ms",
           "p95_ttft_ms", "p50_itl_ms", "requests", "mean_tokens", "errors", "load_avg"]
LONG_COLUMNS = ["engine", "contention", "long_prompt_tokens", "long_ttft_ms", "short_during", "p50_ttft_ms",
                "p95_ttft_ms", "before_p50_ttft_ms", "steady_p50_ttft_ms", "max_itl_during_ms", "tokens_per_s",
                "load_avg"]
COLD_COLUMNS = ["engine", "contention", "prompt_tokens", "p50_ttft_ms", "min_ttft_ms", "max_ttft_ms", "requests",
                "errors", "load_avg"]


def adapter_for(adapters: int, stream: int, turn: int) -> str:
    return ADAPTERS[0] if adapters == 1 else ADAPTERS[(stream + turn) % adapters]


Send = Callable[[str, str, int, load.Record], load.Record]  # (user text, our adapter, max_tokens, record) -> record


def mol2_send(client: load.Mol2Client, min_tokens: bool = False) -> Send:
    """Our Triton generate_stream: each turn a new conversation, ended by the turn (single server or pair);
    `min_tokens`: min_tokens = max_tokens sent beside ignore_eos (see PAIR_NOTE)."""
    return lambda text, adapter, max_tokens, record: client.stream(
        text, adapter, max_tokens, end_conversation=True, record=record, min_tokens=max_tokens if min_tokens else None)


def interval_note(args: argparse.Namespace) -> str:
    if not (args.pair and args.stream_interval_ms):
        return ""
    return f"; the pair streams with --stream-interval-ms {args.stream_interval_ms:g} (its turns' tokens gathered)"


PAIR_NOTE = ("with --pair every mol2 request also carries min_tokens = max_tokens: a pair's relay passes min_tokens on "
             "to its decode server but not ignore_eos, so without it the pair's turns stop at the model's stop token "
             "and do less work than the single server's")


def vllm_send(client: load.VllmClient) -> Send:
    """vLLM's completions: the turn wrapped in our chat markers, the adapter's LoRA name."""
    return lambda text, adapter, max_tokens, record: client.stream(load.user_turn(text), vllm_name(adapter),
                                                                   max_tokens, record=record)


def llamacpp_send(client: peer_llamacpp.LlamaCppClient) -> Send:
    """llama-server's /completion: the turn wrapped in our chat markers, our adapter in its `lora` field."""
    return lambda text, adapter, max_tokens, record: client.stream(load.user_turn(text), adapter, max_tokens,
                                                                   record=record)


def serve_status(base: str) -> dict | None:
    """A `mol2 serve`'s /v2/status (its supervisor's view: restarts of tritonserver, last exit); None when there is
    none (tritonserver's own port, or no answer)."""
    try:
        return json.loads(load.get_text(base, "/v2/status"))
    except (OSError, ValueError, load.ServerError, http.client.HTTPException):
        return None


def ready(base: str, timeout_s: float = 2.0) -> bool:
    try:
        load.get_text(base, "/v2/health/ready", timeout_s)
        return True
    except (OSError, load.ServerError, http.client.HTTPException):
        return False


class Engines:
    """The engines measured in this run, by name (mol2, mol2_pair, vllm): each a (short request, long request).
    `served`: for an engine run by `mol2 serve`, the HTTP bases of its servers, whose supervisors count restarts of
    tritonserver (a row's `restarts`) and whose readiness a cell waits for."""

    def __init__(self, sends: dict[str, Send], served: dict[str, list[str]] | None = None):
        self.sends, self.served = dict(sends), dict(served or {})

    @property
    def names(self) -> list[str]:
        return list(self.sends)

    def reversed(self) -> Engines:
        """The same engines, measured in the opposite order."""
        return Engines(dict(reversed(list(self.sends.items()))), self.served)

    def restarts(self, engine: str) -> int | None:
        """tritonserver restarts so far, summed over the engine's servers; None where not known."""
        statuses = [serve_status(base) for base in self.served.get(engine, [])]
        if not statuses or any(status is None for status in statuses):
            return None
        return sum(int(status.get("tritonserver", {}).get("restarts", 0)) for status in statuses)

    def wait_ready(self, engine: str, timeout_s: float = 300.0) -> None:
        """Until every server of the engine says ready (after a crash its supervisor restarts tritonserver: a cell
        does not start into that), at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for base in self.served.get(engine, []):
            while not ready(base) and time.monotonic() < deadline:
                time.sleep(1.0)

    def short(self, engine: str, adapters: int):
        send = self.sends[engine]

        def request(stream: int, turn: int, record: load.Record) -> load.Record:
            adapter = adapter_for(adapters, stream, turn)
            text = PROMPTS[(stream * 7 + turn) % len(PROMPTS)]
            record.engine, record.adapter = engine, adapter
            return send(text, adapter, MAX_TOKENS, record)
        return request

    def long(self, engine: str, text: str, tokens: int):
        send = self.sends[engine]

        def request(record: load.Record) -> load.Record:
            record.engine, record.adapter, record.tag, record.prompt_tokens = engine, ADAPTERS[0], "long", tokens
            return send(text, ADAPTERS[0], 1, record)
        return request


def steady_row(engine: str, concurrency: int, adapters: int, run: load.Run) -> dict:
    summary = load.summarize(run.records, run.window)
    done = [r for r in run.records if r.error is None]
    return {"engine": engine, "scenario": "steady", "concurrency": concurrency, "adapters": adapters,
            **{k: summary[k] for k in ("tokens_per_s", "p50_ttft_ms", "p95_ttft_ms", "p50_itl_ms", "requests",
                                       "errors")},
            "mean_tokens": statistics.mean(r.tokens for r in done) if done else None,
            "window_s": run.window[1] - run.window[0], "load_avg": load.load_avg(),
            "first_error": next((r.error for r in run.records if r.error), None)}


def long_row(engine: str, run: load.Run) -> dict:
    summary = load.summarize(run.records, run.window)
    long = run.extras[0]
    row = {"engine": engine, "scenario": "long_prompt", "concurrency": LONG_CONCURRENCY, "adapters": LONG_ADAPTERS,
           "tokens_per_s": summary["tokens_per_s"], "p50_itl_ms": summary["p50_itl_ms"],
           "requests": summary["requests"], "errors": summary["errors"] + (1 if long.error else 0),
           "long_prompt_tokens": long.prompt_tokens, "long_ttft_ms": None if long.ttft is None else long.ttft * 1e3,
           "window_s": run.window[1] - run.window[0], "load_avg": load.load_avg(),
           "first_error": long.error or next((r.error for r in run.records if r.error), None)}
    done = [r for r in run.records if r.error is None]
    row["mean_tokens"] = statistics.mean(r.tokens for r in done) if done else None
    before = [r.ttft for r in done if r.first_token is not None and r.first_token < long.start]
    row["before_p50_ttft_ms"] = load._ms(load.percentile(before, 50))  # the same cell before the long prompt came
    if long.first_token is not None:
        during = load.waiting_during(run.records, long.start, long.first_token)
        ttfts = [r.ttft for r in during if r.ttft is not None]
        row.update(short_during=len(during), p50_ttft_ms=load._ms(load.percentile(ttfts, 50)),
                   p95_ttft_ms=load._ms(load.percentile(ttfts, 95)),
                   max_itl_during_ms=load._ms(load.max_gap_during(run.records, long.start, long.first_token)))
    else:
        row.update(short_during=0, p50_ttft_ms=None, p95_ttft_ms=None, max_itl_during_ms=None)
    return row


def warm_up(engines: Engines) -> None:
    """One short turn per adapter on every engine (vLLM loads a LoRA on its first use; first calls compile)."""
    for engine in engines.names:
        for adapters in (4,):
            load.run_streams(1, engines.short(engine, adapters), requests_each=len(ADAPTERS))


def _restarted(engines: Engines, engine: str, before: int | None, errors: int) -> int | None:
    """Restarts since `before`; after a cell with errors, once the servers are ready again (a crash is counted when
    its supervisor has seen it)."""
    if errors and before is not None:
        time.sleep(2.0)
        engines.wait_ready(engine)
    after = engines.restarts(engine)
    return None if before is None or after is None else after - before


def measure(engines: Engines, concurrency: tuple[int, ...], adapter_counts: tuple[int, ...], cell_s: float,
            long_text: str | None, long_tokens: int, long_tail_s: float) -> list[dict]:
    """Every (adapters, concurrency) cell on each engine in turn (the order reversed every other cell, so each
    engine's mean place in the order is the same), then the long-prompt cell on each (none when `long_text` is
    None). A cell starts once its engine's servers are ready; `restarts`: tritonserver restarts during it."""
    rows = []
    cells = [(adapters, c) for adapters in adapter_counts for c in concurrency]
    for index, (adapters, c) in enumerate(cells):
        order = engines.names if index % 2 == 0 else engines.names[::-1]
        for engine in order:
            engines.wait_ready(engine)
            before = engines.restarts(engine)
            started = time.perf_counter()
            run = load.run_streams(c, engines.short(engine, adapters), duration_s=cell_s)
            rows.append(steady_row(engine, c, adapters, run))
            rows[-1]["restarts"] = _restarted(engines, engine, before, rows[-1]["errors"])
            print(f"  steady  {engine:9s} c={c:<2d} adapters={adapters}: {rows[-1]['tokens_per_s']:.1f} tok/s, "
                  f"p50 TTFT {rows[-1]['p50_ttft_ms'] or float('nan'):.0f} ms  ({time.perf_counter() - started:.0f} s, "
                  f"load {rows[-1]['load_avg'][0]}, errors {rows[-1]['errors']})", flush=True)
    for engine in engines.names if long_text is not None else []:
        engines.wait_ready(engine)
        before = engines.restarts(engine)
        started = time.perf_counter()
        run = load.run_streams(LONG_CONCURRENCY, engines.short(engine, LONG_ADAPTERS), duration_s=cell_s,
                               extras=[(cell_s / 3, engines.long(engine, long_text, long_tokens))],
                               tail_s=long_tail_s)
        rows.append(long_row(engine, run))
        rows[-1]["restarts"] = _restarted(engines, engine, before, rows[-1]["errors"])
        print(f"  long    {engine:9s}: long prompt TTFT {rows[-1]['long_ttft_ms'] or float('nan'):.0f} ms, short p50 "
              f"TTFT during it {rows[-1]['p50_ttft_ms'] or float('nan'):.0f} ms ({time.perf_counter() - started:.0f} s, "
              f"load {rows[-1]['load_avg'][0]})", flush=True)
    return rows


def _find(rows, **keys):
    return next((r for r in rows if all(r.get(k) == v for k, v in keys.items())), None)


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def ratio_rows(rows: list[dict], ours: str, theirs: str) -> list[dict]:
    """Per cell (steady: adapters x concurrency; long_prompt): `ours` / `theirs` of tokens/s, p50 TTFT and p50 ITL,
    for the cells both engines ran."""
    out = []
    for row in rows:
        if row["engine"] != ours:
            continue
        other = _find(rows, engine=theirs, scenario=row["scenario"], adapters=row["adapters"],
                      concurrency=row["concurrency"], contention=row.get("contention"))
        if other:
            out.append({"scenario": row["scenario"], "contention": row.get("contention"), "adapters": row["adapters"],
                        "concurrency": row["concurrency"],
                        f"tokens_per_s {ours}/{theirs}": _ratio(row["tokens_per_s"], other["tokens_per_s"]),
                        f"p50_ttft {ours}/{theirs}": _ratio(row["p50_ttft_ms"], other["p50_ttft_ms"]),
                        f"p50_itl {ours}/{theirs}": _ratio(row["p50_itl_ms"], other["p50_itl_ms"]),
                        "load_avg": row["load_avg"]})
    return out


def scaling_lines(rows: list[dict], engines: list[str]) -> list[str]:
    lines = []
    for engine in engines:
        for adapters in sorted({r["adapters"] for r in rows if r["scenario"] == "steady"}):
            c1 = _find(rows, engine=engine, scenario="steady", adapters=adapters, concurrency=1, contention="none")
            c16 = _find(rows, engine=engine, scenario="steady", adapters=adapters, concurrency=16, contention="none")
            if c1 and c16 and c1["tokens_per_s"] and c16["tokens_per_s"]:
                lines.append(f"{engine} tokens/s c16/c1, {adapters} adapter(s): "
                             f"{_ratio(c16['tokens_per_s'], c1['tokens_per_s']):.3g}")
    return lines


def pair_target_line(rows: list[dict], engine: str = "mol2_pair") -> str | None:
    """The house issue's targets: a pair (or --engine onnxruntime) at 16 mixed streams (4 adapters) reaches 0.8x
    the single torch server's tokens/s."""
    pair = _find(rows, engine=engine, scenario="steady", adapters=4, concurrency=16)
    single = _find(rows, engine="mol2", scenario="steady", adapters=4, concurrency=16)
    ratio = _ratio(pair["tokens_per_s"], single["tokens_per_s"]) if pair and single else None
    if ratio is None:
        return None
    return (f"{engine} / mol2 tokens/s at 16 streams on 4 adapters: {ratio:.3g} (target >= 0.8: "
            f"{'met' if ratio >= 0.8 else 'not met'})")


def plan_cells(adapter_counts: tuple[int, ...], concurrency: tuple[int, ...], with_llamacpp: bool
               ) -> list[tuple[int, int]]:
    """The (adapters, concurrency) cells chosen, plus issue #36's target cells where llama.cpp runs."""
    cells = [(adapters, c) for adapters in adapter_counts for c in concurrency]
    return sorted(set(cells) | set(TARGET_CELLS)) if with_llamacpp else cells


def cold_rows(engines: Engines, texts: list[str], tokens: int) -> list[dict]:
    """`cold_prompt`: each engine in turn sends `texts` one after another, alone (max_tokens 1)."""
    rows = []
    for engine in engines.names:
        engines.wait_ready(engine)
        records = []
        for text in texts:
            record = load.Record()
            try:
                engines.long(engine, text, tokens)(record)
            except (OSError, ValueError, load.ServerError, http.client.HTTPException) as error:  # kept in the row
                record.error = f"{type(error).__name__}: {error}"
            records.append(record)
        ttfts = [r.ttft * 1e3 for r in records if r.error is None and r.ttft is not None]
        rows.append({"engine": engine, "scenario": "cold_prompt", "concurrency": 1, "adapters": 1,
                     "tokens_per_s": None, "p50_ttft_ms": statistics.median(ttfts) if ttfts else None,
                     "p95_ttft_ms": None, "p50_itl_ms": None, "requests": len(records), "mean_tokens": None,
                     "errors": sum(1 for r in records if r.error), "prompt_tokens": tokens,
                     "min_ttft_ms": min(ttfts, default=None), "max_ttft_ms": max(ttfts, default=None),
                     "load_avg": load.load_avg(), "first_error": next((r.error for r in records if r.error), None)})
        p50 = rows[-1]["p50_ttft_ms"]
        print(f"  cold    {engine:9s}: {tokens}-token prompt, p50 TTFT {p50 or float('nan'):.0f} ms "
              f"(load {rows[-1]['load_avg'][0]}, errors {rows[-1]['errors']})", flush=True)
    return rows


@contextlib.contextmanager
def contention(condition: str, limit_s: float):
    """The block alone ("none") or beside the CPU burner ("burner"), which lives at most `limit_s`."""
    if condition == "none":
        yield
        return
    with cpu_burner(limit_s):
        yield


def measure_conditions(engines: Engines, cells: list[tuple[int, int]], conditions: tuple[str, ...], cell_s: float,
                       long_texts: dict[str, str] | None, long_tokens: int, long_tail_s: float, cold_tokens: int,
                       cold_text: Callable[[str, int], str]) -> list[dict]:
    """`measure` cell by cell ((adapters, concurrency); the engines' order reversed every other cell), each cell
    under every condition in turn; then the long-prompt cell and the cold-prompt cell (none when `long_texts` is None
    or `cold_tokens` is 0) under each. A row's `contention` says which. The burner's limit is a safety net: it is
    killed as its cell ends."""
    rows: list[dict] = []
    limit_s = 600.0 + 4 * cell_s

    def run(condition: str, measured: Callable[[], list[dict]]) -> None:
        if len(conditions) > 1:
            print(f"  -- contention: {condition}", flush=True)
        with contention(condition, limit_s):
            done = measured()
        rows.extend({**row, "contention": condition} for row in done)

    for index, (adapters, c) in enumerate(cells):
        ordered = engines if index % 2 == 0 else engines.reversed()
        for condition in conditions:
            run(condition, partial(measure, ordered, (c,), (adapters,), cell_s, None, 0, 0.0))
    for condition in conditions if long_texts is not None else ():  # a text per condition: none is cached
        run(condition, partial(measure, engines, (), (), cell_s, long_texts[condition], long_tokens, long_tail_s))
    for condition in conditions if cold_tokens > 0 else ():
        texts = [cold_text(condition, i) for i in range(COLD_PROMPTS)]
        run(condition, partial(cold_rows, engines, texts, cold_tokens))
    return rows


def _target(label: str, value: float | None, goal: str, met: bool | None) -> str:
    shown = "n/a (not measured)" if value is None else f"{value:.3g}"
    verdict = "" if value is None else f": {'met' if met else 'NOT met'}"
    return f"{label}: {shown} (target {goal}{verdict})"


def llamacpp_target_lines(rows: list[dict]) -> list[str]:
    """Issue #36's targets against llama.cpp, on the rows without contention."""
    def tps(engine, adapters, concurrency):
        row = _find(rows, engine=engine, scenario="steady", adapters=adapters, concurrency=concurrency,
                    contention="none")
        return row and row["tokens_per_s"]

    one = _ratio(tps("mol2", 1, 1), tps("llamacpp", 1, 1))
    mixed = _ratio(tps("mol2", 4, 16), tps("llamacpp", 1, 16))
    return [_target("mol2 / llamacpp tokens/s, 1 stream on 1 adapter", one, ">= 0.8", one is not None and one >= 0.8),
            _target("mol2 16 streams on 4 adapters / llamacpp 16 streams on 1 adapter, tokens/s", mixed, ">= 1.0",
                    mixed is not None and mixed >= 1.0)]


def contention_lines(rows: list[dict], engines: list[str]) -> list[str]:
    """Issue #36's contention targets per engine: burner / none of a cold prompt's TTFT and of 16-stream tokens/s."""
    lines = []
    def pair(engine, key, **cell):
        idle, busy = (_find(rows, engine=engine, contention=condition, **cell) for condition in CONDITIONS)
        return _ratio(busy and busy[key], idle and idle[key])

    for engine in engines:
        cold = pair(engine, "p50_ttft_ms", scenario="cold_prompt")
        if cold is not None:
            lines.append(_target(f"{engine} cold prompt p50 TTFT, burner / none", cold, "<= 3", cold <= 3))
        for adapters in (1, 4):
            ratio = pair(engine, "tokens_per_s", scenario="steady", adapters=adapters, concurrency=16)
            if ratio is not None:
                lines.append(_target(f"{engine} tokens/s at 16 streams on {adapters} adapter(s), burner / none",
                                     ratio, ">= 0.4", ratio >= 0.4))
    return lines


STRUCTURED_CONCURRENCY, STRUCTURED_ADAPTERS = 16, 4
STRUCTURED_SCHEMA = {"type": "object", "required": ["answer", "confidence", "tags"],
                     "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"},
                                    "tags": {"type": "array", "items": {"type": "string"}}}}


class StructuredClient(load.Mol2Client):
    """Our Triton generate_stream with every turn under STRUCTURED_SCHEMA (the `structured_output` input)."""

    def _body(self, *args, **kwargs) -> dict:
        spec = {"type": "json_schema", "value": json.dumps(STRUCTURED_SCHEMA)}
        return {**super()._body(*args, **kwargs), "structured_output": json.dumps(spec)}


def structured_rows(engine: str, client: load.Mol2Client, cell_s: float) -> list[dict]:
    """The `structured` cell on one of ours: half the streams under the schema, half free, every batch mixed. It is
    bracketed by two cells of the same streams all free (`structured_steady`, just before and just after), so that
    its target compares cells under the same load: measured against the `steady` cell minutes earlier, the ratio
    moved with the machine's drift (0.68-1.40 in one day's runs)."""
    guided = mol2_send(StructuredClient(client.base, timeout=client.timeout))
    plain = mol2_send(client)

    def requests(with_schema: bool):
        def request(stream: int, turn: int, record: load.Record) -> load.Record:
            adapter = adapter_for(STRUCTURED_ADAPTERS, stream, turn)
            record.engine, record.adapter = engine, adapter
            record.tag = "structured" if with_schema and stream % 2 == 0 else "plain"
            send = guided if record.tag == "structured" else plain
            return send(PROMPTS[(stream * 7 + turn) % len(PROMPTS)], adapter, MAX_TOKENS, record)
        return request

    load.run_streams(1, requests(True), requests_each=1)  # the schema's grammar compiles once, before the cells
    rows = []
    for scenario in ("structured_steady", "structured", "structured_steady"):
        run = load.run_streams(STRUCTURED_CONCURRENCY, requests(scenario == "structured"), duration_s=cell_s)
        row = {**steady_row(engine, STRUCTURED_CONCURRENCY, STRUCTURED_ADAPTERS, run), "scenario": scenario}
        schema_turns = [r.tokens for r in run.records if r.error is None and r.tag == "structured"]
        row["structured_tokens"] = statistics.mean(schema_turns) if schema_turns else None
        # the free streams' inter-token latency alone: what a grammar row costs the rows without one (issue #35)
        row["free_p50_itl_ms"] = load.summarize([r for r in run.records if r.tag == "plain"], run.window)["p50_itl_ms"]
        print(f"  {scenario:17s} {engine:9s} c={STRUCTURED_CONCURRENCY} adapters={STRUCTURED_ADAPTERS}: "
              f"{row['tokens_per_s']:.1f} tok/s, free streams' p50 ITL {row['free_p50_itl_ms'] or float('nan'):.1f} ms "
              f"(load {row['load_avg'][0]}, errors {row['errors']})", flush=True)
        rows.append(row)
    return rows


def structured_target_line(rows: list[dict]) -> str | None:
    """Issue #35's target: the structured cell's tokens/s >= 0.9x the steady cells' that bracket it (16 streams, 4
    adapters, the mean of the one before and the one after)."""
    cell = {"engine": "mol2", "adapters": STRUCTURED_ADAPTERS, "concurrency": STRUCTURED_CONCURRENCY,
            "contention": "none"}
    structured = _find(rows, scenario="structured", **cell)
    beside = [r["tokens_per_s"] for r in rows if r["scenario"] == "structured_steady" and r["engine"] == "mol2"
              and r["tokens_per_s"] is not None]
    if not structured or not beside:
        return None
    ratio = _ratio(structured["tokens_per_s"], statistics.mean(beside))
    itl = [r["free_p50_itl_ms"] for r in rows if r["scenario"] == "structured_steady" and r["engine"] == "mol2"]
    slower = _ratio(structured["free_p50_itl_ms"], statistics.mean(itl)) if None not in itl else None
    return _target("mol2 structured / the steady cells beside it, tokens/s at 16 streams on 4 adapters", ratio,
                   ">= 0.9", ratio is not None and ratio >= 0.9) + \
        (f"; the free streams' p50 ITL beside the grammar rows: {slower:.3g}x theirs in the steady cells"
         if slower is not None else "")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contended = [r for r in rows if r.get("contention") == "burner"]
    rows = [r for r in rows if r.get("contention", "none") == "none"]  # the first three panels: no burner
    figure, axes = plt.subplots(1, 4 if contended else 3, figsize=(17 if contended else 13, 3.6))
    left, middle, right = axes[:3]
    colours = {"mol2": "#2a7", "mol2_pair": "#36c", "mol2_onnxruntime": "#7a2", "vllm": "#c63", "llamacpp": "#94c"}
    styles = {(engine, adapters): (colour, "-" if adapters == 1 else "--") for engine, colour in colours.items()
              for adapters in (1, 4)}
    for (engine, adapters), (colour, dash) in styles.items():
        cells = sorted((r for r in rows if r["scenario"] == "steady" and r["engine"] == engine
                        and r["adapters"] == adapters), key=lambda r: r["concurrency"])
        if not cells:
            continue
        xs = [r["concurrency"] for r in cells]
        label = f"{engine}, {adapters} adapter{'s' if adapters > 1 else ''}"
        left.plot(xs, [r["tokens_per_s"] or 0 for r in cells], dash, color=colour, marker="o", label=label)
        middle.plot(xs, [r["p50_ttft_ms"] or 0 for r in cells], dash, color=colour, marker="o", label=label)
    for row in (r for r in rows if r["scenario"] == "structured"):  # beside the steady curve of its cell
        left.plot([row["concurrency"]], [row["tokens_per_s"] or 0], "*", color=colours[row["engine"]], markersize=11,
                  label=f"{row['engine']}, {row['adapters']} adapters, half under a JSON schema")
    for axis, title, unit in ((left, "throughput", "tokens/s"), (middle, "time to first token", "p50 TTFT (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel(unit)
        axis.set_title(title)
    middle.set_yscale("log")
    left.legend(fontsize=7)
    longs = [r for r in rows if r["scenario"] == "long_prompt"]
    bars = (("before_p50_ttft_ms", "#888", "p50 TTFT before it"), ("p50_ttft_ms", "#36c", "p50 TTFT during its prefill"),
            ("max_itl_during_ms", "#c33", "longest token gap during it"))
    for offset, (key, colour, label) in zip((-0.27, 0.0, 0.27), bars):
        values = [r.get(key) for r in longs]
        right.bar([x + offset for x in range(len(longs))], [v or 0 for v in values], 0.27, color=colour, label=label)
        for x, value in enumerate(values):
            if value is None:
                right.text(x + offset, 0.02, "none", rotation=90, ha="center", va="bottom", fontsize=7,
                           transform=right.get_xaxis_transform())
    right.set_xticks(list(range(len(longs))), [r["engine"] for r in longs])
    right.set_ylabel("short requests (ms)")
    right.set_yscale("log")
    right.set_title(f"a {longs[0]['long_prompt_tokens'] if longs else LONG_PROMPT_TOKENS}-token prompt arrives "
                    f"(c{LONG_CONCURRENCY}, {LONG_ADAPTERS} adapters)", fontsize=9)
    right.legend(fontsize=7)
    if contended:
        plot_contention(axes[3], rows, contended)
    engines = sorted({r["engine"] for r in rows}, key=list(colours).index)
    names = {"mol2": "mol2 (tritonserver, demo)", "mol2_pair": "mol2_pair (disaggregated)",
             "mol2_onnxruntime": "mol2_onnxruntime (exported graphs, batched)",
             "vllm": "vLLM CPU (same size Llama)", "llamacpp": "llama.cpp (same Llama, GGUF bf16)"}
    figure.suptitle(f"serving: {' vs '.join(names[e] for e in engines)}, {MAX_TOKENS} tokens a turn")
    save_figure(figure, path)


def plot_contention(axis, idle: list[dict], busy: list[dict]) -> None:
    """Per engine, burner / none: a cold prompt's TTFT and tokens/s at 16 streams, with the targets drawn."""
    engines = sorted({r["engine"] for r in busy})
    measures = (("cold_prompt", None, "p50_ttft_ms", "cold prompt TTFT", "#c33", 3.0),
                ("steady", 1, "tokens_per_s", "tokens/s, 16 streams, 1 adapter", "#888", 0.4),
                ("steady", 4, "tokens_per_s", "tokens/s, 16 streams, 4 adapters", "#36c", 0.4))
    for offset, (scenario, adapters, key, label, colour, target) in zip((-0.27, 0.0, 0.27), measures):
        cell = {"scenario": scenario} if adapters is None else {"scenario": scenario, "adapters": adapters,
                                                                 "concurrency": 16}
        values = []
        for engine in engines:
            before, after = _find(idle, engine=engine, **cell), _find(busy, engine=engine, **cell)
            values.append(_ratio(after and after[key], before and before[key]) or 0)
        axis.bar([x + offset for x in range(len(engines))], values, 0.27, color=colour, label=f"{label} "
                 f"(target {'<=' if key == 'p50_ttft_ms' else '>='} {target:g})")
    for target in (3.0, 0.4):
        axis.axhline(target, color="#444", linewidth=0.6, linestyle=":")
    axis.set_xticks(list(range(len(engines))), engines)
    axis.set_ylabel("with the burner / without")
    axis.set_yscale("log")
    axis.set_title("one busy process beside the server", fontsize=9)
    axis.legend(fontsize=6)


def _counts(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 16 on 4 adapters and shorter cells "
                                                             "(a smoke check)")
    parser.add_argument("--json", help="write the rows as JSON (the measured rows, then the ratio rows)")
    add_plot_option(parser, "artifacts/benchmarks/serving_throughput.png")
    parser.add_argument("--cell-s", type=float, default=None, help="seconds a cell sends new requests "
                                                                   "(default 30; --quick 8)")
    parser.add_argument("--concurrency", type=_counts, default=None,
                        help="streams of the cells, e.g. 1,4,16 (default 1,2,4,8,16,32; --quick 1,16)")
    parser.add_argument("--adapters", type=_counts, default=None,
                        help="adapter counts of the cells, 1 and/or 4 (default 1,4; --quick 4)")
    parser.add_argument("--long-tokens", type=int, default=None,
                        help=f"the long prompt's tokens (default {LONG_PROMPT_TOKENS}; --quick "
                             f"{QUICK_LONG_PROMPT_TOKENS}; 0: no long-prompt cell)")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    parser.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--contention", action="store_true",
                        help="run every cell twice: alone, then beside a CPU burner (one busy process)")
    parser.add_argument("--cold-tokens", type=int, default=COLD_PROMPT_TOKENS,
                        help=f"the cold prompts' tokens (default {COLD_PROMPT_TOKENS}; 0: no cold-prompt cell)")
    parser.add_argument("--pair", action="store_true",
                        help="also start a disaggregated pair (mol2 serve --role decode / --role prefill) and measure "
                             "it as engine mol2_pair, interleaved with the others")
    parser.add_argument("--stream-interval-ms", type=float, default=None,
                        help="with --pair: the pair's mol2 serve --stream-interval-ms (default: its own, 0)")
    parser.add_argument("--demo", default=None,
                        help="serve this demo folder, as `mol2 serve --demo` (e.g. models/demo-v41; default: the "
                             "demo every command uses); every row carries its `family`. vLLM and llama.cpp run only "
                             "beside the ced family (their CPU builds do not run the deepseek_v41 layout)")
    parser.add_argument("--engine", default="torch", choices=("torch", "onnxruntime"), help="our servers' engine")
    parser.add_argument("--onnxruntime", action="store_true",
                        help="also start a server on the exported ONNX graphs (mol2 serve --engine onnxruntime) and "
                             "measure it as engine mol2_onnxruntime, interleaved with the others")
    args = parser.parse_args(argv)
    args.plot = plot_path(args)
    concurrency = args.concurrency or (QUICK_CONCURRENCY if args.quick else CONCURRENCY)
    adapter_counts = args.adapters or (QUICK_ADAPTER_COUNTS if args.quick else ADAPTER_COUNTS)
    if set(adapter_counts) - {1, len(ADAPTERS)}:
        parser.error(f"--adapters: 1 and/or {len(ADAPTERS)}")
    cell_s = args.cell_s or (8.0 if args.quick else 30.0)
    if args.long_tokens is None:
        args.long_tokens = QUICK_LONG_PROMPT_TOKENS if args.quick else LONG_PROMPT_TOKENS
    long_tail_s = 2.0 if args.quick else 5.0
    began = time.perf_counter()

    from tokenizers import Tokenizer

    from python_backend.server.launcher import Ports
    from python_backend.server.serve_cli import prepare_demo

    from ced.families import family_of

    model_dir = prepare_demo(args.demo)
    family = family_of(model_dir).name
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    long_text, long_tokens = None, 0
    if args.long_tokens > 0:
        long_text = load.text_of_tokens(args.long_tokens, tokenizer, ROOT)
        long_tokens = len(tokenizer.encode(load.user_turn(long_text)).ids)
    if family != "ced" and not (args.no_vllm and args.no_llamacpp):
        print(f"vLLM and llama.cpp left out: their CPU builds do not run the {family} layout (their rows stay on "
              "the Llama peer of the ced demo's shape: run without --demo)")
        args.no_vllm = args.no_llamacpp = True
    use_vllm = not args.no_vllm and vllm_available()
    if not args.no_vllm and not use_vllm:
        print(SKIP_MESSAGE)
    use_llamacpp = not args.no_llamacpp and peer_llamacpp.llamacpp_available()
    if not args.no_llamacpp and not use_llamacpp:
        print(peer_llamacpp.SKIP_MESSAGE)
    cells = plan_cells(adapter_counts, concurrency, use_llamacpp)
    conditions = CONDITIONS if args.contention else CONDITIONS[:1]

    def cold_text(condition: str, index: int) -> str:  # a first line of its own: no engine has cached it
        return load.text_of_tokens(args.cold_tokens, tokenizer, ROOT, lead=f"{index} {condition}: a cold prompt.\n")

    max_prompt = "32768"  # the model's context: prompts up to it
    env = {"MOL2_ENGINE": args.engine, "MOL2_MAX_PROMPT_TOKENS": max_prompt}
    if args.engine == "onnxruntime":
        from ced.engines import ensure_onnx_engine

        env["MOL2_ENGINE_DIR"] = str(ensure_onnx_engine(model_dir))
    logs = ROOT / "artifacts/logs"

    clients: dict[str, load.Mol2Client] = {}
    with contextlib.ExitStack() as stack:
        ports, _ = stack.enter_context(load.demo_server("serving_throughput", env, demo=args.demo))
        clients["mol2"] = load.Mol2Client(f"http://{ports.http_url}")
        served: dict[str, list[str]] = {}
        if args.pair:
            prefill, decode = stack.enter_context(load.demo_pair(
                "serving_throughput_pair", ["--engine", args.engine, "--max-prompt-tokens", max_prompt,
                                            *(["--demo", args.demo] if args.demo else []),
                                            *([] if args.stream_interval_ms is None else
                                              ["--stream-interval-ms", str(args.stream_interval_ms)])]))
            # a request that hears nothing for 5 minutes fails (not 15): a stalled pair costs a cell, not the run
            clients["mol2_pair"] = load.Mol2Client(f"http://{prefill.http_url}", timeout=300.0)
            served["mol2_pair"] = [f"http://{prefill.http_url}", f"http://{decode.http_url}"]
        if args.onnxruntime:
            from ced.engines import ensure_onnx_engine

            ort_env = {**env, "MOL2_ENGINE": "onnxruntime", "MOL2_ENGINE_DIR": str(ensure_onnx_engine(model_dir))}
            ort_ports, _ = stack.enter_context(load.demo_server("serving_throughput_onnxruntime", ort_env,
                                                                demo=args.demo))
            clients["mol2_onnxruntime"] = load.Mol2Client(f"http://{ort_ports.http_url}")
        sends: dict[str, Send] = {name: mol2_send(client, min_tokens=args.pair) for name, client in clients.items()}
        if use_vllm:
            peer = build_peer(PEER_ROOT)
            vllm_port = Ports.free().http
            print(f"starting vLLM on the peer ({peer}); log {logs / 'vllm_serving_throughput.log'}", flush=True)
            sends["vllm"] = vllm_send(load.VllmClient(stack.enter_context(
                running_vllm(peer, vllm_port, logs / "vllm_serving_throughput.log"))))
        if use_llamacpp:
            sends["llamacpp"] = llamacpp_send(peer_llamacpp.start_client(
                stack, logs / "llamacpp_serving_throughput.log", tokenizer, Ports.free().http, ROOT))
        engines = Engines(sends, served)
        print(f"servers up after {time.perf_counter() - began:.0f} s ({', '.join(engines.names)}); warming up",
              flush=True)
        warm_up(engines)
        long_texts = None if long_text is None else {  # the first as it always was; the others start their own way
            condition: long_text if condition == CONDITIONS[0] else
            load.text_of_tokens(args.long_tokens, tokenizer, ROOT, lead=f"A long prompt, contention {condition}.\n")
            for condition in conditions}
        rows = measure_conditions(engines, cells, conditions, cell_s, long_texts, long_tokens, long_tail_s,
                                  args.cold_tokens, cold_text)
        rows += structured_rows("mol2", clients["mol2"], cell_s)
        exits = {base: (serve_status(base) or {}).get("tritonserver", {}) for bases in served.values()
                 for base in bases}
    notes = [f"{name}: {client.ignore_eos_note}" for name, client in clients.items() if client.ignore_eos_note]
    print(f"\n{MAX_TOKENS} tokens a turn, short prompts (each turn a new conversation: ours ends it with "
          f"end_conversation, vLLM's completions are stateless), cells of {cell_s:.0f} s, engines interleaved; "
          f"ignore_eos: {'; '.join(notes) or 'sent to all'}; load average (1, 5, 15 min) beside each row"
          f"{'; ' + PAIR_NOTE if args.pair else ''}{interval_note(args)}\n")
    for row in rows:
        row["family"] = family
    columns = COLUMNS + (["restarts"] if any(r.get("restarts") is not None for r in rows) else []) + \
        (["structured_tokens"] if any(r["scenario"] == "structured" for r in rows) else [])
    for row in rows:  # every row gets every column: a row measured alone, or with no value for a scenario's own
        row.setdefault("contention", "none")
        for column in columns:
            row.setdefault(column, None)
    print(markdown_table(rows, columns))
    longs = [r for r in rows if r["scenario"] == "long_prompt"]
    if longs:
        print(f"\nlong_prompt: a {long_tokens}-token prompt at concurrency {LONG_CONCURRENCY} on {LONG_ADAPTERS} "
              "adapters; TTFTs of the short requests waiting during its prefill\n")
        for row in longs:
            row["steady_p50_ttft_ms"] = (_find(rows, engine=row["engine"], scenario="steady", adapters=LONG_ADAPTERS,
                                               concurrency=LONG_CONCURRENCY, contention=row["contention"])
                                         or {}).get("p50_ttft_ms")
        print(markdown_table(longs, LONG_COLUMNS))
        print("(short_during: short requests that waited for their first token during the prefill; none means every "
              "stream was already decoding, and max_itl_during_ms is their stall; before_p50_ttft_ms: the same cell "
              "before the long prompt arrived)")
    colds = [r for r in rows if r["scenario"] == "cold_prompt"]
    if colds:
        print(f"\ncold_prompt: {COLD_PROMPTS} fresh {args.cold_tokens}-token prompts alone, one after another, "
              "max_tokens 1\n")
        print(markdown_table(colds, COLD_COLUMNS))
    ratio_tables = []
    for ours, theirs in (("mol2", "vllm"), ("mol2", "llamacpp"), ("mol2_pair", "mol2"), ("mol2_onnxruntime", "mol2")):
        ratios = ratio_rows(rows, ours, theirs)
        if ratios:
            print(f"\nratios ({ours} / {theirs})\n")
            print(markdown_table(ratios, list(ratios[0])))
            ratio_tables += [{"engine": f"{ours}/{theirs}", **r, "scenario": f"{r['scenario']}_ratio", "family": family}
                             for r in ratios]
    for line in scaling_lines(rows, engines.names):
        print(line)
    for other in ("mol2_pair", "mol2_onnxruntime"):
        target = pair_target_line(rows, other)
        if target:
            print(target)
    target = structured_target_line(rows)
    if target:
        print(target)
    if use_llamacpp:
        print(f"\nissue #36's targets (llama.cpp: {peer_llamacpp.installed_version()}, -t {peer_llamacpp.THREADS}):")
        for line in llamacpp_target_lines(rows):
            print(line)
    for line in contention_lines(rows, engines.names):
        print(line)
    short_turns = [r for r in rows if r["scenario"] == "steady" and r["mean_tokens"] is not None
                   and r["mean_tokens"] < 0.95 * MAX_TOKENS]
    for row in short_turns:
        print(f"note: {row['engine']} c={row['concurrency']} adapters={row['adapters']} generated "
              f"{row['mean_tokens']:.1f} tokens a turn, not {MAX_TOKENS}: its streams stopped early (less work a turn)")
    for base, status in exits.items():
        if status.get("restarts"):
            print(f"note: the mol2 serve on {base.removeprefix('http://')} restarted its tritonserver "
                  f"{status['restarts']} time(s); last exit: {status.get('last_exit')}")
    errors = [r for r in rows if r.get("first_error")]
    for row in errors:
        print(f"errors in {row['engine']} {row['scenario']} c={row['concurrency']} adapters={row['adapters']}: "
              f"{row['errors']}, first: {row['first_error']}")
    if not use_vllm and not args.no_vllm:
        print(SKIP_MESSAGE)
    if not use_llamacpp and not args.no_llamacpp:
        print(peer_llamacpp.SKIP_MESSAGE)
    print(f"\ntook {time.perf_counter() - began:.0f} s; load average now {load.load_avg()}")
    write_json(rows + ratio_tables, args.json)
    plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
