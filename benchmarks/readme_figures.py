"""Which README figure comes from which benchmark field, and the README's figures read back.

The README's tables against CTranslate2 are ratios (ours / CTranslate2) that benchmarks write
under ``benchmarks/out``: one table per benchmark, one row per measure, one column per precision
or layout. ``readme_figures`` reads a README's cells; ``measured_figures`` takes the same cells
from a folder of results; ``python benchmarks/run_all.py --check docs/performance.md`` sets
them side by side.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Table:
    """One README table: its benchmark, its columns (as the results name them), its rows
    (README label, key) and how a cell's value is read from the benchmark's results."""

    benchmark: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, str], ...]
    value: Callable[[dict, str, str], float | None]


def _ratio(data: dict, column: str, key: str) -> float:
    return data["precisions"][column]["ratios"][key]


def _within_peak(data: dict, column: str, case: str) -> float | None:
    point = data["precisions"][column]["within_peak"][case]
    return None if point is None else point["ratio"]


def _ends(data: dict, column: str, key: str) -> float:
    case, _, measure = key.partition(":")
    return data["precisions"][column][case][measure]


CTRANSLATE2 = Table(
    "ctranslate2",
    (
        "float32",
        "float32 external data",
        "float32 session cache",
        "float32 by path",
        "int8",
        "int8 external data",
        "int8 session cache",
        "int8 by path",
    ),
    (
        ("greedy time", "greedy_b1"),
        ("beam-4 time", "beam4_b1"),
        ("memory after load", "rss_after_load_mb"),
        ("memory import and load add", "rss_import_and_load_mb"),
        ("memory the model adds", "rss_added_by_load_mb"),
        ("load time", "load_s"),
    ),
    _ratio,
)
CORPUS = Table(
    "corpus",
    ("float32", "int8"),
    (("greedy tokens/s", "greedy"), ("beam-4 tokens/s", "beam4"), ("peak memory", "peak_rss")),
    _ratio,
)
CORPUS_WITHIN_PEAK = Table(
    "corpus",
    ("float32", "int8"),
    (
        ("greedy tokens/s, within the memory target", "greedy"),
        ("beam-4 tokens/s, within the memory target", "beam4"),
    ),
    _within_peak,
)
CORPUS_ENDS = Table(
    "corpus_ends",
    ("float32", "int8"),
    (
        ("greedy tokens/s", "greedy:vs_ctranslate2"),
        ("beam-4 tokens/s", "beam4:vs_ctranslate2"),
        ("greedy, dropping / keeping ended rows", "greedy:vs_rows_kept"),
        ("beam-4, dropping / keeping ended rows", "beam4:vs_rows_kept"),
    ),
    _ends,
)
TABLES = (CTRANSLATE2, CORPUS, CORPUS_WITHIN_PEAK, CORPUS_ENDS)


@dataclass(frozen=True)
class Figure:
    """One README cell: its table, row and column, and the value the README prints."""

    table: Table
    row: str
    column: str
    key: str
    readme: float | None

    @property
    def name(self) -> str:
        return f"{self.table.benchmark}: {self.row}, {self.column}"


_NUMBER = re.compile(r"\**([0-9]+(?:\.[0-9]+)?)\s*[×x]")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _markdown_tables(text: str) -> list[tuple[list[str], dict[str, list[str]]]]:
    """Every table of ``text``: its header's cells and its rows' cells by their first cell."""
    tables, lines = [], text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if not (line.startswith("|") and re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$", lines[i + 1])):
            continue
        rows = {}
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            label, *cells = _cells(row)
            rows[label] = cells
        tables.append((_cells(line)[1:], rows))
    return tables


def _column_name(header: str) -> str:
    """A README column header as the results name it ("float32, external data")."""
    return " ".join(header.replace(",", " ").split())


def readme_figures(readme: str) -> list[Figure]:
    """The README's cells of every table in ``TABLES`` that it prints: a README table is the
    one whose header has the table's columns and whose rows have all the table's labels."""
    figures = []
    tables = _markdown_tables(readme)
    for table in TABLES:
        for header, rows in tables:
            columns = [_column_name(h) for h in header]
            labels = [label for label, _ in table.rows]
            if columns != list(table.columns) or not all(label in rows for label in labels):
                continue
            for label, key in table.rows:
                for column, cell in zip(table.columns, rows[label], strict=True):
                    found = _NUMBER.match(cell)
                    value = float(found.group(1)) if found else None
                    figures.append(Figure(table, label, column, key, value))
            break
    return figures


def measured_figure(figure: Figure, results: dict[str, Any] | None) -> float | None:
    """``figure``'s value in a benchmark's results (None where they lack it)."""
    if results is None:
        return None
    try:
        return figure.table.value(results, figure.column, figure.key)
    except (KeyError, TypeError):
        return None


def load_results(folder: Path, benchmark: str) -> dict[str, Any] | None:
    """A benchmark's results in ``folder``: those it wrote, else those of a run it refused
    (with their ``refused`` reason), else None."""
    import json

    for name in (f"{benchmark}.json", f"{benchmark}.refused.json"):
        path = folder / name
        if path.exists():
            return json.loads(path.read_text(encoding="utf-8"))
    return None
