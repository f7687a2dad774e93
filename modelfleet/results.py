"""Result files the benchmarks write (docs/results): one CSV writer, so every table has the same
shape rules: the parent folder made, a header of every column any row has (first seen first),
blank cells where a row lacks one."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path


def write_csv(path: Path, rows: Iterable[Mapping[str, object]], fields: Sequence[str] | None = None) -> Path:
    """Write ``rows`` to ``path`` as CSV (columns ``fields``, or every key of the rows in order)."""
    rows = list(rows)
    columns = list(fields) if fields is not None else list(dict.fromkeys(key for row in rows for key in row))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path
