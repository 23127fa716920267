"""Shared helpers for benchmark scripts: table printing and JSON output."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Print rows as a fixed-width table; ``columns`` = [(key, format spec)]."""
    widths = [max(len(k), 10) for k, _ in columns]
    print("  ".join(k.rjust(w) for (k, _), w in zip(columns, widths)))
    for r in rows:
        cells = []
        for (k, fmt), w in zip(columns, widths):
            v = r.get(k)
            cells.append(("n/a" if v is None else format(v, fmt)).rjust(w))
        print("  ".join(cells))


def write_json(path: str | Path, rows: list[dict], **meta) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    doc = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), **meta, "rows": rows}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {path}")
