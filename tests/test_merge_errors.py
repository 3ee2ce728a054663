"""Refusals of merge_seq2seq: what is wrong is said, nothing is written, inputs are untouched."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from onnxmerge import (
    ExportFolderError,
    IncompatibleModelsError,
    InvalidMergedModelError,
    OnnxMergeError,
    RefusedOutputError,
    merge_seq2seq,
    passes,
)
from onnxmerge import check as check_module
from onnxmerge.merge import _compat as compat
from onnxmerge.merge import _splice as splice
from onnxmerge.passes import dedup
from tests import textmodels as tm


def _assert_untouched(folder: Path, before: dict[str, str]) -> None:
    """The folder holds exactly the files it held, with the same bytes: no output, no temp."""
    assert tm.folder_digest(folder) == before
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []


def _edit(path: Path, change) -> None:
    model = onnx.load(os.fspath(path))
    change(model)
    tm.save(model, path)


# ------------------------------------------------------------------ missing or unreadable files


def test_missing_folder(tmp_path):
    with pytest.raises(ExportFolderError, match="not a folder"):
        merge_seq2seq(tmp_path / "nowhere")


def test_folder_without_models(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ExportFolderError, match=r"no \.onnx file"):
        merge_seq2seq(tmp_path)


@pytest.mark.parametrize(
    ("removed", "named"),
    [
        ([tm.DECODER, tm.DECODER_WITH_PAST], "decoder_model.onnx"),
        ([tm.ENCODER], "encoder_model.onnx"),
        ([tm.DECODER], "decoder"),
    ],
)
def test_missing_files_are_named(tmp_path, removed, named):
    folder = tm.write_export(tmp_path / "export")
    for name in removed:
        (folder / name).unlink()
    before = tm.folder_digest(folder)
    with pytest.raises(ExportFolderError, match=named):
        merge_seq2seq(folder)
    _assert_untouched(folder, before)


def test_unreadable_model_file(tmp_path):
    folder = tm.write_export(tmp_path / "export")
    (folder / tm.DECODER).write_bytes(b"\x08\x07not a protobuf at all" * 10)
    with pytest.raises(OnnxMergeError, match=tm.DECODER):
        merge_seq2seq(folder)


def test_invalid_config_json(tmp_path):
    folder = tm.write_export(tmp_path / "export")
    (folder / "config.json").write_text("{not json")
    before = tm.folder_digest(folder)
    with pytest.raises(ExportFolderError, match="config.json"):
        merge_seq2seq(folder)
    _assert_untouched(folder, before)


# ------------------------------------------------------------------ files that do not fit


def test_decoders_from_different_checkpoints(tmp_path):
    # optimum's merge_decoders merged these without a word.
    folder = tm.write_export(tmp_path / "export", with_past_seed=99)
    before = tm.folder_digest(folder)
    with pytest.raises(IncompatibleModelsError) as caught:
        merge_seq2seq(folder)
    problems = caught.value.problems
    assert len(problems) == 1
    assert tm.DECODER_WITH_PAST in problems[0] and "different checkpoints" in problems[0]
    assert "force" in str(caught.value)
    _assert_untouched(folder, before)

    path = merge_seq2seq(folder, force=True)
    onnx.checker.check_model(os.fspath(path), full_check=True)
    inputs = tm.sample_inputs()
    first, cached = tm.run_sources(folder, inputs)
    assert tm.max_abs_diff(first, tm.run_merged(path, inputs, use_cache=False)) <= 1e-6
    assert tm.max_abs_diff(cached, tm.run_merged(path, inputs, use_cache=True)) <= 1e-6


def test_checkpoint_problems_are_returned_for_the_merge_to_judge():
    parts, models = tm.export_parts(with_past_seed=99)
    origins = compat.origins(parts)
    model = splice.splice(parts, models)
    (dedup_result,) = passes.run(model, [dedup.DeduplicateInitializers()])

    problems = compat.checkpoint_problems(parts, origins, list(dedup_result.records))

    assert len(problems) == 1
    assert "decoder_with_past.onnx shares 0% of its weights" in problems[0]


def test_encoder_from_another_checkpoint(tmp_path):
    folder = tm.write_export(tmp_path / "export", encoder_seed=5)
    with pytest.raises(IncompatibleModelsError) as caught:
        merge_seq2seq(folder)
    assert any(tm.ENCODER in p and "embedding" in p for p in caught.value.problems)


def test_encoder_from_another_checkpoint_without_shared_small_tensors(tmp_path):
    # The same folder, except that the encoder's small axes tensor differs from the decoders'.
    folder = tm.write_export(tmp_path / "export", encoder_seed=5)

    def other_axes(model: onnx.ModelProto) -> None:
        (axes,) = [t for t in model.graph.initializer if t.name == tm.LAST_AXIS]
        axes.CopyFrom(onnx.numpy_helper.from_array(np.array([2], np.int64), tm.LAST_AXIS))

    _edit(folder / tm.ENCODER, other_axes)
    with pytest.raises(IncompatibleModelsError) as caught:
        merge_seq2seq(folder)
    assert len(caught.value.problems) == 1
    assert tm.ENCODER in caught.value.problems[0] and "embedding" in caught.value.problems[0]
    path = merge_seq2seq(folder, force=True)
    inputs = tm.sample_inputs()
    first, _ = tm.run_sources(folder, inputs)
    assert tm.max_abs_diff(first, tm.run_merged(path, inputs, use_cache=False)) <= 1e-6


def test_mismatched_opsets(tmp_path):
    folder = tm.write_export(tmp_path / "export", opsets={tm.DECODER_WITH_PAST: 18})
    before = tm.folder_digest(folder)
    with pytest.raises(IncompatibleModelsError) as caught:
        merge_seq2seq(folder)
    assert any(tm.DECODER_WITH_PAST in p and "18" in p for p in caught.value.problems)
    _assert_untouched(folder, before)


def test_mismatch_in_a_second_opset_domain_is_found(tmp_path):
    # optimum compared only the first opset entry of each file.
    folder = tm.write_export(tmp_path / "export")
    for name, version in ((tm.DECODER, 3), (tm.DECODER_WITH_PAST, 4)):
        _edit(
            folder / name,
            lambda m, v=version: m.opset_import.append(onnx.helper.make_opsetid("ai.onnx.ml", v)),
        )
    with pytest.raises(IncompatibleModelsError, match="ai.onnx.ml"):
        merge_seq2seq(folder)


def test_different_ir_versions_merge_under_the_newest(tmp_path):
    folder = tm.write_export(tmp_path / "export", ir_versions={tm.ENCODER: 7, tm.DECODER: 9})
    path = merge_seq2seq(folder)
    assert onnx.load(os.fspath(path)).ir_version == 9
    onnx.checker.check_model(os.fspath(path), full_check=True)


def test_mask_dtype_that_differs_between_files(tmp_path):
    folder = tm.write_export(tmp_path / "export")

    def int32_mask(model: onnx.ModelProto) -> None:
        (mask,) = [i for i in model.graph.input if i.name == "encoder_attention_mask"]
        mask.type.tensor_type.elem_type = onnx.TensorProto.INT32

    _edit(folder / tm.DECODER, int32_mask)
    with pytest.raises(IncompatibleModelsError, match="encoder_attention_mask"):
        merge_seq2seq(folder)


def test_decoder_with_past_lacking_a_present_output(tmp_path):
    folder = tm.write_export(tmp_path / "export")

    def drop_output(model: onnx.ModelProto) -> None:
        keep = [o for o in model.graph.output if o.name != "present.1.decoder.value"]
        del model.graph.output[:]
        model.graph.output.extend(keep)

    _edit(folder / tm.DECODER_WITH_PAST, drop_output)
    with pytest.raises(IncompatibleModelsError, match="present.1.decoder.value"):
        merge_seq2seq(folder)


# ------------------------------------------------------------------ the output path


@pytest.mark.parametrize(
    "output",
    [
        tm.ENCODER,
        tm.DECODER,
        tm.DECODER_WITH_PAST,
    ],
)
def test_an_input_model_is_never_the_output(tmp_path, output):
    folder = tm.write_export(tmp_path / "export")
    before = tm.folder_digest(folder)
    with pytest.raises(RefusedOutputError, match="input"):
        merge_seq2seq(folder, folder / output, overwrite=True)
    _assert_untouched(folder, before)


@pytest.mark.parametrize("output", ["encoder_model.onnx_data", "decoder_model.onnx_data"])
def test_an_input_data_file_is_never_the_output(tmp_path, output):
    folder = tm.write_export(tmp_path / "export", external_data=True)
    before = tm.folder_digest(folder)
    with pytest.raises(RefusedOutputError, match="input"):
        merge_seq2seq(folder, folder / output, overwrite=True)
    _assert_untouched(folder, before)


def test_existing_output_needs_overwrite(tmp_path):
    folder = tm.write_export(tmp_path / "export")
    output = tmp_path / "out.onnx"
    output.write_bytes(b"keep me")
    with pytest.raises(RefusedOutputError, match="overwrite"):
        merge_seq2seq(folder, output)
    assert output.read_bytes() == b"keep me"
    merge_seq2seq(folder, output, overwrite=True)
    onnx.checker.check_model(os.fspath(output), full_check=True)


def test_output_that_is_a_folder(tmp_path):
    folder = tm.write_export(tmp_path / "export")
    (tmp_path / "out.onnx").mkdir()
    with pytest.raises(RefusedOutputError, match="folder"):
        merge_seq2seq(folder, tmp_path / "out.onnx", overwrite=True)


def test_output_folder_is_created(tmp_path):
    folder = tm.write_export(tmp_path / "export")
    path = merge_seq2seq(folder, tmp_path / "a" / "b" / "merged.onnx")
    assert path.is_file()


# ------------------------------------------------------------------ failure leaves nothing


def test_failed_validation_leaves_no_output_and_no_temporary_files(tmp_path, monkeypatch):
    folder = tm.write_export(tmp_path / "export")
    before = tm.folder_digest(folder)

    def refuse(path: Path, **_) -> None:
        assert path.exists()  # the file is checked where it was written, before it is published
        raise InvalidMergedModelError("refused by the test")

    monkeypatch.setattr(check_module, "check_written_model", refuse)
    with pytest.raises(InvalidMergedModelError, match="refused by the test"):
        merge_seq2seq(folder)
    _assert_untouched(folder, before)


def test_failed_validation_keeps_the_previous_output(tmp_path, monkeypatch):
    folder = tm.write_export(tmp_path / "export")
    previous = merge_seq2seq(folder).read_bytes()

    def refuse(path: Path, **_) -> None:
        raise InvalidMergedModelError("refused by the test")

    monkeypatch.setattr(check_module, "check_written_model", refuse)
    with pytest.raises(InvalidMergedModelError):
        merge_seq2seq(folder, overwrite=True)
    assert (folder / "model.onnx").read_bytes() == previous
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []


def test_successful_merge_changes_no_input(tmp_path):
    folder = tm.write_export(tmp_path / "export", layout="all", external_data=True)
    before = tm.folder_digest(folder)
    path = merge_seq2seq(folder, tmp_path / "out" / "model.onnx", external_data=True)
    assert tm.folder_digest(folder) == before
    onnx.checker.check_model(os.fspath(path), full_check=True)


@pytest.mark.parametrize("layout", ["with_past", "no_past", "merged_only"])
def test_merged_file_passes_the_full_checker(tmp_path, layout):
    path = merge_seq2seq(
        tm.write_export(
            tmp_path / "export",
            layout=layout,
            head="tied",
            out_proj_as_constant=layout != "merged_only",
        )
    )
    onnx.checker.check_model(os.fspath(path), full_check=True)
    assert np.isfinite(tm.run_merged(path, tm.sample_inputs(), use_cache=False)["logits"]).all()


# ------------------------------------------------------------------ arguments and the result


@pytest.mark.parametrize(
    ("arguments", "argument"),
    [
        ({"format_version": 5}, "format_version"),
        ({"format_version": "3"}, "format_version"),
        ({"format": 7}, "format_version"),
        ({"format": 3, "format_version": 3}, "format"),
    ],
)
def test_a_bad_argument_is_refused_before_the_folder_is_read(tmp_path, arguments, argument):
    # The folder does not exist: the argument is refused before it is looked for.
    with pytest.raises(ValueError, match=argument) as refused:
        merge_seq2seq(tmp_path / "nowhere", tmp_path / "out" / "model.onnx", **arguments)
    assert isinstance(refused.value, OnnxMergeError) and refused.value.argument == argument
    assert list(tmp_path.iterdir()) == []


def test_the_result_is_the_path_and_carries_the_report(tmp_path):
    import pickle

    from onnxmerge.merge import MergeResult, merge_seq2seq_with_report

    folder = tm.write_export(tmp_path / "export", layout="with_past")
    steps: list[str] = []
    written = merge_seq2seq(folder, tmp_path / "a" / "model.onnx", progress=steps.append)
    assert written == tmp_path / "a" / "model.onnx" and isinstance(written, Path)
    assert str(written) == os.fspath(tmp_path / "a" / "model.onnx")
    assert written.parent == tmp_path / "a" and (written.parent / written.name).is_file()
    assert isinstance(written.report, MergeResult) and written.report.path == written
    assert written.report.output_bytes == Path(written).stat().st_size
    assert steps[0] == "loading" and steps[-1] == "saving and checking"
    assert pickle.loads(pickle.dumps(written)).report == written.report
    with pytest.warns(DeprecationWarning, match="merge_seq2seq_with_report"):
        old = merge_seq2seq_with_report(folder, tmp_path / "b" / "model.onnx")
    assert isinstance(old, MergeResult) and old.path.read_bytes() == written.read_bytes()
    with pytest.warns(DeprecationWarning, match="format_version"):
        two = merge_seq2seq(folder, tmp_path / "c" / "model.onnx", format=2)
    assert (
        two.report.format_version
        == merge_seq2seq(
            folder, tmp_path / "d" / "model.onnx", format_version=2
        ).report.format_version
    )
