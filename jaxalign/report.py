"""Plain-text tables and JSON output for the command line."""

from __future__ import annotations

import json
import math
from typing import Any, Sequence


def fmt(value: Any) -> str:
    """A compact human form of a number (scientific for tiny or huge magnitudes)."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value == 0 or math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.3e}" if abs(value) < 1e-3 or abs(value) >= 1e5 else f"{value:.4f}"
    return str(value)


def table(rows: Sequence[dict], columns: Sequence[str], headers: Sequence[str] | None = None) -> str:
    """A left-aligned text table of `rows` (dicts) restricted to `columns`."""
    headers = list(headers or columns)
    cells = [[fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def to_json(obj: Any) -> str:
    """JSON with numpy scalars and arrays converted."""
    def default(o):
        if hasattr(o, "tolist"):
            return o.tolist()
        raise TypeError(f"not JSON serialisable: {type(o).__name__}")
    return json.dumps(obj, indent=2, default=default)
