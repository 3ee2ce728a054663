"""Figures quoted in docs/performance.md, docs/architecture.md and the demo's note are the
benchmarks' own.

They are written from benchmarks/out/*.json (what `python benchmarks/run_all.py` produces); after a
benchmark run changes them, update the prose to the values these tests print.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_corpus import fastest_within
from benchmarks.readme_figures import CTRANSLATE2

pytestmark = pytest.mark.docs

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "out"
# The README shows only the generated headline table (benchmarks/headline.py); the prose figures
# live on the performance page.
PERFORMANCE = REPO / "docs" / "performance.md"


def _load(name: str) -> dict:
    path = OUT / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path} is not there (run benchmarks/run_all.py)")
    return json.loads(path.read_text(encoding="utf-8"))


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _span(values: list[float], digits: int = 2) -> str:
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}–{high}"


def _assert_quoted(text: str, expected: str, where: str) -> None:
    assert expected in text, f"{where} should say {expected!r} (from benchmarks/out)"


def test_readme_sizes_and_merge_cost_are_the_merge_benchmark() -> None:
    page = PERFORMANCE.read_text(encoding="utf-8")
    variants = _load("merge")["variants"]
    tied, untied = variants["tied"]["layouts"], variants["untied"]["layouts"]
    rows = {
        "optimum: encoder + decoder + decoder_with_past": tied["encoder+decoder+decoder_with_past"],
        "optimum: all four files": tied["all four files"],
        "optimum: encoder + decoder_model_merged (its leanest)": tied[
            "encoder+decoder_model_merged"
        ],
        "optimum without `accelerate` (untied LM head): all four files": untied["all four files"],
    }
    for label, layout in rows.items():
        row = f"| {label} | {_mb(layout['bytes'])} | {layout['ratio_to_safetensors']:.2f}× |"
        _assert_quoted(page, row, "docs/performance.md")
    ours = tied["onnxmerge model.onnx"]
    _assert_quoted(
        page,
        f"| **onnxmerge: model.onnx** | **{_mb(ours['bytes'])}** | "
        f"**{ours['ratio_to_safetensors']:.3f}×** |",
        "docs/performance.md",
    )
    checkpoint = variants["tied"]["checkpoint_bytes"]
    _assert_quoted(page, f"`model.safetensors` = {_mb(checkpoint)}", "docs/performance.md")
    ratios = [v["merge_time_memory"]["ratios_ours_over_optimum"] for v in variants.values()]
    time = _span([r["call_s"] for r in ratios], 1)
    memory = _span([r["peak_rss_bytes"] for r in ratios])
    _assert_quoted(
        page, f"takes {time}× the time and {memory}× the peak memory", "docs/performance.md"
    )


def test_readme_generation_ratios_are_the_generate_benchmark() -> None:
    page = PERFORMANCE.read_text(encoding="utf-8")
    ratios = _load("generate")["ratios"]
    for label, key in (
        ("greedy time", "greedy_time"),
        ("beam-4 time", "beam4_time"),
        ("memory after load", "rss_after_load_mb"),
        ("load time", "load_time"),
    ):
        _assert_quoted(page, f"| {label} | {ratios[key]:.2f}× |", "docs/performance.md")


def test_large_model_figures_are_the_large_benchmark() -> None:
    large = _load("large")
    ours, limited = large["onnxmerge"], large["limited_merge"]
    assert limited["measured"] and not limited["crashed"]
    quoted = (
        f"{ours['peak_anonymous_bytes'] / 2**30:.2f} GiB of anonymous memory",
        f"{limited['limit_bytes'] / 2**30:.1f} GiB memory cgroup",
        f"{ours['peak_private_bytes'] / 2**30:.2f} GiB",
    )
    for doc in ("docs/performance.md", "docs/architecture.md"):
        text = (REPO / doc).read_text(encoding="utf-8")
        for figure in quoted:
            _assert_quoted(" ".join(text.split()), figure, doc)


def test_architecture_merge_peaks_are_the_merge_benchmark() -> None:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    variants = _load("merge")["variants"].values()
    medians = [v["merge_time_memory"] for v in variants]
    ours = _span([m["onnxmerge"]["median"]["peak_private_bytes"] / 1e9 for m in medians])
    theirs = _span(
        [m["optimum_merge_decoders"]["median"]["peak_private_bytes"] / 1e9 for m in medians]
    )
    _assert_quoted(text, f"the merge peaks at {ours} GB against {theirs} GB", "architecture.md")


def test_demo_note_quotes_the_merge_benchmark() -> None:
    from onnxmerge.cli import demo_command

    ours = _load("merge")["variants"]["tied"]["layouts"]["onnxmerge model.onnx"]
    _assert_quoted(
        demo_command.SIZE_NOTE,
        f"the merged file is {ours['ratio_to_safetensors']:.3f}x the checkpoint",
        "onnxmerge.cli.demo_command.SIZE_NOTE",
    )


def test_architecture_session_memory_is_the_generate_benchmark() -> None:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    generate = _load("generate")
    ours, theirs = (generate[side]["rss_after_load_mb"] for side in ("ours", "optimum"))
    _assert_quoted(text, f"holds {ours:.0f} MB against {theirs:.0f} MB", "architecture.md")


def ratio_rows(precisions: dict, columns: tuple[str, ...], rows: tuple) -> list[str]:
    """Table rows of a benchmark's ratios: one row per (label, key), one column per precision."""
    return [
        f"| {label} | " + " | ".join(f"{precisions[c]['ratios'][key]:.2f}×" for c in columns) + " |"
        for label, key in rows
    ]


def ctranslate2_readme_rows(precisions: dict) -> list[str]:
    """The performance page's table against CTranslate2, row by row, from the benchmark's ratios."""
    # Which cell reads which field is the benchmark's own mapping, which --check uses too.
    return ratio_rows(precisions, CTRANSLATE2.columns, CTRANSLATE2.rows)


def test_readme_ctranslate2_ratios_are_the_ctranslate2_benchmark() -> None:
    page = PERFORMANCE.read_text(encoding="utf-8")
    for row in ctranslate2_readme_rows(_load("ctranslate2")["precisions"]):
        _assert_quoted(page, row, "docs/performance.md")


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def corpus_memory_sentence(corpus: dict) -> str:
    """runtime.md's figures of float32 beam 4 over the corpus, one batch at a time, setting by
    setting (the candidates by examples first, then the token budget)."""
    settings = corpus["precisions"]["float32"]["ours"]["cases"]["beam4"]["settings"]
    tried = {name: result for name, result in settings.items() if len(name.split()) == 2}
    peaks = []
    for name, result in tried.items():
        batch_type, size = name.split()
        if batch_type == "tokens":
            label = f"{int(size):,} tokens"
        else:
            label = f"`max_batch_size={size}` examples" if not peaks else size
        peaks.append(f"{result['peak_rss_mb']:.0f} MB with {label}")
    speeds = [f"{r['tokens_per_s']:.0f}" for r in tried.values()]
    return f"peaked at {_listed(peaks)}, for {_listed(speeds)} tokens/s"


def test_runtime_corpus_memory_is_the_corpus_benchmark() -> None:
    runtime = " ".join((REPO / "docs" / "runtime.md").read_text(encoding="utf-8").split())
    _assert_quoted(runtime, corpus_memory_sentence(_load("corpus")), "docs/runtime.md")


CORPUS_COLUMNS = ("float32", "int8")
CORPUS_ROWS = (("greedy tokens/s", "greedy"), ("beam-4 tokens/s", "beam4"))


def corpus_readme_rows(precisions: dict) -> list[str]:
    """The performance page's corpus table, row by row: fastest against fastest, then ours within
    the
    memory target (with the batching that got there)."""

    def within(case: str, precision: str) -> str:
        point = precisions[precision]["within_peak"][case]
        return "none fits" if point is None else f"{point['ratio']:.2f}× ({point['batching']})"

    rows = ratio_rows(precisions, CORPUS_COLUMNS, (*CORPUS_ROWS, ("peak memory", "peak_rss")))
    rows += [
        f"| {label}, within the memory target | "
        + " | ".join(within(key, c) for c in CORPUS_COLUMNS)
        + " |"
        for label, key in CORPUS_ROWS
    ]
    return rows


def test_readme_corpus_ratios_are_the_corpus_benchmark() -> None:
    page = PERFORMANCE.read_text(encoding="utf-8")
    corpus = _load("corpus")
    for row in corpus_readme_rows(corpus["precisions"]):
        _assert_quoted(page, row, "docs/performance.md")
    s = corpus["setting"]
    setting = (
        f"{s['inputs']:,} inputs of {s['source_ids']['min']}–{s['source_ids']['max']} ids, "
        f"lengths drawn like sentences', {s['new_tokens_per_input']} new tokens each, "
        f"{s['threads']} threads"
    )
    _assert_quoted(" ".join(page.split()), setting, "docs/performance.md")
    target = corpus["precisions"]["float32"]["targets"]["peak_rss"]
    _assert_quoted(" ".join(page.split()), f"within {target}× CTranslate2's", "docs/performance.md")


def test_readme_float32_beam_ceiling_is_the_corpus_benchmarks() -> None:
    page = " ".join(PERFORMANCE.read_text(encoding="utf-8").split())
    beam = _load("corpus")["float32_ceiling"]["cases"]["beam4"]
    quoted = (
        f"at least {beam['work_gflop'] / 1000:.1f} TFLOP on this corpus; CTranslate2 runs them at "
        f"{beam['shares']['ctranslate2']:.0%} of this machine's rate"
    )
    _assert_quoted(page, quoted, "docs/performance.md")
    _assert_quoted(page, f"would need {beam['target_needs']:.0%}", "docs/performance.md")


ENDS_ROWS = (
    ("greedy tokens/s", "greedy", "vs_ctranslate2"),
    ("beam-4 tokens/s", "beam4", "vs_ctranslate2"),
    ("greedy, dropping / keeping ended rows", "greedy", "vs_rows_kept"),
    ("beam-4, dropping / keeping ended rows", "beam4", "vs_rows_kept"),
)


def corpus_ends_readme_rows(precisions: dict) -> list[str]:
    """The performance page's table of the corpus whose outputs end at different lengths."""
    return [
        f"| {label} | "
        + " | ".join(f"{precisions[c][case][key]:.2f}×" for c in CORPUS_COLUMNS)
        + " |"
        for label, case, key in ENDS_ROWS
    ]


def test_readme_corpus_ends_ratios_are_the_corpus_ends_benchmark() -> None:
    page = PERFORMANCE.read_text(encoding="utf-8")
    ends = _load("corpus_ends")
    for row in corpus_ends_readme_rows(ends["precisions"]):
        _assert_quoted(page, row, "docs/performance.md")
    s = ends["setting"]
    setting = f"{s['min_new_tokens']} to {s['max_new_tokens']} new tokens"
    _assert_quoted(" ".join(page.split()), setting, "docs/performance.md")
    target = _load("corpus")["precisions"]["float32"]["targets"]["peak_rss"]
    sentence = corpus_ends_memory_sentence(ends["precisions"], target)
    _assert_quoted(" ".join(page.split()), sentence, "docs/performance.md")


CASE_NAMES = {"greedy": "greedy", "beam4": "beam 4"}


def corpus_ends_memory_sentence(precisions: dict, target: float) -> str:
    """The performance page's account of peak memory on the ends corpus: at each side's fastest
    batching,
    within the corpus benchmark's memory target or not, and where not, our fastest batching
    that stays within it."""
    over = []
    for precision in CORPUS_COLUMNS:
        for case, c in precisions[precision].items():
            best = c["best"]
            theirs = best["ctranslate2"]
            ratio = best["ours"]["peak_rss_mb"] / theirs["peak_rss_mb"]
            if ratio <= target:
                continue
            ours = c["settings"]["ours"]
            name = fastest_within(ours, target * theirs["peak_rss_mb"])
            text = f"{precision} {CASE_NAMES[case]} ({ratio:.2f}×, at {best['ours']['batching']}"
            if name is not None:
                speed = ours[name]["tokens_per_s"] / theirs["tokens_per_s"]
                peak = ours[name]["peak_rss_mb"] / theirs["peak_rss_mb"]
                text += f"; at {name} ours runs {speed:.2f}× CTranslate2's speed"
                text += f" at {peak:.2f}× its peak"
            over.append(text + ")")
    if not over:
        return f"each case's peak memory stays within {target}× CTranslate2's here too"
    return (
        f"at each side's fastest batching our peak memory stays within {target}× CTranslate2's "
        f"in every case but {_listed(over)}"
    )
