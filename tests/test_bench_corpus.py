"""The corpus benchmarks' grid of batch settings: widened until no side's best lies at its edge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_corpus, bench_corpus_ends

OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "out"


def _speeds(**by_setting: float) -> dict[str, dict]:
    return {name.replace("_", " "): {"tokens_per_s": s} for name, s in by_setting.items()}


@pytest.mark.parametrize(
    "runs, largest, past",
    [
        (_speeds(examples_32_x2=9, examples_64_x2=5, examples_128_x2=4), 1000, "examples 16 x2"),
        (_speeds(examples_32_x2=4, examples_64_x2=5, examples_128_x2=9), 1000, "examples 256 x2"),
        (_speeds(examples_32_x2=4, examples_64_x2=9, examples_128_x2=5), 1000, None),
        # The edge of its own kind: sizes run one batch at a time are another grid.
        (_speeds(examples_32=2, examples_64_x2=9, examples_128_x2=5), 1000, "examples 32 x2"),
        (_speeds(examples_32=9, examples_64_x2=5), 1000, "examples 16"),
        (_speeds(tokens_1024=9, examples_64_x2=5), 1000, None),
        # Nothing below one input, nothing above the corpus, nothing tried twice.
        (_speeds(examples_1_x2=9, examples_2_x2=5), 1000, None),
        (_speeds(examples_32_x2=4, examples_64_x2=9), 100, None),
        (_speeds(examples_16_x2=5, examples_32_x2=9, examples_64_x2=4), 1000, None),
    ],
)
def test_the_setting_past_the_grids_edge(runs, largest, past):
    assert bench_corpus.beyond_edge(runs, largest) == past


def _peaked(peaks: dict[str, int], calls: list[tuple[str, str]]):
    """A side whose speed peaks at a batch size of its own, recording every run."""

    def run(side: str, name: str) -> dict:
        calls.append((side, name))
        size = bench_corpus.parse_setting(name)[1]
        return {"tokens_per_s": 100.0 - abs(size.bit_length() - peaks[side].bit_length())}

    return run


def test_widen_follows_a_sides_best_past_the_edge_on_every_side():
    calls: list[tuple[str, str]] = []
    run = _peaked({"ctranslate2": 16, "ours": 64, "kept": 256}, calls)
    grid = ("examples 32 x2", "examples 64 x2", "examples 128 x2")
    tried = {side: {n: run(side, n) for n in grid} for side in ("ctranslate2", "ours", "kept")}
    calls.clear()
    added = bench_corpus.widen(tried, run, ("ctranslate2", "ours"), 1000)
    # 32 was CTranslate2's fastest, then 16; 8 is slower, so 16 lies inside the grid.
    assert added == ["examples 16 x2", "examples 8 x2"]
    # Every side runs what is added, the sides alternated; a side that does not decide (ours
    # with rows kept, fastest at the largest) adds nothing.
    assert calls == [(s, n) for n in added for s in ("ctranslate2", "ours", "kept")]
    assert all(set(runs) == {*grid, *added} for runs in tried.values())


def test_widen_stops_after_its_most():
    calls: list[tuple[str, str]] = []
    run = _peaked({"ctranslate2": 1, "ours": 64}, calls)
    tried = {
        s: {n: run(s, n) for n in ("examples 64 x2", "examples 128 x2")}
        for s in ("ctranslate2", "ours")
    }
    assert bench_corpus.widen(tried, run, ("ctranslate2", "ours"), 1000, most=2) == [
        "examples 32 x2",
        "examples 16 x2",
    ]


def test_corpus_tables_show_what_the_grid_added_and_runs_from_before_it():
    data = json.loads((OUT / "corpus.json").read_text())
    del data["setting"]["widened"]  # as in a run from before the widening
    assert "tried too" not in "\n".join(bench_corpus.markdown(data))
    # As if a run had added examples 8 x2 to float32 greedy alone.
    data["setting"]["widened"] = {"float32": {"greedy": ["examples 8 x2"]}, "int8": {}}
    for side in ("ours", "ctranslate2"):
        runs = data["precisions"]["float32"][side]["cases"]["greedy"]["settings"]
        runs["examples 8 x2"] = {"tokens_per_s": 1.0, "peak_rss_mb": 2.0, "s": 3.0}
    page = bench_corpus.markdown(data)
    assert "(added: float32 greedy: examples 8 x2)" in "\n".join(page)
    table = page[
        page.index("Every setting, tokens/s (peak memory); empty where a setting was not tried:") :
    ]
    header = table[2].split(" | ")
    assert header[header.index("tokens 1024") + 1 :][:2] == ["examples 8 x2", "examples 16 x2"]
    rows = [line for line in table if line.startswith(("| float32 |", "| int8 |"))]
    assert len(rows) == 8
    for row in rows:
        added = row.split(" | ")[header.index("examples 8 x2")]
        assert added == ("1 (2 MB)" if row.startswith("| float32 | greedy |") else ""), row


def test_ends_text_says_what_the_grid_added():
    data = json.loads((OUT / "corpus_ends.json").read_text())
    del data["setting"]["widened"]  # as in a run from before the widening
    assert "tried too" not in "\n".join(bench_corpus_ends.markdown(data))
    data["setting"]["widened"] = {"float32": {"greedy": ["examples 256 x2"]}, "int8": {}}
    text = "\n".join(bench_corpus_ends.markdown(data))
    assert "(added: float32 greedy: examples 256 x2)" in text
    data["setting"]["widened"] = {"float32": {"greedy": []}, "int8": {}}
    text = "\n".join(bench_corpus_ends.markdown(data))
    assert "until it was not, three at most (none was)" in text
