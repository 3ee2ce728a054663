"""The ``onnxmerge`` command run as a user runs it, in its own process: exit codes and output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import onnxmerge
from onnxmerge import cli
from onnxmerge.demo import DEMO_SENTENCES, english_number, french_number

pytest.importorskip("onnxruntime")

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_ERROR, EXIT_MISSING = 0, 1, 2, 3, 4
ERROR_PREFIX = "onnxmerge: error: "
SOURCE_IDS = ["5", "17", "42", "9", "2"]  # ordinary tokens of the tiny Marian, then its eos


def run(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onnxmerge", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int, *fragments: str):
    """Exit ``code``, no traceback, and exactly one error line that holds every fragment."""
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith(ERROR_PREFIX)]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0]


def copy_export(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def marian(tiny_export):
    """The cached tiny Marian export; never written to (merges go to copies)."""
    return tiny_export("marian")


@pytest.fixture(scope="module")
def merged(marian, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A copy of the tiny Marian export merged by ``onnxmerge merge``, with that run's result."""
    folder = copy_export(marian.onnx_dir, tmp_path_factory.mktemp("merged") / "export")
    return folder, run("merge", folder)


@pytest.fixture(scope="module")
def merged_model(merged) -> Path:
    folder, result = merged
    assert result.returncode == EXIT_OK, result.stderr
    return folder / "model.onnx"


@pytest.fixture(scope="module")
def tampered_model(merged_model, tmp_path_factory) -> Path:
    """The merged model with its largest tensor (the shared embedding) shifted by 0.5."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(os.fspath(merged_model))
    largest = max(model.graph.initializer, key=lambda t: numpy_helper.to_array(t).size)
    shifted = numpy_helper.to_array(largest) + np.float32(0.5)
    largest.CopyFrom(numpy_helper.from_array(shifted.astype(np.float32), largest.name))
    path = tmp_path_factory.mktemp("tampered") / "model.onnx"
    onnx.save(model, os.fspath(path))
    return path


@pytest.fixture(scope="module")
def demo_model(demo_export, tmp_path_factory) -> Path:
    from onnxmerge import merge_seq2seq

    folder = copy_export(demo_export, tmp_path_factory.mktemp("demo") / "export")
    return merge_seq2seq(folder)


# ---------------------------------------------------------------------------------------------
# merge


def test_merge_prints_the_files_read_and_written_with_their_sizes(merged) -> None:
    folder, result = merged
    assert result.returncode == EXIT_OK, result.stderr
    out = result.stdout
    assert out.splitlines()[0].split() == ["file", "role", "size"]
    for name, role in (
        ("encoder_model.onnx", "encoder"),
        ("decoder_model.onnx", "decoder"),
        ("decoder_with_past_model.onnx", "decoder_with_past"),
    ):
        size = cli.human((folder / name).stat().st_size)
        assert f"{name}" in out and f"{role}" in out and size in out
    merged_line = next(line for line in out.splitlines() if line.startswith("model.onnx"))
    assert merged_line.split()[1] == "merged"
    assert merged_line.endswith(cli.human((folder / "model.onnx").stat().st_size))
    assert f"wrote {folder / 'model.onnx'}" in out
    assert "saved " in out
    assert "loading ..." in result.stderr  # progress goes to stderr, not into the table


def test_merge_json_reports_the_byte_counts_of_the_files(marian, tmp_path) -> None:
    folder = copy_export(marian.onnx_dir, tmp_path / "export")
    result = run("merge", folder, "--json")
    assert result.returncode == EXIT_OK, result.stderr
    report = json.loads(result.stdout)  # stdout is the JSON document and nothing else
    output = folder / "model.onnx"
    assert Path(report["path"]) == output
    assert report["layout"] == "with_past"
    assert report["output_bytes"] == output.stat().st_size
    assert {Path(f["path"]).name: f["role"] for f in report["inputs"]} == {
        "encoder_model.onnx": "encoder",
        "decoder_model.onnx": "decoder",
        "decoder_with_past_model.onnx": "decoder_with_past",
    }
    for f in report["inputs"]:
        assert f["bytes"] == Path(f["path"]).stat().st_size
    assert report["input_bytes"] == sum(f["bytes"] for f in report["inputs"])
    assert report["bytes_saved"] == report["input_bytes"] - report["output_bytes"] > 0
    assert report["tensors_out"] < report["tensors_in"]
    assert report["shared"]
    assert {"kept", "removed", "nbytes", "transposed"} <= set(report["shared"][0])
    assert result.stderr == ""  # no progress lines in JSON mode


def test_merge_refuses_to_replace_its_output_without_overwrite(merged_model) -> None:
    before = merged_model.read_bytes()
    refused = run("merge", merged_model.parent)
    assert_one_line_error(refused, EXIT_ERROR, str(merged_model), "--overwrite")
    assert refused.stdout == ""
    assert merged_model.read_bytes() == before
    replaced = run("merge", merged_model.parent, "--overwrite")
    assert replaced.returncode == EXIT_OK, replaced.stderr
    assert merged_model.read_bytes() == before  # merging is deterministic


def test_merge_refuses_an_earlier_merged_model_as_input(merged_model) -> None:
    second = merged_model.with_name("second.onnx")
    result = run("merge", merged_model.parent, "-o", second)
    assert_one_line_error(result, EXIT_ERROR, str(merged_model), "already a merged model")
    assert not second.exists()


def test_merge_refuses_a_missing_folder(tmp_path) -> None:
    result = run("merge", tmp_path / "absent")
    assert_one_line_error(result, EXIT_ERROR, str(tmp_path / "absent"), "not a folder")


def test_merge_refuses_a_folder_without_onnx_files(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    result = run("merge", tmp_path)
    assert_one_line_error(result, EXIT_ERROR, "no .onnx file", "optimum-cli export onnx")


def test_merge_external_data_writes_the_weights_beside_the_model(marian, tmp_path) -> None:
    folder = copy_export(marian.onnx_dir, tmp_path / "export")
    output = tmp_path / "out" / "model.onnx"
    result = run("merge", folder, "-o", output, "--external-data", "--json")
    assert result.returncode == EXIT_OK, result.stderr
    data = output.with_name("model.onnx_data")
    assert data.is_file() and data.stat().st_size > 0
    assert json.loads(result.stdout)["output_bytes"] == output.stat().st_size + data.stat().st_size
    verified = run("verify", output, "--against", folder)
    assert verified.returncode == EXIT_OK, verified.stdout + verified.stderr


def test_quantize_external_data_writes_the_weights_beside_the_output(tmp_path) -> None:
    from onnxmerge import merge_seq2seq
    from tests import textmodels as tm

    source = merge_seq2seq(tm.write_export(tmp_path / "export"))
    output = tmp_path / "q" / "model_int8.onnx"
    result = run("quantize", source, "-o", output, "--weights", "int8", "--external-data", "--json")
    assert result.returncode == EXIT_OK, result.stderr
    data = output.with_name("model_int8.onnx_data")
    assert data.is_file() and data.stat().st_size > 0
    assert json.loads(result.stdout)["bytes_after"] == output.stat().st_size + data.stat().st_size


def test_quantize_with_row_activation_scales(tmp_path) -> None:
    import onnx

    from onnxmerge import merge_seq2seq
    from onnxmerge._proto import graph_protos
    from tests import textmodels as tm

    source = merge_seq2seq(tm.write_export(tmp_path / "export"))
    output = tmp_path / "model_int8.onnx"
    result = run("quantize", source, "-o", output, "--weights", "int8", "--activation-scale", "row")
    assert result.returncode == EXIT_OK, result.stderr
    model = onnx.load(output, load_external_data=False)
    ops = {n.op_type for g in graph_protos(model.graph) for n in g.node}
    assert {"MatMulInteger", "ReduceMax", "Round"} <= ops and "DynamicQuantizeLinear" not in ops

    refused = run("quantize", source, "-o", tmp_path / "fp16.onnx", "--weights", "fp16",
                  "--activation-scale", "row")  # fmt: skip
    assert refused.returncode == EXIT_ERROR
    assert "applies to the products of int8 and uint8 weights" in refused.stderr
    assert not (tmp_path / "fp16.onnx").exists()


def test_merge_with_generation_writes_the_loop_model(marian, tmp_path) -> None:
    import onnx

    folder = copy_export(marian.onnx_dir, tmp_path / "export")
    result = run("merge", folder, "--generation", "greedy", "--json")
    assert result.returncode == EXIT_OK, result.stderr
    report = json.loads(result.stdout)
    generator = Path(report["generator"]["path"])
    assert generator == folder / "generator.onnx" and generator.exists()
    model = onnx.load(generator, load_external_data=False)
    assert [o.name for o in model.graph.output][0] == "sequences"
    assert {op.domain for op in model.opset_import} <= {"", "ai.onnx"}


def test_merge_with_generation_checks_both_outputs_before_writing(marian, tmp_path) -> None:
    # Once, model.onnx was written and only then the existing generator.onnx refused.
    folder = copy_export(marian.onnx_dir, tmp_path / "export")
    (folder / "generator.onnx").write_bytes(b"an earlier generator")
    result = run("merge", folder, "--generation", "greedy")
    assert_one_line_error(result, EXIT_ERROR, str(folder / "generator.onnx"), "--overwrite")
    assert not (folder / "model.onnx").exists()
    assert (folder / "generator.onnx").read_bytes() == b"an earlier generator"


@pytest.mark.parametrize(
    "options",
    [["--num-beams", "3"], ["--generation", "greedy", "--num-beams", "3"],
     ["--generation", "beam", "--num-beams", "1"]],
)  # fmt: skip
def test_merge_num_beams_needs_beam_generation(tmp_path, options) -> None:
    # A usage error (2) comes before the missing folder is noticed (3).
    result = run("merge", tmp_path / "absent", *options)
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "--num-beams" in result.stderr


@pytest.mark.parametrize("options", [["--encoder", "fp32"], ["--activation-scale", "row"]])
def test_merge_quantization_options_need_weights(tmp_path, options) -> None:
    result = run("merge", tmp_path / "absent", *options)
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "apply only with --weights" in result.stderr


# ---------------------------------------------------------------------------------------------
# verify


def test_verify_compares_both_steps_and_says_ok(merged_model) -> None:
    result = run("verify", merged_model)
    assert result.returncode == EXIT_OK, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["step", "output", "shape", "max", "|diff|"]
    steps = {(line.split()[0], line.split()[1]) for line in lines[2:] if line.strip()}
    assert {
        ("first", "logits"),
        ("cached", "logits"),
        ("first", "present.1.encoder.value"),
        ("cached", "present.1.decoder.value"),
    } <= steps
    assert lines[-1].startswith("OK: max |diff| ")
    assert lines[-1].endswith(f"against {merged_model.parent}")


def test_verify_json_lists_every_output_diff(merged_model) -> None:
    result = run("verify", merged_model, "--json")
    assert result.returncode == EXIT_OK, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert report["tolerance"] == 1e-4
    assert 0 <= report["max_abs_diff"] <= 1e-4
    # 2 layers: logits + 8 present tensors on the first step, logits + 4 decoder ones cached.
    assert len(report["diffs"]) == 9 + 5
    assert {"step", "name", "shape", "max_abs_diff", "reference_peak"} == set(report["diffs"][0])
    assert report["relative"] is False  # a float32 file: the tolerance is absolute


def test_verify_finds_a_tampered_tensor_and_exits_1(tampered_model, marian) -> None:
    result = run("verify", tampered_model, "--against", marian.onnx_dir)
    assert result.returncode == EXIT_MISMATCH, result.stderr
    assert result.stdout.splitlines()[-1].startswith("MISMATCH: max |diff| ")
    as_json = run("verify", tampered_model, "--against", marian.onnx_dir, "--json")
    report = json.loads(as_json.stdout)
    assert report["ok"] is False and report["max_abs_diff"] > 1e-2


def test_verify_a_copy_against_a_folder_that_holds_a_merged_model(merged_model, tmp_path) -> None:
    copy = tmp_path / "copy.onnx"
    shutil.copy2(merged_model, copy)
    result = run("verify", copy, "--against", merged_model.parent)
    assert result.returncode == EXIT_OK, result.stderr


def test_verify_away_from_the_export_folder_needs_against(tampered_model) -> None:
    result = run("verify", tampered_model)
    assert_one_line_error(result, EXIT_ERROR, "encoder_model.onnx", "--against")


def test_verify_refuses_a_model_onnxmerge_did_not_write(marian) -> None:
    result = run("verify", marian.onnx_dir / "encoder_model.onnx")
    assert_one_line_error(result, EXIT_ERROR, "not a merged model", "onnxmerge merge DIR")


# ---------------------------------------------------------------------------------------------
# inspect


def test_inspect_shows_the_contract_metadata_and_sizes(merged_model) -> None:
    result = run("inspect", merged_model)
    assert result.returncode == EXIT_OK, result.stderr
    out = result.stdout
    assert out.splitlines()[0].startswith(f"{merged_model}: merged seq2seq model, ")
    rows = {tuple(line.split()[:2]) for line in out.splitlines() if line.strip()}
    for row in (
        ("input", "input_ids"),
        ("input", "attention_mask"),
        ("input", "decoder_input_ids"),
        ("input", "past_key_values.0.encoder.key"),
        ("input", "use_cache_branch"),
        ("output", "logits"),
        ("output", "present.0.decoder.value"),
        ("onnxmerge.format_version", "4"),
        ("onnxmerge.layout", "with_past"),
    ):
        assert row in rows, row
    assert "past_key_values.1.decoder.key" not in out  # later layers fold into one line
    assert "more cache tensors (--all shows them)" in out
    parts = {row[0] for row in rows}
    assert {"embedding", "encoder", "decoder", "head"} <= parts


def test_inspect_all_lists_every_cache_tensor(merged_model) -> None:
    out = run("inspect", merged_model, "--all").stdout
    assert "past_key_values.1.decoder.key" in out and "present.1.encoder.value" in out
    assert "--all shows them" not in out


def test_inspect_json_matches_the_file(merged_model) -> None:
    import onnx
    from onnx import numpy_helper

    result = run("inspect", merged_model, "--json")
    assert result.returncode == EXIT_OK, result.stderr
    found = json.loads(result.stdout)
    model = onnx.load(os.fspath(merged_model))
    assert [i["name"] for i in found["inputs"]] == [i.name for i in model.graph.input]
    assert [o["name"] for o in found["outputs"]] == [o.name for o in model.graph.output]
    assert found["file_bytes"] == merged_model.stat().st_size
    assert found["initializers"] == len(model.graph.initializer)
    assert sum(found["bytes_by_part"].values()) == sum(
        numpy_helper.to_array(t).nbytes for t in model.graph.initializer
    )
    assert found["metadata"]["onnxmerge.format_version"] == "4"
    encoder_inputs = json.loads(found["metadata"]["onnxmerge.encoder_inputs"])
    assert encoder_inputs == ["input_ids", "attention_mask"]
    assert {"name", "type", "shape"} == set(found["inputs"][0])


def test_inspect_refuses_a_file_that_is_not_onnx(marian) -> None:
    result = run("inspect", marian.onnx_dir / "config.json")
    assert_one_line_error(result, EXIT_ERROR, "config.json")


# ---------------------------------------------------------------------------------------------
# generate


def test_generate_ids_gives_the_runtime_tokens(merged_model) -> None:
    from onnxmerge.runtime import Seq2SeqModel

    ids = np.array([[int(i) for i in SOURCE_IDS]], dtype=np.int64)
    expected = (
        Seq2SeqModel(merged_model)
        .generate(input_ids=ids, attention_mask=np.ones_like(ids), max_new_tokens=6)
        .tolist()
    )
    text = run("generate", merged_model, "--ids", *SOURCE_IDS, "--max-new-tokens", "6")
    assert text.returncode == EXIT_OK, text.stderr
    assert [[int(t) for t in line.split()] for line in text.stdout.splitlines()] == expected
    as_json = run("generate", merged_model, "--ids", *SOURCE_IDS, "--max-new-tokens", "6", "--json")
    assert json.loads(as_json.stdout) == {"sequences": expected}
    assert len(expected[0]) <= 1 + 6


def test_generate_with_a_session_cache_gives_the_same_tokens(merged_model, tmp_path) -> None:
    args = ("generate", merged_model, "--ids", *SOURCE_IDS, "--max-new-tokens", "6")
    plain = run(*args)
    cache = tmp_path / "cache"
    entries = []
    for _ in range(2):  # writes the entry, then reads it
        cached = run(*args, "--session-cache", cache)
        assert cached.returncode == EXIT_OK, cached.stderr
        assert cached.stdout == plain.stdout
        entries += [(p.name, p.stat().st_ino) for p in cache.iterdir()]
    assert len(entries) == 2 and entries[0] == entries[1]  # read, not written again


def test_generate_threads_caps_onnxruntimes_pool(merged_model, monkeypatch, capsys) -> None:
    from onnxmerge import runtime

    opened = []

    class Noted(runtime.Seq2SeqModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            opened.append(self.session.get_session_options().intra_op_num_threads)

    monkeypatch.setattr(runtime, "Seq2SeqModel", Noted)
    args = ["generate", str(merged_model), "--ids", *SOURCE_IDS, "--max-new-tokens", "6"]
    assert cli.main(args) == EXIT_OK
    default = capsys.readouterr().out
    assert cli.main([*args, "--threads", "1"]) == EXIT_OK
    assert capsys.readouterr().out == default
    assert opened == [0, 1]
    refused = run(*args, "--threads", "0")
    assert refused.returncode == EXIT_USAGE and "--threads" in refused.stderr


def test_generate_refuses_ids_outside_the_vocabulary(merged_model) -> None:
    result = run("generate", merged_model, "--ids", "100000", "2")
    assert_one_line_error(result, EXIT_ERROR, "100000")


def test_generate_text_without_a_tokenizer_says_so(merged_model) -> None:
    result = run("generate", merged_model, "--text", "bonjour")
    assert_one_line_error(result, EXIT_ERROR, "tokenizer")


def test_generate_refuses_max_new_tokens_0_in_its_own_terms(merged_model) -> None:
    result = run("generate", merged_model, "--ids", *SOURCE_IDS, "--max-new-tokens", "0")
    assert result.returncode == EXIT_USAGE
    assert "--max-new-tokens" in result.stderr and "max_length" not in result.stderr


def test_generate_and_verify_say_what_a_generator_model_is(tmp_path) -> None:
    import onnx
    from onnx import TensorProto, helper

    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "length"])
    out = helper.make_tensor_value_info("sequences", TensorProto.INT64, ["batch", "length"])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["input_ids"], ["sequences"])], "g", [ids], [out]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    helper.set_model_props(model, {"onnxmerge.generator": '{"version": "1"}'})
    path = tmp_path / "generator.onnx"
    onnx.save(model, path)
    for command in (["generate", path, "--ids", "5", "0"], ["verify", path]):
        result = run(*command)
        assert_one_line_error(result, EXIT_ERROR, str(path), "a generator model", "session.run")


def test_generate_needs_ids_or_text(merged_model) -> None:
    result = run("generate", merged_model)
    assert result.returncode == EXIT_USAGE
    assert "--ids" in result.stderr and "--text" in result.stderr


def test_generate_text_translates_with_the_demo_model(demo_model) -> None:
    numbers = (243, 1984)
    sources = [french_number(n) for n in numbers]
    result = run("generate", demo_model, "--text", *sources, "--json")
    assert result.returncode == EXIT_OK, result.stderr
    assert json.loads(result.stdout) == {
        "inputs": sources,
        "outputs": [english_number(n) for n in numbers],
    }


# A transformers that is installed but fails on import (a broken or blocked install).
BROKEN_TRANSFORMERS = """
import importlib.abc, importlib.util, sys

class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            return importlib.util.spec_from_loader(name, self)
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        raise ImportError("transformers is broken here")

sys.meta_path.insert(0, Broken())
from onnxmerge.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_generate_text_with_a_broken_transformers_says_what_to_install(demo_model) -> None:
    """The module is found but its import raises: that is a dependency to install, exit 4, not a
    bug (it used to exit 5)."""
    result = subprocess.run(
        [sys.executable, "-c", BROKEN_TRANSFORMERS, "generate", str(demo_model), "--text", "un"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert_one_line_error(result, EXIT_MISSING, "pip install 'onnxmerge[text]'", "broken")


# ---------------------------------------------------------------------------------------------
# export and demo (each runs optimum once)


def test_export_writes_the_onnx_files_and_the_merged_model(marian, tmp_path) -> None:
    output = tmp_path / "marian-onnx"
    result = run("export", marian.pytorch_dir, "-o", output, "--json")
    assert result.returncode == EXIT_OK, result.stderr
    for name in (
        "encoder_model.onnx",
        "decoder_model.onnx",
        "decoder_with_past_model.onnx",
        "model.onnx",
    ):
        assert (output / name).is_file(), name
    report = json.loads(result.stdout)
    assert Path(report["path"]) == output / "model.onnx"
    assert report["output_bytes"] == (output / "model.onnx").stat().st_size


def test_export_refuses_a_used_output_folder_before_exporting(marian, tmp_path) -> None:
    output = tmp_path / "used"
    output.mkdir()
    (output / "model.onnx").write_bytes(b"not replaced")
    result = run("export", marian.pytorch_dir, "-o", output)
    assert_one_line_error(result, EXIT_ERROR, "--overwrite")
    assert sorted(p.name for p in output.iterdir()) == ["model.onnx"]
    assert (output / "model.onnx").read_bytes() == b"not replaced"


@pytest.mark.export
def test_demo_exports_merges_and_translates(tmp_path) -> None:
    pytest.importorskip("optimum.exporters.onnx", reason="the demo exports with optimum")
    work = tmp_path / "demo"
    result = run("demo", "--dir", work)
    assert result.returncode == EXIT_OK, result.stderr
    assert (work / "export" / "model.onnx").is_file()
    out = result.stdout
    assert f"wrote {work / 'export' / 'model.onnx'}" in out
    assert "Generating with the single file model.onnx:" in out
    table = out.split("Generating with the single file model.onnx:")[1].strip().splitlines()
    assert table[0].split() == ["French", "English", "(generated)"]
    english = {french_number(n): english_number(n) for n in range(10000)}
    rows = table[2:]
    assert len(rows) == len(DEMO_SENTENCES)
    for source, row in zip(DEMO_SENTENCES, rows, strict=True):
        assert row.startswith(source)
        assert row[len(source) :].strip() == english[source]


# ---------------------------------------------------------------------------------------------
# the command itself


def test_version() -> None:
    result = run("--version")
    assert result.returncode == EXIT_OK
    assert result.stdout.strip() == f"onnxmerge {onnxmerge.__version__}"


def test_no_arguments_is_a_usage_error() -> None:
    result = run()
    assert result.returncode == EXIT_USAGE
    assert "usage: onnxmerge" in result.stderr


def test_unknown_command_is_a_usage_error() -> None:
    result = run("squash", "x")
    assert result.returncode == EXIT_USAGE
    assert "invalid choice: 'squash'" in result.stderr


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_shows_the_traceback_and_keeps_the_exit_code(tmp_path, where) -> None:
    command = ["merge", tmp_path / "absent"]
    result = run(*(["-v", *command] if where == "before" else [*command, "-v"]))
    assert result.returncode == EXIT_ERROR, result.stderr
    assert "Traceback (most recent call last)" in result.stderr
    assert "ExportFolderError" in result.stderr


def run_without(module: str, *args: object) -> subprocess.CompletedProcess[str]:
    """The command, with ``module`` hidden from the dependency check as if not installed."""
    code = (
        "import importlib.util as u, sys; real = u.find_spec; "
        f"u.find_spec = lambda name, package=None: None if name == {module!r} "
        "else real(name, package); "
        "from onnxmerge.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *map(os.fspath, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_missing_optional_dependency_exits_4(merged_model) -> None:
    result = run_without("onnxruntime", "verify", merged_model)
    assert_one_line_error(result, EXIT_MISSING, "onnxruntime", "pip install 'onnxmerge[runtime]'")


def test_inspect_folds_cache_tensors_by_the_contract_not_by_dots(tmp_path, capsys) -> None:
    """Regression: names holding ``.3.`` were hidden and layer 99's cache tensors were shown."""
    import onnx
    from onnx import TensorProto, helper

    cache = [f"past_key_values.{i}.decoder.key" for i in (0, 1, 2, 3, 99)]
    others = [f"feature.{i}.x" for i in range(12)] + ["encoder.3.weight_scale"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in cache + others]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["feature.0.x"], ["y"])], "g", inputs, [output]
    )
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph), path)
    assert cli.main(["inspect", str(path)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "encoder.3.weight_scale" in out and "feature.3.x" in out
    assert "past_key_values.0.decoder.key" in out
    for layer in (1, 2, 3, 99):
        assert f"past_key_values.{layer}.decoder.key" not in out
    assert "4 more cache tensors (--all shows them)" in out


def test_generate_text_without_transformers_exits_4(merged_model) -> None:
    # Once, this was exit 5, "report it".
    result = run_without("transformers", "generate", merged_model, "--text", "Bonjour")
    assert_one_line_error(result, EXIT_MISSING, "transformers", "pip install 'onnxmerge[text]'")


def test_json_errors_are_json_on_stdout_too(tmp_path) -> None:
    result = run("merge", tmp_path / "absent", "--json")
    assert_one_line_error(result, EXIT_ERROR, "not a folder")
    error = json.loads(result.stdout)["error"]
    assert error["exit_code"] == EXIT_ERROR and "not a folder" in error["message"]


def test_every_exit_code_is_in_the_help() -> None:
    help_text = " ".join(run("--help").stdout.split())
    for code in cli.ExitCode:
        assert f"{code.value} {code.meaning}" in help_text


def test_batch_ray_without_ray_exits_4_with_what_to_install(tmp_path, monkeypatch, capsys) -> None:
    # Once, this was exit 3 (a refused input).
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    out = tmp_path / "out"
    assert cli.main(["batch", str(tmp_path), "-o", str(out), "--ray", "--json"]) == EXIT_MISSING
    captured = capsys.readouterr()
    assert "pip install 'onnxmerge[ray]'" in captured.err
    assert json.loads(captured.out)["error"]["exit_code"] == EXIT_MISSING
    assert not out.exists()


def test_an_invalid_argument_the_library_refuses_exits_3(tmp_path, monkeypatch, capsys) -> None:
    from onnxmerge import inspection
    from onnxmerge.errors import InvalidArgumentError

    def refuse(path):
        raise InvalidArgumentError(f"{path} is not a name this takes", argument="file")

    monkeypatch.setattr(inspection, "inspect_model", refuse)
    assert cli.main(["inspect", str(tmp_path / "m.onnx"), "--json"]) == EXIT_ERROR
    captured = capsys.readouterr()
    assert captured.err == f"{ERROR_PREFIX}{tmp_path / 'm.onnx'} is not a name this takes\n"
    assert json.loads(captured.out)["error"]["exit_code"] == EXIT_ERROR
