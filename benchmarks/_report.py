"""What every benchmark shares: medians with spread, markdown tables, JSON rows, saved plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def median_spread(samples: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of a list of timings."""
    return statistics.median(samples), min(samples), max(samples)


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
