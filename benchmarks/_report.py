"""What every benchmark shares: medians with spread, markdown tables, JSON rows, saved plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def add_plot_option(parser, default: str) -> None:
    """--plot PATH; its default gets a _quick suffix with --quick (`plot_path`), so a smoke run never replaces the
    figure of a full run."""
    parser.add_argument("--plot", default=None, help=f"PNG path (default: {default}; with --quick, "
                                                     f"{quick_name(default)})")
    parser.set_defaults(plot_default=default)


def quick_name(path: str) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}_quick{p.suffix}"))


def plot_path(args) -> str:
    """The figure's path: --plot, else the benchmark's default (its _quick variant with --quick)."""
    if args.plot is not None:  # given, "" included (no figure where the benchmark allows that)
        return args.plot
    return quick_name(args.plot_default) if getattr(args, "quick", False) else args.plot_default


def median_spread(samples: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of a list of timings."""
    return statistics.median(samples), min(samples), max(samples)


def paired_difference(a: list[float], b: list[float], resamples: int = 2000,
                      seed: int = 0) -> tuple[float, float, float]:
    """Mean of a - b over paired items with a 95% percentile-bootstrap interval: (mean, low, high).

    Two methods scored on the same items differ less from item to item than either's own mean does, so the
    interval of their paired difference says whether a gap between two means is more than the items' noise."""
    import numpy as np

    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    if d.size == 0:
        raise ValueError("no paired items")
    means = d[np.random.default_rng(seed).integers(0, d.size, (resamples, d.size))].mean(axis=1)
    return float(d.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def cell(value):
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_json(rows: list[dict], path: str | Path | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rows, indent=2))
        print(f"wrote {path}")


def save_figure(figure, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}")
