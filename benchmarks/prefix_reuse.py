"""Prefix reuse across adapters: the time to the first token of a long chat history sent whole (OpenAI's stateless
way), cold, again under the same adapter, then under another adapter; ours (tritonserver on the demo behind the
OpenAI front end, as `mol2 serve` runs them) beside vLLM's CPU build (benchmarks/peer_vllm.py) on this machine.

Each measurement takes a fresh history: this repository's READMEs as one user message, cut so that the rendered
chat (`<|bos|><|user|>text<|end|><|assistant|>`, the same ids under both servers' templates) is `context_tokens`
long in demo tokens, opened by a line of its own ("Session <hex>.") so that neither cache has seen any block of
it. Then three streamed chat completions of 1 token, in this order: `cold` under adapter A (chat / vLLM a0),
`same_adapter` under A, `other_adapter` under B (coding / vLLM a2). ttft_ms = client-observed time from sending to
the first streamed token, on loopback, the median over the repeats. cached_tokens: ours from the answer's
usage.prompt_tokens_details.cached_tokens; vLLM's from the change of its `vllm:prefix_cache_hits` counter across the
request (its usage has no cached tokens unless started with --enable-prompt-tokens-details). vLLM keys its prefix
cache by adapter, so its other_adapter is a full prefill; ours reuses the adapter-free prefix and replays W.

Engines are interleaved context by context (the order alternating); the load average is written beside each row.

`--demo DIR` serves another demo (as `mol2 serve --demo DIR`), e.g. models/demo-v41; every row names its model's
family (ced, deepseek_v41; vLLM's rows `llama`). vLLM's peer is a Llama of the CED demo's shape and its CPU build does
not run the deepseek_v41 layout, so with a deepseek_v41 demo it is left out, said so in one line.

    python -m benchmarks.prefix_reuse [--demo DIR] [--quick] [--json PATH] [--plot PATH] [--no-vllm] [--repeats N]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import uuid
from pathlib import Path

from . import load
from ._report import add_plot_option, markdown_table, plot_path, save_figure, write_json
from .peer_vllm import PEER_ROOT, SKIP_MESSAGE, build_peer, running_vllm, vllm_available, vllm_name

ROOT = Path(__file__).resolve().parent.parent
CONTEXTS = (2048, 8192)
QUICK_CONTEXTS = (2048,)
CASES = ("cold", "same_adapter", "other_adapter")
ADAPTER_A, ADAPTER_B = "chat", "coding"
COLUMNS = ["family", "engine", "context_tokens", "case", "ttft_ms", "ttft_ms_min", "ttft_ms_max", "cached_tokens",
           "prompt_tokens", "repeats", "load_avg"]
HITS = "vllm:prefix_cache_hits"
PEER_FAMILY = "llama"  # vLLM's model: a Llama of the CED demo's size (benchmarks/peer_vllm.py)
PEER_SKIPPED = ("vLLM left out: its CPU build does not run the {family} layout (its rows stay on its Llama peer: run "
                "prefix_reuse without --demo)")


def history(tokens: int, tokenizer) -> list[dict]:
    """A chat of one user message whose rendering is `tokens` long, never sent before (its own first line)."""
    lead = f"Session {uuid.uuid4().hex[:12]}.\n"
    return [{"role": "user", "content": load.text_of_tokens(tokens, tokenizer, ROOT, lead=lead)}]


class Engine:
    """One server's OpenAI endpoint: `name` (mol2 | vllm), its model names for adapters A and B, its model's family."""

    def __init__(self, name: str, base: str, models: tuple[str, str], metrics_base: str | None = None,
                 family: str = PEER_FAMILY):
        self.name, self.base, self.models, self.metrics_base = name, base, models, metrics_base
        self.family = family

    def hits(self) -> float | None:
        if self.metrics_base is None:
            return None
        try:
            return load.prometheus_sum(load.get_text(self.metrics_base, "/metrics"), HITS)
        except (OSError, load.ServerError):
            return None

    def first_token(self, messages: list[dict], model: str) -> tuple[float, int | None, int | None]:
        """(ttft seconds, cached tokens, prompt tokens) of one streamed chat completion of one token."""
        body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        before = self.hits()
        started, first, usage = time.perf_counter(), None, {}
        for event in load.post_sse(self.base, "/v1/chat/completions", body):
            choices = event.get("choices") or []
            if first is None and choices and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter()
            usage = event.get("usage") or usage
        first = first or time.perf_counter()  # a token that decodes to nothing: the stream's end
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if self.metrics_base is not None:
            time.sleep(0.2)  # vLLM records a step's stats just after sending its outputs
            after = self.hits()
            cached = None if after is None or before is None else int(after - before)
        return first - started, cached, usage.get("prompt_tokens")


def measure(engine: Engine, tokenizer, context: int, repeats: int) -> list[dict]:
    samples = {case: [] for case in CASES}
    cached = {case: [] for case in CASES}
    prompts = []
    a, b = engine.models
    for _ in range(repeats):
        messages = history(context, tokenizer)
        for case, model in zip(CASES, (a, a, b)):
            seconds, hit, prompt_tokens = engine.first_token(messages, model)
            samples[case].append(seconds * 1e3)
            cached[case].append(hit)
            prompts.append(prompt_tokens)
    rows = []
    for case in CASES:
        ms = samples[case]
        hits = [h for h in cached[case] if h is not None]
        rows.append({"family": engine.family, "engine": engine.name, "context_tokens": context, "case": case,
                     "ttft_ms": statistics.median(ms), "ttft_ms_min": min(ms), "ttft_ms_max": max(ms),
                     "cached_tokens": int(statistics.median(hits)) if hits else None,
                     "prompt_tokens": next((p for p in prompts if p is not None), None), "repeats": len(ms),
                     "load_avg": load.load_avg()})
    return rows


def _get(rows, engine, context, case):
    row = next((r for r in rows if r["engine"] == engine and r["context_tokens"] == context and r["case"] == case),
               None)
    return None if row is None else row["ttft_ms"]


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def targets(rows: list[dict], contexts: tuple[int, ...]) -> list[str]:
    """The issue's done-when targets at 8K (at the largest context measured under --quick, labelled), met or not."""
    at = 8192 if 8192 in contexts else max(contexts)
    label = f"{at // 1024}K"
    ours_other, ours_same = _get(rows, "mol2", at, "other_adapter"), _get(rows, "mol2", at, "same_adapter")
    vllm_other, vllm_same = _get(rows, "vllm", at, "other_adapter"), _get(rows, "vllm", at, "same_adapter")

    def verdict(value, ok) -> str:
        return "n/a (not measured)" if value is None else f"{value:.3g} ({'met' if ok(value) else 'NOT met'})"

    lines = [f"ours other_adapter / ours same_adapter at {label} (target <= 2): "
             f"{verdict(_ratio(ours_other, ours_same), lambda v: v <= 2)}",
             f"vLLM other_adapter / ours other_adapter at {label} (target >= 100): "
             f"{verdict(_ratio(vllm_other, ours_other), lambda v: v >= 100)}",
             f"ours same_adapter / vLLM same_adapter at {label} (target <= 1.0): "
             f"{verdict(_ratio(ours_same, vllm_same), lambda v: v <= 1.0)}"]
    if at != 8192:
        lines.append(f"(--quick: 8K not measured; the ratios above are at {label})")
    return lines


def plot(rows: list[dict], path: str, family: str = "ced") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context_tokens"] for r in rows})
    figure, axes = plt.subplots(1, len(contexts), figsize=(4.5 * len(contexts), 3.6), squeeze=False)
    colours = {"mol2": "#2a7", "vllm": "#c63"}
    for axis, context in zip(axes[0], contexts):
        engines = [e for e in ("mol2", "vllm") if any(r["engine"] == e for r in rows)]
        width = 0.8 / max(1, len(engines))
        for index, engine in enumerate(engines):
            values = [_get(rows, engine, context, case) or 0 for case in CASES]
            positions = [i + (index - (len(engines) - 1) / 2) * width for i in range(len(CASES))]
            axis.bar(positions, values, width, color=colours[engine], label=engine)
        axis.set_xticks(range(len(CASES)), [case.replace("_", "\n") for case in CASES])
        axis.set_yscale("log")
        axis.set_ylabel("time to first token (ms)")
        axis.set_title(f"{context // 1024}K tokens of history")
        axis.legend(fontsize=8)
    figure.suptitle(f"a whole history resent: cold, same adapter, another adapter (mol2 on the {family} demo shares "
                    "the prefix)", y=1.04)
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2K only, 2 repeats (a smoke check)")
    parser.add_argument("--demo", default=None, help="the demo folder to serve (default: the one every command "
                                                     "uses, ced/demo.py), e.g. models/demo-v41")
    parser.add_argument("--json", help="write the rows as JSON")
    add_plot_option(parser, "artifacts/benchmarks/prefix_reuse.png")
    parser.add_argument("--repeats", type=int, default=None, help="fresh histories per context (default 3; --quick 2)")
    parser.add_argument("--no-vllm", action="store_true", help="measure our server alone")
    args = parser.parse_args(argv)
    contexts = QUICK_CONTEXTS if args.quick else CONTEXTS
    repeats = args.repeats or (2 if args.quick else 3)
    began = time.perf_counter()

    from tokenizers import Tokenizer

    from ced.families import family_of
    from python_backend.server.launcher import Ports
    from python_backend.server.openai_api import OpenAIServer, OpenAISettings
    from python_backend.server.serve_cli import prepare_demo

    model_dir = prepare_demo(args.demo)
    family = family_of(model_dir).name
    if family != "ced":
        print(PEER_SKIPPED.format(family=family))
        args.no_vllm = True
        args.plot_default = args.plot_default.replace(".png", f"_{family}.png")  # the ced figure stays
    args.plot = plot_path(args)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    use_vllm = not args.no_vllm and vllm_available()
    if not args.no_vllm and not use_vllm:
        print(SKIP_MESSAGE)
    logs = ROOT / "artifacts/logs"
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        ports, _ = stack.enter_context(load.demo_server("prefix_reuse", demo=args.demo))
        front = OpenAIServer(OpenAISettings(ports.grpc_url, model_dir, model_dir.parent / "adapter_set.json"),
                             port=0).start()
        stack.callback(front.stop)
        engines = [Engine("mol2", front.url, (ADAPTER_A, ADAPTER_B), family=family)]
        if use_vllm:
            peer = build_peer(PEER_ROOT)
            print(f"starting vLLM on the peer ({peer}); log {logs / 'vllm_prefix_reuse.log'}", flush=True)
            base = stack.enter_context(running_vllm(peer, Ports.free().http, logs / "vllm_prefix_reuse.log"))
            engines.append(Engine("vllm", base, (vllm_name(ADAPTER_A), vllm_name(ADAPTER_B)), metrics_base=base))
        print(f"servers up after {time.perf_counter() - began:.0f} s", flush=True)
        for engine in engines:  # every adapter loaded and the paths warm before anything is timed
            for model in engine.models:
                engine.first_token([{"role": "user", "content": "Hello."}], model)
        for index, context in enumerate(contexts):
            for engine in engines if index % 2 == 0 else engines[::-1]:
                started = time.perf_counter()
                done = measure(engine, tokenizer, context, repeats)
                rows += done
                print(f"  {engine.name:4s} {context:>5d} tokens: " + ", ".join(
                    f"{r['case']} {r['ttft_ms']:.0f} ms ({r['cached_tokens']} cached)" for r in done) +
                    f" ({time.perf_counter() - started:.0f} s, load {done[-1]['load_avg'][0]})", flush=True)
    print(f"\nstreamed chat completions of 1 token, {repeats} fresh histories per context; ttft_ms = client-observed "
          f"time to the first token on loopback, median (min, max); cached_tokens = ours: usage's cached tokens, "
          f"vLLM: the change of {HITS}; load average (1, 5, 15 min) beside each row\n")
    print(markdown_table(rows, COLUMNS))
    print()
    for line in targets(rows, contexts):
        print(line)
    if not use_vllm and not args.no_vllm:
        print(SKIP_MESSAGE)
    if family != "ced":
        print(PEER_SKIPPED.format(family=family))
    print(f"\ntook {time.perf_counter() - began:.0f} s; load average now {load.load_avg()}")
    write_json(rows, args.json)
    if args.plot:  # --plot "": no figure
        plot(rows, args.plot, family)
    return rows


if __name__ == "__main__":
    main()
