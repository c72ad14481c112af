"""Batched decode: tokens/s of decode steps at 1, 4 and 16 rows on 4 adapters, one call per row beside one pass.

In-process, on an engine whose decode steps batch through the scheduler's `RowEngine` (the `deepseek_v41`
family's V41Engine: `step_rows`; the ced family's batching is `ced/batched.py`, timed through the server by
`serving_throughput`). Row b holds `--context` + 13*b tokens (each its own length) and decodes under adapter
b mod 4 after its replay. Three variants on copies of the same rows:

- serial:  one `engine.step` call per row (the time of B rows is B times one row's);
- batched: `RowEngine.step`, every row of the step in one native call (ced/deepseek_v41/native.py);
- batched_torch: the same with the native kernels off: one pass of the torch model (the server's step before).

Each repeat times every (rows, variant) pair in turn, the variants' order alternating, so the machine's drift
(2 shared cores) hits both; each row carries the 1-minute load average read when it ended.

    python -m benchmarks.batched_decode [--quick] [--json PATH] [--plot PATH] [--model DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ced import kernels
from ced.engines import make_engine
from ced.row_engine import RowEngine

from ._report import add_plot_option, markdown_table, median_spread, plot_path, save_figure, write_json

COLUMNS = ["rows", "variant", "tokens", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "ms_per_step",
           "batched_vs_serial", "vs_one_row_serial", "load_1min"]
ADAPTERS = ("chat", "agent", "coding", "design")
DEFAULT_MODEL = Path("models/demo-v41/model")
VARIANTS = ("serial", "batched", "batched_torch")


def load_1min() -> float:
    return os.getloadavg()[0]


def open_rows(engine, n_rows: int, context: int, adapters: list[str | None]) -> list:
    """n_rows conversations of context + 13*b tokens, each replayed under its adapter."""
    states, g = [], torch.Generator().manual_seed(0)
    for b in range(n_rows):
        state = engine.new_conversation()
        engine.prefill(state, torch.randint(0, engine.config.vocab_size, (context + 13 * b,), generator=g).tolist())
        engine.replay(state, adapters[b])
        states.append(state)
    return states


def decode(rows_engine: RowEngine, states: list, adapters: list[str | None], variant: str, n_steps: int) -> float:
    """Seconds for n_steps decode steps of copies of `states` (the same token stream for both variants)."""
    rows = [rows_engine.open(state) for state in states]  # copies: the tensors shared, nothing written into them
    engine, vocab = rows_engine.engine, rows_engine.config.vocab_size
    start = time.perf_counter()
    with kernels.turned_off() if variant == "batched_torch" else contextlib.nullcontext():
        for t in range(n_steps):
            tokens = [(7919 * t + 104729 * b) % vocab for b in range(len(rows))]
            if variant == "serial":
                for row, token, adapter in zip(rows, tokens, adapters):
                    engine.step(row.state, token, adapter)
            else:
                rows_engine.step(rows, tokens, adapters)
    return time.perf_counter() - start


def measure(rows_engine: RowEngine, states: list, adapters: list, row_counts: list[int], n_steps: int,
            repeats: int) -> list[dict]:
    for n in row_counts:  # warm-up: first calls allocate
        for variant in VARIANTS:
            decode(rows_engine, states[:n], adapters[:n], variant, 2)
    seconds = {(n, v): [] for n in row_counts for v in VARIANTS}
    loads = {}
    for repeat in tqdm(range(repeats), desc="repeats (every rows x variant in turn)"):
        for n in row_counts:
            for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
                seconds[(n, variant)].append(decode(rows_engine, states[:n], adapters[:n], variant, n_steps))
                loads[(n, variant)] = load_1min()
    rate = {key: n_steps * key[0] / median_spread(s)[0] for key, s in seconds.items()}
    rows = []
    for (n, variant), samples in seconds.items():
        median, fastest, slowest = median_spread(samples)
        rows.append(dict(rows=n, variant=variant, tokens=n_steps * n, tokens_per_s=rate[(n, variant)],
                         tokens_per_s_min=n_steps * n / slowest, tokens_per_s_max=n_steps * n / fastest,
                         ms_per_step=1e3 * median / n_steps,
                         batched_vs_serial=rate[(n, variant)] / rate[(n, "serial")],
                         vs_one_row_serial=rate[(n, variant)] / rate[(row_counts[0], "serial")],
                         load_1min=loads[(n, variant)]))
    return rows


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for variant in VARIANTS:
        these = [r for r in rows if r["variant"] == variant]
        axis.errorbar([r["rows"] for r in these], [r["tokens_per_s"] for r in these],
                      yerr=[[r["tokens_per_s"] - r["tokens_per_s_min"] for r in these],
                            [r["tokens_per_s_max"] - r["tokens_per_s"] for r in these]],
                      marker="o", capsize=3, label=variant)
    axis.set(xscale="log", xlabel="rows (conversations decoding at once)", ylabel="decode tokens/s (median, min-max)",
             title=title)
    axis.set_xticks([r["rows"] for r in rows if r["variant"] == "serial"],
                    [str(r["rows"]) for r in rows if r["variant"] == "serial"])
    axis.legend()
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 and 4 rows, 128-token context, 4 steps, 1 repeat")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help=f"model folder (default {DEFAULT_MODEL})")
    parser.add_argument("--rows", type=int, nargs="+", help="row counts (default 1 4 16)")
    parser.add_argument("--context", type=int, help="tokens of row 0's context (default 384; row b has 13*b more)")
    parser.add_argument("--steps", type=int, help="decode steps per timing (default 32)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadiest when shared)")
    parser.add_argument("--json", help="write the table as JSON rows here")
    add_plot_option(parser, "artifacts/benchmarks/batched_decode.png")
    args = parser.parse_args(argv)
    args.plot = plot_path(args)
    torch.set_num_threads(args.threads)
    row_counts = sorted(args.rows or ([1, 4] if args.quick else [1, 4, 16]))
    context = args.context or (128 if args.quick else 384)
    n_steps = args.steps or (4 if args.quick else 32)
    repeats = args.repeats or (1 if args.quick else 3)

    engine = make_engine("torch", args.model)
    if not hasattr(engine, "step_rows"):
        parser.error(f"{args.model}: its engine ({type(engine).__name__}) steps one row per call; the ced family's "
                     "batched engine is timed through the server by serving_throughput")
    names = [name for name in ADAPTERS if (args.model.parent / "adapters" / name).is_dir()]
    for name in names:
        engine.adapters.load(name, args.model.parent / "adapters" / name)
    adapters = [names[b % len(names)] if names else None for b in range(max(row_counts))]
    states = open_rows(engine, max(row_counts), context, adapters)
    load_before = load_1min()
    rows = measure(RowEngine(engine), states, adapters, row_counts, n_steps, repeats)
    print(f"\nBatched decode on {args.model} ({len(names)} adapters, row b under adapter b mod {max(len(names), 1)}; "
          f"contexts {context}..{context + 13 * (max(row_counts) - 1)} tokens; {n_steps} steps; medians with min-max "
          f"over {repeats} interleaved repeats; {args.threads} thread(s); 1-min load {load_before:.2f} before, "
          f"{load_1min():.2f} after)\n")
    print(markdown_table(rows, COLUMNS))
    write_json(rows, args.json)
    plot(rows, args.plot, f"Decode steps on {args.model.parent.name}: one call per row vs one pass")
    return rows


if __name__ == "__main__":
    main()
