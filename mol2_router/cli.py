"""`mol2 router ...`: build routing data, extract H19, train heads, evaluate them, benchmark the routers.

    mol2 router data     [--out DIR] [--freeform-only]       generic + domain routing questions (JSONL)
    mol2 router extract  [--kind mol2|contextual|both]       H19 features, cached in shards (resumable)
    mol2 router train    [--kind K] [--modes A B C] [--seeds 0 1 2] [--epochs N]
    mol2 router eval     [--kind K] [--mode B] [--seed 0] [--checkpoint best|last] [--data-file FILE.jsonl]
    mol2 router export   [--mode B] [--seed 0] [--checkpoint last] [--out DEMO/router]
    mol2 router bench    latency|accuracy|scaling [benchmark options...]

Every command works on the demo that `mol2 chat` and `mol2 serve` use (ced/demo.py): --demo when given, else the
fresh build in artifacts/demo, else the committed models/demo, else the untrained demo; each says which.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

DATA = "artifacts/router/data"


def _demo(args):
    from ced.demo import resolve_demo

    demo = resolve_demo(args.demo, args.artifacts)
    print(demo.describe())
    return demo


def cmd_data(args) -> None:
    from .builders import build_all, write_freeform

    if args.freeform_only:
        print(f"{'domain.freeform':<14} {write_freeform(args.out):>6}")
        return

    counts = build_all(args.out, corpus=args.corpus, apt_lists=args.apt_lists, generic_total=args.generic_total,
                       train_per_class=args.train_per_class, bench_per_class=args.bench_per_class,
                       asks_per_class=args.asks_per_class)
    for name, n in counts.items():
        print(f"{name:<14} {n:>6}")


def cmd_extract(args) -> None:
    from .config import RouterConfig
    from .pipeline import default_limits, load_model, load_sets

    demo = _demo(args)
    model, config = load_model(demo.model_dir), RouterConfig.from_name(args.preset)
    for kind in (("mol2", "contextual") if args.kind == "both" else (args.kind,)):
        sets = load_sets(model, demo, args.data, kind, config, limits=default_limits(kind, _limits(args.limit)))
        print(kind, {name: len(rs) for name, rs in sets.items()})


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _limits(items: list[str] | None) -> dict[str, int]:
    """["generic.train=2400", ...] -> {"generic.train": 2400}."""
    out = {}
    for item in items or []:
        split, _, n = item.partition("=")
        if not n.isdigit():
            raise SystemExit(f"--limit takes SPLIT=N, got {item!r}")
        out[split] = int(n)
    return out


def cmd_train(args) -> None:
    from .pipeline import train_runs

    rows = train_runs(_demo(args), args.data, args.kind, args.modes, args.seeds, args.epochs, args.preset,
                      args.batch_size, limits=_limits(args.limit))
    columns = ["kind", "mode", "seed", "best_epoch", "last:generic.test", "last:domain.bench", "best:generic.test",
               "best:domain.bench", "train_s"]
    print(markdown_table(rows, columns))


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """benchmarks/_report.py's table, for the router's own commands: the benchmarks sit above the router."""
    def cell(value) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def summarize(rows: list[dict]) -> list[dict]:
    """Accuracy per split: overall, per class (label) for domain splits and a user's file, and per source."""
    out, groups = [], defaultdict(list)
    for r in rows:
        groups[(r["split"], "all", "all")].append(r["correct"])
        groups[(r["split"], "source", r["source"])].append(r["correct"])
        if r["split"].startswith("domain") or r["split"] == "user":
            groups[(r["split"], "class", r["label"])].append(r["correct"])
    for (split, by, key), hits in sorted(groups.items()):
        out.append({"split": split, "by": by, "group": key, "n": len(hits), "accuracy": sum(hits) / len(hits)})
    return out


def cmd_eval(args) -> None:
    from .pipeline import evaluate_run, run_dir

    if Path(args.data).is_file():
        raise NotADirectoryError(f"--data takes the routing-data folder; {args.data} is a file "
                                 "(evaluate a file of your own with --data-file)")
    demo = _demo(args)
    folder = Path(args.head) if args.head else run_dir(demo, args.kind, args.mode, args.seed) / args.checkpoint
    if args.data_file:  # a user's own file, same format
        from .data import read_questions

        read_questions(args.data_file)  # validate first: a bad line is named before any work
        rows = evaluate_run(demo, None, folder, splits=("user",), files={"user": Path(args.data_file)})
    else:
        rows = evaluate_run(demo, args.data, folder)
    print(markdown_table(summarize(rows), ["split", "by", "group", "n", "accuracy"]))


def cmd_demo_v41(args) -> None:
    import torch

    from .demo_v41 import train_v41_head

    torch.set_num_threads(args.threads)
    report = train_v41_head(args.root, quick=args.quick, progress=not args.quiet)
    print(json.dumps(report["accuracy"], indent=1))


def cmd_export(args) -> None:
    from .builders import adapter_candidates
    from .features import RouteTokenizer
    from .pipeline import load_head, load_model, run_dir
    from .router import MoL2Router

    demo = _demo(args)
    folder = run_dir(demo, "mol2", args.mode, args.seed) / args.checkpoint
    head, _, meta = load_head(folder)
    model = load_model(demo.model_dir)
    router = MoL2Router(head, model.get_input_embeddings().weight, RouteTokenizer(demo.tokenizer),
                        adapter_candidates(demo.adapters_dir))
    out = Path(args.out) if args.out else demo.router_dir
    router.save(out, backbone=demo.model_dir, meta={k: meta[k] for k in ("mode", "seed", "epochs") if k in meta}
                | {"checkpoint": args.checkpoint, "trained_backbone": demo.trained})
    print(f"wrote {out} (mode {args.mode}, seed {args.seed}, {args.checkpoint} checkpoint)")


def cmd_bench(args) -> None:
    """`mol2 bench router_NAME ...` under its router name. By module name, as `python -m benchmarks.NAME` runs it:
    the benchmarks sit above the router and import it."""
    import importlib

    module = {"latency": "router_latency", "accuracy": "router_accuracy", "scaling": "router_data_scaling"}[args.which]
    importlib.import_module(f"benchmarks.{module}").main(args.rest)


def register(commands, **options) -> None:
    """`mol2 router` and its subcommands."""
    p = commands.add_parser("router", **options, description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="router_command", required=True)

    def common(q, data=True):
        q.add_argument("--demo", default=None, help="a demo folder (model/ + adapters/); default: ARTIFACTS/demo "
                                                    "when built, else models/demo, else the untrained demo")
        q.add_argument("--artifacts", default=None,
                       help="where `mol2 build demo` writes ARTIFACTS/demo (default: the project's artifacts/)")
        q.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
        q.add_argument("--preset", default="demo", help="router head preset (default: %(default)s)")
        if data:
            q.add_argument("--data", default=DATA, help="routing data folder (default: %(default)s)")

    q = sub.add_parser("data", help="build generic and domain routing questions from offline text")
    q.add_argument("--out", default=DATA)
    q.add_argument("--corpus", default="artifacts/corpus")
    q.add_argument("--apt-lists", default="artifacts/apt/lists")
    q.add_argument("--generic-total", type=int, default=6000)
    q.add_argument("--train-per-class", type=int, default=300)
    q.add_argument("--bench-per-class", type=int, default=100)
    q.add_argument("--asks-per-class", type=int, default=300,
                   help="requests about each domain made from offline text (mol2_router/asks.py) added to domain "
                        "train/dev, a third as many to the benchmark; 0 for the corpus alone")
    q.add_argument("--freeform-only", action="store_true",
                   help="only (re)write domain.freeform.jsonl, the hand-written held-out requests, into --out")
    q.add_argument("--threads", type=int, default=1)
    q.set_defaults(run=cmd_data)

    q = sub.add_parser("extract", help="H19 features of every split (batched, sharded, resumable)")
    common(q)
    q.add_argument("--kind", choices=("mol2", "contextual", "both"), default="both")
    q.add_argument("--limit", nargs="*", metavar="SPLIT=N", help="questions kept per split (added to the defaults)")
    q.set_defaults(run=cmd_extract)

    q = sub.add_parser("train", help="train heads for the recipe modes and seeds")
    common(q)
    q.add_argument("--kind", choices=("mol2", "contextual"), default="mol2")
    q.add_argument("--modes", nargs="+", default=["A", "B", "C"], choices=("A", "B", "C"))
    q.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    q.add_argument("--epochs", type=_at_least_one, default=30, help="per stage (default: %(default)s, the seed's)")
    q.add_argument("--batch-size", type=int, default=256)
    q.add_argument("--limit", nargs="*", metavar="SPLIT=N", help="questions kept per split (added to the defaults)")
    q.set_defaults(run=cmd_train)

    q = sub.add_parser("eval", help="accuracy of a saved head: overall, per class, per source")
    common(q)
    q.add_argument("--kind", choices=("mol2", "contextual"), default="mol2")
    q.add_argument("--mode", default="B")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--checkpoint", choices=("best", "last"), default="last")
    q.add_argument("--head", default=None, help="a head folder (overrides kind/mode/seed/checkpoint)")
    q.add_argument("--data-file", default=None, help="evaluate on your own JSONL file (same format)")
    q.set_defaults(run=cmd_eval)

    q = sub.add_parser("export", help="save a trained MoL2 head beside the demo adapters for serving")
    common(q, data=False)
    q.add_argument("--mode", default="B")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--checkpoint", choices=("best", "last"), default="last")
    q.add_argument("--out", default=None, help="default: <demo>/router beside the adapters")
    q.set_defaults(run=cmd_export)

    q = sub.add_parser("demo-v41", help="train the deepseek_v41 demo's head on its H19 (after `mol2 build demo "
                                        "--family deepseek_v41`)")
    q.add_argument("--root", default="artifacts", help="where the demo was built (default: %(default)s)")
    q.add_argument("--quick", action="store_true", help="the quick build's (ROOT/demo-v41-quick)")
    q.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    q.add_argument("--quiet", action="store_true", help="no progress bars")
    q.set_defaults(run=cmd_demo_v41)

    q = sub.add_parser("bench", help="run a router benchmark (options after the name go to it)")
    q.add_argument("which", choices=("latency", "accuracy", "scaling"))
    q.add_argument("rest", nargs=argparse.REMAINDER)
    q.add_argument("--threads", type=int, default=1)
    q.set_defaults(run=cmd_bench)

