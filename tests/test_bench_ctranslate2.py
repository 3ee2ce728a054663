"""The CTranslate2 benchmark's arithmetic: what it derives from each process and how it compares."""

from __future__ import annotations

import json
from pathlib import Path

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
    ours = bench._summary([_run(1.2, 0.2, 60.0, 150.0, 0.3)])
    theirs = bench._summary([_run(0.3, 0.1, 30.0, 120.0, 0.4)])
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

    ours = bench._summary([_run(1.2, 0.2, 60.0, 150.0, 0.3)])
    theirs = bench._summary([_run(0.3, 0.1, 30.0, 120.0, 0.4)])
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


def test_each_side_is_its_best_process_and_run():
    slow, fast = _run(1.2, 0.2, 60.0, 150.0, 0.3), _run(0.9, 0.2, 62.0, 152.0, 0.5)
    slow["cases"]["greedy_b1"]["times"] = [0.31, 0.30, 0.29]
    fast["cases"]["greedy_b1"]["times"] = [0.52, 0.25, 0.50]
    side = bench._summary([slow, fast])
    assert side["cases"]["greedy_b1"]["s"] == pytest.approx(0.25)  # noise only adds time
    assert side["load_s"] == pytest.approx(0.9)
    assert side["rss_after_load_mb"] == pytest.approx(151.0)  # memory: the median process


# -- the anchor's reference check ---------------------------------------------------------------


def test_check_allows_the_machines_spread_and_no_more():
    from benchmarks import _anchor

    same = _anchor.check([[0.100, 0.104, 0.101]], [[0.102, 0.101, 0.106]])
    assert same["agrees"] and same["ratio"] == pytest.approx(0.100 / 0.101)
    # the published run's int8 greedy: CTranslate2 2.8x its plain time, in steady processes
    slowed = _anchor.check([[0.278, 0.282, 0.285], [0.293, 0.293, 0.316]], [[0.101, 0.104, 0.11]])
    assert not slowed["agrees"] and slowed["ratio"] == pytest.approx(2.75, rel=0.01)
    assert slowed["threshold"] == pytest.approx(0.15 + slowed["spread"])
    # faster than the plain one-liner is as wrong: the anchor did not run as its users run it
    assert not _anchor.check([[0.05, 0.05]], [[0.10, 0.10]])["agrees"]
    # a noisy machine widens what is allowed by what it measures
    assert _anchor.check([[0.13, 0.2]], [[0.10, 0.16]])["agrees"]
    reason = _anchor.refusal({"int8": slowed, "float32": same})
    assert reason.startswith("the anchor side ran unlike its plain reference")
    assert "int8: the anchor took 2.75x the reference's time" in reason
    assert "float32" not in reason
    assert _anchor.refusal({"float32": same}) is None


def test_a_busy_machine_is_refused_even_where_the_reference_agrees():
    from benchmarks import _anchor

    use = {"other_cores": 0.9, "max_other_cores": _anchor.MAX_OTHER_CORES}
    reason = _anchor.refusal({}, use)
    assert "other processes used 0.90 cores on average" in reason
    assert _anchor.refusal({}, {**use, "other_cores": 0.01}) is None
    record = _anchor.MachineUse().record()
    assert record["other_cores"] >= 0 and record["processors"]


def test_a_refused_run_keeps_the_figures_it_would_replace(tmp_path, capsys):
    from benchmarks import _anchor

    out = tmp_path / "ctranslate2.json"
    out.write_text('{"published": true}')
    checks = {"int8": _anchor.check([[0.3, 0.3]], [[0.1, 0.1]])}
    quiet = _anchor.MachineUse()
    assert _anchor.finish(out, {"benchmark": "x"}, checks, quiet, "refuse") == 3
    assert json.loads(out.read_text()) == {"published": True}
    refused = json.loads((tmp_path / "ctranslate2.refused.json").read_text())
    assert "the anchor side ran unlike its plain reference" in refused["refused"]
    assert refused["reference_checks"]["int8"]["ratio"] == pytest.approx(3.0)
    assert "machine_use" in refused
    assert "refused to write" in capsys.readouterr().err
    # recorded: written, with the reason beside the figures
    assert _anchor.finish(out, {"benchmark": "x"}, checks, quiet, "record") == 0
    written = json.loads(out.read_text())
    assert written["anchor_check"]["mode"] == "record"
    assert "int8: the anchor took 3.00x" in written["anchor_check"]["failed"]


def test_the_reference_runs_with_a_clean_environment(monkeypatch):
    from benchmarks import _anchor

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("KMP_AFFINITY", "compact")
    monkeypatch.setenv("ONNXMERGE_SECRET", "x")
    threading = _anchor.threading_environment()
    assert threading["KMP_AFFINITY"] == "compact" and threading["OMP_NUM_THREADS"] == "1"
    assert "ONNXMERGE_SECRET" not in threading
    assert set(_anchor.clean_environment()) <= set(_anchor.CLEAN_VARIABLES)
    assert "OMP_NUM_THREADS" in _common_environment()["threading_environment"]


def _common_environment() -> dict:
    from benchmarks import _common

    return _common.environment((0.0, 0.0, 0.0))


@pytest.fixture(scope="module")
def tiny_ctranslate2(tmp_path_factory) -> tuple[Path, dict]:
    """The tiny Marian converted by the benchmark's converter, and its config ids."""
    pytest.importorskip("ctranslate2")
    pytest.importorskip("transformers")
    from benchmarks import _common

    folder = tmp_path_factory.mktemp("tiny-ct2")
    config = _common.tiny_marian_config()
    _common.build_pytorch(config, folder / "pytorch")
    ids = {k: int(getattr(config, k)) for k in ("vocab_size", "pad_token_id", "eos_token_id")}
    (folder / "scratch").mkdir()
    return bench.convert_ctranslate2(folder / "pytorch", folder / "scratch", ids)["int8"], ids


def _anchor_against_reference(path: Path, config: dict, rounds: int, repeats: int) -> dict:
    """Rounds of a worker of the benchmark and a plain reference beside it: the int8 check."""
    workers, references = [], []
    for _ in range(rounds):  # alternated, as the benchmark does
        workers.append(bench.worker_process("ctranslate2", path, config, repeats, 2, None))
        references.append(bench.reference_run(path, config, repeats, 2))
    return bench.reference_checks({"int8": workers}, {"int8": references})


@pytest.mark.export
def test_the_benchmarks_ctranslate2_worker_agrees_with_the_plain_one_liner(tiny_ctranslate2):
    from benchmarks import _anchor

    # rounds of processes, so that a process that ran while the machine was busy shows as spread
    checks = _anchor_against_reference(*tiny_ctranslate2, rounds=3, repeats=10)
    assert _anchor.refusal(checks) is None, checks["int8"]
    assert checks["int8"]["reference_runs"][0]["environment"] == sorted(_anchor.clean_environment())


@pytest.mark.export
def test_a_slowed_ctranslate2_worker_is_refused(tiny_ctranslate2, monkeypatch):
    from benchmarks import _anchor

    monkeypatch.setenv(_anchor.SLOWDOWN_VARIABLE, "10")  # the worker inherits it, not the reference
    checks = _anchor_against_reference(*tiny_ctranslate2, rounds=1, repeats=5)
    assert checks["int8"]["ratio"] > 3
    assert "int8: the anchor took" in _anchor.refusal(checks)


# -- README figures beside a machine's -------------------------------------------------------------


def test_check_sets_each_readme_figure_beside_the_measured_one(tmp_path, capsys):
    from benchmarks import run_all

    readme = tmp_path / "README.md"
    readme.write_text(
        "Against CTranslate2:\n\n"
        "| | float32 | float32, external data | float32, session cache | float32, by path | int8 "
        "| int8, external data | int8, session cache | int8, by path |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        "| greedy time | 0.57× | 0.54× | 0.36× | 0.55× | 0.31× | 0.33× | 0.32× | 0.30× |\n"
        "| beam-4 time | 0.40× | 0.41× | 0.39× | 0.40× | 0.22× | 0.24× | 0.22× | 0.22× |\n"
        "| memory after load | 1.27× | 0.98× | 1.06× | 1.27× | 1.29× | 1.11× | 1.10× | 1.29× |\n"
        "| memory import and load add | 1.3× | 1.0× | 1.1× | 1.3× | 1.4× | 1.1× | 1.1× | 1.4× |\n"
        "| memory the model adds | 1.3× | 0.94× | 1.04× | 1.3× | 1.45× | 1.09× | 1.06× | 1.45× |\n"
        "| load time | 2.50× | 1.42× | 1.54× | 2.50× | 3.40× | 2.89× | 1.64× | 3.40× |\n\n"
        "A corpus whose outputs end:\n\n| | float32 | int8 |\n|---|---:|---:|\n"
        "| greedy tokens/s | 0.96× | 1.25× |\n| beam-4 tokens/s | 1.03× | 1.27× |\n"
        "| greedy, dropping / keeping ended rows | 1.86× | 2.36× |\n"
        "| beam-4, dropping / keeping ended rows | 1.84× | 2.06× |\n",
        encoding="utf-8",
    )
    measured = tmp_path / "measured"
    measured.mkdir()
    from benchmarks.readme_figures import CTRANSLATE2

    keys = [key for _, key in CTRANSLATE2.rows]
    precisions = {c: {"ratios": dict.fromkeys(keys, 1.0)} for c in CTRANSLATE2.columns}
    precisions["int8"]["ratios"]["greedy_b1"] = 0.80  # what a plain CTranslate2 makes of it
    precisions["float32"]["ratios"]["greedy_b1"] = 0.60  # within 15% of 0.57
    (measured / "ctranslate2.json").write_text(json.dumps({"precisions": precisions}))
    assert run_all.main(["--check", str(readme), "--measured", str(measured)]) == 1
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| figure | README.md | measured | within 15% |"
    assert "| ctranslate2: greedy time, int8 | 0.31× | 0.80× | **no** |" in table
    assert "| ctranslate2: greedy time, float32 | 0.57× | 0.60× | yes |" in table
    assert "| ctranslate2: load time, int8 | 3.40× | 1.00× | **no** |" in table
    # the ends corpus was not measured here: each of its figures says so
    assert (
        "| corpus_ends: beam-4, dropping / keeping ended rows, int8 | 2.06× | - | not measured |"
        in table
    )
    assert len(table) == 2 + 48 + 8
    # a refused run's figures are shown as such, and never agree
    refused = {"precisions": precisions, "refused": "the machine was not quiet"}
    (measured / "ctranslate2.json").unlink()
    (measured / "ctranslate2.refused.json").write_text(json.dumps(refused))
    assert run_all.main(["--check", str(readme), "--measured", str(measured)]) == 1
    table = capsys.readouterr().out.splitlines()
    assert "| ctranslate2: greedy time, float32 | 0.57× | 0.60× | yes (refused run) |" in table


def test_check_agrees_with_the_results_the_page_was_written_from(capsys):
    from benchmarks import run_all

    out = Path(__file__).resolve().parents[1] / "benchmarks" / "out"
    page = out.parents[1] / "docs" / "performance.md"
    if not all((out / f"{n}.json").exists() for n in ("ctranslate2", "corpus", "corpus_ends")):
        pytest.skip("benchmarks/out lacks the results the performance page quotes")
    assert run_all.main(["--check", str(page), "--measured", str(out)]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert len(rows) == 66 and all(row.endswith("| yes |") for row in rows)
