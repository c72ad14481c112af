"""HeteroFold quality benchmark: every direction among the benchmarked families (heterofold/registry.py), every
method, one table.

    python -m benchmarks.heterofold_eval [--quick] [--json PATH] [--plot PATH] [--directions llama:qwen3,...]
                                         [--split heldout|selection]

Columns: direction, method, next_token_kl, attention_kl, top1_agreement, mc_agreement, mc_accuracy, recon_f1
(see heterofold/evaluate.py for the definitions). Fits every method from the same calibration samples.
Every other method is also compared with HeteroFold item by item: `gap_next_token_kl` and `gap_attention_kl` are
the method's mean minus HeteroFold's over the same items (> 0: HeteroFold is lower), with a 95% bootstrap
interval (`..._low`, `..._high`); a second table prints them.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks._report import paired_difference
from heterofold.baselines import ALL_METHODS, COMPOSED, compose, fit_method
from heterofold.evaluate import Direction, EvalConfig, evaluate, make_items, selection_items
from heterofold import corpus
from heterofold.pipeline import N_HELD, N_TRAIN, calibration_texts, collect_direction, parse_direction
from heterofold.registry import directions
from heterofold.zoo import ROOT, load_zoo

QUICK_METHODS = ["text_reprefill", "heterofold", "kv_ridge_ta", "dense_latent_ta", "abl_index_pairing"]
COLUMNS = ["direction", "method", "next_token_kl", "attention_kl", "top1_agreement", "mc_agreement",
           "mc_accuracy", "recon_f1"]
GAP_METRICS = ("next_token_kl", "attention_kl")


def with_gaps(rows: list[dict], reference: str = "heterofold") -> list[dict]:
    """Each row without its per-item values, plus (for the other methods of a direction where `reference` ran)
    the paired gap to `reference` per metric with its 95% bootstrap interval."""
    items = {(r["direction"], r["method"]): r["per_item"] for r in rows}
    out = []
    for row in rows:
        row = {k: v for k, v in row.items() if k != "per_item"}
        ref = items.get((row["direction"], reference))
        if ref is not None and row["method"] != reference:
            for metric in GAP_METRICS:
                mean, low, high = paired_difference(items[row["direction"], row["method"]][metric], ref[metric])
                row.update({f"gap_{metric}": mean, f"gap_{metric}_low": low, f"gap_{metric}_high": high})
        out.append(row)
    return out


def gap_table(rows: list[dict]) -> str:
    lines = ["| direction | method | next-token KL gap [95% CI] | attention KL gap [95% CI] |", "|---|---|---|---|"]
    for r in rows:
        if "gap_next_token_kl" in r and r["method"] != "text_reprefill":
            cells = [f"{r[f'gap_{m}']:+.4f} [{r[f'gap_{m}_low']:+.4f}, {r[f'gap_{m}_high']:+.4f}]" for m in GAP_METRICS]
            lines.append(f"| {r['direction']} | {r['method']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def markdown(rows: list[dict], cols=COLUMNS) -> str:
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else "-" if v is None else str(v)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "text_reprefill"]
    dirs = list(dict.fromkeys(r["direction"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, metric in zip(axes, ["next_token_kl", "attention_kl", "top1_agreement"]):
        w = 0.8 / len(methods)
        for i, m in enumerate(methods):
            vals = [next((r[metric] for r in rows if r["direction"] == d and r["method"] == m), 0) for d in dirs]
            ax.bar([x + i * w for x in range(len(dirs))], vals, w, label=m)
        ax.set_xticks([x + 0.4 - w / 2 for x in range(len(dirs))], dirs, rotation=30, fontsize=7)
        ax.set_title(metric)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="the first default direction, main methods, small sets (1-2 min)")
    p.add_argument("--json", help="write the rows as a JSON list")
    p.add_argument("--plot", type=Path, help="the figure (default: ROOT/heterofold_eval.png; with --quick, "
                                             "ROOT/heterofold_eval_quick.png)")
    p.add_argument("--directions", type=lambda text: [parse_direction(d) for d in text.split(",")],
                   help="comma list of SENDER:RECEIVER of any registered families (default: every direction "
                        "among the benchmarked ones)")
    p.add_argument("--methods", type=lambda text: text.split(","),
                   help=f"comma list of {', '.join(ALL_METHODS)} (default: all, or the main ones with --quick)")
    p.add_argument("--n-train", type=int, default=None)
    p.add_argument("--n-held", type=int, default=None)
    p.add_argument("--n-docs", type=int, default=16, help="evaluation items per task (full run)")
    p.add_argument("--split", choices=("heldout", "selection"), default="heldout",
                   help="heldout: the held-out corpus (the reported numbers); selection: the calibration held-out "
                        "prompts scored the same way (next-token and attention items only), for choosing settings")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--root", type=Path, default=ROOT, help="zoo + corpus folder (default: %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dirs = args.directions or (directions()[:1] if args.quick else directions())
    methods = args.methods or (QUICK_METHODS if args.quick else ALL_METHODS)
    if set(methods) - set(ALL_METHODS):
        p.error(f"unknown method(s) {', '.join(sorted(set(methods) - set(ALL_METHODS)))}; "
                f"known: {', '.join(ALL_METHODS)}")
    n_train = args.n_train or (32 if args.quick else N_TRAIN)
    n_held = args.n_held or (8 if args.quick else N_HELD)
    ecfg = EvalConfig(n_docs=8, n_mc=8, n_recon=6) if args.quick else EvalConfig(
        n_docs=args.n_docs, n_mc=args.n_docs, n_recon=max(args.n_docs * 2 // 3, 1))
    zoo = load_zoo(tuple(dict.fromkeys(f for d in dirs for f in d)), args.root)
    items = make_items(corpus.build(args.root / "corpus.json")["heldout"], ecfg)
    rows = []
    for s_name, r_name in dirs:
        t0 = time.time()
        s, r = zoo[s_name], zoo[r_name]
        if args.split == "selection":
            items = selection_items(calibration_texts(n_train, n_held, root=args.root)[1], r.tok)
        r.set_attn("eager")                       # attention weights for attention_kl
        train, held, _ = collect_direction(s, r, n_train, n_held, args.root)
        fitted = {"text_reprefill": None}
        fit = lambda m: fitted.get(m) or fit_method(m, s.adapter, r.adapter, train, held)[0]
        for m in methods:
            if m in COMPOSED:
                k_from, v_from = (fitted.setdefault(b, fit(b)) for b in COMPOSED[m])
                fitted[m] = compose(k_from, v_from)
            elif m not in fitted:
                fitted[m] = fit(m)
        mappers = {m: fitted[m] for m in methods}
        t1 = time.time()
        scored = [{"direction": f"{s_name}->{r_name}", **row} for row in evaluate(Direction(s, r), mappers, items)]
        rows += with_gaps(scored)
        r.set_attn("sdpa")
        print(f"[{s_name}->{r_name}] fit {t1 - t0:.0f}s, eval {time.time() - t1:.0f}s", flush=True)
        if args.json:                              # written after every direction, so a long run keeps its rows
            Path(args.json).write_text(json.dumps(rows, indent=1))
    print(markdown(rows))
    if any("gap_next_token_kl" in r for r in rows):
        print("\nEach method against HeteroFold on the same items (its mean minus HeteroFold's; "
              "> 0: HeteroFold lower):")
        print(gap_table(rows))
    figure = args.plot or args.root / ("heterofold_eval_quick.png" if args.quick else "heterofold_eval.png")
    figure.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, figure)
    print(f"plot: {figure}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
