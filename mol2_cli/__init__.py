"""`mol2 COMMAND ...`: the one entry point. Each command belongs to its package, which adds it to the parser
(`register` in ced/cli.py, mol2_router/cli.py, engine_build/cli.py, heterofold/cli.py; python_backend/server/cli.py
for serve and repo; mol2_cli/bench.py for bench; mol2_cli/inspect.py for inspect)."""

from __future__ import annotations

import argparse
import importlib
import sys

# command: (the function that adds it, its line in `mol2 --help`). Only the named command's module is imported, so
# `mol2 --help` loads no package and `mol2 serve --help` only the server's options.
COMMANDS = {
    "chat": ("ced.cli:register", "run a scripted conversation that switches adapters"),
    "serve": ("python_backend.server.cli:add_serve", "start the Triton server (prefill -> route -> decode)"),
    "repo": ("python_backend.server.cli:add_repo", "build the Triton model repository"),
    "router": ("mol2_router.cli:register", "the MoL2 router: data, H19 extraction, training, evaluation, benchmarks"),
    "build": ("engine_build.cli:register", "build the demo model (corpus, tokenizer, pretraining, adapters), its "
                                           "engines (ONNX, TensorRT), or a synthetic DeepSeek-V4.1 checkpoint"),
    "heterofold": ("heterofold.cli:register", "HeteroFold: fit, evaluate, apply and serve KV-cache maps between "
                                              "model families"),
    "bench": ("mol2_cli.bench:register", "list the benchmarks, or run one by name"),
    "inspect": ("mol2_cli.inspect:register", "load a model directory (any family): its parts, parameter counts and "
                                             "one short forward; or count a preset"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mol2", description="Mixture-of-LoRA on causal encoder-decoder models.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    named = next((word for word in argv if not word.startswith("-")), None)  # mol2 has no options of its own
    for name, (target, summary) in COMMANDS.items():
        if name == named:
            module, function = target.split(":")
            getattr(importlib.import_module(module), function)(commands, help=summary)
        else:  # listed in --help, never parsed
            commands.add_parser(name, help=summary)
    return parser


def user_errors() -> tuple[type[Exception], ...]:
    """The errors that mean bad input or a failed start: one line, no traceback. Imported only once a command has
    failed, so no command pays for the others' packages."""
    from mol2_router.data import RouteDataError
    from python_backend.core.adapter_set import AdapterSetError
    from python_backend.server.launcher import LaunchError

    return OSError, RouteDataError, AdapterSetError, LaunchError


def main(argv: list[str] | None = None) -> int | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    try:
        return args.run(args)
    except Exception as error:
        if not isinstance(error, user_errors()):
            raise
        command = " ".join(filter(None, ("mol2", args.command, getattr(args, "router_command", None))))
        raise SystemExit(f"{command}: error: {error}") from None
