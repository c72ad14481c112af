"""Data scaling of the MoL2 head: vary the share of each kind of training data, as the seed's groups A/B/C.

- group A: no generic data, 10%..100% of the domain data;
- group B: all generic data, 0%..100% of the domain data;
- group C: both scaled together, 10%..100%.
Subsets are stratified by label and nested across ratios (each ratio's subset contains the smaller ones). Every
point trains a fresh head (mode B mixing) and is scored on generic test, domain train and the domain benchmark.

    python -m benchmarks.router_data_scaling [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from ._report import add_plot_option, markdown_table, plot_path, save_figure, write_json

COLUMNS = ["group", "ratio", "generic_n", "domain_n", "generic.test", "domain.train", "domain.bench", "train_s"]


def nested(rs, ratio: float, salt: str):
    """Stratified by label, nested across ratios: the first ceil-ish share of each label in hash order."""
    from mol2_router.data import unit_hash

    by = defaultdict(list)
    for i, q in enumerate(rs.questions):
        by[q.label].append(i)
    keep = []
    for label, idx in by.items():
        idx.sort(key=lambda i: unit_hash(rs.questions[i].id or rs.questions[i].query, salt))
        keep += idx[: int(round(ratio * len(idx)))]
    return rs.subset(sorted(keep))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_data_scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 ratios, 15%% of the generic data, 2 epochs")
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.0, 0.1, 0.2, 0.4, 0.7, 1.0])
    parser.add_argument("--groups", nargs="+", default=["A", "B", "C"], choices=("A", "B", "C"))
    parser.add_argument("--generic-share", type=float, default=1.0, help="'all generic' means this share")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--subset-seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--demo", default=None, help="a demo folder (default: the one every command uses, ced/demo.py)")
    parser.add_argument("--artifacts", default=None, help="where `mol2 build demo` writes ARTIFACTS/demo")
    parser.add_argument("--data", default="artifacts/router/data")
    parser.add_argument("--json", default=None)
    add_plot_option(parser, "artifacts/benchmarks/router_data_scaling.png")
    args = parser.parse_args(argv)
    args.plot = plot_path(args)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.ratios, args.generic_share, args.epochs = [0.0, 0.2, 1.0], 0.15, 2

    import time

    from mol2_router.config import RouterConfig
    from mol2_router.features import RouteTokenizer
    from ced.demo import resolve_demo
    from mol2_router.pipeline import load_model, load_sets
    from mol2_router.train import OptionTable, Scorer, TrainConfig, accuracy, new_scorer, train_head

    demo = resolve_demo(args.demo, args.artifacts)
    print(demo.describe())
    config = RouterConfig.from_name("demo")
    model = load_model(demo.model_dir)
    sets = load_sets(model, demo, args.data, "mol2", config, progress=False, log=None)
    table = OptionTable(RouteTokenizer(demo.tokenizer), config.max_option_tokens)
    generic_all = nested(sets["generic.train"], args.generic_share, f"g{args.subset_seed}")
    rows = []
    for group in args.groups:
        for ratio in args.ratios:
            if group in ("A", "C") and ratio == 0:
                continue  # no data at all
            generic = {"A": nested(generic_all, 0.0, "g"), "B": generic_all,
                       "C": nested(generic_all, ratio, f"g{args.subset_seed}")}[group]
            domain = nested(sets["domain.train"], ratio, f"d{args.subset_seed}")
            scorer = new_scorer("mol2", config, model.get_input_embeddings().weight, args.seed)
            started = time.time()
            result = train_head(scorer, generic, domain, [], TrainConfig(mode="B", epochs=args.epochs, seed=args.seed),
                                table, progress=False)
            s = Scorer(result.last, scorer.embedding)
            rows.append({"group": group, "ratio": ratio, "generic_n": len(generic), "domain_n": len(domain),
                         **{split: accuracy(s, sets[split], table)
                            for split in ("generic.test", "domain.train", "domain.bench")},
                         "train_s": round(time.time() - started, 1)})
            print(markdown_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
    print(f"\n{demo.describe()}; epochs {args.epochs}, "
          f"seed {args.seed}, subset seed {args.subset_seed}")
    print(markdown_table(rows, COLUMNS))
    write_json(rows, args.json)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), sharey=True)
        for ax, split in zip(axes, ("generic.test", "domain.train", "domain.bench")):
            for group in args.groups:
                pts = [(r["ratio"], 100 * r[split]) for r in rows if r["group"] == group]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"group {group}")
            ax.set_title(split)
            ax.set_xlabel("domain data ratio")
        axes[0].set_ylabel("accuracy (%)")
        axes[0].legend()
        save_figure(fig, args.plot)
    return rows


if __name__ == "__main__":
    main()
