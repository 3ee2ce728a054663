"""Which file is which: judged from inputs and outputs, never from file names."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx_ir as ir
import pytest

from onnxmerge import (
    ExportFolderError,
    InvalidMergedModelError,
    merge_seq2seq,
    merge_seq2seq_with_report,
)
from onnxmerge.merge._roles import Judgement, Role, assign_roles, judge
from tests import textmodels as tm


def _judge_file(path: Path) -> Judgement:
    return judge(ir.load(path))


@pytest.fixture(scope="module")
def export_all(tmp_path_factory) -> Path:
    return tm.write_export(tmp_path_factory.mktemp("roles") / "export", layout="all")


@pytest.mark.parametrize(
    ("file", "role"),
    [
        (tm.ENCODER, Role.ENCODER),
        (tm.DECODER, Role.DECODER),
        (tm.DECODER_WITH_PAST, Role.DECODER_WITH_PAST),
        (tm.MERGED_DECODER, Role.MERGED_DECODER),
    ],
)
def test_each_file_of_an_export_is_recognised(export_all, file, role):
    assert _judge_file(export_all / file).role == role


def test_a_merged_output_is_recognised(export_all, tmp_path):
    path = merge_seq2seq(export_all, tmp_path / "merged.onnx")
    assert _judge_file(path).role == Role.MERGED_MODEL


def test_no_past_decoder_is_a_decoder(tmp_path):
    folder = tm.write_export(tmp_path / "export", layout="no_past")
    assert _judge_file(folder / tm.DECODER).role == Role.DECODER


def test_an_unrelated_model_has_no_role_and_a_reason():
    model = tm.ir_from_text("""
<ir_version: 8, opset_import: ["" : 17]>
g (float[2] x) => (float[2] y) { y = Relu(x) }
""")
    judgement = judge(model)
    assert judgement.role is None
    assert "last_hidden_state" in judgement.reason and "logits" in judgement.reason


def test_assign_roles_prefers_the_usual_name(tmp_path):
    judged = {
        tmp_path / "decoder_model.onnx": Judgement(Role.DECODER, ""),
        tmp_path / "decoder_model_quantized.onnx": Judgement(Role.DECODER, ""),
        tmp_path / "encoder_model.onnx": Judgement(Role.ENCODER, ""),
    }
    assert assign_roles(judged) == {
        Role.DECODER: tmp_path / "decoder_model.onnx",
        Role.ENCODER: tmp_path / "encoder_model.onnx",
    }


def test_assign_roles_refuses_two_candidates_without_the_usual_name(tmp_path):
    judged = {
        tmp_path / "a.onnx": Judgement(Role.ENCODER, ""),
        tmp_path / "b.onnx": Judgement(Role.ENCODER, ""),
    }
    with pytest.raises(ExportFolderError, match=r"a\.onnx, b\.onnx"):
        assign_roles(judged)


# ------------------------------------------------------------------ through merge_seq2seq


def test_files_with_odd_names_still_merge(tmp_path):
    reference = merge_seq2seq(tm.write_export(tmp_path / "reference"))
    # Names swapped on purpose: the "encoder" file is the decoder with past, and so on.
    folder = tm.write_export(
        tmp_path / "odd",
        names={
            tm.ENCODER: "decoder_with_past_model.onnx",
            tm.DECODER: "encoder_model.onnx",
            tm.DECODER_WITH_PAST: "weights v2 (final).onnx",
        },
    )
    result = merge_seq2seq_with_report(folder)
    roles = {f.path.name: f.role for f in result.inputs}
    assert roles == {
        "decoder_with_past_model.onnx": "encoder",
        "encoder_model.onnx": "decoder",
        "weights v2 (final).onnx": "decoder_with_past",
    }
    assert result.layout == "with_past"
    tm_inputs = tm.sample_inputs()
    first, cached = tm.run_sources(tm.write_export(tmp_path / "sources"), tm_inputs)
    assert tm.max_abs_diff(first, tm.run_merged(result.path, tm_inputs, use_cache=False)) <= 1e-6
    assert tm.max_abs_diff(cached, tm.run_merged(result.path, tm_inputs, use_cache=True)) <= 1e-6
    # The file names end up nowhere in the model: same bytes as with the usual names.
    assert result.path.read_bytes() == reference.read_bytes()


def test_two_candidates_for_one_role_are_refused(tmp_path):
    folder = tm.write_export(tmp_path / "export", names={tm.DECODER: "first.onnx"})
    shutil.copy(folder / "first.onnx", folder / "second.onnx")
    with pytest.raises(ExportFolderError) as caught:
        merge_seq2seq(folder)
    message = str(caught.value)
    assert "first.onnx" in message and "second.onnx" in message and "decoder" in message
    assert not (folder / "model.onnx").exists()


def test_a_copy_beside_the_usual_file_is_ignored(tmp_path):
    reference = merge_seq2seq(tm.write_export(tmp_path / "reference"))
    folder = tm.write_export(tmp_path / "export")
    shutil.copy(folder / tm.DECODER, folder / "decoder_model_quantized.onnx")
    result = merge_seq2seq_with_report(folder)
    assert {f.path.name for f in result.inputs} == {tm.ENCODER, tm.DECODER, tm.DECODER_WITH_PAST}
    assert result.path.read_bytes() == reference.read_bytes()


def test_an_already_merged_model_in_the_folder_is_refused(tmp_path):
    folder = tm.write_export(tmp_path / "export")
    merged = merge_seq2seq(folder)
    with pytest.raises(InvalidMergedModelError, match="already a merged model"):
        merge_seq2seq(folder, folder / "again.onnx")
    assert not (folder / "again.onnx").exists()
    # Writing over the merged file itself is allowed: it is not an input.
    assert merge_seq2seq(folder, merged, overwrite=True) == merged


def test_a_merged_model_given_as_the_only_file_is_refused(tmp_path):
    folder = tm.write_export(tmp_path / "export")
    merged = merge_seq2seq(folder, tmp_path / "only" / "renamed.onnx")
    with pytest.raises(InvalidMergedModelError):
        merge_seq2seq(merged.parent, tmp_path / "elsewhere.onnx")
