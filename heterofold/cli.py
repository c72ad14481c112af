"""`heterofold fit | eval | apply`: fit a map for a direction, evaluate methods, continue text from a mapped cache."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .families import FAMILIES
from .zoo import ROOT, load_or_train


def _pair(args):
    return load_or_train(args.sender, Path(args.root)), load_or_train(args.receiver, Path(args.root))


def cmd_fit(args) -> None:
    from .pipeline import fit_and_save

    s, r = _pair(args)
    out = Path(args.out or Path(args.root) / "maps" / f"{args.sender}-to-{args.receiver}")
    m, curves = fit_and_save(s, r, out, args.n_train, args.n_held, Path(args.root))
    first_last = {k: (round(v[0], 4), round(min(v), 4)) for k, v in curves.items()}
    print(f"wrote {out} ({m.n_params()} parameters); held-out loss recolor -> best: {json.dumps(first_last)}")


def cmd_eval(args) -> None:
    from benchmarks.heterofold_eval import main as bench_main

    argv = ["--directions", f"{args.sender}:{args.receiver}"] + (["--quick"] if args.quick else [])
    bench_main(argv + (["--json", args.json] if args.json else []))


def cmd_apply(args) -> None:
    from .pipeline import apply_map, native_continuation

    s, r = _pair(args)
    path = Path(args.map or Path(args.root) / "maps" / f"{args.sender}-to-{args.receiver}")
    print(f"mapped cache ({path}): {apply_map(path, s, r, args.text, args.max_new)!r}")
    if args.native:
        print(f"native prefill:  {native_continuation(r, args.text, args.max_new)!r}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="heterofold", description=__doc__)
    p.add_argument("--root", default=str(ROOT), help="artifact folder (zoo, corpus, maps)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    sub = p.add_subparsers(dest="cmd", required=True)
    fams = sorted(FAMILIES)

    def pair_args(sp):
        sp.add_argument("--sender", choices=fams, required=True)
        sp.add_argument("--receiver", choices=fams, required=True)

    f = sub.add_parser("fit", help="fit and save the HeteroFold map for one direction")
    pair_args(f)
    f.add_argument("--out", help="map folder (default ROOT/maps/SENDER-to-RECEIVER)")
    f.add_argument("--n-train", type=int, default=128, help="calibration prompts")
    f.add_argument("--n-held", type=int, default=32, help="held-out calibration prompts")
    f.set_defaults(fn=cmd_fit)

    e = sub.add_parser("eval", help="evaluate HeteroFold, baselines and ablations on one direction")
    pair_args(e)
    e.add_argument("--quick", action="store_true")
    e.add_argument("--json", help="write the table as JSON rows")
    e.set_defaults(fn=cmd_eval)

    a = sub.add_parser("apply", help="sender prefills TEXT, the receiver continues from the mapped cache")
    pair_args(a)
    a.add_argument("text")
    a.add_argument("--map", help="map folder (default ROOT/maps/SENDER-to-RECEIVER)")
    a.add_argument("--max-new", type=int, default=24)
    a.add_argument("--native", action="store_true", help="also print the receiver's own continuation")
    a.set_defaults(fn=cmd_apply)

    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.fn(args)


if __name__ == "__main__":
    main()
