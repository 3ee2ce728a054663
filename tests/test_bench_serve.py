"""The serving benchmark: a quick run end to end over loopback, and the fleet-sizing table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the servers need the serve extra")
pytest.importorskip("ctranslate2", reason="the anchor server needs CTranslate2")
pytest.importorskip("psutil", reason="peak memory is sampled with psutil")

from benchmarks import bench_serve as bench  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_run_answers_every_request_and_batched_answers_equal_alone(tmp_path):
    out = tmp_path / "serve.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_serve.py", "--quick", "--out", str(out)]
        + ["--anchor-check", "record"],  # this machine may be busy; the test checks the pipeline
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads(out.read_text())
    assert set(results["precisions"]) == {"float32", "int8"}
    for precision in results["precisions"].values():
        assert set(precision["sides"]) == set(bench.SERVERS)
        for side, levels in precision["sides"].items():
            run = bench.UNBATCHED_CONCURRENCY if side == "ours_unbatched" else bench.CONCURRENCY
            assert list(levels) == [str(c) for c in run]
            for level, measured in levels.items():
                assert measured["errors"] == 0, measured["first_error"]
                assert measured["requests"] == bench.QUICK_REQUESTS[int(level)]
                assert measured["new_tokens_per_s"] > 0
                assert measured["latency_p50_s"] <= measured["latency_p99_s"]
                assert measured["peak_rss_mb"] > 10
        assert set(precision["ratios"]) == set(bench.TARGETS)
        assert "agrees" in precision["anchor_check"]
    assert results["precisions"]["float32"]["ours_equals_alone"] == 1.0
    sizing = subprocess.run(
        [sys.executable, "benchmarks/bench_serve.py", "--sizing", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        check=True,
    ).stdout
    assert sizing == bench.sizing_table(results)
    section = "\n".join(bench.markdown(results))
    assert "| float32 | ours | 32 |" in section and "| int8 | ctranslate2 | 64 |" in section


def test_sizing_table_rounds_replicas_up_and_leaves_placeholders_without_results():
    measured = {"requests_per_s": 70.0, "latency_p99_s": 0.4, "peak_rss_mb": 512.0}
    results = {"threads": 2, "precisions": {"int8": {"sides": {"ours": {"32": measured}}}}}
    table = bench.sizing_table(results)
    # 1,000 / (70 x 0.7) = 20.4 -> 21 replicas of 2 cores
    assert "| int8 | 70.0 | 400 ms | 512 MB | 21 | 42 |" in table
    empty = bench.sizing_table(None)
    assert empty.count("(not measured)") == 10
    assert "replicas for 1,000/s at 70%" in empty


def test_percentiles_are_taken_from_the_answers():
    values = [float(v) for v in range(1, 101)]
    assert (bench.percentile(values, 50), bench.percentile(values, 99)) == (50.0, 99.0)
    assert bench.percentile([3.0], 99) == 3.0


def test_the_sizing_table_in_the_docs_is_the_one_the_results_give():
    page = (REPO_ROOT / "docs" / "serve.md").read_text(encoding="utf-8")
    start = "<!-- sizing table: python benchmarks/bench_serve.py --sizing -->\n"
    shown = page[page.index(start) + len(start) : page.index("<!-- end of sizing table -->")]
    published = REPO_ROOT / "benchmarks" / "out" / "serve.json"
    results = json.loads(published.read_text("utf-8")) if published.exists() else None
    assert shown == bench.sizing_table(results)
