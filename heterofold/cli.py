"""`mol2 heterofold fit | eval | apply | serve` (or `heterofold ...`): fit a map for a direction, evaluate methods,
continue text from a mapped cache, serve the maps through Triton."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from python_backend.server.launcher import LaunchError

from .registry import directions, family_names
from .pipeline import N_HELD, N_TRAIN
from .zoo import ROOT, TrainConfig, load_or_train, trained_steps


def _pair(args):
    root = Path(args.root)
    if args.zoo_steps is not None:
        for family in (args.sender, args.receiver):
            steps = trained_steps(family, root)
            if steps is not None and steps != args.zoo_steps:
                print(f"heterofold: note: zoo model {family!r} under {root} was trained {steps} steps and is used as "
                      f"it is; --zoo-steps {args.zoo_steps} applies only to a model trained now (another --root "
                      f"trains a new zoo)", file=sys.stderr)
    cfg = TrainConfig(steps=args.zoo_steps or TrainConfig.steps)  # used only for a zoo model not trained yet
    return load_or_train(args.sender, root, cfg), load_or_train(args.receiver, root, cfg)


def cmd_fit(args) -> None:
    from .pipeline import fit_and_save

    s, r = _pair(args)
    out = Path(args.out or Path(args.root) / "maps" / f"{args.sender}-to-{args.receiver}")
    m, curves = fit_and_save(s, r, out, args.n_train, args.n_held, Path(args.root))
    first_last = {k: (round(v[0], 4), round(min(v), 4)) for k, v in curves.items()}
    print(f"wrote {out} ({m.n_params()} parameters); held-out loss recolor -> best: {json.dumps(first_last)}")


def cmd_eval(args) -> None:
    """`mol2 bench heterofold_eval` on one direction. By module name, as `python -m benchmarks.heterofold_eval` runs
    it: the benchmarks sit above heterofold and import it."""
    import importlib

    bench_main = importlib.import_module("benchmarks.heterofold_eval").main
    argv = ["--directions", f"{args.sender}:{args.receiver}", "--split", args.split, "--root", args.root]
    argv += ["--quick"] if args.quick else []
    for flag, value in (("--json", args.json), ("--plot", args.plot), ("--methods", args.methods),
                        ("--n-docs", args.n_docs)):
        argv += [flag, str(value)] if value is not None else []
    bench_main(argv)


def cmd_apply(args) -> None:
    from .pipeline import apply_map, native_continuation, require_map

    path = Path(args.map or Path(args.root) / "maps" / f"{args.sender}-to-{args.receiver}")
    require_map(path, args.sender, args.receiver)  # before loading (or training) the zoo
    s, r = _pair(args)
    print(f"mapped cache ({path}): {apply_map(path, s, r, args.text, args.max_new)!r}")
    if args.native:
        print(f"native prefill:  {native_continuation(r, args.text, args.max_new)!r}")


def cmd_serve(args) -> None:
    """tritonserver on model_repository_heterofold/ (heterofold_sender + the BLS model heterofold)."""
    import signal
    import time

    from python_backend.server.launcher import LaunchError, Ports, start, stop, wait_ready

    from .serving import REPOSITORY

    root = Path(args.root).resolve()
    maps = sorted(p.name for p in (root / "maps").glob("*") if (p / "map.json").is_file())
    ports = Ports(args.http_port, args.grpc_port, args.metrics_port, args.host)
    log = Path(args.log or root / "tritonserver.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"serving {REPOSITORY.name} on zoo + maps in {root} (maps: {maps or 'none yet'}); log: {log}")
    process = start(REPOSITORY, ports, root / "triton", log, env={"HETEROFOLD_ROOT": str(root)})
    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.append(1))
    try:
        wait_ready(process, ports)
        example = maps[0] if maps else "{}-to-{}".format(*directions()[0])    # the map `fit` would write first
        body = json.dumps({"text_input": "Package grep (utils): GNU grep", "map": example, "max_tokens": 16})
        print(f"ready: HTTP http://{ports.http_url}  gRPC {ports.grpc_url}\ntry:\n  curl -s -X POST "
              f"http://{ports.http_url}/v2/models/heterofold/generate -d '{body}'")
        while not stopping and not args.ready_only:
            if process.poll() is not None:
                raise LaunchError(f"tritonserver exited with code {process.returncode}; see {log}")
            time.sleep(0.5)
    finally:
        stop(process)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of steps")
    return int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options and subcommands, on `heterofold`'s own parser or on `mol2 heterofold`'s."""
    p.add_argument("--root", default=str(ROOT), help="artifact folder (zoo, corpus, maps)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--zoo-steps", type=_positive, default=None,
                   help=f"training steps of a zoo model that fit or apply trains on first use (default: "
                        f"{TrainConfig.steps}); a zoo model already under --root is used as it is")
    sub = p.add_subparsers(dest="cmd", required=True)
    fams = sorted(family_names())

    def pair_args(sp):
        sp.add_argument("--sender", choices=fams, required=True)
        sp.add_argument("--receiver", choices=fams, required=True)

    f = sub.add_parser("fit", help="fit and save the HeteroFold map for one direction")
    pair_args(f)
    f.add_argument("--out", help="map folder (default ROOT/maps/SENDER-to-RECEIVER)")
    f.add_argument("--n-train", type=int, default=N_TRAIN, help="calibration prompts")
    f.add_argument("--n-held", type=int, default=N_HELD, help="held-out calibration prompts")
    f.set_defaults(fn=cmd_fit)

    e = sub.add_parser("eval", help="evaluate HeteroFold, baselines and ablations on one direction")
    pair_args(e)
    e.add_argument("--quick", action="store_true", help="main methods, small sets (1-2 min)")
    e.add_argument("--json", help="write the table as JSON rows")
    e.add_argument("--plot", help="the figure (default: ROOT/heterofold_eval.png)")
    e.add_argument("--methods", help="comma list (default: all; see python -m benchmarks.heterofold_eval --help)")
    e.add_argument("--n-docs", type=int, help="evaluation items per task (default 16)")
    e.add_argument("--split", choices=("heldout", "selection"), default="heldout",
                   help="heldout: the held-out corpus; selection: the held-out calibration prompts, for choosing settings")
    e.set_defaults(fn=cmd_eval)

    a = sub.add_parser("apply", help="sender prefills TEXT, the receiver continues from the mapped cache")
    pair_args(a)
    a.add_argument("text")
    a.add_argument("--map", help="map folder (default ROOT/maps/SENDER-to-RECEIVER)")
    a.add_argument("--max-new", type=int, default=24)
    a.add_argument("--native", action="store_true", help="also print the receiver's own continuation")
    a.set_defaults(fn=cmd_apply)

    sv = sub.add_parser("serve", help="serve the maps through Triton (BLS model `heterofold`)",
                        description="Start tritonserver on model_repository_heterofold/ with the zoo and maps under "
                                    "--root; Ctrl-C stops it.")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--http-port", type=int, default=8010)
    sv.add_argument("--grpc-port", type=int, default=8011)
    sv.add_argument("--metrics-port", type=int, default=8012)
    sv.add_argument("--log", help="server log (default ROOT/tritonserver.log)")
    sv.add_argument("--ready-only", action="store_true", help="exit once the server answers ready (smoke test)")
    sv.set_defaults(fn=cmd_serve)


def run(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if getattr(args, "sender", None) is not None and args.sender == args.receiver:
        p.error(f"--sender and --receiver are both {args.sender}: a map transfers a cache between two families")
    torch.set_num_threads(args.threads)
    try:
        args.fn(args)
    except (OSError, ValueError, LaunchError) as error:  # missing, mismatched, damaged or too-short input
        raise SystemExit(f"{p.prog} {args.cmd}: error: {error}") from None


def register(commands, **options) -> None:
    """`mol2 heterofold ...`."""
    p = commands.add_parser("heterofold", **options, description=__doc__)
    add_arguments(p)
    p.set_defaults(run=lambda args: run(p, args))


def main(argv=None) -> None:
    """The `heterofold` console script: `mol2 heterofold` under its own name."""
    p = argparse.ArgumentParser(prog="heterofold", description=__doc__)
    add_arguments(p)
    run(p, p.parse_args(argv))


if __name__ == "__main__":
    main()
