"""The benchmark entry point in its tiny mode: the scripts behind docs/benchmarks.md still run."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest


def _installed(*distributions: str) -> bool:
    """Looked up, not imported: the tiers that leave this test out collect without torch."""
    try:
        return all(metadata.version(name) for name in distributions)
    except metadata.PackageNotFoundError:
        return False


# It also writes the benchmarks page, so it is a docs test too.
pytestmark = [
    pytest.mark.export,
    pytest.mark.docs,
    pytest.mark.skipif(
        not _installed("optimum-onnx", "matplotlib"),
        reason="the benchmarks need the bench extra (optimum-onnx, matplotlib)",
    ),
]

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_run_all_quick_writes_results_and_docs(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "run_all.py"),
            "--quick",
            "--jobs",
            "2",
            "--out",
            str(tmp_path / "out"),
            "--docs",
            str(tmp_path / "docs"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    for name in (
        "merge",
        "sizes",
        "generate",
        "generator",
        "batch",
        "ctranslate2",
        "threads",
        "quantize",
        "corpus",
        "corpus_ends",
        "pipeline",
    ):
        assert json.loads((tmp_path / "out" / f"{name}.json").read_text())
    merge = json.loads((tmp_path / "out" / "merge.json").read_text())
    for variant in merge["variants"].values():
        assert variant["ort_check"]["ok"]
        layouts = variant["layouts"]
        merged_bytes = layouts["encoder+decoder_model_merged"]["bytes"]
        assert layouts["onnxmerge model.onnx"]["bytes"] < merged_bytes
    generate = json.loads((tmp_path / "out" / "generate.json").read_text())
    assert all(generate["same_tokens"].values())
    web = json.loads((tmp_path / "out" / "web.json").read_text())
    assert "skipped" in web or all(m["same_tokens"] for m in web["models"])
    whisper = json.loads((tmp_path / "out" / "whisper.json").read_text())
    assert whisper["python"]["tokens_equal"] and whisper["python"]["features_max_abs_diff"] < 1e-4
    assert "skipped" in whisper["browser"] or whisper["browser"]["tokens_equal_python"]
    side = web.get("side_by_side", {"skipped": "not run"})
    for m in side.get("models", []):  # transformers.js installed in benchmarks/web
        for page in m["sides"]:
            assert page["same_tokens_to_eos"], (page["side"], page["precision"])
            assert page["same_tokens"] or page["side"] == "transformers.js"
    batch = json.loads((tmp_path / "out" / "batch.json").read_text())
    assert all(m["converted"] == m["models"] for m in batch["modes"].values())
    page = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert "## Bytes on disk" in page and "## Generation" in page and "## Converting a zoo" in page
    ctranslate2 = json.loads((tmp_path / "out" / "ctranslate2.json").read_text())
    for precision in ("float32", "int8"):
        assert ctranslate2["precisions"][precision]["token_agreement"]["greedy_b1"] > 0.5
    # The file optimized for onnxruntime and the external-data layout generate what the plain
    # file does.
    variants = ctranslate2["precisions"]
    for case in ("greedy_b1", "beam4_b1"):
        for plain, other in (
            ("float32", "float32 optimized"),
            ("float32", "float32 external data"),
            ("int8", "int8 external data"),
            ("float32", "float32 session cache"),
            ("int8", "int8 session cache"),
        ):
            tokens = variants[plain]["ours"]["cases"][case]["tokens"]
            assert variants[other]["ours"]["cases"][case]["tokens"] == tokens
    # CTranslate2 beside its plain one-liner, recorded (not refused: the run shares the machine)
    assert ctranslate2["anchor_check"]["mode"] == "record"
    for precision in ("float32", "int8"):
        check = ctranslate2["reference_checks"][precision]
        assert check["anchor_s"] > 0 and check["reference_s"] > 0
        clean = {"HOME", "LANG", "LC_ALL", "PATH", "TMPDIR"}
        assert set(check["reference_runs"][0]["environment"]) <= clean
    assert "affinity" in ctranslate2["environment"]
    assert "other_cores" in ctranslate2["machine_use"]
    for variant in variants.values():  # one round in the quick run: each range is its ratio
        for measure, (low, high) in variant["ratio_ranges"].items():
            assert low == pytest.approx(variant["ratios"][measure]) == high
    corpus = json.loads((tmp_path / "out" / "corpus.json").read_text())
    for precision in ("float32", "int8"):
        for case in ("greedy", "beam4"):
            ours = corpus["precisions"][precision]["ours"]["cases"][case]
            assert ours["tokens_per_s"] > 0
            assert ours["batching"].split()[0] in ("examples", "tokens")
            # one batch at a time and two at once, on both sides
            for side in ("ours", "ctranslate2"):
                tried = corpus["precisions"][precision][side]["cases"][case]["settings"]
                assert set(tried) == {"examples 16", "tokens 1024 x2"}
            assert corpus["precisions"][precision]["token_agreement"][case] > 0.5
        # float32 rows in a padded batch get the tokens they get alone
        assert corpus["precisions"]["float32"]["ours"]["cases"]["greedy"]["same_as_alone"] == 1.0
    for case, row in corpus["row_scales"]["cases"].items():
        assert row["batching"] == corpus["precisions"]["int8"]["ours"]["cases"][case]["batching"]
        assert row["tokens_per_s"] > 0 and row["per_batch_tokens_per_s"] > 0
    # one scale per row: int8 rows get the tokens they get alone, as float32 ones do
    assert corpus["row_scales"]["cases"]["greedy"]["same_as_alone"] == 1.0
    # each CTranslate2 corpus worker's probe, beside a plain reference, by threads per translator
    assert set(corpus["reference_checks"]) == {
        f"{p}, intra_threads={n}" for p in ("float32", "int8") for n in (1, 2)
    }
    assert corpus["anchor_check"]["mode"] == "record"
    ends = json.loads((tmp_path / "out" / "corpus_ends.json").read_text())
    assert set(ends["reference_checks"]) == {"float32, intra_threads=1", "int8, intra_threads=1"}
    assert "## A corpus against CTranslate2" in page
    threads = json.loads((tmp_path / "out" / "threads.json").read_text())
    assert all(row["same_tokens_as_serial"] for row in threads["throughput"])
    assert "## Generation against CTranslate2" in page
    quantize = json.loads((tmp_path / "out" / "quantize.json").read_text())
    sizes = quantize["sizes"]
    assert sizes["onnxmerge int4"] < sizes["onnxmerge int8"] < sizes["onnxmerge fp32"]
    assert quantize["demo_quality"]["rows"]["int8"]["same_as_fp32"] >= 0.9
    assert "## Quantized" in page
    assert "## `pipeline()` and long-form Whisper" in page
    assert (tmp_path / "docs" / "img" / "sizes.png").stat().st_size > 1000
