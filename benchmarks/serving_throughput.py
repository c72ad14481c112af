"""Serving throughput: our tritonserver (the demo, 4 LoRA adapters) beside vLLM's CPU build (a Llama of the demo's
size and shape, 4 LoRA adapters r=16; benchmarks/peer_vllm.py), both running on this machine in the same run.

Cells: concurrency 1, 2, 4, 8, 16, 32 streams, on 1 adapter (every turn `chat` / a0) and on 4 adapters (stream i's
turn j on adapter (i + j) mod 4: round robin, every batch mixed). Each stream sends turns one after another: a short
prompt, max_tokens 64, `ignore_eos` (every stream runs to max_tokens where the server takes it). Each turn is a new
conversation (ours: no conversation_id, end_conversation true; vLLM: stateless completions), the prompt wrapped the
same way for both (our chat markers, one special token each), so both see the same token ids. Engines are
interleaved cell by cell (one engine's cell, then the other's, the order alternating), so drift of the machine's
load hits both; the load average is written beside each row.

`long_prompt`: at concurrency 8 on 4 adapters, one extra request with a ~25K-token prompt (this repository's
READMEs, repeated; counted with the demo tokenizer) arrives a third into the cell; the row's TTFTs are those of the
short requests that waited for their first token while the long prompt was being prefilled (sent before its first
token, first token after it was sent). tokens_per_s is over the whole cell; p50_itl_ms over the cell's short
requests; `max_itl_during_ms` the longest stall of a running stream during the prefill.

    python -m benchmarks.serving_throughput [--quick] [--json PATH] [--plot PATH] [--no-vllm]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from . import load
from ._report import add_plot_option, markdown_table, plot_path, save_figure, write_json
from .peer_vllm import ADAPTERS, PEER_ROOT, SKIP_MESSAGE, build_peer, running_vllm, vllm_available, vllm_name

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = (1, 2, 4, 8, 16, 32)
QUICK_CONCURRENCY = (1, 4, 16)
ADAPTER_COUNTS = (1, 4)
MAX_TOKENS = 64
LONG_PROMPT_TOKENS = 25_000
LONG_CONCURRENCY, LONG_ADAPTERS = 8, 4
PROMPTS = [
    "Tell me a joke about compilers.", "How was your weekend? Mine was quiet.", "Say something cheerful about rain.",
    "Archive every log file older than a week.", "Install the package that edits PDF files.",
    "Restart the web server and show its status.",
    "Write a Python function that merges two sorted lists.", "Fix the off-by-one error in this loop.",
    "Write a shell script that counts lines in every file.",
    "Make the header sticky with a soft shadow.", "Pick a calm colour palette for a reading app.",
    "Center the login form and round its corners.",
]
COLUMNS = ["engine", "scenario", "concurrency", "adapters", "tokens_per_s", "p50_ttft_ms", "p95_ttft_ms",
           "p50_itl_ms", "requests", "mean_tokens", "errors", "load_avg"]
LONG_COLUMNS = ["engine", "long_prompt_tokens", "long_ttft_ms", "short_during", "p50_ttft_ms", "p95_ttft_ms",
                "before_p50_ttft_ms", "steady_p50_ttft_ms", "max_itl_during_ms", "tokens_per_s", "load_avg"]


def adapter_for(adapters: int, stream: int, turn: int) -> str:
    return ADAPTERS[0] if adapters == 1 else ADAPTERS[(stream + turn) % adapters]


class Engines:
    """The engines measured in this run: name -> (a short request, a long request)."""

    def __init__(self, mol2: load.Mol2Client, vllm: load.VllmClient | None):
        self.mol2, self.vllm = mol2, vllm

    @property
    def names(self) -> list[str]:
        return ["mol2"] + (["vllm"] if self.vllm else [])

    def short(self, engine: str, adapters: int):
        def request(stream: int, turn: int, record: load.Record) -> load.Record:
            adapter = adapter_for(adapters, stream, turn)
            text = PROMPTS[(stream * 7 + turn) % len(PROMPTS)]
            record.engine, record.adapter = engine, adapter
            if engine == "mol2":
                return self.mol2.stream(text, adapter, MAX_TOKENS, end_conversation=True, record=record)
            return self.vllm.stream(load.user_turn(text), vllm_name(adapter), MAX_TOKENS, record=record)
        return request

    def long(self, engine: str, text: str, tokens: int):
        def request(record: load.Record) -> load.Record:
            record.engine, record.adapter, record.tag, record.prompt_tokens = engine, ADAPTERS[0], "long", tokens
            if engine == "mol2":
                return self.mol2.stream(text, ADAPTERS[0], 1, end_conversation=True, record=record)
            return self.vllm.stream(load.user_turn(text), vllm_name(ADAPTERS[0]), 1, record=record)
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


def measure(engines: Engines, concurrency: tuple[int, ...], cell_s: float, long_text: str, long_tokens: int,
            long_tail_s: float) -> list[dict]:
    rows = []
    cells = [(adapters, c) for adapters in ADAPTER_COUNTS for c in concurrency]
    for index, (adapters, c) in enumerate(cells):
        order = engines.names if index % 2 == 0 else engines.names[::-1]
        for engine in order:
            started = time.perf_counter()
            run = load.run_streams(c, engines.short(engine, adapters), duration_s=cell_s)
            rows.append(steady_row(engine, c, adapters, run))
            print(f"  steady  {engine:4s} c={c:<2d} adapters={adapters}: {rows[-1]['tokens_per_s']:.1f} tok/s, "
                  f"p50 TTFT {rows[-1]['p50_ttft_ms'] or float('nan'):.0f} ms  ({time.perf_counter() - started:.0f} s, "
                  f"load {rows[-1]['load_avg'][0]})", flush=True)
    for index, engine in enumerate(engines.names):
        started = time.perf_counter()
        run = load.run_streams(LONG_CONCURRENCY, engines.short(engine, LONG_ADAPTERS), duration_s=cell_s,
                               extras=[(cell_s / 3, engines.long(engine, long_text, long_tokens))],
                               tail_s=long_tail_s)
        rows.append(long_row(engine, run))
        print(f"  long    {engine:4s}: long prompt TTFT {rows[-1]['long_ttft_ms'] or float('nan'):.0f} ms, short p50 "
              f"TTFT during it {rows[-1]['p50_ttft_ms'] or float('nan'):.0f} ms ({time.perf_counter() - started:.0f} s, "
              f"load {rows[-1]['load_avg'][0]})", flush=True)
    return rows


def _find(rows, **keys):
    return next((r for r in rows if all(r.get(k) == v for k, v in keys.items())), None)


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def ratio_rows(rows: list[dict], concurrency: tuple[int, ...]) -> list[dict]:
    """Per scenario / adapters / concurrency: mol2 / vllm of tokens/s and TTFT; and mol2's c_max / c1 tokens/s."""
    out = []
    for adapters in ADAPTER_COUNTS:
        for c in concurrency:
            ours, theirs = _find(rows, engine="mol2", scenario="steady", adapters=adapters, concurrency=c), \
                _find(rows, engine="vllm", scenario="steady", adapters=adapters, concurrency=c)
            if ours and theirs:
                out.append({"scenario": "steady", "adapters": adapters, "concurrency": c,
                            "tokens_per_s mol2/vllm": _ratio(ours["tokens_per_s"], theirs["tokens_per_s"]),
                            "p50_ttft mol2/vllm": _ratio(ours["p50_ttft_ms"], theirs["p50_ttft_ms"]),
                            "p50_itl mol2/vllm": _ratio(ours["p50_itl_ms"], theirs["p50_itl_ms"])})
    ours, theirs = _find(rows, engine="mol2", scenario="long_prompt"), _find(rows, engine="vllm", scenario="long_prompt")
    if ours and theirs:
        out.append({"scenario": "long_prompt", "adapters": LONG_ADAPTERS, "concurrency": LONG_CONCURRENCY,
                    "tokens_per_s mol2/vllm": _ratio(ours["tokens_per_s"], theirs["tokens_per_s"]),
                    "p50_ttft mol2/vllm": _ratio(ours["p50_ttft_ms"], theirs["p50_ttft_ms"]),
                    "p50_itl mol2/vllm": _ratio(ours["p50_itl_ms"], theirs["p50_itl_ms"])})
    return out


def scaling_lines(rows: list[dict]) -> list[str]:
    lines = []
    for adapters in ADAPTER_COUNTS:
        c1 = _find(rows, engine="mol2", scenario="steady", adapters=adapters, concurrency=1)
        c16 = _find(rows, engine="mol2", scenario="steady", adapters=adapters, concurrency=16)
        if c1 and c16:
            lines.append(f"mol2 tokens/s c16/c1, {adapters} adapter(s): "
                         f"{_ratio(c16['tokens_per_s'], c1['tokens_per_s']):.3g}")
    return lines


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(13, 3.6))
    styles = {("mol2", 1): ("#2a7", "-"), ("mol2", 4): ("#2a7", "--"), ("vllm", 1): ("#c63", "-"),
              ("vllm", 4): ("#c63", "--")}
    for (engine, adapters), (colour, dash) in styles.items():
        cells = sorted((r for r in rows if r["scenario"] == "steady" and r["engine"] == engine
                        and r["adapters"] == adapters), key=lambda r: r["concurrency"])
        if not cells:
            continue
        xs = [r["concurrency"] for r in cells]
        label = f"{engine}, {adapters} adapter{'s' if adapters > 1 else ''}"
        left.plot(xs, [r["tokens_per_s"] or 0 for r in cells], dash, color=colour, marker="o", label=label)
        middle.plot(xs, [r["p50_ttft_ms"] or 0 for r in cells], dash, color=colour, marker="o", label=label)
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
    figure.suptitle(f"serving: mol2 (tritonserver, demo) vs vLLM CPU (same size Llama), {MAX_TOKENS} tokens a turn")
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="concurrency 1, 4, 16 and shorter cells (a smoke check)")
    parser.add_argument("--json", help="write the rows as JSON")
    add_plot_option(parser, "artifacts/benchmarks/serving_throughput.png")
    parser.add_argument("--cell-s", type=float, default=None, help="seconds a cell sends new requests "
                                                                   "(default 30; --quick 8)")
    parser.add_argument("--long-tokens", type=int, default=LONG_PROMPT_TOKENS)
    parser.add_argument("--no-vllm", action="store_true", help="measure our server alone")
    parser.add_argument("--engine", default="torch", choices=("torch", "onnxruntime"), help="our server's engine")
    args = parser.parse_args(argv)
    args.plot = plot_path(args)
    concurrency = QUICK_CONCURRENCY if args.quick else CONCURRENCY
    cell_s = args.cell_s or (8.0 if args.quick else 30.0)
    long_tail_s = 2.0 if args.quick else 5.0
    began = time.perf_counter()

    from tokenizers import Tokenizer

    from python_backend.server.launcher import Ports
    from python_backend.server.serve_cli import prepare_demo

    model_dir = prepare_demo()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    long_text = load.text_of_tokens(args.long_tokens, tokenizer, ROOT)
    long_tokens = len(tokenizer.encode(load.user_turn(long_text)).ids)
    use_vllm = not args.no_vllm and vllm_available()
    if not args.no_vllm and not use_vllm:
        print(SKIP_MESSAGE)
    env = {"MOL2_ENGINE": args.engine, "MOL2_MAX_PROMPT_TOKENS": "32768"}  # the model's context: prompts up to it
    if args.engine == "onnxruntime":
        from ced.engines import ensure_onnx_engine

        env["MOL2_ENGINE_DIR"] = str(ensure_onnx_engine(model_dir))
    logs = ROOT / "artifacts/logs"
    import contextlib

    with contextlib.ExitStack() as stack:
        ports, _ = stack.enter_context(load.demo_server("serving_throughput", env))
        vllm = None
        if use_vllm:
            peer = build_peer(PEER_ROOT)
            vllm_port = Ports.free().http
            print(f"starting vLLM on the peer ({peer}); log {logs / 'vllm_serving_throughput.log'}", flush=True)
            vllm = load.VllmClient(stack.enter_context(running_vllm(peer, vllm_port,
                                                                     logs / "vllm_serving_throughput.log")))
        mol2 = load.Mol2Client(f"http://{ports.http_url}")
        engines = Engines(mol2, vllm)
        print(f"servers up after {time.perf_counter() - began:.0f} s; warming up", flush=True)
        warm_up(engines)
        rows = measure(engines, concurrency, cell_s, long_text, long_tokens, long_tail_s)
    print(f"\n{MAX_TOKENS} tokens a turn, short prompts (each turn a new conversation: ours ends it with "
          f"end_conversation, vLLM's completions are stateless), cells of {cell_s:.0f} s, engines interleaved; "
          f"ignore_eos: {mol2.ignore_eos_note or 'sent to both'}; load average (1, 5, 15 min) beside each row\n")
    print(markdown_table(rows, COLUMNS))
    print(f"\nlong_prompt: a {long_tokens}-token prompt at concurrency {LONG_CONCURRENCY} on {LONG_ADAPTERS} adapters; "
          "TTFTs of the short requests waiting during its prefill\n")
    longs = [r for r in rows if r["scenario"] == "long_prompt"]
    for row in longs:
        row["steady_p50_ttft_ms"] = (_find(rows, engine=row["engine"], scenario="steady", adapters=LONG_ADAPTERS,
                                           concurrency=LONG_CONCURRENCY) or {}).get("p50_ttft_ms")
    print(markdown_table(longs, LONG_COLUMNS))
    print("(short_during: short requests that waited for their first token during the prefill; none means every "
          "stream was already decoding, and max_itl_during_ms is their stall; before_p50_ttft_ms: the same cell "
          "before the long prompt arrived)")
    ratios = ratio_rows(rows, concurrency)
    if ratios:
        print("\nratios (mol2 / vllm)\n")
        print(markdown_table(ratios, list(ratios[0])))
    for line in scaling_lines(rows):
        print(line)
    errors = [r for r in rows if r.get("first_error")]
    for row in errors:
        print(f"errors in {row['engine']} {row['scenario']} c={row['concurrency']} adapters={row['adapters']}: "
              f"{row['errors']}, first: {row['first_error']}")
    if not use_vllm and not args.no_vllm:
        print(SKIP_MESSAGE)
    print(f"\ntook {time.perf_counter() - began:.0f} s; load average now {load.load_avg()}")
    write_json(rows, args.json)
    plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
