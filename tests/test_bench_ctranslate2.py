"""The CTranslate2 benchmark's arithmetic: what it derives from each process and how it compares."""

from __future__ import annotations

import pytest

from benchmarks import bench_ctranslate2 as bench


def _run(load: float, imported: float, rss_import: float, rss_load: float, greedy: float) -> dict:
    return {
        "load_s": load,
        "import_s": imported,
        "rss_before_load_mb": 20.0,
        "rss_after_import_mb": rss_import,
        "rss_after_load_mb": rss_load,
        "cases": {"greedy_b1": {"s": greedy, "tokens": [[5, 0]]}},
    }


def test_load_and_memory_are_split_into_import_and_model():
    ours = bench._medians([_run(1.2, 0.2, 60.0, 150.0, 0.3)])
    theirs = bench._medians([_run(0.3, 0.1, 30.0, 120.0, 0.4)])
    assert ours["load_without_import_s"] == pytest.approx(1.0)
    assert ours["rss_added_by_load_mb"] == pytest.approx(90.0)
    ratios = bench.compare(ours, theirs)["ratios"]
    assert ratios["rss_after_load_mb"] == pytest.approx(1.25)
    assert ratios["rss_added_by_load_mb"] == pytest.approx(1.0)
    assert ratios["load_without_import_s"] == pytest.approx(5.0)
    assert ratios["greedy_b1"] == pytest.approx(0.75)


def test_ratio_ranges_pair_the_rounds():
    ours = [_run(1.0, 0.2, 60, 150, 0.30), _run(1.0, 0.2, 60, 150, 0.36)]
    theirs = [_run(0.3, 0.1, 30, 120, 0.40), _run(0.3, 0.1, 30, 120, 0.30)]
    low, high = bench.ratio_ranges(ours, theirs)["greedy_b1"]
    assert (low, high) == (pytest.approx(0.75), pytest.approx(1.2))
    with pytest.raises(ValueError):  # a round without its counterpart is a bug, not a range
        bench.ratio_ranges(ours, theirs[:1])


def test_results_from_before_the_ranges_and_the_processor_still_render():
    from benchmarks import run_all

    ours = bench._medians([_run(1.2, 0.2, 60.0, 150.0, 0.3)])
    theirs = bench._medians([_run(0.3, 0.1, 30.0, 120.0, 0.4)])
    variant = {"ours": ours, "ctranslate2": theirs, **bench.compare(ours, theirs), "targets": {}}
    data = {
        "model": "tiny",
        "int8_ours": "int8: quantize",
        "setting": {
            "threads": 2,
            "new_tokens": 2,
            "batch1_source_tokens": 2,
            "batch8_source_lengths": [2],
            "statistic": "median",
            "rounds": 1,
        },
        "environment": {"load_average_at_end": [1.0, 1.0, 1.0]},
        "precisions": {"int8": variant},
    }
    page = "\n".join(run_all._ctranslate2_section(data))
    assert "processor: not recorded" in page
    assert "| int8 | greedy_b1 | 0.400 | 0.300 | **0.75x** |  |" in page
