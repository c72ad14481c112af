"""Router accuracy: MoL2 under the recipe modes A/B/C (seeds) beside Contextual MoL and MoL, on the same questions.

MoL2 and Contextual-MoL heads trained by `mol2 router train` are scored on every split from the cached H19
features (generic train/dev/test, domain train/dev and the held-out domain benchmark). MoL needs no training but
decodes for every decision, so it runs through the engine on a class-stratified subset of the domain benchmark;
on that same subset all three routers also run end to end through the engine (prefill the turn, then decide), which
checks that the feature path and the serving path agree.

Splits: generic train/dev/test, domain train/dev, `domain.bench` (held out) with its two parts `domain.bench[corpus]`
(the corpus sources and templates of domain train) and `domain.bench[asks]` (requests about each domain: held-out
items, phrasings training never saw; `mol2_router/asks.py`) and, when built, `domain.freeform` (hand-written requests
that follow no training template; `mol2 router data --freeform-only`). `--route-prompt` scores the MoL2 heads with
another route prompt on the option side (what serving does with an adapter set whose prompt differs from the trained
one).

The head the demo ships (DEMO/router, what `auto` routes with; checkpoint `demo`) is scored the same way on the
demo's own H19. `--demo DIR` chooses the demo, e.g. models/demo-v41 (its H19 pooled over the mHC streams); every row
names the demo's family (ced, deepseek_v41). `mol2 router train` trains on the ced family only, so for another
family the run heads are left out (said so) and the harness runs MoL and the demo's head through that family's
engine.

    python -m benchmarks.router_accuracy [--demo DIR] [--quick] [--json PATH] [--plot PATH]
                                         [--checkpoint last|best] [--no-harness] [--route-prompt TEXT] [--runs DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from ._report import add_plot_option, markdown_table, paired_difference, plot_path, save_figure, write_json

COLUMNS = ["family", "router", "mode", "checkpoint", "split", "accuracy", "std", "seeds", "n"]


def head_predictions(demo, data_dir, kind, checkpoint, modes, progress=False, route_prompt=None, runs_dir=None,
                     splits=None):
    """{(mode, seed): {split: [(question, predicted name)...]}} plus the sets, for every saved run of `kind`."""
    from mol2_router.features import ROUTE_PROMPT, RouteTokenizer
    from mol2_router.pipeline import CONTEXTUAL_LIMITS, OPTIONAL_SPLITS, SPLITS, WORK, load_head, load_model, load_sets
    from mol2_router.train import OptionTable, Scorer, predict

    runs = sorted(Path(runs_dir or WORK / "runs" / demo.tag).glob(f"{kind}-*-seed*"))
    runs = [r for r in runs if (r / checkpoint / "head.safetensors").exists() and r.name.split("-")[1] in modes]
    if not runs:
        return {}, {}
    model = load_model(demo.model_dir)
    _, config, meta = load_head(runs[0] / checkpoint)
    limits = meta.get("limits", CONTEXTUAL_LIMITS if kind == "contextual" else None)
    sets = load_sets(model, demo, data_dir, kind, config, splits or SPLITS + OPTIONAL_SPLITS, limits=limits,
                     progress=progress, log=None)
    table = OptionTable(RouteTokenizer(demo.tokenizer), config.max_option_tokens, route_prompt or ROUTE_PROMPT) \
        if kind == "mol2" else None
    embedding = model.get_input_embeddings().weight.detach().float()
    out = {}
    for run in runs:
        head, _, meta = load_head(run / checkpoint)
        scorer = Scorer(head, embedding if kind == "mol2" else None)
        out[meta["mode"], meta["seed"]] = {
            split: [(q, q.candidates[p].name) for q, p in zip(rs.questions, predict(scorer, rs, table).tolist())]
            for split, rs in sets.items()}
    return out, sets


def accuracy_rows(router, predictions, checkpoint, family="ced") -> list[dict]:
    rows, by_mode = [], defaultdict(lambda: defaultdict(list))
    for (mode, seed), splits in predictions.items():
        for split, pairs in splits.items():
            by_mode[mode][split].append((seed, sum(q.label == p for q, p in pairs) / len(pairs), len(pairs)))
    for mode in sorted(by_mode):
        for split, runs in by_mode[mode].items():
            accs = [a for _, a, _ in runs]
            rows.append({"family": family, "router": router, "mode": mode, "checkpoint": checkpoint, "split": split,
                         "accuracy": statistics.fmean(accs), "std": statistics.pstdev(accs) if len(accs) > 1 else 0.0,
                         "seeds": len(accs), "n": runs[0][2]})
    return rows


def demo_model(demo, family: str):
    """The demo's model in its family's class (the module the router's H19 is read from)."""
    if family == "ced":
        from mol2_router.pipeline import load_model

        return load_model(demo.model_dir)
    from ced.deepseek_v41.checkpoint import load_checkpoint

    return load_checkpoint(demo.model_dir)[1].eval()


def input_embedding(model) -> torch.Tensor:
    """The token embedding the MoL2 head reads options through (ced: get_input_embeddings; deepseek_v41: embed)."""
    layer = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.embed
    return layer.weight.detach().float()


def demo_head_predictions(demo, family, data_dir, limits=None, splits=None, progress=False):
    """{(mode, seed): {split: [(question, predicted name)...]}} of the head the demo ships (DEMO/router), on the
    demo's own H19 (cached as a run's features are); {} when the demo has no head."""
    from mol2_router.features import ROUTE_PROMPT, RouteTokenizer
    from mol2_router.pipeline import OPTIONAL_SPLITS, SPLITS, load_head, load_sets
    from mol2_router.train import OptionTable, Scorer, predict

    if not (demo.router_dir / "head.safetensors").is_file():
        return {}
    head, config, meta = load_head(demo.router_dir)
    model = demo_model(demo, family)
    sets = load_sets(model, demo, data_dir, "mol2", config, splits or SPLITS + OPTIONAL_SPLITS, limits=limits,
                     progress=progress, log=None)
    prompt = meta.get("route_prompt", ROUTE_PROMPT)
    table = OptionTable(RouteTokenizer(demo.tokenizer), config.max_option_tokens, prompt)
    scorer = Scorer(head, input_embedding(model))
    return {(meta.get("mode", "-"), meta.get("seed", 0)): {
        split: [(q, q.candidates[p].name) for q, p in zip(rs.questions, predict(scorer, rs, table).tolist())]
        for split, rs in sets.items()}}


def bench_parts(splits: dict[str, list]) -> dict[str, list]:
    """domain.bench cut by where its questions come from: the corpus (`domain:*`, train's sources and templates)
    and the requests about each domain (`ask:*`, held-out items and phrasings), when it holds both."""
    pairs = splits.get("domain.bench", [])
    parts = {f"domain.bench[{name}]": [(q, p) for q, p in pairs if q.source.startswith(prefix)]
             for name, prefix in (("corpus", "domain:"), ("asks", "ask:"))}
    return {name: part for name, part in parts.items() if 0 < len(part) < len(pairs)}


def breakdown(router, pairs, key) -> list[dict]:
    groups = defaultdict(list)
    for q, p in pairs:
        groups[key(q)].append(q.label == p)
    return [{"router": router, "group": g, "n": len(v), "accuracy": sum(v) / len(v)} for g, v in sorted(groups.items())]


def stratified(questions, per_class: int) -> list:
    by = defaultdict(list)
    for q in questions:
        by[q.label].append(q)
    return [q for label in sorted(by) for q in by[label][:per_class]]


def family_engine(demo, family: str):
    """The demo's engine with its adapters: ced as the router pipeline loads it (demo_engine); another family's
    engine (ced.engines.make_engine) with the demo's domain adapters and its random_l0 (MoL's)."""
    from mol2_router.pipeline import demo_engine

    if family == "ced":
        return demo_engine(demo)
    from ced.engines import make_engine

    engine = make_engine("torch", demo.model_dir, max_adapters=8, max_rank=16)
    for name, path in {**demo.adapters, "random_l0": demo.adapters_dir / "random_l0"}.items():
        engine.adapters.load(name, path)
    return engine


def harness(demo, questions, mol_tokens, checkpoint, progress=True, family="ced") -> tuple[dict, list, dict]:
    """The routers through the engine on the same questions: prefill the turn, then each decides. MoL, the run
    heads of mode B seed 0 (ced), and the demo's own head where no mol2 run head is. Returns (pairs per router, MoL's
    first decoded texts, the checkpoint each router's head came from)."""
    from mol2_router import ContextualRouter, MoL2Router, MoLRouter, RouteQuery
    from mol2_router.features import BOS, RouteTokenizer, turn_tokens
    from mol2_router.pipeline import load_head, run_dir

    engine = family_engine(demo, family)
    tok = RouteTokenizer(demo.tokenizer)
    routers, checkpoints = [MoLRouter(engine, tok, adapter="random_l0", max_tokens=mol_tokens)], {"mol": "-"}
    heads = [(kind, run_dir(demo, kind, "B", 0) / checkpoint, checkpoint) for kind in ("mol2", "contextual")
             if family == "ced"]
    heads = [h for h in heads if (h[1] / "head.safetensors").exists()]
    if not any(kind == "mol2" for kind, _, _ in heads) and (demo.router_dir / "head.safetensors").exists():
        heads.append(("mol2", demo.router_dir, "demo"))
    for kind, folder, label in heads:
        head, config, _ = load_head(folder)
        routers.append(MoL2Router(head, input_embedding(engine.model), tok) if kind == "mol2"
                       else ContextualRouter(engine, head, tok, max_option_tokens=config.max_option_tokens))
        checkpoints[kind] = label
    out = {router.name: [] for router in routers}
    reasons = []
    for q in tqdm(questions, desc="harness (all routers per question)", disable=not progress):
        state = engine.new_conversation()
        query = RouteQuery(engine.prefill(state, [BOS] + turn_tokens(tok, q.query))[1:], state)
        for router in routers:
            d = router.decide(query, q.candidates)
            out[router.name].append((q, d.adapter))
            if d.reason and len(reasons) < 3:  # MoL's decoded text
                reasons.append(d.reason)
    return out, reasons, checkpoints


GAP_SPLITS = ("domain.bench", "domain.bench[corpus]", "domain.bench[asks]", "domain.freeform")


def mode_gaps(router, predictions, reference: str = "B", splits=GAP_SPLITS) -> list[dict]:
    """Mode `reference` against each other mode, paired over the same questions: per question the share of a mode's
    seeds that route it right, then the mean of (reference - other) with a 95% bootstrap interval over questions
    (the spread over seeds is the accuracy rows' std)."""
    def per_question(mode, split):
        runs = [v[split] for (m, _), v in sorted(predictions.items()) if m == mode and split in v]
        return [statistics.fmean(run[i][0].label == run[i][1] for run in runs) for i in range(len(runs[0]))] \
            if runs else None

    rows = []
    for other in sorted({m for m, _ in predictions} - {reference}):
        for split in splits:
            ref, oth = per_question(reference, split), per_question(other, split)
            if ref and oth:
                gap, low, high = paired_difference(ref, oth)
                rows.append({"router": router, "group": f"{reference} - {other}, {split}", "n": len(ref),
                             "accuracy": round(gap, 4) + 0.0,  # + 0.0 prints a zero gap as 0, not -0
                             "low": round(low, 4), "high": round(high, 4)})
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = ["generic.test", "domain.bench"] + (["domain.freeform"] if any(r["split"] == "domain.freeform"
                                                                            for r in rows) else [])
    fig, axes = plt.subplots(1, len(splits), figsize=(5 * len(splits), 4), sharey=True)
    for ax, split in zip(axes, splits):
        labels, values, errors = [], [], []
        for r in rows:
            if r["split"] == split and r["router"] in ("mol2", "contextual"):
                labels.append(f"{'ctx' if r['router'] == 'contextual' else r['router']}\n{r['mode']}"
                              + (" (demo)" if r["checkpoint"] == "demo" else ""))
                values.append(100 * r["accuracy"])
                errors.append(100 * r["std"])
        for r in rows:
            if r["router"] == "mol" and split == "domain.bench" and r["split"].startswith("domain.bench"):
                labels.append("mol\n(subset)")
                values.append(100 * r["accuracy"])
                errors.append(0)
        ax.bar(range(len(values)), values, yerr=errors, capsize=3,
               color=["C0" if l.startswith("mol2") else "C1" if l.startswith("ctx") else "C2" for l in labels])
        ax.set_xticks(range(len(values)), labels, fontsize=8)
        ax.set_title(split)
        ax.set_ylim(0, 100)
    axes[0].set_ylabel("accuracy (%)")
    fig.suptitle("Routing accuracy: MoL2 modes A/B/C (mean ± std over seeds) vs Contextual MoL (ctx) and MoL")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_accuracy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="harness on 3 questions per class, short MoL decode")
    parser.add_argument("--harness-per-class", type=int, default=25)
    parser.add_argument("--mol-tokens", type=int, default=64)
    parser.add_argument("--checkpoint", choices=("last", "best"), default="last")
    parser.add_argument("--modes", nargs="+", default=["A", "B", "C"], choices=("A", "B", "C"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--demo", default=None, help="a demo folder (default: the one every command uses, ced/demo.py)")
    parser.add_argument("--artifacts", default=None, help="where `mol2 build demo` writes ARTIFACTS/demo")
    parser.add_argument("--data", default="artifacts/router/data")
    parser.add_argument("--no-harness", action="store_true", help="skip the end-to-end engine harness (and MoL)")
    parser.add_argument("--route-prompt", default=None, help="MoL2 option side with this route prompt")
    parser.add_argument("--runs", default=None, help="runs folder (default: artifacts/router/runs/<demo>)")
    parser.add_argument("--kinds", nargs="+", default=["mol2", "contextual"], choices=("mol2", "contextual"))
    parser.add_argument("--splits", nargs="+", default=None, help="only these splits (default: all)")
    parser.add_argument("--demo-head-limit", type=int, default=None,
                        help="questions per split for the demo's own head, evenly spread (default: all; --quick 200)")
    parser.add_argument("--json", default=None)
    add_plot_option(parser, "artifacts/benchmarks/router_accuracy.png")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.harness_per_class, args.mol_tokens = 3, min(args.mol_tokens, 16)
        args.demo_head_limit = args.demo_head_limit or 200

    from ced.demo import resolve_demo
    from ced.families import family_of
    from mol2_router.data import read_questions
    from mol2_router.pipeline import OPTIONAL_SPLITS, SPLITS

    demo = resolve_demo(args.demo, args.artifacts)
    family = family_of(demo.model_dir).name
    print(f"{demo.describe()}; family {family}")
    if family != "ced":
        args.plot_default = args.plot_default.replace(".png", f"_{family}.png")  # the ced figure stays
    args.plot = plot_path(args)
    rows, details = [], []
    if family != "ced":
        print(f"run heads ({', '.join(args.kinds)}) left out: `mol2 router train` trains on the ced family's H19, "
              f"not {family}'s")
    limits = {split: args.demo_head_limit for split in SPLITS + OPTIONAL_SPLITS} if args.demo_head_limit else None
    own = demo_head_predictions(demo, family, args.data, limits, args.splits, progress=True)
    if own:
        for splits in own.values():
            splits.update(bench_parts(splits))
        rows += accuracy_rows("mol2", own, "demo", family)
    else:
        print(f"no router head in {demo.router_dir}")
    for kind in args.kinds if family == "ced" else ():
        predictions, _ = head_predictions(demo, args.data, kind, args.checkpoint, args.modes,
                                          route_prompt=args.route_prompt if kind == "mol2" else None,
                                          runs_dir=args.runs, splits=args.splits)
        if not predictions:
            print(f"no trained {kind} heads under artifacts/router/runs/{demo.tag}: run `mol2 router train --kind {kind}`")
            continue
        for splits in predictions.values():
            splits.update(bench_parts(splits))
        rows += accuracy_rows(kind, predictions, args.checkpoint, family)
        gap_table = "mode B against the others, paired over questions (accuracy = gap, 95% interval)"
        details += [{"table": gap_table, **r} for r in mode_gaps(kind, predictions)]
        b = [v for (mode, seed), v in sorted(predictions.items()) if mode == "B"]
        if b and "domain.bench" in b[0]:
            details += [{"table": "per class, domain.bench, mode B seed %d" % 0, **r}
                        for r in breakdown(kind, b[0]["domain.bench"], lambda q: q.label)]
        if b:
            if "domain.freeform" in b[0]:
                details += [{"table": "per class, domain.freeform, mode B seed 0", **r}
                            for r in breakdown(kind, b[0]["domain.freeform"], lambda q: q.label)]
            if "generic.test" in b[0]:
                details += [{"table": "per source, generic.test, mode B seed 0", **r}
                            for r in breakdown(kind, b[0]["generic.test"], lambda q: q.source)]
    bench = stratified(read_questions(Path(args.data) / "domain.bench.jsonl"), args.harness_per_class)
    harnessed, reasons, checkpoints = ({}, [], {}) if args.no_harness else \
        harness(demo, bench, args.mol_tokens, args.checkpoint, family=family)
    split = f"domain.bench[harness {len(bench)}]"
    for name, pairs in harnessed.items():
        rows.append({"family": family, "router": name, "mode": "B" if name != "mol" else "-",
                     "checkpoint": checkpoints[name], "split": split,
                     "accuracy": sum(q.label == p for q, p in pairs) / len(pairs),
                     "std": 0.0, "seeds": 1, "n": len(pairs)})
        details += [{"table": f"per class, {split}", **r} for r in breakdown(name, pairs, lambda q: q.label)]
    print(f"\n{demo.describe()}; family {family}; checkpoint: {args.checkpoint} (demo: the demo's router/); "
          f"MoL: random_l0, up to {args.mol_tokens} tokens"
          + (f"; MoL2 route prompt: {args.route_prompt!r}" if args.route_prompt else ""))
    print(markdown_table(rows, COLUMNS))
    for table in dict.fromkeys(d["table"] for d in details):
        print(f"\n{table}")
        chosen = [d for d in details if d["table"] == table]
        interval = ["low", "high"] if "low" in chosen[0] else []
        print(markdown_table(chosen, ["router", "group", "n", "accuracy"] + interval))
    if reasons:
        print("\nMoL's first decoded texts:", json.dumps(reasons)[:600])
    write_json(rows + [{"family": family, "router": d["router"], "mode": "detail", "split": d["table"],
                        "group": d["group"], "accuracy": d["accuracy"], "n": d["n"],
                        **{k: d[k] for k in ("low", "high") if k in d}} for d in details], args.json)
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
