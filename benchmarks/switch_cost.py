"""Switch cost: bounded replay beside the every-layer-LoRA baseline, at growing context and adapters visited.

Switch latency is the time from the switch to the first token's logits under the target: ours replays the last
W positions through the decoder; the baseline prefills the whole context under the target. State bytes are
what the conversation holds after visiting N adapters. Both engines run the same `demo`-shape weights (random,
seeded: cost does not depend on what the weights learned), each switch of ours timed right beside the baseline's.

    python -m benchmarks.switch_cost [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ced import CEDConfig, CEDEngine, CEDForCausalLM
from ced.baseline import BaselineConversation, EveryLayerBaseline
from ced.synthetic import ATTENTION, FFN, decoder_modules_regex, make_random_adapter

from ._report import add_plot_option, markdown_table, median_spread, plot_path, save_figure, write_json

COLUMNS = ["context_tokens", "adapters_visited", "replay_ms", "replay_ms_min", "replay_ms_max", "baseline_ms",
           "baseline_ms_min", "baseline_ms_max", "latency_ratio", "state_bytes", "baseline_state_bytes",
           "bytes_ratio"]


def build(config: CEDConfig, n_adapters: int, rank: int, workdir: Path):
    plain = CEDForCausalLM.from_ced(config, seed=0)  # PEFT wraps plain Linears: make adapters before the engines
    every_layer = r"model\.layers\.\d+\.(" + "|".join(m.replace(".", r"\.") for m in ATTENTION + FFN) + ")"
    decoder_only = decoder_modules_regex(config, ATTENTION + FFN)
    names = [f"adapter{i}" for i in range(n_adapters)]
    paths = {}
    for i, name in enumerate(tqdm(names, desc="adapters (PEFT)", leave=False)):
        paths[name] = (make_random_adapter(plain, workdir / f"dec{i}", decoder_only, rank, seed=i),
                       make_random_adapter(plain, workdir / f"all{i}", every_layer, rank, seed=i))
    engine = CEDEngine(CEDForCausalLM.from_ced(config, seed=0), n_adapters, rank)
    baseline = EveryLayerBaseline(CEDForCausalLM.from_ced(config, seed=0), n_adapters, rank)
    for name, (ours, theirs) in paths.items():
        engine.adapters.load(name, ours)
        baseline.adapters.load(name, theirs)
    return engine, baseline, names


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure(engine: CEDEngine, baseline: EveryLayerBaseline, names: list[str], contexts: list[int],
            visits: list[int], repeats: int) -> list[dict]:
    """Every context's conversation is built first; then each visit switches every context in turn, ours right
    beside the baseline's, so drift of the machine spreads over all rows instead of skewing one."""
    states, conversations = {}, {}
    for context in tqdm(contexts, desc="prefilling the histories"):
        tokens = torch.randint(0, engine.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
        states[context] = engine.new_conversation()
        engine.prefill(states[context], tokens.tolist())  # the history, written once by the adapter-free stage
        engine.replay(states[context], None)  # warm-up
        conversations[context] = BaselineConversation(tokens.tolist())
    ours_ms = {c: [] for c in contexts}
    baseline_ms = {c: [] for c in contexts}
    bytes_after = {c: {} for c in contexts}
    for visit, name in enumerate(tqdm(names[: max(visits)], desc="adapters visited"), start=1):
        for context in contexts:
            state, conversation = states[context], conversations[context]
            extra = repeats if visit == 1 and context <= 8192 else 1  # a 32K full prefill is slow enough alone
            for _ in range(extra):
                ours_ms[context].append(timed(lambda: engine.replay(state, name)[0].argmax()))
                baseline_ms[context].append(timed(lambda: baseline.switch(conversation, name).argmax()))
            if visit in visits:
                bytes_after[context][visit] = (sum(state.nbytes().values()), conversation.nbytes())
    rows = []
    for context in contexts:
        (ours_med, ours_lo, ours_hi) = median_spread(ours_ms[context])
        (base_med, base_lo, base_hi) = median_spread(baseline_ms[context])
        for visit in visits:
            ours_bytes, base_bytes = bytes_after[context][visit]
            rows.append(dict(context_tokens=context, adapters_visited=visit, replay_ms=ours_med, replay_ms_min=ours_lo,
                             replay_ms_max=ours_hi, baseline_ms=base_med, baseline_ms_min=base_lo,
                             baseline_ms_max=base_hi, latency_ratio=ours_med / base_med, state_bytes=ours_bytes,
                             baseline_state_bytes=base_bytes, bytes_ratio=ours_bytes / base_bytes))
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    first = [r for r in rows if r["adapters_visited"] == rows[0]["adapters_visited"]]
    contexts = [r["context_tokens"] for r in first]
    for key, label in (("replay_ms", "bounded replay (ours)"), ("baseline_ms", "every-layer LoRA: full prefill")):
        left.errorbar(contexts, [r[key] for r in first], marker="o", label=label,
                      yerr=[[r[key] - r[key + "_min"] for r in first], [r[key + "_max"] - r[key] for r in first]])
    left.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="switch → first token (ms, median, min–max)",
             title="Switch latency")
    left.legend()
    for context in sorted({r["context_tokens"] for r in rows}):
        these = [r for r in rows if r["context_tokens"] == context]
        visited = [r["adapters_visited"] for r in these]
        right.plot(visited, [r["baseline_state_bytes"] / 2**20 for r in these], "--o", label=f"baseline, {context}")
        right.plot(visited, [r["state_bytes"] / 2**20 for r in these], "-s", label=f"ours, {context}")
    right.set(xscale="log", yscale="log", xlabel="adapters visited", ylabel="conversation state (MiB)",
              title="State bytes")
    right.set_xticks(visited, [str(v) for v in visited])
    right.minorticks_off()
    right.legend(fontsize=7, ncol=2)
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="512 and 2K tokens, 4 adapters: a smoke check")
    parser.add_argument("--contexts", type=int, nargs="+", help="context lengths (default 512 2048 8192 32768)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timings of the first visit, at contexts up to 8K (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--json", help="write the table as JSON rows here")
    add_plot_option(parser, "artifacts/benchmarks/switch_cost.png")
    args = parser.parse_args(argv)
    args.plot = plot_path(args)
    torch.set_num_threads(args.threads)

    contexts = args.contexts or ([512, 2048] if args.quick else [512, 2048, 8192, 32768])
    visits = [1, 2, 4] if args.quick else [1, 2, 4, 8]
    config = CEDConfig.from_name("demo", max_context=max(contexts))
    with tempfile.TemporaryDirectory() as workdir:
        engine, baseline, names = build(config, max(visits), rank=16, workdir=Path(workdir))
        rows = measure(engine, baseline, names, contexts, visits, args.repeats)
    print(f"\nSwitch cost on the demo shape (W={config.window}; ms are medians with min-max over "
          f"{args.repeats + max(visits) - 1} interleaved switches ({max(visits)} above 8K); bytes after N adapters "
          "visited)\n")
    print(markdown_table(rows, COLUMNS))
    write_json(rows, args.json)
    plot(rows, args.plot)
    flat = [r["replay_ms"] for r in rows if r["adapters_visited"] == 1 and r["context_tokens"] <= 8192]
    if len(flat) > 1:
        print(f"\nbounded replay max/min over contexts up to 8K: {max(flat) / min(flat):.2f}")
    return rows


if __name__ == "__main__":
    main()
