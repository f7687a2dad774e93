"""modelfleet.results.write_csv: the one writer of the benchmarks' CSV tables."""

from __future__ import annotations

import csv
from pathlib import Path

from modelfleet.results import write_csv


def test_every_column_any_row_has_in_first_seen_order_with_blanks_and_the_folder_made(tmp_path: Path) -> None:
    rows = [{"batch": 1, "tok_s": 10.5}, {"batch": 8, "tok_s": 40.25, "note": "capped"}]
    path = write_csv(tmp_path / "new" / "folder" / "rows.csv", rows)
    with path.open(newline="") as f:
        read = list(csv.DictReader(f))
    assert list(read[0]) == ["batch", "tok_s", "note"]
    assert read == [{"batch": "1", "tok_s": "10.5", "note": ""}, {"batch": "8", "tok_s": "40.25", "note": "capped"}]


def test_named_columns_keep_their_order(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "rows.csv", ({"b": i, "a": -i} for i in range(2)), fields=["a", "b"])
    assert path.read_text().splitlines() == ["a,b", "0,0", "-1,1"]
