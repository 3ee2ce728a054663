"""The README's table of headline figures, written from the benchmarks' own output.

    python benchmarks/headline.py            # print the table
    python benchmarks/headline.py --write    # put it between the README's headline markers

A figure against CTranslate2 appears only from a run whose CTranslate2 side passed its reference
check (the anchor's own one-liner in a clean process, same run); otherwise the row says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "out"
README = REPO / "README.md"
START = "<!-- headline: start"
END = "<!-- headline: end -->"


def _load(name: str) -> dict[str, Any] | None:
    path = OUT / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _size_rows(merge: dict[str, Any] | None, quantize: dict[str, Any] | None) -> list[str]:
    rows = []
    if merge:
        layouts = merge["variants"]["tied"]["layouts"]
        ours = layouts["onnxmerge model.onnx"]["ratio_to_safetensors"]
        theirs = layouts["all four files"]["ratio_to_safetensors"]
        rows.append(
            f"| bytes on disk, float32 | **{ours:.3f}×** the checkpoint | optimum's four files: "
            f"{theirs:.2f}× | `bench_merge.py` |"
        )
    if quantize:
        checkpoint = quantize["checkpoint_bytes"]
        ct2 = quantize["anchors"]["CTranslate2 int8 model.bin"] / checkpoint
        sizes = quantize["sizes"]
        for name in ("int8", "int4"):
            ours = sizes[f"onnxmerge {name}"] / checkpoint
            smallest = sizes.get(f"onnxmerge {name}, int4 embedding")
            also = (
                f'; with `embedding="int4"`: {smallest / checkpoint:.3f}×, slower'
                if smallest
                else ""
            )
            rows.append(
                f"| bytes on disk, {name} | **{ours:.3f}×** the checkpoint{also} | CTranslate2 "
                f"int8 `model.bin`: {ct2:.3f}× | `bench_quantize.py` |"
            )
    return rows


def _optimum_rows(generate: dict[str, Any] | None) -> list[str]:
    if not generate:
        return []
    ratios = generate["ratios"]
    return [
        f"| float32 greedy time, batch 1 | **{ratios['greedy_time']:.2f}×** optimum's "
        f"`ORTModelForSeq2SeqLM` | | `bench_generate.py` |",
        f"| memory after load | **{ratios['rss_after_load_mb']:.2f}×** optimum's | | "
        f"`bench_generate.py` |",
    ]


def _processor(results: dict[str, Any]) -> str:
    """The processor as the run recorded it: its name says little (every "AMD EPYC"), its
    instruction sets tell generations apart, and ratios move between them."""
    cpu = results["environment"]["cpu"]
    return f"{cpu['model']}: {', '.join(cpu.get('flags') or [])}"


def _anchor_checked(results: dict[str, Any] | None) -> bool:
    """Whether a run's CTranslate2 side passed every reference check (``benchmarks/_anchor.py``)
    and the run was not refused."""
    checks = (results or {}).get("reference_checks") or {}
    return bool(checks) and "refused" not in results and all(c["agrees"] for c in checks.values())


def _ctranslate2_rows(ct2: dict[str, Any] | None) -> list[str]:
    if not ct2 or not _anchor_checked(ct2):
        return [
            "| against CTranslate2 | not published: no run here whose CTranslate2 side passed "
            "its reference check | | `bench_ctranslate2.py` |"
        ]
    rows = []
    processor = _processor(ct2)
    for precision in ("float32", "int8"):
        ratios = ct2["precisions"][precision]["ratios"]
        rows.append(
            f"| {precision} greedy time, batch 1 | **{ratios['greedy_b1']:.2f}×** "
            f"CTranslate2's, same precision ({processor}) | | `bench_ctranslate2.py` |"
        )
    return rows


def _corpus_rows(corpus: dict[str, Any] | None) -> list[str]:
    if not corpus or not _anchor_checked(corpus):
        return []
    cells = []
    for precision in ("float32", "int8"):
        ratios = corpus["precisions"][precision]["ratios"]
        cells.append(
            f"{precision} greedy **{ratios['greedy']:.2f}×**, beam-4 **{ratios['beam4']:.2f}×**"
        )
    processor = _processor(corpus)
    inputs = corpus["setting"]["inputs"]
    return [
        f"| tokens/s over a corpus of {inputs:,} inputs | {'; '.join(cells)} CTranslate2's "
        f"({processor}) | | `bench_corpus.py` |"
    ]


def render() -> str:
    """The table, as Markdown lines, from whatever benchmarks/out holds."""
    head = [
        "Opus-mt-fr-en shape (random weights), 2 threads; the processor and every other figure: "
        "[performance](docs/performance.md).",
        "",
        "| | onnxmerge | anchor | measured by |",
        "|---|---|---|---|",
    ]
    rows = (
        _size_rows(_load("merge"), _load("quantize"))
        + _optimum_rows(_load("generate"))
        + _ctranslate2_rows(_load("ctranslate2"))
        + _corpus_rows(_load("corpus"))
    )
    return "\n".join(head + rows) + "\n"


def _bounds(readme: str) -> tuple[int, int]:
    """Where the table goes: after the start marker's line, up to the end marker."""
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{README}: the headline markers are missing")
    return readme.index("\n", start) + 1, end


def current(readme: str) -> str:
    """What the README holds between its headline markers."""
    start, end = _bounds(readme)
    return readme[start:end]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update README.md in place")
    args = parser.parse_args(argv)
    table = render()
    if not args.write:
        sys.stdout.write(table)
        return 0
    readme = README.read_text(encoding="utf-8")
    start, end = _bounds(readme)
    README.write_text(readme[:start] + table + readme[end:], encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
