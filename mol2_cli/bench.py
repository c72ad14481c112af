"""`mol2 bench [NAME [OPTIONS...]]`: the benchmarks of benchmarks/, listed, or one run as `python -m benchmarks.NAME
OPTIONS...` runs it (`mol2 bench NAME --help` shows its options)."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import runpy
import sys
from pathlib import Path


def benchmarks() -> dict[str, str]:
    """name -> title (its docstring up to the first colon), for every module of benchmarks/ that runs as a script.
    Read from the source, so listing them imports none."""
    folder = Path(importlib.util.find_spec("benchmarks").submodule_search_locations[0])
    found = {}
    for path in sorted(folder.glob("[!_]*.py")):
        source = path.read_text()
        if '__name__ == "__main__"' in source:
            found[path.stem] = (ast.get_docstring(ast.parse(source)) or "").split(":")[0].split("\n")[0]
    return found


def run(args: argparse.Namespace) -> None:
    if args.name is None:
        width = max(map(len, args.found))
        print("\n".join(f"{name:<{width}}  {title}" for name, title in args.found.items()))
        return
    sys.argv = [args.name, *args.options]  # its parser reads them; runpy names argv[0] as `python -m` does
    runpy.run_module(f"benchmarks.{args.name}", run_name="__main__", alter_sys=True)


def register(commands, **options) -> None:
    found = benchmarks()
    listing = "\n".join(f"  {name:<20} {title}" for name, title in found.items())
    p = commands.add_parser("bench", **options, description=__doc__, epilog=f"benchmarks:\n{listing}",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", choices=list(found), metavar="NAME", help="the benchmark (none: list them)")
    p.add_argument("options", nargs=argparse.REMAINDER, help="its options")
    p.set_defaults(run=run, found=found)
