"""Batch conversion: a small zoo with one broken model, on the process pool, on Ray and in-process.

The first tests need neither torch nor optimum (planning, manifests, the pool's crash handling).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import onnx
import pytest

from onnxmerge._ray_session import ray_session
from onnxmerge.batch import CONVERTED, FAILED, SKIPPED, convert_many, plan
from onnxmerge.batch import _manifest as manifest_module
from onnxmerge.batch._runners import WORKER_DIED, run_pool
from onnxmerge.batch._sources import EXPORT, UNKNOWN, Job, unique_names
from onnxmerge.batch._task import MODEL_FILE, ModelResult, Options, finished
from onnxmerge.cli import ExitCode, main

GOOD = ("marian", "t5", "bart")


# ------------------------------------------------------------------ no torch needed


def test_names_grow_parent_folders_only_where_they_collide(tmp_path):
    folders = [tmp_path / "a" / "onnx", tmp_path / "b" / "onnx", tmp_path / "opus mt/fr-en"]
    assert unique_names(folders) == ["a-onnx", "b-onnx", "fr-en"]


def test_list_file_entries_are_relative_to_the_list(tmp_path):
    (tmp_path / "zoo" / "m1").mkdir(parents=True)
    (tmp_path / "zoo" / "m1" / "encoder_model.onnx").write_bytes(b"x" * 10)
    listing = tmp_path / "zoo" / "models.txt"
    listing.write_text("# the zoo\nm1\n\nmissing  # gone\n")
    jobs = plan([listing])
    found = [(j.name, j.kind, j.input_bytes) for j in jobs]
    assert found == [("m1", EXPORT, 10), ("missing", UNKNOWN, 0)]
    assert jobs[0].memory_bytes > 10


def test_manifest_rejects_changed_truncated_or_foreign_folders(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"abcdef")
    key = {"source": "s", "options": {"web": False}}
    manifest_module.write(tmp_path, key=key, result={})
    assert manifest_module.read_valid(tmp_path, key) is not None
    assert manifest_module.read_valid(tmp_path, dict(key, source="other")) is None
    (tmp_path / "model.onnx").write_bytes(b"abcdeX")  # same size, other bytes
    assert manifest_module.read_valid(tmp_path, key) is None
    (tmp_path / "model.onnx").write_bytes(b"abc")
    assert manifest_module.read_valid(tmp_path, key) is None


def crash_or_pretend(job: Job, out_dir: str, options: Options) -> ModelResult:
    """A pool task: the job named "crash" kills its worker process, the others succeed at once."""
    if job.name == "crash":
        os._exit(70)
    return ModelResult(name=job.name, source=str(job.source), status=CONVERTED)


def test_a_worker_that_dies_fails_its_own_model_only(tmp_path):
    jobs = [Job(name, tmp_path / name, EXPORT, 1, 1) for name in ("a", "crash", "b", "c")]
    results = list(run_pool(jobs, tmp_path, Options(), workers=2, task=crash_or_pretend))
    by_name = {r.name: r for r in results}
    assert sorted(by_name) == ["a", "b", "c", "crash"]
    assert by_name["crash"].status == FAILED and by_name["crash"].error == WORKER_DIED
    assert all(by_name[n].status == CONVERTED for n in "abc")


def test_an_unknown_precision_is_refused_before_any_work(tmp_path):
    from onnxmerge.errors import OnnxMergeError

    with pytest.raises(OnnxMergeError, match="'int3' is not a precision") as refused:
        convert_many([tmp_path], tmp_path / "out", weights="int3")
    assert refused.value.argument == "weights"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("arguments", "argument"),
    [
        ({"runner": "threads"}, "runner"),
        ({"ray_address": "auto"}, "ray_address"),
        ({"search": "sample"}, "search"),
        ({"search": "beam", "num_beams": 1}, "num_beams"),
    ],
)
def test_a_bad_argument_is_refused_before_any_work(tmp_path, arguments, argument):
    from onnxmerge.errors import OnnxMergeError

    with pytest.raises(ValueError) as refused:
        convert_many([tmp_path], tmp_path / "out", **arguments)
    assert isinstance(refused.value, OnnxMergeError) and refused.value.argument == argument
    assert not (tmp_path / "out").exists()


def test_the_old_spellings_still_work_and_warn(tmp_path):
    from onnxmerge.errors import InvalidArgumentError

    with pytest.warns(DeprecationWarning, match="generation"):
        with pytest.raises(InvalidArgumentError, match="sample") as refused:
            convert_many([tmp_path], out=tmp_path / "out", generation="sample")
    assert refused.value.argument == "search"
    with pytest.warns(DeprecationWarning, match="out"):
        assert convert_many([], out=tmp_path / "out", jobs=0) == []
    assert (tmp_path / "out" / "results.jsonl").read_text() == ""


def test_ray_without_ray_installed_names_the_extra(tmp_path, monkeypatch, capsys):
    from onnxmerge.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails, as when absent
    with pytest.raises(MissingDependencyError, match=r"pip install 'onnxmerge\[ray\]'"):
        convert_many([tmp_path], tmp_path / "out", runner="ray")
    with pytest.warns(DeprecationWarning, match="ray"):
        with pytest.raises(MissingDependencyError):
            convert_many([tmp_path], tmp_path / "out", ray="10.0.0.1:6379")
    assert main(["batch", str(tmp_path), "-o", str(tmp_path / "out"), "--ray"]) == 4
    assert "onnxmerge[ray]" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_progress_hears_of_every_model(tmp_path):
    (tmp_path / "empty").mkdir()
    lines: list[str] = []
    [result] = convert_many([tmp_path / "empty"], tmp_path / "out", jobs=0, progress=lines.append)
    assert lines == [f"empty: {result.status} (1/1)"]


# ------------------------------------------------------------------ real conversions


@pytest.fixture
def zoo(tmp_path, tiny_export) -> Path:
    """Three tiny exports and a broken one (a truncated decoder), listed in zoo/models.txt."""
    root = tmp_path / "zoo"
    for arch in GOOD:
        shutil.copytree(tiny_export(arch).onnx_dir, root / arch)
    broken = root / "broken"
    shutil.copytree(tiny_export("marian").onnx_dir, broken)
    decoder = broken / "decoder_model.onnx"
    decoder.write_bytes(decoder.read_bytes()[: decoder.stat().st_size // 2])
    (root / "models.txt").write_text("\n".join([*GOOD, "broken"]) + "\n")
    return root


def _check_first_run(results: list[ModelResult], out: Path, good=GOOD) -> None:
    by_name = {r.name: r for r in results}
    assert sorted(by_name) == sorted([*good, "broken"])
    for name in good:
        r = by_name[name]
        assert r.status == CONVERTED, r.error
        assert r.max_abs_diff is not None and r.max_abs_diff <= 1e-4
        assert (out / name / MODEL_FILE).stat().st_size == r.model_bytes == r.files[MODEL_FILE]
        assert r.model_bytes == pytest.approx(r.ratio_to_export * r.export_bytes)
        assert r.model_bytes < r.export_bytes  # every tensor stored once
        assert {"merge", "verify"} <= set(r.seconds)
    broken = by_name["broken"]
    assert broken.status == FAILED
    assert "decoder_model.onnx" in broken.error
    assert not (out / "broken").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted([*good, "results.jsonl"])
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((d["name"], d["status"]) for d in lines) == sorted(
        (r.name, r.status) for r in results
    )


def _mtimes(out: Path, good=GOOD) -> dict[str, int]:
    return {n: (out / n / MODEL_FILE).stat().st_mtime_ns for n in good}


def _check_rerun(results: list[ModelResult], out: Path, written: dict[str, int]) -> None:
    statuses = {r.name: r.status for r in results}
    assert statuses == {**dict.fromkeys(written, SKIPPED), "broken": FAILED}
    assert all(MODEL_FILE in r.files for r in results if r.status == SKIPPED)
    assert _mtimes(out, written) == written  # nothing was written again


def test_ray_converts_the_zoo_reports_the_broken_model_and_resumes(zoo, tmp_path):
    ray = pytest.importorskip("ray")
    out = tmp_path / "out"
    # Ray started by the conversion: ended after it, the signal handlers as they were (the
    # autouse fixture fails the test otherwise).
    _check_first_run(convert_many([zoo / "models.txt"], out, ray=True), out)
    assert not ray.is_initialized()
    written = _mtimes(out)
    with ray_session(None, num_cpus=2, include_dashboard=False, log_to_driver=False):
        # The process's own session: used, and left running.
        _check_rerun(convert_many([zoo / "models.txt"], out, ray=True), out, written)
        assert ray.is_initialized()


def test_pool_converts_the_zoo_from_the_command_line_and_resumes(zoo, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["batch", str(zoo / "models.txt"), "-o", str(out), "--jobs", "2"])
    assert code == ExitCode.ERROR  # one model failed
    printed = capsys.readouterr().out
    assert "3 converted, 1 failed" in printed or "1 failed, 3 converted" in printed
    lines = (out / "results.jsonl").read_text().splitlines()
    _check_first_run([ModelResult(**json.loads(line)) for line in lines], out)
    written = _mtimes(out)
    _check_rerun(convert_many([zoo / "models.txt"], out, jobs=2), out, written)


def test_checkpoint_folder_is_exported_and_damaged_output_converted_again(
    zoo, tmp_path, tiny_export
):
    pytorch = zoo / "marian-pytorch"
    shutil.copytree(tiny_export("marian").pytorch_dir, pytorch)
    out = tmp_path / "out"
    sources = [pytorch, zoo / "t5"]
    first = {r.name: r for r in convert_many(sources, out, jobs=0)}
    assert first["marian-pytorch"].status == CONVERTED, first["marian-pytorch"].error
    assert "export" in first["marian-pytorch"].seconds
    checkpoint = (pytorch / "model.safetensors").stat().st_size
    assert first["marian-pytorch"].checkpoint_bytes == checkpoint
    assert first["t5"].status == CONVERTED
    model = out / "t5" / MODEL_FILE
    size = model.stat().st_size
    # A run killed mid-way leaves a staging folder and, say, a half-written model.
    (out / ".t5.staging-leftover").mkdir()
    model.write_bytes(model.read_bytes()[: size // 2])
    statuses = {r.name: r.status for r in convert_many(sources, out, jobs=0)}
    assert statuses == {"marian-pytorch": SKIPPED, "t5": CONVERTED}
    assert model.stat().st_size == size
    assert not (out / ".t5.staging-leftover").exists()
    # Other options make other outputs: nothing counts as done then.
    job = plan([zoo / "t5"])[0]
    assert finished(job, out, Options()) is not None
    assert finished(job, out, Options(generation="greedy")) is None


def test_a_model_over_its_memory_fails_with_a_memory_error(zoo, tmp_path):
    job = Job(**{**plan([zoo / "marian"])[0].__dict__, "memory_bytes": 1 << 20})
    (result,) = run_pool([job], tmp_path / "out", Options(), workers=1)
    assert result.status == FAILED
    assert result.error.startswith("out of memory") or result.error == WORKER_DIED
    assert not (tmp_path / "out" / "marian").exists()


def test_generator_and_web_site_are_part_of_the_model_folder(demo_export, tmp_path):
    out = tmp_path / "out"
    (result,) = convert_many([demo_export], out, jobs=0, generation="greedy", web=True)
    assert result.status == CONVERTED, result.error
    folder = out / demo_export.name
    assert {"generator.onnx", "tokenizer.json", "web/index.html", "web/generator.onnx"} <= set(
        result.files
    )
    manifest = json.loads((folder / "manifest.json").read_text())
    page_bytes = (folder / "web" / "index.html").stat().st_size
    assert manifest["files"]["web/index.html"]["bytes"] == page_bytes
    # Without the options the outputs differ, so the folder is converted again, without them.
    (again,) = convert_many([demo_export], out, jobs=0)
    assert again.status == CONVERTED and not (folder / "web").exists()


def test_weights_write_the_quantized_file_and_the_site_reads_it(demo_export, tmp_path):
    from onnxmerge.contract import META_PRECISION

    out = tmp_path / "out"
    (result,) = convert_many([demo_export], out, jobs=0, weights="int8", web=True)
    assert result.status == CONVERTED, result.error
    folder = out / demo_export.name
    assert {"model.onnx", "model_int8.onnx", "web/generator.onnx"} <= set(result.files)
    quantized = onnx.load(folder / "model_int8.onnx", load_external_data=False)
    precision = json.loads({p.key: p.value for p in quantized.metadata_props}[META_PRECISION])
    assert precision == {"encoder": "int8", "decoder": "int8"}
    page_model = (folder / "web" / "generator.onnx").stat().st_size
    assert page_model < (folder / "model.onnx").stat().st_size  # the site serves the int8 weights
