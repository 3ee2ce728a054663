"""The pipeline() and long-form Whisper benchmark: a quick run writes what its section reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.export

pytest.importorskip("torch")
pytest.importorskip("optimum.onnxruntime", reason="the benchmark needs optimum-onnx")

from benchmarks import bench_pipeline as bench  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_run_writes_the_measures_and_the_sides_agree(tmp_path):
    out = tmp_path / "pipeline.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_pipeline.py", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["environment"]["cpu"]["model"] is not None
    translation = data["translation"]
    assert set(translation["sides"]) == set(bench.TRANSLATION_SIDES)
    for side in translation["sides"].values():
        assert len(side["processes"]) == data["setting"]["rounds"] == 1
        assert side["batch_s"] > 0 and side["memory_after_load_mb"] > 0
        assert len(side["texts"]) == len(side["ids"]) == len(bench.BATCH_LENGTHS)
        # exactly new_tokens after the decoder start token, on every row
        assert {len(row) for row in side["ids"]} == {translation["new_tokens"] + 1}
    for other in ("optimum", "pytorch"):
        assert set(translation["ratios"][f"ours_over_{other}"]) == set(bench.TRANSLATION_MEASURES)
    assert translation["same_ids"] == translation["same_text"] == {"optimum": True, "pytorch": True}
    assert set(translation["targets_met"]) == set(bench.TARGETS["translation"])
    longform = data["longform"]
    assert set(longform["sides"]) == set(bench.LONGFORM_SIDES)
    assert longform["frames"] == bench.QUICK_FRAMES
    assert longform["windows"] > 1 and longform["segments"] > 1
    assert longform["same_ids"] and longform["same_segments"]
    assert longform["ratios"]["ours_over_pytorch"]["call_s"] > 0
    page = "\n".join(bench.markdown(data))
    assert page.startswith("## `pipeline()` and long-form Whisper")
    assert "| time per batch, s |" in page and "| time per call, s |" in page
